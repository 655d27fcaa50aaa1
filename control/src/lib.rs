//! kvguard-control: the service beside the inference engine.
//!
//! It proxies inference traffic to the engine (so it owns the last hop), keys every
//! request by its `x-request-id`, carries out signed aborts (contract §3) by closing the
//! engine connection and, per strategy, calling the engine's own abort API, reaps stalled
//! sequences itself, and reports NVML memory, engine KV signals and leak signals as
//! Prometheus metrics.
//!
//! The abort path through the files: [`admin`] verifies a signed call and asks [`state`]
//! to end the id or tombstone it (one lock); the [`reaper`] loop ends what its rules
//! judge idle; [`state`] removes the [`table`] entry, tombstones the id ([`tombstones`]),
//! cancels the entry (the [`proxy`]'s response body sends the final SSE event), closes
//! its engine connection, calls the [`engine`]'s abort API, and arms the post-abort
//! deadline after which [`downstream`] cuts the client's h2 stream or HTTP/1.1
//! connection. [`server`] wires the listeners and tasks.
//!
//! The liveness lease (a dead gateway's streams) is [`lease`]: the judgement in
//! `lease/mod.rs`, the renewal endpoints in `lease/endpoints.rs`, the loop that enforces
//! it in `lease/enforce.rs`.
#![forbid(unsafe_code)]

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
pub mod peers;
pub mod procfs;
pub mod proxy;
pub mod reaper;
pub mod replay;
pub mod sampler;
pub mod scan;
pub mod server;
pub mod state;
pub mod table;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;
pub mod tombstones;

pub use config::{Args, Config, ConfigError, EXIT_USAGE};
pub use server::{Deps, Server};
pub use state::AppState;
