//! Tests of the request byte budget and each caller's shares.

use futures_util::future::BoxFuture;

use super::*;
use http_body::Frame;
use layer::Counted;
use tonic::{
    Status,
    body::Body,
    codegen::{Bytes, http},
};

type Response = http::Response<Body>;

fn message(len: usize) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&(len as u32).to_be_bytes());
    out.extend(std::iter::repeat_n(7, len));
    out
}

fn body(budget: &Arc<Budget>) -> Counted {
    Counted::new(Body::empty(), Ticket::new(Arc::clone(budget), None, None), 1_000, false, None)
}

fn body_of(budget: &Arc<Budget>, caller: &Caller) -> Counted {
    let ticket = Ticket::new(Arc::clone(budget), Some(Arc::clone(&caller.bytes)), None);
    Counted::new(Body::empty(), ticket, 1_000, false, None)
}

fn reclaimed(body: &Counted) -> bool {
    body.ticket.cancelled(futures_util::task::noop_waker_ref())
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
        let budget = Arc::new(Budget::unshared(1_000));
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
    let budget = Arc::new(Budget::unshared(1_000));
    let mut stream = body(&budget);
    stream.count(&bytes[..60]).unwrap();
    assert_eq!(budget.held(), 100);
    drop(stream);
    assert_eq!(budget.held(), 0, "an ended request gives its bytes back");
}

/// Past the budget a message fails its request; others go on.
#[test]
fn a_message_past_the_budget_fails_its_request() {
    let budget = Arc::new(Budget::unshared(1_500));
    let (mut a, mut b) = (body(&budget), body(&budget));
    a.count(&message(1_000)[..100]).unwrap();
    let error = b.count(&message(1_000)[..100]).unwrap_err();
    assert_eq!(error.code(), tonic::Code::ResourceExhausted);
    assert_eq!((budget.held(), budget.refused()), (1_000, 1));
    drop(a);
    let mut c = body(&budget);
    c.count(&message(10)).unwrap();
    assert_eq!(budget.held(), 0);
    // Over the method's bound: refused from its prefix, nothing held.
    let mut huge = body(&budget);
    let error = huge.count(&message(1_001)[..20]).unwrap_err();
    assert!(error.message().contains("grpc.max_message_bytes"), "{error:?}");
    assert_eq!((budget.held(), budget.oversized()), (0, 1));
}

/// Each connection and each untrusted peer holds at most its share;
/// untrusted peers together at most theirs; a trusted peer reaches
/// what they cannot; a refusal takes nothing from any share.
#[test]
fn a_caller_holds_at_most_its_share() {
    let shares = Shares { pool: 1_000, per_connection: 300, per_peer: 400, untrusted: 500 };
    let budget = Arc::new(Budget::new(shares));
    let attacker = PeerKey::of("192.0.2.7".parse().unwrap());
    let untrusted = |key| Peer { key, trusted: false, may_report: true };
    let caller = |peer| budget.caller(peer, Quotas::default()).expect("unbounded connections");
    let (a1, a2) = (caller(untrusted(attacker)), caller(untrusted(attacker)));
    let mut first = body_of(&budget, &a1);
    first.count(&message(300)[..10]).unwrap();
    let error = body_of(&budget, &a1).count(&message(1)[..5]).unwrap_err();
    assert_eq!(
        (error.code(), error.message()),
        (tonic::Code::ResourceExhausted, Refused::Connection.message())
    );
    let mut second = body_of(&budget, &a2);
    second.count(&message(100)[..10]).unwrap();
    let error = body_of(&budget, &a2).count(&message(1)[..5]).unwrap_err();
    assert_eq!(error.message(), Refused::Peer.message(), "two connections, one address");
    assert_eq!(budget.held(), 400, "refusals hold nothing");
    // Another address of the same IPv6 /64 is the same peer; another /64 is not.
    let v6 = |addr: &str| PeerKey::of(addr.parse().unwrap());
    assert_eq!(v6("2001:db8::1"), v6("2001:db8::ffff:1"));
    assert_ne!(v6("2001:db8::1"), v6("2001:db8:0:1::1"));
    assert_eq!(v6("::ffff:192.0.2.7"), attacker);
    let other = caller(untrusted(v6("2001:db8::1")));
    let mut third = body_of(&budget, &other);
    third.count(&message(100)[..10]).unwrap();
    // The untrusted part is full: the peer holding most (400, more than
    // this one's 100 and 1 more) has its requests cancelled, their bytes
    // given back at once, and this one passes.
    let mut fourth = body_of(&budget, &other);
    fourth.count(&message(1)[..5]).unwrap();
    assert!(reclaimed(&first) && reclaimed(&second) && !reclaimed(&third));
    assert_eq!(budget.held(), 101);
    // A peer holding no more than the newcomer would is not reclaimed from.
    let (late, late_too) =
        (caller(untrusted(v6("2001:db8:0:2::1"))), caller(untrusted(v6("2001:db8:0:2::2"))));
    let mut fifth = body_of(&budget, &late);
    fifth.count(&message(290)[..10]).unwrap();
    let error = body_of(&budget, &late_too).count(&message(110)[..10]).unwrap_err();
    assert_eq!(error.message(), Refused::Untrusted.message(), "untrusted peers together");
    let proxy = caller(Peer { key: PeerKey::Local, trusted: true, may_report: true });
    let mut trusted = body_of(&budget, &proxy);
    trusted.count(&message(300)[..10]).unwrap();
    let error = body_of(&budget, &proxy).count(&message(201)[..10]).unwrap_err();
    assert_eq!(error.message(), Refused::Connection.message());
    // Refused: connection, peer, untrusted, connection; 2 reclaimed.
    assert_eq!((budget.held(), budget.refused(), budget.peers()), (691, 6, 3));
    drop((first, second, third, fourth, fifth, trusted));
    assert_eq!(budget.held(), 0);
    drop((a1, a2, late, late_too));
    assert_eq!(budget.peers(), 1, "a peer's share goes with its last connection");
}

