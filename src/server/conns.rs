//! The HTTP port's connections, bounded (`http.max_connections`,
//! `http.idle_timeout_ms`, `http.max_connection_age_ms`): each accepted
//! connection holds one of a fixed number of places until it closes. A
//! connection that finds none free takes the place of the one that
//! received nothing for longest ([`super::reclaim`]), which is closed: so
//! keep-alive pollers from any number of addresses, each within its share,
//! cannot keep a probe or a scraper out. A connection
//! that sends nothing for the idle timeout, or that reaches its age (a
//! client that never reads the answer), is closed; a request head trickled
//! in byte by byte is cut by the server's header-read deadline
//! (`http.header_read_timeout_ms`, [`super::health`]). So idle or slow clients of `/metrics` can hold
//! neither the descriptors nor the memory gRPC needs. Accept errors (no
//! descriptor left) are retried after a pause by axum's own listener.
//!
//! One peer (an IPv4 address, an IPv6 /64) holds at most
//! `http.max_connections_per_peer` of the places: a connection past it is
//! closed as soon as it is accepted, so a flood of unfinished request
//! heads from one address cannot take the places the probes and scrapers
//! need.

use std::{
    collections::HashMap,
    future::Future,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use crate::budget::PeerKey;

use axum::serve::Listener;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::{Instant, Sleep},
};

use super::reclaim::{Place, Places};
use crate::budget::{Activity, Peer, now_ms};

/// How the connections of a listener are bounded.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Of those, one peer's.
    pub max_connections_per_peer: usize,
    /// Closed after this long without a byte received.
    pub idle_timeout: Duration,
    /// Closed this long after being accepted.
    pub max_age: Duration,
    /// A request's head must be whole this long after its first byte.
    pub header_read_timeout: Duration,
}

/// Connections open, by peer (a peer with none has no entry).
type Peers = Arc<Mutex<HashMap<PeerKey, usize>>>;

/// A listener whose connections are [`Bounded`].
#[derive(Debug)]
pub struct Capped<L> {
    inner: L,
    places: Arc<Places>,
    peers: Peers,
    limits: Limits,
}

impl<L> Capped<L> {
    /// `inner`'s connections, bounded by `limits`.
    pub fn new(inner: L, limits: Limits) -> Self {
        Capped {
            inner,
            places: Arc::new(Places::with_untrusted(limits.max_connections, limits.max_connections, 0)),
            peers: Peers::default(),
            limits,
        }
    }
}

/// One of its peer's connections, counted until dropped.
#[derive(Debug)]
struct PeerPlace {
    peers: Peers,
    peer: PeerKey,
}

impl PeerPlace {
    /// A place for one more connection of `peer`, if it holds fewer than `max`.
    fn take(peers: &Peers, peer: PeerKey, max: usize) -> Option<PeerPlace> {
        let mut open = peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = open.entry(peer).or_default();
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(PeerPlace { peers: Arc::clone(peers), peer })
    }
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let mut open = self.peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = open.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.peer);
            }
        }
    }
}

impl<L: Listener<Addr = SocketAddr>> Listener for Capped<L> {
    type Io = Bounded<L::Io>;
    type Addr = L::Addr;

