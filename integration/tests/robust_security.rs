//! Security through the real stack: a client cannot abort another client's request.
//!
//! - A client that sends a victim's `x-request-id` (forged or replayed) and a forged
//!   `x-kvguard-control` request header, then disconnects: Envoy mints a fresh id, the
//!   abort names the attacker's own request, the forged replica address is never called,
//!   and the victim's stream completes.
//! - Abort calls made straight to kvguard-control's admin listener: unsigned, signed with
//!   a wrong key, signed too far in the past or future (clock skew), replayed: each is
//!   refused (401 / 409) and counted in `kvguard_control_abort_api_answers_total`, and
//!   the victim's stream is untouched.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_contract::{signature, stamp, Domain, Key, RequestId};
use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Stack, StackOptions};
use kvguard_integration::envoy::CONTROL_TARGET_CLUSTER;
use kvguard_integration::sim::{self, EndKind, SimConfig};
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use support::*;

fn slow_sim() -> SimConfig {
    SimConfig {
        token_rate: 20.0,
        ..SimConfig::default()
    }
}

async fn first_id(s: &mut client::SseStream) -> String {
    let ev = s.next_data(W).await.unwrap().expect("a first event");
    ev.json().unwrap()["id"]
        .as_str()
        .unwrap()
        .strip_prefix("chatcmpl-")
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_request_id_and_control_header_cannot_abort_another_client() {
    bounded("forged ids", T, async {
        // An "attacker" replica address that must never be called.
        let trap = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let trap_addr = trap.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let h2 = hits.clone();
        let trap_task = tokio::spawn(async move {
            while trap.accept().await.is_ok() {
                h2.fetch_add(1, Ordering::SeqCst);
            }
        });
        let extra = json!({"control_target_cluster": CONTROL_TARGET_CLUSTER, "control_target_cidrs": ["127.0.0.0/8"]});
        let r = rig_with(slow_sim(), extra, |o| {
            o.original_dst_cluster = Some(CONTROL_TARGET_CLUSTER.into());
        })
        .await;
        let addr = r.envoy.listener_addr();
        // The victim.
        let mut a = client::stream_sse(addr, "/v1/chat/completions", &chat(30), &[], false).await.unwrap();
        let victim = first_id(&mut a).await;
        // The attacker: the victim's id, a forged stamp (wrong key) and a garbage one.
        let wrong = Key::try_new(b"attacker-key-0123456789abcdef").unwrap();
        let forged = stamp::stamp(&wrong, trap_addr, &RequestId::try_new(victim.as_bytes()).unwrap(), now_unix());
        for (i, ctl) in [forged.as_str(), "127.0.0.1:1;t=1;sig=00"].into_iter().enumerate() {
            let h = [("x-request-id", victim.as_str()), ("x-kvguard-control", ctl)];
            let mut b = client::stream_sse(addr, "/v1/chat/completions", &chat(30), &h, i == 1).await.unwrap();
            let own = first_id(&mut b).await;
            assert_ne!(own, victim, "Envoy kept the client's x-request-id");
            b.disconnect();
            let calls = r.recv.wait_calls_for(&own, W).await.unwrap();
            assert_eq!(calls[0].abort.as_ref().unwrap().reason.as_str(), "downstream_reset");
        }
        // The victim's stream completes in full; nobody aborted it anywhere.
        let evs = a.collect(W).await.unwrap();
        assert!(evs.iter().any(|e| e.is_done()), "the victim's stream did not complete");
        assert!(r.recv.calls_for(&victim).is_empty(), "an abort named the victim");
        let rec = r.sim.state().request(&victim).cloned().unwrap();
        assert_eq!(rec.ended, Some(EndKind::Length), "victim: {rec:?}");
        assert_eq!(hits.load(Ordering::SeqCst), 0, "the forged replica address was called");
        assert_eq!(stat(&r.envoy, "kvguard_filter_abort_routes_total_route=.=fallback;.;").await, 2.0);
        assert_vm_healthy(&r.envoy);
        trap_task.abort();
    })
    .await
    .unwrap();
}

async fn post_abort(admin: std::net::SocketAddr, body: &[u8], sig: Option<&str>) -> u16 {
    let mut h = vec![("content-type", "application/json")];
    if let Some(s) = sig {
        h.push(("x-kvguard-signature", s));
    }
    client::request(
        admin,
        hyper::Method::POST,
        "/v1/abort",
        &h,
        body.to_vec(),
        false,
        W,
    )
    .await
    .unwrap()
    .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_skewed_and_replayed_abort_calls_are_refused_and_counted() {
    bounded("abort call forgery", T, async {
        let engine = sim::spawn(slow_sim()).await.unwrap();
        let mut so = StackOptions::new(engine.addr(), Some(stack::filter_config(0, 0)));
        so.lossy = false;
        so.buffer_limit = None;
        let st = Stack::start(so).await.unwrap();
        let admin = st.control.admin;
        let mut a = client::stream_sse(st.entry(), "/v1/chat/completions", &chat(40), &[], false)
            .await
            .unwrap();
        let victim = first_id(&mut a).await;
        let body =
            serde_json::to_vec(&json!({"request_id": victim, "reason": "operator"})).unwrap();
        let key = Key::try_new(stack::SECRET.as_bytes()).unwrap();
        let wrong = Key::try_new(b"not-the-secret-0123456789abcdef").unwrap();
        let now = now_unix();
        assert_eq!(post_abort(admin, &body, None).await, 401, "unsigned");
        assert_eq!(
            post_abort(
                admin,
                &body,
                Some(&signature::sign(Domain::Abort, &wrong, now, &body))
            )
            .await,
            401,
            "wrong key"
        );
        assert_eq!(
            post_abort(
                admin,
                &body,
                Some(&signature::sign(Domain::Abort, &key, now - 120, &body))
            )
            .await,
            401,
            "120 s in the past"
        );
        assert_eq!(
            post_abort(
                admin,
                &body,
                Some(&signature::sign(Domain::Abort, &key, now + 45, &body))
            )
            .await,
            401,
            "45 s in the future"
        );
        assert_eq!(
            post_abort(admin, &body, Some("t=1,v2=zz")).await,
            401,
            "malformed"
        );
        // Signed for another kind of message (a lease renewal's prefix).
        assert_eq!(
            post_abort(
                admin,
                &body,
                Some(&signature::sign(Domain::Renewal, &key, now, &body))
            )
            .await,
            401,
            "signed as a renewal"
        );
        // A sender before the prefixes (its v1 alone): refused and counted by name.
        let v1_only = signature::sign(Domain::Abort, &key, now, &body)
            .split(",v2=")
            .next()
            .unwrap()
            .to_owned();
        assert_eq!(
            post_abort(admin, &body, Some(&v1_only)).await,
            401,
            "v1 only"
        );
        // A signature made for another body does not carry over.
        let other = br#"{"request_id":"ghost-1","reason":"operator"}"#;
        let sig_other = signature::sign(Domain::Abort, &key, now, other);
        assert_eq!(
            post_abort(admin, &body, Some(&sig_other)).await,
            401,
            "signature of another body"
        );
        // A genuine call (as captured on the wire) works once; its replay is refused.
        assert_eq!(
            post_abort(admin, other, Some(&sig_other)).await,
            404,
            "genuine call for an unknown id"
        );
        assert_eq!(
            post_abort(admin, other, Some(&sig_other)).await,
            409,
            "replay"
        );
        // The victim streams on and completes.
        let evs = a.collect(W).await.unwrap();
        assert!(evs.iter().any(|e| e.is_done()), "the victim was cut");
        let m = st.control.metrics_text().await.unwrap();
        let count = |res: &str| -> f64 {
            m.lines()
                .filter(|l| {
                    l.starts_with("kvguard_control_abort_api_answers")
                        && l.contains(&format!("result=\"{res}\""))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        assert!(count("unauthorized") >= 7.0, "refusals not counted:\n{m}");
        assert!(count("outdated") >= 1.0, "outdated not counted:\n{m}");
        assert!(count("replay") >= 1.0, "replay not counted:\n{m}");
        assert_eq!(
            engine.state().request(&victim).and_then(|r| r.ended),
            Some(EndKind::Length)
        );
    })
    .await
    .unwrap();
}
