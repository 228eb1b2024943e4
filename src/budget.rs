//! `grpc.max_request_bytes_in_flight`: the bytes of gRPC request messages
//! announced but not yet whole, over every connection and stream together.
//! A message is buffered until its last byte arrives, so a client opening
//! streams that announce large messages and never finish them made the
//! service hold `connections × streams × grpc.max_message_bytes` (3
//! connections × 1,000 streams took over 3 GB). Each request body is followed
//! as it arrives, frame by frame, through the gRPC length prefixes: when a
//! message's prefix has been read, its announced length (what tonic
//! reserves for it) is taken from the budget, and it is given back when
//! the message is whole (then tonic decodes and frees it) or the request
//! ends. A message that would pass the budget fails its request with
//! RESOURCE_EXHAUSTED (counted), never the whole process.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
};

use http_body::{Frame, SizeHint};
use tonic::{
    Status,
    body::Body,
    codegen::{Bytes, http},
};

/// The process-wide budget.
#[derive(Debug)]
pub struct Budget {
    held: AtomicUsize,
    limit: usize,
    /// A longer message is refused by tonic as soon as its prefix is read
    /// (`grpc.max_message_bytes`, named in its error): nothing to hold.
    max_message: usize,
    refused: AtomicU64,
}

impl Budget {
    /// At most `limit` bytes of unfinished messages at once, each at most
    /// `max_message` long.
    pub fn new(limit: usize, max_message: usize) -> Self {
        Budget { held: AtomicUsize::new(0), limit, max_message, refused: AtomicU64::new(0) }
    }

    /// Bytes of unfinished messages now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Requests failed for the budget since start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    fn take(&self, bytes: usize) -> bool {
        let before = self.held.fetch_add(bytes, Ordering::Relaxed);
        if before + bytes <= self.limit {
            return true;
        }
        self.held.fetch_sub(bytes, Ordering::Relaxed);
        self.refused.fetch_add(1, Ordering::Relaxed);
        false
    }

    fn give(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// Counts every request's body against the budget (a tower layer).
#[derive(Debug, Clone)]
pub struct BudgetLayer(pub Arc<Budget>);

impl<S> tower::Layer<S> for BudgetLayer {
    type Service = Budgeted<S>;

    fn layer(&self, inner: S) -> Budgeted<S> {
        Budgeted { inner, budget: Arc::clone(&self.0) }
    }
}

/// A service whose requests' bodies are counted against the budget.
#[derive(Debug, Clone)]
pub struct Budgeted<S> {
    inner: S,
    budget: Arc<Budget>,
}

impl<S: tower::Service<http::Request<Body>>> tower::Service<http::Request<Body>> for Budgeted<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let budget = Arc::clone(&self.budget);
        self.inner.call(request.map(|body| Body::new(Counted::new(body, budget))))
    }
}

/// A request body whose unfinished message is held against the budget.
struct Counted {
    inner: Body,
    budget: Arc<Budget>,
    /// Bytes taken for the message not yet whole: its announced length.
    held: usize,
    /// The gRPC prefix (flag, 4-byte length) being read.
    prefix: [u8; 5],
    prefix_len: usize,
    /// Bytes of the current message still to come.
    left: usize,
}

impl Counted {
    fn new(inner: Body, budget: Arc<Budget>) -> Self {
        Counted { inner, budget, held: 0, prefix: [0; 5], prefix_len: 0, left: 0 }
    }

    /// Follows `chunk` through the gRPC framing: each message's announced
    /// length (what tonic reserves for it once it reads the prefix) is
    /// taken from the budget when its prefix is read, and given back when
    /// its last byte has passed.
    fn count(&mut self, chunk: &[u8]) -> Result<(), Status> {
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
                let announced = if self.left > self.budget.max_message { 0 } else { self.left };
                if !self.budget.take(announced) {
                    return Err(Status::resource_exhausted(
                        "the service holds grpc.max_request_bytes_in_flight of unfinished requests",
                    ));
                }
                self.held = announced;
            } else {
                let take = self.left.min(chunk.len() - at);
                self.left -= take;
                at += take;
            }
            if self.left == 0 {
                self.budget.give(self.held);
                self.held = 0;
                self.prefix_len = 0;
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
        let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            other => return other,
        };
        if let Some(data) = frame.data_ref() {
            this.count(data)?;
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.budget.give(self.held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(len: usize) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(len as u32).to_be_bytes());
        out.extend(std::iter::repeat_n(7, len));
        out
    }

    fn body(budget: &Arc<Budget>) -> Counted {
        Counted::new(Body::empty(), Arc::clone(budget))
    }

    /// A message's announced length is held from its prefix until it is
    /// whole, however it is cut into frames; the end of the request gives
    /// everything back.
    #[test]
    fn unfinished_messages_are_held_until_whole() {
        let mut bytes = message(100);
        bytes.extend(message(0));
        bytes.extend(message(50));
        for cut in [3, 40, 65, 105, 112, 130] {
            let budget = Arc::new(Budget::new(1_000, 1_000));
            let mut b = body(&budget);
            b.count(&bytes[..cut]).unwrap();
            // 0..105 the first message (held once its prefix is read), 105..110
            // the empty second, 110..165 the third (announcing 50).
            let expected = match cut {
                5..105 => 100,
                115.. => 50,
                _ => 0,
            };
            assert_eq!(budget.held(), expected, "cut at {cut}: what has been announced and not finished");
            b.count(&bytes[cut..140]).unwrap();
            assert_eq!(budget.held(), 50, "cut at {cut}: the third message announced");
            b.count(&bytes[140..]).unwrap();
            assert_eq!(budget.held(), 0, "cut at {cut}");
        }
        let budget = Arc::new(Budget::new(1_000, 1_000));
        let mut stream = body(&budget);
        stream.count(&bytes[..60]).unwrap();
        assert_eq!(budget.held(), 100);
        drop(stream);
        assert_eq!(budget.held(), 0, "an ended request gives its bytes back");
    }

    /// Past the budget a message fails its request; others go on.
    #[test]
    fn a_message_past_the_budget_fails_its_request() {
        let budget = Arc::new(Budget::new(1_500, 1_000));
        let (mut a, mut b) = (body(&budget), body(&budget));
        a.count(&message(1_000)[..100]).unwrap();
        let error = b.count(&message(1_000)[..100]).unwrap_err();
        assert_eq!(error.code(), tonic::Code::ResourceExhausted);
        assert_eq!((budget.held(), budget.refused()), (1_000, 1));
        drop(a);
        let mut c = body(&budget);
        c.count(&message(10)).unwrap();
        assert_eq!(budget.held(), 0);
        // Over grpc.max_message_bytes: tonic refuses it, naming that bound.
        let mut huge = body(&budget);
        huge.count(&message(1_001)[..20]).unwrap();
        assert_eq!(budget.held(), 0);
    }
}
