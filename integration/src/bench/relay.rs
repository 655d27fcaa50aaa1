//! The `relay` section (issue 39 point 4): kvguard-control proxies every token of every
//! stream, so its relay is measured against a plain Envoy relaying the same streams.
//!
//! kvguard-control (its defaults but `--log warn` and an in-flight cap above the memory
//! phase's streams) and a plain Envoy (`--concurrency 1`, router only) in front of the
//! same fast upstream, both pinned on the proxy CPU. Per round, in alternating order,
//! straight to the upstream (the reference), through kvguard-control and through Envoy:
//! - CPU per relayed event: the proxy's CPU (schedstat, all threads) over a paced SSE load
//!   / its events;
//! - added time to first byte: TTFB p50 of sequential one-event requests − the direct
//!   ones' of the same round.
//!
//! Then memory per stream, each proxy in a fresh process (started, pinned, warmed with
//! the paced load's first 50 streams): RSS with streams held open after their first
//! event, minus RSS before, per stream (its open files before and with them, beside).
//! Twice:
//! - [`BenchOptions`]' largest memory level (10,000) over h2c, [`H2_STREAMS_PER_CONNECTION`]
//!   streams per client connection; the proxy's upstream side stays HTTP/1.1, one
//!   connection per stream (kvguard-control's engine client speaks nothing else);
//! - over HTTP/1.1, one connection per stream, as many as the file descriptor limit
//!   lets a proxy hold: it holds two sockets per stream (its client's and its
//!   upstream's), and the hard limit (`ulimit -Hn`, 20,000 on the project's VM, which
//!   root in its container cannot raise) is the same for every process, so 10,000
//!   HTTP/1.1 streams through one proxy need more than it allows.

use super::upstream::FastUpstream;
use super::{
    cpu, load_once, open_held, raise_circuit_breakers, rss, BenchOptions, Scenario, Spread,
};
use crate::client::SseStream;
use crate::demo::stack::Control;
use crate::envoy::{Envoy, EnvoyOptions};
use crate::proc::ChildGuard;
use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::{JoinHandle, JoinSet};

/// The proxies compared, and the direct reference.
const PATHS: [&str; 3] = ["direct", "kvguard-control", "envoy"];

/// Streams per client connection in the h2c memory phase (kvguard-control allows 1,024,
/// Envoy 2^31 − 1): 10,000 streams over 100 connections.
pub const H2_STREAMS_PER_CONNECTION: usize = 100;

/// How many HTTP/1.1 streams a proxy can hold: each takes two of its file descriptors (its
/// client's connection and its upstream's; this process holds the same two, the client's
/// end and the in-process upstream's), less a margin for everything else it has open. The
/// limit is this process's, which its children inherit.
fn fd_room() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1000;
    }
    usize::try_from(lim.rlim_cur)
        .unwrap_or(usize::MAX)
        .saturating_sub(1000)
        / 2
}

