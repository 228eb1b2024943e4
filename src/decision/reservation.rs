//! Reservations: a `Check` that reserves counts the request's estimate on
//! every limit of its rule and is answered with a reservation id; the
//! `Report` that names it after the call settles it, once: each limit is
//! charged the difference between what the report states and what was
//! reserved, more counted whatever is left, less given back to the window
//! the estimate was counted in ([`ManyItem::refund`]). A claim counter
//! (`~settled/<nonce>`, a first-hit window of one until the reservation
//! expires) is decided in the same job, so a settlement retried, on this
//! instance or another, counts nothing more. A reservation never settled
//! stays charged at its estimate.
//!
//! The id carries what settling needs, so no instance keeps state for it:
//! `r1|<rule id>|<expiry ms>|<nonce>|<limit>:<amount>:<window>,…`.

use std::{
    fmt::Write as _,
    sync::{
        LazyLock,
        atomic::{AtomicU64, Ordering},
    },
};

use crate::{
    limiter::{Count, ManyItem, window::Algorithm, window::WindowParams},
    rules::{MAX_ALSO_LIMITS, Rule},
};

/// How long a reservation may be settled unless configured
/// (`limits.reservation_ttl_ms`): ten minutes.
pub const DEFAULT_TTL_MS: u64 = 600_000;

/// The longest `limits.reservation_ttl_ms`: a day.
pub const MAX_TTL_MS: u64 = 86_400_000;

/// Longest reservation id accepted on a `Report`.
pub const MAX_RESERVATION_BYTES: usize = 1_024;

/// What one limit of a reservation holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    /// The limit's index in its rule (0 the first, then `also`'s).
    pub limit: usize,
    /// What was counted on it.
    pub amount: u64,
    /// The window it was counted in ([`ManyItem::window_at`]).
    pub window: u64,
}

/// A reservation, as its id spells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The rule whose limits it holds.
    pub rule_id: String,
    /// When it expires (Unix ms): not settled by then, it stays charged at
    /// its estimate.
    pub expires_ms: u64,
    /// Unique per reservation: names its claim counter.
    pub nonce: u64,
    /// What each limit holds.
    pub limits: Vec<Reserved>,
}

/// Nonces: a random start per process, then one more per reservation.
static NEXT: LazyLock<AtomicU64> = LazyLock::new(|| {
    let mut random = [0u8; 8];
    let _ = getrandom::fill(&mut random);
    AtomicU64::new(u64::from_le_bytes(random))
});

/// A reservation's unique number.
pub(super) fn nonce() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The claim counter of reservation `nonce`, expiring at `expires_ms`:
/// one hit of a first-hit window of one that lasts until then, so a
/// second settlement does not fit and its job counts nothing.
pub(super) fn claim(nonce: u64, expires_ms: u64, now_ms: u64) -> ManyItem {
    let window_ms = expires_ms.saturating_sub(now_ms).max(1);
    let params = WindowParams { window_ms, capacity: 1, rate: 1, algorithm: Algorithm::FirstHitWindow };
    ManyItem::admission(format!("~settled/{nonce:016x}"), params)
}

impl Reservation {
    /// A new reservation of `limits` on `rule`, expiring at `expires_ms`.
    pub fn new(rule: &Rule, expires_ms: u64, limits: Vec<Reserved>) -> Self {
        Reservation { rule_id: rule.id.to_string(), expires_ms, nonce: nonce(), limits }
    }

    /// Its id.
    pub fn id(&self) -> String {
        let mut id = format!("r1|{}|{}|{:016x}|", self.rule_id, self.expires_ms, self.nonce);
        for (i, r) in self.limits.iter().enumerate() {
            let _ = write!(id, "{}{}:{}:{}", if i == 0 { "" } else { "," }, r.limit, r.amount, r.window);
        }
        id
    }

