//! Request priority: which traffic is shed first when the service runs hot
//! (docs/design.md §7). Defined here, with the policy that reads it; rules, the
//! engine and the configuration all name it from `shed`.

use std::fmt;

use serde::{Deserialize, Serialize};

/// How important a request is when the service sheds load (docs/design.md §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Priority {
    /// Never shed.
    Critical,
    /// Shed only at CRITICAL_ONLY.
    Degraded,
    /// Shed from DEGRADED_MODE on.
    BestEffort,
    /// Shed from DEGRADED_MODE on.
    Bulk,
}

impl Priority {
    /// The name used in rule files, the API and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "CRITICAL",
            Priority::Degraded => "DEGRADED",
            Priority::BestEffort => "BEST_EFFORT",
            Priority::Bulk => "BULK",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Priority {
    /// Every priority, most important first.
    pub const ALL: [Priority; 4] =
        [Priority::Critical, Priority::Degraded, Priority::BestEffort, Priority::Bulk];

    /// The less important of `self` and `other` (BULK is the least).
    pub fn least_important(self, other: Priority) -> Priority {
        let rank = |p: Priority| Priority::ALL.iter().position(|&q| q == p);
        if rank(other) > rank(self) { other } else { self }
    }

    /// The priority named `text` (`CRITICAL`, `DEGRADED`, `BEST_EFFORT`,
    /// `BULK`, any ASCII case); `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        Priority::ALL.into_iter().find(|p| p.as_str().eq_ignore_ascii_case(text))
    }
}
