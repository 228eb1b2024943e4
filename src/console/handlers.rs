//! The console's JSON API. Every call signs in on its own ([`super::auth`])
//! and needs a role; every action (sign-in, gate, proposal, publish,
//! rollback, sync, and any refusal of them) is written to the audit log
//! before it is answered. Whatever a request names (commits, captures,
//! files) is checked against what the console owns before git or the disk
//! sees it. Errors are JSON `{"error": …}`; rule problems come back as a
//! list naming file, line, rule and field.

use std::{
    collections::VecDeque,
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{
    Json,
    extract::{Path as UrlPath, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{
    Console, Peer,
    audit::AuditEntry,
    auth::{Refusal, Role, User},
    workspace::{self, ChangeError, Checked, File},
};
use crate::{
    clock::{Clock as _, SystemClock},
    release::{self, ReleaseError},
    rollout::{
        RolloutError, git,
        publish::{self, Entry},
        status,
    },
    rules::encoding::SnapshotRecord,
};

/// An answer that is not a success.
#[derive(Debug)]
pub(super) struct ApiError(pub(super) StatusCode, pub(super) Value);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(self.1)).into_response()
    }
}

pub(super) fn error(status: StatusCode, message: impl std::fmt::Display) -> ApiError {
    ApiError(status, json!({ "error": message.to_string() }))
}

impl From<RolloutError> for ApiError {
    fn from(e: RolloutError) -> Self {
        match e {
            RolloutError::Git(ref m) if m.contains("moved since") => error(StatusCode::CONFLICT, e),
            RolloutError::Git(_) => error(StatusCode::BAD_REQUEST, e),
            _ => error(StatusCode::BAD_GATEWAY, e),
        }
    }
}

impl From<ChangeError> for ApiError {
    fn from(e: ChangeError) -> Self {
        match e {
            ChangeError::Refused(m) => error(StatusCode::BAD_REQUEST, m),
            ChangeError::Invalid(problems) => ApiError(
                StatusCode::UNPROCESSABLE_ENTITY,
                json!({ "error": format!("{} problem(s) in the rules", problems.len()), "problems": problems }),
            ),
            ChangeError::Rollout(e) => e.into(),
            ChangeError::Release(e) => e.into(),
        }
    }
}

impl From<ReleaseError> for ApiError {
    fn from(e: ReleaseError) -> Self {
        match e {
            ReleaseError::Rollout(e) => e.into(),
            ReleaseError::Rules(m) => error(StatusCode::UNPROCESSABLE_ENTITY, m),
            ReleaseError::GateFailed(report) => ApiError(
                StatusCode::UNPROCESSABLE_ENTITY,
                json!({ "error": "the change fails the gate; nothing published", "report": report }),
            ),
        }
    }
}

pub(super) type Answer = Result<Json<Value>, ApiError>;

/// Runs blocking work (git, Kafka reads, compilers, the audit log) off the runtime.
pub(super) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| Err(error(StatusCode::INTERNAL_SERVER_ERROR, format!("task failed: {e}"))))
}

impl Console {
    /// The user of a request with at least `need`; a refusal by role is
    /// audited as `action` refused.
    pub(super) async fn user(
        self: &Arc<Self>,
        headers: &HeaderMap,
        peer: &Peer,
        need: Role,
        action: &str,
    ) -> Result<User, ApiError> {
        let user = self.auth.user(headers, peer.0.ip()).map_err(|refusal| {
            self.audit.refused();
            let what = match refusal {
                Refusal::Missing => "sign in first",
                Refusal::Unknown => "unknown token, or no role",
                Refusal::Duplicated => "an identity header was sent more than once",
            };
            error(StatusCode::UNAUTHORIZED, what)
        })?;
        if user.role < need {
            let why = format!(
                "{} needs the {} role; {} has {}",
                action,
                need.as_str(),
                user.name,
                user.role.as_str()
            );
            // Refused, nothing done: folded, so repeating it cannot flood the log.
            self.log_folded(AuditEntry::new(&user, action, "refused", &why)).await?;
            return Err(error(StatusCode::FORBIDDEN, why));
        }
        Ok(user)
    }