/// The section.
pub async fn relay(opts: &BenchOptions) -> Result<Value> {
    let up = FastUpstream::spawn().await?;
    let top = *opts.memory_levels.iter().max().unwrap_or(&1000);
    let h1_n = top.min(fd_room());
    // Its defaults, but for the in-flight cap (4,096): the memory phase holds `top`.
    let max_inflight = top + 100;
    let mut control = start_control(up.addr(), max_inflight).await?;
    let mut envoy = Envoy::start(envoy_options(up.addr())).await?;
    let pids = [
        ("kvguard-control", control.guard().pid()),
        ("envoy", envoy.guard().pid()),
    ];
    for (_, pid) in pids {
        super::pin_proxy(opts, pid)?;
    }
    let (control_addr, envoy_addr) = (control.proxy, envoy.listener_addr());
    let target = |path: &str| match path {
        "direct" => up.addr(),
        "kvguard-control" => control_addr,
        _ => envoy_addr,
    };
    let pid_of = |path: &str| pids.iter().find(|(p, _)| *p == path).map(|(_, pid)| *pid);
    let sc = Scenario {
        name: "paced".into(),
        http2: false,
        concurrency: if opts.quick { 100 } else { 300 },
        requests: if opts.quick { 200 } else { 600 },
        events: 20,
        interval_us: 20_000,
    };
    let probe = Scenario {
        name: "ttfb".into(),
        http2: false,
        concurrency: 1,
        requests: if opts.quick { 100 } else { 300 },
        events: 1,
        interval_us: 0,
    };
    // Warm-up.
    for path in PATHS {
        warm_up(target(path), &sc).await;
    }
    let mut cpu_per_event: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut ttfb_p50: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut errors: BTreeMap<&str, usize> = BTreeMap::new();
    for round in 0..opts.rounds.max(1) {
        let mut order = PATHS;
        if round % 2 == 1 {
            order.reverse();
        }
        for path in order {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let before = pid_of(path).map(|p| cpu(p).0);
            let s = load_once(target(path), &sc, round as u64 * 7 + 1).await;
            if let (Some(p), Some(ns0)) = (pid_of(path), before) {
                let us = (cpu(p).0 - ns0) as f64 / 1000.0 / s.events.max(1) as f64;
                cpu_per_event.entry(path).or_default().push(us);
            }
            // Time to first byte alone: sequential one-event requests (no queue behind
            // other streams).
            let t = load_once(target(path), &probe, round as u64).await;
            ttfb_p50
                .entry(path)
                .or_default()
                .push(t.ttfb_ms.p50 * 1000.0);
            let errs = s.errors + s.truncated + t.errors + t.truncated;
            *errors.entry(path).or_default() += errs;
            eprintln!(
                "relay round {round} {path:>15}: {} events, sequential TTFB p50 {:.0} µs, errors {errs}",
                s.events,
                t.ttfb_ms.p50 * 1000.0,
            );
        }
    }
    let added = |path: &str| -> Spread {
        let (Some(x), Some(d)) = (ttfb_p50.get(path), ttfb_p50.get("direct")) else {
            return Spread::of(&[]);
        };
        Spread::of(&x.iter().zip(d).map(|(a, b)| a - b).collect::<Vec<_>>())
    };
    let ratio = {
        let (c, e) = (&cpu_per_event["kvguard-control"], &cpu_per_event["envoy"]);
        Spread::of(&c.iter().zip(e).map(|(a, b)| a / b).collect::<Vec<_>>())
    };
    // A proxy that died mid-run measured nothing.
    control.guard().ensure_running()?;
    envoy.guard().ensure_running()?;
    drop(control);
    drop(envoy);
    // Memory: streams held open through each proxy in turn, each in a fresh process.
    let mut memory = Vec::new();
    for ph in [
        HeldPhase {
            protocol: "h2c",
            per_conn: H2_STREAMS_PER_CONNECTION,
            n: top,
        },
        HeldPhase {
            protocol: "HTTP/1.1",
            per_conn: 1,
            n: h1_n,
        },
    ] {
        let mut phase = serde_json::Map::new();
        phase.insert("protocol".into(), json!(ph.protocol));
        phase.insert("streams_per_connection".into(), json!(ph.per_conn));
        for path in ["kvguard-control", "envoy"] {
            let m = held_memory(opts, &up, path, max_inflight, &sc, &ph).await?;
            phase.insert(path.into(), m);
        }
        memory.push(Value::Object(phase));
    }
    Ok(json!({
        "rounds": opts.rounds.max(1),
        "load": sc,
        "cpu_us_per_event": cpu_per_event.iter().map(|(k, v)| (*k, Spread::of(v))).collect::<BTreeMap<_, _>>(),
        "cpu_control_over_envoy": ratio,
        "ttfb_p50_us": ttfb_p50.iter().map(|(k, v)| (*k, Spread::of(v))).collect::<BTreeMap<_, _>>(),
        "ttfb_added_p50_us": {"kvguard-control": added("kvguard-control"), "envoy": added("envoy")},
        "errors": errors,
        "memory": memory,
        "per_round": {"cpu_us_per_event": cpu_per_event, "ttfb_p50_us": ttfb_p50},
    }))
}

/// kvguard-control's arguments: its defaults, but for warn-level logs and the in-flight
/// cap (4,096 by default: a replica's), raised above the streams the memory phase holds.
async fn start_control(upstream: SocketAddr, max_inflight: usize) -> Result<Control> {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let args: Vec<String> = vec![
        "--log".into(),
        "warn".into(),
        "--max-inflight".into(),
        max_inflight.to_string(),
    ];
    Control::start(upstream, any, any, &args).await
}

/// The plain Envoy: the router alone, quiet logs, circuit breakers raised.
fn envoy_options(upstream: SocketAddr) -> EnvoyOptions {
    let mut eo = EnvoyOptions::new(upstream);
    eo.access_log = false;
    eo.log_level = "warn".into();
    eo.component_log_level = None;
    eo.patch = Some(Arc::new(raise_circuit_breakers));
    eo
}

/// The paced load's first 50 streams.
async fn warm_up(target: SocketAddr, sc: &Scenario) {
    let _ = load_once(
        target,
        &Scenario {
            requests: 50,
            ..sc.clone()
        },
        1,
    )
    .await;
}

/// One proxy process of the memory phase.
enum Proxy {
    Control(Box<Control>),
    Envoy(Box<Envoy>),
}

impl Proxy {
    fn addr(&self) -> SocketAddr {
        match self {
            Proxy::Control(c) => c.proxy,
            Proxy::Envoy(e) => e.listener_addr(),
        }
    }

    fn guard(&mut self) -> &mut ChildGuard {
        match self {
            Proxy::Control(c) => c.guard(),
            Proxy::Envoy(e) => e.guard(),
        }
    }
}

/// Streams held open after their first event.
enum Held {
    /// One connection each.
    H1(Vec<SseStream>),
    /// Their bodies, and the connections' tasks (aborting one closes it).
    H2(Vec<Incoming>, Vec<JoinHandle<()>>),
}

impl Held {
    fn len(&self) -> usize {
        match self {
            Held::H1(v) => v.len(),
            Held::H2(v, _) => v.len(),
        }
    }

