//! The compiled rule model: what a rule means once it has been validated.

use std::{path::Path, sync::Arc};

use serde::{Deserialize, Serialize};

use crate::{
    limiter::{
        Count, CounterSpec, ManyItem,
        adaptive::{AdaptiveLimit, AimdParams},
        calendar::Calendar,
        window::WindowParams,
    },
    shed::Priority,
};

/// Whether a rule's denials are enforced or only reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Over-limit requests are denied.
    #[default]
    Enforce,
    /// Requests are counted exactly as under `enforce`, but an over-limit
    /// request is allowed and flagged `shadow_denied`.
    Shadow,
}

/// What answers when the counter store cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FailurePolicy {
    /// Decide at this instance's share of the limit, counted locally and
    /// written back to the store when it answers again (reasons LOCAL_OK
    /// and LOCAL_OVER_LIMIT); denied (FAIL_CLOSED) when the local limiter
    /// itself is at its bound.
    #[default]
    Local,
    /// Allow, with reason FAIL_OPEN.
    Open,
    /// Deny, with reason FAIL_CLOSED.
    Closed,
}

/// What an overload directive's global rate is counted per.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OverloadScope {
    /// One bucket for the rule: tenants share `rate_per_second` by weight.
    #[default]
    Rule,
    /// One bucket per tenant of the tenant table (tenants not in it share
    /// one more), each with `rate_per_second`.
    Tenant,
}

impl OverloadScope {
    /// The rule-file name.
    pub fn as_str(self) -> &'static str {
        match self {
            OverloadScope::Rule => "rule",
            OverloadScope::Tenant => "tenant",
        }
    }
}

/// An overload directive: a global request rate, summed over every
/// instance, enforced statistically in front of the exact counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OverloadSpec {
    /// Requests per second admitted past the overload layer, all instances together.
    pub rate_per_second: u64,
    /// Counted per rule (default) or per rule and tenant.
    #[serde(default)]
    pub per: OverloadScope,
}

/// Largest accepted `overload.rate_per_second`.
pub const MAX_OVERLOAD_RATE: u64 = 1_000_000_000;

/// Longest unit name (`unit:`): it is a key of a request's `usage`.
pub const MAX_UNIT_BYTES: usize = 64;

/// Most limits a rule may add with `also:` (each is one more counter per
/// decision).
pub const MAX_ALSO_LIMITS: usize = 8;

/// A rule's `adaptive:` as written, and as a record carries it (there with
/// `increase` resolved): its first limit moves between `min` and `max` by
/// AIMD from reported outcomes, starting at the rule's `limit`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveSpec {
    /// The lowest the limit goes.
    pub min: u64,
    /// The highest the limit goes.
    pub max: u64,
    /// Added per good interval; default 1% of `max` (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub increase: Option<u64>,
    /// Multiplied per bad interval (between 0 and 1, exclusive).
    #[serde(default = "default_decrease")]
    pub decrease: f64,
    /// One interval in ms: the limit changes at most once per interval.
    #[serde(default = "default_adaptive_interval")]
    pub interval_ms: u64,
    /// An interval is bad when more than this share of the outcomes
    /// reported in it are failures or overloads.
    #[serde(default = "default_max_failure_ratio")]
    pub max_failure_ratio: f64,
    /// A success reported slower than this (ms) counts as an overload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
}

fn default_decrease() -> f64 {
    0.9
}

fn default_adaptive_interval() -> u64 {
    1_000
}

fn default_max_failure_ratio() -> f64 {
    0.02
}

impl AdaptiveSpec {
    /// `increase`, or its default: 1% of `max`, at least 1.
    pub fn increase(&self) -> u64 {
        self.increase.unwrap_or_else(|| self.max.div_ceil(100).max(1))
    }

    /// The spec of compiled `params`, every field explicit.
    pub fn of(params: &AimdParams) -> Self {
        AdaptiveSpec {
            min: params.min,
            max: params.max,
            increase: Some(params.increase),
            decrease: params.decrease,
            interval_ms: params.interval_ms,
            max_failure_ratio: params.max_failure_ratio,
            latency_ms: params.latency_ms,
        }
    }
}

/// Shortest and longest `adaptive.interval_ms`.
pub const ADAPTIVE_INTERVAL_MS: std::ops::RangeInclusive<u64> = 100..=60_000;

/// A limit a rule adds to its first (`also:`): counted with it, all or
/// nothing, on the same user.
#[derive(Debug, Clone, PartialEq)]
pub struct AlsoLimit {
    /// Requests per window, before burst.
    pub limit: u64,
    /// Burst multiplier (>= 1).
    pub burst_capacity: f64,
    /// Window length and capacity (a calendar period's window: its
    /// longest, in its ticks).
    pub window: WindowParams,
    /// Counted per calendar period (`period:`) rather than per window.
    pub calendar: Option<Arc<Calendar>>,
    /// What it counts (`unit:`); `None`: requests.
    pub unit: Option<Arc<str>>,
    /// Whose key it is charged to: a level of the rule's `levels:`
    /// (its index), `None`: the user's.
    pub level: Option<usize>,
}

