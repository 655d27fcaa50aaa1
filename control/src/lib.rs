//! kvguard-control: the service beside the inference engine.
//!
//! It proxies inference traffic to the engine (so it owns the last hop), keys every
//! request by its `x-request-id`, carries out signed aborts (contract §3) by closing the
//! engine connection and, per strategy, calling the engine's own abort API, reaps stalled
//! sequences itself, and reports NVML memory, engine KV signals and leak signals as
//! Prometheus metrics.
//!
//! The abort path is [`abort`]: its endpoints verify a signed call (`abort/endpoint.rs`),
//! `abort/mod.rs` decides it (here, under the table lock, or by the peer that holds the
//! id: `abort/peer.rs`) and ends the request: the [`table`] entry leaves, the id is
//! tombstoned ([`tombstones`]), the entry is cancelled (the [`proxy`]'s response body
//! sends the final SSE event), its engine connection is closed, the [`engine`]'s abort API
//! is called, and the post-abort deadline is armed after which [`downstream`] cuts the
//! client's h2 stream or HTTP/1.1 connection. The [`reaper`] loop, the lease and shutdown
//! end requests the same way. [`state`] holds what they share and admits requests;
//! [`server`] wires the listeners and tasks.
//!
//! The liveness lease (a dead gateway's streams) is [`lease`]: the judgement in
//! `lease/mod.rs`, the renewal endpoints in `lease/endpoints.rs`, the loop that enforces
//! it in `lease/enforce.rs`.
#![forbid(unsafe_code)]

pub mod abort;
pub mod admin;
pub mod clock;
pub mod config;
pub mod downstream;
pub mod engine;
pub mod expo;
pub mod gpu;
pub mod keys;
pub mod lease;
pub mod metrics;
pub mod pd;
pub mod peers;
pub mod procfs;
pub mod proxy;
pub mod reaper;
pub mod refusal;
pub mod sampler;
pub mod server;
pub mod state;
pub mod table;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;

pub use kvguard_control_core::{replay, scan, tombstones};

pub use config::{Args, Config, ConfigError, EXIT_USAGE};
pub use server::{Deps, Server};
pub use state::AppState;
