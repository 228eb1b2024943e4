//! Tests of the Envoy format: loading, validation errors and lookups.

use std::{
    fs,
    path::{Path, PathBuf},
};

use super::{yaml::parse_file, *};
use crate::{limiter::window::MAX_CAPACITY_TIMES_WINDOW, rules::RuleErrors};

fn config(files: &[(&str, &str)]) -> Result<EnvoyConfig, RuleErrors> {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        fs::write(dir.path().join(name), text).unwrap();
    }
    load(dir.path(), Compile::SLIDING)
}

fn one_error(text: &str) -> String {
    let errors = config(&[("c.yaml", text)]).unwrap_err();
    assert_eq!(errors.0.len(), 1, "{errors}");
    errors.0[0].to_string()
}

/// The example of envoyproxy/ratelimit's README, unchanged.
const UPSTREAM: &str = r#"
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500

  - key: database
    value: default
    rate_limit:
      unit: second
      requests_per_unit: 500

  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10
    descriptors:
      - key: path
        value: "/foo*"
        rate_limit:
          unit: minute
          requests_per_unit: 2

  - key: client_id
    value: "*_bar*"
    rate_limit:
      requests_per_unit: 7
      unit: HOUR
    shadow_mode: true
    detailed_metric: true

  - key: free
    rate_limit:
      unlimited: true

  - key: named
    rate_limit:
      name: specific
      replaces:
        - name: general
      unit: week
      requests_per_unit: 100
    quota_mode: true
    value_to_metric: true
    metadata:
      team: search
"#;

fn entries<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
    pairs.iter().copied()
}

#[test]
fn loads_upstreams_format_and_looks_up_like_upstream() {
    let c = config(&[("mongo.yaml", UPSTREAM)]).unwrap();
    let key =
        |pairs: &[(&str, &str)]| c.lookup("mongo_cps", entries(pairs)).map(|m| m.limit.full_key.to_string());
    assert_eq!(key(&[("database", "users")]).as_deref(), Some("mongo_cps.database_users"));
    assert_eq!(key(&[("database", "other")]), None, "no default for database");
    // remote_address has a default (no value) limit; nested path wildcard.
    assert_eq!(key(&[("remote_address", "10.0.0.1")]).as_deref(), Some("mongo_cps.remote_address"));
    assert_eq!(
        key(&[("remote_address", "10.0.0.1"), ("path", "/foo/bar")]).as_deref(),
        Some("mongo_cps.remote_address.path_/foo*")
    );
    assert_eq!(
        key(&[("remote_address", "10.0.0.1"), ("path", "/baz")]),
        None,
        "the limit applies to the last entry only"
    );
    // A mid-value wildcard.
    assert_eq!(key(&[("client_id", "x_bar_y")]).as_deref(), Some("mongo_cps.client_id_*_bar*"));
    assert_eq!(key(&[("client_id", "bar")]), None);
    assert_eq!(key(&[("unknown", "x")]), None);
    assert!(c.lookup("other_domain", entries(&[("database", "users")])).is_none());

    let free = c.lookup("mongo_cps", entries(&[("free", "x")])).unwrap().limit;
    assert!(free.unlimited);
    let named = c.lookup("mongo_cps", entries(&[("named", "x")])).unwrap().limit;
    assert_eq!(
        (named.name.as_deref(), named.replaces.as_slice(), named.quota_mode),
        (Some("specific"), &["general".to_owned()][..], true)
    );
    assert_eq!(
        named.metadata.as_deref(),
        Some(&serde_json::json!({ "team": "search" }).as_object().unwrap().clone())
    );
    let shadow = c.lookup("mongo_cps", entries(&[("client_id", "a_bar")])).unwrap().limit;
    assert!(shadow.shadow_mode && shadow.detailed_metric);
    assert_eq!(shadow.unit, Some(Unit::Hour));
}

#[test]
fn wildcard_match_is_upstreams() {
    let parts = |p: &str| p.split('*').map(str::to_owned).collect::<Vec<_>>();
    assert!(wildcard_match(&parts("path_/foo*"), "path_/foo"));
    assert!(wildcard_match(&parts("path_/foo*"), "path_/foo/x"));
    assert!(!wildcard_match(&parts("path_/foo*"), "path_/fo"));
    assert!(wildcard_match(&parts("k_a*b*c"), "k_aXbYc"));
    assert!(wildcard_match(&parts("k_a*b*c"), "k_abc"));
    assert!(!wildcard_match(&parts("k_a*b*c"), "k_ac"));
    assert!(!wildcard_match(&parts("k_ab*ab"), "k_ab"), "fixed parts may not overlap");
}

