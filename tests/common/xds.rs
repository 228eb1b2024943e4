//! A small aggregated discovery server (state of the world), as Envoy
//! Gateway's control plane serves envoyproxy/ratelimit its
//! `RateLimitConfig`s, over plain gRPC or mutual TLS.

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use ratelimitd::api::{
    envoy_pb::discovery::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
        aggregated_discovery_service_server::{AggregatedDiscoveryService, AggregatedDiscoveryServiceServer},
    },
    xds::TYPE_URL,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::{Stream, StreamExt as _, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};

use super::free_port;

pub type Set = Option<(String, Vec<prost_types::Any>)>;

/// Serves the current set to every subscriber, again whenever it changes,
/// and keeps every request it receives.
#[derive(Clone)]
struct Ads {
    current: watch::Receiver<Set>,
    seen: Arc<Mutex<Vec<DiscoveryRequest>>>,
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Responses;
    type DeltaAggregatedResourcesStream =
        Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Responses>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let mut current = self.current.clone();
        let seen = Arc::clone(&self.seen);
        tokio::spawn(async move {
            let mut nonce = 0u64;
            let mut send = |set: &Set| {
                set.as_ref().map(|(version, resources)| {
                    nonce += 1;
                    DiscoveryResponse {
                        version_info: version.clone(),
                        resources: resources.clone(),
                        type_url: TYPE_URL.to_owned(),
                        nonce: nonce.to_string(),
                        ..Default::default()
                    }
                })
            };
            let mut subscribed = false;
            loop {
                let response = tokio::select! {
                    message = inbound.next() => match message {
                        Some(Ok(request)) => {
                            seen.lock().unwrap().push(request);
                            if subscribed { continue }
                            subscribed = true;
                            send(&current.borrow_and_update())
                        }
                        _ => return,
                    },
                    changed = current.changed() => {
                        if changed.is_err() { return }
                        send(&current.borrow_and_update())
                    }
                };
                if let Some(response) = response
                    && tx.send(Ok(response)).await.is_err()
                {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn delta_aggregated_resources(
        &self,
        _: Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented("state of the world only"))
    }
}

/// A management server on a free port; the sender sets what it serves.
pub async fn management_server(
    initial: Set,
) -> (watch::Sender<Set>, Arc<Mutex<Vec<DiscoveryRequest>>>, String) {
    management_server_with(initial, None).await
}

/// The same, over TLS with `server.pem`/`server.key` from `tls` and client
/// certificates signed by its `ca.pem` required (mTLS).
pub async fn management_server_with(
    initial: Set,
    tls: Option<&std::path::Path>,
) -> (watch::Sender<Set>, Arc<Mutex<Vec<DiscoveryRequest>>>, String) {
    let (set, current) = watch::channel(initial);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let ads = Ads { current, seen: Arc::clone(&seen) };
    let port = free_port();
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut builder = tonic::transport::Server::builder();
    if let Some(dir) = tls {
        let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
        let config = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(read("server.pem"), read("server.key")))
            .client_ca_root(tonic::transport::Certificate::from_pem(read("ca.pem")));
        builder = builder.tls_config(config).unwrap();
    }
    tokio::spawn(builder.add_service(AggregatedDiscoveryServiceServer::new(ads)).serve(addr));
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(Instant::now() < deadline, "the management server did not listen");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    (set, seen, format!("{scheme}://localhost:{port}"))
}
