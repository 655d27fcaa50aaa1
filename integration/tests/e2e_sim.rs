//! End to end on the engine simulator, for what real vLLM cannot show on this machine:
//! client → Envoy + kvguard filter → lossy hop → kvguard-control (real binary) → simulator.
//! Stalls with keep-alives only (reaped by the filter, and by kvguard-control alone), a
//! disconnect while queued (aborted before admission), a storm of 2,000 disconnects within
//! 0.5 s from the Rust load generator (every abort reaches kvguard-control: the filter's
//! queue, not its 32 calls in flight per VM, bounds a burst), and the demo's leak run vs
//! kvguard run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Stack, StackOptions};
use kvguard_integration::demo::{self, DemoConfig, EngineKind, Mode};
use kvguard_integration::load::LoadSummary;
use kvguard_integration::proc::ChildGuard;
use kvguard_integration::sim::{self, EndKind, SeqState, SimConfig};
use kvguard_integration::stall::{self, StallMark};
use kvguard_integration::wait::{bounded, poll_until_async};
use kvguard_integration::{bench, paths};
use serde_json::json;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(150);
const W: Duration = Duration::from_secs(20);

fn off() -> Vec<String> {
    ["--idle-timeout", "off", "--max-age", "off"]
        .map(String::from)
        .to_vec()
}

fn completion(max_tokens: u32) -> serde_json::Value {
    json!({"model": "tiny", "prompt": "kvguard e2e", "stream": true, "max_tokens": max_tokens})
}

async fn control_aborts(st: &Stack, reason: &str) -> f64 {
    st.control
        .aborts_by_reason()
        .await
        .unwrap()
        .get(reason)
        .copied()
        .unwrap_or_else(|| panic!("kvguard-control exports no {reason:?} aborts"))
}

