//! What the global exchange shows (`/metrics`, `rules status`): per global
//! limit of this region, its grants' total, its keys, its demand, the age
//! of its lease and the allocator's last answer. Bounded: one series per
//! global rule, never per key.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use crate::{
    clock::Clock,
    limiter::StoreError,
    telemetry::exposition::{Figures, escape, header},
};

/// The allocator's last answer to this region for one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Answer {
    /// Not asked yet (this instance is not the agent, or no key was active).
    #[default]
    None,
    /// Grants came back.
    Ok,
    /// The report failed (unreachable, timed out).
    Failed,
    /// Another deployment holds this region's name.
    Claimed,
}

impl Answer {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Answer::None => "none",
            Answer::Ok => "ok",
            Answer::Failed => "failed",
            Answer::Claimed => "claimed",
        }
    }
}

/// One limit's figures.
#[derive(Debug, Clone, Copy, Default)]
pub struct LimitStatus {
    /// The sum of the region's grants over the limit's keys.
    pub granted: u64,
    /// Keys with a grant.
    pub keys: usize,
    /// Admitted and denied over the last interval, all keys.
    pub demand: u64,
    /// When the lease of the last grants ends (ms of the monotonic clock);
    /// 0: none held.
    pub until_ms: u64,
    /// The allocator's last answer.
    pub answer: Answer,
    /// Reports answered and failed.
    pub reports_ok: u64,
    /// Reports that failed.
    pub reports_failed: u64,
}

/// The global exchange's figures for this region.
#[derive(Debug)]
pub struct GlobalStatus {
    region: String,
    lease_ms: u64,
    clock: Arc<dyn Clock>,
    agent: AtomicBool,
    expired: AtomicU64,
    limits: Mutex<BTreeMap<Arc<str>, LimitStatus>>,
}

impl GlobalStatus {
    /// The figures of region `region` under leases of `lease_ms`, ages on
    /// `clock` (monotonic).
    pub fn new(region: &str, lease_ms: u64, clock: Arc<dyn Clock>) -> Self {
        GlobalStatus {
            region: region.to_owned(),
            lease_ms,
            clock,
            agent: AtomicBool::new(false),
            expired: AtomicU64::new(0),
            limits: Mutex::default(),
        }
    }

    fn with(&self, id: &Arc<str>, f: impl FnOnce(&mut LimitStatus)) {
        let mut limits = self.limits.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        f(limits.entry(Arc::clone(id)).or_default());
    }

    /// Whether this instance is its region's agent.
    pub fn set_agent(&self, agent: bool) {
        self.agent.store(agent, Ordering::Relaxed);
    }

    /// Whether this instance is its region's agent.
    pub fn is_agent(&self) -> bool {
        self.agent.load(Ordering::Relaxed)
    }

    /// Limit `id` now holds `granted` over `keys` keys, leased until
    /// `until_ms` (the monotonic clock).
    pub fn granted(&self, id: &Arc<str>, granted: u64, keys: usize, until_ms: u64) {
        self.with(id, |s| (s.granted, s.keys, s.until_ms) = (granted, keys, until_ms.max(1)));
    }

    /// The region's demand of limit `id` over the last interval.
    pub fn demand(&self, id: &Arc<str>, demand: u64) {
        self.with(id, |s| s.demand = demand);
    }

    /// The allocator's answer to a report of limit `id`.
    pub fn answered(&self, id: &Arc<str>, result: Result<(), &StoreError>) {
        self.with(id, |s| match result {
            Ok(()) => {
                s.answer = Answer::Ok;
                s.reports_ok += 1;
            }
            Err(error) => {
                s.answer =
                    if error.message.contains("REGION_CLAIMED") { Answer::Claimed } else { Answer::Failed };
                s.reports_failed += 1;
            }
        });
    }

    /// Whether the lease of limit `id`'s grants has run out since they
    /// came while some were above the region's `floor`: then the region is
    /// back on its floors, counted (and true) once. (Grants at the floor
    /// of keys gone idle lapse unremarked.)
    pub fn lease_ran_out(&self, id: &Arc<str>, floor: u64) -> bool {
        let now = self.clock.now_ms();
        let mut ran_out = false;
        self.with(id, |s| {
            if s.until_ms != 0 && now >= s.until_ms {
                ran_out = s.granted > floor.saturating_mul(s.keys as u64);
                (s.granted, s.keys, s.until_ms) = (0, 0, 0);
            }
        });
        if ran_out {
            self.expired.fetch_add(1, Ordering::Relaxed);
        }
        ran_out
    }

