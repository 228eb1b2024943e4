//! Global limits across regions (docs/global-limits.md): the region's side
//! of the leases the coordination store grants ([`crate::limiter::lease`]).
//!
//! Once per `global.interval_ms` every instance runs the global exchange
//! (a [`Participant`]):
//! 1. **With its region** ([`regional`], one script call to the regional
//!    store): it adds what it admitted and denied of each global key since
//!    its last exchange to the region's tallies, takes or renews the
//!    region's agent role (a key leased for `global.lease_ms`), and reads
//!    the grants the agent last wrote, which it enforces from then on.
//! 2. **As the region's agent**, when it holds the role: it drains the
//!    region's tallies, peeks at each active key's counter (what the region
//!    has admitted in the current window), reports every key of each limit
//!    to the coordination store in one round trip per limit, and writes
//!    the grants back to the region for the others to read.
//!
//! With the memory store the instance is the region and its own agent.
//!
//! The agent exchanges at the start of each interval, the other instances
//! half an interval later: they read the grants the agent wrote in the same
//! interval, and their tallies reach the next drain.
//!
//! Why a region never enforces more than the allocator counts it for: an
//! instance keeps a grant it read for at most two intervals (and never past
//! its lease), so a grant the agent wrote more than two intervals (and the
//! skew margin) ago is enforced nowhere. Each agent's write of the grants
//! has a version; each instance records in its region, with every read,
//! the oldest version it may still enforce (what it applied before, or
//! what it reads), and once it has applied what it read, that version. The
//! agent reports as what its region enforces the largest grant it wrote
//! since the oldest version another instance recorded in that time (the
//! grant in force at that version included), its own, and at least what
//! the region has admitted in the window. A new agent takes the role only
//! once the last one's has run out (a lease, longer than two intervals), so
//! no grant it does not know of is still enforced.

pub mod regional;
mod served;
mod settings;

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
    time::Duration,
};

use futures_util::future::{BoxFuture, join_all};

pub use served::Served;
pub use settings::{GlobalConfig, RegionConfig};

use crate::{
    limiter::{
        Algorithm, RedisStore, Store, StoreError,
        exchange::Participant,
        grants::{Grants, KeyTally, share},
        lease::{self, GlobalLimit, KeyReport, Lease, Reporter},
    },
    rules::{Hot, RuleStore, envoy::EnvoyConfig},
};

/// What the global exchange runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// This region's index in `global.regions`.
    pub region: usize,
    /// Every region's floor, parts per million of each limit.
    pub floors_ppm: Vec<u64>,
    /// `global.interval_ms`.
    pub interval_ms: u64,
    /// `global.lease_ms` and `global.skew_ms`.
    pub lease: Lease,
    /// How long a report to the coordination store may take (`global.timeout_ms`).
    pub timeout: Duration,
    /// How long a call to the regional store may take (`redis.timeout_ms`,
    /// at least 100 ms: these calls are off the request path).
    pub regional_timeout: Duration,
    /// Keys per limit reported at most (`global.max_keys`).
    pub max_keys: usize,
    /// How an Envoy limit counts when it names no algorithm (`envoy.algorithm`).
    pub envoy_algorithm: Algorithm,
    /// This instance's id (the agent role's holder).
    pub instance: String,
}

impl Settings {
    /// How long an instance keeps a grant it read: two intervals, so one
    /// failed read of the regional store does not drop it to its floor.
    pub fn hold_ms(&self) -> u64 {
        self.interval_ms.saturating_mul(2)
    }
}

/// One write of a key's grant by the agent: its version, the grant, and
/// when the write was done (ms of the monotonic clock; when it was taken,
/// until the write to the region returns): an instance may read a grant
/// until the next write of its key lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Write {
    version: u64,
    grant: u64,
    at: u64,
}

/// The grants the agent wrote of one key, oldest first: those still
/// possibly enforced; and what it last reported the region enforces.
#[derive(Debug, Default)]
struct Written {
    grants: VecDeque<Write>,
    reported: u64,
}

impl Written {
    /// Keeps the last and those replaced within `keep_ms` of `now`.
    fn trim(&mut self, now: u64, keep_ms: u64) {
        while self.grants.get(1).is_some_and(|next| next.at.saturating_add(keep_ms) < now) {
            self.grants.pop_front();
        }
    }

