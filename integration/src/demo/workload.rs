//! The demo's seeded workload: the plan (the same for both runs) and the client of one
//! planned request, built on [`crate::client`]. It records per request what the
//! aggregate load generator (`kvguard-load`) does not: the request id, when the client
//! left, and how the stream ended.

use super::{ClientRecord, DemoConfig, EngineKind};
use crate::client;
use crate::load::Rng;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// What a client does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Reads to the end.
    Complete,
    /// Disconnects after this many data events.
    Disconnect(u32),
    /// The stream stalls after this many tokens (simulator: `x-sim-stall-after`; vLLM:
    /// the client stops reading); the client gives up after its patience.
    Stall(u32),
}

impl Kind {
    /// The plan's name in records and tables: `complete`, `disconnect`, `stall`.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Complete => "complete",
            Kind::Disconnect(_) => "disconnect",
            Kind::Stall(_) => "stall",
        }
    }
}

/// One planned request.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Index.
    pub index: usize,
    /// Arrival, from the run's start.
    pub at: Duration,
    /// `max_tokens` (and, with `ignore_eos`, the length).
    pub tokens: u32,
    /// Chat or completions.
    pub chat: bool,
    /// What the client does.
    pub kind: Kind,
    /// Streaming (`"stream": true`); a non-streaming request is a completion that
    /// completes or is left (never a stall), sent by [`nonstream_client`].
    pub stream: bool,
}

/// The plan for `cfg` (deterministic in `cfg.seed`): steady arrivals at `cfg.rate`.
pub fn plan(cfg: &DemoConfig) -> Vec<Planned> {
    let mut rng = Rng::new(cfg.seed);
    let n = (cfg.arrival_s * cfg.rate).floor() as usize;
    let span = u64::from(cfg.max_tokens.saturating_sub(cfg.min_tokens)) + 1;
    (0..n)
        .map(|i| {
            let tokens = cfg.min_tokens + rng.below(span) as u32;
            let r = rng.unit();
            let kind = if r < cfg.stall_share {
                Kind::Stall(1 + rng.below(u64::from(tokens / 2).max(1)) as u32)
            } else if r < cfg.stall_share + cfg.disconnect_share {
                Kind::Disconnect(1 + rng.below(u64::from(tokens - 1).max(1)) as u32)
            } else {
                Kind::Complete
            };
            // A silent client (vLLM's stand-in for a stall) must leave more output
            // behind than the buffers on the way hold, or its stream is not stalled.
            let tokens = match (kind, cfg.engine) {
                (Kind::Stall(_), EngineKind::Vllm) => tokens.max(1800),
                _ => tokens,
            };
            // With non-streaming requests in the plan or a real hop (`--hop litellm`),
            // streams are chat and non-streaming ones completions, so that
            // kvguard-control's in-flight table tells them apart by path. No draw without
            // non-streaming requests: the plan's randomness is unchanged.
            let stream = cfg.nonstream_share <= 0.0 || rng.unit() >= cfg.nonstream_share;
            let (chat, kind) = match (cfg.split_by_path(), stream) {
                (false, _) => (i % 2 == 0, kind),
                (true, true) => (true, kind),
                (true, false) => (
                    false,
                    match kind {
                        Kind::Stall(_) => Kind::Complete,
                        k => k,
                    },
                ),
            };
            Planned {
                index: i,
                at: Duration::from_secs_f64(i as f64 / cfg.rate),
                tokens,
                chat,
                kind,
                stream,
            }
        })
        .collect()
}

fn body(p: &Planned) -> serde_json::Value {
    if !p.stream {
        return json!({"model": "tiny", "prompt": format!("demo request {}", p.index),
                      "stream": false, "max_tokens": p.tokens, "ignore_eos": true});
    }
    if p.chat {
        json!({"model": "tiny", "messages": [{"role": "user", "content": format!("demo request {}", p.index)}],
               "stream": true, "max_tokens": p.tokens, "ignore_eos": true})
    } else {
        json!({"model": "tiny", "prompt": format!("demo request {}", p.index), "stream": true,
               "max_tokens": p.tokens, "ignore_eos": true})
    }
}

struct Connected<'a>(&'a AtomicUsize);

