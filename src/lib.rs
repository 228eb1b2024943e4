//! ratelimitd: a gRPC rate-limit decision service.
//!
//! # Layout
//!
//! The modules follow the decision path (docs/design.md §3):
//!
//! - [`api`]: protobuf ↔ domain conversion, validation, the gRPC services.
//!   The only module that sees generated types.
//! - [`rules`]: rule model, YAML loader, compiler, immutable [`rules::Snapshot`],
//!   hot-swapping [`rules::RuleStore`].
//! - [`shed`]: utilization sampler and the priority shedding policy.
//! - [`adapter`]: the exchange that moves adaptive limits from reported
//!   outcomes, shared by every instance through the store.
//! - [`overload`]: the probabilistic drop in front of exact counting (global
//!   rates per rule and tenant) and its feed.
//! - [`decision`]: the one engine both APIs decide through — lookup, priority,
//!   shedding, store call, failure policy, shadow mode, dead-letter record, metrics.
//! - [`limiter`]: the sliding-window arithmetic as a pure function and the
//!   stores that apply it (Redis Lua script, in-memory shards).
//! - [`dlq`]: records of decisions the store could not make: file or Kafka (through a
//!   durable spool), and the `audit` reader.
//! - [`migrate`]: the numbered setup steps of `migrations/`.
//! - [`clock`]: injectable time sources; [`folded`]: logging at most once a second.
//! - [`telemetry`]: metrics, health and readiness.
//! - [`rollout`]: the rules topic (publish, subscribe, status, git);
//!   [`release`]: the one publish path the CLI and the console share;
//!   [`console`]: `ratelimitd admin`, the web console of the write path.
//! - [`config`] (one module per section), [`cli`], [`server`] (named parts,
//!   startup, graceful shutdown), [`signal`], [`tls`].
//!
//! See ARCHITECTURE.md for the invariants between them.

#![forbid(unsafe_code)]

pub mod accept;
pub mod adapter;
pub mod api;
pub mod budget;
pub mod capture;
pub mod cli;
pub mod clock;
pub mod config;
pub mod console;
pub mod decision;
pub mod dlq;
pub mod folded;
pub mod global;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod limiter;
pub mod locality;
pub mod migrate;
pub mod overload;
pub mod quota;
pub mod release;
pub mod replay;
pub mod rollout;
pub mod rules;
pub mod server;
pub mod shed;
pub mod signal;
pub mod telemetry;
pub mod tls;
