//! The leak reproduction behind `scripts/demo` (README command 1) and the stack the
//! end-to-end suites share. A test/demo instrument, not a product.
//!
//! One run = one stack (client → Envoy [+ filter] → lossy hop → kvguard-control → engine)
//! under a seeded workload: steady streaming arrivals, a share of clients that disconnect
//! at a random point, a few stalls. The demo runs it twice, without kvguard and with it,
//! with the same plan, and compares what the engine went through.
//!
//! - "without kvguard" (`Mode::Leak`): the same topology, Envoy without the filter and
//!   kvguard-control with its own reaping off (`--idle-timeout off --max-age off`), so it
//!   only proxies: nothing tells the engine that a client left.
//! - "with kvguard" (`Mode::Kvguard`): the filter at the edge (idle timeout) and
//!   kvguard-control's reaper as the backstop.
//!
//! Measures (see [`RunResult`]): engine KV usage, running and waiting over time (engine
//! `/metrics`, simulator and vLLM alike), orphan-seconds (time a request stayed in flight
//! at the engine after its client had gone: kvguard-control's `/v1/requests` table, which
//! holds exactly the requests with an open engine connection, sampled), requests whose
//! first token took longer than [`WAIT_THRESHOLD`] (they queued), aborts by reason
//! (kvguard-control's `kvguard_control_aborts_total`), false aborts (a client that meant to
//! read to the end and did not get `[DONE]`).

pub mod observe;
pub mod pd;
pub mod stack;
mod workload;

pub use workload::{plan, Kind, Planned};

use crate::load::Percentiles;
use crate::sim::{self, SimConfig};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use stack::{Stack, StackOptions};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A first token later than this means the request queued.
pub const WAIT_THRESHOLD: Duration = Duration::from_millis(500);

/// Which engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// The workspace's engine simulator, in process.
    Sim,
    /// Real vLLM (CPU).
    Vllm,
}

/// The vLLM the demo starts for `--engine vllm`: the suite's model with a small KV pool
/// (128 blocks × 32 tokens = 4096 tokens, `--max-model-len 2048`) so that a few orphans
/// make requests wait.
pub fn demo_vllm_options() -> crate::vllm::VllmOptions {
    crate::vllm::VllmOptions {
        max_model_len: 2048,
        num_blocks: 128,
        ..crate::vllm::VllmOptions::default()
    }
}

/// Without or with kvguard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// No filter, kvguard-control's reaping off: the leak.
    Leak,
    /// Filter + kvguard-control reaping.
    Kvguard,
}

impl Mode {
    /// Label in tables.
    pub fn label(self) -> &'static str {
        match self {
            Mode::Leak => "without kvguard",
            Mode::Kvguard => "with kvguard",
        }
    }
}

/// The demo's settings (the `kvguard-demo` flags).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DemoConfig {
    /// Engine.
    pub engine: EngineKind,
    /// Seconds of arrivals.
    pub arrival_s: f64,
    /// Seconds of observation after the last arrival.
    pub drain_s: f64,
    /// Arrivals per second.
    pub rate: f64,
    /// Share of clients that disconnect at a random point.
    pub disconnect_share: f64,
    /// Share of streams that stall (simulator: the engine stops producing tokens; vLLM:
    /// the client stops reading).
    pub stall_share: f64,
    /// Generation length range (tokens, `max_tokens` of each request).
    pub min_tokens: u32,
    /// Upper end of the range.
    pub max_tokens: u32,
    /// A client with no data event for this long gives up (disconnects).
    pub patience_s: f64,
    /// Sampling period.
    pub sample_ms: u64,
    /// RNG seed.
    pub seed: u64,
    /// Filter idle timeout (ms) in the kvguard run.
    pub filter_idle_ms: u64,
    /// kvguard-control `--idle-timeout` in the kvguard run.
    pub control_idle: String,
    /// Simulator: KV blocks.
    pub sim_kv_blocks: u32,
    /// Simulator: tokens per second per stream.
    pub sim_token_rate: f64,
    /// The hop between Envoy and kvguard-control.
    #[serde(default)]
    pub hop: Hop,
    /// Share of requests sent without streaming (`"stream": false`, `/v1/completions`);
    /// 0 = all stream (then the plan is the same as before this option existed).
    #[serde(default)]
    pub nonstream_share: f64,
    /// Run each scenario under a real Prometheus with the shipped rules time-scaled
    /// ([`observe`]): alert timeline, dashboard queries, scraped names.
    #[serde(default)]
    pub prometheus: bool,
    /// The mutation check of the verdict: the kvguard run's filter in observe mode (it
    /// sends no abort). [`engine_verdict`] must then fail.
    #[serde(default)]
    pub filter_observe: bool,
}

/// The hop between Envoy and kvguard-control in the demo (`--hop`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Hop {
    /// The suite's lossy hop ([`crate::lossy`]): passes no disconnect on.
    #[default]
    Lossy,
    /// LiteLLM's proxy as shipped for kvguard ([`crate::hops`]): passes a streaming
    /// client's disconnect on, not a non-streaming one's.
    Litellm,
}