/// A cancelled request's bytes leave every share at once but count as
/// reclaiming until the request ends (its memory goes then): while they
/// and the largest peer's would pass half the pool, nothing more is
/// reclaimed and the newcomer is refused.
#[test]
fn requests_cancelled_and_not_ended_stop_reclaiming_at_half_the_pool() {
    let shares = Shares { pool: 1_000, per_connection: 300, per_peer: 300, untrusted: 500 };
    let budget = Arc::new(Budget::new(shares));
    let peer = |n: u8| {
        let key = PeerKey::of(std::net::IpAddr::from([192, 0, 2, n]));
        budget.caller(Peer { key, trusted: false, may_report: true }, Quotas::default()).unwrap()
    };
    let (a, b, c, d, e) = (peer(1), peer(2), peer(3), peer(4), peer(5));
    let mut held_by_a = body_of(&budget, &a);
    held_by_a.count(&message(300)[..10]).unwrap();
    let mut held_by_b = body_of(&budget, &b);
    held_by_b.count(&message(200)[..10]).unwrap();
    let mut held_by_c = body_of(&budget, &c);
    held_by_c.count(&message(10)[..10]).unwrap();
    assert!(reclaimed(&held_by_a), "a held most");
    assert_eq!((budget.held(), budget.reclaiming()), (210, 300));
    let mut held_by_d = body_of(&budget, &d);
    held_by_d.count(&message(290)[..10]).unwrap();
    // 300 not ended and d's 290 would pass 500: d keeps its bytes.
    let error = body_of(&budget, &e).count(&message(10)[..10]).unwrap_err();
    assert_eq!(error.message(), Refused::Untrusted.message());
    assert!(!reclaimed(&held_by_d));
    drop(held_by_a);
    assert_eq!(budget.reclaiming(), 0, "an ended request's memory is gone");
    let mut held_by_e = body_of(&budget, &e);
    held_by_e.count(&message(10)[..10]).unwrap();
    assert!(reclaimed(&held_by_d) && !reclaimed(&held_by_b));
    assert_eq!((budget.held(), budget.reclaiming()), (220, 290));
    drop((held_by_b, held_by_c, held_by_d, held_by_e));
    assert_eq!((budget.held(), budget.reclaiming()), (0, 0));
}

/// An untrusted peer opens at most its connections and holds at most
/// its store calls, all its connections together; a trusted peer has
/// neither bound; a closed connection frees its place.
#[test]
fn a_peer_holds_at_most_its_connections_and_store_calls() {
    let budget = Budget::unshared(1_000);
    let quotas = Quotas { store_calls_per_connection: 2, store_calls_per_peer: 3, connections_per_peer: 2 };
    let peer = Peer { key: PeerKey::of("192.0.2.7".parse().unwrap()), trusted: false, may_report: true };
    let (a1, a2) = (budget.caller(peer, quotas).unwrap(), budget.caller(peer, quotas).unwrap());
    assert!(budget.caller(peer, quotas).is_none(), "a third connection of the peer");
    assert_eq!(budget.refused_connections(), 1);
    let other = Peer { key: PeerKey::of("192.0.2.8".parse().unwrap()), ..peer };
    assert!(budget.caller(other, quotas).is_some(), "another address has its own");
    let trusted = Peer { trusted: true, ..peer };
    let proxies: Vec<_> = (0..5).map(|_| budget.caller(trusted, quotas).unwrap()).collect();
    assert!(proxies.iter().all(|proxy| proxy.store_calls.peer.is_none()));

    let calls = |caller: &Caller| {
        let calls = &caller.store_calls;
        (calls.connection.available_permits(), calls.peer.as_ref().unwrap().available_permits())
    };
    let first = (a1.store_calls.connection.try_acquire_many(2).unwrap(), {
        a1.store_calls.peer.as_ref().unwrap().try_acquire_many(2).unwrap()
    });
    assert_eq!(calls(&a2), (2, 1), "the peer's calls are shared by its connections");
    drop(first);
    assert_eq!(calls(&a2), (2, 3));
    drop(a1);
    let a3 = budget.caller(peer, quotas).expect("a closed connection's place");
    assert!(Arc::ptr_eq(a3.store_calls.peer.as_ref().unwrap(), a2.store_calls.peer.as_ref().unwrap()));
}

