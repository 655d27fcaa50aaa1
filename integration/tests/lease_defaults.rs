//! The liveness lease with the shipped defaults everywhere (contract §8): kvguard-control
//! with no lease flag (`--lease-mode enforce`, `--lease-ttl 30s`), the filter with no lease
//! setting (`lease_renew_ms` 5000), real processes: Envoy + kvguard → lossy hop (which
//! hides every client disconnect, so a dead gateway's streams would run on to
//! `max_tokens`) → kvguard-control → simulator.
//!
//! - A SIGKILLed gateway: its 20 streams are ended by kvguard-control within TTL + 2 s.
//! - A gateway killed and restarted in place (the same Envoy node id): its old streams end
//!   `replaced` within TTL + 2 s of the new process's start (positive evidence: a process
//!   started after it renews with its host key, while the listener, which the new process
//!   answers, cannot speak for the old one).
//! - The admin path (out-of-band renewals) refused, and separately answering 403, for
//!   three TTLs while the data path works: no stream is cut (the in-band renewals on the
//!   data path keep the lease), and the filter's counters show the divergence the
//!   `KvguardLeaseAdminPathDown` alert fires on.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::demo::stack::{self, Control};
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::gate::Gate;
use kvguard_integration::lossy::{self, LossyConfig, LossyHandle};
use kvguard_integration::sim::{self, SimConfig, SimHandle};
use kvguard_integration::wait::{bounded, poll_until_async};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use support::{open_streams as open, W};

/// kvguard-control's default `--lease-ttl`.
const TTL: Duration = Duration::from_secs(30);
/// Three in-band renewals (one a period) make a lease enforceable; with the first
/// renewal after the first tracked response, and a loaded machine: a bound, not a figure.
const ENFORCEABLE_WITHIN: Duration = Duration::from_secs(40);

struct Path {
    engine: SimHandle,
    control: Control,
    hop: LossyHandle,
}

/// Engine, kvguard-control with default flags, lossy hop.
async fn path() -> Path {
    let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let control = Control::start(engine.addr(), any, any, &[]).await.unwrap();
    let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
    Path {
        engine,
        control,
        hop,
    }
}

/// A gateway with the filter at its defaults (`lease_renew_ms` unset), its aborts and
/// out-of-band renewals to `admin`.
async fn gateway(upstream: SocketAddr, admin: SocketAddr, node: Option<&str>) -> Envoy {
    let cfg = stack::filter_config(0, 0);
    assert!(cfg.get("lease_renew_ms").is_none(), "the default period");
    let mut eo =
        EnvoyOptions::with_filter(upstream, admin, cfg).vm_env("KVGUARD_SECRET", stack::SECRET);
    eo.concurrency = 2;
    eo.component_log_level = Some("wasm:info".into());
    eo.node_id = node.map(str::to_owned);
    Envoy::start(eo).await.unwrap()
}

