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

/// `n` distinct loopback addresses free now, for processes that must know each other's
/// address before they start (replicas naming their `--peers`, NIXL's side channel).
/// A port is only free until someone binds it, so the ports are drawn at random below the
/// kernel's ephemeral range (`net.ipv4.ip_local_port_range`), where neither port-0
/// listeners nor outgoing connections take them, and each is checked bindable now; the
/// caller still retries on a collision ([`with_free_addrs`]).
pub fn free_addrs(n: usize) -> Vec<std::net::SocketAddr> {
    use std::hash::{BuildHasher, Hasher};
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // Above the ports daemons register by habit; no room below the range: port 0.
    let (from, span) = (20_000u16, low.saturating_sub(20_000));
    let mut out: Vec<std::net::SocketAddr> = Vec::new();
    let mut seed = std::collections::hash_map::RandomState::new().build_hasher();
    for attempt in 0u32..(n as u32 * 50) {
        if out.len() == n {
            break;
        }
        let port = if span >= 1000 {
            seed.write_u32(attempt);
            from + (seed.finish() % u64::from(span)) as u16
        } else {
            0
        };
        let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) else {
            continue;
        };
        if let Ok(a) = l.local_addr() {
            if !out.contains(&a) {
                out.push(a);
            }
        }
    }
    out
}

/// Whether `text` (an error chain, a process's log) says a port was taken.
pub fn says_addr_in_use(text: &str) -> bool {
    ["Address already in use", "AddrInUse", "os error 98"]
        .iter()
        .any(|p| text.contains(p))
}

/// Runs `start` again (three tries in all) while it fails because a port it was to bind
/// was taken first ([`says_addr_in_use`] on the whole error chain, child logs included).
pub async fn retry_addr_in_use<T, F, Fut>(mut start: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut tries = 0;
    loop {
        tries += 1;
        match start().await {
            Err(e) if tries < 3 && says_addr_in_use(&format!("{e:#}")) => {
                eprintln!("a port was taken before its process bound it; starting again: {e:#}");
            }
            r => return r,
        }
    }
}

/// Runs `start` on `n` fresh addresses from [`free_addrs`], with fresh ones again when one
/// was taken between the draw and the bind ([`retry_addr_in_use`]).
pub async fn with_free_addrs<T, F, Fut>(n: usize, mut start: F) -> anyhow::Result<T>
where
    F: FnMut(Vec<std::net::SocketAddr>) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    retry_addr_in_use(|| {
        let addrs = free_addrs(n);
        let started = (addrs.len() == n).then(|| start(addrs));
        async move {
            match started {
                Some(s) => s.await,
                None => anyhow::bail!("could not find {n} free loopback ports"),
            }
        }
    })
    .await
}
