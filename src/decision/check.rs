//! The native decision ([`Engine::check`]: `Check`, a peek, a `Report`):
//! one request, one rule, one counter per user, or with the rule's `also`
//! limits one all-or-nothing job of a counter per limit; and when the store
//! cannot decide, the rule's failure policy (`local`: the local limiter at
//! this instance's share; `open`; `closed`), flagged, with one
//! [`FailedDecision`] for the dead-letter sink.

use std::{borrow::Cow, collections::HashMap, sync::Arc};

use super::reservation::{Reservation, Reserved};
use super::{
    Api, Engine, FAIL_CLOSED_RETRY_MS, FailedDecision, Reason, TenantSource, clamp_i64, keys,
    pipeline::Subject,
};
use crate::rules::prices::{COST, Cost, Prices};
use crate::{
    limiter::{
        CallerCalls, Count, FailureKind, ManyItem, ManyOutcome, Shares, StoreError, Verdict,
        adaptive::Reported,
    },
    overload::{Kind, OverloadVerdict},
    rules::{FailurePolicy, Mode, Rule, Snapshot},
    shed::{Level, Priority},
};

/// The retry time of a denial while another deployment holds the region
/// of a global limit (its hold lasts a lease from its last refusal).
const CLAIMED_RETRY_MS: i64 = 1_000;

/// The usage of a request that states none (only its weight).
pub static NO_USAGE: std::sync::LazyLock<HashMap<String, u64>> = std::sync::LazyLock::new(HashMap::new);

/// A validated request. Borrows from the wire message: no copies.
#[derive(Debug, Clone, Copy)]
pub struct CheckRequest<'a> {
    /// The counting dimension (non-empty, bounded).
    pub user_id: &'a str,
    /// Matched against the rules (non-empty, bounded).
    pub resource_path: &'a str,
    /// `None` when the caller did not say.
    pub client_type: Option<&'a str>,
    /// Cost, at least 1: what a limit of requests counts.
    pub weight: u32,
    /// What a limit of another unit counts, by unit (`usage`); a unit not
    /// named counts nothing.
    pub usage: &'a HashMap<String, u64>,
    /// `IfFits`: a `Check`; `Never`: a `Check` with `peek` (nothing is
    /// counted); `Always`: a `Report` (counted whatever is left).
    pub count: Count,
    /// `None`: the matched rule's priority.
    pub priority: Option<Priority>,
    /// Request headers (copied into failure records by allow-list).
    pub headers: &'a HashMap<String, String>,
    /// W3C trace id from the call's `traceparent`, if any.
    pub trace_id: Option<&'a str>,
    /// The caller's shares of the store's in-flight work; `None`: unbounded.
    pub share: Option<&'a CallerCalls>,
    /// A `Report` of how `weight` checked requests went downstream: fed to
    /// the rule's adaptive limit, nothing counted, no store call.
    pub outcome: Option<Reported>,
    /// The caller may report outcomes and give slots in flight back
    /// (`grpc.reporting_peers`): a `Report` of a rule of requests in flight
    /// from any other caller is answered as a peek, nothing given back.
    pub may_report: bool,
    /// A `Check` that reserves: when admitted on a rule that counts a job,
    /// its answer carries a reservation id to settle.
    pub reserve: bool,
    /// A `Report` that settles this reservation (from a caller that may
    /// report).
    pub reservation: Option<&'a Reservation>,
}

impl<'a> CheckRequest<'a> {
    /// A `Check` of weight 1 by `user_id` on `resource_path` with
    /// `headers`, from a caller that may report, stating nothing else (no
    /// client type, priority, usage, trace, share, outcome or
    /// reservation): the other fields are set with `..`.
    pub fn new(user_id: &'a str, resource_path: &'a str, headers: &'a HashMap<String, String>) -> Self {
        CheckRequest {
            user_id,
            resource_path,
            client_type: None,
            weight: 1,
            usage: &NO_USAGE,
            count: Count::IfFits,
            priority: None,
            headers,
            trace_id: None,
            share: None,
            outcome: None,
            may_report: true,
            reserve: false,
            reservation: None,
        }
    }
}

