//! Which user each request counts against: one hot key, uniform over N,
//! zipf over N (a few users hot, a long tail cold), from a seeded RNG so
//! runs are repeatable; or a new user every request (a flood of distinct
//! keys, optionally padded to a length).

use std::{
    str::FromStr,
    sync::atomic::{AtomicU64, Ordering},
};

/// xorshift64*: fast, seedable, good enough to pick keys.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value).
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The distribution of user ids.
#[derive(Debug)]
pub(crate) enum KeySpace {
    /// Every request for `user-0`.
    Hot,
    /// `user-0 .. user-{N-1}`, equally likely.
    Uniform(u64),
    /// `user-0 .. user-{N-1}`, rank k with probability ∝ 1/(k+1)^s (cumulative table).
    Zipf(Vec<f64>),
    /// `user-<n>` for n = 0, 1, 2, … across all callers, left-padded with
    /// `x` to at least the given length.
    Distinct(AtomicU64, usize),
}

impl KeySpace {
    /// The user id of the next request.
    pub(crate) fn pick(&self, rng: &mut Rng) -> String {
        let index = match self {
            KeySpace::Hot => 0,
            KeySpace::Uniform(n) => rng.next() % n,
            KeySpace::Zipf(cumulative) => {
                let roll = rng.unit();
                cumulative.partition_point(|&c| c < roll) as u64
            }
            KeySpace::Distinct(next, len) => {
                let id = format!("user-{}", next.fetch_add(1, Ordering::Relaxed));
                return if id.len() < *len { format!("{}{id}", "x".repeat(len - id.len())) } else { id };
            }
        };
        format!("user-{index}")
    }
}

impl FromStr for KeySpace {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let parts: Vec<&str> = text.split(':').collect();
        let number = |s: &str| {
            s.parse::<u64>().map_err(|_| format!("--keys {text}: {s} is not a count")).and_then(|n| {
                if n == 0 { Err(format!("--keys {text}: needs at least one user")) } else { Ok(n) }
            })
        };
        match parts.as_slice() {
            ["hot"] => Ok(KeySpace::Hot),
            ["distinct"] => Ok(KeySpace::Distinct(AtomicU64::new(0), 0)),
            ["distinct", len] => {
                let len = len.parse().map_err(|_| format!("--keys {text}: {len} is not a length"))?;
                Ok(KeySpace::Distinct(AtomicU64::new(0), len))
            }
            ["uniform", n] => Ok(KeySpace::Uniform(number(n)?)),
            ["zipf", n, s] => {
                let n = number(n)?;
                let s: f64 = s.parse().map_err(|_| format!("--keys {text}: {s} is not an exponent"))?;
                let weights: Vec<f64> = (1..=n).map(|k| 1.0 / (k as f64).powf(s)).collect();
                let total: f64 = weights.iter().sum();
                let mut running = 0.0;
                let cumulative = weights.iter().map(|w| {
                    running += w / total;
                    running
                });
                Ok(KeySpace::Zipf(cumulative.collect()))
            }
            _ => Err(format!("--keys {text}: expected hot, uniform:N or zipf:N:S")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributions_have_their_shape() {
        let mut rng = Rng::new(7);
        assert_eq!(KeySpace::Hot.pick(&mut rng), "user-0");
        let uniform: KeySpace = "uniform:10".parse().unwrap();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1_000 {
            seen.insert(uniform.pick(&mut rng));
        }
        assert_eq!(seen.len(), 10);
        let zipf: KeySpace = "zipf:1000:1.1".parse().unwrap();
        let top = (0..10_000).filter(|_| zipf.pick(&mut rng) == "user-0").count();
        assert!(top > 1_000, "rank 0 should be hot: {top}");
        assert!("zipf:0:1".parse::<KeySpace>().is_err());
        assert!("lots".parse::<KeySpace>().is_err());
    }
}
