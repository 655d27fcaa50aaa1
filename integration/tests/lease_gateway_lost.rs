//! Liveness leases with real processes (contract §8): Envoy + kvguard → lossy hop →
//! kvguard-control → simulator. The lossy hop hides every client disconnect, so a dead
//! gateway's streams would run on to `max_tokens`; the lease is what ends them.
//!
//! - Two gateways on one kvguard-control (`--lease-mode enforce --lease-ttl 2s`, the
//!   filter renewing every 400 ms); gateway A carries 200 live streams, B 20. A is
//!   SIGKILLed (no abort can leave it): every one of A's streams is ended by
//!   kvguard-control within TTL + 1 s (reason `gateway_lost`, the engine's running count
//!   back to B's 20), and B's streams keep flowing to their end.
//! - `--lease-mode observe` (the rollout step): a SIGKILLed gateway's lease expires and
//!   kvguard-control counts the streams enforce mode would have ended, and ends none.
//! - Two gateways SIGSTOPped at once past the TTL, then resumed: their silence is held,
//!   and no worker VM is judged lost for renewals sent before the other VMs beat again
//!   (`why="vm_lost"` counts from the first renewal that leaves a VM out): every stream
//!   keeps flowing.
//! - Two gateways renewing out of phase, both renewal paths of both cut (out of band
//!   refused, the hop's new connections to kvguard-control refused: every in-band renewal
//!   fails) for three TTLs while their streams flow to readers: kvguard-control hears from
//!   nobody, holds both silences, and cuts no stream.
//!
//! The shipped defaults (enforce, TTL 30 s, renewals every 5 s) are `lease_defaults.rs`.
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

/// Waits until `n` leases are enforceable: each gateway's data path carried three
/// in-band renewals (from its first tracked response on).
async fn wait_enforceable(control: &Control, n: f64) {
    poll_until_async(
        "leases enforceable",
        W,
        Duration::from_millis(50),
        || async {
            (support::control_metric(control, "kvguard_control_leases_enforceable").await >= n)
                .then_some(())
        },
    )
    .await
    .unwrap();
}

/// kvguard-control in front of `engine`, `--lease-mode mode` with the TTL above, no idle
/// reaper (the lease alone ends streams here).
async fn control(engine: &sim::SimHandle, mode: &str) -> Control {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let args = [
        "--lease-mode".into(),
        mode.into(),
        "--lease-ttl".into(),
        format!("{}ms", TTL.as_millis()),
        "--idle-timeout".into(),
        "off".into(),
    ];
    Control::start(engine.addr(), any, any, &args)
        .await
        .unwrap()
}

/// kvguard-control's lease `family` (`expiries`, `requests_ended`) under `mode` for a
/// gateway gone: `silent` (its in-band renewals stopped) or `dead` (its listener, asked
/// once while it lived, refused): which depends on whether it was asked before the kill.
async fn gone(control: &Control, family: &str, mode: &str) -> f64 {
    let mut n = 0.0;
    for why in ["silent", "dead"] {
        let series =
            format!("kvguard_control_lease_{family}_total{{mode=\"{mode}\",why=\"{why}\"}}");
        n += support::control_metric(control, &series).await;
    }
    n
}

