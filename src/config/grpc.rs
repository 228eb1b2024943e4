//! `grpc.*`: the gRPC listener, its limits and its TLS.

use std::{net::SocketAddr, path::PathBuf};

use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::tls::GrpcTlsConfig;

/// The request byte budget with no memory limit to take it from.
const DEFAULT_REQUEST_BYTES_IN_FLIGHT: usize = 128 << 20;

/// `grpc.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcConfig {
    /// Address the gRPC server binds (`grpc.listen`).
    pub listen: String,
    /// How long in-flight calls may take to finish after SIGTERM before the
    /// process exits anyway (`grpc.shutdown_grace_ms`).
    pub shutdown_grace_ms: u64,
    /// After SIGTERM, how long to keep answering while health already says
    /// NOT_SERVING (and `/readyz` 503), so load balancers stop sending before
    /// the listener closes. Behind Kubernetes or Envoy a few seconds is usual.
    pub drain_delay_ms: u64,
    /// Largest request message, in bytes, of every method but `CheckBatch`;
    /// read from the message's length prefix, before it is buffered. A
    /// larger `Check`, `Report` or `ShouldRateLimit` is denied (reason
    /// `REQUEST_TOO_LARGE`, Envoy `OVER_LIMIT`), never failed: a proxy that
    /// fails open would allow on an error, and an Envoy request grows with
    /// the headers its client sends. A larger `CheckStream` item fails the
    /// stream with RESOURCE_EXHAUSTED. Real requests are a few hundred
    /// bytes; the default takes Envoy's default header limit (60 KiB)
    /// copied into four descriptors.
    pub max_message_bytes: usize,
    /// Largest `CheckBatch` request message (up to 1,024 items); a larger one is refused with
    /// RESOURCE_EXHAUSTED before it is buffered. At least `grpc.max_message_bytes`.
    pub max_batch_message_bytes: usize,
    /// Most requests (HTTP/2 streams) open at once on one connection, advertised in the server's
    /// SETTINGS; clients queue or open another connection past it. What one connection can make the
    /// service hold is at most this × `grpc.max_message_bytes` (256 MiB at the defaults;
    /// `grpc.max_request_bytes_in_flight` bounds all connections together). gRPC over tonic alone
    /// advertises no limit.
    pub max_concurrent_streams: u32,
    /// Largest header list of one request (HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE, its HEADERS and
    /// CONTINUATION frames together, decoded): past it the request is refused before it reaches a
    /// handler, and a header block that never ends (a CONTINUATION flood) holds at most this
    /// much. gRPC metadata is a few hundred bytes; Envoy's descriptors travel in the message.
    pub max_header_list_bytes: u32,
    /// Most bytes held for unfinished requests, over every connection and stream together: each
    /// request's header block (four times its decoded size: what it keeps held) and 4 KiB for
    /// its stream from its arrival until it is
    /// answered, and each message from its gRPC length prefix (what is reserved for it) until it
    /// is whole. So clients opening streams they never finish, with large header blocks or
    /// announcing large messages, cannot make the service hold `connections × streams × (16 KiB +
    /// max_message_bytes)`. Shared per caller (the two keys below); untrusted callers together
    /// hold at most half, whether or not `grpc.trusted_peers` are set. A request past its
    /// caller's share is refused (`ratelimitd_grpc_requests_over_budget_total`): a `Check`,
    /// `Report` or `ShouldRateLimit` is denied (`CALLER_BUSY`, Envoy `OVER_LIMIT` flagged
    /// `caller_busy`), a `CheckBatch` or `CheckStream` fails with RESOURCE_EXHAUSTED. When the
    /// untrusted half or the whole is what refuses it, the requests of the untrusted address
    /// holding most are cancelled first, their bytes freed at once, if it holds more than the
    /// caller's address would (`share="reclaimed"`) and while the cancelled requests not yet ended
    /// (`ratelimitd_grpc_request_bytes_reclaiming`) and its own stay within half of this. What
    /// requests make the process hold stays under twice this (docs/hostile-input.md), so a value
    /// over half the process's memory limit is refused at start.
    ///
    /// Default: an eighth of the process's memory limit (cgroup v2 `memory.max`, v1
    /// `memory.limit_in_bytes`, under `shed.cgroup_root`): 134217728 (128 MiB) in the shipped
    /// Deployment's 1 GiB; 134217728 with no limit.
    pub max_request_bytes_in_flight: Option<usize>,
    /// The process's memory limit, read from its cgroup at load.
    #[serde(skip)]
    pub memory_limit: Option<u64>,
    /// Most of those bytes one connection holds (at most the whole budget in effect); at least
    /// `grpc.max_batch_message_bytes`.
    pub max_request_bytes_per_connection: usize,
    /// Most of those bytes one untrusted peer holds, all its connections together: an IPv4
    /// address, an IPv6 /64 (one host has a whole prefix), the Unix socket's clients together. At
    /// least `grpc.max_request_bytes_per_connection`.
    pub max_request_bytes_per_peer: usize,
    /// Peers trusted with the whole budget (the proxies in front: Envoy), as addresses or
    /// prefixes (`10.0.0.0/8`, `fd00::/8`, `192.0.2.1`): no peer share applies to them, untrusted
    /// peers together hold at most half of `grpc.max_request_bytes_in_flight` and 15/16 of
    /// `grpc.max_connections`, the rest theirs alone, and their requests are never reclaimed. So a
    /// caller that reaches the port directly, from any number of addresses, cannot take what the
    /// proxies need. The Unix socket's clients are trusted.
    pub trusted_peers: Vec<String>,
    /// Who may report outcomes (`Report` with `outcome`, Envoy `ratelimitd.outcome` entries),
    /// give slots of requests in flight back (`Report` of such a rule, `ratelimitd.release`),
    /// settle reservations (`Report` with `reservation`, Envoy `ratelimitd.settle`) and stream
    /// quota usage (Envoy's Rate Limit Quota Service), as addresses or prefixes; with
    /// `grpc.tls.reporting_client_names`, the only callers whose reports move an adaptive limit,
    /// free slots or give reserved units back (others are answered and count nowhere,
    /// `ratelimitd_request_values_adjusted_total{reason="outcome_not_allowed"}`,
    /// `release_not_allowed` or `settlement_not_allowed`). Unset with it: anyone, each outcome
    /// still weighing at most what its reporter was admitted.
    pub reporting_peers: Vec<String>,
    /// How long a unary call may take, its request read included; past it
    /// the call is cancelled (CANCELLED) and its buffer freed. A client's
    /// shorter `grpc-timeout` wins. Streams (`CheckStream`) are not bound
    /// by it, but each of their messages is: one begun (its length prefix
    /// read) and not whole within this long fails its stream
    /// (RESOURCE_EXHAUSTED) and frees its bytes. 0: none.
    pub request_timeout_ms: u64,
    /// Most gRPC connections open at once (the TCP port and `grpc.uds` together). Untrusted
    /// connections hold at most 15/16 of them together; the rest are kept for `grpc.trusted_peers`.
    /// A new connection that finds no place takes the place of one of its class, the one idle
    /// longest (no request in flight), else one of the peer holding most connections while that
    /// peer holds more than one past the newcomer's; the connection reclaimed is closed
    /// (`ratelimitd_grpc_connections_reclaimed_total`). With none to reclaim the newcomer is
    /// closed (`ratelimitd_grpc_connections_refused_total`). With the two limits above this bounds
    /// what clients can make the service hold; keep it under the process's open-file limit
    /// (`ulimit -n`), or accepting fails there instead.
    pub max_connections: usize,
    /// A gRPC connection that starts no request within this long of opening is closed
    /// (`ratelimitd_grpc_connections_unused_total`): an idle connection holds a descriptor and a
    /// place, and a client that needs one opens it when it has a request. `0`: never.
    pub first_request_timeout_ms: u64,
    /// Most store calls (Redis) one connection has in flight: each decision
    /// of a `Check`, each item of a `CheckBatch` or `CheckStream`, each
    /// `ShouldRateLimit` holds one while its store call runs; past it the
    /// connection's next decisions wait for its own calls to finish. So a
    /// client flooding distinct keys slows itself, not the store's queue
    /// for everyone else. 0: unbounded.
    pub max_store_calls_per_connection: usize,
    /// Most store calls one tenant has in flight, all its connections
    /// together, where a tenant table is configured (`overload.tenants_path`;
    /// the tenant is read as `overload.tenant_from` says): each tenant the
    /// table names has this many, every other tenant and requests without
    /// one share another this many. Behind Envoy, whose few connections
    /// carry every tenant's requests, it is what keeps one tenant's flood
    /// from queueing the others. 0: unbounded.
    pub max_store_calls_per_tenant: usize,
    /// Most store calls one untrusted peer (an IPv4 address, an IPv6 /64;
    /// not `grpc.trusted_peers`) has in flight, all its connections
    /// together: past it its next decisions wait for its own calls, so
    /// opening more connections does not take more of the store. 0:
    /// unbounded.
    pub max_store_calls_per_peer: usize,
    /// Most gRPC connections one untrusted peer has open: one past it is
    /// closed as soon as it is accepted
    /// (`ratelimitd_grpc_connections_over_peer_share_total`), so no
    /// address takes the `grpc.max_connections` places, or their streams,
    /// that others need. Clients behind one NAT share an address: trust
    /// it (`grpc.trusted_peers`) or raise this. 0: unbounded.
    pub max_connections_per_peer: usize,
    /// After this long a connection is told to go (HTTP/2 GOAWAY): its calls in flight finish and
    /// the client opens its next connection, possibly to another instance, so clients spread again
    /// over a fleet that scaled out. Exact (tonic applies no jitter: connections opened together
    /// age out together); never a forced close, so an open `CheckStream` keeps its connection until
    /// it ends; it costs about 0.1 % of a unary decision's CPU; `0` never.
    pub max_connection_age_ms: u64,
    /// TCP keepalive on gRPC connections: after this long idle the kernel probes the peer every 10
    /// s and closes the connection after 3 unanswered probes, so a client that vanished without
    /// closing (a dead host, a NAT that dropped the flow) does not keep its connection and buffers.
    /// Set on the listener, inherited by every accepted connection; costs nothing per request; `0`
    /// disables.
    pub tcp_keepalive_ms: u64,
    /// HTTP/2 PING keepalive: an idle connection is pinged this often and closed when a PING goes
    /// unanswered for `grpc.keepalive_timeout_ms`; unlike TCP keepalive it also finds a peer whose
    /// host answers but whose process hangs, so its place goes back. It costs about 1.5 % more CPU
    /// per unary decision (hyper takes a lock and reads the clock for every frame received); `0`
    /// disables.
    pub keepalive_interval_ms: u64,
    /// How long a keepalive PING may go unanswered before the connection is
    /// closed.
    pub keepalive_timeout_ms: u64,
    /// Threads serving the gRPC port's plain TCP connections, each with a runtime of its own: a
    /// connection is served for its life by the one holding the fewest when it arrives, with the
    /// store calls its requests make, so a decision wakes no other thread (docs/performance.md).
    /// One connection's decisions use at most one core. Connections over TLS and on `grpc.uds`
    /// are served by the shared runtime; 0 serves every connection there.
    ///
    /// Default: one per CPU the process may use (its affinity and CPU quota).
    pub serving_threads: Option<usize>,
    /// TLS on the gRPC port; off unless `cert_file` and `key_file` are set.
    pub tls: GrpcTlsConfig,
    /// Also serve gRPC (plain) on this Unix socket, for a proxy on the same host (upstream's
    /// `GRPC_UDS`); a stale socket file is replaced, another kind of file refuses to start, the
    /// file is removed at shutdown. Clients must send a valid `:authority` (`grpcurl -unix
    /// -authority localhost …`): HTTP/2 refuses a socket path there.
    pub uds: Option<PathBuf>,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:8081".to_owned(),
            shutdown_grace_ms: 10_000,
            drain_delay_ms: 0,
            max_message_bytes: 256 << 10,
            max_batch_message_bytes: 4 << 20,
            max_concurrent_streams: 1_024,
            max_header_list_bytes: 16 << 10,
            max_connections: 10_000,
            first_request_timeout_ms: 10_000,
            max_request_bytes_in_flight: None,
            memory_limit: None,
            max_request_bytes_per_connection: 16 << 20,
            max_request_bytes_per_peer: 32 << 20,
            trusted_peers: Vec::new(),
            reporting_peers: Vec::new(),
            request_timeout_ms: 10_000,
            max_store_calls_per_connection: 256,
            max_store_calls_per_tenant: 1_024,
            max_store_calls_per_peer: 1_024,
            max_connections_per_peer: 128,
            max_connection_age_ms: 1_800_000,
            tcp_keepalive_ms: 60_000,
            keepalive_interval_ms: 60_000,
            keepalive_timeout_ms: 20_000,
            serving_threads: None,
            tls: GrpcTlsConfig::default(),
            uds: None,
        }
    }
}

