//! `--victim PATH`: what the load does to someone else. While the main load
//! runs, a victim (a connection of its own) sends one `Check` for user
//! `victim` on PATH every `--victim-interval-ms`, and an attacker (another
//! connection) sends `CheckBatch` calls of `--batch` items of its own key
//! `attacker` on PATH, back to back. Reported: how many of each were
//! admitted (against PATH's limit), how many were answered without the
//! shared store (`store_error` set), and the victim's latency.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use ratelimitd::api::pb::{self, rate_limiter_client::RateLimiterClient};
use tonic::transport::Channel;

/// What the victim and the attacker saw.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    victim_sent: u64,
    victim_admitted: u64,
    victim_local: u64,
    /// The victim's latencies, sorted.
    latencies: Vec<Duration>,
    attacker_sent: u64,
    attacker_admitted: u64,
    attacker_local: u64,
}

impl Outcome {
    /// One paragraph for the report.
    pub(crate) fn text(&self, path: &str) -> String {
        let p = |q: f64| {
            let i = ((self.latencies.len().saturating_sub(1)) as f64 * q) as usize;
            self.latencies.get(i).copied().unwrap_or_default()
        };
        format!(
            "victim on {path}: admitted {} of {} ({} answered without the shared store), latency p50 {:?} p99 {:?} max {:?}\n\
             attacker on {path} (its own key, batched): admitted {} of {} ({} without the shared store)",
            self.victim_admitted,
            self.victim_sent,
            self.victim_local,
            p(0.5),
            p(0.99),
            self.latencies.last().copied().unwrap_or_default(),
            self.attacker_admitted,
            self.attacker_sent,
            self.attacker_local,
        )
    }
}

async fn client(target: &str) -> anyhow::Result<RateLimiterClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(target.to_owned())?
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("cannot connect to {target}"))?;
    Ok(RateLimiterClient::new(channel))
}

fn request(user: &str, path: &str) -> pb::RateLimitRequest {
    pb::RateLimitRequest { user_id: user.to_owned(), resource_path: path.to_owned(), ..Default::default() }
}

/// Runs the victim and the attacker until `running` turns false.
pub(crate) async fn run(
    target: String,
    path: String,
    interval: Duration,
    batch: usize,
    running: Arc<AtomicBool>,
) -> anyhow::Result<Outcome> {
    let mut victim = client(&target).await?;
    let mut attacker = client(&target).await?;
    let attacking = {
        let (path, running) = (path.clone(), Arc::clone(&running));
        tokio::spawn(async move {
            let (mut sent, mut admitted, mut local) = (0, 0, 0);
            while running.load(Ordering::Relaxed) {
                let items = (0..batch as u64)
                    .map(|id| pb::CheckItem { id, request: Some(request("attacker", &path)) })
                    .collect();
                let Ok(answer) = attacker.check_batch(pb::CheckBatchRequest { items }).await else {
                    continue;
                };
                for response in answer.into_inner().results.iter().filter_map(|r| r.response.as_ref()) {
                    sent += 1;
                    admitted += u64::from(response.allowed);
                    local += u64::from(!response.store_error.is_empty());
                }
            }
            (sent, admitted, local)
        })
    };
    let mut outcome = Outcome::default();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while running.load(Ordering::Relaxed) {
        ticker.tick().await;
        let sent = Instant::now();
        if let Ok(answer) = victim.check(request("victim", &path)).await {
            let answer = answer.into_inner();
            outcome.latencies.push(sent.elapsed());
            outcome.victim_sent += 1;
            outcome.victim_admitted += u64::from(answer.allowed);
            outcome.victim_local += u64::from(!answer.store_error.is_empty());
        }
    }
    (outcome.attacker_sent, outcome.attacker_admitted, outcome.attacker_local) = attacking.await?;
    outcome.latencies.sort();
    Ok(outcome)
}
