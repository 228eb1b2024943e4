//! The statsd sink of envoyproxy/ratelimit's counters
//! (`telemetry.statsd_addr`; upstream's `USE_STATSD`, `STATSD_HOST`,
//! `STATSD_PORT`, `STATS_FLUSH_INTERVAL`): every flush interval, what each
//! counter the registered parts report ([`Figures::statsd_counters`]:
//! envoyproxy/ratelimit's families, counted by the decision path) gained
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

use super::Metrics;
#[cfg(doc)]
use super::exposition::Figures;

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
        if let Some(client) = &client {
            flush(client, &metrics.statsd_counters(), &mut sent);
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
fn flush(client: &StatsdClient, totals: &[(String, u64)], sent: &mut HashMap<String, u64>) {
    for (name, total) in totals {
        let last = sent.entry(name.clone()).or_insert(0);
        if *total > *last {
            let delta = i64::try_from(total - *last).unwrap_or(i64::MAX);
            // A full or unreachable sink drops the datagram; nothing to do.
            let _ = client.count(name, delta);
            *last = *total;
        }
    }
    let _ = client.flush();
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::telemetry::Figures;

    /// Counters whose totals the test sets.
    #[derive(Debug, Default)]
    struct Totals(Mutex<Vec<(String, u64)>>);

    impl Figures for Totals {
        fn render(&self, _: &mut String) {}

        fn statsd_counters(&self, out: &mut Vec<(String, u64)>) {
            out.extend(self.0.lock().unwrap().iter().cloned());
        }
    }

    /// The names as given and the deltas, read off a real UDP socket.
    #[tokio::test]
    async fn sends_each_counters_gain_and_only_what_changed() {
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        receiver.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let client = client(&receiver.local_addr().unwrap().to_string()).await.unwrap();
        let totals = Arc::new(Totals::default());
        let metrics = Metrics::new();
        metrics.register(Arc::clone(&totals) as Arc<dyn Figures>);
        let set = |pairs: &[(&str, u64)]| {
            *totals.0.lock().unwrap() = pairs.iter().map(|(n, v)| ((*n).to_owned(), *v)).collect();
        };
        set(&[("service.a.total_hits", 3), ("service.a.near_limit", 0), ("service.error", 1)]);
        let mut sent = HashMap::new();
        flush(&client, &metrics.statsd_counters(), &mut sent);
        set(&[("service.a.total_hits", 4), ("service.a.near_limit", 0), ("service.error", 1)]);
        flush(&client, &metrics.statsd_counters(), &mut sent);
        let mut lines = Vec::new();
        let mut buf = [0u8; 2048];
        while lines.len() < 3 {
            let n = receiver.recv(&mut buf).expect("a datagram");
            lines.extend(String::from_utf8_lossy(&buf[..n]).lines().map(str::to_owned));
        }
        assert_eq!(
            lines,
            [
                "ratelimit.service.a.total_hits:3|c",
                "ratelimit.service.error:1|c",
                "ratelimit.service.a.total_hits:1|c"
            ]
        );
        receiver.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        assert!(receiver.recv(&mut buf).is_err(), "nothing unchanged is sent");
    }
}
