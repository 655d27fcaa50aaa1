//! Header hygiene and key rotation in a real Envoy: a client's `x-kvguard-control`,
//! `x-kvguard-signature` and `x-kvguard-instance` request headers never reach the
//! upstream, on tracked and untracked paths; the response stamp never reaches the client;
//! a stamp signed with the second key of the rotation list is used; a stamp naming a port
//! outside `control_target_ports` is not.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_contract::{stamp, Key, RequestId};
use kvguard_integration::client;
use kvguard_integration::envoy::{Envoy, CONTROL_TARGET_CLUSTER};
use kvguard_integration::receiver::{self, ReceiverConfig};
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

const NEXT: &str = "the-next-kvguard-secret-0123456789";

/// An upstream that records each request head and answers SSE stamped for `stamp_addr`
/// with `key`, 50 events 50 ms apart, then `[DONE]`.
async fn stamping_upstream(
    stamp_addr: SocketAddr,
    key: Key,
) -> (
    SocketAddr,
    Arc<Mutex<Vec<String>>>,
    tokio::task::JoinHandle<()>,
) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let (seen, key) = (seen.clone(), key.clone());
            tokio::spawn(async move {
                let Ok((head, _)) = read_head(&mut s).await else {
                    return;
                };
                let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
                // The lease's in-band renewal (contract §8) is not a request under test.
                if text.starts_with("post /v1/kvguard/lease ") {
                    return;
                }
                let id = text
                    .lines()
                    .find_map(|l| l.strip_prefix("x-request-id:"))
                    .map(|v| v.trim().to_owned())
                    .unwrap_or_default();
                seen.lock().unwrap().push(text);
                let st = stamp::stamp(
                    &key,
                    stamp_addr,
                    &RequestId::try_new(id.as_bytes()).unwrap(),
                    now_unix(),
                );
                let out = format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\nx-kvguard-control: {st}\r\n\r\n");
                if s.write_all(out.as_bytes()).await.is_err() {
                    return;
                }
                for i in 0..=50 {
                    let ev = if i == 50 {
                        "data: [DONE]\n\n".to_owned()
                    } else {
                        format!("data: {{\"t\":{i}}}\n\n")
                    };
                    if s.write_all(format!("{:x}\r\n{ev}\r\n", ev.len()).as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let _ = s.write_all(b"0\r\n\r\n").await;
                let _ = s.shutdown().await;
            });
        }
    });
    (addr, heads, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_headers_are_stripped_and_stamps_follow_rotation_and_ports() {
    bounded("headers", T, async {
        let next = Key::try_new(NEXT.as_bytes()).unwrap();
        let replica = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let fallback = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        // (stamp port allowed?, the stamp's key): signed with the rotation list's second
        // key and naming an allowed port → the replica; naming another port → fallback.
        for (allowed, name) in [(true, "allowed port"), (false, "port not allowed")] {
            let (up, heads, task) = stamping_upstream(replica.addr(), next.clone()).await;
            let ports = if allowed {
                vec![replica.addr().port()]
            } else {
                vec![9902]
            };
            let mut o = options(
                up,
                fallback.addr(),
                json!({"control_target_cluster": CONTROL_TARGET_CLUSTER,
                       "control_target_cidrs": ["127.0.0.0/8"], "control_target_ports": ports}),
            );
            o = o.vm_env("KVGUARD_SECRET", &format!("{SECRET}\n{NEXT}"));
            o.original_dst_cluster = Some(CONTROL_TARGET_CLUSTER.into());
            let envoy = Envoy::start(o).await.unwrap();
            let hdrs = [
                ("x-kvguard-control", "127.0.0.1:1;t=1;sig=00"),
                ("x-kvguard-signature", "t=1,v1=00"),
            ];
            // A healthy stream first: completes, no stamp leaks either way.
            let mut s = client::stream_sse(
                envoy.listener_addr(),
                "/v1/completions",
                &completion(8, true),
                &hdrs,
                false,
            )
            .await
            .unwrap();
            assert!(
                s.header("x-kvguard-control").is_none(),
                "{name}: the stamp reached the client"
            );
            let ev = s.collect(W).await.unwrap();
            assert!(ev.last().is_some_and(|e| e.is_done()), "{name}: {ev:?}");
            // Then one that leaves: its abort goes where the stamp allows.
            let mut s = client::stream_sse(
                envoy.listener_addr(),
                "/v1/completions",
                &completion(8, true),
                &hdrs,
                true,
            )
            .await
            .unwrap();
            s.read_events(2, W).await.unwrap();
            s.disconnect();
            let target = if allowed { &replica } else { &fallback };
            let calls = target.wait_for_calls(1, W).await.unwrap();
            assert_eq!(
                calls[0].verify,
                Some(Ok(())),
                "{name}: signed with the first key"
            );
            if !allowed {
                envoy
                    .wait_stat(
                        "kvguard_filter_stamp_rejected_total_cause=.=port_not_allowed;.;",
                        W,
                        |v| v >= 1.0,
                    )
                    .await
                    .unwrap();
            }
            assert_eq!(
                stat(
                    &envoy,
                    "kvguard_filter_stamp_rejected_total_cause=.=mismatch;.;"
                )
                .await,
                0.0,
                "{name}: the second rotation key verifies"
            );
            for h in heads.lock().unwrap().iter() {
                assert!(
                    !h.contains("x-kvguard-control"),
                    "{name}: reached the upstream: {h}"
                );
                assert!(
                    !h.contains("x-kvguard-signature"),
                    "{name}: reached the upstream: {h}"
                );
            }
            assert_eq!(heads.lock().unwrap().len(), 2);
            assert_vm_healthy(&envoy);
            drop(envoy);
            replica.clear_calls();
            fallback.clear_calls();
            task.abort();
        }
    })
    .await
    .unwrap();
}

/// A client's `x-kvguard-control`, `x-kvguard-signature` (twice) and `x-kvguard-instance`
/// never reach the upstream, on a path kvguard tracks and on one it does not, over HTTP/1.1
/// and HTTP/2 (contract §3, §8): the filter finds them in one copy of the request's header
/// map and strips each it finds (the harness has no `header_mutation` doing it first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_kvguard_headers_are_stripped_on_tracked_and_untracked_paths() {
    bounded("client headers", T, async {
        let rx = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let (up, heads, task) = stamping_upstream(rx.addr(), key()).await;
        let envoy = Envoy::start(options(up, rx.addr(), json!({})))
            .await
            .unwrap();
        let hdrs = [
            ("x-kvguard-control", "127.0.0.1:1;t=1;sig=00"),
            ("x-kvguard-signature", "t=1,v1=00"),
            ("x-kvguard-signature", "t=2,v1=11"),
            ("x-kvguard-instance", "forged-instance-tag"),
        ];
        let mut sent = 0;
        for http2 in [false, true] {
            for path in ["/v1/completions", "/v1/untracked-by-kvguard"] {
                let mut s = client::stream_sse(
                    envoy.listener_addr(),
                    path,
                    &completion(8, true),
                    &hdrs,
                    http2,
                )
                .await
                .unwrap();
                let ev = s.collect(W).await.unwrap();
                assert!(
                    ev.last().is_some_and(|e| e.is_done()),
                    "{path} (h2 {http2}): {ev:?}"
                );
                sent += 1;
            }
        }
        let heads = heads.lock().unwrap().clone();
        assert_eq!(heads.len(), sent, "{heads:?}");
        for h in &heads {
            for bad in [
                "x-kvguard-control",
                "x-kvguard-signature",
                "forged-instance-tag",
            ] {
                assert!(!h.contains(bad), "{bad} reached the upstream: {h}");
            }
        }
        // The tracked path was tracked (twice), the other one not.
        envoy
            .wait_stat("kvguard_filter_requests_tracked_total", W, |v| v == 2.0)
            .await
            .unwrap();
        assert_vm_healthy(&envoy);
        task.abort();
    })
    .await
    .unwrap();
}