/// What the matched rule says about itself in a response.
#[derive(Debug, Clone)]
pub struct RuleInfo {
    /// The rule id.
    pub id: Arc<str>,
    /// Requests per window before burst.
    pub limit: u64,
    /// `floor(limit * burst_capacity)`.
    pub capacity: u64,
    /// Window length in ms.
    pub window_ms: u64,
    /// What the limit counts; `None`: requests.
    pub unit: Option<Arc<str>>,
    /// The level the limit is charged to (`levels:`); `None`: the user.
    pub level: Option<Arc<str>>,
}

/// The answer to one request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Let the request through?
    pub allowed: bool,
    /// Why.
    pub reason: Reason,
    /// Tokens left after this decision.
    pub remaining: u64,
    /// 0 when allowed; exact ms until the same request passes; -1 never.
    pub retry_after_ms: i64,
    /// ms until the counter has fully decayed.
    pub reset_after_ms: u64,
    /// A shadow rule would have denied.
    pub shadow_denied: bool,
    /// The matched rule, if any.
    pub rule: Option<RuleInfo>,
    /// The priority the request was decided with (its own, else the rule's,
    /// else `shed.default_priority`).
    pub priority: Priority,
    /// The utilization level the request was decided at.
    pub level: Level,
    /// Shedding would have refused this request, but `shed.mode` is shadow.
    pub shadow_shed: bool,
    /// Why the shared store did not decide (the rule's failure policy
    /// did); `None` when it did.
    pub store_error: Option<FailureKind>,
    /// A reserving `Check` admitted: the id its `Report` settles with.
    pub reservation: Option<Box<str>>,
}

impl Decision {
    pub(super) fn allowed(reason: Reason, rule: Option<RuleInfo>, priority: Priority, level: Level) -> Self {
        Decision {
            allowed: true,
            reason,
            remaining: 0,
            retry_after_ms: 0,
            reset_after_ms: 0,
            shadow_denied: false,
            rule,
            priority,
            level,
            shadow_shed: false,
            store_error: None,
            reservation: None,
        }
    }
}

/// Decides one request through the pipeline; feeds the rule's adaptive
/// limit its outcome report, or an admission.
pub(super) async fn decide(engine: &Engine, snapshot: &Snapshot, request: &CheckRequest<'_>) -> Decision {
    let rule = snapshot.lookup(request.resource_path, request.client_type);
    let adaptive = rule.and_then(|r| r.adaptive.as_deref());
    if let Some(reported) = request.outcome
        && reported.counted
        && let Some(adaptive) = adaptive
    {
        // The reporter is the user: its report weighs what it was admitted.
        adaptive.record(request.user_id, reported.outcome, reported.latency_ms, u64::from(request.weight));
    }
    let clocked = rule.is_some_and(Rule::has_calendar) || request.reserve || request.reservation.is_some();
    let now_ms = if clocked { engine.inner.clock.now_ms() } else { 0 };
    let peek;
    let request = match refused_report(engine, rule, request, now_ms) {
        Some(refused) => {
            peek = refused;
            &peek
        }
        None => request,
    };
    let base = rule.map_or(engine.inner.default_priority, |r| r.priority);
    let native = Native {
        request,
        rule,
        priority: engine.effective_priority(request.priority, base),
        level: Level::Normal,
        shadow_shed: false,
        user: Cow::Borrowed(request.user_id),
        levels: Vec::new(),
        cache: None,
        version: snapshot.version(),
        grant: None,
        now_ms,
    };
    let decision = engine.run(native).await;
    if let Some(adaptive) = adaptive
        && decision.allowed
        && request.count == Count::IfFits
        && request.outcome.is_none()
        && matches!(decision.reason, Reason::Ok | Reason::LocalOk)
    {
        adaptive.admit(request.user_id, u64::from(request.weight));
    }
    decision
}

