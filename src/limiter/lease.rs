//! The arithmetic of a global limit's grants (docs/design.md §7c): how one
//! limit is shared by several regions, each deciding against its own store
//! at its **grant**, so that the grants any region may still be enforcing
//! never sum above the limit, whatever the lag.
//!
//! Every interval each region reports, per global limit and key, the grant
//! it enforces, what it admitted in the current window and its demand (what
//! it admitted and denied over the last interval). [`allocate`] answers with
//! its new grant and lease, from the state of every region:
//! - what a region **may be enforcing** ([`RegionState::held`]): while its
//!   lease (plus the clock-skew margin) runs, the larger of the grant last
//!   offered and the one it last confirmed; once it has run out, its floor
//!   (the region itself falls to its floor when its lease runs out, measured
//!   from when it sent its report, which is never later than the store's
//!   clock says), but only once what it admitted under its grant has left
//!   its counters too (the limit's **linger**: two windows for a sliding
//!   window, one for a fixed one, a full refill for a bucket);
//! - the **target**: max-min fair shares of the limit over the regions'
//!   demands above their floors (a region whose lease ran out wants
//!   nothing), what no region wants shared equally;
//! - the new grant: the target, but never above the limit less what every
//!   other region may be enforcing, and never below the region's floor.
//!   A region's report says what it enforces, never less than what it has
//!   admitted in the window, and it is counted as holding that until a
//!   later report says less: lowering a grant never revokes admitted
//!   traffic nor hands it to another region, and a region with demand
//!   cannot keep a grant above its share just by using it.
//!
//! Why the bound holds: before a report, the regions' held grants sum to at
//! most the limit. The reporting region enforces at most what it held; its
//! new grant is at most the limit less the others' held grants; so after the
//! report it holds at most that, and the sum still fits. Time only lowers
//! what the others hold (a lease runs out to a floor). Capacity a region
//! gives up therefore reaches another region only once it has confirmed the
//! lower grant, or its lease has run out.

use std::time::Duration;

use super::{RedisStore, StoreError, push_encoded, scripts};

/// The coordination store's memory of the global limit `limit_id`: when it
/// began to remember its leases (`<prefix>rlg:{<limit_id>}`). Missing, it
/// has lost them, and for one lease and margin no grant grows.
pub fn memory_key(prefix: &str, limit_id: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 6 + limit_id.len());
    out.push_str(prefix);
    out.push_str("rlg:{");
    push_encoded(&mut out, limit_id, &['{', '}']);
    out.push('}');
    out
}

/// The coordination store's hash of `key` of the global limit `limit_id`,
/// under `prefix`: `<prefix>rlg:{<limit_id>}:<key>`. The hash tag is the
/// limit's (with `%`, `{` and `}` percent-encoded), so a call for every key
/// of one limit stays in one cluster slot.
pub fn lease_key(prefix: &str, limit_id: &str, key: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 7 + limit_id.len() + key.len());
    out.push_str(prefix);
    out.push_str("rlg:{");
    push_encoded(&mut out, limit_id, &['{', '}']);
    out.push_str("}:");
    out.push_str(key);
    out
}

/// One global limit as a region reports it: its id (the hash tag), the
/// limit, every region's floor, by region index, and its linger.
#[derive(Debug, Clone, Copy)]
pub struct GlobalLimit<'a> {
    /// The limit's id: a rule id or an Envoy full key.
    pub id: &'a str,
    /// What all regions together may admit.
    pub limit: u64,
    /// Each region's floor.
    pub floors: &'a [u64],
    /// How long what a region admitted weighs in its counters ([`linger_ms`]).
    pub linger_ms: u64,
}

/// How long an admission weighs in a counter of `window` (ms): until a
/// sliding window's next window ends (two windows; a slot in flight at the
/// latest then), a fixed or first-hit
/// window ends (one), a bucket has refilled its capacity.
pub fn linger_ms(window: &super::window::WindowParams) -> u64 {
    use super::window::Algorithm;
    match window.algorithm {
        // A slot in flight weighs until given back, two windows at most.
        Algorithm::SlidingWindow | Algorithm::Concurrency => window.window_ms.saturating_mul(2),
        Algorithm::FixedWindow | Algorithm::FirstHitWindow => window.window_ms,
        Algorithm::TokenBucket | Algorithm::Gcra => {
            let rate = window.rate.max(1);
            window.capacity.saturating_mul(window.window_ms).div_ceil(rate)
        }
    }
}

