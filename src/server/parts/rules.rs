//! The rule sets the engine decides with: from files, the rules topic or
//! xDS, each hot-swapped by its reloader or subscriber; and the tenant
//! table, hot-reloaded the same way.

use std::{path::PathBuf, sync::Arc, time::Duration};

use super::Tasks;
use crate::rules::XdsState;
use crate::server::ServerError;
use crate::{
    config::{Config, EnvoySettings, OverloadConfig, RulesConfig, RulesSource},
    rules::{
        self, Feed, Hot, RuleErrors, RuleStore, envoy::EnvoyConfig, limitador::Limits, tenants::Tenants,
    },
};

/// The compiled rules the engine decides with.
#[derive(Debug)]
pub(crate) struct Rules {
    /// Native rules.
    pub(crate) native: Arc<RuleStore>,
    /// Where they come from, for logs: a path, or the embedded set.
    pub(crate) native_source: String,
    /// The Envoy configuration, when `rules.envoy_path` is set (always
    /// with `rules.source: kafka` or `xds`).
    pub(crate) envoy: Option<Arc<Hot<EnvoyConfig>>>,
    /// limitador's limits, when `rules.limitador_path` is set.
    pub(crate) limitador: Option<Arc<Hot<Limits>>>,
    /// What the rules topic feeds, with `rules.source: kafka`.
    pub(crate) feed: Option<Arc<Feed>>,
    /// The xDS subscription, with `rules.source: xds`.
    pub(crate) xds: Option<Arc<XdsState>>,
    /// What the status reports say beside the rules, with `rules.source: kafka`.
    pub(crate) vitals: Option<crate::rollout::status::VitalsSource>,
}

/// The rules: from files ([`rules`]), from the rules topic
/// ([`subscribed_rules`]), or native from files and Envoy's over xDS
/// ([`xds_rules`]).
pub(crate) fn rules_of(config: &Config, tasks: &mut Tasks) -> Result<Rules, ServerError> {
    match config.rules.source {
        RulesSource::Files => rules(&config.rules, &config.envoy, tasks),
        #[cfg(feature = "kafka")]
        RulesSource::Kafka => Ok(subscribed_rules(config, tasks)),
        // The configuration refuses it in a build without Kafka.
        #[cfg(not(feature = "kafka"))]
        RulesSource::Kafka => Err(ServerError::Kafka(super::NO_KAFKA.to_owned())),
        RulesSource::Xds => xds_rules(config, tasks),
    }
}

/// `rules.source: xds`: native rules as from files, and an Envoy
/// configuration with no domain until the subscription swaps in the first.
pub(crate) fn xds_rules(config: &Config, tasks: &mut Tasks) -> Result<Rules, ServerError> {
    let files = RulesConfig { envoy_path: None, ..config.rules.clone() };
    let mut rules = rules(&files, &config.envoy, tasks)?;
    if config.rules.path.is_none() {
        rules.native = Arc::new(RuleStore::new(rules::empty()));
        rules.native_source = "none (rules.path unset, Envoy rules over xDS only)".to_owned();
    }
    // Before anything serves: a TLS file that does not load is fatal.
    crate::api::xds::endpoint(&config.rules.xds).map_err(ServerError::Xds)?;
    let envoy = Arc::new(Hot::new(EnvoyConfig::default()));
    let state = Arc::new(XdsState::default());
    tracing::info!(
        server = %config.rules.xds.server_url,
        node = %config.rules.xds.node_id,
        force_start = config.rules.xds.force_start,
        "Envoy rules come over xDS"
    );
    let stop = tasks.stopper();
    tasks.spawn(crate::api::xds::run(
        config.rules.xds.clone(),
        crate::api::xds::Accept { how: config.envoy.compile(), allow_empty: config.rules.allow_empty },
        Arc::clone(&envoy),
        Arc::clone(&state),
        stop,
    ));
    rules.envoy = Some(envoy);
    rules.xds = Some(state);
    Ok(rules)
}