    /// Logs `entry`, an action that changes nothing, folded
    /// ([`super::audit::AuditLog::fold`]); when it cannot be written the
    /// caller answers an error.
    pub(super) async fn log_folded(self: &Arc<Self>, entry: AuditEntry) -> Result<(), ApiError> {
        match self.audit.fold(entry, std::time::Instant::now()) {
            Some(entry) => self.log(entry).await,
            None => Ok(()),
        }
    }

    /// Writes `entry` to the audit log; when it cannot be written the
    /// caller answers an error and takes no action.
    pub(super) async fn log(self: &Arc<Self>, entry: AuditEntry) -> Result<(), ApiError> {
        let console = self.clone();
        blocking(move || {
            console.audit.write(&entry).map_err(|e| {
                tracing::error!("{e}");
                error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}: nothing done"))
            })
        })
        .await
    }

    /// The topic's history and the instances' reports, read at most once
    /// a second. A view older than that is answered at once while one
    /// reader fetches the next behind it (a read takes most of a second:
    /// checks as the user types must not wait for it); only with no view
    /// at all (at start, after a publication) does a request wait.
    pub(super) async fn view(self: &Arc<Self>) -> Result<Arc<View>, ApiError> {
        let cached = self.overview().view.clone();
        match cached {
            Some((at, view)) if at.elapsed() < Duration::from_secs(1) => Ok(view),
            Some((_, view)) => {
                if let Ok(reader) = Arc::clone(&self.refresh).try_acquire_owned() {
                    let console = self.clone();
                    tokio::spawn(async move {
                        let _reader = reader;
                        let _ = console.read_view().await;
                    });
                }
                Ok(view)
            }
            None => {
                let _reader = self
                    .refresh
                    .acquire()
                    .await
                    .map_err(|_| error(StatusCode::SERVICE_UNAVAILABLE, "stopping"))?;
                let read_before = self.overview().view.clone();
                match read_before {
                    Some((_, view)) => Ok(view), // read by the one before
                    None => self.read_view().await,
                }
            }
        }
    }

    /// Reads the topics into a new view (the caller holds `refresh`).
    async fn read_view(self: &Arc<Self>) -> Result<Arc<View>, ApiError> {
        let console = self.clone();
        let view = blocking(move || {
            let kafka = &console.config.rules.kafka;
            let history = publish::history(kafka, &console.trust)?;
            let reports = status::read(kafka)?;
            Ok(View { history, reports })
        })
        .await?;
        let view = Arc::new(view);
        let mut cache = self.overview();
        cache.observe(&view.reports);
        cache.view = Some((Instant::now(), view.clone()));
        Ok(view)
    }

    /// Forgets the last view: the next reads the topics (after a publication).
    pub(super) fn forget_view(&self) {
        self.overview().view = None;
    }

    fn overview(&self) -> std::sync::MutexGuard<'_, OverviewCache> {
        self.overview.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `edits` on `base`, checked (blocking).
    pub(super) async fn checked(
        self: &Arc<Self>,
        base: Option<String>,
        edits: Vec<File>,
    ) -> Result<Checked, ApiError> {
        if let Some(base) = &base {
            commit_id(base)?;
        }
        let console = self.clone();
        blocking(move || Ok(console.workspace.check(&console.config, base.as_deref(), &edits)?)).await
    }

    /// The capture `name` in `admin.captures_dir`.
    fn capture(&self, name: &str) -> Result<std::path::PathBuf, ApiError> {
        let dir = self.config.admin.captures_dir.as_ref().ok_or_else(|| {
            error(StatusCode::BAD_REQUEST, "admin.captures_dir is not set: this console has no captures")
        })?;
        let path = dir.join(name);
        if !capture_name(name) || !path.is_file() {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!("{name:?} is not a capture of admin.captures_dir"),
            ));
        }
        Ok(path)
    }

    /// The gate a publication runs: the capture named, required when
    /// `rules.kafka.require_gate` is on.
    pub(super) fn gate_of(&self, capture: Option<&str>) -> Result<Option<std::path::PathBuf>, ApiError> {
        match capture {
            Some(name) => self.capture(name).map(Some),
            None if self.config.rules.kafka.require_gate => Err(error(
                StatusCode::BAD_REQUEST,
                "rules.kafka.require_gate is on: choose a capture to gate the change against",
            )),
            None => Ok(None),
        }
    }

    pub(super) fn author(user: &User) -> git::Author {
        git::Author { name: user.name.clone(), email: user.email.clone() }
    }
}

