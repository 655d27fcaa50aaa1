//! A gateway that does not run for longer than the idle timeout (SIGSTOP: what a
//! descheduled, CPU-starved or throttled Envoy looks like from inside) cuts no stream that
//! is still flowing: the tokens the engine sent meanwhile wait in Envoy's socket, and the
//! tick stamps the progress they bring before it looks for idle streams (a tick that
//! decided on the previous stamp would find every stream idle for the length of the stop).
//! A stream whose engine really went silent is still ended once Envoy runs again.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client;
use kvguard_integration::sim::SimConfig;
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::time::{Duration, Instant};
use support::*;

/// The filter's idle timeout here, and how long Envoy is stopped (well past it).
const IDLE: Duration = Duration::from_millis(1000);
const STOP: Duration = Duration::from_millis(2500);

/// The rig (idle timeout [`IDLE`]) and a stream whose engine stops after 3 tokens (nobody
/// will send it anything), its first event read; and its request id.
async fn with_silent_stream() -> (Rig, client::SseStream, String) {
    let r = rig(
        SimConfig::default(),
        json!({"idle_timeout_ms": IDLE.as_millis() as u64}),
    )
    .await;
    let mut s = client::stream_sse(
        r.envoy.listener_addr(),
        "/v1/completions",
        &completion(1000, true),
        &[("x-sim-rate", "25"), ("x-sim-stall-after", "3")],
        false,
    )
    .await
    .unwrap();
    assert!(s.next_data(W).await.unwrap().is_some());
    let id = last_id(&r.sim);
    (r, s, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_stopped_past_the_idle_timeout_cuts_no_flowing_stream() {
    bounded("gateway stall", T, async {
        // One stream whose engine stops after 3 tokens: nobody will send it anything.
        let (mut r, mut silent, silent_id) = with_silent_stream().await;
        let addr = r.envoy.listener_addr();
        // Four flowing streams: 25 tokens/s, 150 tokens (about 6 s), HTTP/1.1 and h2.
        let mut flowing = Vec::new();
        for (i, http2) in [false, true, false, true].into_iter().enumerate() {
            let path = if i % 2 == 0 {
                "/v1/completions"
            } else {
                "/v1/chat/completions"
            };
            let body = if i % 2 == 0 {
                completion(150, true)
            } else {
                chat(150)
            };
            let mut s = client::stream_sse(addr, path, &body, &[("x-sim-rate", "25")], http2)
                .await
                .unwrap();
            assert!(s.next_data(W).await.unwrap().is_some());
            flowing.push((last_id(&r.sim), s));
        }
        // Envoy stops for 2.5 idle timeouts; the simulator keeps sending meanwhile.
        let stopped = Instant::now();
        r.envoy.guard().signal(libc::SIGSTOP).unwrap();
        // The length of the stop is the subject here, not a wait for an event.
        tokio::time::sleep(STOP).await;
        r.envoy.guard().signal(libc::SIGCONT).unwrap();
        let resumed = stopped.elapsed();
        for (id, s) in &mut flowing {
            let end = s.wait_end(W).await.unwrap();
            assert!(
                end.completed(),
                "{id}: cut after Envoy was stopped {resumed:?} (idle timeout {IDLE:?}): {:?}\n{}",
                end.reset,
                r.envoy.log()
            );
            assert_eq!(access_outcome(&r.envoy, id).await, "completed");
        }
        // The silent one is ended, and it is the only abort.
        let calls = r.recv.wait_for_calls(1, W).await.unwrap();
        assert_eq!(calls[0].request_id(), Some(silent_id.as_str()));
        assert_eq!(
            access_outcome(&r.envoy, &silent_id).await,
            "aborted:stalled"
        );
        let end = silent.wait_end(W).await.unwrap();
        assert!(
            !end.saw_done(),
            "the silent stream was ended, not completed"
        );
        assert_eq!(
            r.recv.calls().len(),
            1,
            "only the silent stream is aborted: {:?}",
            r.recv.calls()
        );
        assert_eq!(stat(&r.envoy, &aborts("stalled", "aborted")).await, 1.0);
        // The stop reached the filter as a stall of its VMs (the subject of the test; the
        // main thread's VM ticks too).
        let stalls = stat(&r.envoy, "kvguard_filter_worker_stalls_total").await;
        assert!(stalls >= 1.0, "the stop was not seen as a stall: {stalls}");
        wait_log(&r.envoy, "this worker did not run for").await;
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}

/// Issue 27.1: an Envoy whose ticks always come late (throttled: stopped 600 ms of every
/// 700, so every tick is more than two periods after the last) still ends a silent
/// stream, and cuts none that flows. (A hold as long as each late tick's lateness held
/// every idle cut at every tick: the silent stream was never ended.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_envoy_still_ends_a_silent_stream() {
    bounded("throttled gateway", T, async {
        let (mut r, mut silent, silent_id) = with_silent_stream().await;
        let addr = r.envoy.listener_addr();
        let mut flowing = Vec::new();
        for http2 in [false, true] {
            let mut s = client::stream_sse(
                addr,
                "/v1/chat/completions",
                &chat(250),
                &[("x-sim-rate", "25")],
                http2,
            )
            .await
            .unwrap();
            assert!(s.next_data(W).await.unwrap().is_some());
            flowing.push((last_id(&r.sim), s));
        }
        // Throttle until the abort arrives (bounded: 14 periods, about 10 s). The stops'
        // lengths are the subject here, not a wait for an event.
        let started = Instant::now();
        for _ in 0..14 {
            r.envoy.guard().signal(libc::SIGSTOP).unwrap();
            tokio::time::sleep(Duration::from_millis(600)).await;
            r.envoy.guard().signal(libc::SIGCONT).unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            if !r.recv.calls().is_empty() {
                break;
            }
        }
        let throttled = started.elapsed();
        let calls = r.recv.calls();
        assert!(
            !calls.is_empty(),
            "the silent stream was not ended in {throttled:?} of throttling"
        );
        assert_eq!(
            calls[0].request_id(),
            Some(silent_id.as_str()),
            "after {:?} of throttling",
            started.elapsed()
        );
        let stalls = stat(&r.envoy, "kvguard_filter_worker_stalls_total").await;
        assert!(stalls >= 2.0, "the ticks were not late: {stalls}");
        for (id, s) in &mut flowing {
            let end = s.wait_end(W).await.unwrap();
            assert!(end.completed(), "{id} was cut: {:?}", end.reset);
        }
        assert_eq!(r.recv.calls().len(), 1, "{:?}", r.recv.calls());
        let end = silent.wait_end(W).await.unwrap();
        assert!(!end.saw_done());
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}