/// `rules.source: kafka`: empty rule sets until the subscription swaps in
/// the first snapshot (or the fallback files), its subscriber, and its
/// status reporter.
#[cfg(feature = "kafka")]
pub(crate) fn subscribed_rules(config: &Config, tasks: &mut Tasks) -> Rules {
    use crate::rollout::{
        status,
        subscribe::{self, Fallback, Subscription},
    };
    let native = Arc::new(RuleStore::new(rules::empty()));
    let envoy = Arc::new(Hot::new(EnvoyConfig::default()));
    let feed = Arc::new(Feed::default());
    let kafka = &config.rules.kafka;
    tracing::info!(
        brokers = kafka.brokers.as_deref().unwrap_or_default(),
        topic = %kafka.topic,
        "rules come from the rules topic; not ready until the first snapshot"
    );
    // With rules.limitador_path, ShouldRateLimit answers with the records' limitador limits.
    let limitador = config.rules.limitador_path.as_ref().map(|_| Arc::new(Hot::new(Limits::default())));
    let subscription = Subscription {
        kafka: kafka.clone(),
        compile: config.compilers(),
        allow_empty: config.rules.allow_empty,
        trust: config.rules_trust(),
        native: Arc::clone(&native),
        envoy: Arc::clone(&envoy),
        limitador: limitador.clone(),
        feed: Arc::clone(&feed),
        fallback: Fallback {
            native: config.rules.path.clone(),
            envoy: config.rules.envoy_path.clone(),
            limitador: config.rules.limitador_path.clone(),
        },
    };
    let stop = tasks.stopper();
    tasks.spawn(subscribe::run(subscription, stop));
    let stop = tasks.stopper();
    let instance = format!("{}@{}", config.dlq.instance(), config.grpc_addr().port());
    let vitals = status::VitalsSource::default();
    let reporter = status::run_reporter(
        kafka.clone(),
        instance,
        Arc::clone(&feed),
        Arc::clone(&native),
        Arc::clone(&envoy),
        vitals.clone(),
        stop,
    );
    tasks.spawn(reporter);
    Rules {
        native,
        native_source: format!("kafka topic {}", kafka.topic),
        envoy: Some(envoy),
        limitador,
        feed: Some(feed),
        xds: None,
        vitals: Some(vitals),
    }
}

/// Loads the native rules (`rules.path`; unset: the embedded set, or none
/// when only Envoy rules are configured) and the Envoy configuration, and
/// spawns their reloaders.
pub(crate) fn rules(
    config: &RulesConfig,
    envoy: &EnvoySettings,
    tasks: &mut Tasks,
) -> Result<Rules, ServerError> {
    let form = config.path_matching;
    let allow_empty = config.allow_empty;
    // One function loads at start and on every change: an emptied file is
    // refused either way (`rules.allow_empty`).
    let load_native = move |path: &std::path::Path| {
        rules::load(path, form).and_then(|set| rules::non_empty(set, path, allow_empty))
    };
    let other = config.envoy_path.as_ref().or(config.limitador_path.as_ref());
    let (native, native_source) = match (&config.path, other) {
        (Some(path), _) => (load_native(path)?, path.display().to_string()),
        (None, None) if config.examples => (rules::embedded(form)?, rules::EMBEDDED_SOURCE.to_owned()),
        (None, None) if config.source == crate::config::RulesSource::Files => {
            return Err(ServerError::NoRules);
        }
        (None, None) => (rules::empty(), "none (rules.path unset, rules.examples off)".to_owned()),
        (None, Some(_)) if config.limitador_path.is_some() => {
            (rules::empty(), "none (rules.path unset, limitador limits only)".to_owned())
        }
        (None, Some(_)) => (rules::empty(), "none (rules.path unset, Envoy rules only)".to_owned()),
    };
    let native = Arc::new(RuleStore::new(native));
    let interval = Duration::from_millis(config.reload_interval_ms);
    if let Some(path) = &config.path {
        watch(tasks, &native, path, interval, load_native);
    }
    let envoy = match &config.envoy_path {
        None => None,
        Some(path) => {
            let how = envoy.compile();
            let load = move |path: &std::path::Path| {
                rules::envoy::load(path, how).and_then(|set| rules::non_empty(set, path, allow_empty))
            };
            let loaded = load(path)?;
            tracing::info!(
                path = %path.display(),
                domains = loaded.domain_count(),
                version = loaded.version(),
                algorithm = ?envoy.algorithm,
                "serving envoy.service.ratelimit.v3.RateLimitService"
            );
            let hot = Arc::new(Hot::new(loaded));
            watch(tasks, &hot, path, interval, load);
            Some(hot)
        }
    };
    let limitador = limitador(config, interval, tasks)?;
    Ok(Rules { native, native_source, envoy, limitador, feed: None, xds: None, vitals: None })
}

