//! TLS and mTLS on the gRPC port, with certificates made by the `openssl`
//! command line: a client with a certificate the configured CA signed is
//! served; one without a certificate, with one from another CA, or speaking
//! plain text is refused; a rotated server certificate is picked up by new
//! connections without a restart.

mod common;

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use common::{Rules, TestServer, config, eventually, make_ca, make_leaf, request};
use ratelimitd::api::pb::rate_limiter_client::RateLimiterClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

const RULES: &str = "rules:\n  - { rule_id: r, resource_path: /r, limit: 1000, window_seconds: 60 }\n";

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).unwrap()
}

/// A fresh connection to the server trusting `ca`, presenting `identity`
/// (a `<name>.pem`/`<name>.key` pair) if given.
async fn connect(
    addr: std::net::SocketAddr,
    dir: &Path,
    ca: &str,
    identity: Option<&str>,
) -> Result<RateLimiterClient<Channel>, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(dir, &format!("{ca}.pem"))))
        .domain_name("localhost");
    if let Some(name) = identity {
        tls = tls.identity(Identity::from_pem(
            read(dir, &format!("{name}.pem")),
            read(dir, &format!("{name}.key")),
        ));
    }
    let endpoint = Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(tls)?;
    endpoint.connect_timeout(Duration::from_secs(5)).connect().await.map(RateLimiterClient::new)
}

/// Whether a Check over a new connection is answered.
async fn served(addr: std::net::SocketAddr, dir: &Path, ca: &str, identity: Option<&str>) -> bool {
    match connect(addr, dir, ca, identity).await {
        Ok(mut client) => client.check(request("t", "/r")).await.is_ok(),
        Err(_) => false,
    }
}

/// Writes `name`'s pair over the server's files, each by rename.
fn install_server_cert(dir: &Path, name: &str, cert: &Path, key: &Path) {
    for (from, to) in [(format!("{name}.key"), key), (format!("{name}.pem"), cert)] {
        let tmp = to.with_extension("tmp");
        std::fs::copy(dir.join(from), &tmp).unwrap();
        std::fs::rename(&tmp, to).unwrap();
    }
}

fn server_files(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("live-server.pem"), dir.join("live-server.key"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_refuses_clients_without_a_valid_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    make_ca(d, "ca");
    make_ca(d, "rogue-ca");
    make_leaf(d, "ca", "server", "serverAuth");
    make_leaf(d, "ca", "client", "clientAuth");
    make_leaf(d, "rogue-ca", "rogue", "clientAuth");
    let (cert, key) = server_files(d);
    install_server_cert(d, "server", &cert, &key);

    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), None);
    cfg.grpc.tls.cert_file = Some(cert);
    cfg.grpc.tls.key_file = Some(key);
    cfg.grpc.tls.client_ca_file = Some(d.join("ca.pem"));
    let server = TestServer::start(cfg).await;

    let mut client = connect(server.addr, d, "ca", Some("client")).await.expect("a valid client connects");
    let r = client.check(request("alice", "/r")).await.expect("served over mTLS").into_inner();
    assert!(r.allowed && r.rule_id == "r", "{r:?}");

    assert!(!served(server.addr, d, "ca", None).await, "no client certificate: refused");
    assert!(!served(server.addr, d, "ca", Some("rogue")).await, "a certificate from another CA: refused");
    let mut plain = RateLimiterClient::connect(format!("http://{}", server.addr)).await;
    let plain_answered = match &mut plain {
        Ok(client) => client.check(request("t", "/r")).await.is_ok(),
        Err(_) => false,
    };
    assert!(!plain_answered, "plain text: refused");
    // The refusals did not disturb the valid client's connection.
    assert!(client.check(request("alice", "/r")).await.is_ok());
    server.stop().await.unwrap();
}

/// A CA, a server certificate installed where the server reads it, and two
/// client certificates of the CA, `gateway` (gateway.internal) and `other`
/// (other.internal), in `d`; a server config with mTLS on them.
fn mtls_config(d: &Path, rules: &Rules) -> ratelimitd::config::Config {
    make_ca(d, "ca");
    make_leaf(d, "ca", "server", "serverAuth");
    common::make_leaf_for(d, "ca", "gateway", "clientAuth", "DNS:gateway.internal");
    common::make_leaf_for(d, "ca", "other", "clientAuth", "DNS:other.internal");
    let (cert, key) = server_files(d);
    install_server_cert(d, "server", &cert, &key);
    let mut cfg = config(&rules.path(), None);
    cfg.grpc.tls.cert_file = Some(cert);
    cfg.grpc.tls.key_file = Some(key);
    cfg.grpc.tls.client_ca_file = Some(d.join("ca.pem"));
    cfg
}

/// `grpc.tls.client_san` (upstream's `GRPC_CLIENT_TLS_SAN`): a client
/// certificate the CA signed is accepted only when it carries the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_with_a_client_san_accepts_only_that_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rules = Rules::new(RULES);
    let mut cfg = mtls_config(d, &rules);
    cfg.grpc.tls.client_san = Some("gateway.internal".to_owned());
    let server = TestServer::start(cfg).await;
    assert!(served(server.addr, d, "ca", Some("gateway")).await, "the named client is served");
    assert!(!served(server.addr, d, "ca", Some("other")).await, "the same CA, another name: refused");
    server.stop().await.unwrap();
}

