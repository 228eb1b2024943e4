//! The overload layer: a statistical drop in front of exact
//! counting, so that when traffic spikes Redis sees less load, not more.
//!
//! A rule (native `overload:`, or an Envoy descriptor's) declares a global
//! rate for a bucket: the rule, or the rule and tenant. Each instance counts
//! the requests of every bucket in atomics; every `overload.report_interval_ms`
//! the feed ([`feed`]) adds them to the global view (one pipelined Redis call
//! per interval per instance) and reads back the last interval's sums, from
//! which every instance computes the same drop ratios ([`solve`]). The hot
//! path ([`Overload::check`]) adds one to its bucket and flips a biased coin
//! against the cached ratio: no lock, no network, no allocation.
//!
//! Order of layers, in the engine: shedding → overload drop → exact counter.
//! A dropped request costs no store call and answers OVERLOAD.
//!
//! Invariants:
//! - buckets exist only for configured directives and tenants of the
//!   tenant table (tenants not in it share one bucket): no request value
//!   creates a bucket, a Redis field or a metric series;
//! - a stalled feed keeps the last ratios, decayed after
//!   `overload.max_staleness_ms` ([`solve::freshness`]): never fail-open
//!   or fail-closed because of the feed.

pub mod feed;
mod figures;
pub mod solve;

use std::{
    collections::HashMap,
    hash::BuildHasher as _,
    sync::{
        Arc,
        atomic::{AtomicU8, AtomicU64, Ordering},
    },
};

use arc_swap::ArcSwap;

use crate::rules::{OverloadMode, OverloadScope, OverloadSpec, tenants::Tenants};

/// The label of the bucket of tenants not in the table (and of requests
/// that name no tenant): not a valid tenant name, so never a real one.
pub const OTHER_TENANT: &str = "*";

/// What the overload layer says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverloadVerdict {
    /// Not dropped (or no directive, or the layer is off).
    Pass,
    /// Dropped: answer OVERLOAD, retry after this many ms.
    Drop {
        /// When the ratio is next recomputed.
        retry_after_ms: u64,
    },
    /// Would have been dropped, but the layer (or the rule) is in shadow mode.
    ShadowDrop,
}

/// Which rule format a directive belongs to (their names are separate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A native rule, by id.
    Native,
    /// An Envoy limit, by full key.
    Envoy,
}

impl Kind {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Native => "native",
            Kind::Envoy => "envoy",
        }
    }
}

/// One tenant's bucket of a directive.
#[derive(Debug)]
pub struct Slot {
    /// The tenant (or [`OTHER_TENANT`]).
    pub tenant: Arc<str>,
    /// Its weight and floor from the table.
    pub weight: f64,
    /// Requests per second it always keeps.
    pub floor: f64,
    /// The global view's field: `kind|name|tenant`.
    pub(crate) field: Box<str>,
    /// Requests seen (the hot path's counter, also the coin's input).
    pub(crate) offered: AtomicU64,
    /// `offered` as last added to the global view (the feed's).
    pub(crate) reported: AtomicU64,
    /// The drop applied now, fixed point ([`solve::ONE`] = all).
    pub(crate) drop: AtomicU64,
    /// The drop last computed, before decay (f64 bits; the feed's).
    pub(crate) computed: AtomicU64,
    /// Requests dropped.
    pub(crate) dropped: AtomicU64,
    /// Requests that would have been dropped in shadow mode.
    pub(crate) shadow_dropped: AtomicU64,
}

impl Slot {
    /// Requests seen, dropped, shadow-dropped.
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.offered.load(Ordering::Relaxed),
            self.dropped.load(Ordering::Relaxed),
            self.shadow_dropped.load(Ordering::Relaxed),
        )
    }

    /// The drop ratio applied now.
    pub fn drop_ratio(&self) -> f64 {
        self.drop.load(Ordering::Relaxed) as f64 / solve::ONE as f64
    }
}

/// One directive's buckets: one per tenant of the table, plus the others'.
#[derive(Debug)]
pub struct Directive {
    /// Native or Envoy.
    pub kind: Kind,
    /// The rule id or the Envoy limit's full key.
    pub name: Arc<str>,
    /// The rate and scope.
    pub spec: OverloadSpec,
    /// One per tenant of the table in order, then [`OTHER_TENANT`]'s.
    pub slots: Box<[Slot]>,
    /// When its ratios were last computed from a fresh global view
    /// (ms of the feed's clock; 0: never).
    pub(crate) updated_at_ms: AtomicU64,
}

