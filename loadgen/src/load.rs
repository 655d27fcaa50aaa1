//! The load generator behind `kvguard-load`: concurrent SSE streams at
//! a steady arrival rate, a share of clients that disconnect at a random point, a share of
//! silent clients, and a storm mode (many disconnects within a short window). The summary
//! is JSON: counts, TTFB and inter-event percentiles.

use crate::client;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Barrier, Semaphore};

/// Load settings (the `kvguard-load` flags).
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// Where to send (Envoy's listener, a hop, an engine).
    pub target: SocketAddr,
    /// Request path (`/v1/chat/completions` or `/v1/completions`).
    pub path: String,
    /// Streams in all (normal mode).
    pub requests: usize,
    /// Most streams in flight.
    pub concurrency: usize,
    /// Arrivals per second (0 = as fast as `concurrency` allows).
    pub rate: f64,
    /// `max_tokens` of each request.
    pub max_tokens: u32,
    /// Use h2c instead of HTTP/1.1.
    pub http2: bool,
    /// Share of streams (0..=1) that disconnect after a random number of events.
    pub disconnect_share: f64,
    /// Share of streams (0..=1) that never read the response (HTTP/1.1, small SO_RCVBUF).
    pub silent_share: f64,
    /// How long a silent client keeps its socket open.
    pub silent_hold: Duration,
    /// Storm mode: open this many streams, wait until every one has its response head
    /// (it may still be queued in the engine), then disconnect all of them at random
    /// moments within `storm_window` (0 = off).
    pub storm: usize,
    /// Window of the storm's disconnects.
    pub storm_window: Duration,
    /// Extra request headers.
    pub headers: Vec<(String, String)>,
    /// Bound on each stream.
    pub stream_timeout: Duration,
    /// RNG seed.
    pub seed: u64,
}

impl LoadConfig {
    /// Defaults against `target`.
    pub fn new(target: SocketAddr) -> Self {
        LoadConfig {
            target,
            path: "/v1/chat/completions".into(),
            requests: 100,
            concurrency: 32,
            rate: 0.0,
            max_tokens: 64,
            http2: false,
            disconnect_share: 0.0,
            silent_share: 0.0,
            silent_hold: Duration::from_secs(5),
            storm: 0,
            storm_window: Duration::from_secs(2),
            headers: Vec::new(),
            stream_timeout: Duration::from_secs(120),
            seed: 1,
        }
    }
}

/// Percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Samples.
    pub n: usize,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `samples` (ms).
    pub fn of(mut samples: Vec<f64>) -> Self {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
            samples[rank - 1]
        };
        Percentiles {
            n: samples.len(),
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: samples[samples.len() - 1],
        }
    }
}

/// The JSON summary.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadSummary {
    /// Streams started.
    pub started: usize,
    /// Streams read to `data: [DONE]`.
    pub completed: usize,
    /// Streams ended without `[DONE]` (server closed early).
    pub truncated: usize,
    /// Streams this generator disconnected on purpose.
    pub disconnected: usize,
    /// Silent clients.
    pub silent: usize,
    /// Failures (connect, status, reset, timeout).
    pub errors: usize,
    /// First error messages (at most 10).
    pub error_samples: Vec<String>,
    /// Response status counts.
    pub status: BTreeMap<u16, usize>,
    /// Data events received.
    pub events: u64,
    /// Time to the first data event.
    pub ttfb_ms: Percentiles,
    /// Gaps between data events of a stream.
    pub inter_event_ms: Percentiles,
    /// Storm mode: seconds between the first and the last disconnect.
    pub storm_spread_s: Option<f64>,
    /// Wall time of the run.
    pub duration_s: f64,
}

