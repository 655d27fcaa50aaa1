//! The kill switch in a real Envoy: a pushed `"mode"` (file-based LDS, new file renamed
//! into the watched directory) reaches the streams already in flight, which keep the old
//! configuration's root context. Observe pushed mid-stream: a stream that then stalls
//! is only observed (no abort, not cut). Enforce pushed back: that stream gets a fresh
//! idle window instead of being closed at once. Healthy streams reach `[DONE]`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client;
use kvguard_integration::envoy::{listener_filter_config, DynamicListeners, Envoy};
use kvguard_integration::sim::SimConfig;
use kvguard_integration::wait::bounded;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::*;

const IDLE_MS: u64 = 4000;

/// Pushes `mode` to the listener's filter and waits until Envoy applied the update.
async fn push_mode(envoy: &Envoy, dl: &DynamicListeners, mode: &str) {
    let before = stat(envoy, "listener_manager.lds.update_success").await;
    dl.update(|ls| {
        let (value, mut cfg) = listener_filter_config(&mut ls[0]).expect("the filter config");
        cfg["mode"] = json!(mode);
        *value = Value::String(serde_json::to_string(&cfg).unwrap());
    })
    .unwrap();
    envoy
        .wait_stat("listener_manager.lds.update_success", W, |v| v > before)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_mode_reaches_streams_in_flight() {
    bounded("kill switch", T, async {
        let dl = DynamicListeners::new().unwrap();
        let r = rig_with(
            SimConfig {
                stall_keepalive_ms: 200,
                ..SimConfig::default()
            },
            json!({"idle_timeout_ms": IDLE_MS}),
            |o| {
                o.dynamic_listeners = Some(dl.clone());
                // Streams on the replaced filter chain live on for the whole test.
                o.drain_time_s = 600;
            },
        )
        .await;
        let addr = r.envoy.listener_addr();
        // Healthy streams: 20 tokens/s, 240 tokens (12 s), HTTP/1.1 and HTTP/2.
        let mut healthy = Vec::new();
        for http2 in [false, true] {
            let mut s = client::stream_sse(
                addr,
                "/v1/completions",
                &completion(240, true),
                &[("x-sim-rate", "20")],
                http2,
            )
            .await
            .unwrap();
            assert!(s.next_data(W).await.unwrap().is_some());
            healthy.push(s);
        }
        // A stream that stalls after 2 tokens (keep-alives only), started in enforce mode.
        let mut stalled = client::stream_sse(
            addr,
            "/v1/completions",
            &completion(1000, true),
            &[("x-sim-stall-after", "2")],
            false,
        )
        .await
        .unwrap();
        let id = last_id(&r.sim);
        assert_eq!(stalled.read_events(2, W).await.unwrap().len(), 2);

        // Observe, pushed while it is in flight: its stall is observed, not enforced.
        push_mode(&r.envoy, &dl, "observe").await;
        r.envoy
            .wait_stat(
                "kvguard_filter_would_abort_total_reason=.=stalled;.;",
                Duration::from_millis(IDLE_MS) + W,
                |v| v == 1.0,
            )
            .await
            .unwrap();
        assert!(r.recv.calls().is_empty(), "observe mode sent an abort");
        // Still open: keep-alives keep coming.
        assert!(stalled.next_chunk(W).await.unwrap().is_some());
        assert!(!stalled.is_ended());

        // Enforce again: the observed stream is not closed at once, it gets a fresh idle
        // window, then (still stalled) it is closed and aborted.
        let pushed = Instant::now();
        push_mode(&r.envoy, &dl, "enforce").await;
        let calls = r
            .recv
            .wait_for_calls(1, Duration::from_millis(IDLE_MS) + W)
            .await
            .unwrap();
        let took = pushed.elapsed();
        assert_eq!(calls[0].request_id(), Some(id.as_str()));
        assert_eq!(calls[0].abort.as_ref().unwrap().reason.as_str(), "stalled");
        assert!(
            took >= Duration::from_millis(IDLE_MS),
            "closed {took:?} after enforce came back: the clocks did not restart"
        );
        let rest = stalled.collect(W).await;
        assert!(
            !rest.iter().flatten().any(|e| e.is_done()),
            "the stalled stream cannot have completed"
        );
        // The healthy streams were never touched.
        for s in &mut healthy {
            let ev = s.collect(W).await.unwrap();
            assert!(
                ev.last().is_some_and(|e| e.is_done()),
                "a healthy stream was cut: {ev:?}"
            );
        }
        r.recv
            .expect_no_more_calls(1, Duration::from_millis(1000))
            .await
            .unwrap();
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}