impl GrpcConfig {
    /// Checks `grpc.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen.parse::<SocketAddr>().map_err(|e| {
            invalid("grpc.listen", format!("{:?} is not an ip:port address: {e}", self.listen))
        })?;
        if let Some(path) = &self.uds
            && (path.as_os_str().is_empty() || path.as_os_str().len() > 100)
        {
            return Err(invalid("grpc.uds", format!("{}: a socket path of 1 to 100 bytes", path.display())));
        }
        if !(1_024..=64 << 20).contains(&self.max_message_bytes) {
            return Err(invalid("grpc.max_message_bytes", "must be between 1024 and 67108864"));
        }
        if !(1..=1 << 20).contains(&self.max_concurrent_streams) {
            return Err(invalid("grpc.max_concurrent_streams", "must be between 1 and 1048576"));
        }
        if !(1_024..=1 << 20).contains(&self.max_header_list_bytes) {
            return Err(invalid("grpc.max_header_list_bytes", "must be between 1024 and 1048576"));
        }
        if !(self.max_message_bytes..=64 << 20).contains(&self.max_batch_message_bytes) {
            return Err(invalid(
                "grpc.max_batch_message_bytes",
                format!("must be between grpc.max_message_bytes ({}) and 67108864", self.max_message_bytes),
            ));
        }
        self.validate_shares()?;
        if self.serving_threads.is_some_and(|threads| threads > 1_024) {
            return Err(invalid("grpc.serving_threads", "must be between 0 (none) and 1024"));
        }
        if !(1..=1 << 20).contains(&self.max_connections) {
            return Err(invalid("grpc.max_connections", "must be between 1 and 1048576"));
        }
        // A semaphore's size: tokio's limit is far above, and panics past it.
        for (key, calls) in [
            ("grpc.max_store_calls_per_connection", self.max_store_calls_per_connection),
            ("grpc.max_store_calls_per_tenant", self.max_store_calls_per_tenant),
            ("grpc.max_store_calls_per_peer", self.max_store_calls_per_peer),
            ("grpc.max_connections_per_peer", self.max_connections_per_peer),
        ] {
            if calls > 1 << 20 {
                return Err(invalid(key, "must be between 0 (unbounded) and 1048576"));
            }
        }
        if self.keepalive_interval_ms > 0 && self.keepalive_timeout_ms == 0 {
            return Err(invalid(
                "grpc.keepalive_timeout_ms",
                "must be at least 1 while grpc.keepalive_interval_ms is set",
            ));
        }
        self.tls.validate()
    }
}