/// A `Report` that may not do what it asks, as the peek it is answered
/// with instead, counted: slots in flight or a settlement given back by a
/// caller that may not report (they would lift a limit others live
/// under), a settlement of another rule's reservation (or of a rule that
/// counts no job), or of one expired (it stays charged at its estimate).
fn refused_report<'a>(
    engine: &Engine,
    rule: Option<&Rule>,
    request: &CheckRequest<'a>,
    now_ms: u64,
) -> Option<CheckRequest<'a>> {
    let refused = |what| {
        engine.adjusted(Api::Check, what);
        Some(CheckRequest { count: Count::Never, reservation: None, ..*request })
    };
    if request.count != Count::Always {
        return None;
    }
    if !request.may_report && rule.is_some_and(|r| r.window.algorithm.releases()) {
        return refused("release_not_allowed");
    }
    let reservation = request.reservation?;
    if !request.may_report {
        return refused("settlement_not_allowed");
    }
    if !rule.is_some_and(|rule| *rule.id == *reservation.rule_id && rule.counts_a_job()) {
        return refused("settlement_other_rule");
    }
    if reservation.expires_ms <= now_ms {
        return refused("reservation_expired");
    }
    None
}

impl RuleInfo {
    /// The rule's limit `index` (0 the first, then `also`'s): the one that
    /// bound; the first at `grant` when given (a global rule's); a calendar
    /// period's window is the period's length at `now_ms`.
    pub(super) fn of_limit(rule: &Rule, index: usize, grant: Option<u64>, now_ms: u64) -> Self {
        let (limit, window) = rule.limit_at_grant(index, grant);
        let window_ms = rule.window_ms_at(index, now_ms);
        let (unit, level) = (rule.unit_at(index).cloned(), rule.level_name_at(index).cloned());
        RuleInfo { id: Arc::clone(&rule.id), limit, capacity: window.capacity, window_ms, unit, level }
    }
}

/// A `Check` (a peek, a `Report`) in the pipeline: one rule, its counters
/// of one user.
struct Native<'r, 'a> {
    request: &'r CheckRequest<'a>,
    rule: Option<&'r Rule>,
    priority: Priority,
    level: Level,
    shadow_shed: bool,
    /// The counted user id: the digest of an over-long one.
    user: Cow<'a, str>,
    /// The key of each of the rule's levels (`levels:`), as counted.
    levels: Vec<Cow<'a, str>>,
    /// The rules' version in the denial cache, where the cache applies.
    cache: Option<u64>,
    /// The rules' version.
    version: &'r str,
    /// A global rule's limit for this user in this region: its grant, or
    /// the region's floor.
    grant: Option<u64>,
    /// The engine's clock, read once when a limit counts per calendar
    /// period, or the request reserves or settles.
    now_ms: u64,
}