/// One key's report: the key, the grant the region enforces, what it
/// admitted in the window and its demand over the interval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyReport {
    /// The key (a user, a tenant, a descriptor's counter).
    pub key: String,
    /// The grant the region enforces as it reports.
    pub enforcing: u64,
    /// Admitted in the current window.
    pub admitted: u64,
    /// Admitted and denied over the last interval.
    pub demand: u64,
}

/// What the coordination store answered a report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    /// The store's clock when it decided (ms).
    pub now_ms: u64,
    /// Each key's grant, in the reports' order; each leased for
    /// `lease_ms` from when the report was sent.
    pub grants: Vec<u64>,
}

/// Who reports: a region's index and its deployment's id (one deployment
/// per region name: another's report is refused while it holds a lease).
#[derive(Debug, Clone, Copy)]
pub struct Reporter<'a> {
    /// The region's index in `global.regions`.
    pub region: usize,
    /// The deployment's id, kept in its regional store.
    pub deployment: &'a str,
}

/// Keys per script call of a report: a call runs alone in the store, so a
/// limit with many active keys is reported in several calls (pipelined,
/// one round trip), each short enough not to hold up other regions'
/// reports.
pub const KEYS_PER_CALL: usize = 500;

/// A region's reports of `limit`'s keys to the coordination store `store`:
/// one call of [`scripts::LEASE`] ([`allocate`] in the coordination
/// store; their keys share the limit's hash tag) per [`KEYS_PER_CALL`]
/// keys, pipelined, within `timeout`. The hashes expire
/// two leases (and margins and lingers) after the last report of any
/// region, when every lease they hold has run out.
pub async fn report(
    store: &RedisStore,
    limit: GlobalLimit<'_>,
    reporter: Reporter<'_>,
    lease: Lease,
    reports: &[KeyReport],
    timeout: Duration,
) -> Result<Granted, StoreError> {
    let calls: Vec<scripts::Call> = reports
        .chunks(KEYS_PER_CALL)
        .map(|chunk| lease_call(store.key_prefix(), limit, reporter, lease, chunk))
        .collect();
    let answers: Vec<Vec<u64>> = store
        .scripts(&calls, timeout)
        .await?
        .into_iter()
        .map(redis::from_redis_value)
        .collect::<Result<_, _>>()
        .map_err(|e| StoreError {
            kind: super::FailureKind::ScriptError,
            message: format!("the lease script answered {e}"),
        })?;
    let mut granted = Granted { now_ms: 0, grants: Vec::with_capacity(reports.len()) };
    for (answer, chunk) in answers.iter().zip(reports.chunks(KEYS_PER_CALL)) {
        match answer.split_first() {
            Some((now_ms, grants)) if grants.len() == chunk.len() => {
                granted.now_ms = granted.now_ms.max(*now_ms);
                granted.grants.extend_from_slice(grants);
            }
            _ => {
                return Err(StoreError {
                    kind: super::FailureKind::ScriptError,
                    message: format!(
                        "the lease script answered {} values for {} keys",
                        answer.len(),
                        chunk.len()
                    ),
                });
            }
        }
    }
    Ok(granted)
}

/// The call of [`scripts::LEASE`] for `reports` (see the script for its
/// arguments).
fn lease_call(
    prefix: &str,
    limit: GlobalLimit<'_>,
    reporter: Reporter<'_>,
    lease: Lease,
    reports: &[KeyReport],
) -> scripts::Call {
    let mut call = scripts::LEASE.call();
    // Beside the memory, in its hash slot; no key's lease key ends its tag with `!`.
    let mut claims = memory_key(prefix, limit.id);
    claims.push_str("!claims");
    call.arg(2 + reports.len()).arg(memory_key(prefix, limit.id)).arg(claims);
    for r in reports {
        call.arg(lease_key(prefix, limit.id, &r.key));
    }
    call.arg(reporter.region).arg(reporter.deployment).arg(limit.floors.len()).arg(limit.floors);
    let ttl_ms =
        lease.lease_ms.saturating_add(lease.skew_ms).saturating_add(limit.linger_ms).saturating_mul(2);
    call.arg(limit.limit).arg(lease.lease_ms).arg(lease.skew_ms).arg(limit.linger_ms).arg(ttl_ms);
    for r in reports {
        call.arg(r.enforcing).arg(r.admitted).arg(r.demand);
    }
    call
}

