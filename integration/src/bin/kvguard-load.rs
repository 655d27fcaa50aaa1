//! `kvguard-load`: a load generator for kvguard's benchmarks and leak reproductions (a test
//! instrument). Prints a JSON summary on stdout.

use clap::Parser;
use kvguard_integration::load::{self, LoadConfig};
use std::net::SocketAddr;
use std::time::Duration;

/// Concurrent SSE streams with disconnecting and silent clients; JSON summary on stdout.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Target address (ip:port), e.g. Envoy's listener.
    #[arg(long)]
    target: SocketAddr,
    /// Request path.
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// Streams in all.
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Most streams in flight.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Arrivals per second (0 = as fast as --concurrency allows).
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// max_tokens of each request.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Use h2c (prior knowledge) instead of HTTP/1.1.
    #[arg(long)]
    http2: bool,
    /// Share (0..1) of streams that disconnect after a random number of events.
    #[arg(long, default_value_t = 0.0)]
    disconnect_share: f64,
    /// Share (0..1) of silent clients (never read; HTTP/1.1).
    #[arg(long, default_value_t = 0.0)]
    silent_share: f64,
    /// How long silent clients hold their socket, in ms.
    #[arg(long, default_value_t = 5000)]
    silent_hold_ms: u64,
    /// Storm mode: open this many streams, wait for every response head, then disconnect
    /// all of them within --storm-window-ms.
    #[arg(long, default_value_t = 0)]
    storm: usize,
    /// Storm window in ms.
    #[arg(long, default_value_t = 2000)]
    storm_window_ms: u64,
    /// Extra request header `name: value` (repeatable), e.g. `x-sim-rate: 20`.
    #[arg(long = "header")]
    headers: Vec<String>,
    /// Bound on each stream, in seconds.
    #[arg(long, default_value_t = 120)]
    stream_timeout_s: u64,
    /// RNG seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let mut headers = Vec::new();
    for h in &a.headers {
        let Some((k, v)) = h.split_once(':') else {
            anyhow::bail!("--header {h:?}: expected `name: value`");
        };
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    for (name, share) in [
        ("--disconnect-share", a.disconnect_share),
        ("--silent-share", a.silent_share),
    ] {
        if !(0.0..=1.0).contains(&share) {
            anyhow::bail!("{name} must be within 0..1, got {share}");
        }
    }
    if a.disconnect_share + a.silent_share > 1.0 {
        anyhow::bail!("--disconnect-share + --silent-share must not exceed 1");
    }
    let cfg = LoadConfig {
        target: a.target,
        path: a.path,
        requests: a.requests,
        concurrency: a.concurrency,
        rate: a.rate,
        max_tokens: a.max_tokens,
        http2: a.http2,
        disconnect_share: a.disconnect_share,
        silent_share: a.silent_share,
        silent_hold: Duration::from_millis(a.silent_hold_ms),
        storm: a.storm,
        storm_window: Duration::from_millis(a.storm_window_ms),
        headers,
        stream_timeout: Duration::from_secs(a.stream_timeout_s),
        seed: a.seed,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let summary = rt.block_on(load::run(cfg));
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(())
}
