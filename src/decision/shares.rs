//! Each tenant's share of the store's in-flight work
//! (`grpc.max_store_calls_per_tenant`), where a tenant table is configured
//! (`overload.tenants_path`): one semaphore per tenant the table names, one
//! more shared by every other tenant and by requests without one. A store
//! call holds a permit of its tenant's (and of its connection's, see
//! `grpc.max_store_calls_per_connection`) while it runs, so a tenant flooding distinct keys
//! over many connections (or through one Envoy that carries everyone's
//! traffic) waits for its own calls, not the others'.
//!
//! The semaphores follow the hot-reloaded table: the first decision after a
//! swap rebuilds them, keeping the semaphore (and the permits in flight) of
//! every tenant the new table still names. Their number is bounded by the
//! table's (`MAX_TENANTS` + 1); a name the table does not hold, whatever a
//! request claims, draws on the shared one.

use std::sync::Arc;

use arc_swap::ArcSwap;
use hashbrown::HashMap;
use tokio::sync::Semaphore;

use crate::rules::{Hot, tenants::Tenants};

/// The semaphores of one version of the tenant table.
#[derive(Debug)]
struct Built {
    /// The table's [`Hot::loads`] they were built for.
    loads: u64,
    named: HashMap<Box<str>, Arc<Semaphore>>,
    other: Arc<Semaphore>,
}

/// Every tenant's share of the store's in-flight calls.
#[derive(Debug)]
pub struct TenantShares {
    table: Arc<Hot<Tenants>>,
    permits: usize,
    built: ArcSwap<Built>,
}

impl TenantShares {
    /// `permits` store calls in flight per tenant of `table`.
    pub fn new(table: Arc<Hot<Tenants>>, permits: usize) -> Self {
        let other = Arc::new(Semaphore::new(permits));
        let built = build(&table, permits, &HashMap::new(), other);
        TenantShares { table, permits, built: ArcSwap::from_pointee(built) }
    }

    /// The share of `tenant`: its own if the table names it, else the
    /// one every other tenant shares. An `Arc` clone, no allocation.
    pub fn of(&self, tenant: Option<&str>) -> Arc<Semaphore> {
        let mut built = self.built.load();
        if built.loads != self.table.loads() {
            // Rare: the first decision after a swap of the table.
            let next = build(&self.table, self.permits, &built.named, Arc::clone(&built.other));
            self.built.store(Arc::new(next));
            built = self.built.load();
        }
        Arc::clone(tenant.and_then(|t| built.named.get(t)).unwrap_or(&built.other))
    }
}

/// The semaphores for the table's current version, reusing `old`'s for
/// the names it still holds.
fn build(
    table: &Hot<Tenants>,
    permits: usize,
    old: &HashMap<Box<str>, Arc<Semaphore>>,
    other: Arc<Semaphore>,
) -> Built {
    // Read before the table: a swap in between only rebuilds once more.
    let loads = table.loads();
    let named = table
        .load()
        .tenants
        .iter()
        .map(|(name, _)| {
            let kept = old.get(name.as_str()).map(Arc::clone);
            (Box::from(name.as_str()), kept.unwrap_or_else(|| Arc::new(Semaphore::new(permits))))
        })
        .collect();
    Built { loads, named, other }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::rules::tenants::parse;

    fn table(text: &str) -> Tenants {
        parse(Path::new("tenants.yaml"), text).expect("valid table")
    }

    #[test]
    fn named_tenants_have_their_own_share_and_the_rest_one_together() {
        let hot = Arc::new(Hot::new(table("tenants:\n  - { name: acme }\n  - { name: globex }\n")));
        let shares = TenantShares::new(Arc::clone(&hot), 2);
        let acme = shares.of(Some("acme"));
        let _held = acme.try_acquire_many(2).expect("acme's two permits");
        assert_eq!(shares.of(Some("acme")).available_permits(), 0, "acme has used its share");
        assert_eq!(shares.of(Some("globex")).available_permits(), 2, "globex keeps its own");
        let other = shares.of(Some("claimed-by-anyone"));
        assert!(Arc::ptr_eq(&other, &shares.of(None)), "unknown and absent tenants share one");
        assert!(!Arc::ptr_eq(&other, &acme));
    }

    #[test]
    fn a_swapped_table_keeps_the_shares_of_the_tenants_it_still_names() {
        let hot = Arc::new(Hot::new(table("tenants:\n  - { name: acme }\n  - { name: gone }\n")));
        let shares = TenantShares::new(Arc::clone(&hot), 3);
        let acme = shares.of(Some("acme"));
        let _held = acme.try_acquire().expect("a permit");
        let other = shares.of(None);
        hot.swap(table("tenants:\n  - { name: acme }\n  - { name: new }\n"));
        assert!(Arc::ptr_eq(&acme, &shares.of(Some("acme"))), "acme's permits in flight still count");
        assert_eq!(shares.of(Some("acme")).available_permits(), 2);
        assert!(Arc::ptr_eq(&other, &shares.of(Some("gone"))), "a dropped name joins the others");
        assert_eq!(shares.of(Some("new")).available_permits(), 3, "a new name gets a share");
    }
}
