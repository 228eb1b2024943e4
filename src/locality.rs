//! Which serving thread the current code runs on. The gRPC port's
//! connections are each served by one thread with a runtime of its own
//! (`server/threads.rs`); what a decision wakes (the store's dispatcher,
//! its connection) lives on that thread too, so a decision crosses no
//! thread but for the store's round trip. Stores that keep state per
//! thread read the index here; code on any other thread reads `None`.

use std::cell::Cell;

thread_local! {
    static SERVING: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The index of the serving thread running this code (counted from 0,
/// below `grpc.serving_threads`), `None` elsewhere.
pub fn serving_thread() -> Option<usize> {
    SERVING.with(Cell::get)
}

/// Marks the current thread as serving thread `index`, for its life.
pub fn become_serving_thread(index: usize) {
    SERVING.with(|serving| serving.set(Some(index)));
}