impl DemoConfig {
    /// The default demo on `engine` (~2 minutes in all on the simulator).
    pub fn new(engine: EngineKind) -> Self {
        match engine {
            EngineKind::Sim => DemoConfig {
                engine,
                arrival_s: 40.0,
                drain_s: 15.0,
                rate: 5.0,
                disconnect_share: 0.15,
                stall_share: 0.05,
                min_tokens: 100,
                max_tokens: 500,
                patience_s: 8.0,
                sample_ms: 500,
                seed: 42,
                filter_idle_ms: 3000,
                control_idle: "6s".into(),
                sim_kv_blocks: 800,
                sim_token_rate: 40.0,
                hop: Hop::Lossy,
                nonstream_share: 0.0,
                prometheus: false,
                filter_observe: false,
            },
            EngineKind::Vllm => DemoConfig {
                engine,
                arrival_s: 60.0,
                drain_s: 30.0,
                rate: 1.0,
                disconnect_share: 0.15,
                stall_share: 0.05,
                min_tokens: 200,
                max_tokens: 500,
                // Silent clients hold their socket this long: past the filter's idle
                // timeout plus the time the buffers take to fill.
                patience_s: 20.0,
                sample_ms: 500,
                seed: 42,
                // vLLM on a shared 2-core machine can pause for seconds (CPU contention):
                // stall thresholds stay well above the worst token gap seen.
                filter_idle_ms: 10_000,
                control_idle: "20s".into(),
                sim_kv_blocks: 0,
                sim_token_rate: 0.0,
                hop: Hop::Lossy,
                nonstream_share: 0.0,
                prometheus: false,
                filter_observe: false,
            },
        }
    }

    /// Whether streams are chat and non-streaming requests completions (see
    /// [`workload::plan`]): with non-streaming requests, or behind a real hop, which does
    /// not return the edge's request id to the client, so orphans are counted by path.
    pub fn split_by_path(&self) -> bool {
        self.nonstream_share > 0.0 || self.hop != Hop::Lossy
    }

    /// The simulator's configuration for this demo.
    pub fn sim_config(&self) -> SimConfig {
        SimConfig {
            kv_blocks: self.sim_kv_blocks,
            block_size: 16,
            token_rate: self.sim_token_rate,
            max_running: 256,
            max_model_len: 8192,
            stall_keepalive_ms: 1000,
            // Listed in /v1/models as vLLM lists --lora-modules: the LoRA panel has data.
            lora_adapters: DEMO_LORA_ADAPTERS.iter().map(|a| a.to_string()).collect(),
            ..SimConfig::default()
        }
    }
}

/// The LoRA adapters the demo's simulator lists in `/v1/models`.
pub const DEMO_LORA_ADAPTERS: [&str; 2] = ["demo-sql-lora", "demo-chat-lora"];

/// One sample of the series.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the run's first arrival.
    pub t: f64,
    /// Engine KV usage (0..1).
    pub kv: f64,
    /// Engine running.
    pub running: f64,
    /// Engine waiting.
    pub waiting: f64,
    /// Clients connected and reading.
    pub clients: usize,
    /// Requests in flight at kvguard-control (open engine connections).
    pub inflight: usize,
}

/// What happened to one request, as its client saw it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClientRecord {
    /// Index in the plan.
    pub index: usize,
    /// The plan: `complete`, `disconnect`, `stall`.
    pub plan: String,
    /// The `x-request-id` the response carried (minted by Envoy).
    pub request_id: Option<String>,
    /// Seconds since the run's start when it was sent.
    pub sent_s: f64,
    /// Time to the first data event (s).
    pub ttft_s: Option<f64>,
    /// Data events read.
    pub events: u64,
    /// `done` (read `[DONE]`), `disconnected` (left on purpose), `gave_up` (stalled
    /// past its patience, then left), `kvguard_error` (got kvguard's error event),
    /// `closed` (ended without `[DONE]`), `error`, `hung` (had not finished when the run
    /// ended: see [`account_for_every_client`]).
    pub outcome: String,
    /// Seconds since the run's start when the client left (disconnected or gave up).
    pub gone_s: Option<f64>,
    /// Error text, if any.
    pub error: Option<String>,
}

/// One run's results.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunResult {
    /// `leak` or `kvguard`.
    pub mode: String,
    /// The series.
    pub series: Vec<Sample>,
    /// Requests sent.
    pub requests: usize,
    /// Read to `[DONE]`.
    pub completed: usize,
    /// Clients that left on purpose.
    pub disconnected: usize,
    /// Streams planned to stall.
    pub stalled: usize,
    /// Clients planned to complete that did not get `[DONE]` (must be 0).
    pub false_aborts: usize,
    /// Their ids and outcomes.
    pub false_abort_samples: Vec<String>,
    /// Requests whose first token took longer than [`WAIT_THRESHOLD`].
    pub waited: usize,
    /// Time to first token.
    pub ttft_ms: Percentiles,
    /// Engine time on requests whose client had gone (s).
    pub orphan_seconds: f64,
    /// Requests still in flight at the engine at the end whose client had gone.
    pub orphans_at_end: usize,
    /// KV usage: mean over the arrival phase, peak, at the end.
    pub kv_mean: f64,
    /// Peak KV usage.
    pub kv_peak: f64,
    /// KV usage at the last sample.
    pub kv_end: f64,
    /// KV usage before the first arrival.
    pub kv_baseline: f64,
    /// Peak waiting.
    pub waiting_peak: f64,
    /// kvguard-control's aborts by reason.
    pub aborts_by_reason: BTreeMap<String, f64>,
    /// The filter's stats (name → value).
    pub filter_stats: BTreeMap<String, f64>,
    /// The lossy hop: clients gone / bytes read after the client had gone.
    pub hop_clients_gone: u64,
    /// Bytes the hop kept reading for gone clients.
    pub hop_bytes_after_gone: u64,
    /// Non-streaming requests sent (`nonstream_share`).
    #[serde(default)]
    pub nonstream_sent: usize,
    /// Non-streaming requests whose client left before the answer.
    #[serde(default)]
    pub nonstream_left: usize,
    /// Engine time on non-streaming requests whose client had left (s): samples of
    /// kvguard-control's in-flight non-streaming requests beyond the connected clients.
    #[serde(default)]
    pub nonstream_orphan_seconds: f64,
    /// Non-streaming requests at the engine at the end whose client had left.
    #[serde(default)]
    pub nonstream_orphans_at_end: usize,
    /// Per-client records.
    pub clients: Vec<ClientRecord>,
    /// Wall time of the run (s).
    pub wall_s: f64,
    /// What Prometheus saw (`DemoConfig::prometheus`).
    #[serde(default)]
    pub observed: Option<observe::Observed>,
    /// Orphans from the engine's side: the simulator's own records (`None` on vLLM, and
    /// behind a hop that returns no request id to the client).
    #[serde(default)]
    pub engine_orphans: Option<EngineOrphans>,
}

