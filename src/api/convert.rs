//! Request validation and conversion between protobuf and decision types.
//!
//! Validation borrows from the wire message: a valid request is converted
//! without copying any string.

use crate::{
    config::LimitsConfig,
    decision::{CheckRequest, Decision, Reason},
    shed::Priority,
    telemetry::traces::trace_id_of,
};

use super::pb;

/// A request field that is out of bounds. Becomes INVALID_ARGUMENT with this
/// message, which names the field and the bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ValidationError {
    /// The offending field.
    pub field: &'static str,
    /// What is wrong with it, including the bound and its configuration key.
    pub message: String,
}

fn invalid(field: &'static str, message: String) -> ValidationError {
    ValidationError { field, message }
}

fn bounded(
    field: &'static str,
    value: &str,
    max: usize,
    key: &str,
    required: bool,
) -> Result<(), ValidationError> {
    if required && value.is_empty() {
        return Err(invalid(field, "must not be empty".to_owned()));
    }
    if value.len() > max {
        return Err(invalid(
            field,
            format!("{} bytes exceeds the maximum of {max} (limits.{key})", value.len()),
        ));
    }
    Ok(())
}

/// Validates a `RateLimitRequest` against `limits` and borrows it as a
/// [`CheckRequest`].
pub fn validate<'a>(
    request: &'a pb::RateLimitRequest,
    metadata: &'a tonic::metadata::MetadataMap,
    limits: &LimitsConfig,
) -> Result<CheckRequest<'a>, ValidationError> {
    bounded("user_id", &request.user_id, limits.max_user_id_bytes, "max_user_id_bytes", true)?;
    bounded(
        "resource_path",
        &request.resource_path,
        limits.max_resource_path_bytes,
        "max_resource_path_bytes",
        true,
    )?;
    bounded(
        "client_type",
        &request.client_type,
        limits.max_client_type_bytes,
        "max_client_type_bytes",
        false,
    )?;
    if request.headers.len() > limits.max_headers {
        return Err(invalid(
            "headers",
            format!(
                "{} entries exceed the maximum of {} (limits.max_headers)",
                request.headers.len(),
                limits.max_headers
            ),
        ));
    }
    for (name, value) in &request.headers {
        if name.len() + value.len() > limits.max_header_bytes {
            return Err(invalid(
                "headers",
                format!(
                    "entry {name:?} is {} bytes (name + value), more than the maximum of {} (limits.max_header_bytes)",
                    name.len() + value.len(),
                    limits.max_header_bytes
                ),
            ));
        }
    }
    let priority = match pb::PriorityBucket::try_from(request.priority) {
        Ok(pb::PriorityBucket::Unspecified) => None,
        Ok(pb::PriorityBucket::Critical) => Some(Priority::Critical),
        Ok(pb::PriorityBucket::Degraded) => Some(Priority::Degraded),
        Ok(pb::PriorityBucket::BestEffort) => Some(Priority::BestEffort),
        Ok(pb::PriorityBucket::Bulk) => Some(Priority::Bulk),
        Err(_) => {
            return Err(invalid(
                "priority",
                format!(
                    "unknown value {}; expected 0 (PRIORITY_BUCKET_UNSPECIFIED), 1 (CRITICAL), 2 (DEGRADED), 3 (BEST_EFFORT) or 4 (BULK)",
                    request.priority
                ),
            ));
        }
    };
    Ok(CheckRequest {
        user_id: &request.user_id,
        resource_path: &request.resource_path,
        client_type: (!request.client_type.is_empty()).then_some(request.client_type.as_str()),
        weight: request.weight.max(1),
        priority,
        headers: &request.headers,
        // W3C trace context: the gRPC call's own metadata first, else a
        // `traceparent` the gateway forwarded among the request headers.
        trace_id: metadata
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .or_else(|| request.headers.get("traceparent").map(String::as_str))
            .and_then(trace_id_of),
    })
}

/// Builds the wire response for `decision`.
pub(crate) fn response(decision: Decision) -> pb::RateLimitResponse {
    let (rule_id, limit, capacity, window_ms) = match decision.rule {
        Some(rule) => (String::from(&*rule.id), rule.limit, rule.capacity, rule.window_ms),
        None => (String::new(), 0, 0, 0),
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
    }
}

