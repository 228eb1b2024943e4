//! The script call: how jobs are encoded as one `decide_batch.lua` call
//! (declared keys for one slot, inline keys with one `MGET` per slot for
//! several), and how its flat reply is split back into each job's answer.

use redis::{
    RedisError, Value,
    cluster_async::ClusterConnection,
    cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr},
};

use super::{Job, fail_all};
use crate::limiter::{
    Count, FailureKind, Seen, StoreError,
    bucket::MAX_DEBT,
    scripts,
    window::{Algorithm, Counts, WindowParams, max_count, position},
};

/// The parameters a counter shares with every counter of its rule: window
/// (ticks), capacity, tick (ms), flags (algorithm code + 8 if shadow + 16 ×
/// count code + 64 when the counter's clock follows + 128 when a refund's
/// window follows), rate, the counter's clock in ticks (a calendar
/// period's; sent only with flag 64) and the window a refund gives back to
/// (sent only with flag 128). A script call sends each distinct spec once.
pub(super) type Spec = [u64; 7];

/// The flag of a spec whose counter's clock follows its rate.
pub(super) const OWN_CLOCK: u64 = 64;

/// The flag of a spec that gives its weight back to the window that follows.
pub(super) const REFUND: u64 = 128;

/// One counter's script arguments: its spec and the request's weight.
#[derive(Debug, Clone, Copy)]
pub(super) struct KeyArgs {
    pub(super) spec: Spec,
    pub(super) weight: u64,
}

/// The flags argument of a counter: its algorithm's code, plus 8 when
/// shadow, plus 16 times how it counts ([`Count::code`]).
pub(super) fn flags(params: WindowParams, shadow: bool, count: Count) -> u64 {
    params.algorithm.code() | (u64::from(shadow) << 3) | (count.code() << 4)
}

impl KeyArgs {
    /// Its algorithm, from the flags ([`flags`]).
    pub(super) fn algorithm(&self) -> Algorithm {
        Algorithm::ALL[(self.spec[3] & 7) as usize]
    }
}

/// How many values the script answers for a counter of `algorithm`:
/// whether it fits, then a bucket's debt, or a window's current count and
/// its previous count (a first-hit window: its start, in ticks).
pub(super) fn answer_len(algorithm: Algorithm) -> usize {
    if algorithm.is_bucket() { 2 } else { 3 }
}

/// What the script answered for one counter (`values`, [`answer_len`] of
/// them): whether it fits, and what it saw, checked against the
/// counter's parameters. A window's elapsed ticks follow from `now`, the
/// counter's clock in ticks (Redis' clock, which the script's answer
/// starts with, over the tick; or the one the spec sent), and, for a
/// first-hit window, its start, as the script derives them.
pub(super) fn seen_of(values: &[u64], now: u64, params: WindowParams) -> Result<(bool, Seen), StoreError> {
    let seen = match (params.algorithm.is_bucket(), values) {
        (true, &[_, debt]) => {
            if debt > MAX_DEBT {
                return Err(script_error(format!("debt {debt} beyond the largest debt {MAX_DEBT}")));
            }
            Seen::Bucket { debt }
        }
        (false, &[_, current, start]) if params.algorithm == Algorithm::FirstHitWindow => {
            let elapsed = now.saturating_sub(start);
            if current > max_count(params.window_ms) || elapsed >= params.window_ms {
                return Err(script_error(format!("count {current} from tick {start} at tick {now}")));
            }
            Seen::Window { counts: Counts { current, previous: 0 }, elapsed }
        }
        (false, &[_, current, previous]) => {
            let max = max_count(params.window_ms);
            if current > max || previous > max {
                return Err(script_error(format!(
                    "counts {current}, {previous} beyond the largest count {max}"
                )));
            }
            let (_, elapsed) = position(now, params.window_ms);
            Seen::Window { counts: Counts { current, previous }, elapsed }
        }
        _ => return Err(script_error(format!("script answered {} values for one counter", values.len()))),
    };
    Ok((values[0] == 1, seen))
}