impl GrpcConfig {
    /// Checks how the request byte budget is shared (`grpc.max_request_bytes_*`,
    /// `grpc.trusted_peers`).
    fn validate_shares(&self) -> Result<(), ConfigError> {
        let budget = self.request_bytes_in_flight();
        let limit = self.memory_limit.map(|limit| usize::try_from(limit).unwrap_or(usize::MAX));
        match (self.max_request_bytes_in_flight, limit) {
            (Some(set), Some(limit)) if set > limit / 2 => {
                return Err(invalid(
                    "grpc.max_request_bytes_in_flight",
                    format!(
                        "{set} is over half the process's memory limit ({limit} bytes, cgroup memory.max): \
                         what requests make the service hold reaches twice it; at most {}",
                        limit / 2
                    ),
                ));
            }
            (None, Some(limit)) if budget < self.max_batch_message_bytes => {
                return Err(invalid(
                    "grpc.max_request_bytes_in_flight",
                    format!(
                        "an eighth of the process's memory limit ({limit} bytes, cgroup memory.max) is {budget}, \
                         less than grpc.max_batch_message_bytes ({}): raise the limit, or set both keys",
                        self.max_batch_message_bytes
                    ),
                ));
            }
            _ if budget < self.max_batch_message_bytes => {
                return Err(invalid(
                    "grpc.max_request_bytes_in_flight",
                    format!(
                        "must be at least grpc.max_batch_message_bytes ({})",
                        self.max_batch_message_bytes
                    ),
                ));
            }
            _ => {}
        }
        if self.max_request_bytes_per_connection < self.max_batch_message_bytes {
            return Err(invalid(
                "grpc.max_request_bytes_per_connection",
                format!("must be at least grpc.max_batch_message_bytes ({})", self.max_batch_message_bytes),
            ));
        }
        if self.max_request_bytes_per_peer < self.max_request_bytes_per_connection {
            return Err(invalid(
                "grpc.max_request_bytes_per_peer",
                format!(
                    "must be at least grpc.max_request_bytes_per_connection ({})",
                    self.max_request_bytes_per_connection
                ),
            ));
        }
        self.trusted_nets()?;
        self.reporting_nets()?;
        Ok(())
    }

