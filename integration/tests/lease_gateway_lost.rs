//! Liveness leases with real processes (contract §8): Envoy + kvguard → lossy hop →
//! kvguard-control → simulator. The lossy hop hides every client disconnect, so a dead
//! gateway's streams would run on to `max_tokens`; the lease is what ends them.
//!
//! - Two gateways on one kvguard-control (`--lease-mode enforce --lease-ttl 2s`, the
//!   filter renewing every 400 ms); gateway A carries 200 live streams, B 20. A is
//!   SIGKILLed (no abort can leave it): every one of A's streams is ended by
//!   kvguard-control within TTL + 1 s (reason `gateway_lost`, the engine's running count
//!   back to B's 20), and B's streams keep flowing to their end.
//! - Renewals black-holed for 3 × TTL while long healthy streams flow and no new request
//!   arrives, with the default `--lease-mode observe`: no stream a client reads ends;
//!   kvguard-control counts the expiry and the streams it would have ended (the reason
//!   expiry is not enforced by default, see docs/DESIGN.md).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::demo::stack::{self, Control};
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::gate::Gate;
use kvguard_integration::lossy::{self, LossyConfig};
use kvguard_integration::sim::{self, SimConfig};
use kvguard_integration::wait::{bounded, poll_until_async};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use support::{open_streams as open, W};

const TTL: Duration = Duration::from_secs(2);
const RENEW_MS: u64 = 400;

fn lease_filter_config() -> serde_json::Value {
    let mut c = stack::filter_config(0, 0);
    c["lease_renew_ms"] = RENEW_MS.into();
    c
}

async fn gateway(upstream: SocketAddr, control: SocketAddr) -> Envoy {
    let mut eo = EnvoyOptions::with_filter(upstream, control, lease_filter_config())
        .vm_env("KVGUARD_SECRET", stack::SECRET);
    // Two workers: two VMs share the instance id and elect one renewer per period.
    eo.concurrency = 2;
    eo.component_log_level = Some("wasm:info".into());
    Envoy::start(eo).await.unwrap()
}

async fn metric(control: &Control, series: &str) -> f64 {
    let text = control.metrics_text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from kvguard-control's /metrics"))
}

async fn wait_leases(control: &Control, n: f64) {
    poll_until_async("leases taken", W, Duration::from_millis(50), || async {
        (metric(control, "kvguard_control_leases").await >= n).then_some(())
    })
    .await
    .unwrap();
}