/// A small deterministic RNG (xorshift64*).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded (0 is mapped to a fixed non-zero seed).
    pub fn new(seed: u64) -> Self {
        Rng(if seed == 0 {
            0x9e37_79b9_7f4a_7c15
        } else {
            seed
        })
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[0, n)` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

#[derive(Default)]
struct Acc {
    s: LoadSummary,
    ttfb: Vec<f64>,
    gaps: Vec<f64>,
    storm_times: Vec<Instant>,
}

impl Acc {
    fn error(&mut self, e: String) {
        self.s.errors += 1;
        if self.s.error_samples.len() < 10 {
            self.s.error_samples.push(e);
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Plan {
    Complete,
    DisconnectAfter(u64),
    Silent,
}

fn body(cfg: &LoadConfig) -> Value {
    if cfg.path.contains("chat") {
        json!({"model": "tiny", "messages": [{"role": "user", "content": "hello from kvguard-load"}],
               "stream": true, "max_tokens": cfg.max_tokens})
    } else {
        json!({"model": "tiny", "prompt": "hello from kvguard-load", "stream": true, "max_tokens": cfg.max_tokens})
    }
}

/// Makes sure a storm stream that ends early still counts at the barrier, so the others
/// are not kept waiting.
struct BarrierGuard(Option<Arc<Barrier>>);

impl Drop for BarrierGuard {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            tokio::spawn(async move {
                b.wait().await;
            });
        }
    }
}

async fn one_stream(
    cfg: Arc<LoadConfig>,
    acc: Arc<Mutex<Acc>>,
    plan: Plan,
    storm: Option<(Arc<Barrier>, Duration)>,
) {
    let mut barrier_guard = BarrierGuard(storm.as_ref().map(|(b, _)| b.clone()));
    let lock = || match acc.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    let headers: Vec<(&str, &str)> = cfg
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    lock().s.started += 1;
    if let Plan::Silent = plan {
        match client::silent_client(cfg.target, &cfg.path, &body(&cfg), &headers, 4096, false).await
        {
            Ok(c) => {
                lock().s.silent += 1;
                tokio::time::sleep(cfg.silent_hold).await;
                c.close();
            }
            Err(e) => lock().error(format!("silent: {e:#}")),
        }
        return;
    }
    let t0 = Instant::now();
    let mut s =
        match client::stream_sse(cfg.target, &cfg.path, &body(&cfg), &headers, cfg.http2).await {
            Ok(s) => s,
            Err(e) => {
                lock().error(format!("{e:#}"));
                return;
            }
        };
    *lock().s.status.entry(s.status).or_insert(0) += 1;
    if s.status != 200 {
        // The body says who answered (Envoy's local reply, kvguard-control's JSON error).
        let body = s
            .collect_bytes(Duration::from_secs(1))
            .await
            .unwrap_or_default();
        let body = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        lock().error(format!("status {}: {}", s.status, body.trim()));
        return;
    }
    if let Some((barrier, delay)) = &storm {
        // Storm: every stream is in flight (headers received; it may still be queued in
        // the engine), then each disconnects at its moment within the window.
        barrier_guard.0 = None;
        // Bounded: a stream that never gets its head must not hold the storm forever.
        let _ = tokio::time::timeout(cfg.stream_timeout, barrier.wait()).await;
        tokio::time::sleep(*delay).await;
        let mut a = lock();
        a.s.disconnected += 1;
        a.storm_times.push(Instant::now());
        drop(a);
        s.disconnect();
        return;
    }
    let deadline = tokio::time::Instant::now() + cfg.stream_timeout;
    let mut last: Option<Instant> = None;
    let mut n = 0u64;
    if let Plan::DisconnectAfter(0) = plan {
        lock().s.disconnected += 1;
        s.disconnect();
        return;
    }
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match s.next_data(left).await {
            Ok(Some(ev)) => {
                let now = Instant::now();
                {
                    let mut a = lock();
                    a.s.events += 1;
                    match last {
                        None => a.ttfb.push(ms(now - t0)),
                        Some(l) => a.gaps.push(ms(now - l)),
                    }
                }
                last = Some(now);
                n += 1;
                if ev.is_done() {
                    lock().s.completed += 1;
                    return;
                }
                if let Plan::DisconnectAfter(k) = plan {
                    if n >= k {
                        lock().s.disconnected += 1;
                        s.disconnect();
                        return;
                    }
                }
            }
            Ok(None) => {
                lock().s.truncated += 1;
                return;
            }
            Err(e) => {
                lock().error(format!("{e:#}"));
                return;
            }
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Runs the load; returns the summary.
pub async fn run(cfg: LoadConfig) -> LoadSummary {
    let started = Instant::now();
    let cfg = Arc::new(cfg);
    let acc = Arc::new(Mutex::new(Acc::default()));
    let mut rng = Rng::new(cfg.seed);
    let mut tasks = tokio::task::JoinSet::new();
    if cfg.storm > 0 {
        let barrier = Arc::new(Barrier::new(cfg.storm));
        let window_ms = cfg.storm_window.as_millis() as u64;
        for _ in 0..cfg.storm {
            let delay = Duration::from_millis(rng.below(window_ms.max(1)));
            tasks.spawn(one_stream(
                cfg.clone(),
                acc.clone(),
                Plan::Complete,
                Some((barrier.clone(), delay)),
            ));
        }
    } else {
        let sem = Arc::new(Semaphore::new(cfg.concurrency.max(1)));
        let gap = (cfg.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / cfg.rate));
        let mut next = tokio::time::Instant::now();
        for _ in 0..cfg.requests {
            if let Some(g) = gap {
                tokio::time::sleep_until(next).await;
                next += g;
            }
            let Ok(permit) = sem.clone().acquire_owned().await else {
                break;
            };
            let r = rng.unit();
            let plan = if r < cfg.silent_share {
                Plan::Silent
            } else if r < cfg.silent_share + cfg.disconnect_share {
                Plan::DisconnectAfter(rng.below(u64::from(cfg.max_tokens)))
            } else {
                Plan::Complete
            };
            let (c, a) = (cfg.clone(), acc.clone());
            tasks.spawn(async move {
                one_stream(c, a, plan, None).await;
                drop(permit);
            });
            while tasks.try_join_next().is_some() {}
        }
    }
    while tasks.join_next().await.is_some() {}
    let mut g = match acc.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    let mut a = std::mem::take(&mut *g);
    drop(g);
    a.s.ttfb_ms = Percentiles::of(std::mem::take(&mut a.ttfb));
    a.s.inter_event_ms = Percentiles::of(std::mem::take(&mut a.gaps));
    if let (Some(first), Some(last)) = (a.storm_times.iter().min(), a.storm_times.iter().max()) {
        a.s.storm_spread_s = Some((*last - *first).as_secs_f64());
    }
    a.s.duration_s = started.elapsed().as_secs_f64();
    a.s
}
