//! The limits file's semantics, as limitador's documentation states them.

use super::*;

/// limitador's own example: a limit for the whole namespace, and one per
/// user for POSTs.
const EXAMPLE: &str = r#"
---
- namespace: test_namespace
  max_value: 1000000
  seconds: 60
  conditions:
  variables:
- namespace: test_namespace
  max_value: 5
  seconds: 60
  conditions:
    - "descriptors[0]['req.method'] == 'POST'"
  variables:
    - descriptors[0]['user_id']
"#;

/// Compiles `text` with limitador's counting.
fn parse(file: &Path, text: &str) -> Result<Limits, RuleError> {
    Limits::parse(file, text, Algorithm::FirstHitWindow)
}

fn applied<'a>(
    limits: &'a Limits,
    namespace: &str,
    descriptors: &[Vec<(&str, &str)>],
) -> Vec<(u64, Vec<String>)> {
    limits
        .applying(namespace, descriptors)
        .unwrap()
        .into_iter()
        .map(|a: Applied<'a>| (a.limit.max_value, a.values))
        .collect()
}

#[test]
fn every_limit_whose_conditions_hold_and_variables_resolve_applies() {
    let limits = parse(Path::new("limits.yaml"), EXAMPLE).unwrap();
    let post = vec![("req.method", "POST"), ("user_id", "ann")];
    assert_eq!(
        applied(&limits, "test_namespace", &[post]),
        [(1_000_000, vec![]), (5, vec!["ann".to_owned()])]
    );
    let get = vec![("req.method", "GET"), ("user_id", "ann")];
    assert_eq!(applied(&limits, "test_namespace", &[get]), [(1_000_000, vec![])]);
    // A key the descriptors lack: the limit does not apply (NoSuchKey).
    let anonymous = vec![("req.method", "POST")];
    assert_eq!(applied(&limits, "test_namespace", &[anonymous]), [(1_000_000, vec![])]);
    assert!(applied(&limits, "other", &[vec![("req.method", "POST")]]).is_empty());
}

/// Every limit counts by the algorithm given (`rules.limitador_algorithm`),
/// in each of its modes.
#[test]
fn limits_count_by_the_algorithm_given() {
    for algorithm in [Algorithm::FirstHitWindow, Algorithm::SlidingWindow] {
        let limits = Limits::parse(Path::new("limits.yaml"), EXAMPLE, algorithm).unwrap();
        for limit in limits.of("test_namespace") {
            let modes = [&limit.envoy, &limit.envoy_peek, &limit.envoy_report].map(|l| l.algorithm);
            assert_eq!(modes, [Some(algorithm); 3]);
        }
    }
}

#[test]
fn any_descriptor_and_the_limit_itself_can_be_referred_to() {
    let limits = parse(
        Path::new("limits.yaml"),
        r#"
- namespace: ns
  name: per-plan
  max_value: 3
  seconds: 10
  conditions: ["descriptors[1].plan == 'free'", "limit.name == 'per-plan'"]
  variables: ["descriptors[0].user", "descriptors[1].plan"]
"#,
    )
    .unwrap();
    let request = [vec![("user", "bob")], vec![("plan", "free")]];
    assert_eq!(applied(&limits, "ns", &request), [(3, vec!["bob".to_owned(), "free".to_owned()])]);
    let paid = [vec![("user", "bob")], vec![("plan", "paid")]];
    assert!(applied(&limits, "ns", &paid).is_empty());
}

#[test]
fn an_evaluation_error_is_an_error_not_no_limit() {
    let limits = parse(
        Path::new("limits.yaml"),
        "- { namespace: ns, max_value: 1, seconds: 1, conditions: [\"descriptors[0].n\"] }\n\
         - { namespace: other, max_value: 1, seconds: 1, variables: [\"descriptors[0]\"] }\n",
    )
    .unwrap();
    let error = limits.applying("ns", &[vec![("n", "1")]]).unwrap_err();
    assert!(error.message.contains("boolean") && &*error.expression == "descriptors[0].n", "{error}");
    let error = limits.applying("other", &[vec![("n", "1")]]).unwrap_err();
    assert!(error.message.contains("scalar"), "{error}");
}

#[test]
fn bad_limits_are_refused_naming_file_limit_and_field() {
    let refused = |text: &str| parse(Path::new("limits.yaml"), text).unwrap_err().to_string();
    let error = refused("- { namespace: ns, max_value: 1, seconds: 1, condition: [\"true\"] }\n");
    assert!(error.contains("limits.yaml") && error.contains("condition"), "{error}");
    let error = refused("- { namespace: ns, max_value: 1, seconds: 0 }\n");
    assert!(error.contains("limits[0]") && error.contains("seconds"), "{error}");
    let error = refused(
        "- { namespace: ns, max_value: 1, seconds: 1 }\n- { namespace: ns, max_value: 1, seconds: 1, conditions: [\"descriptors[0].a ==\"] }\n",
    );
    assert!(error.contains("limits[1]") && error.contains("conditions[0]"), "{error}");
    let error = refused("- { namespace: ns, max_value: 4294967296, seconds: 1 }\n");
    assert!(error.contains("max_value"), "{error}");
    let error = refused("- { namespace: ns, max_value: 1, seconds: 31536001 }\n");
    assert!(error.contains("seconds") && error.contains("a year"), "{error}");
    let error = refused("- { namespace: '', max_value: 1, seconds: 1 }\n");
    assert!(error.contains("namespace"), "{error}");
    let long =
        format!("- {{ namespace: ns, max_value: 1, seconds: 1, variables: [\"{}\"] }}\n", "a".repeat(2000));
    assert!(refused(&long).contains("variables[0]"));
    let error = refused(
        "- { namespace: ns, max_value: 1, seconds: 60, variables: [\"descriptors[0].a\", \"descriptors[0].b\"] }\n\
         - { namespace: ns, max_value: 9, seconds: 60, variables: [\"descriptors[0].b\", \"descriptors[0].a\"] }\n",
    );
    assert!(error.contains("limits[1]") && error.contains("as limits[0]"), "{error}");
    let nested = "- { namespace: ns, max_value: 1, seconds: 1, conditions: [\"descriptors.all(d, descriptors.all(e, \
                  descriptors.exists(f, f == d)))\"] }\n";
    let error = refused(nested);
    assert!(error.contains("conditions[0]") && error.contains("nested 3 deep"), "{error}");
    let two = "- { namespace: ns, max_value: 1, seconds: 1, conditions: [\"descriptors.all(d, \
               descriptors.exists(e, true)) && descriptors.map(d, 1).size() > 0\"] }\n";
    parse(Path::new("limits.yaml"), two).unwrap();
    assert!(parse(Path::new("limits.yaml"), "").unwrap().namespaces().next().is_none());
    assert!(parse(Path::new("limits.yaml"), "---\n").unwrap().namespaces().next().is_none());
}

#[test]
fn a_limits_identity_is_its_counter_not_its_value() {
    let identity = |text: &str| Arc::clone(&parse(Path::new("f"), text).unwrap().of("ns")[0].identity);
    let base = identity(
        "- { namespace: ns, max_value: 5, seconds: 60, variables: [\"descriptors[0].a\", \"descriptors[0].b\"] }",
    );
    let raised = identity(
        "- { namespace: ns, max_value: 50, name: x, seconds: 60, variables: [\"descriptors[0].b\", \"descriptors[0].a\"] }",
    );
    assert_eq!(base, raised, "max_value, name and variable order keep the counter");
    let longer = identity(
        "- { namespace: ns, max_value: 5, seconds: 61, variables: [\"descriptors[0].a\", \"descriptors[0].b\"] }",
    );
    assert_ne!(base, longer);
}

#[test]
fn a_descriptor_the_request_lacks_is_an_error() {
    let limits = parse(
        Path::new("f"),
        "- { namespace: ns, max_value: 1, seconds: 1, variables: [\"descriptors[1].a\"] }",
    )
    .unwrap();
    let result = limits.applying("ns", &[vec![("a", "1")]]);
    assert!(result.is_err(), "{result:?}");
}

/// What limitador-server would panic on, or never apply, is refused at
/// load naming file, limit and field: a comprehension's variable (taken
/// there for an unbound reference), a name it does not bind, a struct
/// literal, a comprehension over a value that may be a string.
#[test]
fn what_limitador_never_applies_or_cannot_evaluate_is_refused_at_load() {
    let refused = |field: &str, source: &str| {
        let text = format!("- {{ namespace: ns, max_value: 1, seconds: 1, {field}: [{source:?}] }}\n");
        parse(Path::new("limits.yaml"), &text).unwrap_err().to_string()
    };
    for (field, source, why) in [
        ("conditions", "descriptors[0].exists(k, k == 'user')", "comprehension's variable"),
        ("conditions", "descriptors.exists(d, d.user == 'ann')", "comprehension's variable"),
        ("conditions", "descriptors.filter(d, true).size() == 1", "comprehension's variable"),
        ("variables", "descriptors.map(d, d.user)[0]", "comprehension's variable"),
        ("conditions", "Foo{a: 1} == Foo{a: 1}", "struct literal"),
        ("conditions", "descriptors[0].user.exists(c, true)", "string or a scalar"),
        ("conditions", "'abc'.all(c, true)", "string or a scalar"),
        ("conditions", "user == 'ann'", "`user` is not bound"),
        ("variables", "limit.name", "`limit` is not bound"),
    ] {
        let error = refused(field, source);
        assert!(
            error.contains("limits.yaml")
                && error.contains("limits[0]")
                && error.contains(&format!("{field}[0]")),
            "{source}: {error}"
        );
        assert!(error.contains(why), "{source}: {error}");
    }
    // What limitador evaluates is kept: comprehensions that read only the
    // request, `has()`, `in`, the limit's own name in a condition.
    for source in [
        "descriptors.exists(d, true)",
        "[1, 2].all(x, true)",
        "descriptors.map(d, 1).size() == 1",
        "has(descriptors[0].user)",
        "'user' in descriptors[0]",
        "limit.name == 'x'",
    ] {
        let text = format!("- {{ namespace: ns, max_value: 1, seconds: 1, conditions: [{source:?}] }}\n");
        parse(Path::new("limits.yaml"), &text).unwrap_or_else(|e| panic!("{source}: {e}"));
    }
}

/// An expression that panics the interpreter (one the load refuses,
/// compiled here past it) is an error of the request, not a panic.
#[test]
fn an_interpreter_panic_is_an_evaluation_error() {
    let program = cel::Program::compile("Foo{a: 1} == Foo{a: 1}").unwrap();
    let expression = Expression { source: Arc::from("Foo{a: 1} == Foo{a: 1}"), program, fast: None };
    let root = context(&[vec![("user", "ann")]]);
    assert!(interpret(&expression, &root).is_err());
}

/// Compiled limits are shared by every worker (a snapshot).
#[test]
fn limits_are_shareable() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Limits>();
}
