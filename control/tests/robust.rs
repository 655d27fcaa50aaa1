//! kvguard-control under retries, slow clients, abusive admin callers and hung GPUs, on
//! real sockets (issue 11). Every wait is bounded; no sleep is used as synchronisation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvguard_control::admin::REQUEST_TIMEOUT;
use kvguard_control::config::AbortStrategy;
use kvguard_control::testing::HangingProbe;
use kvguard_control::{Deps, Server};
use kvguard_integration::client;
use kvguard_integration::sim::SimConfig;
use kvguard_integration::wait::{bounded, poll_until_async};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// Whole-test backstop: the slowest test here takes 4.6 s (measured, three runs), the others
/// 0.1-3.3 s.
const LIMIT: Duration = Duration::from_secs(20);

fn final_error(ev: &client::SseEvent) -> Option<String> {
    if ev.event.as_deref() != Some("error") {
        return None;
    }
    let j = ev.json()?;
    (j["error"]["type"] == "kvguard_aborted")
        .then(|| j["error"]["reason"].as_str().unwrap_or("").to_owned())
}

async fn stream(addr: SocketAddr, id: &str, tokens: u32) -> client::SseStream {
    client::stream_sse(
        addr,
        "/v1/completions",
        &completion(tokens),
        &[("x-request-id", id)],
        false,
    )
    .await
    .unwrap()
}

async fn inflight(admin: SocketAddr) -> u64 {
    client::get_json(admin, "/v1/requests").await.unwrap()["inflight"]
        .as_u64()
        .unwrap()
}

