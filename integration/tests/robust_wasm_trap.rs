//! A wasm trap in one worker's VM, under `failure_policy` FAIL_OPEN and FAIL_RELOAD.
//!
//! Real Envoy 1.40 (`--concurrency 2`: two worker VMs) with the filter's test build
//! (`kvguard_filter_trap.wasm`, feature `trap-injection`) → the simulator; aborts → the
//! verifying receiver. The test build traps its VM (wasm `unreachable`) when a request
//! carries `x-kvguard-test-trap: response-body | request-headers`, and tags every request
//! it sees towards the upstream with `x-kvguard-test-vm: <random id of that VM instance>`,
//! which the simulator records: a request's tag says which worker VM ran the filter for
//! it (no tag: the filter did not run).
//!
//! Measured and asserted, the same under both policies unless noted:
//! - the trapping request (trap in its response body): its 200 head has gone out, its body
//!   is cut before the first event (`wasm_fail_stream` in the access log);
//! - every other stream live on the trapped VM is cut at its next body chunk (HTTP/1.1:
//!   connection closed; HTTP/2: RST_STREAM; `wasm_fail_stream`), FAIL_OPEN included. No
//!   abort is sent for them (their VM is gone); the engine here sees the disconnect
//!   (behind a hop that hides it they would run to kvguard-control's max age);
//! - every stream on the other worker completes in full; no abort at all is sent;
//! - FAIL_OPEN: later requests on the trapped worker pass (200, complete) with no filter:
//!   not counted, and a disconnect there sends no abort; the other worker keeps tracking;
//!   Envoy counts no reload;
//! - FAIL_RELOAD: the next request on that worker gets a fresh VM (new id,
//!   `wasm.kvguard.vm_reload_success` +1, `wasm.envoy.wasm.runtime.v8.created` +1), and
//!   every request that gets through is tracked again (a disconnect there gets its abort).
//!   Within Envoy's reload backoff (~1 s after the last reload, measured) requests on that
//!   worker are refused with 503 instead, each counted in `wasm.kvguard.vm_reload_backoff`;
//! - a trap in the request headers answers that request 503 and nothing reaches the
//!   engine; FAIL_OPEN then runs both workers without the filter, FAIL_RELOAD reloads that
//!   VM again (after its backoff);
//! - the shared gauges come back down: a live VM of the process finds the trapped VM's
//!   entry in the VM table silent for 3 lease periods and takes its share of
//!   `active_requests` (and `pending_aborts`, `vm_memory_bytes`) back; with both VMs
//!   trapped (FAIL_OPEN) nobody is left to, and the gauge keeps what the second one had;
//!   Envoy never crashes.
//!
//! Behind a hop that hides disconnects, with kvguard-control (`vm_lost`, below): the
//! trapped VM's streams, cut downstream by Envoy, would run on at the engine; each
//! renewal of the process lists its live VMs, and kvguard-control ends the streams of the
//! VM the renewals leave out for its TTL. The healthy VM's streams are untouched.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client::{self, SseStream};
use kvguard_integration::demo::stack::{self, Control};
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::lossy::{self, LossyConfig};
use kvguard_integration::paths;
use kvguard_integration::receiver::{self, Receiver, ReceiverConfig};
use kvguard_integration::sim::{self, EndKind, SimConfig, SimHandle};
use kvguard_integration::wait::{bounded, poll_until_async};
use serde_json::json;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use support::{access_line, chat, stat, T, W};

const VM_HEADER: &str = "x-kvguard-test-vm";
const TRAP_HEADER: &str = "x-kvguard-test-trap";
const TAG: &str = "x-test-tag";
/// Streams opened before the trap (more if one worker has fewer than 2 of them).
const LIVE: usize = 16;
/// Bound on requests sent while looking for a worker (2 workers, connections spread by the
/// kernel: the chance of missing one 64 times is 2^-64).
const TRIES: usize = 64;
/// The filter's lease period here: a trapped VM's gauge share is taken back within
/// `vms::SILENT_PERIODS` (3) of them after its last beat.
const RENEW_MS: u64 = 1000;

struct Rig {
    sim: SimHandle,
    recv: Receiver,
    envoy: Envoy,
}

