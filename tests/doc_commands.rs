//! What the documentation shows is what the binary does (tests/docs.rs:
//! that it holds together): each command
//! output shown in a `console` block of the docs is produced here by
//! running the same command (against a test server where it needs one,
//! with its address added), and compared line for line; and every file
//! the docs and manifests name exists.

mod common;

use std::{path::Path, process::Command};

use common::{Rules, TestServer, default_rules_config};

/// The commands of the `console` block of `doc` whose first command is
/// `first`, each with the output shown under it.
fn console_block(doc: &str, first: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(common::repo_path(doc)).unwrap();
    let start = text
        .find(&format!("```console\n$ {first}"))
        .unwrap_or_else(|| panic!("{doc} has no console block starting with `$ {first}`"));
    let block = &text[start + "```console\n".len()..];
    let block = &block[..block.find("```").unwrap()];
    let mut out: Vec<(String, String)> = Vec::new();
    for line in block.lines() {
        match line.strip_prefix("$ ") {
            Some(command) => out.push((command.to_owned(), String::new())),
            None => {
                let (_, output) = out.last_mut().unwrap();
                output.push_str(line);
                output.push('\n');
            }
        }
    }
    out
}

/// Runs `command` (a `ratelimitd …` line, split on spaces) in `dir`, with
/// `extra` arguments, and returns what it printed, stdout then stderr.
fn run(command: &str, dir: &Path, extra: &[&str]) -> String {
    let mut words = command.split_whitespace();
    assert_eq!(words.next(), Some("ratelimitd"), "{command}");
    let output = Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .args(words)
        .args(extra)
        .current_dir(dir)
        .env_clear()
        .output()
        .unwrap();
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// docs/rules.md: `rules validate` on the example rules (its version line)
/// and on a broken copy of them (`tests/fixtures/broken`).
#[test]
fn rules_validate_prints_what_rules_md_shows() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |from: &str, to: &str| {
        let to = dir.path().join(to);
        std::fs::create_dir_all(&to).unwrap();
        for entry in std::fs::read_dir(common::repo_path(from)).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    };
    copy("examples/rules", "examples/rules");
    copy("tests/fixtures/broken", "broken");
    let block = console_block("docs/rules.md", "ratelimitd rules validate examples/rules");
    assert_eq!(block.len(), 2);
    for (command, shown) in block {
        assert_eq!(run(&command, dir.path(), &[]), shown, "docs/rules.md: `{command}`");
    }
}

/// docs/dead-letters.md: `audit` over the file sink's records of a real
/// outage (`tests/fixtures/dlq.jsonl`).
#[test]
fn audit_prints_what_dead_letters_md_shows() {
    let block = console_block("docs/dead-letters.md", "ratelimitd audit --file dlq.jsonl");
    let (command, shown) = &block[0];
    let dir = common::repo_path("tests/fixtures");
    assert_eq!(run(command, &dir, &[]), *shown, "docs/dead-letters.md: `{command}`");
}

/// README's quick start: `check` against the service on embedded defaults
/// prints what the README shows, but for `reset_after_ms`, which depends
/// on when in the second it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_prints_what_the_readme_shows() {
    let server = TestServer::start(default_rules_config(None)).await;
    let block = console_block("README.md", "cargo run --release -q -- check");
    assert_eq!(block.len(), 1);
    let (command, shown) = &block[0];
    let command = command.replace("cargo run --release -q --", "ratelimitd");
    let addr = format!("http://{}", server.addr);
    let dir = tempfile::tempdir().unwrap();
    let printed = tokio::task::spawn_blocking({
        let dir = dir.path().to_path_buf();
        move || run(&command, &dir, &["--addr", &addr])
    })
    .await
    .unwrap();
    let mask = |text: &str| -> Vec<String> {
        text.lines()
            .map(|line| match line.strip_prefix("reset_after_ms") {
                Some(value) => {
                    let millis: u64 = value.trim().parse().unwrap();
                    assert!(millis <= 1_000 * 2, "{line}");
                    "reset_after_ms".to_owned()
                }
                None => line.to_owned(),
            })
            .collect()
    };
    assert_eq!(mask(&printed), mask(shown), "README's check output");
    server.stop().await.unwrap();
}

/// docs/observability.md: grpcurl lists the services of a server with
/// Envoy rules, as shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_lists_what_observability_md_shows() {
    let rules = Rules::new("rules:\n  - { rule_id: a, resource_path: /a, limit: 1, window_seconds: 1 }\n");
    let mut config = common::config(&rules.path(), None);
    config.rules.envoy_path = Some(common::repo_path("examples/envoy/ratelimit"));
    let server = TestServer::start(config).await;
    let block = console_block("docs/observability.md", "grpcurl -plaintext 127.0.0.1:8081 list");
    let (command, shown) = &block[0];
    let args: Vec<String> = command
        .split_whitespace()
        .skip(1)
        .map(|word| if word == "127.0.0.1:8081" { server.addr.to_string() } else { word.to_owned() })
        .collect();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(common::grpcurl_path()).args(&args).output().unwrap()
    })
    .await
    .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(String::from_utf8_lossy(&output.stdout), *shown, "docs/observability.md: `{command}`");
    server.stop().await.unwrap();
}

/// Every repository file the docs, the README, ARCHITECTURE.md and the
/// manifests name (a path in backticks, or a manifest's `-f` file) exists.
#[test]
fn every_file_the_docs_name_exists() {
    let mut texts = vec!["README.md".to_owned(), "ARCHITECTURE.md".to_owned()];
    for entry in std::fs::read_dir(common::repo_path("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            texts.push(format!("docs/{}", path.file_name().unwrap().to_string_lossy()));
        }
    }
    for entry in std::fs::read_dir(common::repo_path("deploy/kubernetes")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            texts.push(format!("deploy/kubernetes/{}", path.file_name().unwrap().to_string_lossy()));
        }
    }
    texts.extend(["Dockerfile", "docker-compose.yml", "deploy/alerts.yml"].map(str::to_owned));
    let roots = [
        "src/",
        "tests/",
        "docs/",
        "deploy/",
        "examples/",
        "scripts/",
        "loadtest/",
        "benches/",
        "migrations/",
        "proto/",
    ];
    let mut checked = 0;
    let mut missing = Vec::new();
    for doc in &texts {
        let text = std::fs::read_to_string(common::repo_path(doc)).unwrap();
        for candidate in text.split(['`', ' ', '(', ')', '"', '\'', '\n', ',', '[', ']']) {
            let candidate = candidate.trim_end_matches(['.', ':', ';']);
            if !roots.iter().any(|root| candidate.starts_with(root))
                || candidate.contains(['*', '<', '{', '$', '…'])
                || candidate.ends_with("::")
            {
                continue;
            }
            // `src/limiter/mod.rs::evaluate`, `docs/rules.md#anchor`: the file
            // (tests/docs.rs checks the anchors).
            let file = candidate.split("::").next().unwrap().split('#').next().unwrap();
            checked += 1;
            if !common::repo_path(file).exists() {
                missing.push(format!("{doc}: {file}"));
            }
        }
    }
    assert!(checked > 100, "only {checked} paths checked");
    assert!(missing.is_empty(), "files named but missing:\n{}", missing.join("\n"));
}
