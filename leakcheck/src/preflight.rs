//! Checks before any load: both endpoints answer, the engine exports the names leakcheck
//! reads, the model exists, the target answers a request and a stream, and the engine
//! behind `--engine-metrics` is the one the target routes to (with `--prefill-metrics`:
//! the prefill engine exports KV usage and counted the probes' prefill legs too). Each
//! failure is a
//! [`Fail`]: an exit code and a message that names the fix. Every step is bounded.

use crate::cli::{Api, Args, Exit};
use crate::engine::{self, Endpoint, EndpointError};
use kvguard_control::expo::EngineFlavour;
use kvguard_loadgen::client;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// A check that failed.
#[derive(Debug)]
pub struct Fail {
    /// Exit code.
    pub exit: Exit,
    /// What is wrong and what to do.
    pub message: String,
}

fn fail(exit: Exit, message: impl Into<String>) -> Fail {
    Fail {
        exit,
        message: message.into(),
    }
}

/// What the checks established.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Ready {
    /// Where requests go.
    #[serde(skip)]
    pub target: Endpoint,
    /// Where the engine's metrics are read.
    #[serde(skip)]
    pub metrics: Endpoint,
    /// The request path (`<prefix>/v1/chat/completions`).
    pub path: String,
    /// The model asked for.
    pub model: String,
    /// Whose metric names the engine exports.
    pub flavour: EngineFlavour,
    /// The probe stream: time to the first event (s).
    pub probe_ttft_s: f64,
    /// The probe stream: seconds per data event (whole stream time / events).
    pub probe_s_per_event: f64,
    /// The probe stream: seconds per data event after the first (`None`: one event).
    pub probe_gap_s_per_event: Option<f64>,
    /// The probe stream: data events read.
    pub probe_events: u64,
    /// Whether the engine counted the probes (`vllm:request_success_total` rose); `None`:
    /// the engine does not export that counter, so the routing could not be confirmed.
    pub routing_confirmed: Option<bool>,
    /// Notes for the report (what could not be checked).
    pub notes: Vec<String>,
    /// Prefill/decode disaggregation: the prefill engine (`--prefill-metrics`).
    pub prefill: Option<PrefillReady>,
}

/// The prefill engine of a P/D pair, as the checks found it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PrefillReady {
    /// Where its metrics are read.
    #[serde(skip)]
    pub metrics: Endpoint,
    /// Whose metric names it exports.
    pub flavour: EngineFlavour,
    /// Whether it counted the probes' prefill legs; `None`: it exports no finished-request
    /// counter.
    pub routing_confirmed: Option<bool>,
    /// KV blocks in its pool (`vllm:cache_config_info`), when exported.
    pub num_blocks: Option<f64>,
}

impl Ready {
    /// The estimated natural length of one request (s): `max_tokens` events at the probe's
    /// pace. With P/D the time to the first token holds the prefill leg and the hand-off,
    /// so the whole stream's pace would overstate a request's length (and the clients
    /// planned to leave part-way would finish first): the pace after the first event is
    /// used (the P/D proxies in front of these engines stream events as they come).
    pub fn natural_estimate_s(&self, max_tokens: u32) -> f64 {
        let pace = match (&self.prefill, self.probe_gap_s_per_event) {
            (Some(_), Some(gap)) => gap,
            _ => self.probe_s_per_event,
        };
        self.probe_ttft_s + f64::from(max_tokens) * pace
    }
}

/// The request body for `api`.
pub fn body(
    api: Api,
    model: &str,
    stream: bool,
    max_tokens: u32,
    text: &str,
    extra: &Value,
) -> Value {
    let mut b = match api {
        Api::Chat => json!({"model": model, "messages": [{"role": "user", "content": text}],
                            "stream": stream, "max_tokens": max_tokens}),
        Api::Completions => {
            json!({"model": model, "prompt": text, "stream": stream, "max_tokens": max_tokens})
        }
    };
    if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    b
}

/// The path of `api` under the target's prefix.
pub fn api_path(prefix: &str, api: Api) -> String {
    match api {
        Api::Chat => format!("{prefix}/v1/chat/completions"),
        Api::Completions => format!("{prefix}/v1/completions"),
    }
}

fn looks_like_missing_model(status: u16, body: &str) -> bool {
    let b = body.to_ascii_lowercase();
    // A 404 alone may be a wrong path; vLLM's says "The model `x` does not exist."
    (400..500).contains(&status)
        && b.contains("model")
        && [
            "does not exist",
            "not found",
            "invalid model",
            "no such model",
            "unknown model",
        ]
        .iter()
        .any(|p| b.contains(p))
}