/// Orphans measured from the engine's side, from the simulator's own request records: for
/// every request whose client left (disconnected, or gave up on a stall), how long the
/// engine still held it after the client left (generating, or stalled holding its KV
/// blocks), to its end in the engine or, still there, to the end of the run. The client's
/// leaving and the engine's end are on one clock (the simulator runs in the demo's
/// process); kvguard-control's table plays no part.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EngineOrphans {
    /// Requests whose client left.
    pub left: usize,
    /// Of those, found in the engine's records by their request id (must be all).
    pub matched: usize,
    /// Engine-seconds held after the clients left, summed.
    pub orphan_seconds: f64,
    /// Per request, ms from its client leaving to its end in the engine.
    pub after_leaving_ms: Percentiles,
    /// Still in the engine at the end of the run.
    pub still_at_end: usize,
}

/// [`engine_verdict`]: kvguard's engine-side orphan-seconds at most this share of the run
/// without kvguard's.
pub const ENGINE_ORPHAN_SHARE: f64 = 0.01;
/// [`engine_verdict`]: kvguard's engine-side orphan-seconds at most this, absolute (s).
/// Measured in the CI demo (`--arrival-s 20 --drain-s 10 --seed 42`, 16 clients left):
/// 0.042, 0.042, 0.033 s (per client p99 ≤ 12 ms); without kvguard 77.1 s.
pub const ENGINE_ORPHAN_BOUND_S: f64 = 0.25;

/// Both runs and the settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DemoResults {
    /// Settings.
    pub config: DemoConfig,
    /// Without kvguard.
    pub leak: Option<RunResult>,
    /// With kvguard.
    pub kvguard: Option<RunResult>,
}

/// Live progress shared with the sampler.
#[derive(Default)]
struct Live {
    clients: AtomicUsize,
    /// Non-streaming clients with their connection open.
    nonstream_clients: AtomicUsize,
    sent: AtomicUsize,
    done: AtomicUsize,
}

/// Runs one mode against `engine` (must be idle). `progress` gets one line every ~5 s.
pub async fn run_once(
    cfg: &DemoConfig,
    mode: Mode,
    engine: SocketAddr,
    progress: &(dyn Fn(String) + Sync),
) -> Result<RunResult> {
    run_once_on(cfg, mode, engine, None, progress).await
}