impl<'a> Native<'_, 'a> {
    /// An answer of `reason` from the rule alone, nothing counted.
    fn uncounted(&self, reason: Reason) -> Decision {
        Decision {
            shadow_shed: self.shadow_shed,
            ..Decision::allowed(reason, self.info(), self.priority, self.level)
        }
    }

    /// What the answer says of the matched rule.
    fn info(&self) -> Option<RuleInfo> {
        self.rule.map(|rule| RuleInfo::of_limit(rule, 0, self.grant, self.now_ms))
    }

    /// Counts what a global rule admitted and denied of this user, for the
    /// region's next report (a peek counts nothing).
    fn record_global(&self, engine: &Engine, admitted: bool) {
        if let (Some(rule), Some(grants)) = (self.rule, engine.inner.grants.as_deref())
            && rule.global
            && self.request.count != Count::Never
        {
            grants.record(&rule.id, &self.user, u64::from(self.request.weight), admitted);
        }
    }

    fn rule(&self) -> &Rule {
        self.rule.expect("settled: a rule matched")
    }

    fn shadow(&self) -> bool {
        self.rule.is_some_and(|rule| rule.mode == Mode::Shadow)
    }

    /// What limit `index` of `rule` counts of this request, and how: a
    /// limit of requests its weight; a limit of another unit the amount
    /// the request states of it. A unit not stated (or stated as 0)
    /// counts nothing: an admission or a peek then asks for room for one
    /// unit more (a spent budget refuses even a request that states none
    /// of it), a report counts nothing of it.
    fn counted(&self, rule: &Rule, index: usize) -> (u64, Count) {
        let count = self.request.count;
        let Some(unit) = rule.unit_at(index) else { return (u64::from(self.request.weight), count) };
        match (self.amount(rule, unit).filter(|&amount| amount > 0), count) {
            (Some(amount), _) => (amount, count),
            (None, Count::Always) => (0, count),
            (None, _) => (1, Count::Never),
        }
    }

    /// What a settling report states of limit `index`'s unit: `None` for a
    /// limit of requests, or of a unit it does not name.
    fn stated(&self, rule: &Rule, index: usize) -> Option<u64> {
        rule.unit_at(index).and_then(|unit| self.amount(rule, unit))
    }

    /// What the request states of `unit`: for `cost` on a rule with a
    /// price table, what its tokens cost at its model's prices (an
    /// unlisted model's: `None`, or on a report the table's highest).
    fn amount(&self, rule: &Rule, unit: &str) -> Option<u64> {
        match (&rule.prices, unit) {
            (Some(prices), COST) => match self.cost(prices) {
                Cost::Priced(cost) => Some(cost),
                Cost::Unpriced => None,
            },
            _ => self.request.usage.get(unit).copied(),
        }
    }

    /// What the request costs at its model's prices.
    fn cost(&self, prices: &Prices) -> Cost {
        let report = self.request.count == Count::Always;
        prices.cost(self.request.headers, |unit| self.request.usage.get(unit).copied(), report)
    }

    /// A reserving `Check` admitted whole: the reservation of what it
    /// counted of each unit, in the windows the store counted it in.
    fn reserved(&self, engine: &Engine, items: &[ManyItem], outcome: &ManyOutcome) -> Option<Box<str>> {
        let rule = self.rule();
        let admitted = outcome.committed && outcome.verdicts.iter().all(|v| v.admitted);
        if !self.request.reserve || self.request.count != Count::IfFits || !admitted || !rule.has_units() {
            return None;
        }
        let limits = items
            .iter()
            .enumerate()
            .filter(|(index, item)| rule.unit_at(*index).is_some() && item.count == Count::IfFits)
            .map(|(limit, item)| Reserved {
                limit,
                amount: item.weight,
                window: item.window_at(outcome.now_ms),
            })
            .collect();
        let expires_ms = self.now_ms.saturating_add(engine.inner.reservation_ttl_ms);
        Some(Reservation::new(rule, expires_ms, limits).id().into_boxed_str())
    }

    /// A settlement: its claim and each limit's difference, one job. A
    /// reservation settled before is answered as a peek, nothing counted.
    async fn settle(
        &self,
        engine: &Engine,
        shares: Shares<'_>,
        reservation: &Reservation,
    ) -> Result<(Verdict, usize, Option<Box<str>>), StoreError> {
        let (rule, store) = (self.rule(), &engine.inner.store);
        let items = self.items(None, |index| self.counted(rule, index));
        let job = reservation.settle(self.now_ms, items, |index| self.stated(rule, index));
        let outcome = store.decide_job_in(shares, self.group(), &job).await?;
        if !outcome.committed {
            engine.adjusted(Api::Check, "settlement_repeated");
            let peeks = self.items(None, |_| (1, Count::Never));
            let (verdict, bound) = bound(rule, &store.decide_many_in(shares, self.group(), &peeks).await?);
            return Ok((verdict, bound, None));
        }
        let limits = ManyOutcome { verdicts: outcome.verdicts[1..].to_vec(), ..outcome };
        let (verdict, bound) = bound(rule, &limits);
        Ok((verdict, bound, None))
    }

    /// The group the rule's counters are kept in: the user's, or for a
    /// rule with levels the rule's own (a team's counter is no user's).
    fn group(&self) -> &str {
        match self.rule().levels.as_deref() {
            Some(levels) => &levels.group,
            None => &self.user,
        }
    }

    /// The rule's counters for this decision ([`Rule::items`]); with
    /// levels, each keyed by whose it is: `#<rule id>/<index>/<key>`.
    fn items(&self, grant: Option<u64>, counted: impl Fn(usize) -> (u64, Count)) -> Vec<ManyItem> {
        let rule = self.rule();
        let mut items = rule.items(grant, self.now_ms, counted);
        if rule.levels.is_some() {
            for (index, item) in items.iter_mut().enumerate() {
                let key = rule.level_at(index).map_or(&*self.user, |level| &*self.levels[level]);
                item.key.push('/');
                item.key.push_str(key);
            }
        }
        items
    }

    /// The key of each of `rule`'s levels, read from the request's
    /// headers (an over-long one counted by its digest, like a user id);
    /// `false` when one is missing: absent, empty, or sent twice with two
    /// values.
    fn read_levels(&mut self, engine: &Engine, rule: &Rule) -> bool {
        let Some(levels) = rule.levels.as_deref() else { return true };
        let headers: &'a HashMap<String, String> = self.request.headers;
        for key in &levels.keys {
            let Some(value) = crate::rules::header(headers, &key.header).filter(|v| !v.is_empty()) else {
                return false;
            };
            let counted = keys::bounded(value, engine.inner.max_user_id_bytes);
            if matches!(counted, Cow::Owned(_)) {
                engine.adjusted(Api::Check, "level_key_digest");
            }
            self.levels.push(counted);
        }
        true
    }

    /// Whether a limit of `rule` can never admit what this request asks of
    /// it (more than its capacity; a report is counted whatever it is).
    fn never_fits(&self, rule: &Rule) -> bool {
        if !rule.has_units() {
            return u64::from(self.request.weight) > rule.min_capacity();
        }
        (0..=rule.also.len()).any(|index| {
            let (amount, count) = self.counted(rule, index);
            count != Count::Always && amount > rule.limit_at(index).1.capacity
        })
    }
}

