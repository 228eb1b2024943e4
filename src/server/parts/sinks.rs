//! Where decisions go besides the answer: the dead-letter pipeline (file,
//! or spool and Kafka shipper) and the capture sink.

use std::{sync::Arc, time::Duration};

use super::Tasks;
use crate::server::ServerError;
use crate::{
    capture::{self, Capture, CaptureCounters},
    config::{Config, DlqConfig, LimitsConfig},
    dlq::{self, DlqSink, RecordBounds},
};

/// The dead-letter pipeline: the hot path's sink, and its writer tasks (the
/// file writer, or the spooler and the Kafka shipper).
pub(crate) fn dlq(
    config: &DlqConfig,
    limits: &LimitsConfig,
    tasks: &mut Tasks,
) -> Result<Arc<DlqSink>, ServerError> {
    let bounds = RecordBounds {
        resource_path_bytes: limits.max_resource_path_bytes,
        client_type_bytes: limits.max_client_type_bytes,
        headers: limits.max_headers,
        header_bytes: limits.max_header_bytes,
    };
    let (sink, queue, counters) = DlqSink::new(
        config.queue_capacity,
        config.queue_max_bytes,
        config.instance(),
        config.header_allowlist.clone(),
        bounds,
    );
    let fold_interval = Duration::from_millis(config.aggregate_interval_ms);
    let folds = Arc::new(dlq::fold::Folds::new(config.aggregate_interval_ms, config.aggregate_after));
    let sink = sink.with_folds(Arc::clone(&folds));
    let drain = || dlq::file::Drain::with_folds(Arc::clone(&folds), fold_interval);
    let Some(brokers) = &config.kafka.brokers else {
        let stop = tasks.stopper();
        let target = file_target(config)?;
        let sink = match &target {
            dlq::file::Target::File(file) => {
                tracing::info!(file = %file.path.display(), "failed decisions go to a JSON-lines file");
                let size = std::fs::metadata(&file.path).map_or(0, |m| m.len());
                counters.file_bytes.store(size, std::sync::atomic::Ordering::SeqCst);
                sink.with_disk_cap(file.max_bytes)
            }
            dlq::file::Target::Stderr => sink,
        };
        tasks.spawn(dlq::file::run(queue, target, counters, drain(), stop));
        return Ok(Arc::new(sink));
    };
    dlq_to_kafka(config, brokers, (sink, queue, counters), drain(), tasks)
}

#[cfg(not(feature = "kafka"))]
fn dlq_to_kafka(
    _config: &DlqConfig,
    _brokers: &str,
    _sink: (DlqSink, tokio::sync::mpsc::Receiver<dlq::FailureRecord>, Arc<dlq::DlqCounters>),
    _drain: dlq::file::Drain,
    _tasks: &mut Tasks,
) -> Result<Arc<DlqSink>, ServerError> {
    Err(ServerError::Kafka(super::NO_KAFKA.to_owned()))
}

/// Failed decisions to the dead-letter topic, through the spool.
#[cfg(feature = "kafka")]
fn dlq_to_kafka(
    config: &DlqConfig,
    brokers: &str,
    (sink, queue, counters): (
        DlqSink,
        tokio::sync::mpsc::Receiver<dlq::FailureRecord>,
        Arc<dlq::DlqCounters>,
    ),
    drain: dlq::file::Drain,
    tasks: &mut Tasks,
) -> Result<Arc<DlqSink>, ServerError> {
    let spool_dir = &config.spool_dir;
    let (writer, reader, spool) = dlq::spool::open(
        spool_dir,
        dlq::spool::SpoolSizes {
            segment_bytes: config.spool_segment_bytes,
            max_bytes: config.spool_max_bytes,
        },
    )
    .map_err(|e| ServerError::Spool(format!("{}: {e}", spool_dir.display())))?;
    let recovered = spool.pending();
    counters.recovered.store(recovered, std::sync::atomic::Ordering::SeqCst);
    if recovered > 0 {
        tracing::info!(records = recovered, spool = %spool_dir.display(), "delivering failure records a previous run left in the spool");
    }
    let kafka = &config.kafka;
    let producer =
        dlq::kafka::producer(brokers, &kafka.properties).map_err(|e| ServerError::Kafka(e.to_string()))?;
    tracing::info!(brokers = %brokers, topic = %kafka.topic, spool = %spool_dir.display(), "failed decisions go to Kafka through the spool");
    let notify = Arc::new(tokio::sync::Notify::new());
    let stop = tasks.stopper();
    tasks.spawn(dlq::kafka::run_spooler(
        queue,
        writer,
        Arc::clone(&spool),
        Arc::clone(&counters),
        Arc::clone(&notify),
        drain,
        stop,
    ));
    let shipper = dlq::kafka::Shipper {
        producer,
        topic: kafka.topic.clone(),
        undeliverable: spool_dir.join("undeliverable.jsonl"),
        undeliverable_max_bytes: config.spool_max_bytes,
        set_aside_logs: crate::folded::Folded::default(),
        counters,
        flush_timeout: Duration::from_millis(kafka.flush_timeout_ms),
    };
    let stop = tasks.stopper();
    tasks.spawn(dlq::kafka::run_shipper(shipper, reader, Arc::clone(&spool), notify, stop));
    Ok(Arc::new(sink.with_spool(spool).with_disk_cap(config.spool_max_bytes)))
}

