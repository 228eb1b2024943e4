//! What the target process spends while the load runs, read from
//! `/proc/PID`: CPU time (`stat`), and over all its threads the context
//! switches (`task/*/status`, voluntary and not) and the moves between
//! CPUs (`task/*/sched`, `se.nr_migrations`): a thread woken from sleep
//! costs a switch, and a wake-up on another core a migration.

use anyhow::Context as _;

/// The target's use of the machine so far.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Usage {
    /// User + system CPU time, in seconds.
    pub(crate) cpu: f64,
    /// The system part of it (the kernel working for it: system calls,
    /// loopback TCP run in the sender's context), in seconds.
    pub(crate) system: f64,
    /// Context switches of its threads.
    pub(crate) switches: u64,
    /// Moves of its threads between CPUs (0 where the kernel keeps no
    /// scheduler statistics).
    pub(crate) migrations: u64,
}

impl Usage {
    /// `pid`'s usage now.
    pub(crate) fn of(pid: u32) -> anyhow::Result<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .with_context(|| format!("/proc/{pid}/stat"))?;
        // Fields after the command name, which is in parentheses and may contain spaces.
        let after = stat.rsplit_once(')').context("malformed stat")?.1;
        let fields: Vec<&str> = after.split_whitespace().collect();
        let user: u64 = fields.get(11).context("utime")?.parse()?;
        let system: u64 = fields.get(12).context("stime")?.parse()?;
        // USER_HZ is 100.
        let mut usage =
            Usage { cpu: (user + system) as f64 / 100.0, system: system as f64 / 100.0, ..Usage::default() };
        let tasks =
            std::fs::read_dir(format!("/proc/{pid}/task")).with_context(|| format!("/proc/{pid}/task"))?;
        for task in tasks.flatten() {
            // A thread may end between the listing and the read.
            if let Ok(status) = std::fs::read_to_string(task.path().join("status")) {
                usage.switches += field(&status, "voluntary_ctxt_switches:")
                    + field(&status, "nonvoluntary_ctxt_switches:");
            }
            if let Ok(sched) = std::fs::read_to_string(task.path().join("sched")) {
                usage.migrations += field(&sched, "se.nr_migrations");
            }
        }
        Ok(usage)
    }

    /// What was used between `before` and `self`.
    pub(crate) fn since(self, before: Usage) -> Usage {
        Usage {
            cpu: self.cpu - before.cpu,
            system: self.system - before.system,
            switches: self.switches.saturating_sub(before.switches),
            migrations: self.migrations.saturating_sub(before.migrations),
        }
    }
}

/// The number after `name` on its line of `text` (`name: 12`, `name   :   12`); 0 if absent.
fn field(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| rest.trim_start_matches([' ', '\t', ':']).trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_of_status_and_sched_parse() {
        assert_eq!(field("Name:\tx\nvoluntary_ctxt_switches:\t17\n", "voluntary_ctxt_switches:"), 17);
        assert_eq!(
            field(
                "se.nr_migrations                             :                    42\n",
                "se.nr_migrations"
            ),
            42
        );
        assert_eq!(field("", "se.nr_migrations"), 0);
    }

    #[test]
    fn this_process_has_used_something() {
        let usage = Usage::of(std::process::id()).unwrap();
        assert!(usage.switches > 0, "{usage:?}");
    }
}