impl Subject for Native<'_, '_> {
    type Answer = Decision;
    /// The verdict, which of the rule's limits bound (0 the first), and a
    /// reservation's id.
    type Outcome = (Verdict, usize, Option<Box<str>>);

    #[inline]
    fn priority(&self) -> Priority {
        self.priority
    }

    #[inline]
    fn shed_exempt(&self) -> bool {
        self.request.count == Count::Always || self.request.outcome.is_some()
    }

    #[inline]
    fn refused(self, _: &Engine, reason: Reason, retry_after_ms: u64, level: Level) -> Decision {
        Decision {
            allowed: false,
            retry_after_ms: clamp_i64(retry_after_ms),
            shadow_shed: self.shadow_shed,
            ..Decision::allowed(reason, self.info(), self.priority, level)
        }
    }

    /// No rule: allowed, uncounted. An outcome report has been recorded:
    /// answered from the rule. A weight over the rule's capacity can
    /// never pass: answered from the rule alone with a retry_after of -1,
    /// so no client loops waiting for it (a report is counted whatever
    /// its weight). A request without the key of one of the rule's levels
    /// is refused the same way, a report too: it cannot be counted.
    #[inline]
    fn settle(&mut self, engine: &Engine, level: Level, shadow_shed: bool) -> Option<Decision> {
        (self.level, self.shadow_shed) = (level, shadow_shed);
        let Some(rule) = self.rule else {
            return Some(self.uncounted(Reason::NoRule));
        };
        if self.request.outcome.is_some() {
            return Some(self.uncounted(Reason::Ok));
        }
        let unkeyed = !self.read_levels(engine, rule);
        let unpriced = rule.prices.as_deref().is_some_and(|prices| self.cost(prices) == Cost::Unpriced);
        let never = match (unkeyed, unpriced) {
            (true, _) => Reason::NoLevelKey,
            (false, true) => Reason::NoPrice,
            (false, false) => Reason::WeightExceedsCapacity,
        };
        // Without a level's key nothing can be counted, a report's usage
        // neither.
        if unkeyed || (self.request.count != Count::Always && (unpriced || self.never_fits(rule))) {
            let base = self.uncounted(Reason::Ok);
            return Some(if self.shadow() {
                Decision { shadow_denied: true, ..base }
            } else {
                Decision { allowed: false, reason: never, retry_after_ms: -1, ..base }
            });
        }
        None
    }

