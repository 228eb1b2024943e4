//! Reservations through Envoy's API, the twin of a native `Check` with
//! `reserve` and its settling `Report` (`decision::reservation`).
//!
//! A descriptor whose last entry is `ratelimitd.reserve` counts its hits
//! (the estimate: `hits_addend` from a request header) on the counter its
//! other entries name, like any admission; a request admitted whole is
//! answered with the reservation's id in its dynamic metadata
//! (`ratelimitd.reservation`, in the filter's namespace). A descriptor
//! whose last entry is `ratelimitd.settle` with that id as its value
//! (Envoy's `metadata` action reads it when the stream is done) charges
//! its counter the difference between its hits (the actual usage, from
//! the response) and what the reservation holds there: more counted
//! whatever is left, less given back to the window the estimate was
//! counted in. The call's claim counter makes it count once.
//!
//! The id carries what settling needs, so no instance keeps state for it:
//! `e1|<domain digest>|<expiry ms>|<nonce>|<counter digest>:<amount>:<window>,…`,
//! a digest being the first 8 bytes of a SHA-256, in hex.

use sha2::{Digest, Sha256};

use super::{
    RlsRequest,
    request::{Descriptor, Marked, marked},
};
use crate::{
    decision::{
        Api, Engine,
        reservation::{MAX_RESERVATION_BYTES, claim, nonce},
    },
    limiter::{Count, ManyItem},
    rules::envoy::Role,
};

/// The most counters one reservation holds: a longer request reserves
/// nothing (its estimates stay charged, none is given back).
pub(crate) const MAX_RESERVED: usize = 16;

/// What one counter of a reservation holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    /// The counter key's digest ([`digest`]).
    pub(crate) counter: u64,
    /// What was counted on it.
    pub(crate) amount: u64,
    /// The window it was counted in ([`ManyItem::window_at`]).
    pub(crate) window: u64,
}

/// A reservation of a `ShouldRateLimit` request, as its id spells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EnvoyReservation {
    /// The digest of the domain its counters are in.
    pub(crate) domain: u64,
    /// When it expires (Unix ms): not settled by then, it stays charged at
    /// its estimates.
    pub(crate) expires_ms: u64,
    /// Unique per reservation: names its claim counter.
    pub(crate) nonce: u64,
    /// What each counter holds.
    pub(crate) held: Vec<Held>,
}

/// The first 8 bytes of the SHA-256 of `text`.
pub(crate) fn digest(text: &str) -> u64 {
    let hash = Sha256::digest(text.as_bytes());
    u64::from_be_bytes(hash[..8].try_into().expect("a SHA-256 has 32 bytes"))
}

impl EnvoyReservation {
    /// A new reservation of what `items` counted at `now_ms` in `domain`,
    /// expiring at `expires_ms`; `None` when they are more than
    /// [`MAX_RESERVED`].
    pub(crate) fn new<'i>(
        domain: &str,
        expires_ms: u64,
        items: impl Iterator<Item = &'i ManyItem>,
        now_ms: u64,
    ) -> Option<Self> {
        let held: Vec<Held> = items
            .map(|item| Held {
                counter: digest(&item.key),
                amount: item.weight,
                window: item.window_at(now_ms),
            })
            .collect();
        (held.len() <= MAX_RESERVED).then(|| EnvoyReservation {
            domain: digest(domain),
            expires_ms,
            nonce: nonce(),
            held,
        })
    }

    /// Its id.
    pub(crate) fn id(&self) -> String {
        use std::fmt::Write as _;
        let mut id = format!("e1|{:016x}|{}|{:016x}|", self.domain, self.expires_ms, self.nonce);
        for (i, h) in self.held.iter().enumerate() {
            let _ =
                write!(id, "{}{:016x}:{}:{}", if i == 0 { "" } else { "," }, h.counter, h.amount, h.window);
        }
        id
    }

    /// The reservation an id names; `None` when it is none this service
    /// answered with.
    pub(crate) fn parse(id: &str) -> Option<Self> {
        if id.len() > MAX_RESERVATION_BYTES {
            return None;
        }
        let hex = |text: &str| u64::from_str_radix(text, 16).ok().filter(|_| text.len() == 16);
        let mut parts = id.split('|');
        let (Some("e1"), Some(domain), Some(expires), Some(nonce), Some(held), None) =
            (parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        let mut counters = Vec::new();
        for one in held.split(',').filter(|h| !h.is_empty()) {
            let mut fields = one.split(':');
            let (Some(counter), Some(amount), Some(window), None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                return None;
            };
            let held =
                Held { counter: hex(counter)?, amount: amount.parse().ok()?, window: window.parse().ok()? };
            if counters.len() == MAX_RESERVED || counters.iter().any(|h: &Held| h.counter == held.counter) {
                return None;
            }
            counters.push(held);
        }
        Some(EnvoyReservation {
            domain: hex(domain)?,
            expires_ms: expires.parse().ok()?,
            nonce: hex(nonce)?,
            held: counters,
        })
    }

    /// The claim counter of its settlement, decided with it: a second
    /// settlement does not fit, and its call counts nothing.
    pub(crate) fn claim(&self, now_ms: u64) -> ManyItem {
        claim(self.nonce, self.expires_ms, now_ms)
    }

    /// How `item` (a counter a settling descriptor names, its weight the
    /// actual usage) is charged: the difference from what the
    /// reservation holds on it, more counted whatever is left, less given
    /// back to the window it was counted in; all of it when it holds
    /// nothing there.
    pub(crate) fn settle(&self, item: ManyItem) -> ManyItem {
        let counter = digest(&item.key);
        let held = self.held.iter().find(|h| h.counter == counter);
        let reserved = held.map_or(0, |h| h.amount);
        match item.weight.checked_sub(reserved) {
            Some(more) => ManyItem { weight: more, count: Count::Always, ..item },
            None => ManyItem {
                weight: reserved - item.weight,
                count: Count::Always,
                refund: held.map(|h| h.window),
                ..item
            },
        }
    }
}