fn request(path: &str, bytes: Vec<u8>, cut: usize) -> http::Request<Body> {
    let (first, second) = bytes.split_at(cut);
    let frames = [Bytes::copy_from_slice(first), Bytes::copy_from_slice(second)]
        .map(|data| Ok::<_, Status>(Frame::data(data)));
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut request = http::Request::new(Body::new(body));
    *request.uri_mut() = path.parse().unwrap();
    request
}

/// Answers with the bytes of the request body it read.
fn echo() -> impl tower::Service<
    http::Request<Body>,
    Response = Response,
    Error = std::convert::Infallible,
    Future = BoxFuture<'static, Result<Response, std::convert::Infallible>>,
> + Clone {
    tower::service_fn(|request: http::Request<Body>| -> BoxFuture<'static, _> {
        Box::pin(async move {
            // As tonic does: a body's error is the call's status.
            Ok(match http_body_util::BodyExt::collect(request.into_body()).await {
                Ok(bytes) => http::Response::new(Body::new(http_body_util::Full::new(bytes.to_bytes()))),
                Err(status) => status.into_http(),
            })
        })
    })
}

async fn call(layer: &BudgetLayer, request: http::Request<Body>) -> (Option<String>, Bytes) {
    use tower::{Layer, ServiceExt};
    let response = layer.layer(echo()).oneshot(request).await.unwrap();
    let content_type = response.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned());
    let collected = http_body_util::BodyExt::collect(response.into_body()).await.unwrap();
    let trailers = collected.trailers().map(|t| t.get("grpc-status").unwrap().to_str().unwrap().to_owned());
    assert!(content_type.is_none() || trailers.as_deref() == Some("0"), "a denial ends with grpc-status 0");
    (content_type, collected.to_bytes())
}

/// A single-decision call over its bound is answered with its denial,
/// its message never read; within it, the call sees every byte however
/// the prefix was cut; a batch has its own bound.
#[tokio::test]
async fn an_oversized_single_decision_is_denied_and_others_pass_whole() {
    let budget = Arc::new(Budget::unshared(10_000));
    let layer = BudgetLayer::new(
        Arc::clone(&budget),
        MessageBounds {
            message: 100,
            batch: 1_000,
            batch_path: "/s/Batch",
            message_timeout: None,
            denials: vec![(
                "/s/Check",
                Arc::new(|refusal| match refusal {
                    Refusal::TooLarge => Bytes::from_static(b"no"),
                    Refusal::CallerBusy => Bytes::from_static(b"busy"),
                }),
            )],
        },
    );
    for cut in [0, 2, 5, 50] {
        let (grpc, body) = call(&layer, request("/s/Check", message(100), cut)).await;
        assert_eq!((grpc, body.len()), (None, 105), "cut at {cut}: handed on whole");
        let (grpc, body) = call(&layer, request("/s/Check", message(101), cut)).await;
        assert_eq!(grpc.as_deref(), Some("application/grpc"), "cut at {cut}");
        assert_eq!(&body[..], b"\0\0\0\0\x02no", "cut at {cut}: the denial, framed");
    }
    let (grpc, body) = call(&layer, request("/s/Batch", message(1_000), 3)).await;
    assert_eq!((grpc, body.len()), (None, 1_005));
    assert_eq!((budget.held(), budget.oversized()), (0, 4));
    // Within its bound but past its caller's share: the other denial.
    let small = BudgetLayer::new(Arc::new(Budget::unshared(50)), (*layer.bounds).clone());
    let (grpc, body) = call(&small, request("/s/Check", message(60), 7)).await;
    assert_eq!(grpc.as_deref(), Some("application/grpc"));
    assert_eq!(&body[..], b"\0\0\0\0\x04busy");
}
