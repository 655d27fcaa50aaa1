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
//!   ones' of the same round;
//! - memory per stream: RSS with [`BenchOptions`]' largest memory level of streams held
//!   open after their first event (at most what this process's file descriptor limit
//!   lets it hold: two per stream), minus RSS before, per stream (each proxy in turn).

use super::upstream::FastUpstream;
use super::{
    cpu, load_once, open_held, raise_circuit_breakers, rss, BenchOptions, Scenario, Spread,
};
use crate::demo::stack::Control;
use crate::envoy::{Envoy, EnvoyOptions};
use anyhow::Result;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The proxies compared, and the direct reference.
const PATHS: [&str; 3] = ["direct", "kvguard-control", "envoy"];

/// How many streams this process can hold through a proxy: each takes two of its file
/// descriptors (the client's connection and the in-process upstream's), less a margin.
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
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let held_n = (*opts.memory_levels.iter().max().unwrap_or(&1000)).min(fd_room());
    // Its defaults, but for the in-flight cap (4,096): the memory phase holds `held_n`.
    let args: Vec<String> = vec![
        "--log".into(),
        "warn".into(),
        "--max-inflight".into(),
        (held_n + 100).to_string(),
    ];
    let mut control = Control::start(up.addr(), any, any, &args).await?;
    let mut eo = EnvoyOptions::new(up.addr());
    eo.access_log = false;
    eo.log_level = "warn".into();
    eo.component_log_level = None;
    eo.patch = Some(Arc::new(raise_circuit_breakers));
    let mut envoy = Envoy::start(eo).await?;
    let pids = [
        ("kvguard-control", control.guard().pid()),
        ("envoy", envoy.guard().pid()),
    ];
    for (_, pid) in pids {
        super::pin_proxy(opts, pid)?;
    }
    let target = |path: &str| match path {
        "direct" => up.addr(),
        "kvguard-control" => control.proxy,
        _ => envoy.listener_addr(),
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
        let _ = load_once(
            target(path),
            &Scenario {
                requests: 50,
                ..sc.clone()
            },
            1,
        )
        .await;
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
    // Memory: streams held open through each proxy in turn.
    let mut memory = BTreeMap::new();
    for path in ["kvguard-control", "envoy"] {
        let Some(pid) = pid_of(path) else { continue };
        let before = rss(pid)?;
        let held = open_held(target(path), held_n).await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        let with = rss(pid)?;
        let n = held.len();
        for s in held {
            s.disconnect();
        }
        eprintln!(
            "relay memory {path}: RSS {:.1} → {:.1} MiB with {n} streams held",
            before as f64 / 1048576.0,
            with as f64 / 1048576.0
        );
        memory.insert(
            path,
            json!({
                "streams_held": n,
                "rss_before_bytes": before,
                "rss_held_bytes": with,
                "bytes_per_stream": (with as f64 - before as f64) / n.max(1) as f64,
            }),
        );
        // Let the proxy see them gone before the next one is measured.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // A proxy that died mid-run measured nothing.
    control.guard().ensure_running()?;
    envoy.guard().ensure_running()?;
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
