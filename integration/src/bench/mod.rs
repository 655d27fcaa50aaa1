//! `kvguard-bench`: what kvguard costs, measured side by side (issue 6). Never a timed
//! test assertion: it prints figures and writes them to JSON, markdown and an SVG chart.
//!
//! Sections:
//! - `overhead`: one Envoy process with three identical listeners (no filter, a
//!   do-nothing wasm filter, kvguard in enforce mode with aborts to a receiver), many
//!   concurrent SSE streams over HTTP/1.1 and HTTP/2 from the Rust load generator
//!   ([`crate::load`]) against a fast upstream ([`upstream::FastUpstream`]), interleaved
//!   rounds in alternating order. Envoy CPU per relayed event from `/proc/<pid>`, TTFB,
//!   inter-event delay, throughput.
//! - `abort`: client disconnect → abort received (mock receiver), and client disconnect
//!   → engine connection closed (Envoy + kvguard → lossy hop → kvguard-control → upstream).
//! - `stall`: stall detection delay minus the idle timeout.
//! - `memory`: wasm VM memory and Envoy RSS at 0, 1k, 10k tracked streams and after they
//!   end, over repeated waves.
//! - `control`: kvguard-control RSS, and its proxy hop vs direct (TTFB p50).
//! - `instructions` (the headline): Envoy's instructions per request and per event under
//!   callgrind, per listener, in one run ([`instructions`]).
//! - `relay`: kvguard-control on the data path against a plain Envoy relaying the same
//!   paced SSE streams: CPU per event, added TTFB, memory per held stream ([`relay`]).
//! - `requests`: Envoy CPU per request (2,000 one-event requests at 500 concurrent) with
//!   h2load over HTTP/1.1 and h2c beside the workspace's load generator, including other
//!   builds of the filter (`--compare-wasm`) side by side ([`requests`]).

pub mod instructions;
pub mod relay;
pub mod report;
pub mod requests;
pub mod soak;
pub mod upstream;

use crate::client;
use crate::demo::stack::{self, Control};
use crate::envoy::{Envoy, EnvoyOptions};
use crate::load::{self, LoadConfig, LoadSummary, Percentiles};
use crate::lossy::{self, LossyConfig};
use crate::receiver::{self, ReceiverConfig};
use anyhow::{bail, Context, Result};
use kvguard_contract::Key;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use upstream::FastUpstream;

/// The listeners compared by the overhead section, in their round-0 order.
pub const VARIANTS: [&str; 4] = ["none", "noop", "noop-read", "kvguard"];

fn listener_name(variant: &str) -> &str {
    if variant == "kvguard" {
        "ingress"
    } else {
        variant
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Interleaved rounds of the overhead section (≥ 5 for a recorded run).
    pub rounds: usize,
    /// Smaller loads (development runs).
    pub quick: bool,
    /// Sections to run (`overhead`, `abort`, `stall`, `memory`, `control`, `requests`).
    pub sections: Vec<String>,
    /// The do-nothing filter's wasm.
    pub noop_wasm: PathBuf,
    /// Disconnects measured per abort-latency setup.
    pub disconnects: usize,
    /// Tracked-stream levels of the memory section (the largest is the wave size).
    pub memory_levels: Vec<usize>,
    /// Memory waves.
    pub memory_waves: usize,
    /// Pin the measured proxy (Envoy; kvguard-control in the control section) alone on
    /// the last CPU and the bench (clients, upstream, receivers) on the others, so that
    /// the load generator's scheduling does not land in the proxy's figures.
    pub pin: bool,
    /// Other builds of the filter measured beside `kvguard` in the `requests` section:
    /// (label, wasm path).
    pub compare_wasm: Vec<(String, PathBuf)>,
    /// `requests` section: measure what single host calls cost, each made this many times
    /// per request by the do-nothing filter.
    pub host_call_costs: Option<u32>,
    /// `requests` section: only these clients (empty: all of [`requests::CLIENTS`]).
    pub request_clients: Vec<String>,
    /// Keys set in kvguard's filter configuration in the overhead and requests sections
    /// (on top of the bench's), e.g. `{"max_age_ms": 1, "tick_ms": 10}` to check that the
    /// bench fails when healthy streams are aborted.
    pub kvguard_config: serde_json::Map<String, Value>,
    /// Rounds of the `instructions` section (each a zero/dump per listener and load).
    pub instruction_rounds: usize,
    /// Headers added to every request of the `instructions` section.
    pub instruction_headers: usize,
    /// Where the `instructions` section keeps its callgrind dumps and annotations.
    pub callgrind_dir: PathBuf,
}

/// Restricts every thread of process `pid` to `cpus` (`sched_setaffinity` per task).
pub fn pin_tasks(pid: u32, cpus: &[usize]) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `c` is below the number of CPUs, far below CPU_SETSIZE.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .with_context(|| format!("listing the threads of {pid}"))?;
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: `set` is a valid cpu_set_t of the size passed.
        let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set) };
        if rc != 0 {
            bail!(
                "sched_setaffinity({tid}): {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// The CPU the measured proxy gets when pinning (the last one), if there are two or more.
fn proxy_cpu() -> Option<usize> {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    (n >= 2).then_some(n - 1)
}

/// Pins the measured proxy `pid` alone on the last CPU (no-op without `opts.pin`).
fn pin_proxy(opts: &BenchOptions, pid: u32) -> Result<()> {
    match proxy_cpu() {
        Some(cpu) if opts.pin => pin_tasks(pid, &[cpu]),
        _ => Ok(()),
    }
}

/// Envoy's CPU time so far, in ns: the sum of `/proc/<pid>/task/*/schedstat` run times
/// (ns resolution), and `/proc/<pid>/stat` utime+stime in clock ticks.
pub fn cpu(pid: u32) -> (u64, u64) {
    let mut ns = 0u64;
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in rd.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                ns += s
                    .split_whitespace()
                    .next()
                    .and_then(|x| x.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    let ticks = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1.to_owned();
            let f: Vec<&str> = rest.split_whitespace().collect();
            // After the comm: state is field 3; utime 14 and stime 15 (1-based) → 11, 12.
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0);
    (ns, ticks)
}

/// Clock ticks per second (for `/proc/<pid>/stat`).
pub fn clk_tck() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if v > 0 {
        v as u64
    } else {
        100
    }
}

/// Resident set size of a process, bytes (`VmRSS`). Errors when the process or the field
/// is missing: a memory check must not pass on a process that is gone.
pub fn rss(pid: u32) -> Result<u64> {
    status_bytes(pid, "VmRSS")
}

/// Peak resident set size of a process so far, bytes (`VmHWM`, the kernel's high-water
/// mark): the peak of a burst, however short, without sampling during it.
pub fn peak_rss(pid: u32) -> Result<u64> {
    status_bytes(pid, "VmHWM")
}

/// A `kB` field of `/proc/<pid>/status`, in bytes.
fn status_bytes(pid: u32, field: &str) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let s = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .with_context(|| format!("no {field} in {path}"))
}