async fn rig(policy: &str) -> Rig {
    let sim = sim::spawn(SimConfig::default()).await.unwrap();
    let recv = receiver::spawn(ReceiverConfig::new(vec![support::key()]))
        .await
        .unwrap();
    let mut o = support::options(sim.addr(), recv.addr(), json!({"lease_renew_ms": RENEW_MS}));
    o.wasm_path = Some(paths::trap_wasm_path().unwrap());
    o.concurrency = 2;
    o.failure_policy = policy.into();
    let envoy = Envoy::start(o).await.unwrap();
    Rig { sim, recv, envoy }
}

/// What the simulator saw of the request tagged `tag`: its request id and VM tag.
fn seen(sim: &SimHandle, tag: &str) -> Option<(String, Option<String>)> {
    sim.state()
        .requests
        .into_iter()
        .find(|r| r.headers.get(TAG).map(String::as_str) == Some(tag))
        .map(|r| (r.request_id, r.headers.get(VM_HEADER).cloned()))
}

/// Opens a stream tagged `tag` and reads its first data event; returns it with the
/// request id and VM tag the simulator saw, or the status when it is not 200.
async fn open(
    rig: &Rig,
    tag: &str,
    max_tokens: u32,
    http2: bool,
) -> Result<(SseStream, String, Option<String>), u16> {
    open_on(&rig.envoy, &rig.sim, tag, max_tokens, http2).await
}

/// [`open`] on `envoy`, the simulator `sim` behind it.
async fn open_on(
    envoy: &Envoy,
    sim: &SimHandle,
    tag: &str,
    max_tokens: u32,
    http2: bool,
) -> Result<(SseStream, String, Option<String>), u16> {
    let mut s = client::stream_sse(
        envoy.listener_addr(),
        "/v1/chat/completions",
        &chat(max_tokens),
        &[(TAG, tag), ("x-sim-rate", "10")],
        http2,
    )
    .await
    .unwrap();
    if s.status != 200 {
        return Err(s.status);
    }
    s.next_data(W).await.unwrap().unwrap();
    let (id, vm) = seen(sim, tag).unwrap();
    Ok((s, id, vm))
}

/// A short request to completion (or its error answer); returns the status and what the
/// simulator saw (`None`: it never reached the engine).
async fn short(
    rig: &Rig,
    tag: &str,
    extra: &[(&str, &str)],
) -> (u16, Option<(String, Option<String>)>) {
    let mut headers = vec![(TAG, tag)];
    headers.extend_from_slice(extra);
    let mut s = client::stream_sse(
        rig.envoy.listener_addr(),
        "/v1/chat/completions",
        &chat(3),
        &headers,
        false,
    )
    .await
    .unwrap();
    let status = s.status;
    let events = s.collect(W).await.unwrap();
    let seen = seen(&rig.sim, tag);
    if status == 200 {
        assert!(
            events.last().is_some_and(|e| e.is_done()),
            "{tag}: {events:?}"
        );
        assert!(seen.is_some(), "{tag}");
    }
    (status, seen)
}

/// Envoy's own wasm counters (`wasm.*`, not the filter's `wasmcustom.*`).
async fn wasm_stats(envoy: &Envoy) -> std::collections::BTreeMap<String, f64> {
    envoy
        .stats_matching("wasm.")
        .await
        .unwrap()
        .into_iter()
        .filter(|(k, _)| !k.starts_with("wasmcustom."))
        .collect()
}

struct Trapped {
    trapped: String,
    healthy: String,
    /// Tracked streams that were live on the trapped VM (the trapping one included).
    stranded: usize,
}

