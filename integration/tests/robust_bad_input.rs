//! Bad input through the real stack (Envoy + the kvguard filter + a raw upstream / the
//! simulator + a verifying abort receiver): malformed SSE, a 1 MiB event, binary garbage,
//! gzip bodies, wrong and missing content types, CR/CRLF framing, hostile request ids
//! (60 KiB, CRLF-laden, duplicated, missing), HTTP/2 resets before the response head,
//! mid-event and after `[DONE]`.
//!
//! Documented behaviour (docs/ROBUSTNESS.md): the filter never changes a byte of the
//! body, never aborts a request whose upstream completed, counts what it skips
//! (`parse_anomalies_total{kind=oversized_event|compressed|opaque_body}`), the VM never
//! crashes; Envoy mints every id (client ids never reach the engine); a stream the client
//! resets before the upstream's end gets exactly one `downstream_reset` abort unless the
//! body already said it was complete.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "robust_support.rs"]
mod rsupport;
#[path = "filter_support.rs"]
mod support;

use hyper_util::rt::TokioIo;
use kvguard_integration::client;
use kvguard_integration::envoy::Envoy;
use kvguard_integration::receiver::{self, ReceiverConfig};
use kvguard_integration::wait::{bounded, poll_until};
use rsupport::{event, healthy_sse, Answer, RawUpstream};
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;
use support::*;

fn sse(ct: &str, body: Vec<u8>, chunk: usize) -> Answer {
    Answer {
        headers: vec![format!("content-type: {ct}")],
        body,
        chunk,
        ..Answer::default()
    }
}

