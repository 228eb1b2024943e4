//! CPU utilization the service can use, as a fraction 0..1.
//!
//! [`Source::Process`] (the default) measures the service's own use, so a
//! neighbour's load never sheds its traffic: with a cgroup v2 CPU quota
//! (`cpu.max` other than `max`), the cgroup's CPU time (`cpu.stat`
//! `usage_usec`) against the quota (a container using 70% of its quota
//! reads 0.70 even on an idle host); without one, the process's own CPU time
//! (`<procfs>/self/stat` utime + stime) against the CPUs its affinity mask
//! allows (`<procfs>/self/status` `Cpus_allowed_list`), over the same
//! wall-clock interval. [`Source::Host`] is the host's busy share from
//! `<procfs>/stat`, only when configured (`shed.source: host`).
//!
//! Raw samples are smoothed by an exponentially weighted moving average so a
//! single spike does not flip levels. The roots are configurable so tests
//! feed synthetic files; time comes from an injected monotonic clock.

use std::{
    fs,
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::clock::Clock;

/// Why a reading failed. The sampler keeps the last value and reports a
/// failure once until a reading succeeds again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct SampleError {
    /// The file that could not be used.
    pub path: PathBuf,
    /// What was wrong with it.
    pub message: String,
}

/// What utilization measures (`shed.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The service's own CPU use: its cgroup against the quota when there
    /// is one, else the process against the CPUs of its affinity mask.
    #[default]
    Process,
    /// The whole host's busy share (`/proc/stat`), neighbours included.
    Host,
}

/// Clock ticks per second of `/proc/<pid>/stat` times (`USER_HZ`, fixed at
/// 100 by the kernel's ABI on the architectures Linux runs services on).
const USER_HZ: u64 = 100;

/// One raw reading of cumulative counters.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Reading {
    /// `/proc/stat` aggregate line, in jiffies.
    Host { busy: u64, total: u64 },
    /// cgroup v2: CPU time used, when, and the quota in CPUs.
    Cgroup { usage_usec: u64, at_ms: u64, quota_cpus: f64 },
    /// This process: CPU time in `USER_HZ` ticks, when, and the CPUs its
    /// affinity mask allows.
    Process { ticks: u64, at_ms: u64, cpus: f64 },
}

/// Reads and smooths utilization.
#[derive(Debug)]
pub struct Sampler {
    source: Source,
    procfs_root: PathBuf,
    cgroup_root: PathBuf,
    clock: Arc<dyn Clock>,
    /// Weight of a new sample in the moving average (0 < alpha <= 1).
    alpha: f64,
    last: Option<Reading>,
    smoothed: Option<f64>,
}

impl Sampler {
    /// A sampler of `source`, reading `<procfs_root>/stat` (host),
    /// `<procfs_root>/self/{stat,status}` (process) and
    /// `<cgroup_root>/cpu.{max,stat}`.
    pub fn new(
        source: Source,
        procfs_root: &Path,
        cgroup_root: &Path,
        alpha: f64,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Sampler {
            source,
            procfs_root: procfs_root.to_path_buf(),
            cgroup_root: cgroup_root.to_path_buf(),
            clock,
            alpha,
            last: None,
            smoothed: None,
        }
    }

    /// The smoothed utilization so far, if any interval has been measured.
    pub fn utilization(&self) -> Option<f64> {
        self.smoothed
    }

    /// Takes one reading. Returns the new smoothed utilization when this
    /// reading completes an interval, `Ok(None)` when it only starts one
    /// (first reading, a switch between cgroup and host, or no time passed).
    pub fn sample(&mut self) -> Result<Option<f64>, SampleError> {
        let reading = self.read()?;
        let previous = self.last.replace(reading);
        let Some(raw) = previous.and_then(|p| interval_utilization(p, reading)) else {
            return Ok(None);
        };
        let smoothed = match self.smoothed {
            Some(s) => s + self.alpha * (raw - s),
            None => raw,
        };
        self.smoothed = Some(smoothed);
        Ok(Some(smoothed))
    }

