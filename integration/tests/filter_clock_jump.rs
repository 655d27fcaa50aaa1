//! The filter's timers in a real Envoy whose WALL clock steps while streams run
//! (`LD_PRELOAD` clock shim, [`kvguard_integration::clock_shim`]): a step of minutes
//! forward and back cuts no stream and sends no abort, because every timer runs on the
//! monotonic clock; only the abort signature follows the wall clock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client;
use kvguard_integration::clock_shim::ClockShim;
use kvguard_integration::sim::SimConfig;
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::time::Duration;
use support::*;

/// `t=` of an `x-kvguard-signature` header.
fn signature_time(header: &str) -> u64 {
    header
        .split(',')
        .find_map(|p| p.strip_prefix("t="))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no t= in {header:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wall_clock_steps_of_minutes_cut_no_stream() {
    bounded("clock jump", T, async {
        let shim = ClockShim::build().unwrap();
        let r = rig_with(
            SimConfig::default(),
            json!({"idle_timeout_ms": 2000, "first_token_timeout_ms": 5000, "max_age_ms": 60000}),
            |o| o.process_env.extend(shim.env()),
        )
        .await;
        let addr = r.envoy.listener_addr();
        // Healthy streams: 25 tokens/s, 100 tokens (about 4 s each).
        let mut streams = Vec::new();
        for http2 in [false, true, false, true] {
            let mut s = client::stream_sse(
                addr,
                "/v1/completions",
                &completion(100, true),
                &[("x-sim-rate", "25")],
                http2,
            )
            .await
            .unwrap();
            assert!(s.next_data(W).await.unwrap().is_some());
            streams.push(s);
        }
        // The wall clock jumps 5 minutes ahead: past every idle, first-token and
        // max-age deadline if a timer read it.
        shim.set_offset_s(300).unwrap();
        // The jump reached the VM (the subject of the test is there): the abort of a
        // client that leaves now is signed with the shifted wall clock.
        let mut gone = client::stream_sse(
            addr,
            "/v1/completions",
            &completion(1000, true),
            &[("x-sim-rate", "25")],
            false,
        )
        .await
        .unwrap();
        assert!(gone.next_data(W).await.unwrap().is_some());
        let gone_id = last_id(&r.sim);
        gone.disconnect();
        let calls = r.recv.wait_for_calls(1, W).await.unwrap();
        assert_eq!(calls[0].request_id(), Some(gone_id.as_str()));
        let t = signature_time(&calls[0].headers["x-kvguard-signature"]);
        assert!(
            t >= now_unix() + 250,
            "the abort's signature time {t} is not ~5 min ahead of {}: the shim did not reach Envoy",
            now_unix()
        );
        // Still mid-stream: now a step 10 minutes back.
        for s in &mut streams {
            assert!(s.next_data(W).await.unwrap().is_some());
        }
        shim.set_offset_s(-300).unwrap();
        // Every healthy stream reaches [DONE]; nothing was cut or aborted.
        for s in &mut streams {
            let ev = s.collect(W).await.unwrap();
            assert!(
                ev.last().is_some_and(|e| e.is_done()),
                "a healthy stream was cut: {ev:?}"
            );
        }
        r.recv
            .expect_no_more_calls(1, Duration::from_millis(1500))
            .await
            .unwrap();
        assert_eq!(stat(&r.envoy, "kvguard_filter_streams_closed_total").await, 0.0);
        for reason in ["stalled", "max_age", "first_token_timeout"] {
            let n: f64 = r
                .envoy
                .stats_matching(&format!("aborts_total_reason=.={reason};"))
                .await
                .unwrap()
                .values()
                .sum();
            assert_eq!(n, 0.0, "{reason} aborts after a wall-clock step");
        }
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}
