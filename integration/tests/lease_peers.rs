//! Several kvguard-control replicas with `--peers` (contract §4, §8), real processes:
//! Envoy + kvguard → one lossy hop per replica (each hides every client disconnect) →
//! three kvguard-control replicas → one simulator.
//!
//! The gateways' `control_cluster` names all three replicas, replica A at priority 0 and
//! B, C at priority 1, so every abort and renewal reaches A (as one replica of N does in
//! general): what B and C learn, they learn through A's forwarding.
//!
//! - A request abandoned before its response headers (so before the `x-kvguard-control`
//!   stamp) on any replica is aborted on that replica, through A's forward, within a
//!   bound far inside the abort deadline; A never answers 404, and tombstones each id
//!   (ended there, or forwarded to the replica that held it).
//! - Two gateways; one carries a request running on C and is SIGKILLed: C ends it by the
//!   lease (enforce, the renewals C holds came from A's fan-out), within TTL + 1 s; the
//!   other gateway's streams on every replica run to their end.
//! - A hot restart whose parent exits: the parent's remaining streams end by its lease,
//!   the child's run to their end (the aborts the exiting parent still sent are printed:
//!   docs/DESIGN.md "What leaves an exiting Envoy").
//! - Forged and replayed forwarded messages are refused and counted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_contract::{
    signature, AbortReason, AbortRequest, Domain, Forwarded, Key, Renewal, RequestId,
};
use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Control};
use kvguard_integration::envoy::{
    Envoy, EnvoyOptions, CONTROL_CLUSTER, CONTROL_TARGET_CLUSTER, UPSTREAM_CLUSTER,
};
use kvguard_integration::lossy::{self, LossyConfig, LossyHandle};
use kvguard_integration::sim::{self, SimConfig, SimHandle};
use kvguard_integration::wait::{bounded, poll_until_async};
use kvguard_integration::with_free_addrs;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{chat, open_streams as open, W};

const TTL: Duration = Duration::from_secs(2);
const RENEW_MS: u64 = 400;

/// Three replicas in front of `engine`, each knowing the others (`--peers` lists all
/// three; each leaves itself out by its `--admin-listen`), each behind its own lossy hop.
async fn replicas(engine: &SimHandle, extra: &[&str]) -> (Vec<Control>, Vec<LossyHandle>) {
    replicas_n(engine, 3, extra, false).await
}

/// `n` replicas as [`replicas`]; with `advertise`, each stamps its responses with its admin
/// address (the per-replica route).
async fn replicas_n(
    engine: &SimHandle,
    n: usize,
    extra: &[&str],
    advertise: bool,
) -> (Vec<Control>, Vec<LossyHandle>) {
    let mut args = vec!["--idle-timeout", "off"];
    args.extend_from_slice(extra);
    let controls = Control::start_replicas(engine.addr(), n, &args, advertise)
        .await
        .unwrap();
    let mut hops = Vec::new();
    for c in &controls {
        hops.push(lossy::spawn(LossyConfig::to(c.proxy)).await.unwrap());
    }
    (controls, hops)
}

fn endpoints(addrs: &[SocketAddr]) -> Value {
    Value::Array(
        addrs
            .iter()
            .map(|a| {
                json!({"endpoint": {"address": {"socket_address": {
                    "address": a.ip().to_string(), "port_value": a.port()}}}})
            })
            .collect(),
    )
}