#[test]
fn a_limit_may_name_its_algorithm() {
    let c = config(&[(
            "e.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: minute, requests_per_unit: 5, algorithm: gcra }\n  - key: b\n    rate_limit: { unit: minute, requests_per_unit: 5 }\n",
        )])
        .unwrap();
    let algorithm = |key: &str| c.lookup("d", [(key, "x")]).unwrap().limit.algorithm;
    assert_eq!(algorithm("a"), Some(Algorithm::Gcra));
    assert_eq!(algorithm("b"), None, "unset: envoy.algorithm decides");
}

#[test]
fn a_global_limit_may_adapt() {
    let c = config(&[(
            "e.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 9, global: true, adaptive: { min: 1, max: 20 } }\n",
        )])
        .unwrap();
    let found = c.lookup("d", [("a", "x")]).unwrap();
    assert!(found.limit.global);
    assert_eq!(
        found.limit.adaptive.as_deref().map(|a| (a.params.min, a.params.max, a.current())),
        Some((1, 20, 9))
    );
}

#[test]
fn every_upstream_error() {
    let cases = [
        ("descriptors:\n  - key: a\n", "config file cannot have empty domain"),
        ("domain: d\ndescriptors:\n  - value: v\n", "descriptor has empty key"),
        ("domain: d\ndescriptors:\n  - key: a\n  - key: a\n", "duplicate descriptor composite key 'd.a'"),
        (
            "domain: d\ndescriptors:\n  - key: a\n    value: b\n  - key: a\n    value: b\n",
            "duplicate descriptor composite key 'd.a_b'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n",
            "invalid rate limit unit 'fortnight'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { requests_per_unit: 1 }\n",
            "invalid rate limit unit ''",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 1, algorithm: leaky }\n",
            "unknown algorithm \"leaky\" (one of sliding_window, fixed_window, token_bucket, gcra, first_hit_window, concurrency)",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unlimited: true, unit: second }\n",
            "should not specify rate limit unit when unlimited",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unlimited: true, unit_multiplier: 2 }\n",
            "should not specify a unit_multiplier when unlimited",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    also: [ { unit: minute, requests_per_unit: 5 } ]\n",
            "needs a rate_limit beside it",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unlimited: true }\n    also: [ { unit: minute, requests_per_unit: 5 } ]\n",
            "needs a limited rate_limit beside it",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 1 }\n    also: [ { unlimited: true } ]\n",
            "an also limit is a limit",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 1 }\n    also: [ { name: x, unit: minute, requests_per_unit: 5 } ]\n",
            "an also limit has no name",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unlimited: true, adaptive: { min: 1, max: 2 } }\n",
            "should not specify adaptive when unlimited",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 9, adaptive: { min: 10, max: 20 } }\n",
            "an adaptive limit starts at `requests_per_unit`: it must be between adaptive.min (10) and adaptive.max (20)",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 9, adaptive: { min: 1, max: 5000000000 } }\n",
            "must be at most 4294967295",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 1 }\n    also: [ { unit: minute, requests_per_unit: 5, adaptive: { min: 1, max: 9 } } ]\n",
            "an also limit is fixed",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 1, unit_multiplier: 0 }\n",
            "must be at least 1",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unlimited: true, global: true }\n",
            "should not specify global when unlimited",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 1 }\n    also: [ { unit: minute, requests_per_unit: 5, global: true } ]\n",
            "an also limit is this region's own",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: day, requests_per_unit: 1, unit_multiplier: 366 }\n",
            "a window of 366 × Day is longer than a year (31536000 s)",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 1, replaces: [ {} ] }\n",
            "should not have an empty replaces entry",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { name: x, unit: second, requests_per_unit: 1, replaces: [ { name: x } ] }\n",
            "replaces should not contain name of same descriptor",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    share_threshold: true\n",
            "share_threshold can only be used with wildcard values",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 1, burst: 2 }\n",
            "unknown field `burst`",
        ),
        ("domain: d\nlimits: []\n", "unknown field `limits`"),
        (
            "domain: d\ndescriptors:\n  - key: a\n    metadata: [1]\n    rate_limit: { unit: second, requests_per_unit: 1 }\n",
            "field `metadata`: must be a mapping",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    metadata: { x: { 1: y } }\n    rate_limit: { unit: second, requests_per_unit: 1 }\n",
            "field `metadata`: x: keys must be strings",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: -1 }\n",
            "expected u32",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: minute, requests_per_unit: 1, algorithm: concurrency }\n    also: [ { unit: hour, requests_per_unit: 5 } ]\n",
            "field `also`: a limit of requests in flight",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    report_mode: true\n    rate_limit: { unit: minute, requests_per_unit: 1, algorithm: concurrency }\n",
            "field `report_mode`: a limit of requests in flight",
        ),
    ];
    for (text, expected) in cases {
        let err = one_error(text);
        assert!(err.starts_with(std::env::temp_dir().to_str().unwrap()) || err.contains("c.yaml"), "{err}");
        assert!(err.contains(expected), "{expected:?} not in {err}");
    }
    // The error says where in the document.
    let nested = one_error(
        "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit: { unit: eon }\n",
    );
    assert!(nested.contains("descriptors[0].descriptors[0].rate_limit"), "{nested}");
}