/// The most levels a rule may declare (`levels:`).
pub const MAX_LEVELS: usize = 4;

/// A rule's levels (`levels:`): further keys its limits may be charged
/// to besides the user (a team, an organisation), each read from a
/// request header.
#[derive(Debug, Clone, PartialEq)]
pub struct Levels {
    /// The group its counters share in the stores (`~<rule id>`): the
    /// counters of one decision must share a group, and a team's counter
    /// cannot live in any one user's.
    pub group: Box<str>,
    /// Each level, in name order.
    pub keys: Vec<LevelKey>,
}

/// One level: its name and the header its key is read from.
#[derive(Debug, Clone, PartialEq)]
pub struct LevelKey {
    /// Its name (`team`), as the answer names it.
    pub name: Arc<str>,
    /// The header whose value is its key, lower-case.
    pub header: Box<str>,
}

/// One validated rule. Shared by reference from the [`Snapshot`](super::Snapshot);
/// the hot path never clones it.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Unique id: part of Redis keys and of metric labels.
    pub id: Arc<str>,
    /// The path as written: exact, or a prefix pattern ending in `*`.
    pub resource_path: String,
    /// Only requests with this client type match; `None` matches any.
    pub client_type: Option<String>,
    /// Priority of matching requests that do not state one.
    pub priority: Priority,
    /// Requests per window, before burst.
    pub limit: u64,
    /// Burst multiplier (>= 1).
    pub burst_capacity: f64,
    /// Window length and capacity (`floor(limit * burst_capacity)`).
    pub window: WindowParams,
    /// Enforce or shadow.
    pub mode: Mode,
    /// Answer when the store fails.
    pub failure_policy: FailurePolicy,
    /// A global rate enforced by probabilistic drop before the exact counter.
    pub overload: Option<OverloadSpec>,
    /// Further limits (`also:`), counted with the first all or nothing:
    /// "10 per second and 1,000 per day". Empty for most rules.
    pub also: Vec<AlsoLimit>,
    /// Set when the first limit is adaptive (`adaptive:`): then `limit`
    /// and `window` are where it starts, and the limit in force is its
    /// [`AdaptiveLimit::current`].
    pub adaptive: Option<Arc<AdaptiveLimit>>,
    /// The first limit holds for every region together (`global: true`):
    /// each region enforces it at its grant (docs/global-limits.md).
    pub global: bool,
    /// The first limit is counted per calendar period (`period:`): then
    /// `window` is the period's longest, in its ticks.
    pub calendar: Option<Arc<Calendar>>,
    /// What the first limit counts (`unit:`); `None`: requests (the
    /// request's weight).
    pub unit: Option<Arc<str>>,
    /// What its limits of unit `cost` charge, by model (`prices:`).
    pub prices: Option<Arc<super::prices::Prices>>,
    /// Further keys its limits are charged to (`levels:`).
    pub levels: Option<Arc<Levels>>,
    /// The level the first limit is charged to (`level:`); `None`: the
    /// user's.
    pub level: Option<usize>,
    /// The file the rule came from, for messages.
    pub source: Arc<Path>,
}

