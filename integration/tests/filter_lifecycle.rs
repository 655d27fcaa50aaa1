//! The kvguard filter in a real Envoy: completion, disconnects (while waiting and
//! mid-stream, HTTP/1.1 and HTTP/2), stalls, first-token timeout, max age, observe mode,
//! non-UTF-8 header bytes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use hyper::Method;
use kvguard_integration::client;
use kvguard_integration::sim::{EndKind, SimConfig};
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::time::Duration;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_completion_sends_no_abort() {
    bounded("normal completion", T, async {
        let r = rig(SimConfig::default(), json!({})).await;
        for http2 in [false, true] {
            let mut s = client::stream_sse(
                r.envoy.listener_addr(),
                "/v1/chat/completions",
                &chat(8),
                &[],
                http2,
            )
            .await
            .unwrap();
            assert_eq!(s.status, 200);
            let ev = s.collect(W).await.unwrap();
            assert!(ev.last().unwrap().is_done(), "{ev:?}");
            let id = last_id(&r.sim);
            assert_eq!(access_outcome(&r.envoy, &id).await, "completed");
        }
        // A non-streaming request and an untracked path.
        let resp = client::post_json(
            r.envoy.listener_addr(),
            "/v1/completions",
            &completion(4, false),
            &[],
        )
        .await
        .unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
        let id = last_id(&r.sim);
        assert_eq!(access_outcome(&r.envoy, &id).await, "completed");
        let m = client::get(r.envoy.listener_addr(), "/v1/models")
            .await
            .unwrap();
        assert_eq!(m.status, 200);
        r.envoy
            .wait_stat("kvguard_filter_requests_completed_total", W, |v| v >= 3.0)
            .await
            .unwrap();
        assert_eq!(
            stat(&r.envoy, "kvguard_filter_requests_tracked_total").await,
            3.0
        );
        r.envoy
            .wait_stat("kvguard_filter_active_requests", W, |v| v == 0.0)
            .await
            .unwrap();
        r.recv
            .expect_no_more_calls(0, Duration::from_millis(800))
            .await
            .unwrap();
        // Untracked: no filter state is written (contract §7), the access log shows `-`.
        let log = r.envoy.log();
        assert!(
            log.lines()
                .any(|l| l.contains("/v1/models") && l.contains("outcome=-")),
            "{log}"
        );
        assert!(!log.contains("outcome=untracked"), "{log}");
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_mid_stream_sends_one_signed_abort() {
    bounded("disconnect mid-stream", T, async {
        let r = rig(
            SimConfig {
                token_rate: 20.0,
                ..SimConfig::default()
            },
            json!({}),
        )
        .await;
        let mut s = client::stream_sse(
            r.envoy.listener_addr(),
            "/v1/completions",
            &completion(1000, true),
            &[],
            false,
        )
        .await
        .unwrap();
        s.read_events(3, W).await.unwrap();
        let id = last_id(&r.sim);
        s.disconnect();
        let calls = r.recv.wait_for_calls(1, W).await.unwrap();
        let c = &calls[0];
        assert_eq!(c.path, "/v1/abort");
        assert_eq!(c.method, "POST");
        assert_eq!(c.request_id(), Some(id.as_str()));
        let a = c.abort.as_ref().unwrap();
        assert_eq!(a.reason.as_str(), "downstream_reset");
        assert!(a.tokens >= 3, "{a:?}");
        assert_eq!(c.verify, Some(Ok(())));
        assert_eq!(c.status, Some(200));
        assert_eq!(
            access_outcome(&r.envoy, &id).await,
            "aborted:downstream_reset"
        );
        r.envoy
            .wait_stat(&aborts("downstream_reset", "aborted"), W, |v| v == 1.0)
            .await
            .unwrap();
        r.envoy
            .wait_stat("kvguard_filter_pending_aborts", W, |v| v == 0.0)
            .await
            .unwrap();
        r.recv
            .expect_no_more_calls(1, Duration::from_millis(800))
            .await
            .unwrap();
        let log = r.envoy.log();
        assert!(
            log.contains(&format!(
                "kvguard: abort request_id={id} reason=downstream_reset outcome=aborted"
            )),
            "{log}"
        );
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_before_response_headers_sends_abort() {
    bounded("disconnect while waiting", T, async {
        let r = rig(SimConfig::default(), json!({})).await;
        // Non-streaming: the simulator answers only when done (30 s from now), so the
        // response head never reaches Envoy; the client gives up after 500 ms.
        let res = client::request(
            r.envoy.listener_addr(),
            Method::POST,
            "/v1/completions",
            &[("x-sim-delay-first-ms", "30000")],
            serde_json::to_vec(&completion(4, false)).unwrap(),
            false,
            Duration::from_millis(500),
        )
        .await;
        assert!(res.is_err(), "the client timed out");
        let id = last_id(&r.sim);
        let calls = r.recv.wait_for_calls(1, W).await.unwrap();
        assert_eq!(calls[0].request_id(), Some(id.as_str()));
        let a = calls[0].abort.as_ref().unwrap();
        assert_eq!((a.reason.as_str(), a.tokens), ("downstream_reset", 0));
        assert_eq!(
            access_outcome(&r.envoy, &id).await,
            "aborted:downstream_reset"
        );
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_downstream_reset_and_completion() {
    bounded("http2", T, async {
        let r = rig(
            SimConfig {
                token_rate: 20.0,
                ..SimConfig::default()
            },
            json!({}),
        )
        .await;
        // Two streams on one h2 connection would need a shared client; one at a time.
        let mut s = client::stream_sse(
            r.envoy.listener_addr(),
            "/v1/chat/completions",
            &chat(1000),
            &[],
            true,
        )
        .await
        .unwrap();
        s.read_events(2, W).await.unwrap();
        let id = last_id(&r.sim);
        let conn = s.reset_stream();
        let calls = r.recv.wait_for_calls(1, W).await.unwrap();
        assert_eq!(calls[0].request_id(), Some(id.as_str()));
        assert_eq!(
            calls[0].abort.as_ref().unwrap().reason.as_str(),
            "downstream_reset"
        );
        conn.abort();
        let outcome = access_outcome(&r.envoy, &id).await;
        assert_eq!(outcome, "aborted:downstream_reset");
        let log = r.envoy.log();
        let line = log
            .lines()
            .find(|l| l.starts_with("ACCESS") && l.contains(&id))
            .unwrap();
        eprintln!("h2 reset access line: {line}");
        // Envoy 1.40: an h2 RST_STREAM from the client is `http2.remote_reset`, flag DR.
        assert!(line.contains(" DR http2.remote_reset "), "{line}");
        assert!(
            log.contains("ended early (code_details=\"http2.remote_reset\", flags=0x10000000)"),
            "{log}"
        );
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_only_stall_is_reaped() {
    bounded("stall", T, async {
        let r = rig(
            SimConfig {
                stall_keepalive_ms: 200,
                ..SimConfig::default()
            },
            json!({"idle_timeout_ms": 1500}),
        )
        .await;
        let mut s = client::stream_sse(
            r.envoy.listener_addr(),
            "/v1/completions",
            &completion(1000, true),
            &[("x-sim-stall-after", "3")],
            false,
        )
        .await
        .unwrap();
        let t0 = std::time::Instant::now();
        let id = last_id(&r.sim);
        // Tokens, then keep-alives only: the stream ends when the filter closes it.
        let end = s
            .wait_end(W)
            .await
            .unwrap_or_else(|e| panic!("the stalled stream was not closed: {e:#}"));
        let took = t0.elapsed();
        // The simulator's keep-alives (every 200 ms) reached the client: the stall is one
        // of data, not of bytes.
        let keepalives = end
            .events
            .iter()
            .filter(|e| e.comment && e.raw.contains("keep-alive"))
            .count();
        assert!(keepalives >= 2, "{keepalives} keep-alives: {end:?}");
        assert!(!end.saw_done(), "{end:?}");
        eprintln!("stalled stream ended after {took:?}: {end:?}");
        assert!(took >= Duration::from_millis(1400), "{took:?}");
        let calls = r.recv.wait_for_calls(1, W).await.unwrap();
        assert_eq!(calls[0].request_id(), Some(id.as_str()));
        let a = calls[0].abort.as_ref().unwrap();
        assert_eq!((a.reason.as_str(), a.tokens), ("stalled", 3));
        assert_eq!(access_outcome(&r.envoy, &id).await, "aborted:stalled");
        let log = r.envoy.log();
        let line = log
            .lines()
            .find(|l| l.starts_with("ACCESS") && l.contains(&id))
            .unwrap();
        eprintln!("tick-closed stream access line: {line}");
        r.envoy
            .wait_stat("kvguard_filter_streams_closed_total", W, |v| v == 1.0)
            .await
            .unwrap();
        // The simulator saw its client go: the stream was really closed.
        let st = r
            .sim
            .wait_state("sequence ended", W, |s| s.is_idle())
            .await
            .unwrap();
        assert_eq!(st.request(&id).unwrap().ended, Some(EndKind::Disconnected));
        r.recv
            .expect_no_more_calls(1, Duration::from_millis(800))
            .await
            .unwrap();
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_token_timeout_and_max_age() {
    bounded("first token / max age", T, async {
        let r = rig(
            SimConfig {
                token_rate: 20.0,
                ..SimConfig::default()
            },
            json!({"first_token_timeout_ms": 800, "max_age_ms": 2500, "idle_timeout_ms": 0}),
        )
        .await;
        // No token for 30 s: first-token timeout.
        let mut s = client::stream_sse(
            r.envoy.listener_addr(),
            "/v1/completions",
            &completion(1000, true),
            &[("x-sim-delay-first-ms", "30000")],
            false,
        )
        .await
        .unwrap();
        let id1 = last_id(&r.sim);
        let end = s
            .wait_end(W)
            .await
            .unwrap_or_else(|e| panic!("the aborted stream hangs: {e:#}"));
        assert!(!end.saw_done(), "{end:?}");
        let calls = r.recv.wait_for_calls(1, W).await.unwrap();
        let a = calls[0].abort.as_ref().unwrap();
        assert_eq!(
            (calls[0].request_id(), a.reason.as_str()),
            (Some(id1.as_str()), "first_token_timeout")
        );
        assert!(a.age_ms >= 800, "{a:?}");
        assert_eq!(
            access_outcome(&r.envoy, &id1).await,
            "aborted:first_token_timeout"
        );
        // Steady tokens (20/s) for longer than max age: closed at ~2.5 s.
        let mut s = client::stream_sse(
            r.envoy.listener_addr(),
            "/v1/completions",
            &completion(1000, true),
            &[],
            false,
        )
        .await
        .unwrap();
        let id2 = last_id(&r.sim);
        let t0 = std::time::Instant::now();
        let end = s
            .wait_end(W)
            .await
            .unwrap_or_else(|e| panic!("the aborted stream hangs: {e:#}"));
        assert!(!end.saw_done(), "{end:?}");
        assert!(
            t0.elapsed() >= Duration::from_millis(2000),
            "{:?}",
            t0.elapsed()
        );
        let calls = r.recv.wait_for_calls(2, W).await.unwrap();
        let a = calls[1].abort.as_ref().unwrap();
        assert_eq!(
            (calls[1].request_id(), a.reason.as_str()),
            (Some(id2.as_str()), "max_age")
        );
        assert!(a.tokens > 10, "{a:?}");
        assert_eq!(access_outcome(&r.envoy, &id2).await, "aborted:max_age");
        r.envoy
            .wait_stat("kvguard_filter_streams_closed_total", W, |v| v == 2.0)
            .await
            .unwrap();
        r.recv
            .expect_no_more_calls(2, Duration::from_millis(800))
            .await
            .unwrap();
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_mode_counts_and_logs_but_sends_and_closes_nothing() {
    bounded("observe", T, async {
        let r = rig(
            SimConfig {
                stall_keepalive_ms: 200,
                ..SimConfig::default()
            },
            json!({"mode": "observe", "idle_timeout_ms": 800}),
        )
        .await;
        let mut s = client::stream_sse(
            r.envoy.listener_addr(),
            "/v1/completions",
            &completion(1000, true),
            &[("x-sim-stall-after", "2")],
            false,
        )
        .await
        .unwrap();
        let id = last_id(&r.sim);
        r.envoy
            .wait_stat(
                "kvguard_filter_would_abort_total_reason=.=stalled;.;",
                W,
                |v| v == 1.0,
            )
            .await
            .unwrap();
        // Still open: keep-alives keep coming well after the idle timeout.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let more = s.next_chunk(Duration::from_secs(3)).await.unwrap();
        assert!(more.is_some(), "the stream is still open");
        s.disconnect();
        assert_eq!(access_outcome(&r.envoy, &id).await, "observed:stalled");
        r.recv
            .expect_no_more_calls(0, Duration::from_millis(1000))
            .await
            .unwrap();
        assert_eq!(
            stat(&r.envoy, "kvguard_filter_streams_closed_total").await,
            0.0
        );
        assert!(r
            .envoy
            .log()
            .contains(&format!("would abort request_id={id} reason=stalled")));
        assert_vm_healthy(&r.envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_utf8_header_bytes_do_not_crash_the_vm() {
    bounded("non-utf8", T, async {
        let up = scripted_upstream(Script {
            stamp: Stamp::Raw(b"10.0.0.1:9902;t=1;sig=\xff\xfe".to_vec()),
            content_type: b"text/event-stream; x=\xff\xfe".to_vec(),
            extra_headers: b"x-odd: \xc3\x28\xa0\xa1\r\n".to_vec(),
            events: 3,
            interval: Duration::from_millis(20),
            reset_after: None,
        })
        .await;
        let recv = kvguard_integration::receiver::spawn(kvguard_integration::receiver::ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let envoy = kvguard_integration::envoy::Envoy::start(options(
            up.addr,
            recv.addr(),
            json!({"control_target_cluster": "kvguard_control_target", "control_target_cidrs": ["127.0.0.0/8"]}),
        ))
        .await
        .unwrap();
        let body = br#"{"prompt":"x","stream":true}"#;
        let mut req = Vec::new();
        req.extend_from_slice(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n");
        req.extend_from_slice(b"x-junk: \xff\xfe\xfd\x80\r\nuser-agent: caf\xe9\r\n");
        req.extend_from_slice(format!("content-length: {}\r\nconnection: close\r\n\r\n", body.len()).as_bytes());
        req.extend_from_slice(body);
        for _ in 0..3 {
            let out = raw_request(envoy.listener_addr(), &req, W).await;
            let text = String::from_utf8_lossy(&out).into_owned();
            assert!(text.starts_with("HTTP/1.1 200"), "{text}");
            assert!(text.contains("[DONE]"), "{text}");
            assert!(!text.to_ascii_lowercase().contains("x-kvguard-control"), "{text}");
        }
        envoy.wait_stat("kvguard_filter_requests_tracked_total", W, |v| v == 3.0).await.unwrap();
        envoy
            .wait_stat("kvguard_filter_stamp_rejected_total_cause=.=malformed;.;", W, |v| v == 3.0)
            .await
            .unwrap();
        envoy.wait_stat("kvguard_filter_requests_completed_total", W, |v| v == 3.0).await.unwrap();
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_route_timeout_and_upstream_reset_send_aborts() {
    bounded("route timeout / upstream reset", T, async {
        // A 1 s route timeout: Envoy answers 504 itself (flag UT, response_timeout); its
        // local reply's end of stream is not the upstream's, so the request is aborted.
        let r = rig_with(SimConfig::default(), json!({}), |o| {
            o.patch = Some(std::sync::Arc::new(|b: &mut serde_json::Value| {
                let route = b.pointer_mut(
                    "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes/0/route",
                );
                if let Some(route) = route {
                    route["timeout"] = json!("1s");
                }
            }));
        })
        .await;
        let resp = client::request(
            r.envoy.listener_addr(),
            Method::POST,
            "/v1/completions",
            &[("x-sim-delay-first-ms", "30000")],
            serde_json::to_vec(&completion(4, false)).unwrap(),
            false,
            W,
        )
        .await
        .unwrap();
        assert_eq!(resp.status, 504);
        let id = last_id(&r.sim);
        let calls = r.recv.wait_for_calls(1, W).await.unwrap();
        assert_eq!(calls[0].request_id(), Some(id.as_str()));
        assert_eq!(calls[0].abort.as_ref().unwrap().reason.as_str(), "timeout");
        assert_eq!(access_outcome(&r.envoy, &id).await, "aborted:timeout");
        drop(r);

        // The upstream connection drops mid-stream.
        let up = scripted_upstream(Script { reset_after: Some(3), interval: Duration::from_millis(30), ..Script::default() }).await;
        let recv = kvguard_integration::receiver::spawn(kvguard_integration::receiver::ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let envoy = kvguard_integration::envoy::Envoy::start(options(up.addr, recv.addr(), json!({}))).await.unwrap();
        let mut s = client::stream_sse(envoy.listener_addr(), "/v1/completions", &completion(100, true), &[], false)
            .await
            .unwrap();
        let end = s.wait_end(W).await.unwrap_or_else(|e| panic!("the aborted stream hangs: {e:#}"));
        assert!(!end.saw_done(), "{end:?}");
        let calls = recv.wait_for_calls(1, W).await.unwrap();
        let a = calls[0].abort.as_ref().unwrap();
        assert_eq!((a.reason.as_str(), a.tokens), ("upstream_reset", 3));
        let log = envoy.log();
        let line = log.lines().find(|l| l.starts_with("ACCESS") && l.contains("outcome=aborted:upstream_reset"));
        let line = match line {
            Some(l) => l.to_owned(),
            None => {
                wait_log(&envoy, "outcome=aborted:upstream_reset").await;
                envoy.log().lines().find(|l| l.contains("outcome=aborted:upstream_reset")).unwrap().to_owned()
            }
        };
        eprintln!("upstream reset access line: {line}");
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}