/// [`run_once`]; with `sim`, the simulator at `engine`, also measures the orphans from
/// the engine's side ([`RunResult::engine_orphans`]).
pub async fn run_once_on(
    cfg: &DemoConfig,
    mode: Mode,
    engine: SocketAddr,
    sim: Option<&sim::Sim>,
    progress: &(dyn Fn(String) + Sync),
) -> Result<RunResult> {
    let started = Instant::now();
    let filter = match mode {
        Mode::Leak => None,
        Mode::Kvguard => {
            let mut f = stack::filter_config(cfg.filter_idle_ms, 0);
            if cfg.filter_observe {
                f["mode"] = serde_json::json!("observe");
            }
            Some(f)
        }
    };
    let mut opts = StackOptions::new(engine, filter);
    opts.control_args = match mode {
        Mode::Leak => vec![
            "--idle-timeout".into(),
            "off".into(),
            "--max-age".into(),
            "off".into(),
        ],
        Mode::Kvguard => vec!["--idle-timeout".into(), cfg.control_idle.clone()],
    };
    opts.control_args
        .extend(["--sample-interval".into(), "1s".into()]);
    if cfg.hop == Hop::Litellm {
        opts.real_hop = Some(crate::hops::HopKind::LiteLlm(
            crate::hops::LiteLlmOptions::kvguard("tiny"),
        ));
    }
    if cfg.prometheus {
        opts.envoy_extra_yaml = Some(observe::shipped_stats_config()?);
    }
    let st = Stack::start(opts).await.context("starting the stack")?;
    let mut observer = match cfg.prometheus {
        true => Some(
            observe::Observer::start(&st, engine)
                .await
                .context("starting Prometheus on the stack")?,
        ),
        false => None,
    };
    let mut probed = false;
    let baseline = crate::vllm::engine_figures(engine)
        .await
        .context("the engine's /metrics before the run")?;
    let plan = workload::plan(cfg);
    let live = Arc::new(Live::default());
    let records = Arc::new(Mutex::new(Vec::<ClientRecord>::new()));
    let t0 = Instant::now();
    // The first arrival on the simulator's clock (ms since it started).
    let t0_engine_ms = sim.map(|s| s.now_ms() as f64);
    let entry = st.entry();

    // The load: one task per planned request, at its arrival time.
    let load = {
        let (live, records, cfg2) = (live.clone(), records.clone(), cfg.clone());
        let plan = plan.clone();
        tokio::spawn(async move {
            let mut tasks = tokio::task::JoinSet::new();
            for p in plan {
                tokio::time::sleep_until(tokio::time::Instant::from_std(t0 + p.at)).await;
                let (live, records, cfg) = (live.clone(), records.clone(), cfg2.clone());
                tasks.spawn(async move {
                    live.sent.fetch_add(1, Ordering::Relaxed);
                    let r = if p.stream {
                        workload::client(&cfg, entry, &p, t0, &live.clients).await
                    } else {
                        workload::nonstream_client(&cfg, entry, &p, t0, &live.nonstream_clients)
                            .await
                    };
                    live.done.fetch_add(1, Ordering::Relaxed);
                    if let Ok(mut g) = records.lock() {
                        g.push(r);
                    }
                });
                while tasks.try_join_next().is_some() {}
            }
            while tasks.join_next().await.is_some() {}
        })
    };

    // The sampler, until the end of the drain phase.
    let end = t0 + Duration::from_secs_f64(cfg.arrival_s + cfg.drain_s);
    let mut series = Vec::new();
    let mut last_seen: HashMap<String, f64> = HashMap::new();
    // Non-streaming requests at the engine beyond the non-streaming clients still
    // connected: requests whose client left (they carry no id the client could read).
    let (mut nonstream_orphan_s, mut stream_orphan_s) = (0.0, 0.0);
    let mut next_progress = t0;
    let period = Duration::from_millis(cfg.sample_ms);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while Instant::now() < end {
        tick.tick().await;
        let t = t0.elapsed().as_secs_f64();
        // A sample that cannot be read stops the run: a missing figure is not 0 (it
        // would hide orphans).
        let f = crate::vllm::engine_figures(engine)
            .await
            .with_context(|| format!("the engine's /metrics at {t:.1}s"))?;
        let ids = st
            .control
            .inflight_ids()
            .await
            .with_context(|| format!("kvguard-control's /v1/requests at {t:.1}s"))?;
        for id in &ids {
            last_seen.insert(id.clone(), t);
        }
        if cfg.split_by_path() {
            let (streams, nonstream) = inflight_by_kind(&st).await?;
            let p = period.as_secs_f64();
            let open = live.nonstream_clients.load(Ordering::Relaxed);
            nonstream_orphan_s += nonstream.saturating_sub(open) as f64 * p;
            let open = live.clients.load(Ordering::Relaxed);
            stream_orphan_s += streams.saturating_sub(open) as f64 * p;
        }
        let s = Sample {
            t,
            kv: f.kv_usage,
            running: f.running,
            waiting: f.waiting,
            clients: live.clients.load(Ordering::Relaxed),
            inflight: ids.len(),
        };
        series.push(s);
        if let Some(o) = observer.as_mut() {
            o.poll(t).await.context("Prometheus's alerts")?;
            if !probed && t >= cfg.arrival_s {
                probed = true;
                o.probe_dashboard()
                    .await
                    .context("the dashboard's queries")?;
            }
        }
        if Instant::now() >= next_progress {
            next_progress += Duration::from_secs(5);
            progress(format!(
                "[{:<15} {:>5.1}s] sent {:>3}  clients {:>3}  engine: kv {:>5.1}%  running {:>3}  waiting {:>3}",
                mode.label(),
                t,
                live.sent.load(Ordering::Relaxed),
                s.clients,
                s.kv * 100.0,
                s.running,
                s.waiting
            ));
        }
    }
    // Every client task is bounded (patience, per-stream bound); wait for them. One still
    // running after that is hung: it is stopped and accounted for below, never left out.
    let mut load = load;
    if tokio::time::timeout(CLIENTS_END, &mut load).await.is_err() {
        load.abort();
        let _ = load.await;
    }
    let end_t = t0.elapsed().as_secs_f64();
    let final_ids = st
        .control
        .inflight_ids()
        .await
        .context("kvguard-control's /v1/requests at the end of the run")?;
    let finished = records.lock().map(|g| g.clone()).unwrap_or_default();
    let clients = account_for_every_client(&plan, finished);

    let mut r = RunResult {
        mode: match mode {
            Mode::Leak => "leak".into(),
            Mode::Kvguard => "kvguard".into(),
        },
        requests: plan.len(),
        kv_baseline: baseline.kv_usage,
        nonstream_sent: plan.iter().filter(|p| !p.stream).count(),
        nonstream_left: clients
            .iter()
            .filter(|c| c.outcome == "disconnected" && plan.get(c.index).is_some_and(|p| !p.stream))
            .count(),
        nonstream_orphan_seconds: nonstream_orphan_s,
        ..RunResult::default()
    };
    // Behind a real hop the client gets no `x-request-id` back: count by path instead.
    let by_path = cfg.split_by_path() && clients.iter().all(|c| c.request_id.is_none());
    if cfg.split_by_path() {
        let (streams, nonstream) = inflight_by_kind(&st).await?;
        r.nonstream_orphans_at_end = nonstream;
        if by_path {
            r.orphan_seconds = stream_orphan_s;
            r.orphans_at_end = streams;
        }
    }
    let mut ttft = Vec::new();
    for c in &clients {
        match c.outcome.as_str() {
            "done" => r.completed += 1,
            "disconnected" => r.disconnected += 1,
            _ => {}
        }
        if c.plan == "stall" {
            r.stalled += 1;
        }
        if (c.plan == "complete" && c.outcome != "done") || c.outcome == HUNG {
            r.false_aborts += 1;
            if r.false_abort_samples.len() < 10 {
                r.false_abort_samples.push(format!(
                    "#{} {:?}: {} {}",
                    c.index,
                    c.request_id,
                    c.outcome,
                    c.error.clone().unwrap_or_default()
                ));
            }
        }
        if let Some(t) = c.ttft_s {
            ttft.push(t * 1000.0);
            if t > WAIT_THRESHOLD.as_secs_f64() {
                r.waited += 1;
            }
        }
        if let (Some(gone), Some(id)) = (c.gone_s, &c.request_id) {
            let still = final_ids.contains(id);
            let seen = if still {
                Some(end_t)
            } else {
                last_seen.get(id).copied()
            };
            if let Some(seen) = seen {
                r.orphan_seconds += (seen - gone).max(0.0);
            }
            if still {
                r.orphans_at_end += 1;
            }
        }
    }
    r.ttft_ms = Percentiles::of(ttft);
    let arrival: Vec<&Sample> = series.iter().filter(|s| s.t <= cfg.arrival_s).collect();
    r.kv_mean = if arrival.is_empty() {
        0.0
    } else {
        arrival.iter().map(|s| s.kv).sum::<f64>() / arrival.len() as f64
    };
    r.kv_peak = series.iter().map(|s| s.kv).fold(0.0, f64::max);
    r.waiting_peak = series.iter().map(|s| s.waiting).fold(0.0, f64::max);
    r.kv_end = series.last().map(|s| s.kv).unwrap_or_default();
    r.aborts_by_reason = st
        .control
        .aborts_by_reason()
        .await
        .context("kvguard-control's aborts at the end of the run")?;
    r.filter_stats = st.filter_stats().await?;
    if let Some(h) = &st.hop {
        let s = h.stats();
        r.hop_clients_gone = s.clients_gone;
        r.hop_bytes_after_gone = s.bytes_after_client_gone;
    }
    if let Some(mut o) = observer {
        o.poll(end_t)
            .await
            .context("Prometheus's alerts at the end")?;
        if !probed {
            o.probe_dashboard()
                .await
                .context("the dashboard's queries")?;
        }
        o.finish()
            .await
            .context("Prometheus's figures at the end")?;
        r.observed = Some(o.seen);
    }
    if let (Some(sim), Some(t0_ms), false) = (sim, t0_engine_ms, by_path) {
        r.engine_orphans = Some(engine_orphans(sim, t0_ms, &clients));
    }
    r.series = series;
    r.clients = clients;
    r.wall_s = started.elapsed().as_secs_f64();
    drop(st);
    Ok(r)
}

