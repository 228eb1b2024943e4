//! The admin console end to end, in a real headless Chromium driven over
//! WebDriver (Debian's chromium and chromedriver), against a real
//! Kafka-protocol broker, three instances subscribed to the rules topic
//! and a bare Git repository holding the rules.
//!
//! An editor signs in (keyboard only), changes a limit, sees the diff and
//! a failing gate against captured traffic, fixes the change, sees it pass
//! and proposes it. A viewer cannot publish (the button is disabled and the
//! API answers 403). The publisher reviews the proposal and publishes it:
//! the repository holds the commit with the publisher as author, the three
//! instances converge on its version, and the audit log has every step.
//! limitador's limits file is edited, compared and published the same way
//! and served by an instance answering with limitador's limits. With `RATELIMITD_SCREENSHOTS=DIR` the main pages are saved as PNGs
//! (the README's pictures).

#![cfg(feature = "kafka")]

mod common;

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Output},
    time::Duration,
};

use common::{Broker, TestServer, config, eventually, http_get, start_listening, webdriver::Browser};
use ratelimitd::{config::RulesSource, rules::signing::Signer};
use serde_json::{Value, json};
use sha2::Digest as _;

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

/// How long a page may take to show what a step expects (Chromium shares
/// two cores with the rest of the suite).
const WAIT: Duration = Duration::from_secs(20);

use common::play_and_bulk_rules as rules_of;

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_AUTHOR_NAME", "Seed")
        .env("GIT_AUTHOR_EMAIL", "seed@example.com")
        .env("GIT_COMMITTER_NAME", "Seed")
        .env("GIT_COMMITTER_EMAIL", "seed@example.com")
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn hex_sha256(token: &str) -> String {
    sha2::Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// The fixture: broker, keys, repository, capture, config file.
struct Fixture {
    dir: tempfile::TempDir,
    broker: Broker,
    public_key: String,
    config_file: PathBuf,
    repo: PathBuf,
    audit: PathBuf,
}

impl Fixture {
    fn run(&self, args: &[&str]) -> Output {
        Command::new(BIN).arg("--config").arg(&self.config_file).args(args).output().unwrap()
    }

    /// The version `rules history` marks in force.
    fn in_force(&self) -> String {
        let out = self.run(&["rules", "history"]);
        let history = text(&out);
        let line = history.lines().find(|l| l.contains("(in force)")).unwrap_or_else(|| panic!("{history}"));
        line.split_whitespace().nth(1).unwrap().to_owned()
    }

    fn subscriber(&self, instance: &str) -> ratelimitd::config::Config {
        let mut cfg = config(Path::new("/unused"), None);
        cfg.rules.path = None;
        cfg.rules.source = RulesSource::Kafka;
        cfg.rules.kafka.brokers = Some(self.broker.brokers());
        cfg.rules.kafka.status_interval_ms = 200;
        cfg.rules.kafka.verify_keys = vec![self.public_key.clone()];
        cfg.dlq.instance_id = Some(instance.to_owned());
        cfg
    }

    /// `ratelimitd admin` on a free port, and the console's URL.
    fn admin(&self) -> (Admin, String) {
        self.admin_with(&[])
    }

    /// [`Fixture::admin`] with more environment.
    fn admin_with(&self, env: &[(&str, &str)]) -> (Admin, String) {
        let log = self.dir.path().join("admin.log");
        let (child, port) = start_listening("ratelimitd admin", &log, |port| {
            let mut command = Command::new(BIN);
            command
                .arg("--config")
                .arg(&self.config_file)
                .arg("admin")
                .env("RATELIMITD__ADMIN__LISTEN", format!("127.0.0.1:{port}"))
                .envs(env.iter().copied());
            command
        });
        (Admin(child), format!("http://127.0.0.1:{port}/"))
    }
}

/// The console's process, stopped by PID when dropped, a failing test's
/// included.
struct Admin(Child);

impl Drop for Admin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Captures CRITICAL /play and BULK /bulk traffic of an instance serving
/// `rules_of(10, 10)` to `file`.
async fn capture_traffic(dir: &Path, file: &Path) {
    let rules = dir.join("capture-rules.yaml");
    std::fs::write(&rules, rules_of(10, 10)).unwrap();
    common::capture_play_and_bulk(&rules, file).await;
}

fn fixture(broker: Broker) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("publisher.key");
    let out = Command::new(BIN).args(["rules", "keygen", "--out"]).arg(&key).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let public_key = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(Signer::from_text(&std::fs::read_to_string(&key).unwrap()).is_ok());
    let seed = dir.path().join("seed");
    std::fs::create_dir_all(seed.join("rules")).unwrap();
    std::fs::write(seed.join("rules/limits.yaml"), rules_of(10, 10)).unwrap();
    git(&seed, &["init", "-q", "-b", "main"]);
    git(&seed, &["add", "rules"]);
    git(&seed, &["commit", "-q", "-m", "Seed the rules"]);
    let repo = dir.path().join("rules.git");
    git(dir.path(), &["clone", "-q", "--bare", seed.to_str().unwrap(), repo.to_str().unwrap()]);
    std::fs::create_dir_all(dir.path().join("captures")).unwrap();
    let audit = dir.path().join("state/admin-audit.jsonl");
    let user = |name: &str, email: &str, role: &str, token: &str| {
        format!(
            "    - {{ name: {name}, email: {email}, role: {role}, token_sha256: {} }}\n",
            hex_sha256(token)
        )
    };
    let config_file = dir.path().join("ratelimitd.yaml");
    let yaml = format!(
        "rules:\n  kafka:\n    brokers: {brokers}\n    replication_factor: 1\n    status_interval_ms: 200\n    signing_key_file: {key}\n    verify_keys: [{public_key}]\nadmin:\n  repo: {repo}\n  rules_path: rules\n  captures_dir: {captures}\n  audit_log: {audit}\n  users:\n{eve}{pat}{val}gate:\n  min_capture_requests: 10\n",
        brokers = broker.brokers(),
        key = key.display(),
        repo = repo.display(),
        captures = dir.path().join("captures").display(),
        audit = audit.display(),
        eve = user("Eve Editor", "eve@example.com", "editor", "eve-token"),
        pat = user("Pat Publisher", "pat@example.com", "publisher", "pat-token"),
        val = user("Val Viewer", "val@example.com", "viewer", "val-token"),
    );
    std::fs::write(&config_file, yaml).unwrap();
    Fixture { dir, broker, public_key, config_file, repo, audit }
}

