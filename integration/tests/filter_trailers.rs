//! A response that ends with trailers (HTTP/1.1 chunked trailers, passed on by the
//! upstream cluster's `enable_trailers`) reaches the filter's end of stream through
//! `on_http_response_trailers`: it completes, with no abort, even without `[DONE]`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client;
use kvguard_integration::envoy::UPSTREAM_CLUSTER;
use kvguard_integration::sim::SimConfig;
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

const EVENTS: usize = 3;

/// An HTTP/1.1 upstream whose SSE responses (no `[DONE]`) end with a trailer (one
/// response per connection).
async fn trailer_upstream() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let Ok(_) = read_head(&mut s).await else {
                    return;
                };
                let mut out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\ntrailer: x-stream-status\r\nconnection: close\r\n\r\n".to_vec();
                for i in 0..EVENTS {
                    let ev = format!("data: {{\"choices\":[{{\"index\":0,\"text\":\"t{i}\",\"finish_reason\":null}}]}}\n\n");
                    out.extend_from_slice(format!("{:x}\r\n{ev}\r\n", ev.len()).as_bytes());
                    if s.write_all(&out).await.is_err() {
                        return;
                    }
                    out.clear();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let _ = s.write_all(b"0\r\nx-stream-status: ok\r\n\r\n").await;
                let _ = s.shutdown().await;
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_ending_in_trailers_completes() {
    bounded("trailers", T, async {
        let (up, task) = trailer_upstream().await;
        let r = rig_with(SimConfig::default(), json!({}), |o| {
            o.upstream = up;
            o.patch = Some(Arc::new(|b| {
                let clusters = b["static_resources"]["clusters"].as_array_mut().unwrap();
                let c = clusters
                    .iter_mut()
                    .find(|c| c["name"] == UPSTREAM_CLUSTER)
                    .unwrap();
                c["typed_extension_protocol_options"] = json!({
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http_protocol_options": {"enable_trailers": true}}
                    }
                });
            }));
        })
        .await;
        for http2 in [false, true] {
            let mut s = client::stream_sse(
                r.envoy.listener_addr(),
                "/v1/completions",
                &completion(8, true),
                &[],
                http2,
            )
            .await
            .unwrap();
            let ev = s.collect(W).await.unwrap();
            assert_eq!(ev.len(), EVENTS, "the whole stream arrived: {ev:?}");
        }
        // Both requests: completed at their end, no abort.
        let log_has_two = || {
            r.envoy
                .log()
                .lines()
                .filter(|l| l.starts_with("ACCESS"))
                .count()
                >= 2
        };
        kvguard_integration::wait::poll_until("two access lines", W, Duration::from_millis(50), || {
            log_has_two().then_some(())
        })
        .await
        .unwrap();
        for line in r.envoy.log().lines().filter(|l| l.starts_with("ACCESS")) {
            assert!(line.trim_end().ends_with("outcome=completed"), "{line}");
        }
        r.recv
            .expect_no_more_calls(0, Duration::from_millis(1000))
            .await
            .unwrap();
        assert_eq!(stat(&r.envoy, "kvguard_filter_requests_completed_total").await, 2.0);
        // Envoy prefixes the plugin's lines itself: the filter adds no second prefix.
        let log = r.envoy.log();
        assert!(log.contains("kvguard kvguard: configured: mode=enforce"), "{log}");
        assert!(!log.contains("kvguard: kvguard:"), "doubled log prefix:\n{log}");
        assert_vm_healthy(&r.envoy);
        task.abort();
    })
    .await
    .unwrap();
}