    fn read(&self) -> Result<Reading, SampleError> {
        if self.source == Source::Host {
            let path = self.procfs_root.join("stat");
            return parse_proc_stat(&read(&path)?).map_err(|m| error(&path, m));
        }
        match self.cgroup_quota()? {
            Some(quota_cpus) => {
                let path = self.cgroup_root.join("cpu.stat");
                let text = read(&path)?;
                let usage_usec = text
                    .lines()
                    .find_map(|l| l.strip_prefix("usage_usec "))
                    .and_then(|v| v.trim().parse().ok())
                    .ok_or_else(|| error(&path, "no numeric usage_usec line"))?;
                Ok(Reading::Cgroup { usage_usec, at_ms: self.clock.now_ms(), quota_cpus })
            }
            None => {
                let stat = self.procfs_root.join("self/stat");
                let ticks = parse_self_stat(&read(&stat)?).map_err(|m| error(&stat, m))?;
                let status = self.procfs_root.join("self/status");
                let cpus = parse_cpus_allowed(&read(&status)?).map_err(|m| error(&status, m))?;
                Ok(Reading::Process { ticks, at_ms: self.clock.now_ms(), cpus: cpus as f64 })
            }
        }
    }

    /// The quota in CPUs from `cpu.max` (`<quota> <period>`), or `None` when
    /// there is no such file or no limit (`max`).
    fn cgroup_quota(&self) -> Result<Option<f64>, SampleError> {
        let path = self.cgroup_root.join("cpu.max");
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(error(&path, &e.to_string())),
        };
        let mut fields = text.split_whitespace();
        match (fields.next(), fields.next()) {
            (Some("max"), _) => Ok(None),
            (Some(quota), Some(period)) => {
                let quota: f64 = quota.parse().map_err(|_| error(&path, "quota is not a number"))?;
                let period: f64 = period.parse().map_err(|_| error(&path, "period is not a number"))?;
                if quota <= 0.0 || period <= 0.0 {
                    return Err(error(&path, "quota and period must be positive"));
                }
                Ok(Some(quota / period))
            }
            _ => Err(error(&path, "expected \"<quota> <period>\" or \"max <period>\"")),
        }
    }
}

fn interval_utilization(previous: Reading, now: Reading) -> Option<f64> {
    let raw = match (previous, now) {
        (Reading::Host { busy: b0, total: t0 }, Reading::Host { busy: b1, total: t1 }) => {
            let total = t1.checked_sub(t0).filter(|&t| t > 0)?;
            let busy = b1.saturating_sub(b0);
            busy as f64 / total as f64
        }
        (
            Reading::Cgroup { usage_usec: u0, at_ms: a0, .. },
            Reading::Cgroup { usage_usec: u1, at_ms: a1, quota_cpus },
        ) => {
            let elapsed_usec = a1.checked_sub(a0).filter(|&e| e > 0)? * 1_000;
            u1.saturating_sub(u0) as f64 / (elapsed_usec as f64 * quota_cpus)
        }
        (Reading::Process { ticks: t0, at_ms: a0, .. }, Reading::Process { ticks: t1, at_ms: a1, cpus }) => {
            let elapsed_ms = a1.checked_sub(a0).filter(|&e| e > 0)?;
            let used_ms = t1.saturating_sub(t0) * (1_000 / USER_HZ);
            used_ms as f64 / (elapsed_ms as f64 * cpus)
        }
        _ => return None,
    };
    Some(raw.clamp(0.0, 1.0))
}

/// Busy and total jiffies from the aggregate `cpu` line of `/proc/stat`:
/// user nice system idle iowait irq softirq steal (guest time is already
/// inside user and nice). Idle and iowait are not busy.
fn parse_proc_stat(text: &str) -> Result<Reading, &'static str> {
    let line = text.lines().find(|l| l.starts_with("cpu ")).ok_or("no aggregate \"cpu\" line")?;
    let values: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|_| "non-numeric field in the \"cpu\" line")?;
    if values.len() < 4 {
        return Err("fewer than 4 fields in the \"cpu\" line");
    }
    let total: u64 = values.iter().sum();
    let idle = values[3] + values.get(4).copied().unwrap_or(0);
    Ok(Reading::Host { busy: total - idle, total })
}

/// utime + stime (ticks) from `/proc/self/stat`. The command name in
/// parentheses may hold spaces or parentheses: fields are counted after the
/// last `)`, where field 3 (state) comes first and utime, stime are 14, 15.
fn parse_self_stat(text: &str) -> Result<u64, &'static str> {
    let rest = text.rsplit_once(')').ok_or("no \"(comm)\" field")?.1;
    let mut fields = rest.split_whitespace().skip(11);
    let mut next =
        || fields.next().and_then(|f| f.parse::<u64>().ok()).ok_or("no numeric utime/stime fields");
    Ok(next()? + next()?)
}

