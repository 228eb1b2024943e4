//! Envoy's Rate Limit Quota Service (RLQS): each Envoy decides the requests
//! of a bucket itself, against an assignment, and reports the bucket's
//! usage; this module shares each bucket's limit out among the Envoys
//! reporting it, by demand.
//!
//! The limit of a bucket comes from the Envoy rules (its id matched like a
//! descriptor: `api::rlqs`). Its Envoys are holders of the limit as regions
//! are of a global limit, and [`lease::allocate`] shares it out: each
//! report is answered with the reporter's share, max-min fair over the
//! holders' demands, never above the limit less what every other holder
//! may still be enforcing (its share while its assignment's time to live
//! and the skew run, and a window more while what it admitted weighs).
//! A share lowered reaches another Envoy only once the Envoy that held it
//! reports again (it then enforces the lower one) or its assignment has
//! expired. The limit shared out is the bucket's less the bursts the
//! Envoys' buckets may add when an assignment changes ([`strategy`]).
//!
//! The shares are this instance's: every Envoy of a bucket reports to one
//! instance for them to sum within the limit.

pub mod strategy;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use serde::{Deserialize, Serialize};

use crate::{
    clock::Clock,
    limiter::lease::{self, Lease, RegionState, Report},
};

/// `rlqs.*`: Envoy's Rate Limit Quota Service, served beside
/// `ShouldRateLimit` when Envoy rules are configured.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RlqsConfig {
    /// How long an assignment holds without a new report (ms), Envoy's
    /// `assignment_time_to_live`: several of the Envoys' report intervals
    /// (Envoy 1.40 reports about every 5 s).
    pub assignment_ttl_ms: u64,
    /// How long past its end an assignment is still counted as enforced
    /// (ms): Envoy's clock drift over one.
    pub skew_ms: u64,
    /// A bucket an Envoy has not reported for this long is abandoned (ms):
    /// the Envoy forgets it until its next request.
    pub abandon_after_ms: u64,
    /// RLQS streams open at once, every Envoy's together; one more is
    /// refused with RESOURCE_EXHAUSTED.
    pub max_streams: usize,
    /// Buckets one stream may hold; the buckets it reports beyond get no
    /// assignment (Envoy applies their `no_assignment_behavior`).
    pub max_buckets_per_stream: usize,
    /// Buckets shared out at once, every stream's together; beyond, a new
    /// bucket gets no assignment until an idle one is forgotten.
    pub max_buckets: usize,
}

impl Default for RlqsConfig {
    fn default() -> Self {
        RlqsConfig {
            assignment_ttl_ms: 20_000,
            skew_ms: 1_000,
            abandon_after_ms: 60_000,
            max_streams: 1_024,
            max_buckets_per_stream: 1_000,
            max_buckets: 100_000,
        }
    }
}

/// A bucket: its domain and its id's entries, sorted by key and joined.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BucketKey {
    /// The domain the Envoy reports in.
    pub domain: Arc<str>,
    /// `key=value` entries sorted by key, separated by `\u{1f}`.
    pub id: Box<str>,
}

/// What an Envoy reported of a bucket since its last report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Requests it let through.
    pub allowed: u64,
    /// Requests it refused.
    pub denied: u64,
    /// Over how long (ms; Envoy reports whole seconds, 0 read as 1 s).
    pub elapsed_ms: u64,
}

/// One bucket's limit and its holders.
#[derive(Debug)]
struct Shared {
    /// Requests per window.
    limit: u64,
    /// The window (ms).
    window_ms: u64,
    /// Each holder's stream, by index into `states`.
    holders: Vec<u64>,
    /// Each holder's state, as the allocator keeps a region's.
    states: Vec<RegionState>,
}

