//! kvguard-control tells a silent engine from a client that does not drain (issue 27,
//! point 5), in process against the engine simulator; every wait is bounded.
//!
//! - A gateway's `stalled` abort that allows a deferral (`recheck_ms`) is answered
//!   `deferred` while the engine produces, and carried out once the gateway's silence
//!   reaches the reader timeout, or when the engine is the one that is silent; an abort
//!   without `recheck_ms` (an older gateway) is carried out at once.
//! - A request that completed (the engine finished) while its gateway drains the last
//!   bytes to a slow reader: its `stalled` abort with `recheck_ms` is deferred while the
//!   gateway's silence is under the reader timeout, and for a reader timeout after the
//!   completion or the last deferral; 404 otherwise, and for ids never seen.
//! - Its own reaper: a client that reads nothing fills the buffers, kvguard-control stops
//!   taking the engine's frames, and the idle timeout (which counts only the engine's
//!   silence) does not fire; the reader timeout ends it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvguard_integration::client;
use kvguard_integration::sim::{EndKind, SimConfig};
use kvguard_integration::wait::{bounded, poll_until_async};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(60);

/// A signed `stalled` abort of `id` whose sender saw no data for `idle_ms`; with
/// `recheck_ms` it allows a deferral. Each call's body differs (`age_ms`). Its status and
/// answer.
async fn stall_call(
    admin: SocketAddr,
    id: &str,
    idle_ms: u64,
    recheck_ms: Option<u64>,
) -> (u16, Value) {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut body = json!({"request_id": id, "reason": "stalled", "age_ms": n, "tokens": 2, "idle_ms": idle_ms});
    if let Some(r) = recheck_ms {
        body["recheck_ms"] = r.into();
    }
    let (status, v, _) = abort_signed(admin, &body, Some(&key()), now_unix()).await;
    (status, v)
}

