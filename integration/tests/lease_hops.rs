//! Invariant 2 behind every hop (contract §8, issue 37): a gateway gone for good has its
//! orphans ended by its lease whatever the hop between it and kvguard-control routes,
//! and however young it dies; invariant 1 holds for a lone gateway frozen past the TTL.
//! Real processes: Envoy + kvguard → hop → kvguard-control → simulator.
//!
//! - LiteLLM 1.108.7 (the suite's kvguard settings: client headers forwarded), which
//!   answers 404 to the in-band renewal and hides a non-streaming client's disconnect:
//!   the gateway SIGKILLed after serving 8 non-streaming requests → every one ended at
//!   the engine within TTL + 2 s, `why="dead"` (its listener refused).
//! - The suite's P/D proxy hiding disconnects (it forwards the renewal's signature with
//!   a rewritten body: the prefill side answers 401): the gateway SIGKILLed mid-decode →
//!   every decode leg ended, the prefill side holds no block.
//! - The shipped defaults (TTL 30 s), the lossy hop: a gateway SIGKILLed 2 s after it
//!   started → every stream ended within TTL + 5 s.
//! - A lone gateway SIGSTOPped past the TTL behind the lossy hop, then resumed, its
//!   clients reading: its listener still completes a handshake (the kernel answers), so
//!   the expiry is held and every stream completes.
//!
//! Scaled: TTL 3 s, a renewal every 500 ms (the shipped 30 s / 5 s ratio); "20 s in" is
//! two thirds of the TTL, 2 s.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Control, Stack, StackOptions};
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::hops::{HopKind, LiteLlmOptions};
use kvguard_integration::lossy::{self, LossyConfig};
use kvguard_integration::pd_proxy::{self, PdProxyConfig};
use kvguard_integration::sim::{self, SimConfig};
use kvguard_integration::wait::{bounded, poll_until_async};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use support::{open_streams as open, W};

const TTL: Duration = Duration::from_secs(3);
const RENEW_MS: u64 = 500;
/// Two thirds of the TTL: the scaled "20 s in".
const SERVED: Duration = Duration::from_secs(2);
/// How long past the TTL (from the kill) the engine may still run an orphan.
const SLACK: Duration = Duration::from_secs(2);

fn filter_config() -> serde_json::Value {
    let mut c = stack::filter_config(0, 0);
    c["lease_renew_ms"] = RENEW_MS.into();
    c
}

/// kvguard-control's flags: the scaled TTL, no idle reaper (the lease alone ends).
fn control_args() -> Vec<String> {
    vec![
        "--lease-ttl".into(),
        format!("{}ms", TTL.as_millis()),
        "--idle-timeout".into(),
        "off".into(),
    ]
}