fn sim_config() -> SimConfig {
    SimConfig {
        max_running: 4096,
        kv_blocks: 131_072,
        ..SimConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_gateways_streams_end_within_the_ttl_and_only_its_own() {
    bounded("SIGKILLed gateway", Duration::from_secs(120), async {
        let engine = sim::spawn(sim_config()).await.unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let control = Control::start(
            engine.addr(),
            any,
            any,
            &[
                "--lease-mode".into(),
                "enforce".into(),
                "--lease-ttl".into(),
                format!("{}ms", TTL.as_millis()),
                "--idle-timeout".into(),
                "off".into(),
            ],
        )
        .await
        .unwrap();
        let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
        let mut a = gateway(hop.addr(), control.admin).await;
        let b = gateway(hop.addr(), control.admin).await;
        wait_leases(&control, 2.0).await;
        // 200 streams on A, 20 on B: 1,000 tokens at 5 tokens/s, far longer than the test.
        let a_streams = open(a.listener_addr(), 200, 1000, "5").await;
        // B's streams end on their own (40 tokens at 5/s: ~8 s), read to the end.
        let b_streams = open(b.listener_addr(), 20, 40, "5").await;
        assert_eq!(engine.state().running.len(), 220);
        let mut b_reads = tokio::task::JoinSet::new();
        for mut s in b_streams {
            b_reads.spawn(async move { s.wait_end(W).await.map(|e| e.saw_done()) });
        }

        a.guard().kill().unwrap();
        let killed = Instant::now();
        drop(a_streams);
        // Every one of A's sequences ended: only B's (at most 20) still run.
        engine
            .wait_state("A's streams ended", W, |s| s.running.len() <= 20)
            .await
            .unwrap();
        let took = killed.elapsed();
        eprintln!("A's 200 streams ended {took:?} after the SIGKILL (TTL {TTL:?})");
        assert!(
            took <= TTL + Duration::from_secs(1),
            "A's streams took {took:?} to end, more than TTL + 1 s"
        );
        let by_reason = control.aborts_by_reason().await.unwrap();
        assert_eq!(by_reason.get("gateway_lost"), Some(&200.0), "{by_reason:?}");
        assert_eq!(
            metric(
                &control,
                "kvguard_control_lease_expiries_total{mode=\"enforce\"}"
            )
            .await,
            1.0
        );
        // B untouched: every one of its streams reaches [DONE].
        while let Some(r) = b_reads.join_next().await {
            assert!(
                r.unwrap().unwrap(),
                "a stream of the live gateway did not complete"
            );
        }
        engine
            .wait_state("the engine idle", W, |s| s.running.is_empty())
            .await
            .unwrap();
        assert_eq!(
            control
                .aborts_by_reason()
                .await
                .unwrap()
                .get("gateway_lost"),
            Some(&200.0)
        );
        drop(b);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_blocked_for_three_ttls_in_the_default_observe_mode_end_no_stream_someone_reads() {
    bounded("renewals blocked", Duration::from_secs(120), async {
        let engine = sim::spawn(sim_config()).await.unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        // The default lease mode (observe), a short TTL.
        let control = Control::start(
            engine.addr(),
            any,
            any,
            &[
                "--lease-ttl".into(),
                format!("{}ms", TTL.as_millis()),
                "--idle-timeout".into(),
                "off".into(),
            ],
        )
        .await
        .unwrap();
        let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
        // Renewals (and aborts) go through the gate; inference traffic does not.
        let gate = Gate::spawn(control.admin).await.unwrap();
        let envoy = gateway(hop.addr(), gate.addr()).await;
        wait_leases(&control, 1.0).await;
        // 10 streams of 60 tokens at 5 tokens/s (~12 s), read by their clients throughout.
        let streams = open(envoy.listener_addr(), 10, 60, "5").await;
        let mut reads = tokio::task::JoinSet::new();
        for mut s in streams {
            reads.spawn(async move { s.wait_end(W).await.map(|e| e.saw_done()) });
        }
        gate.set_open(false);
        let shut = Instant::now();
        // The lease expires while the gate is shut (whatever the mode: a mutation to
        // enforce must fail on the streams below, not here).
        poll_until_async("the lease expiry", W, Duration::from_millis(50), || async {
            let text = control.metrics_text().await.unwrap();
            let n: f64 = stack::labelled(&text, "kvguard_control_lease_expiries_total", "mode")
                .values()
                .sum();
            (n >= 1.0).then_some(())
        })
        .await
        .unwrap();
        tokio::time::sleep((TTL * 3).saturating_sub(shut.elapsed())).await;
        gate.set_open(true);
        // Every stream reaches [DONE]: nothing ended a stream someone reads.
        while let Some(r) = reads.join_next().await {
            assert!(
                r.unwrap().unwrap(),
                "a stream someone reads did not complete"
            );
        }
        assert_eq!(
            metric(
                &control,
                "kvguard_control_lease_requests_ended_total{mode=\"observe\"}"
            )
            .await,
            10.0,
            "observe mode counts the streams enforce mode would have ended"
        );
        assert_eq!(
            control
                .aborts_by_reason()
                .await
                .unwrap()
                .get("gateway_lost"),
            Some(&0.0)
        );
        // The renewals resumed and the lease is held again.
        wait_leases(&control, 1.0).await;
        drop(envoy);
    })
    .await
    .unwrap();
}
