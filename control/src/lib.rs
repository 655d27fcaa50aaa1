//! kvguard-control: the service beside the inference engine.
//!
//! It proxies inference traffic to the engine (so it owns the last hop), keys every
//! request by its `x-request-id`, carries out signed aborts (contract §3) by closing the
//! engine connection and, per strategy, calling the engine's own abort API, reaps stalled
//! and over-age sequences itself, and reports NVML memory, engine KV signals and leak
//! signals as Prometheus metrics.
#![forbid(unsafe_code)]

pub mod admin;
pub mod clock;
pub mod config;
pub mod engine;
pub mod expo;
pub mod gpu;
pub mod metrics;
pub mod pool;
pub mod procfs;
pub mod proxy;
pub mod reaper;
pub mod replay;
pub mod sampler;
pub mod scan;
pub mod server;
pub mod state;
pub mod table;
pub mod tombstones;

pub use config::{Args, Config, ConfigError, EXIT_USAGE};
pub use server::{Deps, Server};
pub use state::AppState;