    /// Drops the limits no longer served.
    pub fn retain(&self, served: &dyn Fn(&str) -> bool) {
        self.limits.lock().unwrap_or_else(std::sync::PoisonError::into_inner).retain(|id, _| served(id));
    }

    /// Every limit's figures, by id.
    pub fn limits(&self) -> Vec<(Arc<str>, LimitStatus)> {
        let limits = self.limits.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        limits.iter().map(|(id, s)| (Arc::clone(id), *s)).collect()
    }

    /// The region's name.
    pub fn region(&self) -> &str {
        &self.region
    }

    /// Leases that ran out so far.
    pub fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }

    /// Seconds since the lease of `s`'s grants began; `None` when it holds none.
    pub fn lease_age_seconds(&self, s: &LimitStatus) -> Option<f64> {
        let began = s.until_ms.saturating_sub(self.lease_ms);
        (s.until_ms != 0).then(|| self.clock.now_ms().saturating_sub(began) as f64 / 1_000.0)
    }
}

impl GlobalStatus {
    /// One gauge per served limit, `value` rendering its sample (`None`:
    /// no sample).
    fn per_limit(
        &self,
        out: &mut String,
        (name, help): (&str, &str),
        limits: &[(Arc<str>, LimitStatus)],
        value: impl Fn(&LimitStatus) -> Option<String>,
    ) {
        header(out, name, "gauge", help);
        let region = escape(&self.region);
        for (id, s) in limits {
            if let Some(value) = value(s) {
                let _ = writeln!(out, "{name}{{limit=\"{}\",region=\"{region}\"}} {value}", escape(id));
            }
        }
    }
}

impl GlobalStatus {
    /// The reports to the coordination store and its last answer, per limit.
    fn render_answers(&self, out: &mut String, limits: &[(Arc<str>, LimitStatus)]) {
        let region = escape(&self.region);
        header(
            out,
            "ratelimitd_global_reports_total",
            "counter",
            "The agent's reports of a global limit to the coordination store, by result.",
        );
        for (id, s) in limits {
            for (result, n) in [("ok", s.reports_ok), ("failed", s.reports_failed)] {
                let id = escape(id);
                let _ = writeln!(
                    out,
                    "ratelimitd_global_reports_total{{limit=\"{id}\",region=\"{region}\",result=\"{result}\"}} {n}"
                );
            }
        }
        header(
            out,
            "ratelimitd_global_last_answer",
            "gauge",
            "1 for the allocator's last answer to the region for a global limit (none, ok, failed, claimed).",
        );
        for (id, s) in limits {
            let (id, answer) = (escape(id), s.answer.as_str());
            let _ = writeln!(
                out,
                "ratelimitd_global_last_answer{{limit=\"{id}\",region=\"{region}\",answer=\"{answer}\"}} 1"
            );
        }
    }
}

impl Figures for GlobalStatus {
    fn render(&self, out: &mut String) {
        let region = escape(&self.region);
        header(
            out,
            "ratelimitd_global_agent",
            "gauge",
            "1 while this instance is its region's agent for the global limits.",
        );
        let _ = writeln!(out, "ratelimitd_global_agent{{region=\"{region}\"}} {}", u8::from(self.is_agent()));
        header(
            out,
            "ratelimitd_global_lease_expired_total",
            "counter",
            "Times a global limit's lease ran out and the region fell to its floors.",
        );
        let _ =
            writeln!(out, "ratelimitd_global_lease_expired_total{{region=\"{region}\"}} {}", self.expired());
        let limits = self.limits();
        let grant =
            ("ratelimitd_global_grant", "The region's grants of a global limit, summed over its keys.");
        self.per_limit(out, grant, &limits, |s| Some(s.granted.to_string()));
        let keys = ("ratelimitd_global_keys", "Keys of a global limit the region holds a grant for.");
        self.per_limit(out, keys, &limits, |s| Some(s.keys.to_string()));
        let demand = (
            "ratelimitd_global_demand",
            "Hits of a global limit the region admitted and denied in the last interval (the agent's view).",
        );
        self.per_limit(out, demand, &limits, |s| Some(s.demand.to_string()));
        let age = (
            "ratelimitd_global_lease_age_seconds",
            "Seconds since the lease of the region's grants of a global limit began (absent: none held).",
        );
        self.per_limit(out, age, &limits, |s| self.lease_age_seconds(s).map(|a| a.to_string()));
        self.render_answers(out, &limits);
    }
}
