//! A `ShouldRateLimit` request as the engine takes it: descriptors borrowed
//! as they are (any [`Descriptor`]), owned ones for capture and replay, and
//! the outcome report a descriptor can carry.

use std::hash::{Hash, Hasher};

use crate::{
    limiter::{CallerCalls, adaptive::Outcome},
    rules::envoy::Unit,
};

/// A `ShouldRateLimit` request that owns its parts (capture, replay).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyCall {
    /// The configuration domain.
    pub domain: String,
    /// The descriptors, in request order.
    pub descriptors: Vec<OwnedDescriptor>,
    /// Hits of descriptors that state none (0 means 1).
    pub hits_addend: u32,
}

impl EnvoyCall {
    /// The request as the engine takes it.
    pub fn request(&self) -> RlsRequest<'_, OwnedDescriptor> {
        RlsRequest {
            domain: &self.domain,
            descriptors: &self.descriptors,
            hits_addend: self.hits_addend,
            trace_id: None,
            share: None,
            may_report: true,
        }
    }
}

/// A validated `ShouldRateLimit` request. It borrows the descriptors as
/// they are (any [`Descriptor`], the wire message's included), so handing
/// a request to the engine copies and allocates nothing.
#[derive(Debug, Clone, Copy)]
pub struct RlsRequest<'a, D> {
    /// The configuration domain.
    pub domain: &'a str,
    /// The descriptors, in request order.
    pub descriptors: &'a [D],
    /// Hits of descriptors that state none (0 means 1).
    pub hits_addend: u32,
    /// W3C trace id from the call's `traceparent`, if any.
    pub trace_id: Option<&'a str>,
    /// The caller's shares of the store's in-flight work; `None`: unbounded.
    pub share: Option<&'a CallerCalls>,
    /// The caller may report outcomes (`grpc.reporting_peers`): if not, its
    /// outcome descriptors are answered and count nowhere.
    pub may_report: bool,
}

/// What the engine reads of one descriptor. `api` implements it for the
/// wire type; [`RlsDescriptor`] is a plain one for tools and tests.
pub trait Descriptor {
    /// `(key, value)` entries, in order.
    fn entries(&self) -> impl Iterator<Item = (&str, &str)> + Clone;
    /// A limit the request supplies for this descriptor (a valid one: one
    /// with a unit this service does not know reads as none).
    fn limit(&self) -> Option<LimitOverride>;
    /// This descriptor's own hits, overriding the request's.
    fn hits_addend(&self) -> Option<u64>;
}

/// The descriptor entry key that makes a descriptor an outcome report: its
/// last entry `ratelimitd.outcome: success | failure | overload` tells how
/// requests matched by its other entries went downstream (the Envoy
/// twin of a native `Report` with an outcome).
pub(super) const OUTCOME_KEY: &str = "ratelimitd.outcome";

/// The descriptor entry key that makes a descriptor the end of requests in
/// flight: with its last entry `ratelimitd.release` (any value), its other
/// entries name the counter of a limit of requests in flight
/// (`algorithm: concurrency`) and its hits give slots back. Envoy sends it
/// with `apply_on_stream_done`.
pub(super) const RELEASE_KEY: &str = "ratelimitd.release";

/// The descriptor entry key that makes a descriptor a reservation: with
/// its last entry `ratelimitd.reserve` (any value), its other entries name
/// the counter its hits (an estimate) are counted on, and the answer
/// names the reservation (`reserve`).
pub(super) const RESERVE_KEY: &str = "ratelimitd.reserve";

/// The descriptor entry key that settles a reservation: with its last
/// entry `ratelimitd.settle` valued with the reservation's id, its other
/// entries name the counter and its hits are the actual usage.
pub(super) const SETTLE_KEY: &str = "ratelimitd.settle";