impl Directive {
    fn new(kind: Kind, name: Arc<str>, spec: OverloadSpec, tenants: &Tenants, now_ms: u64) -> Self {
        let slot = |tenant: &str, weight: &crate::rules::tenants::TenantWeight| Slot {
            tenant: Arc::from(tenant),
            weight: weight.weight,
            floor: weight.min_floor_rps as f64,
            field: format!("{}|{name}|{tenant}", kind.as_str()).into_boxed_str(),
            offered: AtomicU64::new(0),
            reported: AtomicU64::new(0),
            drop: AtomicU64::new(0),
            computed: AtomicU64::new(0f64.to_bits()),
            dropped: AtomicU64::new(0),
            shadow_dropped: AtomicU64::new(0),
        };
        let slots = tenants
            .tenants
            .iter()
            .map(|(tenant, weight)| slot(tenant, weight))
            .chain(std::iter::once(slot(OTHER_TENANT, &tenants.default)))
            .collect();
        Directive { kind, name, spec, slots, updated_at_ms: AtomicU64::new(now_ms) }
    }

    /// Ms since the ratios were last computed from a fresh view.
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.updated_at_ms.load(Ordering::Relaxed))
    }

    /// The rate and scope as a metric label.
    pub fn scope(&self) -> OverloadScope {
        self.spec.per
    }
}

/// The buckets of every directive in force, for one tenant table. Rebuilt
/// (by the feed) when the rules or the table change; a directive whose
/// name, spec and table are unchanged keeps its counters.
#[derive(Debug, Default)]
pub struct Table {
    /// Tenant name → slot index.
    tenants: HashMap<Arc<str>, usize>,
    /// The versions it was built from: native, Envoy, tenant table.
    pub(crate) built_from: (String, String, String),
    native: HashMap<Arc<str>, Arc<Directive>>,
    envoy: HashMap<Arc<str>, Arc<Directive>>,
}

impl Table {
    /// A table of `directives` over `tenants`, reusing the directives of
    /// `old` that did not change.
    pub(crate) fn build(
        directives: impl IntoIterator<Item = (Kind, Arc<str>, OverloadSpec)>,
        tenants: &Tenants,
        old: &Table,
        built_from: (String, String, String),
        now_ms: u64,
    ) -> Self {
        let same_tenants = old.built_from.2 == built_from.2;
        let mut table = Table {
            tenants: tenants
                .tenants
                .iter()
                .enumerate()
                .map(|(index, (name, _))| (Arc::from(name.as_str()), index))
                .collect(),
            built_from,
            native: HashMap::new(),
            envoy: HashMap::new(),
        };
        for (kind, name, spec) in directives {
            let kept =
                old.directives(kind).get(&name).filter(|d| same_tenants && d.spec == spec).map(Arc::clone);
            let directive = kept
                .unwrap_or_else(|| Arc::new(Directive::new(kind, Arc::clone(&name), spec, tenants, now_ms)));
            match kind {
                Kind::Native => table.native.insert(name, directive),
                Kind::Envoy => table.envoy.insert(name, directive),
            };
        }
        table
    }

    /// How many directives are in force (native rules and Envoy limits).
    pub fn directive_count(&self) -> usize {
        self.native.len() + self.envoy.len()
    }

    fn directives(&self, kind: Kind) -> &HashMap<Arc<str>, Arc<Directive>> {
        match kind {
            Kind::Native => &self.native,
            Kind::Envoy => &self.envoy,
        }
    }

    /// Every directive, native first.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Directive>> {
        self.native.values().chain(self.envoy.values())
    }
}

/// The hot path's handle on the overload layer.
#[derive(Debug)]
pub struct Overload {
    table: ArcSwap<Table>,
    /// The [`OverloadMode`] in force, as its index.
    mode: AtomicU8,
    /// Mixed into the coin's input.
    seed: u64,
    /// `retry_after_ms` of a dropped request: the ratio's next recomputation.
    retry_after_ms: u64,
}

