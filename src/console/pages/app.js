// ratelimitd admin console. Plain script, no framework, no build step.
// Every value from the server is written with textContent, never as HTML.
"use strict";

const state = {
  token: sessionStorage.getItem("ratelimitd-token") || "",
  user: null,
  head: null,
  original: new Map(), // path -> text at the branch head
  edits: new Map(), // path -> text (null: deleted)
  current: null,
  proposal: null,
  checkTimer: null,
  checkSeq: 0,
  refreshTimer: null,
  inForce: { version: null, rules: [] },
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const svgNs = "http://www.w3.org/2000/svg";
function svg(tag, attrs, text) {
  const node = document.createElementNS(svgNs, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function notice(text, bad) {
  const n = $("notice");
  n.textContent = text || "";
  n.className = bad ? "bad" : "";
}

async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  if (state.token) headers.Authorization = "Bearer " + state.token;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  let data = {};
  try { data = await response.json(); } catch (_) { /* an empty body */ }
  if (response.status === 401) { signOut(data.error || "signed out"); }
  return { ok: response.ok, status: response.status, data };
}

function short(version) { return version ? String(version).slice(0, 12) : "–"; }
function ago(ms, now) {
  if (!ms) return "–";
  const s = Math.max(0, Math.round((now - ms) / 1000));
  return s < 120 ? s + " s ago" : Math.round(s / 60) + " min ago";
}

// ---- sign-in and navigation ----

async function signIn(event) {
  if (event) event.preventDefault();
  state.token = $("token").value.trim();
  const { ok, data } = await api("GET", "/api/session");
  if (!ok) { notice(data.error || "sign-in refused", true); return; }
  sessionStorage.setItem("ratelimitd-token", state.token);
  $("token").value = "";
  state.user = data;
  $("who-name").textContent = data.user.name;
  $("who-role").textContent = data.user.role;
  $("who").hidden = false;
  $("nav").hidden = false;
  notice("Signed in as " + data.user.name + " (" + data.user.role + ")");
  route();
}

function signOut(why) {
  clearInterval(state.refreshTimer);
  state.token = "";
  state.user = null;
  // Nothing of this user's work is left for the next one on this tab.
  state.edits = new Map();
  state.proposal = null;
  state.head = null;
  sessionStorage.removeItem("ratelimitd-token");
  $("who").hidden = true;
  $("nav").hidden = true;
  show("sign-in");
  notice(why || "Signed out");
}

function show(page) {
  for (const section of document.querySelectorAll("main > section")) {
    section.hidden = section.id !== "page-" + page;
  }
  for (const link of document.querySelectorAll("nav a")) {
    if (link.id === "nav-" + page) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
}

function route() {
  clearInterval(state.refreshTimer);
  if (!state.user) { show("sign-in"); return; }
  const page = (location.hash || "#overview").slice(1);
  // Unsaved edits survive a visit to another page.
  const known = { overview: loadOverview, rules: () => loadRules(true), proposals: loadProposals, audit: loadAudit };
  const load = known[page] || loadOverview;
  show(known[page] ? page : "overview");
  load();
  // The overview follows a rollout as it happens.
  if (load === loadOverview) state.refreshTimer = setInterval(loadOverview, 2000);
}

// ---- overview ----

async function loadOverview() {
  const { ok, data } = await api("GET", "/api/overview");
  if (!ok) { notice(data.error, true); return; }
  const now = data.now_ms;
  const force = data.in_force;
  $("in-force").textContent = force
    ? short(force.version) + " published " + force.published_at + (force.author ? " by " + force.author : "")
    : "nothing published";
  const current = data.instances.filter((i) => i.standing === "current").length;
  $("converged").textContent = current + " of " + data.instances.length + " serve the version in force";
  const body = $("instances").tBodies[0];
  body.replaceChildren(...data.instances.map((i) => el("tr", {},
    el("td", {}, i.instance), el("td", { class: "mono" }, short(i.version)),
    el("td", { class: "standing-" + i.standing }, i.standing), el("td", {}, i.origin || "–"),
    el("td", {}, ago(i.since_ms, now)), el("td", {}, ago(i.reported_ms, now)),
    el("td", { class: i.vitals && i.vitals.shed_level !== "NORMAL" ? "bad" : "" }, i.vitals
      ? i.vitals.shed_level + (i.vitals.utilization !== null ? " (" + Math.round(i.vitals.utilization * 100) + "% busy)" : "") : "–"),
    el("td", {}, i.vitals ? i.vitals.overload_mode + ", " + i.vitals.overload_directives + " directive(s)" : "–"),
    el("td", { class: i.dead_letters_recent.count ? "bad" : "" }, i.vitals
      ? i.dead_letters_recent.count + " in the last " + i.dead_letters_recent.over_s + " s; " + i.vitals.dead_letters + " since start"
        + (i.vitals.dead_letters_dropped ? ", " + i.vitals.dead_letters_dropped + " lost" : "") : "–"),
    el("td", {}, Object.entries(i.adaptive || {}).map(([k, v]) => k + "=" + v).join(", ") || "–"),
    el("td", { class: Object.values((i.vitals && i.vitals.global) || {}).some((g) => g.answer !== "ok" && g.answer !== "none") ? "bad" : "" },
      Object.entries((i.vitals && i.vitals.global) || {}).map(([k, g]) => k + " in " + g.region + ": " + g.granted
        + " granted" + (g.lease_age_s === null ? ", no lease" : "") + (g.answer !== "ok" && g.answer !== "none" ? ", " + g.answer : "")).join("; ") || "–"),
    el("td", { class: Object.values((i.vitals && i.vitals.rlqs) || {}).some((q) => q.unanswered > 0) ? "bad" : "" },
      Object.entries((i.vitals && i.vitals.rlqs) || {}).map(([d, q]) => d + ": " + q.envoys + " Envoy(s), " + q.buckets
        + " bucket(s), " + q.assigned_per_second.toFixed(1) + "/s assigned" + (q.expired ? ", " + q.expired + " expired" : "")
        + (q.unanswered ? ", " + q.unanswered + " unanswered" : "")).join("; ") || "–"))));
  const recent = data.instances.reduce((sum, i) => sum + i.dead_letters_recent.count, 0);
  $("dead-letters").textContent = recent + " failed decision(s) recorded in the last minute";
  drawTimeline(data.timeline, data.instances, now);
  loadInForce(force ? force.version : null);
  const may = state.user.may_publish;
  $("revert-box").hidden = !may;
  if (may && !$("revert-capture").options.length) fillCaptures($("revert-capture"));
  $("history").tBodies[0].replaceChildren(...data.history.map((h) => {
    if (h.refused) return el("tr", {}, el("td", {}, h.offset), el("td", { colspan: 6 }, "refused: " + h.refused));
    const r = h.record;
    const gate = r.gate ? (r.gate.passed ? "passed" : "failed") + " (" + r.gate.capture_requests + " requests, worst " + r.gate.worst + ")" : "ungated";
    const action = may && r.commit
      ? el("button", { type: "button", class: "rollback", "data-commit": r.commit, onclick: () => rollback(r.commit) }, "Revert this change") : null;
    return el("tr", {}, el("td", {}, h.offset), el("td", { class: "mono" }, short(r.version)),
      el("td", {}, r.published_at), el("td", { class: "mono" }, r.commit ? r.commit.slice(0, 10) : "–"),
      el("td", {}, r.author || "–"), el("td", {}, gate), el("td", {}, action));
  }));
}

async function loadInForce(version) {
  if (version !== state.inForce.version) {
    const { ok, data } = await api("GET", "/api/in-force");
    if (!ok) { notice(data.error, true); return; }
    state.inForce = data;
  }
  showInForce();
}

function showInForce() {
  const words = $("rule-search").value.toLowerCase().split(/\s+/).filter(Boolean);
  const shown = state.inForce.rules.filter((r) => {
    const line = (r.kind + " " + r.id + " " + r.describe + " " + (r.overload || "")).toLowerCase();
    return words.every((w) => line.includes(w));
  });
  $("in-force-rules").tBodies[0].replaceChildren(...shown.slice(0, 500).map((r) => el("tr", {},
    el("td", {}, r.kind), el("td", { class: "mono" }, r.id), el("td", {}, r.describe), el("td", {}, r.overload || "–"))));
}

function drawTimeline(points, instances, now) {
  const box = $("timeline");
  const names = [...new Set(instances.map((i) => i.instance).concat(points.map((p) => p.instance)))].sort();
  if (!names.length) { box.replaceChildren(el("p", {}, "No instance has reported.")); return; }
  const start = Math.min(now - 60000, ...points.map((p) => p.since_ms));
  const width = 720, lane = 26, left = 210, height = names.length * lane + 24;
  const x = (t) => left + (width - left - 10) * (t - start) / Math.max(1, now - start);
  const versions = [...new Set(points.map((p) => p.version))];
  const colour = (v) => "hsl(" + (versions.indexOf(v) * 67 % 360) + " 60% 55%)";
  const plot = svg("svg", { viewBox: "0 0 " + width + " " + height, role: "img", "aria-label": "Versions served per instance over time" });
  names.forEach((name, row) => {
    const y = row * lane + 4;
    plot.append(svg("text", { x: 4, y: y + 16, class: "lane" }, name.length > 28 ? name.slice(0, 27) + "…" : name));
    const mine = points.filter((p) => p.instance === name).sort((a, b) => a.since_ms - b.since_ms);
    mine.forEach((p, i) => {
      const end = i + 1 < mine.length ? mine[i + 1].since_ms : now;
      const bar = svg("rect", { x: x(p.since_ms), y, width: Math.max(2, x(end) - x(p.since_ms)), height: lane - 8, fill: colour(p.version) });
      bar.append(svg("title", {}, name + ": " + p.version + " from " + new Date(p.since_ms).toISOString()));
      plot.append(bar);
    });
  });
  plot.append(svg("text", { x: left, y: height - 4, class: "axis" }, new Date(start).toISOString().slice(11, 19)));
  plot.append(svg("text", { x: width - 70, y: height - 4, class: "axis" }, "now"));
  box.replaceChildren(plot);
}

async function fillCaptures(select) {
  const { ok, data } = await api("GET", "/api/rules");
  if (!ok) return;
  select.replaceChildren(el("option", { value: "" }, data.captures.length ? "(no gate)" : "(no captures)"),
    ...data.captures.map((c) => el("option", { value: c }, c)));
}

async function rollback(commit) {
  const message = prompt("Why revert commit " + commit.slice(0, 10) + "? (the revert's commit message)");
  if (!message) return;
  const capture = $("revert-capture").value || undefined;
  const { ok, data } = await api("POST", "/api/rollback", { commit, message, capture });
  notice(ok ? "Reverted in " + data.commit.slice(0, 10) + ", published " + short(data.version) : data.error, !ok);
  loadOverview();
}

// ---- rules: edit, check, gate, propose, publish ----

async function loadRules(keepEdits) {
  const { ok, data } = await api("GET", "/api/rules");
  if (!ok) { notice(data.error, true); return; }
  const moved = state.head !== null && state.head !== data.head;
  state.head = data.head;
  state.original = new Map(data.files.map((f) => [f.path, f.text]));
  if (!keepEdits) { state.edits = new Map(); state.proposal = null; }
  else if (moved && changedFiles().length) {
    notice(data.branch + " moved to " + (data.head || "").slice(0, 10) + ": your edits now apply to it; check the diff again.", true);
  }
  $("rules-head").textContent = data.branch + " at " + (data.head ? data.head.slice(0, 10) : "no commit yet")
    + "; rules in " + [data.rules_path, data.envoy_path, data.limitador_path].filter(Boolean).join(", ");
  const select = $("file-select");
  const paths = [...new Set([...state.original.keys(), ...state.edits.keys()])].sort();
  select.replaceChildren(...paths.map((p) => el("option", { value: p }, p)));
  state.current = paths.includes(state.current) ? state.current : paths[0] || null;
  select.value = state.current || "";
  $("capture").replaceChildren(el("option", { value: "" }, data.captures.length ? "(choose a capture)" : "(no captures)"),
    ...data.captures.map((c) => el("option", { value: c }, c)));
  const edit = state.user.may_edit, publish = state.user.may_publish;
  $("editor").readOnly = !edit;
  $("run-gate").disabled = !edit;
  $("propose-box").hidden = !edit;
  $("publish").disabled = !publish;
  $("publish").title = publish ? "" : "Publishing needs the publisher role";
  $("proposal-loaded").textContent = state.proposal ? "Reviewing proposal " + state.proposal.id + " by " + state.proposal.author + ": " + state.proposal.note : "";
  showFile();
  if (edit) scheduleCheck(0);
}

function text(path) {
  return state.edits.has(path) ? state.edits.get(path) : state.original.get(path);
}

function showFile() {
  $("editor").value = state.current ? text(state.current) || "" : "";
}

function changedFiles() {
  const files = [];
  for (const [path, t] of state.edits) {
    if (t !== state.original.get(path)) files.push({ path, text: t });
  }
  return files;
}

function scheduleCheck(delay) {
  clearTimeout(state.checkTimer);
  state.checkTimer = setTimeout(check, delay === undefined ? 300 : delay);
}

async function check() {
  const seq = ++state.checkSeq;
  const { ok, data } = await api("POST", "/api/check", { base: state.head, files: changedFiles() });
  if (seq !== state.checkSeq) return; // a newer check is on its way
  const problems = $("problems");
  if (!ok) { problems.replaceChildren(el("li", { class: "bad" }, data.error)); return; }
  problems.replaceChildren(...(data.problems.length ? data.problems.map((p) => el("li", { class: "bad" }, p.text))
    : [el("li", { class: "good" }, "No problems: the rules compile.")]));
  $("changes").tBodies[0].replaceChildren(...(data.changes.length ? data.changes.map((c) => el("tr", {},
    el("td", { class: "mono" }, c.id), el("td", { class: "change-" + c.change }, c.change),
    el("td", {}, c.change === "changed" ? c.fields.map((f) => f[0] + ": " + f[1] + " → " + f[2]).join("; ") : c.describe)))
    : [el("tr", {}, el("td", { colspan: 3 }, "No change against the rules in force."))]));
}

function rows(table, entries) {
  $(table).tBodies[0].replaceChildren(...entries.map(([name, r]) => el("tr", {},
    el("td", {}, name), el("td", {}, r.requests), el("td", {}, r.denied_current),
    el("td", {}, r.denied_candidate), el("td", { class: r.newly_denied ? "bad" : "" }, r.newly_denied))));
}

async function runGate() {
  const capture = $("capture").value;
  if (!capture) { $("gate-verdict").textContent = "Choose a capture first."; return; }
  $("gate-verdict").textContent = "Replaying " + capture + "…";
  const { ok, data } = await api("POST", "/api/gate", { base: state.head, files: changedFiles(), capture });
  if (!ok) { $("gate-verdict").textContent = data.error; $("gate-verdict").className = "bad"; return; }
  const report = data.report, gate = report.gate, worst = gate.worst;
  const verdict = $("gate-verdict");
  verdict.className = gate.passed ? "good" : "bad";
  const tooSmall = report.requests < gate.thresholds.min_capture_requests;
  verdict.textContent = (gate.passed ? "Passes" : "Fails") + " the gate: " + report.requests + " requests replayed"
    + (tooSmall ? ", under gate.min_capture_requests (" + gate.thresholds.min_capture_requests + "): too small to judge any change." : "; worst "
    + worst.kind + " " + worst.name + " drops " + (worst.drop * 100).toFixed(2) + "% of its CRITICAL requests"
    + (gate.passed ? "." : " (" + gate.failed_groups + " group(s) over their threshold)."));
  rows("gate-priorities", Object.entries(report.priorities));
  rows("gate-rules", Object.entries(report.rules));
  drawGate(gate);
}

function drawGate(gate) {
  const groups = [gate.all, ...gate.rules].slice(0, 12);
  const width = 440, bar = 20, left = 150, height = groups.length * (bar + 6) + 10;
  const most = Math.max(0.1, ...groups.map((g) => g.drop), ...groups.map((g) => g.max_drop));
  const x = (v) => left + (width - left - 60) * v / most;
  const plot = svg("svg", { viewBox: "0 0 " + width + " " + height, role: "img", "aria-label": "Share of CRITICAL requests newly denied, per group, against its threshold" });
  groups.forEach((g, i) => {
    const y = 4 + i * (bar + 6);
    plot.append(svg("text", { x: 4, y: y + 14, class: "lane" }, (g.kind === "all" ? "all requests" : g.name).slice(0, 20)));
    plot.append(svg("rect", { x: left, y, width: Math.max(1, x(g.drop) - left), height: bar, class: g.passed ? "bar-good" : "bar-bad" }));
    plot.append(svg("line", { x1: x(g.max_drop), x2: x(g.max_drop), y1: y - 2, y2: y + bar + 2, class: "limit" }));
    plot.append(svg("text", { x: x(g.drop) + 4, y: y + 14, class: "axis" }, (g.drop * 100).toFixed(1) + "%" + (g.judged ? "" : " (too few)")));
  });
  $("gate-plot").replaceChildren(plot);
}

async function propose() {
  const message = $("propose-note").value;
  const { ok, data } = await api("POST", "/api/proposals", { base: state.head, files: changedFiles(), message });
  $("publish-result").className = ok ? "good" : "bad";
  $("publish-result").textContent = ok ? "Proposed as #" + data.proposal.id + " for review." : data.error;
}

async function publish() {
  const body = { base: state.head, files: changedFiles(), message: $("message").value, capture: $("capture").value || undefined };
  if (state.proposal) body.proposal = state.proposal.id;
  $("publish-result").className = "";
  $("publish-result").textContent = "Publishing…";
  const { ok, data } = await api("POST", "/api/publish", body);
  const out = $("publish-result");
  out.className = ok ? "good" : "bad";
  if (ok) {
    out.textContent = data.already_in_force ? "Committed " + data.commit.slice(0, 10) + "; " + short(data.version) + " was already in force."
      : "Committed " + data.commit.slice(0, 10) + " and published " + short(data.version) + " at offset " + data.offset + ".";
    state.edits = new Map();
    state.proposal = null;
    loadRules(false).then(() => { $("publish-result").className = "good"; $("publish-result").textContent = out.textContent; });
  } else {
    out.textContent = data.error + (data.problems ? ": " + data.problems.map((p) => p.text).join("; ") : "");
  }
}

// ---- proposals and audit ----

async function loadProposals() {
  const { ok, data } = await api("GET", "/api/proposals");
  if (!ok) { notice(data.error, true); return; }
  $("proposals").tBodies[0].replaceChildren(...(data.proposals.length ? data.proposals.map((p) => el("tr", {},
    el("td", {}, p.id), el("td", {}, p.note), el("td", {}, p.author), el("td", {}, p.at),
    el("td", {}, el("button", { type: "button", class: "open-proposal", "data-id": p.id, onclick: () => openProposal(p.id) }, "Review"))))
    : [el("tr", {}, el("td", { colspan: 5 }, "No open proposal."))]));
}

async function openProposal(id) {
  const { ok, data } = await api("GET", "/api/proposals/" + id);
  if (!ok) { notice(data.error, true); return; }
  history.replaceState(null, "", "#rules"); // no hashchange: the edits below must stay
  show("rules");
  await loadRules(false);
  state.proposal = data.proposal;
  if (data.proposal.base !== state.head) notice("Proposal " + id + " was made on an earlier head: its changes are applied to the current one.", true);
  // The proposal's own changes, applied to the head.
  state.edits = new Map(data.files.map((f) => [f.path, f.text]));
  await loadRules(true);
}

async function loadAudit() {
  const { ok, data } = await api("GET", "/api/audit");
  if (!ok) { notice(data.error, true); return; }
  $("audit").tBodies[0].replaceChildren(...data.entries.map((e) => el("tr", { class: "outcome-" + e.outcome },
    el("td", {}, e.at), el("td", {}, e.user), el("td", {}, e.role), el("td", {}, e.action), el("td", {}, e.outcome),
    el("td", {}, e.detail), el("td", { class: "mono" }, short(e.before)), el("td", { class: "mono" }, short(e.after)),
    el("td", { class: "mono" }, e.commit ? e.commit.slice(0, 10) : "–"))));
}

// ---- wiring ----

document.addEventListener("DOMContentLoaded", () => {
  $("sign-in-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", () => signOut());
  $("file-select").addEventListener("change", (e) => { state.current = e.target.value; showFile(); });
  $("editor").addEventListener("input", (e) => {
    if (!state.current) return;
    state.edits.set(state.current, e.target.value);
    scheduleCheck();
  });
  $("run-gate").addEventListener("click", runGate);
  $("rule-search").addEventListener("input", showInForce);
  $("propose").addEventListener("click", propose);
  $("publish").addEventListener("click", publish);
  window.addEventListener("hashchange", route);
  if (state.token) { $("token").value = state.token; signIn(); } else { show("sign-in"); }
});
