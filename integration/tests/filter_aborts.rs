//! The abort path of the kvguard filter in a real Envoy: an abort receiver that is down,
//! slow, refuses the signature (401) or does not know the id (404) — client traffic is
//! unaffected and the outcomes are counted — and per-replica routing through the signed
//! `x-kvguard-control` stamp, with a forged stamp rejected.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_contract::Key;
use kvguard_integration::client;
use kvguard_integration::envoy::{Envoy, CONTROL_TARGET_CLUSTER};
use kvguard_integration::receiver::{self, Behaviour, IdPolicy, ReceiverConfig};
use kvguard_integration::sim::{self, SimConfig};
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::time::{Duration, Instant};
use support::*;

/// Streams one request through, disconnects after two events; returns its id.
async fn disconnect_one(envoy: &Envoy, sim: &sim::SimHandle) -> String {
    let mut s = client::stream_sse(
        envoy.listener_addr(),
        "/v1/completions",
        &completion(1000, true),
        &[],
        false,
    )
    .await
    .unwrap();
    s.read_events(2, W).await.unwrap();
    let id = last_id(sim);
    s.disconnect();
    id
}

/// A normal request completes, fast, whatever the abort endpoint does.
async fn healthy_traffic(envoy: &Envoy) {
    let t0 = Instant::now();
    let mut s = client::stream_sse(
        envoy.listener_addr(),
        "/v1/chat/completions",
        &chat(8),
        &[],
        false,
    )
    .await
    .unwrap();
    let ev = s.collect(W).await.unwrap();
    assert!(ev.last().unwrap().is_done());
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_down_fails_after_retries_traffic_unaffected() {
    bounded("receiver down", T, async {
        let sim = sim::spawn(SimConfig { token_rate: 20.0, ..SimConfig::default() }).await.unwrap();
        let dead = dead_port().await;
        let envoy = Envoy::start(options(
            sim.addr(),
            dead,
            json!({"abort_retries": 2, "abort_timeout_ms": 500}),
        ))
        .await
        .unwrap();
        let id = disconnect_one(&envoy, &sim).await;
        healthy_traffic(&envoy).await;
        envoy
            .wait_stat(&aborts("downstream_reset", "failed"), W, |v| v == 1.0)
            .await
            .unwrap();
        assert_eq!(stat(&envoy, "kvguard_filter_abort_attempts_total").await, 3.0);
        assert_eq!(stat(&envoy, "kvguard_filter_pending_aborts").await, 0.0);
        wait_log(&envoy, &format!("kvguard: abort request_id={id} reason=downstream_reset outcome=failed status=503 attempts=3")).await;
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_receiver_times_out_and_retries() {
    bounded("slow receiver", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 20.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let mut rc = ReceiverConfig::new(vec![key()]);
        rc.behaviour = Behaviour::Delay(Duration::from_secs(3));
        let recv = receiver::spawn(rc).await.unwrap();
        let envoy = Envoy::start(options(
            sim.addr(),
            recv.addr(),
            json!({"abort_retries": 1, "abort_timeout_ms": 400}),
        ))
        .await
        .unwrap();
        let id = disconnect_one(&envoy, &sim).await;
        healthy_traffic(&envoy).await;
        // Two attempts, both time out (Envoy answers a timed-out call with a 504): failed.
        envoy
            .wait_stat(&aborts("downstream_reset", "failed"), W, |v| v == 1.0)
            .await
            .unwrap();
        assert_eq!(
            stat(&envoy, "kvguard_filter_abort_attempts_total").await,
            2.0
        );
        wait_log(
            &envoy,
            &format!(
                "request_id={id} reason=downstream_reset outcome=failed status=504 attempts=2"
            ),
        )
        .await;
        // The receiver saw both attempts arrive (it records a delayed call on arrival).
        assert_eq!(recv.calls_for(&id).len(), 2, "{:?}", recv.calls());
        // Once the receiver answers in time, the next abort gets through.
        recv.set_behaviour(Behaviour::Verify);
        let id2 = disconnect_one(&envoy, &sim).await;
        envoy
            .wait_stat(&aborts("downstream_reset", "aborted"), W, |v| v == 1.0)
            .await
            .unwrap();
        assert!(!recv.calls_for(&id2).is_empty());
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthorized_and_not_found_are_final_and_counted() {
    bounded("401 / 404", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 20.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        // The receiver knows another key: 401, not retried, logged loudly.
        let other = Key::try_new(b"some-other-secret-0123456789").unwrap();
        let recv401 = receiver::spawn(ReceiverConfig::new(vec![other]))
            .await
            .unwrap();
        let envoy = Envoy::start(options(
            sim.addr(),
            recv401.addr(),
            json!({"abort_retries": 3}),
        ))
        .await
        .unwrap();
        let id = disconnect_one(&envoy, &sim).await;
        healthy_traffic(&envoy).await;
        envoy
            .wait_stat(&aborts("downstream_reset", "unauthorized"), W, |v| v == 1.0)
            .await
            .unwrap();
        recv401
            .expect_no_more_calls(1, Duration::from_millis(800))
            .await
            .unwrap();
        wait_log(
            &envoy,
            &format!("request_id={id} reason=downstream_reset outcome=unauthorized status=401"),
        )
        .await;
        assert!(
            envoy.log().contains("[error][wasm]") || envoy.log().contains("][error]"),
            "logged at error"
        );
        drop(envoy);

        // The receiver does not know the id: 404 (tombstone), final.
        let mut rc = ReceiverConfig::new(vec![key()]);
        rc.ids = IdPolicy::Registered;
        let recv404 = receiver::spawn(rc).await.unwrap();
        let envoy = Envoy::start(options(sim.addr(), recv404.addr(), json!({})))
            .await
            .unwrap();
        let id = disconnect_one(&envoy, &sim).await;
        healthy_traffic(&envoy).await;
        envoy
            .wait_stat(&aborts("downstream_reset", "not_found"), W, |v| v == 1.0)
            .await
            .unwrap();
        let calls = recv404
            .expect_no_more_calls(1, Duration::from_millis(800))
            .await
            .unwrap();
        assert_eq!(calls[0].status, Some(404));
        assert_eq!(
            access_outcome(&envoy, &id).await,
            "aborted:downstream_reset"
        );
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_replica_routing_and_forged_stamps() {
    bounded("per-replica routing", T, async {
        // The replica that holds the requests, and the fallback (control_cluster).
        let replica = receiver::spawn(ReceiverConfig::new(vec![key()])).await.unwrap();
        let fallback = receiver::spawn(ReceiverConfig::new(vec![key()])).await.unwrap();
        let cases: [(&str, Stamp); 3] = [
            ("valid", Stamp::Valid { addr: replica.addr(), key: key() }),
            (
                "forged",
                Stamp::Valid { addr: replica.addr(), key: Key::try_new(b"attacker-secret-0123456789").unwrap() },
            ),
            ("outside", Stamp::Valid { addr: "192.0.2.7:9902".parse().unwrap(), key: key() }),
        ];
        for (name, st) in cases {
            let up = scripted_upstream(Script { stamp: st, ..Script::default() }).await;
            let mut o = options(
                up.addr,
                fallback.addr(),
                json!({"control_target_cluster": CONTROL_TARGET_CLUSTER, "control_target_cidrs": ["127.0.0.0/8"],
                       "control_target_ports": [replica.addr().port()]}),
            );
            o.original_dst_cluster = Some(CONTROL_TARGET_CLUSTER.into());
            let envoy = Envoy::start(o).await.unwrap();
            let mut s = client::stream_sse(envoy.listener_addr(), "/v1/completions", &completion(100, true), &[], false)
                .await
                .unwrap();
            assert!(s.header("x-kvguard-control").is_none(), "{name}: the stamp is stripped");
            s.read_events(2, W).await.unwrap();
            s.disconnect();
            let (target, n) = match name {
                "valid" => (&replica, 1),
                "forged" => (&fallback, 1),
                _ => (&fallback, 2),
            };
            let calls = target.wait_for_calls(n, W).await.unwrap();
            let c = calls.last().unwrap();
            assert_eq!(c.verify, Some(Ok(())), "{name}");
            if name == "valid" {
                assert_eq!(
                    c.headers.get("x-envoy-original-dst-host").map(String::as_str),
                    Some(replica.addr().to_string().as_str())
                );
                envoy
                    .wait_stat("kvguard_filter_abort_routes_total_route=.=replica;.;", W, |v| v == 1.0)
                    .await
                    .unwrap();
            } else {
                envoy
                    .wait_stat("kvguard_filter_abort_routes_total_route=.=fallback;.;", W, |v| v == 1.0)
                    .await
                    .unwrap();
                let cause = if name == "forged" { "mismatch" } else { "outside_cidrs" };
                assert_eq!(
                    stat(&envoy, &format!("kvguard_filter_stamp_rejected_total_cause=.={cause};.;")).await,
                    1.0,
                    "{name}"
                );
            }
            assert_vm_healthy(&envoy);
        }
        assert_eq!(replica.calls().len(), 1);
        assert_eq!(fallback.calls().len(), 2);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_workers_send_their_aborts_without_waiting_for_the_tick() {
    bounded("several workers", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 20.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let recv = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        // A 10 s tick: aborts that arrive within a second were woken through the queue.
        let mut o = options(sim.addr(), recv.addr(), json!({"tick_ms": 10000}));
        o.concurrency = 3;
        let envoy = Envoy::start(o).await.unwrap();
        let log = envoy.log();
        let queues: std::collections::BTreeSet<&str> = log
            .lines()
            .filter_map(|l| l.split("wake-up queue ").nth(1))
            .filter_map(|r| r.split(' ').next())
            .collect();
        assert!(
            queues.len() >= 3,
            "one queue per VM, unique names: {queues:?}"
        );
        let mut streams = Vec::new();
        for i in 0..8 {
            let s = client::stream_sse(
                envoy.listener_addr(),
                "/v1/completions",
                &completion(1000, true),
                &[],
                i % 2 == 1,
            )
            .await
            .unwrap();
            streams.push(s);
        }
        for s in streams.iter_mut() {
            s.read_events(2, W).await.unwrap();
        }
        envoy
            .wait_stat("kvguard_filter_active_requests", W, |v| v == 8.0)
            .await
            .unwrap();
        let t0 = Instant::now();
        for s in streams {
            s.disconnect();
        }
        let calls = recv
            .wait_for_calls(8, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        let ids: std::collections::BTreeSet<_> = calls
            .iter()
            .map(|c| c.request_id().unwrap().to_owned())
            .collect();
        assert_eq!(ids.len(), 8);
        assert!(calls
            .iter()
            .all(|c| c.status == Some(200) && c.verify == Some(Ok(()))));
        envoy
            .wait_stat(&aborts("downstream_reset", "aborted"), W, |v| v == 8.0)
            .await
            .unwrap();
        // Shared gauges move by increments from every VM and come back to 0.
        envoy
            .wait_stat("kvguard_filter_active_requests", W, |v| v == 0.0)
            .await
            .unwrap();
        envoy
            .wait_stat("kvguard_filter_pending_aborts", W, |v| v == 0.0)
            .await
            .unwrap();
        let mem = stat(&envoy, "kvguard_filter_vm_memory_bytes").await;
        assert!(mem >= 3.0 * 65536.0, "summed over the VMs: {mem}");
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_control_cluster_is_a_dispatch_error() {
    bounded("unknown cluster", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 20.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let recv = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let envoy = Envoy::start(options(
            sim.addr(),
            recv.addr(),
            json!({"control_cluster": "no_such_cluster"}),
        ))
        .await
        .unwrap();
        let id = disconnect_one(&envoy, &sim).await;
        healthy_traffic(&envoy).await;
        envoy
            .wait_stat(&aborts("downstream_reset", "dispatch_error"), W, |v| {
                v == 1.0
            })
            .await
            .unwrap();
        wait_log(
            &envoy,
            &format!("request_id={id} reason=downstream_reset outcome=dispatch_error"),
        )
        .await;
        recv.expect_no_more_calls(0, Duration::from_millis(300))
            .await
            .unwrap();
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_cluster_without_hosts_does_not_hurt_the_vm() {
    bounded("no hosts", T, async {
        // A call to a cluster with no endpoint fails inside `dispatch_http_call` itself
        // ("no healthy upstream"): the VM must survive and count the abort as failed.
        let sim = sim::spawn(SimConfig {
            token_rate: 20.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let recv = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let mut o = options(sim.addr(), recv.addr(), json!({"abort_retries": 1}));
        o.patch = Some(std::sync::Arc::new(|b: &mut serde_json::Value| {
            if let Some(cs) = b
                .pointer_mut("/static_resources/clusters")
                .and_then(|c| c.as_array_mut())
            {
                for c in cs.iter_mut() {
                    if c["name"] == "kvguard_control" {
                        c["load_assignment"]["endpoints"] = json!([]);
                    }
                }
            }
        }));
        let envoy = Envoy::start(o).await.unwrap();
        let id = disconnect_one(&envoy, &sim).await;
        healthy_traffic(&envoy).await;
        envoy
            .wait_stat(&aborts("downstream_reset", "failed"), W, |v| v == 1.0)
            .await
            .unwrap();
        wait_log(
            &envoy,
            &format!("request_id={id} reason=downstream_reset outcome=failed"),
        )
        .await;
        let line = envoy
            .log()
            .lines()
            .find(|l| {
                l.contains(&format!(
                    "request_id={id} reason=downstream_reset outcome=failed"
                ))
            })
            .unwrap()
            .to_owned();
        eprintln!("no-hosts abort line: {line}");
        // And the next request is still tracked: the VM is alive.
        healthy_traffic(&envoy).await;
        envoy
            .wait_stat("kvguard_filter_requests_completed_total", W, |v| v == 2.0)
            .await
            .unwrap();
        assert_vm_healthy(&envoy);
    })
    .await
    .unwrap();
}