    /// Only admissions are counted and dropped (a peek asks, a report
    /// tells what happened).
    #[inline]
    fn overload(&self, engine: &Engine) -> Option<u64> {
        let rule = self.rule();
        if self.request.count != Count::IfFits || rule.overload.is_none() {
            return None;
        }
        let overload = engine.inner.overload.as_ref()?;
        match overload.check(Kind::Native, &rule.id, tenant(engine, self.request), self.shadow()) {
            OverloadVerdict::Drop { retry_after_ms } => Some(retry_after_ms),
            _ => None,
        }
    }

    /// An over-long user id is counted by its digest, exactly, never
    /// refused. A denial the store gave for this counter still holds:
    /// answered here, exactly as the store would (only enforced admissions
    /// and peeks).
    #[inline]
    fn cached(&mut self, engine: &Engine) -> Option<Decision> {
        self.user = keys::bounded(self.request.user_id, engine.inner.max_user_id_bytes);
        if matches!(self.user, Cow::Owned(_)) {
            engine.inner.stats.adjusted(Api::Check, "user_id_digest");
        }
        if let (Some(rule), Some(grants)) = (self.rule, engine.inner.grants.as_deref())
            && rule.global
        {
            let grant = grants.limit(&rule.id, &self.user, rule.limit_at(0).0);
            self.grant = Some(grant.unwrap_or(0));
            // Another deployment holds the region: zero, which a counter
            // (at least one hit) cannot hold, so denied here, no store call;
            // still demand, so the agent keeps reporting until it lets go.
            if grant.is_none() && !self.shadow() && self.request.count != Count::Always {
                self.record_global(engine, false);
                return Some(Decision {
                    allowed: false,
                    retry_after_ms: CLAIMED_RETRY_MS,
                    ..self.uncounted(Reason::OverLimit)
                });
            }
        }
        // A global rule's denials are not cached: its limit moves with its
        // grant, and a denial's retry time is the grant's of the moment. Nor
        // are those of requests in flight (a slot given back admits sooner),
        // nor of limits of other units (the cache knows a request by its
        // weight, not by its usage), nor of levels (it knows a request by
        // its user, not by its team).
        let rule = self.rule();
        let cached = !rule.window.algorithm.releases() && !rule.has_units() && rule.levels.is_none();
        let cache = engine.inner.denials.as_deref().filter(|_| {
            !self.shadow() && self.request.count != Count::Always && self.grant.is_none() && cached
        })?;
        let version = cache.version_hash(self.version);
        self.cache = Some(version);
        let hit = cache.lookup(version, &self.rule().id, &self.user, u64::from(self.request.weight))?;
        Some(Decision {
            allowed: false,
            retry_after_ms: clamp_i64(hit.retry_after_ms),
            reset_after_ms: hit.reset_after_ms,
            ..self.uncounted(Reason::OverLimit)
        })
    }

