//! The overload layer's feed: the periodic exchange (a
//! [`Participant`] of [`crate::limiter::exchange`]) that turns the local
//! counts into drop ratios.
//!
//! Every `overload.report_interval_ms`, aligned to the wall clock so all
//! instances tick together (5 ms into each interval), it
//! 1. rebuilds the bucket table when the rules or the tenant table changed;
//! 2. takes each bucket's requests since the last tick;
//! 3. exchanges them with the global view: against Redis one pipelined call
//!    adds them to the hash of the interval that just ended
//!    (`rlo:{overload}:<index>`, field `kind|name|tenant`, expiring after
//!    a few intervals) and reads the whole hash of the interval before,
//!    which every instance finished writing an interval ago, plus the
//!    cluster-wide mode switch (`rlo:{overload}:mode`); with the memory
//!    store the instance is the whole view;
//! 4. computes every bucket's drop from those sums ([`solve`]) — the same
//!    function of the same sums on every instance — or, when the exchange
//!    failed, keeps the last drops, decayed by their age ([`solve::freshness`]).

use std::{collections::HashMap, sync::Arc, time::Duration};

use futures_util::future::BoxFuture;

use super::{Kind, Overload, Table, solve};
use crate::{
    clock::Clock,
    limiter::{
        RedisStore, StoreError,
        exchange::{Participant, next_aligned},
    },
    rules::{Hot, OverloadMode, OverloadScope, RuleStore, Versioned, envoy::EnvoyConfig, tenants::Tenants},
};

/// The Redis key of the cluster-wide mode switch (`ratelimitd overload`),
/// after `redis.key_prefix`.
pub const MODE_KEY: &str = "rlo:{overload}:mode";

/// The switch's key under `prefix` (`redis.key_prefix`).
pub fn mode_key(prefix: &str) -> String {
    format!("{prefix}{MODE_KEY}")
}

/// The hash of one interval's global counts, under `prefix`.
pub fn interval_key(prefix: &str, index: u64) -> String {
    format!("{prefix}rlo:{{overload}}:{index}")
}

/// Where the directives come from.
#[derive(Debug, Clone)]
pub struct Sources {
    /// Native rules (`overload:` on a rule).
    pub rules: Arc<RuleStore>,
    /// The Envoy configuration, when served.
    pub envoy: Option<Arc<Hot<EnvoyConfig>>>,
    /// The tenant table (`overload.tenants_path`), when set.
    pub tenants: Option<Arc<Hot<Tenants>>>,
}

/// Where the global view lives.
#[derive(Debug, Clone)]
pub enum Exchange {
    /// Summed in Redis over every instance.
    Redis(Arc<RedisStore>),
    /// This instance alone (the memory store).
    Local,
}

/// How the feed runs (from `overload.*`).
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// `overload.mode`: the mode unless the table or the switch say otherwise.
    pub mode: OverloadMode,
    /// `overload.report_interval_ms`.
    pub interval_ms: u64,
    /// `overload.max_staleness_ms`.
    pub max_staleness_ms: u64,
}

/// What one exchange brought back.
#[derive(Debug, Default)]
pub struct View {
    /// Requests per bucket field over one interval, all instances together.
    pub counts: HashMap<String, u64>,
    /// The cluster-wide mode switch, if set.
    pub mode: Option<String>,
}

/// The feed's state between ticks.
#[derive(Debug)]
pub struct Feed {
    overload: Arc<Overload>,
    sources: Sources,
    settings: Settings,
    /// The last mode switch read (kept while the view is unreachable).
    switch: Option<OverloadMode>,
    /// Whether the last exchange failed: the view after it lacks this
    /// instance's counts.
    failed: bool,
    drops: Vec<f64>,
}

impl Feed {
    /// A feed for `overload`; builds its first table at once.
    pub fn new(overload: Arc<Overload>, sources: Sources, settings: Settings, now_ms: u64) -> Self {
        let mut feed = Feed { overload, sources, settings, switch: None, failed: false, drops: Vec::new() };
        feed.refresh(now_ms);
        feed
    }

