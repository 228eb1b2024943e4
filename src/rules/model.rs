//! The compiled rule model: what a rule means once it has been validated.

use std::{path::Path, sync::Arc};

use serde::{Deserialize, Serialize};

use crate::{
    limiter::{CounterSpec, window::WindowParams},
    shed::Priority,
};

/// Whether a rule's denials are enforced or only reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
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

impl Rule {
    /// The counter this rule keeps per user, as the store takes it.
    pub fn counter(&self) -> CounterSpec<'_> {
        CounterSpec { id: &self.id, window: self.window }
    }
}
