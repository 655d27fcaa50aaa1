//! Prefill/decode disaggregation in the suite, without kvguard: the simulator's prefill
//! and decode roles (vLLM NixlConnector-like, docs/PD-ENGINES.md) behind the P/D proxy.
//! A healthy stream frees the prefill side at the decode side's read; a client that
//! leaves during decode behind a proxy that hides it leaves the decode side generating;
//! one that leaves during prefill leaves the prefill side's blocks held until its lease
//! runs out, with nothing running anywhere; the decode side lets the prefill side go when
//! it refuses a request or loses it before its read.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::client;
use kvguard_integration::pd_proxy::{self, PdProxyConfig, PdProxyHandle};
use kvguard_integration::sim::{self, EndKind, KvRelease, SimHandle};
use kvguard_integration::wait::{bounded, poll_until};
use serde_json::{json, Value};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

const T: Duration = Duration::from_secs(60);
const W: Duration = Duration::from_secs(10);
/// The prefill side's lease in these tests (vLLM's default is 30 s).
const LEASE_MS: u64 = 1500;

/// A streaming completion of `max_tokens` tokens (prompt: 64 tokens, 5 blocks of 16 with
/// the completion).
fn completion(max_tokens: u32) -> Value {
    json!({"prompt": "x".repeat(256), "stream": true, "max_tokens": max_tokens})
}

struct Pd {
    p: SimHandle,
    d: SimHandle,
    proxy: PdProxyHandle,
}

async fn pd(hide_disconnects: bool, pull_ms: u64) -> Pd {
    let (p, d) = sim::spawn_pd(LEASE_MS, pull_ms, 20.0).await.unwrap();
    let proxy = pd_proxy::spawn(PdProxyConfig {
        listen: None,
        prefill: p.addr(),
        decode: d.addr(),
        hide_disconnects,
        hand_off: None,
    })
    .await
    .unwrap();
    Pd { p, d, proxy }
}

