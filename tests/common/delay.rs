//! A TCP proxy in front of a store: every byte is delivered a one-way
//! latency after it was read, in each direction, in order. It stands for
//! the network between a region and a store in another region, or for a
//! store that turns slow without this process working harder
//! (`set_latency`); `cut` stops forwarding (the connections stay open,
//! bytes wait) until `restore`. Stopped when dropped.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream, tcp::OwnedReadHalf, tcp::OwnedWriteHalf},
    sync::mpsc,
    task::JoinSet,
    time::Instant,
};

/// The proxy: connect to `addr` to reach the target late.
#[derive(Debug)]
pub struct DelayProxy {
    pub addr: SocketAddr,
    cut: Arc<AtomicBool>,
    /// The one-way latency of bytes read from now on, in µs.
    latency_us: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl DelayProxy {
    /// A proxy on a free loopback port to `target`, `one_way` late in each
    /// direction.
    pub async fn start(target: SocketAddr, one_way: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let cutting = Arc::clone(&cut);
        let latency_us = Arc::new(AtomicU64::new(micros(one_way)));
        let latency = Arc::clone(&latency_us);
        let task = tokio::spawn(async move {
            // Dropped with the accept loop: every connection's tasks end too.
            let mut connections = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else { continue };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (from, to) in [(client_read, server_write), (server_read, client_write)] {
                    let (sent, queued) = mpsc::unbounded_channel();
                    connections.spawn(read(from, sent, Arc::clone(&latency)));
                    connections.spawn(write(queued, to, Arc::clone(&cutting)));
                }
            }
        });
        DelayProxy { addr, cut, latency_us, task }
    }

    /// The one-way latency of what is read from now on (what waits keeps
    /// its time; order is kept).
    pub fn set_latency(&self, one_way: Duration) {
        self.latency_us.store(micros(one_way), Ordering::Relaxed);
    }

    /// Stops forwarding: what is sent waits, in order, until [`Self::restore`].
    pub fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }

    /// Forwards again, what waited first.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::Relaxed);
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

/// Reads chunks as they come, each stamped with when it may be delivered.
async fn read(
    mut from: OwnedReadHalf,
    sent: mpsc::UnboundedSender<(Instant, Vec<u8>)>,
    latency_us: Arc<AtomicU64>,
) {
    let mut buffer = vec![0; 64 * 1024];
    while let Ok(n) = from.read(&mut buffer).await {
        let due = Instant::now() + Duration::from_micros(latency_us.load(Ordering::Relaxed));
        if n == 0 || sent.send((due, buffer[..n].to_vec())).is_err() {
            break;
        }
    }
}

/// Delivers each chunk at its time, and none while the path is cut.
async fn write(
    mut queued: mpsc::UnboundedReceiver<(Instant, Vec<u8>)>,
    mut to: OwnedWriteHalf,
    cut: Arc<AtomicBool>,
) {
    while let Some((due, bytes)) = queued.recv().await {
        tokio::time::sleep_until(due).await;
        while cut.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if to.write_all(&bytes).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
