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

/// Pushes an edit of the listeners and waits until Envoy applied the update.
async fn push(envoy: &Envoy, dl: &DynamicListeners, edit: impl FnOnce(&mut Vec<Value>)) {
    let before = stat(envoy, "listener_manager.lds.update_success").await;
    dl.update(edit).unwrap();
    envoy
        .wait_stat("listener_manager.lds.update_success", W, |v| v > before)
        .await
        .unwrap();
}

/// Sets keys of a listener's filter configuration.
fn edit_filter(listener: &mut Value, keys: Value) {
    let (value, mut cfg) = listener_filter_config(listener).expect("the filter config");
    for (k, v) in keys.as_object().into_iter().flatten() {
        cfg[k] = v.clone();
    }
    *value = Value::String(serde_json::to_string(&cfg).unwrap());
}

/// Pushes `mode` to the listener's filter and waits until Envoy applied the update.
async fn push_mode(envoy: &Envoy, dl: &DynamicListeners, mode: &str) {
    push(envoy, dl, |ls| {
        edit_filter(&mut ls[0], json!({ "mode": mode }))
    })
    .await;
}

/// A stream that stalls after 2 tokens (keep-alives only), its 2 events read; and its id.
async fn stalling_stream(r: &Rig) -> (client::SseStream, String) {
    let mut s = client::stream_sse(
        r.envoy.listener_addr(),
        "/v1/completions",
        &completion(1000, true),
        &[("x-sim-stall-after", "2")],
        false,
    )
    .await
    .unwrap();
    assert_eq!(s.read_events(2, W).await.unwrap().len(), 2);
    (s, last_id(&r.sim))
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
        let (mut stalled, id) = stalling_stream(&r).await;

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

/// Issue 27.6: a pushed `observe` stays when the plugin is configured again: here another
/// listener with the same plugin name loads a configuration of its own that does not name
/// a mode (Envoy 1.40 configures no new root context for byte-identical configuration, so
/// the first listener's pre-push configuration would not run `on_configure` again; one
/// loaded again after a VM reload is the unit test
/// `the_kill_switch_moves_only_on_a_new_configuration`). A stream that then stalls is only
/// observed. Only a new configuration that names `"enforce"` ends observe mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_observe_stays_when_another_configuration_loads() {
    const IDLE: Duration = Duration::from_millis(1000);
    bounded("kill switch stays", T, async {
        let dl = DynamicListeners::new().unwrap();
        let r = rig_with(
            SimConfig {
                stall_keepalive_ms: 200,
                ..SimConfig::default()
            },
            json!({"idle_timeout_ms": IDLE.as_millis() as u64}),
            |o| {
                o.dynamic_listeners = Some(dl.clone());
                o.drain_time_s = 600;
            },
        )
        .await;
        let original = dl.listeners().unwrap()[0].clone();
        let (_, cfg) = listener_filter_config(&mut original.clone()).expect("the filter config");
        assert!(cfg.get("mode").is_none(), "the configuration names no mode");
        push_mode(&r.envoy, &dl, "observe").await;
        // Another listener of the same plugin, with the configuration from before the push.
        push(&r.envoy, &dl, |ls| {
            let mut second = original.clone();
            second["name"] = json!("ingress-2");
            second["address"]["socket_address"]["port_value"] = json!(0);
            edit_filter(
                &mut second,
                json!({"paths": ["/v1/completions", "/v2/other"]}),
            );
            ls.push(second);
        })
        .await;
        r.envoy
            .wait_stat("listener_manager.total_listeners_active", W, |v| v >= 2.0)
            .await
            .unwrap();
        // A stream on the first listener that stalls after 2 tokens: observed only.
        let (mut stalled, id) = stalling_stream(&r).await;
        r.envoy
            .wait_stat(
                "kvguard_filter_would_abort_total_reason=.=stalled;.;",
                IDLE + W,
                |v| v == 1.0,
            )
            .await
            .unwrap();
        r.recv
            .expect_no_more_calls(0, IDLE)
            .await
            .expect("the kill switch was reverted by another configuration");
        assert!(stalled.next_chunk(W).await.unwrap().is_some());
        // A new configuration naming enforce ends observe mode: the stream is then aborted.
        push_mode(&r.envoy, &dl, "enforce").await;
        let calls = r.recv.wait_for_calls(1, IDLE + W).await.unwrap();
        assert_eq!(calls[0].request_id(), Some(id.as_str()));
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}
