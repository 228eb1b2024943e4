//! The pause after a failed accept, for every gRPC listener (plain TCP and
//! the Unix socket through `server::places`, TLS in `tls.rs`): out of
//! descriptors or memory, an accept fails again at once, and retrying at
//! once spins a core. 10 ms, doubling to 1 s while accepts keep failing,
//! back to 10 ms after one succeeds; the failure logged at most once a
//! second.

use std::time::Duration;

use crate::{
    clock::{Clock as _, SystemClock},
    folded::Folded,
};

/// One listener's pause between failed accepts.
#[derive(Debug)]
pub struct AcceptBackoff {
    pause: Duration,
    failures: Folded,
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        AcceptBackoff { pause: AcceptBackoff::FIRST, failures: Folded::default() }
    }
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MOST: Duration = Duration::from_secs(1);

    /// An accept succeeded: the next failure pauses briefly again.
    pub fn reset(&mut self) {
        self.pause = AcceptBackoff::FIRST;
    }

    /// An accept failed with `error`: says so (at most once a second) and
    /// waits, each time twice as long up to a second.
    pub async fn pause(&mut self, error: &str) {
        if let Some(folded) = self.failures.pass(SystemClock.now_ms() / 1_000) {
            tracing::warn!(%error, also_failed = folded, pause = ?self.pause, "accepting a gRPC connection failed");
        }
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(AcceptBackoff::MOST);
    }
}
