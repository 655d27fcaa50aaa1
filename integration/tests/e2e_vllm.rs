//! End to end on real vLLM (CPU, tiny random Llama): client → Envoy + kvguard filter →
//! lossy hop → kvguard-control → vLLM. The suite shares one vLLM: `scripts/test` starts
//! it with `scripts/vllm-server start` and passes `KVGUARD_VLLM_URL` (and
//! `KVGUARD_VLLM_LOG`); without it each test starts its own (a developer running one test).
//! `KVGUARD_SKIP_VLLM=1` skips every test here with a line saying so. nextest runs this
//! binary's tests one at a time (test group `vllm`); each waits for vLLM to be idle first.
//!
//! vLLM is observed only from the outside: `/metrics` (`vllm:num_requests_running`,
//! `..._waiting`, `vllm:kv_cache_usage_perc`) and its request log ("Aborted request(s)").
//! What the filter saw is read from its abort calls (a recording tap before
//! kvguard-control, `StackOptions::abort_tap`) and its stats.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Stack, StackOptions};
use kvguard_integration::stall::StallMark;
use kvguard_integration::vllm::Vllm;
use kvguard_integration::wait::{bounded, poll_until_async};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Bound of each test (vLLM start-up, when a test starts its own, included).
const T: Duration = Duration::from_secs(400);
/// Bound of single waits.
const W: Duration = Duration::from_secs(30);
/// Tokens of a long request: ~25 s at ~60 tok/s (the suite's model on one CPU), so it is
/// still generating whenever a test looks.
const LONG: u32 = 1500;
/// Tokens of a non-streaming request a test leaves behind beside a [`LONG`] stream: four
/// times as long, so it still generates whenever the stream starts, runs and ends beside
/// it (the test ends it either way: the abort, or the stack's teardown closing its hop).
const LEFT: u32 = 6000;
/// Tokens of each stream read to its end beside requests that leave.
const HEALTHY: u32 = 600;
/// Bound of the [`HEALTHY`] streams read side by side: a hang guard, not a speed claim
/// (on a 2-core machine loaded by other builds three of them read 466 events each in
/// 120 s).
const HEALTHY_STREAMS: Duration = Duration::from_secs(300);
/// Bound of a whole normal stream of several hundred tokens.
const LONG_STREAM: Duration = Duration::from_secs(120);
/// The longest a normal stream may send nothing before it counts as stalled (ten idle
/// timeouts of the test's filter): its whole length is the machine's speed (1,022 of
/// 1,200 tokens in 120 s on a 2-core machine building beside it), never a verdict.
const STREAM_QUIET: Duration = Duration::from_secs(30);
/// Tokens of a stream that must outlast a lease's expiry: the wait for an enforceable lease
/// plus the TTL (30 s). 1500 tokens ended on their own 20 s after a SIGKILL on a quiet CI
/// machine (~60 tok/s each); 4000 last ~65 s at that rate, and four of them fit the suite's
/// KV pool (512 blocks of 32: 504 used).
const OUTLAST_LEASE: u32 = 4000;

/// Serialises the tests of this binary when they share a process (`cargo test` without
/// nextest): they all watch the one vLLM's running count.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The shared vLLM, idle, and this binary's turn; `None` when `KVGUARD_SKIP_VLLM=1`.
async fn vllm(test: &str) -> Option<(Vllm, tokio::sync::MutexGuard<'static, ()>)> {
    let turn = ONE_AT_A_TIME.lock().await;
    let v = Vllm::shared(test).await.unwrap()?;
    v.wait_idle(Duration::from_secs(120)).await.unwrap();
    Some((v, turn))
}

fn completion(max_tokens: u32) -> Value {
    json!({"model": "tiny", "prompt": "kvguard e2e", "stream": true, "max_tokens": max_tokens, "ignore_eos": true})
}

fn chat(max_tokens: u32) -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": "kvguard e2e"}], "stream": true,
           "max_tokens": max_tokens, "ignore_eos": true})
}

/// The leak topology without kvguard: no filter, kvguard-control only proxies.
fn leak_opts(engine: SocketAddr) -> StackOptions {
    let mut o = StackOptions::new(engine, None);
    o.control_args = ["--idle-timeout", "off", "--max-age", "off"]
        .map(String::from)
        .to_vec();
    o
}

/// The filter (idle timeout `idle_ms`) and kvguard-control with its reaper off, so that
/// what ends a stream is the filter's abort.
fn filter_opts(engine: SocketAddr, idle_ms: u64) -> StackOptions {
    let mut o = StackOptions::new(engine, Some(stack::filter_config(idle_ms, 0)));
    o.control_args = ["--idle-timeout", "off", "--max-age", "off"]
        .map(String::from)
        .to_vec();
    o
}

/// kvguard-control's `kvguard_control_aborts_total` for `reason` (every reason is exported from the start).
async fn control_aborts(st: &Stack, reason: &str) -> f64 {
    st.control
        .aborts_by_reason()
        .await
        .unwrap()
        .get(reason)
        .copied()
        .unwrap_or_else(|| panic!("kvguard-control exports no {reason:?} aborts"))
}

/// Measures the run-queue wait (time runnable without a CPU) of this process and of the
/// stack's kvguard-control from now on: taken just before the event a latency bound starts
/// from, it credits the bound with it (see `kvguard_integration::stall`).
fn stall_mark(st: &Stack) -> StallMark {
    StallMark::control(st.control.pid())
}