    /// Rebuilds the table when the rules or the tenant table changed, and
    /// sets the mode: the switch, else the table's, else `overload.mode`.
    pub fn refresh(&mut self, now_ms: u64) {
        let rules = self.sources.rules.load();
        let envoy = self.sources.envoy.as_ref().map(|e| e.load());
        let tenants =
            self.sources.tenants.as_ref().map_or_else(|| Arc::new(Tenants::default()), |t| t.load());
        let mode = self.switch.or(tenants.mode).unwrap_or(self.settings.mode);
        if self.overload.mode() != mode {
            tracing::info!(from = self.overload.mode().as_str(), to = mode.as_str(), "overload mode changed");
            self.overload.set_mode(mode);
        }
        let built_from = (
            rules.version().to_owned(),
            envoy.as_ref().map_or_else(String::new, |e| e.version().to_owned()),
            tenants.version().to_owned(),
        );
        let old = self.overload.table();
        if old.built_from == built_from {
            return;
        }
        let native = rules
            .rules()
            .iter()
            .filter_map(|r| r.overload.map(|spec| (Kind::Native, Arc::clone(&r.id), spec)));
        let envoy_directives: Vec<_> = envoy
            .as_ref()
            .map(|e| e.overload_directives().map(|(key, spec)| (Kind::Envoy, key, spec)).collect())
            .unwrap_or_default();
        let table = Table::build(native.chain(envoy_directives), &tenants, &old, built_from, now_ms);
        self.overload.swap_table(table);
    }

    /// Each bucket's requests since the last call, by field (buckets with
    /// none left out).
    pub fn collect(&self) -> Vec<(Box<str>, u64)> {
        let table = self.overload.table();
        let mut deltas = Vec::new();
        for directive in table.all() {
            for slot in &*directive.slots {
                let offered = slot.offered.load(std::sync::atomic::Ordering::Relaxed);
                let before = slot.reported.swap(offered, std::sync::atomic::Ordering::Relaxed);
                if offered > before {
                    deltas.push((slot.field.clone(), offered - before));
                }
            }
        }
        deltas
    }

    /// Applies one exchange's outcome at `now_ms`: new drops from a fresh
    /// view, or the last ones decayed by their age.
    pub fn apply(&mut self, now_ms: u64, outcome: Result<View, StoreError>) {
        let view = match outcome {
            Ok(view) => view,
            Err(_) => {
                self.failed = true;
                self.decay(now_ms);
                return;
            }
        };
        self.switch = match view.mode.as_deref() {
            None => None,
            Some(name) => match OverloadMode::parse(name) {
                Some(mode) => Some(mode),
                None => {
                    tracing::warn!(value = name, key = MODE_KEY, "ignoring an unknown overload mode switch");
                    None
                }
            },
        };
        // The view read back is the interval the exchange before this one
        // wrote: if that exchange failed, this instance's counts (and very
        // likely every other's) are missing from it, and its low sum would
        // switch drops off for an interval. Keep the drops until a view
        // this instance wrote its share of.
        if !std::mem::take(&mut self.failed) {
            self.solve(now_ms, &view);
        }
    }

    /// The last drops, each decayed by its directive's age.
    fn decay(&self, now_ms: u64) {
        let ordering = std::sync::atomic::Ordering::Relaxed;
        for directive in self.overload.table().all() {
            let freshness = solve::freshness(directive.age_ms(now_ms), self.settings.max_staleness_ms);
            for slot in &*directive.slots {
                let computed = f64::from_bits(slot.computed.load(ordering));
                slot.drop.store(solve::to_fixed(computed * freshness), ordering);
            }
        }
    }

    /// Every bucket's drop from the view's sums: the same function of the
    /// same sums on every instance.
    fn solve(&mut self, now_ms: u64, view: &View) {
        let ordering = std::sync::atomic::Ordering::Relaxed;
        let per_second = 1_000.0 / self.settings.interval_ms as f64;
        for directive in self.overload.table().all() {
            let loads: Vec<solve::TenantLoad> = directive
                .slots
                .iter()
                .map(|slot| solve::TenantLoad {
                    rate: view.counts.get(&*slot.field).copied().unwrap_or(0) as f64 * per_second,
                    weight: slot.weight,
                    floor: slot.floor,
                })
                .collect();
            let limit = directive.spec.rate_per_second as f64;
            match directive.spec.per {
                OverloadScope::Rule => {
                    solve::shared(limit, &loads, &mut self.drops);
                }
                OverloadScope::Tenant => {
                    self.drops.clear();
                    self.drops.extend(loads.iter().map(|load| solve::own(limit, *load)));
                }
            }
            for (slot, drop) in directive.slots.iter().zip(&self.drops) {
                slot.computed.store(drop.to_bits(), ordering);
                slot.drop.store(solve::to_fixed(*drop), ordering);
            }
            directive.updated_at_ms.store(now_ms, ordering);
        }
    }
}

