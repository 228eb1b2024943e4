//! The capture record: one decided request, one JSON object per line (file)
//! or message (topic), schema `ratelimitd.capture/1`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{decision::EnvoyCall, limiter::Count, shed::Priority};

/// The schema this build writes and reads.
pub const CAPTURE_SCHEMA: &str = "ratelimitd.capture/1";

/// How a captured request counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CountKind {
    /// A `Check`: counted if it fits.
    Check,
    /// A `Check` with `peek`: counts nothing.
    Peek,
    /// A `Report`: counted whatever is left.
    Report,
    /// An admission counted whether or not it fits (Envoy
    /// `envoy.hits_counted: always`).
    #[serde(rename = "check_anyway")]
    CheckAnyway,
}

impl CountKind {
    /// The kind of `count`.
    pub fn of(count: Count) -> Self {
        match count {
            Count::IfFits => CountKind::Check,
            Count::Never => CountKind::Peek,
            Count::Always => CountKind::Report,
            Count::Anyway => CountKind::CheckAnyway,
        }
    }

    /// The engine's `Count`.
    pub fn count(self) -> Count {
        match self {
            CountKind::Check => Count::IfFits,
            CountKind::Peek => Count::Never,
            CountKind::Report => Count::Always,
            CountKind::CheckAnyway => Count::Anyway,
        }
    }
}

/// Most units of a request's `usage` a capture keeps.
pub const MAX_CAPTURED_UNITS: usize = 16;

/// One captured request and its decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaptureRecord {
    /// [`CAPTURE_SCHEMA`].
    pub schema: String,
    /// When it was decided, ms since the epoch.
    pub time_ms: u64,
    /// The instance that decided it.
    pub instance: String,
    /// The user id as counted (the digest of an over-long one); empty for
    /// an Envoy request.
    #[serde(default)]
    pub user_id: String,
    /// The path (truncated past `limits.max_resource_path_bytes`); empty
    /// for an Envoy request.
    #[serde(default)]
    pub resource_path: String,
    /// The client type, if the request said.
    pub client_type: Option<String>,
    /// The priority the request stated, if any.
    pub priority: Option<Priority>,
    /// Its weight (at least 1).
    pub weight: u32,
    /// What it stated of units other than requests (`usage`), at most
    /// [`MAX_CAPTURED_UNITS`] of them, each named as a unit may be.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub usage: BTreeMap<String, u64>,
    /// Check, peek or report.
    pub count: CountKind,
    /// Allow-listed headers (`dlq.header_allowlist`), lower-case names.
    pub headers: BTreeMap<String, String>,
    /// The version of the rules it was decided under: the native rule
    /// set's, or for an Envoy request the Envoy configuration's.
    pub rules_version: String,
    /// The rule that matched; for an Envoy request the full key of the
    /// limit that bound (the tightest).
    pub rule_id: Option<String>,
    /// The priority it was decided with.
    pub effective_priority: Priority,
    /// The answer.
    pub allowed: bool,
    /// Why (`OK`, `OVER_LIMIT`, `SHED`, …).
    pub reason: String,
    /// A `ShouldRateLimit` request: its domain, descriptors and hits
    /// (`user_id` and `resource_path` are then empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envoy: Option<EnvoyCall>,
}
