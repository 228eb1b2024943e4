//! The tower layer that counts each gRPC request against the budget: its
//! header block when it arrives, then its body frame by frame through the
//! gRPC length prefixes, and a single-decision call refused unread
//! answered with its method's denial.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use http_body::{Frame, SizeHint};
use tonic::{
    Status,
    body::Body,
    codegen::{Bytes, http},
};

use super::{Budget, Caller, MessageBounds, Refusal, Refused, ticket::Ticket};

/// What a request's stream costs beside its header block and messages
/// (its HTTP/2 and gRPC state, its handler), charged from its arrival.
const STREAM_BYTES: usize = 4 << 10;

/// How many times its decoded size a header block keeps held: its values
/// are slices of the connection's read buffer (HPACK literals are not
/// copied), and a slice keeps that buffer's whole allocation, frames of
/// other streams with it. Measured with the shipped allocator: about four
/// times the decoded size per unfinished stream (docs/hostile-input.md).
const HEADER_RETENTION: usize = 4;

/// What a request's header block costs: each field's name and value and
/// 32 bytes (HTTP/2's measure of a header list), and its path, times what
/// it keeps held ([`HEADER_RETENTION`]).
fn header_bytes(request: &http::Request<Body>) -> usize {
    let fields: usize =
        request.headers().iter().map(|(name, value)| name.as_str().len() + value.len() + 32).sum();
    (fields + request.uri().path().len()) * HEADER_RETENTION
}

/// Counts every request's body against the budget and its message bound
/// (a tower layer).
#[derive(Debug, Clone)]
pub struct BudgetLayer {
    budget: Arc<Budget>,
    pub(super) bounds: Arc<MessageBounds>,
}

impl BudgetLayer {
    /// Requests held against `budget`, each message within `bounds`.
    pub fn new(budget: Arc<Budget>, bounds: MessageBounds) -> Self {
        BudgetLayer { budget, bounds: Arc::new(bounds) }
    }
}

impl<S> tower::Layer<S> for BudgetLayer {
    type Service = Budgeted<S>;

    fn layer(&self, inner: S) -> Budgeted<S> {
        Budgeted { inner, budget: Arc::clone(&self.budget), bounds: Arc::clone(&self.bounds) }
    }
}

/// A service whose requests' bodies are counted against the budget.
#[derive(Debug, Clone)]
pub struct Budgeted<S> {
    inner: S,
    budget: Arc<Budget>,
    bounds: Arc<MessageBounds>,
}

type Response = http::Response<Body>;

impl<S> tower::Service<http::Request<Body>> for Budgeted<S>
where
    S: tower::Service<http::Request<Body>, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Answered<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let path = request.uri().path();
        let bound = self.bounds.of(path);
        let denied = self.bounds.denials.iter().position(|(p, _)| *p == path);
        let budget = Arc::clone(&self.budget);
        let caller = request.extensions().get::<Caller>();
        // In flight, and holding its bytes, while its handler answers or its
        // body is read: the ticket lives as long as either.
        let ticket = match caller {
            Some(caller) => {
                Ticket::new(budget, Some(Arc::clone(&caller.bytes)), Some(caller.activity.begin()))
            }
            None => Ticket::new(budget, None, None),
        };
        // The header block and the stream are held from now until the answer.
        let refused = ticket.take(header_bytes(&request) + STREAM_BYTES).err();
        let deny = denied.is_some();
        let timeout = self.bounds.message_timeout;
        let counted =
            |body| Body::new(Counted::new(body, Arc::clone(&ticket), bound, deny, refused).timed(timeout));
        let future = self.inner.call(request.map(counted));
        Answered { future, denial: denied.map(|at| (Arc::clone(&self.bounds), at)), _held: ticket }
    }
}

pin_project_lite::pin_project! {
    /// A call's answer; a single-decision call refused unread (by its
    /// counted body, with OUT_OF_RANGE for its size or ABORTED for its
    /// caller's share: tonic answers the body's error as a trailers-only
    /// response, and no handler answers either) is answered with its
    /// method's denial instead.
    pub struct Answered<F> {
        #[pin]
        future: F,
        denial: Option<(Arc<MessageBounds>, usize)>,
        _held: Arc<Ticket>,
    }
}

impl<F, E> std::future::Future for Answered<F>
where
    F: std::future::Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = std::task::ready!(this.future.poll(cx))?;
        let refusal = match this.denial {
            None => None,
            Some(_) => match response.headers().get("grpc-status").map(|code| code.as_bytes()) {
                Some(b"11") => Some(Refusal::TooLarge),
                Some(b"10") => Some(Refusal::CallerBusy),
                _ => None,
            },
        };
        Poll::Ready(Ok(match (this.denial.take(), refusal) {
            (Some((bounds, at)), Some(refusal)) => answer((bounds.denials[at].1)(refusal)),
            _ => response,
        }))
    }
}

/// A gRPC answer of one message (`message`, encoded) and status OK.
fn answer(message: Bytes) -> Response {
    let mut framed = Vec::with_capacity(5 + message.len());
    framed.push(0);
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap_or(u32::MAX).to_be_bytes());
    framed.extend_from_slice(&message);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let mut response =
        http::Response::new(Body::new(Answer { data: Some(Bytes::from(framed)), trailers: Some(trailers) }));
    response
        .headers_mut()
        .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
    response
}