    /// The largest grant still possibly held by an instance that recorded
    /// version `oldest` or a later one: the last, and each one replaced
    /// within `within_ms` of `now` by a write of a version after `oldest`
    /// (an instance reads a grant until it is replaced, and keeps it for
    /// at most the hold).
    fn largest(&self, now: u64, within_ms: u64, oldest: u64) -> Option<u64> {
        let replaced = self.grants.iter().zip(self.grants.iter().skip(1));
        let held = replaced
            .filter(|(_, next)| next.version > oldest && next.at.saturating_add(within_ms) >= now)
            .map(|(w, _)| w.grant);
        held.chain(self.grants.back().map(|w| w.grant)).max()
    }
}

/// What the coordination store answered the agent for one limit: the keys
/// reported, their grants, and when the report was sent (ms of the
/// monotonic clock, where the lease starts).
struct Answered {
    keys: Vec<Box<str>>,
    /// What the region was reported to enforce, per key.
    enforcing: Vec<u64>,
    granted: lease::Granted,
    sent: u64,
}

/// The region's side of every global limit: a [`Participant`] of the
/// periodic exchanges.
#[derive(Debug)]
pub struct GlobalExchange {
    grants: Arc<Grants>,
    rules: Arc<RuleStore>,
    envoy: Option<Arc<Hot<EnvoyConfig>>>,
    store: Store,
    coordination: Arc<RedisStore>,
    settings: Settings,
    /// The deployment's id: kept in the regional store (one per region's
    /// store), this process's own with the memory store.
    deployment: Option<String>,
    /// The grants written, by limit and key (the agent's).
    written: HashMap<Arc<str>, HashMap<Box<str>, Written>>,
    /// The version of the grants this instance applied last.
    applied: Option<u64>,
    /// Whether this instance held the agent role at its last exchange.
    agent: bool,
    /// The hits of the last interval, by limit and key (the agent's): an
    /// instance's tallies may land in either of two intervals' drains, so
    /// demand is their mean.
    previous: HashMap<Arc<str>, HashMap<Box<str>, u64>>,
    status: Arc<status::GlobalStatus>,
}

pub mod status;

impl GlobalExchange {
    /// The exchange of the global limits of the native `rules` and the
    /// Envoy configuration `envoy`, decided against `store` (the region's),
    /// reported to `coordination`; grants go to `grants`, figures to `status`.
    pub fn new(
        grants: Arc<Grants>,
        (rules, envoy): (Arc<RuleStore>, Option<Arc<Hot<EnvoyConfig>>>),
        store: Store,
        coordination: Arc<RedisStore>,
        settings: Settings,
        status: Arc<status::GlobalStatus>,
    ) -> Self {
        let deployment = store.shared().is_none().then(|| crate::limiter::instance::id("memory"));
        GlobalExchange {
            grants,
            rules,
            envoy,
            store,
            coordination,
            settings,
            deployment,
            written: HashMap::new(),
            applied: None,
            agent: false,
            previous: HashMap::new(),
            status,
        }
    }

    /// One exchange: with the region, then, as its agent, with the
    /// coordination store.
    pub async fn run_once(&mut self) -> Result<(), StoreError> {
        let (native, envoy) = (self.rules.load(), self.envoy.as_ref().map(|e| e.load()));
        let served = Served::all(&native, envoy.as_deref(), self.settings.envoy_algorithm);
        self.forget_unserved(&served);
        self.prune(&served);
        if served.is_empty() {
            return Ok(());
        }
        let sent = self.grants.now_ms();
        let view = self.with_region(&served, sent).await?;
        self.enforce_written(&served, &view, sent);
        self.status.set_agent(view.agent);
        self.agent = view.agent;
        if view.agent { self.as_agent(&served, &view).await } else { self.applied(&view).await }
    }

    /// An instance that is not the agent says it applied what it read.
    async fn applied(&mut self, view: &regional::View) -> Result<(), StoreError> {
        self.applied = Some(view.version);
        let Some(redis) = self.store.shared() else { return Ok(()) };
        let (instance, timeout) = (&self.settings.instance, self.settings.regional_timeout);
        regional::applied(redis, instance, (view.version, view.now_ms), timeout).await
    }

