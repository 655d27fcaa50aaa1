//! kvguard-control end to end on loopback, in process, against the workspace's engine
//! simulator. Every wait is bounded; no sleep is used as synchronisation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvguard_contract::{stamp, Key, RequestId};
use kvguard_control::config::AbortStrategy;
use kvguard_integration::client;
use kvguard_integration::free_addrs;
use kvguard_integration::sim::{EndKind, SimConfig};
use kvguard_integration::wait::{bounded, poll_until_async};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(60);

/// How long past its configured time (none for an abort call; the idle timeout or max age
/// plus a reaper tick; the drain timeout) the engine may be seen to end a request, timed
/// from the call's or the request's start. Measured (six runs): 1-9 ms from an abort call
/// to the engine, at most 11 ms past idle timeout + tick, 8 ms past max age + tick, 7 ms
/// past the drain timeout; the engine is polled every 10 ms. About 5x (worst + one poll).
const SLACK: Duration = Duration::from_millis(100);

/// What is left of the time to `deadline` (zero once it passed), for a wait that must end
/// by then whenever it began.
fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Fails unless `what`, just seen, was seen within `bound` of `start`: an event that came
/// late but before the wait for it began fails too. Returns the time taken.
fn seen_within(what: &str, start: Instant, bound: Duration) -> Duration {
    let took = start.elapsed();
    assert!(
        took <= bound,
        "{what}: seen {took:?} after its start, bound {bound:?}"
    );
    took
}

fn final_error(ev: &kvguard_integration::client::SseEvent) -> Option<String> {
    if ev.event.as_deref() != Some("error") {
        return None;
    }
    let j = ev.json()?;
    (j["error"]["type"] == "kvguard_aborted")
        .then(|| j["error"]["reason"].as_str().unwrap_or("").to_owned())
}

