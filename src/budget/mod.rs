//! The bytes a gRPC request may make the service hold, and each caller's
//! share of them.
//!
//! `grpc.max_request_bytes_in_flight`: the bytes of gRPC request messages
//! announced but not yet whole, over every connection and stream together.
//! A message is buffered until its last byte arrives, so a client opening
//! streams that announce large messages and never finish them made the
//! service hold `connections × streams × grpc.max_message_bytes` (3
//! connections × 1,000 streams took over 3 GB). Each request body is followed
//! as it arrives, frame by frame, through the gRPC length prefixes: when a
//! message's prefix has been read, its announced length (what tonic
//! reserves for it) is taken from the budget, and it is given back when
//! the message is whole (then tonic decodes and frees it) or the request
//! ends.
//!
//! The pool is shared per caller, never first come first served: a
//! message's bytes are taken from its connection's share
//! (`grpc.max_request_bytes_per_connection`), its peer's
//! (`grpc.max_request_bytes_per_peer`: an IPv4 address, an IPv6 /64, the
//! Unix socket's clients together), the untrusted callers' part of the pool
//! and the pool, all or none. Trusted peers (`grpc.trusted_peers`,
//! `grpc.tls.trusted_client_names`: the Envoys in front) have no peer
//! share, and the other half of the pool is kept for them alone while any
//! trust is configured. So a flood from one connection or address refuses
//! that caller, and no number of untrusted addresses can take what the
//! trusted proxies need.
//!
//! A message that would pass a share fails its request. For a
//! single-decision call (`Check`, `Report`, `ShouldRateLimit`) the answer
//! is a denial, never an error: a proxy that fails open would allow on an
//! error. `CheckBatch` and `CheckStream` fail with RESOURCE_EXHAUSTED
//! (native clients, no proxy between; their items were never read).
//!
//! `grpc.max_message_bytes` bounds one message; `CheckBatch` has its own,
//! larger bound (`grpc.max_batch_message_bytes`). A single-decision call
//! whose message is over its bound is answered with a denial too. The
//! length prefix is checked as it arrives: over the bound the body fails
//! (nothing buffered) and the call's answer is replaced by the denial.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
};

mod activity;
mod layer;
mod memory;
mod ticket;
pub use activity::{Active, Activity, now_ms};
pub use layer::{Answered, BudgetLayer, Budgeted};
pub use memory::{BUDGET_FRACTION, memory_limit};
use ticket::Ticket;

use crate::limiter::CallerCalls;
use tonic::codegen::Bytes;

/// How much of the pool one caller may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    /// Every caller together (`grpc.max_request_bytes_in_flight`).
    pub pool: usize,
    /// One connection (`grpc.max_request_bytes_per_connection`).
    pub per_connection: usize,
    /// One untrusted peer, all its connections together
    /// (`grpc.max_request_bytes_per_peer`).
    pub per_peer: usize,
    /// Every untrusted peer together: half the pool while trusted peers
    /// are configured (the rest is theirs alone), else the pool.
    pub untrusted: usize,
}

/// What else one caller may hold, 0 meaning unbounded: store calls in
/// flight per connection (`grpc.max_store_calls_per_connection`) and per
/// untrusted peer (`grpc.max_store_calls_per_peer`, all its connections
/// together), and connections per untrusted peer
/// (`grpc.max_connections_per_peer`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quotas {
    /// Store calls one connection has in flight.
    pub store_calls_per_connection: usize,
    /// Store calls one untrusted peer has in flight.
    pub store_calls_per_peer: usize,
    /// Connections one untrusted peer has open.
    pub connections_per_peer: usize,
}

/// The bytes some callers hold, and the most they may.
#[derive(Debug)]
struct Held {
    held: AtomicUsize,
    limit: usize,
}

impl Held {
    fn new(limit: usize) -> Self {
        Held { held: AtomicUsize::new(0), limit }
    }

    fn take(&self, bytes: usize) -> bool {
        let before = self.held.fetch_add(bytes, Ordering::Relaxed);
        if before.saturating_add(bytes) <= self.limit {
            return true;
        }
        self.held.fetch_sub(bytes, Ordering::Relaxed);
        false
    }

