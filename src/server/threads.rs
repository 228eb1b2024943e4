//! The serving threads: each plain TCP gRPC connection is served, for its
//! whole life, by one of `grpc.serving_threads` threads, each running a
//! single-threaded runtime of its own (thread per core). The connection's
//! HTTP/2 task, its requests' tasks and the store's dispatcher they call
//! ([`crate::locality`]) all run there, so a decision wakes no other
//! thread: a thread sleeps only waiting for the network (the request, the
//! store's answer), and a busy one does the next piece of work itself. On a
//! shared multi-threaded runtime each hand-off between those tasks woke a
//! sleeping worker (a write to its driver's eventfd, a context switch,
//! often a move to another CPU), which at a few thousand decisions a
//! second cost more than the decision.
//!
//! The accept loop stays on the shared runtime: it gives each connection
//! its place and shares (`places.rs`), then hands it to the serving thread
//! holding the fewest connections. A connection is served by one thread,
//! so one connection's decisions use at most one core; clients open
//! several (Envoy one per worker).

use std::{
    net::TcpStream as StdTcpStream,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use futures_util::{Stream, StreamExt as _};
use tokio::sync::{mpsc, oneshot, watch};

use super::{Router, Serving, places::Placed};

/// Scheduler ticks between two looks at the tasks woken from other
/// threads: every tick. Those are a request cancelled so that another
/// caller gets its bytes (it frees its memory only when it runs) and a
/// connection handed over; at tokio's default, one tick in 31, a thread
/// busy with a flood of its own leaves cancelled requests waiting, their
/// memory held after their bytes have left the budget. A
/// decision's own wake-ups are all on its thread, and an empty queue costs
/// one atomic load to look at.
const REMOTE_FIRST_EVERY: u32 = 1;

/// A connection on its way to a serving thread, and that thread's count of
/// the connections it holds (given back when the connection ends).
struct Handed {
    placed: Placed<StdTcpStream>,
    held: Counted,
}

/// One of a thread's connections, counted while it lives.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A serving thread's connection: the connection and its count.
pub(super) struct Served {
    placed: Placed<tokio::net::TcpStream>,
    _held: Counted,
}

/// A serving thread's end of the hand-off: its queue of connections and
/// its count of them.
type Thread = (mpsc::UnboundedSender<Handed>, Arc<AtomicUsize>);

/// What a serving thread's server answered when it ended.
type Finished = oneshot::Receiver<Result<(), tonic::transport::Error>>;

/// Serves `router` on the connections of `incoming` on `threads` serving
/// threads until `signal`; the future ends when every thread has finished
/// its connections.
pub(super) fn serve<S>(
    threads: usize,
    router: Router,
    incoming: S,
    signal: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<Serving>
where
    S: Stream<Item = Result<Placed<tokio::net::TcpStream>, std::io::Error>> + Send + 'static,
{
    let (stop, stopped) = watch::channel(false);
    let (mut queues, mut finished) = (Vec::with_capacity(threads), Vec::with_capacity(threads));
    for index in 0..threads {
        let (queue, result) = start(index, router.clone(), stopped.clone())?;
        queues.push(queue);
        finished.push(result);
    }
    Ok(Box::pin(async move {
        hand_out(incoming.take_until(signal), &queues).await;
        drop(queues);
        let _ = stop.send(true);
        let mut served = Ok(());
        for result in finished {
            if let Ok(Err(error)) = result.await {
                served = served.and(Err(error));
            }
        }
        served
    }))
}

/// Starts serving thread `index`: `router` on the connections handed to
/// it, until `stopped` says so.
fn start(
    index: usize,
    router: Router,
    mut stopped: watch::Receiver<bool>,
) -> std::io::Result<(Thread, Finished)> {
    // Unbounded: the accept loop admits at most grpc.max_connections.
    let (queue, connections) = mpsc::unbounded_channel::<Handed>();
    let (done, finished) = oneshot::channel();
    std::thread::Builder::new().name(format!("ratelimitd-serve-{index}")).spawn(move || {
        crate::locality::become_serving_thread(index);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .global_queue_interval(REMOTE_FIRST_EVERY)
            .build();
        let runtime = match runtime {
            Ok(runtime) => runtime,
            Err(error) => {
                tracing::error!(%error, index, "a serving thread cannot start its runtime");
                let _ = done.send(Ok(()));
                return;
            }
        };
        let incoming = tokio_stream::wrappers::UnboundedReceiverStream::new(connections)
            .map(|Handed { placed, held }| placed.into_tokio().map(|placed| Served { placed, _held: held }));
        let signal = async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        };
        let served = runtime.block_on(router.serve_with_incoming_shutdown(incoming, signal));
        let _ = done.send(served);
    })?;
    Ok(((queue, Arc::new(AtomicUsize::new(0))), finished))
}

/// Hands each connection of `incoming` to the thread holding the fewest,
/// until it ends. Dropped on return: at the signal the listener closes at
/// once, so a client connecting then is refused rather than left
/// unaccepted until the process exits.
async fn hand_out<S>(incoming: S, threads: &[Thread])
where
    S: Stream<Item = Result<Placed<tokio::net::TcpStream>, std::io::Error>>,
{
    let mut incoming = std::pin::pin!(incoming);
    while let Some(accepted) = incoming.next().await {
        // An accept error was paused on and logged where it happened.
        let Ok(placed) = accepted else { continue };
        // A thread whose runtime did not start has closed its queue; with
        // none left the server ends rather than closing every connection.
        let alive = threads.iter().filter(|(queue, _)| !queue.is_closed());
        let Some((queue, held)) = alive.min_by_key(|(_, held)| held.load(Ordering::Relaxed)) else {
            tracing::error!("no serving thread is left; the gRPC port stops accepting");
            break;
        };
        let Ok(placed) = placed.into_std() else { continue };
        held.fetch_add(1, Ordering::Relaxed);
        let _ = queue.send(Handed { placed, held: Counted(Arc::clone(held)) });
    }
}

impl tokio::io::AsyncRead for Served {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.placed).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Served {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.placed).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.placed).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.placed.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.placed).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.placed).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Served {
    type ConnectInfo = crate::budget::Caller;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.placed.connect_info()
    }
}