#[tokio::test]
async fn sse_flows_unbuffered_with_id_and_stamp() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |_| {}).await;
        for http2 in [false, true] {
            let id = if http2 { "unbuf-h2" } else { "unbuf-h1" };
            let mut s = client::stream_sse(
                ctl.proxy_addr,
                "/v1/completions",
                &completion(40),
                &[("x-request-id", id)],
                http2,
            )
            .await
            .unwrap();
            assert_eq!(s.status, 200);
            // The stamp names the advertised admin address and verifies for this id.
            let st = s.header("x-kvguard-control").unwrap().to_owned();
            let rid = RequestId::try_new(id.as_bytes()).unwrap();
            assert_eq!(
                stamp::verify(&[key()], st.as_bytes(), &rid)
                    .unwrap()
                    .addr
                    .to_string(),
                "127.0.0.1:9902"
            );
            assert_eq!(s.header("x-request-id"), Some(id));
            // Events arrive one by one while the engine is still generating (40 tokens at 20/s = 2 s).
            for i in 0..3 {
                let ev = s.next_data(Duration::from_secs(5)).await.unwrap().unwrap();
                assert!(ev.json().is_some(), "event {i}: {ev:?}");
                let rec = sim.state().request(id).cloned().unwrap();
                assert!(
                    rec.ended.is_none(),
                    "engine already finished: not streamed ({rec:?})"
                );
                assert!(rec.tokens_sent < 40);
            }
            // The engine saw our id.
            assert_eq!(sim.state().request(id).unwrap().request_id, id);
            // While it streams, /v1/requests shows it with its progress.
            let reqs = client::get_json(ctl.admin_addr, "/v1/requests")
                .await
                .unwrap();
            let row = reqs["requests"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["request_id"] == id)
                .cloned()
                .unwrap();
            assert_eq!(row["body"], "sse");
            assert!(row["events"].as_u64().unwrap() >= 3);
            let rest = s.collect(Duration::from_secs(10)).await.unwrap();
            assert!(rest.last().unwrap().is_done());
            assert!(s.is_ended());
        }
        // Both ended clean; the in-flight table is empty again.
        poll_until_async(
            "clean ends counted",
            T,
            Duration::from_millis(20),
            || async {
                (metric(
                    ctl.admin_addr,
                    "kvguard_control_request_ends_total{end=\"clean\",cause=\"complete\"}",
                )
                .await
                    == Some(2.0))
                .then_some(())
            },
        )
        .await
        .unwrap();
        assert_eq!(ctl.state.inflight(), 0);
        // An id is minted when absent, and passed to the engine.
        let r = client::post_json(
            ctl.proxy_addr,
            "/v1/completions",
            &json!({"model":"tiny","prompt":"x","max_tokens":2}),
            &[],
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let minted = r.header("x-request-id").unwrap().to_owned();
        assert!(minted.len() >= 32);
        assert!(sim.state().request(&minted).is_some());
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn signed_abort_closes_engine_connection_and_sends_final_event() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |_| {}).await;
        let id = "abort-me";
        let mut s = long_completion(ctl.proxy_addr, id).await;
        s.read_events(2, Duration::from_secs(5)).await.unwrap();
        let t0 = Instant::now();
        let (status, body) = abort(ctl.admin_addr, id, "downstream_reset").await;
        let answered = t0.elapsed();
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            body,
            json!({"request_id": id, "found": true, "aborted": true})
        );
        // The engine sees the disconnect within SLACK of the abort call's start.
        let st = sim
            .wait_state("engine saw the disconnect", left(t0 + SLACK), |st| {
                st.request(id)
                    .is_some_and(|r| r.ended == Some(EndKind::Disconnected))
            })
            .await
            .unwrap();
        let took = seen_within("engine saw the disconnect", t0, SLACK);
        assert!(st.request(id).unwrap().client_gone);
        eprintln!("abort answered in {answered:?}; abort call → engine disconnect: {took:?}");
        // The client gets the contract's final event, then the end of the stream.
        let events = s.collect(Duration::from_secs(5)).await.unwrap();
        let last = events.last().unwrap();
        assert_eq!(
            final_error(last).as_deref(),
            Some("downstream_reset"),
            "{events:?}"
        );
        assert!(s.is_ended());
        // Again: already aborted (tombstone).
        let (status, body) = abort(ctl.admin_addr, id, "downstream_reset").await;
        assert_eq!(status, 200);
        assert_eq!(
            body,
            json!({"request_id": id, "found": true, "already_aborted": true})
        );
        // Counted by reason and outcome.
        poll_until_async("abort counted", T, Duration::from_millis(20), || async {
            (metric(
                ctl.admin_addr,
                "kvguard_control_aborts_total{reason=\"downstream_reset\",outcome=\"aborted\"}",
            )
            .await
                == Some(1.0))
            .then_some(())
        })
        .await
        .unwrap();
        assert_eq!(
            metric(
                ctl.admin_addr,
                "kvguard_control_abort_api_answers_total{result=\"aborted\"}"
            )
            .await,
            Some(1.0)
        );
        assert_eq!(
            metric(
                ctl.admin_addr,
                "kvguard_control_abort_api_answers_total{result=\"already_aborted\"}"
            )
            .await,
            Some(1.0)
        );
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn unsigned_wrong_key_stale_replayed_and_malformed_aborts_are_refused() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |_| {}).await;
        let id = "keep-flowing";
        let mut s = long_completion(ctl.proxy_addr, id).await;
        s.next_data(Duration::from_secs(5)).await.unwrap().unwrap();
        let admin = ctl.admin_addr;
        let body = json!({"request_id": id, "reason": "operator"});
        let other = Key::try_new(OTHER_KEY).unwrap();
        let (st, _, _) = abort_signed(admin, &body, None, now_unix()).await;
        assert_eq!(st, 401, "unsigned");
        let (st, _, _) = abort_signed(admin, &body, Some(&other), now_unix()).await;
        assert_eq!(st, 401, "wrong key");
        let (st, _, _) = abort_signed(admin, &body, Some(&key()), now_unix() - 31).await;
        assert_eq!(st, 401, "stale");
        let (st, _, _) = abort_signed(admin, &body, Some(&key()), now_unix() + 31).await;
        assert_eq!(st, 401, "future");
        // Malformed body, correctly signed: 400.
        let (st, _, _) = abort_signed(
            admin,
            &json!({"request_id": "a b", "reason": "operator"}),
            Some(&key()),
            now_unix(),
        )
        .await;
        assert_eq!(st, 400);
        let (st, _, _) = abort_signed(
            admin,
            &json!({"request_id": id, "reason": "bored"}),
            Some(&key()),
            now_unix(),
        )
        .await;
        assert_eq!(st, 400);
        // Replay: a valid call (for another id: 404) sent twice with the same signature.
        let other_body =
            serde_json::to_vec(&json!({"request_id": "someone-else", "reason": "operator"}))
                .unwrap();
        let sig = kvguard_contract::signature::sign(
            kvguard_contract::Domain::Abort,
            &key(),
            now_unix(),
            &other_body,
        );
        for expected in [404, 409] {
            let r = client::request(
                admin,
                hyper::Method::POST,
                "/v1/abort",
                &[("x-kvguard-signature", sig.as_str())],
                other_body.clone(),
                false,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
            assert_eq!(r.status, expected, "{}", r.text());
        }
        // The stream kept flowing and the engine still runs it.
        s.read_events(5, Duration::from_secs(5)).await.unwrap();
        assert!(sim.state().request(id).unwrap().ended.is_none());
        assert_eq!(
            metric(
                admin,
                "kvguard_control_abort_api_answers_total{result=\"unauthorized\"}"
            )
            .await,
            Some(4.0)
        );
        assert_eq!(
            metric(
                admin,
                "kvguard_control_abort_api_answers_total{result=\"replay\"}"
            )
            .await,
            Some(1.0)
        );
        assert_eq!(
            metric(
                admin,
                "kvguard_control_abort_api_answers_total{result=\"bad_request\"}"
            )
            .await,
            Some(2.0)
        );
        drop(s);
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn abort_before_the_request_arrives_refuses_it() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |_| {}).await;
        let id = "overtaken";
        let (status, body) = abort(ctl.admin_addr, id, "downstream_reset").await;
        assert_eq!(status, 404);
        assert_eq!(body, json!({"request_id": id, "found": false}));
        let r = client::post_json(
            ctl.proxy_addr,
            "/v1/completions",
            &completion(5),
            &[("x-request-id", id)],
        )
        .await
        .unwrap();
        assert_eq!(r.status, 409, "{}", r.text());
        let j = r.json().unwrap();
        assert_eq!(j["error"]["type"], "kvguard_aborted");
        assert_eq!(j["error"]["reason"], "downstream_reset");
        assert_eq!(j["error"]["request_id"], id);
        assert!(
            sim.state().request(id).is_none(),
            "the engine must not see it"
        );
        let (status, body) = abort(ctl.admin_addr, id, "downstream_reset").await;
        assert_eq!(status, 200);
        assert_eq!(body["already_aborted"], true);
        assert_eq!(
            metric(
                ctl.admin_addr,
                "kvguard_control_requests_total{result=\"refused_tombstone\"}"
            )
            .await,
            Some(1.0)
        );
        assert_eq!(
            metric(ctl.admin_addr, "kvguard_control_tombstones").await,
            Some(1.0)
        );
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn idle_stream_is_reaped_although_keepalives_flow() {
    bounded("test", LIMIT, async {
        let sim = sim(SimConfig::default()).await;
        let ctl = control(&sim.url(), |c| {
            c.limits.idle_timeout = Some(Duration::from_millis(400))
        })
        .await;
        let id = "stalls";
        let idle = ctl.state.cfg.limits.idle_timeout.unwrap();
        let tick = kvguard_control::reaper::tick(&ctl.state.cfg.limits);
        let started = Instant::now();
        let mut s = client::stream_sse(
            ctl.proxy_addr,
            "/v1/completions",
            &completion(100),
            &[
                ("x-request-id", id),
                ("x-sim-stall-after", "2"),
                ("x-sim-keepalive-ms", "50"),
            ],
            false,
        )
        .await
        .unwrap();
        let events = s.collect(Duration::from_secs(10)).await.unwrap();
        assert!(
            events.iter().filter(|e| e.comment).count() >= 3,
            "keep-alives flowed: {events:?}"
        );
        assert_eq!(
            events
                .iter()
                .filter(|e| e.data.is_some() && e.event.is_none())
                .count(),
            2
        );
        assert_eq!(
            final_error(events.last().unwrap()).as_deref(),
            Some("stalled")
        );
        // Two tokens (10 ms at 200/s), then the idle timeout, seen by the reaper's next
        // tick: counted from the request's start.
        sim.wait_state(
            "engine aborted",
            left(started + idle + tick + SLACK),
            |st| {
                st.request(id)
                    .is_some_and(|r| r.ended == Some(EndKind::Disconnected))
            },
        )
        .await
        .unwrap();
        let took = seen_within("engine aborted", started, idle + tick + SLACK);
        eprintln!(
            "idle timeout {idle:?}, tick {tick:?}: engine saw the stall end {took:?} after the \
             request began"
        );
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn first_token_timeout_and_max_age_are_reaped() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |c| {
            c.limits.first_token_timeout = Some(Duration::from_millis(300));
            c.limits.max_age = Some(Duration::from_millis(1200));
        })
        .await;
        let max_age = ctl.state.cfg.limits.max_age.unwrap();
        let tick = kvguard_control::reaper::tick(&ctl.state.cfg.limits);
        let started = Instant::now();
        let mut slow = client::stream_sse(
            ctl.proxy_addr,
            "/v1/completions",
            &completion(100),
            &[
                ("x-request-id", "slow-first"),
                ("x-sim-delay-first-ms", "5000"),
            ],
            false,
        )
        .await
        .unwrap();
        let mut long = long_completion(ctl.proxy_addr, "runaway").await;
        let ev = slow.collect(Duration::from_secs(5)).await.unwrap();
        assert_eq!(
            final_error(ev.last().unwrap()).as_deref(),
            Some("first_token_timeout"),
            "{ev:?}"
        );
        let ev = long.collect(Duration::from_secs(5)).await.unwrap();
        assert!(
            ev.len() > 10,
            "it made progress until max age: {}",
            ev.len()
        );
        assert_eq!(final_error(ev.last().unwrap()).as_deref(), Some("max_age"));
        // Both are ended by max age at the latest (counted from their start), seen by the
        // reaper's next tick.
        sim.wait_state(
            "engine aborted both",
            left(started + max_age + tick + SLACK),
            |st| {
                ["slow-first", "runaway"].iter().all(|id| {
                    st.request(id)
                        .is_some_and(|r| r.ended == Some(EndKind::Disconnected))
                })
            },
        )
        .await
        .unwrap();
        let took = seen_within("engine aborted both", started, max_age + tick + SLACK);
        eprintln!(
            "max age {max_age:?}, tick {tick:?}: engine saw both end {took:?} after the \
             requests began"
        );
        assert_eq!(
            metric(
                ctl.admin_addr,
                "kvguard_control_aborts_total{reason=\"first_token_timeout\",outcome=\"aborted\"}"
            )
            .await,
            Some(1.0)
        );
        assert_eq!(
            metric(
                ctl.admin_addr,
                "kvguard_control_aborts_total{reason=\"max_age\",outcome=\"aborted\"}"
            )
            .await,
            Some(1.0)
        );
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn engine_down_readyz_fails_and_proxy_answers_502() {
    bounded("test", LIMIT, async {
        // A port that nothing listens on.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = l.local_addr().unwrap();
        drop(l);
        let ctl = control(&format!("http://{dead}"), |_| {}).await;
        let r = client::post_json(
            ctl.proxy_addr,
            "/v1/completions",
            &completion(5),
            &[("x-request-id", "to-nowhere")],
        )
        .await
        .unwrap();
        assert_eq!(r.status, 502);
        let j = r.json().unwrap();
        assert_eq!(j["error"]["type"], "kvguard_engine_unreachable");
        assert!(j["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&dead.to_string()));
        poll_until_async("readyz 503", T, Duration::from_millis(20), || async {
            let r = client::get(ctl.admin_addr, "/readyz").await.ok()?;
            (r.status == 503).then_some(r.text())
        })
        .await
        .unwrap();
        assert_eq!(
            client::get(ctl.admin_addr, "/healthz")
                .await
                .unwrap()
                .status,
            200
        );
        assert_eq!(ctl.state.inflight(), 0);
        ctl.stop().await;

        // And with an engine that goes away: ready, then not.
        let mut sim = sim(SimConfig::default()).await;
        let ctl = control(&sim.url(), |_| {}).await;
        poll_until_async("readyz 200", T, Duration::from_millis(20), || async {
            (client::get(ctl.admin_addr, "/readyz").await.ok()?.status == 200).then_some(())
        })
        .await
        .unwrap();
        sim.shutdown();
        poll_until_async(
            "readyz 503 after the engine left",
            T,
            Duration::from_millis(50),
            || async {
                (client::get(ctl.admin_addr, "/readyz").await.ok()?.status == 503).then_some(())
            },
        )
        .await
        .unwrap();
        assert_eq!(
            metric(ctl.admin_addr, "kvguard_control_engine_up").await,
            Some(0.0)
        );
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn engine_figures_orphans_and_quiet_checkpoints() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |_| {}).await;
        // A quiet checkpoint is taken while nothing is in flight.
        poll_until_async("quiet checkpoint", T, Duration::from_millis(20), || async {
            (metric(
                ctl.admin_addr,
                "kvguard_control_quiet_checkpoint_timestamp_seconds",
            )
            .await?
                > 0.0)
                .then_some(())
        })
        .await
        .unwrap();
        assert_eq!(
            metric(ctl.admin_addr, "kvguard_control_quiet_kv_usage").await,
            Some(0.0)
        );
        assert_eq!(
            metric(ctl.admin_addr, "kvguard_control_nvml_available").await,
            Some(0.0)
        );
        // One request through kvguard, one straight to the engine (an orphan: no client
        // connection through kvguard holds it).
        let mut through = long_completion(ctl.proxy_addr, "through").await;
        let mut direct = long_completion(sim.addr(), "direct").await;
        through.next_data(Duration::from_secs(5)).await.unwrap();
        direct.next_data(Duration::from_secs(5)).await.unwrap();
        poll_until_async("engine figures", T, Duration::from_millis(20), || async {
            let running = metric(ctl.admin_addr, "kvguard_control_engine_requests_running").await?;
            let orphans = metric(ctl.admin_addr, "kvguard_control_orphans").await?;
            let kv = metric(ctl.admin_addr, "kvguard_control_engine_kv_usage_ratio").await?;
            (running == 2.0 && orphans == 1.0 && kv > 0.0).then_some(())
        })
        .await
        .unwrap();
        let e = client::get_json(ctl.admin_addr, "/v1/engine")
            .await
            .unwrap();
        assert_eq!(e["flavour"], "vllm");
        let g = client::get_json(ctl.admin_addr, "/v1/gpu").await.unwrap();
        assert_eq!(g["nvml_available"], false);
        // A client that goes away: the engine sees it (abort on disconnect through kvguard).
        through.disconnect();
        sim.wait_state(
            "engine saw the client leave",
            Duration::from_secs(2),
            |st| {
                st.request("through")
                    .is_some_and(|r| r.ended == Some(EndKind::Disconnected))
            },
        )
        .await
        .unwrap();
        poll_until_async(
            "client_gone counted",
            T,
            Duration::from_millis(20),
            || async {
                (metric(
                    ctl.admin_addr,
                    "kvguard_control_request_ends_total{end=\"unclean\",cause=\"client_gone\"}",
                )
                .await
                    == Some(1.0))
                .then_some(())
            },
        )
        .await
        .unwrap();
        drop(direct);
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn engine_abort_apis_per_strategy_and_dry_run() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        for (strategy, api, ids) in [
            (AbortStrategy::Sglang, "sglang", vec!["sg-1".to_owned()]),
            (
                AbortStrategy::VllmScaleOut,
                "vllm",
                vec![
                    "cmpl-vl-1-0".to_owned(),
                    "chatcmpl-vl-1".to_owned(),
                    "cmpl-vl-1".to_owned(),
                ],
            ),
        ] {
            let ctl = control(&sim.url(), |c| c.abort_strategy = strategy).await;
            let id = if api == "sglang" { "sg-1" } else { "vl-1" };
            let mut s = long_completion(ctl.proxy_addr, id).await;
            s.next_data(Duration::from_secs(5)).await.unwrap();
            let called = Instant::now();
            let (status, _) = abort(ctl.admin_addr, id, "operator").await;
            assert_eq!(status, 200);
            let st = sim
                .wait_state("engine abort API called", left(called + SLACK), |st| {
                    st.abort_calls.iter().any(|c| c.api == api)
                })
                .await
                .unwrap();
            let took = seen_within("engine abort API called", called, SLACK);
            eprintln!("{api}: abort call → engine abort API called: {took:?}");
            let call = st.abort_calls.iter().find(|c| c.api == api).unwrap();
            assert_eq!(call.ids, ids);
            if api == "sglang" {
                // SGLang knows a request by its body's `rid` only: kvguard-control wrote
                // the id into the body (the simulator takes it as the engine's id).
                assert_eq!(st.request(id).unwrap().engine_id, id);
            } else {
                assert_eq!(st.request(id).unwrap().engine_id, format!("cmpl-{id}"));
            }
            let ev = s.collect(Duration::from_secs(5)).await.unwrap();
            assert_eq!(final_error(ev.last().unwrap()).as_deref(), Some("operator"));
            ctl.stop().await;
        }
        // Dry run: found, counted, nothing ended.
        let ctl = control(&sim.url(), |c| c.dry_run = true).await;
        let mut s = long_completion(ctl.proxy_addr, "dry").await;
        s.next_data(Duration::from_secs(5)).await.unwrap();
        let (status, body) = abort(ctl.admin_addr, "dry", "operator").await;
        assert_eq!(status, 200);
        assert_eq!(body, json!({"request_id": "dry", "found": true}));
        s.read_events(5, Duration::from_secs(5)).await.unwrap();
        assert!(sim.state().request("dry").unwrap().ended.is_none());
        assert_eq!(
            metric(
                ctl.admin_addr,
                "kvguard_control_aborts_total{reason=\"operator\",outcome=\"dry_run\"}"
            )
            .await,
            Some(1.0)
        );
        drop(s);
        ctl.stop().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn shutdown_drains_then_ends_the_rest() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |c| {
            c.drain_timeout = Duration::from_millis(1500)
        })
        .await;
        let proxy = ctl.proxy_addr;
        // Finishes within the drain (10 tokens at 20/s); the long one does not.
        let mut short = client::stream_sse(
            proxy,
            "/v1/completions",
            &completion(10),
            &[("x-request-id", "short")],
            false,
        )
        .await
        .unwrap();
        let mut long = long_completion(proxy, "long").await;
        short.next_data(Duration::from_secs(5)).await.unwrap();
        long.next_data(Duration::from_secs(5)).await.unwrap();
        let state = ctl.state.clone();
        let drain = ctl.state.cfg.drain_timeout;
        let stop_called = Instant::now();
        let stopping = tokio::spawn(ctl.stop());
        poll_until_async("draining", T, Duration::from_millis(10), || {
            let st = state.clone();
            async move { st.is_draining().then_some(()) }
        })
        .await
        .unwrap();
        // New connections are refused (the listener is closed).
        poll_until_async("listener closed", T, Duration::from_millis(20), || async {
            tokio::net::TcpStream::connect(proxy)
                .await
                .is_err()
                .then_some(())
        })
        .await
        .unwrap();
        let ev = short.collect(Duration::from_secs(5)).await.unwrap();
        assert!(ev.last().unwrap().is_done(), "short finished cleanly");
        let ev = long.collect(Duration::from_secs(5)).await.unwrap();
        assert_eq!(final_error(ev.last().unwrap()).as_deref(), Some("operator"));
        // Both the end of stop() and the engine's disconnect of the long one come the
        // drain timeout after stop() was called, plus the time to end what is left.
        bounded("stop", left(stop_called + drain + SLACK), stopping)
            .await
            .unwrap()
            .unwrap();
        let stopped = seen_within("stop", stop_called, drain + SLACK);
        sim.wait_state(
            "engine aborted the long one",
            left(stop_called + drain + SLACK),
            |st| {
                st.request("long")
                    .is_some_and(|r| r.ended == Some(EndKind::Disconnected))
            },
        )
        .await
        .unwrap();
        let ended = seen_within("engine aborted the long one", stop_called, drain + SLACK);
        eprintln!(
            "drain {drain:?}: stop() returned {stopped:?} after the call, engine saw the long \
             one end {ended:?} after it"
        );
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn client_gone_before_headers_and_h2_stream_reset_reach_the_engine() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |_| {}).await;
        // Non-streaming: the engine answers only when done; the client gives up first.
        let body = serde_json::to_vec(&json!({"model": "tiny", "prompt": "x", "max_tokens": 400})).unwrap();
        let gave_up = client::request(
            ctl.proxy_addr,
            hyper::Method::POST,
            "/v1/completions",
            &[("x-request-id", "impatient")],
            body,
            false,
            Duration::from_millis(500),
        )
        .await;
        assert!(gave_up.is_err());
        sim.wait_state("engine saw the impatient client leave", Duration::from_secs(2), |st| {
            st.request("impatient").is_some_and(|r| r.ended == Some(EndKind::Disconnected))
        })
        .await
        .unwrap();
        // h2: the client resets its stream but keeps the connection.
        let mut s = client::stream_sse(ctl.proxy_addr, "/v1/chat/completions", &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": true}), &[("x-request-id", "h2-reset")], true)
            .await
            .unwrap();
        s.next_data(Duration::from_secs(5)).await.unwrap().unwrap();
        let conn = s.reset_stream();
        sim.wait_state("engine saw the h2 reset", Duration::from_secs(2), |st| {
            st.request("h2-reset").is_some_and(|r| r.ended == Some(EndKind::Disconnected))
        })
        .await
        .unwrap();
        conn.abort();
        poll_until_async("client_gone counted twice", T, Duration::from_millis(20), || async {
            (metric(ctl.admin_addr, "kvguard_control_request_ends_total{end=\"unclean\",cause=\"client_gone\"}").await == Some(2.0)).then_some(())
        })
        .await
        .unwrap();
        assert_eq!(ctl.state.inflight(), 0);
        ctl.stop().await;
    })
    .await
    .unwrap();
}

/// `--peers` naming every address of `all`, this replica being `me`.
fn peer_config(all: &[SocketAddr], me: SocketAddr) -> kvguard_control::config::PeerConfig {
    kvguard_control::config::PeerConfig {
        urls: all
            .iter()
            .map(|a| kvguard_control::config::parse_peer_url(&format!("http://{a}")).unwrap())
            .collect(),
        self_addr: me,
    }
}

/// Rotation step 4 (the old key leaves `--secret-file`), half done: replica B reloaded
/// and accepts only the new key, replica A still holds [old, new] and signs its stamp with
/// the new one. An abort reaching A for a request on B is forwarded in an envelope B
/// accepts (signed with the stamp key), so it ends the request.
#[tokio::test]
async fn a_forwarded_abort_crosses_a_half_done_rotation() {
    bounded("test", T, async {
        let sim = sim(slow_sim()).await;
        let old = Key::try_new(KEY).unwrap();
        let new = Key::try_new(b"kvguard-rotated-key-0123456789").unwrap();
        let admins = free_addrs(2);
        let (a, b) = (admins[0], admins[1]);
        let rb = control(&sim.url(), |c| {
            c.admin_listen = b;
            c.keys = vec![new.clone()];
            c.stamp_key = Some(new.clone());
            c.peers = Some(peer_config(&admins, b));
        })
        .await;
        let ra = control(&sim.url(), |c| {
            c.admin_listen = a;
            c.keys = vec![old.clone(), new.clone()];
            c.stamp_key = Some(new.clone());
            c.peers = Some(peer_config(&admins, a));
        })
        .await;
        let mut s = long_completion(rb.proxy_addr, "rotated").await;
        s.next_data(T).await.unwrap().unwrap();
        let body = json!({"request_id": "rotated", "reason": "downstream_reset"});
        let (status, v, _) = abort_signed(ra.admin_addr, &body, Some(&new), now_unix()).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["aborted"], true, "{v}");
        let ev = s.collect(T).await.unwrap();
        let last = ev.last().and_then(|e| e.json()).unwrap_or_default();
        assert_eq!(last["error"]["reason"], "downstream_reset", "{ev:?}");
        ra.stop().await;
        rb.stop().await;
    })
    .await
    .unwrap();
}

/// An abort that overtakes its request (a queueing hop in front: LiteLLM) reaches one
/// replica of three; none holds the id, so each tombstones it: the request is refused
/// (409) whichever replica it lands on.
#[tokio::test]
async fn an_abort_overtaking_its_request_is_tombstoned_on_every_replica() {
    bounded("test", T, async {
        let sim = sim(slow_sim()).await;
        let admins = free_addrs(3);
        let mut replicas = Vec::new();
        for a in &admins {
            let a = *a;
            let all = admins.clone();
            replicas.push(
                control(&sim.url(), move |c| {
                    c.admin_listen = a;
                    c.peers = Some(peer_config(&all, a));
                })
                .await,
            );
        }
        let (status, v) = abort(replicas[0].admin_addr, "overtaken", "downstream_reset").await;
        assert_eq!(status, 404, "{v}");
        for (i, r) in replicas.iter().enumerate() {
            let resp = client::post_json(
                r.proxy_addr,
                "/v1/completions",
                &completion(4),
                &[("x-request-id", "overtaken")],
            )
            .await
            .unwrap();
            assert_eq!(resp.status, 409, "replica {i}: {}", resp.text());
        }
        for r in replicas {
            r.stop().await;
        }
    })
    .await
    .unwrap();
}

/// The replay memory filled while streams run: once it holds `cap` live signatures a new
/// call is refused 503 (retry) and a replay of any remembered one stays 409, never 200 or
/// 404; admission (its own lock) goes on throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_memory_filled_under_load_refuses_new_calls_and_never_accepts_a_replay() {
    bounded("test", Duration::from_secs(60), async {
        let sim = sim(SimConfig {
            token_rate: 500.0,
            ..SimConfig::default()
        })
        .await;
        const CAP: usize = 300;
        let ctl = control(&sim.url(), |c| c.max_replay_entries = CAP).await;
        let proxy = ctl.proxy_addr;
        let stop = tokio_util::sync::CancellationToken::new();
        let load: Vec<_> = (0..8)
            .map(|w| {
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut done = 0u32;
                    while !stop.is_cancelled() {
                        let id = format!("load-{w}-{done}");
                        let mut s = client::stream_sse(
                            proxy,
                            "/v1/completions",
                            &completion(20),
                            &[("x-request-id", &id)],
                            false,
                        )
                        .await
                        .unwrap();
                        let ev = s.collect(T).await.unwrap();
                        assert!(ev.last().unwrap().is_done(), "{id}: {ev:?}");
                        done += 1;
                    }
                    done
                })
            })
            .collect();
        let key = key();
        let t = now_unix();
        let mut sent = Vec::new();
        for i in 0..CAP + 50 {
            let body = serde_json::to_vec(
                &json!({"request_id": format!("fill-{i}"), "reason": "operator"}),
            )
            .unwrap();
            let sig =
                kvguard_contract::signature::sign(kvguard_contract::Domain::Abort, &key, t, &body);
            let r = post_signed(ctl.admin_addr, &body, &sig).await;
            let want = if i < CAP { 404 } else { 503 };
            assert_eq!(r, want, "call {i}");
            sent.push((body, sig));
        }
        for (i, (body, sig)) in sent.iter().enumerate().take(CAP) {
            assert_eq!(
                post_signed(ctl.admin_addr, body, sig).await,
                409,
                "replay {i}"
            );
        }
        stop.cancel();
        let mut completed = 0;
        for l in load {
            completed += l.await.unwrap();
        }
        assert!(completed > 0, "admission went on");
        assert_eq!(
            metric(ctl.admin_addr, "kvguard_control_replay_full_total").await,
            Some(50.0)
        );
        ctl.stop().await;
    })
    .await
    .unwrap();
}

