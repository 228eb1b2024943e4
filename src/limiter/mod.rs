//! Counting: the window arithmetic ([`window`]), the token bucket and GCRA
//! ([`bucket`]), `evaluate` which picks by a rule's [`Algorithm`], and the
//! two stores that apply it atomically — [`redis`] (a Lua script) and
//! [`memory`] (sharded maps) — behind one interface ([`store`]); and [`adaptive`], the
//! arithmetic of limits that follow reported outcomes.
//!
//! Architecture invariant: no gRPC here, and both stores answer through
//! `Seen::verdict` (the memory store through `evaluate`, the Lua script
//! as its twin), so the embedded default behaves exactly like Redis.

pub mod adaptive;
pub mod breaker;
pub mod bucket;
pub mod calendar;
pub mod exchange;
pub mod figures;
pub mod grants;
pub mod instance;
pub mod lease;
pub mod local;
pub mod memory;
pub mod redis;
pub mod scripts;
pub mod settings;
pub mod slots;
pub mod store;
pub mod window;

use std::{
    borrow::Cow,
    fmt::{self, Write as _},
    sync::Arc,
};

pub use memory::MemoryStore;
pub use redis::RedisStore;
pub use store::{CallerCalls, CounterStore, Listed, Shares, Store};
use window::StoredCounter;
pub use window::{Algorithm, Count, Verdict, WindowParams};

pub use crate::clock::{Clock, ManualClock, SystemClock};

/// Appends `text` to a counter key with `%` and every character of
/// `reserved` (ASCII separators of the key format) percent-encoded, so
/// values can never be confused with the key's structure. Borrowed through
/// when there is nothing to encode, the usual case.
pub fn push_encoded(key: &mut String, text: &str, reserved: &[char]) {
    if !text.contains(|c| c == '%' || reserved.contains(&c)) {
        key.push_str(text);
        return;
    }
    for c in text.chars() {
        if c == '%' || reserved.contains(&c) {
            let _ = write!(key, "%{:02X}", u32::from(c));
        } else {
            key.push(c);
        }
    }
}

/// The text [`push_encoded`] appended as `encoded`: each `%XX` turned back
/// into its character (only ASCII was encoded). `None` when `encoded`
/// holds a `%` not followed by two hex digits of an ASCII character, which
/// `push_encoded` never writes.
pub fn decoded(encoded: &str) -> Option<Cow<'_, str>> {
    if !encoded.contains('%') {
        return Some(Cow::Borrowed(encoded));
    }
    let mut out = String::with_capacity(encoded.len());
    let mut rest = encoded;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let hex = rest.get(at + 1..at + 3).filter(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()))?;
        let byte = u8::from_str_radix(hex, 16).ok().filter(u8::is_ascii)?;
        out.push(char::from(byte));
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    Some(Cow::Owned(out))
}

/// Which counter of a user a single-counter decision uses: the rule's id
/// (part of the key) and its window. Borrowed from the caller's rule, so the
/// store knows nothing of the rule model.
#[derive(Debug, Clone, Copy)]
pub struct CounterSpec<'a> {
    /// Scopes the counter (a native rule id).
    pub id: &'a Arc<str>,
    /// Window and capacity.
    pub window: WindowParams,
}

/// One counter of a multi-counter decision.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ManyItem {
    /// The counter's key within its group.
    pub key: String,
    /// Window and capacity, in ticks of `tick_ms`.
    pub params: WindowParams,
    /// Length of one tick in ms (1 for windows up to a minute).
    pub tick_ms: u64,
    /// Weight to add.
    pub weight: u64,
    /// Whether to count it: if it fits, never (a peek) or always (a report).
    pub count: Count,
    /// Over the limit does not block the other items (and is not counted).
    pub shadow: bool,
    /// The counter's clock when the decision keeps it (a calendar period);
    /// `None`: the store's, `now_ms / tick_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock: Option<calendar::ItemClock>,
    /// A report (`Count::Always`) that gives `weight` back instead of
    /// counting it: a settlement below its reservation, which was counted
    /// in window `r` (the window's index in ticks, [`ManyItem::window_at`]).
    /// Taken from that window's count while it still counts (this window,
    /// or the previous one); a bucket's debt shrinks by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refund: Option<u64>,
}