/// The distinct specs of one script call, in order of first use: the
/// script parses each once, and a key names its spec by position (1-based).
#[derive(Debug, Default)]
pub(super) struct Specs {
    pub(super) list: Vec<Spec>,
    /// Position of each spec, once there are too many to search in order
    /// (a batch spanning many rules).
    pub(super) index: Option<std::collections::HashMap<Spec, usize>>,
}

impl Specs {
    /// Specs searched in order below this many; a map from there on.
    const LINEAR: usize = 8;

    /// The 1-based position of `spec`, added when new.
    pub(super) fn position(&mut self, spec: Spec) -> usize {
        if let Some(index) = &mut self.index {
            let next = self.list.len() + 1;
            let at = *index.entry(spec).or_insert(next);
            if at == next {
                self.list.push(spec);
            }
            return at;
        }
        if let Some(at) = self.list.iter().position(|s| *s == spec) {
            return at + 1;
        }
        self.list.push(spec);
        if self.list.len() == Self::LINEAR {
            self.index = Some(self.list.iter().enumerate().map(|(i, s)| (*s, i + 1)).collect());
        }
        self.list.len()
    }
}

/// Where one script call goes.
pub(super) enum Target<'a> {
    /// One server (plain or the master Sentinel names).
    Server(&'a mut redis::aio::MultiplexedConnection),
    /// A cluster, routed by the call's declared keys (all in one slot).
    Slot(&'a mut ClusterConnection),
    /// A cluster: the primary serving `slot`, with the keys of its other
    /// slots inline.
    Node(&'a mut ClusterConnection, u16),
}

impl Target<'_> {
    pub(super) async fn query(&mut self, call: &redis::Cmd) -> Result<Value, RedisError> {
        match self {
            Target::Server(conn) => call.query_async(*conn).await,
            Target::Slot(conn) => call.query_async(*conn).await,
            Target::Node(conn, slot) => {
                let route = Route::new(*slot, SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
                conn.route_command(call.clone(), routing).await
            }
        }
    }
}

/// Sends one batch as one call of the decision script by its SHA, and
/// once more with its text when the server does not know it (NOSCRIPT: a
/// restart, a new node), as every script is called ([`scripts`]).
pub(super) async fn run_script(mut target: Target<'_>, batch: &[Job]) -> Result<Vec<u64>, RedisError> {
    let inline = matches!(target, Target::Node(..));
    let call = script_call(batch, inline);
    let answer = match target.query(call.by_sha()).await {
        Err(e) if scripts::unknown(&e) => target.query(&call.by_text()).await?,
        answer => answer?,
    };
    Ok(redis::from_redis_value(answer)?)
}

/// The EVALSHA of one batch: its keys (declared, or `inline` in ARGV),
/// how to read them (one run, or one run per slot when inline), the
/// distinct specs, then per job (`0, n` first when it has several keys)
/// per key its entry: its spec's position, plus the number of specs when
/// its weight (not 1) follows, negated when the key occurs more than once
/// in the call. The layout is the script's header. Every value is a
/// command argument Redis parses and Lua interns (~900 instructions per
/// key for two of them), so the common case (one key, weight 1) is one.
pub(super) fn script_call(batch: &[Job], inline: bool) -> scripts::Call {
    let keys = || batch.iter().flat_map(|job| job.keys.as_slice().iter().map(|(key, _)| key.as_str()));
    let nkeys: usize = batch.iter().map(|job| job.keys.as_slice().len()).sum();
    let mut call = scripts::DECIDE_BATCH.call();
    if inline {
        call.arg(0);
        let runs = slot_runs(batch);
        call.arg(runs.len());
        for run in &runs {
            call.arg(*run);
        }
        for key in keys() {
            call.arg(key);
        }
    } else {
        call.arg(nkeys);
        for key in keys() {
            call.arg(key);
        }
        call.arg(1).arg(nkeys);
    }
    let mut specs = Specs::default();
    let positions: Vec<usize> =
        batch.iter().flat_map(|job| job.keys.as_slice()).map(|(_, args)| specs.position(args.spec)).collect();
    call.arg(specs.list.len());
    for spec in &specs.list {
        for value in &spec[..5] {
            call.arg(*value);
        }
        if spec[3] & OWN_CLOCK != 0 {
            call.arg(spec[5]);
        }
        if spec[3] & REFUND != 0 {
            call.arg(spec[6]);
        }
    }
    call.arg(batch.len());
    let repeated = repeated_keys(keys(), nkeys);
    let nspecs = specs.list.len();
    let mut positions = positions.into_iter();
    for job in batch {
        let keys = job.keys.as_slice();
        if keys.len() > 1 {
            call.arg(0).arg(keys.len());
        }
        for ((key, args), position) in keys.iter().zip(&mut positions) {
            // At most twice the call's number of keys.
            let entry = (if args.weight == 1 { position } else { nspecs + position }) as i64;
            call.arg(if repeated.contains(key.as_str()) { -entry } else { entry });
            if args.weight != 1 {
                call.arg(args.weight);
            }
        }
    }
    call
}

/// The keys that occur more than once in a call of `nkeys` keys over
/// `batch` (none in a call of one key). The script writes any other key as
/// soon as its job is decided, keeping no state for it.
pub(super) fn repeated_keys<'a>(
    keys: impl Iterator<Item = &'a str>,
    nkeys: usize,
) -> hashbrown::HashSet<&'a str> {
    let mut repeated = hashbrown::HashSet::new();
    if nkeys > 1 {
        let mut seen = hashbrown::HashSet::with_capacity(nkeys);
        for key in keys {
            if !seen.insert(key) {
                repeated.insert(key);
            }
        }
    }
    repeated
}

