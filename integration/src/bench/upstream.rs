//! A purpose-built fast SSE upstream for the benchmarks.
//!
//! Why not the simulator: its admission control and KV accounting (256 running sequences
//! by default, a block pool) would queue a 1,000-stream load, and its per-token JSON work
//! competes with Envoy for this machine's two cores. This upstream does the minimum: it
//! answers any POST with vLLM-framed chat chunks (`chatcmpl-<x-request-id>`), paced or
//! in a burst, and records, per request id, when it sent the last event and when the
//! connection to it went away (the "engine connection closed" moment of abort latency).
//!
//! Request headers: `x-bench-events: n` (default 32), `x-bench-interval-us: n` (0 = as
//! fast as the socket takes them), `x-bench-stall-after: k` (after k events send nothing
//! more, keep the stream open until the peer goes), `x-bench-hold-ms: n` (after the first
//! event wait n ms before the rest), `x-bench-lockstep: 1` (each write, the events,
//! `[DONE]` and the end, waits for a [`FastUpstream::step`]: a client that steps only once
//! it has read the previous one makes a proxy read each alone, as the instruction counts
//! need; one such stream at a time).

use crate::http::{bind, serve, ChannelBody, RespBody, Server};
use anyhow::Result;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{Request, Response};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

#[derive(Default)]
struct Shared {
    /// Request id → when its last event was handed to hyper.
    last_sent: Mutex<HashMap<String, Instant>>,
    /// Request id → when the peer went away before the end.
    closed: Mutex<HashMap<String, Instant>>,
    open: AtomicUsize,
    events: AtomicU64,
    /// Writes of lock-step streams allowed ([`FastUpstream::step`]).
    steps: Steps,
}

/// A semaphore with no permit at first.
struct Steps(tokio::sync::Semaphore);

impl Default for Steps {
    fn default() -> Self {
        Steps(tokio::sync::Semaphore::new(0))
    }
}

/// The running upstream; dropping it stops it.
pub struct FastUpstream {
    server: Server,
    shared: Arc<Shared>,
}

fn header<'a>(req: &'a Request<hyper::body::Incoming>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

fn num(req: &Request<hyper::body::Incoming>, name: &str, default: u64) -> u64 {
    header(req, name)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

fn chunk(id: &str, i: u64, finish: bool) -> Bytes {
    let fin = if finish { "\"length\"" } else { "null" };
    let content = if finish {
        String::new()
    } else {
        format!(" t{i}")
    };
    Bytes::from(format!(
        "data: {{\"id\":\"chatcmpl-{id}\",\"object\":\"chat.completion.chunk\",\"created\":1795960117,\"model\":\"bench\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}},\"logprobs\":null,\"finish_reason\":{fin}}}]}}\n\n"
    ))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl FastUpstream {
    /// Starts it on `127.0.0.1:0` (HTTP/1.1 and h2c) on the current runtime.
    pub async fn spawn() -> Result<FastUpstream> {
        let listener = bind(None).await?;
        let shared = Arc::new(Shared::default());
        let sh = shared.clone();
        let server = serve(listener, move |req, _peer| {
            let sh = sh.clone();
            async move { Ok::<_, std::io::Error>(handle(req, sh).await) }
        })?;
        Ok(FastUpstream { server, shared })
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// When the stream of `id` was seen gone (before its end), if it was.
    pub fn closed_at(&self, id: &str) -> Option<Instant> {
        lock(&self.shared.closed).get(id).copied()
    }

    /// When the last event of `id` was sent.
    pub fn last_sent(&self, id: &str) -> Option<Instant> {
        lock(&self.shared.last_sent).get(id).copied()
    }

    /// Streams open now.
    pub fn open(&self) -> usize {
        self.shared.open.load(Ordering::Relaxed)
    }

    /// Events sent in total.
    pub fn events(&self) -> u64 {
        self.shared.events.load(Ordering::Relaxed)
    }

    /// Lets a lock-step stream (`x-bench-lockstep: 1`) make its next write.
    pub fn step(&self) {
        self.shared.steps.0.add_permits(1);
    }

    /// Forgets the per-id records (between phases).
    pub fn clear(&self) {
        lock(&self.shared.closed).clear();
        lock(&self.shared.last_sent).clear();
    }
}

/// Waits for a step; false when the peer went away first.
async fn step<T>(sh: &Shared, tx: &mpsc::UnboundedSender<T>) -> bool {
    tokio::select! {
        p = sh.steps.0.acquire() => {
            p.map(tokio::sync::SemaphorePermit::forget).is_ok()
        }
        _ = tx.closed() => false,
    }
}

async fn handle(req: Request<hyper::body::Incoming>, sh: Arc<Shared>) -> Response<RespBody> {
    let id = header(&req, "x-request-id").unwrap_or("none").to_owned();
    let n = num(&req, "x-bench-events", 32);
    let interval = Duration::from_micros(num(&req, "x-bench-interval-us", 0));
    let stall_after = header(&req, "x-bench-stall-after").and_then(|v| v.parse::<u64>().ok());
    let hold = Duration::from_millis(num(&req, "x-bench-hold-ms", 0));
    let lockstep = num(&req, "x-bench-lockstep", 0) == 1;
    // Drain the request body.
    let _ = req.into_body().collect().await;
    let (tx, rx) = mpsc::unbounded_channel();
    let body = ChannelBody { rx, taken: None };
    let mut resp = Response::new(BodyExt::boxed(body));
    let h = resp.headers_mut();
    h.insert(
        "content-type",
        hyper::header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        "cache-control",
        hyper::header::HeaderValue::from_static("no-cache"),
    );
    sh.open.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(async move {
        let gone = |sh: &Shared, id: &str| {
            lock(&sh.closed).insert(id.to_owned(), Instant::now());
        };
        let mut next = tokio::time::Instant::now();
        let mut ok = true;
        for i in 0..n {
            if i > 0 && !interval.is_zero() {
                next += interval;
                tokio::select! {
                    _ = tokio::time::sleep_until(next) => {}
                    _ = tx.closed() => { ok = false; break; }
                }
            }
            if i == 1 && !hold.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(hold) => {}
                    _ = tx.closed() => { ok = false; break; }
                }
            }
            if stall_after == Some(i) {
                tx.closed().await;
                ok = false;
                break;
            }
            if lockstep && !step(&sh, &tx).await {
                ok = false;
                break;
            }
            if tx.send(Ok(chunk(&id, i, i + 1 == n))).is_err() {
                ok = false;
                break;
            }
            sh.events.fetch_add(1, Ordering::Relaxed);
            lock(&sh.last_sent).insert(id.clone(), Instant::now());
        }
        ok = ok && (!lockstep || step(&sh, &tx).await);
        if ok {
            let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
            ok = !lockstep || step(&sh, &tx).await;
        }
        if ok {
            drop(tx);
        } else {
            gone(&sh, &id);
        }
        sh.open.fetch_sub(1, Ordering::Relaxed);
    });
    resp
}