/// [`EngineOrphans`] of a run whose first arrival was at `t0_ms` on the simulator's clock.
fn engine_orphans(sim: &sim::Sim, t0_ms: f64, clients: &[ClientRecord]) -> EngineOrphans {
    let now_ms = sim.now_ms() as f64;
    let state = sim.state();
    let mut o = EngineOrphans::default();
    let mut per = Vec::new();
    for c in clients {
        let Some(gone) = c.gone_s else { continue };
        o.left += 1;
        let Some(rec) = c.request_id.as_deref().and_then(|id| state.request(id)) else {
            continue;
        };
        o.matched += 1;
        let end_ms = match rec.ended_ms {
            Some(e) => e as f64,
            None => {
                o.still_at_end += 1;
                now_ms
            }
        };
        let ms = (end_ms - (t0_ms + gone * 1000.0)).max(0.0);
        per.push(ms);
        o.orphan_seconds += ms / 1000.0;
    }
    o.after_leaving_ms = Percentiles::of(per);
    o
}

/// How long the run waits, after its drain phase, for the clients still reading.
const CLIENTS_END: Duration = Duration::from_secs(60);

/// The outcome of a planned client that had not finished when the run ended.
pub const HUNG: &str = "hung";

/// One record per planned client, in plan order: the finished ones as they reported, and
/// for every client that did not report (it hung, or its task was lost) a record with
/// outcome [`HUNG`], which counts as a false abort. A client that vanishes from the
/// table would hide the very failure the demo looks for.
pub fn account_for_every_client(
    plan: &[Planned],
    finished: Vec<ClientRecord>,
) -> Vec<ClientRecord> {
    let mut by_index: BTreeMap<usize, ClientRecord> =
        finished.into_iter().map(|c| (c.index, c)).collect();
    plan.iter()
        .map(|p| {
            by_index.remove(&p.index).unwrap_or_else(|| ClientRecord {
                index: p.index,
                plan: p.kind.label().into(),
                sent_s: p.at.as_secs_f64(),
                outcome: HUNG.into(),
                error: Some(format!(
                    "still running {}s after the drain phase",
                    CLIENTS_END.as_secs()
                )),
                ..ClientRecord::default()
            })
        })
        .collect()
}