/// What the allocator keeps of one region, for one global limit and key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegionState {
    /// The region's floor (`global.regions`): its grant before its first,
    /// for a key it has no grant for, and after its lease runs out.
    pub floor: u64,
    /// The grant last offered to it.
    pub offered: u64,
    /// The grant it last said it enforces.
    pub confirmed: u64,
    /// Until when (the store's clock, ms) it may enforce `offered`: its
    /// lease; 0 before its first report.
    pub lease_until_ms: u64,
    /// Its demand over its last reported interval: admitted and denied.
    pub demand: u64,
}

impl RegionState {
    /// A region that has never reported: at its floor.
    pub fn new(floor: u64) -> Self {
        RegionState { floor, offered: floor, confirmed: floor, ..RegionState::default() }
    }

    /// The most its counters may hold at `now_ms` (the store's clock): its
    /// grants while its lease runs (trusted `skew_ms` past its end) and
    /// what it admitted under them lingers (`linger_ms` more), then its floor.
    pub fn held(&self, now_ms: u64, skew_ms: u64, linger_ms: u64) -> u64 {
        if now_ms < self.lease_until_ms.saturating_add(skew_ms).saturating_add(linger_ms) {
            self.offered.max(self.confirmed).max(self.floor)
        } else {
            self.floor
        }
    }
}

/// One region's report for one global limit and key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Which region: an index into the regions' states.
    pub region: usize,
    /// The grant it enforces as it reports.
    pub enforcing: u64,
    /// What it has admitted in the current window.
    pub admitted: u64,
    /// Admitted and denied over its last interval.
    pub demand: u64,
}

/// The timing a grant is leased under (`global.lease_ms`, the skew margin)
/// and how long a limit's admissions linger in its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// How long a grant holds without a new report.
    pub lease_ms: u64,
    /// How long past its end the allocator still counts a lease as held:
    /// the clock rates of the store and the regions may differ by this much
    /// over a lease.
    pub skew_ms: u64,
}

impl Lease {
    /// The same lease for a limit whose admissions linger `linger_ms`.
    pub fn lingering(self, linger_ms: u64) -> Lingering {
        Lingering { lease: self, linger_ms }
    }
}

/// A lease and how long the limit's admissions linger in its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lingering {
    /// The lease.
    pub lease: Lease,
    /// [`linger_ms`] of the limit.
    pub linger_ms: u64,
}

/// What [`allocate`] answers a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The grant the region enforces from the answer on.
    pub grant: u64,
    /// The lease the store granted it, on the store's clock (the region
    /// keeps it for `lease_ms` from when it sent its report).
    pub lease_until_ms: u64,
}

/// Max-min fair shares of `limit` over the regions: each its floor, then
/// what is left shared equally among those that want more, none given more
/// than it wants, and what nobody wants shared equally among all (so a
/// burst in any region finds room). The shares sum to exactly `limit` when
/// the floors fit in it; ties go to the lower index.
pub fn fair_shares(limit: u64, floors: &[u64], demands: &[u64]) -> Vec<u64> {
    let mut shares: Vec<u64> = floors.to_vec();
    let mut left = limit.saturating_sub(floors.iter().sum());
    // What each region wants above its floor.
    let mut wants: Vec<u64> = demands.iter().zip(floors).map(|(d, f)| d.saturating_sub(*f)).collect();
    loop {
        let wanting: Vec<usize> = (0..wants.len()).filter(|&i| wants[i] > 0).collect();
        if wanting.is_empty() || left == 0 {
            break;
        }
        let n = wanting.len() as u64;
        let even = left / n;
        if even == 0 {
            // Fewer units than regions wanting them: one each, in order.
            for &i in wanting.iter().take(left as usize) {
                shares[i] += 1;
                wants[i] -= 1;
            }
            left = 0;
            break;
        }
        for &i in &wanting {
            let given = even.min(wants[i]);
            shares[i] += given;
            wants[i] -= given;
            left -= given;
        }
    }
    if left > 0 && !shares.is_empty() {
        let n = shares.len() as u64;
        let (even, extra) = (left / n, (left % n) as usize);
        for (i, share) in shares.iter_mut().enumerate() {
            *share += even + u64::from(i < extra);
        }
    }
    shares
}

