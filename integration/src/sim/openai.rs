//! The simulator's HTTP side: routing, the OpenAI API in vLLM's framing, abort APIs.

use super::engine::{Sim, Ticket};
use super::pd::{self, PullDuty};
use super::{EndKind, PdRole, RequestRecord, SeqState};
use crate::http::{bytes_response, full, json_response, read_body, ChannelBody, RespBody};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Request, Response};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio::time::{sleep_until, Instant};

const MAX_BODY: usize = 4 << 20;
const FINGERPRINT: &str = "vllm-0.32.0-kvguard-sim";

/// Answers one request. `Err` closes the connection without an answer (a simulated
/// engine reset of a non-streaming request).
pub(crate) async fn handle(
    sim: Arc<Sim>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, std::io::Error> {
    let path = req.uri().path().to_string();
    Ok(match (req.method().clone(), path.as_str()) {
        (Method::POST, "/v1/completions") => return completion(sim, req, Kind::Completion).await,
        (Method::POST, "/v1/chat/completions") => return completion(sim, req, Kind::Chat).await,
        (Method::GET, "/health") => bytes_response(200, "text/plain", ""),
        (Method::GET, "/metrics") => bytes_response(
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            sim.metrics_text(),
        ),
        (Method::GET, "/sim/state") => json_response(
            200,
            &serde_json::to_value(sim.state()).unwrap_or(Value::Null),
        ),
        (Method::GET, "/v1/models") => json_response(200, &models(&sim)),
        (Method::POST, "/sim/kv/notify") => pd::notify_endpoint(&sim, req).await,
        (Method::POST, "/sim/kv/heartbeat") => pd::heartbeat_endpoint(&sim, req).await,
        (Method::POST, "/v1/load_lora_adapter") => {
            let Some(name) = lora_name(req).await else {
                return Ok(error(
                    400,
                    "missing \"lora_name\"",
                    "BadRequestError",
                    Some("lora_name"),
                ));
            };
            if !sim.load_lora(&name) {
                return Ok(error(
                    400,
                    &format!("The lora adapter '{name}' has already been loaded."),
                    "InvalidUserInput",
                    None,
                ));
            }
            bytes_response(
                200,
                "text/plain; charset=utf-8",
                format!("Success: LoRA adapter '{name}' added successfully."),
            )
        }
        (Method::POST, "/v1/unload_lora_adapter") => {
            let Some(name) = lora_name(req).await else {
                return Ok(error(
                    400,
                    "missing \"lora_name\"",
                    "BadRequestError",
                    Some("lora_name"),
                ));
            };
            if !sim.unload_lora(&name) {
                return Ok(error(
                    404,
                    &format!("The lora adapter '{name}' cannot be found."),
                    "NotFoundError",
                    None,
                ));
            }
            bytes_response(
                200,
                "text/plain; charset=utf-8",
                format!("Success: LoRA adapter '{name}' removed successfully."),
            )
        }
        (Method::POST, "/abort_request") => {
            let body = read_body(req.into_body(), MAX_BODY)
                .await
                .unwrap_or_default();
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let Some(rid) = v.get("rid").and_then(Value::as_str) else {
                return Ok(error(
                    400,
                    "missing \"rid\"",
                    "BadRequestError",
                    Some("rid"),
                ));
            };
            let ended = sim.abort_ids("sglang", &[rid.to_string()]);
            json_response(200, &json!({"success": true, "aborted": ended}))
        }
        (Method::POST, "/inference/v1/abort_requests") => {
            let body = read_body(req.into_body(), MAX_BODY)
                .await
                .unwrap_or_default();
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let Some(ids) = v.get("request_ids").and_then(Value::as_array) else {
                return Ok(error(
                    400,
                    "missing \"request_ids\"",
                    "BadRequestError",
                    Some("request_ids"),
                ));
            };
            let ids: Vec<String> = ids
                .iter()
                .filter_map(|i| i.as_str().map(str::to_string))
                .collect();
            let ended = sim.abort_ids("vllm", &ids);
            json_response(200, &json!({"aborted": ended}))
        }
        _ => json_response(404, &json!({"detail": "Not Found"})),
    })
}

/// `GET /v1/models` as vLLM answers it: the base model (`parent: null`), then each loaded
/// LoRA adapter with the base model as its `parent`.
fn models(sim: &Sim) -> Value {
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let model = |id: &str, root: &str, parent: Value| {
        json!({"id": id, "object": "model", "created": created, "owned_by": "vllm",
               "root": root, "parent": parent, "max_model_len": sim.cfg.max_model_len})
    };
    let mut data = vec![model(&sim.cfg.model, &sim.cfg.model, Value::Null)];
    for a in sim.lora_adapters() {
        data.push(model(&a, &format!("/sim/lora/{a}"), json!(sim.cfg.model)));
    }
    json!({"object": "list", "data": data})
}

/// The `lora_name` of a load/unload body.
async fn lora_name(req: Request<Incoming>) -> Option<String> {
    let body = read_body(req.into_body(), MAX_BODY).await.ok()?;
    let v: Value = serde_json::from_slice(&body).ok()?;
    v.get("lora_name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
}

/// [`error`] as an early return of a handler.
fn err_reply(
    status: u16,
    message: &str,
    typ: &str,
    param: Option<&str>,
) -> Result<Response<RespBody>, std::io::Error> {
    Ok(error(status, message, typ, param))
}

/// A vLLM-shaped error body (field order as in `vllm-0.32-chat-400.json`).
fn error(status: u16, message: &str, typ: &str, param: Option<&str>) -> Response<RespBody> {
    let msg = serde_json::to_string(message).unwrap_or_default();
    let param = param
        .map(|p| serde_json::to_string(p).unwrap_or_default())
        .unwrap_or_else(|| "null".into());
    bytes_response(
        status,
        "application/json",
        format!(
            "{{\"error\":{{\"message\":{msg},\"type\":\"{typ}\",\"param\":{param},\"code\":{status}}}}}"
        ),
    )
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Everything a sequence needs, parsed from the request.
struct Params {
    kind: Kind,
    model: String,
    stream: bool,
    include_usage: bool,
    n: u32,
    prompt_tokens: u32,
    max_tokens: u32,
    /// Tokens per choice to generate.
    length: u32,
    stall_after: Option<u32>,
    reset_after: Option<u32>,
    delay_first: Duration,
    rate: f64,
    keepalive: Option<Duration>,
    engine_id: String,
    created: u64,
    /// Prefill role: the `kv_transfer_params` its answer carries (blocks held for the
    /// decode side).
    kv_out: Option<Value>,
    /// Decode role: the prefill replica to read from and notify.
    pull: PullDuty,
}

fn header<'a, B>(req: &'a Request<B>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

fn header_num<T: std::str::FromStr>(req: &Request<()>, name: &str) -> Result<Option<T>, String> {
    match header(req, name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| format!("bad {name} header: {v:?}")),
    }
}

fn generate_id() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "sim-{:x}-{:x}-{}",
        std::process::id(),
        nanos & 0xffff_ffff_ffff,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn text_tokens(bytes: usize) -> u32 {
    u32::try_from(bytes / 4).unwrap_or(u32::MAX).max(1)
}

async fn completion(
    sim: Arc<Sim>,
    req: Request<Incoming>,
    kind: Kind,
) -> Result<Response<RespBody>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = read_body(body, MAX_BODY).await;
    // Decode role: from here the prefill replica named in the body is owed a notification,
    // also when this request is refused (the duty notifies when dropped).
    let remote = match (&body, sim.cfg.pd_role) {
        (Ok(b), PdRole::Decode) => serde_json::from_slice::<Value>(b)
            .ok()
            .and_then(|v| pd::remote_prefill(&v)),
        _ => None,
    };
    let duty = PullDuty::new(remote);
    completion_inner(sim, Request::from_parts(parts, ()), body, kind, duty).await
}

async fn completion_inner(
    sim: Arc<Sim>,
    req: Request<()>,
    body: Result<Bytes, String>,
    kind: Kind,
    pull: PullDuty,
) -> Result<Response<RespBody>, std::io::Error> {
    let cfg = &sim.cfg;
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in req.headers() {
        let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
        headers
            .entry(k.as_str().to_string())
            .and_modify(|e| {
                e.push_str(", ");
                e.push_str(&v);
            })
            .or_insert(v);
    }
    let request_id = header(&req, "x-request-id")
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .unwrap_or_else(generate_id);
    let hdr = (|| -> Result<_, String> {
        Ok((
            header_num::<u32>(&req, "x-sim-stall-after")?,
            header_num::<u64>(&req, "x-sim-delay-first-ms")?,
            header_num::<u32>(&req, "x-sim-tokens")?,
            header_num::<f64>(&req, "x-sim-rate")?,
            header_num::<u64>(&req, "x-sim-keepalive-ms")?,
            header_num::<u32>(&req, "x-sim-reset-after")?,
            header_num::<u16>(&req, "x-sim-status")?,
        ))
    })();
    let (stall_after, delay_first, forced, rate, ka, reset_after, status) = match hdr {
        Ok(h) => h,
        Err(e) => return err_reply(400, &e, "BadRequestError", None),
    };
    // `x-sim-first-attempts: k`: the fault headers (stall, first-token delay, reset,
    // status) apply to the first k arrivals of this request id only; later ones (a hop's
    // retry or fallback) are served normally.
    let first_attempts = match header_num::<u32>(&req, "x-sim-first-attempts") {
        Ok(k) => k,
        Err(e) => return err_reply(400, &e, "BadRequestError", None),
    };
    let (stall_after, delay_first, reset_after, status) = match first_attempts {
        Some(k) if sim.attempt(&request_id) > k => (None, None, None, None),
        _ => (stall_after, delay_first, reset_after, status),
    };
    if let Some(code) = status.filter(|c| *c != 200) {
        let typ = match code {
            400 => "BadRequestError",
            404 => "NotFoundError",
            429 => "RateLimitError",
            503 => "ServiceUnavailableError",
            _ => "InternalServerError",
        };
        return err_reply(code, "simulated engine error (x-sim-status)", typ, None);
    }
    let path = req.uri().path().to_string();
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            return err_reply(
                400,
                &format!("reading the body: {e}"),
                "BadRequestError",
                None,
            )
        }
    };
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => {
            return err_reply(
                400,
                "the body must be a JSON object",
                "BadRequestError",
                None,
            )
        }
        Err(e) => {
            return err_reply(
                400,
                &format!("JSON decode error: {e}"),
                "BadRequestError",
                None,
            )
        }
    };
    let prompt_tokens = match kind {
        Kind::Completion => match v.get("prompt") {
            Some(Value::String(s)) => text_tokens(s.len()),
            Some(Value::Array(a)) if !a.is_empty() => {
                text_tokens(a.iter().map(|x| x.to_string().len()).sum())
            }
            _ => {
                return err_reply(
                    400,
                    "prompt: Field required",
                    "BadRequestError",
                    Some("prompt"),
                )
            }
        },
        Kind::Chat => match v.get("messages") {
            Some(Value::Array(a)) if !a.is_empty() => text_tokens(
                a.iter()
                    .map(|m| match m.get("content") {
                        Some(Value::String(s)) => s.len(),
                        Some(other) => other.to_string().len(),
                        None => 0,
                    })
                    .sum::<usize>()
                    + 16,
            ),
            _ => {
                return err_reply(
                    400,
                    "messages: Field required",
                    "BadRequestError",
                    Some("messages"),
                )
            }
        },
    };
    let max_tokens_v = v
        .get("max_tokens")
        .or_else(|| v.get("max_completion_tokens"))
        .filter(|x| !x.is_null());
    let max_tokens = match max_tokens_v {
        None => cfg.default_max_tokens,
        Some(x) => match x.as_u64() {
            Some(m) if m >= 1 => u32::try_from(m).unwrap_or(u32::MAX),
            _ => {
                return err_reply(
                    400,
                    &format!("max_tokens must be at least 1, got {x}."),
                    "BadRequestError",
                    Some("max_tokens"),
                )
            }
        },
    };
    if max_tokens > cfg.max_model_len {
        return err_reply(
            400,
            &format!(
                "max_tokens={max_tokens} cannot be greater than max_model_len={}. Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                cfg.max_model_len
            ),
            "BadRequestError",
            Some("max_tokens"),
        );
    }
    if u64::from(prompt_tokens) + u64::from(max_tokens) > u64::from(cfg.max_model_len) {
        return err_reply(
            400,
            &format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
                cfg.max_model_len,
                u64::from(prompt_tokens) + u64::from(max_tokens)
            ),
            "BadRequestError",
            None,
        );
    }
    let n = match v.get("n") {
        None | Some(Value::Null) => 1,
        Some(x) => match x.as_u64() {
            Some(n @ 1..=64) => n as u32,
            _ => {
                return err_reply(
                    400,
                    &format!("n must be between 1 and 64, got {x}."),
                    "BadRequestError",
                    Some("n"),
                )
            }
        },
    };
    let stream = match v.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(x) => {
            return err_reply(
                400,
                &format!("stream must be a boolean, got {x}."),
                "BadRequestError",
                Some("stream"),
            )
        }
    };
    // vLLM 0.32 refuses this first thing in `_create_completion`, inside the wrapper
    // that notifies a prefill engine of a rejected decode request (a decode replica's
    // refusal here lets the prefill side go: the pull duty is dropped).
    if stream && v.get("use_beam_search").and_then(Value::as_bool) == Some(true) {
        return err_reply(
            400,
            "Streaming is not currently supported with beam search",
            "BadRequestError",
            None,
        );
    }
    let include_usage = v
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let length = forced.unwrap_or(max_tokens);
    let per_seq = u64::from(prompt_tokens) + u64::from(length.max(max_tokens));
    let blocks = per_seq.div_ceil(u64::from(cfg.block_size.max(1))) * u64::from(n);
    if blocks > u64::from(cfg.kv_blocks) {
        return err_reply(
            400,
            &format!(
                "the request needs {blocks} KV blocks, the pool has {}",
                cfg.kv_blocks
            ),
            "BadRequestError",
            None,
        );
    }
    let blocks = blocks as u32;
    let rate = rate.unwrap_or(cfg.token_rate).max(0.001);
    let keepalive = match ka {
        Some(0) => None,
        Some(ms) => Some(Duration::from_millis(ms)),
        None if cfg.keepalive_ms > 0 => Some(Duration::from_millis(cfg.keepalive_ms)),
        None if stall_after.is_some() && cfg.stall_keepalive_ms > 0 => {
            Some(Duration::from_millis(cfg.stall_keepalive_ms))
        }
        None => None,
    };
    // SGLang knows a request by its body's `rid` (never by `x-request-id`).
    let engine_id = match (v.get("rid").and_then(Value::as_str), kind) {
        (Some(rid), _) => rid.to_string(),
        (None, Kind::Completion) => format!("cmpl-{request_id}"),
        (None, Kind::Chat) => format!("chatcmpl-{request_id}"),
    };
    let hold = cfg.pd_role == PdRole::Prefill && pd::wants_remote_decode(&v);
    let kv_out = hold.then(|| pd::transfer_params(&sim, &engine_id, blocks));
    let kv_remote_id = pull.pending().map(|r| r.request_id.clone());
    let model = v
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(&cfg.model)
        .to_string();
    let params = Params {
        kind,
        model,
        stream,
        include_usage,
        n,
        prompt_tokens,
        max_tokens,
        length,
        stall_after,
        reset_after,
        delay_first: Duration::from_millis(delay_first.unwrap_or(0)),
        rate,
        keepalive,
        engine_id: engine_id.clone(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        kv_out,
        pull,
    };
    let rec = RequestRecord {
        request_id,
        engine_id,
        path,
        stream,
        n,
        prompt_tokens,
        max_tokens,
        blocks,
        tokens_sent: 0,
        bytes_delivered: 0,
        keepalives_sent: 0,
        state: SeqState::Waiting,
        ended: None,
        aborted_by: None,
        client_gone: false,
        arrived_ms: 0,
        started_ms: None,
        first_token_ms: None,
        ended_ms: None,
        headers,
        kv_held_ms: None,
        kv_released: None,
        kv_remote_id,
        kv_pulled_ms: None,
    };
    let ticket = sim.enqueue(rec);
    if hold {
        sim.hold_on_finish(ticket.seq);
    }
    let delivered = sim.delivered_counter(ticket.seq);
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(run_sequence(sim.clone(), params, ticket, tx));
    if stream {
        let mut r = Response::new(
            ChannelBody {
                rx,
                taken: Some(delivered),
            }
            .boxed(),
        );
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        Ok(r)
    } else {
        // The task sends exactly one message: the whole JSON body. If this future is
        // dropped (client gone), `rx` goes with it and the task sees the channel closed.
        let mut rx = rx;
        match rx.recv().await {
            Some(Ok(body)) => Ok(bytes_response(200, "application/json", body)),
            Some(Err(e)) => Err(e),
            None => {
                let mut r = Response::new(full(""));
                *r.status_mut() = hyper::StatusCode::SERVICE_UNAVAILABLE;
                Ok(r)
            }
        }
    }
}