    /// The reservation an id names; an error says what is wrong with it.
    pub fn parse(id: &str) -> Result<Self, String> {
        if id.len() > MAX_RESERVATION_BYTES {
            return Err(format!("{} bytes, at most {MAX_RESERVATION_BYTES}", id.len()));
        }
        let malformed = || "not a reservation id this service answered with".to_owned();
        let mut parts = id.split('|');
        let (Some("r1"), Some(rule_id), Some(expires), Some(nonce), Some(limits), None) =
            (parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed());
        };
        let expires_ms = expires.parse().map_err(|_| malformed())?;
        let nonce = u64::from_str_radix(nonce, 16).map_err(|_| malformed())?;
        let mut reserved = Vec::new();
        for limit in limits.split(',').filter(|l| !l.is_empty()) {
            let mut fields = limit.split(':').map(str::parse::<u64>);
            let (Some(Ok(index)), Some(Ok(amount)), Some(Ok(window)), None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                return Err(malformed());
            };
            let limit =
                usize::try_from(index).ok().filter(|&i| i <= MAX_ALSO_LIMITS).ok_or_else(malformed)?;
            if reserved.len() > MAX_ALSO_LIMITS || reserved.iter().any(|r: &Reserved| r.limit == limit) {
                return Err(malformed());
            }
            reserved.push(Reserved { limit, amount, window });
        }
        Ok(Reservation { rule_id: rule_id.to_owned(), expires_ms, nonce, limits: reserved })
    }

    /// What limit `index` holds (0 when nothing).
    fn held(&self, index: usize) -> Option<&Reserved> {
        self.limits.iter().find(|r| r.limit == index)
    }

    /// The counter that records the settlement, decided first in its job:
    /// one hit of a first-hit window of one that lasts until the
    /// reservation expires, so a second settlement does not fit and the
    /// job counts nothing.
    pub fn claim(&self, now_ms: u64) -> ManyItem {
        claim(self.nonce, self.expires_ms, now_ms)
    }

    /// The settlement's job: the claim, then each of `items` (the rule's
    /// limits as reports, [`Rule::items`]) charged the difference between
    /// what the report states of its unit (`stated(index)`) and what it
    /// holds: more counted whatever is left, less given back to the window
    /// it was counted in. A limit whose unit the report does not state (a
    /// limit of requests among them) keeps what it holds: nothing is
    /// counted on it.
    pub fn settle(
        &self,
        now_ms: u64,
        items: Vec<ManyItem>,
        stated: impl Fn(usize) -> Option<u64>,
    ) -> Vec<ManyItem> {
        let mut job = Vec::with_capacity(items.len() + 1);
        job.push(self.claim(now_ms));
        for (index, item) in items.into_iter().enumerate() {
            let held = self.held(index);
            let reserved = held.map_or(0, |r| r.amount);
            let actual = stated(index).unwrap_or(reserved);
            let item = match actual.checked_sub(reserved) {
                Some(more) => ManyItem { weight: more, count: Count::Always, ..item },
                None => ManyItem {
                    weight: reserved - actual,
                    count: Count::Always,
                    refund: held.map(|r| r.window),
                    ..item
                },
            };
            job.push(item);
        }
        job
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_reads_back_as_written_and_nothing_else_reads() {
        let reservation = Reservation {
            rule_id: "llm.key-1".to_owned(),
            expires_ms: 1_800_000_000_000,
            nonce: 0xfeed,
            limits: vec![
                Reserved { limit: 0, amount: 1, window: 30_000_000 },
                Reserved { limit: 2, amount: 4_000, window: 24_312 },
            ],
        };
        let id = reservation.id();
        assert_eq!(id, "r1|llm.key-1|1800000000000|000000000000feed|0:1:30000000,2:4000:24312");
        assert_eq!(Reservation::parse(&id).unwrap(), reservation);
        for bad in [
            "",
            "r2|a|1|1|0:1:1",
            "r1|a|x|1|0:1:1",
            "r1|a|1|zz|0:1:1",
            "r1|a|1|1|0:1",
            "r1|a|1|1|0:1:1:1",
            "r1|a|1|1|0:1:1,0:2:2",
            "r1|a|1|1|9:1:1",
            "r1|a|1|1|0:1:1|",
        ] {
            assert!(Reservation::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Reservation::parse(&"r".repeat(MAX_RESERVATION_BYTES + 1)).unwrap_err().contains("at most"));
    }
}
