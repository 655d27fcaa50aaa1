//! Host-free logic of the kvguard proxy-wasm filter: configuration, the incremental
//! SSE/NDJSON scanner, per-request clocks and decisions, the abort queue, metric
//! definitions, and the per-VM [`engine::Engine`] that ties them together behind small
//! traits ([`host::Clock`], [`host::Host`], [`metrics::Metrics`]).
//!
//! No proxy-wasm dependency: everything here is unit-tested natively and compiled to
//! `wasm32-wasip1`. Nothing here panics on any input.
#![forbid(unsafe_code)]

pub mod aborts;
pub mod cidr;
pub mod config;
pub mod cut;
pub mod engine;
pub mod header_map;
pub mod host;
pub mod json;
pub mod lease;
pub mod metrics;
pub mod request;
pub mod scan;
pub mod tracked_id;
pub mod vms;

#[cfg(test)]
pub(crate) mod testing;

/// The filter's tables: hashbrown with a fixed-seed hasher, so they iterate in one order
/// on every run and the simulator replays a seed alike.
pub(crate) type Map<K, V> = hashbrown::HashMap<K, V, foldhash::fast::FixedState>;

pub use config::{Config, ConfigError, Limits, Mode};
pub use engine::{Action, BodyNeed, Engine, Verdict};
pub use request::OutcomeTag;
