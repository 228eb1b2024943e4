//! Envoy's Rate Limit Quota Service (`StreamRateLimitQuotas`), served
//! beside `ShouldRateLimit` on the Envoy rules: one stream per Envoy, which
//! reports each bucket's usage and is answered each bucket's assignment.
//!
//! A bucket's id (its key/value map) is matched against the Envoy rules of
//! the stream's domain like a descriptor whose entries are the id's, in
//! key order. A bucket under a limit gets its share of it as a token
//! bucket (`quota::strategy`), for `rlqs.assignment_ttl_ms`; one under an
//! `unlimited` limit, or under none, is allowed whole. A bucket the Envoy
//! has not reported for `rlqs.abandon_after_ms` is abandoned. Streams are
//! bounded as a whole (`rlqs.max_streams`), and buckets per stream and
//! overall; only a caller that may report (`grpc.reporting_peers`) opens
//! one, since its demand moves the limit the other Envoys live under.

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures_util::{Stream, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::{Request, Response, Status, Streaming};

use super::envoy_pb::{
    envoy::r#type::v3::{
        RateLimitStrategy, TokenBucket,
        rate_limit_strategy::{BlanketRule, Strategy},
    },
    rlqs::{
        BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
        rate_limit_quota_response::{
            BucketAction,
            bucket_action::{self, AbandonAction, QuotaAssignmentAction},
        },
        rate_limit_quota_service_server::{RateLimitQuotaService, RateLimitQuotaServiceServer},
    },
};
use crate::{
    quota::{BucketKey, BucketShares, Usage, strategy},
    rules::{Hot, envoy::EnvoyConfig},
};

/// The RLQS service.
#[derive(Clone)]
pub struct RlqsService {
    quotas: Arc<BucketShares>,
    envoy: Arc<Hot<EnvoyConfig>>,
    streams: Arc<Semaphore>,
    next_holder: Arc<AtomicU64>,
}

impl std::fmt::Debug for RlqsService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RlqsService").field("buckets", &self.quotas.len()).finish_non_exhaustive()
    }
}

/// What one stream keeps: its holder number, its domain (the first
/// report's), and each bucket it reported with when it last did.
struct Holder {
    id: u64,
    domain: Option<Arc<str>>,
    buckets: HashMap<BucketKey, (BucketId, u64)>,
    _permit: OwnedSemaphorePermit,
}

/// The answers of one stream.
type Answers = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send + 'static>>;

impl RlqsService {
    /// Shares the limits of the Envoy rules `envoy` through `quotas`.
    pub fn new(quotas: Arc<BucketShares>, envoy: Arc<Hot<EnvoyConfig>>) -> Self {
        let streams = Arc::new(Semaphore::new(quotas.settings().max_streams));
        RlqsService { quotas, envoy, streams, next_holder: Arc::new(AtomicU64::new(1)) }
    }

    /// The tonic server.
    pub fn into_server(self) -> RateLimitQuotaServiceServer<Self> {
        RateLimitQuotaServiceServer::new(self)
    }

    /// The answer to one message of `holder`'s stream: an assignment for
    /// each bucket it reports that it may hold.
    fn answer(
        &self,
        holder: &mut Holder,
        reports: RateLimitQuotaUsageReports,
    ) -> Result<Option<RateLimitQuotaResponse>, Status> {
        let domain = match &holder.domain {
            Some(domain) => Arc::clone(domain),
            None if reports.domain.is_empty() => {
                return Err(Status::invalid_argument("domain: the stream's first report must name it"));
            }
            None => Arc::clone(holder.domain.insert(Arc::from(reports.domain.as_str()))),
        };
        let config = self.envoy.load();
        let settings = self.quotas.settings();
        let (ttl, now_ms) = (settings.assignment_ttl_ms, self.quotas.now_ms());
        let mut actions = Vec::with_capacity(reports.bucket_quota_usages.len());
        for usage in reports.bucket_quota_usages {
            let Some(id) = usage.bucket_id.filter(|id| !id.bucket.is_empty()) else { continue };
            let mut entries: Vec<(&str, &str)> =
                id.bucket.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            entries.sort_unstable();
            let key = BucketKey { domain: Arc::clone(&domain), id: bucket_key(&entries) };
            if !holder.buckets.contains_key(&key) && holder.buckets.len() >= settings.max_buckets_per_stream {
                continue;
            }
            let limit =
                config.lookup(&domain, entries.iter().copied()).filter(|found| !found.limit.unlimited);
            let strategy = match limit
                .as_ref()
                .and_then(|found| Some((found.limit.per_unit(), found.limit.window_seconds()?)))
            {
                None => blanket(BlanketRule::AllowAll),
                Some((per_unit, window_s)) => {
                    let elapsed = usage
                        .time_elapsed
                        .map_or(0, |d| u64::try_from(d.seconds).unwrap_or(0).saturating_mul(1_000));
                    let reported = Usage {
                        allowed: usage.num_requests_allowed,
                        denied: usage.num_requests_denied,
                        elapsed_ms: elapsed,
                    };
                    let Some(share) =
                        self.quotas.share(holder.id, &key, (u64::from(per_unit), window_s), reported)
                    else {
                        continue;
                    };
                    tracing::debug!(holder = holder.id, bucket = %key.id, ?reported, share, "rlqs assignment");
                    token_bucket(share, window_s)
                }
            };
            holder.buckets.insert(key, (id.clone(), now_ms));
            actions.push(assignment(id, strategy, ttl));
        }
        Ok((!actions.is_empty()).then_some(RateLimitQuotaResponse { bucket_action: actions }))
    }