impl Rule {
    /// The counter this rule keeps per user, as the store takes it.
    #[inline]
    pub fn counter(&self) -> CounterSpec<'_> {
        self.counter_at(None)
    }

    /// The counter, its first limit at `grant` when the rule is global (the
    /// region's grant for the user).
    #[inline]
    pub fn counter_at(&self, grant: Option<u64>) -> CounterSpec<'_> {
        CounterSpec { id: &self.id, window: self.first(grant).1 }
    }

    /// The first limit in force, as (limit, window): `grant` when given, else
    /// the adaptive limit's current value when the rule has one.
    #[inline]
    fn first(&self, grant: Option<u64>) -> (u64, WindowParams) {
        let limit = match (grant, &self.adaptive) {
            (Some(grant), _) => grant,
            (None, Some(adaptive)) => adaptive.current(),
            (None, None) => return (self.limit, self.window),
        };
        (limit, WindowParams { capacity: capacity(limit, self.burst_capacity), rate: limit, ..self.window })
    }

    /// Limit `index`: 0 the first, then `also`'s, as (limit, window).
    pub fn limit_at(&self, index: usize) -> (u64, WindowParams) {
        self.limit_at_grant(index, None)
    }

    /// Limit `index`, the first at `grant` when given.
    pub fn limit_at_grant(&self, index: usize, grant: Option<u64>) -> (u64, WindowParams) {
        match index.checked_sub(1).and_then(|i| self.also.get(i)) {
            Some(also) => (also.limit, also.window),
            None => self.first(grant),
        }
    }

    /// The smallest capacity of its limits: a weight above it never fits.
    pub fn min_capacity(&self) -> u64 {
        self.also.iter().map(|a| a.window.capacity).fold(self.first(None).1.capacity, u64::min)
    }

    /// Limit `index`'s calendar period, when it is counted per period.
    pub fn calendar_at(&self, index: usize) -> Option<&Calendar> {
        match index.checked_sub(1) {
            Some(i) => self.also.get(i).and_then(|also| also.calendar.as_deref()),
            None => self.calendar.as_deref(),
        }
    }

    /// Limit `index` as a reviewer reads it: `10`, or with its unit
    /// (`100000 input_tokens`).
    pub fn limit_text(&self, index: usize) -> String {
        let limit = self.limit_at(index).0;
        match self.unit_at(index) {
            Some(unit) => format!("{limit} {unit}"),
            None => limit.to_string(),
        }
    }

    /// Limit `index`'s window as a reviewer reads it: `60000 ms`, or a
    /// calendar period and its zone (`month in Europe/Berlin`).
    pub fn window_text(&self, index: usize) -> String {
        match self.calendar_at(index) {
            Some(calendar) => format!("{} in {}", calendar.period().as_str(), calendar.zone_name()),
            None => format!("{} ms", self.limit_at(index).1.window_ms),
        }
    }

    /// What limit `index` counts: `None` for requests (the weight), else
    /// the unit whose amount the request states.
    pub fn unit_at(&self, index: usize) -> Option<&Arc<str>> {
        match index.checked_sub(1) {
            Some(i) => self.also.get(i).and_then(|also| also.unit.as_ref()),
            None => self.unit.as_ref(),
        }
    }

    /// Whether a limit counts a unit other than requests.
    pub fn has_units(&self) -> bool {
        self.unit.is_some() || self.also.iter().any(|also| also.unit.is_some())
    }

    /// Whether a limit is counted per calendar period: the decision then
    /// reads the clock, and counts as one job of every limit.
    pub fn has_calendar(&self) -> bool {
        self.calendar.is_some() || self.also.iter().any(|also| also.calendar.is_some())
    }

    /// Whether a decision counts one job of a counter per limit (several
    /// limits, or a calendar period's) rather than one counter.
    pub fn counts_a_job(&self) -> bool {
        !self.also.is_empty() || self.calendar.is_some() || self.unit.is_some() || self.levels.is_some()
    }

    /// The level limit `index` is charged to (its index in `levels`);
    /// `None`: the user's.
    pub fn level_at(&self, index: usize) -> Option<usize> {
        match index.checked_sub(1) {
            Some(i) => self.also.get(i).and_then(|also| also.level),
            None => self.level,
        }
    }

    /// The name of the level limit `index` is charged to; `None`: the
    /// user's.
    pub fn level_name_at(&self, index: usize) -> Option<&Arc<str>> {
        let levels = self.levels.as_deref()?;
        self.level_at(index).and_then(|level| levels.keys.get(level)).map(|key| &key.name)
    }

    /// Limit `index`'s window length in ms at `now_ms`: a calendar
    /// period's length where it is counted per period.
    pub fn window_ms_at(&self, index: usize, now_ms: u64) -> u64 {
        match self.calendar_at(index) {
            Some(calendar) => {
                let at = calendar.at(now_ms);
                at.end_ms - at.start_ms
            }
            None => self.limit_at(index).1.window_ms,
        }
    }

    /// The counters of a rule with `also` limits (or a calendar period, or
    /// a unit) for one decision at `now_ms`, one per limit, keyed `#<rule
    /// id>/<index>` within the user's group (a key no Envoy counter has:
    /// theirs start with a digit), each counting what `counted(index)`
    /// says; the first at `grant` when given. A calendar limit's counter
    /// counts in its period's ticks on its own clock ([`Calendar::clock`]).
    pub fn items(
        &self,
        grant: Option<u64>,
        now_ms: u64,
        counted: impl Fn(usize) -> (u64, Count),
    ) -> Vec<ManyItem> {
        (0..=self.also.len())
            .map(|index| {
                let (weight, count) = counted(index);
                let params = self.limit_at_grant(index, grant).1;
                let (params, tick_ms, clock) = match self.calendar_at(index) {
                    Some(calendar) => {
                        let (clock, window_ms) = calendar.clock(now_ms);
                        (WindowParams { window_ms, ..params }, calendar.period().tick_ms(), Some(clock))
                    }
                    None => (params, 1, None),
                };
                ManyItem {
                    key: format!("#{}/{index}", self.id),
                    params,
                    tick_ms,
                    weight,
                    count,
                    shadow: false,
                    clock,
                    refund: None,
                }
            })
            .collect()
    }
}

/// `floor(limit × burst)`, at least 1: what one window admits.
pub fn capacity(limit: u64, burst_capacity: f64) -> u64 {
    // Exact in f64 for every limit the compiler admits (below 2^53).
    ((limit as f64 * burst_capacity).floor() as u64).max(1)
}
