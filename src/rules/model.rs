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
    /// Decide at this instance's share of the limit, counted locally and
    /// written back to the store when it answers again (reasons LOCAL_OK
    /// and LOCAL_OVER_LIMIT); denied (FAIL_CLOSED) when the local limiter
    /// itself is at its bound.
    #[default]
    Local,
    /// Allow, with reason FAIL_OPEN.
    Open,
    /// Deny, with reason FAIL_CLOSED.
    Closed,
}

/// What an overload directive's global rate is counted per.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OverloadScope {
    /// One bucket for the rule: tenants share `rate_per_second` by weight.
    #[default]
    Rule,
    /// One bucket per tenant of the tenant table (tenants not in it share
    /// one more), each with `rate_per_second`.
    Tenant,
}

impl OverloadScope {
    /// The rule-file name.
    pub fn as_str(self) -> &'static str {
        match self {
            OverloadScope::Rule => "rule",
            OverloadScope::Tenant => "tenant",
        }
    }
}

/// An overload directive: a global request rate, summed over every
/// instance, enforced statistically in front of the exact counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OverloadSpec {
    /// Requests per second admitted past the overload layer, all instances together.
    pub rate_per_second: u64,
    /// Counted per rule (default) or per rule and tenant.
    #[serde(default)]
    pub per: OverloadScope,
}

/// Largest accepted `overload.rate_per_second`.
pub const MAX_OVERLOAD_RATE: u64 = 1_000_000_000;

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
    /// A global rate enforced by probabilistic drop before the exact counter.
    pub overload: Option<OverloadSpec>,
    /// The file the rule came from, for messages.
    pub source: Arc<Path>,
}

impl Rule {
    /// The counter this rule keeps per user, as the store takes it.
    pub fn counter(&self) -> CounterSpec<'_> {
        CounterSpec { id: &self.id, window: self.window }
    }
}