/// A gateway whose upstream cluster is `upstreams` (round robin) and whose
/// `control_cluster` is replica `control[0]` at priority 0, the others at priority 1.
async fn gateway(
    upstreams: &[SocketAddr],
    control: &[SocketAddr],
    opts: impl FnOnce(&mut EnvoyOptions),
) -> Envoy {
    let mut c = stack::filter_config(0, 0);
    c["lease_renew_ms"] = RENEW_MS.into();
    let mut eo = EnvoyOptions::with_filter(upstreams[0], control[0], c)
        .vm_env("KVGUARD_SECRET", stack::SECRET);
    eo.concurrency = 2;
    eo.component_log_level = Some("wasm:info".into());
    let up = endpoints(upstreams);
    let primary = endpoints(&control[..1]);
    let backup = endpoints(&control[1..]);
    eo.patch = Some(Arc::new(move |b: &mut Value| {
        for c in b["static_resources"]["clusters"].as_array_mut().unwrap() {
            let eps = match c["name"].as_str() {
                Some(UPSTREAM_CLUSTER) => json!([{"lb_endpoints": up.clone()}]),
                Some(CONTROL_CLUSTER) => json!([
                    {"priority": 0, "lb_endpoints": primary.clone()},
                    {"priority": 1, "lb_endpoints": backup.clone()}
                ]),
                _ => continue,
            };
            c["load_assignment"]["endpoints"] = eps;
        }
    }));
    opts(&mut eo);
    Envoy::start(eo).await.unwrap()
}

async fn wait_metric(control: &Control, series: &str, at_least: f64) {
    poll_until_async(series, W, Duration::from_millis(50), || async {
        // A labelled series appears with its first count.
        let text = control.metrics_text().await.ok()?;
        let n: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or(0.0);
        (n >= at_least).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", control.log()));
}

/// Sends a long non-streaming completion through `entry` in the background: its response
/// headers (and the stamp) come only at its end, and the lossy hop holds it before its
/// head too. Abort the handle to leave.
fn send_non_streaming(entry: SocketAddr, i: usize) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let body = serde_json::to_vec(&json!({"model": "tiny", "prompt": format!("p{i}"),
            "stream": false, "max_tokens": 1000}))
        .unwrap();
        let _ = client::request(
            entry,
            hyper::Method::POST,
            "/v1/completions",
            &[
                ("content-type", "application/json"),
                ("x-sim-rate", "5"),
                (lossy::HOLD_HEADER, "1"),
            ],
            body,
            false,
            Duration::from_secs(300),
        )
        .await;
    })
}

