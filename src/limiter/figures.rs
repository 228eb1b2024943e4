//! The stores' figures for `/metrics` (`telemetry::Figures`): the
//! in-memory store's counters and evictions, the local limiter's share
//! and write-back, and the store calls that waited for their share.

use std::fmt::Write as _;

use super::{MemoryStore, local::LocalLimiter};
use crate::telemetry::exposition::{Figures, header, single};

impl Figures for MemoryStore {
    fn render(&self, out: &mut String) {
        single(
            out,
            "ratelimitd_memory_counters",
            "gauge",
            "Counters held by the in-memory store (expired ones not yet swept included).",
            self.len(),
        );
        single(
            out,
            "ratelimitd_memory_counters_max",
            "gauge",
            "The most counters the in-memory store holds (memory.max_counters, rounded up to the shards).",
            self.max_counters(),
        );
        single(
            out,
            "ratelimitd_memory_evictions_total",
            "counter",
            "Expired counters evicted to make room for new ones in a full shard.",
            self.evictions(),
        );
        single(
            out,
            "ratelimitd_memory_live_evictions_total",
            "counter",
            "Counters that still counted evicted to make room in a full shard (the least full first), each remembered in the shard's summary so its key returns at least at its count.",
            self.live_evictions(),
        );
        share_waits(out, ShareWaits::default());
    }
}

impl Figures for LocalLimiter {
    fn render(&self, out: &mut String) {
        let gauges: [(&str, &str, &str, u64); 5] = [
            (
                "ratelimitd_local_instances",
                "gauge",
                "Instances each limit is shared by when decided locally (reported alive, else local.instances).",
                self.instances(),
            ),
            (
                "ratelimitd_local_counters",
                "gauge",
                "Counters held by the local limiter (expired ones not yet swept included).",
                self.counters() as u64,
            ),
            (
                "ratelimitd_local_owed_hits",
                "gauge",
                "Hits admitted locally and not yet written back to the shared store.",
                self.owed_hits(),
            ),
            (
                "ratelimitd_local_owed_folded_hits_total",
                "counter",
                "Locally admitted hits folded out of the owed entries at their bound (local.max_counters): never written back.",
                self.folded_hits(),
            ),
            (
                "ratelimitd_local_written_back_hits_total",
                "counter",
                "Locally admitted hits written back to the shared store.",
                self.written_back(),
            ),
        ];
        for (name, kind, help, value) in gauges {
            header(out, name, kind, help);
            let _ = writeln!(out, "{name} {value}");
        }
    }
}

/// Calls that waited for a share of the in-flight calls, by share.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShareWaits {
    /// For their connection's (`grpc.max_store_calls_per_connection`).
    pub connection: u64,
    /// For their tenant's (`grpc.max_store_calls_per_tenant`).
    pub tenant: u64,
    /// For their peer's (`grpc.max_store_calls_per_peer`).
    pub peer: u64,
}

/// `ratelimitd_store_call_waits_total`, shown by every store (a store in
/// the process never waits: 0).
pub(crate) fn share_waits(out: &mut String, waits: ShareWaits) {
    header(
        out,
        "ratelimitd_store_call_waits_total",
        "counter",
        "Store calls that waited for their connection's, peer's or tenant's share (grpc.max_store_calls_per_*).",
    );
    let _ = writeln!(out, "ratelimitd_store_call_waits_total{{share=\"connection\"}} {}", waits.connection);
    let _ = writeln!(out, "ratelimitd_store_call_waits_total{{share=\"peer\"}} {}", waits.peer);
    let _ = writeln!(out, "ratelimitd_store_call_waits_total{{share=\"tenant\"}} {}", waits.tenant);
}