/// The reservation a call's settling descriptors name: the value of their
/// last entry, when they all name the same.
fn named<'a, D: Descriptor>(request: &RlsRequest<'a, D>) -> Option<&'a str> {
    let mut ids = request.descriptors.iter().filter_map(|d| match marked(d) {
        Some((Marked::Settle, _)) => d.entries().last().map(|(_, id)| id),
        _ => None,
    });
    let first = ids.next()?;
    ids.all(|id| id == first).then_some(first)
}

/// Settles the counters of a call's settling descriptors (`roles`
/// [`Role::Settled`] among `items`), at `now_ms`: by the reservation they
/// name, with its claim added last (then `true`: the call is one job,
/// counted whole or, settled before, not at all); of one expired, nothing
/// more (it stays charged at its estimates); of none this service
/// answered with (absent, another domain's, altered), their hits counted
/// as usage reports: usage is never left uncounted.
pub(super) fn settle<D: Descriptor>(
    engine: &Engine,
    request: &RlsRequest<'_, D>,
    items: &mut Vec<ManyItem>,
    roles: &[Role],
    now_ms: u64,
) -> bool {
    let settled = |items: &mut Vec<ManyItem>, how: &dyn Fn(&ManyItem) -> ManyItem| {
        for (item, _) in items.iter_mut().zip(roles).filter(|(_, role)| **role == Role::Settled) {
            *item = how(item);
        }
    };
    let reservation =
        named(request).and_then(EnvoyReservation::parse).filter(|r| r.domain == digest(request.domain));
    match reservation {
        None => {
            engine.adjusted(Api::Envoy, "settlement_without_reservation");
            false
        }
        Some(expired) if expired.expires_ms <= now_ms => {
            engine.adjusted(Api::Envoy, "reservation_expired");
            settled(items, &|item| ManyItem { weight: 1, count: Count::Never, ..item.clone() });
            false
        }
        Some(reservation) => {
            settled(items, &|item| reservation.settle(item.clone()));
            items.push(reservation.claim(now_ms));
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::window::WindowParams;

    #[test]
    fn an_id_reads_back_as_written_and_nothing_else_reads() {
        let items = [
            ManyItem {
                weight: 800,
                ..ManyItem::admission("60|key_alice|budget_output", WindowParams::sliding(60_000, 1_000))
            },
            ManyItem {
                weight: 1_200,
                ..ManyItem::admission("60|key_alice|budget_input", WindowParams::sliding(60_000, 5_000))
            },
        ];
        let reservation =
            EnvoyReservation::new("llm", 1_800_000_600_000, items.iter(), 1_800_000_000_000).unwrap();
        let id = reservation.id();
        assert!(id.starts_with(&format!("e1|{:016x}|1800000600000|", digest("llm"))), "{id}");
        assert_eq!(EnvoyReservation::parse(&id), Some(reservation.clone()));
        assert_eq!(reservation.held[0].window, 30_000_000, "the minute it was counted in");
        for bad in
            ["", "r1|a|1|1|0:1:1", "e1|00|1|0000000000000001|", "e1|0000000000000001|x|0000000000000001|"]
        {
            assert_eq!(EnvoyReservation::parse(bad), None, "{bad:?}");
        }
        let twice = format!("{id},{}", id.rsplit_once('|').unwrap().1.split(',').next().unwrap());
        assert_eq!(EnvoyReservation::parse(&twice), None, "a counter held twice");
        let many = vec![items[0].clone(); MAX_RESERVED + 1];
        assert!(EnvoyReservation::new("llm", 1, many.iter(), 0).is_none());
    }

    #[test]
    fn a_settlement_charges_the_difference_up_or_down() {
        let params = WindowParams::sliding(60_000, 1_000);
        let reserved = ManyItem { weight: 800, ..ManyItem::admission("60|key_alice", params) };
        let reservation = EnvoyReservation::new("llm", 600_000, [&reserved].into_iter(), 120_000).unwrap();
        let actual = |weight| ManyItem { weight, ..ManyItem::admission("60|key_alice", params) };
        let less = reservation.settle(actual(300));
        assert_eq!((less.weight, less.count, less.refund), (500, Count::Always, Some(2)));
        let more = reservation.settle(actual(900));
        assert_eq!((more.weight, more.refund), (100, None));
        let other = reservation.settle(ManyItem { weight: 40, ..ManyItem::admission("60|key_bob", params) });
        assert_eq!((other.weight, other.refund), (40, None), "nothing held there: all of it counted");
    }
}
