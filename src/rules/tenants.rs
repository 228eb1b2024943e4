//! The tenant table of the overload layer (`overload.tenants_path`): each
//! tenant's weight and floor, and optionally the layer's mode. Loaded,
//! validated whole and hot-swapped like rule files; errors name file,
//! tenant and field.
//!
//! ```yaml
//! mode: enforce            # optional: enforce | shadow | off
//! default: { weight: 1.0, min_floor_rps: 0 }
//! tenants:
//!   - { name: acme, weight: 4.0, min_floor_rps: 100 }
//!   - { name: free, weight: 0.25 }
//! ```

use std::{collections::HashSet, fmt::Write as _, fs, path::Path};

use serde::Deserialize;

use super::{RuleError, RuleErrors, store::Versioned};

/// What the overload layer does with the drop ratio it computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OverloadMode {
    /// Requests the coin drops are refused with reason OVERLOAD.
    #[default]
    Enforce,
    /// Requests are counted and the coin is flipped, but nothing is
    /// refused: a would-be drop is counted (`result="shadow_dropped"`).
    Shadow,
    /// Nothing is counted or dropped.
    Off,
}

impl OverloadMode {
    /// The configuration and metric name.
    pub fn as_str(self) -> &'static str {
        match self {
            OverloadMode::Enforce => "enforce",
            OverloadMode::Shadow => "shadow",
            OverloadMode::Off => "off",
        }
    }

    /// Parses a configuration name.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "enforce" => Some(OverloadMode::Enforce),
            "shadow" => Some(OverloadMode::Shadow),
            "off" => Some(OverloadMode::Off),
            _ => None,
        }
    }
}

/// The most tenants a table may name: each is a bucket (and a metric
/// series) per overload directive.
pub const MAX_TENANTS: usize = 1_000;

/// Longest tenant name; names are metric labels and Redis hash fields.
pub const MAX_TENANT_NAME_BYTES: usize = 64;

/// How one tenant is weighed.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantWeight {
    /// The tenant's drop is the bucket's drop ratio divided by this
    /// (4.0: a quarter of it; 0.25: four times it, at most all).
    #[serde(default = "one")]
    pub weight: f64,
    /// A tenant sending at most this many requests per second (all
    /// instances together) is never dropped, and one sending more keeps at
    /// least this many.
    #[serde(default)]
    pub min_floor_rps: u64,
}

fn one() -> f64 {
    1.0
}