/// A stream that stalls after 5 tokens, with keep-alive comments every 200 ms (which are
/// not progress), must be ended by `st`'s kvguard within `idle + 2 s`; returns how long
/// after the last token it took.
async fn stall_is_reaped(sim: &sim::SimHandle, st: &Stack, idle: Duration) -> Duration {
    let mut s = client::stream_sse(
        st.entry(),
        "/v1/completions",
        &completion(400),
        &[("x-sim-stall-after", "5"), ("x-sim-keepalive-ms", "200")],
        false,
    )
    .await
    .unwrap();
    let rid = s.header("x-request-id").unwrap().to_owned();
    s.read_events(5, W).await.unwrap();
    let last_token = Instant::now();
    // Keep-alives keep arriving; no data.
    let ka = s.next_event(W).await.unwrap().unwrap();
    assert!(ka.comment, "{ka:?}");
    let rec = sim
        .wait_state("the engine frees the stalled sequence", idle + W, |s| {
            s.request(&rid).is_some_and(|r| r.ended.is_some())
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
    let took = last_token.elapsed();
    let r = rec.request(&rid).unwrap();
    assert_eq!(r.ended, Some(EndKind::Disconnected), "{r:?}");
    assert!(r.keepalives_sent >= 2, "{r:?}");
    assert!(
        took >= idle - Duration::from_millis(300),
        "ended before the idle timeout: {took:?}"
    );
    assert!(
        took <= idle + Duration::from_secs(2),
        "ended {took:?} after the last token (idle timeout {idle:?})"
    );
    // The client's stream ends too (within the wait, without completing).
    let end = s
        .wait_end(W)
        .await
        .unwrap_or_else(|e| panic!("the stalled client's stream hangs: {e:#}\n{}", st.logs(40)));
    assert!(!end.saw_done(), "{end:?}");
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stall_with_keepalives_only_is_reaped_by_the_filter() {
    bounded("filter reaps a stall", T, async {
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        let idle = Duration::from_millis(1500);
        let mut o = StackOptions::new(
            sim.addr(),
            Some(stack::filter_config(idle.as_millis() as u64, 0)),
        );
        o.control_args = off();
        let st = Stack::start(o).await.unwrap();
        let took = stall_is_reaped(&sim, &st, idle).await;
        eprintln!("filter: stall ended {took:?} after the last token");
        assert_eq!(control_aborts(&st, "stalled").await, 1.0);
        let f = st.filter_stats().await.unwrap();
        let stalled: f64 = f
            .iter()
            .filter(|(k, _)| k.contains("aborts_total") && k.contains("stalled"))
            .map(|(_, v)| v)
            .sum();
        assert_eq!(stalled, 1.0, "{f:?}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stall_with_keepalives_only_is_reaped_by_kvguard_control_alone() {
    bounded("control reaps a stall", T, async {
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        let idle = Duration::from_millis(1500);
        // No filter at the edge: kvguard-control's own idle reaper.
        let mut o = StackOptions::new(sim.addr(), None);
        o.control_args = ["--idle-timeout", "1500ms", "--max-age", "off"]
            .map(String::from)
            .to_vec();
        let st = Stack::start(o).await.unwrap();
        let took = stall_is_reaped(&sim, &st, idle).await;
        eprintln!("kvguard-control: stall ended {took:?} after the last token");
        assert_eq!(control_aborts(&st, "stalled").await, 1.0);
    })
    .await
    .unwrap();
}

/// The simulator's form of `e2e_vllm`'s "vLLM frees it within 2 s of the disconnect": a
/// client leaves a running stream, the filter calls kvguard-control's `POST /v1/abort`, and
/// kvguard-control ends the engine request (the lossy hop in between does not pass the
/// disconnect on: the abort is the only way the engine hears of it). The bound is credited
/// with the run-queue wait of kvguard-control and of this process (the simulator's), and
/// with nothing else: kvguard-control's runtime blocked in the abort handler fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_is_aborted_and_the_engine_frees_it_within_2s() {
    bounded("disconnect aborted within 2 s", T, async {
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        let mut o = StackOptions::new(sim.addr(), Some(stack::filter_config(60_000, 0)));
        o.control_args = off();
        let st = Stack::start(o).await.unwrap();
        let mut s =
            client::stream_sse(st.entry(), "/v1/completions", &completion(1500), &[], false)
                .await
                .unwrap();
        let rid = s.header("x-request-id").unwrap().to_owned();
        s.read_events(3, W).await.unwrap();
        let mark = StallMark::control(st.control.pid());
        s.disconnect();
        let dropped = Instant::now();
        stall::within(
            "the engine frees the stream within 2 s of the disconnect",
            dropped,
            Duration::from_secs(2),
            &mark,
            Duration::from_millis(10),
            || {
                let ended = sim.state().request(&rid).and_then(|r| r.ended);
                async move { ended }
            },
        )
        .await
        .map(|ended| assert_eq!(ended, EndKind::Disconnected))
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        assert_eq!(control_aborts(&st, "downstream_reset").await, 1.0);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_while_queued_is_aborted_before_admission() {
    bounded("queued disconnect", T, async {
        // A pool of 8 blocks × 16 tokens: one request of 120 tokens fills it.
        let sim = sim::spawn(SimConfig {
            kv_blocks: 8,
            block_size: 16,
            token_rate: 20.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let mut o = StackOptions::new(sim.addr(), Some(stack::filter_config(60_000, 0)));
        o.control_args = off();
        let st = Stack::start(o).await.unwrap();
        let body = json!({"model": "tiny", "prompt": "x", "stream": true, "max_tokens": 120});
        let mut a = client::stream_sse(st.entry(), "/v1/completions", &body, &[], false)
            .await
            .unwrap();
        let a_id = a.header("x-request-id").unwrap().to_owned();
        a.read_events(1, W).await.unwrap();
        let b = client::stream_sse(st.entry(), "/v1/completions", &body, &[], false)
            .await
            .unwrap();
        let b_id = b.header("x-request-id").unwrap().to_owned();
        sim.wait_state("B queued behind A", W, |s| {
            s.waiting.contains(&b_id) && s.running.contains(&a_id)
        })
        .await
        .unwrap();
        b.disconnect();
        let s = sim
            .wait_state("B aborted while queued", W, |s| {
                s.request(&b_id).is_some_and(|r| r.ended.is_some())
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        let r = s.request(&b_id).unwrap();
        assert_eq!(r.ended, Some(EndKind::Disconnected), "{r:?}");
        assert_eq!(r.started_ms, None, "B was admitted: {r:?}");
        assert_eq!(r.tokens_sent, 0);
        // A is untouched and completes.
        assert_eq!(s.request(&a_id).unwrap().state, SeqState::Running);
        assert_eq!(control_aborts(&st, "downstream_reset").await, 1.0);
        let evs = a.collect(W).await.unwrap();
        assert!(evs.last().unwrap().is_done());
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_of_2000_disconnects_at_once_loses_no_abort_and_bounded_memory() {
    bounded("storm", Duration::from_secs(170), async {
        let n = 2000usize;
        let sim = sim::spawn(SimConfig {
            kv_blocks: 100_000,
            max_running: 4096,
            token_rate: 2.0,
            record_limit: 5000,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let mut o = StackOptions::new(sim.addr(), Some(stack::filter_config(60_000, 0)));
        o.control_args = off();
        let mut st = Stack::start(o).await.unwrap();
        let ctl_pid = st.control.guard().pid();
        let envoy_pid = st.envoy.guard().pid();
        let (ctl0, envoy0) = (bench::rss(ctl_pid).unwrap(), bench::rss(envoy_pid).unwrap());
        let target = st.entry().to_string();
        let started = Instant::now();
        let mut load = ChildGuard::spawn_program(
            "kvguard-load",
            paths::load_bin().unwrap(),
            [
                "--target",
                target.as_str(),
                "--storm",
                &n.to_string(),
                "--storm-window-ms",
                "500",
                "--max-tokens",
                "400",
                "--stream-timeout-s",
                "90",
            ],
            &[],
        )
        .unwrap();
        let status = load
            .wait_exit_async(Duration::from_secs(120))
            .await
            .unwrap();
        assert!(status.success(), "{}", load.log_tail(40));
        let log = load.log();
        let summary: LoadSummary = serde_json::from_str(&log[log.find('{').unwrap()..]).unwrap();
        eprintln!(
            "storm: {} streams disconnected, spread {:?} s, in {:?}",
            summary.disconnected,
            summary.storm_spread_s,
            started.elapsed()
        );
        assert_eq!(summary.disconnected, n, "{summary:?}");
        assert!(summary.storm_spread_s.unwrap() <= 5.0, "{summary:?}");
        // Every sequence is freed: nothing runs or waits, no block is held.
        let s = sim
            .wait_state("0 orphans", Duration::from_secs(30), |s| {
                s.is_idle() && s.blocks_used == 0
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(30)));
        assert_eq!(
            s.disconnected as usize, n,
            "engine saw {} aborts",
            s.disconnected
        );
        // The kernel's high-water marks: the peak during the storm, not a read after it.
        let peak_ctl = bench::peak_rss(ctl_pid).unwrap();
        let peak_envoy = bench::peak_rss(envoy_pid).unwrap();
        poll_until_async(
            "kvguard-control has nothing in flight",
            W,
            Duration::from_millis(100),
            || async {
                st.control
                    .inflight_ids()
                    .await
                    .ok()
                    .filter(|v| v.is_empty())
            },
        )
        .await
        .unwrap();
        let aborts = control_aborts(&st, "downstream_reset").await;
        assert_eq!(aborts, n as f64, "{}", st.logs(30));
        let f = st.filter_stats().await.unwrap();
        let pending = f
            .iter()
            .find(|(k, _)| k.ends_with("kvguard_filter_pending_aborts"))
            .map(|(_, v)| *v);
        assert_eq!(pending, Some(0.0), "{f:?}");
        let vm = stack::stat_ending(&f, "kvguard_filter_vm_memory_bytes").unwrap();
        assert!(vm > 0.0, "the filter reports no VM memory: {f:?}");
        eprintln!(
            "memory: kvguard-control RSS {} → {} MiB, Envoy RSS {} → {} MiB, filter VM {:.1} MiB",
            ctl0 >> 20,
            peak_ctl >> 20,
            envoy0 >> 20,
            peak_envoy >> 20,
            vm / 1048576.0
        );
        assert!(
            peak_ctl.saturating_sub(ctl0) < 256 << 20,
            "kvguard-control grew {} MiB",
            (peak_ctl - ctl0) >> 20
        );
        assert!(
            peak_envoy.saturating_sub(envoy0) < 512 << 20,
            "Envoy grew {} MiB",
            (peak_envoy - envoy0) >> 20
        );
        assert!(vm < 64.0 * 1048576.0, "filter VM memory {vm}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_run_kv_climbs_and_kvguard_run_returns_to_baseline() {
    bounded("leak vs kvguard", T, async {
        let mut cfg = DemoConfig::new(EngineKind::Sim);
        cfg.arrival_s = 12.0;
        cfg.drain_s = 10.0;
        // Streams last at most 300 / 40 = 7.5 s: all normal ones end within the drain.
        cfg.max_tokens = 300;
        cfg.stall_share = 0.1;
        cfg.patience_s = 4.0;
        cfg.seed = 7;
        let quiet = |_s: String| {};
        let res = demo::run_demo(&cfg, &[Mode::Leak, Mode::Kvguard], None, &quiet)
            .await
            .unwrap();
        eprintln!("{}", demo::table(&res));
        let leak = res.leak.unwrap();
        let kvg = res.kvguard.unwrap();
        assert_eq!(leak.requests, kvg.requests);
        assert!(
            leak.stalled > 0 && leak.disconnected > 0,
            "the plan has stalls and disconnects"
        );
        // Without kvguard the stalled sequences hold their pages after the load is gone.
        assert_eq!(leak.kv_baseline, 0.0);
        assert!(
            leak.kv_end > 0.0,
            "leak run ended at baseline: {:?}",
            leak.series.last()
        );
        assert!(leak.orphans_at_end > 0);
        assert!(
            leak.orphan_seconds > 10.0,
            "orphan-seconds {}",
            leak.orphan_seconds
        );
        // With kvguard: back to the baseline, no orphan time to speak of, nothing wrongly cut.
        assert_eq!(kvg.kv_end, kvg.kv_baseline, "{:?}", kvg.series.last());
        assert_eq!(kvg.orphans_at_end, 0);
        assert!(
            kvg.orphan_seconds < 2.0,
            "orphan-seconds {}",
            kvg.orphan_seconds
        );
        assert_eq!(kvg.false_aborts, 0, "{:?}", kvg.false_abort_samples);
        assert_eq!(leak.false_aborts, 0, "{:?}", leak.false_abort_samples);
        let by_reason = |r: &str| kvg.aborts_by_reason.get(r).copied().expect(r);
        assert!(
            by_reason("downstream_reset") >= kvg.disconnected as f64,
            "{:?}",
            kvg.aborts_by_reason
        );
        assert_eq!(by_reason("stalled"), kvg.stalled as f64);
        assert!(leak.kv_mean > kvg.kv_mean);
    })
    .await
    .unwrap();
}