/// Formats the SSE chunk of one choice.
fn chunk(
    p: &Params,
    index: u32,
    text: &str,
    role: bool,
    finish: Option<&str>,
    fingerprint: bool,
) -> String {
    let text = serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into());
    let fr = finish
        .map(|f| format!("\"{f}\""))
        .unwrap_or_else(|| "null".into());
    let fp = if fingerprint {
        format!(",\"system_fingerprint\":\"{FINGERPRINT}\"")
    } else {
        String::new()
    };
    let (id, created, model) = (&p.engine_id, p.created, &p.model);
    let model = serde_json::to_string(model).unwrap_or_default();
    match p.kind {
        Kind::Chat if role => format!(
            "data: {{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":{created},\"model\":{model},\"choices\":[{{\"index\":{index},\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}],\"prompt_token_ids\":null,\"prompt_text\":null}}\n\n"
        ),
        Kind::Chat => {
            let stop = if finish.is_some() { ",\"stop_reason\":null" } else { "" };
            format!(
                "data: {{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":{created},\"model\":{model},\"choices\":[{{\"index\":{index},\"delta\":{{\"content\":{text}}},\"logprobs\":null,\"finish_reason\":{fr}{stop},\"token_ids\":null}}]{fp}}}\n\n"
            )
        }
        Kind::Completion => format!(
            "data: {{\"id\":\"{id}\",\"object\":\"text_completion\",\"created\":{created},\"model\":{model},\"choices\":[{{\"index\":{index},\"text\":{text},\"logprobs\":null,\"finish_reason\":{fr},\"stop_reason\":null,\"prompt_token_ids\":null,\"token_ids\":null}}]{fp}}}\n\n"
        ),
    }
}