    /// The agent's part: reports each limit's active keys and writes the
    /// grants back as the next version.
    async fn as_agent(&mut self, served: &[Served], view: &regional::View) -> Result<(), StoreError> {
        let version = view.version.saturating_add(1);
        let deployment = self.deployment.clone().unwrap_or_default();
        for (s, drained) in served.iter().zip(&view.tallies) {
            self.status.demand(&s.id, drained.values().map(|(a, d)| a.saturating_add(*d)).sum());
        }
        let reports = join_all(
            served
                .iter()
                .zip(&view.tallies)
                .map(|(s, drained)| self.agent_limit(s, drained, (&deployment, view.oldest_applied))),
        )
        .await;
        self.previous = served
            .iter()
            .zip(&view.tallies)
            .map(|(s, drained)| {
                let hits = drained.iter().map(|(k, (a, d))| (k.clone(), a.saturating_add(*d))).collect();
                (Arc::clone(&s.id), hits)
            })
            .collect();
        let mut written = Vec::new();
        let mut failure = None;
        for (s, result) in served.iter().zip(reports) {
            match result {
                Ok(Some(answer)) => written.push(self.take_grants(s, answer, (version, view.now_ms))),
                Ok(None) => {}
                Err(error) => {
                    if error.message.contains("REGION_CLAIMED") {
                        written.push(self.claimed(s, &error, view.now_ms));
                    }
                    self.status.answered(&s.id, Err(&error));
                    failure = Some(error);
                }
            }
        }
        self.write_back(version, &written).await?;
        failure.map_or(Ok(()), Err)
    }

    /// The agent writes `written` to its region as `version` (with the
    /// memory store, the instance has them already).
    async fn write_back(&mut self, version: u64, written: &[regional::Written]) -> Result<(), StoreError> {
        if written.is_empty() {
            return Ok(());
        }
        self.applied = Some(version);
        let result = match self.store.shared() {
            Some(redis) => {
                let (lease_ms, timeout) = (self.settings.lease.lease_ms, self.settings.regional_timeout);
                regional::write_grants(redis, (version, written), lease_ms, timeout).await
            }
            None => Ok(()),
        };
        self.landed(version);
        result
    }

    /// The write of `version` is done (or failed): its grants are read from
    /// now on, what they replace until now.
    fn landed(&mut self, version: u64) {
        let now = self.grants.now_ms();
        for write in self.written.values_mut().flat_map(|keys| keys.values_mut()) {
            if let Some(last) = write.grants.back_mut().filter(|w| w.version == version) {
                last.at = now;
            }
        }
    }

    /// Drops the tables, figures and history of limits no longer served,
    /// and notes the leases that ran out (logged once each).
    fn forget_unserved(&mut self, served: &[Served]) {
        let is_served = |id: &str| served.iter().any(|s| &*s.id == id);
        self.grants.retain(&is_served);
        self.status.retain(&is_served);
        self.written.retain(|id, _| is_served(id));
        for s in served {
            let floor = share(s.limit, self.settings.floors_ppm[self.settings.region]);
            if self.status.lease_ran_out(&s.id, floor) {
                tracing::warn!(
                    limit = %s.id,
                    region = self.status.region(),
                    "a global limit's lease ran out: the region enforces its floor for each key until new grants come"
                );
            }
        }
    }

    /// The exchange with the region (the memory store: the instance alone).
    async fn with_region(&mut self, served: &[Served], sent: u64) -> Result<regional::View, StoreError> {
        let tallies: Vec<Vec<KeyTally>> =
            served.iter().map(|s| self.grants.table(&s.id).take_tallies(sent)).collect();
        let Some(redis) = self.store.shared() else { return Ok(regional::View::alone(tallies, sent)) };
        let ids: Vec<&str> = served.iter().map(|s| &*s.id).collect();
        let call = regional::Call {
            instance: &self.settings.instance,
            applied: self.applied,
            role_ms: self.settings.lease.lease_ms,
            tally_ttl_ms: self.settings.interval_ms.saturating_mul(3),
            kept_ms: self.settings.hold_ms().saturating_add(self.settings.lease.skew_ms),
        };
        let view = regional::exchange(redis, call, &ids, &tallies, self.settings.regional_timeout).await?;
        self.deployment = Some(view.deployment.clone());
        Ok(view)
    }

