//! Prefill/decode disaggregation with kvguard-control beside each engine (docs/DESIGN.md
//! "Prefill/decode disaggregation"): the simulator's prefill and decode roles (vLLM
//! NixlConnector-like), a kvguard-control in front of each (`--pd-role`, peers of each
//! other; the prefill side's `--pd-decode-url` is the decode side's kvguard-control), and
//! the P/D proxy in front, hiding client disconnects as the reference proxies do. Aborts
//! are sent signed as the filter sends them, to either replica.
//!
//! Judged on the engines' own state (held blocks, running sequences, why and when the
//! prefill side let go):
//! - a healthy stream is untouched, and its prefill hand-off is listed;
//! - a client gone during prefill: the prefill leg is ended at once (without kvguard its
//!   blocks are held until the lease: `sim_pd.rs`);
//! - gone between prefill and decode (the prefill finished, the decode side never got the
//!   request): the prefill side's held blocks are released through the decode engine at
//!   once, and a decode leg arriving afterwards releases, not strands; without kvguard
//!   they are held until the lease (shown here on the same engine);
//! - gone while the decode side waits for its read: both legs end, the prefill side lets
//!   go at once;
//! - gone during decode: the decode side stops (without kvguard it generates on for
//!   nobody: `sim_pd.rs`);
//! - through Envoy with the kvguard filter in front of the P/D proxy, the filter's own
//!   aborts (to one replica, its `control_cluster`) free the prefill leg of a client gone
//!   during prefill and the decode leg of one gone during decode;
//! - and its stall asks about a slow reader, sent to the prefill side's replica, are
//!   deferred by the decode side that holds the stream: the reader is never cut.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_contract::AbortReason;
use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Control};
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::pd_proxy::{self, PdProxyConfig, PdProxyHandle};
use kvguard_integration::sim::{self, EndKind, KvRelease, SimHandle};
use kvguard_integration::wait::bounded;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

const T: Duration = Duration::from_secs(60);
const W: Duration = Duration::from_secs(10);
/// The prefill engine's lease here (vLLM's default is 30 s).
const LEASE_MS: u64 = 4000;
/// How soon after the abort's answer the engines must have let go: far inside the lease
/// (measured 3-8 ms on loopback; the bound leaves room for a loaded 2-CPU machine and
/// stays far under the 4 s lease).
const FREED_WITHIN: Duration = Duration::from_millis(500);

fn completion(max_tokens: u32) -> Value {
    json!({"prompt": "x".repeat(256), "stream": true, "max_tokens": max_tokens})
}

struct Pd {
    p: SimHandle,
    d: SimHandle,
    pc: Control,
    dc: Control,
    proxy: PdProxyHandle,
}

/// P and D simulators, a kvguard-control beside each (peers of each other), the P/D
/// proxy (hiding disconnects) in front of the two kvguard-controls.
async fn pd(pull_ms: u64) -> Pd {
    pd_held(pull_ms, None, 20.0).await
}

/// [`pd`], the proxy holding each request between its legs until `hand_off` reads `true`,
/// the engines generating `token_rate` tokens a second.
async fn pd_held(
    pull_ms: u64,
    hand_off: Option<tokio::sync::watch::Receiver<bool>>,
    token_rate: f64,
) -> Pd {
    let (p, d) = sim::spawn_pd(LEASE_MS, pull_ms, token_rate).await.unwrap();
    let (pc, dc) = Control::start_pd_pair(
        p.addr(),
        d.addr(),
        Duration::from_millis(LEASE_MS),
        &["--idle-timeout", "off"],
    )
    .await
    .unwrap();
    let proxy = pd_proxy::spawn(PdProxyConfig {
        listen: None,
        prefill: pc.proxy,
        decode: dc.proxy,
        hide_disconnects: true,
        hand_off,
    })
    .await
    .unwrap();
    Pd {
        p,
        d,
        pc,
        dc,
        proxy,
    }
}

