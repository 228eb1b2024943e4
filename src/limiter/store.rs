//! Where counters live: [`CounterStore`], what a store implements, and
//! [`Store`], the one the service opened, through which the decision path,
//! the local limiter's write-back, the health monitor, `/metrics` and every
//! periodic exchange reach it.
//!
//! Adding a store: its folder under `limiter/` implementing
//! [`CounterStore`] (and passing `tests/conformance.rs`), one line in
//! `stores!` below (the registration), and its settings (a section
//! `config/` composes, opened in `server/parts/store.rs`). Nothing else
//! matches on the store.

use std::{future::Future, sync::Arc, time::Duration};

use tokio::sync::{Semaphore, SemaphorePermit};

use super::{
    Count, CounterSpec, ManyItem, ManyOutcome, MemoryStore, RedisStore, StoreError, Verdict, breaker::Breaker,
};
use crate::telemetry::exposition::Figures;

/// The shares of the store's in-flight work one call draws on: a Redis
/// call holds a permit of each it is given while it runs, its tenant's
/// first, then its peer's, then its connection's (one order for every
/// call, so no two wait on each other). `Shares::default()`: unbounded.
#[derive(Debug, Clone, Copy, Default)]
pub struct Shares<'a> {
    /// The caller's connection's and peer's.
    pub caller: Option<&'a CallerCalls>,
    /// The caller's tenant's (`grpc.max_store_calls_per_tenant`).
    pub tenant: Option<&'a Semaphore>,
}

/// One caller's shares of the store's in-flight calls: its connection's
/// (`grpc.max_store_calls_per_connection`) and, for an untrusted peer, the
/// one all the peer's connections draw on (`grpc.max_store_calls_per_peer`).
#[derive(Debug)]
pub struct CallerCalls {
    /// The connection's own.
    pub connection: Semaphore,
    /// The peer's; `None` for a trusted peer.
    pub peer: Option<Arc<Semaphore>>,
}

/// The permits a call holds while it runs ([`CounterStore::hold`]): none
/// for a store in the process.
pub type Held<'s> = [Option<SemaphorePermit<'s>>; 3];

/// What a store does: decide counters atomically as the window arithmetic
/// says (`evaluate`, or a script that is its twin), list a group's
/// counters, and say whether it answers. `tests/conformance.rs` runs the
/// behaviours every store shows against each.
pub trait CounterStore: std::fmt::Debug + Send + Sync + 'static {
    /// Its name in logs and metrics (`memory`, `redis`).
    const NAME: &'static str;
    /// Whether a call leaves the process: only those are timed, hold the
    /// caller's [`Shares`], and are worth a cache of denials.
    const REMOTE: bool;

    /// Decides a request of `weight` for `user_id` against `counter` and
    /// counts it as `count` says ([`Count`]): if it fits, never (a peek),
    /// or always (a report); holding a permit of each of `shares` while it
    /// runs. The verdict of a peek or a report describes the counter
    /// without (peek) or after (report) its weight.
    fn decide_in(
        &self,
        shares: Shares<'_>,
        user_id: &str,
        counter: CounterSpec<'_>,
        weight: u64,
        count: Count,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send;

    /// One all-or-nothing job over several counters of `group` (reports
    /// only, or no report): if any item blocks (`ManyItem::blocks`), none
    /// of the admissions is counted.
    fn decide_job(
        &self,
        group: &str,
        items: &[ManyItem],
    ) -> impl Future<Output = Result<ManyOutcome, StoreError>> + Send;

    /// A permit of each of `shares`, held for a call of several jobs.
    fn hold<'s>(&self, shares: Shares<'s>) -> impl Future<Output = Held<'s>> + Send {
        let _ = shares;
        std::future::ready([None, None, None])
    }

    /// The keys of `group`'s job counters that start with `prefix` and
    /// still count, at most `max` (unordered); see [`Listed`].
    fn list_keys(
        self: &Arc<Self>,
        group: &str,
        prefix: &str,
        max: usize,
    ) -> impl Future<Output = Result<Listed, StoreError>> + Send;

    /// Whether the store answers within `timeout` (the readiness probe),
    /// restoring what a restart of the store lost.
    fn probe(&self, timeout: Duration) -> impl Future<Output = bool> + Send {
        let _ = timeout;
        std::future::ready(true)
    }

    /// Its circuit breakers, which the readiness monitor reads and closes
    /// once its probe finds the store answering.
    fn breakers(&self) -> Option<Arc<[Breaker]>> {
        None
    }

    /// The store every instance of the deployment shares, through which
    /// the periodic exchanges (the instance count, the overload feed, the
    /// adaptive limits, a region's grants) sum what each instance saw; they
    /// are Redis commands. `None`: this instance is the whole deployment,
    /// and each exchange keeps what it saw.
    fn shared(self: &Arc<Self>) -> Option<&Arc<RedisStore>> {
        None
    }

    /// What it shows in `/metrics`.
    fn figures(self: &Arc<Self>) -> Arc<dyn Figures>;
}