/// Streams live on both workers, then a trap in one VM's response-body callback.
async fn trap_mid_traffic(rig: &Rig) -> Trapped {
    let mut live = Vec::new();
    let mut vms = std::collections::BTreeMap::<String, usize>::new();
    while live.len() < LIVE || vms.len() < 2 || vms.values().any(|n| *n < 2) {
        assert!(
            live.len() < LIVE + TRIES,
            "one worker got no stream: {vms:?}"
        );
        let i = live.len();
        let (s, id, vm) = open(rig, &format!("live-{i}"), 40, i % 2 == 1)
            .await
            .unwrap();
        let vm = vm.expect("the filter ran");
        *vms.entry(vm.clone()).or_default() += 1;
        live.push((s, id, vm));
    }
    eprintln!(
        "live streams per VM: {vms:?}; vm_memory_bytes {}",
        stat(&rig.envoy, "kvguard_filter_vm_memory_bytes").await
    );
    let before = wasm_stats(&rig.envoy).await;

    // The trap: its head goes out (the response-body callback has not run yet), then the
    // VM traps on the first body chunk, which never reaches the client.
    let mut trap = client::stream_sse(
        rig.envoy.listener_addr(),
        "/v1/chat/completions",
        &chat(40),
        &[
            (TAG, "trap"),
            (TRAP_HEADER, "response-body"),
            ("x-sim-rate", "10"),
        ],
        false,
    )
    .await
    .unwrap();
    assert_eq!(trap.status, 200);
    let got = trap
        .wait_end(W)
        .await
        .unwrap_or_else(|e| panic!("the trapping stream hangs: {e:#}"));
    assert!(
        got.events.iter().all(|e| e.data.is_none()),
        "the trapping stream got data: {got:?}"
    );
    let (trap_id, trap_vm) = seen(&rig.sim, "trap").unwrap();
    let trapped = trap_vm.unwrap();
    let healthy = vms.keys().find(|v| **v != trapped).unwrap().clone();
    assert!(vms.contains_key(&trapped), "{trapped} not in {vms:?}");
    assert!(access_line(&rig.envoy, &trap_id)
        .await
        .contains("wasm_fail_stream"));
    support::wait_log(&rig.envoy, "failed: Uncaught RuntimeError: unreachable").await;

    // Streams on the trapped VM are cut; the others complete in full.
    let mut cut_ids = Vec::new();
    for (mut s, id, vm) in live {
        let r = s
            .wait_end(W)
            .await
            .unwrap_or_else(|e| panic!("{id} (VM {vm}) hangs: {e:#}"));
        if vm == trapped {
            assert!(!r.saw_done(), "{id} on the trapped VM completed");
            let line = access_line(&rig.envoy, &id).await;
            assert!(line.contains("wasm_fail_stream"), "{line}");
            cut_ids.push(id);
        } else {
            assert!(r.completed(), "{id} on the healthy VM: {r:?}");
            let events = r.events;
            // After the role chunk read by `open`: 40 tokens (the last with its finish
            // reason), usage, [DONE].
            assert_eq!(events.len(), 42, "{id}");
            assert!(access_line(&rig.envoy, &id).await.contains("via_upstream"));
        }
    }
    // The engine sees the cut streams go (Envoy resets their upstream requests).
    cut_ids.push(trap_id);
    let ids = cut_ids.clone();
    rig.sim
        .wait_state("the cut streams ended at the engine", W, move |s| {
            ids.iter().all(|id| {
                s.request(id)
                    .is_some_and(|r| r.ended == Some(EndKind::Disconnected))
            })
        })
        .await
        .unwrap();
    // No abort for anything: the healthy worker's streams completed, the trapped VM is gone.
    assert_eq!(rig.recv.calls().len(), 0);
    let after = wasm_stats(&rig.envoy).await;
    assert_eq!(before, after, "Envoy's wasm stats moved at the trap");
    eprintln!(
        "trapped VM {trapped}: {} streams cut; wasm stats {after:?}",
        cut_ids.len()
    );
    Trapped {
        trapped,
        healthy,
        stranded: cut_ids.len(),
    }
}

/// What later traffic saw: per request its status and VM tag (`None`: no filter ran).
#[derive(Debug, Default)]
struct Later {
    /// Requests read to the end: (status, VM tag).
    requests: Vec<(u16, Option<String>)>,
    /// Streams dropped after their first event: (request id, VM tag).
    dropped: Vec<(String, Option<String>)>,
    /// Answers other than 200 while opening the streams to drop.
    refused: Vec<u16>,
}

impl Later {
    /// Every answer that was not 200.
    fn errors(&self) -> Vec<u16> {
        self.requests
            .iter()
            .map(|(s, _)| *s)
            .filter(|s| *s != 200)
            .chain(self.refused.iter().copied())
            .collect()
    }

    /// VM tags of every request that reached the engine.
    fn tags(&self) -> Vec<Option<String>> {
        self.requests
            .iter()
            .filter(|(s, _)| *s == 200)
            .map(|(_, v)| v.clone())
            .chain(self.dropped.iter().map(|(_, v)| v.clone()))
            .collect()
    }
}

