//! A `Check` client for tools (`ratelimitd check`): plain request and answer
//! types, so callers outside `api` never name a generated type.

use std::{collections::HashMap, time::Duration};

use super::pb;
use crate::shed::Priority;

/// One `Check` call.
#[derive(Debug, Clone, Default)]
pub struct CheckCall {
    /// The counting dimension.
    pub user_id: String,
    /// The path to match.
    pub resource_path: String,
    /// The client type, if any.
    pub client_type: Option<String>,
    /// Cost (0 means 1).
    pub weight: u32,
    /// `None`: the rule's.
    pub priority: Option<Priority>,
    /// Request headers.
    pub headers: HashMap<String, String>,
    /// Check without counting.
    pub peek: bool,
    /// Call `Report` (count the weight whatever is left) instead of `Check`.
    pub report: bool,
}

/// The server's answer, field by field.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CheckAnswer {
    /// Let the request through?
    pub allowed: bool,
    /// OK, OVER_LIMIT, SHED, NO_RULE, FAIL_OPEN, FAIL_CLOSED, WEIGHT_EXCEEDS_CAPACITY.
    pub reason: String,
    /// Tokens left.
    pub remaining_tokens: u32,
    /// 0 when allowed; -1 never.
    pub retry_after_ms: i64,
    /// ms until the counter has fully decayed.
    pub reset_after_ms: i64,
    /// The matched rule ("" when none).
    pub rule_id: String,
    /// The rule's limit per window.
    pub limit: u64,
    /// The rule's capacity (limit × burst).
    pub capacity: u64,
    /// The rule's window in ms.
    pub window_ms: i64,
    /// A shadow rule would have denied.
    pub shadow_denied: bool,
    /// NORMAL, DEGRADED_MODE or CRITICAL_ONLY.
    pub cluster_utilization_status: String,
    /// Set when the shared store did not decide: the failure kind.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub store_error: String,
}

/// Why a call got no answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The address is not a valid URI.
    #[error("{0}")]
    Address(String),
    /// No connection could be made.
    #[error("{0}")]
    Connect(String),
    /// The server refused the request as malformed.
    #[error("{0}")]
    InvalidArgument(String),
    /// Any other gRPC failure.
    #[error("{0}")]
    Rpc(String),
}

/// Sends `call` to the server at `addr` (`http://host:port`) within `timeout`.
pub async fn check(addr: &str, timeout: Duration, call: CheckCall) -> Result<CheckAnswer, CallError> {
    let endpoint = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .map_err(|e| CallError::Address(e.to_string()))?
        .timeout(timeout);
    let channel = endpoint.connect().await.map_err(|e| CallError::Connect(e.to_string()))?;
    let request = pb::RateLimitRequest {
        user_id: call.user_id,
        resource_path: call.resource_path,
        client_type: call.client_type.unwrap_or_default(),
        weight: call.weight,
        priority: call.priority.map_or(pb::PriorityBucket::Unspecified, super::convert::priority) as i32,
        headers: call.headers,
        peek: call.peek,
        ..Default::default()
    };
    let mut client = pb::rate_limiter_client::RateLimiterClient::new(channel);
    let answer = if call.report { client.report(request).await } else { client.check(request).await };
    let response = answer.map_err(|status| {
        let message = format!("{}: {}", status.code(), status.message());
        if status.code() == tonic::Code::InvalidArgument {
            CallError::InvalidArgument(message)
        } else {
            CallError::Rpc(message)
        }
    })?;
    let r = response.into_inner();
    Ok(CheckAnswer {
        allowed: r.allowed,
        reason: pb::Reason::try_from(r.reason).map_or("REASON_UNSPECIFIED", |r| r.as_str_name()).to_owned(),
        remaining_tokens: r.remaining_tokens,
        retry_after_ms: r.retry_after_ms,
        reset_after_ms: r.reset_after_ms,
        rule_id: r.rule_id,
        limit: r.limit,
        capacity: r.capacity,
        window_ms: r.window_ms,
        shadow_denied: r.shadow_denied,
        cluster_utilization_status: r.cluster_utilization_status,
        store_error: r.store_error,
    })
}
