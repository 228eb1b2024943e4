//! The region's shared state of the global limits, in its own store: the
//! tallies its instances add, the agent role, the grants the agent writes
//! and the deployment's id. Every key carries the hash tag `{global}`, so a
//! regional Redis Cluster keeps them in one slot and each step is one
//! script call:
//! - `<prefix>rlr:{global}:agent`: the instance holding the agent role
//!   (leased for `global.lease_ms`);
//! - `<prefix>rlr:{global}:deployment`: the deployment's id, set once;
//! - `<prefix>rlr:{global}:t:<limit>`: the tallies since the agent last
//!   drained them, fields `a:<key>` (admitted) and `d:<key>` (denied);
//! - `<prefix>rlr:{global}:g:<limit>`: the grants, field `k:<key>` per
//!   key and `_until` (when their lease ends, the regional store's clock),
//!   or `_claimed` alone (until when: the coordination store refused the
//!   region's report, another deployment holding the region);
//! - `<prefix>rlr:{global}:version`: the version of the grants, one more
//!   with each write of the agent;
//! - `<prefix>rlr:{global}:applied`: per instance, the oldest version of
//!   the grants it may enforce and when it said so (`<version>:<ms>`).

use std::{collections::HashMap, time::Duration};

use crate::limiter::{RedisStore, StoreError, grants::KeyTally, push_encoded, scripts};

/// The grants of one limit the agent last wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LimitGrants {
    /// When their lease ends (ms of the regional store's clock); `None`
    /// when there are none.
    pub until: Option<u64>,
    /// Each key's grant.
    pub grants: Vec<(Box<str>, u64)>,
    /// Until when the region enforces nothing of the limit (ms of the
    /// regional store's clock): another deployment holds the region.
    pub claimed: Option<u64>,
}

/// What an instance learnt from its region.
#[derive(Debug, Clone, Default)]
pub struct View {
    /// The regional store's clock when it answered (ms).
    pub now_ms: u64,
    /// Whether this instance holds the agent role.
    pub agent: bool,
    /// The deployment's id.
    pub deployment: String,
    /// The version of the grants read.
    pub version: u64,
    /// The oldest version of the grants another instance of the region may
    /// still enforce (the agent's view; `None`: no other instance said
    /// anything within the time a grant is kept).
    pub oldest_applied: Option<u64>,
    /// Per limit (in the order asked), the region's tallies the agent
    /// drained: (admitted, denied) by key; empty unless the agent.
    pub tallies: Vec<HashMap<Box<str>, (u64, u64)>>,
    /// Per limit, the grants last written.
    pub grants: Vec<LimitGrants>,
}

impl View {
    /// The view of an instance that is its whole region (the memory
    /// store): the agent, with its own tallies and no grant written.
    pub fn alone(tallies: Vec<Vec<KeyTally>>, now_ms: u64) -> Self {
        let grants = tallies.iter().map(|_| LimitGrants::default()).collect();
        let tallies = tallies
            .into_iter()
            .map(|limit| limit.into_iter().map(|t| (t.key, (t.admitted, t.denied))).collect())
            .collect();
        View { now_ms, agent: true, deployment: String::new(), tallies, grants, ..View::default() }
    }
}

/// Who calls, and how long the role and the tallies live.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// This instance's id.
    pub instance: &'a str,
    /// The version of the grants this instance applied last, if any.
    pub applied: Option<u64>,
    /// How long the agent role holds without renewal.
    pub role_ms: u64,
    /// How long tallies no agent drains are kept.
    pub tally_ttl_ms: u64,
    /// How long an instance keeps grants it read, and the margin: past it,
    /// an instance that said nothing enforces nothing it read.
    pub kept_ms: u64,
}

/// `<prefix>rlr:{global}:<what>`, with `limit` percent-encoded after it.
fn key(prefix: &str, what: &str, limit: Option<&str>) -> String {
    let mut out = format!("{prefix}rlr:{{global}}:{what}");
    if let Some(limit) = limit {
        out.push(':');
        push_encoded(&mut out, limit, &['{', '}']);
    }
    out
}

/// One instance's exchange with its region: adds `tallies` (per limit of
/// `limits`), takes or renews the agent role, drains the region's tallies
/// when the agent, and reads the grants. One script call, within `timeout`.
pub async fn exchange(
    store: &RedisStore,
    call: Call<'_>,
    limits: &[&str],
    tallies: &[Vec<KeyTally>],
    timeout: Duration,
) -> Result<View, StoreError> {
    let prefix = store.key_prefix();
    let mut cmd = scripts::REGION.call();
    cmd.arg(4 + 2 * limits.len());
    cmd.arg(key(prefix, "agent", None)).arg(key(prefix, "deployment", None));
    cmd.arg(key(prefix, "applied", None)).arg(key(prefix, "version", None));
    for limit in limits {
        cmd.arg(key(prefix, "t", Some(limit))).arg(key(prefix, "g", Some(limit)));
    }
    let mut random = [0u8; 8];
    let _ = getrandom::fill(&mut random);
    let fresh = format!("{:016x}", u64::from_be_bytes(random));
    cmd.arg(call.instance).arg(call.role_ms).arg(call.tally_ttl_ms).arg(fresh);
    cmd.arg(call.applied.map_or(-1, |v| i64::try_from(v).unwrap_or(i64::MAX))).arg(call.kept_ms);
    for limit in tallies {
        cmd.arg(limit.len());
        for t in limit {
            cmd.arg(&*t.key).arg(t.admitted).arg(t.denied);
        }
    }
    let answer = store.script(&cmd, timeout).await?;
    parse(answer, limits.len()).ok_or_else(|| StoreError {
        kind: crate::limiter::FailureKind::ScriptError,
        message: "the region script answered an unexpected shape".to_owned(),
    })
}

