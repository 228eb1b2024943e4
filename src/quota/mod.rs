//! Envoy's Rate Limit Quota Service (RLQS): each Envoy decides the requests
//! of a bucket itself, against an assignment, and reports the bucket's
//! usage; this module shares each bucket's limit out among the Envoys
//! reporting it, by demand.
//!
//! The limit of a bucket comes from the Envoy rules (its id matched like a
//! descriptor: `api::rlqs`). Its Envoys are holders of the limit as regions
//! are of a global limit, and [`allot`] shares it out with the global
//! limits' allocator ([`lease::allocate`]): each report is answered with
//! the reporter's share, max-min fair over the holders' demands, never
//! above the limit less what every other holder may still be enforcing
//! (its share while its assignment's time to live and the skew run, and a
//! window more while what it admitted weighs). A share lowered reaches
//! another Envoy only once the Envoy that held it reports again (it then
//! enforces the lower one) or its assignment has expired. The limit shared
//! out is the bucket's less the bursts the Envoys' buckets may add when an
//! assignment changes ([`strategy`]).
//!
//! Where the holders are kept ([`Quotas`]): with the Redis store, in it
//! ([`store`], `quota.lua`, the twin of [`allot`]), so every instance's
//! Envoys share one bound, and a `global: true` limit's in the
//! coordination store, so every region's do; with the memory store, in
//! this instance ([`local`]).

pub mod figures;
pub mod local;
pub mod store;
pub mod strategy;

use std::{collections::BTreeMap, sync::Arc};

use serde::{Deserialize, Serialize};

pub use figures::QuotaFigures;
pub use local::BucketShares;

pub use store::QuotaStore;

use crate::limiter::{
    StoreError,
    lease::{self, Lease, Lingering, RegionState, Report},
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
    /// (ms): the answer's way to the Envoy and its clock's drift over one.
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
    /// Bucket reports one stream is answered per second (a message of `n`
    /// buckets counts `n`, up to `max_buckets_per_stream` at once); a
    /// faster stream's messages are read later, HTTP/2's flow control
    /// holding its Envoy back. Bounds the store calls (one per bucket
    /// report) at this × `max_streams` a second.
    pub max_bucket_reports_per_second: u64,
    /// Buckets shared out at once by this instance with the memory store,
    /// every stream's together; beyond, a new bucket gets no assignment
    /// until an idle one is forgotten. (With Redis each bucket's holders
    /// expire in the store; what an instance holds is bounded by
    /// `max_streams` × `max_buckets_per_stream`.)
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
            max_bucket_reports_per_second: 1_000,
            max_buckets: 100_000,
        }
    }
}

impl RlqsConfig {
    /// The lease every assignment is made under.
    pub fn lease(&self) -> Lease {
        Lease { lease_ms: self.assignment_ttl_ms, skew_ms: self.skew_ms }
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

/// The most any count is taken as: exact in the store's arithmetic
/// (doubles), and far above any limit (at most `u32::MAX` a window).
pub const MOST: u64 = 1 << 52;

impl Usage {
    /// `count` of this usage scaled to a window of `window_ms`.
    fn per_window(&self, count: u64, window_ms: u64) -> u64 {
        let elapsed = self.elapsed_ms.max(1_000);
        let scaled = u128::from(count) * u128::from(window_ms) / u128::from(elapsed);
        u64::try_from(scaled).unwrap_or(u64::MAX).min(MOST)
    }

    /// The holder's report of this usage, in requests per window of
    /// `window_ms`: it enforces `assigned` (its assignment from this
    /// stream, while it lives), or, when the stream knows of none, what it
    /// shows it admits per window (an Envoy keeps an assignment through a
    /// broken stream); it admitted `admitted` in the window ([`Recent`]).
    pub fn holding(&self, assigned: Option<u64>, admitted: u64, window_ms: u64) -> Holding {
        let enforcing =
            assigned.map_or_else(|| self.per_window(self.allowed, window_ms), |share| share.min(MOST));
        Holding {
            enforcing,
            admitted: admitted.min(MOST),
            demand: self.per_window(self.allowed.saturating_add(self.denied), window_ms),
        }
    }
}

/// Reports of a bucket a holder's window remembers at most; beyond, the
/// two oldest are merged (kept as long as the newer would be).
pub const RECENT_REPORTS: usize = 16;

/// One report a holder's window remembers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Remembered {
    /// When it was received (ms).
    at: u64,
    /// What it allowed.
    allowed: u64,
    /// Over how long before `at` (ms).
    elapsed_ms: u64,
    /// The share the holder enforced over that time, when known.
    enforced: Option<u64>,
}

/// What a holder admitted of a bucket in its recent reports: each report
/// covers the time up to its arrival, so one received within the last
/// window counts toward what the holder admitted in it: whole when all its
/// time is in the window; when only its last part is, at most what the
/// share it enforced could admit in that part (two bursts, the part's
/// share of the refill and a token: [`strategy`]), or whole when the share
/// is unknown. An Envoy reports every few seconds, a window may be far
/// longer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recent {
    reports: std::collections::VecDeque<Remembered>,
}

