//! The buckets' holders in this instance: what the memory store shares
//! out, every Envoy of a bucket reporting to this instance. Like the memory
//! store's counters, they are forgotten when the process ends.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, MutexGuard},
};

use super::{BucketKey, BucketLimit, Holding, RlqsConfig, allot, lapsed};
use crate::{clock::Clock, limiter::lease::RegionState};

/// One bucket's limit and its holders.
#[derive(Debug)]
pub(super) struct Shared {
    /// The limit it was last shared out under.
    pub(super) limit: BucketLimit,
    /// Each holder's state, by its id.
    pub(super) holders: BTreeMap<Arc<str>, RegionState>,
}

/// The shares of every bucket, in this instance.
#[derive(Debug)]
pub struct BucketShares {
    settings: RlqsConfig,
    clock: Arc<dyn Clock>,
    table: Mutex<HashMap<BucketKey, Shared>>,
}

impl BucketShares {
    /// No bucket shared yet.
    pub fn new(settings: RlqsConfig, clock: Arc<dyn Clock>) -> Self {
        BucketShares { settings, clock, table: Mutex::new(HashMap::new()) }
    }

    /// The settings.
    pub fn settings(&self) -> &RlqsConfig {
        &self.settings
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, HashMap<BucketKey, Shared>> {
        // A panic mid-update leaves plain integers: still meaningful.
        self.table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes `holder`'s report `holding` of bucket `key`, limited by
    /// `limit`, and answers its share for the next assignment's time to
    /// live; `None` when the bucket is new and [`RlqsConfig::max_buckets`]
    /// are shared out.
    pub fn share(
        &self,
        holder: &Arc<str>,
        key: &BucketKey,
        limit: BucketLimit,
        holding: Holding,
    ) -> Option<u64> {
        let now_ms = self.clock.now_ms();
        let mut table = self.lock();
        if !table.contains_key(key) && table.len() >= self.settings.max_buckets {
            self.forget_idle(&mut table, now_ms);
            if table.len() >= self.settings.max_buckets {
                return None;
            }
        }
        let shared = table.entry(key.clone()).or_insert_with(|| Shared { limit, holders: BTreeMap::new() });
        // A rule changed: shared out anew under the new limit, what the
        // holders may still enforce counted as it is.
        shared.limit = limit;
        Some(allot(&mut shared.holders, holder, limit, holding, (now_ms, self.settings.lease())))
    }

    /// Forgets every bucket no holder may still enforce.
    fn forget_idle(&self, table: &mut HashMap<BucketKey, Shared>, now_ms: u64) {
        let lease = self.settings.lease();
        table.retain(|_, shared| {
            let timing = lease.lingering(shared.limit.window_ms);
            shared.holders.values().any(|s| !lapsed(s, now_ms, timing))
        });
    }

    /// How many buckets are shared out.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no bucket is shared out.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
