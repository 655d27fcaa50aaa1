//! Prefill/decode disaggregation on real vLLM: two vLLM CPU servers with NixlConnector
//! (`kvguard_integration::vllm_pd`) behind the suite's P/D proxy. One test, run in steps,
//! because the pair takes about two minutes to start on 2 cores and the steps read the
//! two engines' own figures (`vllm:kv_cache_usage_perc`, `vllm:num_requests_running`):
//!
//! 1. a healthy P/D stream completes and P's blocks are freed at D's read;
//! 2. a client that leaves at the hand-off (after P's prefill, before D is asked) leaves
//!    P's blocks held, with nothing running anywhere, until P's lease runs out;
//! 3. a decode request carrying P's `kv_transfer_params` that D rejects frees P at once
//!    (how kvguard-control frees P, docs/PD-ENGINES.md);
//! 4. a client that leaves during decode behind a proxy that hides it leaves D generating.
//!
//! `KVGUARD_SKIP_VLLM=1` skips it; `KVGUARD_VLLM_PD_URLS=http://P,http://D` uses a running
//! pair (`scripts/pd-vllm`, e.g. on GPUs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::client;
use kvguard_integration::pd_proxy::{self, PdProxyConfig, PdProxyHandle};
use kvguard_integration::vllm::{metric_sum, EngineFigures, Vllm};
use kvguard_integration::vllm_pd::{VllmPd, LEASE_S};
use kvguard_integration::wait::{bounded, poll_until_async};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// The whole test: the pair's start (3 minutes seen on a loaded 2-core machine) and the
/// steps; under nextest's limit for this binary (.config/nextest.toml).
const T: Duration = Duration::from_secs(780);
const W: Duration = Duration::from_secs(30);
const LEASE: Duration = Duration::from_secs(LEASE_S);

/// A completion long enough to hold a few blocks on P (the prompt: about 200 tokens).
fn completion(max_tokens: u32) -> Value {
    json!({"model": "tiny", "prompt": "kvguard prefill decode ".repeat(50), "stream": true,
           "max_tokens": max_tokens, "ignore_eos": true})
}

async fn proxy(
    pd: &VllmPd,
    hide: bool,
    hand_off: Option<tokio::sync::watch::Receiver<bool>>,
) -> PdProxyHandle {
    pd_proxy::spawn(PdProxyConfig {
        listen: None,
        prefill: pd.p.addr(),
        decode: pd.d.addr(),
        hide_disconnects: hide,
        hand_off,
    })
    .await
    .unwrap()
}

/// `vllm:request_success_total` (any finish reason): counts finished requests.
async fn finished(v: &Vllm) -> f64 {
    let r = client::get(v.addr(), "/metrics").await.unwrap();
    metric_sum(&r.text(), "vllm:request_success_total").unwrap_or(0.0)
}

/// `vllm:nixl_num_kv_expired_reqs`: prefills whose blocks P freed at the end of their
/// lease (what the `KvguardPrefillBlocksStranded` alert reads). Must be exported.
async fn expired(p: &Vllm) -> f64 {
    let r = client::get(p.addr(), "/metrics").await.unwrap();
    metric_sum(&r.text(), "vllm:nixl_num_kv_expired_reqs")
        .expect("P exports no vllm:nixl_num_kv_expired_reqs (the alert's series)")
}

/// Nothing runs or waits on either side and neither holds blocks.
async fn both_idle(pd: &VllmPd, within: Duration) {
    let idle = |f: &EngineFigures| f.running == 0.0 && f.waiting == 0.0 && f.kv_usage == 0.0;
    pd.p.wait_figures("P idle, no blocks held", within, idle)
        .await
        .unwrap();
    pd.d.wait_figures("D idle, no blocks held", within, idle)
        .await
        .unwrap();
}

/// P holds blocks with nothing running: the blocks of a finished prefill, kept for D.
fn holding_for_d(f: &EngineFigures) -> bool {
    f.running == 0.0 && f.waiting == 0.0 && f.kv_usage > 0.0
}

/// Sends `body` to the proxy on a raw connection; returns it (drop it to leave).
async fn send_raw(to: std::net::SocketAddr, id: &str, body: &Value) -> tokio::net::TcpStream {
    let body = serde_json::to_vec(body).unwrap();
    let mut conn = tokio::net::TcpStream::connect(to).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n\
         x-request-id: {id}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(&body).await.unwrap();
    conn
}

async fn healthy(pd: &VllmPd) {
    let px = proxy(pd, false, None).await;
    let mut c = client::stream_sse(
        px.addr(),
        "/v1/completions",
        &completion(16),
        &[("x-request-id", "pd-healthy")],
        false,
    )
    .await
    .unwrap();
    assert_eq!(c.status, 200);
    let end = c.wait_end(W).await.unwrap();
    assert!(end.completed(), "the P/D stream did not complete: {end:?}");
    both_idle(pd, W).await;
}