/// The feed as a periodic exchange: due 5 ms into each interval of the
/// wall clock, after every instance has counted the interval that ended.
#[derive(Debug)]
pub struct FeedExchange {
    feed: Feed,
    exchange: Exchange,
    clock: Arc<dyn Clock>,
}

impl FeedExchange {
    /// The exchange of `feed` through `exchange`, timed by `clock`.
    pub fn new(feed: Feed, exchange: Exchange, clock: Arc<dyn Clock>) -> Self {
        FeedExchange { feed, exchange, clock }
    }
}

impl Participant for FeedExchange {
    fn name(&self) -> &'static str {
        "overload"
    }

    fn holding(&self) -> &'static str {
        "keeping the last drop ratios, decaying after overload.max_staleness_ms"
    }

    fn due(&mut self, now_ms: u64) -> u64 {
        next_aligned(now_ms, self.feed.settings.interval_ms, 5)
    }

    /// Nothing when no directive is in force: nothing to count, no call.
    fn exchange(&mut self, now_ms: u64) -> BoxFuture<'_, Option<Result<(), StoreError>>> {
        Box::pin(async move {
            self.feed.refresh(now_ms);
            // No directive in force: nothing to count, no call to make.
            self.feed.overload.table().all().next()?;
            let deltas = self.feed.collect();
            let interval = self.feed.settings.interval_ms;
            let outcome = match &self.exchange {
                Exchange::Local => {
                    Ok(View { counts: deltas.into_iter().map(|(f, n)| (f.into(), n)).collect(), mode: None })
                }
                Exchange::Redis(store) => {
                    let ended = (now_ms / interval).saturating_sub(1);
                    exchange_redis(store, ended, &deltas, interval).await
                }
            };
            let result = outcome.as_ref().map(|_| ()).map_err(StoreError::clone);
            self.feed.apply(self.clock.now_ms(), outcome);
            Some(result)
        })
    }
}

/// One pipelined call: add `deltas` to interval `ended`, read interval
/// `ended − 1` and the mode switch.
async fn exchange_redis(
    store: &RedisStore,
    ended: u64,
    deltas: &[(Box<str>, u64)],
    interval_ms: u64,
) -> Result<View, StoreError> {
    let mut pipeline = redis::pipe();
    if !deltas.is_empty() {
        let key = interval_key(store.key_prefix(), ended);
        for (field, delta) in deltas {
            pipeline.cmd("HINCRBY").arg(&key).arg(&**field).arg(*delta).ignore();
        }
        // Read one interval later; a few intervals' worth of hashes at most.
        pipeline.cmd("PEXPIRE").arg(&key).arg(interval_ms * 4).ignore();
    }
    pipeline.cmd("HGETALL").arg(interval_key(store.key_prefix(), ended.saturating_sub(1)));
    pipeline.cmd("GET").arg(mode_key(store.key_prefix()));
    // Well inside the interval, so a slow Redis never stacks exchanges.
    let timeout = Duration::from_millis((interval_ms / 2).clamp(10, 1_000));
    let (counts, mode): (HashMap<String, u64>, Option<String>) = store.pipeline(&pipeline, timeout).await?;
    Ok(View { counts, mode })
}

#[cfg(test)]
mod tests {
    use std::{path::Path, sync::atomic::Ordering};

    use super::*;
    use crate::{limiter::FailureKind, overload::OverloadVerdict, rules};

    const RULES: &str = "rules:\n  - { rule_id: r, resource_path: /r, limit: 1000000, window_seconds: 1, overload: { rate_per_second: 100 } }\n";

