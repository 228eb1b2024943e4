//! What each gRPC connection may hold ([`Caller`], handed to every request
//! of the connection as its connect info): its share of the store's
//! in-flight work (`grpc.max_store_calls_per_connection`, read by `api/`)
//! and of the request byte budget (its own and its peer's, read by the
//! budget layer), and one of the `grpc.max_connections` places across the
//! TCP port (plain or TLS) and the Unix socket ([`super::reclaim`]: which
//! connection gives its place up when they run short). Each accepted
//! connection holds its place ([`Placed`]) until tonic drops it or the
//! place is reclaimed, which ends it at its next read. Over TLS the accept
//! loop (`tls.rs`) hands finished handshakes through a queue of 1,024.

use std::{
    io::{self, IoSlice},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use futures_util::{Stream, StreamExt as _};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

use super::reclaim::{Place, Places};
use crate::{
    accept::AcceptBackoff,
    budget::{Budget, Caller, Peer, Quotas},
};

/// A connection holding one of the `grpc.max_connections` places, freed
/// when it is dropped, and its share of the store's in-flight work. Reads
/// and writes go straight to the connection, until its place is
/// reclaimed: then its next read is its end.
#[derive(Debug)]
pub(super) struct Placed<T> {
    io: T,
    _place: Place,
    caller: Caller,
}

impl Placed<tokio::net::TcpStream> {
    /// The same connection, its place and shares, off this runtime's
    /// reactor: to be served by another thread's ([`super::threads`]).
    pub(super) fn into_std(self) -> io::Result<Placed<std::net::TcpStream>> {
        let Placed { io, _place, caller } = self;
        Ok(Placed { io: io.into_std()?, _place, caller })
    }
}

impl Placed<std::net::TcpStream> {
    /// The connection on the current runtime's reactor.
    pub(super) fn into_tokio(self) -> io::Result<Placed<tokio::net::TcpStream>> {
        let Placed { io, _place, caller } = self;
        Ok(Placed { io: tokio::net::TcpStream::from_std(io)?, _place, caller })
    }
}

/// Who a connection comes from, for its shares and what it may do.
pub(super) type PeerOf<T> = Arc<dyn Fn(&T) -> Peer + Send + Sync>;

/// `incoming`'s connections, each with a place in `places` (reclaimed
/// from another when none is free; a connection that gets none is closed
/// at once); an accept error passes through after a pause
/// ([`AcceptBackoff`]: tonic retries at once, which spun a core while no
/// descriptor was left). Each connection gets its shares of `budget` and
/// of the store's calls (`quotas`), as `peer_of` says who it comes from;
/// one from an untrusted peer that has its `quotas.connections_per_peer`
/// open already is closed at once (dropped).
pub(super) fn placed<S, T, E>(
    incoming: S,
    places: Arc<Places>,
    budget: Arc<Budget>,
    peer_of: PeerOf<T>,
    quotas: Quotas,
) -> impl Stream<Item = Result<Placed<T>, E>> + Send
where
    S: Stream<Item = Result<T, E>> + Unpin + Send,
    T: Send + 'static,
    E: Send + std::fmt::Display,
{
    let state = (incoming, places, AcceptBackoff::default());
    futures_util::stream::unfold(state, move |(mut incoming, places, mut backoff)| {
        let (budget, peer_of) = (Arc::clone(&budget), Arc::clone(&peer_of));
        async move {
            loop {
                let io = match incoming.next().await? {
                    Ok(io) => io,
                    Err(error) => {
                        let message = error.to_string();
                        backoff.pause(&message).await;
                        return Some((Err(error), (incoming, places, backoff)));
                    }
                };
                backoff.reset();
                let peer = peer_of(&io);
                let Some(caller) = budget.caller(peer, quotas) else { continue };
                let now = crate::budget::now_ms();
                if let Some(place) = places.admit(peer, Arc::clone(&caller.activity), now) {
                    return Some((Ok(Placed { io, _place: place, caller }), (incoming, places, backoff)));
                }
            }
        }
    })
}

/// Who a connection is, by its address and, over mTLS, the names its
/// certificate carries: trusted (`grpc.trusted_peers`,
/// `grpc.tls.trusted_client_names`) and allowed to report outcomes
/// (`grpc.reporting_peers`, `grpc.tls.reporting_client_names`; everyone
/// while neither is set).
#[derive(Debug)]
pub(super) struct Identify {
    trusted: Vec<ipnet::IpNet>,
    trusted_names: Vec<String>,
    reporting: Vec<ipnet::IpNet>,
    reporting_names: Vec<String>,
}

impl Identify {
    /// From `grpc.*` (validated with the rest of the configuration).
    pub(super) fn of(grpc: &crate::config::GrpcConfig) -> Self {
        Identify {
            trusted: grpc.trusted_nets().unwrap_or_default(),
            trusted_names: grpc.tls.trusted_client_names.clone(),
            reporting: grpc.reporting_nets().unwrap_or_default(),
            reporting_names: grpc.tls.reporting_client_names.clone(),
        }
    }

    /// The peer at `addr` (none readable: one peer with every other such),
    /// over `tls` when it is.
    pub(super) fn peer(
        &self,
        addr: Option<std::net::SocketAddr>,
        tls: Option<&tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
    ) -> Peer {
        let ip = addr.map(|addr| addr.ip());
        let within = |nets: &[ipnet::IpNet]| ip.is_some_and(|ip| nets.iter().any(|net| net.contains(&ip)));
        let named = |names: &[String]| tls.is_some_and(|tls| crate::tls::client_named(tls, names));
        let restricted = !self.reporting.is_empty() || !self.reporting_names.is_empty();
        Peer {
            key: ip.map_or(crate::budget::PeerKey::Local, crate::budget::PeerKey::of),
            trusted: within(&self.trusted) || named(&self.trusted_names),
            may_report: !restricted || within(&self.reporting) || named(&self.reporting_names),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Placed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // Its place reclaimed: the end of the stream ends it. The waker is
        // registered only when the read is to wait (then looked again).
        if self.caller.activity.closed() {
            return Poll::Ready(Ok(()));
        }
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Pending if self.caller.activity.closing(cx.waker()) => Poll::Ready(Ok(())),
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Placed<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.caller.activity.closed() {
            return Poll::Ready(Err(io::ErrorKind::ConnectionAborted.into()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    /// As the connection's: hyper gathers a response's frames into one
    /// `writev` only when it is.
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The connect info tonic puts in every request's extensions: what the
/// connection may hold.
impl<T> Connected for Placed<T> {
    type ConnectInfo = Caller;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.caller.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two places, both held by idle connections: a third takes the
    /// place of the one idle longest, which ends at its next read; an
    /// accept error passes through.
    #[tokio::test]
    async fn a_new_connection_takes_the_place_of_the_idle_one() {
        let (send, receive) = tokio::sync::mpsc::unbounded_channel::<Result<u32, &str>>();
        for item in [Ok(1), Err("accept failed"), Ok(2), Ok(3)] {
            send.send(item).unwrap();
        }
        let places = Arc::new(Places::new(2, 0));
        let incoming = tokio_stream::wrappers::UnboundedReceiverStream::new(receive);
        let budget = Arc::new(Budget::unshared(1));
        let local: PeerOf<u32> =
            Arc::new(|_| Peer { key: crate::budget::PeerKey::Local, trusted: true, may_report: true });
        let mut connections =
            Box::pin(placed(incoming, Arc::clone(&places), budget, local, Quotas::default()));
        let first = connections.next().await.unwrap().unwrap();
        assert_eq!(connections.next().await.unwrap().unwrap_err(), "accept failed");
        let second = connections.next().await.unwrap().unwrap();
        let _busy = second.caller.activity.begin();
        assert_eq!((first.io, second.io), (1, 2));
        let third = connections.next().await.unwrap().unwrap();
        assert_eq!((third.io, places.open()), (3, 2));
        let waker = futures_util::task::noop_waker_ref();
        assert!(first.caller.activity.closing(waker), "the idle one gave its place");
        assert!(!second.caller.activity.closing(waker));
        drop(first);
        assert_eq!(places.open(), 2, "a reclaimed place is not given back twice");
        drop((second, third));
        assert_eq!(places.open(), 0, "closed connections free their places");
    }
}