/// The demo's verdict, what `kvguard-demo` (and so `scripts/demo` and CI) exits non-zero
/// on: no false abort in any run, and, when both ran, kvguard's orphan-seconds below the
/// run without it.
pub fn verdict(res: &DemoResults) -> Result<()> {
    let mut wrong = Vec::new();
    for r in [&res.leak, &res.kvguard].into_iter().flatten() {
        if r.false_aborts > 0 {
            wrong.push(format!(
                "{}: {} false aborts (clients planned to complete that did not get [DONE], or hung): {:?}",
                r.mode, r.false_aborts, r.false_abort_samples
            ));
        }
        if r.requests != r.clients.len() {
            wrong.push(format!(
                "{}: {} planned clients, {} accounted for",
                r.mode,
                r.requests,
                r.clients.len()
            ));
        }
    }
    if let (Some(leak), Some(kvg)) = (&res.leak, &res.kvguard) {
        // Streams and non-streaming requests left by their clients together.
        let orphan = |r: &RunResult| r.orphan_seconds + r.nonstream_orphan_seconds;
        if orphan(kvg) >= orphan(leak) {
            wrong.push(format!(
                "kvguard's orphan-seconds {:.1} are not below the run without it ({:.1})",
                orphan(kvg),
                orphan(leak)
            ));
        }
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("{}", wrong.join("\n"))
    }
}

/// The demo's verdict from the engine's side, absolute: on the simulator behind the lossy
/// hop (where the engine's records and the clients' request ids meet), kvguard's
/// engine-side orphan-seconds ([`EngineOrphans`]) at most [`ENGINE_ORPHAN_SHARE`] of the
/// run without kvguard's and at most [`ENGINE_ORPHAN_BOUND_S`]; every client that left
/// found in the engine's records. Elsewhere (vLLM, LiteLLM) there is no engine-side
/// figure and this passes, [`verdict`] stands alone. `kvguard-demo` exits non-zero on it.
pub fn engine_verdict(res: &DemoResults) -> Result<()> {
    if res.config.engine != EngineKind::Sim || res.config.hop != Hop::Lossy {
        return Ok(());
    }
    let mut wrong = Vec::new();
    let mut figure = |r: &Option<RunResult>, label: &str| -> Option<f64> {
        let r = r.as_ref()?;
        match &r.engine_orphans {
            None => {
                wrong.push(format!("{label}: no engine-side orphan figure"));
                None
            }
            Some(o) if o.matched != o.left => {
                wrong.push(format!(
                    "{label}: {} of the {} clients that left are not in the engine's records",
                    o.left - o.matched,
                    o.left
                ));
                None
            }
            Some(o) => Some(o.orphan_seconds),
        }
    };
    let leak = figure(&res.leak, "without kvguard");
    let kvg = figure(&res.kvguard, "with kvguard");
    if let Some(k) = kvg {
        if k > ENGINE_ORPHAN_BOUND_S {
            wrong.push(format!(
                "kvguard's engine-side orphan-seconds {k:.3} are above the bound {ENGINE_ORPHAN_BOUND_S} s"
            ));
        }
        if let Some(l) = leak {
            if k > ENGINE_ORPHAN_SHARE * l {
                wrong.push(format!(
                    "kvguard's engine-side orphan-seconds {k:.3} are above {:.0} % of the run without it ({l:.1})",
                    ENGINE_ORPHAN_SHARE * 100.0
                ));
            }
        }
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("{}", wrong.join("\n"))
    }
}

/// Starts the engine for a run: a fresh simulator (returned, keep it alive), or the
/// given vLLM address (waited idle first).
pub async fn engine_for_run(
    cfg: &DemoConfig,
    vllm: Option<SocketAddr>,
) -> Result<(SocketAddr, Option<sim::SimHandle>)> {
    match (cfg.engine, vllm) {
        (EngineKind::Sim, _) => {
            let h = sim::spawn(cfg.sim_config()).await?;
            Ok((h.addr(), Some(h)))
        }
        (EngineKind::Vllm, Some(a)) => {
            crate::vllm::wait_figures(a, "vLLM idle", Duration::from_secs(180), |f| {
                f.running == 0.0 && f.waiting == 0.0
            })
            .await?;
            Ok((a, None))
        }
        (EngineKind::Vllm, None) => anyhow::bail!("--engine vllm needs a vLLM address"),
    }
}

/// Runs both modes (leak first), each on a fresh engine (simulator) or the idle vLLM.
pub async fn run_demo(
    cfg: &DemoConfig,
    modes: &[Mode],
    vllm: Option<SocketAddr>,
    progress: &(dyn Fn(String) + Sync),
) -> Result<DemoResults> {
    let mut out = DemoResults {
        config: cfg.clone(),
        leak: None,
        kvguard: None,
    };
    for &m in modes {
        let (engine, sim) = engine_for_run(cfg, vllm).await?;
        progress(format!("== run: {} (engine {engine}) ==", m.label()));
        let r = run_once_on(
            cfg,
            m,
            engine,
            sim.as_ref().map(|h| h.sim().as_ref()),
            progress,
        )
        .await?;
        drop(sim);
        match m {
            Mode::Leak => out.leak = Some(r),
            Mode::Kvguard => out.kvguard = Some(r),
        }
    }
    Ok(out)
}

