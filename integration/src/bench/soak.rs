//! The soak (`scripts/soak`): the demo load in waves, with random disconnects and stalls,
//! through Envoy + kvguard → lossy hop → kvguard-control → the simulator. It asserts
//! invariants only, at each wave's quiet point:
//! - no crash: Envoy and kvguard-control still running, the filter's VM healthy;
//! - 0 false aborts: every stream the client neither dropped nor was stalled completed
//!   (no truncated stream, no error), and the engine ended nothing else early;
//! - 0 orphans: nothing running or waiting in the engine, nothing in flight in
//!   kvguard-control, no tracked request or pending abort in the filter;
//! - no growth of the wasm VM memory, Envoy RSS or kvguard-control RSS from one quiet
//!   point to the next beyond a small bound (the first wave is the warm-up).
//!
//! The long run also reports each one's slope (bytes per hour, least squares).

use super::{rss, Spread};
use crate::demo::stack::{self, Stack, StackOptions};
use crate::load::{self, LoadConfig};
use crate::sim::{self, SimConfig};
use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Soak options.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    /// How long to run.
    pub minutes: f64,
    /// Allowed growth of Envoy's and kvguard-control's RSS between quiet points after the
    /// first wave, bytes.
    pub rss_slack: u64,
    /// Allowed growth of the wasm VM memory after the first wave, bytes.
    pub vm_slack: u64,
}

fn slope_per_hour(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx == 0.0 {
        0.0
    } else {
        sxy / sxx * 3600.0
    }
}

