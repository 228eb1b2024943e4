//! The compose stack, the image and the Kubernetes manifests cannot be
//! started on these machines, so their files are checked against the
//! service itself: every `RATELIMITD__*` variable is a configuration key with
//! a valid value, every port and path exists, the HEALTHCHECK runs a real
//! subcommand, the manifests validate against Kubernetes' schemas (vendored
//! in `deploy/kubernetes/schemas`) and agree with each other, and the
//! Grafana dashboard is valid JSON with a panel for every metric family the
//! service exports.

mod common;

use std::{collections::HashMap, path::Path, process::Command, sync::Arc};

use common::{TestServer, default_rules_config, http_get};
use ratelimitd::config::Config;
use yaml_serde::Value;

fn repo(path: &str) -> std::path::PathBuf {
    common::repo_path(path)
}

fn compose() -> Value {
    yaml_serde::from_str(&std::fs::read_to_string(repo("docker-compose.yml")).unwrap()).unwrap()
}

fn dockerfile() -> String {
    std::fs::read_to_string(repo("Dockerfile")).unwrap()
}

/// The environment of a compose service, as strings.
fn environment(service: &Value) -> HashMap<String, String> {
    service["environment"]
        .as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let value = match v {
                        Value::String(s) => s.clone(),
                        Value::Number(n) => n.to_string(),
                        Value::Bool(b) => b.to_string(),
                        other => panic!("unexpected value {other:?}"),
                    };
                    (k.as_str().unwrap().to_owned(), value)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `/etc/ratelimitd/examples/…` in the image is `examples/…` in the repository
/// (the Dockerfile's `COPY examples /etc/ratelimitd/examples`).
fn image_path_to_repo(path: &str) -> std::path::PathBuf {
    assert!(dockerfile().contains("COPY examples /etc/ratelimitd/examples"));
    let rest = path
        .strip_prefix("/etc/ratelimitd/examples/")
        .unwrap_or_else(|| panic!("{path} is not under the copied examples"));
    repo(&format!("examples/{rest}"))
}

#[test]
fn compose_environment_is_real_configuration() {
    let compose = compose();
    let services = compose["services"].as_mapping().unwrap();
    let mut checked = 0;
    for (name, service) in services {
        let env: HashMap<String, String> = environment(service)
            .into_iter()
            .filter(|(k, _)| k.starts_with("RATELIMITD__"))
            // A build without Kafka refuses the compose file's dead-letter
            // topic (tested in config); the rest is checked all the same.
            .filter(|(k, _)| cfg!(feature = "kafka") || !k.starts_with("RATELIMITD__DLQ__KAFKA__"))
            .collect();
        if env.is_empty() {
            continue;
        }
        checked += env.len();
        // Unknown keys and bad values are rejected by the service's own loader.
        let config = Config::load(None, env.clone()).unwrap_or_else(|e| panic!("service {name:?}: {e}"));
        if let Some(path) = env.get("RATELIMITD__RULES__PATH") {
            assert_eq!(config.rules.path.as_deref(), Some(Path::new(path)));
            ratelimitd::rules::load(&image_path_to_repo(path), Default::default())
                .unwrap_or_else(|e| panic!("{path}: {e}"));
        }
        if let Some(path) = env.get("RATELIMITD__RULES__ENVOY_PATH") {
            ratelimitd::rules::envoy::load_sliding(&image_path_to_repo(path))
                .unwrap_or_else(|e| panic!("{path}: {e}"));
        }
        if let Some(endpoint) = &config.telemetry.otlp_endpoint {
            let collector = std::fs::read_to_string(repo("deploy/otel-collector.yaml")).unwrap();
            let port = endpoint.rsplit(':').next().unwrap();
            assert!(
                collector.contains(&format!("0.0.0.0:{port}")),
                "the collector does not listen on {port}"
            );
            assert!(endpoint.contains("otel-collector"), "{endpoint}");
        }
        if let Some(brokers) = &config.dlq.kafka.brokers {
            assert_eq!(brokers, "kafka:9092");
            let kafka = environment(&services[&Value::from("kafka")]);
            assert!(kafka["KAFKA_ADVERTISED_LISTENERS"].contains("kafka:9092"));
        }
        if let Some(url) = &config.redis.connection.url {
            assert!(
                services.contains_key(Value::from("redis")) && url.starts_with("redis://redis:"),
                "{url}"
            );
        }
    }
    assert!(checked >= 10, "only {checked} variables checked");
}

#[test]
fn compose_ports_and_files_exist() {
    let compose = compose();
    let services = compose["services"].as_mapping().unwrap();
    let defaults = Config::default();
    let grpc_port = defaults.grpc_addr().port();
    let http_port = defaults.http_addr().port();
    let ports: Vec<String> = services[&Value::from("ratelimitd")]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_owned())
        .collect();
    assert!(ports.contains(&format!("{grpc_port}:{grpc_port}")), "{ports:?}");
    assert!(ports.contains(&format!("{http_port}:{http_port}")), "{ports:?}");
    let prometheus = std::fs::read_to_string(repo("deploy/prometheus.yml")).unwrap();
    assert!(prometheus.contains(&format!("ratelimitd:{http_port}")), "Prometheus scrapes another port");
    // The alert rules it loads parse, and the staleness alert reads the metric the service serves.
    assert!(prometheus.contains("/etc/prometheus/alerts.yml"), "{prometheus}");
    let alerts: Value =
        yaml_serde::from_str(&std::fs::read_to_string(repo("deploy/alerts.yml")).unwrap()).unwrap();
    let rules = alerts["groups"][0]["rules"].as_sequence().unwrap();
    assert!(
        rules.iter().any(|r| r["expr"]
            .as_str()
            .unwrap()
            .contains("ratelimitd_overload_directive_age_seconds")
            && r["expr"].as_str().unwrap().contains("> 60")),
        "{rules:?}"
    );
    // Every bind mount of the repository exists.
    for service in services.values() {
        for volume in service["volumes"].as_sequence().into_iter().flatten() {
            let volume = volume.as_str().unwrap();
            if let Some(source) = volume.strip_prefix("./") {
                let source = source.split(':').next().unwrap();
                assert!(repo(source).exists(), "{volume}: {source} missing");
            }
        }
    }
}

