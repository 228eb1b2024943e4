//! Folding a flood of failed decisions into aggregate records, so that no
//! flood can fill the dead-letter queue or its disk cap and crowd out a real
//! failure.
//!
//! Per rule, failure kind and answer, the first `dlq.aggregate_after`
//! failures of each interval (`dlq.aggregate_interval_ms`) are written as
//! records of their own; the rest of that interval are only counted, and
//! one aggregate record stands for them: the first folded failure as its
//! sample, `count` the number of failed decisions it stands for,
//! `last_time` when the last of them happened. A folded failure costs a
//! lock and an increment, no allocation and no queue slot. The writer task
//! takes the aggregates of ended intervals every interval, and every one
//! left at shutdown.
//!
//! Bounded: one slot per (rule, kind, answer) seen, at most `MAX_RULES`
//! rules (rule ids are configured, never request values); past it a failure
//! is written on its own, where the queue's bounds apply.

use std::{collections::HashMap, sync::Mutex};

use super::record::{FailureRecord, format_time};
use crate::{
    decision::{FailedDecision, Reason},
    limiter::FailureKind,
};

/// The most rules whose failures are folded.
pub const MAX_RULES: usize = 100_000;

/// What [`Folds::admit`] says of one failure.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
    /// Write it as a record of its own.
    Own,
    /// Counted into its interval's aggregate.
    Folded,
}

#[derive(Debug)]
struct Slot {
    kind: FailureKind,
    answer: Reason,
    /// The interval (`time / interval_ms`) being counted.
    interval: u64,
    /// Failures of the interval written on their own.
    own: u32,
    /// The aggregate of the interval: its sample, how many it stands for,
    /// and the time of the last.
    sample: Option<FailureRecord>,
    folded: u64,
    last_ms: u64,
}

impl Slot {
    /// The interval's aggregate record, if any failure was folded; resets.
    fn take(&mut self) -> Option<FailureRecord> {
        let mut record = self.sample.take()?;
        record.count = std::mem::take(&mut self.folded);
        record.last_time = Some(format_time(self.last_ms));
        Some(record)
    }
}

/// The fold state of every (rule, kind, answer).
#[derive(Debug)]
pub struct Folds {
    interval_ms: u64,
    after: u32,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    slots: HashMap<Box<str>, Vec<Slot>>,
    /// Aggregates of intervals that ended, waiting for the writer.
    ready: Vec<FailureRecord>,
}

impl Folds {
    /// Writes the first `after` failures of each (rule, kind, answer) per
    /// `interval_ms` on their own, and folds the rest.
    pub fn new(interval_ms: u64, after: u32) -> Self {
        Folds { interval_ms: interval_ms.max(1), after, state: Mutex::new(State::default()) }
    }

    /// Decides whether `failure`, at `now_ms`, is written on its own or
    /// folded; a folded one's record is built (by `record`) only when it is
    /// its interval's sample.
    pub fn admit(
        &self,
        failure: &FailedDecision<'_>,
        now_ms: u64,
        record: impl FnOnce() -> FailureRecord,
    ) -> Admit {
        let interval = now_ms / self.interval_ms;
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let State { slots, ready } = &mut *state;
        if !slots.contains_key(failure.rule_id) {
            if slots.len() >= MAX_RULES {
                return Admit::Own;
            }
            slots.insert(failure.rule_id.into(), Vec::new());
        }
        let slots = slots.get_mut(failure.rule_id).expect("inserted above");
        let (kind, answer) = (failure.error.kind, failure.answer);
        let slot = match slots.iter().position(|s| s.kind == kind && s.answer == answer) {
            Some(at) => &mut slots[at],
            None => {
                slots.push(Slot { kind, answer, interval, own: 0, sample: None, folded: 0, last_ms: 0 });
                slots.last_mut().expect("just pushed")
            }
        };
        if slot.interval != interval {
            ready.extend(slot.take());
            slot.interval = interval;
            slot.own = 0;
        }
        if slot.own < self.after {
            slot.own += 1;
            return Admit::Own;
        }
        if slot.sample.is_none() {
            slot.sample = Some(record());
        }
        slot.folded += 1;
        slot.last_ms = now_ms;
        Admit::Folded
    }

    /// The aggregates of intervals ended by `now_ms` (every one when
    /// `now_ms` is `u64::MAX`: at shutdown), appended to `out`.
    pub fn take_ended(&self, now_ms: u64, out: &mut Vec<FailureRecord>) {
        let current = now_ms / self.interval_ms;
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let State { slots, ready } = &mut *state;
        out.append(ready);
        for slot in slots.values_mut().flatten() {
            if slot.interval < current || now_ms == u64::MAX {
                out.extend(slot.take());
            }
        }
        // Rules not failing any more give their slots back.
        slots.retain(|_, rule| {
            rule.retain(|s| s.interval >= current.saturating_sub(1) || s.sample.is_some());
            !rule.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::{limiter::StoreError, shed::Priority};

    fn failure<'a>(
        rule: &'a str,
        error: &'a StoreError,
        headers: &'a HashMap<String, String>,
    ) -> FailedDecision<'a> {
        FailedDecision {
            user_id: "u",
            resource_path: "/p",
            client_type: None,
            weight: 1,
            count: crate::limiter::Count::IfFits,
            headers,
            trace_id: None,
            rule_id: rule,
            priority: Priority::Bulk,
            error,
            answer: Reason::LocalOk,
        }
    }

    fn record(failure: &FailedDecision<'_>, now_ms: u64) -> FailureRecord {
        FailureRecord::new(failure, "id".to_owned(), now_ms, "i", &[], &Default::default())
    }

    #[test]
    fn a_flood_becomes_a_few_records_and_one_aggregate_per_interval() {
        let folds = Folds::new(1_000, 2);
        let error = StoreError { kind: FailureKind::Timeout, message: "late".to_owned() };
        let headers = HashMap::new();
        let f = failure("r", &error, &headers);
        let admitted: Vec<Admit> =
            (0..1_000).map(|i| folds.admit(&f, 5_000 + i % 999, || record(&f, 5_000))).collect();
        assert_eq!(admitted.iter().filter(|a| **a == Admit::Own).count(), 2);
        let mut out = Vec::new();
        folds.take_ended(5_999, &mut out);
        assert!(out.is_empty(), "the interval has not ended");
        folds.take_ended(6_000, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].count, 998);
        assert!(out[0].last_time.is_some());
        // Another rule, kind or answer is folded apart.
        let other = StoreError { kind: FailureKind::CircuitOpen, message: String::new() };
        let g = failure("r", &other, &headers);
        assert_eq!(folds.admit(&g, 6_000, || record(&g, 6_000)), Admit::Own);
        assert_eq!(folds.admit(&f, 6_000, || record(&f, 6_000)), Admit::Own, "a new interval");
    }

    #[test]
    fn an_interval_left_unflushed_is_kept_and_shutdown_takes_all() {
        let folds = Folds::new(1_000, 0);
        let error = StoreError { kind: FailureKind::Timeout, message: String::new() };
        let headers = HashMap::new();
        let f = failure("r", &error, &headers);
        for now in [1_000, 1_500, 2_100] {
            assert_eq!(folds.admit(&f, now, || record(&f, now)), Admit::Folded);
        }
        let mut out = Vec::new();
        folds.take_ended(u64::MAX, &mut out);
        let counts: Vec<u64> = out.iter().map(|r| r.count).collect();
        assert_eq!(counts, [2, 1], "the first interval's aggregate moved aside when the second began");
    }
}
