//! Proofs of life on requests (contract §8): the signed `x-kvguard-instance` value read
//! at the proxy's admission takes and arms a lease; a forged one tags nothing; a silent
//! gateway's listener is asked, and its kernel's answer decides (sockets on loopback,
//! the lease clock injected).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use axum::body::Body;
use http::{Request, StatusCode};
use kvguard_contract::{AbortReason, InstanceId, InstanceTag, Key, Proof, RequestId};
use kvguard_control::config::Config;
use kvguard_control::gpu::GpuTracker;
use kvguard_control::lease::enforce;
use kvguard_control::state::AppState;
use kvguard_control::testing::{FakeEngine, ManualClock};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;

const KEY: &[u8] = b"kvguard-control-test-key-0123456789";
const TTL: Duration = Duration::from_secs(30);
/// How long an event may take to show (a probe on loopback answers in microseconds).
const BOUND: Duration = Duration::from_secs(10);

fn state() -> (Arc<AppState>, Arc<ManualClock>) {
    // Port 9 (discard): nothing answers there.
    let mut cfg =
        Config::for_tests("http://127.0.0.1:9", vec![Key::try_new(KEY).unwrap()]).unwrap();
    cfg.lease_ttl = TTL;
    let clock = Arc::new(ManualClock::new(1_800_000_000));
    let st = AppState::new(
        cfg,
        clock.clone(),
        Arc::new(FakeEngine),
        GpuTracker::unavailable("test".into()),
    );
    (st, clock)
}

fn value(id: InstanceId, counter: u64, listener: Option<SocketAddr>, key: &[u8]) -> String {
    let tag = InstanceTag {
        instance: id,
        vm: Some(1),
    };
    Proof {
        counter,
        host: None,
        listener,
    }
    .value(tag, &Key::try_new(key).unwrap())
}

/// A tracked request through the proxy listener carrying `tag` (the engine is
/// unreachable: 502, after admission).
async fn request(st: &Arc<AppState>, tag: &str) {
    let req = Request::post("/v1/completions")
        .header("x-request-id", "r")
        .header(kvguard_contract::INSTANCE_HEADER, tag)
        .body(Body::from("{}"))
        .unwrap();
    let resp = kvguard_control::proxy::app(st.clone())
        .oneshot(req)
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
}

fn metric(st: &AppState, series: &str) -> f64 {
    let text = kvguard_control::metrics::encode(&st.registry);
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing"))
}

fn proofs(st: &AppState, result: &str) -> f64 {
    metric(
        st,
        &format!("kvguard_control_lease_proofs_total{{result=\"{result}\"}}"),
    )
}

/// Waits (bounded) until `what` holds.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed() < BOUND, "{what}: not within {BOUND:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An in-flight request of `id`.
fn entry_of(st: &Arc<AppState>, id: InstanceId) -> Arc<kvguard_control::table::Entry> {
    let e = st
        .admit(
            RequestId::try_new(format!("e-{id}").as_bytes()).unwrap(),
            "POST".into(),
            "/".into(),
        )
        .unwrap();
    e.set_instance(InstanceTag {
        instance: id,
        vm: Some(1),
    });
    e
}

#[tokio::test]
async fn the_first_request_with_a_proof_takes_the_lease_a_forged_or_replayed_one_proves_nothing() {
    let (st, _clock) = state();
    let a = InstanceId([1; 16]);
    // Signed with a key kvguard-control does not hold: no tag, no lease.
    request(&st, &value(a, 1, None, b"not-the-key-of-kvguard-control")).await;
    assert!(!st.leases.lock().unwrap().holds(&a));
    assert_eq!(proofs(&st, "unauthorized"), 1.0);
    // Unreadable: counted.
    request(&st, &format!("{a}.1;c=1;s=00")).await;
    assert_eq!(proofs(&st, "bad_request"), 1.0);
    // Genuine: the first one takes the lease.
    request(&st, &value(a, 1, None, KEY)).await;
    assert!(st.leases.lock().unwrap().holds(&a));
    assert_eq!(proofs(&st, "accepted"), 1.0);
    // The period's value again, then an older counter.
    request(&st, &value(a, 1, None, KEY)).await;
    request(&st, &value(a, 0, None, KEY)).await;
    assert_eq!(
        (proofs(&st, "duplicate"), proofs(&st, "replay")),
        (1.0, 1.0)
    );
    // A plain tag (an older filter) is still read.
    let b = InstanceId([2; 16]);
    request(&st, &format!("{b}.1")).await;
    assert_eq!(proofs(&st, "accepted"), 1.0);
}

