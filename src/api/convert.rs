//! Request validation and conversion between protobuf and decision types.
//!
//! Validation borrows from the wire message: a valid request is converted
//! without copying any string.

use crate::{
    decision::{CheckRequest, Decision, Reason},
    limiter::{
        Count,
        adaptive::{Outcome, Reported},
    },
    shed::Priority,
    telemetry::traces::trace_id_of,
};

use super::pb;

/// A structurally broken request. Becomes INVALID_ARGUMENT with this
/// message, which names the field; `reason` is the fixed metric label.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ValidationError {
    /// The offending field.
    pub field: &'static str,
    /// What is wrong with it.
    pub message: String,
    /// Fixed name of the problem (`empty_user_id`, …), for metrics.
    pub reason: &'static str,
}

fn invalid(field: &'static str, reason: &'static str, message: String) -> ValidationError {
    ValidationError { field, message, reason }
}

/// Whether `request` states a priority this service does not know (a
/// newer client's, or a forged one): it is read as none stated, and the
/// API counts it (`ratelimitd_request_values_adjusted_total`).
pub(super) fn unknown_priority(request: &pb::RateLimitRequest) -> bool {
    pb::PriorityBucket::try_from(request.priority).is_err()
}

/// Validates a `RateLimitRequest` and borrows it as a [`CheckRequest`].
///
/// Only a structurally broken request is refused (empty `user_id` or
/// `resource_path`): a refusal is an error a proxy may answer with
/// "allow", so no value is refused for its size, and a priority this
/// service does not know reads as none stated ([`unknown_priority`]). The engine
/// counts an over-long `user_id` by its digest; long paths and client types
/// are matched as they are; records keep bounded copies (`limits.*`).
///
/// `call_traceparent` is the gRPC call's own `traceparent` ([`call_traceparent`]),
/// read once per call: a stream's items share it.
pub fn validate<'a>(
    request: &'a pb::RateLimitRequest,
    call_traceparent: Option<&'a str>,
) -> Result<CheckRequest<'a>, ValidationError> {
    if request.user_id.is_empty() {
        return Err(invalid("user_id", "empty_user_id", "must not be empty".to_owned()));
    }
    if request.resource_path.is_empty() {
        return Err(invalid("resource_path", "empty_resource_path", "must not be empty".to_owned()));
    }
    let priority = match pb::PriorityBucket::try_from(request.priority) {
        Ok(pb::PriorityBucket::Unspecified) => None,
        Ok(pb::PriorityBucket::Critical) => Some(Priority::Critical),
        Ok(pb::PriorityBucket::Degraded) => Some(Priority::Degraded),
        Ok(pb::PriorityBucket::BestEffort) => Some(Priority::BestEffort),
        Ok(pb::PriorityBucket::Bulk) => Some(Priority::Bulk),
        Err(_) => None,
    };
    Ok(CheckRequest {
        user_id: &request.user_id,
        resource_path: &request.resource_path,
        client_type: (!request.client_type.is_empty()).then_some(request.client_type.as_str()),
        weight: request.weight.max(1),
        usage: &request.usage,
        count: if request.peek { Count::Never } else { Count::IfFits },
        priority,
        headers: &request.headers,
        // W3C trace context: the gRPC call's own metadata first, else a
        // `traceparent` the gateway forwarded among the request headers.
        trace_id: call_traceparent
            .or_else(|| request.headers.get("traceparent").map(String::as_str))
            .and_then(trace_id_of),
        share: None,
        outcome: None,
        may_report: true,
        reserve: request.reserve,
        reservation: None,
    })
}

