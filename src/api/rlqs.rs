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
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
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
    clock::Clock,
    quota::{
        Asked, BucketKey, BucketLimit, Holding, Quotas, Recent, Usage,
        figures::{DomainFigures, milli_per_second},
        strategy,
    },
    rules::{Hot, envoy::EnvoyConfig},
};

/// The RLQS service.
#[derive(Clone)]
pub struct RlqsService {
    quotas: Arc<Quotas>,
    envoy: Arc<Hot<EnvoyConfig>>,
    streams: Arc<Semaphore>,
    instance: Arc<str>,
    next_holder: Arc<AtomicU64>,
    clock: Arc<dyn Clock>,
    draining: watch::Receiver<bool>,
}

impl std::fmt::Debug for RlqsService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RlqsService").field("instance", &self.instance).finish_non_exhaustive()
    }
}

/// What one stream keeps: its holder id, its domain (the first report's),
/// and each bucket it reported.
struct Holder {
    id: Arc<str>,
    domain: Option<Arc<str>>,
    buckets: HashMap<BucketKey, Reported>,
    /// Its domain's figures, from its first report.
    figures: Option<Arc<DomainFigures>>,
    /// Bucket reports it may still have answered now, and when that was
    /// reckoned (`rlqs.max_bucket_reports_per_second`).
    credit: (f64, tokio::time::Instant),
    _permit: OwnedSemaphorePermit,
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(figures) = &self.figures {
            let held = self.buckets.values().filter_map(|r| r.milli);
            let (buckets, milli) = held.fold((0, 0u64), |(n, sum), m| (n + 1, sum.saturating_add(m)));
            figures.stream_closed(buckets, milli);
        }
    }
}

/// A bucket a stream reported: its id, when it last did, and the share it
/// was last assigned with when that assignment ends.
struct Reported {
    id: BucketId,
    last_ms: u64,
    assigned: Option<(u64, u64)>,
    /// What it admitted in its recent reports.
    recent: Recent,
    /// The share in thousandths of a request per second, as the domain's
    /// figures count it; `None` for a bucket under no limit.
    milli: Option<u64>,
}

impl Holder {
    /// The share `key` is assigned on this stream at `now_ms`, if any.
    fn assigned(&self, key: &BucketKey, now_ms: u64) -> Option<u64> {
        let (share, until_ms) = self.buckets.get(key)?.assigned?;
        (now_ms < until_ms).then_some(share)
    }
}

/// One bucket of a report, its limit found.
struct Found {
    id: BucketId,
    key: BucketKey,
    /// Its limit, window (s), whether global, and the holder's report;
    /// `None`: unlimited, or under no rule.
    limited: Option<(BucketLimit, u64, bool, Holding)>,
    /// What the holder admitted in its recent reports, this one's added.
    recent: Recent,
}

/// The answers of one stream.
type Answers = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send + 'static>>;

impl RlqsService {
    /// Shares the limits of the Envoy rules `envoy` through `quotas`; the
    /// streams' holder ids start with `instance` (unique among the
    /// instances sharing a store).
    pub fn new(quotas: Arc<Quotas>, envoy: Arc<Hot<EnvoyConfig>>, instance: &str) -> Self {
        let streams = Arc::new(Semaphore::new(quotas.settings().max_streams));
        RlqsService {
            quotas,
            envoy,
            streams,
            instance: Arc::from(instance),
            next_holder: Arc::new(AtomicU64::new(1)),
            clock: Arc::new(crate::clock::SystemClock),
            // Never draining: the sender is gone.
            draining: watch::channel(false).1,
        }
    }

    /// The same service ending its streams once `draining` turns true (the
    /// server stops): their Envoys reconnect, to another instance, while
    /// their assignments live.
    pub fn with_draining(mut self, draining: watch::Receiver<bool>) -> Self {
        self.draining = draining;
        self
    }

    /// The tonic server.
    pub fn into_server(self) -> RateLimitQuotaServiceServer<Self> {
        RateLimitQuotaServiceServer::new(self)
    }