/// Later traffic: short requests until two workers (two distinct VM tags, "none" being
/// one) answered, then streams dropped mid-way until two workers had one.
async fn later_traffic(rig: &Rig, round: &str) -> Later {
    let mut l = Later::default();
    let distinct = |v: &mut dyn Iterator<Item = Option<String>>| v.collect::<BTreeSet<_>>().len();
    let mut i = 0;
    while distinct(
        &mut l
            .requests
            .iter()
            .filter(|(s, _)| *s == 200)
            .map(|(_, v)| v.clone()),
    ) < 2
    {
        assert!(i < TRIES, "later requests reached one worker only: {l:?}");
        let (status, seen) = short(rig, &format!("{round}-new-{i}"), &[]).await;
        l.requests.push((status, seen.and_then(|(_, vm)| vm)));
        i += 1;
        if status != 200 {
            // A worker refusing requests (reload backoff): poll it out.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut i = 0;
    while distinct(&mut l.dropped.iter().map(|(_, v)| v.clone())) < 2 {
        assert!(i < TRIES, "disconnects reached one worker only: {l:?}");
        match open(rig, &format!("{round}-dc-{i}"), 100, false).await {
            Ok((s, id, vm)) => {
                s.disconnect();
                l.dropped.push((id, vm));
            }
            Err(status) => {
                l.refused.push(status);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        i += 1;
    }
    eprintln!("{round}: {l:?}");
    l
}

/// Waits for the aborts of the `expected` ids, then checks that no other one comes.
async fn assert_aborts(rig: &Rig, before: usize, expected: &[String]) {
    let calls = rig
        .recv
        .wait_for_calls(before + expected.len(), W)
        .await
        .unwrap();
    let got: BTreeSet<_> = calls[before..]
        .iter()
        .map(|c| c.request_id().unwrap().to_string())
        .collect();
    assert_eq!(got, expected.iter().cloned().collect::<BTreeSet<_>>());
    rig.recv
        .expect_no_more_calls(before + expected.len(), Duration::from_millis(500))
        .await
        .unwrap();
}

async fn tracked(rig: &Rig) -> f64 {
    stat(&rig.envoy, "kvguard_filter_requests_tracked_total").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trap_under_fail_open() {
    bounded("trap under FAIL_OPEN", T, async {
        let rig = rig("FAIL_OPEN").await;
        let t = trap_mid_traffic(&rig).await;
        let tracked0 = tracked(&rig).await;

        // Later requests all succeed: the healthy VM tracks its share; the trapped worker
        // runs without the filter (no tag, not counted).
        let l = later_traffic(&rig, "open").await;
        assert_eq!(l.errors(), Vec::<u16>::new());
        let tags = l.tags();
        assert!(
            tags.iter()
                .all(|v| v.is_none() || v.as_ref() == Some(&t.healthy)),
            "{l:?}"
        );
        let filtered = tags.iter().filter(|v| v.is_some()).count();
        assert_eq!(tracked(&rig).await - tracked0, filtered as f64);
        // A disconnect gets its abort only where the filter still runs.
        let expected: Vec<String> = l
            .dropped
            .iter()
            .filter(|(_, v)| v.is_some())
            .map(|(id, _)| id.clone())
            .collect();
        assert_aborts(&rig, 0, &expected).await;
        let w = wasm_stats(&rig.envoy).await;
        assert_eq!(w["wasm.kvguard.vm_reload_success"], 0.0, "{w:?}");
        assert_eq!(w["wasm.kvguard.vm_reload_backoff"], 0.0, "{w:?}");

        // The healthy VM found the trapped VM's entry silent and took its share back:
        // nothing is tracked now.
        wait_gauge(&rig.envoy, 0.0).await;

        // A trap in the request headers of the remaining VM answers that request 503 and
        // nothing reaches the engine. On the dead worker the header does nothing (no
        // filter runs there): try again.
        let mut i = 0;
        loop {
            assert!(i < TRIES, "no request reached the remaining VM");
            let tag = format!("hdr-trap-{i}");
            let (status, seen) = short(&rig, &tag, &[(TRAP_HEADER, "request-headers")]).await;
            if status == 200 {
                assert_eq!(seen.unwrap().1, None, "{tag} passed a live VM");
                i += 1;
                continue;
            }
            assert_eq!(status, 503);
            assert!(seen.is_none(), "the trapping request reached the engine");
            break;
        }
        support::wait_log(&rig.envoy, "proxy_on_request_headers failed").await;
        // Both VMs gone: every request passes untracked, a disconnect sends no abort.
        let calls = rig.recv.calls().len();
        let tracked1 = tracked(&rig).await;
        for i in 0..8 {
            let (status, seen) = short(&rig, &format!("after-{i}"), &[]).await;
            assert_eq!((status, seen.unwrap().1), (200, None));
        }
        let (s, _, vm) = open(&rig, "after-dc", 100, false).await.unwrap();
        assert_eq!(vm, None);
        s.disconnect();
        rig.recv
            .expect_no_more_calls(calls, Duration::from_millis(500))
            .await
            .unwrap();
        assert_eq!(tracked(&rig).await, tracked1);
        finish(&rig, &t).await;
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trap_under_fail_reload() {
    bounded("trap under FAIL_RELOAD", T, async {
        let rig = rig("FAIL_RELOAD").await;
        let t = trap_mid_traffic(&rig).await;
        let w0 = wasm_stats(&rig.envoy).await;
        let tracked0 = tracked(&rig).await;

        // The next request on the trapped worker reloads its VM (a new id); every request
        // that gets through is tracked again. Within the reload backoff, requests on that
        // worker are refused with 503 instead (counted by vm_reload_backoff).
        let l = later_traffic(&rig, "reload").await;
        let w = wasm_stats(&rig.envoy).await;
        let tags = l.tags();
        assert!(
            tags.iter().all(Option::is_some),
            "untracked requests: {l:?}"
        );
        let fresh: BTreeSet<&String> = tags.iter().flatten().filter(|v| **v != t.healthy).collect();
        assert_eq!(fresh.len(), 1, "{l:?}");
        let fresh = (*fresh.iter().next().unwrap()).clone();
        assert_ne!(fresh, t.trapped);
        assert!(l.errors().iter().all(|s| *s == 503), "{l:?}");
        assert_eq!(
            w["wasm.kvguard.vm_reload_backoff"] - w0["wasm.kvguard.vm_reload_backoff"],
            l.errors().len() as f64,
            "{w:?}"
        );
        assert_eq!(w["wasm.kvguard.vm_reload_success"], 1.0, "{w:?}");
        assert_eq!(
            w["wasm.envoy.wasm.runtime.v8.created"],
            w0["wasm.envoy.wasm.runtime.v8.created"] + 1.0
        );
        assert_eq!(tracked(&rig).await - tracked0, tags.len() as f64);
        // A disconnect on either worker, the reloaded one included, gets its abort.
        let expected: Vec<String> = l.dropped.iter().map(|(id, _)| id.clone()).collect();
        assert_aborts(&rig, 0, &expected).await;

        // A trap in the request headers: that request gets 503 and never reaches the
        // engine; requests on that worker get 503 until the backoff lets Envoy reload the
        // VM (a third id), then are tracked again.
        let (status, seen) = short(&rig, "hdr-trap", &[(TRAP_HEADER, "request-headers")]).await;
        assert_eq!(status, 503);
        assert!(seen.is_none(), "the trapping request reached the engine");
        support::wait_log(&rig.envoy, "proxy_on_request_headers failed").await;
        let backoff0 = wasm_stats(&rig.envoy).await["wasm.kvguard.vm_reload_backoff"];
        let known = [t.healthy.clone(), fresh.clone(), t.trapped.clone()];
        let mut refused = 0usize;
        let mut i = 0;
        loop {
            assert!(
                i < 4 * TRIES,
                "no second reload: {:?}",
                wasm_stats(&rig.envoy).await
            );
            let (status, seen) = short(&rig, &format!("after-{i}"), &[]).await;
            i += 1;
            if status == 503 {
                assert!(seen.is_none());
                refused += 1;
                // Poll the backoff out rather than hammering the worker.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            assert_eq!(status, 200);
            let vm = seen.unwrap().1.expect("tracked");
            if !known.contains(&vm) {
                break;
            }
        }
        let w = wasm_stats(&rig.envoy).await;
        assert_eq!(w["wasm.kvguard.vm_reload_success"], 2.0, "{w:?}");
        assert_eq!(
            w["wasm.kvguard.vm_reload_backoff"] - backoff0,
            refused as f64,
            "{w:?}"
        );
        eprintln!("second trap: {refused} request(s) refused with 503 during the reload backoff");
        finish(&rig, &t).await;
    })
    .await
    .unwrap();
}

/// Waits for the shared gauge of tracked requests to read `v`.
async fn wait_gauge(envoy: &Envoy, v: f64) {
    envoy
        .wait_stat("wasmcustom.kvguard_filter_active_requests", W, |x| x == v)
        .await
        .unwrap();
}

/// Envoy alive and ready; the shared gauges at rest: nothing tracked (the trapped VMs'
/// shares taken back by a live VM), nothing pending.
async fn finish(rig: &Rig, t: &Trapped) {
    let envoy = &rig.envoy;
    let ready = client::get(envoy.admin_addr(), "/ready").await.unwrap();
    assert_eq!(ready.status, 200);
    wait_gauge(envoy, 0.0).await;
    assert_eq!(stat(envoy, "kvguard_filter_pending_aborts").await, 0.0);
    eprintln!(
        "active_requests at rest: 0 ({} stranded on the trapped VM, taken back); vm_memory_bytes {}; wasm stats {:?}",
        t.stranded,
        stat(envoy, "kvguard_filter_vm_memory_bytes").await,
        wasm_stats(envoy).await
    );
    assert!(!envoy.log().contains("kvguard: panic"));
}

/// The kvguard-control TTL and the filter's lease period of [`trapped_vm_behind_a_hop`].
const VM_TTL: Duration = Duration::from_secs(2);
const VM_RENEW_MS: u64 = 400;

/// Envoy (2 workers, the trap build, FAIL_RELOAD, renewing every 400 ms) → the lossy hop,
/// which hides every disconnect → kvguard-control (`--lease-ttl 2s`, no idle reaper) →
/// the simulator. Streams run on both VMs; one VM traps. Envoy cuts that VM's streams
/// downstream; behind the hop the engine would generate them to `max_tokens`. Asserted:
/// kvguard-control ends every one of them (`gateway_lost`, `why="vm_lost"`) within
/// 5 periods (the VM table's silence, then renewals without it) + the TTL + a lease pass
/// (TTL/8) + 2 s of slack after the trap,
/// while the healthy VM's streams keep flowing to their readers; the gauges come back
/// down to the healthy VM's share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trapped_vm_behind_a_hop() {
    bounded("trapped VM behind a hop", T, async {
        let sim = sim::spawn(SimConfig::roomy())
        .await
        .unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let control = Control::start(
            sim.addr(),
            any,
            any,
            &[
                "--lease-mode".into(),
                "enforce".into(),
                "--lease-ttl".into(),
                format!("{}ms", VM_TTL.as_millis()),
                "--idle-timeout".into(),
                "off".into(),
            ],
        )
        .await
        .unwrap();
        let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
        let mut cfg = stack::filter_config(0, 0);
        cfg["lease_renew_ms"] = VM_RENEW_MS.into();
        let mut o = EnvoyOptions::with_filter(hop.addr(), control.admin, cfg)
            .vm_env("KVGUARD_SECRET", stack::SECRET);
        o.wasm_path = Some(paths::trap_wasm_path().unwrap());
        o.concurrency = 2;
        o.failure_policy = "FAIL_RELOAD".into();
        o.component_log_level = Some("wasm:info".into());
        let envoy = Envoy::start(o).await.unwrap();

        // Long streams (1,000 tokens at 5/s) on both VMs, at least 3 on each.
        let mut live = Vec::new();
        let mut vms = std::collections::BTreeMap::<String, usize>::new();
        while live.len() < 12 || vms.len() < 2 || vms.values().any(|n| *n < 3) {
            assert!(live.len() < 12 + TRIES, "one worker got no stream: {vms:?}");
            let i = live.len();
            let (s, id, vm) = open_on(&envoy, &sim, &format!("hop-{i}"), 1000, i % 2 == 1)
                .await
                .unwrap();
            let vm = vm.expect("the filter ran");
            *vms.entry(vm.clone()).or_default() += 1;
            live.push((s, id, vm));
        }
        poll_until_async("the lease enforceable", W, Duration::from_millis(50), || async {
            (support::control_metric(&control, "kvguard_control_leases_enforceable").await >= 1.0)
                .then_some(())
        })
        .await
        .unwrap();
        wait_gauge(&envoy, live.len() as f64).await;
        let memory0 = stat(&envoy, "kvguard_filter_vm_memory_bytes").await;

        // The trap: on the first body chunk of a new stream, on whichever VM takes it
        // (timed from before the request: the bound is an upper one).
        let trapped_at = Instant::now();
        let mut trap = client::stream_sse(
            envoy.listener_addr(),
            "/v1/chat/completions",
            &chat(1000),
            &[
                (TAG, "trap"),
                (TRAP_HEADER, "response-body"),
                ("x-sim-rate", "5"),
            ],
            false,
        )
        .await
        .unwrap();
        assert_eq!(trap.status, 200);
        trap.wait_end(W).await.unwrap();
        let (trap_id, trap_vm) = seen(&sim, "trap").unwrap();
        let trapped = trap_vm.unwrap();
        let (mut on_trapped, mut on_healthy): (Vec<_>, Vec<_>) =
            live.into_iter().partition(|(_, _, vm)| *vm == trapped);
        assert!(!on_trapped.is_empty() && !on_healthy.is_empty());
        // Envoy cuts the trapped VM's streams downstream at their next chunk.
        for (s, id, _) in &mut on_trapped {
            let r = s.wait_end(W).await.unwrap();
            assert!(!r.saw_done(), "{id} on the trapped VM completed");
        }
        // Behind the hop the engine never learns; kvguard-control ends them.
        let mut gone: Vec<String> = on_trapped.iter().map(|(_, id, _)| id.clone()).collect();
        gone.push(trap_id);
        let ids = gone.clone();
        sim.wait_state("the trapped VM's streams ended at the engine", W, move |s| {
            ids.iter()
                .all(|id| s.request(id).is_some_and(|r| r.ended.is_some()))
        })
        .await
        .unwrap();
        let took = trapped_at.elapsed();
        // Listed for 3 periods after its last beat, left out by the next renewal, lost
        // at the first renewal a TTL after that, ended at the next lease pass (TTL/8).
        let bound = Duration::from_millis(5 * VM_RENEW_MS) + VM_TTL + VM_TTL / 8
            + Duration::from_secs(2);
        eprintln!(
            "the trapped VM's {} streams ended at the engine {took:?} after the trap (bound {bound:?})",
            gone.len()
        );
        assert!(took <= bound, "took {took:?}, over {bound:?}");
        let ended = gone.len() as f64;
        assert_eq!(
            support::control_metric(
                &control,
                "kvguard_control_lease_requests_ended_total{mode=\"enforce\",why=\"vm_lost\"}"
            )
            .await,
            ended
        );
        assert_eq!(
            support::control_metric(
                &control,
                "kvguard_control_lease_expiries_total{mode=\"enforce\",why=\"vm_lost\"}"
            )
            .await,
            1.0
        );
        let by_reason = control.aborts_by_reason().await.unwrap();
        assert_eq!(by_reason.get("gateway_lost"), Some(&ended), "{by_reason:?}");

        // The gauges: the trapped VM's share taken back by the healthy VM.
        wait_gauge(&envoy, on_healthy.len() as f64).await;
        let memory1 = stat(&envoy, "kvguard_filter_vm_memory_bytes").await;
        assert!(
            memory1 > 0.0 && memory1 < memory0,
            "vm_memory_bytes {memory0} -> {memory1}"
        );
        assert_eq!(stat(&envoy, "kvguard_filter_pending_aborts").await, 0.0);

        // The healthy VM's streams: still running at the engine and read by their
        // clients a TTL later.
        tokio::time::sleep(VM_TTL).await;
        let st = sim.state();
        for (s, id, _) in &mut on_healthy {
            assert!(
                st.request(id).is_some_and(|r| r.ended.is_none()),
                "{id} on the healthy VM ended"
            );
            assert!(s.next_data(W).await.unwrap().is_some(), "{id} stopped");
        }
        assert!(!envoy.log().contains("kvguard: panic"));
    })
    .await
    .unwrap();
}
