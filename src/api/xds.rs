//! The Envoy rules over xDS (`rules.source: xds`), as envoyproxy/ratelimit's
//! `CONFIG_TYPE=GRPC_XDS_SOTW` receives them from a control plane such as
//! Envoy Gateway: a state-of-the-world subscription, on the aggregated
//! discovery service, to `type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig`.
//!
//! Each response is the whole set. Its resources become upstream's YAML
//! (one file per resource, named `xds:<name>`), are compiled exactly as
//! files are, and swap in atomically; the response is then acknowledged
//! (ACK: its version and nonce). A set that does not compile, or has no domain (unless `rules.allow_empty`), is refused
//! (NACK: the last accepted version, the nonce and the errors) and the last
//! good set keeps serving. A broken stream is reopened after a jittered,
//! doubling back-off; the rules in force stay in force meanwhile.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use prost::Message as _;
use serde::Deserialize;
use tokio::sync::{mpsc, watch};
use tokio_stream::{StreamExt as _, wrappers::ReceiverStream};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::envoy_pb::{
    discovery::{
        DiscoveryRequest, DiscoveryResponse,
        aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
    },
    envoy::config::core::v3::Node,
    google::rpc::Status,
    rls_config::{RateLimitConfig, RateLimitDescriptor, RateLimitUnit},
};
use crate::rules::{
    Hot, RuleErrors, XdsState,
    envoy::{Compile, EnvoyConfig},
    non_empty,
};

/// `rules.xds.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct XdsConfig {
    /// The management server, `http://host:port` or `https://` for TLS (upstream's
    /// `CONFIG_GRPC_XDS_SERVER_URL`).
    pub server_url: String,
    /// The node id announced (upstream's `CONFIG_GRPC_XDS_NODE_ID`).
    pub node_id: String,
    /// The node's metadata, strings (`CONFIG_GRPC_XDS_NODE_METADATA`; from the environment the keys
    /// arrive in lower case).
    pub node_metadata: BTreeMap<String, String>,
    /// gRPC metadata sent with the stream (`CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS`).
    // Secrets (passwords, SASL and TLS properties, auth headers) are
    // never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
    pub headers: BTreeMap<String, String>,
    /// With `https://`: the PEM CA certificate(s) the management server's certificate must chain
    /// to; no other roots are trusted.
    pub ca_file: Option<PathBuf>,
    /// With `https://`: the PEM client certificate presented for mTLS (with `key_file`).
    pub cert_file: Option<PathBuf>,
    /// With `https://`: the PEM private key of `cert_file`.
    pub key_file: Option<PathBuf>,
    /// The name the server's certificate must carry, when it differs from
    /// the URL's host (`CONFIG_GRPC_XDS_SERVER_TLS_SAN`).
    pub server_name: Option<String>,
    /// Serve before the first configuration arrives (every Envoy
    /// descriptor then has no limit) instead of waiting for it
    /// (`FORCE_START_WITHOUT_INITIAL_CONFIG`).
    pub force_start: bool,
    /// Deadline for connecting to the management server (each attempt).
    pub connect_timeout_ms: u64,
    /// First wait before reconnecting after a broken stream; it doubles
    /// up to `retry_max_ms` (jittered).
    pub retry_initial_ms: u64,
    /// Longest wait before reconnecting a broken stream: the doubling
    /// wait from `retry_initial_ms` stops growing here (jittered).
    pub retry_max_ms: u64,
    /// Largest response accepted (`XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES`).
    pub max_message_bytes: usize,
}

