//! The periodic exchanges with a store, in one place: what meets a store on
//! a period rather than per request (the overload feed, the adaptive
//! limits, the local limiter's instance count and write-back) is a
//! [`Participant`] with its own period, its own store and its own freshness
//! rule. One task ([`run`]) wakes when the first participant is due, runs
//! every one due (side by side, each in one round trip to its store),
//! counts each exchange under one metric family
//! (`ratelimitd_store_exchanges_total{exchange,result}`,
//! `ratelimitd_store_exchange_failing{exchange}`), and logs a run of
//! failures once: when it starts, naming what holds meanwhile, and when it
//! ends. A participant that aligns to the wall clock does it one way,
//! [`next_aligned`], so every instance exchanges the same interval.
//!
//! No participant's failure reaches a request: an exchange never blocks a
//! decision, and what holds while one fails is each participant's own rule
//! (the last drop ratios decaying, the limits in force, the hits owed).

use std::{
    fmt::Write as _,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use futures_util::future::{BoxFuture, join_all};
use tokio::sync::watch;

use super::{Clock, StoreError};
use crate::telemetry::exposition::{Figures, header};

/// One kind of periodic exchange with a store.
pub trait Participant: Send {
    /// The `exchange` label of its metrics and logs (`overload`,
    /// `adaptive`, `local`).
    fn name(&self) -> &'static str;
    /// What holds while its exchanges fail, for the log line that opens a
    /// run of failures.
    fn holding(&self) -> &'static str;
    /// When it is next due (ms of the wall clock), asked after each
    /// exchange and each wake: at most a second away when it must notice
    /// new rules soon.
    fn due(&mut self, now_ms: u64) -> u64;
    /// Exchanges what is due at `due_ms` (the instant [`due`](Self::due)
    /// named, however late the exchange runs: what a participant keys by
    /// the interval it counted, it keys by this), in one round trip to its
    /// store; `None` when nothing was (no call made, nothing counted).
    fn exchange(&mut self, due_ms: u64) -> BoxFuture<'_, Option<Result<(), StoreError>>>;
    /// At shutdown: a last exchange, if it owes one.
    fn finish(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// The first instant after `now_ms` that is `phase_ms` into a period of
/// `period_ms` of the wall clock: every instance computes the same one.
pub fn next_aligned(now_ms: u64, period_ms: u64, phase_ms: u64) -> u64 {
    let period = period_ms.max(1);
    let at = now_ms / period * period + phase_ms % period;
    if at > now_ms { at } else { at + period }
}

/// The exchanges' counts, by participant, for `/metrics`.
#[derive(Debug)]
pub struct ExchangeCounts {
    names: Box<[&'static str]>,
    ok: Box<[AtomicU64]>,
    failed: Box<[AtomicU64]>,
    failing: Box<[AtomicBool]>,
}

impl ExchangeCounts {
    /// Counts for `participants`, in their order.
    pub fn of(participants: &[Box<dyn Participant>]) -> Self {
        let names: Box<[&'static str]> = participants.iter().map(|p| p.name()).collect();
        let zeros = || names.iter().map(|_| AtomicU64::new(0)).collect();
        ExchangeCounts {
            ok: zeros(),
            failed: zeros(),
            failing: names.iter().map(|_| AtomicBool::new(false)).collect(),
            names,
        }
    }

    /// The exchanges of `name` so far: (succeeded, failed).
    pub fn get(&self, name: &str) -> (u64, u64) {
        self.names
            .iter()
            .position(|n| *n == name)
            .map_or((0, 0), |i| (self.ok[i].load(Ordering::Relaxed), self.failed[i].load(Ordering::Relaxed)))
    }

    /// Counts one exchange of participant `index`; a change between
    /// failing and not is logged, once.
    fn record(&self, index: usize, holding: &str, result: &Result<(), StoreError>) {
        let name = self.names[index];
        let was_failing = self.failing[index].swap(result.is_err(), Ordering::Relaxed);
        match result {
            Ok(()) => {
                self.ok[index].fetch_add(1, Ordering::Relaxed);
                if was_failing {
                    tracing::info!(exchange = name, "store exchange restored");
                }
            }
            Err(error) => {
                self.failed[index].fetch_add(1, Ordering::Relaxed);
                if !was_failing {
                    tracing::warn!(exchange = name, %error, "store exchange failing; {holding}");
                }
            }
        }
    }
}

impl Figures for ExchangeCounts {
    fn render(&self, out: &mut String) {
        header(
            out,
            "ratelimitd_store_exchanges_total",
            "counter",
            "Periodic exchanges with the store, by exchange (overload, adaptive, local) and result.",
        );
        for (i, name) in self.names.iter().enumerate() {
            for (result, n) in [("ok", &self.ok[i]), ("failed", &self.failed[i])] {
                let n = n.load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "ratelimitd_store_exchanges_total{{exchange=\"{name}\",result=\"{result}\"}} {n}"
                );
            }
        }
        header(
            out,
            "ratelimitd_store_exchange_failing",
            "gauge",
            "1 while the last exchange of its kind failed (what holds meanwhile: docs/observability.md).",
        );
        for (i, name) in self.names.iter().enumerate() {
            let failing = u8::from(self.failing[i].load(Ordering::Relaxed));
            let _ = writeln!(out, "ratelimitd_store_exchange_failing{{exchange=\"{name}\"}} {failing}");
        }
    }
}

/// Runs `participants` until `stop` turns true, counting into `counts`
/// (made [`ExchangeCounts::of`] them); then each finishes.
pub async fn run(
    mut participants: Vec<Box<dyn Participant>>,
    counts: Arc<ExchangeCounts>,
    clock: Arc<dyn Clock>,
    mut stop: watch::Receiver<bool>,
) {
    let start = clock.now_ms();
    let mut next: Vec<u64> = participants.iter_mut().map(|p| p.due(start)).collect();
    loop {
        let wake = next.iter().copied().min().unwrap_or(u64::MAX);
        let wait = wake.saturating_sub(clock.now_ms());
        if wait > 0 {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(wait)) => {}
                _ = stop.changed() => break,
            }
        }
        if *stop.borrow() {
            break;
        }
        let now = clock.now_ms();
        // Each is told when it was due, not when it runs: one that runs
        // late (the machine busy, another participant's slow store) still
        // writes what it counted under the interval it counted it in, the
        // interval every other instance writes and reads that turn.
        let runs =
            participants.iter_mut().enumerate().filter(|(i, _)| next[*i] <= now).map(|(i, participant)| {
                let due = next[i];
                async move {
                    let holding = participant.holding();
                    (i, holding, participant.exchange(due).await)
                }
            });
        for (i, holding, result) in join_all(runs).await {
            if let Some(result) = result {
                counts.record(i, holding, &result);
            }
        }
        let now = clock.now_ms();
        for (participant, at) in participants.iter_mut().zip(&mut next) {
            *at = participant.due(now);
        }
    }
    join_all(participants.iter_mut().map(|p| p.finish())).await;
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::{clock::ManualClock, limiter::FailureKind};

    #[test]
    fn aligned_instants_are_the_same_for_every_caller_and_always_ahead() {
        assert_eq!(next_aligned(10_003, 1_000, 5), 11_005 - 1_000);
        assert_eq!(next_aligned(10_005, 1_000, 5), 11_005);
        assert_eq!(next_aligned(10_600, 1_000, 500), 11_500);
        assert_eq!(next_aligned(0, 1_000, 0), 1_000);
    }

    /// Due every `period` ms from its last exchange; fails while `failing`.
    struct Probe {
        name: &'static str,
        period: u64,
        last: Option<u64>,
        failing: Arc<AtomicBool>,
        ran: Arc<Mutex<Vec<(&'static str, u64)>>>,
    }

    impl Participant for Probe {
        fn name(&self) -> &'static str {
            self.name
        }
        fn holding(&self) -> &'static str {
            "nothing changes"
        }
        fn due(&mut self, now_ms: u64) -> u64 {
            self.last.map_or(now_ms, |last| last + self.period)
        }
        fn exchange(&mut self, now_ms: u64) -> BoxFuture<'_, Option<Result<(), StoreError>>> {
            self.last = Some(now_ms);
            self.ran.lock().unwrap().push((self.name, now_ms));
            let failed = self.failing.load(Ordering::Relaxed);
            Box::pin(async move {
                Some(if failed {
                    Err(StoreError { kind: FailureKind::Timeout, message: "down".to_owned() })
                } else {
                    Ok(())
                })
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn each_participant_runs_at_its_own_period_and_failures_are_counted_per_exchange() {
        let clock = Arc::new(ManualClock::new(0));
        let ran = Arc::new(Mutex::new(Vec::new()));
        let failing = Arc::new(AtomicBool::new(false));
        let probe = |name, period| -> Box<dyn Participant> {
            Box::new(Probe { name, period, last: None, failing: Arc::clone(&failing), ran: Arc::clone(&ran) })
        };
        let participants = vec![probe("fast", 100), probe("slow", 300)];
        let counts = Arc::new(ExchangeCounts::of(&participants));
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(participants, Arc::clone(&counts), clock.clone(), stopped));
        for step in 1..=6 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            if step == 4 {
                failing.store(true, Ordering::Relaxed);
            }
            clock.set(step * 100);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = stop.send(true);
        task.await.unwrap();
        let ran = ran.lock().unwrap().clone();
        let of = |name| ran.iter().filter(|(n, _)| *n == name).map(|(_, at)| *at).collect::<Vec<_>>();
        assert_eq!(of("fast"), [0, 100, 200, 300, 400, 500, 600]);
        assert_eq!(of("slow"), [0, 300, 600]);
        assert_eq!(counts.get("fast"), (4, 3));
        assert_eq!(counts.get("slow"), (2, 1));
        let mut text = String::new();
        counts.render(&mut text);
        assert!(
            text.contains("ratelimitd_store_exchanges_total{exchange=\"fast\",result=\"failed\"} 3"),
            "{text}"
        );
        assert!(text.contains("ratelimitd_store_exchange_failing{exchange=\"slow\"} 1"), "{text}");
    }

    /// A participant that runs late (the clock already past its next
    /// instant, as when another's store was slow) is told the instant it was
    /// due, so an interval's counts keep the interval's key.
    #[tokio::test(start_paused = true)]
    async fn a_late_exchange_is_told_the_instant_it_was_due() {
        let clock = Arc::new(ManualClock::new(0));
        let ran = Arc::new(Mutex::new(Vec::new()));
        let failing = Arc::new(AtomicBool::new(false));
        let probe = Probe { name: "late", period: 500, last: None, failing, ran: Arc::clone(&ran) };
        let participants: Vec<Box<dyn Participant>> = vec![Box::new(probe)];
        let counts = Arc::new(ExchangeCounts::of(&participants));
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(participants, counts, clock.clone(), stopped));
        for now in [499, 990, 1_400] {
            tokio::time::sleep(Duration::from_millis(1)).await;
            clock.set(now);
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        let _ = stop.send(true);
        task.await.unwrap();
        let ran: Vec<u64> = ran.lock().unwrap().iter().map(|(_, at)| *at).collect();
        assert_eq!(ran, [0, 500, 1_000], "run at 0, 990 and 1400: told 0, 500 and 1000");
    }
}