impl Overload {
    /// A layer in `mode` with no directives yet (the feed builds them).
    pub fn new(mode: OverloadMode, report_interval_ms: u64) -> Self {
        Overload {
            table: ArcSwap::from_pointee(Table::default()),
            mode: AtomicU8::new(mode_index(mode)),
            seed: std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64),
            retry_after_ms: report_interval_ms,
        }
    }

    /// The mode in force.
    pub fn mode(&self) -> OverloadMode {
        match self.mode.load(Ordering::Relaxed) {
            0 => OverloadMode::Enforce,
            1 => OverloadMode::Shadow,
            _ => OverloadMode::Off,
        }
    }

    pub(crate) fn set_mode(&self, mode: OverloadMode) {
        self.mode.store(mode_index(mode), Ordering::Relaxed);
    }

    /// The current table (for metrics and the feed).
    pub fn table(&self) -> Arc<Table> {
        self.table.load_full()
    }

    pub(crate) fn swap_table(&self, table: Table) {
        self.table.store(Arc::new(table));
    }

    /// Counts one request against the directive `name` of `kind` for
    /// `tenant` and flips the coin. `shadow`: the rule never refuses, so a
    /// drop is only counted. One map lookup per name and tenant, one atomic
    /// add, two loads; nothing else.
    pub fn check(&self, kind: Kind, name: &str, tenant: Option<&str>, shadow: bool) -> OverloadVerdict {
        let mode = self.mode();
        if mode == OverloadMode::Off {
            return OverloadVerdict::Pass;
        }
        let table = self.table.load();
        let Some(directive) = table.directives(kind).get(name) else {
            return OverloadVerdict::Pass;
        };
        let index = tenant.and_then(|t| table.tenants.get(t)).copied().unwrap_or(directive.slots.len() - 1);
        let slot = &directive.slots[index];
        let n = slot.offered.fetch_add(1, Ordering::Relaxed);
        let drop = slot.drop.load(Ordering::Relaxed);
        if drop == 0 || !solve::coin(n, self.seed, drop) {
            return OverloadVerdict::Pass;
        }
        if mode == OverloadMode::Shadow || shadow {
            slot.shadow_dropped.fetch_add(1, Ordering::Relaxed);
            return OverloadVerdict::ShadowDrop;
        }
        slot.dropped.fetch_add(1, Ordering::Relaxed);
        OverloadVerdict::Drop { retry_after_ms: self.retry_after_ms }
    }
}

fn mode_index(mode: OverloadMode) -> u8 {
    match mode {
        OverloadMode::Enforce => 0,
        OverloadMode::Shadow => 1,
        OverloadMode::Off => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::tenants;

    fn spec(rate: u64) -> OverloadSpec {
        OverloadSpec { rate_per_second: rate, per: OverloadScope::Rule }
    }

    fn layer(tenants: &Tenants) -> Overload {
        let overload = Overload::new(OverloadMode::Enforce, 500);
        let table = Table::build(
            [(Kind::Native, Arc::from("r"), spec(10))],
            tenants,
            &Table::default(),
            (String::new(), String::new(), "t".to_owned()),
            0,
        );
        overload.swap_table(table);
        overload
    }

    #[test]
    fn requests_are_counted_per_tenant_and_dropped_at_the_ratio() {
        let table =
            tenants::parse(std::path::Path::new("t.yaml"), "tenants: [{name: acme, weight: 4}]").unwrap();
        let overload = layer(&table);
        assert_eq!(overload.check(Kind::Native, "r", Some("acme"), false), OverloadVerdict::Pass);
        assert_eq!(overload.check(Kind::Native, "r", Some("nobody"), false), OverloadVerdict::Pass);
        assert_eq!(overload.check(Kind::Native, "r", None, false), OverloadVerdict::Pass);
        assert_eq!(overload.check(Kind::Envoy, "r", None, false), OverloadVerdict::Pass, "kinds are apart");
        let t = overload.table();
        let directive = &t.native["r"];
        assert_eq!(directive.slots[0].counts().0, 1);
        assert_eq!(directive.slots[1].counts().0, 2, "unknown tenants and none share the other bucket");
        directive.slots[1].drop.store(solve::ONE, Ordering::Relaxed);
        assert_eq!(
            overload.check(Kind::Native, "r", None, false),
            OverloadVerdict::Drop { retry_after_ms: 500 }
        );
        assert_eq!(overload.check(Kind::Native, "r", None, true), OverloadVerdict::ShadowDrop);
        overload.set_mode(OverloadMode::Shadow);
        assert_eq!(overload.check(Kind::Native, "r", None, false), OverloadVerdict::ShadowDrop);
        overload.set_mode(OverloadMode::Off);
        assert_eq!(overload.check(Kind::Native, "r", None, false), OverloadVerdict::Pass);
        assert_eq!(directive.slots[1].counts(), (5, 1, 2), "off counts nothing");
    }

    #[test]
    fn a_rebuild_keeps_unchanged_directives() {
        let table = Tenants::default();
        let overload = layer(&table);
        overload.check(Kind::Native, "r", None, false);
        let old = overload.table();
        let same = Table::build(
            [(Kind::Native, Arc::from("r"), spec(10)), (Kind::Native, Arc::from("s"), spec(5))],
            &table,
            &old,
            (String::new(), String::new(), "t".to_owned()),
            0,
        );
        assert!(Arc::ptr_eq(&same.native["r"], &old.native["r"]));
        let changed =
            Table::build([(Kind::Native, Arc::from("r"), spec(11))], &table, &old, old.built_from.clone(), 0);
        assert!(!Arc::ptr_eq(&changed.native["r"], &old.native["r"]), "a new rate starts a new bucket");
    }
}