    /// `grpc.trusted_peers`, parsed; an error names the entry.
    pub fn trusted_nets(&self) -> Result<Vec<ipnet::IpNet>, ConfigError> {
        nets("grpc.trusted_peers", &self.trusted_peers)
    }

    /// `grpc.reporting_peers`, parsed; an error names the entry.
    pub fn reporting_nets(&self) -> Result<Vec<ipnet::IpNet>, ConfigError> {
        nets("grpc.reporting_peers", &self.reporting_peers)
    }

    /// The serving threads in effect: `grpc.serving_threads`, else one per
    /// CPU the process may use; 0: none.
    pub fn serving_threads(&self) -> usize {
        self.serving_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get))
    }

    /// What one caller may hold besides bytes.
    pub fn quotas(&self) -> crate::budget::Quotas {
        crate::budget::Quotas {
            store_calls_per_connection: self.max_store_calls_per_connection,
            store_calls_per_peer: self.max_store_calls_per_peer,
            connections_per_peer: self.max_connections_per_peer,
        }
    }

    /// The request byte budget: `grpc.max_request_bytes_in_flight`, else an
    /// eighth of the process's memory limit, else 128 MiB.
    pub fn request_bytes_in_flight(&self) -> usize {
        self.max_request_bytes_in_flight.unwrap_or_else(|| match self.memory_limit {
            Some(limit) => usize::try_from(limit / crate::budget::BUDGET_FRACTION).unwrap_or(usize::MAX),
            None => DEFAULT_REQUEST_BYTES_IN_FLIGHT,
        })
    }

    /// How the request byte budget is shared.
    pub fn byte_shares(&self) -> crate::budget::Shares {
        let pool = self.request_bytes_in_flight();
        crate::budget::Shares {
            pool,
            per_connection: self.max_request_bytes_per_connection.min(pool),
            per_peer: self.max_request_bytes_per_peer.min(pool),
            // Whether or not trust is configured: what untrusted callers can
            // hold is a part, never the whole.
            untrusted: pool / 2,
        }
    }
}