/// Takes `report` into `regions` at `now_ms` (the store's clock) and
/// answers the reporting region's new grant for a limit of `limit`. While
/// `amnesia` (the store lost its leases less than a lease and margin ago),
/// no grant grows above what its region enforces, or its floor.
pub fn allocate(
    regions: &mut [RegionState],
    limit: u64,
    report: Report,
    now_ms: u64,
    timing: Lingering,
    amnesia: bool,
) -> Grant {
    let Lingering { lease, linger_ms } = timing;
    let r = report.region;
    {
        let mine = &mut regions[r];
        mine.demand = report.demand;
        // What it enforces now is what it may be enforcing until the answer
        // reaches it, and its counter holds at least what it admitted.
        mine.confirmed = report.enforcing.max(report.admitted);
    }
    let others: u64 = regions
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != r)
        .map(|(_, s)| s.held(now_ms, lease.skew_ms, linger_ms))
        .sum();
    let room = limit.saturating_sub(others);
    let floors: Vec<u64> = regions.iter().map(|s| s.floor).collect();
    // A region whose lease ran out wants nothing until it reports again.
    let live = |i: usize, s: &RegionState| i == r || now_ms < s.lease_until_ms.saturating_add(lease.skew_ms);
    let demands: Vec<u64> =
        regions.iter().enumerate().map(|(i, s)| if live(i, s) { s.demand } else { 0 }).collect();
    let target = fair_shares(limit, &floors, &demands)[r];
    let mine = &mut regions[r];
    let mut grant = target.max(mine.floor).min(room);
    if amnesia {
        grant = grant.min(mine.floor.max(report.enforcing));
    }
    mine.offered = grant;
    mine.lease_until_ms = now_ms.saturating_add(lease.lease_ms);
    Grant { grant, lease_until_ms: mine.lease_until_ms }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const LEASE: Lease = Lease { lease_ms: 3_000, skew_ms: 500 };
    /// What admissions linger: a fixed window of a second.
    const LINGER: u64 = 1_000;

    #[test]
    fn fair_shares_follow_demand_above_the_floors() {
        // All demand in one region: it gets all but the others' floors.
        assert_eq!(fair_shares(1_000, &[50, 50, 50], &[5_000, 0, 0]), [900, 50, 50]);
        // 60/30/10 of a demand that exceeds the limit: max-min fair.
        assert_eq!(fair_shares(1_000, &[50, 50, 50], &[600, 300, 100]), [600, 300, 100]);
        assert_eq!(fair_shares(1_000, &[50, 50, 50], &[6_000, 3_000, 100]), [450, 450, 100]);
        // Nobody wants it: shared equally.
        assert_eq!(fair_shares(1_000, &[0, 0, 0], &[0, 0, 0]), [334, 333, 333]);
        assert_eq!(fair_shares(10, &[0, 0, 0], &[5, 5, 5]), [4, 3, 3]);
    }

    #[test]
    fn capacity_moves_only_after_the_holder_confirms_or_its_lease_runs_out() {
        let mut regions = [RegionState::new(50), RegionState::new(50), RegionState::new(50)];
        let report = |region, enforcing, admitted, demand| Report { region, enforcing, admitted, demand };
        // A wants everything and gets all but the others' floors.
        let a = allocate(&mut regions, 1_000, report(0, 50, 0, 5_000), 0, LEASE.lingering(LINGER), false);
        assert_eq!(a.grant, 900);
        // Demand moves to B: B cannot take A's capacity while A may enforce it.
        let b = allocate(&mut regions, 1_000, report(1, 50, 0, 5_000), 1_000, LEASE.lingering(LINGER), false);
        assert_eq!(b.grant, 50);
        // A reports no demand and has admitted 200 this window: lowered to
        // its floor (it admits no more until its counter is under it)...
        let a = allocate(&mut regions, 1_000, report(0, 900, 200, 0), 2_000, LEASE.lingering(LINGER), false);
        assert_eq!(a.grant, 50);
        // ...but until A confirms, B still finds no room.
        let b = allocate(&mut regions, 1_000, report(1, 50, 0, 5_000), 2_100, LEASE.lingering(LINGER), false);
        assert_eq!(b.grant, 50);
        // A confirms the lower grant, its counter still holding 200: B gets
        // the rest.
        allocate(&mut regions, 1_000, report(0, 50, 200, 0), 3_000, LEASE.lingering(LINGER), false);
        let b = allocate(&mut regions, 1_000, report(1, 50, 0, 5_000), 3_100, LEASE.lingering(LINGER), false);
        assert_eq!(b.grant, 750);
        // A goes silent: once its lease and the margin run out, its grant is
        // its floor, and B's next report takes the rest.
        let b = allocate(
            &mut regions,
            1_000,
            report(1, 750, 0, 5_000),
            6_000 + 500 + 999,
            LEASE.lingering(LINGER),
            false,
        );
        assert_eq!(b.grant, 750, "A's lease is still trusted, or what it admitted lingers");
        let b = allocate(
            &mut regions,
            1_000,
            report(1, 750, 0, 5_000),
            6_000 + 500 + 1_000,
            LEASE.lingering(LINGER),
            false,
        );
        assert_eq!(b.grant, 900);
    }

    /// One region as it runs: the grant it enforces and until when (its own
    /// clock), and the answer on its way to it, if any.
    #[derive(Debug, Clone, Copy)]
    struct Running {
        grant: u64,
        until_ms: u64,
        floor: u64,
    }

    impl Running {
        fn enforcing(&self, now_ms: u64) -> u64 {
            if now_ms < self.until_ms { self.grant } else { self.floor }
        }
    }

    proptest! {
        /// Whatever the order of reports, their delays, lost answers and
        /// the store losing its memory, what the regions enforce never sums
        /// above the limit.
        #[test]
        fn what_the_regions_enforce_never_sums_above_the_limit(
            floors in proptest::collection::vec(0u64..100, 2..5),
            steps in proptest::collection::vec(
                (0usize..4, 0u64..2_000, 0u64..3_000, 0u64..400, any::<bool>(), 0u64..1_500, 0u8..10),
                1..80,
            ),
        ) {
            let limit = 1_000;
            prop_assume!(floors.iter().sum::<u64>() <= limit);
            let mut regions: Vec<RegionState> = floors.iter().map(|f| RegionState::new(*f)).collect();
            let mut running: Vec<Running> =
                floors.iter().map(|f| Running { grant: *f, until_ms: 0, floor: *f }).collect();
            let (mut now, mut store_now) = (0u64, 0u64);
            // The store starts with no memory, and may lose it again.
            let mut remembering = 0u64;
            for (region, demand, admitted, delay, lost, advance, forget) in steps {
                let region = region % floors.len();
                now += advance;
                let sent = now;
                let mine = running[region];
                let enforcing = mine.enforcing(sent);
                let admitted = admitted.min(enforcing);
                let report = Report { region, enforcing, admitted, demand };
                // The store takes reports in the order they arrive, after
                // the one-way delay, by its clock.
                store_now = (sent + delay).max(store_now);
                if forget == 0 {
                    regions = floors.iter().map(|f| RegionState::new(*f)).collect();
                    remembering = store_now;
                }
                let amnesia = store_now < remembering + LEASE.lease_ms + LEASE.skew_ms;
                let answer = allocate(&mut regions, limit, report, store_now, LEASE.lingering(LINGER), amnesia);
                if !lost {
                    // The region keeps the lease from when it sent the report.
                    running[region] = Running { grant: answer.grant, until_ms: sent + LEASE.lease_ms, ..mine };
                }
                // Check at the moment the answer arrives and a little later.
                for t in [sent + 2 * delay, sent + 2 * delay + 700] {
                    let total: u64 = running.iter().map(|r| r.enforcing(t)).sum();
                    prop_assert!(total <= limit, "{total} > {limit} at {t}: {running:?} {regions:?}");
                }
            }
        }
    }
}