/// One load scenario of the overhead section.
#[derive(Debug, Clone, Serialize)]
pub struct Scenario {
    /// Name, e.g. `h2-paced-1000`.
    pub name: String,
    /// h2c instead of HTTP/1.1.
    pub http2: bool,
    /// Concurrent streams.
    pub concurrency: usize,
    /// Streams in all.
    pub requests: usize,
    /// Data events per stream (plus `[DONE]`).
    pub events: u64,
    /// Gap between events, µs (0 = burst: saturation).
    pub interval_us: u64,
}

fn scenarios(quick: bool) -> Vec<Scenario> {
    let s = |name: &str, http2, concurrency, requests, events, interval_us| Scenario {
        name: name.into(),
        http2,
        concurrency,
        requests,
        events,
        interval_us,
    };
    if quick {
        return vec![
            s("h1-sat-100", false, 100, 300, 64, 0),
            s("h1-paced-100", false, 100, 100, 20, 20_000),
            s("h2-paced-1000", true, 1000, 1000, 10, 100_000),
        ];
    }
    vec![
        s("h1-sat-100", false, 100, 1000, 64, 0),
        // The same with 4 events per stream: with h1-sat-100 it splits kvguard's cost into
        // a per-request and a per-event part.
        s("h1-sat-100-short", false, 100, 4000, 4, 0),
        s("h2-sat-100", true, 100, 1000, 64, 0),
        s("h1-paced-100", false, 100, 300, 40, 20_000),
        s("h1-paced-1000", false, 1000, 1000, 20, 100_000),
        s("h2-paced-1000", true, 1000, 1000, 20, 100_000),
    ]
}

/// One measured run.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// Round.
    pub round: usize,
    /// Listener variant.
    pub variant: String,
    /// Envoy CPU (schedstat) per relayed event, µs.
    pub cpu_us_per_event: f64,
    /// Envoy CPU (`/proc/<pid>/stat` utime+stime) per relayed event, µs (10 ms ticks).
    pub stat_cpu_us_per_event: f64,
    /// Events relayed (data events and `[DONE]`).
    pub events: u64,
    /// Events per second over the run.
    pub throughput: f64,
    /// TTFB (request sent → first data event), ms.
    pub ttfb_ms: Percentiles,
    /// Gap between events, ms.
    pub inter_event_ms: Percentiles,
    /// Errors + truncated streams.
    pub errors: usize,
    /// Seconds.
    pub duration_s: f64,
}

async fn load_once(target: SocketAddr, sc: &Scenario, seed: u64) -> LoadSummary {
    let mut cfg = LoadConfig::new(target);
    cfg.requests = sc.requests;
    cfg.concurrency = sc.concurrency;
    cfg.http2 = sc.http2;
    cfg.max_tokens = sc.events as u32;
    cfg.seed = seed;
    cfg.stream_timeout = Duration::from_secs(60);
    cfg.headers = vec![
        ("x-bench-events".into(), sc.events.to_string()),
        ("x-bench-interval-us".into(), sc.interval_us.to_string()),
    ];
    load::run(cfg).await
}

fn noop_filter_json(noop_wasm: &std::path::Path, read_body: bool) -> Value {
    let (vm, cfg) = if read_body {
        ("noop-read", r#"{"read_body": true}"#)
    } else {
        ("noop", "{}")
    };
    json!({
        "name": "noop",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "noop",
                "root_id": "noop",
                "failure_policy": "FAIL_OPEN",
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": cfg},
                "vm_config": {
                    "vm_id": vm,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": noop_wasm.display().to_string()}}
                }
            }
        }
    })
}

/// The bench secret (filter and receiver / control).
pub const SECRET: &str = stack::SECRET;

/// Raises Envoy's default circuit breakers (1,024 connections / requests per cluster) on
/// every cluster, so that 10,000 streams can be held.
pub fn raise_circuit_breakers(b: &mut Value) {
    if let Some(clusters) = b["static_resources"]["clusters"].as_array_mut() {
        for c in clusters {
            c["circuit_breakers"] = json!({"thresholds": [{
                "max_connections": 1_000_000,
                "max_pending_requests": 1_000_000,
                "max_requests": 1_000_000,
                "max_retries": 1_000
            }]});
        }
    }
}

/// Envoy options with kvguard in front of `upstream`, aborts to `control`, quiet logs,
/// circuit breakers raised.
pub fn kvguard_envoy(upstream: SocketAddr, control: SocketAddr, filter: Value) -> EnvoyOptions {
    let mut eo =
        EnvoyOptions::with_filter(upstream, control, filter).vm_env("KVGUARD_SECRET", SECRET);
    eo.access_log = false;
    eo.log_level = "warn".into();
    eo.component_log_level = Some("wasm:warn".into());
    eo.patch = Some(Arc::new(raise_circuit_breakers));
    eo
}