async fn inflight(controls: &[Control]) -> Vec<usize> {
    let mut v = Vec::new();
    for c in controls {
        v.push(c.inflight_ids().await.unwrap().len());
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_before_the_stamp_is_forwarded_to_the_replica_holding_the_request() {
    bounded("abort before the stamp", Duration::from_secs(60), async {
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let (controls, hops) = replicas(&engine, &[]).await;
        let ups: Vec<_> = hops.iter().map(LossyHandle::addr).collect();
        let admins: Vec<_> = controls.iter().map(|c| c.admin).collect();
        let envoy = gateway(&ups, &admins, |_| {}).await;
        // Six requests, round robin over the three replicas: two each.
        const N: usize = 6;
        let clients: Vec<_> = (0..N)
            .map(|i| send_non_streaming(envoy.listener_addr(), i))
            .collect();
        poll_until_async(
            "six requests in flight",
            W,
            Duration::from_millis(50),
            || async {
                let v = inflight(&controls).await;
                (v.iter().sum::<usize>() == N).then_some(v)
            },
        )
        .await
        .unwrap();
        let held = inflight(&controls).await;
        eprintln!("requests in flight per replica: {held:?}");
        assert!(held[1] + held[2] > 0, "no request on B or C: {held:?}");
        assert_eq!(engine.state().running.len(), N);
        // Every client leaves before any response header: the filter has no stamp, so
        // every abort goes to control_cluster, that is to A.
        let left = Instant::now();
        for c in clients {
            c.abort();
            let _ = c.await;
        }
        engine
            .wait_state("every abandoned request ended", W, |s| {
                s.running.is_empty() && s.waiting.is_empty()
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", controls[0].log()));
        let took = left.elapsed();
        eprintln!("all {N} ended {took:?} after their clients left");
        assert!(
            took <= Duration::from_secs(3),
            "{took:?}: far slower than one abort attempt (1 s) plus the filter's tick"
        );
        let a = &controls[0];
        let series = |r: &str| format!("kvguard_control_abort_api_answers_total{{result=\"{r}\"}}");
        assert_eq!(
            support::control_metric(a, &series("aborted")).await,
            held[0] as f64
        );
        assert_eq!(
            support::control_metric(a, &series("forwarded")).await,
            (held[1] + held[2]) as f64
        );
        assert_eq!(
            support::control_metric(a, &series("not_found")).await,
            0.0,
            "no 404 for an id a peer held"
        );
        assert_eq!(
            support::control_metric(
                a,
                "kvguard_control_peer_forwards_total{kind=\"abort\",result=\"ok\"}"
            )
            .await,
            (held[1] + held[2]) as f64
        );
        assert_eq!(
            support::control_metric(
                a,
                "kvguard_control_peer_forwards_total{kind=\"abort\",result=\"failed\"}"
            )
            .await,
            0.0
        );
        assert_eq!(
            support::control_metric(a, "kvguard_control_tombstones").await,
            (held[0] + held[1] + held[2]) as f64,
            "A tombstoned every id it ended or a peer ended on its forward"
        );
        for (i, c) in controls.iter().enumerate().skip(1) {
            assert_eq!(
                support::control_metric(
                    c,
                    "kvguard_control_peer_received_total{kind=\"abort\",result=\"aborted\"}"
                )
                .await,
                held[i] as f64,
                "replica {i}"
            );
            let by = c.aborts_by_reason().await.unwrap();
            assert_eq!(
                by.get("downstream_reset"),
                Some(&(held[i] as f64)),
                "replica {i}: {by:?}"
            );
        }
        drop(envoy);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_a_killed_gateways_request_on_one_ends_there_by_its_lease() {
    bounded(
        "killed gateway, three replicas",
        Duration::from_secs(60),
        async {
            let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
            let ttl = format!("{}ms", TTL.as_millis());
            let (controls, hops) =
                replicas(&engine, &["--lease-mode", "enforce", "--lease-ttl", &ttl]).await;
            let ups: Vec<_> = hops.iter().map(LossyHandle::addr).collect();
            let admins: Vec<_> = controls.iter().map(|c| c.admin).collect();
            // G1's inference goes to replica C only; G2's to all three.
            let mut g1 = gateway(&ups[2..], &admins, |_| {}).await;
            let g2 = gateway(&ups, &admins, |_| {}).await;
            // Both leases reach all three replicas, though every out-of-band renewal goes to
            // A. A short stream on each gateway names its upstream cluster; from then on its
            // in-band renewals land on the replicas it routes to (G1: C only) and reach the
            // others through C's fan-out: three make every lease enforceable everywhere.
            for g in [&g1, &g2] {
                let mut s = open(g.listener_addr(), 1, 3, "20").await;
                assert!(s.pop().unwrap().wait_end(W).await.unwrap().saw_done());
            }
            for c in &controls {
                wait_metric(c, "kvguard_control_leases_enforceable", 2.0).await;
            }
            let lost = send_non_streaming(g1.listener_addr(), 0);
            poll_until_async(
                "G1's request on C",
                W,
                Duration::from_millis(50),
                || async { (controls[2].inflight_ids().await.unwrap().len() == 1).then_some(()) },
            )
            .await
            .unwrap();
            // G2: six streams over the three replicas (60 tokens at 10/s: ~6 s), read to the end.
            let streams = open(g2.listener_addr(), 6, 60, "10").await;
            assert_eq!(inflight(&controls).await.iter().sum::<usize>(), 7);
            let mut reads = tokio::task::JoinSet::new();
            for mut s in streams {
                reads.spawn(async move { s.wait_end(W).await.map(|e| e.saw_done()) });
            }
            g1.guard().kill().unwrap();
            let killed = Instant::now();
            lost.abort();
            let _ = lost.await;
            poll_until_async(
                "G1's request ended on C",
                W,
                Duration::from_millis(20),
                || async {
                    let by = controls[2].aborts_by_reason().await.ok()?;
                    (by.get("gateway_lost") == Some(&1.0)).then_some(())
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", controls[2].log()));
            let took = killed.elapsed();
            eprintln!("G1's request on C ended {took:?} after the SIGKILL (TTL {TTL:?})");
            assert!(took <= TTL + Duration::from_secs(1), "{took:?} > TTL + 1 s");
            // G2 untouched: every stream reaches [DONE], no other replica ended anything.
            while let Some(r) = reads.join_next().await {
                assert!(
                    r.unwrap().unwrap(),
                    "a stream of the live gateway did not complete"
                );
            }
            for (i, c) in controls.iter().enumerate() {
                let by = c.aborts_by_reason().await.unwrap();
                let want = if i == 2 { 1.0 } else { 0.0 };
                assert_eq!(by.get("gateway_lost"), Some(&want), "replica {i}: {by:?}");
                assert_eq!(
                    support::control_metric(c, "kvguard_control_leases").await,
                    1.0,
                    "replica {i}: G2's lease"
                );
            }
            engine
                .wait_state("the engine idle", W, |s| s.running.is_empty())
                .await
                .unwrap();
            drop(g2);
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_restart_parent_that_exits_has_its_streams_ended_by_its_lease_the_childs_run_on() {
    bounded("hot restart parent exit", Duration::from_secs(60), async {
        const PARENT: usize = 20;
        const CHILD: usize = 10;
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let ttl = format!("{}ms", TTL.as_millis());
        let control = Control::start(
            engine.addr(),
            any,
            any,
            &[
                "--lease-mode",
                "enforce",
                "--lease-ttl",
                &ttl,
                "--idle-timeout",
                "off",
            ]
            .map(String::from),
        )
        .await
        .unwrap();
        let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
        let epoch0 = gateway(&[hop.addr()], &[control.admin], |eo| {
            eo.hot_restart = true;
            eo.drain_time_s = 1;
            eo.parent_shutdown_time_s = Some(3);
        })
        .await;
        wait_metric(&control, "kvguard_control_leases", 1.0).await;
        // The parent's streams: 1,000 tokens at 5/s, far longer than the test.
        let parent = open(epoch0.listener_addr(), PARENT, 1000, "5").await;
        let mut epoch0 = epoch0;
        let epoch1 = epoch0.hot_restart(epoch0.options().clone()).await.unwrap();
        epoch0
            .guard()
            .wait_for_log("closing and draining listeners", W)
            .await
            .unwrap();
        // The child's own lease, then its streams (60 tokens at 10/s: ~6 s), read to the end.
        wait_metric(&control, "kvguard_control_leases", 2.0).await;
        let child = open(epoch1.listener_addr(), CHILD, 60, "10").await;
        let mut reads = tokio::task::JoinSet::new();
        for mut s in child {
            reads.spawn(async move { s.wait_end(W).await.map(|e| e.saw_done()) });
        }
        let status = epoch0
            .guard()
            .wait_exit_async(Duration::from_secs(15))
            .await
            .unwrap();
        let exited = Instant::now();
        eprintln!("epoch 0 exited: {status:?}");
        drop(parent);
        engine
            .wait_state("the parent's streams ended", W, |s| {
                s.running.len() <= CHILD
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", control.log()));
        let took = exited.elapsed();
        let by = control.aborts_by_reason().await.unwrap();
        let (lost, reset) = (
            by.get("gateway_lost").copied().unwrap_or(0.0),
            by.get("downstream_reset").copied().unwrap_or(0.0),
        );
        eprintln!(
            "parent's {PARENT} streams ended {took:?} after it exited: {lost} by its lease, \
             {reset} by aborts the exiting parent still sent"
        );
        assert_eq!(lost + reset, PARENT as f64, "{by:?}");
        assert!(lost >= 1.0, "the lease ended none of them: {by:?}");
        assert!(took <= TTL + Duration::from_secs(1), "{took:?} > TTL + 1 s");
        while let Some(r) = reads.join_next().await {
            assert!(
                r.unwrap().unwrap(),
                "a stream of the child did not complete"
            );
        }
        assert_eq!(
            support::control_metric(&control, "kvguard_control_leases").await,
            1.0,
            "the child's lease"
        );
        drop(epoch1);
    })
    .await
    .unwrap();
}

async fn post(admin: SocketAddr, path: &'static str, body: Vec<u8>, sig: String) -> client::Resp {
    client::request(
        admin,
        hyper::Method::POST,
        path,
        &[
            ("content-type", "application/json"),
            (signature::SIGNATURE_HEADER, &sig),
        ],
        body,
        false,
        W,
    )
    .await
    .unwrap()
}

/// Posts `env` to `path` three times: signed with `forged` (401), signed with `key`
/// (`genuine`), and that same signature replayed (409).
async fn forged_genuine_replayed(
    admin: SocketAddr,
    path: &'static str,
    env: &[u8],
    key: &Key,
    forged: &Key,
    genuine: u16,
) {
    let r = post(
        admin,
        path,
        env.to_vec(),
        signature::sign(Domain::Envelope, forged, unix(), env),
    )
    .await;
    assert_eq!(r.status, 401, "forged, {path}: {}", r.text());
    let sig = signature::sign(Domain::Envelope, key, unix(), env);
    let r = post(admin, path, env.to_vec(), sig.clone()).await;
    assert_eq!(r.status, genuine, "genuine, {path}: {}", r.text());
    let r = post(admin, path, env.to_vec(), sig).await;
    assert_eq!(r.status, 409, "replayed, {path}: {}", r.text());
}

fn unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_replayed_forwarded_messages_are_refused_and_counted() {
    bounded(
        "forged and replayed forwards",
        Duration::from_secs(60),
        async {
            let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
            let any = SocketAddr::from(([127, 0, 0, 1], 0));
            let control = Control::start(engine.addr(), any, any, &[]).await.unwrap();
            let key = Key::try_new(stack::SECRET.as_bytes()).unwrap();
            let forged_key = Key::try_new(b"not-the-replicas-key-0123456789").unwrap();
            let id = RequestId::try_new(b"peer-forward-1").unwrap();
            let abort = AbortRequest::new(&id, AbortReason::DownstreamReset, 10, 0).to_json();
            let env = Forwarded::new("10.9.9.9:9902", &abort).unwrap().to_json();
            let a = control.admin;
            let (pa, pl) = (
                kvguard_contract::PEER_ABORT_PATH,
                kvguard_contract::PEER_LEASE_PATH,
            );
            // Genuine: not held here, 404, and tombstoned (a request with the id is
            // refused: the abort overtook it on another replica).
            forged_genuine_replayed(a, pa, &env, &key, &forged_key, 404).await;
            assert_eq!(
                support::control_metric(&control, "kvguard_control_tombstones").await,
                1.0
            );
            // A gateway's own signed abort is not a forwarded one (and is not forwarded on):
            // its MAC is an abort's, not an envelope's; and an abort body signed as an
            // envelope is still no envelope.
            let as_gateway = signature::sign(Domain::Abort, &key, unix(), &abort);
            let r = post(a, pa, abort.clone(), as_gateway).await;
            assert_eq!(r.status, 401, "{}", r.text());
            let as_replica = signature::sign(Domain::Envelope, &key, unix(), &abort);
            let r = post(a, pa, abort.clone(), as_replica).await;
            assert_eq!(r.status, 400, "{}", r.text());
            // Renewals: forged, genuine, replayed.
            let inst = kvguard_contract::InstanceId([5; 16]);
            let renewal = Renewal::new(inst, 1).to_json();
            let env = Forwarded::new("10.9.9.9:9902", &renewal).unwrap().to_json();
            forged_genuine_replayed(a, pl, &env, &key, &forged_key, 200).await;
            assert_eq!(
                support::control_metric(&control, "kvguard_control_leases").await,
                1.0
            );
            // Stale signature time (outside ±30 s): refused like an abort's.
            let r = post(
                a,
                pl,
                env.clone(),
                signature::sign(Domain::Envelope, &key, unix() - 120, &env),
            )
            .await;
            assert_eq!(r.status, 401, "{}", r.text());
            let s = |k: &str, r: &str| {
                format!("kvguard_control_peer_received_total{{kind=\"{k}\",result=\"{r}\"}}")
            };
            assert_eq!(
                support::control_metric(&control, &s("abort", "unauthorized")).await,
                2.0
            );
            assert_eq!(
                support::control_metric(&control, &s("abort", "replay")).await,
                1.0
            );
            assert_eq!(
                support::control_metric(&control, &s("abort", "not_found")).await,
                1.0
            );
            assert_eq!(
                support::control_metric(&control, &s("abort", "bad_request")).await,
                1.0
            );
            assert_eq!(
                support::control_metric(&control, &s("renewal", "unauthorized")).await,
                2.0
            );
            assert_eq!(
                support::control_metric(&control, &s("renewal", "replay")).await,
                1.0
            );
            assert_eq!(
                support::control_metric(&control, &s("renewal", "accepted")).await,
                1.0
            );
            // The id is tombstoned: a request with it is refused.
            let r = client::request(
                control.proxy,
                hyper::Method::POST,
                "/v1/completions",
                &[
                    ("content-type", "application/json"),
                    ("x-request-id", "peer-forward-1"),
                ],
                serde_json::to_vec(&support::completion(3, false)).unwrap(),
                false,
                W,
            )
            .await
            .unwrap();
            assert_eq!(r.status, 409, "{}", r.text());
        },
    )
    .await
    .unwrap();
}

/// Measurement (docs/DESIGN.md "What leaves an exiting Envoy"), not a check: `STREAMS`
/// clients leave at once and Envoy gets SIGTERM `delay` later; how many of their aborts
/// reach kvguard-control? Run with
/// `cargo test -p kvguard-integration --test lease_peers -- --ignored --nocapture measure`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; prints its figures"]
async fn measure_aborts_leaving_a_sigtermed_envoy_during_disconnects() {
    bounded("SIGTERM measurement", Duration::from_secs(120), async {
        const STREAMS: usize = 100;
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let off = ["--idle-timeout", "off"].map(String::from);
        let control = Control::start(engine.addr(), any, any, &off).await.unwrap();
        let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
        let series = "kvguard_control_abort_api_answers_total{result=\"aborted\"}";
        for delay_ms in [0u64, 10, 50, 200] {
            let mut envoy = gateway(&[hop.addr()], &[control.admin], |_| {}).await;
            let streams = open(envoy.listener_addr(), STREAMS, 1000, "5").await;
            let before = support::control_metric(&control, series).await;
            drop(streams);
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            let (_, in_grace) = envoy.guard().terminate(Duration::from_secs(10)).unwrap();
            // Whatever was going to arrive has arrived well within this (one attempt is
            // at most 1 s; Envoy is gone).
            tokio::time::sleep(Duration::from_secs(2)).await;
            let arrived = support::control_metric(&control, series).await - before;
            eprintln!(
                "MEASURE SIGTERM {delay_ms} ms after {STREAMS} disconnects: {arrived} of {STREAMS} aborts arrived (exited in grace: {in_grace})"
            );
            // End the rest so the next round starts from an idle engine.
            for id in control.inflight_ids().await.unwrap() {
                let body = AbortRequest::new(
                    &RequestId::try_new(id.as_bytes()).unwrap(),
                    AbortReason::Operator,
                    0,
                    0,
                )
                .to_json();
                let key = Key::try_new(stack::SECRET.as_bytes()).unwrap();
                let sig = signature::sign(Domain::Abort, &key, unix(), &body);
                post(control.admin, kvguard_contract::ABORT_PATH, body, sig).await;
            }
            engine
                .wait_state("idle", W, |s| s.running.is_empty())
                .await
                .unwrap();
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_down_is_counted_and_the_abort_nobody_was_found_holding_asks_again() {
    bounded("a peer down", Duration::from_secs(60), async {
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let down = stack::closed_port().await.unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let engine_addr = engine.addr();
        let control = with_free_addrs(1, |a| async move {
            let peers = format!("http://{down},http://{}", a[0]);
            Control::start(engine_addr, any, a[0], &["--peers".into(), peers]).await
        })
        .await
        .unwrap();
        let key = Key::try_new(stack::SECRET.as_bytes()).unwrap();
        let id = RequestId::try_new(b"nowhere-1").unwrap();
        let body = AbortRequest::new(&id, AbortReason::DownstreamReset, 10, 0).to_json();
        let sent = Instant::now();
        let r = post(
            control.admin,
            kvguard_contract::ABORT_PATH,
            body.clone(),
            signature::sign(Domain::Abort, &key, unix(), &body),
        )
        .await;
        let took = sent.elapsed();
        // The peer that did not answer may hold it: 503, the gateway asks again.
        assert_eq!(r.status, 503, "{}", r.text());
        assert!(r.text().contains("peer_unanswered"), "{}", r.text());
        assert!(
            took < Duration::from_secs(1),
            "{took:?}: a peer down must not hold the answer past its 500 ms bound"
        );
        assert_eq!(
            support::control_metric(
                &control,
                "kvguard_control_peer_forwards_total{kind=\"abort\",result=\"failed\"}"
            )
            .await,
            1.0
        );
        // It left itself out of the list: one peer.
        assert_eq!(
            support::control_metric(&control, "kvguard_control_peers").await,
            1.0
        );
        // Not tombstoned: the gateway's retry must reach the peers again, not find a
        // tombstone here (the retry, once the peer answers, tombstones it).
        assert_eq!(
            support::control_metric(&control, "kvguard_control_tombstones").await,
            0.0
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_renews_every_replica_its_stamps_named() {
    bounded(
        "renewals to stamped replicas",
        Duration::from_secs(60),
        async {
            let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
            let any = SocketAddr::from(([127, 0, 0, 1], 0));
            // The replica stamps its responses with its admin address.
            let engine_addr = engine.addr();
            let control = with_free_addrs(1, |a| async move {
                let advertise = a[0].to_string();
                Control::start(engine_addr, any, a[0], &["--advertise".into(), advertise]).await
            })
            .await
            .unwrap();
            let admin = control.admin;
            let port = admin.port();
            let envoy = gateway(&[control.proxy], &[control.admin], |eo| {
                let c = eo.filter_config.as_mut().unwrap();
                c["control_target_cluster"] = CONTROL_TARGET_CLUSTER.into();
                c["control_target_cidrs"] = json!(["127.0.0.0/8"]);
                c["control_target_ports"] = json!([port]);
                eo.original_dst_cluster = Some(CONTROL_TARGET_CLUSTER.into());
            })
            .await;
            let renewals = |r: &str| {
                format!("kvguard_control_lease_renewals_total{{path=\"admin\",result=\"{r}\"}}")
            };
            wait_metric(&control, &renewals("accepted"), 2.0).await;
            // No stamp seen yet: each period's renewal reaches the replica once.
            assert_eq!(
                support::control_metric(&control, &renewals("duplicate")).await,
                0.0
            );
            // A stream in flight there carries the stamp; while it runs, each period's renewal
            // goes to control_cluster and, through the per-replica route, to the stamped
            // replica: the replica gets it twice (one accepted, one duplicate).
            let mut s = client::stream_sse(
                envoy.listener_addr(),
                "/v1/chat/completions",
                &chat(60),
                &[("x-sim-rate", "20")],
                false,
            )
            .await
            .unwrap();
            wait_metric(&control, &renewals("duplicate"), 2.0).await;
            assert!(s.wait_end(W).await.unwrap().saw_done());
            assert_eq!(
                support::control_metric(&control, &renewals("replay")).await,
                0.0
            );
            assert_eq!(
                support::stat(
                    &envoy,
                    "kvguard_filter_lease_renewals_total_result=.=failed;.;"
                )
                .await,
                0.0
            );
        },
    )
    .await
    .unwrap();
}

/// The peer renewal messages all replicas sent so far.
async fn peer_renewals(controls: &[Control]) -> f64 {
    let mut n = 0.0;
    for c in controls {
        let text = c.metrics_text().await.unwrap();
        n += text
            .lines()
            .filter(|l| {
                l.starts_with("kvguard_control_peer_forwards_total{")
                    && l.contains("kind=\"renewal\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_replicas_and_one_gateway_cost_at_most_r_peer_renewal_messages_a_period() {
    bounded("eight replicas", Duration::from_secs(90), async {
        const R: usize = 8;
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let (controls, hops) = replicas_n(&engine, R, &[], true).await;
        let ups: Vec<_> = hops.iter().map(LossyHandle::addr).collect();
        let admins: Vec<_> = controls.iter().map(|c| c.admin).collect();
        let ports: Vec<u16> = admins.iter().map(|a| a.port()).collect();
        let g = gateway(&ups, &admins, |eo| {
            let c = eo.filter_config.as_mut().unwrap();
            c["control_target_cluster"] = CONTROL_TARGET_CLUSTER.into();
            c["control_target_cidrs"] = json!(["127.0.0.0/8"]);
            c["control_target_ports"] = json!(ports);
            eo.original_dst_cluster = Some(CONTROL_TARGET_CLUSTER.into());
        })
        .await;
        // Streams on every replica (round robin), stamped: the gateway renews each replica
        // directly, and in band over its upstream cluster.
        let streams = open(g.listener_addr(), 2 * R, 400, "10").await;
        for c in &controls {
            wait_metric(c, "kvguard_control_leases_enforceable", 1.0).await;
        }
        // Twenty periods of steady state.
        let periods = 20.0;
        let before = peer_renewals(&controls).await;
        let t = Instant::now();
        tokio::time::sleep(Duration::from_millis(RENEW_MS * 20)).await;
        let sent = peer_renewals(&controls).await - before;
        let measured = t.elapsed().as_secs_f64() * 1000.0 / RENEW_MS as f64;
        let per_period = sent / measured.max(periods);
        eprintln!("{R} replicas, one gateway: {sent} peer renewal messages in {measured:.1} periods ({per_period:.2} a period)");
        assert!(sent > 0.0, "the in-band renewal reaches every replica through one");
        assert!(
            sent <= R as f64 * (measured + 1.0),
            "{sent} peer renewal messages in {measured:.1} periods: more than {R} a period"
        );
        drop(streams);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_replica_still_takes_forwarded_renewals_and_aborts() {
    bounded("draining replica", Duration::from_secs(60), async {
        let engine = sim::spawn(SimConfig::roomy()).await.unwrap();
        let (mut controls, hops) = replicas_n(&engine, 2, &["--drain-timeout", "60s"], false).await;
        let admins: Vec<_> = controls.iter().map(|c| c.admin).collect();
        // Inference to replica B only; aborts and renewals to A (B is the backup).
        let g = gateway(&[hops[1].addr()], &admins, |_| {}).await;
        let mut streams = open(g.listener_addr(), 2, 1000, "5").await;
        // B holds the lease from the proofs on its requests, and takes A's forwarded
        // renewals.
        let series = "kvguard_control_peer_received_total{kind=\"renewal\",result=\"accepted\"}";
        wait_metric(&controls[1], series, 1.0).await;
        assert_eq!(inflight(&controls).await, vec![0, 2]);
        // B is told to stop: not ready, draining its two streams.
        controls[1].guard().signal(libc::SIGTERM).unwrap();
        poll_until_async("B not ready", W, Duration::from_millis(50), || async {
            let r = client::get(controls[1].admin, "/readyz").await.ok()?;
            (r.status == 503).then_some(())
        })
        .await
        .unwrap();
        // A still forwards each period's renewal to B, and B takes it.
        let taken = support::control_metric(&controls[1], series).await;
        wait_metric(&controls[1], series, taken + 3.0).await;
        // A client leaves: its abort goes to A, which forwards it to the draining B.
        drop(streams.pop());
        poll_until_async(
            "the abort ended on B",
            W,
            Duration::from_millis(20),
            || async {
                let by = controls[1].aborts_by_reason().await.ok()?;
                (by.get("downstream_reset") == Some(&1.0)).then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", controls[1].log()));
        assert_eq!(inflight(&controls).await, vec![0, 1]);
        drop(streams);
    })
    .await
    .unwrap();
}