/// A kvguard-control series (0 when absent).
async fn metric(c: &Control, series: &str) -> f64 {
    let text = c.metrics_text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn expiries(c: &Control, why: &str) -> f64 {
    let series = format!("kvguard_control_lease_expiries_total{{mode=\"enforce\",why=\"{why}\"}}");
    metric(c, &series).await
}

/// Waits until `c` holds `n` leases whose silence ends their streams (here: a proof on a
/// request took the lease and the gateway's listener answered a handshake).
async fn wait_enforceable(c: &Control, n: f64) {
    poll_until_async(
        "the lease enforceable",
        W,
        Duration::from_millis(50),
        || async { (metric(c, "kvguard_control_leases_enforceable").await >= n).then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", c.log()));
}

/// Waits until `started` is `SERVED` old.
async fn served_since(started: Instant) {
    tokio::time::sleep(SERVED.saturating_sub(started.elapsed())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_litellm_a_gateway_gone_for_good_has_every_non_streaming_request_ended() {
    bounded(
        "LiteLLM, gateway SIGKILLed",
        Duration::from_secs(150),
        async {
            let engine = sim::spawn(SimConfig {
                model: "tiny".into(),
                ..SimConfig::roomy()
            })
            .await
            .unwrap();
            let mut o = StackOptions::new(engine.addr(), Some(filter_config()));
            o.control_args = control_args();
            o.real_hop = Some(HopKind::LiteLlm(LiteLlmOptions::kvguard("tiny")));
            let mut st = Stack::start(o).await.unwrap();
            let started = Instant::now();
            let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "lease"}],
                          "stream": false, "max_tokens": 1000});
            let mut clients = Vec::new();
            for _ in 0..8 {
                let c = client::silent_client(
                    st.entry(),
                    "/v1/chat/completions",
                    &body,
                    &[("x-sim-rate", "5")],
                    1 << 20,
                    false,
                )
                .await
                .unwrap();
                clients.push(c);
            }
            engine
                .wait_state("8 requests generating", W, |s| s.running.len() == 8)
                .await
                .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(60)));
            wait_enforceable(&st.control, 1.0).await;
            // The in-band renewal never passes LiteLLM: the lease stands on the proofs.
            let data = "kvguard_control_lease_renewals_total{path=\"data\",result=\"accepted\"}";
            assert_eq!(metric(&st.control, data).await, 0.0);
            served_since(started).await;
            st.envoy.guard().kill().unwrap();
            let killed = Instant::now();
            drop(clients);
            engine
                .wait_state("every orphan ended", TTL + SLACK + W, |s| {
                    s.running.is_empty() && s.waiting.is_empty()
                })
                .await
                .unwrap_or_else(|e| panic!("{e:#}\n{}", st.control.log()));
            let took = killed.elapsed();
            eprintln!(
                "LiteLLM: 8 non-streaming orphans ended {took:?} after the SIGKILL (TTL {TTL:?})"
            );
            assert!(took <= TTL + SLACK, "took {took:?}\n{}", st.control.log());
            let by_reason = st.control.aborts_by_reason().await.unwrap();
            assert_eq!(by_reason.get("gateway_lost"), Some(&8.0), "{by_reason:?}");
            assert_eq!(expiries(&st.control, "dead").await, 1.0);
            assert_eq!(expiries(&st.control, "unproven").await, 0.0);
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_pd_proxy_a_gateway_gone_for_good_has_every_decode_leg_ended() {
    bounded(
        "P/D proxy, gateway SIGKILLed",
        Duration::from_secs(120),
        async {
            let (p, d) = sim::spawn_pd(4000, 20, 5.0).await.unwrap();
            let args = control_args();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (pc, dc) =
                Control::start_pd_pair(p.addr(), d.addr(), Duration::from_secs(4), &args)
                    .await
                    .unwrap();
            let proxy = pd_proxy::spawn(PdProxyConfig {
                listen: None,
                prefill: pc.proxy,
                decode: dc.proxy,
                hide_disconnects: true,
                hand_off: None,
            })
            .await
            .unwrap();
            let mut envoy = Envoy::start(
                EnvoyOptions::with_filter(proxy.addr(), pc.admin, filter_config())
                    .vm_env("KVGUARD_SECRET", stack::SECRET),
            )
            .await
            .unwrap();
            let started = Instant::now();
            let mut streams = Vec::new();
            for _ in 0..4 {
                let body = json!({"prompt": "x".repeat(256), "stream": true, "max_tokens": 1000});
                let mut s =
                    client::stream_sse(envoy.listener_addr(), "/v1/completions", &body, &[], false)
                        .await
                        .unwrap();
                assert_eq!(s.status, 200);
                s.next_data(W).await.unwrap().unwrap();
                streams.push(s);
            }
            assert_eq!(d.state().running.len(), 4);
            wait_enforceable(&dc, 1.0).await;
            served_since(started).await;
            envoy.guard().kill().unwrap();
            let killed = Instant::now();
            drop(streams);
            d.wait_state("every decode leg ended", TTL + SLACK + W, |s| {
                s.running.is_empty() && s.blocks_used == 0
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", dc.log()));
            let took = killed.elapsed();
            eprintln!("P/D: 4 decode legs ended {took:?} after the SIGKILL (TTL {TTL:?})");
            assert!(took <= TTL + SLACK, "took {took:?}\n{}", dc.log());
            let st = p.state();
            assert!(
                st.blocks_used == 0 && st.held_for_decode.is_empty() && st.running.is_empty(),
                "the prefill side still holds blocks: {st:?}"
            );
            let by_reason = dc.aborts_by_reason().await.unwrap();
            assert_eq!(by_reason.get("gateway_lost"), Some(&4.0), "{by_reason:?}");
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_flags_a_gateway_killed_2_s_after_it_started_has_its_orphans_ended_within_the_ttl()
{
    const SHIPPED_TTL: Duration = Duration::from_secs(30);
    bounded("young gateway SIGKILLed", Duration::from_secs(120), async {
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let control = Control::start(engine.addr(), any, any, &[]).await.unwrap();
        let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
        let mut gw = Envoy::start(
            EnvoyOptions::with_filter(hop.addr(), control.admin, stack::filter_config(0, 0))
                .vm_env("KVGUARD_SECRET", stack::SECRET),
        )
        .await
        .unwrap();
        let started = Instant::now();
        let streams = open(gw.listener_addr(), 20, 1000, "5").await;
        tokio::time::sleep(Duration::from_secs(2).saturating_sub(started.elapsed())).await;
        gw.guard().kill().unwrap();
        let killed = Instant::now();
        drop(streams);
        assert_eq!(engine.state().running.len(), 20);
        engine
            .wait_state("the young gateway's orphans ended", SHIPPED_TTL + W, |s| {
                s.running.is_empty()
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", control.log()));
        let took = killed.elapsed();
        eprintln!("killed 2 s after start: 20 orphans ended {took:?} after the kill");
        assert!(
            took <= SHIPPED_TTL + Duration::from_secs(5),
            "took {took:?}"
        );
        let by_reason = control.aborts_by_reason().await.unwrap();
        assert_eq!(by_reason.get("gateway_lost"), Some(&20.0), "{by_reason:?}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_gateway_frozen_past_the_ttl_and_resumed_loses_no_stream() {
    bounded("lone gateway SIGSTOPped", Duration::from_secs(120), async {
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let control = Control::start(engine.addr(), any, any, &control_args())
            .await
            .unwrap();
        let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
        let mut gw = Envoy::start(
            EnvoyOptions::with_filter(hop.addr(), control.admin, filter_config())
                .vm_env("KVGUARD_SECRET", stack::SECRET),
        )
        .await
        .unwrap();
        // 8 streams of 150 tokens at 10/s (15 s), read throughout.
        let streams = open(gw.listener_addr(), 8, 150, "10").await;
        wait_enforceable(&control, 1.0).await;
        let mut reads = tokio::task::JoinSet::new();
        for mut s in streams {
            reads.spawn(async move { s.wait_end(W * 6).await.map(|e| e.saw_done()) });
        }
        gw.guard().signal(libc::SIGSTOP).unwrap();
        tokio::time::sleep(TTL + Duration::from_secs(2)).await;
        gw.guard().signal(libc::SIGCONT).unwrap();
        while let Some(r) = reads.join_next().await {
            assert!(
                r.unwrap().unwrap(),
                "a stream of the frozen gateway did not complete\n{}",
                control.log()
            );
        }
        let by_reason = control.aborts_by_reason().await.unwrap();
        assert_eq!(by_reason.get("gateway_lost"), Some(&0.0), "{by_reason:?}");
        assert!(metric(&control, "kvguard_control_lease_held_expiries_total").await >= 1.0);
        assert!(
            metric(
                &control,
                "kvguard_control_lease_probes_total{answer=\"alive\"}"
            )
            .await
                >= 2.0
        );
        drop(gw);
    })
    .await
    .unwrap();
}
