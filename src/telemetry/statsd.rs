//! The statsd sink of envoyproxy/ratelimit's counters
//! (`telemetry.statsd_addr`; upstream's `USE_STATSD`, `STATSD_HOST`,
//! `STATSD_PORT`, `STATS_FLUSH_INTERVAL`): every flush interval, what each
//! counter of [`UpstreamMetrics`](super::upstream::UpstreamMetrics) gained
//! since the last flush, as statsd counters under upstream's names
//! (`ratelimit.service.rate_limit.<key>.total_hits`,
//! `ratelimit.service.call.should_rate_limit.redis_error`,
//! `ratelimit.service.config_load_success`, …), so a statsd-exporter fed
//! by upstream keeps its mapping. Sending is UDP through cadence's
//! buffered sink, off the decision path; a lost datagram loses that
//! interval's deltas, as with upstream. An address that does not resolve
//! (a statsd pod not yet up) is tried again at every flush, warned about
//! once, and never stops the service; its deltas wait for the first send.

use std::{collections::HashMap, net::UdpSocket, sync::Arc, time::Duration};

use cadence::{BufferedUdpMetricSink, Counted as _, StatsdClient};
use tokio::sync::watch;

use super::{Metrics, upstream::Totals};

/// Sends the deltas of `metrics`' upstream counters to `addr` (`host:port`)
/// every `interval` until `stop` turns true (one last flush then).
pub async fn run(metrics: Arc<Metrics>, addr: String, interval: Duration, mut stop: watch::Receiver<bool>) {
    let mut sent = HashMap::new();
    let mut client = None;
    let mut warned = false;
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            _ = stop.changed() => {}
        }
        if client.is_none() {
            match self::client(&addr).await {
                Ok(ready) => {
                    if warned {
                        tracing::info!(addr, "statsd: sending");
                    }
                    client = Some(ready);
                }
                Err(error) if !warned => {
                    warned = true;
                    tracing::warn!(addr, error, "statsd: cannot send; tried again at every flush");
                }
                Err(_) => {}
            }
        }
        if let (Some(client), Some(totals)) = (&client, metrics.upstream_totals()) {
            flush(client, &totals, &mut sent);
        }
        if *stop.borrow() {
            return;
        }
    }
}

/// A client sending to `addr` (`host:port`, resolved now) from a
/// non-blocking UDP socket.
pub async fn client(addr: &str) -> Result<StatsdClient, String> {
    let mut targets = tokio::net::lookup_host(addr).await.map_err(|e| e.to_string())?;
    let target = targets.next().ok_or("resolves to no address")?;
    // The socket's family must be the target's (`localhost` may be ::1).
    let local = if target.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
    let socket = UdpSocket::bind(local).map_err(|e| e.to_string())?;
    socket.set_nonblocking(true).map_err(|e| e.to_string())?;
    let sink = BufferedUdpMetricSink::from(target, socket).map_err(|e| e.to_string())?;
    Ok(StatsdClient::from_sink("ratelimit", sink))
}

/// Sends every counter's gain since `sent` recorded it, and records the new totals.
fn flush(client: &StatsdClient, totals: &Totals, sent: &mut HashMap<String, u64>) {
    for (name, total) in totals.counters() {
        let last = sent.entry(name.clone()).or_insert(0);
        if total > *last {
            let delta = i64::try_from(total - *last).unwrap_or(i64::MAX);
            // A full or unreachable sink drops the datagram; nothing to do.
            let _ = client.count(&name, delta);
            *last = total;
        }
    }
    let _ = client.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{LimitHits, Stats as _};

    /// Upstream's names and the deltas, read off a real UDP socket.
    #[tokio::test]
    async fn sends_upstream_names_and_only_what_changed() {
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        receiver.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let client = client(&receiver.local_addr().unwrap().to_string()).await.unwrap();
        let metrics = Metrics::new("memory").with_upstream(10);
        let hits = LimitHits { total: 3, over: 1, within: 2, ..LimitHits::default() };
        metrics.limit_hits("edge.user", hits);
        metrics.envoy_failed();
        let mut sent = HashMap::new();
        flush(&client, &metrics.upstream_totals().unwrap(), &mut sent);
        metrics.limit_hits("edge.user", LimitHits { total: 1, within: 1, ..LimitHits::default() });
        flush(&client, &metrics.upstream_totals().unwrap(), &mut sent);
        let mut lines = Vec::new();
        let mut buf = [0u8; 2048];
        while lines.len() < 5 {
            let n = receiver.recv(&mut buf).expect("a datagram");
            lines.extend(String::from_utf8_lossy(&buf[..n]).lines().map(str::to_owned));
        }
        for line in [
            "ratelimit.service.rate_limit.edge.user.total_hits:3|c",
            "ratelimit.service.rate_limit.edge.user.over_limit:1|c",
            "ratelimit.service.rate_limit.edge.user.within_limit:2|c",
            "ratelimit.service.call.should_rate_limit.redis_error:1|c",
            "ratelimit.service.rate_limit.edge.user.total_hits:1|c",
        ] {
            assert!(lines.iter().any(|l| l == line), "missing {line} in {lines:?}");
        }
        assert!(!lines.iter().any(|l| l.contains("near_limit")), "nothing unchanged is sent: {lines:?}");
    }
}