impl Recent {
    /// Adds a report of `allowed` over `elapsed_ms` received at `now_ms`,
    /// the holder enforcing `enforced` meanwhile (if known), and answers
    /// what the holder admitted in the window of `window_ms` ending now.
    pub fn add(
        &mut self,
        now_ms: u64,
        (allowed, elapsed_ms): (u64, u64),
        enforced: Option<u64>,
        window_ms: u64,
    ) -> u64 {
        self.reports.retain(|r| now_ms.saturating_sub(r.at) < window_ms);
        if self.reports.len() >= RECENT_REPORTS
            && let Some(oldest) = self.reports.pop_front()
            && let Some(next) = self.reports.front_mut()
        {
            next.allowed = next.allowed.saturating_add(oldest.allowed);
            next.elapsed_ms = next.at.saturating_sub(oldest.at.saturating_sub(oldest.elapsed_ms));
            next.enforced = next.enforced.zip(oldest.enforced).map(|(a, b)| a.max(b));
        }
        self.reports.push_back(Remembered { at: now_ms, allowed, elapsed_ms, enforced });
        let start = now_ms.saturating_sub(window_ms);
        self.reports.iter().fold(0u64, |sum, r| {
            let counted = match r.enforced {
                Some(share) if r.at.saturating_sub(r.elapsed_ms) < start => {
                    let part = r.at - start;
                    let refill = u128::from(share) * u128::from(part) / u128::from(window_ms.max(1));
                    let most = 2 * strategy::burst(share) + u64::try_from(refill).unwrap_or(u64::MAX) + 1;
                    r.allowed.min(most)
                }
                _ => r.allowed,
            };
            sum.saturating_add(counted)
        })
    }
}

/// One holder's report of a bucket, requests per window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// The share it enforces as it reports.
    pub enforcing: u64,
    /// What it admitted.
    pub admitted: u64,
    /// What it admitted and denied.
    pub demand: u64,
}

/// A bucket's limit: requests per window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketLimit {
    /// Requests per window.
    pub limit: u64,
    /// The window (ms).
    pub window_ms: u64,
}

impl BucketLimit {
    /// `limit` per window of `window_s` seconds (at least one).
    pub fn new(limit: u64, window_s: u64) -> Self {
        BucketLimit { limit: limit.min(MOST), window_ms: window_s.max(1).saturating_mul(1_000) }
    }
}

/// Takes `reporter`'s report `holding` of a bucket limited by `limit`,
/// whose holders are `holders` (by id: sorted, which orders ties), at
/// `now_ms`, and answers its share for the next assignment. Holders that
/// may enforce nothing any more are forgotten first. Twin: `quota.lua`.
pub fn allot(
    holders: &mut BTreeMap<Arc<str>, RegionState>,
    reporter: &Arc<str>,
    limit: BucketLimit,
    holding: Holding,
    (now_ms, lease): (u64, Lease),
) -> u64 {
    let timing = lease.lingering(limit.window_ms);
    holders.retain(|holder, state| holder == reporter || !lapsed(state, now_ms, timing));
    holders.entry(Arc::clone(reporter)).or_insert_with(|| RegionState::new(0));
    let mut states: Vec<RegionState> = holders.values().copied().collect();
    let region = holders.keys().position(|holder| holder == reporter).unwrap_or_default();
    let report =
        Report { region, enforcing: holding.enforcing, admitted: holding.admitted, demand: holding.demand };
    let room = shareable(limit.limit, states.len());
    let grant = lease::allocate(&mut states, room, report, now_ms, timing, false).grant;
    holders.insert(Arc::clone(reporter), states[region]);
    grant
}