/// The number of CPUs in `Cpus_allowed_list:` (`0-3,6,8-9`) of
/// `/proc/self/status`.
fn parse_cpus_allowed(text: &str) -> Result<u64, &'static str> {
    let list = text
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .ok_or("no Cpus_allowed_list line")?
        .trim();
    let mut count = 0;
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        let (first, last): (u64, u64) = (
            first.trim().parse().map_err(|_| "non-numeric CPU in Cpus_allowed_list")?,
            last.trim().parse().map_err(|_| "non-numeric CPU in Cpus_allowed_list")?,
        );
        count += last.checked_sub(first).ok_or("a descending CPU range in Cpus_allowed_list")? + 1;
    }
    if count == 0 { Err("an empty Cpus_allowed_list") } else { Ok(count) }
}

fn read(path: &Path) -> Result<String, SampleError> {
    fs::read_to_string(path).map_err(|e| error(path, &e.to_string()))
}

fn error(path: &Path, message: &str) -> SampleError {
    SampleError { path: path.to_path_buf(), message: message.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    struct Files {
        proc: tempfile::TempDir,
        cgroup: tempfile::TempDir,
        clock: Arc<ManualClock>,
    }

    impl Files {
        fn new() -> Self {
            Files {
                proc: tempfile::tempdir().unwrap(),
                cgroup: tempfile::tempdir().unwrap(),
                clock: Arc::new(ManualClock::new(0)),
            }
        }

        fn sampler(&self, alpha: f64) -> Sampler {
            self.sampler_of(Source::Host, alpha)
        }

        fn sampler_of(&self, source: Source, alpha: f64) -> Sampler {
            Sampler::new(
                source,
                self.proc.path(),
                self.cgroup.path(),
                alpha,
                Arc::clone(&self.clock) as Arc<dyn Clock>,
            )
        }

        fn host(&self, busy: u64, idle: u64) {
            // user nice system idle iowait irq softirq steal guest guest_nice
            let text = format!(
                "cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 {busy} 0 0 {idle} 0 0 0 0 0 0\nintr 1 2 3\n"
            );
            fs::write(self.proc.path().join("stat"), text).unwrap();
        }

        fn cgroup(&self, max: &str, usage_usec: u64) {
            fs::write(self.cgroup.path().join("cpu.max"), max).unwrap();
            fs::write(
                self.cgroup.path().join("cpu.stat"),
                format!("usage_usec {usage_usec}\nuser_usec 0\nsystem_usec 0\n"),
            )
            .unwrap();
        }

        fn process(&self, ticks: u64, cpus: &str) {
            fs::create_dir_all(self.proc.path().join("self")).unwrap();
            // A command name with spaces and a parenthesis, as a process may have.
            let stat = format!(
                "4242 (rate limit) d) S 1 4242 4242 0 -1 4194560 1 0 0 0 {} {} 0 0 20 0 9 0\n",
                ticks / 2,
                ticks - ticks / 2
            );
            fs::write(self.proc.path().join("self/stat"), stat).unwrap();
            fs::write(
                self.proc.path().join("self/status"),
                format!("Name:\tratelimitd\nCpus_allowed:\tff\nCpus_allowed_list:\t{cpus}\n"),
            )
            .unwrap();
        }
    }

    /// The default measures the process itself: 1.5 CPU-seconds in one
    /// second on 4 allowed CPUs is 0.375, while the host reads fully busy.
    #[test]
    fn process_utilization_is_its_own_cpu_time_over_its_allowed_cpus() {
        let f = Files::new();
        let mut s = f.sampler_of(Source::Process, 1.0);
        f.host(0, 0);
        f.process(1_000, "0-1,4,6");
        assert_eq!(s.sample().unwrap(), None);
        f.host(1_000_000, 0); // a neighbour keeps every core busy
        f.clock.advance(1_000);
        f.process(1_150, "0-1,4,6");
        let u = s.sample().unwrap().unwrap();
        assert!((u - 0.375).abs() < 1e-9, "{u}");
        // Host only when asked for.
        let mut host = f.sampler_of(Source::Host, 1.0);
        f.host(2_000_000, 0);
        host.sample().unwrap();
        f.host(2_000_100, 0);
        assert_eq!(host.sample().unwrap(), Some(1.0));
    }

    #[test]
    fn self_stat_and_cpu_lists_parse_or_say_why() {
        assert_eq!(parse_self_stat("1 (a) b) S 1 1 1 0 -1 0 0 0 0 0 7 5 0 0\n"), Ok(12));
        assert!(parse_self_stat("no parenthesis").is_err());
        assert!(parse_self_stat("1 (a) S 1").is_err());
        assert_eq!(parse_cpus_allowed("Cpus_allowed_list:\t0-3,8,10-11\n"), Ok(7));
        assert!(parse_cpus_allowed("Cpus_allowed_list:\t3-1\n").is_err());
        assert!(parse_cpus_allowed("Cpus_allowed_list:\t\n").is_err());
        assert!(parse_cpus_allowed("Name: x\n").is_err());
    }

    #[test]
    fn host_utilization_is_busy_over_total_jiffies() {
        let f = Files::new();
        let mut s = f.sampler(1.0);
        f.host(1_000, 9_000);
        assert_eq!(s.sample().unwrap(), None, "the first reading only starts an interval");
        f.host(1_070, 9_030);
        assert_eq!(s.sample().unwrap(), Some(0.70));
    }

    #[test]
    fn iowait_counts_as_idle() {
        assert_eq!(
            parse_proc_stat("cpu  10 20 30 400 50 6 7 8 9 10\n").unwrap(),
            Reading::Host { busy: 81, total: 531 }
        );
    }

    /// A cgroup at 70% of a 2-CPU quota reads 0.70 although the host's
    /// /proc/stat says it is idle.
    #[test]
    fn quota_limited_cgroup_reads_against_its_quota() {
        let f = Files::new();
        let mut s = f.sampler_of(Source::Process, 1.0);
        f.host(0, 1_000_000);
        f.cgroup("200000 100000\n", 5_000_000);
        assert_eq!(s.sample().unwrap(), None);
        f.host(0, 2_000_000); // the host stays idle
        f.clock.advance(1_000);
        f.cgroup("200000 100000\n", 5_000_000 + 1_400_000); // 1.4 CPU-seconds in 1 s of 2 CPUs
        let u = s.sample().unwrap().unwrap();
        assert!((u - 0.70).abs() < 1e-9, "{u}");
    }

    #[test]
    fn unlimited_cgroup_falls_back_to_the_process() {
        let f = Files::new();
        let mut s = f.sampler_of(Source::Process, 1.0);
        f.cgroup("max 100000\n", 0);
        f.process(0, "0-1");
        s.sample().unwrap();
        f.clock.advance(2_000);
        f.process(100, "0-1"); // 1 CPU-second in 2 s of 2 CPUs
        assert_eq!(s.sample().unwrap(), Some(0.25));
    }

    #[test]
    fn moving_average_damps_a_single_spike() {
        let f = Files::new();
        let mut s = f.sampler(0.3);
        let (mut busy, mut idle) = (0, 0);
        f.host(busy, idle);
        s.sample().unwrap();
        for _ in 0..20 {
            busy += 30;
            idle += 70;
            f.host(busy, idle);
            s.sample().unwrap();
        }
        assert!((s.utilization().unwrap() - 0.30).abs() < 1e-9);
        busy += 100; // one interval at 100%
        f.host(busy, idle);
        let after_spike = s.sample().unwrap().unwrap();
        assert!(after_spike < 0.60, "one spike reached {after_spike}");
    }

    #[test]
    fn missing_or_malformed_files_are_errors_not_panics() {
        let f = Files::new();
        let mut s = f.sampler(1.0);
        let err = s.sample().unwrap_err();
        assert!(err.path.ends_with("stat"), "{err}");
        for bad in ["", "cpu  a b c d\n", "cpu  1 2\n", "intr 1\n"] {
            fs::write(f.proc.path().join("stat"), bad).unwrap();
            assert!(s.sample().is_err(), "{bad:?} accepted");
        }
        for bad in ["", "fifty 100000", "0 100000", "50000"] {
            f.cgroup(bad, 0);
            assert!(s.sample().is_err(), "cpu.max {bad:?} accepted");
        }
        fs::write(f.cgroup.path().join("cpu.max"), "50000 100000").unwrap();
        fs::write(f.cgroup.path().join("cpu.stat"), "user_usec 1\n").unwrap();
        assert!(s.sample().is_err());
        // After errors, a good pair of readings works again.
        fs::remove_file(f.cgroup.path().join("cpu.max")).unwrap();
        f.host(0, 10);
        s.sample().unwrap();
        f.host(5, 15);
        assert_eq!(s.sample().unwrap(), Some(0.5));
    }

    #[test]
    fn counters_going_backwards_or_standing_still_give_no_sample() {
        let f = Files::new();
        let mut s = f.sampler(1.0);
        f.host(100, 100);
        s.sample().unwrap();
        assert_eq!(s.sample().unwrap(), None, "no time passed");
        f.host(10, 10);
        assert_eq!(s.sample().unwrap(), None, "counters reset");
    }
}