impl ManyItem {
    /// A counter `key` of `params` (in ms) admitting one request if it
    /// fits: the fields a job's item most often has, for the others to
    /// be set with `..`.
    pub fn admission(key: impl Into<String>, params: WindowParams) -> Self {
        ManyItem {
            key: key.into(),
            params,
            tick_ms: 1,
            weight: 1,
            count: Count::IfFits,
            shadow: false,
            clock: None,
            refund: None,
        }
    }

    /// Whether this item's answer keeps its job from committing: it does
    /// not fit, and it is enforced (not shadow) and not a report (a report
    /// is counted whatever is left). Both stores decide a job with this;
    /// Redis' script is its twin.
    pub(crate) fn blocks(&self, fits: bool) -> bool {
        !fits && !self.shadow && !self.count.whatever_is_left()
    }

    /// Now in the counter's ticks, the store's clock reading `now_ms`: its
    /// own clock when it has one (a calendar period's), else `now_ms / tick_ms`.
    #[inline]
    pub(crate) fn now(&self, now_ms: u64) -> u64 {
        self.clock.map_or(now_ms / self.tick_ms.max(1), |clock| clock.now)
    }

    /// The index of the window this counter counts in at `now_ms` of the
    /// store's clock (what a refund names).
    pub fn window_at(&self, now_ms: u64) -> u64 {
        self.now(now_ms) / self.params.window_ms.max(1)
    }

    /// A duration the arithmetic answered in ticks, in ms.
    #[inline]
    fn ms(&self, ticks: u64) -> u64 {
        match self.clock {
            Some(clock) => clock.ms(ticks, self.params.window_ms, self.tick_ms),
            None => ticks.saturating_mul(self.tick_ms),
        }
    }
}

/// The result of [`Store::decide_many`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManyOutcome {
    /// Whether the admissions that fit were counted (no enforced item was
    /// over).
    pub committed: bool,
    /// Per item, durations in ms. `admitted` says whether the item fit on
    /// its own; `remaining` reflects what was actually counted.
    pub verdicts: Vec<Verdict>,
    /// The store's clock when it decided (Unix ms): where each item's
    /// window was ([`ManyItem::window_at`]).
    pub now_ms: u64,
}

impl ManyOutcome {
    /// [`binding`] over the whole job.
    pub fn binding(&self) -> (Verdict, usize) {
        binding(&self.verdicts)
    }

    /// The binding item of a job whose items count different units (item
    /// `i` of capacity `capacity(i)`), answered with its own remaining and
    /// reset, in its unit: denied, the denying item that frees last, as
    /// [`binding`] chooses; admitted, the one with the least left as a
    /// share of its capacity.
    pub fn binding_in_units(&self, capacity: impl Fn(usize) -> u64) -> (Verdict, usize) {
        let frees = |v: &Verdict| v.retry_after_ms.unwrap_or(u64::MAX);
        let items = self.verdicts.iter().enumerate();
        let denied = items.clone().filter(|(_, v)| !v.admitted).max_by_key(|(_, v)| frees(v));
        // remaining / capacity, compared as a cross product.
        let least_share = |(a, va): &(usize, &Verdict), (b, vb): &(usize, &Verdict)| {
            let left =
                |v: &Verdict, other: usize| u128::from(v.remaining) * u128::from(capacity(other).max(1));
            left(va, *b).cmp(&left(vb, *a))
        };
        match denied.or_else(|| items.min_by(least_share)) {
            Some((index, verdict)) => (*verdict, index),
            None => (Verdict { admitted: true, remaining: 0, retry_after_ms: Some(0), reset_after_ms: 0 }, 0),
        }
    }
}