    /// The buckets of one message of `holder`'s stream, each with its
    /// limit and the holder's report of it.
    fn find(&self, holder: &Holder, domain: &Arc<str>, reports: RateLimitQuotaUsageReports) -> Vec<Found> {
        let config = self.envoy.load();
        let settings = self.quotas.settings();
        let now_ms = self.clock.now_ms();
        let mut found = Vec::with_capacity(reports.bucket_quota_usages.len());
        for usage in reports.bucket_quota_usages {
            let Some(id) = usage.bucket_id.filter(|id| !id.bucket.is_empty()) else { continue };
            let mut entries: Vec<(&str, &str)> =
                id.bucket.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            entries.sort_unstable();
            let key = BucketKey { domain: Arc::clone(domain), id: bucket_key(&entries) };
            let known = holder.buckets.contains_key(&key) || found.iter().any(|f: &Found| f.key == key);
            if !known && holder.buckets.len() + found.len() >= settings.max_buckets_per_stream {
                continue;
            }
            let limit = config.lookup(domain, entries.iter().copied()).filter(|found| !found.limit.unlimited);
            let mut recent = holder.buckets.get(&key).map(|r| r.recent.clone()).unwrap_or_default();
            let limited = limit.and_then(|found| {
                let (per_unit, window_s) = (found.limit.per_unit(), found.limit.window_seconds()?);
                let limit = BucketLimit::new(u64::from(per_unit), window_s);
                let elapsed_ms = usage
                    .time_elapsed
                    .map_or(0, |d| u64::try_from(d.seconds).unwrap_or(0).saturating_mul(1_000));
                let reported = Usage {
                    allowed: usage.num_requests_allowed,
                    denied: usage.num_requests_denied,
                    elapsed_ms,
                };
                let assigned = holder.assigned(&key, now_ms);
                let admitted = recent.add(now_ms, (reported.allowed, elapsed_ms), assigned, limit.window_ms);
                let holding = reported.holding(assigned, admitted, limit.window_ms);
                Some((limit, window_s, found.limit.global, holding))
            });
            found.push(Found { id, key, limited, recent });
        }
        found
    }

    /// The answer to one message of `holder`'s stream: an assignment for
    /// each bucket it reports that it may hold.
    async fn answer(
        &self,
        holder: &mut Holder,
        reports: RateLimitQuotaUsageReports,
    ) -> Result<Option<RateLimitQuotaResponse>, Status> {
        let domain = match &holder.domain {
            Some(domain) => Arc::clone(domain),
            None if reports.domain.is_empty() => {
                return Err(Status::invalid_argument("domain: the stream's first report must name it"));
            }
            None => {
                let known = self.envoy.load().has_domain(&reports.domain);
                let figures = self.quotas.figures().domain(&reports.domain, known);
                figures.stream_opened();
                holder.figures = Some(figures);
                Arc::clone(holder.domain.insert(Arc::from(reports.domain.as_str())))
            }
        };
        let figures = holder.figures.clone().unwrap_or_default();
        let found = self.find(holder, &domain, reports);
        let shares = self.shares(&holder.id, &found).await;
        let ttl = self.quotas.settings().assignment_ttl_ms;
        let now_ms = self.clock.now_ms();
        let mut shares = shares.into_iter();
        let mut actions = Vec::with_capacity(found.len());
        for Found { id, key, limited, recent } in found {
            figures.reported(limited.is_none());
            let previous = holder.buckets.get(&key);
            if previous.and_then(|r| r.assigned).is_some_and(|(_, until_ms)| until_ms <= now_ms) {
                figures.expired();
            }
            let was = previous.and_then(|r| r.milli);
            let (strategy, assigned, milli) = match limited {
                None => (blanket(BlanketRule::AllowAll), None, None),
                Some((_, window_s, _, holding)) => {
                    let Some(share) = shares.next().flatten() else {
                        figures.unanswered();
                        if let Some(reported) = holder.buckets.get_mut(&key) {
                            (reported.last_ms, reported.recent) = (now_ms, recent);
                        }
                        continue;
                    };
                    tracing::debug!(holder = %holder.id, bucket = %key.id, ?holding, share, "rlqs assignment");
                    let until_ms = now_ms.saturating_add(ttl);
                    (
                        token_bucket(share, window_s),
                        Some((share, until_ms)),
                        Some(milli_per_second(share, window_s)),
                    )
                }
            };
            figures.assigned(was, milli);
            holder.buckets.insert(key, Reported { id: id.clone(), last_ms: now_ms, assigned, milli, recent });
            actions.push(assignment(id, strategy, ttl));
        }
        Ok((!actions.is_empty()).then_some(RateLimitQuotaResponse { bucket_action: actions }))
    }

