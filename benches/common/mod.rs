//! What the benches share: a counting global allocator (wrapping the
//! system one) and the heap allocations per call it measures.

use std::alloc::System;

use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Runs `f` `n` times and returns the heap allocations per call.
pub(crate) fn allocations_per_call(n: usize, mut f: impl FnMut()) -> f64 {
    let region = Region::new(GLOBAL);
    for _ in 0..n {
        f();
    }
    region.change().allocations as f64 / n as f64
}