impl Default for XdsConfig {
    fn default() -> Self {
        Self {
            server_url: "http://localhost:18000".to_owned(),
            node_id: "default".to_owned(),
            node_metadata: BTreeMap::new(),
            headers: BTreeMap::new(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            server_name: None,
            force_start: false,
            connect_timeout_ms: 3_000,
            retry_initial_ms: 1_000,
            retry_max_ms: 30_000,
            max_message_bytes: 4 << 20,
        }
    }
}

/// The resource type subscribed to.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// What a set must be to be accepted.
#[derive(Debug, Clone, Copy)]
pub struct Accept {
    /// How its resources compile (`envoy.algorithm`, `envoy.merge_domains`).
    pub how: Compile,
    /// A set without a domain is accepted (`rules.allow_empty`); off, it is
    /// refused (NACK) and the last good set keeps serving.
    pub allow_empty: bool,
}

/// Subscribes until `stop` turns true, swapping every accepted set into `hot`.
pub async fn run(
    config: XdsConfig,
    how: Accept,
    hot: Arc<Hot<EnvoyConfig>>,
    state: Arc<XdsState>,
    mut stop: watch::Receiver<bool>,
) {
    let endpoint = match endpoint(&config) {
        Ok(endpoint) => endpoint,
        Err(error) => {
            // `xds_rules` built it once before serving, so only a TLS file
            // removed in between gets here: logged once, and the service
            // goes on without a set (it never became ready without one,
            // unless force_start).
            tracing::error!(%error, "rules.xds: cannot build the connection; no xDS subscription");
            let _ = stop.wait_for(|s| *s).await;
            return;
        }
    };
    let mut backoff = Duration::from_millis(config.retry_initial_ms);
    loop {
        let mut answered = false;
        let subscribed = tokio::select! {
            result = subscribe(&config, &endpoint, how, &hot, &state, &mut answered) => result,
            _ = stop.wait_for(|s| *s) => return,
        };
        match subscribed {
            Ok(()) => tracing::warn!(server = %config.server_url, "xDS stream ended; reconnecting"),
            Err(error) => {
                tracing::warn!(server = %config.server_url, %error, "xDS stream failed; reconnecting")
            }
        }
        if answered {
            // The stream was up: start the back-off afresh.
            backoff = Duration::from_millis(config.retry_initial_ms);
        }
        let jittered = backoff.mul_f64(0.5 + rand_unit() * 0.5);
        tokio::select! {
            () = tokio::time::sleep(jittered) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        backoff = (backoff * 2).min(Duration::from_millis(config.retry_max_ms));
    }
}

/// A number in [0, 1) from the clock: enough to spread reconnects.
fn rand_unit() -> f64 {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    f64::from(nanos % 1_000) / 1_000.0
}

/// The channel's endpoint: the URL, timeouts, and TLS (with a client
/// certificate for mTLS) when configured.
pub fn endpoint(config: &XdsConfig) -> Result<Endpoint, String> {
    let mut endpoint = Endpoint::from_shared(config.server_url.clone())
        .map_err(|e| format!("rules.xds.server_url {:?}: {e}", config.server_url))?
        .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
        .http2_keep_alive_interval(Duration::from_secs(30));
    if config.server_url.starts_with("https://") {
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &config.ca_file {
            tls = tls.ca_certificate(Certificate::from_pem(read(ca, "rules.xds.ca_file")?));
        }
        if let (Some(cert), Some(key)) = (&config.cert_file, &config.key_file) {
            tls = tls.identity(Identity::from_pem(
                read(cert, "rules.xds.cert_file")?,
                read(key, "rules.xds.key_file")?,
            ));
        }
        if let Some(name) = &config.server_name {
            tls = tls.domain_name(name.clone());
        }
        endpoint = endpoint.tls_config(tls).map_err(|e| format!("rules.xds TLS: {e}"))?;
    }
    Ok(endpoint)
}

fn read(path: &PathBuf, key: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{key} {}: {e}", path.display()))
}

/// One stream: the first request, then an ACK or NACK per response, until
/// the stream ends or fails.
async fn subscribe(
    config: &XdsConfig,
    endpoint: &Endpoint,
    how: Accept,
    hot: &Hot<EnvoyConfig>,
    state: &XdsState,
    answered: &mut bool,
) -> Result<(), String> {
    let channel: Channel = endpoint.connect().await.map_err(|e| format!("connect: {e}"))?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel)
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    let (requests, outgoing) = mpsc::channel(4);
    let node = node(config);
    let accepted = state.version().unwrap_or_default();
    let _ = requests.send(request(&node, accepted, String::new(), None)).await;
    let mut call = tonic::Request::new(ReceiverStream::new(outgoing));
    for (name, value) in &config.headers {
        let (Ok(name), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(name.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) else {
            continue; // validated at startup
        };
        call.metadata_mut().insert(name, value);
    }
    let mut responses =
        client.stream_aggregated_resources(call).await.map_err(|e| format!("open: {e}"))?.into_inner();
    tracing::info!(server = %config.server_url, node = %config.node_id, "subscribed to rate-limit configuration over xDS");
    while let Some(response) = responses.next().await {
        let response = response.map_err(|e| format!("receive: {e}"))?;
        *answered = true;
        let answer = match apply(&response, how, hot) {
            Ok(domains) => {
                state.accept(response.version_info.clone());
                tracing::info!(version = ?response.version_info, domains, "xDS rate-limit configuration swapped in");
                request(&node, response.version_info, response.nonce, None)
            }
            Err(error) => {
                state.refuse();
                tracing::warn!(version = ?response.version_info, %error, "xDS rate-limit configuration refused; the last good one keeps serving");
                let accepted = state.version().unwrap_or_default();
                request(&node, accepted, response.nonce, Some(error))
            }
        };
        if requests.send(answer).await.is_err() {
            break;
        }
    }
    Ok(())
}

/// The node this instance announces: `rules.xds.node_id` and
/// `rules.xds.node_metadata` (strings).
fn node(config: &XdsConfig) -> Node {
    use prost_types::{Struct, Value, value::Kind};
    let fields = config
        .node_metadata
        .iter()
        .map(|(k, v)| (k.clone(), Value { kind: Some(Kind::StringValue(v.clone())) }))
        .collect();
    Node {
        id: config.node_id.clone(),
        metadata: Some(Struct { fields }),
        user_agent_name: "ratelimitd".to_owned(),
        ..Default::default()
    }
}

/// A subscription request: the first (empty version and nonce), an ACK, or
/// (with `error`) a NACK.
fn request(
    node: &Node,
    version_info: String,
    response_nonce: String,
    error: Option<String>,
) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info,
        node: Some(node.clone()),
        resource_names: Vec::new(),
        type_url: TYPE_URL.to_owned(),
        response_nonce,
        // INVALID_ARGUMENT, as envoyproxy/ratelimit's client reports it.
        error_detail: error.map(|message| Status { code: 3, message, details: Vec::new() }),
        ..Default::default()
    }
}