/// One verdict for the items of one subject's limits (a native rule's, an
/// Envoy descriptor's `also`), and the index of the item that binds.
/// Denied (any item did not fit): the denying item that frees last (one
/// that never fits first). Admitted: the item with the least remaining.
/// Either way with the least remaining and the latest reset of all.
pub fn binding(verdicts: &[Verdict]) -> (Verdict, usize) {
    let remaining = verdicts.iter().map(|v| v.remaining).min().unwrap_or(0);
    let reset_after_ms = verdicts.iter().map(|v| v.reset_after_ms).max().unwrap_or(0);
    let frees = |v: &Verdict| v.retry_after_ms.unwrap_or(u64::MAX);
    let denied = verdicts.iter().enumerate().filter(|(_, v)| !v.admitted).max_by_key(|(_, v)| frees(v));
    let found = denied.or_else(|| verdicts.iter().enumerate().min_by_key(|(_, v)| v.remaining));
    match found {
        Some((index, verdict)) => (Verdict { remaining, reset_after_ms, ..*verdict }, index),
        None => (Verdict { admitted: true, remaining, retry_after_ms: Some(0), reset_after_ms }, 0),
    }
}

/// What a store saw of one counter, before the request's own weight: the
/// verdict follows from it alone (`Seen::verdict`), for both stores and
/// for the check of every Redis answer against the Rust arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    /// A window's counts and the ticks elapsed in the current window.
    Window {
        /// Counts of the current and the previous window.
        counts: window::Counts,
        /// Ticks elapsed in the current window.
        elapsed: u64,
    },
    /// A bucket's debt in units ([`bucket`]).
    Bucket {
        /// Units missing from a full bucket.
        debt: u64,
    },
}

impl Seen {
    /// What a store sees of `stored` (none: never counted, or expired) at
    /// `now` ticks: a window's counts (clamped to `window::max_count`) and
    /// the window to store them with ([`window::locate`]), or a bucket's
    /// debt (and 0).
    fn at(stored: Option<StoredCounter>, now: u64, params: WindowParams) -> (Self, u64) {
        if params.algorithm.is_bucket() {
            let debt = stored
                .map_or(0, |s| bucket::debt_of(params.algorithm, s.window, s.current, now, params.bucket()));
            return (Seen::Bucket { debt }, 0);
        }
        let (index, mut counts, elapsed) = window::locate(stored, now, params);
        // Only a report leaves a count above the capacity (≤ max_count): the
        // division of the clamp is paid only then.
        if counts.current.max(counts.previous) > params.capacity {
            counts = counts.clamped(params.window_ms);
        }
        (Seen::Window { counts, elapsed }, index)
    }

    /// The verdict for a request of `weight` (durations in ticks), as if
    /// it were counted when it fits.
    pub(crate) fn verdict(self, weight: u64, params: WindowParams) -> Verdict {
        match self {
            Seen::Window { counts, elapsed } => window::decide(counts, elapsed, weight, params),
            Seen::Bucket { debt } => bucket::decide(debt, weight, params.bucket()).0,
        }
    }

    /// The verdict for a request that is not counted, from its `test`
    /// (`self.verdict(weight, params)`): whether it fits and when it would,
    /// with `remaining` and `reset_after_ms` as the counter stands.
    fn uncounted(self, test: Verdict, params: WindowParams) -> Verdict {
        if !test.admitted {
            // Nothing was counted: remaining and reset are already the counter's own.
            return test;
        }
        Verdict { admitted: true, retry_after_ms: Some(0), ..self.verdict(0, params) }
    }

    /// The counter after `weight` is counted whatever is left, clamped
    /// exactly as both stores clamp it.
    fn after(self, weight: u64, params: WindowParams) -> Self {
        match self {
            Seen::Window { counts, elapsed } => {
                let mut current = counts.current.saturating_add(weight);
                // An admission stays within the capacity (≤ max_count): no division.
                if current > params.capacity {
                    current = current.min(window::max_count(params.window_ms));
                }
                Seen::Window { counts: window::Counts { current, previous: counts.previous }, elapsed }
            }
            Seen::Bucket { debt } => Seen::Bucket { debt: bucket::report(debt, weight, params.bucket()) },
        }
    }

    /// The counter after a refund of `weight` counted in window `window`,
    /// seen from window `index`: taken from that window's count while it
    /// counts (this one's or the previous one's), never below 0; a
    /// bucket's debt less `weight` tokens. Exactly as both stores do.
    fn refunded(self, weight: u64, params: WindowParams, index: u64, window: u64) -> Self {
        match self {
            Seen::Window { mut counts, elapsed } => {
                if window == index {
                    counts.current = counts.current.saturating_sub(weight);
                } else if window.checked_add(1) == Some(index) {
                    counts.previous = counts.previous.saturating_sub(weight);
                }
                Seen::Window { counts, elapsed }
            }
            Seen::Bucket { debt } => {
                Seen::Bucket { debt: debt.saturating_sub(weight.saturating_mul(params.window_ms)) }
            }
        }
    }