/// Starts the Envoy of the overhead section, one listener per [`VARIANTS`] entry, with
/// the abort receiver kvguard's listener calls, and pins Envoy to the proxy's CPU.
pub async fn three_listener_envoy(
    upstream: SocketAddr,
    opts: &BenchOptions,
) -> Result<(Envoy, receiver::Receiver)> {
    let rx = receiver::spawn(ReceiverConfig::new(vec![Key::try_new(SECRET.as_bytes())?])).await?;
    let (mut envoy, _) = requests::envoy(
        upstream,
        rx.addr(),
        opts.noop_wasm.clone(),
        Vec::new(),
        None,
        &opts.kvguard_config,
        |_, _| {},
    )
    .await?;
    pin_proxy(opts, envoy.guard().pid())?;
    Ok((envoy, rx))
}

/// The `p` quantile (0 ≤ p ≤ 1) of `v`, interpolated linearly between the closest ranks
/// (rank (n − 1) × p, 0-based: numpy's and R's default, type 7); NaN when `v` is empty.
fn quantile(mut v: Vec<f64>, p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let h = (v.len() - 1) as f64 * p.clamp(0.0, 1.0);
    let (lo, hi) = (h.floor() as usize, h.ceil() as usize);
    match (v.get(lo), v.get(hi)) {
        (Some(a), Some(b)) => a + (h - lo as f64) * (b - a),
        _ => f64::NAN,
    }
}

/// Median, interquartile range and extremes of a series (across rounds).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    /// Median.
    pub median: f64,
    /// First quartile ([`quantile`] 0.25).
    pub q1: f64,
    /// Third quartile ([`quantile`] 0.75).
    pub q3: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    /// Of a series (non-finite values are left out).
    pub fn of(v: &[f64]) -> Spread {
        let v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        Spread {
            median: quantile(v.clone(), 0.5),
            q1: quantile(v.clone(), 0.25),
            q3: quantile(v.clone(), 0.75),
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }
}

/// The overhead section.
pub async fn overhead(opts: &BenchOptions) -> Result<Value> {
    let up = FastUpstream::spawn().await?;
    let (mut envoy, rx) = three_listener_envoy(up.addr(), opts).await?;
    let pid = envoy.guard().pid();
    let mut ports = BTreeMap::new();
    for v in VARIANTS {
        ports.insert(v, envoy.listener_named(listener_name(v)).await?);
    }
    let scs = scenarios(opts.quick);
    // Warm-up: every listener, every protocol.
    for v in VARIANTS {
        for h2 in [false, true] {
            let w = Scenario {
                name: "warmup".into(),
                http2: h2,
                concurrency: 20,
                requests: 40,
                events: 16,
                interval_us: 0,
            };
            let s = load_once(ports[v], &w, 1).await;
            if s.errors > 0 || s.completed == 0 {
                bail!(
                    "warm-up through {v} failed: {:?}{}",
                    s.error_samples,
                    aborts_note("overhead", &rx.calls())
                );
            }
        }
    }
    let tck = clk_tck();
    let mut runs: BTreeMap<String, Vec<Run>> = BTreeMap::new();
    for round in 0..opts.rounds {
        let mut order: Vec<&str> = VARIANTS.to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for sc in &scs {
            for v in &order {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let (ns0, t0) = cpu(pid);
                let s = load_once(ports[v], sc, round as u64 * 7 + 1).await;
                let (ns1, t1) = cpu(pid);
                let events = s.events.max(1);
                let run = Run {
                    round,
                    variant: (*v).to_owned(),
                    cpu_us_per_event: (ns1 - ns0) as f64 / 1000.0 / events as f64,
                    stat_cpu_us_per_event: (t1 - t0) as f64 * 1e6 / tck as f64 / events as f64,
                    events: s.events,
                    throughput: s.events as f64 / s.duration_s.max(1e-9),
                    ttfb_ms: s.ttfb_ms,
                    inter_event_ms: s.inter_event_ms,
                    errors: s.errors + s.truncated,
                    duration_s: s.duration_s,
                };
                eprintln!(
                    "overhead round {round} {:>14} {:>7}: {:>7.2} µs/event  ttfb p50 {:.2} ms p99 {:.2} ms  gap p99 {:.2} ms  {:.0} ev/s  errors {}",
                    sc.name, v, run.cpu_us_per_event, run.ttfb_ms.p50, run.ttfb_ms.p99, run.inter_event_ms.p99, run.throughput, run.errors
                );
                runs.entry(format!("{}/{}", sc.name, v))
                    .or_default()
                    .push(run);
            }
        }
    }
    // TTFB probes with 1,000 streams in flight on the same listener.
    let mut probes: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let probe_n = if opts.quick { 60 } else { 400 };
    for round in 0..opts.rounds {
        let mut order: Vec<&str> = VARIANTS.to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for v in &order {
            let (p50, p99) = ttfb_under_load(ports[v], probe_n, round as u64).await?;
            eprintln!("ttfb probes round {round} {v:>9}: p50 {p50:.0} µs p99 {p99:.0} µs (1,000 h2 streams in flight)");
            probes.entry((*v).to_owned()).or_default().push((p50, p99));
        }
    }
    let probe_summary: BTreeMap<String, Value> = probes
        .iter()
        .map(|(v, xs)| {
            let p50: Vec<f64> = xs.iter().map(|x| x.0).collect();
            let p99: Vec<f64> = xs.iter().map(|x| x.1).collect();
            (
                v.clone(),
                json!({"p50_us": Spread::of(&p50), "p99_us": Spread::of(&p99)}),
            )
        })
        .collect();
    let probe_added = |a: &str, b: &str, i: usize| -> Spread {
        let (Some(x), Some(y)) = (probes.get(a), probes.get(b)) else {
            return Spread::of(&[]);
        };
        Spread::of(
            &x.iter()
                .zip(y)
                .map(|(p, q)| if i == 0 { p.0 - q.0 } else { p.1 - q.1 })
                .collect::<Vec<_>>(),
        )
    };
    let ttfb_probe = json!({
        "probes_per_round": probe_n,
        "background": "1,000 h2 streams, 2 events/s each, on the same listener",
        "variants": probe_summary,
        "kvguard_added_p50_us_vs_none": probe_added("kvguard", "none", 0),
        "kvguard_added_p99_us_vs_none": probe_added("kvguard", "none", 1),
        "kvguard_added_p50_us_vs_noop": probe_added("kvguard", "noop", 0),
        "kvguard_added_p99_us_vs_noop": probe_added("kvguard", "noop", 1),
    });
    let stats = envoy
        .stats_matching("kvguard_filter")
        .await
        .unwrap_or_default();
    let false_aborts = rx.calls();
    // Summaries per scenario.
    let mut summary = Vec::new();
    for sc in &scs {
        let get = |v: &str| {
            runs.get(&format!("{}/{}", sc.name, v))
                .cloned()
                .unwrap_or_default()
        };
        let (none, noop, noop_read, kvg) =
            (get("none"), get("noop"), get("noop-read"), get("kvguard"));
        let per_round = |a: &[Run], b: &[Run], f: &dyn Fn(&Run) -> f64| -> Vec<f64> {
            a.iter().zip(b).map(|(x, y)| f(x) / f(y)).collect()
        };
        let diff = |a: &[Run], b: &[Run], f: &dyn Fn(&Run) -> f64| -> Vec<f64> {
            a.iter().zip(b).map(|(x, y)| f(x) - f(y)).collect()
        };
        let cpu_f = |r: &Run| r.cpu_us_per_event;
        let p50 = |r: &Run| r.ttfb_ms.p50 * 1000.0;
        let p99 = |r: &Run| r.ttfb_ms.p99 * 1000.0;
        let col =
            |rs: &[Run], f: &dyn Fn(&Run) -> f64| Spread::of(&rs.iter().map(f).collect::<Vec<_>>());
        let variants: BTreeMap<&str, Value> = [
            ("none", &none),
            ("noop", &noop),
            ("noop-read", &noop_read),
            ("kvguard", &kvg),
        ]
        .into_iter()
        .map(|(n, rs)| {
            (
                n,
                json!({
                    "cpu_us_per_event": col(rs, &cpu_f),
                    "stat_cpu_us_per_event": col(rs, &|r| r.stat_cpu_us_per_event),
                    "ttfb_p50_ms": col(rs, &|r| r.ttfb_ms.p50),
                    "ttfb_p99_ms": col(rs, &|r| r.ttfb_ms.p99),
                    "inter_event_p99_ms": col(rs, &|r| r.inter_event_ms.p99),
                    "throughput_events_per_s": col(rs, &|r| r.throughput),
                    "errors": rs.iter().map(|r| r.errors).sum::<usize>(),
                }),
            )
        })
        .collect();
        summary.push(json!({
            "scenario": sc,
            "variants": variants,
            "cpu_kvguard_over_noop": Spread::of(&per_round(&kvg, &noop, &cpu_f)),
            "cpu_kvguard_over_none": Spread::of(&per_round(&kvg, &none, &cpu_f)),
            "cpu_noop_over_none": Spread::of(&per_round(&noop, &none, &cpu_f)),
            "cpu_noop_read_over_noop": Spread::of(&per_round(&noop_read, &noop, &cpu_f)),
            "cpu_kvguard_over_noop_read": Spread::of(&per_round(&kvg, &noop_read, &cpu_f)),
            "ttfb_p50_added_us_vs_none": Spread::of(&diff(&kvg, &none, &p50)),
            "ttfb_p99_added_us_vs_none": Spread::of(&diff(&kvg, &none, &p99)),
            "ttfb_p50_added_us_vs_noop": Spread::of(&diff(&kvg, &noop, &p50)),
            "ttfb_p99_added_us_vs_noop": Spread::of(&diff(&kvg, &noop, &p99)),
        }));
    }
    let cost_split = cost_split(&scs, &runs);
    Ok(json!({
        "rounds": opts.rounds,
        "cost_split": cost_split,
        "envoy_pid_cpu_source": "sum of /proc/<pid>/task/*/schedstat run time (ns); /proc/<pid>/stat utime+stime also recorded",
        "summary": summary,
        "ttfb_probe": ttfb_probe,
        "runs": runs,
        "aborts_sent_during_healthy_load": false_aborts.len(),
        "abort_reasons_during_healthy_load": abort_reasons(&false_aborts),
        "filter_stats": stats,
    }))
}

