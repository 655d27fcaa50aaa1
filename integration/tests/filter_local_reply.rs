//! Local replies after the upstream was reached (issue 10.2): another filter, or Envoy
//! itself, answers the client while the engine may still be generating. kvguard must
//! abort such a request (reason `local_reply`), and must not abort the same streams when
//! nothing intervenes, nor a request answered before any upstream.
//!
//! The local replies come from real filters in a real Envoy, placed after kvguard in
//! `http_filters` (so they see the response first):
//! - `kvguard_test_responder.wasm` (`filter/test-responder`, built by `scripts/build`,
//!   never shipped), which calls `send_http_response` where the request header
//!   `x-test-reply` says: in its response-headers callback (Envoy sends that reply
//!   straight to the codec: kvguard sees no end of stream, the details are `""`), from
//!   its tick while a non-streaming request is still generating (no upstream headers
//!   yet: the reply passes kvguard with an end of stream; this used to count as
//!   completed), or in its request-headers callback (before any upstream: no abort);
//! - Envoy's Lua filter buffering the response body (`body()`) past
//!   `per_connection_buffer_limit_bytes`: Envoy answers 500 `response_payload_too_large`.
//!
//! The first two tests take the aborts at a verifying receiver; the third runs the whole
//! path with the lossy hop (which hides the disconnect from the engine) and the real
//! kvguard-control, and checks that the engine stops generating.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use hyper::Method;
use kvguard_contract::AbortReason;
use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Control};
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::lossy::{self, LossyConfig, HOLD_HEADER};
use kvguard_integration::sim::{self, EndKind, SimConfig};
use kvguard_integration::wait::{bounded, poll_until};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use support::*;

/// The test module: `KVGUARD_TEST_RESPONDER_WASM`, else the wasm target dir's build.
fn responder_wasm() -> PathBuf {
    let p = std::env::var_os("KVGUARD_TEST_RESPONDER_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            kvguard_integration::paths::target_dir()
                .unwrap()
                .join("wasm32-wasip1/release/kvguard_test_responder.wasm")
        });
    assert!(
        p.is_file(),
        "{} not found: build it with scripts/build (or set KVGUARD_TEST_RESPONDER_WASM)",
        p.display()
    );
    p
}

fn responder_filter() -> Value {
    json!({
        "name": "test_responder",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "test_responder",
                "root_id": "test_responder",
                "vm_config": {
                    "vm_id": "test_responder",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": responder_wasm().display().to_string()}}
                }
            }
        }
    })
}

/// Envoy's Lua filter holding the whole response body (`body()` buffers it).
fn lua_body_filter() -> Value {
    json!({
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string":
                "function envoy_on_response(h)\n  h:body()\nend\n"}
        }
    })
}

/// Puts `filter` right after kvguard in the bootstrap's `http_filters`.
fn after_kvguard(o: &mut EnvoyOptions, filter: Value) {
    o.patch = Some(Arc::new(move |b| {
        let filters = b
            .pointer_mut(
                "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/http_filters",
            )
            .and_then(Value::as_array_mut)
            .unwrap();
        assert_eq!(filters[0]["name"], "kvguard");
        filters.insert(1, filter.clone());
    }));
}

/// A simulator at 20 tokens/s, a receiver and an Envoy with `filter` right after kvguard.
async fn rig_after_kvguard(filter: Value, buffer_limit: Option<u32>) -> Rig {
    rig_with(
        SimConfig {
            token_rate: 20.0,
            ..SimConfig::default()
        },
        json!({}),
        move |o| {
            o.per_connection_buffer_limit_bytes = buffer_limit;
            after_kvguard(o, filter);
        },
    )
    .await
}

/// A non-streaming completion; returns the response.
async fn post_json(envoy: &Envoy, body: &Value, headers: &[(&str, &str)]) -> client::Resp {
    client::request(
        envoy.listener_addr(),
        Method::POST,
        "/v1/completions",
        headers,
        serde_json::to_vec(body).unwrap(),
        false,
        W,
    )
    .await
    .unwrap()
}

