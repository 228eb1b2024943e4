//! TLS and mTLS on the gRPC port (rustls, ring provider), with certificates
//! reloaded when their files change.
//!
//! The accept loop takes TCP connections, runs each handshake in its own
//! task (bounded by `grpc.tls.handshake_timeout_ms`, so a client that never
//! finishes its handshake holds no one up) with the acceptor current at that
//! moment, and hands finished TLS streams to tonic. At most
//! `grpc.tls.max_handshakes` run at once: past that the loop stops
//! accepting (connections wait in the kernel's backlog) until one ends, so
//! a flood of slow handshakes cannot grow memory without bound. The
//! handshake tasks belong to the loop and end with it. A watcher polls the
//! files' metadata every `grpc.tls.reload_interval_ms`; when any changed it
//! builds a new acceptor and swaps it in: new connections use the new
//! certificate, established ones keep theirs. A file that does not parse
//! (a rotation half written) leaves the old acceptor serving and is tried
//! again at the next change. Private keys never appear in logs or errors.

use std::{
    io,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use arc_swap::ArcSwap;
use serde::Deserialize;
use tokio::{
    net::{TcpListener, TcpStream},
    sync::{Semaphore, mpsc, watch},
    task::JoinSet,
};
use tokio_rustls::{
    TlsAcceptor,
    rustls::{
        self, CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
        SignatureScheme,
        client::danger::HandshakeSignatureValid,
        pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject},
        server::{
            WebPkiClientVerifier,
            danger::{ClientCertVerified, ClientCertVerifier},
        },
    },
    server::TlsStream,
};

use crate::accept::AcceptBackoff;