/// Splits each listener's Envoy CPU per stream into a per-request and a per-event part,
/// from the two saturation scenarios that differ only in events per stream
/// (`h1-sat-100`, `h1-sat-100-short`): per round, CPU per stream = a + b × events.
fn cost_split(scs: &[Scenario], runs: &BTreeMap<String, Vec<Run>>) -> Value {
    let (long, short) = ("h1-sat-100", "h1-sat-100-short");
    let requests = |name: &str| scs.iter().find(|s| s.name == name).map(|s| s.requests);
    let (Some(req_long), Some(req_short)) = (requests(long), requests(short)) else {
        return Value::Null;
    };
    // Per round: (per-request µs, per-event µs).
    let split = |v: &str| -> Vec<(f64, f64)> {
        let (Some(l), Some(s)) = (
            runs.get(&format!("{long}/{v}")),
            runs.get(&format!("{short}/{v}")),
        ) else {
            return Vec::new();
        };
        l.iter()
            .zip(s)
            .filter_map(|(l, s)| {
                let n_l = l.events as f64 / req_long as f64;
                let n_s = s.events as f64 / req_short as f64;
                if n_l - n_s < 1.0 {
                    return None;
                }
                let (t_l, t_s) = (l.cpu_us_per_event * n_l, s.cpu_us_per_event * n_s);
                let b = (t_l - t_s) / (n_l - n_s);
                Some((t_s - n_s * b, b))
            })
            .collect()
    };
    let mut out = serde_json::Map::new();
    let base = split("noop-read");
    for v in VARIANTS {
        let xs = split(v);
        out.insert(
            v.to_owned(),
            json!({
                "per_request_us": Spread::of(&xs.iter().map(|x| x.0).collect::<Vec<_>>()),
                "per_event_us": Spread::of(&xs.iter().map(|x| x.1).collect::<Vec<_>>()),
            }),
        );
    }
    let kvg = split("kvguard");
    out.insert(
        "kvguard_minus_noop_read".to_owned(),
        json!({
            "per_request_us": Spread::of(&kvg.iter().zip(&base).map(|(k, b)| k.0 - b.0).collect::<Vec<_>>()),
            "per_event_us": Spread::of(&kvg.iter().zip(&base).map(|(k, b)| k.1 - b.1).collect::<Vec<_>>()),
        }),
    );
    Value::Object(out)
}