    fn give(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// Which share refused a message, or that its bytes were reclaimed for
/// another caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    Connection,
    Peer,
    Untrusted,
    Pool,
    Reclaimed,
}

impl Refused {
    const ALL: [Refused; 5] =
        [Refused::Connection, Refused::Peer, Refused::Untrusted, Refused::Pool, Refused::Reclaimed];

    fn as_str(self) -> &'static str {
        match self {
            Refused::Connection => "connection",
            Refused::Peer => "peer",
            Refused::Untrusted => "untrusted",
            Refused::Pool => "pool",
            Refused::Reclaimed => "reclaimed",
        }
    }

    fn message(self) -> &'static str {
        match self {
            Refused::Connection => {
                "this connection holds grpc.max_request_bytes_per_connection of unfinished requests"
            }
            Refused::Peer => "this address holds grpc.max_request_bytes_per_peer of unfinished requests",
            Refused::Untrusted => {
                "untrusted peers hold their half of grpc.max_request_bytes_in_flight of unfinished requests"
            }
            Refused::Pool => "the service holds grpc.max_request_bytes_in_flight of unfinished requests",
            Refused::Reclaimed => {
                "this address held the most of grpc.max_request_bytes_in_flight while another caller needed it"
            }
        }
    }
}

/// Who a connection comes from, for its share: its address (an IPv6
/// address by its /64: one host owns a whole prefix) or the Unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerKey {
    /// An IPv4 address (an IPv4-mapped IPv6 address included).
    V4(u32),
    /// An IPv6 /64.
    V6(u64),
    /// The Unix socket's clients, together.
    Local,
}

impl PeerKey {
    /// The group `addr` belongs to.
    pub fn of(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(v4) => PeerKey::V4(u32::from(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => PeerKey::V4(u32::from(v4)),
                None => PeerKey::V6((u128::from(v6) >> 64) as u64),
            },
        }
    }
}

/// The live peers' shares, by peer; an entry goes with its peer's last
/// connection.
type Peers = Mutex<HashMap<PeerKey, Weak<PeerShare>>>;

/// One peer's share, held by each of its connections (so its strong
/// count is the peer's connections).
#[derive(Debug)]
struct PeerShare {
    held: Held,
    /// Its store calls in flight.
    store_calls: Arc<tokio::sync::Semaphore>,
    /// Its requests holding bytes (dead ones pruned as it grows): what
    /// is reclaimed when it holds most.
    tickets: Mutex<Vec<Weak<Ticket>>>,
    key: PeerKey,
    peers: Arc<Peers>,
}

impl Drop for PeerShare {
    fn drop(&mut self) {
        let mut peers = self.peers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // A new connection of the peer may have put a fresh share there.
        if peers.get(&self.key).is_some_and(|share| share.strong_count() == 0) {
            peers.remove(&self.key);
        }
    }
}

/// Who a connection comes from, as the server tells at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its group, for its share.
    pub key: PeerKey,
    /// A trusted peer (`grpc.trusted_peers`, `grpc.tls.trusted_client_names`):
    /// no peer share.
    pub trusted: bool,
    /// It may report outcomes (`grpc.reporting_peers`,
    /// `grpc.tls.reporting_client_names`; anyone while neither is set).
    pub may_report: bool,
}

/// What one connection may hold and do, handed to each of its requests as
/// its connect info: its share of the store's in-flight work
/// (`grpc.max_store_calls_per_connection`, read by `api/`), of the request
/// byte budget (read by [`BudgetLayer`]), and whether it may report
/// outcomes.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Store calls in flight, the connection's and its peer's: each
    /// decision's store call holds a permit of each.
    pub store_calls: Arc<CallerCalls>,
    /// Whether its outcome reports may move an adaptive limit.
    pub may_report: bool,
    /// What the connection is doing: the server reclaims the places of
    /// idle ones first.
    pub activity: Arc<Activity>,
    bytes: Arc<CallerBytes>,
}

#[derive(Debug)]
struct CallerBytes {
    connection: Held,
    /// `None` for a trusted peer: only the pool bounds it.
    peer: Option<Arc<PeerShare>>,
}

/// Permits of a share of `quota` (0: unbounded).
fn permits(quota: usize) -> usize {
    if quota == 0 {
        tokio::sync::Semaphore::MAX_PERMITS
    } else {
        quota.min(tokio::sync::Semaphore::MAX_PERMITS)
    }
}