/// `grpc.tls.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcTlsConfig {
    /// PEM certificate chain the gRPC port presents; with `key_file` it turns TLS on for the port
    /// (rustls; ALPN h2; TLS 1.2 and 1.3), reloaded when the file changes.
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file` (PKCS#8, PKCS#1 or SEC1); both are needed, one alone is
    /// refused.
    pub key_file: Option<PathBuf>,
    /// PEM CA certificate(s): every client must present a certificate one of them signed (mTLS);
    /// others fail the handshake.
    pub client_ca_file: Option<PathBuf>,
    /// With `client_ca_file`: a name (DNS name or IP address) every client
    /// certificate must carry among its subject alternative names, beyond
    /// being signed by that CA (upstream's `GRPC_CLIENT_TLS_SAN`).
    pub client_san: Option<String>,
    /// With `client_ca_file`: a client whose certificate carries one of these names (DNS names or
    /// IP addresses, among its subject alternative names) is a trusted peer, as an address in
    /// `grpc.trusted_peers` is (the Envoys in front, wherever they run).
    pub trusted_client_names: Vec<String>,
    /// With `client_ca_file`: a client whose certificate carries one of these names may report
    /// outcomes, as an address in `grpc.reporting_peers` may.
    pub reporting_client_names: Vec<String>,
    /// How often the three files are checked (size, mtime); a change is loaded for new connections
    /// without a restart; a file that does not load leaves the previous certificate in use
    /// (logged); `0` disables.
    pub reload_interval_ms: u64,
    /// A connection whose TLS handshake takes longer is closed.
    pub handshake_timeout_ms: u64,
    /// TLS handshakes in progress at once; past it new connections wait in the listen backlog (a
    /// flood of slow handshakes cannot grow memory).
    pub max_handshakes: usize,
}

impl Default for GrpcTlsConfig {
    fn default() -> Self {
        Self {
            cert_file: None,
            key_file: None,
            client_ca_file: None,
            client_san: None,
            trusted_client_names: Vec::new(),
            reporting_client_names: Vec::new(),
            reload_interval_ms: 10_000,
            handshake_timeout_ms: 10_000,
            max_handshakes: 1_024,
        }
    }
}

/// A TLS setting that cannot be used; names the key and the file.
#[derive(Debug, thiserror::Error)]
#[error("{key} {file}: {message}")]
pub struct TlsError {
    key: &'static str,
    file: String,
    message: String,
}

impl TlsError {
    fn new(key: &'static str, file: &Path, message: impl Into<String>) -> Self {
        TlsError { key, file: file.display().to_string(), message: message.into() }
    }
}

/// The files a server configuration is built from.
#[derive(Debug, Clone)]
struct Files {
    cert: PathBuf,
    key: PathBuf,
    client_ca: Option<PathBuf>,
    /// The name every client certificate must carry (`grpc.tls.client_san`).
    client_san: Option<String>,
}

impl Files {
    fn of(config: &GrpcTlsConfig) -> Option<Self> {
        Some(Files {
            cert: config.cert_file.clone()?,
            key: config.key_file.clone()?,
            client_ca: config.client_ca_file.clone(),
            client_san: config.client_san.clone(),
        })
    }

    /// Size and mtime of each file (None for a file that cannot be read):
    /// a change of any is a rotation.
    fn fingerprint(&self) -> Vec<Option<(u64, SystemTime)>> {
        [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()]
            .into_iter()
            .flatten()
            .map(|path| std::fs::metadata(path).ok().and_then(|m| Some((m.len(), m.modified().ok()?))))
            .collect()
    }

    /// Reads and checks every file and builds the rustls configuration.
    fn build(&self) -> Result<ServerConfig, TlsError> {
        let certs = CertificateDer::pem_file_iter(&self.cert)
            .and_then(Iterator::collect::<Result<Vec<_>, _>>)
            .map_err(|e| TlsError::new("grpc.tls.cert_file", &self.cert, e.to_string()))?;
        if certs.is_empty() {
            return Err(TlsError::new("grpc.tls.cert_file", &self.cert, "no PEM certificate in the file"));
        }
        // The key's parse error says what is wrong, never what is in it.
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|e| TlsError::new("grpc.tls.key_file", &self.key, e.to_string()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::new("grpc.tls.cert_file", &self.cert, e.to_string()))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca_file) => {
                let mut roots = RootCertStore::empty();
                let cas = CertificateDer::pem_file_iter(ca_file)
                    .and_then(Iterator::collect::<Result<Vec<_>, _>>)
                    .map_err(|e| TlsError::new("grpc.tls.client_ca_file", ca_file, e.to_string()))?;
                let (added, _) = roots.add_parsable_certificates(cas);
                if added == 0 {
                    return Err(TlsError::new(
                        "grpc.tls.client_ca_file",
                        ca_file,
                        "no usable CA certificate in the file",
                    ));
                }
                // Every client must present a certificate this CA signed.
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| TlsError::new("grpc.tls.client_ca_file", ca_file, e.to_string()))?;
                match &self.client_san {
                    None => builder.with_client_cert_verifier(verifier),
                    Some(san) => {
                        let name = ServerName::try_from(san.clone()).map_err(|e| {
                            TlsError::new(
                                "grpc.tls.client_ca_file",
                                ca_file,
                                format!("grpc.tls.client_san: {e}"),
                            )
                        })?;
                        builder.with_client_cert_verifier(Arc::new(NamedClients { inner: verifier, name }))
                    }
                }
            }
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| TlsError::new("grpc.tls.key_file", &self.key, e.to_string()))?;
        // gRPC is HTTP/2 only.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// Whether the client certificate `stream` presented (verified in its
/// handshake) carries one of `names` among its subject alternative names
/// (`grpc.tls.trusted_client_names`).
pub fn client_named(stream: &TlsStream<TcpStream>, names: &[String]) -> bool {
    let Some(cert) = stream.get_ref().1.peer_certificates().and_then(<[_]>::first) else {
        return false;
    };
    let Ok(cert) = webpki::EndEntityCert::try_from(cert) else { return false };
    names.iter().any(|name| {
        ServerName::try_from(name.as_str())
            .is_ok_and(|name| cert.verify_is_valid_for_subject_name(&name).is_ok())
    })
}

/// The CA's verdict on a client certificate, and then its name: the
/// certificate must carry `name` among its subject alternative names
/// (`grpc.tls.client_san`), as upstream's `GRPC_CLIENT_TLS_SAN` asks.
#[derive(Debug)]
struct NamedClients {
    inner: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

impl ClientCertVerifier for NamedClients {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self.inner.verify_client_cert(end_entity, intermediates, now)?;
        let cert = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        cert.verify_is_valid_for_subject_name(&self.name)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::NotValidForName))?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The acceptor in use, swapped when the certificate files change.
#[derive(Clone)]
pub struct ReloadingAcceptor {
    files: Files,
    current: Arc<ArcSwap<TlsAcceptor>>,
    handshake_timeout: Duration,
    max_handshakes: usize,
    /// The files' fingerprint taken before the first acceptor was built
    /// from them: a change from then on is seen by [`Self::watch`].
    built_from: Vec<Option<(u64, SystemTime)>>,
}

impl std::fmt::Debug for ReloadingAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingAcceptor").field("files", &self.files).finish_non_exhaustive()
    }
}

impl ReloadingAcceptor {
    /// Builds the first acceptor; `None` when `grpc.tls` is not configured.
    pub fn new(config: &GrpcTlsConfig) -> Result<Option<Self>, TlsError> {
        let Some(files) = Files::of(config) else { return Ok(None) };
        let built_from = files.fingerprint();
        let acceptor = TlsAcceptor::from(Arc::new(files.build()?));
        Ok(Some(ReloadingAcceptor {
            files,
            current: Arc::new(ArcSwap::from_pointee(acceptor)),
            handshake_timeout: Duration::from_millis(config.handshake_timeout_ms),
            max_handshakes: config.max_handshakes,
            built_from,
        }))
    }

    /// Whether clients must present a certificate.
    pub fn mutual(&self) -> bool {
        self.files.client_ca.is_some()
    }

    /// Polls the files every `interval` and swaps in a new acceptor when
    /// they changed and parse; ends when `stop` turns true.
    pub async fn watch(self, interval: Duration, mut stop: watch::Receiver<bool>) {
        let mut seen = self.built_from.clone();
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                _ = stop.changed() => return,
            }
            let now = self.files.fingerprint();
            if now == seen {
                continue;
            }
            // Build on a blocking thread: it reads files.
            let files = self.files.clone();
            match tokio::task::spawn_blocking(move || files.build()).await {
                Ok(Ok(config)) => {
                    self.current.store(Arc::new(TlsAcceptor::from(Arc::new(config))));
                    seen = now;
                    tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded; new connections use it");
                }
                Ok(Err(e)) => {
                    // Keep serving with the old one; retry at the next change
                    // (a rotation may still be writing the other file).
                    seen = now;
                    tracing::warn!(error = %e, "TLS files changed but do not load; the previous certificate stays in use");
                }
                Err(e) => tracing::error!(error = %e, "TLS reload task failed"),
            }
        }
    }

    /// Accepts TCP connections on `listener` and sends each completed TLS
    /// stream to the returned channel (for tonic's `serve_with_incoming`).
    /// Ends when `stop` turns true.
    pub fn incoming(
        &self,
        listener: TcpListener,
        mut stop: watch::Receiver<bool>,
    ) -> (mpsc::Receiver<io::Result<TlsStream<TcpStream>>>, impl Future<Output = ()> + Send + 'static) {
        // Bounded: if tonic stops taking connections, handshakes wait.
        let (sender, receiver) = mpsc::channel(1_024);
        let acceptor = self.clone();
        let accept_loop = async move {
            let permits = Arc::new(Semaphore::new(acceptor.max_handshakes));
            let mut handshakes = JoinSet::new();
            let mut backoff = AcceptBackoff::default();
            loop {
                // Reap finished handshakes, then wait for room for one more.
                while handshakes.try_join_next().is_some() {}
                let permit = tokio::select! {
                    permit = Arc::clone(&permits).acquire_owned() => permit.expect("the semaphore is never closed"),
                    _ = stop.wait_for(|stopped| *stopped) => return,
                    () = sender.closed() => break,
                };
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    _ = stop.wait_for(|stopped| *stopped) => return,
                    // tonic dropped the stream: shutdown began. Closing the
                    // listener now refuses new connections, as plain TCP does.
                    () = sender.closed() => break,
                };
                let stream = match accepted {
                    Ok((stream, _)) => {
                        backoff.reset();
                        stream
                    }
                    Err(e) => {
                        // Out of file descriptors and the like.
                        backoff.pause(&e.to_string()).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let tls = acceptor.current.load_full();
                let sender = sender.clone();
                let timeout = acceptor.handshake_timeout;
                handshakes.spawn(async move {
                    let _permit = permit;
                    let peer = stream.peer_addr().ok();
                    match tokio::time::timeout(timeout, tls.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let _ = sender.send(Ok(stream)).await;
                        }
                        // A client without a valid certificate, or not speaking
                        // TLS: refused. Debug level: scanners would flood warn.
                        Ok(Err(e)) => tracing::debug!(?peer, error = %e, "TLS handshake refused"),
                        Err(_) => tracing::debug!(?peer, "TLS handshake timed out"),
                    }
                });
            }
            drop(listener);
            // A background task of the server: it ends with the others.
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        (receiver, accept_loop)
    }
}