/// The shares of every bucket, on this instance.
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

    /// The clock's reading (Unix ms).
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<BucketKey, Shared>> {
        // A panic mid-update leaves plain integers: still meaningful.
        self.table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes `holder`'s report of `usage` of bucket `key`, limited to
    /// `limit` per window of `window_s` seconds, and answers its share for
    /// the next assignment's time to live; `None` when the bucket is new
    /// and [`RlqsConfig::max_buckets`] are shared out.
    pub fn share(
        &self,
        holder: u64,
        key: &BucketKey,
        (limit, window_s): (u64, u64),
        usage: Usage,
    ) -> Option<u64> {
        let now_ms = self.clock.now_ms();
        let window_ms = window_s.max(1).saturating_mul(1_000);
        let mut table = self.lock();
        if !table.contains_key(key) && table.len() >= self.settings.max_buckets {
            self.forget_idle(&mut table, now_ms);
            if table.len() >= self.settings.max_buckets {
                return None;
            }
        }
        let shared = table.entry(key.clone()).or_insert_with(|| Shared {
            limit,
            window_ms,
            holders: Vec::new(),
            states: Vec::new(),
        });
        // A rule changed: shared out anew under the new limit, what the
        // holders may still enforce counted as it is.
        (shared.limit, shared.window_ms) = (limit, window_ms);
        self.forget_lapsed(shared, holder, now_ms);
        let index = match shared.holders.iter().position(|h| *h == holder) {
            Some(index) => index,
            None => {
                shared.holders.push(holder);
                shared.states.push(RegionState::new(0));
                shared.holders.len() - 1
            }
        };
        let per_window = |count: u64| {
            let elapsed = usage.elapsed_ms.max(1_000);
            u64::try_from(u128::from(count) * u128::from(window_ms) / u128::from(elapsed)).unwrap_or(u64::MAX)
        };
        let enforcing = shared.states[index].offered;
        let report = Report {
            region: index,
            enforcing,
            admitted: per_window(usage.allowed).min(enforcing),
            demand: per_window(usage.allowed.saturating_add(usage.denied)),
        };
        let timing = self.lease().lingering(window_ms);
        let room = shareable(limit, shared.holders.len());
        Some(lease::allocate(&mut shared.states, room, report, now_ms, timing, false).grant)
    }

    /// The lease every assignment is made under.
    fn lease(&self) -> Lease {
        Lease { lease_ms: self.settings.assignment_ttl_ms, skew_ms: self.settings.skew_ms }
    }

    /// Forgets the holders of `shared` (but `reporter`) that may enforce
    /// nothing any more: their assignment, its skew and a window have run
    /// out.
    fn forget_lapsed(&self, shared: &mut Shared, reporter: u64, now_ms: u64) {
        let (skew, linger) = (self.settings.skew_ms, shared.window_ms);
        let mut i = 0;
        while i < shared.holders.len() {
            if shared.holders[i] != reporter && lapsed(&shared.states[i], now_ms, skew, linger) {
                shared.holders.swap_remove(i);
                shared.states.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Forgets every bucket no holder may still enforce.
    fn forget_idle(&self, table: &mut HashMap<BucketKey, Shared>, now_ms: u64) {
        let skew = self.settings.skew_ms;
        table.retain(|_, shared| shared.states.iter().any(|s| !lapsed(s, now_ms, skew, shared.window_ms)));
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

/// Whether a holder may enforce nothing any more, nor want anything: its
/// assignment, the skew and what it admitted under it (`linger_ms`) have
/// run out.
fn lapsed(state: &RegionState, now_ms: u64, skew_ms: u64, linger_ms: u64) -> bool {
    now_ms >= state.lease_until_ms.saturating_add(skew_ms).saturating_add(linger_ms)
}

/// What of `limit` is shared out among `holders`: the limit less the
/// bursts their buckets may add in a window whose assignment changes
/// (a fiftieth of a share and one token each, [`strategy::burst`]).
pub fn shareable(limit: u64, holders: usize) -> u64 {
    limit.saturating_sub(limit / strategy::BURST_DIVISOR + holders as u64)
}

#[cfg(test)]
mod tests;