    /// [`RlqsService::answer`] once the stream may be answered `message`'s
    /// buckets (`rlqs.max_bucket_reports_per_second`, a burst of
    /// `rlqs.max_buckets_per_stream`): until then the stream is not read.
    async fn paced(
        &self,
        holder: &mut Holder,
        message: RateLimitQuotaUsageReports,
    ) -> Result<Option<RateLimitQuotaResponse>, Status> {
        let settings = self.quotas.settings();
        let (rate, burst) =
            (settings.max_bucket_reports_per_second as f64, settings.max_buckets_per_stream as f64);
        let (credit, at) = holder.credit;
        let now = tokio::time::Instant::now();
        let mut credit = (credit + rate * now.duration_since(at).as_secs_f64()).min(burst);
        let cost = message.bucket_quota_usages.len() as f64;
        if credit < cost {
            // What accrues while it waits is exactly what it lacks.
            tokio::time::sleep(Duration::from_secs_f64((cost - credit) / rate)).await;
            credit = cost;
        }
        holder.credit = (credit - cost, tokio::time::Instant::now());
        self.answer(holder, message).await
    }

    /// The shares of the `found` buckets under a limit, in order, for the
    /// holder `id`: `None` for those not answered.
    async fn shares(&self, id: &Arc<str>, found: &[Found]) -> Vec<Option<u64>> {
        let asked: Vec<Asked<'_>> = found
            .iter()
            .filter_map(|f| {
                let (limit, _, global, holding) = f.limited?;
                Some(Asked { key: &f.key, limit, global, holding })
            })
            .collect();
        self.quotas.shares(id, &asked).await.unwrap_or_else(|error| {
            // No answer: the Envoy's assignments live out their time to
            // live, counted as held in the store meanwhile.
            let domain = asked.first().map(|a| &a.key.domain);
            tracing::warn!(?domain, %error, "rlqs: the store did not answer; no assignments renewed");
            vec![None; asked.len()]
        })
    }

    /// The buckets `holder` has not reported for `rlqs.abandon_after_ms`,
    /// abandoned: forgotten here, and told to the Envoy.
    fn abandon(&self, holder: &mut Holder) -> Option<RateLimitQuotaResponse> {
        let after = self.quotas.settings().abandon_after_ms;
        let now_ms = self.clock.now_ms();
        let mut actions = Vec::new();
        let figures = holder.figures.clone().unwrap_or_default();
        holder.buckets.retain(|_, reported| {
            let keep = now_ms.saturating_sub(reported.last_ms) < after;
            if !keep {
                figures.assigned(reported.milli, None);
                actions.push(BucketAction {
                    bucket_id: Some(reported.id.clone()),
                    bucket_action: Some(bucket_action::BucketAction::AbandonAction(AbandonAction {})),
                });
            }
            keep
        });
        (!actions.is_empty()).then_some(RateLimitQuotaResponse { bucket_action: actions })
    }
}

/// Resolves true once `draining` is, false if it never can be (its
/// sender is gone).
async fn until_draining(draining: &mut watch::Receiver<bool>) -> bool {
    loop {
        if *draining.borrow_and_update() {
            return true;
        }
        if draining.changed().await.is_err() {
            return false;
        }
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
        let number = self.next_holder.fetch_add(1, Ordering::Relaxed);
        let burst = self.quotas.settings().max_buckets_per_stream;
        let holder = Holder {
            id: Arc::from(format!("{}/{number}", self.instance)),
            domain: None,
            buckets: HashMap::new(),
            figures: None,
            credit: (burst as f64, tokio::time::Instant::now()),
            _permit: permit,
        };
        let tick = (self.quotas.settings().abandon_after_ms / 2).clamp(100, 60_000);
        let mut interval = tokio::time::interval(Duration::from_millis(tick));
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let state = (request.into_inner(), holder, interval, self.clone(), self.draining.clone());
        let answers = futures_util::stream::unfold(Some(state), |state| async move {
            let (mut reports, mut holder, mut interval, service, mut draining) = state?;
            loop {
                tokio::select! {
                    // The server stops: the stream ends (OK).
                    true = until_draining(&mut draining) => return None,
                    message = reports.next() => match message {
                        None => return None,
                        Some(Err(status)) => return Some((Err(status), None)),
                        Some(Ok(message)) => match service.paced(&mut holder, message).await {
                            Ok(None) => {}
                            Ok(Some(answer)) => {
                                return Some((Ok(answer), Some((reports, holder, interval, service, draining))));
                            }
                            Err(status) => return Some((Err(status), None)),
                        },
                    },
                    _ = interval.tick() => {
                        if let Some(answer) = service.abandon(&mut holder) {
                            return Some((Ok(answer), Some((reports, holder, interval, service, draining))));
                        }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(answers)))
    }
}
