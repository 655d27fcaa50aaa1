//! Faults through the real stack:
//! - the abort endpoint answering 500, then slow (10 s), during a disconnect storm: the
//!   healthy streams beside it are untouched, every abort ends `failed` after its bounded
//!   retries, the pending-abort gauge returns to 0;
//! - kvguard-control killed and restarted mid-storm (Envoy + kvguard → lossy hop →
//!   kvguard-control → simulator): the streams through it are cut (documented) and their
//!   engine sequences end, new streams flow after the restart, and aborts for streams
//!   disconnected after the restart all reach the engine;
//! - the engine (the `engine-sim` process) killed mid-stream: clients see their streams
//!   end, each gets an `upstream_reset` abort, Envoy and the VM stay healthy, and traffic
//!   flows again once an engine is back on the same port.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Stack, StackOptions};
use kvguard_integration::envoy::Envoy;
use kvguard_integration::load::{self, LoadConfig};
use kvguard_integration::paths;
use kvguard_integration::proc::ChildGuard;
use kvguard_integration::receiver::{self, Behaviour, ReceiverConfig};
use kvguard_integration::sim::{self, EndKind, SimConfig};
use kvguard_integration::wait::{bounded, poll_until};
use serde_json::json;
use std::time::{Duration, Instant};
use support::*;

fn healthy_load(target: std::net::SocketAddr, n: usize) -> LoadConfig {
    let mut c = LoadConfig::new(target);
    c.requests = n;
    c.concurrency = n;
    c.max_tokens = 20;
    c.http2 = true;
    c.stream_timeout = Duration::from_secs(30);
    c
}