/// Whether a holder may enforce nothing any more, nor want anything: its
/// assignment, the skew and what it admitted under it (a window) have run
/// out.
fn lapsed(state: &RegionState, now_ms: u64, timing: Lingering) -> bool {
    let Lingering { lease, linger_ms } = timing;
    now_ms >= state.lease_until_ms.saturating_add(lease.skew_ms).saturating_add(linger_ms)
}

/// What of `limit` is shared out among `holders`: the limit less the
/// bursts their buckets may add in a window whose assignment changes
/// (a fiftieth of a share and one token each, [`strategy::burst`]).
pub fn shareable(limit: u64, holders: usize) -> u64 {
    limit.saturating_sub(limit / strategy::BURST_DIVISOR + holders as u64)
}

/// Where the holders of the buckets are kept: in the Redis store (or this
/// instance, with the memory store); a `global: true` limit's in the
/// coordination store when the deployment shares limits with other
/// regions.
#[derive(Debug)]
pub struct Quotas {
    local: BucketShares,
    regional: Option<QuotaStore>,
    coordination: Option<QuotaStore>,
    figures: Arc<QuotaFigures>,
}

/// One bucket's report, for [`Quotas::shares`].
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    /// The bucket.
    pub key: &'a BucketKey,
    /// Its limit.
    pub limit: BucketLimit,
    /// Whether the limit is `global: true`.
    pub global: bool,
    /// The holder's report.
    pub holding: Holding,
}

impl Quotas {
    /// Holders kept in `regional` (the counters' Redis store; `None`: in
    /// `local`), a global limit's in `coordination` if any.
    pub fn new(local: BucketShares, regional: Option<QuotaStore>, coordination: Option<QuotaStore>) -> Self {
        Quotas { local, regional, coordination, figures: Arc::new(QuotaFigures::new()) }
    }

    /// The streams' figures, by domain (`/metrics`, status reports).
    pub fn figures(&self) -> &Arc<QuotaFigures> {
        &self.figures
    }

    /// The settings.
    pub fn settings(&self) -> &RlqsConfig {
        self.local.settings()
    }

    /// The holder `holder`'s reports of the buckets `asked` (one domain's),
    /// answered each bucket's share, in order: `None` for a bucket this
    /// instance has no room for (`rlqs.max_buckets`, memory store). A store
    /// that cannot answer answers nothing for its buckets: the Envoy's
    /// assignments live out their time to live.
    pub async fn shares(
        &self,
        holder: &Arc<str>,
        asked: &[Asked<'_>],
    ) -> Result<Vec<Option<u64>>, StoreError> {
        let mut out = vec![None; asked.len()];
        // A global limit's holders are kept in the coordination store, if
        // any; the others' in the regional store, or in this instance.
        let (globals, regionals): (Vec<usize>, Vec<usize>) =
            (0..asked.len()).partition(|i| asked[*i].global && self.coordination.is_some());
        for (store, part) in [(self.regional.as_ref(), regionals), (self.coordination.as_ref(), globals)] {
            if part.is_empty() {
                continue;
            }
            let Some(store) = store else {
                for i in part {
                    let a = &asked[i];
                    out[i] = self.local.share(holder, a.key, a.limit, a.holding);
                }
                continue;
            };
            let reports: Vec<Asked<'_>> = part.iter().map(|i| asked[*i]).collect();
            let shares = store::shares(store, self.settings(), holder, &reports).await?;
            for (i, share) in part.into_iter().zip(shares) {
                out[i] = Some(share);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod local_tests;