    /// Every instance enforces what the agent last wrote, for at most two
    /// intervals from when it asked and never past the lease.
    fn enforce_written(&self, served: &[Served], view: &regional::View, sent: u64) {
        for (s, limit) in served.iter().zip(&view.grants) {
            if let Some(claimed) = limit.claimed.filter(|until| *until > view.now_ms) {
                self.grants.table(&s.id).claimed(sent.saturating_add(claimed - view.now_ms));
                continue;
            }
            let Some(until) = limit.until.filter(|until| *until > view.now_ms) else { continue };
            let left = until - view.now_ms;
            let table = self.grants.table(&s.id);
            let held = sent.saturating_add(left.min(self.settings.hold_ms()));
            for (key, grant) in &limit.grants {
                table.set_grant(key, *grant, held);
            }
            let total = limit.grants.iter().map(|(_, g)| *g).sum();
            self.status.granted(&s.id, total, limit.grants.len(), sent.saturating_add(left));
        }
    }

    /// The agent takes the grants of one limit as `version`: into its own
    /// table and the history of what it wrote; returns them for the region,
    /// leased from `region_now_ms` (the regional store's clock before the
    /// report was sent, so the lease ends there no later than the
    /// coordination store's).
    fn take_grants(
        &mut self,
        served: &Served,
        answer: Answered,
        (version, region_now_ms): (u64, u64),
    ) -> regional::Written {
        let Answered { keys, enforcing, granted, sent } = answer;
        let id = &served.id;
        self.status.answered(id, Ok(()));
        let hold = self.settings.lease.lease_ms.min(self.settings.hold_ms());
        let table = self.grants.table(id);
        let history = self.written.entry(Arc::clone(id)).or_default();
        for ((key, grant), reported) in keys.iter().zip(&granted.grants).zip(enforcing) {
            table.set_grant(key, *grant, sent.saturating_add(hold));
            let written = history.entry(key.clone()).or_default();
            written.grants.push_back(Write { at: sent, version, grant: *grant });
            written.reported = reported;
        }
        let total = granted.grants.iter().sum();
        self.status.granted(id, total, keys.len(), sent.saturating_add(self.settings.lease.lease_ms));
        regional::Written {
            limit: Arc::clone(id),
            until: region_now_ms.saturating_add(self.settings.lease.lease_ms),
            grants: keys.into_iter().zip(granted.grants).collect(),
            claimed: false,
        }
    }

    /// The coordination store refused the region's report of `served`:
    /// another deployment holds the region. The region enforces nothing of
    /// the limit for a lease (renewed with each refusal): two deployments
    /// under one name would each enforce the region's floor and grants.
    /// Returns what tells the region's other instances.
    fn claimed(&self, served: &Served, error: &StoreError, region_now_ms: u64) -> regional::Written {
        let lease_ms = self.settings.lease.lease_ms;
        let table = self.grants.table(&served.id);
        let now = self.grants.now_ms();
        if !table.is_claimed(now) {
            tracing::warn!(
                limit = %served.id,
                region = self.status.region(),
                %error,
                "another deployment holds this region at the coordination store: enforcing zero for the global limit until it lets go (two deployments under one region name would each enforce its share)"
            );
        }
        // Zero is never more than the region is counted for: held a whole lease.
        table.claimed(now.saturating_add(lease_ms));
        regional::Written {
            limit: Arc::clone(&served.id),
            until: region_now_ms.saturating_add(lease_ms),
            grants: Vec::new(),
            claimed: true,
        }
    }