fn storm(target: std::net::SocketAddr, n: usize) -> LoadConfig {
    let mut c = healthy_load(target, n);
    c.storm = n;
    c.storm_window = Duration::from_millis(500);
    c.max_tokens = 400;
    c.headers = vec![("x-sim-rate".into(), "20".into())];
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_and_slow_abort_endpoint_during_a_storm_leaves_healthy_traffic_alone() {
    bounded("abort endpoint 500 / slow", T, async {
        let r = rig(
            SimConfig {
                token_rate: 100.0,
                ..SimConfig::default()
            },
            json!({"abort_timeout_ms": 300, "abort_retries": 2}),
        )
        .await;
        let addr = r.envoy.listener_addr();
        for (label, behaviour) in [
            ("500", Behaviour::Status(500)),
            ("slow 10 s", Behaviour::Delay(Duration::from_secs(10))),
        ] {
            r.recv.set_behaviour(behaviour);
            r.recv.clear_calls();
            let t0 = Instant::now();
            let (healthy, stormed) = tokio::join!(
                load::run(healthy_load(addr, 20)),
                load::run(storm(addr, 30))
            );
            assert_eq!(
                healthy.completed, 20,
                "{label}: healthy streams hurt: {healthy:?}"
            );
            assert_eq!(
                healthy.errors + healthy.truncated,
                0,
                "{label}: {healthy:?}"
            );
            assert!(
                healthy.ttfb_ms.p99 < 2000.0,
                "{label}: healthy TTFB p99 {} ms",
                healthy.ttfb_ms.p99
            );
            assert_eq!(stormed.disconnected, 30, "{label}: {stormed:?}");
            // Bounded retries: 1 + 2 attempts per abort, then `failed`; the queue drains.
            r.envoy
                .wait_stat("kvguard_filter_pending_aborts", W, |v| v == 0.0)
                .await
                .unwrap_or_else(|e| panic!("{label}: pending aborts never drained: {e:#}"));
            // The receiver records every attempt when it arrives (also the ones the filter
            // gives up on before the slow answer): at least one per abort, at most 1 + 2.
            let calls = r.recv.calls().len();
            assert!(
                (30..=30 * 3).contains(&calls),
                "{label}: {calls} calls for 30 aborts (at least 30, at most 90 with 2 retries)"
            );
            eprintln!(
                "{label}: {calls} abort calls, drained in {:?}",
                t0.elapsed()
            );
        }
        let failed = stat(&r.envoy, &aborts("downstream_reset", "failed")).await;
        assert_eq!(failed, 60.0, "every abort should end failed");
        assert_eq!(stat(&r.envoy, "kvguard_filter_active_requests").await, 0.0);
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvguard_control_restarted_mid_storm() {
    bounded("control restart", T, async {
        let engine = sim::spawn(SimConfig {
            token_rate: 20.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let mut so = StackOptions::new(engine.addr(), Some(stack::filter_config(0, 0)));
        so.buffer_limit = None;
        so.control_args = vec!["--idle-timeout".into(), "off".into()];
        let mut st = Stack::start(so).await.unwrap();
        let entry = st.entry();
        // 20 long streams in flight through kvguard-control.
        let mut before = Vec::new();
        for _ in 0..20 {
            let mut s = client::stream_sse(entry, "/v1/chat/completions", &chat(400), &[], false)
                .await
                .unwrap();
            s.next_data(W).await.unwrap().unwrap();
            before.push(s);
        }
        st.control.restart().await.unwrap();
        // Cut, as documented: every one of them ends (none hangs) without completing ...
        for mut s in before {
            let end = s
                .wait_end(W)
                .await
                .unwrap_or_else(|e| panic!("a stream through the dead control hangs: {e:#}"));
            assert!(
                !end.saw_done(),
                "a stream through the dead control completed: {end:?}"
            );
        }
        // ... and the engine ended their sequences (no orphan behind the lossy hop).
        engine
            .wait_state("the cut sequences end", W, |s| s.running.is_empty())
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        // New streams flow; of 10, 5 are disconnected: each of those is aborted at the engine.
        let mut after = Vec::new();
        for _ in 0..10 {
            let mut s = client::stream_sse(entry, "/v1/chat/completions", &chat(30), &[], false)
                .await
                .unwrap();
            let ev = s.next_data(W).await.unwrap().unwrap();
            let id = ev.json().unwrap()["id"]
                .as_str()
                .unwrap()
                .strip_prefix("chatcmpl-")
                .unwrap()
                .to_owned();
            after.push((id, s));
        }
        let mut gone = Vec::new();
        let mut kept = Vec::new();
        for (i, (id, s)) in after.into_iter().enumerate() {
            if i % 2 == 0 {
                s.disconnect();
                gone.push(id);
            } else {
                kept.push(s);
            }
        }
        for id in &gone {
            poll_until(
                "abort reaches the engine after the restart",
                W,
                Duration::from_millis(50),
                || {
                    engine
                        .state()
                        .request(id)
                        .and_then(|r| r.ended)
                        .filter(|e| *e != EndKind::Length)
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{id}: {e:#}\n{}", st.logs(60)));
        }
        for mut s in kept {
            assert!(
                s.wait_end(W).await.unwrap().completed(),
                "a healthy stream after the restart was hurt"
            );
        }
        assert_vm_healthy(&st.envoy);
    })
    .await
    .unwrap();
}

async fn engine_process(listen: &str) -> (ChildGuard, std::net::SocketAddr) {
    ChildGuard::spawn_with_addr_file(
        "engine-sim",
        paths::engine_sim_bin().unwrap(),
        ["--listen", listen, "--token-rate", "20"],
        &[],
        W,
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_killed_mid_stream() {
    bounded("engine killed", T, async {
        let (mut eng, addr) = engine_process("127.0.0.1:0").await;
        let recv = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let envoy = Envoy::start(options(addr, recv.addr(), json!({})))
            .await
            .unwrap();
        let entry = envoy.listener_addr();
        let mut streams = Vec::new();
        for i in 0..10 {
            let mut s =
                client::stream_sse(entry, "/v1/chat/completions", &chat(400), &[], i % 2 == 1)
                    .await
                    .unwrap();
            let ev = s.next_data(W).await.unwrap().unwrap();
            let id = ev.json().unwrap()["id"]
                .as_str()
                .unwrap()
                .strip_prefix("chatcmpl-")
                .unwrap()
                .to_owned();
            streams.push((id, s));
        }
        eng.kill().unwrap();
        for (id, mut s) in streams {
            let end = s
                .wait_end(W)
                .await
                .unwrap_or_else(|e| panic!("{id} hangs after the engine died: {e:#}"));
            assert!(!end.saw_done(), "{id} completed after the engine died");
            let calls = recv.wait_calls_for(&id, W).await.unwrap();
            assert_eq!(
                calls[0].abort.as_ref().unwrap().reason.as_str(),
                "upstream_reset"
            );
        }
        assert_vm_healthy(&envoy);
        // An engine back on the same port: traffic flows, nothing more is aborted.
        let (_eng2, _) = engine_process(&addr.to_string()).await;
        recv.clear_calls();
        let mut s = client::stream_sse(entry, "/v1/chat/completions", &chat(5), &[], false)
            .await
            .unwrap();
        let end = s.wait_end(W).await.unwrap();
        assert!(end.completed(), "{end:?}");
        // The filter is done with it (its access log line says how it ended), then a quiet
        // period: no abort follows.
        let id = end
            .events
            .iter()
            .find_map(|e| e.json())
            .and_then(|j| Some(j["id"].as_str()?.strip_prefix("chatcmpl-")?.to_owned()))
            .unwrap();
        assert_eq!(access_outcome(&envoy, &id).await, "completed");
        envoy
            .wait_stat("kvguard_filter_active_requests", W, |v| v == 0.0)
            .await
            .unwrap();
        recv.expect_no_more_calls(0, QUIET).await.unwrap();
    })
    .await
    .unwrap();
}