/// Compiles the response's resources and swaps them in; the number of
/// domains, or every problem found (a set without a domain is one, unless
/// empty sets are accepted).
fn apply(response: &DiscoveryResponse, accept: Accept, hot: &Hot<EnvoyConfig>) -> Result<usize, String> {
    let files = files(response)?;
    let compiled = crate::rules::envoy::compile_texts(&files, accept.how)
        .and_then(|set| non_empty(set, Path::new("xds"), accept.allow_empty))
        .map_err(|e: RuleErrors| e.to_string())?;
    let domains = compiled.domain_count();
    hot.swap(compiled);
    Ok(domains)
}

/// Each resource as the upstream YAML it stands for, named `xds:<name>`.
pub fn files(response: &DiscoveryResponse) -> Result<Vec<(PathBuf, String)>, String> {
    response
        .resources
        .iter()
        .enumerate()
        .map(|(i, any)| {
            if any.type_url != TYPE_URL {
                return Err(format!("resource {i}: type {:?}, expected {TYPE_URL}", any.type_url));
            }
            let config = RateLimitConfig::decode(any.value.as_slice())
                .map_err(|e| format!("resource {i}: not a RateLimitConfig: {e}"))?;
            let name = if config.name.is_empty() { format!("resource-{i}") } else { config.name.clone() };
            let text = yaml_serde::to_string(&yaml(&config)).map_err(|e| format!("resource {name}: {e}"))?;
            Ok((PathBuf::from(format!("xds:{name}")), text))
        })
        .collect()
}

/// The configuration as upstream's YAML document (what its
/// `ConfigXdsProtoToYaml` builds).
fn yaml(config: &RateLimitConfig) -> serde_json::Value {
    serde_json::json!({ "domain": config.domain, "descriptors": descriptors(&config.descriptors) })
}

fn descriptors(list: &[RateLimitDescriptor]) -> serde_json::Value {
    list.iter()
        .map(|d| {
            let mut out = serde_json::json!({
                "key": d.key,
                "value": d.value,
                "shadow_mode": d.shadow_mode,
                "detailed_metric": d.detailed_metric,
                "quota_mode": d.quota_mode,
                "descriptors": descriptors(&d.descriptors),
            });
            if let Some(policy) = &d.rate_limit {
                let unit = RateLimitUnit::try_from(policy.unit).map_or("unknown", |u| u.as_str_name());
                out["rate_limit"] = serde_json::json!({
                    "unit": unit.to_ascii_lowercase(),
                    "requests_per_unit": policy.requests_per_unit,
                    "unlimited": policy.unlimited,
                    "name": policy.name,
                    "replaces": policy.replaces.iter().map(|r| serde_json::json!({ "name": r.name })).collect::<Vec<_>>(),
                });
            }
            if let Some(metadata) = &d.metadata {
                out["metadata"] = struct_json(metadata);
            }
            out
        })
        .collect()
}

fn struct_json(s: &prost_types::Struct) -> serde_json::Value {
    serde_json::Value::Object(s.fields.iter().map(|(k, v)| (k.clone(), value_json(v))).collect())
}

fn value_json(v: &prost_types::Value) -> serde_json::Value {
    use prost_types::value::Kind;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::NumberValue(n)) => {
            serde_json::Number::from_f64(*n).map_or(serde_json::Value::Null, Into::into)
        }
        Some(Kind::StringValue(s)) => s.clone().into(),
        Some(Kind::BoolValue(b)) => (*b).into(),
        Some(Kind::StructValue(s)) => struct_json(s),
        Some(Kind::ListValue(l)) => l.values.iter().map(value_json).collect(),
    }
}
