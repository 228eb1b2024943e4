//! The gRPC connections' places (`grpc.max_connections`), and which
//! connection gives its place up when they run short.
//!
//! A share per address is no bound against a caller with many addresses,
//! so places are not first come, first served:
//! - **Reserved for the trusted.** Untrusted connections (not
//!   `grpc.trusted_peers`, `grpc.tls.trusted_client_names`) hold at most
//!   [`UNTRUSTED_PARTS`] sixteenths of the places, whether or not trust is
//!   configured; a trusted connection may take any place.
//! - **Reclaimed from the idle and the largest.** A connection that finds
//!   no place takes one from a connection of its class (an untrusted one
//!   first, for a trusted newcomer): among [`SAMPLE`] places from a moving
//!   position, the one idle longest (no request in flight), else one of
//!   the peer holding most connections, when that peer holds more than one
//!   past the newcomer's. The connection reclaimed is closed at its next
//!   read; the newcomer takes its place at once. When no place can be
//!   reclaimed, the newcomer is closed.
//! - **Used, or given up.** A connection that starts no request within
//!   `grpc.first_request_timeout_ms` of opening is closed
//!   ([`Places::sweep`]).

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use crate::budget::{Activity, Peer, PeerKey};

/// Of sixteen places, how many untrusted connections may hold together.
pub(super) const UNTRUSTED_PARTS: usize = 15;

/// Places looked at to choose the one reclaimed.
pub(super) const SAMPLE: usize = 256;

/// Every gRPC listener's places (see the module).
#[derive(Debug)]
pub(super) struct Places {
    slots: Mutex<Slots>,
    max: usize,
    untrusted_max: usize,
    first_request_ms: u64,
    reclaimed: AtomicU64,
    refused: AtomicU64,
    unused: AtomicU64,
}

#[derive(Debug, Default)]
struct Slots {
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    cursor: usize,
    open: usize,
    untrusted: usize,
    peers: HashMap<PeerKey, usize>,
    next_id: u64,
}

#[derive(Debug)]
struct Slot {
    id: u64,
    peer: PeerKey,
    trusted: bool,
    opened_ms: u64,
    activity: Arc<Activity>,
}

/// A connection's place, given back when dropped (unless reclaimed).
#[derive(Debug)]
pub(super) struct Place {
    places: Arc<Places>,
    index: usize,
    id: u64,
}

impl Places {
    /// `max` places, untrusted connections holding at most
    /// [`UNTRUSTED_PARTS`] sixteenths of them; a connection must start a
    /// request within `first_request_ms` (0: no deadline).
    pub(super) fn new(max: usize, first_request_ms: u64) -> Self {
        let max = max.max(1);
        Self::with_untrusted(max, (max * UNTRUSTED_PARTS / 16).max(1), first_request_ms)
    }