#[tokio::test]
async fn a_retry_supersedes_only_the_older_connection_per_strategy() {
    bounded("test", LIMIT, async {
        // 300 tokens at 200/s: each attempt runs 1.5 s, long enough to be superseded.
        let sim = sim(SimConfig {
            token_rate: 200.0,
            ..SimConfig::default()
        })
        .await;
        for strategy in [
            AbortStrategy::Connection,
            AbortStrategy::Sglang,
            AbortStrategy::VllmScaleOut,
        ] {
            let ctl = control(&sim.url(), |c| c.abort_strategy = strategy).await;
            let id = format!("retry-{}", strategy.as_str());
            let mut first = stream(ctl.proxy_addr, &id, 300).await;
            first.next_data(T).await.unwrap().unwrap();
            let mut second = stream(ctl.proxy_addr, &id, 300).await;
            assert_eq!(
                second.status, 200,
                "{strategy:?}: the first retry is admitted"
            );
            second.next_data(T).await.unwrap().unwrap();
            let mut third = stream(ctl.proxy_addr, &id, 300).await;
            assert_eq!(
                third.status, 200,
                "{strategy:?}: the second retry is admitted (no tombstone)"
            );
            // The older attempts end with the final event; the live one runs to its end.
            for old in [&mut first, &mut second] {
                let ev = old.collect(T).await.unwrap();
                assert_eq!(
                    final_error(ev.last().unwrap()).as_deref(),
                    Some("timeout"),
                    "{strategy:?}"
                );
            }
            let ev = third.collect(T).await.unwrap();
            assert!(
                ev.iter().all(|e| final_error(e).is_none()),
                "{strategy:?}: {ev:?}"
            );
            assert!(
                ev.last().unwrap().is_done(),
                "{strategy:?}: the live retry completes"
            );
            assert_eq!(
                metric(ctl.admin_addr, "kvguard_control_superseded_total").await,
                Some(2.0)
            );
            // No engine abort by id: it would have killed the live retry.
            assert!(
                sim.state().abort_calls.is_empty(),
                "{strategy:?}: {:?}",
                sim.state().abort_calls
            );
            ctl.stop().await;
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_client_that_stops_reading_leaves_the_table_and_its_connection_is_closed() {
    bounded("test", LIMIT, async {
        let engine = script::spawn().await;
        let ctl = control(&engine.url(), |c| {
            c.limits.idle_timeout = Some(Duration::from_millis(300));
            c.limits.reader_timeout = Some(Duration::from_millis(300));
            c.abort_flush_timeout = Duration::from_secs(2);
        })
        .await;
        let admin = ctl.admin_addr;
        // HTTP/1.1, a 4 KiB receive buffer, and the client never reads past the head.
        let mut silent = client::silent_client(
            ctl.proxy_addr,
            "/flood",
            &json!({}),
            &[("x-request-id", "silent")],
            4096,
            true,
        )
        .await
        .unwrap();
        assert_eq!(silent.status(), Some(200));
        // Buffers fill, the gateway side takes no more, the reader timeout ends it as
        // stalled...
        wait_metric(
            admin,
            "kvguard_control_aborts_total{reason=\"stalled\",outcome=\"aborted\"}",
            1.0,
        )
        .await;
        // ...and it has left the table at once, although hyper still holds its response
        // body: its downstream side is cut only after the flush timeout.
        assert_eq!(inflight(admin).await, 0);
        assert_eq!(metric(admin, "kvguard_control_inflight").await, Some(0.0));
        assert_eq!(metric(admin, CUT_H1).await, Some(0.0));
        // Then the connection is closed (while the client still does not read): reading
        // drains what the buffers held, then ends.
        wait_metric(admin, CUT_H1, 1.0).await;
        silent.read_to_close(T).await.unwrap();
        poll_until_async(
            "engine connection closed",
            T,
            Duration::from_millis(20),
            || async { (engine.cut() == 1).then_some(()) },
        )
        .await
        .unwrap();
        ctl.stop().await;
    })
    .await
    .unwrap();
}

const CUT_H1: &str = "kvguard_control_downstream_cuts_total{scope=\"connection\"}";
const CUT_H2: &str = "kvguard_control_downstream_cuts_total{scope=\"h2_stream\"}";

async fn wait_metric(admin: SocketAddr, series: &str, value: f64) {
    poll_until_async(series, T, Duration::from_millis(20), || async {
        metric(admin, series).await.filter(|v| *v == value)
    })
    .await
    .unwrap();
}

type H2Sender = hyper::client::conn::http2::SendRequest<http_body_util::Full<Bytes>>;

fn h2_req(addr: SocketAddr, path: &str, id: &str) -> hyper::Request<http_body_util::Full<Bytes>> {
    hyper::Request::post(format!("http://{addr}{path}"))
        .header("x-request-id", id)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

#[tokio::test]
async fn on_h2_only_the_stalled_stream_is_reset_and_the_connection_carries_on() {
    bounded("test", LIMIT, async {
        let engine = script::spawn().await;
        let ctl = control(&engine.url(), |c| {
            c.limits.idle_timeout = Some(Duration::from_millis(300));
            c.limits.reader_timeout = Some(Duration::from_millis(300));
            c.abort_flush_timeout = Duration::from_secs(2);
        })
        .await;
        let tcp = tokio::net::TcpStream::connect(ctl.proxy_addr)
            .await
            .unwrap();
        let (mut tx, conn): (H2Sender, _) =
            hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .initial_stream_window_size(16 * 1024)
                .initial_connection_window_size(16 * 1024 * 1024)
                .handshake(TokioIo::new(tcp))
                .await
                .unwrap();
        let conn_task = tokio::spawn(conn);
        // Stream A: its body is never read, so its window closes and the reader timeout
        // ends it.
        let a = tx
            .send_request(h2_req(ctl.proxy_addr, "/flood", "h2-stalled"))
            .await
            .unwrap();
        assert_eq!(a.status(), 200);
        let admin = ctl.admin_addr;
        wait_metric(
            admin,
            "kvguard_control_aborts_total{reason=\"stalled\",outcome=\"aborted\"}",
            1.0,
        )
        .await;
        // Out of the table at once, before its stream is reset.
        assert_eq!(inflight(admin).await, 0);
        assert_eq!(metric(admin, CUT_H2).await, Some(0.0));
        wait_metric(admin, CUT_H2, 1.0).await;
        // A was reset: reading it ends in an error after what was buffered.
        let read_a = tokio::time::timeout(T, a.into_body().collect())
            .await
            .unwrap();
        assert!(read_a.is_err(), "stream A was reset");
        // The connection is still up: another stream on it completes.
        assert!(!conn_task.is_finished(), "the h2 connection was not closed");
        let b = tx
            .send_request(h2_req(ctl.proxy_addr, "/short", "h2-other"))
            .await
            .unwrap();
        assert_eq!(b.status(), 200);
        let body = tokio::time::timeout(T, b.into_body().collect())
            .await
            .unwrap()
            .unwrap()
            .to_bytes();
        assert!(body.ends_with(b"data: [DONE]\n\n"), "{body:?}");
        assert_eq!(metric(admin, CUT_H1).await, Some(0.0));
        conn_task.abort();
        ctl.stop().await;
    })
    .await
    .unwrap();
}

/// A body with nothing to count in it is progress by bytes, and no event rule (first
/// token, idle after a data event) cuts it while it flows: `text/plain`,
/// `application/octet-stream`, and an SSE or NDJSON body with a `content-encoding`
/// (compressed bytes cannot be scanned; the first frame here even reads as an event).
#[tokio::test]
async fn a_flowing_body_that_cannot_be_scanned_is_progress_never_cut_by_an_event_rule() {
    bounded("test", LIMIT, async {
        let engine = script::spawn().await;
        // 15 chunks 100 ms apart (1.5 s) against 400 ms limits.
        let ctl = control(&engine.url(), |c| {
            c.limits.idle_timeout = Some(Duration::from_millis(400));
            c.limits.first_token_timeout = Some(Duration::from_millis(400));
        })
        .await;
        for path in ["/plain", "/octet", "/gzip-sse", "/gzip-ndjson"] {
            let r = client::request(
                ctl.proxy_addr,
                hyper::Method::POST,
                path,
                &[("x-request-id", &path[1..])],
                Bytes::from_static(b"{}"),
                false,
                T,
            )
            .await
            .unwrap();
            assert_eq!(r.status, 200);
            if path.starts_with("/gzip-") {
                assert_eq!(r.headers["content-encoding"], "gzip");
                assert_eq!(r.body.len(), 10 + 14 * 6, "{path}: the whole body");
            } else {
                assert!(r.text().ends_with("chunk 14\n"), "{path}: {}", r.text());
            }
        }
        let text = client::get(ctl.admin_addr, "/metrics")
            .await
            .unwrap()
            .text();
        let ended: Vec<_> = text
            .lines()
            .filter(|l| l.starts_with("kvguard_control_aborts_total{") && !l.ends_with(" 0"))
            .collect();
        assert!(ended.is_empty(), "{ended:?}");
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn slow_admin_callers_cannot_block_the_abort_api_nor_the_health_probes() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |_| {}).await;
        // Every admin connection slot taken by a caller that sends a head promising a
        // body and then one byte of it.
        let flood = Instant::now();
        let mut slow = Vec::new();
        for _ in 0..kvguard_control::server::MAX_ADMIN_CONNECTIONS {
            let mut s = tokio::net::TcpStream::connect(ctl.admin_addr)
                .await
                .unwrap();
            s.write_all(b"POST /v1/abort HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
                .await
                .unwrap();
            slow.push(s);
        }
        // A health probe on a new connection is answered at once (a connection of the
        // probe reserve), and so is an abort: 503, retry, instead of a wait in the backlog.
        let probe = client::get(ctl.admin_addr, "/healthz").await.unwrap();
        assert_eq!(probe.status, 200);
        let (status, body) = abort(ctl.admin_addr, "during-the-flood", "operator").await;
        assert_eq!(status, 503, "{body}");
        assert!(
            flood.elapsed() < REQUEST_TIMEOUT,
            "answered before the flood timed out"
        );
        // Once the slow ones time out (the admin request deadline, which runs from each
        // one's arrival) their slots are free and a real abort gets its answer.
        let (status, body) = poll_until_async(
            "abort answered 404",
            REQUEST_TIMEOUT * 5,
            Duration::from_millis(50),
            || async {
                let (s, b) = abort(ctl.admin_addr, "after-the-flood", "operator").await;
                (s != 503).then_some((s, b))
            },
        )
        .await
        .unwrap();
        assert_eq!(status, 404, "{body}");
        assert!(
            flood.elapsed() >= REQUEST_TIMEOUT,
            "the flood held every slot"
        );
        drop(slow);
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_hung_nvml_call_delays_nothing_and_is_not_piled_on() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let mut cfg = kvguard_control::Config::for_tests(&sim.url(), vec![key()]).unwrap();
        cfg.sample_interval = Duration::from_millis(100);
        let probe = Arc::new(HangingProbe::default());
        let mut deps = Deps::real(&cfg);
        deps.gpu_probe = Some(probe.clone());
        let ctl = Server::start(cfg, deps).await.unwrap();
        let admin = ctl.admin_addr;
        poll_until_async(
            "NVML timeouts counted",
            T,
            Duration::from_millis(20),
            || async {
                metric(admin, "kvguard_control_nvml_timeouts_total")
                    .await
                    .filter(|v| *v >= 1.0)
            },
        )
        .await
        .unwrap();
        // Ten more sample intervals: readiness holds (the engine scrape is not delayed), and
        // no second call is started on the hung driver.
        let readyz_ok = || async { client::get(admin, "/readyz").await.unwrap().status == 200 };
        poll_until_async("engine ready", T, Duration::from_millis(20), || async {
            readyz_ok().await.then_some(())
        })
        .await
        .unwrap();
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_secs(1) {
            assert!(readyz_ok().await, "readiness flipped while NVML hangs");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(probe.calls(), 1, "one NVML call outstanding at most");
        assert_eq!(
            metric(admin, "kvguard_control_nvml_available").await,
            Some(0.0)
        );
        let gpu = client::get_json(admin, "/v1/gpu").await.unwrap();
        assert!(
            gpu["unavailable_reason"]
                .as_str()
                .unwrap()
                .contains("did not return"),
            "{gpu}"
        );
        // The driver comes back: the next call is made and succeeds.
        probe.release();
        poll_until_async("NVML back", T, Duration::from_millis(20), || async {
            metric(admin, "kvguard_control_nvml_available")
                .await
                .filter(|v| *v == 1.0)
        })
        .await
        .unwrap();
        assert!(probe.calls() >= 2);
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn the_engine_api_key_goes_on_kvguard_controls_own_engine_calls_only() {
    bounded("test", LIMIT, async {
        let engine = script::spawn().await;
        let dir = std::env::temp_dir().join(format!("kvguard-engine-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("engine-key");
        std::fs::write(&file, "vllm-api-key-123\n").unwrap();
        let api_key = kvguard_control::config::read_engine_api_key(&file).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let ctl = control(&engine.url(), |c| {
            c.abort_strategy = AbortStrategy::VllmScaleOut;
            c.engine_api_key = Some(api_key);
        })
        .await;
        let mut s = client::stream_sse(
            ctl.proxy_addr,
            "/flood",
            &json!({}),
            &[("x-request-id", "keyed")],
            false,
        )
        .await
        .unwrap();
        s.next_data(T).await.unwrap().unwrap();
        let (status, _) = abort(ctl.admin_addr, "keyed", "operator").await;
        assert_eq!(status, 200);
        wait_metric(
            ctl.admin_addr,
            "kvguard_control_aborts_total{reason=\"operator\",outcome=\"aborted\"}",
            1.0,
        )
        .await;
        let seen = engine.seen.lock().unwrap().clone();
        let auth_of = |path: &str| seen.iter().find(|(p, _)| p == path).map(|(_, a)| a.clone());
        assert_eq!(
            auth_of("/inference/v1/abort_requests"),
            Some(Some("Bearer vllm-api-key-123".to_owned())),
            "{seen:?}"
        );
        // The proxied request carries the client's headers only.
        assert_eq!(auth_of("/flood"), Some(None), "{seen:?}");
        drop(s);
        ctl.stop().await;
    })
    .await
    .unwrap();
}