impl Default for TenantWeight {
    fn default() -> Self {
        TenantWeight { weight: 1.0, min_floor_rps: 0 }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    name: String,
    #[serde(flatten)]
    weight: TenantWeight,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTable {
    #[serde(default)]
    mode: Option<OverloadMode>,
    #[serde(default)]
    default: Option<TenantWeight>,
    #[serde(default)]
    tenants: Vec<RawTenant>,
}

/// A validated tenant table.
#[derive(Debug, Clone, PartialEq)]
pub struct Tenants {
    /// The layer's mode, when the table sets it.
    pub mode: Option<OverloadMode>,
    /// Tenants not in the table, and requests without a tenant.
    pub default: TenantWeight,
    /// Named tenants, in file order.
    pub tenants: Vec<(String, TenantWeight)>,
    version: String,
}

impl Default for Tenants {
    fn default() -> Self {
        Tenants::build(None, TenantWeight::default(), Vec::new())
    }
}

impl Tenants {
    fn build(
        mode: Option<OverloadMode>,
        default: TenantWeight,
        tenants: Vec<(String, TenantWeight)>,
    ) -> Self {
        let mut canonical = format!("{:?}\t{}\t{}\n", mode, default.weight, default.min_floor_rps);
        for (name, weight) in &tenants {
            let _ = writeln!(canonical, "{name}\t{}\t{}", weight.weight, weight.min_floor_rps);
        }
        let version = sha1_smol::Sha1::from(canonical.as_bytes()).digest().to_string()[..16].to_owned();
        Tenants { mode, default, tenants, version }
    }
}

impl Versioned for Tenants {
    fn version(&self) -> &str {
        &self.version
    }
    fn size(&self) -> usize {
        self.tenants.len()
    }
}

/// Reads and validates the table at `path`.
pub fn load(path: &Path) -> Result<Tenants, RuleErrors> {
    let text = fs::read_to_string(path).map_err(|e| RuleErrors(vec![RuleError::io(path, &e)]))?;
    parse(path, &text)
}

/// Parses and validates one table's text; every problem is reported.
pub fn parse(path: &Path, text: &str) -> Result<Tenants, RuleErrors> {
    let error = |tenant: Option<String>, field: Option<&str>, message: String| RuleError {
        file: path.to_path_buf(),
        line: None,
        rule: tenant,
        field: field.map(str::to_owned),
        message,
    };
    let raw: RawTable = yaml_serde::from_str(text).map_err(|e| {
        RuleErrors(vec![RuleError {
            line: e.location().map(|l| (l.line(), l.column())),
            ..error(None, None, e.to_string())
        }])
    })?;
    let mut errors = Vec::new();
    if raw.tenants.len() > MAX_TENANTS {
        errors.push(error(None, Some("tenants"), format!("more than {MAX_TENANTS} tenants")));
    }
    let check = |who: Option<String>, weight: &TenantWeight, errors: &mut Vec<RuleError>| {
        if !(weight.weight.is_finite() && (0.01..=1_000.0).contains(&weight.weight)) {
            errors.push(error(
                who,
                Some("weight"),
                format!("must be in [0.01, 1000], got {}", weight.weight),
            ));
        }
    };
    let default = raw.default.unwrap_or_default();
    check(Some("default".to_owned()), &default, &mut errors);
    let mut names = HashSet::new();
    for (index, tenant) in raw.tenants.iter().enumerate() {
        let who = Some(format!("tenants[{index}] {:?}", tenant.name));
        if tenant.name.is_empty() || tenant.name.len() > MAX_TENANT_NAME_BYTES {
            errors.push(error(
                who.clone(),
                Some("name"),
                format!("must be 1 to {MAX_TENANT_NAME_BYTES} bytes"),
            ));
        } else if let Some(bad) =
            tenant.name.chars().find(|c| !(c.is_ascii_alphanumeric() || "._-".contains(*c)))
        {
            errors.push(error(
                who.clone(),
                Some("name"),
                format!("{bad:?} is not allowed: use letters, digits, '.', '_' and '-'"),
            ));
        } else if !names.insert(tenant.name.as_str()) {
            errors.push(error(who.clone(), Some("name"), "duplicate tenant".to_owned()));
        }
        check(who, &tenant.weight, &mut errors);
    }
    if !errors.is_empty() {
        return Err(RuleErrors(errors));
    }
    let tenants = raw.tenants.into_iter().map(|t| (t.name, t.weight)).collect();
    Ok(Tenants::build(raw.mode, default, tenants))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_parses_with_defaults() {
        let table = parse(
            Path::new("t.yaml"),
            "mode: shadow\ntenants:\n  - { name: acme, weight: 4.0, min_floor_rps: 100 }\n  - { name: free, weight: 0.25 }\n",
        )
        .unwrap();
        assert_eq!(table.mode, Some(OverloadMode::Shadow));
        assert_eq!(table.default, TenantWeight::default());
        assert_eq!(table.tenants[0], ("acme".to_owned(), TenantWeight { weight: 4.0, min_floor_rps: 100 }));
        assert_eq!(table.tenants[1].1, TenantWeight { weight: 0.25, min_floor_rps: 0 });
        let again = parse(Path::new("u.yaml"), "mode: shadow\ntenants: [{name: acme, weight: 4, min_floor_rps: 100}, {name: free, weight: 0.25}]").unwrap();
        assert_eq!(table.version(), again.version(), "content, not layout");
        assert_ne!(table.version(), Tenants::default().version());
    }

    #[test]
    fn every_bad_field_is_named() {
        let errors = parse(
            Path::new("t.yaml"),
            "default: {weight: 0}\ntenants:\n  - {name: 'a b'}\n  - {name: x, weight: .nan}\n  - {name: x}\n",
        )
        .unwrap_err()
        .to_string();
        for expected in [
            "rule default: field `weight`",
            "tenants[0] \"a b\": field `name`",
            "tenants[1] \"x\": field `weight`",
            "duplicate tenant",
        ] {
            assert!(errors.contains(expected), "{expected} not in {errors}");
        }
        let unknown = parse(Path::new("t.yaml"), "tenants: [{name: a, wieght: 2}]").unwrap_err().to_string();
        assert!(unknown.contains("t.yaml") && unknown.contains("wieght"), "{unknown}");
    }
}