fn usage_chunk(p: &Params, completion_tokens: u64) -> String {
    let object = match p.kind {
        Kind::Chat => "chat.completion.chunk",
        Kind::Completion => "text_completion",
    };
    let model = serde_json::to_string(&p.model).unwrap_or_default();
    format!(
        "data: {{\"id\":\"{}\",\"object\":\"{object}\",\"created\":{},\"model\":{model},\"choices\":[],\"usage\":{{\"prompt_tokens\":{},\"total_tokens\":{},\"completion_tokens\":{completion_tokens}}},\"system_fingerprint\":\"{FINGERPRINT}\"}}\n\n",
        p.engine_id,
        p.created,
        p.prompt_tokens,
        u64::from(p.prompt_tokens) + completion_tokens
    )
}

fn full_body(p: &Params, texts: &[String], finish: &str) -> Bytes {
    let per_choice = u64::from(p.length);
    let completion_tokens = per_choice * u64::from(p.n);
    let choices: Vec<Value> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| match p.kind {
            Kind::Chat => json!({"index": i, "message": {"role": "assistant", "content": t, "refusal": null, "tool_calls": []}, "logprobs": null, "finish_reason": finish, "stop_reason": null}),
            Kind::Completion => json!({"index": i, "text": t, "logprobs": null, "finish_reason": finish, "stop_reason": null, "prompt_logprobs": null}),
        })
        .collect();
    let object = match p.kind {
        Kind::Chat => "chat.completion",
        Kind::Completion => "text_completion",
    };
    let mut v = json!({
        "id": p.engine_id, "object": object, "created": p.created, "model": p.model,
        "choices": choices,
        "usage": {"prompt_tokens": p.prompt_tokens, "total_tokens": u64::from(p.prompt_tokens) + completion_tokens, "completion_tokens": completion_tokens},
        "system_fingerprint": FINGERPRINT,
    });
    if let Some(kv) = &p.kv_out {
        v["kv_transfer_params"] = kv.clone();
    }
    Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
}