/// Addresses and prefixes `list` of `key`, parsed; an error names the entry.
fn nets(key: &'static str, list: &[String]) -> Result<Vec<ipnet::IpNet>, ConfigError> {
    list.iter()
        .enumerate()
        .map(|(i, peer)| {
            peer.parse::<ipnet::IpNet>()
                .or_else(|_| peer.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .map(|net| net.trunc())
                .map_err(|_| {
                    invalid(
                        key,
                        format!("entry {i}: {peer:?} is not an address or a prefix (10.0.0.0/8, fd00::/8)"),
                    )
                })
        })
        .collect()
}

impl GrpcTlsConfig {
    /// Checks `grpc.tls.*`: a certificate and key together, mTLS only over TLS.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match (&self.cert_file, &self.key_file) {
            (Some(_), None) => {
                return Err(invalid("grpc.tls.key_file", "must be set with grpc.tls.cert_file"));
            }
            (None, Some(_)) => {
                return Err(invalid("grpc.tls.cert_file", "must be set with grpc.tls.key_file"));
            }
            (None, None) if self.client_ca_file.is_some() => {
                return Err(invalid(
                    "grpc.tls.client_ca_file",
                    "needs grpc.tls.cert_file and grpc.tls.key_file (mTLS is TLS first)",
                ));
            }
            _ => {}
        }
        if let Some(san) = &self.client_san {
            if self.client_ca_file.is_none() {
                return Err(invalid(
                    "grpc.tls.client_san",
                    "needs grpc.tls.client_ca_file (it checks client certificates)",
                ));
            }
            if rustls_pki_types::ServerName::try_from(san.as_str()).is_err() {
                return Err(invalid(
                    "grpc.tls.client_san",
                    format!("{san:?} is not a DNS name or an IP address"),
                ));
            }
        }
        for (key, names) in [
            ("grpc.tls.trusted_client_names", &self.trusted_client_names),
            ("grpc.tls.reporting_client_names", &self.reporting_client_names),
        ] {
            for (i, name) in names.iter().enumerate() {
                if self.client_ca_file.is_none() {
                    return Err(invalid(
                        key,
                        "needs grpc.tls.client_ca_file (a name is read from a verified client certificate)",
                    ));
                }
                if rustls_pki_types::ServerName::try_from(name.as_str()).is_err() {
                    return Err(invalid(
                        key,
                        format!("entry {i}: {name:?} is not a DNS name or an IP address"),
                    ));
                }
            }
        }
        if self.handshake_timeout_ms == 0 {
            return Err(invalid("grpc.tls.handshake_timeout_ms", "must be at least 1"));
        }
        if !(1..=1 << 20).contains(&self.max_handshakes) {
            return Err(invalid("grpc.tls.max_handshakes", "must be between 1 and 1048576"));
        }
        Ok(())
    }
}
