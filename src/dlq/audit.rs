//! `ratelimitd audit`: reads the dead-letter topic (or a JSON-lines file)
//! from the beginning to its end as of the start of the command, filters,
//! prints a table or JSON lines, and ends with a summary by kind and rule.
//!
//! Kafka is read with `assign()` on every partition of the topic, from the
//! low to the high watermark taken at start: no consumer group is joined and
//! no offset is committed, so other consumers are not disturbed. Records
//! stream through; only the summary (bounded by kinds × rules) is kept.

use std::{
    collections::BTreeMap,
    fs::File,
    io::{self, BufRead, BufReader, Write},
    path::Path,
};

use super::record::{FailureRecord, parse_time};

/// Which records to show.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this user.
    pub user: Option<String>,
    /// Only this rule.
    pub rule: Option<String>,
    /// Only this failure kind.
    pub kind: Option<String>,
    /// Only records at or after this time (ms since the epoch).
    pub since_ms: Option<u64>,
    /// Only records before this time (ms since the epoch).
    pub until_ms: Option<u64>,
}

impl Filter {
    /// Whether `record` passes.
    pub fn matches(&self, record: &FailureRecord) -> bool {
        let time = record.time_ms();
        self.user.as_deref().is_none_or(|u| u == record.request.user_id)
            && self.rule.as_deref().is_none_or(|r| r == record.rule_id)
            && self.kind.as_deref().is_none_or(|k| k == record.failure.kind)
            && self.since_ms.is_none_or(|since| time.is_some_and(|t| t >= since))
            && self.until_ms.is_none_or(|until| time.is_some_and(|t| t < until))
    }
}

/// `2h`, `30m`, `1d` ago from `now_ms`, or an RFC 3339 time.
pub fn parse_when(text: &str, now_ms: u64) -> Result<u64, String> {
    if let Some(ms) = parse_time(text) {
        return Ok(ms);
    }
    let ago = humantime::parse_duration(text)
        .map_err(|_| format!("{text:?} is neither a duration like 2h or 30m nor an RFC 3339 time"))?;
    Ok(now_ms.saturating_sub(u64::try_from(ago.as_millis()).unwrap_or(u64::MAX)))
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns, summary below.
    Table,
    /// One record per line as stored; summary on stderr.
    Json,
}

/// Counts of what was read and shown.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Summary {
    /// Records read from the source.
    pub read: u64,
    /// Records that passed the filter.
    pub matched: u64,
    /// Lines that were not records (file source only).
    pub unreadable: u64,
    /// Matched records by failure kind.
    pub by_kind: BTreeMap<String, u64>,
    /// Matched records by rule.
    pub by_rule: BTreeMap<String, u64>,
    /// Failed decisions the matched records stand for (an aggregate
    /// record stands for its `count`).
    pub decisions: u64,
    /// Those decisions by the answer given (FAIL_OPEN, LOCAL_OK, ...).
    pub by_answer: BTreeMap<String, u64>,
}

/// Why an audit could not run.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// The file cannot be read.
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: String,
        /// The I/O error.
        source: io::Error,
    },
    /// Kafka refused or the topic is missing.
    #[error("{0}")]
    Kafka(String),
    /// Writing the output failed (a closed pipe).
    #[error("output: {0}")]
    Output(#[from] io::Error),
}

/// Prints matching records and accumulates the summary.
#[derive(Debug)]
pub struct Printer<W: Write> {
    out: W,
    format: Format,
    filter: Filter,
    summary: Summary,
    header_done: bool,
}

impl<W: Write> Printer<W> {
    /// A printer writing to `out`.
    pub fn new(out: W, format: Format, filter: Filter) -> Self {
        Printer { out, format, filter, summary: Summary::default(), header_done: false }
    }