    #[inline]
    fn keys(&self) -> usize {
        1 + self.rule.map_or(0, |rule| rule.also.len())
    }

    /// One counter, or with `also` limits one all-or-nothing job of them
    /// all in the user's group.
    #[inline]
    async fn decide(&self, engine: &Engine) -> Result<Self::Outcome, StoreError> {
        let weight = u64::from(self.request.weight);
        let tenant = engine.tenant_share(|| tenant(engine, self.request));
        let shares = Shares { caller: self.request.share, tenant: tenant.as_deref() };
        let (rule, store) = (self.rule(), &engine.inner.store);
        if !rule.counts_a_job() {
            let counter = rule.counter_at(self.grant);
            let verdict = store.decide_in(shares, &self.user, counter, weight, self.request.count).await?;
            return Ok((verdict, 0, None));
        }
        // Boxed: the job's future would otherwise size every decision's,
        // the single-limit ones' too.
        if let Some(reservation) = self.request.reservation {
            return Box::pin(self.settle(engine, shares, reservation)).await;
        }
        let items = self.items(self.grant, |index| self.counted(rule, index));
        let outcome = Box::pin(store.decide_many_in(shares, self.group(), &items)).await?;
        let (verdict, bound) = bound(rule, &outcome);
        Ok((verdict, bound, self.reserved(engine, &items, &outcome)))
    }

    #[inline]
    fn answer(self, engine: &Engine, (verdict, bound, reservation): Self::Outcome) -> Decision {
        if let (Some(version), Some(cache)) = (self.cache, engine.inner.denials.as_deref())
            && !verdict.admitted
            && let Some(retry_after_ms) = verdict.retry_after_ms
        {
            let weight = u64::from(self.request.weight);
            cache.insert(
                version,
                &self.rule().id,
                &self.user,
                weight,
                retry_after_ms,
                verdict.reset_after_ms,
            );
        }
        self.record_global(engine, verdict.admitted);
        let info = self.rule.map(|rule| RuleInfo::of_limit(rule, bound, self.grant, self.now_ms));
        let decided = from_verdict(&verdict, self.shadow(), info, self.priority);
        Decision { shadow_shed: self.shadow_shed, level: self.level, reservation, ..decided }
    }

    #[inline]
    fn failed(self, engine: &Engine, error: StoreError) -> Decision {
        let (user, priority, level, grant, now_ms) =
            (&self.user, self.priority, self.level, self.grant, self.now_ms);
        let rule = self.rule();
        let group = self.group();
        let items = rule.counts_a_job().then(|| {
            let items = self.items(grant, |index| self.counted(rule, index));
            match self.request.reservation {
                Some(reservation) => reservation.settle(now_ms, items, |index| self.stated(rule, index)),
                None => items,
            }
        });
        let what = Failed { user, group, priority, level, error, grant, now_ms, items };
        Decision { shadow_shed: self.shadow_shed, ..failed(engine, self.request, self.rule(), what) }
    }
}

/// The verdict of a rule's job and the limit that binds: limits of one
/// unit answer with the least left of them all, limits of several units
/// with the binding one's own, in its unit.
fn bound(rule: &Rule, outcome: &ManyOutcome) -> (Verdict, usize) {
    if rule.has_units() {
        outcome.binding_in_units(|index| rule.limit_at(index).1.capacity)
    } else {
        outcome.binding()
    }
}

/// The tenant of a `Check` request, for the overload layer and the
/// tenants' shares of the store: the `user_id` up to the separator, or
/// a header (`overload.tenant_from`).
fn tenant<'r>(engine: &Engine, request: &CheckRequest<'r>) -> Option<&'r str> {
    let policy = &engine.inner.tenants;
    match policy.source {
        TenantSource::UserIdPrefix => {
            request.user_id.split_once(policy.separator.as_str()).map(|(tenant, _)| tenant)
        }
        TenantSource::Header => request.headers.get(&policy.header).map(String::as_str),
    }
}

