//! Listing a group's counters: `SCAN … MATCH` on the node that serves the
//! group's hash slot (every key of a group shares its tag), bounded in
//! calls and keys.

use redis::{
    Value,
    cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr},
};

use super::{
    RedisStore,
    backend::{Conn, classify},
    dispatch::timeout_error,
    key_slot,
};
use crate::limiter::{FailureKind, Listed, StoreError};

/// The most `SCAN` calls one listing makes: with [`SCAN_COUNT`], a
/// listing examines at most a million keys of the node, whatever it holds.
pub const MAX_SCAN_CALLS: usize = 1_000;

/// The `COUNT` hint of each `SCAN` call: keys Redis examines per call.
pub const SCAN_COUNT: usize = 1_000;

impl RedisStore {
    /// See [`Store::list`](crate::limiter::Store::list).
    pub(crate) async fn list(&self, group: &str, prefix: &str, max: usize) -> Result<Listed, StoreError> {
        let mut stem = String::new();
        self.push_group_stem(&mut stem, group);
        let mut pattern = String::with_capacity(stem.len() + prefix.len() + 8);
        glob_escape_into(&mut pattern, &stem);
        glob_escape_into(&mut pattern, prefix);
        pattern.push('*');
        let slot = key_slot(&stem);
        let mut conn = self.side_connection().await?;
        let listed = self.scan(&mut conn, slot, &pattern, &stem, max).await;
        self.keep(conn, listed.is_ok());
        listed
    }

    async fn scan(
        &self,
        conn: &mut Conn,
        slot: u16,
        pattern: &str,
        stem: &str,
        max: usize,
    ) -> Result<Listed, StoreError> {
        let mut keys = Vec::new();
        let mut cursor = 0u64;
        for _ in 0..MAX_SCAN_CALLS {
            let mut call = redis::cmd("SCAN");
            call.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(SCAN_COUNT);
            let answer = match conn {
                Conn::Single(conn) => {
                    tokio::time::timeout(self.timeout, call.query_async(conn.connection())).await
                }
                Conn::Cluster(conn) => {
                    let node = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                    tokio::time::timeout(
                        self.timeout,
                        conn.route_command(call, RoutingInfo::SingleNode(node)),
                    )
                    .await
                }
            };
            let answer: Value = answer.map_err(|_| timeout_error(self.timeout))?.map_err(|e| classify(&e))?;
            let (next, found): (u64, Vec<Vec<u8>>) = redis::from_redis_value(answer).map_err(|e| {
                StoreError { kind: FailureKind::Other, message: format!("SCAN answered {e}") }
            })?;
            for key in found {
                // Another program's key under the stem that is not UTF-8 is none of ours.
                let Some(key) = std::str::from_utf8(&key).ok().and_then(|k| k.strip_prefix(stem)) else {
                    continue;
                };
                if keys.len() == max {
                    return Ok(Listed { keys, complete: false });
                }
                keys.push(key.to_owned());
            }
            if next == 0 {
                // SCAN may return a key twice (a rehash during the scan).
                keys.sort_unstable();
                keys.dedup();
                return Ok(Listed { keys, complete: true });
            }
            cursor = next;
        }
        keys.sort_unstable();
        keys.dedup();
        Ok(Listed { keys, complete: false })
    }
}

/// Appends `text` with the characters `SCAN`'s glob gives a meaning to
/// (`*`, `?`, `[`, `]`, `\`) escaped, so a namespace or a prefix matches
/// only itself.
fn glob_escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_characters_match_only_themselves() {
        let mut pattern = String::new();
        glob_escape_into(&mut pattern, "rle2:{a*b?[c]\\d}:");
        assert_eq!(pattern, "rle2:{a\\*b\\?\\[c\\]\\\\d}:");
    }
}