fn sign_in(browser: &Browser, url: &str, token: &str, who: &str) {
    browser.goto(url);
    browser.type_text("#token", token);
    browser.key("#token", '\u{e007}'); // Enter submits the form
    browser.wait_text("#notice", &format!("Signed in as {who}"), WAIT);
}

fn edit(browser: &Browser, rules: &str, wanted_change: &str) {
    browser.clear("#editor");
    browser.type_text("#editor", rules);
    browser.wait_text("#problems", "No problems", WAIT);
    browser.wait_text("#changes", wanted_change, WAIT);
}

fn gate(browser: &Browser, verdict: &str) -> String {
    browser.click("#capture option[value='traffic.jsonl']");
    browser.click("#run-gate");
    browser.wait_text("#gate-verdict", verdict, Duration::from_secs(30))
}

fn shoot(browser: &Browser, name: &str) {
    if let Some(dir) = std::env::var_os("RATELIMITD_SCREENSHOTS") {
        std::fs::create_dir_all(&dir).unwrap();
        browser.screenshot(&Path::new(&dir).join(name));
    }
}

/// POST /api/publish from the page with `token`: the HTTP status.
fn publish_by_script(browser: &Browser, token: &str) -> u64 {
    let script = format!(
        "const done = arguments[arguments.length - 1];
         fetch('/api/publish', {{ method: 'POST', headers: {{ 'Authorization': 'Bearer {token}', 'Content-Type': 'application/json' }},
           body: JSON.stringify({{ base: null, files: [], message: 'sneak' }}) }}).then(r => done(r.status), e => done(String(e)));"
    );
    browser.run_async(&script).as_u64().unwrap_or_default()
}