#[test]
fn dockerfile_matches_the_service() {
    let dockerfile = dockerfile();
    let defaults = Config::default();
    assert!(dockerfile.contains(&format!(
        "EXPOSE {} {}",
        defaults.grpc_addr().port(),
        defaults.http_addr().port()
    )));
    // ENV keys are configuration keys with valid values.
    let env_block = dockerfile.split("ENV ").nth(1).unwrap().split("\nUSER").next().unwrap();
    let env: HashMap<String, String> = env_block
        .split_whitespace()
        .filter(|t| *t != "\\")
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect();
    assert!(env.len() >= 2);
    // The image serves no example rule: `serve` on its environment alone
    // refuses to start and names the keys to set; given rules it loads
    // them, and in compat mode upstream's runtime directory.
    assert!(!env.contains_key("RATELIMITD__RULES__PATH"), "no rules in force in the image");
    let config = Config::load(None, env.clone()).unwrap();
    assert!(!config.rules.examples);
    let state = tempfile::tempdir().unwrap();
    let refused = Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .arg("serve")
        .env_clear()
        .envs(&env)
        .env("RATELIMITD__GRPC__LISTEN", "127.0.0.1:0")
        .env("RATELIMITD__HTTP__LISTEN", "127.0.0.1:0")
        .env("RATELIMITD__DLQ__FILE", state.path().join("dlq.jsonl"))
        .env("RATELIMITD__DLQ__SPOOL_DIR", state.path().join("spool"))
        .env("RATELIMITD__LOCAL__STATE_DIR", state.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "served on the image's environment alone: {stderr}");
    assert!(stderr.contains("rules.path: unset") && stderr.contains("rules.envoy_path"), "{stderr}");
    let with = |pairs: &[(&str, &str)]| {
        let mut env = env.clone();
        env.extend(pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        Config::load(None, env)
    };
    let compat = with(&[("RATELIMITD_COMPAT", "envoyproxy")]).unwrap();
    assert_eq!(compat.rules.path, None, "no native rules");
    assert!(compat.rules.envoy_path.is_some(), "upstream's runtime directory");
    // Whatever user runs the image (Envoy Gateway: 65534, whose home is
    // not this one), its state goes to the data directory.
    assert!(
        config.dlq.file.starts_with("/var/lib/ratelimitd")
            && config.dlq.spool_dir.starts_with("/var/lib/ratelimitd")
            && config.local.state_dir.starts_with("/var/lib/ratelimitd"),
        "{:?} {:?} {:?}",
        config.dlq.file,
        config.dlq.spool_dir,
        config.local.state_dir
    );
    assert!(dockerfile.contains("--home-dir /var/lib/ratelimitd"), "the data directory is the user's home");
    assert!(dockerfile.contains("USER ratelimitd"), "not root");
    // The HEALTHCHECK runs the binary's own probe against http.listen.
    let probe = format!("127.0.0.1:{}", defaults.http_addr().port());
    assert!(
        dockerfile
            .contains(&format!(r#"CMD ["ratelimitd", "probe", "--addr", "{probe}", "--path", "/healthz"]"#))
    );
    let help = Command::new(env!("CARGO_BIN_EXE_ratelimitd")).args(["probe", "--help"]).output().unwrap();
    assert!(help.status.success());
}

/// The metric families `/metrics` serves, on the embedded example rules,
/// in a region sharing global limits (so their families are there too).
async fn metric_families() -> Vec<String> {
    let coordination = common::RedisServer::start();
    let mut config = default_rules_config(None);
    config.region = Some("eu".to_owned());
    config.global.regions = vec![ratelimitd::global::RegionConfig { name: "eu".to_owned(), floor: 0.1 }];
    config.global.redis.url = Some(coordination.url());
    let server = TestServer::start(config).await;
    let addr = server.http_addr;
    let (_, scrape) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics")).await.unwrap();
    server.stop().await.unwrap();
    scrape
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap().to_owned())
        .collect()
}

/// The probe subcommand the HEALTHCHECK uses works against a real server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_reports_health() {
    // The embedded example rules.
    let server = TestServer::start(default_rules_config(None)).await;
    let addr = server.http_addr.to_string();
    let probe = |path: &str| {
        Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
            .args(["probe", "--addr", &addr, "--path", path])
            .status()
            .unwrap()
    };
    assert!(probe("/healthz").success());
    assert!(!probe("/nope").success());
    server.stop().await.unwrap();
    assert!(!probe("/healthz").success(), "nothing listens any more");
}

/// The dashboard is valid JSON and has a panel for every metric family.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_covers_every_metric_family() {
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo("deploy/grafana/dashboards/ratelimitd.json")).unwrap(),
    )
    .expect("valid dashboard JSON");
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter().map(|t| t["expr"].as_str().unwrap().to_owned()))
        .collect();
    // The embedded example rules.
    let families = metric_families().await;
    assert!(families.len() >= 15, "{families:?}");
    for family in families {
        assert!(exprs.iter().any(|e| e.contains(family.as_str())), "no dashboard panel shows {family}");
    }
}