fn reason(reason: Reason) -> pb::Reason {
    match reason {
        Reason::Ok => pb::Reason::Ok,
        Reason::OverLimit => pb::Reason::OverLimit,
        Reason::Shed => pb::Reason::Shed,
        Reason::NoRule => pb::Reason::NoRule,
        Reason::FailOpen => pb::Reason::FailOpen,
        Reason::FailClosed => pb::Reason::FailClosed,
        Reason::WeightExceedsCapacity => pb::Reason::WeightExceedsCapacity,
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

    fn error(mutate: impl FnOnce(&mut pb::RateLimitRequest)) -> String {
        let mut r = request();
        mutate(&mut r);
        validate(&r, &tonic::metadata::MetadataMap::new(), &LimitsConfig::default()).unwrap_err().to_string()
    }

    #[test]
    fn valid_request_borrows_and_defaults() {
        let r = request();
        let metadata = tonic::metadata::MetadataMap::new();
        let checked = validate(&r, &metadata, &LimitsConfig::default()).unwrap();
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
        let checked = validate(&r, &metadata, &LimitsConfig::default()).unwrap();
        assert_eq!(checked.trace_id, Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        let mut r = request();
        r.headers.insert("traceparent".to_owned(), traceparent.to_owned());
        let empty = tonic::metadata::MetadataMap::new();
        assert_eq!(
            validate(&r, &empty, &LimitsConfig::default()).unwrap().trace_id,
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
    }

    #[test]
    fn each_bound_names_field_and_limit() {
        assert_eq!(error(|r| r.user_id.clear()), "user_id: must not be empty");
        assert_eq!(error(|r| r.resource_path.clear()), "resource_path: must not be empty");
        assert_eq!(
            error(|r| r.user_id = "x".repeat(257)),
            "user_id: 257 bytes exceeds the maximum of 256 (limits.max_user_id_bytes)"
        );
        assert!(error(|r| r.resource_path = "/".repeat(2049)).contains("limits.max_resource_path_bytes"));
        assert!(error(|r| r.client_type = "c".repeat(65)).starts_with("client_type: 65 bytes"));
        assert!(error(|r| r.priority = 9).starts_with("priority: unknown value 9"));
        assert!(error(|r| r.priority = -1).starts_with("priority: unknown value -1"));
        assert!(
            error(|r| {
                for i in 0..65 {
                    r.headers.insert(format!("h{i}"), String::new());
                }
            })
            .starts_with("headers: 65 entries exceed the maximum of 64")
        );
        assert!(
            error(|r| {
                r.headers.insert("big".to_owned(), "v".repeat(9_000));
            })
            .starts_with("headers: entry \"big\"")
        );
    }

    mod properties {
        //! Property tests: any request is either converted or refused with a
        //! field-naming error, never a panic, and exactly the bounds decide.
        use proptest::prelude::*;

        use super::*;

        /// Small bounds, so generated values fall on both sides of each.
        fn limits() -> LimitsConfig {
            LimitsConfig {
                max_user_id_bytes: 16,
                max_resource_path_bytes: 32,
                max_client_type_bytes: 8,
                max_headers: 4,
                max_header_bytes: 24,
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

            #[test]
            fn validate_is_total_and_exactly_the_bounds_decide(
                user_id in "(?s).{0,20}",
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
                    user_id, resource_path, client_type, headers, priority, weight
                };
                let limits = limits();
                let within = !request.user_id.is_empty()
                    && request.user_id.len() <= limits.max_user_id_bytes
                    && !request.resource_path.is_empty()
                    && request.resource_path.len() <= limits.max_resource_path_bytes
                    && request.client_type.len() <= limits.max_client_type_bytes
                    && request.headers.len() <= limits.max_headers
                    && request.headers.iter().all(|(n, v)| n.len() + v.len() <= limits.max_header_bytes)
                    && (0..=4).contains(&request.priority);
                match validate(&request, &tonic::metadata::MetadataMap::new(), &limits) {
                    Ok(checked) => {
                        prop_assert!(within, "accepted out of bounds: {request:?}");
                        prop_assert_eq!(checked.user_id, request.user_id.as_str());
                        prop_assert_eq!(checked.weight, request.weight.max(1));
                        prop_assert_eq!(checked.client_type.is_none(), request.client_type.is_empty());
                    }
                    Err(error) => {
                        prop_assert!(!within, "refused within bounds: {error}");
                        prop_assert!(error.to_string().starts_with(error.field));
                    }
                }
            }
        }
    }
}