/// Streams and non-streaming requests in kvguard-control's in-flight table, told apart
/// by path ([`DemoConfig::split_by_path`]).
async fn inflight_by_kind(st: &Stack) -> Result<(usize, usize)> {
    let v = crate::client::get_json(st.control.admin, "/v1/requests")
        .await
        .context("kvguard-control's /v1/requests")?;
    let rows = v["requests"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let nonstream = rows
        .iter()
        .filter(|r| r["path"].as_str() == Some(workload::NONSTREAM_PATH))
        .count();
    Ok((rows.len() - nonstream, nonstream))
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// The side-by-side table (text).
pub fn table(res: &DemoResults) -> String {
    let empty = RunResult::default();
    let a = res.leak.as_ref().unwrap_or(&empty);
    let b = res.kvguard.as_ref().unwrap_or(&empty);
    let mut rows: Vec<(String, String, String)> = vec![
        (
            "requests sent".into(),
            a.requests.to_string(),
            b.requests.to_string(),
        ),
        (
            "read to [DONE]".into(),
            a.completed.to_string(),
            b.completed.to_string(),
        ),
        (
            "clients that disconnected".into(),
            a.disconnected.to_string(),
            b.disconnected.to_string(),
        ),
        (
            "stalled streams".into(),
            a.stalled.to_string(),
            b.stalled.to_string(),
        ),
        (
            "orphan-seconds (engine time, client gone)".into(),
            format!("{:.1}", a.orphan_seconds),
            format!("{:.1}", b.orphan_seconds),
        ),
        (
            "orphans still in the engine at the end".into(),
            a.orphans_at_end.to_string(),
            b.orphans_at_end.to_string(),
        ),
    ];
    if a.engine_orphans.is_some() || b.engine_orphans.is_some() {
        let eo = |r: &RunResult, f: &dyn Fn(&EngineOrphans) -> String| {
            r.engine_orphans
                .as_ref()
                .map(f)
                .unwrap_or_else(|| "-".into())
        };
        rows.push((
            "orphan-seconds, engine side (its own records)".into(),
            eo(a, &|o| format!("{:.3}", o.orphan_seconds)),
            eo(b, &|o| format!("{:.3}", o.orphan_seconds)),
        ));
        rows.push((
            "  per left client, ms to the engine's end p50/p99/max".into(),
            eo(a, &|o| {
                let p = &o.after_leaving_ms;
                format!("{:.0} / {:.0} / {:.0}", p.p50, p.p99, p.max)
            }),
            eo(b, &|o| {
                let p = &o.after_leaving_ms;
                format!("{:.0} / {:.0} / {:.0}", p.p50, p.p99, p.max)
            }),
        ));
    }
    rows.extend([
        (
            "KV usage: mean while loaded".into(),
            pct(a.kv_mean),
            pct(b.kv_mean),
        ),
        ("KV usage: peak".into(), pct(a.kv_peak), pct(b.kv_peak)),
        (
            "KV usage: at the end (baseline)".into(),
            format!("{} ({})", pct(a.kv_end), pct(a.kv_baseline)),
            format!("{} ({})", pct(b.kv_end), pct(b.kv_baseline)),
        ),
        (
            "waiting requests: peak".into(),
            a.waiting_peak.to_string(),
            b.waiting_peak.to_string(),
        ),
        (
            format!(
                "requests that waited (TTFT > {:.1}s)",
                WAIT_THRESHOLD.as_secs_f64()
            ),
            a.waited.to_string(),
            b.waited.to_string(),
        ),
        (
            "TTFT p50 / p99 (ms)".into(),
            format!("{:.0} / {:.0}", a.ttft_ms.p50, a.ttft_ms.p99),
            format!("{:.0} / {:.0}", b.ttft_ms.p50, b.ttft_ms.p99),
        ),
    ]);
    let mut reasons: Vec<&String> = a
        .aborts_by_reason
        .keys()
        .chain(b.aborts_by_reason.keys())
        .collect();
    reasons.sort();
    reasons.dedup();
    for k in reasons {
        let g = |r: &RunResult| r.aborts_by_reason.get(k).copied().unwrap_or(0.0);
        if g(a) == 0.0 && g(b) == 0.0 {
            continue;
        }
        rows.push((format!("aborts: {k}"), g(a).to_string(), g(b).to_string()));
    }
    if a.nonstream_sent + b.nonstream_sent > 0 {
        rows.push((
            "non-streaming requests sent / left by their client".into(),
            format!("{} / {}", a.nonstream_sent, a.nonstream_left),
            format!("{} / {}", b.nonstream_sent, b.nonstream_left),
        ));
        rows.push((
            "non-streaming left: orphan-seconds (leaked)".into(),
            format!("{:.1}", a.nonstream_orphan_seconds),
            format!("{:.1}", b.nonstream_orphan_seconds),
        ));
        rows.push((
            "non-streaming left: still in the engine at the end".into(),
            a.nonstream_orphans_at_end.to_string(),
            b.nonstream_orphans_at_end.to_string(),
        ));
    }
    let total = |r: &RunResult| r.aborts_by_reason.values().sum::<f64>().to_string();
    rows.push(("aborts: all reasons".into(), total(a), total(b)));
    rows.push((
        "false aborts (must be 0)".into(),
        a.false_aborts.to_string(),
        b.false_aborts.to_string(),
    ));
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(10);
    let w1 = rows
        .iter()
        .map(|r| r.1.len())
        .max()
        .unwrap_or(10)
        .max(Mode::Leak.label().len());
    let mut s = format!(
        "{:<w0$}  {:>w1$}  {}\n",
        "",
        Mode::Leak.label(),
        Mode::Kvguard.label()
    );
    for (k, x, y) in rows {
        s.push_str(&format!("{k:<w0$}  {x:>w1$}  {y}\n"));
    }
    s
}

/// KV usage and running/waiting over time, both runs, one row per `step_s`.
pub fn series_table(res: &DemoResults, step_s: f64) -> String {
    let empty = RunResult::default();
    let a = res.leak.as_ref().unwrap_or(&empty);
    let b = res.kvguard.as_ref().unwrap_or(&empty);
    let at = |r: &RunResult, t: f64| -> Option<Sample> {
        r.series.iter().rfind(|s| s.t <= t + 1e-6).copied()
    };
    let horizon = a
        .series
        .last()
        .map(|s| s.t)
        .unwrap_or(0.0)
        .max(b.series.last().map(|s| s.t).unwrap_or(0.0));
    let mut s = format!(
        "{:>5}  {:^26}  {:^26}\n{:>5}  {:>7} {:>8} {:>8}  {:>7} {:>8} {:>8}\n",
        "",
        Mode::Leak.label(),
        Mode::Kvguard.label(),
        "t(s)",
        "kv",
        "running",
        "waiting",
        "kv",
        "running",
        "waiting"
    );
    let mut t = step_s;
    while t <= horizon + 1e-6 {
        let fmt = |o: Option<Sample>| match o {
            Some(x) => format!("{:>7} {:>8} {:>8}", pct(x.kv), x.running, x.waiting),
            None => format!("{:>7} {:>8} {:>8}", "-", "-", "-"),
        };
        s.push_str(&format!("{t:>5.0}  {}  {}\n", fmt(at(a, t)), fmt(at(b, t))));
        t += step_s;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(mode: &str, orphan_seconds: f64, false_aborts: usize) -> RunResult {
        RunResult {
            mode: mode.into(),
            orphan_seconds,
            false_aborts,
            ..RunResult::default()
        }
    }

    #[test]
    fn a_client_that_did_not_report_is_a_hung_false_abort() {
        let mut cfg = DemoConfig::new(EngineKind::Sim);
        cfg.arrival_s = 2.0;
        let plan = plan(&cfg);
        assert_eq!(plan.len(), 10);
        let finished: Vec<ClientRecord> = plan
            .iter()
            .filter(|p| p.index != 3)
            .map(|p| ClientRecord {
                index: p.index,
                plan: p.kind.label().into(),
                outcome: "done".into(),
                ..ClientRecord::default()
            })
            .collect();
        let all = account_for_every_client(&plan, finished);
        assert_eq!(all.len(), plan.len());
        assert!(all.iter().enumerate().all(|(i, c)| c.index == i));
        assert_eq!(all[3].outcome, HUNG);
        assert_eq!(all[3].plan, plan[3].kind.label());
    }

    #[test]
    fn engine_verdict_is_absolute_and_reads_the_engine_side_figure() {
        let eo = |orphan_seconds: f64| EngineOrphans {
            left: 10,
            matched: 10,
            orphan_seconds,
            ..EngineOrphans::default()
        };
        let both = |leak: Option<EngineOrphans>, kvg: Option<EngineOrphans>| DemoResults {
            config: DemoConfig::new(EngineKind::Sim),
            leak: Some(RunResult {
                engine_orphans: leak,
                ..run("leak", 70.0, 0)
            }),
            kvguard: Some(RunResult {
                engine_orphans: kvg,
                ..run("kvguard", 0.0, 0)
            }),
        };
        assert!(engine_verdict(&both(Some(eo(77.0)), Some(eo(0.05)))).is_ok());
        // Below 1 % of the leak run but above the absolute bound.
        let e = engine_verdict(&both(
            Some(eo(1000.0)),
            Some(eo(ENGINE_ORPHAN_BOUND_S + 0.1)),
        ))
        .unwrap_err();
        assert!(e.to_string().contains("above the bound"), "{e}");
        // Below the absolute bound but above 1 % of the leak run.
        let e = engine_verdict(&both(Some(eo(5.0)), Some(eo(0.06)))).unwrap_err();
        assert!(e.to_string().contains("1 % of the run without it"), "{e}");
        // A missing figure, or a client the engine has no record of, is not 0.
        let e = engine_verdict(&both(Some(eo(77.0)), None)).unwrap_err();
        assert!(
            e.to_string().contains("with kvguard: no engine-side"),
            "{e}"
        );
        let mut partial = eo(0.0);
        partial.matched = 9;
        let e = engine_verdict(&both(Some(eo(77.0)), Some(partial))).unwrap_err();
        assert!(e.to_string().contains("1 of the 10 clients"), "{e}");
        // vLLM has no engine-side figure: the verdict is verdict()'s alone.
        let mut v = both(None, None);
        v.config = DemoConfig::new(EngineKind::Vllm);
        assert!(engine_verdict(&v).is_ok());
    }

    #[test]
    fn verdict_fails_on_false_aborts_and_on_orphan_seconds_not_below_the_leak() {
        let both = |leak: RunResult, kvg: RunResult| DemoResults {
            config: DemoConfig::new(EngineKind::Sim),
            leak: Some(leak),
            kvguard: Some(kvg),
        };
        assert!(verdict(&both(run("leak", 50.0, 0), run("kvguard", 0.5, 0))).is_ok());
        let e = verdict(&both(run("leak", 50.0, 0), run("kvguard", 0.5, 1))).unwrap_err();
        assert!(e.to_string().contains("1 false aborts"), "{e}");
        let e = verdict(&both(run("leak", 5.0, 0), run("kvguard", 5.0, 0))).unwrap_err();
        assert!(e.to_string().contains("orphan-seconds"), "{e}");
        let e = verdict(&both(run("leak", 0.0, 2), run("kvguard", 0.0, 0))).unwrap_err();
        assert!(e.to_string().contains("leak: 2 false aborts"), "{e}");
    }
}
