//! The configuration file as a `config` source, parsed by the build's one
//! YAML parser (`yaml_serde`, which reads the rules too) rather than by
//! the `config` crate's own: one parser, one set of YAML rules and errors.

use config::{ConfigError, Map, Source, Value, ValueKind};

/// A YAML file's text and where it came from (named in errors).
#[derive(Debug, Clone)]
pub(super) struct YamlFile {
    pub(super) origin: String,
    pub(super) text: String,
}

impl Source for YamlFile {
    fn clone_into_box(&self) -> Box<dyn Source + Send + Sync> {
        Box::new(self.clone())
    }

    fn collect(&self) -> Result<Map<String, Value>, ConfigError> {
        let document: yaml_serde::Value = yaml_serde::from_str(&self.text)
            .map_err(|e| ConfigError::Message(format!("{}: {e}", self.origin)))?;
        match convert(document, &self.origin)?.kind {
            ValueKind::Table(table) => Ok(table),
            ValueKind::Nil => Ok(Map::new()),
            _ => Err(ConfigError::Message(format!(
                "{}: the top level must be a mapping of sections",
                self.origin
            ))),
        }
    }
}

/// A YAML value as a `config` value from `origin`.
fn convert(value: yaml_serde::Value, origin: &String) -> Result<Value, ConfigError> {
    use yaml_serde::Value as Yaml;
    let kind = match value {
        Yaml::Null => ValueKind::Nil,
        Yaml::Bool(b) => ValueKind::Boolean(b),
        Yaml::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => ValueKind::I64(i),
            (None, Some(u)) => ValueKind::U64(u),
            (None, None) => ValueKind::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Yaml::String(s) => ValueKind::String(s),
        Yaml::Sequence(items) => {
            ValueKind::Array(items.into_iter().map(|item| convert(item, origin)).collect::<Result<_, _>>()?)
        }
        Yaml::Mapping(entries) => ValueKind::Table(
            entries
                .into_iter()
                .map(|(key, value)| Ok((key_text(key, origin)?, convert(value, origin)?)))
                .collect::<Result<_, ConfigError>>()?,
        ),
        Yaml::Tagged(tagged) => convert(tagged.value, origin)?.kind,
    };
    Ok(Value::new(Some(origin), kind))
}

/// A mapping key as text: a string, or a number or boolean as written.
fn key_text(key: yaml_serde::Value, origin: &str) -> Result<String, ConfigError> {
    use yaml_serde::Value as Yaml;
    match key {
        Yaml::String(s) => Ok(s),
        Yaml::Number(n) => Ok(n.to_string()),
        Yaml::Bool(b) => Ok(b.to_string()),
        other => Err(ConfigError::Message(format!("{origin}: a key must be text, not {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<config::Config, ConfigError> {
        config::Config::builder()
            .add_source(YamlFile { origin: "ratelimitd.yaml".to_owned(), text: text.to_owned() })
            .build()
    }

    #[test]
    fn nested_sections_lists_and_scalars_read_as_the_config_crate_reads_them() {
        let text = "redis:\n  url: redis://x\n  timeout_ms: 25\nshed:\n  degraded_at: 0.75\ndlq:\n  header_allowlist: [a, b]\n  kafka:\n    brokers: k:9092\nempty:\n";
        let c = load(text).unwrap();
        assert_eq!(c.get_string("redis.url").unwrap(), "redis://x");
        assert_eq!(c.get_int("redis.timeout_ms").unwrap(), 25);
        assert!((c.get_float("shed.degraded_at").unwrap() - 0.75).abs() < 1e-9);
        assert_eq!(c.get_array("dlq.header_allowlist").unwrap().len(), 2);
        assert_eq!(c.get_string("dlq.kafka.brokers").unwrap(), "k:9092");
    }

    #[test]
    fn errors_name_the_file() {
        let error = load("redis: [unclosed").unwrap_err().to_string();
        assert!(error.starts_with("ratelimitd.yaml: "), "{error}");
        let error = load("- a\n- b\n").unwrap_err().to_string();
        assert!(error.contains("top level must be a mapping"), "{error}");
        assert!(load("").is_ok(), "an empty file is no settings");
    }
}