#[test]
fn merge_domains_joins_a_domain_spread_over_files() {
    let files = |b: &str| {
        vec![
                (PathBuf::from("a.yaml"), "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 5 }\n".to_owned()),
                (PathBuf::from("b.yaml"), format!("domain: d\ndescriptors:\n  - key: {b}\n    rate_limit: {{ unit: second, requests_per_unit: 1 }}\n")),
            ]
    };
    let merged = Compile { sliding: true, merge_domains: true };
    let c = compile_texts(&files("path"), merged).unwrap();
    assert_eq!(c.domain_count(), 1);
    assert_eq!(c.lookup("d", entries(&[("user", "u")])).unwrap().limit.requests_per_unit, 5);
    assert_eq!(c.lookup("d", entries(&[("path", "/")])).unwrap().limit.requests_per_unit, 1);
    let twice = compile_texts(&files("user"), merged).unwrap_err().to_string();
    assert!(twice.contains("b.yaml") && twice.contains("'d.user'"), "{twice}");
    let off = compile_texts(&files("path"), Compile::SLIDING).unwrap_err().to_string();
    assert!(off.contains("duplicate domain 'd'"), "{off}");
    assert_ne!(
        compile_texts(&files("path")[..1], merged).unwrap().version(),
        compile_texts(&files("path")[..1], Compile::SLIDING).unwrap().version(),
        "the version says how it was compiled"
    );
}

/// The stat key of `pairs` in `text`'s domain `d`: `None` when it is the full key.
fn stat_key(text: &str, pairs: &[(&str, &str)]) -> Option<String> {
    let c = config(&[("c.yaml", text)]).unwrap();
    c.lookup("d", entries(pairs)).expect("a limit").stat_key.map(String::from)
}