/// [`stall_call`], answered 200.
async fn stalled(admin: SocketAddr, id: &str, idle_ms: u64, recheck_ms: Option<u64>) -> Value {
    let (status, v) = stall_call(admin, id, idle_ms, recheck_ms).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// kvguard-control's row of `id` in `GET /v1/requests`, if in flight.
async fn row(admin: SocketAddr, id: &str) -> Option<Value> {
    let v = client::get_json(admin, "/v1/requests").await.unwrap();
    v["requests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["request_id"] == id)
        .cloned()
}

#[tokio::test]
async fn a_stall_abort_is_deferred_while_the_engine_produces() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |c| {
            c.limits.idle_timeout = None;
            c.limits.reader_timeout = Some(Duration::from_secs(30));
        })
        .await;
        let (proxy, admin) = (ctl.proxy_addr, ctl.admin_addr);
        let mut s = long_completion(proxy, "flowing").await;
        s.read_events(2, Duration::from_secs(5)).await.unwrap();
        // The gateway saw nothing for 3 s (its client drains slowly); the engine produces.
        let v = stalled(admin, "flowing", 3_000, Some(3_000)).await;
        assert_eq!(
            v,
            json!({"request_id": "flowing", "found": true, "deferred": true})
        );
        assert_eq!(
            metric(
                admin,
                "kvguard_control_abort_api_answers_total{result=\"deferred\"}"
            )
            .await,
            Some(1.0)
        );
        // Still streaming, untouched.
        s.read_events(3, Duration::from_secs(5)).await.unwrap();
        assert!(sim.state().request("flowing").unwrap().ended.is_none());
        // An older gateway (no recheck_ms) is obeyed at once.
        let mut old = long_completion(proxy, "old-sender").await;
        old.read_events(1, Duration::from_secs(5)).await.unwrap();
        let v = stalled(admin, "old-sender", 3_000, None).await;
        assert_eq!(v["aborted"], true, "{v}");
        // The gateway's silence reached the reader timeout: its reader is gone.
        let v = stalled(admin, "flowing", 30_000, Some(3_000)).await;
        assert_eq!(v["aborted"], true, "{v}");
        let started = Instant::now();
        sim.wait_state("engine aborted", Duration::from_secs(5), |st| {
            st.request("flowing")
                .is_some_and(|r| r.ended == Some(EndKind::Disconnected))
        })
        .await
        .unwrap();
        eprintln!("ended {:?} after the abort", started.elapsed());
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_stall_abort_of_a_silent_engine_is_carried_out() {
    bounded("test", LIMIT, async {
        let sim = sim(SimConfig::default()).await;
        let ctl = control(&sim.url(), |c| {
            c.limits.idle_timeout = None;
            c.limits.reader_timeout = Some(Duration::from_secs(30));
        })
        .await;
        let (proxy, admin) = (ctl.proxy_addr, ctl.admin_addr);
        let mut s = client::stream_sse(
            proxy,
            "/v1/completions",
            &completion(100),
            &[("x-request-id", "stuck"), ("x-sim-stall-after", "2")],
            false,
        )
        .await
        .unwrap();
        s.read_events(2, Duration::from_secs(5)).await.unwrap();
        // kvguard-control asked the engine for its next frame and got none: once that
        // silence is half of what the gateway reports, the stall is the engine's.
        let idle = Duration::from_millis(600);
        poll_until_async(
            "the engine silent",
            Duration::from_secs(5),
            Duration::from_millis(20),
            || async {
                row(admin, "stuck").await.filter(|r| {
                    r["waiting_on"] == "engine" && r["waiting_ms"].as_u64().unwrap() >= 300
                })
            },
        )
        .await
        .unwrap();
        let v = stalled(admin, "stuck", idle.as_millis() as u64, Some(3_000)).await;
        assert_eq!(v["aborted"], true, "{v}");
        sim.wait_state("engine aborted", Duration::from_secs(5), |st| {
            st.request("stuck")
                .is_some_and(|r| r.ended == Some(EndKind::Disconnected))
        })
        .await
        .unwrap();
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn the_reaper_waits_the_reader_timeout_for_a_client_that_does_not_drain() {
    bounded("test", LIMIT, async {
        // A fast engine: the buffers toward the client fill within seconds.
        let sim = sim(SimConfig {
            token_rate: 20_000.0,
            default_max_tokens: 1_000_000,
            max_model_len: 2_000_000,
            kv_blocks: 200_000,
            ..SimConfig::default()
        })
        .await;
        let idle = Duration::from_millis(500);
        let reader = Duration::from_secs(4);
        let ctl = control(&sim.url(), |c| {
            c.limits.idle_timeout = Some(idle);
            c.limits.reader_timeout = Some(reader);
        })
        .await;
        let (proxy, admin) = (ctl.proxy_addr, ctl.admin_addr);
        let body = json!({"model": "tiny", "prompt": "x", "max_tokens": 1_000_000, "stream": true});
        let silent = client::silent_client(
            proxy,
            "/v1/completions",
            &body,
            &[("x-request-id", "silent")],
            4096,
            true,
        )
        .await
        .unwrap();
        // kvguard-control stops taking the engine's frames once the buffers are full.
        let t = poll_until_async(
            "waiting on the reader",
            Duration::from_secs(30),
            Duration::from_millis(20),
            || async {
                row(admin, "silent")
                    .await
                    .filter(|r| r["waiting_on"] == "reader")
                    .map(|_| Instant::now())
            },
        )
        .await
        .unwrap();
        // Past the idle timeout (and its tick) the reader's wait goes on: not a stall.
        let past_idle = idle * 3;
        poll_until_async(
            "a reader wait past the idle timeout",
            reader,
            Duration::from_millis(20),
            || async {
                row(admin, "silent").await.filter(|r| {
                    r["waiting_on"] == "reader"
                        && r["waiting_ms"].as_u64().unwrap() >= past_idle.as_millis() as u64
                })
            },
        )
        .await
        .unwrap();
        assert!(sim.state().request("silent").unwrap().ended.is_none());
        // The reader timeout ends it (within its tick).
        let tick = kvguard_control::reaper::tick(&ctl.state.cfg.limits);
        sim.wait_state(
            "engine aborted",
            reader + tick + Duration::from_secs(1),
            |st| {
                st.request("silent")
                    .is_some_and(|r| r.ended == Some(EndKind::Disconnected))
            },
        )
        .await
        .unwrap();
        let after = t.elapsed();
        eprintln!("the reader wait began; ended {after:?} later (reader timeout {reader:?})");
        assert!(
            after + Duration::from_millis(100) >= reader - past_idle.min(reader),
            "{after:?}"
        );
        assert_eq!(
            metric(
                admin,
                "kvguard_control_aborts_total{reason=\"stalled\",outcome=\"aborted\"}"
            )
            .await,
            Some(1.0)
        );
        drop(silent);
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_stall_abort_of_a_completed_request_is_deferred_while_its_sender_saw_data_within_the_reader_timeout(
) {
    bounded("test", LIMIT, async {
        let sim = sim(SimConfig::default()).await;
        let reader = Duration::from_secs(2);
        let ctl = control(&sim.url(), |c| {
            c.limits.idle_timeout = None;
            c.limits.reader_timeout = Some(reader);
        })
        .await;
        let (proxy, admin) = (ctl.proxy_addr, ctl.admin_addr);
        for id in ["done", "done-2", "done-3"] {
            let mut s = client::stream_sse(
                proxy,
                "/v1/completions",
                &completion(5),
                &[("x-request-id", id)],
                false,
            )
            .await
            .unwrap();
            assert!(s
                .wait_end(Duration::from_secs(10))
                .await
                .unwrap()
                .saw_done());
        }
        poll_until_async(
            "all completed here",
            Duration::from_secs(5),
            Duration::from_millis(20),
            || async {
                let v = client::get_json(admin, "/v1/requests").await.unwrap();
                (v["inflight"] == 0).then_some(())
            },
        )
        .await
        .unwrap();
        let t0 = Instant::now();
        // Its gateway saw no data for 1.5 s (a slow reader drains the tail): deferred.
        let deferred = json!({"request_id": "done", "found": true, "deferred": true});
        assert_eq!(stalled(admin, "done", 1_500, Some(500)).await, deferred);
        // Not when its gateway's silence reached the reader timeout, nor for a sender that
        // does not allow a deferral: 404 (and a tombstone).
        for (id, idle, recheck) in [
            ("done-2", reader.as_millis() as u64, Some(500)),
            ("done-3", 10, None),
        ] {
            let (status, v) = stall_call(admin, id, idle, recheck).await;
            assert_eq!(
                (status, &v["found"]),
                (404, &json!(false)),
                "{id} {idle} {recheck:?}: {v}"
            );
        }
        // Judged on its sender's evidence alone, however long after the engine's end: the
        // first ask of a reader that paused past the reader timeout is deferred; the
        // sender's silence reaching it is not.
        tokio::time::sleep_until((t0 + reader * 2).into()).await;
        assert_eq!(stalled(admin, "done", 1_500, Some(500)).await, deferred);
        tokio::time::sleep_until((t0 + reader * 3).into()).await;
        assert_eq!(stalled(admin, "done", 1_900, Some(500)).await, deferred);
        let (status, v) = stall_call(admin, "done", reader.as_millis() as u64, Some(500)).await;
        assert_eq!(
            status, 404,
            "its sender saw nothing for the reader timeout: {v}"
        );
        assert_eq!(
            metric(
                admin,
                "kvguard_control_abort_api_answers_total{result=\"deferred\"}"
            )
            .await,
            Some(3.0)
        );
        ctl.stop().await;
    })
    .await
    .unwrap();
}