    /// The buckets `holder` has not reported for `rlqs.abandon_after_ms`,
    /// abandoned: forgotten here, and told to the Envoy.
    fn abandon(&self, holder: &mut Holder) -> Option<RateLimitQuotaResponse> {
        let after = self.quotas.settings().abandon_after_ms;
        let now_ms = self.quotas.now_ms();
        let mut actions = Vec::new();
        holder.buckets.retain(|_, (id, last)| {
            let keep = now_ms.saturating_sub(*last) < after;
            if !keep {
                actions.push(BucketAction {
                    bucket_id: Some(id.clone()),
                    bucket_action: Some(bucket_action::BucketAction::AbandonAction(AbandonAction {})),
                });
            }
            keep
        });
        (!actions.is_empty()).then_some(RateLimitQuotaResponse { bucket_action: actions })
    }
}

/// A bucket's entries (sorted by key) as one key: `key=value` joined by
/// `\u{1f}`.
fn bucket_key(entries: &[(&str, &str)]) -> Box<str> {
    let mut key = String::with_capacity(entries.iter().map(|(k, v)| k.len() + v.len() + 2).sum());
    for (i, (k, v)) in entries.iter().enumerate() {
        if i > 0 {
            key.push('\u{1f}');
        }
        key.push_str(k);
        key.push('=');
        key.push_str(v);
    }
    key.into_boxed_str()
}

fn blanket(rule: BlanketRule) -> RateLimitStrategy {
    RateLimitStrategy { strategy: Some(Strategy::BlanketRule(rule as i32)) }
}

/// A share of `share` requests per window of `window_s` seconds, as Envoy
/// enforces it: a token bucket, or none for a share of 0.
fn token_bucket(share: u64, window_s: u64) -> RateLimitStrategy {
    match strategy::bucket(share, window_s) {
        None => blanket(BlanketRule::DenyAll),
        Some(bucket) => RateLimitStrategy {
            strategy: Some(Strategy::TokenBucket(TokenBucket {
                max_tokens: bucket.max_tokens,
                tokens_per_fill: Some(bucket.tokens_per_fill),
                fill_interval: Some(prost_types::Duration {
                    seconds: i64::try_from(bucket.fill_interval_s).unwrap_or(i64::MAX),
                    nanos: 0,
                }),
            })),
        },
    }
}

fn assignment(id: BucketId, strategy: RateLimitStrategy, ttl_ms: u64) -> BucketAction {
    let ttl = Duration::from_millis(ttl_ms);
    let ttl = prost_types::Duration {
        seconds: i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(ttl.subsec_nanos()).unwrap_or(0),
    };
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(ttl),
            rate_limit_strategy: Some(strategy),
        })),
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for RlqsService {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        // A report of demand moves the limit other Envoys live under: only
        // a caller that may report streams one.
        if !super::check::may_report(request.extensions()) {
            return Err(Status::permission_denied("only grpc.reporting_peers report quota usage"));
        }
        let permit = Arc::clone(&self.streams)
            .try_acquire_owned()
            .map_err(|_| Status::resource_exhausted("rlqs.max_streams streams are open"))?;
        let holder = Holder {
            id: self.next_holder.fetch_add(1, Ordering::Relaxed),
            domain: None,
            buckets: HashMap::new(),
            _permit: permit,
        };
        let tick = (self.quotas.settings().abandon_after_ms / 2).clamp(100, 60_000);
        let mut interval = tokio::time::interval(Duration::from_millis(tick));
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let state = (request.into_inner(), holder, interval, self.clone());
        let answers = futures_util::stream::unfold(Some(state), |state| async move {
            let (mut reports, mut holder, mut interval, service) = state?;
            loop {
                tokio::select! {
                    message = reports.next() => match message {
                        None => return None,
                        Some(Err(status)) => return Some((Err(status), None)),
                        Some(Ok(message)) => match service.answer(&mut holder, message) {
                            Ok(None) => {}
                            Ok(Some(answer)) => {
                                return Some((Ok(answer), Some((reports, holder, interval, service))));
                            }
                            Err(status) => return Some((Err(status), None)),
                        },
                    },
                    _ = interval.tick() => {
                        if let Some(answer) = service.abandon(&mut holder) {
                            return Some((Ok(answer), Some((reports, holder, interval, service))));
                        }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(answers)))
    }
}
