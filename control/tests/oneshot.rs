//! Router-level tests with `tower::ServiceExt::oneshot` (no sockets): the abort API's
//! answers on an injected clock, refusals of the proxy, the reaper on an injected clock,
//! NVML logic through the fake probe, quiet checkpoints.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use kvguard_contract::{signature, AbortReason, Key, RequestId};
use kvguard_control::clock::Clock;
use kvguard_control::config::Config;
use kvguard_control::engine::{BoxFut, Engine};
use kvguard_control::expo::EngineFigures;
use kvguard_control::gpu::{DeviceMemory, GpuProbe, GpuSnapshot, GpuTracker, ProcessMemory};
use kvguard_control::state::AppState;
use kvguard_control::testing::{FakeProbe, ManualClock};
use kvguard_control::{admin, proxy, reaper, sampler};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;

const KEY: &[u8] = b"kvguard-control-test-key-0123456789";
const NOW: u64 = 1_800_000_000;

struct FakeEngine;
impl Engine for FakeEngine {
    fn scrape(&self) -> BoxFut<'_, Result<String, String>> {
        Box::pin(async { Err("fake".into()) })
    }
    fn health(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Err("fake".into()) })
    }
    fn abort(&self, _id: RequestId) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

fn state(tweak: impl FnOnce(&mut Config)) -> (Arc<AppState>, Arc<ManualClock>) {
    // Port 9 (discard): nothing answers there.
    let mut cfg =
        Config::for_tests("http://127.0.0.1:9", vec![Key::try_new(KEY).unwrap()]).unwrap();
    tweak(&mut cfg);
    let clock = Arc::new(ManualClock::new(NOW));
    let st = AppState::new(
        cfg,
        clock.clone(),
        Arc::new(FakeEngine),
        GpuTracker::unavailable("test".into()),
    );
    (st, clock)
}

