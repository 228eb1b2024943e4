//! The process environment read beside `RATELIMITD__…`: the standard
//! OpenTelemetry variables (`OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `OTEL_SERVICE_NAME`, …), translated into `telemetry.*` in every mode,
//! and variables named like this service's that no setting reads (a
//! misspelt prefix such as `RATELIMITD_REDIS__URL`), each noted with the
//! name that would be read. Notes are logged as warnings at start.
//!
//! Precedence: an explicit `RATELIMITD__TELEMETRY__…` variable beats the
//! OpenTelemetry one, and both beat the file.

use std::collections::HashMap;

use super::{ConfigError, ENV_PREFIX, compat::COMPAT_VAR, invalid};

/// Variables with this service's prefix that the project's scripts and
/// test suite read, not the service.
const TOOLS: [&str; 6] = [
    "RATELIMITD_TOOLS_DIR",
    "RATELIMITD_TANSU",
    "RATELIMITD_ENVOY",
    "RATELIMITD_GRPCURL",
    "RATELIMITD_CHECK_JSONSCHEMA",
    "RATELIMITD_CMD",
];

/// The configuration's sections, the first part of every key.
const SECTIONS: [&str; 15] = [
    "grpc",
    "http",
    "redis",
    "memory",
    "local",
    "rules",
    "limits",
    "shed",
    "overload",
    "denial_cache",
    "dlq",
    "capture",
    "envoy",
    "log",
    "telemetry",
];

/// Adds `RATELIMITD__TELEMETRY__OTLP_ENDPOINT` (from
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`;
/// none when `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`),
/// `RATELIMITD__TELEMETRY__OTLP_PROTOCOL` (from
/// `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else `OTEL_EXPORTER_OTLP_PROTOCOL`:
/// `grpc` or `http/protobuf`; another is an error naming the variable) and
/// `RATELIMITD__TELEMETRY__SERVICE_NAME` (from `OTEL_SERVICE_NAME`, else
/// `service.name` in `OTEL_RESOURCE_ATTRIBUTES`), never over one already set.
pub(super) fn otel(env: &mut HashMap<String, String>) -> Result<(), ConfigError> {
    let get = |name: &str| env.get(name).map(|v| v.trim()).filter(|v| !v.is_empty()).map(str::to_owned);
    let off = get("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || get("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
    let endpoint = get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| get("OTEL_EXPORTER_OTLP_ENDPOINT"));
    let service = get("OTEL_SERVICE_NAME").or_else(|| {
        get("OTEL_RESOURCE_ATTRIBUTES")?
            .split(',')
            .find_map(|pair| pair.trim().strip_prefix("service.name=").map(str::to_owned))
    });
    let protocol = ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"]
        .into_iter()
        .find_map(|name| Some((name, get(name)?)));
    if let Some((name, protocol)) = &protocol
        && !["grpc", "http/protobuf"].contains(&protocol.as_str())
    {
        return Err(invalid(name, format!("{protocol:?}: traces are exported over grpc or http/protobuf")));
    }
    let mut set = |key: &str, value: String| {
        env.entry(format!("{ENV_PREFIX}__TELEMETRY__{key}")).or_insert(value);
    };
    if let Some(endpoint) = endpoint.filter(|_| !off) {
        set("OTLP_ENDPOINT", endpoint);
    }
    if let Some((_, protocol)) = protocol {
        set("OTLP_PROTOCOL", protocol);
    }
    if let Some(service) = service {
        set("SERVICE_NAME", service);
    }
    Ok(())
}