/// What [`Store::list`] found: keys, and whether the listing is complete
/// (`false`: more than `max` keys, or a Redis scan that reached its bound
/// before the end of the keyspace).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listed {
    /// The keys within their group, at most `max`.
    pub keys: Vec<String>,
    /// Every key of the group and prefix is in `keys`.
    pub complete: bool,
}

/// Declares [`Store`], one variant per store, and `each!`, which runs one
/// body on whichever store a `Store` holds. (`$d` is a `$` handed in, so
/// the inner macro can name its own arguments.)
macro_rules! stores {
    ($d:tt $($(#[doc = $doc:literal])* $variant:ident($store:ty),)*) => {
        /// The store this service opened. An enum rather than a trait
        /// object: static dispatch, and no boxed future per decision.
        #[derive(Debug, Clone)]
        pub enum Store {
            $($(#[doc = $doc])* $variant(Arc<$store>),)*
        }

        /// `$body` with `$s` bound to the store inside `$store`.
        macro_rules! each {
            ($d store_:expr, $d s:ident => $d body:expr) => {
                match $d store_ {
                    $(Store::$variant($d s) => $d body,)*
                }
            };
        }
    };
}

// The registration: one line per store.
stores! {$
    /// In-process counters (the embedded default).
    Memory(MemoryStore),
    /// Counters in Redis, updated by a Lua script.
    Redis(RedisStore),
}

impl Store {
    /// [`CounterStore::decide_in`] with no shares to hold.
    pub async fn decide(
        &self,
        user_id: &str,
        counter: CounterSpec<'_>,
        weight: u64,
        count: Count,
    ) -> Result<Verdict, StoreError> {
        self.decide_in(Shares::default(), user_id, counter, weight, count).await
    }

    /// See [`CounterStore::decide_in`].
    pub async fn decide_in(
        &self,
        shares: Shares<'_>,
        user_id: &str,
        counter: CounterSpec<'_>,
        weight: u64,
        count: Count,
    ) -> Result<Verdict, StoreError> {
        each!(self, s => s.decide_in(shares, user_id, counter, weight, count).await)
    }

    /// Decides several counters together, all or nothing (Envoy's
    /// multi-descriptor requests): if any non-shadow item does not fit,
    /// none of the admissions is counted. `group` scopes the keys (the
    /// Envoy domain). Reports ([`Count::Always`]) are counted whatever the
    /// others decide: mixed with admissions, they go to the store as a job
    /// of their own.
    pub async fn decide_many(&self, group: &str, items: &[ManyItem]) -> Result<ManyOutcome, StoreError> {
        self.decide_many_in(Shares::default(), group, items).await
    }

    /// [`Store::decide_many`] for a caller with `shares` of a remote
    /// store's in-flight calls: one permit of each for the whole call.
    pub async fn decide_many_in(
        &self,
        shares: Shares<'_>,
        group: &str,
        items: &[ManyItem],
    ) -> Result<ManyOutcome, StoreError> {
        each!(self, s => decide_many(&**s, shares, group, items).await)
    }

    /// One job as it is, reports with admissions: nothing of it is counted
    /// unless every admission fits (a settlement and its claim,
    /// `decision::reservation`), for a caller with `shares`.
    pub async fn decide_job_in(
        &self,
        shares: Shares<'_>,
        group: &str,
        items: &[ManyItem],
    ) -> Result<ManyOutcome, StoreError> {
        each!(self, s => {
            let _held = s.hold(shares).await;
            s.decide_job(group, items).await
        })
    }

    /// The keys of `group`'s job counters (those of [`Store::decide_many`])
    /// that start with `prefix` and still count, at most `max` of them
    /// (unordered); see [`Listed`]. Memory: every shard walked, one lock
    /// hold each, on a blocking thread. Redis: `SCAN … MATCH` on the node
    /// serving the group's hash slot, at most [`super::redis::MAX_SCAN_CALLS`]
    /// calls of [`super::redis::SCAN_COUNT`] keys, each within `redis.timeout_ms`.
    pub async fn list(&self, group: &str, prefix: &str, max: usize) -> Result<Listed, StoreError> {
        each!(self, s => s.list_keys(group, prefix, max).await)
    }

    /// See [`CounterStore::probe`].
    pub async fn probe(&self, timeout: Duration) -> bool {
        each!(self, s => s.probe(timeout).await)
    }

    /// See [`CounterStore::breakers`].
    pub fn breakers(&self) -> Option<Arc<[Breaker]>> {
        each!(self, s => CounterStore::breakers(&**s))
    }

    /// See [`CounterStore::shared`].
    pub fn shared(&self) -> Option<&Arc<RedisStore>> {
        each!(self, s => s.shared())
    }

    /// See [`CounterStore::figures`].
    pub fn figures(&self) -> Arc<dyn Figures> {
        each!(self, s => s.figures())
    }

    /// Whether a call leaves the process ([`CounterStore::REMOTE`]).
    pub fn is_remote(&self) -> bool {
        each!(self, _s => remote(_s))
    }

    /// Its name, for logs ([`CounterStore::NAME`]).
    pub fn name(&self) -> &'static str {
        each!(self, _s => name(_s))
    }
}

fn remote<S: CounterStore>(_: &Arc<S>) -> bool {
    S::REMOTE
}

fn name<S: CounterStore>(_: &Arc<S>) -> &'static str {
    S::NAME
}

/// A listing of an in-process store (every shard walked, one lock hold
/// each) run on a blocking thread, off the async workers.
pub(crate) async fn listed_blocking(
    list: impl FnOnce() -> Listed + Send + 'static,
) -> Result<Listed, StoreError> {
    tokio::task::spawn_blocking(list).await.map_err(|e| StoreError {
        kind: super::FailureKind::Other,
        message: format!("counter listing failed: {e}"),
    })
}

/// [`Store::decide_many_in`] on `store`: the shares held for the whole
/// call; reports mixed with admissions split into a job of their own.
pub async fn decide_many<S: CounterStore>(
    store: &S,
    shares: Shares<'_>,
    group: &str,
    items: &[ManyItem],
) -> Result<ManyOutcome, StoreError> {
    let _held = store.hold(shares).await;
    let reports = items.iter().filter(|i| i.count.whatever_is_left()).count();
    if reports == 0 || reports == items.len() {
        return store.decide_job(group, items).await;
    }
    // Rare (one request carrying both reports and admissions): clones.
    let (reported, decided): (Vec<ManyItem>, Vec<ManyItem>) =
        items.iter().cloned().partition(|i| i.count.whatever_is_left());
    let (reported, decided) =
        tokio::join!(store.decide_job(group, &reported), store.decide_job(group, &decided));
    let (mut reported, mut decided) = (reported?.verdicts.into_iter(), decided?);
    let committed = decided.committed;
    let mut admissions = std::mem::take(&mut decided.verdicts).into_iter();
    let verdicts = items
        .iter()
        .map(|i| if i.count.whatever_is_left() { reported.next() } else { admissions.next() })
        .collect::<Option<Vec<Verdict>>>()
        .expect("one verdict per item");
    Ok(ManyOutcome { committed, verdicts, now_ms: decided.now_ms })
}