#[test]
fn metric_keys_follow_value_to_metric_and_detailed_metric_as_upstream() {
    // Expectations from envoyproxy/ratelimit's config_test.go.
    let defaults = "domain: d\ndescriptors:\n  - key: route\n    value_to_metric: true\n    descriptors:\n      - key: http_method\n        value_to_metric: true\n        descriptors:\n          - key: subject_id\n            rate_limit: { unit: minute, requests_per_unit: 60 }\n";
    assert_eq!(
        stat_key(defaults, &[("route", "draw"), ("http_method", "GET"), ("subject_id", "123")]).as_deref(),
        Some("d.route_draw.http_method_GET.subject_id")
    );
    let wildcard = "domain: d\ndescriptors:\n  - key: user\n    value_to_metric: true\n    descriptors:\n      - key: action\n        value: \"read*\"\n        value_to_metric: true\n        descriptors:\n          - key: resource\n            rate_limit: { unit: minute, requests_per_unit: 100 }\n";
    assert_eq!(
        stat_key(wildcard, &[("user", "alice"), ("action", "readfile"), ("resource", "documents")])
            .as_deref(),
        Some("d.user_alice.action_readfile.resource")
    );
    // A wildcard without the flag keeps its pattern: the full key.
    let plain = "domain: d\ndescriptors:\n  - key: user\n    value_to_metric: true\n    descriptors:\n      - key: action\n        value: \"read*\"\n        rate_limit: { unit: minute, requests_per_unit: 100 }\n";
    assert_eq!(
        stat_key(plain, &[("user", "bob"), ("action", "readx")]).as_deref(),
        Some("d.user_bob.action_read*")
    );
    let detailed = "domain: d\ndescriptors:\n  - key: user\n    detailed_metric: true\n    rate_limit: { unit: minute, requests_per_unit: 5 }\n  - key: files\n    value: \"files/*\"\n    share_threshold: true\n    descriptors:\n      - key: user\n        detailed_metric: true\n        rate_limit: { unit: minute, requests_per_unit: 5 }\n";
    assert_eq!(stat_key(detailed, &[("user", "alice")]).as_deref(), Some("d.user_alice"));
    // Detailed, but a shared entry stays its pattern.
    assert_eq!(
        stat_key(detailed, &[("files", "files/a"), ("user", "bob")]).as_deref(),
        Some("d.files_files/*.user_bob")
    );
    // No flag anywhere: nothing is built.
    let none =
        "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 5 }\n";
    assert_eq!(stat_key(none, &[("user", "alice")]), None);
}

#[test]
fn share_threshold_reports_the_pattern_of_each_shared_entry() {
    let c = config(&[(
            "c.yaml",
            "domain: d\ndescriptors:\n  - key: files\n    value: \"files/*\"\n    share_threshold: true\n    rate_limit: { unit: minute, requests_per_unit: 5 }\n  - key: own\n    value: \"o/*\"\n    rate_limit: { unit: minute, requests_per_unit: 5 }\n  - key: user\n    value: \"u*\"\n    share_threshold: true\n    descriptors:\n      - key: path\n        rate_limit: { unit: second, requests_per_unit: 1 }\n",
        )])
        .unwrap();
    let a = c.lookup("d", entries(&[("files", "files/a.pdf")])).unwrap();
    let b = c.lookup("d", entries(&[("files", "files/b.csv")])).unwrap();
    assert_eq!(a.shared, vec![(0, Arc::from("files/*"))]);
    assert_eq!(a, b, "both values match the same limit and the same shared pattern");
    assert!(c.lookup("d", entries(&[("own", "o/x")])).unwrap().shared.is_empty(), "no share_threshold");
    let nested = c.lookup("d", entries(&[("user", "u1"), ("path", "/x")])).unwrap();
    assert_eq!(nested.shared, vec![(0, Arc::from("u*"))], "a shared entry above the limit counts too");
}

#[test]
fn duplicate_domain_across_files_names_both() {
    let errors = config(&[("a.yaml", "domain: d\n"), ("b.yaml", "domain: d\n")]).unwrap_err();
    let text = errors.to_string();
    assert!(
        text.contains("b.yaml") && text.contains("duplicate domain 'd'") && text.contains("a.yaml"),
        "{text}"
    );
}

#[test]
fn scalars_and_empty_lists_are_lenient_like_upstream() {
    let c = config(&[("c.yaml", "domain: d\ndescriptors:\n  - key: code\n    value: 429\n    rate_limit: { unit: SECOND, requests_per_unit: 1 }\n    descriptors:\n")]).unwrap();
    assert!(c.lookup("d", entries(&[("code", "429")])).is_some());
}

#[test]
fn units_and_ticks_keep_every_u32_exact() {
    for unit in [Unit::Second, Unit::Minute, Unit::Hour, Unit::Day, Unit::Week, Unit::Month, Unit::Year] {
        let w = unit.params(u32::MAX, Algorithm::SlidingWindow);
        assert!(w.capacity * w.window_ms <= MAX_CAPACITY_TIMES_WINDOW, "{unit:?}");
        assert_eq!(w.window_ms * unit.tick_ms(), unit.seconds() * 1_000);
    }
}

