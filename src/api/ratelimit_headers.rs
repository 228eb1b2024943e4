//! The standard rate-limit fields of draft-ietf-httpapi-ratelimit-headers
//! (revision 11): `RateLimit-Policy`, every quota policy a request met
//! (`"daily";q=1000;w=86400`), and `RateLimit`, where the binding one stands
//! (`"daily";r=12;t=3600`). Both are Structured Field Lists (RFC 8941) of
//! Items whose value is a String naming the policy: the limit's `name`,
//! else its full key (`domain.key_value`), a further limit of a descriptor
//! (`also`) that key with `#1`, `#2`, …; printable ASCII only, each other
//! byte written as `_`, `"` and `\` escaped.

use std::fmt::Write as _;

use crate::{decision::DescriptorDecision, rules::envoy::EnvoyLimit};

/// The quota policies field.
pub const POLICY_FIELD: &str = "RateLimit-Policy";

/// The current service limit field.
pub const RATELIMIT_FIELD: &str = "RateLimit";

/// The two fields' values for a decision of `statuses` whose binding
/// descriptor is `statuses[tightest]`: its limit `bound` in `RateLimit`,
/// and every limit of every descriptor that has one, each once, in
/// `RateLimit-Policy`. `None` when the binding descriptor has no limit in
/// a window (unlimited, or no rule).
pub fn fields(statuses: &[DescriptorDecision], tightest: usize) -> Option<(String, String)> {
    let binding = &statuses[tightest];
    let limit = binding.limit.as_deref().filter(|_| !binding.unlimited)?;
    limit.window_seconds()?;
    let mut policies = String::new();
    let mut listed: Vec<String> = Vec::new();
    for status in statuses.iter().filter(|s| !s.unlimited) {
        let Some(limit) = status.limit.as_deref() else { continue };
        for (index, one) in std::iter::once(limit).chain(limit.also.iter().map(|a| &**a)).enumerate() {
            let Some(window) = one.window_seconds() else { continue };
            let id = policy_id(limit, index);
            if listed.contains(&id) {
                continue;
            }
            if !policies.is_empty() {
                policies.push_str(", ");
            }
            let _ = write!(policies, "{id};q={};w={window}", one.per_unit());
            listed.push(id);
        }
    }
    let reset_s = binding.until_reset_ms.div_ceil(1_000);
    let current = format!("{};r={};t={reset_s}", policy_id(limit, binding.bound), binding.remaining);
    Some((policies, current))
}

/// Limit `index` of the descriptor limited by `limit` (0: itself), named as
/// a Structured Field String.
fn policy_id(limit: &EnvoyLimit, index: usize) -> String {
    let base = limit.name.as_deref().unwrap_or(&limit.full_key);
    let mut id = String::with_capacity(base.len() + 4);
    id.push('"');
    for byte in base.bytes() {
        match byte {
            b'"' | b'\\' => {
                id.push('\\');
                id.push(char::from(byte));
            }
            0x20..=0x7e => id.push(char::from(byte)),
            _ => id.push('_'),
        }
    }
    if index > 0 {
        let _ = write!(id, "#{index}");
    }
    id.push('"');
    id
}