fn audit_entries(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_editor_proposes_a_viewer_cannot_publish_and_a_publisher_ships_through_git() {
    let f = fixture(Broker::start());
    let out = f.run(&["migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    capture_traffic(f.dir.path(), &f.dir.path().join("captures/traffic.jsonl")).await;
    let out = f.run(&["rules", "sync", "--repo", f.repo.to_str().unwrap(), "rules"]);
    assert!(out.status.success(), "{}", text(&out));
    let first = f.in_force();
    let mut instances = Vec::new();
    for name in ["console-a", "console-b", "console-c"] {
        instances.push(TestServer::start(f.subscriber(name)).await);
    }
    let serve = |version: String| {
        let addrs: Vec<_> = instances.iter().map(|s| s.http_addr).collect();
        async move {
            eventually(Duration::from_secs(30), || {
                let (addrs, version) = (addrs.clone(), version.clone());
                async move {
                    tokio::task::spawn_blocking(move || {
                        addrs.iter().all(|a| {
                            http_get(*a, "/readyz").1.contains(&format!("rules {version} (from topic,"))
                        })
                    })
                    .await
                    .unwrap()
                }
            })
            .await
        }
    };
    assert!(serve(first.clone()).await, "the three instances serve the seeded rules");
    let (admin, url) = f.admin();
    let browser = tokio::task::block_in_place(|| Browser::start(&f.dir.path().join("chromedriver.log")));
    tokio::task::block_in_place(|| editor_steps(&browser, &url));
    tokio::task::block_in_place(|| viewer_steps(&browser, &url));
    let published = tokio::task::block_in_place(|| publisher_steps(&browser, &url));
    assert!(published.contains("and published"), "{published}");
    let second = f.in_force();
    assert_ne!(first, second);
    assert!(serve(second.clone()).await, "the three instances converge on the published version");
    tokio::task::block_in_place(|| {
        browser.click("#nav-overview");
        browser.wait_text("#converged", "3 of 3 serve the version in force", WAIT);
        // Each instance's shedding, overload layer and dead letters, from its report.
        let instances = browser.wait_text("#instances", "since start", WAIT);
        assert!(instances.contains("NORMAL") && instances.contains("enforce, 0 directive(s)"), "{instances}");
        // The rules in force, searched.
        browser.wait_text("#in-force-rules", "/play", WAIT);
        browser.type_text("#rule-search", "bulk");
        let found = browser.wait_text("#in-force-rules", "/bulk 2 per 60000 ms", WAIT);
        assert!(!found.contains("/play"), "{found}");
        shoot(&browser, "console-overview.png");
        browser.click("#nav-audit");
        browser.wait_text("#audit", "publish", WAIT);
        shoot(&browser, "console-audit.png");
    });
    // The repository holds the commit, by the publisher, with the reviewer's message.
    let head = git(&f.repo, &["rev-parse", "main"]);
    assert_eq!(git(&f.repo, &["log", "-1", "--format=%an <%ae>", "main"]), "Pat Publisher <pat@example.com>");
    let message = git(&f.repo, &["log", "-1", "--format=%B", "main"]);
    assert!(message.starts_with("Cap bulk exports at 2 a minute"), "{message}");
    assert!(message.contains("Proposed-by: Eve Editor <eve@example.com>"), "{message}");
    assert_eq!(git(&f.repo, &["show", "main:rules/limits.yaml"]), rules_of(10, 2).trim());
    assert!(
        git(&f.repo, &["for-each-ref", "refs/ratelimitd/proposals/"]).is_empty(),
        "the proposal is closed"
    );
    assert_audit(&audit_entries(&f.audit), &first, &second, &head);
    // The publisher reverts the change from the overview's history.
    tokio::task::block_in_place(|| {
        browser.click("#nav-overview");
        browser.click("#revert-capture option[value='traffic.jsonl']");
        browser.click(&format!(".rollback[data-commit='{head}']"));
        browser.answer_prompt("Back to 10 bulk exports a minute");
        browser.wait_text("#notice", "Reverted in", WAIT);
    });
    assert_eq!(f.in_force(), first, "the revert's rules are the seed's");
    assert_eq!(
        git(&f.repo, &["log", "-1", "--format=%an|%s", "main"]),
        "Pat Publisher|Back to 10 bulk exports a minute"
    );
    let last = audit_entries(&f.audit).pop().unwrap();
    assert_eq!(
        (&last["action"], &last["outcome"], &last["after"]),
        (&json!("rollback"), &json!("ok"), &json!(first))
    );
    assert!(last["detail"].as_str().unwrap().starts_with(&format!("revert {head}")), "{last}");
    drop(browser);
    drop(admin);
    for instance in instances {
        instance.stop().await.unwrap();
    }
}

/// Every form control has a label, and the keyboard reaches the sign-in
/// button from the token field.
fn accessible(browser: &Browser, url: &str) {
    browser.goto(url);
    let unlabelled = browser.run_async(
        "const done = arguments[arguments.length - 1];
         done([...document.querySelectorAll('input, select, textarea')].filter(e => e.labels.length === 0).map(e => e.id));",
    );
    assert_eq!(unlabelled, json!([]), "controls without a label");
    browser.click("#token");
    browser.key("#token", '\u{e004}'); // Tab
    assert_eq!(browser.focused_id(), "sign-in");
}

fn editor_steps(browser: &Browser, url: &str) {
    accessible(browser, url);
    sign_in(browser, url, "eve-token", "Eve Editor");
    browser.click("#nav-rules");
    browser.wait_text("#rules-head", "main at", WAIT);
    assert_eq!(browser.property("#editor", "value").as_str().unwrap(), rules_of(10, 10));
    assert_eq!(browser.property("#publish", "disabled"), Value::Bool(true), "an editor does not publish");
    // Too tight: 9 of the 24 captured CRITICAL /play requests would be denied.
    edit(browser, &rules_of(5, 10), "limit: 10 → 5");
    let failed = gate(browser, "Fails the gate");
    assert!(failed.contains("drops 37.50% of its CRITICAL requests"), "{failed}");
    assert!(browser.text("#gate-rules").contains("play"), "{}", browser.text("#gate-rules"));
    shoot(browser, "console-rules.png");
    // An unsaved edit survives a visit to another page.
    browser.click("#nav-overview");
    browser.wait_text("#converged", "serve the version in force", WAIT);
    browser.click("#nav-rules");
    browser.wait_text("#changes", "limit: 10 → 5", WAIT);
    assert_eq!(browser.property("#editor", "value").as_str().unwrap(), rules_of(5, 10));
    // A typo is named by file, rule and field as the editor types.
    browser.clear("#editor");
    browser.type_text("#editor", &rules_of(10, 0));
    let problems = browser.wait_text("#problems", "rules/limits.yaml", WAIT);
    assert!(problems.contains("bulk") && problems.contains("limit"), "{problems}");
    // Fixed: CRITICAL traffic keeps its room; only BULK exports tighten.
    edit(browser, &rules_of(10, 2), "limit: 10 → 2");
    let passed = gate(browser, "Passes the gate");
    assert!(passed.contains("32 requests replayed"), "{passed}");
    browser.type_text("#propose-note", "Bulk exports: 2 a minute");
    browser.click("#propose");
    browser.wait_text("#publish-result", "Proposed as #1", WAIT);
    browser.click("#sign-out");
}

fn viewer_steps(browser: &Browser, url: &str) {
    sign_in(browser, url, "val-token", "Val Viewer");
    browser.click("#nav-rules");
    browser.wait_text("#rules-head", "main at", WAIT);
    assert_eq!(browser.property("#editor", "readOnly"), Value::Bool(true));
    assert_eq!(browser.property("#publish", "disabled"), Value::Bool(true));
    assert_eq!(publish_by_script(browser, "val-token"), 403, "the API refuses a viewer's publish");
    assert_eq!(publish_by_script(browser, "nobody"), 401);
    browser.click("#sign-out");
}

fn publisher_steps(browser: &Browser, url: &str) -> String {
    sign_in(browser, url, "pat-token", "Pat Publisher");
    browser.click("#nav-proposals");
    browser.click(".open-proposal[data-id='1']");
    browser.wait_text("#proposal-loaded", "Reviewing proposal 1 by Eve Editor", WAIT);
    browser.wait_text("#changes", "limit: 10 → 2", WAIT);
    gate(browser, "Passes the gate");
    browser.type_text("#message", "Cap bulk exports at 2 a minute");
    browser.click("#publish");
    browser.wait_text("#publish-result", "published", Duration::from_secs(30))
}

/// Every step, in order, by whom, with the versions and the commit.
fn assert_audit(entries: &[Value], first: &str, second: &str, head: &str) {
    // Refused sign-ins (the unknown token) are summed once a minute, so
    // whether their line is in yet depends on the clock.
    let entries: Vec<&Value> = entries.iter().filter(|e| e["action"] != "sign_in_refused").collect();
    let steps: Vec<(String, String, String)> = entries
        .iter()
        .map(|e| {
            let s = |k: &str| e[k].as_str().unwrap_or_default().to_owned();
            (s("user"), s("action"), s("outcome"))
        })
        .collect();
    let want = [
        ("Eve Editor", "sign_in", "ok"),
        ("Eve Editor", "gate", "refused"),
        ("Eve Editor", "gate", "ok"),
        ("Eve Editor", "propose", "ok"),
        ("Val Viewer", "sign_in", "ok"),
        ("Val Viewer", "publish", "refused"),
        ("Pat Publisher", "sign_in", "ok"),
        ("Pat Publisher", "gate", "ok"),
        ("Pat Publisher", "publish", "started"),
        ("Pat Publisher", "publish", "ok"),
    ];
    let got: Vec<(&str, &str, &str)> =
        steps.iter().map(|(u, a, o)| (u.as_str(), a.as_str(), o.as_str())).collect();
    assert_eq!(got, want, "{entries:#?}");
    let reviewed = entries[entries.len() - 3];
    assert_eq!(
        (&reviewed["before"], &reviewed["after"]),
        (&json!(first), &json!(second)),
        "the gate names the versions"
    );
    let publish = entries.last().unwrap();
    assert_eq!(publish["before"], first);
    assert_eq!(publish["after"], second);
    assert_eq!(publish["commit"], head);
}

/// One JSON call to the console's API: the status and the answer.
fn call(url: &str, method: &str, path: &str, token: &str, body: Option<Value>) -> (u16, Value) {
    use std::io::{Read as _, Write as _};
    let addr = url.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    let (head, payload) = reply.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(payload).unwrap_or(Value::Null))
}

fn change(base: &str, path: &str, text: &str, message: &str) -> Value {
    serde_json::json!({ "base": base, "files": [{ "path": path, "text": text }], "message": message })
}

/// The API on its own: what it refuses, a rollback as a revert commit, a
/// sync of a commit made by other means.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_refuses_what_it_must_and_rolls_back_and_syncs_through_git() {
    let f = fixture(Broker::start());
    assert!(f.run(&["migrate"]).status.success());
    let out = f.run(&["rules", "sync", "--repo", f.repo.to_str().unwrap(), "rules"]);
    assert!(out.status.success(), "{}", text(&out));
    let first = f.in_force();
    let (admin, url) = f.admin();
    let api = |method: &str, path: &str, token: &str, body: Option<Value>| {
        let url = url.clone();
        let (method, path, token) = (method.to_owned(), path.to_owned(), token.to_owned());
        async move { tokio::task::spawn_blocking(move || call(&url, &method, &path, &token, body)).await.unwrap() }
    };
    let head = git(&f.repo, &["rev-parse", "main"]);
    // Only the rule paths, plain relative names, hex commit ids and captures by name.
    for (path, why) in [
        (".github/workflows/ci.yml", "changes only files under rules"),
        ("rules/../ci.yml", "changes only files under rules"),
        ("rules/a\u{0}b.yaml", "changes only files under rules"),
    ] {
        let (status, answer) =
            api("POST", "/api/check", "eve-token", Some(change(&head, path, "x", "m"))).await;
        assert_eq!(status, 400, "{path:?}: {answer}");
        assert!(answer["error"].as_str().unwrap().contains(why), "{answer}");
    }
    let gate = serde_json::json!({ "base": head, "files": [], "capture": "../ratelimitd.yaml" });
    let (status, answer) = api("POST", "/api/gate", "eve-token", Some(gate)).await;
    assert_eq!(status, 400, "{answer}");
    let bad_commit = serde_json::json!({ "commit": "--output=/tmp/x", "message": "m" });
    assert_eq!(api("POST", "/api/rollback", "eve-token", Some(bad_commit.clone())).await.0, 403);
    assert_eq!(api("POST", "/api/rollback", "pat-token", Some(bad_commit)).await.0, 400);
    // A broken change is refused with its problems; a stale base with 409.
    let broken = change(&head, "rules/limits.yaml", &rules_of(10, 0), "m");
    let (status, answer) = api("POST", "/api/publish", "pat-token", Some(broken)).await;
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["problems"][0]["file"], "rules/limits.yaml", "{answer}");
    assert_eq!(answer["problems"][0]["field"], "limit", "{answer}");
    let stale = change("0123abcd", "rules/limits.yaml", &rules_of(10, 2), "m");
    assert_eq!(api("POST", "/api/publish", "pat-token", Some(stale)).await.0, 409);
    // Published ungated (rules.kafka.require_gate is off), then reverted.
    let publish = change(&head, "rules/limits.yaml", &rules_of(10, 2), "Bulk: 2");
    let (status, published) = api("POST", "/api/publish", "pat-token", Some(publish)).await;
    assert_eq!(status, 200, "{published}");
    let commit = published["commit"].as_str().unwrap().to_owned();
    let rollback = serde_json::json!({ "commit": commit, "message": "Bulk exports need 10 again" });
    let (status, reverted) = api("POST", "/api/rollback", "pat-token", Some(rollback)).await;
    assert_eq!(status, 200, "{reverted}");
    assert_eq!(reverted["version"].as_str(), Some(first.as_str()), "the seed's rules, published again");
    assert_eq!(f.in_force(), first);
    assert_eq!(git(&f.repo, &["show", "main:rules/limits.yaml"]), rules_of(10, 10).trim());
    assert_eq!(
        git(&f.repo, &["log", "-1", "--format=%an|%s", "main"]),
        "Pat Publisher|Bulk exports need 10 again"
    );
    // A commit pushed by other means is published by a sync, once.
    let seed = f.dir.path().join("seed");
    std::fs::write(seed.join("rules/limits.yaml"), rules_of(12, 10)).unwrap();
    git(&seed, &["commit", "-q", "-am", "From CI"]);
    git(&seed, &["push", "-q", "--force", f.repo.to_str().unwrap(), "main"]);
    let (status, synced) = api("POST", "/api/sync", "pat-token", Some(serde_json::json!({}))).await;
    assert_eq!(status, 200, "{synced}");
    assert_ne!(f.in_force(), first);
    let (_, again) = api("POST", "/api/sync", "pat-token", Some(serde_json::json!({}))).await;
    assert_eq!(again["already_in_force"], true, "{again}");
    let actions: Vec<(String, String)> = audit_entries(&f.audit)
        .iter()
        .map(|e| (e["action"].as_str().unwrap().to_owned(), e["outcome"].as_str().unwrap().to_owned()))
        .collect();
    let want = [
        ("rollback", "refused"), // an editor
        ("rollback", "refused"), // not a commit id
        ("publish", "refused"),  // a broken rule
        ("publish", "refused"),  // a stale base
        ("publish", "started"),
        ("publish", "ok"),
        ("rollback", "started"),
        ("rollback", "ok"),
        ("sync", "started"),
        ("sync", "ok"),
        ("sync", "started"),
        ("sync", "ok"), // already in force
    ];
    let want: Vec<(String, String)> = want.iter().map(|(a, o)| ((*a).to_owned(), (*o).to_owned())).collect();
    assert_eq!(actions, want);
    drop(admin);
}