    /// The agent's report of one limit: its active keys (with demand, or a
    /// grant above the floor to give back), each with what the region
    /// enforces and has admitted; `None` when no key is active. `oldest`:
    /// the oldest version of the grants another instance may enforce.
    async fn agent_limit(
        &self,
        served: &Served,
        drained: &HashMap<Box<str>, (u64, u64)>,
        (deployment, oldest): (&str, Option<u64>),
    ) -> Result<Option<Answered>, StoreError> {
        let floors: Vec<u64> = self.settings.floors_ppm.iter().map(|ppm| share(served.limit, *ppm)).collect();
        let floor = floors[self.settings.region];
        let keys = self.active_keys(served, drained, floor);
        if keys.is_empty() {
            return Ok(None);
        }
        let reports = self.key_reports(served, &keys, (floor, oldest)).await;
        let sent = self.grants.now_ms();
        let limit = GlobalLimit {
            id: &served.id,
            limit: served.limit,
            floors: &floors,
            linger_ms: lease::linger_ms(&served.window),
        };
        let reporter = Reporter { region: self.settings.region, deployment };
        let (timing, timeout) = (self.settings.lease, self.settings.timeout);
        let granted = lease::report(&self.coordination, limit, reporter, timing, &reports, timeout).await?;
        let enforcing = reports.iter().map(|r| r.enforcing).collect();
        Ok(Some(Answered { keys: keys.into_iter().map(|(k, _)| k).collect(), enforcing, granted, sent }))
    }

    /// The keys of `served` to report, busiest first, at most `max_keys`:
    /// those with demand (`drained`), and those the region holds or last
    /// said it enforces above its `floor` (until it has given them back);
    /// each with its demand in the limit's terms (the mean of the last two
    /// intervals' hits, at that rate over a window).
    fn active_keys(
        &self,
        served: &Served,
        drained: &HashMap<Box<str>, (u64, u64)>,
        floor: u64,
    ) -> Vec<(Box<str>, u64)> {
        let previous = self.previous.get(&served.id);
        let per_window = |key: &str, hits: u64| {
            let before = previous.and_then(|p| p.get(key)).copied().unwrap_or(hits);
            let mean = (u128::from(hits) + u128::from(before)).div_ceil(2);
            let scaled =
                mean * u128::from(served.window.window_ms) / u128::from(self.settings.interval_ms.max(1));
            u64::try_from(scaled).unwrap_or(u64::MAX)
        };
        let mut keys: Vec<(Box<str>, u64)> =
            drained.iter().map(|(k, (a, d))| (k.clone(), per_window(k, a.saturating_add(*d)))).collect();
        if let Some(history) = self.written.get(&served.id) {
            for (key, written) in history {
                let holds_more = written.reported > floor || written.grants.iter().any(|w| w.grant > floor);
                if holds_more && !drained.contains_key(key) {
                    keys.push((key.clone(), 0));
                }
            }
        }
        keys.sort_unstable_by_key(|(_, demand)| std::cmp::Reverse(*demand));
        keys.truncate(self.settings.max_keys);
        keys
    }

    /// Each key's report: what the region may still enforce (the agent's
    /// grant in force and the largest another instance may hold: the last
    /// written and those replaced within the hold by a version after the
    /// `oldest` another recorded; never less than it has admitted), what it
    /// has admitted (its counter peeked at) and its demand.
    async fn key_reports(
        &self,
        served: &Served,
        keys: &[(Box<str>, u64)],
        (floor, oldest): (u64, Option<u64>),
    ) -> Vec<KeyReport> {
        let (now, table, history) =
            (self.grants.now_ms(), self.grants.table(&served.id), self.written.get(&served.id));
        let margin = self.settings.lease.skew_ms;
        let hold = self.settings.hold_ms().saturating_add(margin);
        let linger = hold.saturating_add(lease::linger_ms(&served.window));
        // Per key: the grant in force, the largest held within the hold
        // (what an instance may still enforce) and the linger after it (what
        // the counter may still hold: a window counts hits, so the most the
        // limit can be reads it exactly; a bucket's tokens are read at the
        // largest capacity it had; for a key this agent wrote nothing of,
        // that most).
        let enforced: Vec<(u64, Option<u64>, u64)> = keys
            .iter()
            .map(|(key, _)| {
                let written = history.and_then(|h| h.get(key));
                let in_force = table.limit(key, floor, now);
                let held = written.zip(oldest).and_then(|(w, oldest)| w.largest(now, hold, oldest));
                let counted = match (served.window.algorithm, written.and_then(|w| w.largest(now, linger, 0)))
                {
                    (Algorithm::SlidingWindow | Algorithm::FixedWindow | Algorithm::FirstHitWindow, _)
                    | (_, None) => served.most,
                    (_, Some(largest)) => largest.max(in_force),
                };
                (in_force, held, counted)
            })
            .collect();
        let used = join_all(keys.iter().zip(&enforced).map(|((key, _), &(_, _, peek))| async move {
            served.admitted(&self.store, key, peek).await.unwrap_or(peek)
        }))
        .await;
        keys.iter()
            .zip(enforced.iter().zip(used))
            .map(|((key, demand), (&(in_force, held, _), admitted))| {
                let enforcing = in_force.max(held.unwrap_or(0)).max(admitted);
                KeyReport { key: key.to_string(), enforcing, admitted, demand: *demand }
            })
            .collect()
    }