/// Runs the soak; returns its report, or an error naming the broken invariant.
pub async fn run(opts: SoakOptions) -> Result<Value> {
    let engine = sim::spawn(SimConfig {
        token_rate: 50.0,
        ..SimConfig::default()
    })
    .await?;
    let mut so = StackOptions::new(engine.addr(), Some(stack::filter_config(2000, 0)));
    so.buffer_limit = None;
    so.control_args = vec![
        "--idle-timeout".into(),
        "off".into(),
        "--sample-interval".into(),
        "1s".into(),
        "--log".into(),
        "warn".into(),
    ];
    let mut st = Stack::start(so).await?;
    let envoy_pid = st.envoy.guard().pid();
    let control_pid = st.control.guard().pid();
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(opts.minutes * 60.0);
    let mut quiet: Vec<Value> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut wave = 0usize;
    let (mut total_disc, mut total_stall, mut total_done) = (0usize, 0usize, 0usize);
    while Instant::now() < deadline || wave < 2 {
        let mut main = LoadConfig::new(st.entry());
        main.requests = 200;
        main.concurrency = 40;
        main.max_tokens = 48;
        main.disconnect_share = 0.3;
        main.http2 = wave % 2 == 1;
        main.seed = wave as u64 + 1;
        main.stream_timeout = Duration::from_secs(60);
        let mut stall = LoadConfig::new(st.entry());
        stall.requests = 10;
        stall.concurrency = 10;
        stall.max_tokens = 48;
        stall.headers = vec![("x-sim-stall-after".into(), "2".into())];
        stall.stream_timeout = Duration::from_secs(30);
        stall.seed = wave as u64 + 1000;
        let (m, s) = tokio::join!(load::run(main), load::run(stall));
        total_disc += m.disconnected;
        total_stall += s.started;
        total_done += m.completed;
        if m.errors > 0 || m.truncated > 0 {
            failures.push(format!(
                "wave {wave}: healthy streams hurt (false aborts?): {} truncated, {} errors {:?}",
                m.truncated, m.errors, m.error_samples
            ));
        }
        if m.completed + m.disconnected != m.started {
            failures.push(format!("wave {wave}: {m:?}"));
        }
        if s.completed > 0 {
            failures.push(format!(
                "wave {wave}: {} stalled streams completed",
                s.completed
            ));
        }
        // Quiet point: the engine idle, nothing in flight anywhere.
        let q0 = Instant::now();
        let mut orphans = (usize::MAX, usize::MAX);
        while q0.elapsed() < Duration::from_secs(30) {
            let s = engine.state();
            orphans = (s.running.len(), s.waiting.len());
            if orphans == (0, 0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let inflight = st
            .control
            .inflight_ids()
            .await
            .map(|v| v.len())
            .unwrap_or(usize::MAX);
        // A figure that cannot be read fails the soak (it is not 0, nor "no growth"). The
        // filter hands its active-request gauge to Envoy on its tick (envoy-config/METRICS.md):
        // give it a few ticks to show the last streams' ends before judging.
        let f0 = Instant::now();
        let fs = loop {
            let fs = st.filter_stats().await?;
            let idle = stack::stat_ending(&fs, "kvguard_filter_active_requests")? == 0.0
                && stack::stat_ending(&fs, "kvguard_filter_pending_aborts")? == 0.0;
            if idle || f0.elapsed() > Duration::from_secs(2) {
                break fs;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let find = |k: &str| stack::stat_ending(&fs, k);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let point = json!({
            "wave": wave,
            "t_s": started.elapsed().as_secs_f64(),
            "engine_running": orphans.0,
            "engine_waiting": orphans.1,
            "control_inflight": inflight,
            "filter_active": find("kvguard_filter_active_requests")?,
            "filter_pending_aborts": find("kvguard_filter_pending_aborts")?,
            "vm_memory_bytes": find("kvguard_filter_vm_memory_bytes")?,
            "envoy_rss_bytes": rss(envoy_pid)?,
            "control_rss_bytes": rss(control_pid)?,
            "kv_usage": engine.state().kv_usage(),
            "wave_load": {"completed": m.completed, "disconnected": m.disconnected, "stalled": s.started,
                          "ttfb_p50_ms": m.ttfb_ms.p50, "http2": wave % 2 == 1},
        });
        eprintln!("soak: {point}");
        if orphans != (0, 0) || inflight != 0 {
            failures.push(format!("wave {wave}: orphans at the quiet point: {point}"));
        }
        if point["filter_active"].as_f64() != Some(0.0)
            || point["filter_pending_aborts"].as_f64() != Some(0.0)
        {
            failures.push(format!(
                "wave {wave}: the filter still tracks requests at the quiet point: {point}"
            ));
        }
        if !st.envoy.guard().is_running() || !st.control.guard().is_running() {
            failures.push(format!("wave {wave}: a process died"));
        }
        quiet.push(point);
        wave += 1;
        if !failures.is_empty() {
            break;
        }
    }
    // Growth from the first quiet point after the warm-up wave.
    let series = |k: &str| -> Vec<(f64, f64)> {
        quiet
            .iter()
            .skip(1)
            .map(|p| {
                (
                    p["t_s"].as_f64().unwrap_or(0.0),
                    p[k].as_f64().unwrap_or(f64::NAN),
                )
            })
            .collect()
    };
    let mut growth = json!({});
    for (k, slack) in [
        ("vm_memory_bytes", opts.vm_slack),
        ("envoy_rss_bytes", opts.rss_slack),
        ("control_rss_bytes", opts.rss_slack),
    ] {
        let s = series(k);
        if let (Some(first), Some(max)) = (
            s.first().map(|p| p.1),
            s.iter().map(|p| p.1).reduce(f64::max),
        ) {
            let grew = max - first;
            growth[k] = json!({"first": first, "max": max, "growth": grew, "slack": slack,
                               "slope_bytes_per_hour": slope_per_hour(&s)});
            if grew > slack as f64 {
                failures.push(format!(
                    "{k} grew by {grew} bytes (> {slack}) after the warm-up wave"
                ));
            }
        }
    }
    // The engine ended nothing early that the clients did not drop or stall.
    let es = engine.state();
    let early = es
        .requests
        .iter()
        .filter(|r| {
            !matches!(
                r.ended,
                Some(sim::EndKind::Length) | Some(sim::EndKind::Stop)
            )
        })
        .count();
    if early > total_disc + total_stall {
        failures.push(format!(
            "the engine ended {early} requests early, more than the {total_disc} disconnected + {total_stall} stalled"
        ));
    }
    let report = json!({
        "minutes": opts.minutes,
        "waves": wave,
        "streams": {"completed": total_done, "disconnected": total_disc, "stalled": total_stall, "ended_early_in_engine": early},
        "quiet_points": quiet,
        "growth": growth,
        "failures": failures,
        "ttfb_p50_ms_by_wave": Spread::of(&quiet.iter().filter_map(|p| p["wave_load"]["ttfb_p50_ms"].as_f64()).collect::<Vec<_>>()),
    });
    if !failures.is_empty() {
        bail!(
            "soak invariants broken:\n{}\n{}",
            failures.join("\n"),
            st.logs(40)
        );
    }
    Ok(report)
}