/// The body of [`answer`]: one data frame, then the trailers.
struct Answer {
    data: Option<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let frame = match this.data.take() {
            Some(data) => Some(Frame::data(data)),
            None => this.trailers.take().map(Frame::trailers),
        };
        Poll::Ready(frame.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }
}

/// A request body whose unfinished message is held against the budget.
pub(super) struct Counted {
    inner: Body,
    /// The request's hold on the budget.
    pub(super) ticket: Arc<Ticket>,
    /// The longest message this method takes.
    bound: usize,
    /// Bytes taken for the message not yet whole: its announced length.
    held: usize,
    /// The gRPC prefix (flag, 4-byte length) being read.
    prefix: [u8; 5],
    prefix_len: usize,
    /// Bytes of the current message still to come.
    left: usize,
    /// A single-decision call: an oversized message is refused with
    /// OUT_OF_RANGE, one over its caller's share (or reclaimed) with
    /// ABORTED, which [`Answered`] turns into the denial; others with
    /// RESOURCE_EXHAUSTED.
    deny: bool,
    /// Its header block found no room: the body fails at once.
    refused: Option<Refused>,
    /// How long a message may take once begun, and when the one begun and
    /// not yet whole must be (a timer only while one waits unfinished).
    timeout: Option<std::time::Duration>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Counted {
    pub(super) fn new(
        inner: Body,
        ticket: Arc<Ticket>,
        bound: usize,
        deny: bool,
        refused: Option<Refused>,
    ) -> Self {
        Counted {
            inner,
            ticket,
            bound,
            held: 0,
            prefix: [0; 5],
            prefix_len: 0,
            left: 0,
            deny,
            refused,
            timeout: None,
            deadline: None,
        }
    }

    /// The same, each message whole within `timeout` of its length prefix.
    fn timed(mut self, timeout: Option<std::time::Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// A message begun is not whole: fails when its time is up (polled
    /// only when the body waits with one unfinished).
    fn overdue(&mut self, cx: &mut Context<'_>) -> Option<Status> {
        if self.held == 0 {
            self.deadline = None;
            return None;
        }
        let timeout = self.timeout?;
        let deadline = self.deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        deadline.as_mut().poll(cx).is_ready().then(|| {
            let code = if self.deny { tonic::Code::Aborted } else { tonic::Code::ResourceExhausted };
            let message = format!(
                "a request message begun and not whole within {} ms (grpc.request_timeout_ms)",
                timeout.as_millis()
            );
            Status::new(code, message)
        })
    }

    /// The error of a request refused for its caller's share.
    fn over_budget(&self, refused: Refused) -> Status {
        let code = if self.deny { tonic::Code::Aborted } else { tonic::Code::ResourceExhausted };
        Status::new(code, refused.message())
    }

    /// Follows `chunk` through the gRPC framing: each message's announced
    /// length (what tonic reserves for it once it reads the prefix) is
    /// taken from the budget when its prefix is read, and given back when
    /// its last byte has passed.
    pub(super) fn count(&mut self, chunk: &[u8]) -> Result<(), Status> {
        let mut at = 0;
        while at < chunk.len() {
            if self.prefix_len < 5 {
                let take = (5 - self.prefix_len).min(chunk.len() - at);
                self.prefix[self.prefix_len..self.prefix_len + take].copy_from_slice(&chunk[at..at + take]);
                self.prefix_len += take;
                at += take;
                if self.prefix_len < 5 {
                    break;
                }
                let [_, a, b, c, d] = self.prefix;
                self.left = u32::from_be_bytes([a, b, c, d]) as usize;
                if self.left > self.bound {
                    self.ticket.oversized();
                    let message = format!(
                        "a request message of {} bytes; the limit is {} (grpc.max_message_bytes, \
                         grpc.max_batch_message_bytes for CheckBatch)",
                        self.left, self.bound
                    );
                    let code =
                        if self.deny { tonic::Code::OutOfRange } else { tonic::Code::ResourceExhausted };
                    return Err(Status::new(code, message));
                }
                self.ticket.take(self.left).map_err(|refused| self.over_budget(refused))?;
                self.held = self.left;
            } else {
                let take = self.left.min(chunk.len() - at);
                self.left -= take;
                at += take;
            }
            if self.left == 0 {
                self.ticket.give(self.held);
                self.held = 0;
                self.prefix_len = 0;
                // The next message has its own time.
                self.deadline = None;
            }
        }
        Ok(())
    }
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(refused) = this.refused {
            return Poll::Ready(Some(Err(this.over_budget(refused))));
        }
        // Cancelled (its bytes reclaimed): it fails. The waker is
        // registered only when the body is to wait (then looked again).
        if this.ticket.is_cancelled() {
            this.refused = Some(Refused::Reclaimed);
            return Poll::Ready(Some(Err(this.over_budget(Refused::Reclaimed))));
        }
        let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Pending if this.ticket.cancelled(cx.waker()) => {
                this.refused = Some(Refused::Reclaimed);
                return Poll::Ready(Some(Err(this.over_budget(Refused::Reclaimed))));
            }
            Poll::Pending => {
                return this.overdue(cx).map_or(Poll::Pending, |late| Poll::Ready(Some(Err(late))));
            }
            other => return other,
        };
        if let Some(data) = frame.data_ref() {
            this.count(data)?;
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.refused.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
