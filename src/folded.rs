//! Folded logging: an event the hot path (or a tight loop) may meet at any
//! rate is logged at most once a second, and the line says how many
//! occurrences it stands for, so a flood of events never becomes a flood of
//! log lines. Lock-free; the caller passes the time.

use std::sync::atomic::{AtomicU64, Ordering};

/// One log line a second at most for an event the hot path may meet at any
/// rate: lock-free, and the line says how many occurrences it stands for.
#[derive(Debug, Default)]
pub struct Folded {
    last_logged_s: AtomicU64,
    suppressed: AtomicU64,
}

impl Folded {
    /// Whether to log an occurrence at `now_s` (seconds): `Some(n)` with the
    /// `n` occurrences folded since the last line, or `None` (counted).
    pub fn pass(&self, now_s: u64) -> Option<u64> {
        let last = self.last_logged_s.load(Ordering::Relaxed);
        if now_s > last
            && self.last_logged_s.compare_exchange(last, now_s, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folded_logging_passes_once_a_second_and_counts_the_rest() {
        let folded = Folded::default();
        assert_eq!(folded.pass(10), Some(0));
        assert_eq!((folded.pass(10), folded.pass(10), folded.pass(10)), (None, None, None));
        assert_eq!(folded.pass(11), Some(3), "the next second's line carries the three folded");
        assert_eq!(folded.pass(11), None);
    }
}