fn status_fix(status: u16) -> &'static str {
    match status {
        401 | 403 => "pass the gateway's credentials, e.g. --header 'Authorization: Bearer <key>'",
        404 | 405 => "check --target: it must be the OpenAI-compatible base URL (requests go to <target>/v1/...)",
        429 => "the gateway rate-limits this client: allow it, or lower --rate",
        500..=599 => "the gateway or the engine behind it is failing: check that it serves requests at all",
        _ => "check that --target is an OpenAI-compatible gateway and the request it rejects above",
    }
}

/// Runs the checks.
pub async fn run(args: &Args) -> Result<Ready, Fail> {
    let t = args.request_timeout;
    let target = Endpoint::resolve(&args.target).await.map_err(|e| match e {
        EndpointError::Bad(m) => fail(Exit::BadFlags, format!("--target {m}")),
        EndpointError::Unreachable(m) => fail(Exit::TargetUnreachable, format!("--target {m}")),
    })?;
    let metrics = Endpoint::resolve(&args.engine_metrics)
        .await
        .map_err(|e| match e {
            EndpointError::Bad(m) => fail(Exit::BadFlags, format!("--engine-metrics {m}")),
            EndpointError::Unreachable(m) => {
                fail(Exit::EngineMetrics, format!("--engine-metrics {m}"))
            }
        })?;
    let metrics_fix =
        "pass the engine's own /metrics (vLLM and SGLang serve it on their API port, \
                       e.g. --engine-metrics http://engine:8000/metrics), not the gateway's";
    let (before, flavour) = engine::scrape(&metrics, Duration::from_secs(5).min(t))
        .await
        .map_err(|e| {
            fail(
                Exit::EngineMetrics,
                format!("--engine-metrics: {e:#}; {metrics_fix}"),
            )
        })?;
    let prefill_fix = "pass the prefill engine's own /metrics (vLLM serves it on its API port, \
                       e.g. --prefill-metrics http://prefill:8000/metrics)";
    let prefill_before = match &args.prefill_metrics {
        None => None,
        Some(url) => {
            let ep = Endpoint::resolve(url).await.map_err(|e| match e {
                EndpointError::Bad(m) => fail(Exit::BadFlags, format!("--prefill-metrics {m}")),
                EndpointError::Unreachable(m) => {
                    fail(Exit::EngineMetrics, format!("--prefill-metrics {m}"))
                }
            })?;
            let (s, flavour) = engine::scrape(&ep, Duration::from_secs(5).min(t))
                .await
                .map_err(|e| {
                    fail(
                        Exit::EngineMetrics,
                        format!("--prefill-metrics: {e:#}; {prefill_fix}"),
                    )
                })?;
            if s.kv.is_none() {
                return Err(fail(
                    Exit::EngineMetrics,
                    format!(
                        "--prefill-metrics {url}: no KV usage (vllm:kv_cache_usage_perc, \
                         sglang:token_usage): the prefill-side check reads the blocks it holds; {prefill_fix}"
                    ),
                ));
            }
            Some((ep, s, flavour))
        }
    };
    let mut notes = Vec::new();
    if before.kv.is_none() {
        notes.push(
            "the engine exports no KV usage (vllm:kv_cache_usage_perc, sglang:token_usage): KV checks skipped"
                .to_string(),
        );
    }
    let host = ("host".to_string(), target.authority.clone());
    let headers: Vec<(String, String)> = std::iter::once(host)
        .chain(args.headers.iter().filter(|(k, _)| k != "host").cloned())
        .collect();
    let hdrs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();

    let connect_fail = |e: anyhow::Error| {
        let text = format!("{e:#}");
        let fix = if text.contains("within") && !text.contains("connecting") {
            "it accepted the connection but did not answer in time: a gateway that hangs, or an \
             engine still loading (raise --request-timeout if it is only slow)"
        } else {
            "is the gateway running and reachable from here?"
        };
        fail(
            Exit::TargetUnreachable,
            format!("--target {}: {text}; {fix}", args.target),
        )
    };
    let model = match &args.model {
        Some(m) => m.clone(),
        None => {
            let path = format!("{}/v1/models", target.path);
            let r = client::request(
                target.addr,
                hyper::Method::GET,
                &path,
                &hdrs,
                bytes::Bytes::new(),
                false,
                t,
            )
            .await
            .map_err(connect_fail)?;
            if r.status != 200 {
                return Err(fail(
                    Exit::TargetErrors,
                    format!(
                        "GET {path} answered {}: {}; pass --model, or {}",
                        r.status,
                        engine::snippet(&r.text()),
                        status_fix(r.status)
                    ),
                ));
            }
            let ids: Vec<String> = r
                .json()
                .ok()
                .and_then(|v| v["data"].as_array().cloned())
                .unwrap_or_default()
                .iter()
                .filter_map(|m| m["id"].as_str().map(String::from))
                .collect();
            match ids.as_slice() {
                [one] => one.clone(),
                [] => {
                    return Err(fail(
                        Exit::BadFlags,
                        format!("GET {path} lists no model: pass --model"),
                    ))
                }
                many => {
                    return Err(fail(
                        Exit::BadFlags,
                        format!(
                            "the target serves several models ({}): pass --model",
                            many.join(", ")
                        ),
                    ))
                }
            }
        }
    };
    let extra: Value = args
        .extra_body
        .as_deref()
        .and_then(|e| serde_json::from_str(e).ok())
        .unwrap_or(Value::Null);
    let path = api_path(&target.path, args.api);

    // One non-streaming request: the model, the credentials, the route.
    let probe = body(
        args.api,
        &model,
        false,
        1,
        "kvguard-leakcheck probe",
        &extra,
    );
    let bytes = serde_json::to_vec(&probe).map_err(|e| fail(Exit::BadFlags, e.to_string()))?;
    let r = client::request(
        target.addr,
        hyper::Method::POST,
        &path,
        &hdrs,
        bytes,
        false,
        t,
    )
    .await
    .map_err(connect_fail)?;
    let text = r.text();
    if r.status != 200 {
        if looks_like_missing_model(r.status, &text) {
            return Err(fail(
                Exit::ModelNotFound,
                format!(
                    "model {model:?} does not exist at {} ({} {}); pass --model with a model the \
                     gateway serves (GET {}/v1/models lists them)",
                    args.target,
                    r.status,
                    engine::snippet(&text),
                    target.path
                ),
            ));
        }
        return Err(fail(
            Exit::TargetErrors,
            format!(
                "POST {path} answered {}: {}; {}",
                r.status,
                engine::snippet(&text),
                status_fix(r.status)
            ),
        ));
    }
    if r.json()
        .ok()
        .and_then(|v| v["choices"].as_array().cloned())
        .is_none()
    {
        return Err(fail(
            Exit::TargetErrors,
            format!(
                "POST {path} answered 200 without `choices`: {}; --target must be an \
                 OpenAI-compatible gateway",
                engine::snippet(&text)
            ),
        ));
    }

    // One stream: SSE passes, and its pace (how long a request of --max-tokens lasts).
    let n = args.max_tokens.min(16);
    let sb = body(
        args.api,
        &model,
        true,
        n,
        "kvguard-leakcheck probe stream",
        &extra,
    );
    let t0 = Instant::now();
    let mut s = client::stream_sse(target.addr, &path, &sb, &hdrs, false)
        .await
        .map_err(connect_fail)?;
    if s.status != 200 {
        let b = s
            .collect_bytes(Duration::from_secs(5))
            .await
            .unwrap_or_default();
        return Err(fail(
            Exit::TargetErrors,
            format!(
                "streaming POST {path} answered {}: {}; {}",
                s.status,
                engine::snippet(&String::from_utf8_lossy(&b)),
                status_fix(s.status)
            ),
        ));
    }
    let (mut first, mut last, mut events, mut done) = (None, None, 0u64, false);
    let deadline = tokio::time::Instant::now() + t;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match s.next_data(left).await {
            Ok(Some(ev)) if ev.is_done() => {
                done = true;
                break;
            }
            Ok(Some(_)) => {
                let now = Instant::now();
                first.get_or_insert(now);
                last = Some(now);
                events += 1;
            }
            Ok(None) => break,
            Err(e) => {
                return Err(fail(
                    Exit::TargetErrors,
                    format!("the probe stream through {path} failed: {e:#}; the gateway must pass SSE streams"),
                ))
            }
        }
    }
    if !done || events == 0 {
        return Err(fail(
            Exit::TargetErrors,
            format!(
                "the probe stream through {path} ended without `data: [DONE]` ({events} events); \
                 the gateway must pass OpenAI SSE streams"
            ),
        ));
    }
    let (Some(first), Some(last)) = (first, last) else {
        return Err(fail(Exit::TargetErrors, "the probe stream had no data"));
    };
    let ttft = (first - t0).as_secs_f64();
    // The whole stream's time over its events, not the gaps between them: a hop that
    // buffers (LiteLLM) delivers events in bursts, and the gaps would understate the pace.
    let per_event = (last - t0).as_secs_f64() / events as f64;
    let gap_per_event = (events > 1).then(|| (last - first).as_secs_f64() / (events - 1) as f64);

    // The engine counted the two probes: the target routes to this engine (and, with
    // --prefill-metrics, the prefill engine counted their prefill legs).
    let until = Instant::now() + Duration::from_secs(5);
    let routing_confirmed = match before.finished {
        None => {
            notes.push(
                "the engine exports no finished-request counter (vllm:request_success_total): \
                 could not confirm that --target routes to the engine behind --engine-metrics"
                    .to_string(),
            );
            None
        }
        Some(b) => {
            if !counted(&metrics, b, until).await {
                return Err(fail(
                    Exit::EngineMetrics,
                    format!(
                        "the engine behind --engine-metrics {} did not count the two probe requests \
                         sent to --target {}: the target routes elsewhere (or to several replicas); \
                         point both at one dedicated replica",
                        args.engine_metrics, args.target
                    ),
                ));
            }
            Some(true)
        }
    };
    let prefill = match prefill_before {
        None => None,
        Some((ep, pb, flavour)) => {
            let confirmed = match pb.finished {
                None => {
                    notes.push(
                        "the prefill engine exports no finished-request counter \
                         (vllm:request_success_total): could not confirm that --target sends \
                         prefill legs to the engine behind --prefill-metrics"
                            .to_string(),
                    );
                    None
                }
                Some(b) => {
                    if !counted(&ep, b, until).await {
                        return Err(fail(
                            Exit::EngineMetrics,
                            format!(
                                "the prefill engine behind --prefill-metrics {} did not count the \
                                 prefill legs of the two probe requests sent to --target {}: the \
                                 target is not a P/D proxy over this prefill engine (or spreads \
                                 prefills over several); point both at one dedicated P/D pair",
                                ep.url, args.target
                            ),
                        ));
                    }
                    Some(true)
                }
            };
            if pb.num_blocks.is_none() {
                notes.push(
                    "the prefill engine exports no block count (vllm:cache_config_info \
                     num_gpu_blocks): its held KV is reported as a share of its pool, not in blocks"
                        .to_string(),
                );
            }
            Some(PrefillReady {
                metrics: ep,
                flavour,
                routing_confirmed: confirmed,
                num_blocks: pb.num_blocks,
            })
        }
    };
    Ok(Ready {
        target,
        metrics,
        path,
        model,
        flavour,
        probe_ttft_s: ttft,
        probe_s_per_event: per_event,
        probe_gap_s_per_event: gap_per_event,
        probe_events: events,
        routing_confirmed,
        notes,
        prefill,
    })
}

