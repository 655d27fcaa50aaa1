//! Router-level tests with `tower::ServiceExt::oneshot` (no sockets): the abort API's
//! answers on an injected clock, refusals of the proxy, the reaper on an injected clock,
//! NVML logic through the fake probe, quiet checkpoints.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use kvguard_contract::{signature, AbortReason, Domain, Key, RequestId};
use kvguard_control::clock::Clock;
use kvguard_control::config::Config;
use kvguard_control::engine::{BoxFut, Engine};
use kvguard_control::expo::EngineFigures;
use kvguard_control::gpu::{DeviceMemory, GpuProbe, GpuSnapshot, GpuTracker, ProcessMemory};
use kvguard_control::lease::enforce;
use kvguard_control::state::AppState;
use kvguard_control::testing::{FakeEngine, FakeProbe, ManualClock};
use kvguard_control::{admin, proxy, reaper, sampler};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;

const KEY: &[u8] = b"kvguard-control-test-key-0123456789";
const NOW: u64 = 1_800_000_000;

/// `POST /` admitted as `id`.
fn admitted(st: &Arc<AppState>, id: &str) -> Arc<kvguard_control::table::Entry> {
    st.admit(
        RequestId::try_new(id.as_bytes()).unwrap(),
        "POST".into(),
        "/".into(),
    )
    .unwrap()
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
        abort_req(
            body,
            Some(signature::sign(Domain::Abort, &key, NOW - 31, body)),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(
        app.clone(),
        abort_req(
            body,
            Some(signature::sign(Domain::Abort, &key, NOW + 31, body)),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(app.clone(), abort_req(body, None)).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(app.clone(), abort_req(body, Some("t=1,v1=zz".into()))).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let sig = signature::sign(Domain::Abort, &key, NOW - 30, body);
    let (s, v) = call(app.clone(), abort_req(body, Some(sig.clone()))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v, json!({"request_id": "r1", "found": false}));
    // Replay of the same signature within the window.
    let (s, _) = call(app.clone(), abort_req(body, Some(sig))).await;
    assert_eq!(s, StatusCode::CONFLICT);
    // The tombstone answers already_aborted.
    let (s, v) = call(
        app.clone(),
        abort_req(
            body,
            Some(signature::sign(Domain::Abort, &key, NOW + 30, body)),
        ),
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
        abort_req(&big, Some(signature::sign(Domain::Abort, &key, NOW, &big))),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    // The tombstone expires after its TTL (60 s by default).
    clock.advance(Duration::from_secs(61));
    st.purge_tombstones();
    let t = NOW + 61;
    let (s, _) = call(
        app.clone(),
        abort_req(body, Some(signature::sign(Domain::Abort, &key, t, body))),
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
        abort_req(live, Some(signature::sign(Domain::Abort, &key, t, live))),
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

/// An engine whose scrape answers a settable text (or fails) and can be held until released.
#[derive(Default)]
struct ScriptedEngine {
    text: std::sync::Mutex<Option<String>>,
    hold: std::sync::Mutex<Option<Arc<tokio::sync::Semaphore>>>,
    entered: tokio::sync::Notify,
}

impl ScriptedEngine {
    fn answer(&self, text: Option<&str>) {
        *self.text.lock().unwrap() = text.map(str::to_owned);
    }
}

impl Engine for ScriptedEngine {
    fn scrape(&self) -> BoxFut<'_, Result<String, String>> {
        Box::pin(async move {
            let hold = self.hold.lock().unwrap().clone();
            if let Some(h) = hold {
                self.entered.notify_one();
                let _ = h.acquire().await.unwrap();
            }
            self.text
                .lock()
                .unwrap()
                .clone()
                .ok_or_else(|| "down".to_owned())
        })
    }
    fn health(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Err("down".into()) })
    }
    fn abort(&self, _id: RequestId) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

fn scripted_state() -> (Arc<AppState>, Arc<ScriptedEngine>) {
    let cfg = Config::for_tests("http://127.0.0.1:9", vec![Key::try_new(KEY).unwrap()]).unwrap();
    let engine = Arc::new(ScriptedEngine::default());
    let st = AppState::new(
        cfg,
        Arc::new(ManualClock::new(NOW)),
        engine.clone(),
        GpuTracker::unavailable("test".into()),
    );
    (st, engine)
}

fn series(st: &AppState, name: &str) -> Option<String> {
    let text = kvguard_control::metrics::encode(&st.registry);
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .map(|l| l[name.len() + 1..].to_owned())
}

const VLLM_1_RUNNING_1_WAITING: &str = "vllm:num_requests_running{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"0\"} 1\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n";

#[tokio::test]
async fn orphans_count_waiting_sequences_and_vanish_while_the_engine_is_unknown() {
    let (st, engine) = scripted_state();
    let mut window = sampler::QuietWindow::open(&st);
    // One request in flight through kvguard, queued in the engine; one running sequence
    // nobody holds: a leak, not hidden behind the queue.
    let _queued = st
        .admit(
            RequestId::try_new(b"queued").unwrap(),
            "POST".into(),
            "/".into(),
        )
        .unwrap();
    engine.answer(Some(VLLM_1_RUNNING_1_WAITING));
    sampler::sample_once(&st, &mut window).await;
    assert_eq!(
        series(&st, "kvguard_control_orphans").as_deref(),
        Some("1.0")
    );
    assert_eq!(
        series(&st, "kvguard_control_engine_up").as_deref(),
        Some("1")
    );
    // The engine stops answering: no stale or made-up figure, engine_up 0.
    engine.answer(None);
    sampler::sample_once(&st, &mut window).await;
    assert_eq!(series(&st, "kvguard_control_orphans"), None);
    assert_eq!(series(&st, "kvguard_control_engine_requests_running"), None);
    assert_eq!(series(&st, "kvguard_control_engine_kv_usage_ratio"), None);
    assert_eq!(
        series(&st, "kvguard_control_engine_up").as_deref(),
        Some("0")
    );
    engine.answer(Some(VLLM_1_RUNNING_1_WAITING));
    sampler::sample_once(&st, &mut window).await;
    assert_eq!(
        series(&st, "kvguard_control_orphans").as_deref(),
        Some("1.0")
    );
}

#[tokio::test]
async fn a_request_during_the_scrape_spoils_the_quiet_checkpoint() {
    let (st, engine) = scripted_state();
    engine.answer(Some(VLLM_1_RUNNING_1_WAITING));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    *engine.hold.lock().unwrap() = Some(gate.clone());
    let mut window = sampler::QuietWindow::open(&st);
    let st2 = st.clone();
    let sampling = tokio::spawn(async move {
        sampler::sample_once(&st2, &mut window).await;
        window
    });
    // While the engine is being scraped, a request is admitted and ends.
    engine.entered.notified().await;
    let e = st
        .admit(
            RequestId::try_new(b"brief").unwrap(),
            "POST".into(),
            "/".into(),
        )
        .unwrap();
    st.remove(&e);
    gate.add_permits(1);
    let mut window = sampling.await.unwrap();
    assert_eq!(
        series(&st, "kvguard_control_quiet_checkpoints_total").as_deref(),
        Some("0")
    );
    // A round with nothing admitted and nothing in flight is quiet.
    gate.add_permits(1);
    sampler::sample_once(&st, &mut window).await;
    assert_eq!(
        series(&st, "kvguard_control_quiet_checkpoints_total").as_deref(),
        Some("1")
    );
    assert_eq!(
        series(&st, "kvguard_control_quiet_kv_usage").as_deref(),
        Some("0.5")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_racing_its_request_ends_it_or_refuses_it_never_404_while_it_runs() {
    let (st, _clock) = state(|c| c.max_tombstones = 1_000_000);
    let mut bad = Vec::new();
    for i in 0..3000u32 {
        let id = RequestId::try_new(format!("race-{i}").as_bytes()).unwrap();
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let (st1, id1, b1) = (st.clone(), id.clone(), barrier.clone());
        let admit = tokio::task::spawn_blocking(move || {
            b1.wait();
            st1.admit(id1, "POST".into(), "/".into())
        });
        let (st2, id2, b2) = (st.clone(), id.clone(), barrier);
        let abort = tokio::task::spawn_blocking(move || {
            b2.wait();
            st2.abort_or_tombstone(&id2, AbortReason::DownstreamReset, None)
        });
        let (admitted, found) = (admit.await.unwrap(), abort.await.unwrap());
        if let (Ok(entry), kvguard_control::abort::AbortFound::NotFound) = (&admitted, found) {
            if entry.ended().is_none() {
                bad.push(i);
            }
        }
        if let Ok(e) = admitted {
            st.remove(&e);
        }
    }
    assert!(
        bad.is_empty(),
        "404 answered while the request runs: {} of 3000 races ({:?}...)",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}

#[tokio::test]
async fn a_full_replay_memory_refuses_new_calls_never_a_replay_and_refusals_are_logged_sparingly() {
    let (st, clock) = state(|c| c.max_replay_entries = 2);
    let key = Key::try_new(KEY).unwrap();
    let app = admin::app(st.clone());
    let signed = |i: u32, t: u64| {
        let body = format!(r#"{{"request_id":"e{i}","reason":"stalled","idle_ms":5,"gone_ms":7}}"#);
        let sig = signature::sign(Domain::Abort, &key, t, body.as_bytes());
        (body, sig)
    };
    let calls: Vec<_> = (0..3).map(|i| signed(i, NOW)).collect();
    for (body, sig) in &calls[..2] {
        let (s, _) = call(app.clone(), abort_req(body.as_bytes(), Some(sig.clone()))).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "idle_ms and gone_ms are accepted");
    }
    // Full of live signatures: a new call is refused 503 (retry), and a replay of the
    // first stays a replay (nothing was forgotten to make room).
    let (s, v) = call(
        app.clone(),
        abort_req(calls[2].0.as_bytes(), Some(calls[2].1.clone())),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    let (s, _) = call(
        app.clone(),
        abort_req(calls[0].0.as_bytes(), Some(calls[0].1.clone())),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(
        series(&st, "kvguard_control_replay_full_total").as_deref(),
        Some("1")
    );
    // Once the first signatures leave the window there is room again.
    clock.advance(Duration::from_secs(kvguard_contract::MAX_SKEW_SECS + 1));
    let (body, sig) = signed(3, NOW + kvguard_contract::MAX_SKEW_SECS + 1);
    let (s, _) = call(app.clone(), abort_req(body.as_bytes(), Some(sig))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let l = kvguard_control::refusal::LogLimiter::default();
    let period = Duration::from_secs(10);
    assert_eq!(l.admit(1_000, period), Some(0));
    for t in 1_001..1_100 {
        assert_eq!(l.admit(t, period), None);
    }
    assert_eq!(
        l.admit(11_000, period),
        Some(99),
        "the held-back lines are counted"
    );
}

/// A clock that runs a hook (once) the next time it is read: it lets a test put an event
/// exactly between two steps of a handler.
struct HookClock {
    inner: ManualClock,
    hook: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Clock for HookClock {
    fn now(&self) -> std::time::Instant {
        let hook = self.hook.lock().unwrap().take();
        if let Some(h) = hook {
            h();
        }
        self.inner.now()
    }
    fn unix_secs(&self) -> u64 {
        self.inner.unix_secs()
    }
}

#[tokio::test]
async fn an_abort_overtaken_by_its_request_mid_handler_ends_it() {
    let cfg = Config::for_tests("http://127.0.0.1:9", vec![Key::try_new(KEY).unwrap()]).unwrap();
    let clock = Arc::new(HookClock {
        inner: ManualClock::new(NOW),
        hook: std::sync::Mutex::new(None),
    });
    let st = AppState::new(
        cfg,
        clock.clone(),
        Arc::new(FakeEngine),
        GpuTracker::unavailable("test".into()),
    );
    let admitted = Arc::new(std::sync::Mutex::new(None));
    // The request is admitted the moment the abort handler first reads the clock after
    // verifying the signature: between its look-up and its tombstone, had they been apart.
    let (st2, slot) = (st.clone(), admitted.clone());
    let body = br#"{"request_id":"overtaken","reason":"downstream_reset"}"#;
    let sig = signature::sign(Domain::Abort, &Key::try_new(KEY).unwrap(), NOW, body);
    *clock.hook.lock().unwrap() = Some(Box::new(move || {
        let e = st2.admit(
            RequestId::try_new(b"overtaken").unwrap(),
            "POST".into(),
            "/".into(),
        );
        *slot.lock().unwrap() = Some(e);
    }));
    let (s, v) = call(admin::app(st.clone()), abort_req(body, Some(sig))).await;
    let entry = admitted
        .lock()
        .unwrap()
        .take()
        .expect("the hook ran")
        .expect("admitted");
    // Either it was ended (200 aborted) or it was refused; never 404 while it runs.
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["aborted"], true, "{v}");
    assert_eq!(entry.ended(), Some(AbortReason::DownstreamReset));
}

fn renewal_on(
    key: &[u8],
    t: u64,
    instance: kvguard_contract::InstanceId,
    counter: u64,
    via: kvguard_contract::Via,
) -> Request<Body> {
    let body = kvguard_contract::Renewal::new(instance, counter)
        .sent(via, true)
        .to_json();
    let sig = signature::sign(Domain::Renewal, &Key::try_new(key).unwrap(), t, &body);
    let path = match via {
        kvguard_contract::Via::Admin => kvguard_contract::LEASE_PATH,
        kvguard_contract::Via::Data => kvguard_contract::DATA_LEASE_PATH,
    };
    Request::post(path)
        .header(kvguard_contract::SIGNATURE_HEADER, sig)
        .body(Body::from(body))
        .unwrap()
}

fn renewal(
    key: &[u8],
    t: u64,
    instance: kvguard_contract::InstanceId,
    counter: u64,
) -> Request<Body> {
    renewal_on(key, t, instance, counter, kvguard_contract::Via::Admin)
}

/// Renews `instance` with `counter` on both paths: out of band on the admin listener, in
/// band on the proxy listener.
async fn renew_both(st: &Arc<AppState>, instance: kvguard_contract::InstanceId, counter: u64) {
    let (s, v) = call(admin::app(st.clone()), renewal(KEY, NOW, instance, counter)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let data = renewal_on(KEY, NOW, instance, counter, kvguard_contract::Via::Data);
    let (s, v) = call(kvguard_control::proxy::app(st.clone()), data).await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

async fn lease_metric(st: &Arc<AppState>, series: &str) -> f64 {
    let text = kvguard_control::metrics::encode(&st.registry);
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing"))
}

fn renewals_series(path: &str, result: &str) -> String {
    format!("kvguard_control_lease_renewals_total{{path=\"{path}\",result=\"{result}\"}}")
}

#[tokio::test]
async fn lease_renewals_forged_or_replayed_are_refused_and_counted_a_clock_step_is_not() {
    let (st, _clock) = state(|_| {});
    let a = kvguard_contract::InstanceId([7; 16]);
    // Signed an hour away from kvguard-control's clock: freshness is the counter's job.
    let (s, v) = call(admin::app(st.clone()), renewal(KEY, NOW - 3600, a, 1)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = call(admin::app(st.clone()), renewal(KEY, NOW, a, 1)).await;
    assert_eq!(
        (s, &v["duplicate"]),
        (StatusCode::OK, &serde_json::Value::Bool(true)),
        "same counter: a duplicate, no effect"
    );
    let (s, _) = call(
        admin::app(st.clone()),
        renewal(b"some-other-key-0123456789", NOW, a, 2),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "forged");
    let (s, _) = call(admin::app(st.clone()), renewal(KEY, NOW, a, 3)).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(admin::app(st.clone()), renewal(KEY, NOW, a, 2)).await;
    assert_eq!(s, StatusCode::CONFLICT, "a lower counter: a replay");
    let r = |res: &str| renewals_series("admin", res);
    assert_eq!(lease_metric(&st, &r("accepted")).await, 2.0);
    assert_eq!(lease_metric(&st, &r("duplicate")).await, 1.0);
    assert_eq!(lease_metric(&st, &r("replay")).await, 1.0);
    assert_eq!(lease_metric(&st, &r("unauthorized")).await, 1.0);
    assert_eq!(lease_metric(&st, "kvguard_control_leases").await, 1.0);
}

#[tokio::test]
async fn the_in_band_renewal_is_answered_by_kvguard_control_and_never_reaches_the_engine() {
    // The engine is port 9 (discard): a renewal proxied there would fail with 502.
    let (st, _clock) = state(|_| {});
    let a = kvguard_contract::InstanceId([4; 16]);
    let proxy = || kvguard_control::proxy::app(st.clone());
    for n in 1..=3 {
        let req = renewal_on(KEY, NOW, a, n, kvguard_contract::Via::Data);
        let (s, v) = call(proxy(), req).await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }
    assert_eq!(st.inflight(), 0, "never tracked");
    assert_eq!(
        lease_metric(&st, &renewals_series("data", "accepted")).await,
        3.0
    );
    assert_eq!(
        lease_metric(&st, "kvguard_control_leases_enforceable").await,
        1.0
    );
    // A renewal signed for the admin path is refused on the data path, and the reverse:
    // a renewal captured on one path cannot be passed off on the other.
    let mut wrong = renewal(KEY, NOW, a, 9);
    *wrong.uri_mut() = kvguard_contract::DATA_LEASE_PATH.parse().unwrap();
    let (s, v) = call(proxy(), wrong).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"]
        .as_str()
        .unwrap()
        .contains("signed for the admin path"));
    let mut wrong = renewal_on(KEY, NOW, a, 9, kvguard_contract::Via::Data);
    *wrong.uri_mut() = kvguard_contract::LEASE_PATH.parse().unwrap();
    let (s, _) = call(admin::app(st.clone()), wrong).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    // Unsigned: 401, counted on its path.
    let req = Request::post(kvguard_contract::DATA_LEASE_PATH)
        .body(Body::from(kvguard_contract::Renewal::new(a, 10).to_json()))
        .unwrap();
    let (s, _) = call(proxy(), req).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(
        lease_metric(&st, &renewals_series("data", "unauthorized")).await,
        1.0
    );
    // Lease mode off: 404 on both listeners.
    let (off, _) = state(|c| c.lease_mode = kvguard_control::lease::LeaseMode::Off);
    let req = renewal_on(KEY, NOW, a, 1, kvguard_contract::Via::Data);
    let (s, v) = call(kvguard_control::proxy::app(off.clone()), req).await;
    assert_eq!(
        (s, v["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("leases_off"))
    );
}

#[tokio::test]
async fn a_renewal_period_too_long_for_the_ttl_is_refused_naming_the_fix() {
    let (st, _clock) = state(|c| c.lease_ttl = Duration::from_secs(30));
    let a = kvguard_contract::InstanceId([4; 16]);
    let body = kvguard_contract::Renewal::new(a, 1)
        .from_host(kvguard_contract::HostKey([1; 16]), 10_001)
        .to_json();
    let sig = signature::sign(Domain::Renewal, &Key::try_new(KEY).unwrap(), NOW, &body);
    let req = Request::post(kvguard_contract::LEASE_PATH)
        .header(kvguard_contract::SIGNATURE_HEADER, sig)
        .body(Body::from(body))
        .unwrap();
    let (s, v) = call(admin::app(st.clone()), req).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let msg = v["message"].as_str().unwrap();
    assert!(msg.contains("lease_renew_ms to at most 10000"), "{msg}");
    assert_eq!(
        lease_metric(&st, &renewals_series("admin", "period_too_long")).await,
        1.0
    );
    assert_eq!(lease_metric(&st, "kvguard_control_leases").await, 0.0);
}

#[tokio::test]
async fn enforce_is_the_default_and_an_expired_lease_ends_only_its_instances_requests() {
    let (st, clock) = state(|c| c.lease_ttl = Duration::from_secs(30));
    assert_eq!(
        st.cfg.lease_mode,
        kvguard_control::lease::LeaseMode::Enforce,
        "the default"
    );
    let (a, b) = (
        kvguard_contract::InstanceId([1; 16]),
        kvguard_contract::InstanceId([2; 16]),
    );
    let id = |s: &str| RequestId::try_new(s.as_bytes()).unwrap();
    for n in 1..=3 {
        renew_both(&st, a, n).await;
        renew_both(&st, b, n).await;
    }
    let on_a = st.admit(id("on-a"), "POST".into(), "/".into()).unwrap();
    on_a.set_instance(a);
    let on_b = st.admit(id("on-b"), "POST".into(), "/".into()).unwrap();
    on_b.set_instance(b);
    let untagged = st.admit(id("untagged"), "POST".into(), "/".into()).unwrap();
    // Both silent past the TTL, nobody heard from since: held, nothing ended.
    clock.advance(Duration::from_secs(31));
    enforce::judge(&st);
    assert_eq!(on_a.ended(), None);
    assert_eq!(on_b.ended(), None);
    assert_eq!(
        lease_metric(&st, "kvguard_control_lease_held_expiries_total").await,
        2.0
    );
    // B renews (the paths are back); A's own renewal may be due up to a period later, so
    // nothing ends at B's. A still silent a period and a half (7.5 s) after: A alone
    // expires, its request alone ends.
    let (s, _) = call(admin::app(st.clone()), renewal(KEY, NOW, b, 4)).await;
    assert_eq!(s, StatusCode::OK);
    enforce::judge(&st);
    assert_eq!(on_a.ended(), None, "the first gateway back ends nobody");
    clock.advance(Duration::from_millis(7_500));
    let (s, _) = call(admin::app(st.clone()), renewal(KEY, NOW, b, 5)).await;
    assert_eq!(s, StatusCode::OK);
    enforce::judge(&st);
    assert_eq!(on_a.ended(), Some(AbortReason::GatewayLost));
    assert_eq!(on_b.ended(), None);
    assert_eq!(untagged.ended(), None);
    assert_eq!(
        lease_metric(
            &st,
            "kvguard_control_lease_requests_ended_total{mode=\"enforce\",why=\"silent\"}"
        )
        .await,
        1.0
    );
    // A replayed renewal of A (its counter was kept) cannot take its lease back.
    let (s, _) = call(admin::app(st.clone()), renewal(KEY, NOW, a, 3)).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert!(!st.leases.lock().unwrap().holds(&a));
}

#[tokio::test]
async fn a_gateway_whose_data_path_never_renewed_is_counted_not_ended() {
    let (st, clock) = state(|c| c.lease_ttl = Duration::from_secs(30));
    let a = kvguard_contract::InstanceId([3; 16]);
    for n in 1..=5 {
        let (s, _) = call(admin::app(st.clone()), renewal(KEY, NOW, a, n)).await;
        assert_eq!(s, StatusCode::OK);
    }
    let e = st
        .admit(RequestId::try_new(b"r").unwrap(), "POST".into(), "/".into())
        .unwrap();
    e.set_instance(a);
    clock.advance(Duration::from_secs(31));
    enforce::judge(&st);
    assert_eq!(
        e.ended(),
        None,
        "its hops never carried a renewal: not proof"
    );
    assert_eq!(
        lease_metric(
            &st,
            "kvguard_control_lease_requests_ended_total{mode=\"enforce\",why=\"unproven\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn observe_mode_lease_expiry_counts_and_ends_nothing() {
    let (st, clock) = state(|c| {
        c.lease_ttl = Duration::from_secs(30);
        c.lease_mode = kvguard_control::lease::LeaseMode::Observe;
    });
    let a = kvguard_contract::InstanceId([3; 16]);
    for n in 1..=3 {
        renew_both(&st, a, n).await;
    }
    let e = st
        .admit(RequestId::try_new(b"r").unwrap(), "POST".into(), "/".into())
        .unwrap();
    e.set_instance(a);
    clock.advance(Duration::from_secs(31));
    enforce::judge(&st);
    assert_eq!(e.ended(), None);
    assert_eq!(
        lease_metric(
            &st,
            "kvguard_control_lease_requests_ended_total{mode=\"observe\",why=\"silent\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn a_request_admitted_as_its_gateway_expires_takes_the_lease_back() {
    let (st, clock) = state(|c| c.lease_ttl = Duration::from_secs(30));
    let a = kvguard_contract::InstanceId([9; 16]);
    for n in 1..=3 {
        renew_both(&st, a, n).await;
    }
    let old = st
        .admit(
            RequestId::try_new(b"old").unwrap(),
            "POST".into(),
            "/".into(),
        )
        .unwrap();
    old.set_instance(a);
    clock.advance(Duration::from_secs(31));
    // Admitted at the judgement's instant (after the lease was judged, before the
    // entries were read): evidence of life.
    let new = st
        .admit(
            RequestId::try_new(b"new").unwrap(),
            "POST".into(),
            "/".into(),
        )
        .unwrap();
    new.set_instance(a);
    enforce::judge(&st);
    assert_eq!((old.ended(), new.ended()), (None, None));
    assert!(st.leases.lock().unwrap().holds(&a));
    assert_eq!(
        lease_metric(
            &st,
            "kvguard_control_lease_expiries_total{mode=\"enforce\",why=\"silent\"}"
        )
        .await,
        0.0
    );
}

#[tokio::test]
async fn a_stalled_lease_loop_is_counted_and_extends_every_lease_by_the_stall() {
    let (st, clock) = state(|c| c.lease_ttl = Duration::from_secs(2));
    let every = enforce::lease_tick(st.cfg.lease_ttl);
    let a = kvguard_contract::InstanceId([5; 16]);
    for n in 1..=3 {
        renew_both(&st, a, n).await;
    }
    let e = st
        .admit(RequestId::try_new(b"r").unwrap(), "POST".into(), "/".into())
        .unwrap();
    e.set_instance(a);
    // A gap within twice the period is no stall.
    assert_eq!(
        enforce::note_loop_gap(&st, every * 2, every),
        Duration::ZERO
    );
    // kvguard-control stalled 3 s (beyond the 2 s TTL): the renewals sent meanwhile could
    // not be read, so the lease is extended and the request keeps running.
    clock.advance(Duration::from_secs(3));
    let stalled = enforce::note_loop_gap(&st, Duration::from_secs(3), every);
    assert_eq!(stalled, Duration::from_secs(3) - every);
    enforce::judge(&st);
    assert_eq!(
        e.ended(),
        None,
        "expired by a stall of kvguard-control's own"
    );
    assert_eq!(
        lease_metric(&st, "kvguard_control_lease_loop_stalls_total").await,
        1.0
    );
    // Silent past the TTL after that: expired, its request ended.
    clock.advance(Duration::from_secs(3));
    enforce::judge(&st);
    assert_eq!(e.ended(), Some(AbortReason::GatewayLost));
}

/// Lets both clocks run at the loops' pace: the paused tokio clock (which drives their
/// intervals) by `step`, the injected clock by half of it (so a loop never sees a gap it
/// would take for a stall of its own), `n` times.
async fn run_clocks(clock: &ManualClock, step: Duration, n: u32) {
    for _ in 0..n {
        clock.advance(step / 2);
        tokio::time::sleep(step).await;
    }
}

#[tokio::test(start_paused = true)]
async fn the_reaper_loop_ends_an_overdue_request_on_its_own_until_stopped() {
    let (st, clock) = state(|c| c.limits.first_token_timeout = Some(Duration::from_secs(1)));
    let every = reaper::tick(&st.cfg.limits);
    let stop = tokio_util::sync::CancellationToken::new();
    reaper::spawn(st.clone(), stop.clone());
    let id = |s: &str| RequestId::try_new(s.as_bytes()).unwrap();
    let late = st.admit(id("late"), "POST".into(), "/".into()).unwrap();
    run_clocks(&clock, every, 12).await;
    assert_eq!(late.ended(), Some(AbortReason::FirstTokenTimeout));
    // Stopped: nothing more is reaped.
    stop.cancel();
    let after = st.admit(id("after"), "POST".into(), "/".into()).unwrap();
    run_clocks(&clock, every, 12).await;
    assert_eq!(after.ended(), None);
}

#[tokio::test(start_paused = true)]
async fn the_lease_loop_ends_a_silent_gateways_requests_on_its_own() {
    let (st, clock) = state(|c| c.lease_ttl = Duration::from_secs(2));
    let every = enforce::lease_tick(st.cfg.lease_ttl);
    let a = kvguard_contract::InstanceId([6; 16]);
    for n in 1..=3 {
        renew_both(&st, a, n).await;
    }
    let e = st
        .admit(RequestId::try_new(b"r").unwrap(), "POST".into(), "/".into())
        .unwrap();
    e.set_instance(a);
    let stop = tokio_util::sync::CancellationToken::new();
    enforce::spawn(st.clone(), stop.clone());
    // Within the TTL on the injected clock: kept.
    run_clocks(&clock, every, 12).await;
    assert_eq!(e.ended(), None, "1.5 s of silence is within the 2 s TTL");
    run_clocks(&clock, every, 12).await;
    assert_eq!(e.ended(), Some(AbortReason::GatewayLost));
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn with_lease_mode_off_no_lease_loop_runs() {
    let (st, clock) = state(|c| {
        c.lease_mode = kvguard_control::lease::LeaseMode::Off;
        c.lease_ttl = Duration::from_secs(2);
    });
    let every = enforce::lease_tick(st.cfg.lease_ttl);
    let a = kvguard_contract::InstanceId([8; 16]);
    let body = kvguard_contract::RenewalBody {
        instance: a,
        counter: 1,
        host: None,
        period_ms: None,
        via: kvguard_contract::Via::Data,
        fanout: true,
        vms: None,
    };
    for n in 1..=3 {
        let r = kvguard_contract::RenewalBody {
            counter: n,
            ..body.clone()
        };
        st.leases.lock().unwrap().renew(&r, clock.now()).unwrap();
    }
    let stop = tokio_util::sync::CancellationToken::new();
    enforce::spawn(st.clone(), stop.clone());
    run_clocks(&clock, every, 40).await;
    assert!(
        st.leases.lock().unwrap().holds(&a),
        "silent 5 s past a 2 s TTL, and never judged"
    );
    stop.cancel();
}

/// What the `tracing` events of `f` (run on this thread) print.
fn logs_of(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Buf(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let w = buf.clone();
    let sub = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || w.clone())
        .finish();
    tracing::subscriber::with_default(sub, f);
    let text = String::from_utf8_lossy(&buf.0.lock().unwrap()).into_owned();
    text
}

#[tokio::test]
async fn held_expiries_and_each_kind_of_expiry_are_logged_as_such() {
    let (st, clock) = state(|c| c.lease_ttl = Duration::from_secs(30));
    let (a, b) = (
        kvguard_contract::InstanceId([1; 16]),
        kvguard_contract::InstanceId([2; 16]),
    );
    for n in 1..=3 {
        renew_both(&st, a, n).await;
        renew_both(&st, b, n).await;
    }
    let held = "expiries held";
    let quiet = logs_of(|| enforce::judge(&st));
    assert!(!quiet.contains(held), "nothing silent: {quiet}");
    clock.advance(Duration::from_secs(31));
    let mass = logs_of(|| enforce::judge(&st));
    assert!(mass.contains(held), "both silent: {mass}");
    let (s, _) = call(admin::app(st.clone()), renewal(KEY, NOW, b, 4)).await;
    assert_eq!(s, StatusCode::OK);
    clock.advance(Duration::from_millis(7_500));
    let (s, _) = call(admin::app(st.clone()), renewal(KEY, NOW, b, 5)).await;
    assert_eq!(s, StatusCode::OK);
    let lone = logs_of(|| enforce::judge(&st));
    assert!(lone.contains("no renewal on either path"), "{lone}");
    assert!(!lone.contains(held), "A alone is silent: {lone}");
}

#[tokio::test]
async fn a_new_process_renewing_with_a_dead_ones_host_key_ends_its_requests_after_the_ttl() {
    let (st, clock) = state(|c| c.lease_ttl = Duration::from_secs(30));
    let host = kvguard_contract::HostKey([5; 16]);
    let renew = |i: kvguard_contract::InstanceId, n: u64| {
        let body = kvguard_contract::Renewal::new(i, n)
            .from_host(host, 5_000)
            .to_json();
        let sig = signature::sign(Domain::Renewal, &Key::try_new(KEY).unwrap(), NOW, &body);
        Request::post(kvguard_contract::LEASE_PATH)
            .header(kvguard_contract::SIGNATURE_HEADER, sig)
            .body(Body::from(body))
            .unwrap()
    };
    let (old, new) = (
        kvguard_contract::InstanceId([1; 16]),
        kvguard_contract::InstanceId([2; 16]),
    );
    let (s, _) = call(admin::app(st.clone()), renew(old, 1)).await;
    assert_eq!(s, StatusCode::OK);
    let e = st
        .admit(RequestId::try_new(b"r").unwrap(), "POST".into(), "/".into())
        .unwrap();
    e.set_instance(old);
    // The new process (started 3 s after the old one, by its counter) renews each period.
    for n in 1..=6 {
        clock.advance(Duration::from_secs(if n == 1 { 3 } else { 5 }));
        let (s, _) = call(admin::app(st.clone()), renew(new, n)).await;
        assert_eq!(s, StatusCode::OK);
    }
    clock.advance(Duration::from_secs(2));
    let logs = logs_of(|| enforce::judge(&st));
    assert_eq!(
        e.ended(),
        None,
        "30 s after its last renewal: the TTL, not more"
    );
    assert!(logs.is_empty(), "{logs}");
    clock.advance(Duration::from_millis(1));
    let logs = logs_of(|| enforce::judge(&st));
    assert_eq!(
        e.ended(),
        Some(AbortReason::GatewayLost),
        "no data-path renewal needed"
    );
    assert!(logs.contains("restarted in place"), "{logs}");
}

#[tokio::test]
async fn once_draining_no_request_is_admitted_and_those_in_flight_run_on() {
    let (st, _clock) = state(|_| {});
    let id = |s: &str| RequestId::try_new(s.as_bytes()).unwrap();
    let before = st.admit(id("before"), "POST".into(), "/".into()).unwrap();
    assert!(!st.is_draining());
    st.start_draining();
    assert!(st.is_draining());
    assert_eq!(
        st.admit(id("after"), "POST".into(), "/".into())
            .unwrap_err(),
        kvguard_control::state::Refusal::Draining
    );
    assert_eq!(before.ended(), None);
    assert_eq!(st.inflight(), 1);
}

#[tokio::test]
async fn a_retry_with_the_same_id_ends_the_older_attempt_and_tombstones_nothing() {
    let (st, _clock) = state(|_| {});
    let id = RequestId::try_new(b"retried").unwrap();
    let first = st.admit(id.clone(), "POST".into(), "/".into()).unwrap();
    let retry = st.admit(id.clone(), "POST".into(), "/".into()).unwrap();
    assert_eq!(first.ended(), Some(AbortReason::Timeout));
    assert!(first.cancel_token().is_cancelled(), "its stream is ended");
    assert_eq!(retry.ended(), None);
    assert!(!retry.cancel_token().is_cancelled());
    assert_eq!(st.inflight(), 1);
    assert_eq!(
        series(&st, "kvguard_control_superseded_total").as_deref(),
        Some("1")
    );
    // The older attempt's response ending leaves the retry in flight.
    st.remove(&first);
    assert_eq!(st.inflight(), 1, "the retry is still in flight");
    // The id belongs to the retry: not tombstoned, so the next attempt is admitted too.
    st.remove(&retry);
    assert!(st.admit(id, "POST".into(), "/".into()).is_ok());
}

#[tokio::test]
async fn a_dry_run_counts_a_superseded_attempt_and_ends_nothing() {
    let (st, _clock) = state(|c| c.dry_run = true);
    let id = RequestId::try_new(b"retried").unwrap();
    let first = st.admit(id.clone(), "POST".into(), "/".into()).unwrap();
    let retry = st.admit(id, "POST".into(), "/".into()).unwrap();
    assert_eq!(first.ended(), None);
    assert!(!first.cancel_token().is_cancelled());
    assert_eq!(retry.ended(), None);
    assert_eq!(
        series(&st, "kvguard_control_superseded_total").as_deref(),
        Some("1")
    );
}

#[tokio::test]
async fn the_state_debugs_as_its_name_alone_never_its_keys() {
    let (st, _clock) = state(|_| {});
    assert_eq!(format!("{st:?}"), "AppState { .. }");
}

#[tokio::test]
async fn the_engine_is_ready_while_its_last_answer_is_within_three_sample_intervals() {
    let (st, clock) = state(|c| c.sample_interval = Duration::from_secs(2));
    assert!(!st.engine_ready(), "never answered");
    st.engine_status.lock().unwrap().last_ok = Some(clock.now());
    assert!(st.engine_ready());
    clock.advance(Duration::from_secs(6));
    assert!(st.engine_ready(), "three intervals after its answer");
    clock.advance(Duration::from_millis(1));
    assert!(!st.engine_ready());
    st.engine_status.lock().unwrap().last_ok = Some(clock.now());
    st.engine_status.lock().unwrap().last_error = Some("refused".into());
    assert!(!st.engine_ready(), "its last attempt failed");
}

#[tokio::test]
async fn a_short_sample_interval_still_gives_the_engine_a_second() {
    let (st, clock) = state(|c| c.sample_interval = Duration::from_millis(100));
    st.engine_status.lock().unwrap().last_ok = Some(clock.now());
    clock.advance(Duration::from_secs(1));
    assert!(st.engine_ready());
    clock.advance(Duration::from_millis(1));
    assert!(!st.engine_ready());
}

#[tokio::test]
async fn tombstones_beyond_the_bound_evict_the_oldest_and_each_eviction_is_counted() {
    let (st, _clock) = state(|c| c.max_tombstones = 2);
    for s in ["a", "b", "c", "d"] {
        st.tombstone(
            RequestId::try_new(s.as_bytes()).unwrap(),
            AbortReason::Operator,
        );
    }
    assert_eq!(
        series(&st, "kvguard_control_tombstones_evicted_total").as_deref(),
        Some("2")
    );
    assert_eq!(
        series(&st, "kvguard_control_tombstones").as_deref(),
        Some("2")
    );
    // The abort API's tombstones, of an id not in flight and of one it ends, count theirs.
    let missing = RequestId::try_new(b"e").unwrap();
    assert_eq!(
        st.abort_or_tombstone(&missing, AbortReason::Operator, None),
        kvguard_control::abort::AbortFound::NotFound
    );
    admitted(&st, "f");
    let ended = RequestId::try_new(b"f").unwrap();
    assert_eq!(
        st.abort_or_tombstone(&ended, AbortReason::Operator, None),
        kvguard_control::abort::AbortFound::Ended
    );
    assert_eq!(
        series(&st, "kvguard_control_tombstones_evicted_total").as_deref(),
        Some("4")
    );
}

#[tokio::test]
async fn expired_tombstones_are_purged_and_no_longer_counted() {
    let (st, clock) = state(|c| c.tombstone_ttl = Duration::from_secs(60));
    let id = RequestId::try_new(b"a").unwrap();
    st.tombstone(id.clone(), AbortReason::Operator);
    assert_eq!(
        series(&st, "kvguard_control_tombstones").as_deref(),
        Some("1")
    );
    clock.advance(Duration::from_secs(61));
    st.purge_tombstones();
    assert_eq!(
        series(&st, "kvguard_control_tombstones").as_deref(),
        Some("0")
    );
    assert!(st.admit(id, "POST".into(), "/".into()).is_ok());
}

#[tokio::test]
async fn a_dry_run_logs_the_age_of_the_request_it_would_end() {
    let (st, clock) = state(|c| {
        c.dry_run = true;
        c.limits.first_token_timeout = Some(Duration::from_secs(1));
    });
    st.admit(RequestId::try_new(b"q").unwrap(), "POST".into(), "/".into())
        .unwrap();
    clock.advance(Duration::from_millis(5250));
    let logs = logs_of(|| reaper::reap_once(&st));
    assert!(logs.contains("age_ms=5250"), "{logs}");
}

#[tokio::test]
async fn ending_a_request_whose_client_had_gone_counts_the_orphans_cost() {
    use kvguard_control::scan::BodyKind;
    let (st, clock) = state(|_| {});
    let id = RequestId::try_new(b"orphan").unwrap();
    let e = st.admit(id.clone(), "POST".into(), "/".into()).unwrap();
    e.record_response(200, BodyKind::Sse, clock.now());
    e.record_events(3, clock.now());
    clock.advance(Duration::from_secs(2));
    e.record_events(4, clock.now());
    // The sender saw the client go 2 s ago, having passed on the first 3 events.
    assert_eq!(
        st.abort_or_tombstone(
            &id,
            AbortReason::DownstreamReset,
            Some((Duration::from_secs(2), 3))
        ),
        kvguard_control::abort::AbortFound::Ended
    );
    let l = "{reason=\"downstream_reset\"}";
    assert_eq!(
        lease_metric(&st, &format!("kvguard_control_orphan_ends_total{l}")).await,
        1.0
    );
    assert_eq!(
        lease_metric(&st, &format!("kvguard_control_orphan_seconds_total{l}")).await,
        2.0
    );
    assert_eq!(
        lease_metric(&st, &format!("kvguard_control_wasted_tokens_total{l}")).await,
        4.0
    );
}

#[tokio::test(start_paused = true)]
async fn an_ended_request_whose_client_stops_reading_is_cut_after_the_flush_timeout() {
    use kvguard_control::downstream::{Downstream, Scope};
    let (st, _clock) = state(|c| c.abort_flush_timeout = Duration::from_secs(5));
    let id = |s: &str| RequestId::try_new(s.as_bytes()).unwrap();
    let mut tasks = Vec::new();
    let mut entries = Vec::new();
    for s in ["reading", "stuck"] {
        let e = st.admit(id(s), "POST".into(), "/".into()).unwrap();
        let d = Downstream::new(Scope::H2Stream);
        e.set_downstream(d.clone());
        tasks.push(tokio::spawn(d.run(std::future::pending::<()>())));
        assert!(st.end_request(&e, AbortReason::Operator, "reaper"));
        entries.push(e);
    }
    // One client takes its end: its response is gone.
    entries[0].finish();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(!tasks[1].is_finished(), "within the flush timeout");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(tasks[1].is_finished(), "cut: it never took its end");
    assert!(
        !tasks[0].is_finished(),
        "a client that read its end is never cut"
    );
    assert_eq!(
        series(
            &st,
            "kvguard_control_downstream_cuts_total{scope=\"h2_stream\"}"
        )
        .as_deref(),
        Some("1")
    );
}

#[tokio::test]
async fn replaced_keys_take_effect_on_the_next_abort_call() {
    let (st, _clock) = state(|_| {});
    let new = Key::try_new(b"the-rotated-key-0123456789-abcdef").unwrap();
    let keys = kvguard_control::state::KeySet {
        accept: vec![new.clone()],
        stamp: None,
    };
    st.set_keys(keys.clone());
    assert_eq!(*st.keys(), keys);
    let body = br#"{"request_id":"k","reason":"operator"}"#;
    let old_sig = signature::sign(Domain::Abort, &Key::try_new(KEY).unwrap(), NOW, body);
    let (s, _) = call(admin::app(st.clone()), abort_req(body, Some(old_sig))).await;
    assert_eq!(
        s,
        StatusCode::UNAUTHORIZED,
        "the old key is no longer accepted"
    );
    let new_sig = signature::sign(Domain::Abort, &new, NOW, body);
    let (s, _) = call(admin::app(st.clone()), abort_req(body, Some(new_sig))).await;
    assert_eq!(
        s,
        StatusCode::NOT_FOUND,
        "signed with the new key: accepted"
    );
}

#[tokio::test]
async fn a_connection_beyond_the_admin_bound_serves_health_probes_and_refuses_the_rest() {
    let (st, _) = state(|_| {});
    let app = admin::probe_app(st);
    let get = |p: &str| Request::get(p).body(Body::empty()).unwrap();
    let r = app.clone().oneshot(get("/healthz")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    // The fake engine never answered: not ready, but answered.
    let (s, _) = call(app.clone(), get("/readyz")).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let r = app.clone().oneshot(abort_req(b"{}", None)).await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers()["retry-after"], "1");
    let (_, v) = call(app, get("/metrics")).await;
    assert_eq!(v["error"], "busy");
}

#[tokio::test]
async fn a_stalled_reaper_is_counted_and_credits_the_stall_to_every_stream() {
    let (st, clock) = state(|c| c.limits.idle_timeout = Some(Duration::from_secs(2)));
    let every = reaper::tick(&st.cfg.limits);
    let e = st
        .admit(RequestId::try_new(b"r").unwrap(), "POST".into(), "/".into())
        .unwrap();
    e.record_events(1, clock.now());
    // A gap within twice the period is no stall.
    assert_eq!(
        reaper::note_reaper_gap(&st, every * 2, every),
        Duration::ZERO
    );
    // kvguard-control stalled 3 s (beyond the 2 s idle timeout): what the engine sent
    // meanwhile is not recorded yet, so the stream keeps running.
    clock.advance(Duration::from_secs(3));
    let stalled = reaper::note_reaper_gap(&st, Duration::from_secs(3), every);
    assert_eq!(stalled, Duration::from_secs(3) - every);
    reaper::reap_once(&st);
    assert_eq!(e.ended(), None, "ended by a stall of kvguard-control's own");
    assert_eq!(
        lease_metric(&st, "kvguard_control_reaper_stalls_total").await,
        1.0
    );
    // Silent past the idle timeout after that: ended.
    clock.advance(Duration::from_secs(2));
    reaper::reap_once(&st);
    assert_eq!(e.ended(), Some(AbortReason::Stalled));
}

#[tokio::test]
async fn a_dry_run_tombstones_nothing_and_keeps_a_superseded_attempt_in_flight() {
    let (st, _clock) = state(|c| c.dry_run = true);
    let id = RequestId::try_new(b"early").unwrap();
    // An abort that overtakes its request: counted and logged, no tombstone.
    assert_eq!(
        st.abort_or_tombstone(&id, AbortReason::DownstreamReset, None),
        kvguard_control::abort::AbortFound::NotFound
    );
    assert!(st.inner().tombstones() == 0);
    let first = st.admit(id.clone(), "POST".into(), "/".into()).unwrap();
    // A retry with the same id: the older attempt stays in flight, seen by the reaper.
    let retry = st.admit(id.clone(), "POST".into(), "/".into()).unwrap();
    assert_eq!(st.inflight(), 2);
    let seqs: Vec<u64> = st.entries().iter().map(|e| e.seq).collect();
    assert!(
        seqs.contains(&first.seq) && seqs.contains(&retry.seq),
        "{seqs:?}"
    );
    assert_eq!(
        series(&st, "kvguard_control_inflight").as_deref(),
        Some("2")
    );
    // Each leaves when its own response ends.
    assert!(!st.inner().is_empty());
    st.remove(&retry);
    assert_eq!(
        st.inflight(),
        1,
        "the superseded attempt is still in flight"
    );
    assert!(!st.inner().is_empty());
    assert_eq!(st.entries()[0].seq, first.seq);
    st.remove(&first);
    assert_eq!(st.inflight(), 0);
    assert!(st.inner().is_empty());
    assert_eq!(
        series(&st, "kvguard_control_inflight").as_deref(),
        Some("0")
    );
}

#[tokio::test]
async fn a_dry_run_keeps_superseded_attempts_within_max_inflight() {
    let (st, _clock) = state(|c| {
        c.dry_run = true;
        c.max_inflight = 2;
    });
    let id = RequestId::try_new(b"r").unwrap();
    st.admit(id.clone(), "POST".into(), "/".into()).unwrap();
    st.admit(id.clone(), "POST".into(), "/".into()).unwrap();
    assert!(matches!(
        st.admit(id, "POST".into(), "/".into()),
        Err(kvguard_control::state::Refusal::Full(2))
    ));
    // Enforce mode: a retry replaces its attempt, the table does not grow.
    let (st, _clock) = state(|c| c.max_inflight = 1);
    let id = RequestId::try_new(b"r").unwrap();
    st.admit(id.clone(), "POST".into(), "/".into()).unwrap();
    assert!(st.admit(id, "POST".into(), "/".into()).is_ok());
    assert!(st
        .admit(RequestId::try_new(b"s").unwrap(), "POST".into(), "/".into())
        .is_err());
}

#[tokio::test]
async fn the_in_flight_ids_are_listed_only_with_list_requests() {
    let (st, _) = state(|c| c.list_requests = false);
    st.admit(
        RequestId::try_new(b"secret-id").unwrap(),
        "POST".into(),
        "/".into(),
    )
    .unwrap();
    let (s, v) = call(
        admin::app(st),
        Request::get("/v1/requests").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["error"], "off");
    assert!(!v.to_string().contains("secret-id"));
}

/// vLLM counts each choice of an `n > 1` request (and each prompt of a batch) as a
/// sequence: a healthy `n = 4` request reads 0 orphans, the same four sequences left
/// running after the request ended read 4.
#[tokio::test]
async fn orphans_count_engine_sequences_per_tracked_request() {
    let (st, engine) = scripted_state();
    let mut window = sampler::QuietWindow::open(&st);
    let four = st
        .admit(
            RequestId::try_new(b"n4").unwrap(),
            "POST".into(),
            "/".into(),
        )
        .unwrap();
    four.set_sequences(4);
    assert_eq!(st.inflight_sequences(), 4);
    engine.answer(Some(
        "vllm:num_requests_running{engine=\"0\"} 4\nvllm:num_requests_waiting{engine=\"0\"} 0\n",
    ));
    sampler::sample_once(&st, &mut window).await;
    assert_eq!(
        series(&st, "kvguard_control_orphans").as_deref(),
        Some("0.0")
    );
    st.remove(&four);
    sampler::sample_once(&st, &mut window).await;
    assert_eq!(
        series(&st, "kvguard_control_orphans").as_deref(),
        Some("4.0")
    );
}

/// `body` forwarded by peer `from` (each envelope its own signature).
fn envelope(body: &[u8], from: &str) -> Request<Body> {
    let env = kvguard_contract::Forwarded::new(from, body)
        .unwrap()
        .to_json();
    let sig = signature::sign(Domain::Envelope, &Key::try_new(KEY).unwrap(), NOW, &env);
    Request::post(kvguard_contract::PEER_LEASE_PATH)
        .header(kvguard_contract::SIGNATURE_HEADER, sig)
        .body(Body::from(env))
        .unwrap()
}

#[tokio::test]
async fn a_renewal_forwarded_by_a_peer_is_taken_once_and_counted_by_its_result() {
    let (st, _clock) = state(|_| {});
    let a = kvguard_contract::InstanceId([2; 16]);
    let data = kvguard_contract::Renewal::new(a, 1)
        .sent(kvguard_contract::Via::Data, true)
        .to_json();
    let series =
        |r: &str| format!("kvguard_control_peer_received_total{{kind=\"renewal\",result=\"{r}\"}}");
    let (s, v) = call(admin::app(st.clone()), envelope(&data, "10.0.0.8:9902")).await;
    assert_eq!((s, &v["duplicate"]), (StatusCode::OK, &json!(false)), "{v}");
    assert!(st.leases.lock().unwrap().holds(&a));
    assert_eq!(lease_metric(&st, &series("accepted")).await, 1.0);
    let text = kvguard_control::metrics::encode(&st.registry);
    assert!(!text.contains(&series("duplicate")), "{text}");
    let (s, v) = call(admin::app(st.clone()), envelope(&data, "10.0.0.9:9902")).await;
    assert_eq!((s, &v["duplicate"]), (StatusCode::OK, &json!(true)), "{v}");
    let series =
        |r: &str| format!("kvguard_control_peer_received_total{{kind=\"renewal\",result=\"{r}\"}}");
    assert_eq!(lease_metric(&st, &series("accepted")).await, 1.0);
    assert_eq!(lease_metric(&st, &series("duplicate")).await, 1.0);
    // A forwarded renewal is never counted as the gateway's own.
    assert_eq!(
        lease_metric(&st, &renewals_series("data", "accepted")).await,
        0.0
    );
    // A stale counter is refused, counted as neither.
    let old = kvguard_contract::Renewal::new(a, 0)
        .sent(kvguard_contract::Via::Data, true)
        .to_json();
    let (s, _) = call(admin::app(st.clone()), envelope(&old, "10.0.0.8:9902")).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(lease_metric(&st, &series("accepted")).await, 1.0);
    // Lease mode off: 404.
    let (off, _) = state(|c| c.lease_mode = kvguard_control::lease::LeaseMode::Off);
    let (s, v) = call(admin::app(off), envelope(&data, "10.0.0.8:9902")).await;
    assert_eq!(
        (s, v["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("leases_off"))
    );
}

/// A peer that records the renewals forwarded to it.
async fn recording_peer() -> (std::net::SocketAddr, Arc<std::sync::Mutex<Vec<Vec<u8>>>>) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let app = axum::Router::new().route(
        kvguard_contract::PEER_LEASE_PATH,
        axum::routing::post(move |body: axum::body::Bytes| {
            let s2 = s2.clone();
            async move {
                s2.lock().unwrap().push(body.to_vec());
                "{}"
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, seen)
}

#[tokio::test]
async fn only_a_new_renewal_that_asks_for_it_is_forwarded_to_the_peers() {
    let (peer, seen) = recording_peer().await;
    let (st, _clock) = state(|c| {
        c.peers = Some(kvguard_control::config::PeerConfig {
            urls: vec![kvguard_control::config::parse_peer_url(&format!("http://{peer}")).unwrap()],
            self_addr: "127.0.0.1:1".parse().unwrap(),
        });
    });
    let a = kvguard_contract::InstanceId([3; 16]);
    let send = |counter: u64, via: kvguard_contract::Via, fanout: bool| {
        let body = kvguard_contract::Renewal::new(a, counter)
            .sent(via, fanout)
            .to_json();
        let sig = signature::sign(Domain::Renewal, &Key::try_new(KEY).unwrap(), NOW, &body);
        let path = match via {
            kvguard_contract::Via::Admin => kvguard_contract::LEASE_PATH,
            kvguard_contract::Via::Data => kvguard_contract::DATA_LEASE_PATH,
        };
        (
            Request::post(path)
                .header(kvguard_contract::SIGNATURE_HEADER, sig)
                .body(Body::from(body.clone()))
                .unwrap(),
            body,
        )
    };
    // Sent to this replica directly (fanout false): not forwarded.
    let (req, _) = send(1, kvguard_contract::Via::Admin, false);
    assert_eq!(call(admin::app(st.clone()), req).await.0, StatusCode::OK);
    // In band, to be forwarded: forwarded once, as it is.
    let (req, body) = send(1, kvguard_contract::Via::Data, true);
    assert_eq!(call(proxy::app(st.clone()), req).await.0, StatusCode::OK);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while seen.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        seen.lock().unwrap().len(),
        1,
        "the accepted renewal forwarded"
    );
    // The same again (a duplicate): not forwarded.
    let (req, _) = send(1, kvguard_contract::Via::Data, true);
    assert_eq!(call(proxy::app(st.clone()), req).await.0, StatusCode::OK);
    // Refused (a replay): not forwarded.
    let (req, _) = send(0, kvguard_contract::Via::Admin, true);
    assert_eq!(
        call(admin::app(st.clone()), req).await.0,
        StatusCode::CONFLICT
    );
    // Nothing else arrives (a forward is dispatched before the answer; 200 ms is margin).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let got = seen.lock().unwrap().clone();
    assert_eq!(got.len(), 1, "{got:?}");
    let env = kvguard_contract::Forwarded::parse(&got[0]).unwrap();
    assert_eq!(env.body.as_bytes(), &body[..]);
}

/// The header a signer before the domain prefixes sent: `t` and the unprefixed `v1` only.
fn v1_only(header: &str) -> String {
    header.split(",v2=").next().unwrap().to_owned()
}

#[tokio::test]
async fn each_signed_call_takes_only_its_own_kind_and_a_sender_before_the_prefixes_is_named() {
    let (st, _clock) = state(|_| {});
    let key = Key::try_new(KEY).unwrap();
    let post = |path: &'static str, body: &[u8], sig: String| {
        Request::post(path)
            .header(kvguard_contract::SIGNATURE_HEADER, sig)
            .body(Body::from(body.to_vec()))
            .unwrap()
    };
    let abort = br#"{"request_id":"kinds","reason":"operator"}"#.to_vec();
    let instance = kvguard_contract::InstanceId([4; 16]);
    let renewal = kvguard_contract::Renewal::new(instance, 1).to_json();
    let env = kvguard_contract::Forwarded::new("10.0.0.8:9902", &renewal)
        .unwrap()
        .to_json();
    let calls = [
        (kvguard_contract::ABORT_PATH, &abort, Domain::Abort),
        (kvguard_contract::LEASE_PATH, &renewal, Domain::Renewal),
        (kvguard_contract::PEER_LEASE_PATH, &env, Domain::Envelope),
    ];
    let mut t = NOW - 20;
    for (path, body, own) in calls {
        for signed in [Domain::Abort, Domain::Renewal, Domain::Envelope] {
            if signed == own {
                continue;
            }
            t += 1;
            let sig = signature::sign(signed, &key, t, body);
            let (s, v) = call(admin::app(st.clone()), post(path, body, sig)).await;
            assert_eq!(
                s,
                StatusCode::UNAUTHORIZED,
                "{path} signed as {signed:?}: {v}"
            );
        }
        t += 1;
        let old = v1_only(&signature::sign(own, &key, t, body));
        let (s, v) = call(admin::app(st.clone()), post(path, body, old)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{path} with v1 only: {v}");
        assert!(
            v["message"].as_str().unwrap().contains("v1 and no v2"),
            "{v}"
        );
        t += 1;
        let own_sig = signature::sign(own, &key, t, body);
        let (s, v) = call(admin::app(st.clone()), post(path, body, own_sig)).await;
        assert_ne!(
            s,
            StatusCode::UNAUTHORIZED,
            "{path} signed as its own kind: {v}"
        );
    }
    for (series, unauthorized) in [
        ("kvguard_control_abort_api_answers_total{result=\"", 2.0),
        (
            "kvguard_control_lease_renewals_total{path=\"admin\",result=\"",
            2.0,
        ),
        (
            "kvguard_control_peer_received_total{kind=\"renewal\",result=\"",
            2.0,
        ),
    ] {
        let s = |r: &str| format!("{series}{r}\"}}");
        assert_eq!(
            lease_metric(&st, &s("unauthorized")).await,
            unauthorized,
            "{series}"
        );
        assert_eq!(lease_metric(&st, &s("outdated")).await, 1.0, "{series}");
    }
}

/// A peer that holds every id it is forwarded an abort for (answers 200 `aborted`).
async fn holding_peer() -> std::net::SocketAddr {
    let app = axum::Router::new().route(
        kvguard_contract::PEER_ABORT_PATH,
        axum::routing::post(|| async {
            axum::Json(json!({"request_id": "held", "found": true, "aborted": true}))
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

#[tokio::test]
async fn an_abort_a_peer_answers_is_passed_on_and_tombstoned_here_but_not_in_a_dry_run() {
    let peer = holding_peer().await;
    for dry_run in [false, true] {
        let (st, _clock) = state(|c| {
            c.dry_run = dry_run;
            c.peers = Some(kvguard_control::config::PeerConfig {
                urls: vec![
                    kvguard_control::config::parse_peer_url(&format!("http://{peer}")).unwrap(),
                ],
                self_addr: "127.0.0.1:1".parse().unwrap(),
            });
        });
        let body = br#"{"request_id":"held","reason":"downstream_reset"}"#;
        let sig = signature::sign(Domain::Abort, &Key::try_new(KEY).unwrap(), NOW, body);
        let (s, v) = call(admin::app(st.clone()), abort_req(body, Some(sig))).await;
        assert_eq!((s, &v["aborted"]), (StatusCode::OK, &json!(true)), "{v}");
        assert_eq!(
            lease_metric(
                &st,
                "kvguard_control_abort_api_answers_total{result=\"forwarded\"}"
            )
            .await,
            1.0
        );
        // A later attempt with the id is refused here too, unless this is a dry run
        // (which refuses nothing).
        assert_eq!(st.inner().tombstones() == 0, dry_run, "dry run {dry_run}");
    }
}

/// A peer that holds the stream and defers every abort it is forwarded (its reader drains).
async fn deferring_peer() -> std::net::SocketAddr {
    let app = axum::Router::new().route(
        kvguard_contract::PEER_ABORT_PATH,
        axum::routing::post(|| async {
            axum::Json(json!({"request_id": "slow", "found": true, "deferred": true}))
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// A peer that answers every forwarded abort with `status`.
async fn peer_answering(status: StatusCode) -> std::net::SocketAddr {
    let app = axum::Router::new().route(
        kvguard_contract::PEER_ABORT_PATH,
        axum::routing::post(move || async move { status }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// An address nothing listens on (bound, then closed): a peer that does not answer.
async fn silent_peer() -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

fn peers_at(peers: &[std::net::SocketAddr]) -> kvguard_control::config::PeerConfig {
    kvguard_control::config::PeerConfig {
        urls: peers
            .iter()
            .map(|p| kvguard_control::config::parse_peer_url(&format!("http://{p}")).unwrap())
            .collect(),
        self_addr: "127.0.0.1:1".parse().unwrap(),
    }
}

/// An abort nobody was found holding while a peer did not answer (a partition, a peer
/// restarting) is answered 503, so that its sender asks again: the silent peer may hold
/// it, and a 404 would have the gateway cut a stall ask's reader, or give up on a gone
/// client's engine. Nothing is tombstoned meanwhile (the retry must reach the peers
/// again); counted `peer_unanswered`. With every peer answering 404, the
/// disconnect's abort is answered 404 (and the stall ask deferred: held nowhere).
#[tokio::test]
async fn an_abort_nobody_was_found_holding_asks_again_while_a_peer_did_not_answer() {
    let (silent, not_here) = (
        silent_peer().await,
        peer_answering(StatusCode::NOT_FOUND).await,
    );
    let reader = Duration::from_secs(90);
    for (peers, want) in [
        (vec![silent, not_here], StatusCode::SERVICE_UNAVAILABLE),
        (vec![not_here], StatusCode::NOT_FOUND),
    ] {
        // Held nowhere, a stall ask is deferred on its sender's silence instead.
        let want_ask = if want == StatusCode::NOT_FOUND {
            StatusCode::OK
        } else {
            want
        };
        let (st, clock) = state(|c| {
            c.limits.reader_timeout = Some(reader);
            c.peers = Some(peers_at(&peers));
        });
        let app = admin::app(st.clone());
        let key = Key::try_new(KEY).unwrap();
        let ask = br#"{"request_id":"slow","reason":"stalled","age_ms":70000,"idle_ms":61000,"recheck_ms":3000}"#;
        let sig = signature::sign(Domain::Abort, &key, clock.unix_secs(), ask);
        let (s, v) = call(app.clone(), abort_req(ask, Some(sig))).await;
        assert_eq!(s, want_ask, "{peers:?}: {v}");
        assert_eq!(st.inner().tombstones(), 0, "a stall ask tombstones nothing");
        let (s, v) = signed_abort(app.clone(), "gone", clock.unix_secs()).await;
        assert_eq!(s, want, "{peers:?}: {v}");
        // Tombstoned only once every peer answered: a tombstone now would answer the
        // retry `already_aborted` here, and the silent peer would never be asked.
        let asked_again = want == StatusCode::SERVICE_UNAVAILABLE;
        assert_eq!(
            st.inner().tombstones(),
            usize::from(!asked_again),
            "a disconnect's abort tombstones here once every peer answered"
        );
        let unanswered = lease_metric(
            &st,
            "kvguard_control_abort_api_answers_total{result=\"peer_unanswered\"}",
        )
        .await;
        let expect = if want == StatusCode::SERVICE_UNAVAILABLE {
            2.0
        } else {
            0.0
        };
        assert_eq!(unanswered, expect, "{peers:?}");
        if want == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(v["error"], "peer_unanswered", "{v}");
        }
    }
}

/// An abort of a disaggregated request's leg asks every peer: while one did not answer,
/// a leg may be missing, so the answer is 503 (ask again), whatever was done here.
#[tokio::test]
async fn a_fanned_out_abort_asks_again_while_a_leg_holder_did_not_answer() {
    let silent = silent_peer().await;
    let (st, clock, _decode) = pd_state(Some(400), |c| c.peers = Some(peers_at(&[silent])));
    let leg = admitted(&st, "leg");
    let (s, v) = signed_abort(admin::app(st.clone()), "leg", clock.unix_secs()).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(
        leg.ended(),
        Some(AbortReason::DownstreamReset),
        "ended here all the same"
    );
    clock.advance(Duration::from_secs(1));
    let (s, v) = signed_abort(admin::app(st.clone()), "leg", clock.unix_secs()).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "asked again: {v}");
}

/// A stall ask that lands on a replica that does not hold the stream is forwarded; the
/// holder defers it. Nothing is tombstoned, here or (a forwarded deferrable ask) on any
/// other non-holder, so the sender's next ask landing on either is deferred too, never
/// answered `already_aborted`; the deferral is counted `deferred`.
#[tokio::test]
async fn a_forwarded_deferral_tombstones_the_id_nowhere_and_is_counted_deferred() {
    let peer = deferring_peer().await;
    let (st, clock) = state(|c| {
        c.limits.reader_timeout = Some(Duration::from_secs(90));
        c.peers = Some(kvguard_control::config::PeerConfig {
            urls: vec![kvguard_control::config::parse_peer_url(&format!("http://{peer}")).unwrap()],
            self_addr: "127.0.0.1:1".parse().unwrap(),
        });
    });
    let key = Key::try_new(KEY).unwrap();
    let ask = br#"{"request_id":"slow","reason":"stalled","age_ms":70000,"idle_ms":61000,"recheck_ms":3000}"#;
    for _ in 0..2 {
        let sig = signature::sign(Domain::Abort, &key, clock.unix_secs(), ask);
        let (s, v) = call(admin::app(st.clone()), abort_req(ask, Some(sig))).await;
        assert_eq!(
            (s, v),
            (
                StatusCode::OK,
                json!({"request_id": "slow", "found": true, "deferred": true})
            )
        );
        assert_eq!(st.inner().tombstones(), 0, "a deferral tombstones nothing");
        clock.advance(Duration::from_secs(1));
    }
    assert_eq!(
        lease_metric(
            &st,
            "kvguard_control_abort_api_answers_total{result=\"deferred\"}"
        )
        .await,
        2.0
    );
    // The same ask forwarded to this replica by another (it holds nothing): 404, and no
    // tombstone either.
    let (peer_st, peer_clock) = state(|c| c.limits.reader_timeout = Some(Duration::from_secs(90)));
    let env = kvguard_contract::Forwarded::new("10.0.0.8:9902", ask)
        .unwrap()
        .to_json();
    let sig = signature::sign(Domain::Envelope, &key, peer_clock.unix_secs(), &env);
    let req = Request::post(kvguard_contract::PEER_ABORT_PATH)
        .header(kvguard_contract::SIGNATURE_HEADER, sig)
        .body(Body::from(env))
        .unwrap();
    let (s, _) = call(admin::app(peer_st.clone()), req).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(peer_st.inner().tombstones(), 0);
}

/// An engine whose decode side answers the release request with `status` (or not at all),
/// recording what it was sent.
struct DecodeSide {
    status: Option<u16>,
    sent: std::sync::Mutex<Vec<(String, String, Value)>>,
    /// When set, the answer waits for a permit.
    gate: Option<Arc<tokio::sync::Notify>>,
}

impl Engine for DecodeSide {
    fn scrape(&self) -> BoxFut<'_, Result<String, String>> {
        Box::pin(async { Err("fake".into()) })
    }
    fn health(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Err("fake".into()) })
    }
    fn abort(&self, _id: RequestId) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn release_prefill(
        &self,
        base: String,
        id: RequestId,
        body: Vec<u8>,
    ) -> BoxFut<'_, Result<u16, String>> {
        self.sent.lock().unwrap().push((
            base,
            id.as_str().to_owned(),
            serde_json::from_slice(&body).unwrap(),
        ));
        let (s, gate) = (self.status, self.gate.clone());
        Box::pin(async move {
            if let Some(g) = gate {
                g.notified().await;
            }
            s.ok_or_else(|| "refused".to_owned())
        })
    }
}

fn pd_state(
    status: Option<u16>,
    tweak: impl FnOnce(&mut Config),
) -> (Arc<AppState>, Arc<ManualClock>, Arc<DecodeSide>) {
    let mut cfg =
        Config::for_tests("http://127.0.0.1:9", vec![Key::try_new(KEY).unwrap()]).unwrap();
    cfg.pd_role = kvguard_control::config::PdRole::Prefill;
    tweak(&mut cfg);
    let clock = Arc::new(ManualClock::new(NOW));
    let engine = Arc::new(DecodeSide {
        status,
        sent: std::sync::Mutex::new(Vec::new()),
        gate: None,
    });
    let st = AppState::new(
        cfg,
        clock.clone(),
        engine.clone(),
        GpuTracker::unavailable("test".into()),
    );
    (st, clock, engine)
}

fn decode_url() -> Option<kvguard_control::config::EngineUrl> {
    Some(
        kvguard_control::config::EngineUrl::try_new("--pd-decode-url", "http://10.0.0.9:8001")
            .unwrap(),
    )
}

async fn signed_abort(app: axum::Router, id: &str, t: u64) -> (StatusCode, Value) {
    let body =
        format!(r#"{{"request_id":"{id}","reason":"downstream_reset","age_ms":1,"tokens":0}}"#);
    let key = Key::try_new(KEY).unwrap();
    let sig = signature::sign(Domain::Abort, &key, t, body.as_bytes());
    call(app, abort_req(body.as_bytes(), Some(sig))).await
}

async fn metrics_text(app: axum::Router) -> String {
    let r = app
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    String::from_utf8(r.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} not in:\n{text}"))
}

fn handoff_params() -> Value {
    json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_request_id": "cmpl-h1-0-ab12cd34", "remote_engine_id": "e1", "remote_host": "10.0.0.3", "remote_port": 5600, "remote_block_ids": [1, 2, 3]})
}

#[tokio::test]
async fn an_abort_of_a_held_prefill_releases_it_through_the_decode_side_and_names_the_leg() {
    let (st, clock, decode) = pd_state(Some(400), |c| c.pd_decode_url = decode_url());
    let app = admin::app(st.clone());
    let id = RequestId::try_new(b"h1").unwrap();
    st.record_handoff(id.clone(), handoff_params());
    clock.advance(Duration::from_secs(2));
    let m = metrics_text(app.clone()).await;
    assert_eq!(sample(&m, "kvguard_control_pd_handoffs_held"), 1.0);
    assert_eq!(
        sample(&m, "kvguard_control_pd_handoff_oldest_age_seconds"),
        2.0
    );
    let me = st.replica_name();
    let (s, v) = signed_abort(app.clone(), "h1", NOW + 2).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({"request_id": "h1", "found": true, "aborted": true,
               "legs": [{"replica": me, "role": "prefill", "result": "released"}]})
    );
    // Sent to the decode URL, under a fresh id, a request the decode engine rejects,
    // carrying the prefill engine's parameters.
    let sent = decode.sent.lock().unwrap().clone();
    assert_eq!(sent.len(), 1);
    let (base, rid, body) = &sent[0];
    assert_eq!(base, "http://10.0.0.9:8001");
    assert!(rid.starts_with("kvguard-pd-release-"), "{rid}");
    assert_eq!(
        (body["stream"].clone(), body["use_beam_search"].clone()),
        (json!(true), json!(true))
    );
    assert_eq!(body["kv_transfer_params"], handoff_params());
    let m = metrics_text(app.clone()).await;
    assert_eq!(sample(&m, "kvguard_control_pd_handoffs_held"), 0.0);
    assert_eq!(
        sample(&m, "kvguard_control_pd_handoff_oldest_age_seconds"),
        0.0
    );
    assert_eq!(
        sample(
            &m,
            r#"kvguard_control_pd_releases_total{via="handoff",result="released"}"#
        ),
        1.0
    );
    assert_eq!(
        sample(
            &m,
            r#"kvguard_control_abort_api_answers_total{result="aborted"}"#
        ),
        1.0
    );
    // Again: the tombstone answers; nothing is sent a second time.
    let (s, v) = signed_abort(app.clone(), "h1", NOW + 3).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({"request_id": "h1", "found": true, "already_aborted": true,
               "legs": [{"replica": me, "role": "prefill", "result": "already_aborted"}]})
    );
    assert_eq!(decode.sent.lock().unwrap().len(), 1);
}

/// The caller of an abort (a peer's 500 ms, the filter's 1 s, the admin listener's 2 s)
/// may give up while a held prefill's release is on its way to the decode side: the
/// release goes on, and is counted, whatever becomes of the call.
#[tokio::test]
async fn a_release_under_way_when_its_caller_gives_up_still_completes_and_is_counted() {
    let (st, _clock, _) = pd_state(Some(400), |c| c.pd_decode_url = decode_url());
    let gate = Arc::new(tokio::sync::Notify::new());
    let decode = Arc::new(DecodeSide {
        status: Some(400),
        sent: std::sync::Mutex::new(Vec::new()),
        gate: Some(gate.clone()),
    });
    let st = AppState::new(
        st.cfg.clone(),
        st.clock.clone(),
        decode.clone(),
        GpuTracker::unavailable("test".into()),
    );
    let app = admin::app(st.clone());
    st.record_handoff(RequestId::try_new(b"h9").unwrap(), handoff_params());
    let call = signed_abort(app.clone(), "h9", NOW);
    let gave_up = tokio::time::timeout(Duration::from_millis(200), call).await;
    assert!(gave_up.is_err(), "the decode side had not answered yet");
    assert_eq!(
        decode.sent.lock().unwrap().len(),
        1,
        "sent before the caller left"
    );
    gate.notify_one();
    let released = r#"kvguard_control_pd_releases_total{via="handoff",result="released"}"#;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = metrics_text(app.clone()).await;
        if m.lines().any(|l| l.strip_prefix(released) == Some(" 1")) {
            assert_eq!(sample(&m, "kvguard_control_pd_handoffs_held"), 0.0);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the release was lost with its caller:\n{m}"
        );
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// P/D: an abort on a replica with a `--pd-role` goes to every peer, and each holder's
/// leg is in the answer (here: none; the peer ended its leg).
#[tokio::test]
async fn a_pd_abort_goes_to_every_peer_and_lists_their_legs() {
    let peer = holding_peer().await;
    let (st, clock, _decode) = pd_state(Some(400), |c| {
        c.peers = Some(kvguard_control::config::PeerConfig {
            urls: vec![kvguard_control::config::parse_peer_url(&format!("http://{peer}")).unwrap()],
            self_addr: "127.0.0.1:1".parse().unwrap(),
        });
    });
    let (s, v) = signed_abort(admin::app(st.clone()), "held", clock.unix_secs()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v,
        json!({"request_id": "held", "found": true, "aborted": true,
               "legs": [{"replica": peer.to_string(), "result": "aborted"}]})
    );
    assert!(st.inner().tombstones() == 1, "tombstoned here too");
}

/// P/D: a stall ask that lands on the prefill replica (it holds only the finished
/// prefill's hand-off) is fanned out; the decode replica holds the stream and defers it.
/// The answer is that deferral: nothing ended, the hand-off not released, nothing
/// tombstoned, counted `deferred`.
#[tokio::test]
async fn a_deferral_by_the_decode_side_is_the_answer_of_a_fanned_out_stall_ask() {
    let peer = deferring_peer().await;
    let (st, clock, decode) = pd_state(Some(400), |c| {
        c.pd_decode_url = decode_url();
        c.limits.reader_timeout = Some(Duration::from_secs(90));
        c.peers = Some(kvguard_control::config::PeerConfig {
            urls: vec![kvguard_control::config::parse_peer_url(&format!("http://{peer}")).unwrap()],
            self_addr: "127.0.0.1:1".parse().unwrap(),
        });
    });
    let id = RequestId::try_new(b"slow").unwrap();
    st.record_handoff(id.clone(), handoff_params());
    let ask = br#"{"request_id":"slow","reason":"stalled","age_ms":70000,"idle_ms":61000,"recheck_ms":3000}"#;
    let sig = signature::sign(
        Domain::Abort,
        &Key::try_new(KEY).unwrap(),
        clock.unix_secs(),
        ask,
    );
    let app = admin::app(st.clone());
    let (s, v) = call(app.clone(), abort_req(ask, Some(sig))).await;
    assert_eq!(
        (s, v),
        (
            StatusCode::OK,
            json!({"request_id": "slow", "found": true, "deferred": true})
        )
    );
    assert!(st.holds_handoff(&id), "not released");
    assert!(decode.sent.lock().unwrap().is_empty());
    assert_eq!(st.inner().tombstones(), 0);
    let m = metrics_text(app).await;
    assert_eq!(
        sample(
            &m,
            r#"kvguard_control_abort_api_answers_total{result="deferred"}"#
        ),
        1.0
    );
}

#[tokio::test]
async fn a_held_prefill_that_cannot_be_released_is_reported_held_until_the_lease() {
    // No decode URL: nothing is sent.
    let (st, _clock, decode) = pd_state(Some(400), |_| {});
    let app = admin::app(st.clone());
    st.record_handoff(RequestId::try_new(b"h2").unwrap(), handoff_params());
    let (s, v) = signed_abort(app.clone(), "h2", NOW).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({"request_id": "h2", "found": true,
               "legs": [{"replica": "127.0.0.1:0", "role": "prefill", "result": "held_until_lease"}]})
    );
    assert!(decode.sent.lock().unwrap().is_empty());
    let m = metrics_text(app.clone()).await;
    assert_eq!(
        sample(
            &m,
            r#"kvguard_control_pd_releases_total{via="handoff",result="no_route"}"#
        ),
        1.0
    );
    // The decode side accepts the request (no rejection) or does not answer: failed.
    for status in [Some(200), None] {
        let (st, _clock, decode) = pd_state(status, |c| c.pd_decode_url = decode_url());
        let app = admin::app(st.clone());
        st.record_handoff(RequestId::try_new(b"h3").unwrap(), handoff_params());
        let (s, v) = signed_abort(app.clone(), "h3", NOW).await;
        assert_eq!(s, StatusCode::OK, "{status:?}");
        assert_eq!(v["legs"][0]["result"], "held_until_lease", "{status:?}");
        assert_eq!(decode.sent.lock().unwrap().len(), 1);
        let m = metrics_text(app.clone()).await;
        assert_eq!(
            sample(
                &m,
                r#"kvguard_control_pd_releases_total{via="handoff",result="failed"}"#
            ),
            1.0
        );
    }
}

#[tokio::test]
async fn a_hand_off_is_forgotten_at_the_lease_and_kept_by_a_dry_run() {
    let (st, clock, decode) = pd_state(Some(400), |c| c.pd_decode_url = decode_url());
    let app = admin::app(st.clone());
    st.record_handoff(RequestId::try_new(b"h4").unwrap(), handoff_params());
    // vLLM's lease (30 s) ran out: the engine let go by itself; nothing to release.
    clock.advance(Duration::from_secs(30));
    let (s, v) = signed_abort(app.clone(), "h4", NOW + 30).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v, json!({"request_id": "h4", "found": false}));
    assert!(decode.sent.lock().unwrap().is_empty());
    // A dry run reports it and keeps it.
    let (st, _clock, decode) = pd_state(Some(400), |c| {
        c.pd_decode_url = decode_url();
        c.dry_run = true;
    });
    let app = admin::app(st.clone());
    let id = RequestId::try_new(b"h5").unwrap();
    st.record_handoff(id.clone(), handoff_params());
    let (s, v) = signed_abort(app.clone(), "h5", NOW).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["legs"][0]["result"], "dry_run", "{v}");
    assert_eq!(v["aborted"], Value::Null);
    assert!(decode.sent.lock().unwrap().is_empty());
    assert!(st.holds_handoff(&id));
}

#[tokio::test]
async fn a_tombstoned_decode_leg_has_its_prefill_released_by_this_engine() {
    let (st, _clock, decode) = pd_state(Some(400), |c| {
        c.pd_role = kvguard_control::config::PdRole::Decode;
    });
    let admin_app = admin::app(st.clone());
    // Tombstoned by an abort that overtook it.
    let (s, _) = signed_abort(admin_app.clone(), "d1", NOW).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let body = json!({"prompt": "x", "stream": true, "kv_transfer_params": handoff_params()});
    let (s, v) = call(
        proxy::app(st.clone()),
        Request::post("/v1/completions")
            .header("x-request-id", "d1")
            .body(Body::from(serde_json::to_vec(&body).unwrap()))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(v["error"]["type"], "kvguard_aborted");
    assert_eq!(v["error"]["kv_released"], true);
    let sent = decode.sent.lock().unwrap().clone();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].0, "http://127.0.0.1:9", "this replica's own engine");
    assert_eq!(sent[0].2["kv_transfer_params"], handoff_params());
    // A tombstoned request that is no decode leg is refused as before, nothing sent.
    let (s, v) = call(
        proxy::app(st.clone()),
        Request::post("/v1/completions")
            .header("x-request-id", "d1")
            .body(Body::from(r#"{"prompt":"x"}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(v["error"].get("kv_released"), None);
    assert_eq!(decode.sent.lock().unwrap().len(), 1);
    // An engine that does not reject it: said so.
    let (st2, _clock, _decode) = pd_state(None, |_| {});
    let (s, _) = signed_abort(admin::app(st2.clone()), "d2", NOW).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, v) = call(
        proxy::app(st2.clone()),
        Request::post("/v1/completions")
            .header("x-request-id", "d2")
            .body(Body::from(serde_json::to_vec(&body).unwrap()))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(v["error"]["kv_released"], false);
    let m = metrics_text(admin_app).await;
    assert_eq!(
        sample(
            &m,
            r#"kvguard_control_pd_releases_total{via="tombstoned_decode",result="released"}"#
        ),
        1.0
    );
}

#[tokio::test]
async fn without_a_role_an_abort_reaches_every_leg_only_for_a_disaggregated_request() {
    let (st, _clock, decode) = pd_state(Some(400), |c| {
        c.pd_role = kvguard_control::config::PdRole::None;
        c.pd_decode_url = decode_url();
    });
    let app = admin::app(st.clone());
    // A request in flight whose body asked for the decode leg: its leg is named.
    let entry = st
        .admit(
            RequestId::try_new(b"l1").unwrap(),
            "POST".into(),
            "/v1/completions".into(),
        )
        .unwrap();
    entry.set_pd_leg(kvguard_control::pd::PdLeg::Decode);
    let (s, v) = signed_abort(app.clone(), "l1", NOW).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({"request_id": "l1", "found": true, "aborted": true,
               "legs": [{"replica": "127.0.0.1:0", "role": "decode", "result": "aborted"}]})
    );
    // A held hand-off: released, its leg named.
    st.record_handoff(RequestId::try_new(b"l2").unwrap(), handoff_params());
    let (s, v) = signed_abort(app.clone(), "l2", NOW).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["legs"][0]["result"], "released", "{v}");
    assert_eq!(decode.sent.lock().unwrap().len(), 1);
    // Any other request: the answer as without disaggregation.
    let _plain = st
        .admit(
            RequestId::try_new(b"l3").unwrap(),
            "POST".into(),
            "/v1/completions".into(),
        )
        .unwrap();
    let (s, v) = signed_abort(app.clone(), "l3", NOW).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({"request_id": "l3", "found": true, "aborted": true})
    );
    let (s, v) = signed_abort(app.clone(), "l4", NOW).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v, json!({"request_id": "l4", "found": false}));
}

#[tokio::test]
async fn the_hand_off_table_is_bounded_and_its_evictions_counted() {
    let (st, _clock, _decode) = pd_state(Some(400), |c| c.max_pd_handoffs = 1);
    let app = admin::app(st.clone());
    for id in ["e1", "e2", "e3"] {
        st.record_handoff(RequestId::try_new(id.as_bytes()).unwrap(), handoff_params());
    }
    let m = metrics_text(app).await;
    assert_eq!(sample(&m, "kvguard_control_pd_handoffs_held"), 1.0);
    assert_eq!(sample(&m, "kvguard_control_pd_handoffs_evicted_total"), 2.0);
    assert!(st.holds_handoff(&RequestId::try_new(b"e3").unwrap()));
    assert!(!st.holds_handoff(&RequestId::try_new(b"e1").unwrap()));
}

#[tokio::test]
async fn a_replica_names_itself_by_its_advertised_address_else_its_admin_listener() {
    let (st, _clock, _decode) = pd_state(None, |_| {});
    assert_eq!(st.replica_name(), "127.0.0.1:0");
    let (st, _clock, _decode) = pd_state(None, |c| {
        c.advertise = Some("10.0.0.7:9902".parse().unwrap());
    });
    assert_eq!(st.replica_name(), "10.0.0.7:9902");
}

/// A signed in-band renewal of `instance` listing the live worker VMs `vms`.
fn renewal_listing(
    instance: kvguard_contract::InstanceId,
    counter: u64,
    vms: &[u32],
) -> Request<Body> {
    let body = kvguard_contract::Renewal::new(instance, counter)
        .sent(kvguard_contract::Via::Data, true)
        .with_vms(vms)
        .to_json();
    let sig = signature::sign(Domain::Renewal, &Key::try_new(KEY).unwrap(), NOW, &body);
    Request::post(kvguard_contract::DATA_LEASE_PATH)
        .header(kvguard_contract::SIGNATURE_HEADER, sig)
        .body(Body::from(body))
        .unwrap()
}

#[tokio::test]
async fn a_vm_its_gateways_renewals_leave_out_for_the_ttl_has_its_requests_ended_only_its() {
    let (st, clock) = state(|c| c.lease_ttl = Duration::from_secs(30));
    let a = kvguard_contract::InstanceId([5; 16]);
    let tag = |vm: Option<u32>| kvguard_contract::InstanceTag { instance: a, vm };
    let id = |s: &str| RequestId::try_new(s.as_bytes()).unwrap();
    let mut counter = 0;
    let mut renew = |vms: &'static [u32]| {
        counter += 1;
        let st = st.clone();
        let c = counter;
        async move {
            let (s, v) = call(proxy::app(st), renewal_listing(a, c, vms)).await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
    };
    // VMs 1, 2 and 4 live (4 with no request here), then VM 2 and 4 left out (trapped).
    renew(&[1, 2, 4]).await;
    let on_1 = st.admit(id("on-1"), "POST".into(), "/".into()).unwrap();
    on_1.set_instance(tag(Some(1)));
    let on_2 = st.admit(id("on-2"), "POST".into(), "/".into()).unwrap();
    on_2.set_instance(tag(Some(2)));
    let no_vm = st.admit(id("no-vm"), "POST".into(), "/".into()).unwrap();
    no_vm.set_instance(tag(None));
    clock.advance(Duration::from_secs(5));
    renew(&[1]).await;
    // Renewals every period (a gap of more than 3 reads as the gateway's stall).
    for _ in 0..6 {
        clock.advance(Duration::from_secs(5));
        renew(&[1]).await;
    }
    enforce::judge(&st);
    assert_eq!(on_2.ended(), None, "not more than the TTL yet");
    clock.advance(Duration::from_secs(1));
    renew(&[1]).await;
    enforce::judge(&st);
    assert_eq!(on_2.ended(), Some(AbortReason::GatewayLost));
    assert_eq!(on_1.ended(), None);
    assert_eq!(no_vm.ended(), None);
    let series =
        |m: &str| format!("kvguard_control_lease_{m}_total{{mode=\"enforce\",why=\"vm_lost\"}}");
    assert_eq!(lease_metric(&st, &series("requests_ended")).await, 1.0);
    // VM 4 had no request here: not counted.
    assert_eq!(lease_metric(&st, &series("expiries")).await, 1.0);
    assert!(
        st.leases.lock().unwrap().holds(&a),
        "the gateway's lease stays"
    );

    // VM 3, left out for the TTL, has a request admitted as it is judged: alive after
    // all, nothing of it ended.
    renew(&[1, 3]).await;
    clock.advance(Duration::from_secs(1));
    renew(&[1]).await;
    for _ in 0..6 {
        clock.advance(Duration::from_secs(5));
        renew(&[1]).await;
    }
    clock.advance(Duration::from_secs(1));
    renew(&[1]).await;
    let late = st.admit(id("late-3"), "POST".into(), "/".into()).unwrap();
    late.set_instance(tag(Some(3)));
    enforce::judge(&st);
    assert_eq!(late.ended(), None);
    assert_eq!(lease_metric(&st, &series("expiries")).await, 1.0);
    // ... and it is known again: not judged at the next pass, but judged by the same
    // rule once the renewals have left it out for the TTL from there.
    clock.advance(Duration::from_secs(1));
    renew(&[1]).await;
    enforce::judge(&st);
    assert_eq!(late.ended(), None);
    for _ in 0..6 {
        clock.advance(Duration::from_secs(5));
        renew(&[1]).await;
    }
    enforce::judge(&st);
    assert_eq!(late.ended(), None, "not more than the TTL yet");
    clock.advance(Duration::from_secs(1));
    renew(&[1]).await;
    enforce::judge(&st);
    assert_eq!(late.ended(), Some(AbortReason::GatewayLost));
    assert_eq!(lease_metric(&st, &series("expiries")).await, 2.0);
}

#[tokio::test]
async fn observe_mode_counts_a_lost_vms_requests_and_ends_none() {
    let (st, clock) = state(|c| {
        c.lease_ttl = Duration::from_secs(30);
        c.lease_mode = kvguard_control::lease::LeaseMode::Observe;
    });
    let a = kvguard_contract::InstanceId([6; 16]);
    let (s, _) = call(proxy::app(st.clone()), renewal_listing(a, 1, &[1, 2])).await;
    assert_eq!(s, StatusCode::OK);
    let e = st
        .admit(RequestId::try_new(b"r").unwrap(), "POST".into(), "/".into())
        .unwrap();
    e.set_instance(kvguard_contract::InstanceTag {
        instance: a,
        vm: Some(2),
    });
    clock.advance(Duration::from_secs(1));
    let (s, _) = call(proxy::app(st.clone()), renewal_listing(a, 2, &[1])).await;
    assert_eq!(s, StatusCode::OK);
    clock.advance(Duration::from_secs(31));
    let (s, _) = call(proxy::app(st.clone()), renewal_listing(a, 3, &[1])).await;
    assert_eq!(s, StatusCode::OK);
    enforce::judge(&st);
    assert_eq!(e.ended(), None);
    assert_eq!(
        lease_metric(
            &st,
            "kvguard_control_lease_requests_ended_total{mode=\"observe\",why=\"vm_lost\"}"
        )
        .await,
        1.0
    );
}

/// A `stalled` abort with `recheck_ms` of a stream whose engine produced just now is
/// answered `deferred` and changes nothing; one whose engine has been silent for half the
/// sender's silence, one from a sender that saw nothing for the reader timeout, one
/// without `recheck_ms` (an older sender) and one of another reason are carried out.
#[tokio::test]
async fn stalled_aborts_are_deferred_only_while_the_engine_produces() {
    let (st, clock) = state(|c| c.limits.reader_timeout = Some(Duration::from_secs(90)));
    let app = admin::app(st.clone());
    let key = Key::try_new(KEY).unwrap();
    let admit = |id: &str| {
        let e = admitted(&st, id);
        e.record_events(1, clock.now());
        // The gateway took that frame and asked for the next one.
        e.record_handed(clock.now());
        e.record_demand(clock.now());
        e
    };
    let (flowing, silent, tired, old, gone) = (
        admit("flowing"),
        admit("silent"),
        admit("tired"),
        admit("old"),
        admit("gone"),
    );
    clock.advance(Duration::from_secs(5));
    for e in [&flowing, &tired, &old, &gone] {
        e.record_events(1, clock.now());
    }
    let ask = |id: &str, reason: &str, idle_ms: u64, recheck: bool| {
        let mut b = json!({"request_id": id, "reason": reason, "age_ms": 9, "idle_ms": idle_ms});
        if recheck {
            b["recheck_ms"] = 3000.into();
        }
        let b = serde_json::to_vec(&b).unwrap();
        let sig = signature::sign(Domain::Abort, &key, clock.unix_secs(), &b);
        (app.clone(), abort_req(&b, Some(sig)))
    };
    let answer = |(app, req): (axum::Router, Request<Body>)| call(app, req);
    let (s, v) = answer(ask("flowing", "stalled", 10_000, true)).await;
    assert_eq!(
        (s, v),
        (
            StatusCode::OK,
            json!({"request_id": "flowing", "found": true, "deferred": true})
        )
    );
    assert_eq!(flowing.ended(), None);
    // Silent here for 5 s of the sender's 10 s: the engine's stall.
    let (_, v) = answer(ask("silent", "stalled", 10_000, true)).await;
    assert_eq!(v["aborted"], true, "{v}");
    assert_eq!(silent.ended(), Some(AbortReason::Stalled));
    // The sender saw nothing for the reader timeout.
    let (_, v) = answer(ask("tired", "stalled", 90_000, true)).await;
    assert_eq!(v["aborted"], true, "{v}");
    let (_, v) = answer(ask("old", "stalled", 10_000, false)).await;
    assert_eq!(v["aborted"], true, "{v}");
    let (_, v) = answer(ask("gone", "downstream_reset", 10_000, true)).await;
    assert_eq!(v["aborted"], true, "{v}");
    // Held nowhere (no peers): judged on the sender's silence alone, as a tail.
    let (s, v) = answer(ask("never", "stalled", 10_000, true)).await;
    assert_eq!(v["deferred"], true, "{s}: {v}");
}

/// A stall ask nobody holds (not here, and every peer answered 404) is judged on its
/// sender's silence alone: nothing is held to free, and its gateway may still be draining
/// a completed response's tail to a slow reader, however long after the engine's end.
/// Deferred while the sender saw data within the reader timeout (a request that completed
/// here, or one never seen: a restart forgets nothing that matters); 404 once its silence
/// reached it, for a sender that allows no deferral, and for another reason.
#[tokio::test]
async fn a_stall_ask_held_nowhere_is_deferred_on_its_senders_silence() {
    let reader = Duration::from_secs(90);
    let not_here = peer_answering(StatusCode::NOT_FOUND).await;
    for peers in [None, Some(peers_at(&[not_here]))] {
        let with_peers = peers.is_some();
        let (st, clock) = state(|c| {
            c.limits.reader_timeout = Some(reader);
            c.peers = peers;
        });
        let app = admin::app(st.clone());
        let key = Key::try_new(KEY).unwrap();
        let ask = |id: &str, reason: &str, idle_ms: u64, recheck: bool| {
            let mut b =
                json!({"request_id": id, "reason": reason, "age_ms": 9, "idle_ms": idle_ms});
            if recheck {
                b["recheck_ms"] = 3000.into();
            }
            let b = serde_json::to_vec(&b).unwrap();
            let sig = signature::sign(Domain::Abort, &key, clock.unix_secs(), &b);
            call(app.clone(), abort_req(&b, Some(sig)))
        };
        let done = admitted(&st, "done");
        done.record_events(1, clock.now());
        st.remove(&done);
        clock.advance(reader * 10);
        for id in ["done", "never-seen"] {
            assert_eq!(
                ask(id, "stalled", 89_999, true).await,
                (
                    StatusCode::OK,
                    json!({"request_id": id, "found": true, "deferred": true})
                ),
                "peers: {with_peers}"
            );
        }
        assert_eq!(st.inner().tombstones(), 0, "a deferral tombstones nothing");
        for (id, reason, idle, recheck) in [
            ("silent-sender", "stalled", 90_000, true),
            ("old-sender", "stalled", 10_000, false),
            ("gone", "downstream_reset", 10_000, true),
        ] {
            let (s, v) = ask(id, reason, idle, recheck).await;
            assert_eq!(s, StatusCode::NOT_FOUND, "{id}, peers: {with_peers}: {v}");
        }
    }
}

/// Beside a prefill engine a completion is the prefill leg's (one token), not the
/// stream's: it is not remembered, so a stall ask about the stream is not answered
/// `deferred` here; it goes to the decode side, which holds the stream and ends it.
#[tokio::test]
async fn a_prefill_sides_completion_defers_no_stall_ask() {
    let app = axum::Router::new().route(
        kvguard_contract::PEER_ABORT_PATH,
        axum::routing::post(|| async {
            axum::Json(json!({"request_id": "leg", "found": true, "aborted": true}))
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let decode_replica = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    let (st, clock, _decode) = pd_state(Some(400), |c| {
        c.limits.reader_timeout = Some(Duration::from_secs(90));
        c.peers = Some(peers_at(&[decode_replica]));
    });
    let e = admitted(&st, "leg");
    e.record_events(1, clock.now());
    st.remove(&e);
    let ask = br#"{"request_id":"leg","reason":"stalled","age_ms":9000,"idle_ms":6000,"recheck_ms":3000}"#;
    let sig = signature::sign(
        Domain::Abort,
        &Key::try_new(KEY).unwrap(),
        clock.unix_secs(),
        ask,
    );
    let (s, v) = call(admin::app(st.clone()), abort_req(ask, Some(sig))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["deferred"], json!(null), "{v}");
    assert_eq!(v["aborted"], true, "the decode side's leg: {v}");
    assert_eq!(
        st.inner().tombstones(),
        0,
        "a stall ask tombstones nothing here"
    );
}