/// A commit id as a request gives it: hex, so git never reads it as an option.
pub(super) fn commit_id(text: &str) -> Result<&str, ApiError> {
    let hex = (4..=64).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_hexdigit());
    if hex { Ok(text) } else { Err(error(StatusCode::BAD_REQUEST, format!("{text:?} is not a commit id"))) }
}

/// A commit message or note: not blank, at most 4 KiB.
pub(super) fn message(text: &str, what: &str) -> Result<String, ApiError> {
    let text = text.trim();
    if text.is_empty() || text.len() > 4096 {
        return Err(error(StatusCode::BAD_REQUEST, format!("give a {what} (at most 4096 bytes)")));
    }
    Ok(text.to_owned())
}

/// The topic and the instances, as last read.
#[derive(Debug)]
pub(super) struct View {
    history: Vec<Entry>,
    reports: Vec<status::StatusReport>,
}

impl View {
    pub(super) fn in_force(&self) -> Option<&SnapshotRecord> {
        publish::current(&self.history)
    }
}

/// The most version changes the timeline keeps.
const TIMELINE: usize = 512;

/// How long the dead-letter samples of an instance reach back.
const RECENT_MS: u64 = 60_000;

/// The last view, every (instance, version, since) seen, for the
/// timeline, and each instance's dead-letter counts over the last minute.
#[derive(Debug, Default)]
pub(super) struct OverviewCache {
    view: Option<(Instant, Arc<View>)>,
    seen: VecDeque<(String, String, u64)>,
    dead_letters: std::collections::HashMap<String, VecDeque<(u64, u64)>>,
    /// The rules of the version in force, one line each.
    in_force: Option<(String, Value)>,
}

impl OverviewCache {
    /// Dead letters an instance recorded over the samples of the last
    /// minute, and the seconds they span.
    fn recent_dead_letters(&self, instance: &str) -> (u64, u64) {
        let Some(samples) = self.dead_letters.get(instance) else { return (0, 0) };
        match (samples.front(), samples.back()) {
            // A restart starts its count again: never less than nothing.
            (Some(first), Some(last)) => (last.1.saturating_sub(first.1), (last.0 - first.0) / 1_000),
            _ => (0, 0),
        }
    }

    fn observe(&mut self, reports: &[status::StatusReport]) {
        self.dead_letters.retain(|instance, _| reports.iter().any(|r| &r.instance == instance));
        for report in reports {
            if let Some(vitals) = &report.vitals {
                let samples = self.dead_letters.entry(report.instance.clone()).or_default();
                if samples.back().is_none_or(|(at, _)| *at < report.reported_ms) {
                    samples.push_back((report.reported_ms, vitals.dead_letters));
                }
                while samples.len() > 256
                    || samples.front().is_some_and(|(at, _)| at + RECENT_MS < report.reported_ms)
                {
                    samples.pop_front();
                }
            }
        }
        for report in reports {
            let (Some(version), Some(since)) = (&report.version, report.since_ms) else { continue };
            let known =
                self.seen.iter().any(|(i, v, s)| *i == report.instance && v == version && *s == since);
            if !known {
                if self.seen.len() == TIMELINE {
                    self.seen.pop_front();
                }
                self.seen.push_back((report.instance.clone(), version.clone(), since));
            }
        }
    }
}

/// `GET /api/session`: who is signed in (audited: the page asks once, at sign-in).
pub(super) async fn session(State(console): State<Arc<Console>>, peer: Peer, headers: HeaderMap) -> Answer {
    let user = console.user(&headers, &peer, Role::Viewer, "sign_in").await?;
    console.log_folded(AuditEntry::new(&user, "sign_in", "ok", format!("from {}", peer.0.ip()))).await?;
    Ok(Json(json!({
        "user": user,
        "may_edit": user.role >= Role::Editor,
        "may_publish": user.role >= Role::Publisher,
    })))
}