/// TTFB (request sent on a fresh connection → first data event) of `n` sequential probes
/// while 1,000 paced h2 streams are in flight on the same listener; returns (p50, p99) µs.
async fn ttfb_under_load(target: SocketAddr, n: usize, seed: u64) -> Result<(f64, f64)> {
    let bg = Scenario {
        name: "background".into(),
        http2: true,
        concurrency: 1000,
        requests: 1000,
        events: 20,
        interval_us: 500_000,
    };
    let handle = tokio::spawn(async move { load_once(target, &bg, seed).await });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let body =
        json!({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": true});
    let mut xs = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        let mut s = client::stream_sse(
            target,
            "/v1/chat/completions",
            &body,
            &[("x-bench-events", "1")],
            false,
        )
        .await?;
        if s.next_data(Duration::from_secs(5)).await?.is_some() {
            xs.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        let _ = s.collect(Duration::from_secs(5)).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let bgs = handle.await?;
    if bgs.errors > 0 {
        eprintln!("ttfb probes: background errors {:?}", bgs.error_samples);
    }
    let p = Percentiles::of(xs);
    Ok((p.p50, p.p99))
}

/// One disconnect's timings.
#[derive(Debug, Clone, Serialize)]
struct DisconnectSample {
    id: String,
    to_receiver_ms: Option<f64>,
    to_engine_closed_ms: Option<f64>,
}

/// Opens `n` paced streams through `entry`, reads each one's first event (learning its
/// request id from `chatcmpl-<id>`), then disconnects them one by one `gap` apart.
/// Returns (id, disconnect instant).
async fn open_and_disconnect(
    entry: SocketAddr,
    n: usize,
    headers: &[(&str, &str)],
    http2: bool,
    gap: Duration,
) -> Result<Vec<(String, Instant)>> {
    let body =
        json!({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": true});
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let body = body.clone();
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        set.spawn(async move {
            let h: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let mut s = client::stream_sse(entry, "/v1/chat/completions", &body, &h, http2).await?;
            let ev = s
                .next_data(Duration::from_secs(20))
                .await?
                .context("stream ended before its first event")?;
            let id = ev
                .json()
                .and_then(|v| v["id"].as_str().map(str::to_owned))
                .and_then(|s| s.strip_prefix("chatcmpl-").map(str::to_owned))
                .context("no chatcmpl id in the first event")?;
            anyhow::Ok((id, s))
        });
    }
    let mut streams = Vec::new();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(Ok(x)) => streams.push(x),
            Ok(Err(e)) => eprintln!("abort bench: a stream failed to open: {e:#}"),
            Err(e) => eprintln!("abort bench: a stream task failed: {e}"),
        }
    }
    let mut out = Vec::new();
    for (id, s) in streams {
        let t0 = Instant::now();
        s.disconnect();
        out.push((id, t0));
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
    }
    Ok(out)
}

fn ms_since(a: Instant, b: Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64() * 1000.0
}

/// Stalls `n` staggered streams through `envoy`; returns (detected − threshold) ms.
/// Stalls per wave of the stall measurement: the filter's `MIN_STALL_THRESHOLD`, the most
/// stalls within one idle window that are never a mass stall.
const STALL_WAVE: usize = 8;

async fn stall_once(
    opts: &BenchOptions,
    envoy: &Envoy,
    rx: &receiver::Receiver,
    up: &FastUpstream,
) -> (Percentiles, BTreeMap<String, usize>, usize) {
    rx.clear_calls();
    up.clear();
    let n = if opts.quick { 50 } else { 200 };
    let h = [
        ("x-bench-events", "100"),
        ("x-bench-interval-us", "10000"),
        ("x-bench-stall-after", "3"),
    ];
    let body =
        json!({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": true});
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let entry = envoy.listener_addr();
        let body = body.clone();
        // Staggered over more than one tick: stalls start at every tick phase. In waves of
        // `STALL_WAVE` (8) streams, 1.5 idle windows apart: more stalls than that
        // within one idle window are a mass stall, whose closes the valve holds one more
        // window (measured separately by the mass-stall tests), which is not the detection
        // delay measured here.
        let wave = (i / STALL_WAVE) as u64;
        let stagger = Duration::from_micros(wave * 1_500_000 + (i as u64 * 7919) % 300_000);
        set.spawn(async move {
            tokio::time::sleep(stagger).await;
            if let Ok(mut s) =
                client::stream_sse(entry, "/v1/chat/completions", &body, &h, false).await
            {
                let _ = s.collect(Duration::from_secs(10)).await;
            }
        });
    }
    while set.join_next().await.is_some() {}
    let calls = rx
        .wait_for_calls(n, Duration::from_secs(10))
        .await
        .unwrap_or_else(|_| rx.calls());
    let mut delays = Vec::new();
    for c in &calls {
        let Some(a) = &c.abort else { continue };
        if a.reason != kvguard_contract::AbortReason::Stalled {
            continue;
        }
        if let Some(last) = up.last_sent(&a.request_id) {
            delays.push(ms_since(last, c.at) - 1000.0);
        }
    }
    let mut hist: BTreeMap<String, usize> = BTreeMap::new();
    for d in &delays {
        let b = ((d / 50.0).floor() * 50.0) as i64;
        *hist.entry(format!("{b:+}..{:+} ms", b + 50)).or_default() += 1;
    }
    (Percentiles::of(delays), hist, n)
}

/// The abort-latency and stall sections.
pub async fn abort_and_stall(
    opts: &BenchOptions,
    run_abort: bool,
    run_stall: bool,
) -> Result<Value> {
    let mut out = json!({});
    let batch = 50usize;
    let stream_headers = [("x-bench-events", "60"), ("x-bench-interval-us", "50000")];
    if run_abort || run_stall {
        // A: Envoy + kvguard → lossy hop → fast upstream; aborts to the mock receiver.
        let up = FastUpstream::spawn().await?;
        let hop = lossy::spawn(LossyConfig::to(up.addr())).await?;
        let rx =
            receiver::spawn(ReceiverConfig::new(vec![Key::try_new(SECRET.as_bytes())?])).await?;
        let filter = json!({
            "control_cluster": crate::envoy::CONTROL_CLUSTER,
            "secret_env": "KVGUARD_SECRET",
            "idle_timeout_ms": 1000,
            "tick_ms": 250,
        });
        let envoy = Envoy::start(kvguard_envoy(hop.addr(), rx.addr(), filter.clone())).await?;
        if run_abort {
            let mut samples = Vec::new();
            while samples.len() < opts.disconnects {
                let n = batch.min(opts.disconnects - samples.len());
                let pairs = open_and_disconnect(
                    envoy.listener_addr(),
                    n,
                    &stream_headers,
                    false,
                    Duration::from_millis(2),
                )
                .await?;
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    let calls = rx.calls();
                    let have = pairs
                        .iter()
                        .filter(|(id, _)| calls.iter().any(|c| c.request_id() == Some(id.as_str())))
                        .count();
                    if have == pairs.len() || Instant::now() > deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let calls = rx.calls();
                for (id, t0) in pairs {
                    let at = calls
                        .iter()
                        .filter(|c| c.request_id() == Some(id.as_str()))
                        .map(|c| c.at)
                        .min();
                    samples.push(DisconnectSample {
                        id,
                        to_receiver_ms: at.map(|a| ms_since(t0, a)),
                        to_engine_closed_ms: None,
                    });
                }
                rx.clear_calls();
            }
            let lat: Vec<f64> = samples.iter().filter_map(|s| s.to_receiver_ms).collect();
            let missing = samples.len() - lat.len();
            eprintln!(
                "abort → receiver: {:?} (missing {missing})",
                Percentiles::of(lat.clone())
            );
            out["abort_to_receiver_ms"] = json!(Percentiles::of(lat));
            out["abort_to_receiver_missing"] = json!(missing);
            out["abort_to_receiver_n"] = json!(samples.len());
        }
        if run_stall {
            // Directly in front of the upstream, and behind the lossy hop as above.
            let direct = Envoy::start(kvguard_envoy(up.addr(), rx.addr(), filter.clone())).await?;
            for (label, e) in [("direct", &direct), ("lossy", &envoy)] {
                let (p, hist, n) = stall_once(opts, e, &rx, &up).await;
                eprintln!("stall ({label}) detected − 1000 ms threshold: {p:?}");
                let key = if label == "direct" {
                    "stall_minus_threshold_ms".to_owned()
                } else {
                    format!("stall_minus_threshold_ms_{label}")
                };
                out[key.as_str()] = json!(p);
                out[format!("stall_histogram_{label}").as_str()] = json!(hist);
                out["stall_streams"] = json!(n);
            }
            out["stall_histogram"] = out["stall_histogram_direct"].clone();
            out["stall_tick_ms"] = json!(250);
        }
        drop(envoy);
    }
    if run_abort {
        // B: the full stack: Envoy + kvguard → lossy hop → kvguard-control → fast upstream.
        let up = FastUpstream::spawn().await?;
        let mut so = stack::StackOptions::new(up.addr(), Some(stack::filter_config(0, 0)));
        so.buffer_limit = None;
        so.control_args = vec!["--log".into(), "warn".into()];
        let mut st = stack::Stack::start(so).await?;
        let mut lat = Vec::new();
        let mut missing = 0usize;
        let mut total = 0usize;
        while total < opts.disconnects {
            let n = batch.min(opts.disconnects - total);
            let pairs = open_and_disconnect(
                st.entry(),
                n,
                &stream_headers,
                false,
                Duration::from_millis(2),
            )
            .await?;
            total += pairs.len();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline
                && pairs.iter().any(|(id, _)| up.closed_at(id).is_none())
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            for (id, t0) in &pairs {
                match up.closed_at(id) {
                    Some(c) => lat.push(ms_since(*t0, c)),
                    None => missing += 1,
                }
            }
            up.clear();
        }
        eprintln!(
            "abort → engine connection closed: {:?} (missing {missing})",
            Percentiles::of(lat.clone())
        );
        out["abort_to_engine_closed_ms"] = json!(Percentiles::of(lat));
        out["abort_to_engine_closed_missing"] = json!(missing);
        out["abort_to_engine_closed_n"] = json!(total);
        out["control_rss_after_abort_storm_bytes"] = json!(rss(st.control.guard().pid())?);
    }
    Ok(out)
}

async fn snap(label: String, envoy: &Envoy, pid: u32) -> Result<Value> {
    tokio::time::sleep(Duration::from_millis(600)).await;
    let st = envoy.stats_matching("kvguard_filter").await?;
    let find = |k: &str| stack::stat_ending(&st, k);
    Ok(json!({
        "label": label,
        "vm_memory_bytes": find("kvguard_filter_vm_memory_bytes")?,
        "active_requests": find("kvguard_filter_active_requests")?,
        "envoy_rss_bytes": rss(pid)?,
    }))
}

/// Opens `n` streams through `entry` (200 at a time), each held open by the upstream
/// after its first event (read here); returns those that got it.
async fn open_held(entry: SocketAddr, n: usize) -> Vec<client::SseStream> {
    let body =
        json!({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": true});
    let hdr = [("x-bench-events", "2"), ("x-bench-hold-ms", "600000")];
    let sem = Arc::new(tokio::sync::Semaphore::new(200));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let sem = sem.clone();
        let body = body.clone();
        set.spawn(async move {
            let _p = sem.acquire_owned().await.ok()?;
            let mut s = client::stream_sse(entry, "/v1/chat/completions", &body, &hdr, false)
                .await
                .ok()?;
            s.next_data(Duration::from_secs(30)).await.ok()??;
            Some(s)
        });
    }
    let mut held = Vec::new();
    while let Some(r) = set.join_next().await {
        if let Ok(Some(s)) = r {
            held.push(s);
        }
    }
    held
}

/// The memory section.
pub async fn memory(opts: &BenchOptions) -> Result<Value> {
    let up = FastUpstream::spawn().await?;
    let rx = receiver::spawn(ReceiverConfig::new(vec![Key::try_new(SECRET.as_bytes())?])).await?;
    let filter = json!({
        "control_cluster": crate::envoy::CONTROL_CLUSTER,
        "secret_env": "KVGUARD_SECRET",
        "mode": "observe",
        "idle_timeout_ms": 0,
        "max_age_ms": 0,
    });
    let mut eo = kvguard_envoy(up.addr(), rx.addr(), filter);
    eo.upstream_http2 = true;
    let mut envoy = Envoy::start(eo).await?;
    let pid = envoy.guard().pid();
    let entry = envoy.listener_addr();
    let body =
        json!({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": true});
    // One request so the VM has run once.
    let mut w = client::stream_sse(
        entry,
        "/v1/chat/completions",
        &body,
        &[("x-bench-events", "4")],
        false,
    )
    .await?;
    let _ = w.collect(Duration::from_secs(5)).await;
    let mut points = vec![snap("start".into(), &envoy, pid).await?];
    let top = *opts.memory_levels.iter().max().unwrap_or(&1000);
    for wave in 0..opts.memory_waves {
        let mut held = Vec::new();
        let mut levels = opts.memory_levels.clone();
        levels.sort_unstable();
        for level in levels {
            held.extend(open_held(entry, level.saturating_sub(held.len())).await);
            let p = snap(
                format!("wave {wave}: {} streams held (target {level})", held.len()),
                &envoy,
                pid,
            )
            .await?;
            eprintln!("memory: {p}");
            points.push(p);
        }
        for s in held.drain(..) {
            s.disconnect();
        }
        let _ = envoy
            .wait_stat(
                "kvguard_filter_active_requests",
                Duration::from_secs(60),
                |v| v == 0.0,
            )
            .await;
        let p = snap(
            format!("wave {wave}: after {top} streams ended"),
            &envoy,
            pid,
        )
        .await?;
        eprintln!("memory: {p}");
        points.push(p);
    }
    Ok(
        json!({"points": points, "mode": "observe (no aborts sent: measures the tracking table)", "envoy_concurrency": 1}),
    )
}

/// The control section: kvguard-control's RSS and its proxy hop vs direct.
pub async fn control(opts: &BenchOptions) -> Result<Value> {
    let up = FastUpstream::spawn().await?;
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let args: Vec<String> = vec!["--log".into(), "warn".into()];
    let mut c = Control::start(up.addr(), any, any, &args).await?;
    let pid = c.guard().pid();
    pin_proxy(opts, pid)?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_idle = rss(pid)?;
    // Sequential requests: the hop's latency, not queueing behind other requests (with
    // concurrent clients the figure would be kvguard-control's CPU per request times the
    // queue length; that cost is reported separately as CPU per request).
    let sc = Scenario {
        name: "hop".into(),
        http2: false,
        concurrency: 1,
        requests: if opts.quick { 200 } else { 500 },
        events: 4,
        interval_us: 0,
    };
    // The reference: the same hop through a plain Envoy (router only), on the same CPU.
    let (envoy, _rx) = three_listener_envoy(up.addr(), opts).await?;
    let envoy_port = envoy.listener_named(listener_name("none")).await?;
    let mut direct = Vec::new();
    let mut via = Vec::new();
    let mut via_envoy = Vec::new();
    let mut cpu_per_request = Vec::new();
    let rounds = opts.rounds.max(1);
    for r in 0..rounds {
        let mut order = ["direct", "control", "envoy"];
        if r % 2 == 1 {
            order.reverse();
        }
        for path in order {
            let target = match path {
                "direct" => up.addr(),
                "control" => c.proxy,
                _ => envoy_port,
            };
            let (ns0, _) = cpu(pid);
            let s = load_once(target, &sc, r as u64).await;
            if path == "control" {
                let (ns1, _) = cpu(pid);
                cpu_per_request.push((ns1 - ns0) as f64 / 1000.0 / s.completed.max(1) as f64);
            }
            if s.errors > 0 {
                eprintln!("control hop ({path}): errors {:?}", s.error_samples);
            }
            let p50 = s.ttfb_ms.p50 * 1000.0;
            match path {
                "direct" => direct.push(p50),
                "control" => via.push(p50),
                _ => via_envoy.push(p50),
            }
        }
    }
    drop(envoy);
    let rss_loaded = rss(pid)?;
    let added: Vec<f64> = via.iter().zip(&direct).map(|(a, b)| a - b).collect();
    let added_envoy: Vec<f64> = via_envoy.iter().zip(&direct).map(|(a, b)| a - b).collect();
    eprintln!("control hop: direct p50 {direct:?} µs, via control {via:?} µs, via plain Envoy {via_envoy:?} µs");
    Ok(json!({
        "rss_idle_bytes": rss_idle,
        "rss_after_load_bytes": rss_loaded,
        "ttfb_p50_direct_us": Spread::of(&direct),
        "ttfb_p50_via_control_us": Spread::of(&via),
        "hop_added_p50_us": Spread::of(&added),
        "ttfb_p50_via_plain_envoy_us": Spread::of(&via_envoy),
        "plain_envoy_hop_added_p50_us": Spread::of(&added_envoy),
        "control_cpu_us_per_request": Spread::of(&cpu_per_request),
        "load": sc,
    }))
}

/// The abort calls a receiver got, counted by reason (`unparsed` for a body that did not
/// parse as an abort).
pub fn abort_reasons(calls: &[crate::receiver::ReceivedCall]) -> BTreeMap<String, usize> {
    let mut by = BTreeMap::new();
    for c in calls {
        let r = c.abort.as_ref().map_or("unparsed", |a| a.reason.as_str());
        *by.entry(r.to_owned()).or_insert(0) += 1;
    }
    by
}

/// Records in a section's result the aborts its healthy load's receiver got, where
/// [`healthy_load_aborts`] looks for them.
fn record_healthy_aborts(out: &mut Value, calls: &[crate::receiver::ReceivedCall]) {
    out["aborts_sent_during_healthy_load"] = json!(calls.len());
    out["abort_reasons_during_healthy_load"] = json!(abort_reasons(calls));
}

/// The builds `--compare-wasm` names: label, path, bytes.
fn compare_json(opts: &BenchOptions) -> Value {
    opts.compare_wasm
        .iter()
        .map(|(l, p)| {
            json!({"label": l, "path": p.display().to_string(),
                   "bytes": std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)})
        })
        .collect()
}

/// The sections whose healthy load (nothing stalls, nothing disconnects early) saw an abort,
/// each as a message naming the section, the count and the reasons: a healthy stream is
/// never to be aborted, so the bench fails on any (`kvguard-bench` exits non-zero after
/// writing its results). Empty when every healthy load ran without one.
pub fn healthy_load_aborts(res: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for section in ["instructions", "overhead", "requests"] {
        let s = &res[section];
        let n = s["aborts_sent_during_healthy_load"].as_u64().unwrap_or(0);
        if n == 0 {
            continue;
        }
        let reasons = s["abort_reasons_during_healthy_load"]
            .as_object()
            .filter(|o| !o.is_empty())
            .map_or_else(
                || "reasons not recorded".to_owned(),
                |o| {
                    o.iter()
                        .map(|(r, c)| format!("{r} × {c}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                },
            );
        out.push(format!(
            "{section} section: {n} abort(s) sent during the healthy load ({reasons})"
        ));
    }
    out
}

/// `; <section> section: N abort(s) …` when `calls` holds any, for a failure message (a
/// warm-up's streams cut by aborts); empty otherwise.
fn aborts_note(section: &str, calls: &[crate::receiver::ReceivedCall]) -> String {
    let res = json!({section: {
        "aborts_sent_during_healthy_load": calls.len(),
        "abort_reasons_during_healthy_load": abort_reasons(calls),
    }});
    healthy_load_aborts(&res)
        .iter()
        .map(|m| format!("; {m}"))
        .collect()
}

/// Runs the selected sections; returns the whole result.
pub async fn run(opts: BenchOptions) -> Result<Value> {
    let want = |s: &str| opts.sections.iter().any(|x| x == s || x == "all");
    let started = Instant::now();
    // Described before pinning: once pinned, this process sees only its own CPUs.
    let machine = report::machine();
    let pinning = match proxy_cpu() {
        Some(cpu) if opts.pin => {
            let rest: Vec<usize> = (0..cpu).collect();
            pin_tasks(std::process::id(), &rest).context("pinning the bench")?;
            format!("proxy on CPU {cpu}, bench on CPUs {rest:?}")
        }
        _ => "none".to_owned(),
    };
    let mut res = json!({
        "machine": machine,
        "options": {"rounds": opts.rounds, "quick": opts.quick, "sections": opts.sections,
                    "disconnects": opts.disconnects, "memory_levels": opts.memory_levels,
                    "memory_waves": opts.memory_waves, "pinning": pinning,
                    "instruction_headers": opts.instruction_headers},
    });
    if want("instructions") {
        res["instructions"] = instructions::instructions(&opts)
            .await
            .context("instructions section")?;
    }
    if want("overhead") {
        res["overhead"] = overhead(&opts).await.context("overhead section")?;
    }
    if want("abort") || want("stall") {
        res["abort"] = abort_and_stall(&opts, want("abort"), want("stall"))
            .await
            .context("abort section")?;
    }
    if want("memory") {
        res["memory"] = memory(&opts).await.context("memory section")?;
    }
    if want("control") {
        res["control"] = control(&opts).await.context("control section")?;
    }
    if want("relay") {
        res["relay"] = relay::relay(&opts).await.context("relay section")?;
    }
    if want("requests") {
        res["requests"] = requests::requests(&opts)
            .await
            .context("requests section")?;
    }
    res["duration_s"] = json!(started.elapsed().as_secs_f64());
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_gives_median_quartiles_and_extremes() {
        let s = Spread::of(&[4.0, 1.0, 3.0, 2.0, f64::NAN, 5.0]);
        assert_eq!(
            (s.median, s.q1, s.q3, s.min, s.max),
            (3.0, 2.0, 4.0, 1.0, 5.0)
        );
        // Between ranks: linear interpolation (0-based rank (n − 1) × p).
        let s = Spread::of(&[10.0, 20.0, 30.0, 40.0]);
        assert_eq!((s.median, s.q1, s.q3), (25.0, 17.5, 32.5));
        assert!(Spread::of(&[]).median.is_nan());
    }

    #[test]
    fn a_healthy_load_abort_is_a_failure_naming_section_count_and_reason() {
        let ok = json!({
            "overhead": {"aborts_sent_during_healthy_load": 0},
            "requests": {"aborts_sent_during_healthy_load": 0, "abort_reasons_during_healthy_load": {}},
            "abort": {"abort_to_receiver_n": 1000},
        });
        assert!(healthy_load_aborts(&ok).is_empty());
        assert!(healthy_load_aborts(&json!({})).is_empty());
        let bad = json!({
            "overhead": {"aborts_sent_during_healthy_load": 2},
            "requests": {"aborts_sent_during_healthy_load": 5,
                         "abort_reasons_during_healthy_load": {"max_age": 4, "stalled": 1}},
        });
        assert_eq!(
            healthy_load_aborts(&bad),
            [
                "overhead section: 2 abort(s) sent during the healthy load (reasons not recorded)",
                "requests section: 5 abort(s) sent during the healthy load (max_age × 4, stalled × 1)",
            ]
        );
    }
}