    fn record(&mut self, record: &FailureRecord, raw: &str) -> io::Result<()> {
        self.summary.read += 1;
        if !self.filter.matches(record) {
            return Ok(());
        }
        let s = &mut self.summary;
        s.matched += 1;
        let count = record.count.max(1);
        s.decisions += count;
        *s.by_kind.entry(record.failure.kind.clone()).or_default() += count;
        *s.by_rule.entry(record.rule_id.clone()).or_default() += count;
        *s.by_answer.entry(record.answer.reason.clone()).or_default() += count;
        match self.format {
            Format::Json => writeln!(self.out, "{}", raw.trim_end()),
            Format::Table => {
                if !self.header_done {
                    writeln!(
                        self.out,
                        "{:<24}  {:<26}  {:<18}  {:<20}  {:<16}  {:>6}  {:<24}  PATH",
                        "TIME", "EVENT_ID", "KIND", "RULE", "ANSWER", "COUNT", "USER"
                    )?;
                    self.header_done = true;
                }
                writeln!(
                    self.out,
                    "{:<24}  {:<26}  {:<18}  {:<20}  {:<16}  {:>6}  {:<24}  {}",
                    record.time,
                    record.event_id,
                    record.failure.kind,
                    record.rule_id,
                    record.answer.reason,
                    record.count,
                    record.request.user_id,
                    record.request.resource_path
                )
            }
        }
    }

    /// Prints the summary (stdout for a table, `err` for JSON) and returns it.
    pub fn finish(mut self, err: &mut impl Write) -> io::Result<Summary> {
        let s = &self.summary;
        let mut text = format!("{} of {} records matched", s.matched, s.read);
        if s.unreadable > 0 {
            text += &format!(" ({} unreadable lines skipped)", s.unreadable);
        }
        if s.decisions != s.matched {
            text += &format!(", standing for {} failed decisions", s.decisions);
        }
        // FAIL_OPEN and FAIL_CLOSED always; the local answers when present.
        let answered = |reason: &str| s.by_answer.get(reason).copied().unwrap_or(0);
        text += &format!(
            "; answered FAIL_OPEN {}, FAIL_CLOSED {}",
            answered("FAIL_OPEN"),
            answered("FAIL_CLOSED")
        );
        for (reason, count) in
            s.by_answer.iter().filter(|(r, _)| !matches!(r.as_str(), "FAIL_OPEN" | "FAIL_CLOSED"))
        {
            text += &format!(", {reason} {count}");
        }
        text += "\n";
        for (title, counts) in [("by kind", &s.by_kind), ("by rule", &s.by_rule)] {
            if !counts.is_empty() {
                text += &format!("{title}:\n");
                for (name, count) in counts {
                    text += &format!("  {name:<24} {count}\n");
                }
            }
        }
        match self.format {
            Format::Table => {
                if s.matched > 0 {
                    writeln!(self.out)?;
                }
                self.out.write_all(text.as_bytes())?;
            }
            Format::Json => err.write_all(text.as_bytes())?,
        }
        self.out.flush()?;
        Ok(self.summary)
    }
}

/// Audits a JSON-lines file (the file sink's, or a copy of the topic);
/// `-`: standard input (a container's log, where records written to
/// standard error sit among log lines, which count as unreadable).
pub fn from_file<W: Write>(path: &Path, printer: &mut Printer<W>) -> Result<(), AuditError> {
    let file_error = |source| AuditError::File { path: path.display().to_string(), source };
    let reader: Box<dyn BufRead> = if path.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(BufReader::new(File::open(path).map_err(file_error)?))
    };
    for line in reader.lines() {
        let line = line.map_err(file_error)?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<FailureRecord>(&line) {
            Ok(record) => printer.record(&record, &line)?,
            Err(_) => printer.summary.unreadable += 1,
        }
    }
    Ok(())
}

/// Fails: this build has no Kafka (cargo feature `kafka`).
#[cfg(not(feature = "kafka"))]
pub fn from_kafka<W: Write>(
    _brokers: &str,
    _topic: &str,
    _properties: &BTreeMap<String, String>,
    _printer: &mut Printer<W>,
) -> Result<(), AuditError> {
    Err(AuditError::Kafka("this build has no Kafka support (cargo feature `kafka`)".to_owned()))
}

