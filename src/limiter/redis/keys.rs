//! Counter keys and their Cluster hash slots.

/// Redis Cluster's slot of a key: CRC16 (XMODEM) of its hash tag (between
/// the first `{` and the next `}`, when not empty), else of the whole key,
/// modulo 16384. Every key of one job shares a hash tag.
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let len = bytes[open + 1..].iter().position(|&b| b == b'}')?;
            (len > 0).then(|| &bytes[open + 1..open + 1 + len])
        })
        .unwrap_or(bytes);
    crc16::State::<crc16::XMODEM>::calculate(hashed) % 16_384
}

/// `<prefix>rl2:{<user_id>}:<rule_id>`, built in one allocation. The hash
/// tag keeps all of a user's counters in one Redis Cluster slot.
pub fn counter_key(prefix: &str, user_id: &str, rule_id: &str) -> String {
    let mut key = String::with_capacity(prefix.len() + 7 + user_id.len() + rule_id.len());
    key.push_str(prefix);
    key.push_str("rl2:{");
    push_tag(&mut key, user_id);
    key.push_str("}:");
    key.push_str(rule_id);
    key
}

/// Appends `text` as a hash tag's content with `%`, `{` and `}`
/// percent-encoded: Redis takes the tag from the first `{` to the next `}`,
/// so a raw brace in a user id or a domain would cut the tag short, or
/// empty it (then the whole key is hashed, and one Envoy job's keys could
/// land in different cluster slots). Encoded, the tag is the whole value.
pub(super) fn push_tag(key: &mut String, text: &str) {
    crate::limiter::push_encoded(key, text, &['{', '}']);
}
