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
//! 4. a client that leaves during decode behind a proxy that hides it leaves D generating;
//! 5. with kvguard-control beside each engine (peers, `--pd-role`), an abort of a request
//!    whose client left at the hand-off frees P's blocks through D (`released`), long
//!    before the lease, and the expired-lease counter stays put;
//! 6. with kvguard, an abort of a request whose client left during decode stops D.
//!
//! `KVGUARD_SKIP_VLLM=1` skips it; `KVGUARD_VLLM_PD_URLS=http://P,http://D` uses a running
//! pair (`scripts/pd-vllm`, e.g. on GPUs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_contract::AbortReason;
use kvguard_integration::client;
use kvguard_integration::demo::stack::Control;
use kvguard_integration::pd_proxy::{self, PdProxyConfig, PdProxyHandle};
use kvguard_integration::vllm::{metric_sum, EngineFigures, Vllm};
use kvguard_integration::vllm_pd::{VllmPd, LEASE_S};
use kvguard_integration::wait::{bounded, poll_until_async};
use serde_json::{json, Value};
use std::net::SocketAddr;
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
    proxy_to(pd.p.addr(), pd.d.addr(), hide, hand_off).await
}

async fn proxy_to(
    prefill: SocketAddr,
    decode: SocketAddr,
    hide: bool,
    hand_off: Option<tokio::sync::watch::Receiver<bool>>,
) -> PdProxyHandle {
    pd_proxy::spawn(PdProxyConfig {
        listen: None,
        prefill,
        decode,
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

/// `vllm:nixl_num_kv_expired_reqs_total`: prefills whose blocks P freed at the end of their
/// lease (what the `KvguardPrefillBlocksStranded` alert reads). Must be exported.
async fn expired(p: &Vllm) -> f64 {
    let r = client::get(p.addr(), "/metrics").await.unwrap();
    metric_sum(&r.text(), "vllm:nixl_num_kv_expired_reqs_total")
        .expect("P exports no vllm:nixl_num_kv_expired_reqs_total (the alert's series)")
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

/// Sends a short completion through the P/D proxy at `px` as `id`, waits for P to finish
/// its prefill (the proxy holds the hand-off to D), and leaves; P holds the blocks for D.
async fn leave_at_hand_off(pd: &VllmPd, px: std::net::SocketAddr, id: &str) {
    let p0 = finished(&pd.p).await;
    let conn = send_raw(px, id, &completion(64)).await;
    poll_until_async(
        "P finishes the prefill",
        W,
        Duration::from_millis(50),
        || async { (finished(&pd.p).await > p0).then_some(()) },
    )
    .await
    .unwrap();
    drop(conn);
    let f = pd.p.figures().await.unwrap();
    assert!(
        holding_for_d(&f),
        "P should hold the prefill's blocks for D: {f:?}"
    );
}

/// Streams a 400-token completion through the P/D proxy at `px` as `id`, reads its first
/// event (D decodes), and leaves.
async fn leave_during_decode(px: std::net::SocketAddr, id: &str) {
    let mut c = client::stream_sse(
        px,
        "/v1/completions",
        &completion(400),
        &[("x-request-id", id)],
        false,
    )
    .await
    .unwrap();
    c.next_event(W).await.unwrap().unwrap();
    c.disconnect();
}

/// Returns how long P held the blocks after the client left.
async fn left_at_hand_off(pd: &VllmPd) -> Duration {
    let (_open, hold) = tokio::sync::watch::channel(false);
    let px = proxy(pd, true, Some(hold)).await;
    let (d0, e0) = (finished(&pd.d).await, expired(&pd.p).await);
    leave_at_hand_off(pd, px.addr(), "pd-handoff").await;
    let left = Instant::now();
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
    pd.p.wait_figures("D's rejection frees P", LEASE + W, |f| f.kv_usage == 0.0)
        .await
        .unwrap();
    let held = sent.elapsed();
    // The expiry counter tells D's release from the lease's (on a loaded machine an idle
    // D at nice 19 took 16 s to step once; alone it takes 0.1 s).
    assert_eq!(
        expired(&pd.p).await,
        e0,
        "P let go at its lease ({held:?}), not at D's rejection"
    );
    held
}

async fn left_during_decode_behind_a_hiding_proxy(pd: &VllmPd) {
    let px = proxy(pd, true, None).await;
    let d0 = finished(&pd.d).await;
    leave_during_decode(px.addr(), "pd-decode").await;
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

/// kvguard-control beside each engine: peers of each other, `--pd-role`, P's release
/// through D's kvguard-control (`--pd-decode-url`), the lease as the engines'. Their
/// reapers are off: what ends a leg here is the abort.
struct Guarded {
    pc: Control,
    dc: Control,
}

async fn guarded(pd: &VllmPd) -> Guarded {
    let (pc, dc) = Control::start_pd_pair(
        pd.p.addr(),
        pd.d.addr(),
        LEASE,
        &["--idle-timeout", "off", "--max-age", "off"],
    )
    .await
    .unwrap();
    Guarded { pc, dc }
}

/// The legs an abort's answer lists, as (role, result).
fn legs(v: &Value) -> Vec<(String, String)> {
    v["legs"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|l| {
                    let s = |k: &str| l[k].as_str().unwrap_or_default().to_string();
                    (s("role"), s("result"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// With kvguard: a client gone at the hand-off; the abort (to D's replica, which holds
/// nothing: as the filter's abort reaches whichever replica its stream was stamped by)
/// frees P's held blocks through D. Returns how long after the abort P let go.
async fn kvguard_frees_p_at_the_hand_off(pd: &VllmPd, g: &Guarded) -> Duration {
    let (_open, hold) = tokio::sync::watch::channel(false);
    let px = proxy_to(g.pc.proxy, g.dc.proxy, true, Some(hold)).await;
    let e0 = expired(&pd.p).await;
    leave_at_hand_off(pd, px.addr(), "pd-kv-handoff").await;
    let t0 = Instant::now();
    let (status, v) =
        g.dc.abort("pd-kv-handoff", AbortReason::DownstreamReset)
            .await
            .unwrap();
    assert_eq!(status, 200, "{v}");
    assert!(
        legs(&v).contains(&("prefill".to_string(), "released".to_string())),
        "the answer should list P's leg as released: {v}"
    );
    pd.p.wait_figures("P lets go after the abort", LEASE + W, |f| {
        f.kv_usage == 0.0
    })
    .await
    .unwrap();
    let took = t0.elapsed();
    assert_eq!(
        expired(&pd.p).await,
        e0,
        "P let go at its lease ({took:?} after the abort), not at kvguard's release"
    );
    took
}

/// With kvguard: a client gone during decode behind the hiding proxy; the abort ends D's
/// leg. Returns how long after the abort D stopped.
async fn kvguard_ends_d_during_decode(pd: &VllmPd, g: &Guarded) -> Duration {
    let px = proxy_to(g.pc.proxy, g.dc.proxy, true, None).await;
    let g0 = generated(&pd.d).await;
    leave_during_decode(px.addr(), "pd-kv-decode").await;
    pd.d.wait_figures("D runs the decode leg", W, |f| f.running == 1.0)
        .await
        .unwrap();
    let t0 = Instant::now();
    let (status, v) =
        g.pc.abort("pd-kv-decode", AbortReason::DownstreamReset)
            .await
            .unwrap();
    assert_eq!(status, 200, "{v}");
    pd.d.wait_figures("D stops after the abort", W, |f| {
        f.running == 0.0 && f.kv_usage == 0.0
    })
    .await
    .unwrap();
    let took = t0.elapsed();
    // Ended, not run out: D generated fewer than the request's 400 tokens (a client's
    // abort is not counted in vLLM's request_success_total).
    let made = generated(&pd.d).await - g0;
    assert!(
        made < 400.0,
        "D generated {made} tokens: the request ran to max_tokens"
    );
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_decode_on_real_vllm_leaks_without_kvguard_and_every_leg_is_freed_with_it() {
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
        let g = guarded(&pd).await;
        let took = kvguard_frees_p_at_the_hand_off(&pd, &g).await;
        eprintln!("step 5: with kvguard, P let go {took:?} after the abort (gone at the hand-off)");
        let took = kvguard_ends_d_during_decode(&pd, &g).await;
        eprintln!("step 6: with kvguard, D stopped {took:?} after the abort (gone during decode)");
        both_idle(&pd, W).await;
    })
    .await
    .unwrap();
}