/// `{now_ms, agent, deployment, version, {tallies per limit}, {grants per
/// limit}, {versions of the others}}`.
fn parse(answer: redis::Value, limits: usize) -> Option<View> {
    let redis::Value::Array(parts) = answer else { return None };
    let [now, agent, deployment, version, tallies, grants, others]: [redis::Value; 7] =
        parts.try_into().ok()?;
    let int = |v: &redis::Value| match v {
        redis::Value::Int(n) => u64::try_from(*n).ok(),
        redis::Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    };
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        _ => None,
    };
    let pairs = |v: redis::Value| -> Option<Vec<(String, redis::Value)>> {
        let redis::Value::Array(flat) = v else { return None };
        flat.chunks(2).map(|c| Some((text(c.first()?)?, c.get(1)?.clone()))).collect()
    };
    let per_limit = |v: redis::Value| -> Option<Vec<redis::Value>> {
        match v {
            redis::Value::Array(items) if items.len() == limits => Some(items),
            redis::Value::Array(items) if items.is_empty() => {
                Some(vec![redis::Value::Array(Vec::new()); limits])
            }
            _ => None,
        }
    };
    let mut view = View {
        now_ms: int(&now)?,
        agent: int(&agent)? == 1,
        deployment: text(&deployment)?,
        version: int(&version)?,
        ..View::default()
    };
    for (_, recorded) in pairs(others)? {
        let version = text(&recorded)?.split_once(':')?.0.parse().ok()?;
        view.oldest_applied = Some(view.oldest_applied.map_or(version, |v: u64| v.min(version)));
    }
    for limit in per_limit(tallies)? {
        let mut drained: HashMap<Box<str>, (u64, u64)> = HashMap::new();
        for (field, n) in pairs(limit)? {
            let n = int(&n)?;
            match field.split_at_checked(2) {
                Some(("a:", key)) => drained.entry(key.into()).or_default().0 += n,
                Some(("d:", key)) => drained.entry(key.into()).or_default().1 += n,
                _ => {}
            }
        }
        view.tallies.push(drained);
    }
    for limit in per_limit(grants)? {
        view.grants.push(limit_grants(pairs(limit)?, int)?);
    }
    Some(view)
}

/// One limit's grants hash, read as `field, value` pairs.
fn limit_grants(
    pairs: Vec<(String, redis::Value)>,
    int: impl Fn(&redis::Value) -> Option<u64>,
) -> Option<LimitGrants> {
    let mut written = LimitGrants::default();
    for (field, n) in pairs {
        let n = int(&n)?;
        match field.split_at_checked(2) {
            Some(("k:", key)) => written.grants.push((key.into(), n)),
            _ if field == "_until" => written.until = Some(n),
            _ if field == "_claimed" => written.claimed = Some(n),
            _ => {}
        }
    }
    Some(written)
}

/// The grants of one limit the agent writes for its region.
#[derive(Debug, Clone)]
pub struct Written {
    /// The limit's id.
    pub limit: std::sync::Arc<str>,
    /// When their lease ends (ms of the regional store's clock).
    pub until: u64,
    /// Each key's grant.
    pub grants: Vec<(Box<str>, u64)>,
    /// The region's report was refused as claimed by another deployment:
    /// it enforces nothing of the limit until `until`, and `grants` is empty.
    pub claimed: bool,
}

/// The agent writes each limit's grants for the region's instances as
/// `version`, in one call, replacing what it wrote before; they expire
/// with their lease.
pub async fn write_grants(
    store: &RedisStore,
    (version, written): (u64, &[Written]),
    lease_ms: u64,
    timeout: Duration,
) -> Result<(), StoreError> {
    let prefix = store.key_prefix();
    let mut pipeline = redis::pipe();
    pipeline.atomic();
    pipeline.set(key(prefix, "version", None), version).ignore();
    for Written { limit, until, grants, claimed } in written {
        let key = key(prefix, "g", Some(limit));
        pipeline.del(&key).ignore();
        let mut hset = redis::cmd("HSET");
        hset.arg(&key).arg(if *claimed { "_claimed" } else { "_until" }).arg(*until);
        for (k, grant) in grants {
            hset.arg(format!("k:{k}")).arg(*grant);
        }
        pipeline.add_command(hset).ignore();
        pipeline.pexpire(&key, i64::try_from(lease_ms).unwrap_or(i64::MAX)).ignore();
    }
    store.pipeline::<()>(&pipeline, timeout).await
}

/// An instance says it applied the grants of `version`, read in the
/// exchange the regional store answered at `read_ms`: from then on the
/// agent counts it as enforcing that version or a later one.
pub async fn applied(
    store: &RedisStore,
    instance: &str,
    (version, read_ms): (u64, u64),
    timeout: Duration,
) -> Result<(), StoreError> {
    let mut cmd = scripts::APPLIED.call();
    cmd.arg(1).arg(key(store.key_prefix(), "applied", None));
    cmd.arg(instance).arg(version).arg(read_ms);
    store.script(&cmd, timeout).await.map(drop)
}