mod properties {
    //! Property tests: any file text in envoyproxy/ratelimit's format
    //! either loads or fails with an error naming the file; never a panic.
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1_000, ..ProptestConfig::default() })]

        #[test]
        fn any_text_parses_or_names_the_file(text in "(?s).{0,300}") {
            if let Err(e) = parse_file(Path::new("e.yaml"), &text) {
                prop_assert!(e.to_string().starts_with("e.yaml"), "{e}");
            }
        }

        #[test]
        fn any_descriptor_values_load_or_name_the_file(
            key in "[a-z_]{0,8}",
            value in proptest::option::of("[a-z0-9]{0,6}"),
            unit in "(second|minute|hour|day|week|month|year|fortnight|)",
            requests in any::<i64>(),
            shadow in any::<bool>(),
            nested in any::<bool>(),
        ) {
            let value = value.map_or(String::new(), |v| format!("\n    value: {v}"));
            let inner = if nested {
                format!("\n    descriptors:\n      - key: {key}\n        rate_limit: {{unit: {unit}, requests_per_unit: {requests}}}")
            } else {
                String::new()
            };
            let text = format!(
                "domain: d\ndescriptors:\n  - key: {key}{value}\n    shadow_mode: {shadow}\n    rate_limit:\n      unit: {unit}\n      requests_per_unit: {requests}{inner}\n"
            );
            if let Err(e) = parse_file(Path::new("e.yaml"), &text) {
                prop_assert!(e.to_string().starts_with("e.yaml"), "{e}");
            }
        }
    }
}

#[test]
fn unit_multiplier_makes_a_window_of_any_length() {
    let c = compile_texts(
            &[(
                PathBuf::from("m.yaml"),
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, unit_multiplier: 90, requests_per_unit: 30 }\n  - key: b\n    rate_limit: { unit: minute, requests_per_unit: 5 }\n".to_owned(),
            )],
            Compile::FIXED,
        )
        .unwrap();
    let a = c.lookup("d", [("a", "x")]).unwrap().limit;
    assert_eq!((a.window_seconds(), a.unit, a.unit_multiplier), (Some(90), Some(Unit::Second), 90));
    assert_eq!(c.lookup("d", [("b", "x")]).unwrap().limit.window_seconds(), Some(60));
    // 90 s counts in whole seconds; every existing unit keeps its tick.
    assert_eq!((tick_ms(90), params(90, 30, Algorithm::SlidingWindow).window_ms), (1_000, 90));
    for unit in [Unit::Second, Unit::Minute, Unit::Hour, Unit::Day, Unit::Week, Unit::Month, Unit::Year] {
        let expected = match unit {
            Unit::Second | Unit::Minute => 1,
            Unit::Hour | Unit::Day => 1_000,
            Unit::Week | Unit::Month => 60_000,
            Unit::Year => 3_600_000,
        };
        assert_eq!(unit.tick_ms(), expected, "{unit:?}");
    }
}

#[test]
fn also_limits_sit_beside_the_rate_limit() {
    let c = compile_texts(
            &[(
                PathBuf::from("a.yaml"),
                "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: true\n    rate_limit: { name: n, unit: second, requests_per_unit: 10 }\n    also:\n      - { unit: minute, requests_per_unit: 30, algorithm: gcra }\n      - { unit: day, unit_multiplier: 2, requests_per_unit: 500 }\n".to_owned(),
            )],
            Compile::FIXED,
        )
        .unwrap();
    let limit = c.lookup("d", [("a", "x")]).unwrap().limit;
    assert_eq!(limit.also.len(), 2);
    let (minute, days) = (limit.limit_at(1), limit.limit_at(2));
    assert_eq!(
        (minute.requests_per_unit, minute.unit, minute.algorithm),
        (30, Some(Unit::Minute), Some(Algorithm::Gcra))
    );
    assert_eq!(
        (days.window_seconds(), days.full_key.as_ref(), days.shadow_mode),
        (Some(172_800), "d.a", true)
    );
    assert_eq!((days.name.as_deref(), limit.limit_at(0).name.as_deref()), (None, Some("n")));
    assert_eq!(c.limits().len(), 1, "also limits are the descriptor's, not limits of their own");
    let bad = compile_texts(
            &[(
                PathBuf::from("b.yaml"),
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 1 }\n    also: [ { unit: eon, requests_per_unit: 5 } ]\n".to_owned(),
            )],
            Compile::FIXED,
        )
        .unwrap_err()
        .to_string();
    assert!(bad.contains("descriptors[0].also[0]") && bad.contains("invalid rate limit unit 'eon'"), "{bad}");
}
