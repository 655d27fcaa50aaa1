//! Stall detection keeps working while other streams flow: the idle reaper runs on the
//! root tick, which healthy traffic on the same worker must not starve or delay. Ten
//! stalled streams (staggered over more than a tick) beside forty paced healthy ones:
//! each stall is cut within idle_timeout + 3 ticks (seen within one tick of its threshold,
//! cut at the next tick if nothing arrived, one tick of slack), no healthy stream is
//! touched.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::bench::upstream::FastUpstream;
use kvguard_integration::client;
use kvguard_integration::envoy::Envoy;
use kvguard_integration::receiver::{self, ReceiverConfig};
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::time::{Duration, Instant};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalls_are_detected_within_three_ticks_beside_healthy_traffic() {
    bounded("stall under load", T, async {
        let up = FastUpstream::spawn().await.unwrap();
        let recv = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let mut o = options(
            up.addr(),
            recv.addr(),
            json!({"idle_timeout_ms": 1000, "tick_ms": 250}),
        );
        o.component_log_level = Some("wasm:info".into());
        let envoy = Envoy::start(o).await.unwrap();
        let entry = envoy.listener_addr();
        let body = chat(10);
        let mut set = tokio::task::JoinSet::new();
        for i in 0..40u64 {
            let body = body.clone();
            set.spawn(async move {
                tokio::time::sleep(Duration::from_millis(i * 7)).await;
                let h = [("x-bench-events", "80"), ("x-bench-interval-us", "50000")];
                let mut s =
                    client::stream_sse(entry, "/v1/chat/completions", &body, &h, i % 2 == 0)
                        .await
                        .unwrap();
                let evs = s.collect(Duration::from_secs(30)).await.unwrap();
                assert!(
                    evs.last().is_some_and(|e| e.is_done()),
                    "a healthy stream was cut"
                );
                "healthy"
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t0 = Instant::now();
        for i in 0..10u64 {
            let body = body.clone();
            set.spawn(async move {
                tokio::time::sleep(Duration::from_millis(i * 37)).await;
                let h = [
                    ("x-bench-events", "80"),
                    ("x-bench-interval-us", "10000"),
                    ("x-bench-stall-after", "3"),
                ];
                let mut s = client::stream_sse(entry, "/v1/chat/completions", &body, &h, false)
                    .await
                    .unwrap();
                // The filter closes it: it must end, without completing.
                let end = s
                    .wait_end(Duration::from_secs(10))
                    .await
                    .unwrap_or_else(|e| panic!("a stalled stream was not closed: {e:#}"));
                assert!(!end.saw_done(), "{end:?}");
                "stalled"
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        let calls = recv.calls();
        let mut delays = Vec::new();
        for c in &calls {
            let a = c.abort.as_ref().unwrap();
            assert_eq!(
                a.reason.as_str(),
                "stalled",
                "a healthy stream was aborted: {a:?}"
            );
            let last = up.last_sent(&a.request_id).unwrap();
            delays.push((c.at.saturating_duration_since(last).as_millis() as i64) - 1000);
        }
        delays.sort_unstable();
        eprintln!(
            "stall detection − threshold (ms): {delays:?} (first stall at +{:?})",
            t0.elapsed()
        );
        assert_eq!(
            calls.len(),
            10,
            "stalled streams not all detected: {delays:?}"
        );
        assert!(
            delays.iter().all(|d| *d <= 750),
            "detection later than three ticks: {delays:?}"
        );
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}
