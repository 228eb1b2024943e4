//! The dead-letter pipeline's figures for `/metrics`
//! (`telemetry::Figures`): its accounting (`enqueued + recovered =
//! delivered + pending + dropped`), drops by reason, and its byte caps.

use std::fmt::Write as _;

use super::{DlqSink, DropReason};
use crate::telemetry::exposition::{Figures, header};

impl Figures for DlqSink {
    fn render(&self, out: &mut String) {
        let dlq = self.stats();
        for (name, help, value) in [
            ("ratelimitd_dlq_enqueued_total", "Failure records offered by the decision path.", dlq.enqueued),
            (
                "ratelimitd_dlq_delivered_total",
                "Failure records durably written (file) or acknowledged (Kafka).",
                dlq.delivered,
            ),
            (
                "ratelimitd_dlq_recovered_total",
                "Failure records found in the spool at startup.",
                dlq.recovered,
            ),
            (
                "ratelimitd_dlq_folded_total",
                "Failed decisions folded into aggregate records (dlq.aggregate_after) instead of records of their own.",
                self.folded(),
            ),
        ] {
            header(out, name, "counter", help);
            let _ = writeln!(out, "{name} {value}");
        }
        header(out, "ratelimitd_dlq_dropped_total", "counter", "Failure records lost, by reason.");
        for reason in DropReason::ALL {
            let _ = writeln!(
                out,
                "ratelimitd_dlq_dropped_total{{reason=\"{}\"}} {}",
                reason.as_str(),
                self.dropped_by(reason)
            );
        }
        let (queue_max, disk_max) = self.byte_caps();
        for (name, help, value) in [
            (
                "ratelimitd_dlq_pending",
                "Failure records waiting in the queue, the writer or the spool.",
                dlq.pending,
            ),
            ("ratelimitd_dlq_queue_bytes", "Bytes of failure records in the queue.", dlq.queued_bytes),
            ("ratelimitd_dlq_queue_max_bytes", "The queue's byte cap (dlq.queue_max_bytes).", queue_max),
            (
                "ratelimitd_dlq_disk_bytes",
                "Bytes on disk: the file sink's file, or the spool.",
                dlq.disk_bytes,
            ),
            (
                "ratelimitd_dlq_disk_max_bytes",
                "The byte cap of that file or spool (dlq.file_max_bytes, dlq.spool_max_bytes).",
                disk_max,
            ),
        ] {
            header(out, name, "gauge", help);
            let _ = writeln!(out, "{name} {value}");
        }
    }
}
