//! The compiled rule model: what a rule means once it has been validated.

use std::{fmt, path::Path, sync::Arc};

use serde::Deserialize;

use crate::limiter::window::WindowParams;

/// How important a request is when the service sheds load (DESIGN §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Priority {
    /// Never shed.
    Critical,
    /// Shed only at CRITICAL_ONLY.
    Degraded,
    /// Shed from DEGRADED_MODE on.
    BestEffort,
    /// Shed from DEGRADED_MODE on.
    Bulk,
}

impl Priority {
    /// The name used in rule files, the API and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "CRITICAL",
            Priority::Degraded => "DEGRADED",
            Priority::BestEffort => "BEST_EFFORT",
            Priority::Bulk => "BULK",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a rule's denials are enforced or only reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Over-limit requests are denied.
    #[default]
    Enforce,
    /// Requests are counted exactly as under `enforce`, but an over-limit
    /// request is allowed and flagged `shadow_denied`.
    Shadow,
}

/// What answers when the counter store cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailurePolicy {
    /// Allow, with reason FAIL_OPEN.
    #[default]
    Open,
    /// Deny, with reason FAIL_CLOSED.
    Closed,
}

/// One validated rule. Shared by reference from the [`Snapshot`](super::Snapshot);
/// the hot path never clones it.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Unique id: part of Redis keys and of metric labels.
    pub id: Arc<str>,
    /// The path as written: exact, or a prefix pattern ending in `*`.
    pub resource_path: String,
    /// Only requests with this client type match; `None` matches any.
    pub client_type: Option<String>,
    /// Priority of matching requests that do not state one.
    pub priority: Priority,
    /// Requests per window, before burst.
    pub limit: u64,
    /// Burst multiplier (>= 1).
    pub burst_capacity: f64,
    /// Window length and capacity (`floor(limit * burst_capacity)`).
    pub window: WindowParams,
    /// Enforce or shadow.
    pub mode: Mode,
    /// Answer when the store fails.
    pub failure_policy: FailurePolicy,
    /// The file the rule came from, for messages.
    pub source: Arc<Path>,
}