    fn accept(&mut self) -> impl Future<Output = (Self::Io, Self::Addr)> + Send {
        let places = Arc::clone(&self.places);
        let peers = Arc::clone(&self.peers);
        let limits = self.limits;
        let inner = &mut self.inner;
        async move {
            loop {
                let (io, addr) = inner.accept().await;
                let key = PeerKey::of(addr.ip());
                // Past its peer's share, or with no place to reclaim: closed at once (dropped).
                let Some(peer) = PeerPlace::take(&peers, key, limits.max_connections_per_peer) else {
                    continue;
                };
                let activity = Arc::new(Activity::new(now_ms()));
                let who = Peer { key, trusted: false, may_report: false };
                if let Some(place) = places.admit(who, Arc::clone(&activity), now_ms()) {
                    return (Bounded::new(io, (place, peer), activity, limits), addr);
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection holding a place, closed (an I/O error to hyper) when idle
/// or old, or (its end of stream) when its place is reclaimed.
#[derive(Debug)]
pub struct Bounded<T> {
    io: T,
    _place: (Place, PeerPlace),
    activity: Arc<Activity>,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    age: Pin<Box<Sleep>>,
}

impl<T> Bounded<T> {
    fn new(io: T, place: (Place, PeerPlace), activity: Arc<Activity>, limits: Limits) -> Self {
        let now = Instant::now();
        Bounded {
            io,
            _place: place,
            activity,
            idle_timeout: limits.idle_timeout,
            idle: Box::pin(tokio::time::sleep_until(now + limits.idle_timeout)),
            age: Box::pin(tokio::time::sleep_until(now + limits.max_age)),
        }
    }

    /// The error that closes a connection past its age.
    fn aged(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        self.age
            .as_mut()
            .poll(cx)
            .is_ready()
            .then(|| io::Error::new(io::ErrorKind::TimedOut, "http.max_connection_age_ms reached"))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Bounded<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(error) = this.aged(cx) {
            return Poll::Ready(Err(error));
        }
        if this.activity.closing(cx.waker()) {
            // Its place was reclaimed: the end of the stream ends it.
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    let next = Instant::now() + this.idle_timeout;
                    this.idle.as_mut().reset(next);
                    this.activity.touch(now_ms());
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if this.idle.as_mut().poll(cx).is_ready() => {
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "http.idle_timeout_ms reached")))
            }
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Bounded<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.activity.closing(cx.waker()) {
            return Poll::Ready(Err(io::ErrorKind::ConnectionAborted.into()));
        }
        match Pin::new(&mut this.io).poll_write(cx, buf) {
            // A client that does not read: the write waits, until the age.
            Poll::Pending => this.aged(cx).map_or(Poll::Pending, |error| Poll::Ready(Err(error))),
            other => other,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::{
        io::{AsyncReadExt as _, AsyncWriteExt as _},
        net::{TcpListener, TcpStream},
    };

    use super::*;

    async fn capped(limits: Limits) -> (Capped<TcpListener>, std::net::SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        (Capped::new(listener, limits), addr)
    }

    const LIMITS: Limits = Limits {
        max_connections: 2,
        max_connections_per_peer: 2,
        idle_timeout: Duration::from_millis(300),
        max_age: Duration::from_secs(3_600),
        header_read_timeout: Duration::from_secs(3_600),
    };

    /// Two places, both held: a third connection takes the place of the
    /// one that received nothing for longest, which is closed.
    #[tokio::test]
    async fn a_new_connection_takes_the_place_of_the_quietest() {
        let (mut listener, addr) = capped(Limits { max_connections_per_peer: 3, ..LIMITS }).await;
        let _clients = [TcpStream::connect(addr).await.unwrap(), TcpStream::connect(addr).await.unwrap()];
        let (mut first, _) = listener.accept().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (_second, _) = listener.accept().await;
        let _third = TcpStream::connect(addr).await.unwrap();
        let (_third, _) =
            tokio::time::timeout(Duration::from_secs(5), listener.accept()).await.expect("a place reclaimed");
        let read = tokio::time::timeout(Duration::from_secs(1), first.read(&mut [0; 8])).await.unwrap();
        assert!(matches!(read, Ok(0)), "the quietest was closed: {read:?}");
    }

    /// One peer holds at most its share of the places: past it a connection
    /// is closed at once, and another peer is accepted.
    #[tokio::test]
    async fn a_peer_holds_at_most_its_share() {
        let limits = Limits { max_connections: 3, max_connections_per_peer: 1, ..LIMITS };
        let (mut listener, addr) = capped(limits).await;
        let from = |ip: &str| {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
            socket.connect(addr)
        };
        let _first = from("127.0.0.2").await.unwrap();
        let (held, peer) = listener.accept().await;
        assert_eq!(peer.ip().to_string(), "127.0.0.2");
        let mut second = from("127.0.0.2").await.unwrap();
        let _other = from("127.0.0.3").await.unwrap();
        let (_accepted, peer) = listener.accept().await;
        assert_eq!(peer.ip().to_string(), "127.0.0.3", "the second of 127.0.0.2 was passed over");
        let read = tokio::time::timeout(Duration::from_secs(5), second.read(&mut [0; 8])).await.unwrap();
        assert!(matches!(read, Ok(0) | Err(_)), "closed at once: {read:?}");
        assert_eq!(listener.peers.lock().unwrap().len(), 2);
        drop(held);
        assert_eq!(listener.peers.lock().unwrap().len(), 1, "a peer's count goes with its last connection");
    }

    /// An idle connection is closed after the idle timeout; bytes keep it
    /// open; a connection past its age is closed whatever it sends.
    #[tokio::test]
    async fn idle_and_old_connections_are_closed() {
        let (mut listener, addr) = capped(LIMITS).await;
        let _client = TcpStream::connect(addr).await.unwrap();
        let (mut server, _) = listener.accept().await;
        let started = Instant::now();
        let error = server.read(&mut [0; 8]).await.expect_err("closed when idle");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(250));

        let old = Limits { max_age: Duration::from_millis(400), ..LIMITS };
        let (mut listener, addr) = capped(old).await;
        let mut client = TcpStream::connect(addr).await.unwrap();
        let (mut server, _) = listener.accept().await;
        let trickle = tokio::spawn(async move {
            for _ in 0..20 {
                if client.write_all(b"G").await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let mut read = 0;
        let error = loop {
            match server.read(&mut [0; 8]).await {
                Ok(n) => read += n,
                Err(error) => break error,
            }
        };
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!((2..=6).contains(&read), "a trickle keeps it from idling, not from ageing: {read}");
        trickle.abort();
    }
}