/// Waits until `n` leases here are enforceable (their data path carried three renewals).
async fn wait_enforceable(control: &Control, n: f64) {
    poll_until_async(
        "leases enforceable",
        ENFORCEABLE_WITHIN,
        Duration::from_millis(100),
        || async {
            (support::control_metric(control, "kvguard_control_leases_enforceable").await >= n)
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", control.log()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_flags_a_sigkilled_or_restarted_gateways_streams_end_within_the_ttl() {
    bounded("dead gateways", Duration::from_secs(150), async {
        let killed = async {
            let p = path().await;
            let mut gw = gateway(p.hop.addr(), p.control.admin, None).await;
            let streams = open(gw.listener_addr(), 20, 1000, "5").await;
            wait_enforceable(&p.control, 1.0).await;
            assert_eq!(p.engine.state().running.len(), 20);
            gw.guard().kill().unwrap();
            let at = Instant::now();
            drop(streams);
            p.engine
                .wait_state("the killed gateway's streams ended", TTL + W, |s| {
                    s.running.is_empty()
                })
                .await
                .unwrap_or_else(|e| panic!("{e:#}\n{}", p.control.log()));
            let took = at.elapsed();
            eprintln!("SIGKILL: 20 streams ended {took:?} after the kill (TTL {TTL:?})");
            assert!(took <= TTL + Duration::from_secs(2), "took {took:?}");
            let by_reason = p.control.aborts_by_reason().await.unwrap();
            assert_eq!(by_reason.get("gateway_lost"), Some(&20.0), "{by_reason:?}");
            // Silent (its in-band renewals stopped) or dead (its listener, asked once
            // while it lived, refused): which depends on whether it was asked before.
            let mut gone = 0.0;
            for why in ["silent", "dead"] {
                let series = format!(
                    "kvguard_control_lease_expiries_total{{mode=\"enforce\",why=\"{why}\"}}"
                );
                gone += support::control_metric(&p.control, &series).await;
            }
            assert_eq!(gone, 1.0, "{}", p.control.log());
        };
        let restarted = async {
            let p = path().await;
            let node = "gateway-0~10.0.0.1~gw-0.ns";
            let mut old = gateway(p.hop.addr(), p.control.admin, Some(node)).await;
            let streams = open(old.listener_addr(), 20, 1000, "5").await;
            // A short wait: the old process's lease need not be enforceable for this.
            poll_until_async(
                "the old lease taken",
                W,
                Duration::from_millis(50),
                || async {
                    (support::control_metric(&p.control, "kvguard_control_leases").await >= 1.0)
                        .then_some(())
                },
            )
            .await
            .unwrap();
            old.guard().kill().unwrap();
            drop(streams);
            let new = gateway(p.hop.addr(), p.control.admin, Some(node)).await;
            let started = Instant::now();
            p.engine
                .wait_state("the old process's streams ended", TTL + W, |s| {
                    s.running.is_empty()
                })
                .await
                .unwrap_or_else(|e| panic!("{e:#}\n{}", p.control.log()));
            let took = started.elapsed();
            eprintln!(
                "restart in place: 20 old streams ended {took:?} after the new process was ready"
            );
            // The TTL after the old one's last renewal, judged within a second.
            assert!(took <= TTL + Duration::from_secs(2), "took {took:?}");
            assert_eq!(
                support::control_metric(
                    &p.control,
                    "kvguard_control_lease_requests_ended_total{mode=\"enforce\",why=\"replaced\"}"
                )
                .await,
                20.0
            );
            // The new process serves, and its own stream is untouched.
            let mut s = open(new.listener_addr(), 1, 20, "20").await;
            assert!(s.pop().unwrap().wait_end(W).await.unwrap().saw_done());
        };
        tokio::join!(killed, restarted);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_flags_the_admin_path_refused_or_forbidden_for_three_ttls_cuts_no_stream() {
    bounded("admin path cut", TTL * 3 + Duration::from_secs(90), async {
        let run = |forbid: bool| async move {
            let what = if forbid { "403" } else { "refused" };
            let p = path().await;
            // Out-of-band renewals (and aborts) go through the gate; inference traffic
            // and the in-band renewals do not.
            let gate = Gate::spawn(p.control.admin).await.unwrap();
            let gw = gateway(p.hop.addr(), gate.addr(), None).await;
            // 8 streams of 600 tokens at 5 tokens/s (~2 minutes), read throughout.
            let streams = open(gw.listener_addr(), 8, 600, "5").await;
            let mut reads = tokio::task::JoinSet::new();
            for mut s in streams {
                reads.spawn(async move { s.wait_end(TTL * 5).await.map(|e| e.saw_done()) });
            }
            wait_enforceable(&p.control, 1.0).await;
            let data0 = support::filter_counter(&gw, "lease_data_renewals_total", "accepted").await;
            if forbid {
                gate.forbid();
            } else {
                gate.set_open(false);
            }
            let cut = Instant::now();
            tokio::time::sleep(TTL * 3).await;
            // Nothing expired, nothing ended; the filter says which path fails.
            let expiries: f64 = stack::labelled(
                &p.control.metrics_text().await.unwrap(),
                "kvguard_control_lease_expiries_total",
                "mode",
            )
            .values()
            .sum();
            assert_eq!(expiries, 0.0, "{what}: a lease expired\n{}", p.control.log());
            assert_eq!(p.engine.state().running.len(), 8, "{what}");
            let admin_failed = support::filter_counter(&gw, "lease_renewals_total", "failed").await;
            let data = support::filter_counter(&gw, "lease_data_renewals_total", "accepted").await - data0;
            eprintln!(
                "{what}: {:?} with the admin path cut: {admin_failed} out-of-band renewals failed, {data} in-band accepted",
                cut.elapsed()
            );
            assert!(admin_failed >= 10.0, "{what}: {admin_failed}");
            assert!(data >= 10.0, "{what}: {data}");
            gate.set_open(true);
            // Every stream reaches [DONE]: nothing ended a stream someone reads.
            while let Some(r) = reads.join_next().await {
                assert!(r.unwrap().unwrap(), "{what}: a stream someone reads did not complete");
            }
            assert_eq!(
                p.control.aborts_by_reason().await.unwrap().get("gateway_lost"),
                Some(&0.0)
            );
        };
        tokio::join!(run(false), run(true));
    })
    .await
    .unwrap();
}