fn token_text(step: u32, index: u32) -> String {
    if index == 0 {
        format!(" t{step}")
    } else {
        format!(" t{step}.{index}")
    }
}

/// Drives one sequence: waits for admission, generates tokens, watches the client and
/// the abort signal, ends the sequence.
type Tx = mpsc::UnboundedSender<Result<Bytes, std::io::Error>>;

async fn run_sequence(sim: Arc<Sim>, mut p: Params, ticket: Ticket, tx: Tx) {
    let Ticket {
        seq,
        mut admitted,
        mut stop,
    } = ticket;
    let abort_on_disconnect = sim.cfg.abort_on_disconnect;
    let interval = Duration::from_secs_f64(1.0 / p.rate);
    let far = Instant::now() + Duration::from_secs(86_400 * 365);
    let mut running = false;
    let mut client_gone = false;
    let mut step: u32 = 0; // tokens generated per choice
    let mut next_token = far;
    let ka_every = if p.stream { p.keepalive } else { None };
    let mut next_ka = ka_every.map(|d| Instant::now() + d).unwrap_or(far);
    let mut texts: Vec<String> = vec![String::new(); p.n as usize];
    let finish = if p.length >= p.max_tokens {
        "length"
    } else {
        "stop"
    };
    let stalled_at = p.stall_after.unwrap_or(u32::MAX);
    // Decode role: heartbeats to the prefill replica until the read, which starts at
    // admission and takes `kv_pull_ms`.
    let hb_every = Duration::from_millis((sim.cfg.kv_lease_ms / 6).max(10));
    let mut next_hb = if p.pull.pending().is_some() {
        Instant::now()
    } else {
        far
    };
    let mut pull_done = far;
    if stop.borrow().is_some() {
        sim.finish(seq, EndKind::Shutdown);
        return;
    }
    loop {
        let stalled = step >= stalled_at.min(p.length) && step < p.length;
        tokio::select! {
            biased;
            changed = stop.changed() => {
                // Ended from outside (abort API, shutdown): the bookkeeping is done.
                if changed.is_err() || stop.borrow().is_some() {
                    return;
                }
            }
            _ = tx.closed(), if !client_gone => {
                client_gone = true;
                sim.client_gone(seq);
                if abort_on_disconnect {
                    sim.finish(seq, EndKind::Disconnected);
                    return;
                }
            }
            r = &mut admitted, if !running => {
                if r.is_err() {
                    return;
                }
                running = true;
                if p.pull.pending().is_some() {
                    pull_done = Instant::now() + Duration::from_millis(sim.cfg.kv_pull_ms);
                } else {
                    next_token = Instant::now() + p.delay_first + interval;
                }
            }
            _ = sleep_until(next_hb), if p.pull.pending().is_some() => {
                if let Some(r) = p.pull.pending().cloned() {
                    tokio::spawn(async move { pd::heartbeat(&r).await });
                }
                next_hb += hb_every;
            }
            _ = sleep_until(pull_done), if running && p.pull.pending().is_some() => {
                p.pull.pulled().await;
                let now_ms = sim.now_ms();
                sim.update(seq, |r| r.kv_pulled_ms = Some(now_ms));
                next_hb = far;
                next_token = Instant::now() + p.delay_first + interval;
            }
            _ = sleep_until(next_token), if running && !stalled => {
                if p.reset_after.is_some_and(|n| step >= n) {
                    let _ = tx.send(Err(std::io::Error::other("simulated engine reset (x-sim-reset-after)")));
                    sim.finish(seq, EndKind::Reset);
                    return;
                }
                let mut out = String::new();
                if step == 0 && p.kind == Kind::Chat && p.stream {
                    for i in 0..p.n {
                        out.push_str(&chunk(&p, i, "", true, None, false));
                    }
                }
                let last = step + 1 == p.length;
                for i in 0..p.n {
                    let t = token_text(step, i);
                    if p.stream {
                        let fp = last && !p.include_usage && p.kind == Kind::Completion;
                        out.push_str(&chunk(&p, i, &t, false, last.then_some(finish), fp));
                    } else {
                        texts[i as usize].push_str(&t);
                    }
                }
                step += 1;
                let now_ms = sim.now_ms();
                sim.token_step(seq, p.n, now_ms);
                if last {
                    if p.stream {
                        if p.include_usage {
                            out.push_str(&usage_chunk(&p, u64::from(step) * u64::from(p.n)));
                        }
                        out.push_str("data: [DONE]\n\n");
                    } else {
                        out = String::new();
                    }
                    let body = if p.stream { Bytes::from(out) } else { full_body(&p, &texts, finish) };
                    let _ = tx.send(Ok(body));
                    sim.finish(seq, if finish == "length" { EndKind::Length } else { EndKind::Stop });
                    return;
                }
                if p.stream {
                    let _ = tx.send(Ok(Bytes::from(out)));
                }
                next_token += interval;
                if let Some(d) = ka_every {
                    next_ka = Instant::now() + d;
                }
            }
            _ = sleep_until(next_ka), if ka_every.is_some() => {
                let _ = tx.send(Ok(Bytes::from_static(b": keep-alive\n\n")));
                sim.update(seq, |r| r.keepalives_sent += 1);
                next_ka = Instant::now() + ka_every.unwrap_or(Duration::from_secs(1));
            }
        }
    }
}