/// `grpc.tls.trusted_client_names` and `grpc.tls.reporting_client_names`:
/// a client whose certificate carries the name is a trusted peer (no peer
/// share of the request byte budget: no untrusted peer counted) and may
/// report outcomes; a client of the same CA with another name is neither
/// (one untrusted peer; its outcome report answered and counted as not
/// allowed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_names_say_who_is_trusted_and_who_may_report() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rules = Rules::new(RULES);
    let mut cfg = mtls_config(d, &rules);
    cfg.grpc.tls.trusted_client_names = vec!["gateway.internal".to_owned()];
    cfg.grpc.tls.reporting_client_names = vec!["gateway.internal".to_owned()];
    let server = TestServer::start(cfg).await;
    let peers = || common::metric(&server, "ratelimitd_grpc_request_peers ");
    let not_allowed = || {
        common::metric(
            &server,
            "ratelimitd_request_values_adjusted_total{api=\"check\",reason=\"outcome_not_allowed\"}",
        )
    };
    let report = ratelimitd::api::pb::RateLimitRequest {
        outcome: ratelimitd::api::pb::Outcome::Failure as i32,
        ..request("u", "/r")
    };
    let mut gateway = connect(server.addr, d, "ca", Some("gateway")).await.unwrap();
    gateway.report(report.clone()).await.unwrap();
    assert_eq!(peers().await, Some(0.0), "the named client is trusted");
    assert_eq!(not_allowed().await.unwrap_or(0.0), 0.0, "the named client may report");
    let mut other = connect(server.addr, d, "ca", Some("other")).await.unwrap();
    other.report(report).await.unwrap();
    assert_eq!(peers().await, Some(1.0), "another name is an untrusted peer");
    assert_eq!(not_allowed().await, Some(1.0), "another name's report counts nowhere");
    drop((gateway, other));
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_certificate_is_used_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    make_ca(d, "old-ca");
    make_ca(d, "new-ca");
    make_leaf(d, "old-ca", "old-server", "serverAuth");
    make_leaf(d, "new-ca", "new-server", "serverAuth");
    let (cert, key) = server_files(d);
    install_server_cert(d, "old-server", &cert, &key);

    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), None);
    cfg.grpc.tls.cert_file = Some(cert.clone());
    cfg.grpc.tls.key_file = Some(key.clone());
    cfg.grpc.tls.reload_interval_ms = 20;
    let server = TestServer::start(cfg).await;
    let addr = server.addr;

    let mut established = connect(addr, d, "old-ca", None).await.expect("TLS without client auth");
    assert!(established.check(request("bo", "/r")).await.is_ok());
    assert!(!served(addr, d, "new-ca", None).await, "not rotated yet");

    // A half-written rotation (garbage certificate) keeps the old one serving.
    std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n").unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(served(addr, d, "old-ca", None).await, "a broken rotation must not take TLS down");

    install_server_cert(d, "new-server", &cert, &key);
    assert!(
        eventually(Duration::from_secs(10), || served(addr, d, "new-ca", None)).await,
        "new connections never saw the rotated certificate"
    );
    assert!(!served(addr, d, "old-ca", None).await, "the old certificate is no longer offered");
    // The connection made before the rotation keeps working.
    assert!(established.check(request("bo", "/r")).await.is_ok());
    server.stop().await.unwrap();
}

/// With `grpc.tls.max_handshakes` stalled handshakes in progress (clients
/// that connect and never speak), a real client waits; once the stalled
/// ones go away it is served: handshakes are capped, not queued in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshakes_are_capped_and_release_their_place() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    make_ca(d, "ca");
    make_leaf(d, "ca", "server", "serverAuth");
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), None);
    cfg.grpc.tls.cert_file = Some(d.join("server.pem"));
    cfg.grpc.tls.key_file = Some(d.join("server.key"));
    cfg.grpc.tls.max_handshakes = 2;
    let server = TestServer::start(cfg).await;
    let addr = server.addr;
    let stalled: Vec<std::net::TcpStream> =
        (0..2).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
    let waiting = tokio::spawn({
        let d = d.to_path_buf();
        async move { served(addr, &d, "ca", None).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "a third handshake ran beside two stalled ones");
    drop(stalled);
    assert!(waiting.await.unwrap(), "served once the stalled handshakes ended");
    server.stop().await.unwrap();
}

#[test]
fn unusable_tls_files_stop_startup_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), None);
    cfg.grpc.tls.cert_file = Some(dir.path().join("missing.pem"));
    cfg.grpc.tls.key_file = Some(dir.path().join("missing.key"));
    let err = ratelimitd::tls::ReloadingAcceptor::new(&cfg.grpc.tls).unwrap_err().to_string();
    assert!(err.starts_with("grpc.tls.cert_file") && err.contains("missing.pem"), "{err}");

    make_ca(dir.path(), "ca");
    make_leaf(dir.path(), "ca", "server", "serverAuth");
    std::fs::write(
        dir.path().join("bad.key"),
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    cfg.grpc.tls.cert_file = Some(dir.path().join("server.pem"));
    cfg.grpc.tls.key_file = Some(dir.path().join("bad.key"));
    let err = ratelimitd::tls::ReloadingAcceptor::new(&cfg.grpc.tls).unwrap_err().to_string();
    assert!(err.starts_with("grpc.tls.key_file"), "{err}");
    assert!(!err.contains("AAAA"), "key material in an error: {err}");
}
