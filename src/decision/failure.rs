//! What the engine reports when the store could not decide: one
//! [`FailedDecision`] per request, whichever API asked, handed to a
//! [`FailureSink`] (the dead-letter pipeline implements it).

use std::{collections::HashMap, fmt};

use super::{CheckRequest, Reason};
use crate::{
    limiter::{Count, StoreError},
    rules::Rule,
    shed::Priority,
};

/// One decision the store could not make, as the hot path saw it. Plain
/// borrowed fields, so both APIs (`Check` and Envoy's `ShouldRateLimit`)
/// report through the same sink and schema.
#[derive(Debug)]
pub struct FailedDecision<'a> {
    /// The counting dimension (for Envoy: the first counted descriptor's counter key).
    pub user_id: &'a str,
    /// The matched path (for Envoy: `envoy:<domain>`).
    pub resource_path: &'a str,
    /// The client type, if given.
    pub client_type: Option<&'a str>,
    /// The request's weight (Envoy: the descriptor's hits).
    pub weight: u32,
    /// How it was to be counted: an admission, a peek or a report (a
    /// report's usage is what an auditor must not lose).
    pub count: Count,
    /// Request headers (copied by allow-list; Envoy requests carry none).
    pub headers: &'a HashMap<String, String>,
    /// W3C trace id, if any.
    pub trace_id: Option<&'a str>,
    /// The rule (for Envoy: the limit's full key).
    pub rule_id: &'a str,
    /// The priority the request was decided with.
    pub priority: Priority,
    /// What went wrong.
    pub error: &'a StoreError,
    /// The answer given: `FailOpen` or `FailClosed`.
    pub answer: Reason,
}

impl<'a> FailedDecision<'a> {
    /// The failure of a native `Check` request.
    pub fn of_check(
        request: &'a CheckRequest<'a>,
        rule: &'a Rule,
        priority: Priority,
        error: &'a StoreError,
        answer: Reason,
    ) -> Self {
        FailedDecision {
            user_id: request.user_id,
            resource_path: request.resource_path,
            client_type: request.client_type,
            weight: request.weight,
            count: request.count,
            headers: request.headers,
            trace_id: request.trace_id,
            rule_id: &rule.id,
            priority,
            error,
            answer,
        }
    }
}

/// Receives failed decisions. Called on the hot path: implementations must
/// only enqueue, never wait on I/O.
pub trait FailureSink: Send + Sync + fmt::Debug {
    /// Records one failed decision.
    fn record(&self, failure: &FailedDecision<'_>);
}