/// limitador's limits, when `rules.limitador_path` is set, watched.
fn limitador(
    config: &RulesConfig,
    interval: Duration,
    tasks: &mut Tasks,
) -> Result<Option<Arc<Hot<Limits>>>, ServerError> {
    let Some(path) = &config.limitador_path else { return Ok(None) };
    let (allow_empty, algorithm) = (config.allow_empty, config.limitador_algorithm);
    let load = move |path: &std::path::Path| {
        Limits::load(path, algorithm).and_then(|set| rules::non_empty(set, path, allow_empty))
    };
    let loaded = load(path)?;
    tracing::info!(
        path = %path.display(),
        limits = rules::Versioned::size(&loaded),
        version = rules::Versioned::version(&loaded),
        "serving limitador's limits over envoy.service.ratelimit.v3.RateLimitService"
    );
    let hot = Arc::new(Hot::new(loaded));
    watch(tasks, &hot, path, interval, load);
    Ok(Some(hot))
}

fn watch<T: rules::Versioned>(
    tasks: &mut Tasks,
    hot: &Arc<Hot<T>>,
    path: &std::path::Path,
    interval: Duration,
    load: impl Fn(&std::path::Path) -> Result<T, RuleErrors> + Send + Sync + 'static,
) {
    if !interval.is_zero() {
        let stop = tasks.stopper();
        tasks.spawn(rules::watch(Arc::clone(hot), PathBuf::from(path), interval, load, stop));
    }
}

/// The tenant table (`overload.tenants_path`), hot-reloaded; `None`: not
/// configured.
pub(crate) fn tenants(
    settings: &OverloadConfig,
    tasks: &mut Tasks,
) -> Result<Option<Arc<Hot<Tenants>>>, ServerError> {
    let Some(path) = &settings.tenants_path else { return Ok(None) };
    let table = Arc::new(Hot::new(rules::tenants::load(path)?));
    watch(tasks, &table, path, Duration::from_millis(settings.reload_interval_ms), rules::tenants::load);
    Ok(Some(table))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules_config(path: Option<PathBuf>, envoy_path: Option<PathBuf>) -> RulesConfig {
        RulesConfig { path, envoy_path, reload_interval_ms: 0, ..RulesConfig::default() }
    }
    #[test]
    fn rules_default_to_the_embedded_set_and_to_none_beside_envoy() {
        let mut tasks = Tasks::new();
        let envoy = EnvoySettings::default();
        let embedded = rules(&rules_config(None, None), &envoy, &mut tasks).unwrap();
        assert!(!embedded.native.load().rules().is_empty());
        assert!(embedded.envoy.is_none());

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("envoy.yaml");
        std::fs::write(
            &file,
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, requests_per_unit: 1 }\n",
        )
        .unwrap();
        let envoy_only = rules(&rules_config(None, Some(file)), &envoy, &mut tasks).unwrap();
        assert!(envoy_only.native.load().rules().is_empty(), "no native rules beside Envoy's");
        assert_eq!(envoy_only.envoy.unwrap().load().domain_count(), 1);

        let missing = rules(&rules_config(Some(dir.path().join("absent")), None), &envoy, &mut tasks);
        assert!(matches!(missing, Err(ServerError::Rules(_))));
    }
}
