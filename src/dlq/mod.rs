//! Failed decisions: the seam through which every decision the store could
//! not make is reported, exactly once, with the answer the failure policy gave.
//!
//! Today the only sink logs (rate-limited, so an outage does not flood the
//! log). The Kafka dead-letter topic and the file sink of DESIGN §8 plug in
//! here by implementing [`FailureSink`]; the decision path does not change.

use std::{
    fmt,
    sync::atomic::{AtomicU64, Ordering},
};

use crate::{
    decision::{CheckRequest, Reason},
    limiter::{Clock, StoreError, SystemClock},
    rules::{Priority, Rule},
};

/// One decision the store could not make, as the hot path saw it.
#[derive(Debug)]
pub struct FailedDecision<'a> {
    /// The request, as validated.
    pub request: &'a CheckRequest<'a>,
    /// The rule that matched.
    pub rule: &'a Rule,
    /// The priority the request was decided with.
    pub priority: Priority,
    /// What went wrong.
    pub error: &'a StoreError,
    /// The answer given: `FailOpen` or `FailClosed`.
    pub answer: Reason,
}

/// Receives failed decisions. Called on the hot path: implementations must
/// only enqueue, never wait on I/O.
pub trait FailureSink: Send + Sync + fmt::Debug {
    /// Records one failed decision.
    fn record(&self, failure: &FailedDecision<'_>);
}

/// Logs failed decisions at `warn`, at most one line per second; the line
/// carries how many were folded into it.
#[derive(Debug, Default)]
pub struct LogSink {
    last_logged_s: AtomicU64,
    suppressed: AtomicU64,
}

impl FailureSink for LogSink {
    fn record(&self, failure: &FailedDecision<'_>) {
        let now_s = SystemClock.now_ms() / 1_000;
        let last = self.last_logged_s.load(Ordering::Relaxed);
        if now_s > last
            && self.last_logged_s.compare_exchange(last, now_s, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            let folded = self.suppressed.swap(0, Ordering::Relaxed);
            tracing::warn!(
                rule = %failure.rule.id,
                kind = %failure.error.kind,
                error = %failure.error.message,
                answer = failure.answer.as_str(),
                folded,
                "store could not decide; answered by failure policy"
            );
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
        }
    }
}