    /// The answer to a refund: for the next request, as a report's.
    fn answer_refund(self, weight: u64, params: WindowParams, index: u64, window: u64) -> Verdict {
        let after = self.refunded(weight, params, index, window);
        after.uncounted(after.verdict(1, params), params)
    }

    /// The counter after a report of `weight` counted whatever is left: its
    /// usage added, or for slots in flight ([`Algorithm::releases`]) that
    /// many given back, the previous window's first (the oldest), never
    /// below 0; exactly as both stores do.
    fn reported(self, weight: u64, params: WindowParams) -> Self {
        match self {
            Seen::Window { counts, elapsed } if params.algorithm.releases() => {
                let previous = counts.previous.saturating_sub(weight);
                let rest = weight - (counts.previous - previous);
                let current = counts.current.saturating_sub(rest);
                Seen::Window { counts: window::Counts { current, previous }, elapsed }
            }
            _ => self.after(weight, params),
        }
    }

    /// The answer to a decision of `weight` that counted as `count` says,
    /// from its `test` (`self.verdict(weight, params)`, which every caller
    /// has already computed); `counted`: an admission's weight was written. An admission answers
    /// for itself; a peek (or an admission not counted) answers without
    /// its weight; a report answers for the *next* request: whether one of
    /// weight 1 would pass now that the report is counted, and when. An
    /// admission counted anyway answers for itself; when it did not fit,
    /// with when the same weight would pass now that it is counted.
    pub(crate) fn answer(
        self,
        test: Verdict,
        weight: u64,
        count: Count,
        params: WindowParams,
        counted: bool,
    ) -> Verdict {
        match count {
            Count::IfFits if counted => test,
            Count::Always => {
                let after = self.reported(weight, params);
                after.uncounted(after.verdict(1, params), params)
            }
            Count::Anyway if test.admitted => test,
            Count::Anyway => {
                let after = self.after(weight, params);
                after.uncounted(after.verdict(weight, params), params)
            }
            Count::IfFits | Count::Never => self.uncounted(test, params),
        }
    }
}

/// One counter decided at `now` (in ticks): what was seen, whether the
/// weight fits, the answer, and the state to store (with how long, in
/// ticks, it still matters) when the decision writes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Evaluated {
    pub(crate) seen: Seen,
    pub(crate) fits: bool,
    pub(crate) verdict: Verdict,
    /// What to store, its time to live, and how much of the limit it
    /// holds at most from now on (a window's two counts, a bucket's debt).
    pub(crate) write: Option<(StoredCounter, u64, u64)>,
}

/// Decides a request of `weight` on the counter `stored` (none: never
/// counted, or expired) at `now` ticks, by the rule's algorithm, counting
/// it as `count` says. Pure: the memory store applies `write`; the Lua
/// script is its twin. A bucket keeps its stamp (last refill, or TAT in
/// whole ticks) in `StoredCounter::window` and its debt (or TAT remainder)
/// in `current`. A weight of 0 writes nothing.
pub(crate) fn evaluate(
    stored: Option<StoredCounter>,
    now: u64,
    weight: u64,
    params: WindowParams,
    (count, refund): (Count, Option<u64>),
) -> Evaluated {
    let (seen, index) = Seen::at(stored, now, params);
    let test = seen.verdict(weight, params);
    let fits = test.admitted;
    let writes = weight > 0 && (count.whatever_is_left() || (count == Count::IfFits && fits));
    let refund = refund.filter(|_| count == Count::Always);
    // An admission that does not fit is its own test: the answer is `test` either way.
    let verdict = match refund {
        Some(window) => seen.answer_refund(weight, params, index, window),
        None => seen.answer(test, weight, count, params, fits),
    };
    let write = writes.then(|| match (count, refund) {
        (Count::Always, Some(window)) => seen.refunded(weight, params, index, window),
        (Count::Always, None) => seen.reported(weight, params),
        _ => seen.after(weight, params),
    });
    let write = write.map(|next| match next {
        Seen::Window { counts, .. } => {
            let next = StoredCounter { window: index, current: counts.current, previous: counts.previous };
            // Until it stops mattering: a first-hit window's end, else the next window's.
            let ttl = match params.algorithm {
                Algorithm::FirstHitWindow => {
                    index.saturating_add(params.window_ms).saturating_sub(now).max(1)
                }
                // The next window's end (a counter of a later window: that
                // one's next).
                _ => index.saturating_add(2).saturating_mul(params.window_ms).saturating_sub(now).max(1),
            };
            (next, ttl, counts.current.saturating_add(counts.previous))
        }
        Seen::Bucket { debt } => {
            let b = params.bucket();
            let (stamp, value) = bucket::state_of(params.algorithm, debt, now, b);
            // Until it is full again, at least a tick.
            let tokens = debt.div_ceil(b.window_ms.max(1));
            (
                StoredCounter { window: stamp, current: value, previous: 0 },
                debt.div_ceil(b.rate).max(1),
                tokens,
            )
        }
    });
    Evaluated { seen, fits, verdict, write }
}