/// The outcome a `Report` carries, if any. A value this service does not
/// know is refused: read as none, the report would count usage instead.
pub(super) fn reported(request: &pb::RateLimitRequest) -> Result<Option<Reported>, ValidationError> {
    let outcome = match pb::Outcome::try_from(request.outcome) {
        Ok(pb::Outcome::Unspecified) => return Ok(None),
        Ok(pb::Outcome::Success) => Outcome::Success,
        Ok(pb::Outcome::Failure) => Outcome::Failure,
        Ok(pb::Outcome::Overload) => Outcome::Overload,
        Err(_) => {
            return Err(invalid(
                "outcome",
                "unknown_outcome",
                format!(
                    "{} is not an outcome (OUTCOME_SUCCESS, OUTCOME_FAILURE or OUTCOME_OVERLOAD)",
                    request.outcome
                ),
            ));
        }
    };
    let latency_ms = (request.latency_ms > 0).then_some(u64::from(request.latency_ms));
    Ok(Some(Reported { outcome, latency_ms, counted: true }))
}

/// The W3C `traceparent` of a gRPC call's metadata, if any (and ASCII).
pub(super) fn call_traceparent(metadata: &tonic::metadata::MetadataMap) -> Option<&str> {
    metadata.get("traceparent").and_then(|v| v.to_str().ok())
}

/// Builds the wire response for `decision`.
pub(crate) fn response(decision: Decision) -> pb::RateLimitResponse {
    let (rule_id, limit, capacity, window_ms, unit, level) = match decision.rule {
        Some(rule) => {
            let unit = rule.unit.as_deref().map_or_else(String::new, str::to_owned);
            let level = rule.level.as_deref().map_or_else(String::new, str::to_owned);
            (String::from(&*rule.id), rule.limit, rule.capacity, rule.window_ms, unit, level)
        }
        None => (String::new(), 0, 0, 0, String::new(), String::new()),
    };
    pb::RateLimitResponse {
        allowed: decision.allowed,
        remaining_tokens: u32::try_from(decision.remaining).unwrap_or(u32::MAX),
        retry_after_ms: decision.retry_after_ms,
        cluster_utilization_status: decision.level.as_str().to_owned(),
        rule_id,
        limit,
        reset_after_ms: i64::try_from(decision.reset_after_ms).unwrap_or(i64::MAX),
        reason: reason(decision.reason) as i32,
        shadow_denied: decision.shadow_denied,
        capacity,
        window_ms: i64::try_from(window_ms).unwrap_or(i64::MAX),
        shadow_shed: decision.shadow_shed,
        priority: priority(decision.priority) as i32,
        store_error: decision.store_error.map_or_else(String::new, |kind| kind.as_str().to_owned()),
        unit,
        remaining: decision.remaining,
        reservation: decision.reservation.map_or_else(String::new, String::from),
        level,
    }
}

fn reason(reason: Reason) -> pb::Reason {
    match reason {
        Reason::Ok => pb::Reason::Ok,
        Reason::OverLimit => pb::Reason::OverLimit,
        Reason::Shed => pb::Reason::Shed,
        Reason::Overload => pb::Reason::Overload,
        Reason::NoRule => pb::Reason::NoRule,
        Reason::FailOpen => pb::Reason::FailOpen,
        Reason::FailClosed => pb::Reason::FailClosed,
        Reason::LocalOk => pb::Reason::LocalOk,
        Reason::LocalOverLimit => pb::Reason::LocalOverLimit,
        Reason::WeightExceedsCapacity => pb::Reason::WeightExceedsCapacity,
        Reason::NoPrice => pb::Reason::NoPrice,
        Reason::NoLevelKey => pb::Reason::NoLevelKey,
    }
}