/// Waits for request `id`'s abort at the receiver and checks its reason, the access
/// log's outcome and the filter's log line.
async fn expect_local_reply_abort(r: &Rig, id: &str) {
    let calls = r.recv.wait_calls_for(id, W).await.unwrap();
    let reasons: Vec<_> = calls
        .iter()
        .map(|c| c.abort.as_ref().map(|a| a.reason))
        .collect();
    assert_eq!(reasons, [Some(AbortReason::LocalReply)], "{id}");
    assert_eq!(access_outcome(&r.envoy, id).await, "aborted:local_reply");
    wait_log(
        &r.envoy,
        &format!("kvguard: abort request_id={id} reason=local_reply outcome=aborted status=200"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filters_local_reply_after_the_upstream_was_reached_is_aborted() {
    bounded("local reply", T, async {
        let r = rig_after_kvguard(responder_filter(), None).await;
        let envoy = &r.envoy;

        // A non-streaming completion with nothing in the way completes, no abort.
        let resp = post_json(envoy, &completion(8, false), &[]).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        let healthy_json = last_id(&r.sim);
        assert_eq!(access_outcome(envoy, &healthy_json).await, "completed");

        // The same, answered 300 ms in while the engine generates (100 tokens at 20/s;
        // no response headers yet): the reply passes kvguard with an end of stream (the
        // path that used to count as completed).
        let resp = post_json(
            envoy,
            &completion(100, false),
            &[("x-test-reply", "after-ms=300")],
        )
        .await;
        assert_eq!(resp.status, 500, "{}", resp.text());
        assert_eq!(resp.text(), "test-responder local reply\n");
        let replaced_json = last_id(&r.sim);
        expect_local_reply_abort(&r, &replaced_json).await;

        // A stream with nothing in the way completes, no abort.
        let mut s = client::stream_sse(
            envoy.listener_addr(),
            "/v1/chat/completions",
            &chat(8),
            &[],
            false,
        )
        .await
        .unwrap();
        assert!(s.wait_end(W).await.unwrap().completed());
        let healthy_sse = last_id(&r.sim);
        assert_eq!(access_outcome(envoy, &healthy_sse).await, "completed");

        // The same stream, answered by the responder once the engine's headers arrived.
        let mut s = client::stream_sse(
            envoy.listener_addr(),
            "/v1/chat/completions",
            &chat(200),
            &[("x-test-reply", "response-headers")],
            false,
        )
        .await
        .unwrap();
        assert_eq!(s.status, 500);
        assert_eq!(s.header("x-test-reply"), Some("local"));
        let _ = s.wait_end(W).await.unwrap();
        let replaced_sse = last_id(&r.sim);
        expect_local_reply_abort(&r, &replaced_sse).await;

        // Answered in the request headers, before any upstream: completed, no abort (the
        // engine never saw it).
        let lines = |e: &Envoy| e.log().lines().filter(|l| l.starts_with("ACCESS")).count();
        let before = lines(envoy);
        let last_seen = last_id(&r.sim);
        let resp = post_json(
            envoy,
            &completion(8, false),
            &[("x-test-reply", "request-headers")],
        )
        .await;
        assert_eq!(resp.status, 500, "{}", resp.text());
        let line = poll_until("the access line", W, Duration::from_millis(50), || {
            let log = envoy.log();
            let all: Vec<&str> = log.lines().filter(|l| l.starts_with("ACCESS")).collect();
            (all.len() > before).then(|| all[before].to_owned())
        })
        .await
        .unwrap();
        assert!(line.trim_end().ends_with("outcome=completed"), "{line}");
        assert_eq!(last_id(&r.sim), last_seen, "the engine never saw it");

        // Two aborts in all, both local_reply; the three others completed.
        r.recv.expect_no_more_calls(2, QUIET).await.unwrap();
        envoy
            .wait_stat(&aborts("local_reply", "aborted"), W, |v| v == 2.0)
            .await
            .unwrap();
        assert_eq!(
            stat(envoy, "kvguard_filter_requests_completed_total").await,
            3.0
        );
        assert_eq!(stat(envoy, "kvguard_filter_host_errors_total").await, 0.0);
        assert_vm_healthy(envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_payload_too_large_after_the_upstream_replied_is_aborted() {
    bounded("response_payload_too_large", T, async {
        let r = rig_after_kvguard(lua_body_filter(), Some(4096)).await;
        let envoy = &r.envoy;

        // A short stream fits the buffer: Lua passes it whole, it completes.
        let mut s = client::stream_sse(
            envoy.listener_addr(),
            "/v1/chat/completions",
            &chat(5),
            &[],
            false,
        )
        .await
        .unwrap();
        assert_eq!(s.status, 200);
        assert!(s.wait_end(W).await.unwrap().completed());
        let fits = last_id(&r.sim);
        assert_eq!(access_outcome(envoy, &fits).await, "completed");

        // A long one outgrows it: Envoy answers 500 response_payload_too_large (straight
        // to the codec; the upstream had answered, the engine is still generating).
        let mut s = client::stream_sse(
            envoy.listener_addr(),
            "/v1/chat/completions",
            &chat(200),
            &[],
            false,
        )
        .await
        .unwrap();
        assert_eq!(s.status, 500);
        let _ = s.wait_end(W).await.unwrap();
        let big = last_id(&r.sim);
        let line = access_line(envoy, &big).await;
        assert!(
            line.contains(" 500 - response_payload_too_large "),
            "{line}"
        );
        expect_local_reply_abort(&r, &big).await;

        r.recv.expect_no_more_calls(1, QUIET).await.unwrap();
        assert_eq!(
            stat(envoy, "kvguard_filter_requests_completed_total").await,
            1.0
        );
        assert_vm_healthy(envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_hop_that_hides_disconnects_kvguard_control_ends_the_engines_work() {
    bounded("local reply end to end", T, async {
        // 1000 tokens at 20/s: 50 s of generation nobody reads unless kvguard ends it.
        let sim = sim::spawn(SimConfig {
            token_rate: 20.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let any = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let off = ["--idle-timeout", "off", "--max-age", "off"].map(String::from);
        let control = Control::start(sim.addr(), any, any, &off).await.unwrap();
        let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
        let mut o =
            EnvoyOptions::with_filter(hop.addr(), control.admin, stack::filter_config(0, 0))
                .vm_env("KVGUARD_SECRET", stack::SECRET);
        after_kvguard(&mut o, responder_filter());
        let envoy = Envoy::start(o).await.unwrap();
        let local_replies = || async {
            control
                .aborts_by_reason()
                .await
                .unwrap()
                .get("local_reply")
                .copied()
        };

        // A non-streaming request answered while the engine generates (the hop holds it
        // before its response head, as buffering gateways do).
        let resp = post_json(
            &envoy,
            &completion(1000, false),
            &[("x-test-reply", "after-ms=300"), (HOLD_HEADER, "1")],
        )
        .await;
        assert_eq!(resp.status, 500, "{}", resp.text());
        let json_id = last_id(&sim);
        let rec = engine_end(&sim, &json_id).await;
        assert_eq!(rec.ended, Some(EndKind::Disconnected), "{rec:?}");
        assert!(rec.tokens_sent < 100, "the engine generated on: {rec:?}");
        assert_eq!(local_replies().await, Some(1.0));

        // A stream answered by the responder once the engine's headers arrived.
        let mut s = client::stream_sse(
            envoy.listener_addr(),
            "/v1/completions",
            &completion(1000, true),
            &[("x-test-reply", "response-headers")],
            false,
        )
        .await
        .unwrap();
        assert_eq!(s.status, 500);
        let _ = s.wait_end(W).await.unwrap();
        let sse = last_id(&sim);
        let rec = engine_end(&sim, &sse).await;
        assert_eq!(rec.ended, Some(EndKind::Disconnected), "{rec:?}");
        assert!(rec.tokens_sent < 100, "the engine generated on: {rec:?}");
        assert_eq!(local_replies().await, Some(2.0));

        // Nothing in the way: completes, no abort.
        let mut s = client::stream_sse(
            envoy.listener_addr(),
            "/v1/completions",
            &completion(8, true),
            &[],
            false,
        )
        .await
        .unwrap();
        assert!(s.wait_end(W).await.unwrap().completed());
        let healthy = last_id(&sim);
        assert_eq!(access_outcome(&envoy, &healthy).await, "completed");
        let rec = engine_end(&sim, &healthy).await;
        assert_eq!(rec.ended, Some(EndKind::Length), "{rec:?}");
        let by_reason = control.aborts_by_reason().await.unwrap();
        assert_eq!(by_reason.values().sum::<f64>(), 2.0, "{by_reason:?}");
        assert!(sim.state().running.is_empty(), "{:?}", sim.state().running);
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}