impl<'a> Connected<'a> {
    fn new(c: &'a AtomicUsize) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        Connected(c)
    }
}

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Runs one planned request through `entry`; every wait is bounded.
pub async fn client(
    cfg: &DemoConfig,
    entry: SocketAddr,
    p: &Planned,
    t0: Instant,
    connected: &AtomicUsize,
) -> ClientRecord {
    let since = |t: Instant| (t - t0).as_secs_f64();
    let sent = Instant::now();
    let mut rec = ClientRecord {
        index: p.index,
        plan: p.kind.label().into(),
        sent_s: since(sent),
        ..ClientRecord::default()
    };
    let path = if p.chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let patience = Duration::from_secs_f64(cfg.patience_s);
    let _live = Connected::new(connected);
    // vLLM cannot be told to stall: its stalled streams are clients that stop reading.
    if let (Kind::Stall(_), EngineKind::Vllm) = (p.kind, cfg.engine) {
        match client::silent_client(entry, path, &body(p), &[], 4096, true).await {
            Ok(mut c) => {
                rec.request_id = c.head().and_then(|h| {
                    h.lines().find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("x-request-id")
                            .then(|| v.trim().to_string())
                    })
                });
                // Reads nothing more for its patience, then leaves (unless kvguard
                // closed it first: then the read below ends early).
                let closed = c.read_to_close(patience).await.is_ok();
                rec.outcome = if closed { "closed" } else { "gave_up" }.into();
                rec.gone_s = Some(since(Instant::now()));
                c.close();
            }
            Err(e) => {
                rec.outcome = "error".into();
                rec.error = Some(format!("{e:#}"));
            }
        }
        return rec;
    }
    let mut headers: Vec<(&str, String)> = Vec::new();
    if let Kind::Stall(k) = p.kind {
        headers.push(("x-sim-stall-after", k.to_string()));
    }
    let hdrs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut s = match client::stream_sse(entry, path, &body(p), &hdrs, false).await {
        Ok(s) => s,
        Err(e) => {
            rec.outcome = "error".into();
            rec.error = Some(format!("{e:#}"));
            return rec;
        }
    };
    rec.request_id = s.header("x-request-id").map(str::to_string);
    if s.status != 200 {
        rec.outcome = "error".into();
        rec.error = Some(format!("status {}", s.status));
        return rec;
    }
    // A generous bound on the whole stream: queueing plus generation.
    let bound = Duration::from_secs(120);
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let wait = if matches!(p.kind, Kind::Stall(_)) && rec.events > 0 {
            patience.min(left)
        } else {
            left
        };
        match s.next_data(wait).await {
            Ok(Some(ev)) => {
                if ev.event.as_deref() == Some("error") {
                    rec.outcome = "kvguard_error".into();
                    rec.error = ev.data.clone();
                    return rec;
                }
                if rec.events == 0 {
                    rec.ttft_s = Some(sent.elapsed().as_secs_f64());
                }
                if ev.is_done() {
                    rec.outcome = "done".into();
                    return rec;
                }
                rec.events += 1;
                if let Kind::Disconnect(k) = p.kind {
                    if rec.events >= u64::from(k) {
                        rec.outcome = "disconnected".into();
                        rec.gone_s = Some(since(Instant::now()));
                        s.disconnect();
                        return rec;
                    }
                }
            }
            Ok(None) => {
                rec.outcome = "closed".into();
                return rec;
            }
            Err(e) => {
                let timed_out = e.to_string().contains("no stream bytes within");
                if timed_out && matches!(p.kind, Kind::Stall(_)) {
                    rec.outcome = "gave_up".into();
                    rec.gone_s = Some(since(Instant::now()));
                    s.disconnect();
                } else {
                    rec.outcome = if timed_out { "error" } else { "closed" }.into();
                    rec.error = Some(format!("{e:#}"));
                }
                return rec;
            }
        }
    }
}

/// The path non-streaming requests use (streams use chat when the plan has both).
pub const NONSTREAM_PATH: &str = "/v1/completions";

/// Runs one planned non-streaming request through `entry`: `Complete` waits for the whole
/// answer (bounded); `Disconnect(k)` leaves after about the time `k` tokens take (the
/// client never sees a token: the answer comes at the end). `connected` counts it while
/// its connection is open.
pub async fn nonstream_client(
    cfg: &DemoConfig,
    entry: SocketAddr,
    p: &Planned,
    t0: Instant,
    connected: &AtomicUsize,
) -> ClientRecord {
    let since = |t: Instant| (t - t0).as_secs_f64();
    let sent = Instant::now();
    let mut rec = ClientRecord {
        index: p.index,
        plan: p.kind.label().into(),
        sent_s: since(sent),
        ..ClientRecord::default()
    };
    let _live = Connected::new(connected);
    let body = match serde_json::to_vec(&body(p)) {
        Ok(b) => b,
        Err(e) => {
            rec.outcome = "error".into();
            rec.error = Some(e.to_string());
            return rec;
        }
    };
    let req = client::request(
        entry,
        hyper::Method::POST,
        NONSTREAM_PATH,
        &[("content-type", "application/json")],
        body,
        false,
        Duration::from_secs(120),
    );
    let leave_after = match (p.kind, cfg.engine) {
        (Kind::Disconnect(k), EngineKind::Sim) => Some(f64::from(k) / cfg.sim_token_rate.max(1.0)),
        // vLLM on CPU: ~60 tokens/s for the suite's model.
        (Kind::Disconnect(k), EngineKind::Vllm) => Some(f64::from(k) / 60.0),
        _ => None,
    };
    match leave_after {
        Some(s) => match tokio::time::timeout(Duration::from_secs_f64(s), req).await {
            Err(_) => {
                rec.outcome = "disconnected".into();
                rec.gone_s = Some(since(Instant::now()));
            }
            Ok(r) => record_answer(&mut rec, r),
        },
        None => record_answer(&mut rec, req.await),
    }
    rec
}

fn record_answer(rec: &mut ClientRecord, r: anyhow::Result<client::Resp>) {
    match r {
        Ok(r) if r.status == 200 => {
            rec.request_id = r.header("x-request-id").map(str::to_string);
            rec.outcome = "done".into();
        }
        Ok(r) => {
            rec.outcome = "error".into();
            rec.error = Some(format!("status {}", r.status));
        }
        Err(e) => {
            rec.outcome = "closed".into();
            rec.error = Some(format!("{e:#}"));
        }
    }
}