    fn feed(tenants: Option<&str>) -> Feed {
        let rules = rules::from_text(Path::new("r.yaml"), RULES, rules::PathForm::default()).unwrap();
        let sources = Sources {
            rules: Arc::new(Hot::new(rules)),
            envoy: None,
            tenants: tenants
                .map(|t| Arc::new(Hot::new(rules::tenants::parse(Path::new("t.yaml"), t).unwrap()))),
        };
        let settings = Settings { mode: OverloadMode::Enforce, interval_ms: 500, max_staleness_ms: 10_000 };
        Feed::new(Arc::new(Overload::new(OverloadMode::Enforce, 500)), sources, settings, 0)
    }

    fn view(counts: &[(&str, u64)], mode: Option<&str>) -> View {
        View {
            counts: counts.iter().map(|(f, n)| ((*f).to_owned(), *n)).collect(),
            mode: mode.map(str::to_owned),
        }
    }

    fn drop_of(feed: &Feed, slot: usize) -> f64 {
        feed.overload.table().all().next().unwrap().slots[slot].drop_ratio()
    }

    #[test]
    fn a_view_over_the_limit_sets_the_drop_and_a_stale_one_decays() {
        let mut feed = feed(None);
        for _ in 0..5 {
            feed.overload.check(Kind::Native, "r", None, false);
        }
        assert_eq!(&*feed.collect(), &[(Box::from("native|r|*"), 5)]);
        assert!(feed.collect().is_empty(), "counted once");
        // 150 requests in half a second: 300/s against 100/s.
        feed.apply(1_000, Ok(view(&[("native|r|*", 150)], None)));
        assert!((drop_of(&feed, 0) - 2.0 / 3.0).abs() < 1e-6);
        let failed = || Err(StoreError { kind: FailureKind::Timeout, message: "x".into() });
        feed.apply(11_000, failed());
        assert!((drop_of(&feed, 0) - 2.0 / 3.0).abs() < 1e-6, "unchanged up to max_staleness");
        feed.apply(16_000, failed());
        assert!((drop_of(&feed, 0) - 1.0 / 3.0).abs() < 1e-6, "half decayed");
        feed.apply(30_000, failed());
        assert_eq!(drop_of(&feed, 0), 0.0);
        // The first view after a failure lacks the counts the failed
        // exchange could not write: kept as it is (an interval of 300/s
        // read as 50/s would switch drops off).
        feed.apply(30_500, Ok(view(&[("native|r|*", 25)], None)));
        assert_eq!(feed.overload.table().all().next().unwrap().age_ms(30_500), 30_500 - 1_000);
        feed.apply(31_000, Ok(view(&[("native|r|*", 150)], None)));
        assert_eq!(feed.overload.table().all().next().unwrap().age_ms(31_000), 0);
        assert!((drop_of(&feed, 0) - 2.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn the_switch_beats_the_table_which_beats_the_config() {
        let mut feed = feed(Some("mode: shadow\n"));
        assert_eq!(feed.overload.mode(), OverloadMode::Shadow);
        feed.apply(1_000, Ok(view(&[], Some("off"))));
        feed.refresh(1_000);
        assert_eq!(feed.overload.mode(), OverloadMode::Off);
        assert_eq!(feed.overload.check(Kind::Native, "r", None, false), OverloadVerdict::Pass);
        // Kept while the view is unreachable, dropped once it is unset.
        feed.apply(1_500, Err(StoreError { kind: FailureKind::Timeout, message: "x".into() }));
        feed.refresh(1_500);
        assert_eq!(feed.overload.mode(), OverloadMode::Off);
        feed.apply(2_000, Ok(view(&[], None)));
        feed.refresh(2_000);
        assert_eq!(feed.overload.mode(), OverloadMode::Shadow);
    }

    #[test]
    fn tenants_share_by_weight() {
        let mut feed = feed(Some("tenants: [{name: paid, weight: 4}, {name: free, weight: 0.25}]"));
        // 100/s each against 100/s in all.
        feed.apply(1_000, Ok(view(&[("native|r|paid", 50), ("native|r|free", 50)], None)));
        let (paid, free) = (drop_of(&feed, 0), drop_of(&feed, 1));
        assert!((100.0 * (1.0 - paid) + 100.0 * (1.0 - free) - 100.0).abs() < 0.01, "{paid} {free}");
        assert!(free > paid * 15.0, "{paid} {free}");
        assert_eq!(
            feed.overload.table().all().next().unwrap().slots[0].drop.load(Ordering::Relaxed) > 0,
            paid > 0.0
        );
    }
}