/// The process-wide budget.
#[derive(Debug)]
pub struct Budget {
    pool: Held,
    untrusted: Held,
    shares: Shares,
    peers: Arc<Peers>,
    refused: [AtomicU64; 5],
    oversized: AtomicU64,
    refused_connections: AtomicU64,
    /// Bytes of requests cancelled for another caller whose requests have
    /// not ended yet: given back to every share, still in memory until
    /// their tasks next run. At most half the pool ([`Budget::reclaim`]).
    reclaiming: AtomicUsize,
    /// One reclaim at a time, so `reclaiming` is checked and raised as one.
    reclaim: Mutex<()>,
}

impl Budget {
    /// A pool shared as `shares` says.
    pub fn new(shares: Shares) -> Self {
        Budget {
            pool: Held::new(shares.pool),
            untrusted: Held::new(shares.untrusted.min(shares.pool)),
            shares,
            peers: Arc::default(),
            refused: Default::default(),
            oversized: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
            reclaiming: AtomicUsize::new(0),
            reclaim: Mutex::new(()),
        }
    }

    /// A pool of `limit` bytes, every caller able to hold all of it.
    pub fn unshared(limit: usize) -> Self {
        Budget::new(Shares { pool: limit, per_connection: limit, per_peer: limit, untrusted: limit })
    }

    /// The shares of a new connection from `peer` (a trusted one has no
    /// peer share), as `quotas` say; `None` when an untrusted peer already
    /// has `quotas.connections_per_peer` connections open (the new one is
    /// to be closed).
    pub fn caller(&self, peer: Peer, quotas: Quotas) -> Option<Caller> {
        let share = match peer.trusted {
            true => None,
            false => Some(self.peer(peer.key, quotas)?),
        };
        Some(Caller {
            store_calls: Arc::new(CallerCalls {
                connection: tokio::sync::Semaphore::new(permits(quotas.store_calls_per_connection)),
                peer: share.as_ref().map(|share| Arc::clone(&share.store_calls)),
            }),
            may_report: peer.may_report,
            activity: Arc::new(Activity::new(now_ms())),
            bytes: Arc::new(CallerBytes { connection: Held::new(self.shares.per_connection), peer: share }),
        })
    }

    /// `key`'s share for one more connection, unless it has its
    /// `quotas.connections_per_peer` open already.
    fn peer(&self, key: PeerKey, quotas: Quotas) -> Option<Arc<PeerShare>> {
        let mut peers = self.peers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(share) = peers.get(&key).and_then(Weak::upgrade) {
            // Its connections, and the one just upgraded (a connection
            // closing meanwhile only makes this count high, never low).
            let open = Arc::strong_count(&share) - 1;
            if quotas.connections_per_peer != 0 && open >= quotas.connections_per_peer {
                self.refused_connections.fetch_add(1, Ordering::Relaxed);
                // The share may be the peer's last (its connections closed
                // meanwhile): dropped out of the lock its drop takes.
                drop(peers);
                drop(share);
                return None;
            }
            return Some(share);
        }
        let share = Arc::new(PeerShare {
            held: Held::new(self.shares.per_peer),
            store_calls: Arc::new(tokio::sync::Semaphore::new(permits(quotas.store_calls_per_peer))),
            tickets: Mutex::default(),
            key,
            peers: Arc::clone(&self.peers),
        });
        peers.insert(key, Arc::downgrade(&share));
        Some(share)
    }

    /// Connections closed at accept since start: their peer had its
    /// `grpc.max_connections_per_peer` open.
    pub fn refused_connections(&self) -> u64 {
        self.refused_connections.load(Ordering::Relaxed)
    }

    /// Bytes of unfinished messages now.
    pub fn held(&self) -> usize {
        self.pool.held.load(Ordering::Relaxed)
    }

    /// Bytes of cancelled requests not ended yet (see `reclaiming`).
    pub fn reclaiming(&self) -> usize {
        self.reclaiming.load(Ordering::Relaxed)
    }