/// Per item: fits, then what the store saw before its own weight.
pub(crate) type RawItem = (bool, Seen);

/// Turns the raw per-item results of either store, deciding at `now_ms`,
/// into verdicts in ms.
pub(crate) fn many_verdicts(
    items: &[ManyItem],
    raw: &[RawItem],
    committed: bool,
    now_ms: u64,
) -> Vec<Verdict> {
    items
        .iter()
        .zip(raw)
        .map(|(item, &(fits, seen))| {
            let mut verdict = match item.refund.filter(|_| item.count == Count::Always) {
                Some(window) => seen.answer_refund(item.weight, item.params, item.window_at(now_ms), window),
                None => {
                    let test = seen.verdict(item.weight, item.params);
                    seen.answer(test, item.weight, item.count, item.params, fits && committed)
                }
            };
            verdict.retry_after_ms = verdict.retry_after_ms.map(|t| item.ms(t));
            verdict.reset_after_ms = item.ms(verdict.reset_after_ms);
            verdict
        })
        .collect()
}

/// Why the store could not decide. Cheap to build on the hot path's error
/// branch; the kind is what dashboards and dead-letter records group by.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct StoreError {
    /// Classification.
    pub kind: FailureKind,
    /// Detail from the client library (never contains credentials).
    pub message: String,
}

/// Classification of a store failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The call missed `redis.timeout_ms`.
    Timeout,
    /// Redis refused the connection.
    ConnectionRefused,
    /// The connection broke mid-call.
    ConnectionLost,
    /// No connection could be had from the pool in time, or too many
    /// decisions already wait for one.
    PoolExhausted,
    /// Not tried: the circuit breaker is open after consecutive failures.
    CircuitOpen,
    /// The script failed or answered something unexpected.
    ScriptError,
    /// A Redis Cluster error (slot moved, cluster down).
    ClusterError,
    /// The store is full: Redis at `maxmemory` under `noeviction`, or a
    /// shard of memory counters every one of which it sampled is owed to
    /// the shared store (the local limiter's: none may go).
    StoreFull,
    /// Anything else.
    Other,
}

impl FailureKind {
    /// Every kind, in the order of the enum.
    pub const ALL: [FailureKind; 9] = [
        FailureKind::Timeout,
        FailureKind::ConnectionRefused,
        FailureKind::ConnectionLost,
        FailureKind::PoolExhausted,
        FailureKind::CircuitOpen,
        FailureKind::ScriptError,
        FailureKind::ClusterError,
        FailureKind::StoreFull,
        FailureKind::Other,
    ];

    /// Stable snake_case name used in logs, metrics and records.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Timeout => "timeout",
            FailureKind::ConnectionRefused => "connection_refused",
            FailureKind::ConnectionLost => "connection_lost",
            FailureKind::PoolExhausted => "pool_exhausted",
            FailureKind::CircuitOpen => "circuit_open",
            FailureKind::ScriptError => "script_error",
            FailureKind::ClusterError => "cluster_error",
            FailureKind::StoreFull => "store_full",
            FailureKind::Other => "other",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