/// Deterministic pseudo-random bytes.
fn garbage(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn cases() -> HashMap<String, Answer> {
    let mut c = HashMap::new();
    let mut malformed = b"data:{not json\n\nevent\n:\n\r\r\ndata: {\"choices\":[{\"index\":\n\nretry: x\nid: \0\n\n".to_vec();
    malformed.extend_from_slice(
        b"data: {\"choices\":[{\"index\":99999999999999999999,\"finish_reason\":\"stop\"}]}\n\n",
    );
    malformed.extend_from_slice(&[b'd', b'a', b't', b'a', b':', 0xff, 0xfe, b'\n', b'\n']);
    c.insert("malformed".into(), sse("text/event-stream", malformed, 7));
    let mut huge = b"data: ".to_vec();
    huge.extend(std::iter::repeat_n(b'x', 1 << 20));
    huge.extend_from_slice(b"\n\n");
    huge.extend(healthy_sse(2));
    c.insert(
        "huge-event".into(),
        sse("text/event-stream", huge, 16 * 1024),
    );
    c.insert(
        "binary".into(),
        sse("text/event-stream", garbage(256 * 1024, 7), 4096),
    );
    let mut gz = vec![0x1f, 0x8b, 0x08, 0x00];
    gz.extend(garbage(64 * 1024, 9));
    let mut g = sse("text/event-stream", gz, 1000);
    g.headers.push("content-encoding: gzip".into());
    c.insert("gzip".into(), g);
    c.insert(
        "json-type".into(),
        sse("application/json", healthy_sse(5), 30),
    );
    c.insert(
        "no-type".into(),
        Answer {
            body: healthy_sse(5),
            chunk: 30,
            ..Answer::default()
        },
    );
    c.insert(
        "ndjson-garbage".into(),
        sse("application/x-ndjson", garbage(128 * 1024, 11), 3000),
    );
    let crlf: Vec<u8> = String::from_utf8(healthy_sse(4))
        .unwrap()
        .replace('\n', "\r\n")
        .into_bytes();
    c.insert(
        "crlf".into(),
        sse("text/event-stream; charset=utf-8", crlf, 5),
    );
    let cr: Vec<u8> = String::from_utf8(healthy_sse(4))
        .unwrap()
        .replace('\n', "\r")
        .into_bytes();
    c.insert("cr".into(), sse("TEXT/EVENT-STREAM", cr, 5));
    let mut many = Vec::new();
    for _ in 0..20_000 {
        many.extend_from_slice(b"data: x\n");
    }
    many.extend_from_slice(b"\n");
    many.extend(healthy_sse(1));
    c.insert("many-lines".into(), sse("text/event-stream", many, 8192));
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_pass_through_unchanged_and_are_never_aborted() {
    bounded("bad bodies", T, async {
        let cases = cases();
        let up = RawUpstream::start(cases.clone()).await;
        let recv = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let envoy = Envoy::start(options(
            up.addr,
            recv.addr(),
            json!({"idle_timeout_ms": 5000}),
        ))
        .await
        .unwrap();
        let body = chat(16);
        for http2 in [false, true] {
            for (name, a) in &cases {
                let h = [("x-case", name.as_str())];
                let mut s = client::stream_sse(
                    envoy.listener_addr(),
                    "/v1/chat/completions",
                    &body,
                    &h,
                    http2,
                )
                .await
                .unwrap_or_else(|e| panic!("{name}: {e:#}"));
                assert_eq!(s.status, 200, "{name}");
                let got = s
                    .collect_bytes(W)
                    .await
                    .unwrap_or_else(|e| panic!("{name} (h2 {http2}): {e:#}"));
                assert!(
                    got == a.body,
                    "{name} (h2 {http2}): body changed ({} bytes in, {} out)",
                    a.body.len(),
                    got.len()
                );
            }
        }
        // Every request completed from the upstream's point of view: no abort, ever. Wait
        // until Envoy is done with each (its access log line) and the filter tracks
        // nothing, then for a quiet period.
        for name in cases.keys() {
            for id in up.ids(name) {
                access_line(&envoy, &id).await;
            }
        }
        envoy
            .wait_stat("kvguard_filter_active_requests", W, |v| v == 0.0)
            .await
            .unwrap();
        let quiet = recv.expect_no_more_calls(0, QUIET).await;
        assert!(
            quiet.is_ok(),
            "aborts sent for healthy requests: {:?}",
            recv.calls()
                .iter()
                .map(|c| c.body.clone())
                .collect::<Vec<_>>()
        );
        for name in ["huge-event", "binary", "gzip", "crlf"] {
            for id in up.ids(name) {
                assert_eq!(access_outcome(&envoy, &id).await, "completed", "{name}");
            }
        }
        let anomalies = envoy.stats_matching("parse_anomalies").await.unwrap();
        let count = |k: &str| {
            anomalies
                .iter()
                .filter(|(n, _)| n.contains(k))
                .map(|(_, v)| *v)
                .sum::<f64>()
        };
        assert!(
            count("oversized") >= 2.0,
            "oversized events not counted: {anomalies:?}"
        );
        assert!(
            count("compressed") >= 2.0,
            "compressed bodies not counted: {anomalies:?}"
        );
        assert_eq!(stat(&envoy, "kvguard_filter_active_requests").await, 0.0);
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}

fn looks_minted(id: &str) -> bool {
    id.len() == 36 && id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_request_ids_never_reach_the_engine() {
    bounded("hostile ids", T, async {
        let mut cases = HashMap::new();
        cases.insert("ok".to_string(), sse("text/event-stream", healthy_sse(3), 0));
        let up = RawUpstream::start(cases).await;
        let recv = receiver::spawn(ReceiverConfig::new(vec![key()])).await.unwrap();
        let envoy = Envoy::start(options(up.addr, recv.addr(), json!({}))).await.unwrap();
        let addr = envoy.listener_addr();
        let big = "a".repeat(60 * 1024);
        let req = |extra: &str| {
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-case: ok\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n{extra}\r\n{{}}"
            )
            .into_bytes()
        };
        let attempts: Vec<(&str, Vec<u8>)> = vec![
            ("60 KiB id", req(&format!("x-request-id: {big}\r\n"))),
            ("obs-fold CRLF id", req("x-request-id: abc\r\n def\r\n")),
            ("bare CR in id", req("x-request-id: ab\rcd\r\n")),
            ("CRLF injected header", req("x-request-id: evil%0d%0ax-kvguard-signature: t=1\r\n")),
            ("duplicate ids", req("x-request-id: victim-1\r\nx-request-id: victim-2\r\n")),
            ("missing id", req("")),
            ("bad bytes id", req("x-request-id: {\"a\": 1}\r\n")),
        ];
        for (what, raw) in &attempts {
            let before = up.ids("ok").len();
            let out = raw_request(addr, raw, Duration::from_secs(10)).await;
            let head = String::from_utf8_lossy(&out[..out.len().min(200)]).into_owned();
            let status: u16 = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
            assert!(status == 200 || (400..500).contains(&status), "{what}: {head:?}");
            let ids = up.ids("ok");
            if status == 200 {
                let seen = ids.last().unwrap();
                assert!(looks_minted(seen), "{what}: the engine saw a client-chosen id {seen:?}");
            } else {
                assert_eq!(ids.len(), before, "{what}: refused ({status}) yet forwarded");
            }
            eprintln!("{what}: {status}");
        }
        // Traffic still flows, nothing was aborted, the VM is fine.
        let mut s = client::stream_sse(addr, "/v1/chat/completions", &chat(4), &[("x-case", "ok")], false)
            .await
            .unwrap();
        assert!(s.collect(W).await.unwrap().iter().any(|e| e.is_done()));
        assert!(recv.calls().is_empty());
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}

/// Sends one h2 request on its own connection; drops (RST_STREAM) the request future
/// after `after` if no response head came, keeping the connection open.
async fn h2_reset_before_head(addr: std::net::SocketAddr, case: &str, after: Duration) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let conn = tokio::spawn(conn);
    let req = hyper::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("x-case", case)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            b"{\"stream\":true}",
        )))
        .unwrap();
    let fut = sender.send_request(req);
    assert!(
        tokio::time::timeout(after, fut).await.is_err(),
        "the head came early"
    );
    // The stream is reset (dropped future); the connection stays until the test ends.
    tokio::time::sleep(Duration::from_millis(200)).await;
    conn.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_resets_at_every_phase() {
    bounded("h2 resets", T, async {
        let mut cases = HashMap::new();
        cases.insert(
            "slow-head".to_string(),
            Answer {
                head_delay: Duration::from_secs(3),
                ..sse("text/event-stream", healthy_sse(3), 0)
            },
        );
        let mut mid = Vec::new();
        mid.extend(event(0, false));
        mid.extend(event(1, false));
        let split = mid.len() + 100;
        mid.extend_from_slice(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"");
        mid.extend(std::iter::repeat_n(b'y', 64 * 1024));
        mid.extend_from_slice(b"\"},\"finish_reason\":null}]}\n\n");
        mid.extend(healthy_sse(1));
        cases.insert(
            "mid-event".to_string(),
            Answer {
                pause_at: Some(split),
                pause: Duration::from_secs(3),
                ..sse("text/event-stream", mid, 0)
            },
        );
        cases.insert(
            "after-done".to_string(),
            Answer {
                hold_end: Duration::from_secs(3),
                ..sse("text/event-stream", healthy_sse(3), 0)
            },
        );
        let up = RawUpstream::start(cases).await;
        let recv = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let envoy = Envoy::start(options(up.addr, recv.addr(), json!({})))
            .await
            .unwrap();
        let addr = envoy.listener_addr();

        // 1. Before the response head.
        h2_reset_before_head(addr, "slow-head", Duration::from_millis(500)).await;
        let id = poll_until("slow-head id", W, Duration::from_millis(20), || {
            up.ids("slow-head").pop()
        })
        .await
        .unwrap();
        let calls = recv.wait_calls_for(&id, W).await.unwrap();
        assert_eq!(
            calls[0].abort.as_ref().unwrap().reason.as_str(),
            "downstream_reset"
        );

        // 2. Mid-event: two events read, then the stream is reset inside the third.
        let mut s = client::stream_sse(
            addr,
            "/v1/chat/completions",
            &chat(4),
            &[("x-case", "mid-event")],
            true,
        )
        .await
        .unwrap();
        s.read_events(2, W).await.unwrap();
        // Every byte before the upstream's pause has arrived: the upstream is mid-event.
        while s.raw().len() < split {
            s.next_chunk(W)
                .await
                .unwrap()
                .expect("the stream ended before the pause");
        }
        let _conn = s.reset_stream();
        let id = up.ids("mid-event").pop().unwrap();
        let calls = recv.wait_calls_for(&id, W).await.unwrap();
        let a = calls[0].abort.as_ref().unwrap();
        assert_eq!(a.reason.as_str(), "downstream_reset");
        assert_eq!(a.tokens, 2, "events counted before the reset");

        // 3. After [DONE] (the upstream has not ended the stream yet): completed, no abort.
        let mut s = client::stream_sse(
            addr,
            "/v1/chat/completions",
            &chat(4),
            &[("x-case", "after-done")],
            true,
        )
        .await
        .unwrap();
        let evs = s.read_events(4, W).await.unwrap();
        assert!(evs.last().unwrap().is_done());
        let _conn2 = s.reset_stream();
        let id = up.ids("after-done").pop().unwrap();
        assert_eq!(access_outcome(&envoy, &id).await, "completed");
        let calls = recv
            .expect_no_more_calls(2, QUIET)
            .await
            .unwrap_or_else(|e| panic!("one abort per reset stream: {e:#}"));
        assert!(
            calls.iter().all(|c| c.request_id() != Some(id.as_str())),
            "a completed stream was aborted"
        );
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}
