//! Every Lua script the service runs on a Redis store, in one place, each
//! named with its Rust twin (the function a twin test runs beside it on
//! the same inputs), and the one way to call them: by SHA (`EVALSHA`),
//! and when the server does not know it (NOSCRIPT, told by the error's
//! kind: a restart, a failover, a new cluster node) once more with each
//! script's first call carrying its text (`EVAL`), which the server keeps
//! for the calls after it. No other module builds `EVAL` or `EVALSHA`.

use std::sync::OnceLock;

use redis::{Cmd, ErrorKind, Pipeline, RedisError, ServerErrorKind, Value, aio::ConnectionLike};

/// A script: its name (for errors), its text and, once asked, its SHA.
#[derive(Debug)]
pub struct Script {
    name: &'static str,
    text: &'static str,
    sha: OnceLock<String>,
}

impl Script {
    const fn new(name: &'static str, text: &'static str) -> Self {
        Script { name, text, sha: OnceLock::new() }
    }

    /// Its name, as errors and logs give it.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Its text.
    pub fn text(&self) -> &'static str {
        self.text
    }

    /// Its SHA-1, the name `EVALSHA` calls it by.
    pub fn sha(&self) -> &str {
        self.sha.get_or_init(|| redis::Script::new(self.text).get_hash().to_owned())
    }

    /// A call of it by its SHA; the caller adds the number of keys, the
    /// keys and the arguments.
    pub fn call(&'static self) -> Call {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.sha());
        Call { script: self, cmd }
    }

    /// `SCRIPT LOAD` of its text on `conn` (to every primary of a cluster),
    /// so the first call by SHA finds it.
    pub async fn load<C: ConnectionLike>(&self, conn: &mut C) -> Result<(), RedisError> {
        // Sent as it is: `redis::Script` would hash the text again each time
        // (the readiness probe loads the decision script at every probe).
        redis::cmd("SCRIPT").arg("LOAD").arg(self.text).query_async::<String>(conn).await.map(drop)
    }
}

/// One call of a script: `EVALSHA`, its keys and arguments (added through
/// [`std::ops::DerefMut`] as to any command).
#[derive(Debug, Clone)]
pub struct Call {
    script: &'static Script,
    cmd: Cmd,
}

impl Call {
    /// The script it calls.
    pub fn script(&self) -> &'static Script {
        self.script
    }

    /// The command as sent by SHA.
    pub fn by_sha(&self) -> &Cmd {
        &self.cmd
    }

    /// The same call carrying the script's text (`EVAL`).
    pub fn by_text(&self) -> Cmd {
        let mut eval = redis::cmd("EVAL");
        eval.arg(self.script.text);
        for arg in self.cmd.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                eval.arg(bytes);
            }
        }
        eval
    }
}

impl std::ops::Deref for Call {
    type Target = Cmd;
    fn deref(&self) -> &Cmd {
        &self.cmd
    }
}

impl std::ops::DerefMut for Call {
    fn deref_mut(&mut self) -> &mut Cmd {
        &mut self.cmd
    }
}

/// Whether the server answered that it does not know a script (by the
/// error's kind, never its text).
pub fn unknown(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// `calls` as one pipeline; with `text`, each script's first call
/// carrying its text.
fn pipeline(calls: &[Call], text: bool) -> Pipeline {
    let mut pipeline = redis::pipe();
    let mut sent: Vec<&'static str> = Vec::new();
    for call in calls {
        if text && !sent.contains(&call.script.name) {
            sent.push(call.script.name);
            pipeline.add_command(call.by_text());
        } else {
            pipeline.add_command(call.cmd.clone());
        }
    }
    pipeline
}

/// Runs `calls` in one pipeline on `conn` (one round trip; on NOSCRIPT a
/// second, the first call of each script carrying its text): each call's
/// answer, in order.
pub async fn run<C: ConnectionLike>(conn: &mut C, calls: &[Call]) -> Result<Vec<Value>, RedisError> {
    match pipeline(calls, false).query_async(conn).await {
        Err(error) if unknown(&error) => pipeline(calls, true).query_async(conn).await,
        answered => answered,
    }
}

/// The decision script (`decide_batch.lua`): a batch of jobs, each its
/// counters decided all or nothing, in order. Twin: the Rust arithmetic of
/// `limiter::window` and `limiter::bucket` (`Seen::verdict`), which checks
/// every answer (`redis_store.rs`'s twin tests).
pub static DECIDE_BATCH: Script = Script::new("decide_batch", include_str!("decide_batch.lua"));

/// A region's lease report to the coordination store (`lease.lua`). Twin:
/// `limiter::lease::allocate` (`redis_store.rs::the_lease_script_is_the_twin_of_allocate`).
pub static LEASE: Script =
    Script::new("lease", concat!(include_str!("fair_shares.lua"), include_str!("lease.lua")));

/// An Envoy's report of an RLQS bucket (`quota.lua`). Twin:
/// `quota::allot` (`rlqs.rs::the_quota_script_is_the_twin_of_allot`).
pub static QUOTA: Script =
    Script::new("quota", concat!(include_str!("fair_shares.lua"), include_str!("quota.lua")));

/// An instance's exchange with its region's store (`region.lua`): tallies,
/// the agent role, the grants. Twin: `global::regional`'s in-process
/// exchange.
pub static REGION: Script = Script::new("region", include_str!("region.lua"));

/// An instance's word that it applied a version of the grants
/// (`applied.lua`).
pub static APPLIED: Script = Script::new("applied", include_str!("applied.lua"));

/// One step of the adaptive limits (`adapt.lua`). Twin:
/// `limiter::adaptive::exchange` (`adaptive.rs::the_script_is_the_twin_of_exchange`).
pub static ADAPT: Script = Script::new("adapt", include_str!("adapt.lua"));

/// `ratelimitd migrate`'s compare-and-set of the key-schema version.
pub static SCHEMA_SWAP: Script = Script::new(
    "schema_swap",
    "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]) return 1 end return 0",
);

#[cfg(test)]
mod tests {
    use super::*;

    /// A command's words.
    fn words(cmd: &Cmd) -> Vec<Vec<u8>> {
        cmd.args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => Vec::new(),
            })
            .collect()
    }

    #[test]
    fn a_call_by_text_is_the_call_by_sha_with_the_text_in_place_of_the_sha() {
        let mut call = ADAPT.call();
        call.arg(1).arg("key").arg(7);
        let (by_sha, by_text) = (words(call.by_sha()), words(&call.by_text()));
        assert_eq!(by_sha[0], b"EVALSHA");
        assert_eq!(by_sha[1], ADAPT.sha().as_bytes());
        assert_eq!(ADAPT.sha().len(), 40);
        assert_eq!(by_text[0], b"EVAL");
        assert_eq!(by_text[1], ADAPT.text().as_bytes());
        assert_eq!(by_text[2..], by_sha[2..]);
    }

    #[test]
    fn a_retry_carries_each_scripts_text_once() {
        let calls = [LEASE.call(), LEASE.call(), APPLIED.call()];
        let text = pipeline(&calls, true);
        let firsts: Vec<Vec<u8>> = text.cmd_iter().map(|c| words(c).swap_remove(0)).collect();
        assert_eq!(firsts, [b"EVAL".to_vec(), b"EVALSHA".to_vec(), b"EVAL".to_vec()]);
    }
}
