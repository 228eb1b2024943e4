//! What one connection is doing, for the server to tell the idle from the
//! busy when places run short: its requests in flight, how many it
//! started, when it was last active, and whether it was told to close
//! (its place reclaimed). Its requests update it through their
//! [`super::Caller`]; its I/O reads the close.

use std::{
    sync::{
        OnceLock,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    task::Waker,
    time::Instant,
};

use futures_util::task::AtomicWaker;

/// Milliseconds on the process's monotonic clock, the one every
/// connection's activity is kept by.
pub fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    u64::try_from(EPOCH.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// One connection's activity (see the module).
#[derive(Debug)]
pub struct Activity {
    in_flight: AtomicU32,
    started: AtomicU64,
    last_ms: AtomicU64,
    close: AtomicBool,
    waker: AtomicWaker,
}

impl Activity {
    /// A connection opened at `now_ms`, with nothing started.
    pub fn new(now_ms: u64) -> Self {
        Activity {
            in_flight: AtomicU32::new(0),
            started: AtomicU64::new(0),
            last_ms: AtomicU64::new(now_ms),
            close: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        }
    }

    /// A request begins: in flight until the guard is dropped (which marks
    /// when the connection was last active: while one is in flight it is
    /// not idle, so the start needs no clock).
    pub fn begin(self: &std::sync::Arc<Self>) -> Active {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.started.fetch_add(1, Ordering::Relaxed);
        Active(std::sync::Arc::clone(self))
    }

    /// The connection was active at `now_ms` (bytes arrived): for a
    /// protocol whose requests it does not follow.
    pub fn touch(&self, now_ms: u64) {
        self.last_ms.store(now_ms, Ordering::Relaxed);
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests started since the connection opened.
    pub fn started(&self) -> u64 {
        self.started.load(Ordering::Relaxed)
    }

    /// When a request last ended (or the connection opened).
    pub fn last_ms(&self) -> u64 {
        self.last_ms.load(Ordering::Relaxed)
    }

    /// Tells the connection to close: its next read ends it.
    pub fn close(&self) {
        self.close.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Whether the connection was told to close; `waker` is woken when it
    /// is (registered first, so no close is missed).
    pub fn closing(&self, waker: &Waker) -> bool {
        self.waker.register(waker);
        self.close.load(Ordering::Acquire)
    }

    /// Whether the connection was told to close, registering nothing: for
    /// the I/O to look before it reads, and register ([`Activity::closing`])
    /// only when it is to wait.
    pub fn closed(&self) -> bool {
        self.close.load(Ordering::Acquire)
    }

    #[cfg(test)]
    pub(crate) fn set_last_ms(&self, ms: u64) {
        self.last_ms.store(ms, Ordering::Relaxed);
    }
}

/// A request in flight on its connection, until dropped.
#[derive(Debug)]
pub struct Active(std::sync::Arc<Activity>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.last_ms.store(now_ms(), Ordering::Relaxed);
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}