    /// Drops what neither an instance may still enforce nor a counter may
    /// still hold: grants written before the hold and the limit's linger
    /// (and the margin), but each key's last; and keys whose last grant's
    /// lease and linger have run out.
    fn prune(&mut self, served: &[Served]) {
        let now = self.grants.now_ms();
        let margin = self.settings.lease.skew_ms;
        for s in served {
            let Some(keys) = self.written.get_mut(&s.id) else { continue };
            let linger = lease::linger_ms(&s.window);
            let keep = self.settings.hold_ms().saturating_add(linger).saturating_add(margin);
            let expired = self.settings.lease.lease_ms.saturating_add(linger).saturating_add(margin);
            keys.retain(|_, written| {
                written.trim(now, keep);
                written.grants.back().is_some_and(|w| w.at.saturating_add(expired) >= now)
            });
        }
    }
}

impl Participant for GlobalExchange {
    fn name(&self) -> &'static str {
        "global"
    }

    fn holding(&self) -> &'static str {
        "each global key keeps its grant until its lease runs out, then its region's floor"
    }

    fn due(&mut self, now_ms: u64) -> u64 {
        let phase = if self.agent { 0 } else { self.settings.interval_ms / 2 };
        crate::limiter::exchange::next_aligned(now_ms, self.settings.interval_ms, phase)
    }

    fn exchange(&mut self, _now_ms: u64) -> BoxFuture<'_, Option<Result<(), StoreError>>> {
        Box::pin(async move { Some(self.run_once().await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(writes: &[(u64, u64, u64)]) -> Written {
        let grants = writes.iter().map(|&(version, grant, at)| Write { version, grant, at }).collect();
        Written { grants, reported: 0 }
    }

    #[test]
    fn a_grant_counts_until_the_others_applied_what_replaced_it_or_the_hold_ran_out() {
        // 900 at version 1, replaced at 1,000 ms by 100 (version 2), then
        // by 50 (version 3) at 2,000 ms; a hold of 2,500 ms.
        let w = written(&[(1, 900, 0), (2, 100, 1_000), (3, 50, 2_000)]);
        assert_eq!(w.largest(2_100, 2_500, 1), Some(900), "an instance still at version 1");
        assert_eq!(w.largest(2_100, 2_500, 2), Some(100), "all applied 2: 900 is enforced nowhere");
        assert_eq!(w.largest(2_100, 2_500, 3), Some(50), "all applied the last");
        assert_eq!(w.largest(3_600, 2_500, 1), Some(100), "900 was replaced more than a hold ago");
        assert_eq!(w.largest(10_000, 2_500, 0), Some(50), "the last always counts");
        // A version the region never saw written (a failed write) replaces
        // nothing an instance read: what it read before still counts.
        let failed = written(&[(4, 700, 0), (5, 10, 1_000), (5, 20, 2_000)]);
        assert_eq!(failed.largest(2_100, 2_500, 4), Some(700));
        assert_eq!(failed.largest(2_100, 2_500, 5), Some(20));
    }

    #[test]
    fn trimming_keeps_what_was_replaced_within_the_time_and_the_last() {
        let mut w = written(&[(1, 900, 0), (2, 100, 1_000), (3, 50, 5_000)]);
        w.trim(3_000, 2_500);
        assert_eq!(w.grants.len(), 3, "900 was replaced at 1,000 ms: kept until 3,500");
        w.trim(3_600, 2_500);
        assert_eq!(w.grants.iter().map(|w| w.grant).collect::<Vec<_>>(), [100, 50]);
        w.trim(100_000, 2_500);
        assert_eq!(w.grants.iter().map(|w| w.grant).collect::<Vec<_>>(), [50], "the last stays");
    }
}