/// `max` calls per minute per `user` in limitador's namespace `ns`.
fn limitador_limits(max: u32) -> String {
    format!(
        "- {{ namespace: ns, max_value: {max}, seconds: 60, conditions: [], variables: [\"descriptors[0]['user']\"] }}\n"
    )
}

/// limitador's limits file in the repository (`admin.limitador_path`):
/// listed, edited and checked in the page (errors naming the file),
/// compared by limit, published, and served by an instance answering with
/// limitador's limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limitadors_limits_are_edited_checked_and_published() {
    use ratelimitd::api::envoy_pb::{
        envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
        rls::{RateLimitRequest, rate_limit_service_client::RateLimitServiceClient},
    };
    let f = fixture(Broker::start());
    assert!(f.run(&["migrate"]).status.success());
    let seed = f.dir.path().join("seed");
    std::fs::create_dir_all(seed.join("limitador")).unwrap();
    std::fs::write(seed.join("limitador/limits.yaml"), limitador_limits(5)).unwrap();
    git(&seed, &["add", "limitador"]);
    git(&seed, &["commit", "-q", "-m", "limitador's limits"]);
    git(&seed, &["push", "-q", f.repo.to_str().unwrap(), "main"]);
    let (admin, url) = f.admin_with(&[("RATELIMITD__ADMIN__LIMITADOR_PATH", "limitador/limits.yaml")]);
    let api = |method: &str, path: &str, token: &str, body: Option<Value>| {
        let url = url.clone();
        let (method, path, token) = (method.to_owned(), path.to_owned(), token.to_owned());
        async move { tokio::task::spawn_blocking(move || call(&url, &method, &path, &token, body)).await.unwrap() }
    };
    let (status, listed) = api("GET", "/api/rules", "val-token", None).await;
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed["limitador_path"], "limitador/limits.yaml");
    let paths: Vec<&str> =
        listed["files"].as_array().unwrap().iter().map(|f| f["path"].as_str().unwrap()).collect();
    assert!(paths.contains(&"limitador/limits.yaml"), "{listed}");
    let (status, synced) = api("POST", "/api/sync", "pat-token", Some(json!({}))).await;
    assert_eq!(status, 200, "{synced}");
    let head = git(&f.repo, &["rev-parse", "main"]);
    let key = "ns 60s if [] by [descriptors[0]['user']]";

    // In the page: the file listed beside the native rules, edited, compared, checked.
    let browser = tokio::task::block_in_place(|| Browser::start(&f.dir.path().join("chromedriver.log")));
    tokio::task::block_in_place(|| {
        sign_in(&browser, &url, "eve-token", "Eve Editor");
        browser.click("#nav-rules");
        browser.wait_text("#rules-head", "limitador/limits.yaml", WAIT);
        browser.click("#file-select option[value='limitador/limits.yaml']");
        assert_eq!(browser.property("#editor", "value").as_str().unwrap(), limitador_limits(5));
        edit(&browser, &limitador_limits(2), "max_value: 5 → 2");
        assert!(browser.text("#changes").contains(key), "{}", browser.text("#changes"));
        browser.clear("#editor");
        browser.type_text("#editor", "- { namespace: ns, seconds: 60 }");
        browser.wait_text("#problems", "limitador/limits.yaml: [0]: missing field `max_value`", WAIT);
        browser.click("#sign-out");
    });
    drop(browser);

    let path = "limitador/limits.yaml";
    let broken = change(&head, path, "- { namespace: ns, seconds: 60 }\n", "m");
    let (status, answer) = api("POST", "/api/check", "eve-token", Some(broken)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["problems"][0]["file"], path, "{answer}");
    let problem = answer["problems"][0]["text"].as_str().unwrap();
    assert_eq!(problem, "limitador/limits.yaml: [0]: missing field `max_value` at line 1 column 3");
    let (status, checked) =
        api("POST", "/api/check", "eve-token", Some(change(&head, path, &limitador_limits(2), "m"))).await;
    assert_eq!(status, 200, "{checked}");
    assert_eq!(
        checked["changes"],
        json!([{ "kind": "limitador", "id": key, "change": "changed", "describe": "", "fields": [["max_value", "5", "2"]] }]),
        "{checked}"
    );

    let (status, published) = api(
        "POST",
        "/api/publish",
        "pat-token",
        Some(change(&head, path, &limitador_limits(2), "ns: 2 a minute")),
    )
    .await;
    assert_eq!(status, 200, "{published}");
    let version = published["version"].as_str().unwrap().to_owned();
    assert_eq!(f.in_force(), version);
    let (_, in_force) = api("GET", "/api/in-force", "val-token", None).await;
    assert!(
        in_force["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["kind"] == "limitador" && r["describe"] == "2 per 60 s"),
        "{in_force}"
    );

    let mut instance = f.subscriber("l1");
    let fallback = f.dir.path().join("fallback-limits.yaml");
    std::fs::write(&fallback, limitador_limits(100)).unwrap();
    instance.rules.limitador_path = Some(fallback);
    let server = TestServer::start(instance).await;
    let addr = server.http_addr;
    let serving = || {
        let version = version.clone();
        async move {
            tokio::task::spawn_blocking(move || http_get(addr, "/readyz")).await.unwrap().1.contains(&version)
        }
    };
    assert!(eventually(Duration::from_secs(10), serving).await);
    let mut client = RateLimitServiceClient::connect(format!("http://{}", server.addr)).await.unwrap();
    let mut codes = Vec::new();
    for _ in 0..3 {
        let entries = vec![Entry { key: "user".to_owned(), value: "u".to_owned() }];
        let descriptors = vec![RateLimitDescriptor { entries, ..Default::default() }];
        let request = RateLimitRequest { domain: "ns".to_owned(), descriptors, hits_addend: 0 };
        codes.push(client.should_rate_limit(request).await.unwrap().into_inner().overall_code);
    }
    assert_eq!(codes, [1, 1, 2], "2 a minute, from the console's publication");
    server.stop().await.unwrap();
    drop(admin);
}