async fn call(app: axum::Router, req: Request<Body>) -> (StatusCode, Value) {
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn abort_req(body: &[u8], sig: Option<String>) -> Request<Body> {
    let mut b = Request::post("/v1/abort");
    if let Some(s) = sig {
        b = b.header("x-kvguard-signature", s);
    }
    b.body(Body::from(body.to_vec())).unwrap()
}

#[tokio::test]
async fn abort_api_answers_per_contract_on_an_injected_clock() {
    let (st, clock) = state(|_| {});
    let key = Key::try_new(KEY).unwrap();
    let app = admin::app(st.clone());
    let body = br#"{"request_id":"r1","reason":"stalled","age_ms":5,"tokens":6}"#;
    // Skew boundary: ±30 s accepted, 31 refused.
    let (s, _) = call(
        app.clone(),
        abort_req(body, Some(signature::sign(&key, NOW - 31, body))),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(
        app.clone(),
        abort_req(body, Some(signature::sign(&key, NOW + 31, body))),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(app.clone(), abort_req(body, None)).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(app.clone(), abort_req(body, Some("t=1,v1=zz".into()))).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let sig = signature::sign(&key, NOW - 30, body);
    let (s, v) = call(app.clone(), abort_req(body, Some(sig.clone()))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v, json!({"request_id": "r1", "found": false}));
    // Replay of the same signature within the window.
    let (s, _) = call(app.clone(), abort_req(body, Some(sig))).await;
    assert_eq!(s, StatusCode::CONFLICT);
    // The tombstone answers already_aborted.
    let (s, v) = call(
        app.clone(),
        abort_req(body, Some(signature::sign(&key, NOW + 30, body))),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({"request_id": "r1", "found": true, "already_aborted": true})
    );
    // Too large: 400 (bounded read).
    let big = vec![b' '; 5000];
    let (s, _) = call(
        app.clone(),
        abort_req(&big, Some(signature::sign(&key, NOW, &big))),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    // The tombstone expires after its TTL (60 s by default).
    clock.advance(Duration::from_secs(61));
    st.purge_tombstones();
    let t = NOW + 61;
    let (s, _) = call(
        app.clone(),
        abort_req(body, Some(signature::sign(&key, t, body))),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // In flight → 200 aborted, and the entry is ended with the body's reason.
    let entry = st
        .admit(
            RequestId::try_new(b"live").unwrap(),
            "POST".into(),
            "/v1/completions".into(),
        )
        .unwrap();
    let live = br#"{"request_id":"live","reason":"downstream_reset"}"#;
    let (s, v) = call(
        app.clone(),
        abort_req(live, Some(signature::sign(&key, t, live))),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({"request_id": "live", "found": true, "aborted": true})
    );
    assert_eq!(entry.ended(), Some(AbortReason::DownstreamReset));
    assert!(entry.cancel_token().is_cancelled());
}

#[tokio::test]
async fn proxy_refusals() {
    let (st, _clock) = state(|c| {
        c.max_inflight = 1;
        c.max_request_body = 100;
    });
    let app = proxy::app(st.clone());
    st.tombstone(RequestId::try_new(b"dead").unwrap(), AbortReason::Stalled);
    let (s, v) = call(
        app.clone(),
        Request::post("/v1/completions")
            .header("x-request-id", "dead")
            .body(Body::from("{}"))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(v["error"]["type"], "kvguard_aborted");
    assert_eq!(v["error"]["reason"], "stalled");
    let (s, v) = call(
        app.clone(),
        Request::post("/v1/completions")
            .header("content-length", "101")
            .body(Body::from(vec![b'x'; 101]))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(v["error"]["type"], "kvguard_body_too_large");
    // Engine unreachable: 502 with a clear body; nothing stays in flight.
    let (s, v) = call(
        app.clone(),
        Request::post("/v1/completions")
            .header("x-request-id", "r")
            .body(Body::from("{}"))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_GATEWAY);
    assert_eq!(v["error"]["type"], "kvguard_engine_unreachable");
    assert_eq!(st.inflight(), 0);
    // Table full: 503.
    let _held = st
        .admit(
            RequestId::try_new(b"held").unwrap(),
            "POST".into(),
            "/".into(),
        )
        .unwrap();
    let (s, v) = call(
        app.clone(),
        Request::post("/v1/completions")
            .body(Body::from("{}"))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(v["error"]["type"], "kvguard_overloaded");
    // Admin: healthz, readyz (the fake engine never answers), requests table.
    let admin = admin::app(st.clone());
    let r = admin
        .clone()
        .oneshot(Request::get("/healthz").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = admin
        .clone()
        .oneshot(Request::get("/readyz").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let (s, v) = call(
        admin.clone(),
        Request::get("/v1/requests").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["inflight"], 1);
    assert_eq!(v["requests"][0]["request_id"], "held");
    let r = admin
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/openmetrics-text"));
}

#[tokio::test]
async fn reaper_on_an_injected_clock() {
    let (st, clock) = state(|c| {
        c.limits.max_age = Some(Duration::from_secs(900));
        c.limits.idle_timeout = Some(Duration::from_secs(120));
        c.limits.first_token_timeout = Some(Duration::from_secs(30));
    });
    let id = |s: &str| RequestId::try_new(s.as_bytes()).unwrap();
    let queued = st.admit(id("queued"), "POST".into(), "/".into()).unwrap();
    let streaming = st
        .admit(id("streaming"), "POST".into(), "/".into())
        .unwrap();
    streaming.record_events(1, clock.now());
    clock.advance(Duration::from_secs(29));
    reaper::reap_once(&st);
    assert_eq!(queued.ended(), None);
    clock.advance(Duration::from_secs(1));
    reaper::reap_once(&st);
    assert_eq!(queued.ended(), Some(AbortReason::FirstTokenTimeout));
    assert_eq!(streaming.ended(), None);
    streaming.record_events(1, clock.now());
    clock.advance(Duration::from_secs(120));
    reaper::reap_once(&st);
    assert_eq!(streaming.ended(), Some(AbortReason::Stalled));
    // Ended ids are tombstoned: a late duplicate is refused.
    assert!(st
        .admit(id("streaming"), "POST".into(), "/".into())
        .is_err());
    let old = st.admit(id("old"), "POST".into(), "/".into()).unwrap();
    clock.advance(Duration::from_secs(899));
    old.record_events(1, clock.now());
    reaper::reap_once(&st);
    assert_eq!(old.ended(), None);
    clock.advance(Duration::from_secs(1));
    reaper::reap_once(&st);
    assert_eq!(old.ended(), Some(AbortReason::MaxAge));
}

#[tokio::test]
async fn dry_run_reaper_counts_once_and_ends_nothing() {
    let (st, clock) = state(|c| {
        c.dry_run = true;
        c.limits.first_token_timeout = Some(Duration::from_secs(1));
    });
    let e = st
        .admit(RequestId::try_new(b"q").unwrap(), "POST".into(), "/".into())
        .unwrap();
    clock.advance(Duration::from_secs(5));
    for _ in 0..3 {
        reaper::reap_once(&st);
    }
    assert_eq!(e.ended(), None);
    assert!(!e.cancel_token().is_cancelled());
    let text = kvguard_control::metrics::encode(&st.registry);
    assert!(
        text.contains(
            "kvguard_control_aborts_total{reason=\"first_token_timeout\",outcome=\"dry_run\"} 1"
        ),
        "{text}"
    );
}

fn snap(procs: &[(u32, u64)], used: u64) -> GpuSnapshot {
    GpuSnapshot {
        devices: vec![DeviceMemory {
            index: 0,
            name: "NVIDIA H200".into(),
            uuid: "GPU-abc".into(),
            total_bytes: 150_000,
            used_bytes: used,
            free_bytes: 150_000 - used,
            processes: procs
                .iter()
                .map(|&(pid, b)| ProcessMemory {
                    pid,
                    used_bytes: Some(b),
                })
                .collect(),
        }],
    }
}

#[tokio::test]
async fn nvml_logic_through_the_fake_probe_and_quiet_checkpoints() {
    let (st, _clock) = state(|_| {});
    let probe = FakeProbe::new(vec![
        Ok(snap(&[(10, 100), (11, 200)], 1000)),
        Ok(snap(&[(10, 150)], 1100)),
        Err("NVML: driver gone".into()),
    ]);
    sampler::record_gpu(&st, probe.sample());
    let text = kvguard_control::metrics::encode(&st.registry);
    assert!(text.contains("kvguard_control_nvml_available 1"));
    assert!(
        text.contains("kvguard_control_gpu_memory_used_bytes{gpu=\"0\",uuid=\"GPU-abc\"} 1000"),
        "{text}"
    );
    assert!(
        text.contains("kvguard_control_gpu_process_memory_used_bytes{gpu=\"0\",pid=\"11\"} 200")
    );
    sampler::record_gpu(&st, probe.sample());
    let text = kvguard_control::metrics::encode(&st.registry);
    assert!(!text.contains("pid=\"11\""), "an ended process disappears");
    assert!(
        text.contains("kvguard_control_gpu_process_memory_used_bytes{gpu=\"0\",pid=\"10\"} 150")
    );
    // Quiet checkpoint: nothing in flight, engine figures known.
    if let Ok(mut s) = st.engine_status.lock() {
        s.figures = Some(EngineFigures {
            kv_usage: Some(0.25),
            running: Some(3.0),
            waiting: Some(0.0),
            preemptions: None,
        });
        s.last_error = None;
    }
    let window = sampler::QuietWindow::open(&st);
    sampler::record_gpu(&st, Ok(snap(&[(10, 150)], 1100)));
    sampler::checkpoint(&st, &window);
    let text = kvguard_control::metrics::encode(&st.registry);
    assert!(
        text.contains("kvguard_control_quiet_kv_usage 0.25"),
        "{text}"
    );
    assert!(text.contains("kvguard_control_quiet_gpu_memory_bytes 1100"));
    assert!(text.contains(&format!(
        "kvguard_control_quiet_checkpoint_timestamp_seconds {NOW}"
    )));
    assert!(text.contains("kvguard_control_orphans 3"));
    // Not quiet: one in flight (default --quiet-max-inflight 0): no new checkpoint, orphans 2.
    let _e = st
        .admit(
            RequestId::try_new(b"busy").unwrap(),
            "POST".into(),
            "/".into(),
        )
        .unwrap();
    sampler::checkpoint(&st, &sampler::QuietWindow::open(&st));
    let text = kvguard_control::metrics::encode(&st.registry);
    assert!(text.contains("kvguard_control_quiet_checkpoints_total 1"));
    assert!(text.contains("kvguard_control_orphans 2"));
    // NVML fails: available 0, per-device series gone, /v1/gpu says why.
    sampler::record_gpu(&st, probe.sample());
    let text = kvguard_control::metrics::encode(&st.registry);
    assert!(text.contains("kvguard_control_nvml_available 0"));
    assert!(!text.contains("kvguard_control_gpu_memory_used_bytes{"));
    let (s, v) = call(
        admin::app(st.clone()),
        Request::get("/v1/gpu").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["nvml_available"], false);
    assert_eq!(v["unavailable_reason"], "NVML: driver gone");
}
