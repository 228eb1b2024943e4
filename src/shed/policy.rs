//! The shedding policy as pure functions: which utilization level the
//! service is in (with hysteresis, so it does not flap around a threshold)
//! and which priorities each level sheds (docs/design.md §7).

use std::fmt;

use super::Priority;

/// How hot the host runs, as seen by the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Nothing is shed.
    Normal,
    /// BULK and BEST_EFFORT are shed.
    Degraded,
    /// Everything but CRITICAL is shed.
    CriticalOnly,
}

impl Level {
    /// The `cluster_utilization_status` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Normal => "NORMAL",
            Level::Degraded => "DEGRADED_MODE",
            Level::CriticalOnly => "CRITICAL_ONLY",
        }
    }

    pub(crate) fn to_u8(self) -> u8 {
        match self {
            Level::Normal => 0,
            Level::Degraded => 1,
            Level::CriticalOnly => 2,
        }
    }

    pub(crate) fn from_u8(value: u8) -> Self {
        match value {
            0 => Level::Normal,
            1 => Level::Degraded,
            _ => Level::CriticalOnly,
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the levels start, and how far below a threshold utilization must
/// fall before the level is left again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// Enter DEGRADED_MODE at or above this (0..1).
    pub degraded_at: f64,
    /// Enter CRITICAL_ONLY at or above this (0..1).
    pub critical_only_at: f64,
    /// A level is left only below its threshold minus this.
    pub hysteresis: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds { degraded_at: 0.60, critical_only_at: 0.85, hysteresis: 0.05 }
    }
}

/// The level after observing (smoothed) `utilization` in level `current`.
/// Rising takes effect at the threshold; falling needs `hysteresis` more.
pub fn next_level(current: Level, utilization: f64, t: &Thresholds) -> Level {
    let rising = if utilization >= t.critical_only_at {
        Level::CriticalOnly
    } else if utilization >= t.degraded_at {
        Level::Degraded
    } else {
        Level::Normal
    };
    if rising >= current {
        return rising;
    }
    // Falling: each level held until utilization is below its threshold
    // minus the hysteresis.
    let falling = if utilization >= t.critical_only_at - t.hysteresis {
        Level::CriticalOnly
    } else if utilization >= t.degraded_at - t.hysteresis {
        Level::Degraded
    } else {
        Level::Normal
    };
    falling.min(current)
}

/// Whether `level` sheds requests of `priority`. CRITICAL never is.
pub fn sheds(level: Level, priority: Priority) -> bool {
    match (level, priority) {
        (_, Priority::Critical) | (Level::Normal, _) => false,
        (Level::Degraded, Priority::Degraded) => false,
        (Level::Degraded, Priority::BestEffort | Priority::Bulk) => true,
        (Level::CriticalOnly, Priority::Degraded | Priority::BestEffort | Priority::Bulk) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Thresholds = Thresholds { degraded_at: 0.60, critical_only_at: 0.85, hysteresis: 0.05 };

    #[test]
    fn thresholds_from_normal() {
        assert_eq!(next_level(Level::Normal, 0.0, &T), Level::Normal);
        assert_eq!(next_level(Level::Normal, 0.5999, &T), Level::Normal);
        assert_eq!(next_level(Level::Normal, 0.60, &T), Level::Degraded);
        assert_eq!(next_level(Level::Normal, 0.8499, &T), Level::Degraded);
        assert_eq!(next_level(Level::Normal, 0.85, &T), Level::CriticalOnly, "can jump two levels up");
        assert_eq!(next_level(Level::Normal, 1.0, &T), Level::CriticalOnly);
    }

    #[test]
    fn hysteresis_holds_a_level_just_below_its_threshold() {
        assert_eq!(next_level(Level::Degraded, 0.58, &T), Level::Degraded);
        assert_eq!(next_level(Level::Degraded, 0.5501, &T), Level::Degraded);
        assert_eq!(next_level(Level::Degraded, 0.5499, &T), Level::Normal);
        assert_eq!(next_level(Level::CriticalOnly, 0.83, &T), Level::CriticalOnly);
        assert_eq!(next_level(Level::CriticalOnly, 0.7999, &T), Level::Degraded);
        assert_eq!(next_level(Level::CriticalOnly, 0.5499, &T), Level::Normal, "can fall two levels");
        assert_eq!(next_level(Level::Degraded, 0.85, &T), Level::CriticalOnly);
    }

    #[test]
    fn oscillating_around_a_threshold_does_not_flap() {
        let mut level = Level::Normal;
        let mut changes = 0;
        for i in 0..100 {
            let u = if i % 2 == 0 { 0.61 } else { 0.57 };
            let next = next_level(level, u, &T);
            changes += usize::from(next != level);
            level = next;
        }
        assert_eq!(changes, 1);
        assert_eq!(level, Level::Degraded);
    }

    #[test]
    fn every_priority_at_every_level() {
        use Priority::*;
        let table = [
            (Level::Normal, [false, false, false, false]),
            (Level::Degraded, [false, false, true, true]),
            (Level::CriticalOnly, [false, true, true, true]),
        ];
        for (level, expected) in table {
            for (priority, shed) in [Critical, Degraded, BestEffort, Bulk].into_iter().zip(expected) {
                assert_eq!(sheds(level, priority), shed, "{level} {priority}");
            }
        }
    }

    #[test]
    fn level_round_trips_through_u8() {
        for level in [Level::Normal, Level::Degraded, Level::CriticalOnly] {
            assert_eq!(Level::from_u8(level.to_u8()), level);
        }
    }
}
