//! Redis Cluster's slot map as the Redis store groups a batch by it: which
//! node serves each of the 16,384 slots, read from `CLUSTER SLOTS`.
//!
//! The map only decides which jobs share a script call; it never decides
//! where a call goes (redis-rs routes by its own map and follows MOVED/ASK)
//! nor whether a call is exact (a call that meets a key its node does not
//! serve fails before any write, and its jobs are sent again one call per
//! slot). A stale map therefore costs calls, never a wrong answer.

use redis::Value;

/// Slots in a Redis Cluster.
pub const SLOTS: usize = 16_384;

/// A slot no node serves (not in the map): its jobs go in calls of their own.
const UNSERVED: u16 = u16::MAX;

/// Which node serves each slot, as small numbers (the order nodes first
/// appear in the `CLUSTER SLOTS` answer).
#[derive(Clone, PartialEq, Eq)]
pub struct SlotMap {
    node: Box<[u16]>,
    nodes: usize,
}

impl std::fmt::Debug for SlotMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotMap").field("nodes", &self.nodes).finish_non_exhaustive()
    }
}

/// A `CLUSTER SLOTS` answer of an unexpected shape.
#[derive(Debug, thiserror::Error)]
#[error("unexpected CLUSTER SLOTS answer: {0}")]
pub struct SlotMapError(&'static str);

impl SlotMap {
    /// The map of a `CLUSTER SLOTS` answer: a list of `[start, end,
    /// [host, port, id, ...], replicas...]`. A node is its id (or, from a
    /// server too old to send one, its host and port).
    pub fn parse(answer: &Value) -> Result<SlotMap, SlotMapError> {
        let Value::Array(ranges) = answer else { return Err(SlotMapError("not a list")) };
        let mut node = vec![UNSERVED; SLOTS].into_boxed_slice();
        let mut names: Vec<Vec<u8>> = Vec::new();
        for range in ranges {
            let Value::Array(range) = range else { return Err(SlotMapError("a range is not a list")) };
            let [Value::Int(start), Value::Int(end), Value::Array(primary), ..] = range.as_slice() else {
                return Err(SlotMapError("a range is not [start, end, [primary], ...]"));
            };
            let name = match primary.as_slice() {
                [_, _, Value::BulkString(id), ..] => id.clone(),
                [Value::BulkString(host), Value::Int(port), ..] => {
                    let mut name = host.clone();
                    name.extend_from_slice(format!(":{port}").as_bytes());
                    name
                }
                _ => return Err(SlotMapError("a primary is not [host, port, ...]")),
            };
            let (Ok(start), Ok(end)) = (usize::try_from(*start), usize::try_from(*end)) else {
                return Err(SlotMapError("a negative slot"));
            };
            if start > end || end >= SLOTS {
                return Err(SlotMapError("a range outside 0-16383"));
            }
            let index = match names.iter().position(|n| *n == name) {
                Some(index) => index,
                None => {
                    names.push(name);
                    names.len() - 1
                }
            };
            let index = u16::try_from(index).map_err(|_| SlotMapError("more nodes than slots"))?;
            node[start..=end].fill(index);
        }
        Ok(SlotMap { node, nodes: names.len() })
    }

    /// The node serving `slot`, or `None` when none does.
    pub fn node(&self, slot: u16) -> Option<u16> {
        self.node.get(usize::from(slot)).copied().filter(|&n| n != UNSERVED)
    }

    /// How many nodes serve slots.
    pub fn nodes(&self) -> usize {
        self.nodes
    }
}

/// What a batch is grouped by: a job's node when the map knows it, else
/// its slot (a call of its own). Sorting by this key, then by slot, keeps
/// one node's jobs together and one slot's jobs together inside it.
pub fn group_key(map: Option<&SlotMap>, slot: u16) -> u32 {
    match map.and_then(|map| map.node(slot)) {
        Some(node) => u32::from(node),
        None => 1 << 16 | u32::from(slot),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(host: &str, port: i64, id: &str) -> Value {
        Value::Array(vec![
            Value::BulkString(host.as_bytes().to_vec()),
            Value::Int(port),
            Value::BulkString(id.as_bytes().to_vec()),
        ])
    }

    fn range(start: i64, end: i64, primary: Value) -> Value {
        Value::Array(vec![Value::Int(start), Value::Int(end), primary, node("10.0.0.9", 7000, "replica")])
    }

    #[test]
    fn ranges_map_to_their_primary() {
        let answer = Value::Array(vec![
            range(0, 5460, node("10.0.0.1", 7000, "a")),
            range(10_923, 16_383, node("10.0.0.3", 7000, "c")),
            range(5461, 10_000, node("10.0.0.2", 7000, "b")),
            // A node may serve several ranges: it stays one node.
            range(10_001, 10_922, node("10.0.0.1", 7000, "a")),
        ]);
        let map = SlotMap::parse(&answer).unwrap();
        assert_eq!(map.nodes(), 3);
        assert_eq!(
            [0, 5460, 5461, 10_000, 10_001, 10_922, 10_923, 16_383].map(|s| map.node(s)),
            [Some(0), Some(0), Some(2), Some(2), Some(0), Some(0), Some(1), Some(1)]
        );
        assert_eq!(group_key(Some(&map), 10_001), group_key(Some(&map), 3));
        assert_ne!(group_key(Some(&map), 16_000), group_key(Some(&map), 3));
    }

    #[test]
    fn unserved_slots_and_no_map_group_by_slot() {
        let map = SlotMap::parse(&Value::Array(vec![range(0, 99, node("h", 1, "a"))])).unwrap();
        assert_eq!(map.node(100), None);
        assert_ne!(group_key(Some(&map), 100), group_key(Some(&map), 101));
        assert_ne!(group_key(None, 5), group_key(None, 6));
        assert_eq!(group_key(None, 5), group_key(None, 5));
        // Never confused with a node number.
        assert_ne!(group_key(None, 0), group_key(Some(&map), 0));
    }

    #[test]
    fn a_node_without_an_id_is_its_address() {
        let old = |port| Value::Array(vec![Value::BulkString(b"h".to_vec()), Value::Int(port)]);
        let answer = Value::Array(vec![range(0, 1, old(1)), range(2, 3, old(2)), range(4, 5, old(1))]);
        let map = SlotMap::parse(&answer).unwrap();
        assert_eq!(map.nodes(), 2);
        assert_eq!(map.node(4), map.node(0));
    }

    #[test]
    fn malformed_answers_are_refused() {
        for bad in [
            Value::Int(1),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![Value::Int(0), Value::Int(16_384), node("h", 1, "a")])]),
            Value::Array(vec![Value::Array(vec![Value::Int(5), Value::Int(1), node("h", 1, "a")])]),
            Value::Array(vec![Value::Array(vec![Value::Int(-1), Value::Int(1), node("h", 1, "a")])]),
            Value::Array(vec![Value::Array(vec![Value::Int(0), Value::Int(1), Value::Array(vec![])])]),
        ] {
            assert!(SlotMap::parse(&bad).is_err(), "{bad:?}");
        }
    }
}