    /// Peers with a connection open now.
    pub fn peers(&self) -> usize {
        self.peers.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).len()
    }

    /// Requests failed for the budget since start, every share together.
    pub fn refused(&self) -> u64 {
        self.refused.iter().map(|count| count.load(Ordering::Relaxed)).sum()
    }

    /// Requests whose message was over its size bound, since start
    /// (denied, or failed where the method has no denial).
    pub fn oversized(&self) -> u64 {
        self.oversized.load(Ordering::Relaxed)
    }

    /// Takes `bytes` from every share the caller lives under, all or none;
    /// refused by the untrusted part or the pool, after reclaiming from
    /// the peer holding most ([`Budget::reclaim`]) once.
    fn take(&self, caller: Option<&CallerBytes>, bytes: usize) -> Result<(), Refused> {
        let result = match self.try_take(caller, bytes) {
            Err(Refused::Untrusted | Refused::Pool)
                if self.reclaim(caller.and_then(|c| c.peer.as_deref()), bytes) =>
            {
                self.try_take(caller, bytes)
            }
            other => other,
        };
        if let Err(refused) = result {
            self.refused[refused as usize].fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    fn try_take(&self, caller: Option<&CallerBytes>, bytes: usize) -> Result<(), Refused> {
        let peer = caller.and_then(|caller| caller.peer.as_deref());
        let steps: [(Option<&Held>, Refused); 4] = [
            (caller.map(|caller| &caller.connection), Refused::Connection),
            (peer.map(|peer| &peer.held), Refused::Peer),
            (peer.map(|_| &self.untrusted), Refused::Untrusted),
            (Some(&self.pool), Refused::Pool),
        ];
        for (at, (held, refused)) in steps.iter().enumerate() {
            if let Some(held) = held
                && !held.take(bytes)
            {
                for held in steps[..at].iter().filter_map(|(held, _)| *held) {
                    held.give(bytes);
                }
                return Err(*refused);
            }
        }
        Ok(())
    }

    /// Frees bytes for a caller refused by the untrusted part or the pool
    /// (`requester`: its peer's share, `None` for a trusted one): every
    /// request of the untrusted peer holding most is cancelled and its
    /// bytes given back at once, when that peer holds more than the
    /// requester's peer would with `needed` more. Whether any was.
    ///
    /// A cancelled request's memory goes only when its task next runs
    /// (its body fails, its answer is sent): a busy thread may take a
    /// while. Those bytes count in `reclaiming` until then, and no peer is
    /// cancelled while they and its own would pass half the pool: what
    /// requests make the process hold stays under one and a half times the
    /// pool, and past that the newcomer is refused, never admitted on
    /// memory not yet freed.
    fn reclaim(&self, requester: Option<&PeerShare>, needed: usize) -> bool {
        let _one = self.reclaim.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mine = requester.map_or(0, |p| p.held.held.load(Ordering::Relaxed));
        // Taken out of the lock first: a share dropped here (its last
        // connection gone meanwhile) takes the lock to leave the map.
        let live: Vec<Arc<PeerShare>> = {
            let peers = self.peers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            peers.values().filter_map(Weak::upgrade).collect()
        };
        let largest = live
            .iter()
            .filter(|p| requester.is_none_or(|r| r.key != p.key))
            .max_by_key(|p| p.held.held.load(Ordering::Relaxed))
            .cloned();
        drop(live);
        let Some(largest) = largest else { return false };
        let theirs = largest.held.held.load(Ordering::Relaxed);
        if theirs <= mine.saturating_add(needed)
            || self.reclaiming.load(Ordering::Relaxed).saturating_add(theirs) > self.shares.pool / 2
        {
            return false;
        }
        let tickets: Vec<Arc<Ticket>> = {
            let mut tickets = largest.tickets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            std::mem::take(&mut *tickets).iter().filter_map(Weak::upgrade).collect()
        };
        for ticket in &tickets {
            ticket.cancel();
        }
        self.refused[Refused::Reclaimed as usize].fetch_add(tickets.len() as u64, Ordering::Relaxed);
        !tickets.is_empty()
    }

    fn give(&self, caller: Option<&CallerBytes>, bytes: usize) {
        if bytes == 0 {
            return;
        }
        if let Some(caller) = caller {
            caller.connection.give(bytes);
            if let Some(peer) = &caller.peer {
                peer.held.give(bytes);
                self.untrusted.give(bytes);
            }
        }
        self.pool.give(bytes);
    }
}

/// Why a single-decision call was refused unread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its message is over its bound: the same request never passes.
    TooLarge,
    /// Its caller holds its whole share of the budget: it may pass once
    /// the caller's other requests finish.
    CallerBusy,
}

