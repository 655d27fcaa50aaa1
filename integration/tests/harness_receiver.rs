//! The mock abort endpoint answers per contract §3.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_contract::signature::{self, SignatureError};
use kvguard_contract::{AbortReason, AbortRequest, Domain, Key, RequestId};
use kvguard_integration::client;
use kvguard_integration::receiver::{self, Behaviour, IdPolicy, ReceiverConfig};
use kvguard_integration::wait::bounded;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const T: Duration = Duration::from_secs(20);

fn key() -> Key {
    Key::try_new(b"kvguard-test-key-0123456789abcdef").unwrap()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn abort_body(id: &str) -> Vec<u8> {
    AbortRequest::new(
        &RequestId::try_new(id.as_bytes()).unwrap(),
        AbortReason::DownstreamReset,
        12,
        3,
    )
    .to_json()
}

async fn send(addr: std::net::SocketAddr, body: &[u8], sig: Option<String>) -> client::Resp {
    let mut headers = vec![];
    if let Some(s) = &sig {
        headers.push(("x-kvguard-signature", s.as_str()));
    }
    client::request(
        addr,
        hyper::Method::POST,
        "/v1/abort",
        &headers,
        body.to_vec(),
        false,
        T,
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_answers_per_contract() {
    bounded("receiver verify", T, async {
        let other = Key::try_new(b"another-key-another-key").unwrap();
        let rx = receiver::spawn(ReceiverConfig::new(vec![other, key()]))
            .await
            .unwrap();
        let addr = rx.addr();
        let b = abort_body("r1");
        // In flight: 200 aborted; same body signed again (new signature): already_aborted.
        let r = send(
            addr,
            &b,
            Some(signature::sign(Domain::Abort, &key(), now(), &b)),
        )
        .await;
        assert_eq!(r.status, 200);
        assert_eq!(
            r.text(),
            r#"{"request_id":"r1","found":true,"aborted":true}"#
        );
        let sig = signature::sign(Domain::Abort, &key(), now() - 1, &b);
        let r = send(addr, &b, Some(sig.clone())).await;
        assert_eq!(
            r.text(),
            r#"{"request_id":"r1","found":true,"already_aborted":true}"#
        );
        // Replay of that exact signature: 409.
        assert_eq!(send(addr, &b, Some(sig)).await.status, 409);
        // Missing, stale, wrong key: 401.
        assert_eq!(send(addr, &b, None).await.status, 401);
        assert_eq!(
            send(
                addr,
                &b,
                Some(signature::sign(Domain::Abort, &key(), now() - 100, &b))
            )
            .await
            .status,
            401
        );
        let stranger = Key::try_new(b"not-a-configured-key-at-all").unwrap();
        assert_eq!(
            send(
                addr,
                &b,
                Some(signature::sign(Domain::Abort, &stranger, now(), &b))
            )
            .await
            .status,
            401
        );
        // Signed but malformed: 400.
        let bad = br#"{"request_id":"a b","reason":"stalled"}"#;
        assert_eq!(
            send(
                addr,
                bad,
                Some(signature::sign(Domain::Abort, &key(), now(), bad))
            )
            .await
            .status,
            400
        );
        let calls = rx.wait_for_calls(7, T).await.unwrap();
        let statuses: Vec<_> = calls.iter().map(|c| c.status.unwrap()).collect();
        assert_eq!(statuses, [200, 200, 409, 401, 401, 401, 400]);
        assert_eq!(calls[3].verify, Some(Err(SignatureError::Missing)));
        assert_eq!(calls[4].verify, Some(Err(SignatureError::Stale)));
        assert_eq!(calls[5].verify, Some(Err(SignatureError::Mismatch)));
        assert_eq!(calls[0].request_id(), Some("r1"));
        assert_eq!(calls[0].abort.as_ref().unwrap().tokens, 3);
        assert_eq!(calls[0].path, "/v1/abort");
        assert!(calls[0].headers.contains_key("x-kvguard-signature"));
        assert_eq!(rx.calls_for("r1").len(), 6);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_ids_get_404_and_a_tombstone() {
    bounded("receiver tombstones", T, async {
        let mut cfg = ReceiverConfig::new(vec![key()]);
        cfg.ids = IdPolicy::Registered;
        let rx = receiver::spawn(cfg).await.unwrap();
        assert!(rx.register("known"));
        let b = abort_body("known");
        let r = send(
            rx.addr(),
            &b,
            Some(signature::sign(Domain::Abort, &key(), now(), &b)),
        )
        .await;
        assert_eq!(
            (r.status, r.json().unwrap()["aborted"].as_bool()),
            (200, Some(true))
        );
        let b = abort_body("late");
        let r = send(
            rx.addr(),
            &b,
            Some(signature::sign(Domain::Abort, &key(), now(), &b)),
        )
        .await;
        assert_eq!(r.status, 404);
        assert_eq!(r.text(), r#"{"request_id":"late","found":false}"#);
        assert!(!rx.register("late"), "a tombstone refuses the id");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behaviours_status_delay_close() {
    bounded("receiver behaviours", T, async {
        let rx = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let b = abort_body("x1");
        rx.set_behaviour(Behaviour::Status(503));
        assert_eq!(send(rx.addr(), &b, None).await.status, 503);
        rx.set_behaviour(Behaviour::Delay(Duration::from_millis(300)));
        let t0 = std::time::Instant::now();
        let r = send(
            rx.addr(),
            &b,
            Some(signature::sign(Domain::Abort, &key(), now(), &b)),
        )
        .await;
        assert_eq!(r.status, 200);
        assert!(t0.elapsed() >= Duration::from_millis(300));
        rx.set_behaviour(Behaviour::Close);
        let err = client::request(
            rx.addr(),
            hyper::Method::POST,
            "/v1/abort",
            &[],
            b.clone(),
            false,
            T,
        )
        .await;
        assert!(err.is_err(), "the connection is dropped without an answer");
        let calls = rx.wait_for_calls(3, T).await.unwrap();
        assert_eq!(
            calls.iter().map(|c| c.status).collect::<Vec<_>>(),
            [Some(503), Some(200), None]
        );
        assert_eq!(calls[0].verify, None);
        assert!(rx
            .wait_for_calls(4, Duration::from_millis(100))
            .await
            .is_err());
    })
    .await
    .unwrap();
}