/// The capture sink and its writer task, when `capture.sample_ratio` > 0.
pub(crate) fn capture(config: &Config, tasks: &mut Tasks) -> Result<Option<Captured>, ServerError> {
    let settings = &config.capture;
    if settings.sample_ratio <= 0.0 {
        return Ok(None);
    }
    let limits = &config.limits;
    let bounds = capture::Bounds {
        user_id_bytes: limits.max_user_id_bytes,
        resource_path_bytes: limits.max_resource_path_bytes,
        client_type_bytes: limits.max_client_type_bytes,
        // Replay does not read headers: 256 bytes each bounds the queue
        // (16,384 records of at most ~3 KB) without losing their gist.
        header_bytes: limits.max_header_bytes.min(256),
    };
    let (sink, queue, counters) = Capture::new(
        settings.sample_ratio,
        // Required with a ratio above 0 (validated).
        settings.salt.as_deref().unwrap_or_default(),
        settings.queue_capacity,
        &config.dlq.header_allowlist,
        bounds,
        config.dlq.instance(),
    );
    let stop = tasks.stopper();
    match &settings.kafka.brokers {
        #[cfg(feature = "kafka")]
        Some(brokers) => {
            let producer = capture::producer(brokers, &settings.kafka.properties)
                .map_err(|e| ServerError::Kafka(format!("capture.kafka: {e}")))?;
            tracing::info!(ratio = settings.sample_ratio, topic = %settings.kafka.topic, "capturing a sample of users' requests to Kafka");
            tasks.spawn(capture::run_kafka(
                queue,
                producer,
                settings.kafka.topic.clone(),
                Arc::clone(&counters),
                stop,
            ));
        }
        #[cfg(not(feature = "kafka"))]
        Some(_) => return Err(ServerError::Kafka(super::NO_KAFKA.to_owned())),
        None => {
            tracing::info!(ratio = settings.sample_ratio, file = %settings.file.display(), "capturing a sample of users' requests to a file");
            tasks.spawn(capture::run_file(
                queue,
                settings.file.clone(),
                settings.file_max_bytes,
                Arc::clone(&counters),
                stop,
            ));
        }
    }
    Ok(Some(Captured { sink: Arc::new(sink), counters }))
}

/// The capture sink the engine writes to and the counters `/metrics` reads.
#[derive(Debug)]
pub(crate) struct Captured {
    pub(crate) sink: Arc<Capture>,
    pub(crate) counters: Arc<CaptureCounters>,
}

/// Where the sink without Kafka writes: `dlq.file`, created now, so a place
/// that cannot be written is found at start rather than at the first
/// failure (when every record would be lost). A file set there stops the
/// start; the state directory's default falls back to standard error (a
/// read-only root filesystem without a volume: Envoy Gateway's Deployment),
/// with a warning naming the settings that keep records in a file.
fn file_target(config: &DlqConfig) -> Result<dlq::file::Target, ServerError> {
    if config.to_stderr() {
        tracing::info!("failed decisions go to standard error as JSON lines (dlq.file: -)");
        return Ok(dlq::file::Target::Stderr);
    }
    let file = dlq::file::FileTarget { path: config.file.clone(), max_bytes: config.file_max_bytes };
    match dlq::file::append_durably(&file.path, b"") {
        Ok(()) => Ok(dlq::file::Target::File(file)),
        Err(error) if config.file_is_default => {
            tracing::warn!(
                file = %file.path.display(),
                %error,
                "the state directory cannot be written: failed decisions go to standard error as JSON lines, \
                 kept only as long as the logs are; set dlq.file (or STATE_DIRECTORY) to a writable volume, \
                 or dlq.kafka.brokers, to keep them durably"
            );
            Ok(dlq::file::Target::Stderr)
        }
        Err(error) => Err(ServerError::DlqFile(file.path.display().to_string(), error)),
    }
}