/// Waits until the prefill engine let go of request `id`'s blocks; returns why and how
/// long it held them (ms).
async fn released(p: &SimHandle, id: &str, within: Duration) -> (KvRelease, u64) {
    let s = p
        .wait_state("the prefill side lets go", within, |s| {
            s.request(id).is_some_and(|r| r.kv_released.is_some())
        })
        .await
        .unwrap();
    let r = s.request(id).unwrap();
    let (why, at) = r.kv_released.unwrap();
    (why, at - r.kv_held_ms.unwrap())
}

/// The legs of an abort answer as `(role, result)`, sorted.
fn legs(v: &Value) -> Vec<(String, String)> {
    let mut l: Vec<(String, String)> = v["legs"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|l| {
            (
                l["role"].as_str().unwrap_or("").to_string(),
                l["result"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    l.sort();
    l
}

fn pair(role: &str, result: &str) -> (String, String) {
    (role.to_string(), result.to_string())
}

async fn metric(c: &Control, series: &str) -> f64 {
    let text = c.metrics_text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} not in /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_pd_stream_through_kvguard_is_untouched() {
    bounded("healthy P/D through kvguard", T, async {
        let s = pd(20).await;
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
        assert_eq!(released(&s.p, "healthy", W).await.0, KvRelease::Pulled);
        let dr = s.d.state().request("healthy").cloned().unwrap();
        assert_eq!(dr.ended, Some(EndKind::Length), "{dr:?}");
        assert_eq!(dr.tokens_sent, 8);
        // The hand-off is listed (a pulled one too: the read is between the engines).
        assert_eq!(metric(&s.pc, "kvguard_control_pd_handoffs_held").await, 1.0);
        for c in [&s.pc, &s.dc] {
            let by = c.aborts_by_reason().await.unwrap();
            assert_eq!(by.values().sum::<f64>(), 0.0, "{by:?}");
        }
        assert_eq!((s.p.state().blocks_used, s.d.state().blocks_used), (0, 0));
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_during_prefill_ends_the_prefill_leg_at_once() {
    bounded("gone during prefill", T, async {
        let s = pd(20).await;
        // A prefill of 2 s; the client leaves while it runs (a raw connection, closed).
        let body = serde_json::to_vec(&completion(1000)).unwrap();
        let mut conn = tokio::net::TcpStream::connect(s.proxy.addr())
            .await
            .unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n\
             x-request-id: early\r\nx-sim-delay-first-ms: 2000\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(&body).await.unwrap();
        s.p.wait_state("the prefill runs", W, |st| st.running == ["early"])
            .await
            .unwrap();
        drop(conn);
        // The abort reaches the decode side's replica, which holds nothing: the fan-out
        // ends the prefill leg on its peer.
        let t0 = Instant::now();
        let (status, v) =
            s.dc.abort("early", AbortReason::DownstreamReset)
                .await
                .unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["aborted"], true, "{v}");
        assert_eq!(legs(&v), [pair("prefill", "aborted")], "{v}");
        let st =
            s.p.wait_state("the prefill side holds nothing", FREED_WITHIN, |st| {
                st.running.is_empty() && st.blocks_used == 0
            })
            .await
            .unwrap();
        let took = t0.elapsed();
        let r = st.request("early").unwrap();
        assert!(r.ended.is_some() && r.kv_held_ms.is_none(), "{r:?}");
        assert!(st.held_for_decode.is_empty(), "{st:?}");
        assert!(s.d.state().requests.is_empty(), "the decode side saw it");
        eprintln!("prefill side free {took:?} after the abort was sent");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_between_prefill_and_decode_releases_the_held_blocks_at_once() {
    bounded("gone between prefill and decode", T, async {
        // The proxy holds each request at the hand-off (after P's answer, before D).
        let (_hold, hand_off) = tokio::sync::watch::channel(false);
        let s = pd_held(20, Some(hand_off), 20.0).await;
        // Without kvguard: a finished prefill nobody reads is held until the lease.
        let mut body = completion(1);
        body["stream"] = json!(false);
        body["kv_transfer_params"] = json!({"do_remote_decode": true});
        let r = client::post_json(
            s.p.addr(),
            "/v1/completions",
            &body,
            &[("x-request-id", "bare")],
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200);
        // With kvguard: the client leaves at the hand-off.
        let entry = s.proxy.addr();
        let client = tokio::spawn(async move {
            client::stream_sse(
                entry,
                "/v1/completions",
                &completion(1000),
                &[("x-request-id", "between")],
                false,
            )
            .await
        });
        s.p.wait_state("P holds the prefill for D", W, |st| {
            st.held_for_decode.iter().any(|i| i == "between")
        })
        .await
        .unwrap();
        client.abort();
        let _ = client.await;
        let st = s.p.state();
        assert_eq!(st.held_for_decode.len(), 2, "{st:?}");
        assert_eq!(metric(&s.pc, "kvguard_control_pd_handoffs_held").await, 1.0);
        let t0 = Instant::now();
        // To the decode side's replica (it holds nothing): the prefill side's replica
        // releases the hand-off through the decode engine.
        let (status, v) =
            s.dc.abort("between", AbortReason::DownstreamReset)
                .await
                .unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["aborted"], true, "{v}");
        assert_eq!(legs(&v), [pair("prefill", "released")], "{v}");
        let (why, held) = released(&s.p, "between", FREED_WITHIN).await;
        let took = t0.elapsed();
        assert_eq!(why, KvRelease::NotPulled);
        assert!(held < LEASE_MS / 2, "held {held} ms");
        eprintln!("prefill side let go {took:?} after the abort was sent (held {held} ms)");
        assert_eq!(
            metric(
                &s.pc,
                "kvguard_control_pd_releases_total{via=\"handoff\",result=\"released\"}"
            )
            .await,
            1.0
        );
        assert_eq!(metric(&s.pc, "kvguard_control_pd_handoffs_held").await, 0.0);
        // The decode leg arriving late is refused, and releases rather than strands: a
        // second hold is made for it (as a retried prefill would) and let go at once.
        let params = {
            let mut b = completion(1);
            b["stream"] = json!(false);
            b["kv_transfer_params"] = json!({"do_remote_decode": true});
            let r = client::post_json(
                s.p.addr(),
                "/v1/completions",
                &b,
                &[("x-request-id", "late")],
            )
            .await
            .unwrap();
            r.json().unwrap()["kv_transfer_params"].clone()
        };
        let mut dec = completion(8);
        dec["kv_transfer_params"] = params;
        let r = client::post_json(
            s.dc.proxy,
            "/v1/completions",
            &dec,
            &[("x-request-id", "between")],
        )
        .await
        .unwrap();
        assert_eq!(r.status, 409, "{}", r.text());
        assert_eq!(r.json().unwrap()["error"]["kv_released"], true);
        let (why, held) = released(&s.p, "late", FREED_WITHIN).await;
        assert_eq!(why, KvRelease::NotPulled);
        assert!(held < LEASE_MS / 2, "held {held} ms");
        assert!(
            s.d.state().request("between").is_none(),
            "the decode engine never ran the aborted id"
        );
        // And the one without kvguard: held the whole lease.
        let (why, held) = released(&s.p, "bare", Duration::from_millis(LEASE_MS * 2)).await;
        assert_eq!(why, KvRelease::LeaseExpired);
        assert!(held >= LEASE_MS, "held {held} ms for a lease of {LEASE_MS}");
        assert_eq!(s.p.state().blocks_used, 0);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_the_decode_side_waits_for_its_read_ends_both_legs() {
    bounded("gone before the read", T, async {
        // The decode side reads after 20 s: until then the prefill side holds the blocks
        // (the decode side's heartbeats extend its lease).
        let s = pd(20_000).await;
        let c = client::stream_sse(
            s.proxy.addr(),
            "/v1/completions",
            &completion(1000),
            &[("x-request-id", "waiting")],
            false,
        )
        .await
        .unwrap();
        s.d.wait_state("the decode side waits for its read", W, |st| {
            st.running == ["waiting"]
        })
        .await
        .unwrap();
        assert_eq!(s.p.state().held_for_decode, ["waiting"]);
        c.disconnect();
        let t0 = Instant::now();
        let (status, v) =
            s.pc.abort("waiting", AbortReason::DownstreamReset)
                .await
                .unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            legs(&v),
            [pair("decode", "aborted"), pair("prefill", "released")],
            "{v}"
        );
        let (why, held) = released(&s.p, "waiting", FREED_WITHIN).await;
        assert_eq!(why, KvRelease::NotPulled);
        let st =
            s.d.wait_state("the decode side holds nothing", FREED_WITHIN, |st| {
                st.running.is_empty() && st.blocks_used == 0
            })
            .await
            .unwrap();
        eprintln!(
            "both legs free {:?} after the abort was sent (prefill held {held} ms)",
            t0.elapsed()
        );
        let dr = st.request("waiting").unwrap();
        assert!(dr.kv_pulled_ms.is_none(), "{dr:?}");
        assert_eq!(s.p.state().blocks_used, 0);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_during_decode_ends_the_decode_leg() {
    bounded("gone during decode", T, async {
        let s = pd(20).await;
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
        // The proxy hides it: the decode side generates on until the abort.
        let at = s.d.state().request("gone").unwrap().tokens_sent;
        s.d.wait_state("the decode side generates on", W, |st| {
            st.request("gone")
                .is_some_and(|r| r.ended.is_none() && r.tokens_sent >= at + 5)
        })
        .await
        .unwrap();
        let t0 = Instant::now();
        let (status, v) =
            s.pc.abort("gone", AbortReason::DownstreamReset)
                .await
                .unwrap();
        assert_eq!(status, 200, "{v}");
        assert!(legs(&v).contains(&pair("decode", "aborted")), "{v}");
        let st =
            s.d.wait_state("the decode side stops", FREED_WITHIN, |st| {
                st.request("gone").is_some_and(|r| r.ended.is_some()) && st.blocks_used == 0
            })
            .await
            .unwrap();
        eprintln!(
            "decode side free {:?} after the abort was sent",
            t0.elapsed()
        );
        assert_ne!(st.request("gone").unwrap().ended, Some(EndKind::Length));
        assert_eq!(released(&s.p, "gone", W).await.0, KvRelease::Pulled);
        assert_eq!(s.p.state().blocks_used, 0);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_the_filters_aborts_free_the_leg_each_client_left() {
    bounded("P/D behind Envoy and the filter", T, async {
        let s = pd(20).await;
        // The filter sends its aborts to the prefill side's replica only.
        let envoy = Envoy::start(
            EnvoyOptions::with_filter(s.proxy.addr(), s.pc.admin, stack::filter_config(0, 0))
                .vm_env("KVGUARD_SECRET", stack::SECRET),
        )
        .await
        .unwrap();
        // Gone during decode (Envoy mints the id; the proxy passes it to both legs).
        let mut c = client::stream_sse(
            envoy.listener_addr(),
            "/v1/completions",
            &completion(1000),
            &[],
            false,
        )
        .await
        .unwrap();
        c.next_event(W).await.unwrap().unwrap();
        let st = s.d.state();
        let id = st.requests.first().unwrap().request_id.clone();
        c.disconnect();
        let st =
            s.d.wait_state("the decode side stops", W, |st| {
                st.request(&id).is_some_and(|r| r.ended.is_some()) && st.blocks_used == 0
            })
            .await
            .unwrap();
        assert_ne!(st.request(&id).unwrap().ended, Some(EndKind::Length));
        assert_eq!(released(&s.p, &id, W).await.0, KvRelease::Pulled);
        // Gone during prefill (2 s): the proxy answers nothing before the decode side
        // does, so the client leaves before any response header.
        let entry = envoy.listener_addr();
        let client = tokio::spawn(async move {
            client::stream_sse(
                entry,
                "/v1/completions",
                &completion(1000),
                &[("x-sim-delay-first-ms", "2000")],
                false,
            )
            .await
        });
        let st =
            s.p.wait_state("a prefill runs", W, |st| st.running.len() == 1)
                .await
                .unwrap();
        let early = st.running[0].clone();
        client.abort();
        let _ = client.await;
        let st =
            s.p.wait_state("the prefill side holds nothing", W, |st| {
                st.running.is_empty() && st.blocks_used == 0
            })
            .await
            .unwrap();
        let r = st.request(&early).unwrap();
        assert!(r.ended.is_some() && r.kv_held_ms.is_none(), "{r:?}");
        assert!(st.held_for_decode.is_empty(), "{st:?}");
        // Both were the filter's aborts, answered by the replica it calls.
        let answered = metric(
            &s.pc,
            "kvguard_control_abort_api_answers_total{result=\"aborted\"}",
        )
        .await
            + metric(
                &s.pc,
                "kvguard_control_abort_api_answers_total{result=\"forwarded\"}",
            )
            .await;
        assert_eq!(answered, 2.0);
    })
    .await
    .unwrap();
}

/// A reader slower than its decode engine, behind Envoy with the filter (idle 3 s, the
/// shipped 32 KiB buffers) in front of the P/D proxy, which builds its own response head
/// (no stamp): each stall ask goes to the prefill side's replica, which no longer holds
/// the request, and is fanned out; the decode side defers it (its engine produces, the
/// reader drains), and that is the answer. The reader reads on, never cut, and the decode
/// leg still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_readers_stall_asks_are_deferred_by_the_decode_side() {
    const READ: Duration = Duration::from_secs(25);
    bounded("P/D slow reader", READ + T, async {
        let s = pd_held(20, None, 40.0).await;
        let mut opts =
            EnvoyOptions::with_filter(s.proxy.addr(), s.pc.admin, stack::filter_config(3_000, 0))
                .vm_env("KVGUARD_SECRET", stack::SECRET);
        opts.per_connection_buffer_limit_bytes = Some(32 * 1024);
        opts.downstream_sndbuf = Some(4096);
        let envoy = Envoy::start(opts).await.unwrap();
        let mut c = client::silent_client(
            envoy.listener_addr(),
            "/v1/completions",
            &completion(1_700),
            &[],
            4096,
            true,
        )
        .await
        .unwrap();
        assert_eq!(c.status(), Some(200), "{:?}", c.head());
        let n = c
            .read_paced(200, Instant::now() + READ, &[])
            .await
            .unwrap_or_else(|e| panic!("the slow reader was cut: {e}"));
        let st = s.d.state();
        let r = st.requests.first().unwrap();
        assert_eq!(r.ended, None, "the decode leg was ended ({n} bytes read)");
        let deferred = metric(
            &s.pc,
            "kvguard_control_abort_api_answers_total{result=\"deferred\"}",
        )
        .await;
        assert!(
            deferred >= 1.0,
            "no stall ask was deferred: the test did not reach the case"
        );
        // The decode side, which holds the stream, decided each (the prefill side's own
        // completion of its leg is not the stream's).
        let by_decode = metric(
            &s.dc,
            "kvguard_control_peer_received_total{kind=\"abort\",result=\"deferred\"}",
        )
        .await;
        assert_eq!(by_decode, deferred, "deferred by the decode side");
        assert_eq!(
            metric(
                &s.pc,
                "kvguard_control_abort_api_answers_total{result=\"aborted\"}"
            )
            .await
                + metric(
                    &s.dc,
                    "kvguard_control_aborts_total{reason=\"stalled\",outcome=\"aborted\"}"
                )
                .await,
            0.0
        );
    })
    .await
    .unwrap();
}