    fn disconnect(self) {
        match self {
            Held::H1(v) => v.into_iter().for_each(SseStream::disconnect),
            Held::H2(bodies, conns) => {
                drop(bodies);
                conns.iter().for_each(JoinHandle::abort);
            }
        }
    }
}

/// How the memory phase holds its streams.
#[derive(Clone, Copy)]
struct HeldPhase {
    /// `h2c` or `HTTP/1.1`.
    protocol: &'static str,
    /// Streams per client connection (HTTP/1.1: 1).
    per_conn: usize,
    /// Streams held.
    n: usize,
}

/// Memory per stream through `path` (a fresh process, its in-flight cap `max_inflight`,
/// warmed with `sc`'s first streams): RSS before and with `ph.n` streams held, per stream.
async fn held_memory(
    opts: &BenchOptions,
    up: &FastUpstream,
    path: &str,
    max_inflight: usize,
    sc: &Scenario,
    ph: &HeldPhase,
) -> Result<Value> {
    let HeldPhase {
        protocol,
        per_conn,
        n,
    } = *ph;
    let mut proxy = match path {
        "kvguard-control" => {
            Proxy::Control(Box::new(start_control(up.addr(), max_inflight).await?))
        }
        _ => Proxy::Envoy(Box::new(Envoy::start(envoy_options(up.addr())).await?)),
    };
    let pid = proxy.guard().pid();
    super::pin_proxy(opts, pid)?;
    warm_up(proxy.addr(), sc).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = rss(pid)?;
    let fds_before = open_fds(pid);
    let held = if per_conn > 1 {
        open_held_h2(proxy.addr(), n, per_conn).await?
    } else {
        Held::H1(open_held(proxy.addr(), n).await)
    };
    tokio::time::sleep(Duration::from_millis(600)).await;
    let with = rss(pid)?;
    let fds_held = open_fds(pid);
    let got = held.len();
    let running = proxy.guard().ensure_running();
    held.disconnect();
    drop(proxy);
    // The upstream's side of those streams gone before the next phase opens its own.
    let deadline = Instant::now() + Duration::from_secs(30);
    while up.open() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    running?;
    eprintln!(
        "relay memory {path} ({protocol}): RSS {:.1} → {:.1} MiB, open files {} → {}, with {got} of {n} streams held",
        before as f64 / 1048576.0,
        with as f64 / 1048576.0,
        fds_before.unwrap_or(0),
        fds_held.unwrap_or(0),
    );
    Ok(json!({
        "streams_asked": n,
        "streams_held": got,
        "client_connections": got.div_ceil(per_conn),
        "rss_before_bytes": before,
        "rss_held_bytes": with,
        "bytes_per_stream": (with as f64 - before as f64) / got.max(1) as f64,
        "fds_before": fds_before,
        "fds_held": fds_held,
    }))
}

/// File descriptors `pid` has open (`/proc/<pid>/fd`), if readable.
fn open_fds(pid: u32) -> Option<usize> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()
        .map(Iterator::count)
}

/// Opens `n` h2c streams through `entry`, `per_conn` on each client connection (200 at a
/// time), each held open by the upstream after its first event (read here).
async fn open_held_h2(entry: SocketAddr, n: usize, per_conn: usize) -> Result<Held> {
    let body = Bytes::from(serde_json::to_vec(&json!({
        "model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": true
    }))?);
    let mut senders = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..n.div_ceil(per_conn.max(1)) {
        let tcp = tokio::net::TcpStream::connect(entry)
            .await
            .with_context(|| format!("connecting to {entry}"))?;
        let _ = tcp.set_nodelay(true);
        let (s, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .context("h2c handshake")?;
        conns.push(tokio::spawn(async move {
            let _ = conn.await;
        }));
        senders.push(s);
    }
    let sem = Arc::new(tokio::sync::Semaphore::new(200));
    let mut set = JoinSet::new();
    for i in 0..n {
        let sem = sem.clone();
        let body = body.clone();
        let mut s = senders[i / per_conn.max(1)].clone();
        set.spawn(async move {
            let _p = sem.acquire_owned().await.ok()?;
            let req = hyper::Request::post(format!("http://{entry}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("x-bench-events", "2")
                .header("x-bench-hold-ms", "600000")
                .body(Full::new(body))
                .ok()?;
            let wait = Duration::from_secs(30);
            tokio::time::timeout(wait, s.ready()).await.ok()?.ok()?;
            let resp = tokio::time::timeout(wait, s.send_request(req))
                .await
                .ok()?
                .ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let mut b = resp.into_body();
            // Until the first event's bytes.
            loop {
                let frame = tokio::time::timeout(wait, b.frame()).await.ok()??.ok()?;
                if frame
                    .data_ref()
                    .is_some_and(|d| d.windows(5).any(|w| w == b"data:"))
                {
                    return Some(b);
                }
            }
        });
    }
    let mut bodies = Vec::new();
    while let Some(r) = set.join_next().await {
        if let Ok(Some(b)) = r {
            bodies.push(b);
        }
    }
    drop(senders);
    Ok(Held::H2(bodies, conns))
}