    /// `max` places, untrusted connections holding at most `untrusted_max`.
    pub(super) fn with_untrusted(max: usize, untrusted_max: usize, first_request_ms: u64) -> Self {
        Places {
            slots: Mutex::default(),
            max: max.max(1),
            untrusted_max: untrusted_max.clamp(1, max.max(1)),
            first_request_ms,
            reclaimed: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            unused: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a connection of `peer` doing `activity` at `now_ms`,
    /// reclaimed from another if none is free; `None`: it is to be closed.
    pub(super) fn admit(self: &Arc<Self>, peer: Peer, activity: Arc<Activity>, now_ms: u64) -> Option<Place> {
        let mut slots = self.lock();
        let room = slots.open < self.max && (peer.trusted || slots.untrusted < self.untrusted_max);
        if !room {
            // A trusted newcomer takes an untrusted place first; an
            // untrusted one only ever takes an untrusted place.
            let from_untrusted = !peer.trusted || slots.untrusted > 0;
            let Some(victim) = slots.choose(!from_untrusted, peer.key) else {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            slots.remove(victim).activity.close();
            self.reclaimed.fetch_add(1, Ordering::Relaxed);
        }
        let id = slots.next_id;
        slots.next_id += 1;
        let slot = Slot { id, peer: peer.key, trusted: peer.trusted, opened_ms: now_ms, activity };
        let index = slots.insert(slot);
        Some(Place { places: Arc::clone(self), index, id })
    }

    /// Closes the connections that started no request within the deadline.
    pub(super) fn sweep(&self, now_ms: u64) {
        if self.first_request_ms == 0 {
            return;
        }
        let mut slots = self.lock();
        let unused: Vec<usize> = (0..slots.slots.len())
            .filter(|&i| {
                slots.slots[i].as_ref().is_some_and(|slot| {
                    slot.activity.started() == 0
                        && now_ms.saturating_sub(slot.opened_ms) >= self.first_request_ms
                })
            })
            .collect();
        for index in unused {
            slots.remove(index).activity.close();
            self.unused.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Sweeps every second (see [`Places::sweep`]) until `stop`.
    pub(super) async fn sweep_until(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        if self.first_request_ms == 0 {
            return;
        }
        let mut every = tokio::time::interval(std::time::Duration::from_secs(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = every.tick() => self.sweep(crate::budget::now_ms()),
                _ = stop.wait_for(|stopped| *stopped) => return,
            }
        }
    }

    /// Connections holding a place now.
    pub(super) fn open(&self) -> usize {
        self.lock().open
    }
}

impl Slots {
    fn insert(&mut self, slot: Slot) -> usize {
        self.open += 1;
        self.untrusted += usize::from(!slot.trusted);
        *self.peers.entry(slot.peer).or_default() += 1;
        match self.free.pop() {
            Some(index) => {
                self.slots[index] = Some(slot);
                index
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        }
    }

    /// Takes the slot at `index` out (it must be held).
    fn remove(&mut self, index: usize) -> Slot {
        let slot = self.slots[index].take().expect("a held slot");
        self.free.push(index);
        self.open -= 1;
        self.untrusted -= usize::from(!slot.trusted);
        if let Some(count) = self.peers.get_mut(&slot.peer) {
            *count -= 1;
            if *count == 0 {
                self.peers.remove(&slot.peer);
            }
        }
        slot
    }

    /// The place to reclaim for a newcomer of `newcomer`'s peer, among the
    /// trusted connections or the untrusted ones: the one idle longest of
    /// a sample, else one of the largest peer's if it holds more than one
    /// past the newcomer's peer.
    fn choose(&mut self, trusted: bool, newcomer: PeerKey) -> Option<usize> {
        let len = self.slots.len();
        if len == 0 {
            return None;
        }
        let newcomer_holds = self.peers.get(&newcomer).copied().unwrap_or(0);
        let mut idle: Option<(u64, usize)> = None;
        let mut largest: Option<(usize, u64, usize)> = None;
        let start = self.cursor % len;
        for offset in 0..SAMPLE.min(len) {
            let index = (start + offset) % len;
            let Some(slot) = &self.slots[index] else { continue };
            if slot.trusted != trusted {
                continue;
            }
            let last = slot.activity.last_ms();
            if slot.activity.in_flight() == 0 {
                if idle.is_none_or(|(at, _)| last < at) {
                    idle = Some((last, index));
                }
                continue;
            }
            let holds = self.peers.get(&slot.peer).copied().unwrap_or(0);
            // The largest peer's, and of its, the one active longest ago.
            let better = |(most, at, _): (usize, u64, usize)| holds > most || (holds == most && last < at);
            if holds > newcomer_holds + 1 && largest.is_none_or(better) {
                largest = Some((holds, last, index));
            }
        }
        self.cursor = start + SAMPLE.min(len);
        idle.map(|(_, index)| index).or(largest.map(|(_, _, index)| index))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut slots = self.places.lock();
        if slots.slots.get(self.index).and_then(Option::as_ref).is_some_and(|slot| slot.id == self.id) {
            slots.remove(self.index);
        }
    }
}

impl crate::telemetry::Figures for Places {
    fn render(&self, out: &mut String) {
        use crate::telemetry::exposition::single;
        single(
            out,
            "ratelimitd_grpc_connections_open",
            "gauge",
            "gRPC connections holding a place (grpc.max_connections).",
            self.open() as u64,
        );
        single(
            out,
            "ratelimitd_grpc_connections_reclaimed_total",
            "counter",
            "gRPC connections closed to give their place to a new one (idle longest, or of the peer holding most).",
            self.reclaimed.load(Ordering::Relaxed),
        );
        single(
            out,
            "ratelimitd_grpc_connections_refused_total",
            "counter",
            "New gRPC connections closed at once: no place free and none to reclaim.",
            self.refused.load(Ordering::Relaxed),
        );
        single(
            out,
            "ratelimitd_grpc_connections_unused_total",
            "counter",
            "gRPC connections closed for starting no request within grpc.first_request_timeout_ms.",
            self.unused.load(Ordering::Relaxed),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(n: u32, trusted: bool) -> Peer {
        Peer { key: PeerKey::V4(n), trusted, may_report: true }
    }

    fn activity(last_ms: u64) -> Arc<Activity> {
        let activity = Arc::new(Activity::new(last_ms));
        activity.set_last_ms(last_ms);
        activity
    }

    /// 60 addresses hold every untrusted place with idle connections: a
    /// new address's connection takes the place of the one idle longest,
    /// and a trusted one finds a reserved place free.
    #[test]
    fn idle_places_are_reclaimed_and_the_trusted_keep_their_part() {
        let places = Arc::new(Places::new(160, 0));
        let mut held = Vec::new();
        let mut activities = Vec::new();
        for n in 0..200u32 {
            let a = activity(1_000 + u64::from(n));
            if let Some(place) = places.admit(peer(n % 60, false), Arc::clone(&a), 2_000) {
                held.push(place);
                activities.push(a);
            }
        }
        assert_eq!(places.open(), 150, "untrusted hold 15/16 of 160");
        let newcomer = places.admit(peer(1_000, false), activity(3_000), 3_000);
        assert!(newcomer.is_some(), "an idle place is reclaimed for a new address");
        assert_eq!(activities.iter().filter(|a| a.closing(futures_util::task::noop_waker_ref())).count(), 51);
        let trusted: Vec<Place> =
            (0..11).filter_map(|_| places.admit(peer(7_000, true), activity(3_000), 3_000)).collect();
        assert_eq!(trusted.len(), 11, "the trusted part is free, and then an untrusted place is reclaimed");
        assert_eq!(places.open(), 160);
    }

    /// With no idle place, a newcomer takes one of the peer holding most,
    /// only while that peer holds more than one past its own.
    #[test]
    fn busy_places_go_from_the_largest_peer_down_to_fairness() {
        let places = Arc::new(Places::new(16, 0));
        let mut held = Vec::new();
        for n in 0..15u32 {
            let a = activity(1_000);
            let _busy = a.begin();
            let key = if n < 10 { 1 } else { n };
            held.push((places.admit(peer(key, false), Arc::clone(&a), 1_000).unwrap(), _busy, a));
        }
        // Peer 1 holds 10, the others 1 each: new peers take peer 1's
        // places until it holds 1, as they do.
        let taken = (0..20u32)
            .filter_map(|n| {
                let a = activity(2_000);
                let busy = a.begin();
                places.admit(peer(100 + n, false), a, 2_000).map(|p| (p, busy))
            })
            .collect::<Vec<_>>();
        assert_eq!(taken.len(), 9);
        assert_eq!(places.refused.load(Ordering::Relaxed), 11);
    }

    /// A connection that starts no request within the deadline is closed;
    /// one that did is kept.
    #[test]
    fn unused_connections_are_closed_after_the_first_request_deadline() {
        let places = Arc::new(Places::new(8, 10_000));
        let (idle, used) = (activity(0), activity(0));
        let _a = places.admit(peer(1, false), Arc::clone(&idle), 0).unwrap();
        let _b = places.admit(peer(2, false), Arc::clone(&used), 0).unwrap();
        drop(used.begin());
        places.sweep(9_999);
        assert_eq!(places.open(), 2);
        places.sweep(10_000);
        assert_eq!(places.open(), 1);
        assert!(idle.closing(futures_util::task::noop_waker_ref()));
        assert!(!used.closing(futures_util::task::noop_waker_ref()));
    }
}