/// `GET /api/overview`: instances, the record in force, the history.
pub(super) async fn overview(State(console): State<Arc<Console>>, peer: Peer, headers: HeaderMap) -> Answer {
    console.user(&headers, &peer, Role::Viewer, "overview").await?;
    let view = console.view().await?;
    let now = SystemClock.now_ms();
    let in_force = view.in_force().map(|r| r.version.as_str());
    let stale_after = console.config.rules.kafka.status_interval_ms.saturating_mul(3);
    let (instances, timeline) = {
        let cache = console.overview();
        let instances: Vec<Value> = view
            .reports
            .iter()
            .map(|r| {
                let mut value = serde_json::to_value(r).unwrap_or_default();
                value["standing"] = json!(status::standing(r, in_force, now, stale_after));
                let (recent, over_s) = cache.recent_dead_letters(&r.instance);
                value["dead_letters_recent"] = json!({ "count": recent, "over_s": over_s });
                value
            })
            .collect();
        let timeline: Vec<Value> = cache
            .seen
            .iter()
            .map(|(i, v, s)| json!({ "instance": i, "version": v, "since_ms": s }))
            .collect();
        (instances, timeline)
    };
    let history: Vec<Value> = view.history.iter().rev().take(50).map(history_entry).collect();
    Ok(Json(json!({
        "now_ms": now,
        "in_force": view.in_force().map(record_summary),
        "instances": instances,
        "history": history,
        "timeline": timeline,
    })))
}

fn record_summary(r: &SnapshotRecord) -> Value {
    json!({
        "version": r.version,
        "previous": r.previous,
        "published_at": r.published_at,
        "commit": r.provenance.git_commit,
        "author": r.provenance.git_author,
        "rolled_back_from": r.provenance.rolled_back_from,
        "native_rules": r.native.as_ref().map_or(0, |n| n.rules.len()),
        "envoy_files": r.envoy.as_ref().map_or(0, |e| e.files.len()),
        "limitador_file": r.limitador.as_ref().map(|l| &l.file.name),
        "gate": r.gate.as_ref().map(|g| json!({
            "passed": g.gate.passed,
            "capture_requests": g.capture_requests,
            "worst": format!("{} {} {:.2}%", g.gate.worst.kind.as_str(), g.gate.worst.name, g.gate.worst.drop * 100.0),
        })),
    })
}

fn history_entry(entry: &Entry) -> Value {
    match &entry.record {
        Ok(r) => json!({ "offset": entry.offset, "record": record_summary(r) }),
        Err(why) => json!({ "offset": entry.offset, "refused": why }),
    }
}

/// `GET /api/in-force`: every rule, Envoy limit and limitador limit of the record in force,
/// one line each (the page searches them); compiled once per version.
pub(super) async fn in_force(State(console): State<Arc<Console>>, peer: Peer, headers: HeaderMap) -> Answer {
    console.user(&headers, &peer, Role::Viewer, "in_force").await?;
    let view = console.view().await?;
    let Some(version) = view.in_force().map(|r| r.version.clone()) else {
        return Ok(Json(json!({ "version": null, "rules": [] })));
    };
    if let Some((cached, rules)) = &console.overview().in_force
        && *cached == version
    {
        return Ok(Json(json!({ "version": version, "rules": rules })));
    }
    let c = console.clone();
    let rules = blocking(move || {
        let record = view.in_force().ok_or_else(|| error(StatusCode::NOT_FOUND, "nothing in force"))?;
        let compiled = release::rules_of(&c.config, record, "the rules in force")?;
        let mut lines: Vec<Value> = compiled
            .native
            .rules()
            .iter()
            .map(|r| {
                let describe = crate::rules::diff::describe(r);
                json!({ "kind": "native", "id": &*r.id, "describe": describe, "overload": overload(r.overload) })
            })
            .collect();
        for limit in compiled.envoy.iter().flat_map(|e| e.limits()) {
            let describe = crate::rules::diff::describe_envoy(&limit);
            let directive = overload(limit.overload);
            lines.push(json!({ "kind": "envoy", "id": &*limit.full_key, "describe": describe, "overload": directive }));
        }
        let limitador = compiled.limitador.as_ref().map(crate::rules::diff::limitador_by_key).unwrap_or_default();
        for (key, limit) in limitador {
            let describe = crate::rules::diff::describe_limitador(limit);
            lines.push(json!({ "kind": "limitador", "id": key, "describe": describe, "overload": null }));
        }
        Ok(Value::Array(lines))
    })
    .await?;
    console.overview().in_force = Some((version.clone(), rules.clone()));
    Ok(Json(json!({ "version": version, "rules": rules })))
}