/// Waits until the prefill side let go of request `id`'s blocks; returns why, and how
/// long it held them (ms).
async fn released(p: &SimHandle, id: &str) -> (KvRelease, u64) {
    let s = p
        .wait_state("the prefill side lets go", W, |s| {
            s.request(id).is_some_and(|r| r.kv_released.is_some())
        })
        .await
        .unwrap();
    let r = s.request(id).unwrap();
    let (why, at) = r.kv_released.unwrap();
    (why, at - r.kv_held_ms.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_stream_frees_the_prefill_side_at_the_read_and_completes() {
    bounded("healthy P/D", T, async {
        let s = pd(false, 20).await;
        let mut c = client::stream_sse(
            s.proxy.addr(),
            "/v1/completions",
            &completion(8),
            &[("x-request-id", "healthy")],
            false,
        )
        .await
        .unwrap();
        assert_eq!(c.status, 200);
        assert!(c.wait_end(W).await.unwrap().completed());
        let pr = s.p.state().request("healthy").cloned().unwrap();
        assert_eq!(pr.ended, Some(EndKind::Length), "{pr:?}");
        assert_eq!((pr.max_tokens, pr.tokens_sent, pr.stream), (1, 1, false));
        let (why, held) = released(&s.p, "healthy").await;
        assert_eq!(why, KvRelease::Pulled);
        assert!(held < LEASE_MS, "held {held} ms");
        let dr = s.d.state().request("healthy").cloned().unwrap();
        assert_eq!(dr.ended, Some(EndKind::Length), "{dr:?}");
        assert_eq!(dr.kv_remote_id.as_deref(), Some("cmpl-healthy"));
        assert!(dr.kv_pulled_ms.is_some(), "{dr:?}");
        assert_eq!((s.p.state().blocks_used, s.d.state().blocks_used), (0, 0));
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_during_decode_behind_a_hiding_proxy_leaves_the_decode_side_generating() {
    bounded("gone during decode", T, async {
        let s = pd(true, 20).await;
        let mut c = client::stream_sse(
            s.proxy.addr(),
            "/v1/completions",
            &completion(1000),
            &[("x-request-id", "gone")],
            false,
        )
        .await
        .unwrap();
        c.next_event(W).await.unwrap().unwrap();
        c.disconnect();
        poll_until(
            "the proxy sees the client go",
            W,
            Duration::from_millis(10),
            || (s.proxy.stats().clients_gone == 1).then_some(()),
        )
        .await
        .unwrap();
        // The decode side generates on for nobody; the prefill side was freed at the read.
        let at = s.d.state().request("gone").unwrap().tokens_sent;
        s.d.wait_state("the decode side generates on", W, |st| {
            st.request("gone")
                .is_some_and(|r| r.ended.is_none() && r.tokens_sent >= at + 20)
        })
        .await
        .unwrap();
        assert_eq!(released(&s.p, "gone").await.0, KvRelease::Pulled);
        assert_eq!(s.p.state().blocks_used, 0);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_during_decode_through_a_passing_proxy_ends_the_decode_side() {
    bounded("gone during decode, passed on", T, async {
        let s = pd(false, 20).await;
        let mut c = client::stream_sse(
            s.proxy.addr(),
            "/v1/completions",
            &completion(1000),
            &[("x-request-id", "passed")],
            false,
        )
        .await
        .unwrap();
        c.next_event(W).await.unwrap().unwrap();
        c.disconnect();
        let st =
            s.d.wait_state("the decode side ends", W, |st| {
                st.request("passed").is_some_and(|r| r.ended.is_some())
            })
            .await
            .unwrap();
        assert_eq!(
            st.request("passed").unwrap().ended,
            Some(EndKind::Disconnected)
        );
        assert_eq!(released(&s.p, "passed").await.0, KvRelease::Pulled);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_during_prefill_strands_the_prefill_sides_blocks_until_the_lease() {
    bounded("gone during prefill", T, async {
        let s = pd(true, 20).await;
        // A prefill of 1 s (first-token delay on the prefill leg; the decode leg never
        // comes). The proxy answers nothing before the decode side does: the client leaves
        // while the prefill runs (a raw connection, closed).
        let body = serde_json::to_vec(&completion(1000)).unwrap();
        let mut conn = tokio::net::TcpStream::connect(s.proxy.addr())
            .await
            .unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n\
             x-request-id: early\r\nx-sim-delay-first-ms: 1000\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(&body).await.unwrap();
        s.p.wait_state("the prefill runs", W, |st| st.running == ["early"])
            .await
            .unwrap();
        drop(conn);
        let st =
            s.p.wait_state(
                "the prefill holds its blocks for the decode side",
                W,
                |st| st.held_for_decode == ["early"],
            )
            .await
            .unwrap();
        assert!(
            st.running.is_empty() && st.blocks_held_for_decode > 0,
            "{st:?}"
        );
        let (why, held) = released(&s.p, "early").await;
        assert_eq!(why, KvRelease::LeaseExpired);
        assert!(
            (LEASE_MS..LEASE_MS + 500).contains(&held),
            "held {held} ms for a lease of {LEASE_MS}"
        );
        assert!(s.d.state().requests.is_empty(), "the decode side saw it");
        assert_eq!(s.p.state().blocks_used, 0);
    })
    .await
    .unwrap();
}

/// A prefill for a remote decode, asked of the prefill side directly; returns its
/// `kv_transfer_params`.
async fn held_prefill(p: &SimHandle, id: &str) -> Value {
    let mut body = completion(1);
    body["stream"] = json!(false);
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    let r = client::post_json(p.addr(), "/v1/completions", &body, &[("x-request-id", id)])
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let params = r.json().unwrap()["kv_transfer_params"].clone();
    assert_eq!(params["remote_request_id"], format!("cmpl-{id}"));
    assert_eq!(p.state().held_for_decode, [id]);
    params
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_side_lets_the_prefill_side_go_when_it_refuses_or_loses_a_request() {
    bounded("decode side gives up", T, async {
        let s = pd(false, 5_000).await;
        // Refused: D answers 400 (n out of range) and notifies P at once.
        let params = held_prefill(&s.p, "refused").await;
        let mut bad = completion(8);
        bad["n"] = json!(0);
        bad["kv_transfer_params"] = params;
        let r = client::post_json(s.d.addr(), "/v1/completions", &bad, &[])
            .await
            .unwrap();
        assert_eq!(r.status, 400);
        let (why, held) = released(&s.p, "refused").await;
        assert_eq!(why, KvRelease::NotPulled);
        assert!(held < LEASE_MS, "held {held} ms");

        // Lost before its read (5 s here): D's abort API ends it, and D notifies P.
        let params = held_prefill(&s.p, "lost").await;
        let mut body = completion(8);
        body["kv_transfer_params"] = params;
        let c = client::stream_sse(
            s.d.addr(),
            "/v1/completions",
            &body,
            &[("x-request-id", "lost-d")],
            false,
        )
        .await
        .unwrap();
        s.d.wait_state("D reads", W, |st| st.running == ["lost-d"])
            .await
            .unwrap();
        let ended = s.d.sim().abort_ids("vllm", &["cmpl-lost-d".to_string()]);
        assert_eq!(ended, ["lost-d"]);
        let (why, held) = released(&s.p, "lost").await;
        assert_eq!(why, KvRelease::NotPulled);
        assert!(held < LEASE_MS, "held {held} ms");
        drop(c);
    })
    .await
    .unwrap();
}
