//! `buffer_unordered` that polls each future once as it arrives: one that
//! is ready at once (every in-memory decision) is answered without joining
//! the set of futures in flight, so it costs one small allocation instead
//! of a task in the set (an `Arc`, its links, the ready queue's atomics)
//! and two copies of the future. One that is not ready joins the set and
//! completes there, as with `buffer_unordered`.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use futures_util::{
    Stream, StreamExt as _,
    stream::{FusedStream, FuturesUnordered},
};

/// The futures of `items`, at most `limit` in flight, their outputs in the
/// order they complete.
pub(crate) fn eager_unordered<St>(items: St, limit: usize) -> EagerUnordered<St>
where
    St: Stream + Unpin,
    St::Item: Future,
{
    EagerUnordered { items: Some(items), in_flight: FuturesUnordered::new(), limit: limit.max(1) }
}

/// See [`eager_unordered`].
#[must_use = "streams do nothing unless polled"]
pub(crate) struct EagerUnordered<St: Stream>
where
    St::Item: Future,
{
    /// `None` once the input has ended.
    items: Option<St>,
    in_flight: FuturesUnordered<Pin<Box<St::Item>>>,
    limit: usize,
}

impl<St: Stream> std::fmt::Debug for EagerUnordered<St>
where
    St::Item: Future,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EagerUnordered")
            .field("ended", &self.items.is_none())
            .field("in_flight", &self.in_flight.len())
            .field("limit", &self.limit)
            .finish()
    }
}

impl<St> Stream for EagerUnordered<St>
where
    St: Stream + Unpin,
    St::Item: Future,
{
    type Item = <St::Item as Future>::Output;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        // Answers already made first, so a stream of ready items cannot
        // starve the ones in flight.
        if let Poll::Ready(Some(output)) = this.in_flight.poll_next_unpin(cx) {
            return Poll::Ready(Some(output));
        }
        // Then new items, each polled once as it arrives. One that is not
        // ready joins the set, which polls it again with its own waker.
        while this.in_flight.len() < this.limit {
            let Some(items) = this.items.as_mut() else { break };
            match items.poll_next_unpin(cx) {
                Poll::Ready(Some(future)) => {
                    let mut future = Box::pin(future);
                    match future.as_mut().poll(cx) {
                        Poll::Ready(output) => return Poll::Ready(Some(output)),
                        Poll::Pending => this.in_flight.push(future),
                    }
                }
                Poll::Ready(None) => this.items = None,
                Poll::Pending => break,
            }
        }
        match this.in_flight.poll_next_unpin(cx) {
            Poll::Ready(Some(output)) => Poll::Ready(Some(output)),
            // The set is empty: done once the input is.
            Poll::Ready(None) if this.items.is_none() => Poll::Ready(None),
            Poll::Ready(None) | Poll::Pending => Poll::Pending,
        }
    }
}

impl<St> FusedStream for EagerUnordered<St>
where
    St: Stream + Unpin,
    St::Item: Future,
{
    fn is_terminated(&self) -> bool {
        self.items.is_none() && self.in_flight.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::{
        future::ready,
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
        time::Duration,
    };

    use futures_util::{FutureExt as _, future::Either, stream};
    use tokio::sync::oneshot;

    use super::*;

    #[tokio::test]
    async fn ready_items_come_out_in_order_and_the_stream_ends() {
        let out: Vec<u32> = eager_unordered(stream::iter((0..100).map(ready)), 4).collect().await;
        assert_eq!(out, (0..100).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn pending_items_complete_out_of_order_beside_ready_ones() {
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..3).map(|_| oneshot::channel::<u32>()).unzip();
        let mut receivers = receivers.into_iter();
        // Items 0, 2, 4 wait on a channel; 1, 3, 5 are ready at once.
        let items = stream::iter((0..6u32).map(move |i| {
            if i % 2 == 0 {
                Either::Left(receivers.next().unwrap().map(|r| r.unwrap()))
            } else {
                Either::Right(ready(i))
            }
        }));
        let mut results = eager_unordered(items, 8);
        for i in [1, 3, 5] {
            assert_eq!(results.next().await, Some(i), "ready items are not held back by pending ones");
        }
        let mut senders = senders.into_iter().rev();
        for i in [40, 20, 0] {
            senders.next().unwrap().send(i).unwrap();
            assert_eq!(results.next().await, Some(i));
        }
        assert_eq!(results.next().await, None);
        assert!(results.is_terminated());
    }

    #[tokio::test]
    async fn no_more_than_the_limit_is_in_flight() {
        let in_flight = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let items = stream::iter(0..50).map({
            let (in_flight, most) = (Arc::clone(&in_flight), Arc::clone(&most));
            move |i| {
                let (in_flight, most) = (Arc::clone(&in_flight), Arc::clone(&most));
                async move {
                    let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    i
                }
            }
        });
        let mut out: Vec<i32> = eager_unordered(items, 5).collect().await;
        out.sort_unstable();
        assert_eq!(out, (0..50).collect::<Vec<_>>());
        assert_eq!(most.load(Ordering::SeqCst), 5, "the limit is reached and never passed");
    }
}