/// An overload directive in words: `500/s per rule`.
fn overload(spec: Option<crate::rules::OverloadSpec>) -> Option<String> {
    spec.map(|o| {
        let per = match o.per {
            crate::rules::OverloadScope::Rule => "per rule",
            crate::rules::OverloadScope::Tenant => "per tenant",
        };
        format!("{}/s {per}", o.rate_per_second)
    })
}

/// `GET /api/rules`: the rule files at the branch head, and what the page
/// needs to edit them.
pub(super) async fn rules(State(console): State<Arc<Console>>, peer: Peer, headers: HeaderMap) -> Answer {
    console.user(&headers, &peer, Role::Viewer, "rules").await?;
    let c = console.clone();
    let (head, files) = blocking(move || {
        let head = c.workspace.head()?;
        let files = c.workspace.files(head.as_deref())?;
        Ok((head, files))
    })
    .await?;
    let captures = captures(console.config.admin.captures_dir.as_deref());
    Ok(Json(json!({
        "branch": console.workspace.branch,
        "head": head,
        "files": files,
        "rules_path": console.workspace.native,
        "envoy_path": console.workspace.envoy,
        "limitador_path": console.workspace.limitador,
        "captures": captures,
        "require_gate": console.config.rules.kafka.require_gate,
    })))
}

/// Whether `name` can name a capture: a plain `*.jsonl` file name (no
/// path, nothing hidden). The list offered and the names taken are the same.
fn capture_name(name: &str) -> bool {
    name.ends_with(".jsonl")
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !name.starts_with('.')
}

/// The captures of `dir`, by name.
fn captures(dir: Option<&std::path::Path>) -> Vec<String> {
    let Some(Ok(entries)) = dir.map(std::fs::read_dir) else { return Vec::new() };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| capture_name(n))
        .take(1000)
        .collect();
    names.sort();
    names
}

/// A change as the page sends it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ChangeBody {
    pub(super) base: Option<String>,
    pub(super) files: Vec<File>,
    #[serde(default)]
    pub(super) capture: Option<String>,
    #[serde(default)]
    pub(super) message: Option<String>,
    #[serde(default)]
    pub(super) proposal: Option<u64>,
}

/// `POST /api/check`: the change compiled (its problems) and compared with
/// the rules in force. Not audited: the page asks as the user types.
pub(super) async fn check(
    State(console): State<Arc<Console>>,
    peer: Peer,
    headers: HeaderMap,
    Json(body): Json<ChangeBody>,
) -> Answer {
    console.user(&headers, &peer, Role::Editor, "check").await?;
    let checked = match console.checked(body.base, body.files).await {
        Ok(checked) => checked,
        Err(ApiError(StatusCode::UNPROCESSABLE_ENTITY, value)) if value["problems"].is_array() => {
            return Ok(Json(json!({ "problems": value["problems"], "changes": [] })));
        }
        Err(e) => return Err(e),
    };
    let view = console.view().await?;
    let c = console.clone();
    let changes = blocking(move || {
        let in_force = view.in_force();
        Ok(workspace::changes(&c.config, in_force, &c.trust, &checked.candidate)?)
    })
    .await?;
    Ok(Json(json!({ "problems": [], "changes": changes })))
}

/// `POST /api/gate`: the change replayed against a capture with the rules
/// in force; the report, per priority and per rule.
pub(super) async fn gate(
    State(console): State<Arc<Console>>,
    peer: Peer,
    headers: HeaderMap,
    Json(body): Json<ChangeBody>,
) -> Answer {
    let user = console.user(&headers, &peer, Role::Editor, "gate").await?;
    let name = body.capture.clone().unwrap_or_default();
    let capture = console.capture(&name)?;
    let checked = console.checked(body.base, body.files).await?;
    // The version the record would have (the report names the native set's).
    let version = checked.candidate.version();
    let _one =
        console.heavy.try_acquire().map_err(|_| error(StatusCode::TOO_MANY_REQUESTS, "a gate is running"))?;
    let view = console.view().await?;
    let before = view.in_force().map(|r| r.version.clone());
    let c = console.clone();
    let report = blocking(move || {
        let capture = crate::replay::Capture::from_file(&capture)
            .map_err(|e| error(StatusCode::UNPROCESSABLE_ENTITY, e))?;
        Ok(release::gate(&c.config, view.in_force(), &c.trust, &checked.candidate, &capture, c.config.gate)?)
    })
    .await?;
    let passed = report.gate.passed;
    let worst = &report.gate.worst;
    let detail = format!(
        "capture {name}: {} ({} requests; worst {} {} {:.2}%)",
        if passed { "passes" } else { "fails" },
        report.requests,
        worst.kind.as_str(),
        worst.name,
        worst.drop * 100.0
    );
    let mut entry = AuditEntry::new(&user, "gate", if passed { "ok" } else { "refused" }, detail);
    (entry.before, entry.after) = (before, Some(version));
    console.log(entry).await?;
    Ok(Json(json!({ "report": report })))
}