/// What a descriptor's last entry makes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Marked {
    /// An outcome report ([`OUTCOME_KEY`]).
    Outcome(Outcome),
    /// The end of requests in flight ([`RELEASE_KEY`]).
    Release,
    /// A reservation ([`RESERVE_KEY`]).
    Reserve,
    /// A settlement ([`SETTLE_KEY`]).
    Settle,
}

/// What `d`'s last entry makes it, and its number of entries: `None`
/// unless its last entry is [`OUTCOME_KEY`] with a known outcome (any other
/// value leaves the descriptor an ordinary one, counted as it is) or
/// [`RELEASE_KEY`], [`RESERVE_KEY`] or [`SETTLE_KEY`], after at least one
/// other.
pub(super) fn marked<D: Descriptor>(d: &D) -> Option<(Marked, usize)> {
    let (count, last) = d.entries().fold((0, None), |(n, _), entry| (n + 1, Some(entry)));
    match last? {
        (OUTCOME_KEY, value) if count > 1 => Some((Marked::Outcome(Outcome::parse(value)?), count)),
        (RELEASE_KEY, _) if count > 1 => Some((Marked::Release, count)),
        (RESERVE_KEY, _) if count > 1 => Some((Marked::Reserve, count)),
        (SETTLE_KEY, _) if count > 1 => Some((Marked::Settle, count)),
        _ => None,
    }
}

/// A descriptor as plain data.
#[derive(Debug, Clone, Default)]
pub struct RlsDescriptor<'a> {
    /// `(key, value)` entries, in order.
    pub entries: Vec<(&'a str, &'a str)>,
    /// A limit the request supplies for this descriptor.
    pub limit: Option<LimitOverride>,
    /// This descriptor's own hits, overriding the request's.
    pub hits_addend: Option<u64>,
}

impl Descriptor for RlsDescriptor<'_> {
    fn entries(&self) -> impl Iterator<Item = (&str, &str)> + Clone {
        self.entries.iter().copied()
    }
    fn limit(&self) -> Option<LimitOverride> {
        self.limit
    }
    fn hits_addend(&self) -> Option<u64> {
        self.hits_addend
    }
}

/// A descriptor that owns its entries: what capture records and replay
/// decides again.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnedDescriptor {
    /// `[key, value]` entries, in order.
    pub entries: Vec<(String, String)>,
    /// A limit the request supplied for this descriptor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<LimitOverride>,
    /// This descriptor's own hits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hits_addend: Option<u64>,
}

impl OwnedDescriptor {
    /// A copy of `descriptor`.
    pub fn of<D: Descriptor>(descriptor: &D) -> Self {
        OwnedDescriptor {
            entries: descriptor.entries().map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
            limit: descriptor.limit(),
            hits_addend: descriptor.hits_addend(),
        }
    }
}

impl Descriptor for OwnedDescriptor {
    fn entries(&self) -> impl Iterator<Item = (&str, &str)> + Clone {
        self.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
    fn limit(&self) -> Option<LimitOverride> {
        self.limit
    }
    fn hits_addend(&self) -> Option<u64> {
        self.hits_addend
    }
}

/// A request-supplied limit (`RateLimitDescriptor.limit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitOverride {
    /// Requests per unit.
    pub requests_per_unit: u32,
    /// The unit.
    pub unit: Unit,
}

/// A descriptor's hits: its own, else the request's (0 means 1).
pub(super) fn hits_of<D: Descriptor>(request: &RlsRequest<'_, D>, descriptor: &D) -> u64 {
    descriptor.hits_addend().unwrap_or_else(|| u64::from(request.hits_addend.max(1)))
}

/// Who may report outcomes of an adaptive Envoy limit: a descriptor's
/// counter, by its domain and entries.
pub(super) struct Reporter<'a, I>(pub(super) &'a str, pub(super) I);

impl<'a, I: Iterator<Item = (&'a str, &'a str)> + Clone> Hash for Reporter<'a, I> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
        for entry in self.1.clone() {
            entry.hash(state);
        }
    }
}