/// A lone gateway whose proof names `listener`, with a request in flight, its listener
/// asked once while it lives (and answering).
async fn calibrated(
    st: &Arc<AppState>,
    id: InstanceId,
    listener: SocketAddr,
) -> Arc<kvguard_control::table::Entry> {
    request(st, &value(id, 1, Some(listener), KEY)).await;
    let e = entry_of(st, id);
    enforce::judge(st);
    until("the listener answered", || {
        metric(st, "kvguard_control_lease_probes_total{answer=\"alive\"}") == 1.0
    })
    .await;
    assert_eq!(
        metric(st, "kvguard_control_leases_enforceable"),
        1.0,
        "a listener that answered makes silence judgeable"
    );
    e
}

#[tokio::test]
async fn a_lone_silent_gateway_whose_listener_refuses_is_ended() {
    let (st, clock) = state();
    let id = InstanceId([1; 16]);
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let e = calibrated(&st, id, l.local_addr().unwrap()).await;
    // The process dies: its port refuses.
    drop(l);
    clock.advance(TTL);
    enforce::judge(&st);
    assert_eq!(e.ended(), None, "within the TTL");
    clock.advance(Duration::from_millis(1));
    enforce::judge(&st);
    until("the dead gateway's request ended", || e.ended().is_some()).await;
    assert_eq!(e.ended(), Some(AbortReason::GatewayLost));
    assert_eq!(
        metric(
            &st,
            "kvguard_control_lease_expiries_total{mode=\"enforce\",why=\"dead\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &st,
            "kvguard_control_lease_probes_total{answer=\"refused\"}"
        ),
        1.0
    );
}

#[tokio::test]
async fn a_lone_gateway_frozen_past_the_ttl_whose_kernel_answers_keeps_its_requests() {
    let (st, clock) = state();
    let id = InstanceId([2; 16]);
    // Bound, never accepting: a SIGSTOPped process's kernel completes handshakes.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let e = calibrated(&st, id, l.local_addr().unwrap()).await;
    clock.advance(TTL + Duration::from_secs(1));
    enforce::judge(&st);
    until("its listener answered again", || {
        metric(&st, "kvguard_control_lease_probes_total{answer=\"alive\"}") == 2.0
    })
    .await;
    for _ in 0..20 {
        clock.advance(Duration::from_secs(1));
        enforce::judge(&st);
    }
    assert_eq!(e.ended(), None);
    assert!(st.leases.lock().unwrap().holds(&id));
    assert_eq!(
        metric(&st, "kvguard_control_lease_held_expiries_total"),
        1.0
    );
    // It resumes: its next proof takes the lease on.
    request(&st, &value(id, 2, Some(l.local_addr().unwrap()), KEY)).await;
    assert_eq!(proofs(&st, "accepted"), 2.0);
    drop(l);
}

#[tokio::test]
async fn a_listener_that_cannot_be_reached_reads_as_no_answer_and_is_never_trusted() {
    let (st, _clock) = state();
    let id = InstanceId([3; 16]);
    // The limited broadcast address: connect fails at once, not refused.
    let nowhere: SocketAddr = "255.255.255.255:9".parse().unwrap();
    request(&st, &value(id, 1, Some(nowhere), KEY)).await;
    until("the listener asked", || {
        metric(
            &st,
            "kvguard_control_lease_probes_total{answer=\"timeout\"}",
        ) == 1.0
    })
    .await;
    assert_eq!(
        metric(
            &st,
            "kvguard_control_lease_probes_total{answer=\"refused\"}"
        ),
        0.0
    );
    assert_eq!(metric(&st, "kvguard_control_leases_enforceable"), 0.0);
}
