//! The simulator's KV pool, admission, disconnects, stalls, metrics and abort APIs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::client;
use kvguard_integration::proc::ChildGuard;
use kvguard_integration::sim::{self, EndKind, SeqState, SimConfig, SimState};
use kvguard_integration::{paths, wait::bounded};
use serde_json::json;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);
const W: Duration = Duration::from_secs(10);

fn body(max_tokens: u32) -> serde_json::Value {
    // "abcd" = 1 prompt token.
    json!({"prompt": "abcd", "stream": true, "max_tokens": max_tokens})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_queues_when_full_and_admits_when_blocks_free() {
    bounded("admission", T, async {
        // 4 blocks of 16 tokens; each request needs ceil((1 + 31) / 16) = 2 blocks.
        let sim = sim::spawn(SimConfig {
            kv_blocks: 4,
            block_size: 16,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let stall = [("x-sim-stall-after", "1"), ("x-sim-keepalive-ms", "0")];
        let mut a = client::stream_sse(
            sim.addr(),
            "/v1/completions",
            &body(31),
            &[("x-request-id", "a"), stall[0], stall[1]],
            false,
        )
        .await
        .unwrap();
        let b = client::stream_sse(
            sim.addr(),
            "/v1/completions",
            &body(31),
            &[("x-request-id", "b"), stall[0], stall[1]],
            true,
        )
        .await
        .unwrap();
        let mut c = client::stream_sse(
            sim.addr(),
            "/v1/completions",
            &body(31),
            &[("x-request-id", "c")],
            false,
        )
        .await
        .unwrap();
        let st = sim
            .wait_state("a, b running; c waiting", W, |s| {
                s.running.len() == 2 && s.waiting == ["c"]
            })
            .await
            .unwrap();
        assert_eq!(st.blocks_used, 4);
        assert_eq!(st.kv_usage(), 1.0);
        assert_eq!(st.request("c").unwrap().state, SeqState::Waiting);
        // The metrics say the same.
        let m = client::get(sim.addr(), "/metrics").await.unwrap().text();
        assert!(
            m.contains("vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 2.0"),
            "{m}"
        );
        assert!(
            m.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 1.0"),
            "{m}"
        );
        assert!(
            m.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny\"} 1.0"),
            "{m}"
        );
        // a got its one token and stalls; c gets nothing yet.
        assert!(a.next_data(W).await.unwrap().is_some());
        assert!(
            c.next_data(Duration::from_millis(300)).await.is_err(),
            "c must wait"
        );
        // b's client goes away (h2 connection closed): its blocks free, c is admitted.
        b.disconnect();
        let st = sim
            .wait_state("c admitted", W, |s| s.running.contains(&"c".to_string()))
            .await
            .unwrap();
        assert_eq!(st.request("b").unwrap().ended, Some(EndKind::Disconnected));
        assert_eq!(st.disconnected, 1);
        let events = c.collect(T).await.unwrap();
        assert!(events.last().unwrap().is_done());
        let st = sim
            .wait_state("c finished", W, |s| s.running == ["a"])
            .await
            .unwrap();
        assert_eq!(st.blocks_used, 2);
        assert_eq!(st.request("c").unwrap().ended, Some(EndKind::Length));
        drop(a);
        sim.wait_state("all free", W, |s| s.is_idle() && s.blocks_used == 0)
            .await
            .unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_frees_blocks_over_http1_and_h2() {
    bounded("disconnect", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 50.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        for (id, http2) in [("h1", false), ("h2", true)] {
            let mut s = client::stream_sse(
                sim.addr(),
                "/v1/completions",
                &body(1000),
                &[("x-request-id", id)],
                http2,
            )
            .await
            .unwrap();
            s.read_events(3, W).await.unwrap();
            assert!(sim.state().blocks_used > 0);
            s.disconnect();
            let st = sim
                .wait_state("blocks freed", W, |s| s.blocks_used == 0)
                .await
                .unwrap();
            let r = st.request(id).unwrap();
            assert_eq!(r.ended, Some(EndKind::Disconnected));
            assert!(r.client_gone);
            assert!(r.tokens_sent < 1000);
        }
        // An h2 stream reset (connection kept) also aborts.
        let s = client::stream_sse(
            sim.addr(),
            "/v1/completions",
            &body(1000),
            &[("x-request-id", "rst")],
            true,
        )
        .await
        .unwrap();
        let conn = s.reset_stream();
        let st = sim
            .wait_state("rst aborted", W, |s| {
                s.request("rst").is_some_and(|r| r.ended.is_some())
            })
            .await
            .unwrap();
        assert_eq!(
            st.request("rst").unwrap().ended,
            Some(EndKind::Disconnected)
        );
        conn.abort();
        // A silent client (queued bytes, never read) is not a disconnect.
        let silent = client::silent_client(
            sim.addr(),
            "/v1/completions",
            &body(40),
            &[("x-request-id", "quiet")],
            4096,
            true,
        )
        .await
        .unwrap();
        assert_eq!(silent.status(), Some(200));
        let st = sim
            .wait_state("quiet finished", W, |s| {
                s.request("quiet").is_some_and(|r| r.ended.is_some())
            })
            .await
            .unwrap();
        assert_eq!(st.request("quiet").unwrap().ended, Some(EndKind::Length));
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_abort_on_disconnect_keeps_the_sequence() {
    bounded("leaking engine", T, async {
        let sim = sim::spawn(SimConfig {
            abort_on_disconnect: false,
            token_rate: 100.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let mut s = client::stream_sse(
            sim.addr(),
            "/v1/completions",
            &body(300),
            &[("x-request-id", "gone")],
            false,
        )
        .await
        .unwrap();
        s.read_events(2, W).await.unwrap();
        s.disconnect();
        let st = sim
            .wait_state("client gone noticed", W, |s| s.clients_gone == 1)
            .await
            .unwrap();
        let r = st.request("gone").unwrap();
        assert_eq!(r.state, SeqState::Running, "still holds its blocks");
        assert!(st.blocks_used > 0);
        let st = sim
            .wait_state("finished anyway", W, |s| {
                s.request("gone").unwrap().ended.is_some()
            })
            .await
            .unwrap();
        let r = st.request("gone").unwrap();
        assert_eq!(r.ended, Some(EndKind::Length));
        assert_eq!(r.tokens_sent, 300);
        assert_eq!(st.disconnected, 0);
        // A stalled one with a gone client stays forever; only an abort API ends it.
        let mut s = client::stream_sse(
            sim.addr(),
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "stream": true}),
            &[("x-request-id", "stuck"), ("x-sim-stall-after", "2")],
            false,
        )
        .await
        .unwrap();
        s.read_events(3, W).await.unwrap();
        s.disconnect();
        sim.wait_state("stuck client gone", W, |s| s.clients_gone == 2)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await; // the leak must persist for a while
        assert_eq!(sim.state().running, ["stuck"]);
        let r = client::post_json(sim.addr(), "/abort_request", &json!({"rid": "stuck"}), &[])
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        let st = sim
            .wait_state("stuck aborted", W, |s| s.is_idle())
            .await
            .unwrap();
        assert_eq!(st.request("stuck").unwrap().ended, Some(EndKind::Aborted));
        assert_eq!(
            st.request("stuck").unwrap().aborted_by.as_deref(),
            Some("sglang")
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stall_header_sends_only_keepalives() {
    bounded("stall", T, async {
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        let mut s = client::stream_sse(
            sim.addr(),
            "/v1/completions",
            &body(100),
            &[
                ("x-request-id", "st"),
                ("x-sim-stall-after", "3"),
                ("x-sim-keepalive-ms", "50"),
            ],
            false,
        )
        .await
        .unwrap();
        let events = s.read_events(8, W).await.unwrap();
        assert!(events[..3].iter().all(|e| e.data.is_some()));
        for e in &events[3..] {
            assert!(e.comment && e.data.is_none(), "{e:?}");
            assert_eq!(e.raw, ": keep-alive");
        }
        let st = sim.state();
        let r = st.request("st").unwrap();
        assert_eq!(r.tokens_sent, 3);
        assert!(r.keepalives_sent >= 5);
        assert_eq!(r.state, SeqState::Running);
        // vLLM-style abort API with the engine id.
        let r = client::post_json(
            sim.addr(),
            "/inference/v1/abort_requests",
            &json!({"request_ids": ["cmpl-st", "cmpl-nope"]}),
            &[],
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.json().unwrap()["aborted"], json!(["st"]));
        // The aborted stream ends (no [DONE]).
        let rest = s.collect(W).await.unwrap();
        assert!(rest.iter().all(|e| !e.is_done()));
        let st = sim.state();
        assert_eq!(st.aborted, 1);
        assert_eq!(st.abort_calls.len(), 1);
        assert_eq!(st.abort_calls[0].api, "vllm");
        assert_eq!(st.abort_calls[0].ended, ["st"]);
        // Server-wide keep-alives also flow while a request waits for its first token.
        let sim2 = sim::spawn(SimConfig {
            keepalive_ms: 30,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let mut s = client::stream_sse(
            sim2.addr(),
            "/v1/completions",
            &body(2),
            &[("x-sim-delay-first-ms", "200")],
            false,
        )
        .await
        .unwrap();
        let events = s.collect(W).await.unwrap();
        assert!(events[0].comment, "{events:?}");
        assert!(events.last().unwrap().is_done());
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_use_vllm_names_and_count_outcomes() {
    bounded("metrics", T, async {
        let sim = sim::spawn(SimConfig { model: "m1".into(), ..SimConfig::default() }).await.unwrap();
        let fixture = std::fs::read_to_string(paths::fixture("vllm-0.32-metrics.txt").unwrap()).unwrap();
        client::post_json(sim.addr(), "/v1/completions", &json!({"prompt": "x", "max_tokens": 2}), &[]).await.unwrap();
        let r = client::get(sim.addr(), "/metrics").await.unwrap();
        assert_eq!(r.status, 200);
        let text = r.text();
        for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:request_success_total", "vllm:generation_tokens_total", "process_start_time_seconds"] {
            assert!(fixture.contains(&format!("# TYPE {name} ")), "fixture lacks {name}");
            let fx_type = fixture.lines().find(|l| l.starts_with(&format!("# TYPE {name} "))).unwrap();
            assert!(text.contains(fx_type), "{name}: {fx_type} missing in\n{text}");
        }
        assert!(text.contains("vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m1\"} 1.0"), "{text}");
        assert!(text.contains("vllm:request_success_total{engine=\"0\",finished_reason=\"abort\",model_name=\"m1\"} 0.0"));
        // Every generated token, as vLLM counts them (2 of 1 request so far), and the
        // start time as vLLM's Python client exports its process's.
        assert!(text.contains("\nvllm:generation_tokens_total{engine=\"0\",model_name=\"m1\"} 2.0\n"), "{text}");
        let start: f64 = text.lines().find_map(|l| l.strip_prefix("process_start_time_seconds ")).unwrap().parse().unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        assert!(start <= now && now - start < 60.0, "start {start}, now {now}");
        assert_eq!(client::get(sim.addr(), "/health").await.unwrap().status, 200);
        let state: SimState = serde_json::from_value(client::get_json(sim.addr(), "/sim/state").await.unwrap()).unwrap();
        assert_eq!(state.finished, 1);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_sim_binary_reports_its_address_and_serves() {
    bounded("engine-sim binary", T, async {
        let bin = paths::engine_sim_bin().unwrap();
        let (mut guard, addr) = ChildGuard::spawn_with_addr_file(
            "engine-sim",
            &bin,
            ["--kv-blocks", "8", "--no-abort-on-disconnect"],
            &[],
            W,
        )
        .await
        .unwrap();
        guard.wait_for_log("listening on", W).await.unwrap();
        let mut s = client::stream_sse(
            addr,
            "/v1/completions",
            &body(3),
            &[("x-request-id", "bin")],
            false,
        )
        .await
        .unwrap();
        assert!(s.collect(W).await.unwrap().last().unwrap().is_done());
        let state: SimState =
            serde_json::from_value(client::get_json(addr, "/sim/state").await.unwrap()).unwrap();
        assert_eq!(state.blocks_total, 8);
        assert_eq!(state.request("bin").unwrap().ended, Some(EndKind::Length));
        let (status, graceful) = guard.terminate(W).unwrap();
        assert!(graceful && status.success(), "{status}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_resets_and_error_statuses() {
    bounded("resets and statuses", T, async {
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        for (id, http2) in [("r1", false), ("r2", true)] {
            let mut s = client::stream_sse(
                sim.addr(),
                "/v1/completions",
                &body(50),
                &[("x-request-id", id), ("x-sim-reset-after", "2")],
                http2,
            )
            .await
            .unwrap();
            // The engine resets after 2 token steps. The client sees at most those 2 events,
            // then an error: the last ones can be lost with the connection when hyper polls
            // the reset before it flushed them (seen on a loaded machine: 1 event).
            let mut events = 0;
            let end = loop {
                match s.next_data(W).await {
                    Ok(Some(_)) => events += 1,
                    other => break other,
                }
            };
            assert!(end.is_err(), "{id}: a reset, not a clean end: {end:?}");
            assert!(
                events <= 2,
                "{id}: {events} events before a reset after 2 steps"
            );
        }
        let r = client::post_json(
            sim.addr(),
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 5}),
            &[("x-request-id", "r3"), ("x-sim-reset-after", "1")],
        )
        .await;
        assert!(
            r.is_err(),
            "non-streaming reset closes the connection: {r:?}"
        );
        let st = sim
            .wait_state("three resets", W, |s| s.resets == 3)
            .await
            .unwrap();
        for id in ["r1", "r2"] {
            let rec = st.request(id).unwrap();
            assert_eq!(rec.ended, Some(EndKind::Reset), "{id}: {rec:?}");
            assert_eq!(
                rec.tokens_sent, 2,
                "{id}: reset after 2 token steps: {rec:?}"
            );
        }
        assert_eq!(st.blocks_used, 0);
        let r = client::post_json(
            sim.addr(),
            "/v1/chat/completions",
            &json!({}),
            &[("x-sim-status", "503")],
        )
        .await
        .unwrap();
        assert_eq!(r.status, 503);
        assert_eq!(r.json().unwrap()["error"]["code"], 503);
        let m = sim.metrics_text();
        assert!(
            m.contains("finished_reason=\"error\",model_name=\"tiny\"} 3.0"),
            "{m}"
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_client_gone_is_aborted_too() {
    bounded("non-streaming disconnect", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 10.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        for (id, http2) in [("ns1", false), ("ns2", true)] {
            let addr = sim.addr();
            let req = tokio::spawn(async move {
                let body = serde_json::to_vec(&json!({"prompt": "x", "max_tokens": 100})).unwrap();
                client::request(
                    addr,
                    hyper::Method::POST,
                    "/v1/completions",
                    &[("x-request-id", id)],
                    body,
                    http2,
                    T,
                )
                .await
            });
            sim.wait_state("a token generated", W, |s| {
                s.request(id).is_some_and(|r| r.tokens_sent > 0)
            })
            .await
            .unwrap();
            req.abort(); // the client goes away while the engine generates
            let st = sim.wait_state("aborted", W, |s| s.is_idle()).await.unwrap();
            assert_eq!(st.request(id).unwrap().ended, Some(EndKind::Disconnected));
        }
    })
    .await
    .unwrap();
}

/// `GET /v1/models` as vLLM lists LoRA adapters (`parent` = the base model), with
/// adapters loaded at start and loaded/unloaded at run time through vLLM's endpoints,
/// in process and through the `engine-sim` binary's `--lora-adapter`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_adapters_are_listed_loaded_and_unloaded() {
    bounded("lora adapters", T, async {
        fn listed(v: &serde_json::Value) -> (Vec<String>, Vec<String>) {
            let data = v["data"].as_array().unwrap();
            let name = |m: &serde_json::Value| m["id"].as_str().unwrap().to_string();
            let base = data
                .iter()
                .filter(|m| m["parent"].is_null())
                .map(name)
                .collect();
            let adapters = data
                .iter()
                .filter(|m| !m["parent"].is_null())
                .map(|m| {
                    assert_eq!(m["parent"], "m1", "{m}");
                    name(m)
                })
                .collect();
            (base, adapters)
        }
        let sim = sim::spawn(SimConfig {
            model: "m1".into(),
            lora_adapters: vec!["sql".into(), "chat".into()],
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let a = sim.addr();
        let models = || async move { listed(&client::get_json(a, "/v1/models").await.unwrap()) };
        assert_eq!(
            models().await,
            (
                vec!["m1".to_string()],
                vec!["sql".to_string(), "chat".to_string()]
            )
        );
        let load = |n: &'static str| async move {
            client::post_json(
                a,
                "/v1/load_lora_adapter",
                &json!({"lora_name": n, "lora_path": "/x"}),
                &[],
            )
            .await
            .unwrap()
        };
        let unload = |n: &'static str| async move {
            client::post_json(a, "/v1/unload_lora_adapter", &json!({"lora_name": n}), &[])
                .await
                .unwrap()
        };
        let r = load("new").await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.text().contains("added successfully"), "{}", r.text());
        assert_eq!(load("new").await.status, 400, "loaded twice");
        assert_eq!(models().await.1, ["sql", "chat", "new"]);
        assert_eq!(unload("sql").await.status, 200);
        assert_eq!(unload("sql").await.status, 404, "unloaded twice");
        assert_eq!(models().await.1, ["chat", "new"]);
        let r = client::post_json(a, "/v1/load_lora_adapter", &json!({}), &[])
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{}", r.text());

        let (mut guard, addr) = ChildGuard::spawn_with_addr_file(
            "engine-sim",
            &paths::engine_sim_bin().unwrap(),
            [
                "--model",
                "m1",
                "--lora-adapter",
                "a1",
                "--lora-adapter",
                "a2",
            ],
            &[],
            W,
        )
        .await
        .unwrap();
        assert_eq!(
            listed(&client::get_json(addr, "/v1/models").await.unwrap()).1,
            ["a1", "a2"]
        );
        let (status, graceful) = guard.terminate(W).unwrap();
        assert!(graceful && status.success(), "{status}");
    })
    .await
    .unwrap();
}