/// Encodes the response message that denies a request refused unread, at
/// the time it is answered.
pub type Denial = Arc<dyn Fn(Refusal) -> Bytes + Send + Sync>;

/// The size bounds of one message, by method.
#[derive(Clone)]
pub struct MessageBounds {
    /// Any message but a batch's (`grpc.max_message_bytes`).
    pub message: usize,
    /// A `CheckBatch` request (`grpc.max_batch_message_bytes`).
    pub batch: usize,
    /// The path of the batch method.
    pub batch_path: &'static str,
    /// Single-decision methods, by path, with what denies an oversized
    /// request.
    pub denials: Vec<(&'static str, Denial)>,
    /// How long a message may take from its length prefix to its last
    /// byte (`grpc.request_timeout_ms`; `None`: as long as its request):
    /// a message begun and trickled holds its bytes no longer.
    pub message_timeout: Option<std::time::Duration>,
}

impl std::fmt::Debug for MessageBounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let denied: Vec<_> = self.denials.iter().map(|(path, _)| path).collect();
        f.debug_struct("MessageBounds")
            .field("message", &self.message)
            .field("batch", &self.batch)
            .field("batch_path", &self.batch_path)
            .field("denied", &denied)
            .field("message_timeout", &self.message_timeout)
            .finish()
    }
}

impl MessageBounds {
    fn of(&self, path: &str) -> usize {
        if path == self.batch_path { self.batch } else { self.message }
    }
}

impl crate::telemetry::Figures for Budget {
    fn render(&self, out: &mut String) {
        use crate::telemetry::exposition::{labelled, single};
        single(
            out,
            "ratelimitd_grpc_request_bytes_in_flight",
            "gauge",
            "Bytes held for unfinished gRPC requests: header blocks, a fixed amount per stream, and messages announced but not yet whole (grpc.max_request_bytes_in_flight).",
            self.held(),
        );
        single(
            out,
            "ratelimitd_grpc_request_bytes_limit",
            "gauge",
            "The request byte budget: grpc.max_request_bytes_in_flight, by default an eighth of the process's memory limit.",
            self.shares.pool,
        );
        single(
            out,
            "ratelimitd_grpc_request_bytes_reclaiming",
            "gauge",
            "Bytes of requests cancelled for another caller (reclaimed) that have not ended yet: out of every share, still in memory until their tasks run; while these and the next peer's would pass half of grpc.max_request_bytes_in_flight nothing more is reclaimed.",
            self.reclaiming(),
        );
        single(
            out,
            "ratelimitd_grpc_request_peers",
            "gauge",
            "Untrusted peers (an IPv4 address, an IPv6 /64) with a gRPC connection open, each with its share of the request byte budget.",
            self.peers(),
        );
        let refused = Refused::ALL
            .map(|refused| (refused.as_str(), self.refused[refused as usize].load(Ordering::Relaxed)));
        labelled(
            out,
            "ratelimitd_grpc_requests_over_budget_total",
            "counter",
            "Requests refused unread because their caller's share of the request byte budget was held (by the share that refused: connection, peer, untrusted, pool), or cancelled because their address held the most of it while another caller needed it (reclaimed): a Check, Report or ShouldRateLimit denied, others failed with RESOURCE_EXHAUSTED.",
            "share",
            &refused,
        );
        single(
            out,
            "ratelimitd_grpc_requests_oversized_total",
            "counter",
            "Requests whose message was over grpc.max_message_bytes (grpc.max_batch_message_bytes for CheckBatch): a Check, Report or ShouldRateLimit denied unread, others failed with RESOURCE_EXHAUSTED.",
            self.oversized(),
        );
        single(
            out,
            "ratelimitd_grpc_connections_over_peer_share_total",
            "counter",
            "gRPC connections closed as soon as accepted: their untrusted peer had grpc.max_connections_per_peer open.",
            self.refused_connections(),
        );
    }
}

#[cfg(test)]
mod tests;
