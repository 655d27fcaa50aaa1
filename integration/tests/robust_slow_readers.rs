//! A client that reads slower than its engine writes is not a stall (issue 27, point 5).
//!
//! Real processes at the shipped sizes: the engine simulator writing ~26 KB/s per stream →
//! kvguard-control (`--idle-timeout 3s`, `--reader-timeout 60s`) → a real Envoy
//! with the filter (`idle_timeout_ms` 3000) and the shipped 32 KiB connection buffers →
//! raw TCP clients. Side by side: clients that read a little every 100 ms (2 KB/s, and
//! 0.5 KB/s, the documented floor's bound), and clients that read nothing after the
//! response head. Envoy pauses reading the upstream while a client's buffer is full, so
//! no byte of a slow reader's stream passes the filter for many idle timeouts at a time.
//!
//! - Every slow reader is still streaming at the end, longer than the reader timeout:
//!   never cut (no abort event, no close, its engine sequence still running), because
//!   kvguard-control deferred the filter's `stalled` aborts (it saw its engine produce)
//!   and its own reaper did not count the drain's silence as the engine's.
//! - Every silent client's stream is ended within the documented bound, and not before
//!   the reader timeout: the filter's silence reaches it, kvguard-control ends it; and its
//!   connection is closed (kvguard-control's end of the stream does not stand in for the
//!   filter's cut).
//! - Readers of a short generation (2 KB/s): the engine finishes within seconds and the
//!   rest of the response waits in the buffers while they drain it; the filter's stall
//!   aborts then find it completed at kvguard-control, which defers them: they read to
//!   the end, never cut.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::client::{self, SilentClient};
use kvguard_integration::demo::stack::{self, Control, Stack, StackOptions, FILTER_TICK_MS};
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::receiver::{self, Behaviour, ReceiverConfig};
use kvguard_integration::sim::{self, EndKind, SimConfig};
use kvguard_integration::wait::bounded;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The shipped `per_connection_buffer_limit_bytes` (envoy-config/envoy/*.yaml).
const SHIPPED_BUFFER: u32 = 32 * 1024;
/// `SO_SNDBUF` of Envoy's sockets toward the clients, and the clients' `SO_RCVBUF`: small
/// (no autotuning) as across a network, where Envoy's buffer is what fills. On loopback
/// Linux grows a send buffer past a megabyte at once, which would hide a slow reader from
/// Envoy (and from the filter) for minutes.
const KERNEL_BUFFER: u32 = 4 * 1024;
/// kvguard-control's `--reader-timeout` here (below its default, to keep the test short:
/// the 0.5 KB/s readers are silent at the filter for up to ~45 s at a time).
const READER: Duration = Duration::from_secs(60);
/// The idle timeout of both the filter and kvguard-control.
const IDLE: Duration = Duration::from_secs(3);
/// How long the slow readers read: past the reader timeout.
const RUN: Duration = Duration::from_secs(75);
/// The tail readers' generation.
const TAIL_TOKENS: u32 = 400;

/// Reads `chunk` bytes every 100 ms until `until` or the end of the response; returns the
/// client (still connected) and the bytes read, or why it stopped early.
async fn read_slowly(
    c: SilentClient,
    chunk: usize,
    until: Instant,
) -> Result<(SilentClient, usize), String> {
    read_pausing(c, chunk, until, &[]).await
}

/// [`read_slowly`], reading nothing during each `(from, length)` of `pauses`.
async fn read_pausing(
    mut c: SilentClient,
    chunk: usize,
    until: Instant,
    pauses: &[(Duration, Duration)],
) -> Result<(SilentClient, usize), String> {
    let n = c.read_paced(chunk, until, pauses).await?;
    Ok((c, n))
}

/// A real Envoy with the filter (idle timeout `idle`, aborts to `control`) in front of
/// `upstream`, with the shipped 32 KiB buffers and small kernel buffers toward the
/// clients.
async fn envoy_with_shipped_buffers(
    upstream: SocketAddr,
    control: SocketAddr,
    idle: Duration,
) -> Envoy {
    let cfg = stack::filter_config(idle.as_millis() as u64, 0);
    let mut opts =
        EnvoyOptions::with_filter(upstream, control, cfg).vm_env("KVGUARD_SECRET", stack::SECRET);
    opts.per_connection_buffer_limit_bytes = Some(SHIPPED_BUFFER);
    opts.downstream_sndbuf = Some(KERNEL_BUFFER);
    Envoy::start(opts).await.unwrap()
}

/// A streaming completion of `max_tokens` through `at`, its response head read (200).
async fn open_stream(at: SocketAddr, max_tokens: u32) -> SilentClient {
    let body = json!({"model": "tiny", "prompt": "x", "stream": true, "max_tokens": max_tokens});
    let c = client::silent_client(at, "/v1/completions", &body, &[], KERNEL_BUFFER, true)
        .await
        .unwrap();
    assert_eq!(c.status(), Some(200), "{:?}", c.head());
    c
}

/// The request id of a client's response (kvguard-control sets it).
fn request_id(c: &SilentClient) -> String {
    c.head()
        .unwrap()
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("x-request-id")
                .then(|| v.trim().to_owned())
        })
        .unwrap()
}

/// kvguard-control's view of each request in flight.
async fn inflight(admin: SocketAddr) -> BTreeMap<String, Value> {
    let v = client::get_json(admin, "/v1/requests").await.unwrap();
    v["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["request_id"].as_str().unwrap().to_owned(), r.clone()))
        .collect()
}

/// The longest silence the filter reported in a deferred abort, per request id (from
/// kvguard-control's debug lines).
fn deferred_silences(log: &str) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for l in log.lines().filter(|l| l.contains("stalled abort deferred")) {
        let field = |k: &str| {
            let i = l.find(&format!("{k}="))? + k.len() + 1;
            Some(
                l[i..]
                    .split([' ', ','])
                    .next()?
                    .trim_matches('"')
                    .to_owned(),
            )
        };
        if let (Some(id), Some(ms)) = (field("request_id"), field("sender_idle_ms")) {
            let e = m.entry(id).or_insert(0);
            *e = (*e).max(ms.parse().unwrap_or(0));
        }
    }
    m
}

/// The filter's abort counter for `reason` and `outcome`, as Envoy names it.
fn aborts(reason: &str, outcome: &str) -> String {
    format!("kvguard_filter_aborts_total_reason=.={reason};.;_outcome=.={outcome};.;")
}

/// kvguard-control counted each deferral it logged (at least one): the series is
/// registered at 0, so its presence proves nothing.
async fn assert_deferrals_counted(admin: SocketAddr, log: &str) {
    let m = client::get(admin, "/metrics").await.unwrap().text();
    let counted: f64 = m
        .lines()
        .find_map(|l| {
            l.strip_prefix("kvguard_control_abort_api_answers_total{result=\"deferred\"} ")
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    let logged = log
        .lines()
        .filter(|l| l.contains("stalled abort deferred"))
        .count();
    assert!(counted >= 1.0, "no deferral counted");
    assert!(
        counted >= logged as f64,
        "{logged} deferrals logged, {counted} counted"
    );
}

/// A simulator at 100 tokens/s with room for streams of 30,000 tokens.
fn long_streams() -> SimConfig {
    SimConfig {
        token_rate: 100.0,
        kv_blocks: 16_384,
        max_model_len: 32_768,
        ..SimConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_are_never_cut_and_silent_ones_are_reaped() {
    bounded("slow readers", RUN + Duration::from_secs(60), async {
        let sim = sim::spawn(long_streams())
        .await
        .unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let mut ctl = Control::start(
            sim.addr(),
            any,
            any,
            &[
                "--idle-timeout".into(),
                format!("{}s", IDLE.as_secs()),
                "--reader-timeout".into(),
                format!("{}s", READER.as_secs()),
                "--log".into(),
                "info,kvguard_control::abort=debug".into(),
            ],
        )
        .await
        .unwrap();
        let envoy = envoy_with_shipped_buffers(ctl.proxy, ctl.admin, IDLE).await;
        let open = |max_tokens| open_stream(envoy.listener_addr(), max_tokens);
        let until = Instant::now() + RUN;
        // Bytes per 100 ms: 2 KB/s (the clients) and 0.5 KB/s.
        let rates = [200usize, 200, 50, 50];
        let mut readers = tokio::task::JoinSet::new();
        let mut names = BTreeMap::new();
        for chunk in rates {
            let c = open(30_000).await;
            let id = request_id(&c);
            names.insert(id.clone(), format!("{} B/s", chunk * 10));
            readers.spawn(async move { (id, read_slowly(c, chunk, until).await) });
        }
        // The tail: 400 tokens (~100 KB, ~4 s at the engine), read at 2 KB/s (~50 s).
        let mut tails = Vec::new();
        for _ in 0..2 {
            let c = open(TAIL_TOKENS).await;
            let id = request_id(&c);
            names.insert(id.clone(), "tail, 2000 B/s".to_owned());
            tails.push(id.clone());
            readers.spawn(async move { (id, read_slowly(c, 200, until).await) });
        }
        let mut silent = Vec::new();
        for _ in 0..2 {
            let c = open(30_000).await;
            names.insert(request_id(&c), "silent".to_owned());
            silent.push(c);
        }
        // kvguard-control's view meanwhile: how long each stream waited on its reader.
        let mut reader_wait: BTreeMap<String, u64> = BTreeMap::new();
        while Instant::now() < until {
            for (id, r) in inflight(ctl.admin).await {
                if r["waiting_on"] == "reader" {
                    let e = reader_wait.entry(id).or_default();
                    *e = (*e).max(r["waiting_ms"].as_u64().unwrap());
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let mut read = BTreeMap::new();
        while let Some(r) = readers.join_next().await {
            let (id, r) = r.unwrap();
            read.insert(id, r);
        }
        let st = sim.state();
        let silences = deferred_silences(&ctl.guard().log());
        for (id, name) in &names {
            let rec = st.request(id).unwrap();
            eprintln!(
                "{name}: read {:?} bytes; longest filter silence in a deferred abort {:?} ms, longest reader wait at kvguard-control {:?} ms; engine ended {:?} {:?} ms after arrival",
                read.get(id).map(|r| r.as_ref().map(|(_, n)| *n)),
                silences.get(id),
                reader_wait.get(id),
                rec.ended,
                rec.ended_ms.map(|e| e - rec.arrived_ms),
            );
        }
        let log = ctl.guard().log();
        for (id, r) in &read {
            let name = &names[id];
            let (c, n) = r.as_ref().unwrap_or_else(|e| panic!("the {name} reader was cut: {e}"));
            let rec = st.request(id).unwrap();
            if tails.contains(id) {
                assert_eq!(rec.ended, Some(EndKind::Length), "the {name} reader's engine did not finish");
                assert!(
                    c.bytes_read().windows(6).any(|w| w == b"[DONE]"),
                    "the {name} reader did not reach the end in {RUN:?} ({n} bytes)"
                );
                // The case was reached: a stall abort came after the engine finished.
                assert!(
                    log.lines().any(|l| l.contains(id.as_str()) && l.contains("held nowhere")),
                    "no stall of the {name} reader was deferred after its engine finished"
                );
                continue;
            }
            assert_eq!(rec.ended, None, "the {name} reader's engine sequence was ended (read {n} bytes)");
            // Its idle timeout passed many times over: only the deferrals kept it.
            let silence = silences.get(id).copied().unwrap_or(0);
            assert!(
                silence >= IDLE.as_millis() as u64,
                "the {name} reader was never silent at the filter for an idle timeout ({silence} ms): the test did not reach the case"
            );
        }
        let tick = Duration::from_millis(FILTER_TICK_MS);
        // Envoy stops reading a silent stream once its buffers are full (a few seconds at
        // this rate); the filter's next abort after the reader timeout ends it: within one
        // idle window (its re-ask) and two ticks after that, plus a round trip.
        let fill = Duration::from_secs(5);
        for c in &mut silent {
            let id = request_id(c);
            let rec = st.request(&id).unwrap();
            assert_eq!(rec.ended, Some(EndKind::Disconnected), "silent {id} not ended");
            let after = Duration::from_millis(rec.ended_ms.unwrap() - rec.arrived_ms);
            assert!(after >= READER, "silent {id} ended {after:?} after it arrived, before the reader timeout");
            assert!(
                after <= fill + READER + IDLE + 2 * tick + Duration::from_secs(2),
                "silent {id} ended {after:?} after it arrived"
            );
            // Its connection was closed: it reads what is left and then the close.
            let n = c.read_to_close(Duration::from_secs(10)).await.unwrap_or_else(|e| {
                panic!("silent {id}: its connection was not closed: {e:#}")
            });
            eprintln!("silent {id}: closed after {n} bytes");
        }
        assert_deferrals_counted(ctl.admin, &log).await;
        drop(silent);
    })
    .await
    .unwrap();
}

/// The stack `e2e_vllm`'s silent client runs in (the lossy hop before kvguard-control,
/// 16 KiB buffers), with the simulator: a client that reads nothing after its request;
/// kvguard-control carries out the filter's first stall abort (its reader timeout is the
/// idle timeout) and ends the stream with its final event. The engine sequence ends, and
/// the client's connection is closed too: the end that kvguard-control wrote must not
/// complete the response at Envoy in place of the filter's cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_s_connection_is_closed_when_kvguard_control_ends_it_first() {
    bounded(
        "silent client, ended first",
        Duration::from_secs(60),
        async {
            let sim = sim::spawn(long_streams()).await.unwrap();
            let mut o = StackOptions::new(
                sim.addr(),
                Some(stack::filter_config(IDLE.as_millis() as u64, 0)),
            );
            o.control_args = [
                "--idle-timeout",
                "off",
                "--max-age",
                "off",
                "--reader-timeout",
            ]
            .map(String::from)
            .to_vec();
            o.control_args.push(format!("{}s", IDLE.as_secs()));
            let st = Stack::start(o).await.unwrap();
            let body =
                json!({"model": "tiny", "prompt": "x", "stream": true, "max_tokens": 30_000});
            let mut c =
                client::silent_client(st.entry(), "/v1/completions", &body, &[], 4096, false)
                    .await
                    .unwrap();
            let ended = sim
                .wait_state("the engine sequence ended", Duration::from_secs(30), |s| {
                    s.requests.first().is_some_and(|r| r.ended.is_some())
                })
                .await
                .unwrap();
            assert_eq!(ended.requests[0].ended, Some(EndKind::Disconnected));
            let n = c
                .read_to_close(Duration::from_secs(10))
                .await
                .unwrap_or_else(|e| {
                    panic!("its connection was not closed: {e:#}\n{}", st.logs(40))
                });
            let read = String::from_utf8_lossy(c.bytes_read()).into_owned();
            assert!(!read.contains("[DONE]"), "{read}");
            eprintln!("closed after {n} bytes");
        },
    )
    .await
    .unwrap();
}

/// kvguard-control's admin path refuses the filter's first stall ask of a slow reader
/// (503, as when all its admin work slots are busy), then answers again: the ask got no
/// answer, so it is no verdict. The stream is kept, and the retry asks the same question
/// (`recheck_ms` kept), which kvguard-control defers: the reader reads on, never cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_whose_stall_ask_got_no_answer_is_asked_again_and_kept() {
    const READ: Duration = Duration::from_secs(30);
    bounded(
        "an unanswered stall ask",
        READ + Duration::from_secs(60),
        async {
            let sim = sim::spawn(long_streams()).await.unwrap();
            let any = SocketAddr::from(([127, 0, 0, 1], 0));
            let ctl = Control::start(
                sim.addr(),
                any,
                any,
                &[
                    "--idle-timeout".into(),
                    format!("{}s", IDLE.as_secs()),
                    "--reader-timeout".into(),
                    format!("{}s", READER.as_secs()),
                ],
            )
            .await
            .unwrap();
            // A tap on the admin path: 503 until told to pass calls on.
            let mut rc = ReceiverConfig::new(Vec::new());
            rc.behaviour = Behaviour::Status(503);
            let tap = receiver::spawn(rc).await.unwrap();
            let envoy = envoy_with_shipped_buffers(ctl.proxy, tap.addr(), IDLE).await;
            let c = open_stream(envoy.listener_addr(), 30_000).await;
            let id = request_id(&c);
            let until = Instant::now() + READ;
            let reader = tokio::spawn(async move { read_slowly(c, 200, until).await });
            // The first ask arrives once the buffers are full and the filter sees an idle
            // window of silence; it is refused.
            let first = tap.wait_calls_for(&id, READ).await.unwrap();
            let ask = first[0].abort.clone().unwrap();
            assert_eq!(
                (ask.reason.as_str(), ask.attempt, ask.recheck_ms.is_some()),
                ("stalled", Some(1), true),
                "{ask:?}"
            );
            tap.set_behaviour(Behaviour::Forward(ctl.admin));
            let (c, n) = reader
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("the reader was cut after its ask got no answer: {e}"));
            drop(c);
            assert!(
                sim.state().request(&id).unwrap().ended.is_none(),
                "its engine sequence was ended ({n} bytes read)"
            );
            let calls = tap.calls_for(&id);
            let retried = calls
                .iter()
                .find(|c| {
                    c.status == Some(200) && c.abort.as_ref().is_some_and(|a| a.attempt > Some(1))
                })
                .unwrap_or_else(|| panic!("no retry of the ask was answered: {calls:?}"));
            let a = retried.abort.as_ref().unwrap();
            assert_eq!(
                a.recheck_ms, ask.recheck_ms,
                "the retry did not ask the same question: {a:?}"
            );
            let deferred = envoy
                .stat(&aborts("stalled", "deferred"))
                .await
                .unwrap()
                .unwrap_or(0.0);
            assert!(deferred >= 1.0, "no deferral counted at the filter");
            assert_eq!(
                envoy
                    .stat(&aborts("stalled", "aborted"))
                    .await
                    .unwrap()
                    .unwrap_or(0.0),
                0.0
            );
        },
    )
    .await
    .unwrap();
}

/// The shipped timings, scaled by a tenth with every ratio kept: the filter's idle
/// timeout 60 s → 6 s (tick 250 ms, not scaled: coarser relative to the windows),
/// kvguard-control's `--reader-timeout` 90 s → 9 s, `--idle-timeout` 120 s → 12 s,
/// `--tombstone-ttl` 60 s → 6 s; the engine and every reader ten times faster, so the
/// shipped 32 KiB buffers drain in a tenth of the time. Readers:
///
/// - at the floor: 4 KB/s (0.4 KB/s shipped, just above the documented 0.37 KB/s), its
///   silences at the filter near the idle timeout, for the whole run;
/// - pausing mid-generation: 20 KB/s, with pauses of 7.5 s (75 s shipped: over the
///   idle timeout, under the reader timeout) every 20 s;
/// - pausing in the tail: a 2,000-token generation (~520 KB, finished at the engine
///   within seconds, the rest in the buffers) read at 20 KB/s with a pause of 7.5 s
///   starting 8 s in, after its engine finished: asked about once the engine is done,
///   which `--reader-timeout` after the engine's end no longer bounds;
///
/// and two silent clients, ended within the documented bound. Every reader is asked
/// about at least once where the case says so, and none is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_at_the_floor_and_pausing_readers_at_the_shipped_timings_scaled() {
    const SCALE: u32 = 10;
    let idle = Duration::from_secs(60) / SCALE;
    let reader = Duration::from_secs(90) / SCALE;
    let run = Duration::from_secs(60);
    let pause = Duration::from_secs(75) / SCALE;
    bounded("shipped timings, scaled", run + Duration::from_secs(60), async {
        let sim = sim::spawn(SimConfig {
            token_rate: 100.0 * f64::from(SCALE),
            kv_blocks: 65_536,
            max_model_len: 131_072,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let mut ctl = Control::start(
            sim.addr(),
            any,
            any,
            &[
                "--idle-timeout".into(),
                format!("{}ms", (Duration::from_secs(120) / SCALE).as_millis()),
                "--reader-timeout".into(),
                format!("{}ms", reader.as_millis()),
                "--tombstone-ttl".into(),
                format!("{}ms", (Duration::from_secs(60) / SCALE).as_millis()),
                "--log".into(),
                "info,kvguard_control::abort=debug".into(),
            ],
        )
        .await
        .unwrap();
        let envoy = envoy_with_shipped_buffers(ctl.proxy, ctl.admin, idle).await;
        let open = |max_tokens| open_stream(envoy.listener_addr(), max_tokens);
        let until = Instant::now() + run;
        let mut readers = tokio::task::JoinSet::new();
        let mut names = BTreeMap::new();
        let c = open(100_000).await;
        let floor = request_id(&c);
        names.insert(floor.clone(), "at the floor, 4 KB/s");
        readers.spawn(async move { (request_id(&c), read_slowly(c, 400, until).await) });
        let c = open(100_000).await;
        let mid = request_id(&c);
        names.insert(mid.clone(), "pausing mid-generation, 20 KB/s");
        let pauses: Vec<_> = (1..3).map(|i| (Duration::from_secs(20) * i, pause)).collect();
        readers.spawn(async move { (request_id(&c), read_pausing(c, 2_000, until, &pauses).await) });
        let c = open(2_000).await;
        let tail = request_id(&c);
        names.insert(tail.clone(), "pausing in the tail, 20 KB/s");
        let pauses = [(Duration::from_secs(8), pause)];
        readers.spawn(async move { (request_id(&c), read_pausing(c, 2_000, until, &pauses).await) });
        let mut silent = Vec::new();
        for _ in 0..2 {
            let c = open(100_000).await;
            names.insert(request_id(&c), "silent");
            silent.push(c);
        }
        let mut read = BTreeMap::new();
        while let Some(r) = readers.join_next().await {
            let (id, r) = r.unwrap();
            read.insert(id, r);
        }
        let st = sim.state();
        let log = ctl.guard().log();
        let silences = deferred_silences(&log);
        for (id, name) in &names {
            let rec = st.request(id).unwrap();
            eprintln!(
                "{name}: read {:?} bytes; longest filter silence in a deferred abort {:?} ms; engine ended {:?} {:?} ms after arrival",
                read.get(id).map(|r| r.as_ref().map(|(_, n)| *n)),
                silences.get(id),
                rec.ended,
                rec.ended_ms.map(|e| e - rec.arrived_ms),
            );
        }
        for (id, r) in &read {
            let name = names[id];
            let (c, n) = r.as_ref().unwrap_or_else(|e| panic!("the reader {name} was cut: {e}"));
            let rec = st.request(id).unwrap();
            if *id == tail {
                assert_eq!(rec.ended, Some(EndKind::Length), "{name}: its engine did not finish");
                assert!(c.bytes_read().windows(6).any(|w| w == b"[DONE]"), "{name}: did not reach the end ({n} bytes)");
                assert!(
                    log.lines().any(|l| l.contains(id.as_str()) && l.contains("held nowhere")),
                    "{name}: no stall was deferred after its engine finished: the test did not reach the case"
                );
                continue;
            }
            assert_eq!(rec.ended, None, "{name}: its engine sequence was ended ({n} bytes read)");
        }
        assert!(
            silences.get(&mid).is_some_and(|s| *s >= idle.as_millis() as u64),
            "the reader pausing mid-generation was never deferred: the test did not reach the case"
        );
        // A silent client: asked at the idle timeout (deferred: under the reader timeout),
        // asked again one window later and ended; plus the buffers' fill and the ticks.
        let tick = Duration::from_millis(FILTER_TICK_MS);
        for c in &mut silent {
            let id = request_id(c);
            let rec = st.request(&id).unwrap();
            assert_eq!(rec.ended, Some(EndKind::Disconnected), "silent {id} not ended");
            let after = Duration::from_millis(rec.ended_ms.unwrap() - rec.arrived_ms);
            assert!(after >= reader, "silent {id} ended {after:?} after it arrived, before the reader timeout");
            assert!(
                after <= Duration::from_secs(1) + reader + idle + 4 * tick + Duration::from_secs(2),
                "silent {id} ended {after:?} after it arrived"
            );
            c.read_to_close(Duration::from_secs(10))
                .await
                .unwrap_or_else(|e| panic!("silent {id}: its connection was not closed: {e:#}"));
        }
        assert_deferrals_counted(ctl.admin, &log).await;
    })
    .await
    .unwrap();
}
