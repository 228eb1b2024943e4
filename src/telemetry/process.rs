//! The standard `process_*` families (as every Prometheus client library
//! names them: CPU seconds, resident and virtual memory, open and allowed
//! descriptors, start time), read from `/proc` at each scrape, and
//! `ratelimitd_build_info`. Off Linux only the build info is rendered.

use std::fmt::Write as _;

use super::exposition::{escape, header};

/// Appends the process families and the build info to `out`.
pub fn render(out: &mut String) {
    header(out, "ratelimitd_build_info", "gauge", "Always 1; the labels say which build answers.");
    let _ = writeln!(out, "ratelimitd_build_info{{version=\"{}\"}} 1", escape(env!("CARGO_PKG_VERSION")));
    #[cfg(target_os = "linux")]
    linux(out);
}

#[cfg(target_os = "linux")]
fn linux(out: &mut String) {
    let Ok(me) = procfs::process::Process::myself() else { return };
    if let Ok(stat) = me.stat() {
        let ticks = procfs::ticks_per_second() as f64;
        let cpu = (stat.utime + stat.stime) as f64 / ticks;
        gauge(
            out,
            "process_cpu_seconds_total",
            "counter",
            "User and system CPU time spent, in seconds.",
            cpu,
        );
        let rss = procfs::WithCurrentSystemInfo::get(stat.rss_bytes()) as f64;
        gauge(out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", rss);
        gauge(
            out,
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            stat.vsize as f64,
        );
        if let Ok(boot) = procfs::boot_time_secs() {
            let started = boot as f64 + stat.starttime as f64 / ticks;
            gauge(
                out,
                "process_start_time_seconds",
                "gauge",
                "Start time since the Unix epoch, in seconds.",
                started,
            );
        }
    }
    if let Ok(open) = me.fd_count() {
        gauge(out, "process_open_fds", "gauge", "Open file descriptors.", open as f64);
    }
    if let Ok(limits) = me.limits()
        && let procfs::process::LimitValue::Value(max) = limits.max_open_files.soft_limit
    {
        gauge(out, "process_max_fds", "gauge", "The open file descriptor limit (soft).", max as f64);
    }
}

#[cfg(target_os = "linux")]
fn gauge(out: &mut String, name: &str, kind: &str, help: &str, value: f64) {
    header(out, name, kind, help);
    let _ = writeln!(out, "{name} {value}");
}

#[cfg(test)]
mod tests {
    /// The families a Prometheus dashboard expects, with this process's
    /// own figures.
    #[test]
    fn process_families_describe_this_process() {
        let mut out = String::new();
        super::render(&mut out);
        let value = |name: &str| -> Option<f64> {
            out.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        };
        assert!(out.contains(&format!("ratelimitd_build_info{{version=\"{}\"", env!("CARGO_PKG_VERSION"))));
        if cfg!(target_os = "linux") {
            assert!(value("process_resident_memory_bytes").is_some_and(|rss| rss > 1e6), "{out}");
            assert!(value("process_open_fds").is_some_and(|fds| fds >= 3.0), "{out}");
            assert!(value("process_max_fds").is_some_and(|max| max >= 64.0), "{out}");
            assert!(value("process_cpu_seconds_total").is_some_and(|cpu| cpu >= 0.0), "{out}");
            let now =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
            let started = value("process_start_time_seconds").unwrap();
            assert!(started <= now + 1.0 && started > now - 86_400.0, "{started} vs {now}");
        }
    }
}