/// Audits `topic`: every partition from its low to its high watermark as of now.
#[cfg(feature = "kafka")]
pub fn from_kafka<W: Write>(
    brokers: &str,
    topic: &str,
    properties: &BTreeMap<String, String>,
    printer: &mut Printer<W>,
) -> Result<(), AuditError> {
    let group = format!("ratelimitd-audit-{}", std::process::id());
    // An output error (a closed pipe) stops the read and is reported as such.
    let mut output: Option<io::Error> = None;
    let read = crate::kafka::read_topic(brokers, properties, topic, &group, |message| {
        let Some(payload) = message.payload else { return Ok(()) };
        let text = String::from_utf8_lossy(payload);
        match serde_json::from_str::<FailureRecord>(&text) {
            Ok(record) => printer.record(&record, &text).map_err(|e| {
                output = Some(e);
                String::new()
            }),
            Err(_) => {
                printer.summary.unreadable += 1;
                Ok(())
            }
        }
    });
    match (read, output) {
        (_, Some(e)) => Err(e.into()),
        (Err(e), None) => Err(AuditError::Kafka(e)),
        (Ok(()), None) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dlq::record::*;

    fn record(user: &str, rule: &str, kind: &str, ms: u64, allowed: bool) -> FailureRecord {
        FailureRecord {
            schema_version: SCHEMA_VERSION,
            event_id: format!("{ms:026}"),
            time: format_time(ms),
            instance: "i".to_owned(),
            request: RecordRequest {
                user_id: user.to_owned(),
                resource_path: "/p".to_owned(),
                client_type: None,
                priority: "DEGRADED".to_owned(),
                weight: 1,
                counting: "admission".to_owned(),
                headers: Default::default(),
            },
            rule_id: rule.to_owned(),
            failure: RecordFailure { kind: kind.to_owned(), message: "m".to_owned() },
            answer: RecordAnswer {
                allowed,
                reason: if allowed { "FAIL_OPEN" } else { "FAIL_CLOSED" }.to_owned(),
            },
            trace_id: None,
            count: 1,
            last_time: None,
        }
    }

    #[test]
    fn filters_combine() {
        let r = record("alice", "search", "timeout", 10_000, true);
        assert!(Filter::default().matches(&r));
        assert!(
            Filter { user: Some("alice".into()), rule: Some("search".into()), ..Default::default() }
                .matches(&r)
        );
        assert!(!Filter { user: Some("bob".into()), ..Default::default() }.matches(&r));
        assert!(!Filter { kind: Some("connection_refused".into()), ..Default::default() }.matches(&r));
        assert!(Filter { since_ms: Some(10_000), until_ms: Some(10_001), ..Default::default() }.matches(&r));
        assert!(!Filter { until_ms: Some(10_000), ..Default::default() }.matches(&r), "until is exclusive");
    }

    #[test]
    fn when_is_a_duration_ago_or_a_time() {
        assert_eq!(parse_when("2h", 10 * 3_600_000), Ok(8 * 3_600_000));
        assert_eq!(parse_when("30m", 3_600_000), Ok(1_800_000));
        assert_eq!(parse_when("2026-11-21T06:23:25.123Z", 0), Ok(1_795_242_205_123));
        assert!(parse_when("yesterday-ish", 0).unwrap_err().contains("yesterday-ish"));
    }

    #[test]
    fn table_and_summary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dlq.jsonl");
        let records = [
            record("alice", "search", "timeout", 1_000, true),
            record("bob", "search", "connection_refused", 2_000, false),
            record("alice", "export", "timeout", 3_000, true),
        ];
        let mut text = crate::dlq::file::to_json_lines(&records);
        text.extend_from_slice(b"not a record\n");
        std::fs::write(&path, text).unwrap();

        let mut out = Vec::new();
        let mut printer = Printer::new(
            &mut out,
            Format::Table,
            Filter { user: Some("alice".into()), ..Default::default() },
        );
        from_file(&path, &mut printer).unwrap();
        let summary = printer.finish(&mut io::sink()).unwrap();
        assert_eq!((summary.read, summary.matched, summary.unreadable), (3, 2, 1));
        assert_eq!(summary.by_kind, BTreeMap::from([("timeout".to_owned(), 2)]));
        assert_eq!(summary.by_rule.len(), 2);
        let out = String::from_utf8(out).unwrap();
        assert!(out.starts_with("TIME"), "{out}");
        assert!(out.contains("2 of 3 records matched (1 unreadable lines skipped)"), "{out}");
        assert_eq!(out.lines().filter(|l| l.contains("alice")).count(), 2, "{out}");
    }

    #[test]
    fn json_output_is_the_stored_lines_and_summary_goes_to_stderr() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dlq.jsonl");
        std::fs::write(&path, crate::dlq::file::to_json_lines(&[record("a", "r", "timeout", 1, true)]))
            .unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut printer = Printer::new(&mut out, Format::Json, Filter::default());
        from_file(&path, &mut printer).unwrap();
        printer.finish(&mut err).unwrap();
        let parsed: FailureRecord = serde_json::from_slice(&out).unwrap();
        assert_eq!(parsed.request.user_id, "a");
        assert!(String::from_utf8(err).unwrap().starts_with("1 of 1 records matched"));
    }
}