/// Returns how long P held the blocks after the client left.
async fn left_at_hand_off(pd: &VllmPd) -> Duration {
    let (_open, hold) = tokio::sync::watch::channel(false);
    let px = proxy(pd, true, Some(hold)).await;
    let (p0, d0) = (finished(&pd.p).await, finished(&pd.d).await);
    let e0 = expired(&pd.p).await;
    let conn = send_raw(px.addr(), "pd-handoff", &completion(64)).await;
    poll_until_async(
        "P finishes the prefill",
        W,
        Duration::from_millis(50),
        || async { (finished(&pd.p).await > p0).then_some(()) },
    )
    .await
    .unwrap();
    drop(conn);
    let left = Instant::now();
    let f = pd.p.figures().await.unwrap();
    assert!(
        holding_for_d(&f),
        "P should hold the prefill's blocks for D: {f:?}"
    );
    // Held for the lease with nothing running anywhere; D never saw it.
    pd.p.wait_figures("P's lease frees the blocks", LEASE + W, |f| {
        f.kv_usage == 0.0
    })
    .await
    .unwrap();
    let held = left.elapsed();
    assert!(
        held >= LEASE.mul_f64(0.5),
        "P let go after {held:?}, well before its {LEASE:?} lease: something freed it"
    );
    assert_eq!(finished(&pd.d).await, d0, "D saw the request");
    assert_eq!(px.stats().requests, 1);
    assert_eq!(expired(&pd.p).await, e0 + 1.0, "P counts the expired lease");
    held
}

/// A prefill for a remote decode, asked of P directly (as a proxy would); returns its
/// `kv_transfer_params`.
async fn held_prefill(p: &Vllm, id: &str) -> Value {
    let mut body = completion(1);
    body["stream"] = json!(false);
    body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let r = client::post_json(p.addr(), "/v1/completions", &body, &[("x-request-id", id)])
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let params = r.json().unwrap()["kv_transfer_params"].clone();
    assert!(params["remote_request_id"].is_string(), "{params}");
    params
}

/// Returns how long P held the blocks after D's rejection.
async fn rejected_by_d_frees_p(pd: &VllmPd) -> Duration {
    let e0 = expired(&pd.p).await;
    let params = held_prefill(&pd.p, "pd-reject").await;
    let f = pd.p.figures().await.unwrap();
    assert!(
        holding_for_d(&f),
        "P should hold the prefill's blocks for D: {f:?}"
    );
    // A model D does not serve: D's completion handler answers an error before the engine
    // sees the request, and tells P it will not read (vLLM's rejection clean-up).
    let mut bad = completion(1);
    bad["model"] = json!("kvguard-release");
    bad["stream"] = json!(false);
    bad["kv_transfer_params"] = params;
    let sent = Instant::now();
    let r = client::post_json(pd.d.addr(), "/v1/completions", &bad, &[])
        .await
        .unwrap();
    assert_eq!(r.status, 404, "{}", r.text());
    pd.p.wait_figures("D's rejection frees P", W, |f| f.kv_usage == 0.0)
        .await
        .unwrap();
    let held = sent.elapsed();
    assert!(
        held < LEASE.mul_f64(0.5),
        "P let go only after {held:?}: the lease, not D"
    );
    held
}

async fn left_during_decode_behind_a_hiding_proxy(pd: &VllmPd) {
    let px = proxy(pd, true, None).await;
    let d0 = finished(&pd.d).await;
    let mut c = client::stream_sse(
        px.addr(),
        "/v1/completions",
        &completion(400),
        &[("x-request-id", "pd-decode")],
        false,
    )
    .await
    .unwrap();
    c.next_event(W).await.unwrap().unwrap();
    c.disconnect();
    // D generates on for nobody (its generation counter keeps rising, the request runs).
    let g0 = generated(&pd.d).await;
    poll_until_async(
        "D generates on after the client left",
        W,
        Duration::from_millis(100),
        || async {
            let f = pd.d.figures().await.ok()?;
            (f.running == 1.0 && generated(&pd.d).await >= g0 + 50.0).then_some(())
        },
    )
    .await
    .unwrap();
    assert_eq!(finished(&pd.d).await, d0);
    // P was freed at D's read.
    pd.p.wait_figures("P freed at D's read", W, |f| f.kv_usage == 0.0)
        .await
        .unwrap();
    // Let D finish (400 tokens) before the next step.
    pd.d.wait_figures("D ends at max_tokens", Duration::from_secs(180), |f| {
        f.running == 0.0
    })
    .await
    .unwrap();
}

async fn generated(v: &Vllm) -> f64 {
    let r = client::get(v.addr(), "/metrics").await.unwrap();
    metric_sum(&r.text(), "vllm:generation_tokens_total").unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_decode_on_real_vllm_strands_p_at_the_hand_off_and_d_behind_a_hiding_proxy() {
    bounded("P/D on real vLLM", T, async {
        let Some(pd) = VllmPd::shared("e2e_vllm_pd").await.unwrap() else {
            return;
        };
        both_idle(&pd, W).await;
        let t = Instant::now();
        healthy(&pd).await;
        eprintln!("step 1: healthy P/D stream in {:?}", t.elapsed());
        let held = left_at_hand_off(&pd).await;
        eprintln!("step 2: left at the hand-off: P held its blocks {held:?} (lease {LEASE:?})");
        let held = rejected_by_d_frees_p(&pd).await;
        eprintln!("step 3: D's rejection freed P in {held:?}");
        left_during_decode_behind_a_hiding_proxy(&pd).await;
        eprintln!("step 4: D generated on behind the hiding proxy");
        both_idle(&pd, W).await;
    })
    .await
    .unwrap();
}