/// `check-jsonschema`, from `RATELIMITD_CHECK_JSONSCHEMA` or the tools cache.
fn check_jsonschema() -> std::path::PathBuf {
    std::env::var_os("RATELIMITD_CHECK_JSONSCHEMA")
        .map_or_else(|| common::envoy_path().with_file_name("check-jsonschema"), std::path::PathBuf::from)
}

/// Every object of `deploy/kubernetes`, by file name.
fn manifests() -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = std::fs::read_dir(repo("deploy/kubernetes"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let object = yaml_serde::from_str(&std::fs::read_to_string(&path).unwrap())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, object)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Each manifest validates against its kind's schema (strict: an unknown
/// or misspelt field fails), offline; a ServiceMonitor (a CRD, no schema
/// here) is checked by what it must agree with below.
#[test]
fn kubernetes_manifests_validate_against_the_schemas() {
    let schemas = repo("deploy/kubernetes/schemas");
    let mut validated = 0;
    for (name, object) in manifests() {
        let schema = match (object["apiVersion"].as_str(), object["kind"].as_str()) {
            (Some("apps/v1"), Some("Deployment")) => "deployment-apps-v1.json",
            (Some("v1"), Some("Service")) => "service-v1.json",
            (Some("v1"), Some("ConfigMap")) => "configmap-v1.json",
            (Some("policy/v1"), Some("PodDisruptionBudget")) => "poddisruptionbudget-policy-v1.json",
            (Some("batch/v1"), Some("Job")) => "job-batch-v1.json",
            (Some("networking.k8s.io/v1"), Some("NetworkPolicy")) => "networkpolicy-networking-v1.json",
            (Some("monitoring.coreos.com/v1"), Some("ServiceMonitor" | "PrometheusRule")) => continue,
            other => panic!("{name}: no schema for {other:?}"),
        };
        assert_valid(&schemas.join(schema), &repo(&format!("deploy/kubernetes/{name}")));
        validated += 1;
    }
    assert!(validated >= 8, "only {validated} manifests validated");
}

/// `manifest` validates against `schema` (check-jsonschema, offline).
fn assert_valid(schema: &Path, manifest: &Path) {
    let output = Command::new(check_jsonschema())
        .arg("--schemafile")
        .arg(schema)
        .arg(manifest)
        .output()
        .unwrap_or_else(|e| {
            panic!("check-jsonschema ({}): {e}; run scripts/install-tools", check_jsonschema().display())
        });
    assert!(
        output.status.success(),
        "{}: {}{}",
        manifest.display(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A manifest container's environment (`env`: name and value each).
fn container_env(container: &Value) -> HashMap<String, String> {
    container["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_owned(), e["value"].as_str().unwrap().to_owned()))
        .collect()
}

/// The manifests agree with each other and with the service: the
/// Deployment's environment is a valid configuration whose rules file is
/// the ConfigMap's (and compiles), its probes are the service's endpoints
/// on its HTTP port, its user is the image's; the Service, the
/// PodDisruptionBudget and the ServiceMonitor select its pods and name its
/// ports; the grace period outlasts drain and shutdown.
#[test]
fn kubernetes_manifests_agree_with_the_service_and_each_other() {
    let all = manifests();
    let object = |file: &str| all.iter().find(|(name, _)| name == file).map(|(_, o)| o.clone()).unwrap();
    let (deployment, service, pdb, monitor, configmap) = (
        object("deployment.yaml"),
        object("service.yaml"),
        object("pdb.yaml"),
        object("servicemonitor.yaml"),
        object("configmap.yaml"),
    );
    let pod = &deployment["spec"]["template"];
    let labels = &pod["metadata"]["labels"];
    assert_eq!(&deployment["spec"]["selector"]["matchLabels"], labels);
    assert_eq!(&pdb["spec"]["selector"]["matchLabels"], labels);
    assert_eq!(&service["spec"]["selector"], labels);
    assert_eq!(&monitor["spec"]["selector"]["matchLabels"], &service["metadata"]["labels"]);

    let container = &pod["spec"]["containers"][0];
    let port_of = |name: &str| {
        container["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .map(|p| p["containerPort"].as_u64().unwrap())
    };
    let service_ports = service["spec"]["ports"].as_sequence().unwrap();
    for port in service_ports {
        assert!(port_of(port["targetPort"].as_str().unwrap()).is_some(), "{port:?} names no container port");
    }
    let monitored = monitor["spec"]["endpoints"][0]["port"].as_str().unwrap();
    assert!(
        service_ports.iter().any(|p| p["name"] == monitored),
        "the ServiceMonitor scrapes no Service port"
    );
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");

    let env = container_env(container);
    let config =
        Config::load(None, env.clone()).unwrap_or_else(|e| panic!("deployment.yaml's environment: {e}"));
    assert_eq!(config.grpc_addr().port(), port_of("grpc").unwrap() as u16);
    assert_eq!(config.http_addr().port(), port_of("http").unwrap() as u16);
    // The probes on a port of their own, which a flood of the HTTP port cannot fill.
    let probe_port: std::net::SocketAddr =
        config.http.probe_listen.as_deref().expect("http.probe_listen").parse().unwrap();
    assert_eq!(probe_port.port(), port_of("probes").unwrap() as u16);
    for (probe, path) in
        [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")]
    {
        assert_eq!(container[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(container[probe]["httpGet"]["port"], "probes", "{probe}");
    }
    let grace_ms = pod["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap() * 1_000;
    assert!(grace_ms > config.grpc.drain_delay_ms + config.grpc.shutdown_grace_ms, "killed while draining");
    assert!(
        dockerfile()
            .contains(&format!("--uid {}", pod["spec"]["securityContext"]["runAsUser"].as_u64().unwrap())),
        "the pod runs as another user than the image's"
    );

    // The rules file is the ConfigMap's, mounted where the path points.
    let rules_path = config.rules.path.clone().unwrap();
    let mount = container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| rules_path.starts_with(m["mountPath"].as_str().unwrap()))
        .expect("the rules path is under a mount");
    let volume =
        pod["spec"]["volumes"].as_sequence().unwrap().iter().find(|v| v["name"] == mount["name"]).unwrap();
    assert_eq!(volume["configMap"]["name"], configmap["metadata"]["name"]);
    let file = rules_path.file_name().unwrap().to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join(file),
        configmap["data"][file].as_str().expect("the ConfigMap holds the file"),
    )
    .unwrap();
    let rules =
        ratelimitd::rules::load(&dir.path().join(file), Default::default()).unwrap_or_else(|e| panic!("{e}"));
    assert!(!rules.rules().is_empty());

    // Gateways' long-lived connections reach pods a scale-out adds.
    assert!(config.grpc.max_connection_age_ms > 0, "grpc.max_connection_age_ms unset");

    // The memory limit holds the worst case docs/operations.md states: the
    // base, the in-memory store full (512 bytes a counter and its summary)
    // and what requests can make it hold (twice the request byte budget,
    // by default an eighth of the limit the pod runs under).
    let limit = quantity(container["resources"]["limits"]["memory"].as_str().expect("a memory limit"));
    let mut under = config.clone();
    under.grpc.memory_limit = Some(limit);
    under.validate().unwrap_or_else(|e| panic!("deployment.yaml's environment under its limit: {e}"));
    let budget = under.grpc.request_bytes_in_flight() as u64;
    assert_eq!(budget, limit / 8, "the request byte budget is an eighth of the pod's limit");
    let worst = (40 << 20) + 512 * under.memory.max_counters as u64 + (9 << 19) + 2 * budget;
    assert!(worst < limit, "a worst case of {} MiB over the pod's {} MiB", worst >> 20, limit >> 20);

    // The migrate Job runs the Deployment's image against its store.
    let job = object("migrate-job.yaml");
    let migrate = &job["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(migrate["image"], container["image"]);
    assert_eq!(migrate["args"][0], "migrate");
    let job_env = container_env(migrate);
    let job_config =
        Config::load(None, job_env).unwrap_or_else(|e| panic!("migrate-job.yaml's environment: {e}"));
    assert_eq!(
        job_config.redis.connection.url, config.redis.connection.url,
        "the Job migrates the Deployment's Redis"
    );
    let help = Command::new(env!("CARGO_BIN_EXE_ratelimitd")).args(["migrate", "--help"]).output().unwrap();
    assert!(help.status.success());

    // The NetworkPolicy selects these pods and names their ports; the
    // probes' port is not opened (the kubelet is not subject to it).
    let policy = object("networkpolicy.yaml");
    assert_eq!(&policy["spec"]["podSelector"]["matchLabels"], labels);
    let opened: Vec<&str> = policy["spec"]["ingress"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|rule| rule["ports"].as_sequence().unwrap().iter().map(|p| p["port"].as_str().unwrap()))
        .collect();
    assert_eq!(opened, ["grpc", "http"]);
    for port in &opened {
        assert!(port_of(port).is_some(), "{port} names no container port");
    }
}

/// A Kubernetes memory quantity in bytes (`512Mi`, `1Gi`, `1073741824`).
fn quantity(text: &str) -> u64 {
    let (number, shift) = match text {
        t if t.ends_with("Gi") => (&t[..t.len() - 2], 30),
        t if t.ends_with("Mi") => (&t[..t.len() - 2], 20),
        t if t.ends_with("Ki") => (&t[..t.len() - 2], 10),
        t => (t, 0),
    };
    number.parse::<u64>().unwrap_or_else(|e| panic!("{text:?}: {e}")) << shift
}

/// The alert rules are valid for Prometheus (`promtool check rules`) and
/// fire as their tests say (`promtool test rules`); every metric they name
/// is one the service exports; the PrometheusRule carries the same groups;
/// each links to the section of the operations guide that says what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_rules_are_valid_and_name_real_metrics() {
    for args in [["check", "rules", "deploy/alerts.yml"], ["test", "rules", "deploy/alerts_test.yml"]] {
        let output = Command::new("promtool")
            .args(args)
            .current_dir(repo(""))
            .output()
            .unwrap_or_else(|e| panic!("promtool: {e}; run scripts/install-tools"));
        assert!(
            output.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let alerts: Value =
        yaml_serde::from_str(&std::fs::read_to_string(repo("deploy/alerts.yml")).unwrap()).unwrap();
    let operator: Value = yaml_serde::from_str(
        &std::fs::read_to_string(repo("deploy/kubernetes/prometheusrule.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(operator["spec"]["groups"], alerts["groups"], "the PrometheusRule and alerts.yml differ");

    let families = metric_families().await;
    let guide = std::fs::read_to_string(repo("docs/operations.md")).unwrap();
    let rules = alerts["groups"][0]["rules"].as_sequence().unwrap();
    assert!(rules.len() >= 8, "{} alerts", rules.len());
    for rule in rules {
        let name = rule["alert"].as_str().unwrap();
        let expr = rule["expr"].as_str().unwrap();
        let mut named = 0;
        for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if !word.starts_with("ratelimitd_") {
                continue;
            }
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    word.strip_suffix(suffix).filter(|f| families.iter().any(|known| known == *f))
                })
                .unwrap_or(word);
            assert!(families.iter().any(|known| known == family), "{name}: {word} is not on /metrics");
            named += 1;
        }
        assert!(named > 0, "{name} names no metric of the service");
        let runbook = rule["annotations"]["runbook"].as_str().unwrap();
        let anchor = runbook.strip_prefix("docs/operations.md#").unwrap();
        let heading = anchor.strip_prefix("alert-").unwrap();
        assert!(
            guide.lines().any(|l| l.starts_with("### ")
                && l.to_lowercase().replace(' ', "") == format!("###alert:{heading}")),
            "{name}: docs/operations.md has no section {anchor}"
        );
    }
}

/// The Envoy Gateway example (`deploy/kubernetes/envoy-gateway/`): a valid
/// ConfigMap whose EnvoyGateway swaps the rate limit Deployment's image for
/// the one `deployment.yaml` runs, whose Redis is the example's, and the
/// image answers as the `/bin/ratelimit` Envoy Gateway runs.
#[test]
fn the_envoy_gateway_example_swaps_the_image() {
    let path = repo("deploy/kubernetes/envoy-gateway/envoy-gateway-config.yaml");
    assert_valid(&repo("deploy/kubernetes/schemas/configmap-v1.json"), &path);
    let configmap: Value = yaml_serde::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let gateway: Value =
        yaml_serde::from_str(configmap["data"]["envoy-gateway.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(gateway["kind"], "EnvoyGateway");
    let deployment: Value =
        yaml_serde::from_str(&std::fs::read_to_string(repo("deploy/kubernetes/deployment.yaml")).unwrap())
            .unwrap();
    assert_eq!(
        gateway["provider"]["kubernetes"]["rateLimitDeployment"]["container"]["image"],
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
    );
    let redis: Value =
        yaml_serde::from_str(&std::fs::read_to_string(repo("deploy/kubernetes/redis-service.yaml")).unwrap())
            .unwrap();
    let url = gateway["rateLimit"]["backend"]["redis"]["url"].as_str().unwrap();
    let port = redis["spec"]["ports"][0]["port"].as_u64().unwrap();
    assert!(url.starts_with(&format!("{}.", redis["metadata"]["name"].as_str().unwrap())), "{url}");
    assert!(url.ends_with(&format!(":{port}")), "{url}");
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    assert!(
        dockerfile.contains("ln -s /usr/local/bin/ratelimitd /bin/ratelimit"),
        "the image has no /bin/ratelimit"
    );
}

/// The Kuadrant example (`deploy/kubernetes/kuadrant/`): the Limitador
/// resource swaps the image for the one `deployment.yaml` runs, and its
/// limits and the ConfigMap's (valid against the ConfigMap schema) are one
/// limits file this service compiles; the image answers as limitador-server.
#[test]
fn the_kuadrant_example_swaps_the_image_and_its_limits_compile() {
    let read = |name: &str| -> Value {
        yaml_serde::from_str(&std::fs::read_to_string(repo(&format!("deploy/kubernetes/{name}"))).unwrap())
            .unwrap()
    };
    let limitador = read("kuadrant/limitador.yaml");
    let deployment = read("deployment.yaml");
    assert_eq!(limitador["spec"]["image"], deployment["spec"]["template"]["spec"]["containers"][0]["image"]);
    let path = repo("deploy/kubernetes/kuadrant/limits-configmap.yaml");
    assert_valid(&repo("deploy/kubernetes/schemas/configmap-v1.json"), &path);
    let configmap = read("kuadrant/limits-configmap.yaml");
    let file = configmap["data"]["limitador-config.yaml"].as_str().unwrap();
    let from_configmap = ratelimitd::rules::limitador::Limits::parse(
        Path::new("limitador-config.yaml"),
        file,
        ratelimitd::limiter::Algorithm::FirstHitWindow,
    )
    .unwrap();
    let from_resource = yaml_serde::to_string(&limitador["spec"]["limits"]).unwrap();
    let from_resource = ratelimitd::rules::limitador::Limits::parse(
        Path::new("limits"),
        &from_resource,
        ratelimitd::limiter::Algorithm::FirstHitWindow,
    )
    .unwrap();
    let listed = |l: &ratelimitd::rules::limitador::Limits| {
        l.of("toystore").iter().map(|l| (Arc::clone(&l.identity), l.max_value)).collect::<Vec<_>>()
    };
    assert_eq!(listed(&from_configmap), listed(&from_resource), "the ConfigMap is the resource's limits");
    assert_eq!(listed(&from_configmap).len(), 2);
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    assert!(dockerfile.contains("ln -s /usr/local/bin/ratelimitd /usr/local/bin/limitador-server"));
}