/// What a failed native decision is answered from, beyond its request and
/// rule.
struct Failed<'a> {
    /// The counted user id (the digest of an over-long one).
    user: &'a str,
    /// The group of the rule's job ([`Native::group`]).
    group: &'a str,
    priority: Priority,
    level: Level,
    error: StoreError,
    /// A global rule's limit for the user in this region.
    grant: Option<u64>,
    /// The decision's clock, for its calendar periods.
    now_ms: u64,
    /// The counters of a rule that counts one job of them
    /// ([`Rule::counts_a_job`]); `None`: its one counter.
    items: Option<Vec<ManyItem>>,
}

fn from_verdict(verdict: &Verdict, shadow: bool, info: Option<RuleInfo>, priority: Priority) -> Decision {
    let denied = !verdict.admitted;
    let enforce_denial = denied && !shadow;
    Decision {
        allowed: !enforce_denial,
        reason: if enforce_denial { Reason::OverLimit } else { Reason::Ok },
        remaining: verdict.remaining,
        retry_after_ms: if enforce_denial { verdict.retry_after_ms.map_or(-1, clamp_i64) } else { 0 },
        reset_after_ms: verdict.reset_after_ms,
        shadow_denied: denied && shadow,
        rule: info,
        priority,
        level: Level::Normal,
        shadow_shed: false,
        store_error: None,
        reservation: None,
    }
}

/// A `Check` the store could not decide, answered by `rule`'s failure
/// policy, flagged and dead-lettered.
fn failed(engine: &Engine, request: &CheckRequest<'_>, rule: &Rule, failed: Failed<'_>) -> Decision {
    let Failed { user, group, priority, level, error, grant, now_ms, items } = failed;
    let (weight, info) = (u64::from(request.weight), Some(RuleInfo::of_limit(rule, 0, grant, now_ms)));
    let local = match (rule.failure_policy, items) {
        (FailurePolicy::Local, None) => Some(
            engine.inner.local.decide(user, rule.counter_at(grant), weight, request.count).map(|v| (v, 0)),
        ),
        // Every limit locally too: an outage never lifts the daily one.
        (FailurePolicy::Local, Some(items)) => {
            Some(engine.inner.local.decide_many(group, &items).map(|outcome| bound(rule, &outcome)))
        }
        (FailurePolicy::Open | FailurePolicy::Closed, _) => None,
    };
    let decision = match (rule.failure_policy, local) {
        (_, Some(Ok((verdict, bound)))) => {
            if rule.global
                && request.count != Count::Never
                && let Some(grants) = engine.inner.grants.as_deref()
            {
                grants.record(&rule.id, user, weight, verdict.admitted);
            }
            let info = Some(RuleInfo::of_limit(rule, bound, grant, now_ms));
            let decided = from_verdict(&verdict, rule.mode == Mode::Shadow, info, priority);
            let reason =
                if decided.reason == Reason::OverLimit { Reason::LocalOverLimit } else { Reason::LocalOk };
            Decision { reason, ..decided }
        }
        (FailurePolicy::Open, _) => Decision::allowed(Reason::FailOpen, info, priority, level),
        // Closed, or local at its bound: denied. Nothing is known about
        // the counter, so clients back off for a second (or one window,
        // if shorter) rather than spin against an outage.
        _ => Decision {
            allowed: false,
            retry_after_ms: clamp_i64(rule.window.window_ms.min(FAIL_CLOSED_RETRY_MS)),
            ..Decision::allowed(Reason::FailClosed, info, priority, level)
        },
    };
    // The record names what was counted: the digest of an over-long id.
    engine.inner.failures.record(&FailedDecision {
        user_id: user,
        ..FailedDecision::of_check(request, rule, priority, &error, decision.reason)
    });
    Decision { level, store_error: Some(error.kind), ..decision }
}
