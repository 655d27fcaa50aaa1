//! kvguard's test instruments and end-to-end harness. **Not a product**: everything here
//! exists to test the filter and kvguard-control against real processes.
//!
//! - [`paths`] finds the binaries and fixtures (Envoy, the wasm, kvguard-control).
//! - [`proc`] runs child processes that are always killed, even when a test panics.
//! - [`prom`] a real Prometheus scraping the stack, with the shipped rules time-scaled.
//! - [`wait`] bounded polling; [`stall`] latency bounds credited with measured stalls.
//! - [`sim`] the workspace's one engine simulator (vLLM-like OpenAI streaming API, paged
//!   KV pool with admission control, vLLM metric names, abort APIs).
//! - [`receiver`] a mock `POST /v1/abort` endpoint that verifies signatures per contract.
//! - [`envoy`] runs a real Envoy with (or without) the kvguard filter.
//! - [`client`] small HTTP/SSE client helpers, including disconnecting and silent clients
//!   (re-exported from `kvguard-loadgen`, shared with kvguard-leakcheck).
//! - [`clock_shim`] an `LD_PRELOAD` library that shifts a process's wall clock at run time.
//! - [`hops`] real hops (LiteLLM's proxy, vllm-router) run as child processes.
//! - [`lossy`] a reverse proxy that does not pass client disconnects on (the leak).
//! - [`load`] the load generator behind the `kvguard-load` binary (re-exported from
//!   `kvguard-loadgen`).
//! - [`vllm`] real vLLM on CPU: the tiny random-weight model, one server per suite run.
//! - [`vllm_pd`] a disaggregated vLLM pair (prefill and decode, NixlConnector) on CPU.
//! - [`demo`] the whole stack (Envoy [+ filter] → lossy hop → kvguard-control → engine),
//!   the seeded leak-reproduction workload and its report (`kvguard-demo`, `scripts/demo`).
//! - [`bench`] benchmarks and the soak run behind `kvguard-bench` (`scripts/bench`, `scripts/soak`).

pub mod bench;
pub mod cli;
pub mod clock_shim;
pub mod demo;
pub mod envoy;
pub mod gate;
pub mod hops;
pub mod lossy;
pub mod paths;
pub mod pd_proxy;
pub mod proc;
pub mod prom;
pub mod receiver;
pub mod sim;
pub mod stall;
pub mod vllm;
pub mod vllm_pd;
pub mod wait;

mod http;

/// HTTP/SSE clients (plain, disconnecting, silent): moved to `kvguard-loadgen`, which
/// kvguard-leakcheck shares; re-exported under the old path.
pub use kvguard_loadgen::client;
/// The load generator behind `kvguard-load`: moved to `kvguard-loadgen`; re-exported.
pub use kvguard_loadgen::load;

/// `n` loopback addresses free now (bound, then released): for processes that must know
/// each other's address before they start (replicas naming their `--peers`).
pub fn free_addrs(n: usize) -> Vec<std::net::SocketAddr> {
    let ls: Vec<_> = (0..n)
        .filter_map(|_| std::net::TcpListener::bind("127.0.0.1:0").ok())
        .collect();
    ls.iter().filter_map(|l| l.local_addr().ok()).collect()
}
