//! Aborts survive a config push: the filter's root context of the replaced configuration
//! keeps delivering its pending aborts (on_done answers false until they are delivered,
//! bounded) before it tells the host it is done.
//!
//! 20 clients leave mid-stream while kvguard-control answers 503 (their aborts back off);
//! a config push (file-based LDS) replaces the listener, whose old filter chain drains
//! (1 s) and is destroyed. Only then does the receiver start answering: every one of the
//! 20 aborts still arrives and is answered 200, and the pending gauge comes back to 0.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client;
use kvguard_integration::envoy::{listener_filter_config, DynamicListeners};
use kvguard_integration::receiver::Behaviour;
use kvguard_integration::sim::SimConfig;
use kvguard_integration::wait::{bounded, poll_until_async};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;
use support::*;

const N: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_aborts_are_delivered_across_a_config_push() {
    bounded("reload drain", Duration::from_secs(60), async {
        let dl = DynamicListeners::new().unwrap();
        let r = rig_with(SimConfig::default(), json!({"abort_retries": 10}), |o| {
            o.dynamic_listeners = Some(dl.clone());
            o.drain_time_s = 1;
        })
        .await;
        r.recv.set_behaviour(Behaviour::Status(503));
        let addr = r.envoy.listener_addr();
        let mut ids = BTreeSet::new();
        for i in 0..N {
            let mut s = client::stream_sse(
                addr,
                "/v1/completions",
                &completion(1000, true),
                &[("x-sim-rate", "20")],
                i % 2 == 0,
            )
            .await
            .unwrap();
            assert!(s.next_data(W).await.unwrap().is_some());
            ids.insert(last_id(&r.sim));
            s.disconnect();
        }
        r.recv.wait_for_calls(N, W).await.unwrap();
        assert_eq!(
            stat(&r.envoy, "kvguard_filter_pending_aborts").await,
            N as f64
        );

        // The push: a new filter configuration, so a new listener; the old one drains.
        let before = stat(&r.envoy, "listener_manager.lds.update_success").await;
        dl.update(|ls| {
            let (value, mut cfg) = listener_filter_config(&mut ls[0]).expect("the filter config");
            cfg["idle_timeout_ms"] = json!(61_000);
            *value = Value::String(serde_json::to_string(&cfg).unwrap());
        })
        .unwrap();
        r.envoy
            .wait_stat("listener_manager.lds.update_success", W, |v| v > before)
            .await
            .unwrap();
        r.envoy
            .wait_stat("listener_manager.listener_modified", W, |v| v >= 1.0)
            .await
            .unwrap();
        r.envoy
            .wait_stat("listener_manager.total_filter_chains_draining", W, |v| {
                v == 0.0
            })
            .await
            .unwrap();
        // The old configuration is gone; its aborts are still pending, not lost.
        assert_eq!(
            stat(&r.envoy, "kvguard_filter_pending_aborts").await,
            N as f64
        );

        r.recv.set_behaviour(Behaviour::Verify);
        poll_until_async(
            "every abort answered 200",
            T,
            Duration::from_millis(50),
            || async {
                let done: BTreeSet<String> = r
                    .recv
                    .calls()
                    .into_iter()
                    .filter(|c| c.status == Some(200))
                    .filter_map(|c| c.request_id().map(str::to_string))
                    .collect();
                (done == ids).then_some(())
            },
        )
        .await
        .unwrap();
        r.envoy
            .wait_stat("kvguard_filter_pending_aborts", W, |v| v == 0.0)
            .await
            .unwrap();
    })
    .await
    .unwrap();
}