async fn wait_control_aborts(st: &Stack, reason: &str, n: f64) {
    poll_until_async(
        &format!("kvguard-control counts {n} {reason} abort(s)"),
        W,
        Duration::from_millis(50),
        || async move { (control_aborts(st, reason).await >= n).then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
}

/// Waits until vLLM's request log says it aborted `engine_id`. vLLM's log must be known:
/// a server of the test's own, or `KVGUARD_VLLM_LOG` beside `KVGUARD_VLLM_URL` (both
/// exported by `scripts/vllm-server start`).
async fn wait_vllm_aborted(v: &Vllm, engine_id: &str) {
    assert!(
        v.has_log(),
        "vLLM's log is unknown (KVGUARD_VLLM_URL without KVGUARD_VLLM_LOG): cannot check that it aborted {engine_id}"
    );
    poll_until_async(
        &format!("vLLM logs the abort of {engine_id}"),
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async move {
            v.log()
                .lines()
                .any(|l| l.contains("Aborted request") && l.contains(engine_id))
                .then_some(())
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_mid_stream_is_aborted_within_2s_and_leaks_without_the_filter() {
    bounded("disconnect", T, async {
        let Some((v, _turn)) = vllm("disconnect_mid_stream").await else {
            return;
        };
        // Without kvguard: the hop keeps the request alive after the client left.
        let st = Stack::start(leak_opts(v.addr())).await.unwrap();
        let mut s = client::stream_sse(st.entry(), "/v1/completions", &completion(LONG), &[], false)
            .await
            .unwrap();
        assert_eq!(s.status, 200);
        let rid = s.header("x-request-id").unwrap().to_owned();
        s.read_events(5, W).await.unwrap();
        v.wait_figures("one running", W, |f| f.running == 1.0).await.unwrap();
        s.disconnect();
        let hop = st.hop.as_ref().unwrap();
        poll_until_async("the hop sees the client go", W, Duration::from_millis(20), || async {
            (hop.stats().clients_gone == 1).then_some(())
        })
        .await
        .unwrap();
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end {
            let f = v.figures().await.unwrap();
            if f.running != 1.0 {
                let vl: Vec<String> = v.log().lines().filter(|l| l.contains(&rid)).map(str::to_string).collect();
                panic!(
                    "without the filter the request should keep running: {f:?}; hop {:?}\nvLLM on {rid}: {vl:#?}\n{}",
                    hop.stats(),
                    st.logs(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!("without the filter: still running 3 s after the client left");
        // End it: stopping the stack closes vLLM's connection, and vLLM aborts on that.
        drop(st);
        v.wait_idle(W).await.unwrap();

        // With the filter: vLLM frees the sequence within 2 s of the disconnect.
        let st = Stack::start(filter_opts(v.addr(), 30_000)).await.unwrap();
        let mut s = client::stream_sse(st.entry(), "/v1/completions", &completion(LONG), &[], false)
            .await
            .unwrap();
        let rid = s.header("x-request-id").expect("x-request-id on the response").to_owned();
        let first = s.next_data(W).await.unwrap().unwrap();
        // The engine's id is cmpl-<the id Envoy minted>: that is the key of the abort.
        let engine_id = format!("cmpl-{rid}");
        assert_eq!(first.json().unwrap()["id"], engine_id.as_str());
        s.read_events(4, W).await.unwrap();
        v.wait_figures("one running", W, |f| f.running == 1.0).await.unwrap();
        let mark = stall_mark(&st);
        s.disconnect();
        let dropped = Instant::now();
        v.wait_figures_within(
            "vLLM frees it within 2 s of the disconnect",
            dropped,
            Duration::from_secs(2),
            &mark,
            |f| f.running == 0.0,
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        eprintln!("with the filter: freed {:?} after the disconnect", dropped.elapsed());
        wait_control_aborts(&st, "downstream_reset", 1.0).await;
        assert_eq!(control_aborts(&st, "downstream_reset").await, 1.0);
        // kvguard-control ended exactly that request, and vLLM aborted cmpl-<id>.
        assert!(
            st.control.log().contains(&rid),
            "kvguard-control's log does not name {rid}:\n{}",
            st.control.log()
        );
        wait_vllm_aborted(&v, &engine_id).await;
        v.wait_idle(W).await.unwrap();
    })
    .await
    .unwrap();
}

/// One reading of Envoy's byte counters by the test: asked at `asked`, answered at `got`
/// (the figures are from some instant between the two).
#[derive(Debug, Clone, Copy)]
struct EnvoyBytes {
    asked: Instant,
    got: Instant,
    /// `cluster.upstream.upstream_cx_rx_bytes_total`: what Envoy read from the upstream
    /// (printed beside `passed`: in each run measured it stopped in the same reading).
    upstream_rx: f64,
    /// `http.ingress_http.downstream_cx_tx_bytes_total` + `..._tx_bytes_buffered`: what
    /// passed the filter towards the client, written or in Envoy's write buffer (data the
    /// filter passes on is added to that buffer in the same dispatch).
    passed: f64,
}

/// Envoy's upstream-read and towards-the-client byte figures now.
async fn envoy_bytes(st: &Stack) -> Option<EnvoyBytes> {
    let asked = Instant::now();
    let v = client::get_json(
        st.envoy.admin_addr(),
        "/stats?format=json&filter=upstream_cx_rx_bytes_total%7Cdownstream_cx_tx_bytes",
    )
    .await
    .ok()?;
    let got = Instant::now();
    let stat =
        |name: &str| v["stats"].as_array()?.iter().find(|s| s["name"] == name)?["value"].as_f64();
    Some(EnvoyBytes {
        asked,
        got,
        upstream_rx: stat("cluster.upstream.upstream_cx_rx_bytes_total")?,
        passed: stat("http.ingress_http.downstream_cx_tx_bytes_total")?
            + stat("http.ingress_http.downstream_cx_tx_bytes_buffered")?,
    })
}

/// Bound of the time the silent client's buffers take to fill (~200 tokens: 4 s on an
/// idle machine, 44 s on a loaded one).
const FILL: Duration = Duration::from_secs(120);
/// How often the silent-client test reads Envoy's byte counters.
const BYTES_EVERY: Duration = Duration::from_millis(50);

/// The most the stalled abort may come after the idle timeout has run out from the answer
/// of the reading that saw data last pass the filter, beyond the filter's two ticks (the
/// one that sees the clock run out, the one that sends) and the stalls credited: the
/// call's way from Envoy to the tap and timers firing late. Measured in four runs: the abort
/// came 0.07, 0.26, 0.23 and 0.26 s over the idle timeout after that answer, ticks included
/// (the filter's own word put its last data event 27, 218, 179 ms after the answer: it
/// stamps data with the tick that finds it).
const STALL_SLACK: Duration = Duration::from_millis(250);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_client_is_reaped_as_stalled_and_vllm_frees_it_within_2s() {
    bounded("silent client", T, async {
        let Some((v, _turn)) = vllm("silent_client").await else {
            return;
        };
        let idle = Duration::from_secs(5);
        let tick = Duration::from_millis(stack::FILTER_TICK_MS);
        let mut o = filter_opts(v.addr(), idle.as_millis() as u64);
        // A reader timeout no longer than the idle timeout: the filter's first stalled
        // abort (its silence is the idle timeout) is carried out, not deferred
        // (robust_slow_readers.rs has the deferrals).
        o.control_args
            .extend(["--reader-timeout", "5s"].map(String::from));
        // The filter's abort calls pass through a recording tap to kvguard-control.
        o.abort_tap = true;
        let mut st = Stack::start(o).await.unwrap();
        let envoy_pid = st.envoy.guard().pid();
        let st = st;
        let tap = st.abort_tap.as_ref().unwrap();
        let gen0 = vllm_generated(&v).await;
        let started = Instant::now();
        // Before the request Envoy has read nothing from the upstream (a fresh stack).
        let mut readings = vec![EnvoyBytes {
            asked: started,
            got: started,
            upstream_rx: 0.0,
            passed: 0.0,
        }];
        let mut c = client::silent_client(
            st.entry(),
            "/v1/completions",
            &completion(LONG),
            &[],
            4096,
            false,
        )
        .await
        .unwrap();
        // The filter runs in Envoy: its stalls are credited too, from the reading that saw
        // data last pass it on (taken afresh at each growth).
        let marked = || stall_mark(&st).and("envoy", envoy_pid);
        let mut mark = marked();
        // The client reads nothing; vLLM keeps generating. The buffers on the way fill
        // (Envoy's, the kernel's), Envoy stops reading the upstream, so the filter sees
        // no more data, and its idle clock runs out. The test reads the bytes that passed
        // the filter towards the client until the abort call arrives (the buffers fill
        // after ~200 tokens: [`FILL`]): the last reading that saw them grow bounds when the
        // filter last saw data (after the reading before it was asked, by that reading's
        // answer). The abort must come at least the idle timeout after the former, and at
        // most the idle timeout, two ticks and [`STALL_SLACK`] (and the stalls credited)
        // after the latter. The filter's own `idle_ms` is only a cross-check.
        let deadline = Instant::now() + FILL + idle + W;
        while tap.calls().is_empty() && Instant::now() < deadline {
            if let Some(b) = envoy_bytes(&st).await {
                if readings.last().is_some_and(|l| l.passed != b.passed) {
                    mark = marked();
                }
                readings.push(b);
            }
            tokio::time::sleep(BYTES_EVERY).await;
        }
        let calls = tap
            .wait_for_calls(1, W)
            .await
            .unwrap_or_else(|e| panic!("no abort call: {e:#}\n{}", st.logs(40)));
        let call = &calls[0];
        let aborted = call.at;
        let (credit, credit_said) = mark.since();
        let generated = vllm_generated(&v).await - gen0;
        let a = call.abort.as_ref().expect("an abort body per the contract");
        assert_eq!(a.reason.as_str(), "stalled", "{a:?}");
        assert_eq!(a.gone_ms, None, "the client was still connected: {a:?}");
        // The readings answered before the abort; the last growth of the bytes that passed
        // the filter.
        let seen: Vec<&EnvoyBytes> = readings.iter().filter(|b| b.got <= aborted).collect();
        let last_of = |f: fn(&EnvoyBytes) -> f64| {
            let end = f(seen.last().unwrap());
            seen.iter()
                .rposition(|b| f(b) != end)
                .map_or(0, |i| i + 1)
        };
        let last = last_of(|b| b.passed);
        let rx_last = seen[last_of(|b| b.upstream_rx)];
        assert!(
            last + 1 < seen.len(),
            "the readings did not see data stop passing the filter before the abort: {:?}",
            &seen[seen.len().saturating_sub(3)..]
        );
        let (before, grew) = (seen[last.saturating_sub(1)], seen[last]);
        assert!(
            grew.passed > 0.0 && last > 0,
            "the test saw nothing pass the filter: {readings:?}"
        );
        let final_bytes = seen.last().unwrap();
        let stalled_for = aborted - grew.got;
        let (lo, hi) = (
            before.asked + idle,
            grew.got + idle + 2 * tick + STALL_SLACK + credit,
        );
        eprintln!(
            "stalled: data last passed the filter between {:?} and {:?} after the request started \
             ({} bytes passed; Envoy read {} bytes from the upstream, the last by {:?}; {} readings, \
             the last {:?} after the start); \
             the abort came {:?} after the request started, {stalled_for:?} after that reading's \
             answer (idle timeout {idle:?}: {:?} over it; bound {:?} = 2 ticks + {STALL_SLACK:?} + \
             credit {credit:?}: {credit_said}); vLLM generated {generated} tokens \
             meanwhile, the filter saw {} and says it last saw data {:?} ms before the call \
             (its abort body)",
            before.asked - started,
            grew.got - started,
            final_bytes.passed,
            final_bytes.upstream_rx,
            rx_last.got - started,
            seen.len(),
            final_bytes.got - started,
            aborted - started,
            stalled_for.saturating_sub(idle),
            hi - grew.got - idle,
            a.tokens,
            a.idle_ms,
        );
        assert!(
            aborted >= lo,
            "stalled abort {:?} after data could last have passed the filter (when the \
             last reading before they grew was asked), under the idle timeout {idle:?}\n{}",
            aborted - before.asked,
            st.logs(40)
        );
        assert!(
            aborted <= hi,
            "stalled abort {stalled_for:?} after the test last saw data pass the filter, over \
             the idle timeout {idle:?} + {:?}\n{}",
            hi - grew.got - idle,
            st.logs(40)
        );
        // Cross-check with the filter's own word: the abort body's `idle_ms` is how long
        // before the call it last saw a data event: within the idle timeout plus two ticks,
        // and that event lies where the test saw data last pass it, or up to a tick after
        // (the filter stamps data with the tick that finds it) and STALL_SLACK (the call's
        // way). Measured: 27 and 218 ms after.
        let idle_ms = a
            .idle_ms
            .unwrap_or_else(|| panic!("a stalled abort without idle_ms: {a:?}"));
        let own = Duration::from_millis(idle_ms);
        assert!(
            own >= idle && own <= idle + 2 * tick,
            "the filter says it last saw data {idle_ms} ms before the abort, expected {idle:?} \
             ..= {:?}\n{}",
            idle + 2 * tick,
            st.logs(40)
        );
        let filters_last = aborted - own;
        eprintln!(
            "the filter's own idle_ms {idle_ms}: its last data event {:?} after the request \
             started; the test's window for it: {:?} ..= {:?}",
            filters_last - started,
            before.asked - started,
            grew.got - started
        );
        assert!(
            filters_last >= before.asked && filters_last <= grew.got + tick + STALL_SLACK,
            "the filter's last data event ({:?} after the start, by its idle_ms) is not where \
             the test saw data last pass it ({:?} ..= {:?})",
            filters_last - started,
            before.asked - started,
            grew.got - started
        );
        v.wait_figures_within(
            "vLLM frees the stalled sequence within 2 s of the abort",
            aborted,
            Duration::from_secs(2),
            &mark,
            |f| f.running == 0.0,
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        wait_control_aborts(&st, "stalled", 1.0).await;
        // The filter closed the client's connection too.
        c.read_to_close(W).await.unwrap();
        v.wait_idle(W).await.unwrap();
    })
    .await
    .unwrap();
}

/// vLLM's `vllm:generation_tokens_total` (tokens generated so far, every request).
async fn vllm_generated(v: &Vllm) -> f64 {
    let r = client::get(v.addr(), "/metrics").await.unwrap();
    kvguard_integration::vllm::metric_sum(&r.text(), "vllm:generation_tokens_total")
        .expect("vllm:generation_tokens_total in vLLM's /metrics")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_streams_complete_untouched_chat_and_completions_h1_and_h2() {
    // Four streams of 1,200 tokens, each as slow as the machine makes it: the bound (just
    // under nextest's 600 s for this binary) is a hang guard, the verdict that none is cut.
    bounded("normal streams", Duration::from_secs(590), async {
        let Some((v, _turn)) = vllm("normal_streams").await else {
            return;
        };
        // Each stream lasts several idle timeouts (1200 tokens: ~12 s at 100 tokens/s, seen
        // on a quiet 2-core machine; 600 once took 5.9 s, under two timeouts; longer
        // under load), so a filter whose idle clock did not follow the tokens would cut it.
        // Normal token gaps stay far below the timeout (tens of ms; pauses of a second or
        // two happen on a loaded 2-core machine).
        let idle = Duration::from_secs(3);
        let st = Stack::start(filter_opts(v.addr(), idle.as_millis() as u64))
            .await
            .unwrap();
        let n = 1200u32;
        // Not a credit (a cut stream cannot be made whole): it says, on failure, whether
        // kvguard-control or this process was starved meanwhile.
        let mark = stall_mark(&st);
        for http2 in [false, true] {
            for (path, body) in [
                ("/v1/completions", completion(n)),
                ("/v1/chat/completions", chat(n)),
            ] {
                let mut s = client::stream_sse(st.entry(), path, &body, &[], http2)
                    .await
                    .unwrap();
                assert_eq!(s.status, 200, "{path} h2={http2}");
                let rid = s.header("x-request-id").unwrap().to_owned();
                let t0 = Instant::now();
                let end = s
                    .wait_end_flowing(STREAM_QUIET, T)
                    .await
                    .unwrap_or_else(|e| {
                        panic!(
                            "{path} h2={http2}: {e:#} ({} meanwhile)\n{}",
                            mark.since().1,
                            st.logs(40)
                        )
                    });
                let took = t0.elapsed();
                assert!(
                    end.completed(),
                    "{path} h2={http2}: no [DONE]: {:?} ({} meanwhile)\n{}",
                    end.reset,
                    mark.since().1,
                    st.logs(40)
                );
                assert!(
                    took >= 2 * idle,
                    "{path} h2={http2}: the stream took {took:?}, not several idle timeouts ({idle:?})"
                );
                eprintln!("{path} h2={http2}: {n} tokens in {took:?} under a {idle:?} idle timeout");
                let evs = end.events;
                assert!(
                    evs.iter().all(|e| e.event.as_deref() != Some("error")),
                    "{path}: error event"
                );
                let data: Vec<Value> = evs.iter().filter_map(|e| e.json()).collect();
                let prefix = if path.contains("chat") {
                    "chatcmpl-"
                } else {
                    "cmpl-"
                };
                assert_eq!(data[0]["id"], format!("{prefix}{rid}"));
                let finish: Vec<&Value> = data
                    .iter()
                    .filter_map(|d| d["choices"][0].get("finish_reason"))
                    .filter(|f| !f.is_null())
                    .collect();
                assert_eq!(finish, vec![&json!("length")], "{path} h2={http2}");
                let text: String = data
                    .iter()
                    .filter_map(|d| {
                        let c = &d["choices"][0];
                        c["text"]
                            .as_str()
                            .or_else(|| c["delta"]["content"].as_str())
                            .map(str::to_string)
                    })
                    .collect();
                assert!(!text.is_empty());
            }
        }
        v.wait_idle(W).await.unwrap();
        let aborts: f64 = st.control.aborts_by_reason().await.unwrap().values().sum();
        assert_eq!(aborts, 0.0, "{}", st.logs(40));
        let filter = st.filter_stats().await.unwrap();
        let filter_aborts: f64 = filter
            .iter()
            .filter(|(k, _)| k.contains("kvguard_filter_aborts_total"))
            .map(|(_, v)| v)
            .sum();
        assert_eq!(filter_aborts, 0.0, "{filter:?}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_endpoint_unreachable_traffic_flows_and_failures_are_counted() {
    bounded("abort endpoint down", T, async {
        let Some((v, _turn)) = vllm("abort_endpoint_unreachable").await else {
            return;
        };
        let mut o = filter_opts(v.addr(), 30_000);
        // The filter's abort cluster points at a port nothing listens on (kvguard-control's
        // admin listener down); its proxy listener still carries the traffic.
        o.abort_target = Some(stack::closed_port().await.unwrap());
        let st = Stack::start(o).await.unwrap();
        let mut s = client::stream_sse(st.entry(), "/v1/chat/completions", &chat(200), &[], false)
            .await
            .unwrap();
        assert!(s.collect(W).await.unwrap().last().unwrap().is_done());
        let mut s =
            client::stream_sse(st.entry(), "/v1/completions", &completion(LONG), &[], false)
                .await
                .unwrap();
        s.read_events(3, W).await.unwrap();
        s.disconnect();
        poll_until_async(
            "the failed abort is counted",
            W,
            Duration::from_millis(100),
            || async {
                let f = st.filter_stats().await.unwrap();
                let failed: f64 = f
                    .iter()
                    .filter(|(k, _)| {
                        k.contains("kvguard_filter_aborts_total")
                            && (k.contains("=failed") || k.contains("=dispatch_error"))
                    })
                    .map(|(_, v)| v)
                    .sum();
                (failed >= 1.0).then_some(f)
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(60)));
        // Traffic still flows.
        let mut s = client::stream_sse(st.entry(), "/v1/completions", &completion(100), &[], true)
            .await
            .unwrap();
        assert!(s.collect(W).await.unwrap().last().unwrap().is_done());
        drop(st);
        v.wait_idle(W).await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_crash_cuts_its_streams_and_new_ones_flow_after_restart() {
    bounded("control crash", T, async {
        let Some((v, _turn)) = vllm("control_crash").await else {
            return;
        };
        let mut st = Stack::start(filter_opts(v.addr(), 30_000)).await.unwrap();
        let mut s =
            client::stream_sse(st.entry(), "/v1/completions", &completion(LONG), &[], false)
                .await
                .unwrap();
        s.read_events(3, W).await.unwrap();
        v.wait_figures("one running", W, |f| f.running == 1.0)
            .await
            .unwrap();
        st.control.kill().unwrap();
        // Documented behaviour: the streams through it are cut (the client's stream ends,
        // within the wait, without [DONE]), and vLLM, whose connection closed, frees them.
        let end = s.wait_end(W).await.unwrap_or_else(|e| {
            panic!("the stream through the crashed kvguard-control hangs: {e:#}")
        });
        assert!(
            !end.saw_done(),
            "a stream through a crashed kvguard-control cannot complete"
        );
        v.wait_figures("vLLM frees the cut stream", Duration::from_secs(5), |f| {
            f.running == 0.0
        })
        .await
        .unwrap();
        // Meanwhile new requests fail (nothing listens) ...
        let r =
            client::stream_sse(st.entry(), "/v1/completions", &completion(10), &[], false).await;
        assert!(r.map(|s| s.status != 200).unwrap_or(true));
        // ... and flow again once it is back on the same ports.
        st.control.restart().await.unwrap();
        for http2 in [false, true] {
            let mut s =
                client::stream_sse(st.entry(), "/v1/completions", &completion(100), &[], http2)
                    .await
                    .unwrap();
            assert_eq!(s.status, 200);
            assert!(s.collect(W).await.unwrap().last().unwrap().is_done());
        }
        v.wait_idle(W).await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_max_age_ends_a_long_request_and_vllm_frees_it() {
    bounded("max age", T, async {
        let Some((v, _turn)) = vllm("control_max_age").await else {
            return;
        };
        // No filter: kvguard-control alone, with a 2 s max age.
        let mut o = StackOptions::new(v.addr(), None);
        o.control_args = ["--max-age", "2s", "--idle-timeout", "off"]
            .map(String::from)
            .to_vec();
        let st = Stack::start(o).await.unwrap();
        let sent = Instant::now();
        let mut s =
            client::stream_sse(st.entry(), "/v1/completions", &completion(LONG), &[], false)
                .await
                .unwrap();
        s.read_events(3, W).await.unwrap();
        v.wait_figures("vLLM frees it at max age", Duration::from_secs(6), |f| {
            f.running == 0.0
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        let took = sent.elapsed();
        assert!(
            took >= Duration::from_millis(1900),
            "ended before its max age: {took:?}"
        );
        eprintln!("max age 2 s: freed after {took:?}");
        wait_control_aborts(&st, "max_age", 1.0).await;
        // The client is told why (contract §6: a final SSE error event), and its stream ends.
        let evs = s
            .wait_end(W)
            .await
            .unwrap_or_else(|e| panic!("the max-aged stream hangs: {e:#}"))
            .events;
        let told = evs.iter().any(|e| {
            e.event.as_deref() == Some("error")
                && e.json().is_some_and(|j| {
                    j["error"]["type"] == "kvguard_aborted" && j["error"]["reason"] == "max_age"
                })
        });
        assert!(
            told,
            "no kvguard_aborted max_age event in {:?}",
            evs.iter().rev().take(3).collect::<Vec<_>>()
        );
        v.wait_idle(W).await.unwrap();
    })
    .await
    .unwrap();
}

// kvguard-control on real vLLM: engine abort API, non-streaming

/// kvguard-control in this process, in front of `engine` (its reaper off: what ends a
/// request here is the test's abort).
async fn control_in_process(
    engine: &Vllm,
    strategy: kvguard_control::config::AbortStrategy,
) -> kvguard_control::Server {
    let key = kvguard_contract::Key::try_new(stack::SECRET.as_bytes()).unwrap();
    let mut cfg = kvguard_control::Config::for_tests(&engine.url(), vec![key]).unwrap();
    cfg.abort_strategy = strategy;
    cfg.limits = kvguard_control::config::Limits::default();
    cfg.engine_api_key = vllm_api_key();
    let deps = kvguard_control::Deps::real(&cfg);
    kvguard_control::Server::start(cfg, deps).await.unwrap()
}

/// A long streamed completion sent straight to vLLM with request id `id`, read until
/// vLLM runs it.
async fn running_on_vllm(v: &Vllm, addr: SocketAddr, id: &str) -> client::SseStream {
    let bearer = vllm_api_key().map(|k| format!("Bearer {k}"));
    let mut headers = vec![("x-request-id", id)];
    if let Some(b) = &bearer {
        headers.push(("authorization", b.as_str()));
    }
    let mut s = client::stream_sse(addr, "/v1/completions", &completion(LONG), &headers, false)
        .await
        .unwrap();
    assert_eq!(s.status, 200);
    s.read_events(3, W).await.unwrap();
    v.wait_figures("one running", W, |f| f.running == 1.0)
        .await
        .unwrap();
    s
}

/// `KVGUARD_VLLM_API_KEY_FILE`: the shared vLLM runs with `--api-key` (`VLLM_API_KEY`)
/// holding this file's key. Only the tests in this section use it (the suite's one
/// server runs without a key); set it for a run against a guarded vLLM.
fn vllm_api_key() -> Option<String> {
    let p = std::env::var_os("KVGUARD_VLLM_API_KEY_FILE")?;
    Some(std::fs::read_to_string(p).unwrap().trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_scale_out_abort_api_frees_the_sequence_while_its_client_stays_connected() {
    bounded("scale-out abort", T, async {
        let Some((v, _turn)) = vllm("vllm_scale_out_abort_api").await else {
            return;
        };
        // The engine's own abort API alone (the client keeps its connection to vLLM open):
        // vLLM 0.32 answers 200 for any id and aborts in the background, so what counts
        // is the sequence being freed.
        let mut cfg = kvguard_control::Config::for_tests(&v.url(), vec![]).unwrap();
        cfg.abort_strategy = kvguard_control::config::AbortStrategy::VllmScaleOut;
        use kvguard_control::engine::Engine as _;
        let mut s = running_on_vllm(&v, v.addr(), "scale-out-direct").await;
        let id = kvguard_contract::RequestId::try_new(b"scale-out-direct").unwrap();
        if vllm_api_key().is_some() {
            // Guarded by --api-key: without the key the call is refused.
            let unkeyed = kvguard_control::engine::HttpEngine::new(&cfg);
            let e = unkeyed.abort(id.clone()).await.unwrap_err();
            assert!(e.contains("401"), "{e}");
            cfg.engine_api_key = vllm_api_key();
        }
        let engine = kvguard_control::engine::HttpEngine::new(&cfg);
        engine
            .abort(id)
            .await
            .unwrap_or_else(|e| panic!("{e} (is vLLM started with --enable-scale-out?)"));
        let called = Instant::now();
        v.wait_figures(
            "vLLM frees it through its abort API",
            Duration::from_secs(5),
            |f| f.running == 0.0,
        )
        .await
        .unwrap();
        eprintln!("abort API: freed {:?} after the call", called.elapsed());
        wait_vllm_aborted(&v, "cmpl-scale-out-direct").await;
        let _ = s.collect(W).await;
        v.wait_idle(W).await.unwrap();

        // Through kvguard-control with --abort-strategy vllm-scale-out: a signed abort
        // ends it, the engine call succeeds, vLLM frees the sequence.
        let ctl =
            control_in_process(&v, kvguard_control::config::AbortStrategy::VllmScaleOut).await;
        let mut s = running_on_vllm(&v, ctl.proxy_addr, "scale-out-ctl").await;
        let key = kvguard_contract::Key::try_new(stack::SECRET.as_bytes()).unwrap();
        let body =
            serde_json::to_vec(&json!({"request_id": "scale-out-ctl", "reason": "operator"}))
                .unwrap();
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let sig =
            kvguard_contract::signature::sign(kvguard_contract::Domain::Abort, &key, t, &body);
        // kvguard-control runs in this process: this process's stalls are its stalls.
        let mark = StallMark::process();
        let r = client::request(
            ctl.admin_addr,
            hyper::Method::POST,
            "/v1/abort",
            &[("x-kvguard-signature", sig.as_str())],
            body,
            false,
            W,
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        v.wait_figures_within(
            "vLLM frees it within 2 s of the answer",
            Instant::now(),
            Duration::from_secs(2),
            &mark,
            |f| f.running == 0.0,
        )
        .await
        .unwrap();
        let _ = s.collect(W).await;
        poll_until_async(
            "the engine call is counted as aborted",
            W,
            Duration::from_millis(50),
            || async {
                let m = client::get(ctl.admin_addr, "/metrics").await.ok()?.text();
                m.contains(
                    "kvguard_control_aborts_total{reason=\"operator\",outcome=\"aborted\"} 1",
                )
                .then_some(())
            },
        )
        .await
        .unwrap();
        ctl.stop().await;
        v.wait_idle(W).await.unwrap();
    })
    .await
    .unwrap();
}

/// The lossy hop's header that holds a request before its head too.
const HOLD: (&str, &str) = (kvguard_integration::lossy::HOLD_HEADER, "1");

/// A non-streaming request whose client still waits for the answer (it comes at the end).
struct Waiting(tokio::task::JoinHandle<anyhow::Result<client::Resp>>);

impl Waiting {
    /// The client leaves; returns when it has.
    async fn leave(self) -> Instant {
        self.0.abort();
        let _ = self.0.await;
        Instant::now()
    }
}

/// Sends the non-streaming completion `body` through `entry` with `extra` headers and
/// waits until vLLM's figures satisfy `until` (named `what`); the client keeps waiting.
async fn send_completion(
    v: &Vllm,
    entry: SocketAddr,
    st: &Stack,
    body: Value,
    extra: Option<(&'static str, &'static str)>,
    what: &str,
    until: impl Fn(&kvguard_integration::vllm::EngineFigures) -> bool,
) -> Waiting {
    let body = serde_json::to_vec(&body).unwrap();
    let mut headers = vec![("content-type", "application/json")];
    headers.extend(extra);
    let waiting = Waiting(tokio::spawn(async move {
        client::request(
            entry,
            hyper::Method::POST,
            "/v1/completions",
            &headers,
            body,
            false,
            T,
        )
        .await
    }));
    v.wait_figures(what, W, until)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
    waiting
}

/// Sends a long non-streaming completion through `entry` (held by the lossy hop before
/// its head too) and waits until vLLM generates it; the client waits for the answer.
async fn generating_non_streaming(v: &Vllm, entry: SocketAddr, st: &Stack) -> Waiting {
    let body = json!({"model": "tiny", "prompt": "kvguard e2e", "stream": false,
                      "max_tokens": LONG, "ignore_eos": true});
    send_completion(v, entry, st, body, Some(HOLD), "one generating", |f| {
        f.running == 1.0
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streaming_request_left_behind_the_lossy_hop_is_freed_on_vllm() {
    bounded("non-streaming", T, async {
        let Some((v, _turn)) = vllm("non_streaming_left").await else {
            return;
        };
        // Without kvguard's filter the hop keeps the request alive after the client left.
        let st = Stack::start(leak_opts(v.addr())).await.unwrap();
        generating_non_streaming(&v, st.entry(), &st)
            .await
            .leave()
            .await;
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end {
            let f = v.figures().await.unwrap();
            assert_eq!(
                f.running,
                1.0,
                "without the filter it should keep running\n{}",
                st.logs(40)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        drop(st);
        v.wait_idle(W).await.unwrap();
        // Envoy + filter → lossy hop → kvguard-control → vLLM: freed within 2 s.
        let st = Stack::start(filter_opts(v.addr(), 30_000)).await.unwrap();
        let waiting = generating_non_streaming(&v, st.entry(), &st).await;
        let mark = stall_mark(&st);
        let left = waiting.leave().await;
        v.wait_figures_within(
            "vLLM frees it within 2 s of the client leaving",
            left,
            Duration::from_secs(2),
            &mark,
            |f| f.running == 0.0 && f.waiting == 0.0,
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        eprintln!(
            "non-streaming, generating: freed {:?} after the client left",
            left.elapsed()
        );
        wait_control_aborts(&st, "downstream_reset", 1.0).await;
        v.wait_idle(W).await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_non_streaming_request_left_behind_the_lossy_hop_is_freed_on_vllm() {
    bounded("non-streaming queued", T, async {
        let Some((v, _turn)) = vllm("non_streaming_queued").await else {
            return;
        };
        // The stack first: the pool stays full only for the hogs' few seconds, which must
        // not be spent starting Envoy and kvguard-control.
        let st = Stack::start(filter_opts(v.addr(), 30_000)).await.unwrap();
        // Two requests straight to vLLM with distinct 7900-token prompts fill its KV pool
        // (512 blocks of 32) for several seconds, so a third with a 2000-token prompt waits.
        let hog = |t: u32| {
            let body = serde_json::to_vec(
                &json!({"model": "tiny", "prompt": vec![t; 7900], "max_tokens": 290,
                                                  "ignore_eos": true}),
            )
            .unwrap();
            let addr = v.addr();
            tokio::spawn(async move {
                client::request(
                    addr,
                    hyper::Method::POST,
                    "/v1/completions",
                    &[("content-type", "application/json")],
                    body,
                    false,
                    T,
                )
                .await
            })
        };
        let hogs = [hog(7), hog(8)];
        // vLLM on CPU prefills a 2,048-token chunk at a time (measured on a new 2-core
        // machine: one chunk, 0.125 of the pool, every 5–6 s, so about 30 s to fill; with
        // both cores busy beside it, over 30 s for a chunk): wait while the pool keeps
        // filling, failing on 2 W without growth.
        let mut filled = 0.0;
        loop {
            let f = v
                .wait_figures("the KV pool full (or filling)", 2 * W, |f| {
                    (f.running == 2.0 && f.kv_usage > 0.9) || f.kv_usage > filled
                })
                .await
                .unwrap();
            if f.running == 2.0 && f.kv_usage > 0.9 {
                break;
            }
            filled = f.kv_usage;
        }
        let body = json!({"model": "tiny", "prompt": vec![9u32; 2000], "max_tokens": 100,
                          "ignore_eos": true});
        let waiting = send_completion(&v, st.entry(), &st, body, Some(HOLD), "one queued", |f| {
            f.running == 2.0 && f.waiting == 1.0
        })
        .await;
        let mark = stall_mark(&st);
        let left = waiting.leave().await;
        // Out of vLLM's queue while the two others still run.
        v.wait_figures_within(
            "vLLM drops the queued one within 2 s of the client leaving",
            left,
            Duration::from_secs(2),
            &mark,
            |f| f.waiting == 0.0 && f.running == 2.0,
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        eprintln!(
            "non-streaming, queued: freed {:?} after the client left",
            left.elapsed()
        );
        wait_control_aborts(&st, "downstream_reset", 1.0).await;
        for h in hogs {
            let r = h.await.unwrap().unwrap();
            assert_eq!(r.status, 200, "the other requests complete untouched");
        }
        v.wait_idle(W).await.unwrap();
    })
    .await
    .unwrap();
}

// Real hops on real vLLM: LiteLLM, vllm-router
//
// client → Envoy [+ kvguard filter] → LiteLLM proxy 1.108.7 or vllm-router 0.1.17 (real
// processes from `scripts/setup-hops`) → kvguard-control → vLLM. The facts these check are
// in docs/DESIGN.md, "Hops" (measured on the simulator by e2e_hops.rs as well).

use kvguard_integration::hops::{HopKind, LiteLlmOptions};

/// The stream ended at `max_tokens` (`finish_reason: length`): it was read to its end.
/// (LiteLLM re-chunks a stream and drops chunks without text, so events are not tokens.)
fn assert_finished_at_length(evs: &[client::SseEvent]) {
    let finish = evs
        .iter()
        .rev()
        .filter_map(|e| e.json())
        .filter_map(|j| {
            j["choices"][0]["finish_reason"]
                .as_str()
                .map(str::to_string)
        })
        .next();
    assert_eq!(finish.as_deref(), Some("length"), "{evs:?}");
}

fn with_hop(mut o: StackOptions, hop: HopKind) -> StackOptions {
    o.real_hop = Some(hop);
    o
}

/// Sends a [`LEFT`]-token non-streaming completion through `entry` and waits until vLLM
/// generates it (`running` one more than `before`); the client still waits.
async fn send_non_streaming_behind_hop(
    v: &Vllm,
    entry: SocketAddr,
    st: &Stack,
    before: f64,
) -> Waiting {
    let body = json!({"model": "tiny", "prompt": "kvguard hop", "stream": false,
                      "max_tokens": LEFT, "ignore_eos": true});
    send_completion(
        v,
        entry,
        st,
        body,
        None,
        "the non-streaming request generates",
        |f| f.running == before + 1.0,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn litellm_on_vllm_non_streaming_left_leaks_without_kvguard_and_is_freed_with_it() {
    bounded("litellm on vLLM", T + Duration::from_secs(200), async {
        let Some((v, _turn)) = vllm("litellm_non_streaming").await else {
            return;
        };
        let hop = || HopKind::LiteLlm(LiteLlmOptions::kvguard(v.model()));
        // Without kvguard's filter LiteLLM keeps the upstream call after the client left.
        let st = Stack::start(with_hop(leak_opts(v.addr()), hop()))
            .await
            .unwrap();
        let _left = send_non_streaming_behind_hop(&v, st.entry(), &st, 0.0)
            .await
            .leave()
            .await;
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end {
            let f = v.figures().await.unwrap();
            assert_eq!(
                f.running,
                1.0,
                "without the filter LiteLLM should keep it running\n{}",
                st.logs(40)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        drop(st);
        v.wait_idle(W).await.unwrap();
        // With kvguard: a stream someone reads runs beside it and completes untouched. The
        // non-streaming request goes first and is 4x as long, so it still generates when the
        // stream shows in vLLM's gauge (the other way round, a stream that ended before
        // LiteLLM's first completions call reached vLLM left the gauge at 1).
        let st = Stack::start(with_hop(filter_opts(v.addr(), 30_000), hop()))
            .await
            .unwrap();
        let waiting = send_non_streaming_behind_hop(&v, st.entry(), &st, 0.0).await;
        let mut healthy =
            client::stream_sse(st.entry(), "/v1/chat/completions", &chat(LONG), &[], false)
                .await
                .unwrap();
        healthy.read_events(1, W).await.unwrap();
        v.wait_figures("the stream runs beside it", W, |f| f.running == 2.0)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        let left = waiting.leave().await;
        v.wait_figures("vLLM frees it", Duration::from_secs(5), |f| {
            f.running <= 1.0
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        eprintln!(
            "litellm on vLLM, non-streaming: freed {:?} after the client left",
            left.elapsed()
        );
        wait_control_aborts(&st, "downstream_reset", 1.0).await;
        let evs = healthy.collect(LONG_STREAM).await.unwrap();
        assert!(
            evs.last().unwrap().is_done(),
            "the stream beside it was cut: {evs:?}\n{}",
            st.logs(40)
        );
        assert_finished_at_length(&evs);
        assert_eq!(control_aborts(&st, "downstream_reset").await, 1.0);
        v.wait_idle(W).await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_router_on_vllm_passes_disconnects_and_kvguard_cuts_nothing_else() {
    bounded("vllm-router on vLLM", T, async {
        let Some((v, _turn)) = vllm("vllm_router").await else {
            return;
        };
        let st = Stack::start(with_hop(filter_opts(v.addr(), 30_000), HopKind::VllmRouter))
            .await
            .unwrap();
        // Streams someone reads to their end (each from a task of its own, from its first
        // event on): completions and chat, HTTP/1.1 and HTTP/2, of HEALTHY tokens: still
        // running when the two requests below have left beside them (checked below; a
        // 200-token stream ended in 2.9 s on an idle machine).
        let mut healthy = Vec::new();
        for (path, body, http2) in [
            ("/v1/completions", completion(HEALTHY), false),
            ("/v1/chat/completions", chat(HEALTHY), false),
            ("/v1/chat/completions", chat(HEALTHY), true),
        ] {
            let mut s = client::stream_sse(st.entry(), path, &body, &[], http2)
                .await
                .unwrap();
            assert_eq!(s.status, 200, "{path} h2={http2}");
            let started = Instant::now();
            let reading = tokio::spawn(async move {
                let evs = s.collect(HEALTHY_STREAMS).await;
                (evs, started.elapsed())
            });
            healthy.push((format!("{path} h2={http2}"), reading));
        }
        let n = healthy.len() as f64;
        let mut gone =
            client::stream_sse(st.entry(), "/v1/chat/completions", &chat(LONG), &[], false)
                .await
                .unwrap();
        gone.read_events(3, W).await.unwrap();
        v.wait_figures("the streams run", W, |f| f.running == n + 1.0)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        gone.disconnect();
        v.wait_figures(
            "vLLM frees the stream that left",
            Duration::from_secs(5),
            |f| f.running <= n,
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        let left = send_non_streaming_behind_hop(&v, st.entry(), &st, n)
            .await
            .leave()
            .await;
        v.wait_figures(
            "vLLM frees the request that left",
            Duration::from_secs(5),
            |f| f.running <= n,
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        eprintln!(
            "vllm-router on vLLM, non-streaming: freed {:?} after the client left",
            left.elapsed()
        );
        let ended: Vec<&String> = healthy
            .iter()
            .filter(|(_, r)| r.is_finished())
            .map(|(w, _)| w)
            .collect();
        assert!(
            ended.is_empty(),
            "{ended:?} ended before the others had left beside them: nothing was checked"
        );
        for (what, reading) in healthy {
            let (evs, took) = reading.await.unwrap();
            let evs = evs.unwrap_or_else(|e| panic!("{what}: {e:#}\n{}", st.logs(40)));
            assert!(
                evs.last().is_some_and(|e| e.is_done()),
                "{what}: a stream someone reads was cut: {:?}\n{}",
                evs.iter().rev().take(3).collect::<Vec<_>>(),
                st.logs(40)
            );
            assert_finished_at_length(&evs);
            eprintln!(
                "{what}: {} events to [DONE] in {took:?}, finish_reason length",
                evs.len()
            );
        }
        v.wait_idle(W).await.unwrap();
        // Nothing else was cut: the only aborts kvguard sent or counted are for the two
        // clients that left (downstream_reset: at most one each; vllm-router passed their
        // disconnects on too, so kvguard's may find them ended); every other reason reads
        // 0, in the filter and in kvguard-control.
        let control = st.control.aborts_by_reason().await.unwrap();
        assert!(
            control.contains_key("stalled") && control.contains_key("downstream_reset"),
            "kvguard-control exports every reason from the start: {control:?}"
        );
        let others: Vec<_> = control
            .iter()
            .filter(|(r, c)| r.as_str() != "downstream_reset" && **c != 0.0)
            .collect();
        assert!(
            others.is_empty(),
            "kvguard-control counted other aborts: {control:?}\n{}",
            st.logs(40)
        );
        assert!(control["downstream_reset"] <= 2.0, "{control:?}");
        let filter: Vec<(String, f64)> = st
            .filter_stats()
            .await
            .unwrap()
            .into_iter()
            .filter(|(k, _)| k.contains("kvguard_filter_aborts_total"))
            .collect();
        assert!(
            filter.iter().any(|(k, _)| k.contains("reason=.=stalled;")),
            "the filter exports its stalled aborts from the start: {filter:?}"
        );
        let reset = |k: &str| k.contains("reason=.=downstream_reset;");
        let others: Vec<_> = filter
            .iter()
            .filter(|(k, c)| !reset(k) && *c != 0.0)
            .collect();
        assert!(
            others.is_empty(),
            "the filter sent other aborts: {filter:?}\n{}",
            st.logs(40)
        );
        let resets: f64 = filter.iter().filter(|(k, _)| reset(k)).map(|(_, c)| c).sum();
        assert!(resets <= 2.0, "{filter:?}");
        eprintln!(
            "aborts: kvguard-control {control:?}; the filter's downstream_reset {resets}, every other reason 0"
        );
    })
    .await
    .unwrap();
}

/// The liveness lease on real vLLM, with the shipped defaults (enforce, TTL 30 s, renewals
/// every 5 s): Envoy is SIGKILLed with streams behind the lossy hop (no abort can leave it,
/// the hop hides the disconnects); kvguard-control ends them once the lease expires, and
/// vLLM's running count is back to 0 within TTL + 3 s (vLLM's own reaction and its
/// metrics' refresh included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_gateways_streams_are_freed_on_vllm_by_the_lease() {
    bounded("lease on vLLM", T, async {
        let Some((v, _turn)) = vllm("lease_sigkill").await else {
            return;
        };
        const TTL: Duration = Duration::from_secs(30);
        const STREAMS: usize = 4;
        let cfg = stack::filter_config(0, 0);
        let mut o = StackOptions::new(v.addr(), Some(cfg));
        o.control_args = ["--idle-timeout", "off"].map(String::from).to_vec();
        let mut st = Stack::start(o).await.unwrap();
        let mut streams = Vec::new();
        for i in 0..STREAMS {
            let body = if i % 2 == 0 {
                completion(OUTLAST_LEASE)
            } else {
                chat(OUTLAST_LEASE)
            };
            let path = if i % 2 == 0 {
                "/v1/completions"
            } else {
                "/v1/chat/completions"
            };
            let mut s = client::stream_sse(st.entry(), path, &body, &[], i % 2 == 1)
                .await
                .unwrap();
            assert_eq!(s.status, 200);
            s.read_events(3, W).await.unwrap();
            streams.push(s);
        }
        v.wait_figures("all running", W, |f| f.running == STREAMS as f64)
            .await
            .unwrap();
        // Three in-band renewals (a period each, from the first stream on) make the lease
        // enforceable.
        poll_until_async(
            "the gateway's lease enforceable",
            Duration::from_secs(40),
            Duration::from_millis(100),
            || async {
                let text = st.control.metrics_text().await.ok()?;
                text.lines()
                    .any(|l| {
                        l.strip_prefix("kvguard_control_leases_enforceable ")
                            .is_some_and(|n| n.trim() == "1")
                    })
                    .then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(40)));
        // kvguard-control extends every lease by a stall of its own (a renewal it could not
        // read is no silence): the bound is credited with its stalls.
        let mark = stall_mark(&st);
        st.envoy.guard().kill().unwrap();
        let killed = Instant::now();
        drop(streams);
        v.wait_figures_within(
            "vLLM frees them within the TTL + 3 s of the SIGKILL",
            killed,
            TTL + Duration::from_secs(3),
            &mark,
            |f| f.running == 0.0 && f.waiting == 0.0,
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.control.log()));
        eprintln!(
            "vLLM's {STREAMS} sequences freed {:?} after the SIGKILL (TTL {TTL:?})",
            killed.elapsed()
        );
        assert_eq!(
            control_aborts(&st, "gateway_lost").await,
            STREAMS as f64,
            "every stream ends by the lease (none on its own: they are {OUTLAST_LEASE} tokens)"
        );
        v.wait_idle(W).await.unwrap();
    })
    .await
    .unwrap();
}

/// `kvguard-leakcheck` (issue 15), built by scripts/build; `KVGUARD_LEAKCHECK_BIN` overrides.
fn leakcheck_bin() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("KVGUARD_LEAKCHECK_BIN") {
        return p.into();
    }
    let t = kvguard_integration::paths::target_dir().unwrap();
    ["debug", "release"]
        .iter()
        .map(|p| t.join(p).join("kvguard-leakcheck"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "kvguard-leakcheck not found under {}: scripts/build",
                t.display()
            )
        })
}

/// Runs kvguard-leakcheck (bounded); exit code, output, JSON report.
async fn leakcheck(args: &[String]) -> (i32, String, Option<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut cmd = std::process::Command::new(leakcheck_bin());
    cmd.args(args).arg("--report").arg(&report);
    let mut g = kvguard_integration::proc::ChildGuard::spawn("kvguard-leakcheck", cmd).unwrap();
    let status = g
        .wait_exit_async(Duration::from_secs(300))
        .await
        .unwrap_or_else(|e| panic!("{e:#} (a hang):\n{}", g.log()));
    let log = g.log();
    eprintln!("--- kvguard-leakcheck {}:\n{log}", args.join(" "));
    let r = std::fs::read_to_string(&report)
        .ok()
        .map(|t| serde_json::from_str(&t).unwrap());
    (status.code().unwrap_or(-1), log, r)
}

fn leakcheck_kind_verdict(report: &Option<Value>, kind: &str) -> String {
    report.as_ref().unwrap()["analysis"]["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["kind"] == kind)
        .and_then(|k| k["verdict"].as_str())
        .unwrap_or("missing")
        .to_string()
}

/// kvguard-leakcheck on real vLLM: straight to vLLM (which frees a client's disconnect
/// by itself) no leak; a model vLLM does not serve is refused (exit 6); behind the lossy
/// hop that hides disconnects (no kvguard) both kinds leak. Short: 8 s of arrivals per run,
/// 600-token requests (~10 s on this CPU) so that an orphan is seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leakcheck_on_vllm_direct_no_leak_and_behind_the_lossy_hop_leaks() {
    bounded("leakcheck on vLLM", T, async {
        let Some((v, _turn)) = vllm("leakcheck").await else {
            return;
        };
        let args = |target: String, model: &str| -> Vec<String> {
            [
                "--target",
                &target,
                "--engine-metrics",
                &format!("{}/metrics", v.url()),
                "--model",
                model,
                "--rate",
                "1.5",
                "--rounds",
                "1",
                "--duration",
                "8s",
                // Long enough that an abandoned request left running clearly outlasts
                // --free-within even when vLLM is fast (600 tokens ran 5.7 s on a quiet
                // machine: too soon to tell freed from finished, so inconclusive).
                "--max-tokens",
                "1500",
                "--disconnect-share",
                "0.5",
                "--silent-share",
                "0",
                "--non-streaming-share",
                "0.5",
                "--free-within",
                "3s",
                "--quiet-timeout",
                "90s",
                // 1,500 tokens at the probe's pace: 54 ms each on a quiet machine (81 s),
                // 95 ms with both cores busy beside vLLM (143 s).
                "--request-timeout",
                "200s",
                "--extra-body",
                r#"{"ignore_eos": true}"#,
            ]
            .map(String::from)
            .to_vec()
        };
        let (code, log, r) = leakcheck(&args(v.url(), v.model())).await;
        assert_eq!(code, 0, "exit 0 = no leak:\n{log}");
        for k in ["streaming_dropped", "non_streaming_dropped"] {
            assert_eq!(leakcheck_kind_verdict(&r, k), "no_leak", "{k}:\n{log}");
        }
        v.wait_idle(W).await.unwrap();

        let (code, log, _) = leakcheck(&args(v.url(), "no-such-model")).await;
        assert_eq!(code, 6, "exit 6 = model not found:\n{log}");
        assert!(log.contains("does not exist"), "{log}");

        let st = Stack::start(leak_opts(v.addr())).await.unwrap();
        let mut a = args(format!("http://{}", st.entry()), v.model());
        a.extend(["--header".to_string(), format!("{}: {}", HOLD.0, HOLD.1)]);
        let (code, log, r) = leakcheck(&a).await;
        assert_eq!(code, 1, "exit 1 = leaks:\n{log}\n{}", st.logs(30));
        for k in ["streaming_dropped", "non_streaming_dropped"] {
            assert_eq!(leakcheck_kind_verdict(&r, k), "leaks", "{k}:\n{log}");
        }
        v.wait_idle(Duration::from_secs(120)).await.unwrap();
    })
    .await
    .unwrap();
}

// The engine's process tree (vLLM V1: the API server and its EngineCore child)

/// The pid of the process listening on 127.0.0.1:`port` (vLLM's API server), from
/// `/proc/net/tcp` (the socket's inode) and the processes' fds.
fn listener_pid(port: u16) -> Option<u32> {
    let tcp = std::fs::read_to_string("/proc/net/tcp").ok()?;
    // local_address is HEX_IP:HEX_PORT, st 0A = LISTEN, inode is the 10th field.
    let inode = tcp.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let p = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
        (p == port && f.get(3) == Some(&"0A")).then(|| f.get(9).map(|s| s.to_string()))?
    })?;
    let target = format!("socket:[{inode}]");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        std::fs::read_dir(e.path().join("fd"))
            .ok()?
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == target))
            .then_some(pid)
    })
}

/// vLLM's fds and memory as kvguard-control exports them, summed over its process tree:
/// the API server has an EngineCore child, the tree's figures are the sum of each
/// process's, the EngineCore holds more memory than the API server's figure misses, and
/// kvguard-control with `--engine-pid` exports the tree (`engine_processes` >= 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_fds_and_memory_are_summed_over_its_engine_core() {
    bounded("vLLM process tree", T, async {
        let Some((v, _turn)) = vllm("process tree").await else {
            return;
        };
        let pid = listener_pid(v.addr().port()).expect("the process listening on vLLM's port");
        let root = std::path::Path::new("/proc");
        let tree = kvguard_control::procfs::read_tree(root, pid).unwrap();
        let alone = kvguard_control::procfs::read(root, pid).unwrap();
        let cmd = |p: u32| {
            let c = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
            format!(
                "{} {}",
                String::from_utf8_lossy(&c).replace('\0', " "),
                comm.trim()
            )
        };
        let core: Vec<u32> = tree.pids[1..]
            .iter()
            .copied()
            .filter(|&p| cmd(p).contains("EngineCore"))
            .collect();
        let names: Vec<String> = tree
            .pids
            .iter()
            .map(|&p| format!("{p}: {}", cmd(p)))
            .collect();
        eprintln!("vLLM process tree: {names:#?}\n{tree:?}, API server alone {alone:?}");
        assert_eq!(
            core.len(),
            1,
            "one EngineCore among the descendants: {names:#?}"
        );
        let engine_core = kvguard_control::procfs::read(root, core[0]).unwrap();
        assert!(
            tree.total.open_fds >= alone.open_fds + engine_core.open_fds,
            "{tree:?}"
        );
        assert!(
            tree.total.rss_bytes >= alone.rss_bytes + engine_core.rss_bytes / 2,
            "{tree:?} vs API server {alone:?}, EngineCore {engine_core:?}"
        );
        // kvguard-control reading the same tree.
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let args = [
            "--engine-pid".to_string(),
            pid.to_string(),
            "--sample-interval".into(),
            "1s".into(),
        ];
        let c = stack::Control::start(v.addr(), any, any, &args)
            .await
            .unwrap();
        let text = poll_until_async(
            "kvguard-control samples vLLM's process tree",
            W,
            Duration::from_millis(200),
            || async {
                let t = c.metrics_text().await.ok()?;
                let n = t
                    .lines()
                    .find_map(|l| l.strip_prefix("kvguard_control_engine_processes "))?;
                (n.trim().parse::<f64>().ok()? >= 2.0).then_some(t)
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", c.log()));
        let fig = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        assert!(
            fig("kvguard_control_engine_process_open_fds") > alone.open_fds as f64,
            "{text}"
        );
        assert!(
            fig("kvguard_control_engine_process_resident_memory_bytes") > alone.rss_bytes as f64,
            "{text}"
        );
    })
    .await
    .unwrap();
}

/// A series of kvguard-control's `/metrics` (exact name), if present.
async fn control_series(admin: SocketAddr, name: &str) -> Option<f64> {
    let text = client::get(admin, "/metrics").await.ok()?.text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// vLLM counts each choice of an `n > 1` request and each prompt of a batched completion
/// in `num_requests_running` / `_waiting`: such healthy traffic through kvguard-control
/// reads 0 orphans (it counts `n` × prompts per request), and the same `n = 4` request
/// sent past kvguard-control (nobody accounts for it) reads 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orphan_gauge_reads_0_for_n_and_batched_traffic_and_4_for_an_unaccounted_n_4() {
    bounded("orphans per engine sequence", T, async {
        let Some((v, _turn)) = vllm("orphans_per_engine_sequence").await else {
            return;
        };
        let mut cfg = kvguard_control::Config::for_tests(&v.url(), vec![]).unwrap();
        cfg.limits = kvguard_control::config::Limits::default();
        cfg.sample_interval = Duration::from_millis(200);
        cfg.engine_api_key = vllm_api_key();
        let deps = kvguard_control::Deps::real(&cfg);
        let ctl = kvguard_control::Server::start(cfg, deps).await.unwrap();
        let bearer = vllm_api_key().map(|k| format!("Bearer {k}"));
        let stream = |addr: SocketAddr, id: &'static str, extra: Value| {
            let bearer = bearer.clone();
            async move {
                let mut body = completion(LONG);
                for (k, x) in extra.as_object().unwrap() {
                    body[k] = x.clone();
                }
                let mut headers = vec![("x-request-id", id)];
                if let Some(b) = &bearer {
                    headers.push(("authorization", b.as_str()));
                }
                let mut s = client::stream_sse(addr, "/v1/completions", &body, &headers, false)
                    .await
                    .unwrap();
                assert_eq!(s.status, 200, "{id}");
                s.read_events(2, W).await.unwrap();
                s
            }
        };
        let engine_seqs =
            |n: f64| move |f: &kvguard_integration::vllm::EngineFigures| f.running + f.waiting == n;
        // Through kvguard-control: n = 4, and a batch of 3 prompts: 7 engine sequences.
        let n4 = stream(ctl.proxy_addr, "orph-n4", json!({"n": 4})).await;
        let batch = stream(
            ctl.proxy_addr,
            "orph-batch",
            json!({"prompt": ["kvguard a", "kvguard b", "kvguard c"]}),
        )
        .await;
        v.wait_figures("seven sequences", W, engine_seqs(7.0))
            .await
            .unwrap();
        // Five samples that saw the engine's seven: each reads 0 orphans (before: 5).
        let admin = ctl.admin_addr;
        let mut seen = 0;
        while seen < 5 {
            let running = control_series(admin, "kvguard_control_engine_requests_running").await;
            let waiting = control_series(admin, "kvguard_control_engine_requests_waiting").await;
            let orphans = control_series(admin, "kvguard_control_orphans").await;
            if running.unwrap_or(0.0) + waiting.unwrap_or(0.0) == 7.0 {
                assert_eq!(orphans, Some(0.0), "healthy n=4 and batched traffic");
                seen += 1;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        // Past kvguard-control: an n = 4 request nobody here accounts for reads 4.
        let past = stream(v.addr(), "orph-past", json!({"n": 4})).await;
        v.wait_figures("eleven sequences", W, engine_seqs(11.0))
            .await
            .unwrap();
        poll_until_async("orphans 4", W, Duration::from_millis(100), || async {
            (control_series(admin, "kvguard_control_orphans").await == Some(4.0)).then_some(())
        })
        .await
        .unwrap();
        drop((n4, batch, past));
        v.wait_idle(W).await.unwrap();
        ctl.stop().await;
    })
    .await
    .unwrap();
}