/// The keys of `batch` (sorted by slot) per slot, in order: how many keys
/// each `MGET` of the script reads.
pub(super) fn slot_runs(batch: &[Job]) -> Vec<usize> {
    let mut runs: Vec<usize> = Vec::new();
    let mut last = None;
    for job in batch {
        let keys = job.keys.as_slice().len();
        match runs.last_mut() {
            Some(run) if last == Some(job.slot) => *run += keys,
            _ => runs.push(keys),
        }
        last = Some(job.slot);
    }
    runs
}

/// Values of the script's answer for `job`: whether it committed (only a
/// job of several keys says), then [`answer_len`] per key.
pub(super) fn job_answer_len(job: &Job) -> usize {
    let keys = job.keys.as_slice();
    usize::from(keys.len() > 1) + keys.iter().map(|(_, args)| answer_len(args.algorithm())).sum::<usize>()
}

/// Hands each job of `batch` Redis' clock (the answer's first value) and
/// its slice of the rest of `reply`, emptying `batch`.
pub(super) fn split_reply(batch: &mut Vec<Job>, reply: &[u64]) {
    let expected: usize = 1 + batch.iter().map(job_answer_len).sum::<usize>();
    let Some((&now_ms, mut rest)) = reply.split_first().filter(|_| reply.len() == expected) else {
        fail_all(
            batch,
            &script_error(format!("script answered {} values for a batch needing {expected}", reply.len())),
        );
        return;
    };
    for job in batch.drain(..) {
        let (part, after) = rest.split_at(job_answer_len(&job));
        rest = after;
        let mut answer = Vec::with_capacity(1 + part.len());
        answer.push(now_ms);
        answer.extend_from_slice(part);
        let _ = job.reply.send(Ok(answer));
    }
}

pub(super) fn script_error(message: String) -> StoreError {
    StoreError { kind: FailureKind::ScriptError, message }
}