/// kvguard-control's `gateway_lost` abort count.
async fn gateway_lost(control: &Control) -> Option<f64> {
    control
        .aborts_by_reason()
        .await
        .unwrap()
        .get("gateway_lost")
        .copied()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_gateways_streams_end_within_the_ttl_and_only_its_own() {
    bounded("SIGKILLed gateway", Duration::from_secs(120), async {
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let control = control(&engine, "enforce").await;
        let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
        let mut a = gateway(hop.addr(), control.admin).await;
        let b = gateway(hop.addr(), control.admin).await;
        // 200 streams on A, 20 on B: 1,000 tokens at 5 tokens/s, far longer than the test.
        let a_streams = open(a.listener_addr(), 200, 1000, "5").await;
        // B's streams end on their own (40 tokens at 5/s: ~8 s), read to the end.
        let b_streams = open(b.listener_addr(), 20, 40, "5").await;
        wait_enforceable(&control, 2.0).await;
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
        assert_eq!(gone(&control, "expiries", "enforce").await, 1.0);
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
        assert_eq!(gateway_lost(&control).await, Some(200.0));
        drop(b);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_mode_counts_a_dead_gateways_streams_and_ends_none() {
    bounded("observe mode", Duration::from_secs(60), async {
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let control = control(&engine, "observe").await;
        let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
        let mut gw = gateway(hop.addr(), control.admin).await;
        let streams = open(gw.listener_addr(), 10, 1000, "5").await;
        wait_enforceable(&control, 1.0).await;
        gw.guard().kill().unwrap();
        drop(streams);
        poll_until_async("the lease expiry", W, Duration::from_millis(50), || async {
            (gone(&control, "requests_ended", "observe").await >= 10.0).then_some(())
        })
        .await
        .unwrap();
        // Counted, not ended: the hop keeps reading, the engine keeps generating.
        assert_eq!(engine.state().running.len(), 10);
        assert_eq!(gateway_lost(&control).await, Some(0.0));
    })
    .await
    .unwrap();
}

/// Two gateways stopped at once (SIGSTOP: a frozen node) for longer than the TTL and 5
/// renewal periods, then resumed. Nobody was heard from meanwhile, so their silence is held,
/// not expired; after it, a gateway's first renewal may come from one VM before the others
/// beat again, and no VM is judged lost for that (`vm_lost` counts from the first renewal
/// that leaves a VM out). Every stream keeps flowing to its reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_stopped_past_the_ttl_and_resumed_lose_no_vm_and_no_stream() {
    bounded(
        "stopped and resumed gateways",
        Duration::from_secs(120),
        async {
            let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
            let control = control(&engine, "enforce").await;
            let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
            let mut a = gateway(hop.addr(), control.admin).await;
            let mut b = gateway(hop.addr(), control.admin).await;
            let mut streams = open(a.listener_addr(), 12, 1000, "5").await;
            streams.extend(open(b.listener_addr(), 12, 1000, "5").await);
            wait_enforceable(&control, 2.0).await;
            for g in [&mut a, &mut b] {
                g.guard().signal(libc::SIGSTOP).unwrap();
            }
            tokio::time::sleep(TTL * 2 + Duration::from_millis(5 * RENEW_MS)).await;
            for g in [&mut a, &mut b] {
                g.guard().signal(libc::SIGCONT).unwrap();
            }
            poll_until_async("the silence held", W, Duration::from_millis(50), || async {
                let held =
                    support::control_metric(&control, "kvguard_control_lease_held_expiries_total")
                        .await;
                (held >= 2.0).then_some(())
            })
            .await
            .unwrap();
            // Quiet for a TTL and more after the resume: long enough for a VM left out by
            // the renewals to be judged lost.
            tokio::time::sleep(TTL + Duration::from_millis(3 * RENEW_MS)).await;
            for s in &mut streams {
                assert!(s.next_data(W).await.unwrap().is_some(), "a stream stopped");
            }
            assert_eq!(engine.state().running.len(), 24);
            for why in ["vm_lost", "silent"] {
                let series = format!(
                    "kvguard_control_lease_requests_ended_total{{mode=\"enforce\",why=\"{why}\"}}"
                );
                assert_eq!(
                    support::control_metric(&control, &series).await,
                    0.0,
                    "{why}"
                );
            }
            drop((a, b));
        },
    )
    .await
    .unwrap();
}

/// The gateway's failed renewals: (out of band, in band).
async fn renewals_failed(g: &Envoy) -> (f64, f64) {
    (
        support::filter_counter(g, "lease_renewals_total", "failed").await,
        support::filter_counter(g, "lease_data_renewals_total", "failed").await,
    )
}

/// Two gateways whose renewals arrive out of phase (B started half a period after A), both
/// renewal paths of both cut for three TTLs while every stream flows to its reader: the
/// out-of-band renewals are refused, and the hop's new connections to kvguard-control too,
/// so every in-band renewal fails while the streams already running pass. Nobody is heard
/// from after either silence begins, whatever the phases, so both are held: no lease
/// expires and every stream reaches `[DONE]`. (Expiring one on the other's renewal in the
/// half period after its own last one, the rule this replaced, ends all 24.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_out_of_phase_with_both_renewal_paths_cut_lose_no_stream() {
    bounded("both renewal paths cut", Duration::from_secs(120), async {
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let control = control(&engine, "enforce").await;
        let data_gate = Gate::spawn(control.proxy).await.unwrap();
        let admin_gate = Gate::spawn(control.admin).await.unwrap();
        let hop = lossy::spawn(LossyConfig::to(data_gate.addr()))
            .await
            .unwrap();
        let a = gateway(hop.addr(), admin_gate.addr()).await;
        tokio::time::sleep(Duration::from_millis(RENEW_MS / 2)).await;
        let b = gateway(hop.addr(), admin_gate.addr()).await;
        // 200 tokens at 10/s: ~20 s, past the cut's three TTLs.
        let mut streams = open(a.listener_addr(), 12, 200, "10").await;
        streams.extend(open(b.listener_addr(), 12, 200, "10").await);
        let mut reads = tokio::task::JoinSet::new();
        for mut s in streams {
            reads.spawn(async move { s.wait_end(W * 2).await.map(|e| e.saw_done()) });
        }
        wait_enforceable(&control, 2.0).await;
        let before = [renewals_failed(&a).await, renewals_failed(&b).await];
        admin_gate.set_open(false);
        data_gate.refuse_new();
        tokio::time::sleep(TTL * 3).await;
        // Both paths of both gateways failed throughout; nothing expired, nothing ended.
        for (g, (admin0, data0)) in [&a, &b].into_iter().zip(before) {
            let (admin, data) = renewals_failed(g).await;
            assert!(
                admin - admin0 >= 5.0,
                "out-of-band renewals failed: {}",
                admin - admin0
            );
            assert!(
                data - data0 >= 5.0,
                "in-band renewals failed: {}",
                data - data0
            );
        }
        let text = control.metrics_text().await.unwrap();
        let expiries: f64 = stack::labelled(&text, "kvguard_control_lease_expiries_total", "mode")
            .values()
            .sum();
        assert_eq!(expiries, 0.0, "a lease expired\n{}", control.log());
        assert_eq!(engine.state().running.len(), 24);
        assert!(
            support::control_metric(&control, "kvguard_control_lease_held_expiries_total").await
                >= 2.0,
            "both silences held"
        );
        admin_gate.set_open(true);
        data_gate.set_open(true);
        while let Some(r) = reads.join_next().await {
            assert!(
                r.unwrap().unwrap(),
                "a stream someone reads did not complete"
            );
        }
        assert_eq!(gateway_lost(&control).await, Some(0.0));
        drop((a, b));
    })
    .await
    .unwrap();
}