/// A note for each variable named like this service's that no setting
/// reads, with the name that would be read where one is close.
pub(super) fn unread(env: &HashMap<String, String>) -> Vec<String> {
    let mut names: Vec<&str> = env
        .keys()
        .map(String::as_str)
        .filter(|name| {
            let upper = name.to_ascii_uppercase();
            upper.starts_with(ENV_PREFIX)
                && !upper.starts_with(&format!("{ENV_PREFIX}__"))
                && upper != COMPAT_VAR
                && !TOOLS.contains(name)
        })
        .collect();
    names.sort_unstable();
    names
        .into_iter()
        .map(|name| match closest(name) {
            Some(read) => format!("{name} is not read by any setting: did you mean {read}?"),
            None => format!("{name} is not read by any setting (settings are {ENV_PREFIX}__SECTION__KEY)"),
        })
        .collect()
}

/// `RATELIMITD__SECTION__KEY` for a name that starts, after the prefix and
/// any underscores, with a section and then a key.
fn closest(name: &str) -> Option<String> {
    let rest = name.get(ENV_PREFIX.len()..)?.trim_start_matches('_').to_ascii_lowercase();
    let section = SECTIONS
        .iter()
        .filter(|s| rest.strip_prefix(**s).is_some_and(|after| after.starts_with('_')))
        .max_by_key(|s| s.len())?;
    let key = rest[section.len()..].trim_start_matches('_');
    (!key.is_empty()).then(|| format!("{ENV_PREFIX}__{}__{}", section.to_uppercase(), key.to_uppercase()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn standard_otel_variables_fill_telemetry_unless_set_or_off() {
        let mut e = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
            ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod, service.name=edge-rl"),
        ]);
        otel(&mut e).unwrap();
        assert_eq!(e["RATELIMITD__TELEMETRY__OTLP_ENDPOINT"], "http://collector:4317");
        assert_eq!(e["RATELIMITD__TELEMETRY__SERVICE_NAME"], "edge-rl");

        let mut e = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317"),
            ("OTEL_SERVICE_NAME", "rl"),
            ("RATELIMITD__TELEMETRY__SERVICE_NAME", "explicit"),
        ]);
        otel(&mut e).unwrap();
        assert_eq!(e["RATELIMITD__TELEMETRY__OTLP_ENDPOINT"], "http://traces:4317", "the traces one first");
        assert_eq!(e["RATELIMITD__TELEMETRY__SERVICE_NAME"], "explicit", "ours beats theirs");

        for off in [("OTEL_SDK_DISABLED", "true"), ("OTEL_TRACES_EXPORTER", "none")] {
            let mut e = env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"), off]);
            otel(&mut e).unwrap();
            assert!(!e.contains_key("RATELIMITD__TELEMETRY__OTLP_ENDPOINT"), "{off:?}");
        }

        let mut e = env(&[
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
        ]);
        otel(&mut e).unwrap();
        assert_eq!(e["RATELIMITD__TELEMETRY__OTLP_PROTOCOL"], "http/protobuf", "the traces one first");
        let error = otel(&mut env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")])).unwrap_err().to_string();
        assert!(error.contains("OTEL_EXPORTER_OTLP_PROTOCOL") && error.contains("http/json"), "{error}");
    }

    #[test]
    fn misspelt_names_are_noted_with_the_name_read() {
        let e = env(&[
            ("RATELIMITD_REDIS__URL", "redis://x"),
            ("RATELIMITD_DENIAL_CACHE_MAX_ENTRIES", "5"),
            ("RATELIMITD_NOTHING", "1"),
            ("RATELIMITD__REDIS__URL", "redis://x"),
            ("RATELIMITD_COMPAT", "envoyproxy"),
            ("RATELIMITD_TANSU", "/bin/tansu"),
            ("REDIS_URL", "x"),
        ]);
        assert_eq!(
            unread(&e),
            [
                "RATELIMITD_DENIAL_CACHE_MAX_ENTRIES is not read by any setting: did you mean \
                 RATELIMITD__DENIAL_CACHE__MAX_ENTRIES?",
                "RATELIMITD_NOTHING is not read by any setting (settings are RATELIMITD__SECTION__KEY)",
                "RATELIMITD_REDIS__URL is not read by any setting: did you mean RATELIMITD__REDIS__URL?",
            ]
        );
    }
}