async fn post_signed(admin: SocketAddr, body: &[u8], sig: &str) -> u16 {
    client::request(
        admin,
        hyper::Method::POST,
        "/v1/abort",
        &[("x-kvguard-signature", sig)],
        body.to_vec(),
        false,
        T,
    )
    .await
    .unwrap()
    .status
}

/// The proxy reads a request's body on its way for the engine sequences it makes: `n`
/// choices of each prompt of a batched completion.
#[tokio::test]
async fn the_proxy_counts_the_engine_sequences_of_n_and_batched_prompts() {
    bounded("test", T, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |_| {}).await;
        for (body, want) in [
            (json!({"model": "tiny", "prompt": "a", "n": 4, "max_tokens": 400, "stream": true}), 4),
            (json!({"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 400, "stream": true}), 3),
            (json!({"model": "tiny", "prompt": "a", "max_tokens": 400, "stream": true}), 1),
        ] {
            let mut s = client::stream_sse(ctl.proxy_addr, "/v1/completions", &body, &[("x-request-id", "seqs")], false)
                .await
                .unwrap();
            s.next_data(T).await.unwrap().unwrap();
            assert_eq!(ctl.state.inflight_sequences(), want, "{body}");
            drop(s);
            poll_until_async("ended", T, Duration::from_millis(20), || async {
                (ctl.state.inflight() == 0).then_some(())
            })
            .await
            .unwrap();
        }
        ctl.stop().await;
    })
    .await
    .unwrap();
}

/// A response whose length is in its head (a non-streaming completion, `GET /v1/models`)
/// is written by hyper without polling its body to its end: read to its end, it is still a
/// clean, complete end.
#[tokio::test]
async fn a_length_delimited_answer_read_to_its_end_is_a_clean_complete_end() {
    bounded("test", LIMIT, async {
        let sim = sim(slow_sim()).await;
        let ctl = control(&sim.url(), |c| {
            c.limits.reader_timeout = Some(Duration::from_secs(90));
        })
        .await;
        let ids = ["len-1", "len-2", "len-3"];
        for id in ids {
            let r = client::post_json(
                ctl.proxy_addr,
                "/v1/completions",
                &json!({"model":"tiny","prompt":"x","max_tokens":3}),
                &[("x-request-id", id)],
            )
            .await
            .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            assert!(r.header("content-length").is_some(), "not length-delimited");
            assert!(r.json().is_ok(), "{}", r.text());
        }
        let models = client::get(ctl.proxy_addr, "/v1/models").await.unwrap();
        assert_eq!(models.status, 200);
        assert!(models.header("content-length").is_some());
        let clean = "kvguard_control_request_ends_total{end=\"clean\",cause=\"complete\"}";
        poll_until_async("4 clean ends", T, Duration::from_millis(20), || async {
            (metric(ctl.admin_addr, clean).await == Some(4.0)).then_some(())
        })
        .await
        .unwrap();
        assert_eq!(
            metric(
                ctl.admin_addr,
                "kvguard_control_request_ends_total{end=\"unclean\",cause=\"client_gone\"}"
            )
            .await
            .unwrap_or(0.0),
            0.0,
            "read to its end, no client went"
        );
        assert_eq!(ctl.state.inflight(), 0, "each left the table");
        ctl.stop().await;
    })
    .await
    .unwrap();
}