/// Whether the finished-request counter at `ep` rose by two from `before` by `until`
/// (polled every 200 ms; a failed read is retried).
async fn counted(ep: &Endpoint, before: f64, until: Instant) -> bool {
    loop {
        if let Ok((now, _)) = engine::scrape(ep, Duration::from_secs(5)).await {
            if now.finished.unwrap_or(before) >= before + 2.0 {
                return true;
            }
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_model_answers() {
        // vLLM 0.32.
        assert!(looks_like_missing_model(
            404,
            r#"{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","code":404}}"#
        ));
        // LiteLLM.
        assert!(looks_like_missing_model(
            400,
            r#"{"error":{"message":"Invalid model name passed in model=x. Call `/v1/models` to view available models for your key."}}"#
        ));
        assert!(!looks_like_missing_model(
            400,
            r#"{"error":{"message":"max_tokens too large"}}"#
        ));
        // A wrong path, not a missing model.
        assert!(!looks_like_missing_model(404, "404 page not found"));
    }

    #[test]
    fn natural_length_with_pd_leaves_the_hand_off_out_of_the_pace() {
        let ep = Endpoint {
            url: "http://127.0.0.1:1".into(),
            addr: "127.0.0.1:1".parse().unwrap(),
            authority: "127.0.0.1:1".into(),
            path: String::new(),
        };
        let mut r = Ready {
            target: ep.clone(),
            metrics: ep.clone(),
            path: String::new(),
            model: "m".into(),
            flavour: EngineFlavour::Vllm,
            probe_ttft_s: 1.0,
            probe_s_per_event: 0.1,
            probe_gap_s_per_event: Some(0.02),
            probe_events: 16,
            routing_confirmed: Some(true),
            notes: Vec::new(),
            prefill: None,
        };
        assert!((r.natural_estimate_s(100) - 11.0).abs() < 1e-9);
        r.prefill = Some(PrefillReady {
            metrics: ep,
            flavour: EngineFlavour::Vllm,
            routing_confirmed: Some(true),
            num_blocks: None,
        });
        assert!((r.natural_estimate_s(100) - 3.0).abs() < 1e-9);
        r.probe_gap_s_per_event = None;
        assert!((r.natural_estimate_s(100) - 11.0).abs() < 1e-9);
    }

    #[test]
    fn bodies_merge_extra() {
        let b = body(Api::Chat, "m", true, 5, "hi", &json!({"ignore_eos": true}));
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["messages"][0]["content"], "hi");
        let b = body(Api::Completions, "m", false, 5, "hi", &Value::Null);
        assert_eq!(b["prompt"], "hi");
        assert_eq!(api_path("/gw", Api::Completions), "/gw/v1/completions");
    }
}
