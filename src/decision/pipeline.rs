//! The decision pipeline: the ordered layers every API runs, written once
//! ([`Engine::run`]). What differs between the APIs — one rule and one
//! counter for `Check`, descriptors and an all-or-nothing set of counters
//! for `ShouldRateLimit` — is a [`Subject`]: how a request of that API
//! answers each layer. Adding a layer means adding it here, once, and a
//! method to the trait that each API answers.
//!
//! The order, and why:
//! 1. **shed**: before anything that costs a store call; the utilization
//!    level is read once, so the answer and its status agree; a report is
//!    never shed (its usage has happened);
//! 2. **settle**: a request with nothing to count (no rule, a weight the
//!    rule can never admit, only unlimited descriptors) is answered here;
//! 3. **overload**: the probabilistic drop in front of exact counting (no
//!    store call when dropped);
//! 4. **cached**: a denial the store gave that still holds (no store call);
//! 5. **store**: the counter store decides, timed when remote, the caller's
//!    share of in-flight calls held meanwhile;
//! 6. **answer**, or when the store could not decide, the **failure
//!    policy** (`check.rs`, `envoy/failed.rs`).

use tracing::Instrument as _;

use super::{Engine, Reason};
use crate::{
    limiter::StoreError,
    shed::{Level, Priority, ShedVerdict},
};

/// One request as the pipeline sees it, whichever API asked.
pub(super) trait Subject: Sized {
    /// The API's answer.
    type Answer;
    /// What the store answers for it.
    type Outcome;

    /// The priority it is decided with.
    fn priority(&self) -> Priority;
    /// Never shed: it only reports usage that has happened.
    fn shed_exempt(&self) -> bool;
    /// The answer to a request refused before any counter: shed, or
    /// dropped by the overload layer.
    fn refused(self, engine: &Engine, reason: Reason, retry_after_ms: u64, level: Level) -> Self::Answer;
    /// Past shedding, at `level` (`shadow_shed`: shedding would have
    /// refused it in enforce mode): the answer when there is nothing to
    /// count; else `None`, the subject ready for the store.
    fn settle(&mut self, engine: &Engine, level: Level, shadow_shed: bool) -> Option<Self::Answer>;
    /// The overload layer: `Some(retry_after_ms)` when it drops the request.
    fn overload(&self, engine: &Engine) -> Option<u64>;
    /// A denial the cache still holds for it.
    fn cached(&mut self, engine: &Engine) -> Option<Self::Answer>;
    /// How many counters its store call decides.
    fn keys(&self) -> usize;
    /// The store call.
    async fn decide(&self, engine: &Engine) -> Result<Self::Outcome, StoreError>;
    /// The answer from what the store said.
    fn answer(self, engine: &Engine, outcome: Self::Outcome) -> Self::Answer;
    /// The failure policy's answer, the store having failed with `error`.
    fn failed(self, engine: &Engine, error: StoreError) -> Self::Answer;
}

impl Engine {
    /// Runs `subject` through the layers, in order, to its answer.
    pub(super) async fn run<S: Subject>(&self, subject: S) -> S::Answer {
        let level = self.inner.shedder.level();
        let verdict = if subject.shed_exempt() {
            ShedVerdict::Pass
        } else {
            self.inner.shedder.check(level, subject.priority())
        };
        let shadow_shed = match verdict {
            ShedVerdict::Pass => false,
            ShedVerdict::ShadowShed => true,
            ShedVerdict::Shed { retry_after_ms } => {
                return subject.refused(self, Reason::Shed, retry_after_ms, level);
            }
        };
        let mut subject = subject;
        if let Some(answer) = subject.settle(self, level, shadow_shed) {
            return answer;
        }
        if let Some(retry_after_ms) = subject.overload(self) {
            return subject.refused(self, Reason::Overload, retry_after_ms, level);
        }
        if let Some(answer) = subject.cached(self) {
            return answer;
        }
        let started = self.store_call_started();
        let decided = subject
            .decide(self)
            .instrument(tracing::info_span!(
                "store.decide",
                store = self.inner.store.name(),
                keys = subject.keys()
            ))
            .await;
        self.store_call_done(started, &decided);
        match decided {
            Ok(outcome) => subject.answer(self, outcome),
            Err(error) => subject.failed(self, error),
        }
    }
}