pub(super) fn priority(priority: Priority) -> pb::PriorityBucket {
    match priority {
        Priority::Critical => pb::PriorityBucket::Critical,
        Priority::Degraded => pb::PriorityBucket::Degraded,
        Priority::BestEffort => pb::PriorityBucket::BestEffort,
        Priority::Bulk => pb::PriorityBucket::Bulk,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> pb::RateLimitRequest {
        pb::RateLimitRequest {
            user_id: "u1".to_owned(),
            resource_path: "/a".to_owned(),
            ..Default::default()
        }
    }

    fn error(mutate: impl FnOnce(&mut pb::RateLimitRequest)) -> ValidationError {
        let mut r = request();
        mutate(&mut r);
        validate(&r, None).unwrap_err()
    }

    #[test]
    fn valid_request_borrows_and_defaults() {
        let r = request();
        let checked = validate(&r, None).unwrap();
        assert_eq!(checked.weight, 1, "weight 0 means 1");
        assert_eq!(checked.client_type, None);
        assert_eq!(checked.priority, None);
        assert_eq!(checked.trace_id, None);
    }

    #[test]
    fn trace_id_from_metadata_or_headers() {
        let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut metadata = tonic::metadata::MetadataMap::new();
        metadata.insert("traceparent", traceparent.parse().unwrap());
        let r = request();
        let checked = validate(&r, call_traceparent(&metadata)).unwrap();
        assert_eq!(checked.trace_id, Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        let mut r = request();
        r.headers.insert("traceparent".to_owned(), traceparent.to_owned());
        assert_eq!(call_traceparent(&tonic::metadata::MetadataMap::new()), None);
        assert_eq!(validate(&r, None).unwrap().trace_id, Some("4bf92f3577b34da6a3ce929d0e0e4736"));
    }

    #[test]
    fn only_broken_structure_is_refused() {
        let e = error(|r| r.user_id.clear());
        assert_eq!((e.to_string().as_str(), e.reason), ("user_id: must not be empty", "empty_user_id"));
        assert_eq!(error(|r| r.resource_path.clear()).reason, "empty_resource_path");
        for unknown in [9, -1, i32::MAX] {
            let mut r = request();
            r.priority = unknown;
            assert_eq!(validate(&r, None).unwrap().priority, None, "{unknown} reads as none stated");
            assert!(unknown_priority(&r));
        }
        assert!(!unknown_priority(&request()));
        // Sizes are never a reason to refuse.
        let mut big = request();
        big.user_id = "x".repeat(10_000);
        big.resource_path = "/".repeat(10_000);
        big.client_type = "c".repeat(1_000);
        big.headers = (0..500).map(|i| (format!("h{i}"), "v".repeat(9_000))).collect();
        assert!(validate(&big, None).is_ok());
    }

    mod properties {
        //! Property tests: any request is either converted or refused with a
        //! field-naming error, never a panic, and only its structure decides.
        use proptest::prelude::*;

        use super::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

            #[test]
            fn validate_is_total_and_only_structure_decides(
                user_id in "(?s).{0,300}",
                resource_path in "(?s).{0,40}",
                client_type in "(?s).{0,10}",
                headers in proptest::collection::hash_map("(?s).{0,16}", "(?s).{0,16}", 0..6),
                traceparent in proptest::option::of("(?s).{0,64}"),
                priority in -2i32..8,
                weight in any::<u32>(),
            ) {
                let mut headers = headers;
                if let Some(traceparent) = traceparent {
                    headers.insert("traceparent".to_owned(), traceparent);
                }
                let request = pb::RateLimitRequest {
                    user_id, resource_path, client_type, headers, priority, weight, ..Default::default()
                };
                let well_formed = !request.user_id.is_empty() && !request.resource_path.is_empty();
                match validate(&request, None) {
                    Ok(checked) => {
                        prop_assert!(well_formed, "accepted a broken request: {request:?}");
                        prop_assert_eq!(checked.user_id, request.user_id.as_str());
                        prop_assert_eq!(checked.weight, request.weight.max(1));
                        prop_assert_eq!(checked.client_type.is_none(), request.client_type.is_empty());
                        prop_assert_eq!(checked.priority.is_none(), !(1..=4).contains(&request.priority));
                    }
                    Err(error) => {
                        prop_assert!(!well_formed, "refused a well-formed request: {error}");
                        prop_assert!(error.to_string().starts_with(error.field));
                    }
                }
            }
        }
    }
}
