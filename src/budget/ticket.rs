//! One request's hold on the byte budget: its header block and the stream
//! it costs from its arrival, then each message from its announced
//! length until it is whole, all given back when the request ends. A
//! request of an untrusted peer is listed with its peer, so that its bytes
//! can be reclaimed (its request cancelled) when that peer holds most of
//! the budget and another caller needs it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    task::Waker,
};

use futures_util::task::AtomicWaker;

use super::{Budget, CallerBytes, Refused, activity::Active};

/// Tickets a peer lists before the dead ones are pruned (then at every
/// doubling).
const PRUNE_FROM: usize = 64;

/// One request's hold (see the module).
#[derive(Debug)]
pub(super) struct Ticket {
    budget: Arc<Budget>,
    caller: Option<Arc<CallerBytes>>,
    bytes: AtomicUsize,
    cancelled: AtomicBool,
    /// What it held when cancelled, in the budget's `reclaiming` until it
    /// is dropped.
    reclaimed: AtomicUsize,
    waker: AtomicWaker,
    /// The request is in flight on its connection while it lives.
    _active: Option<Active>,
}

impl Ticket {
    /// A request of `caller`'s holding nothing yet, listed with its peer,
    /// in flight (`active`) while it lives.
    pub(super) fn new(
        budget: Arc<Budget>,
        caller: Option<Arc<CallerBytes>>,
        active: Option<Active>,
    ) -> Arc<Self> {
        let ticket = Arc::new(Ticket {
            budget,
            caller,
            bytes: AtomicUsize::new(0),
            cancelled: AtomicBool::new(false),
            reclaimed: AtomicUsize::new(0),
            waker: AtomicWaker::new(),
            _active: active,
        });
        if let Some(peer) = ticket.caller.as_ref().and_then(|c| c.peer.as_ref()) {
            let mut tickets = peer.tickets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if tickets.len() >= PRUNE_FROM && tickets.len().is_power_of_two() {
                tickets.retain(|t| t.strong_count() > 0);
            }
            tickets.push(Arc::downgrade(&ticket));
        }
        ticket
    }

    /// Takes `bytes` more from every share the request lives under.
    pub(super) fn take(&self, bytes: usize) -> Result<(), Refused> {
        if self.cancelled.load(Ordering::Acquire) {
            return Err(Refused::Reclaimed);
        }
        self.budget.take(self.caller.as_deref(), bytes)?;
        self.bytes.fetch_add(bytes, Ordering::AcqRel);
        Ok(())
    }

    /// Gives `bytes` of what it holds back (less, if reclaimed meanwhile).
    pub(super) fn give(&self, bytes: usize) {
        let mut held = self.bytes.load(Ordering::Acquire);
        loop {
            let given = bytes.min(held);
            match self.bytes.compare_exchange_weak(held, held - given, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return self.budget.give(self.caller.as_deref(), given),
                Err(now) => held = now,
            }
        }
    }

    /// Its message was over its size bound (counted).
    pub(super) fn oversized(&self) {
        self.budget.oversized.fetch_add(1, Ordering::Relaxed);
    }

    /// Cancels the request: what it holds is given back at once, and
    /// counted in `reclaiming` until the ticket is dropped (the request's
    /// memory goes with its task); its body fails at its next read
    /// ([`Ticket::cancelled`]).
    pub(super) fn cancel(&self) {
        if self.cancelled.swap(true, Ordering::AcqRel) {
            return;
        }
        let held = self.bytes.swap(0, Ordering::AcqRel);
        self.budget.reclaiming.fetch_add(held, Ordering::AcqRel);
        self.reclaimed.store(held, Ordering::Release);
        self.budget.give(self.caller.as_deref(), held);
        self.waker.wake();
    }

    /// Whether the request was cancelled; `waker` is woken when it is
    /// (registered first, so no cancel is missed).
    pub(super) fn cancelled(&self, waker: &Waker) -> bool {
        self.waker.register(waker);
        self.cancelled.load(Ordering::Acquire)
    }

    /// Whether the request was cancelled, registering nothing.
    pub(super) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let held = self.bytes.swap(0, Ordering::AcqRel);
        self.budget.give(self.caller.as_deref(), held);
        let reclaimed = *self.reclaimed.get_mut();
        if reclaimed > 0 {
            self.budget.reclaiming.fetch_sub(reclaimed, Ordering::AcqRel);
        }
    }
}