/// `GET /api/proposals`: the open proposals.
pub(super) async fn proposals(State(console): State<Arc<Console>>, peer: Peer, headers: HeaderMap) -> Answer {
    console.user(&headers, &peer, Role::Viewer, "proposals").await?;
    let c = console.clone();
    let list = blocking(move || Ok(git::proposals(&c.workspace.repo)?)).await?;
    Ok(Json(json!({ "proposals": list })))
}

/// `GET /api/proposals/{id}`: one proposal and what it changes against
/// its base (a deleted file has no text), to be applied to the head.
pub(super) async fn proposal(
    State(console): State<Arc<Console>>,
    peer: Peer,
    headers: HeaderMap,
    UrlPath(id): UrlPath<u64>,
) -> Answer {
    console.user(&headers, &peer, Role::Viewer, "proposals").await?;
    let c = console.clone();
    let (proposal, files) = blocking(move || {
        let proposal = git::proposals(&c.workspace.repo)?
            .into_iter()
            .find(|p| p.id == id)
            .ok_or_else(|| error(StatusCode::NOT_FOUND, format!("no proposal {id}")))?;
        let before = c.workspace.files(proposal.base.as_deref())?;
        let after = c.workspace.files(Some(&proposal.commit))?;
        let mut changes: Vec<File> = after.iter().filter(|f| !before.contains(f)).cloned().collect();
        let deleted = before.iter().filter(|b| !after.iter().any(|a| a.path == b.path));
        changes.extend(deleted.map(|b| File { path: b.path.clone(), text: None }));
        Ok((proposal, changes))
    })
    .await?;
    Ok(Json(json!({ "proposal": proposal, "files": files })))
}

/// The most proposals open at once.
const MAX_PROPOSALS: usize = 100;

/// `POST /api/proposals`: the change recorded for a publisher's review.
pub(super) async fn propose(
    State(console): State<Arc<Console>>,
    peer: Peer,
    headers: HeaderMap,
    Json(body): Json<ChangeBody>,
) -> Answer {
    let user = console.user(&headers, &peer, Role::Editor, "propose").await?;
    let note = message(body.message.as_deref().unwrap_or_default(), "note")?;
    let base = body.base.clone();
    let checked = console.checked(body.base, body.files).await?;
    let c = console.clone();
    let author = Console::author(&user);
    let proposal = blocking(move || {
        if git::proposals(&c.workspace.repo)?.len() >= MAX_PROPOSALS {
            return Err(error(StatusCode::TOO_MANY_REQUESTS, format!("{MAX_PROPOSALS} proposals are open")));
        }
        Ok(git::propose(&c.workspace.repo, base.as_deref(), &checked.changes, &author, &note)?)
    })
    .await?;
    let mut entry =
        AuditEntry::new(&user, "propose", "ok", format!("proposal {}: {}", proposal.id, proposal.note));
    entry.commit = Some(proposal.commit.clone());
    console.log(entry).await?;
    Ok(Json(json!({ "proposal": proposal })))
}

/// `GET /api/audit`: the newest 200 entries.
pub(super) async fn audit(State(console): State<Arc<Console>>, peer: Peer, headers: HeaderMap) -> Answer {
    console.user(&headers, &peer, Role::Viewer, "audit").await?;
    let c = console.clone();
    let entries =
        blocking(move || c.audit.recent(200).map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e)))
            .await?;
    Ok(Json(json!({ "entries": entries })))
}
