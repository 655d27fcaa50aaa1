//! The lossy hop: an HTTP reverse proxy instrument that does **not** pass client
//! disconnects on. It forwards each request on a fresh upstream connection, streams the
//! response back, and when the client goes away keeps reading the upstream response to
//! its end — like the buffering gateways and routers that cause the KV leak (see
//! DESIGN.md). A test instrument, not a product.
//!
//! A request carrying [`HOLD_HEADER`]`: 1` is also held before its response head: the
//! upstream request is sent from a task of its own, so a client that leaves while the
//! upstream has not answered yet (a queued or generating non-streaming request) leaves
//! it running too.

use crate::http::{bytes_response, read_body, ChannelBody, RespBody};
use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Lossy hop settings.
#[derive(Debug, Clone)]
pub struct LossyConfig {
    /// Address to bind; `None` = `127.0.0.1:0`.
    pub listen: Option<SocketAddr>,
    /// Where to forward.
    pub upstream: SocketAddr,
    /// Speak h2c to the upstream (default HTTP/1.1).
    pub upstream_http2: bool,
}

impl LossyConfig {
    /// A hop on a free local port forwarding to `upstream` over HTTP/1.1.
    pub fn to(upstream: SocketAddr) -> LossyConfig {
        LossyConfig {
            listen: None,
            upstream,
            upstream_http2: false,
        }
    }
}

/// Counters of a lossy hop.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LossyStats {
    /// Requests received.
    pub requests: u64,
    /// Upstream responses read to their end.
    pub upstream_completed: u64,
    /// Upstream responses that failed (reset, connect error).
    pub upstream_errors: u64,
    /// Requests whose client went away before the response ended.
    pub clients_gone: u64,
    /// Response bytes read from the upstream after the client had gone (the leak).
    pub bytes_after_client_gone: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) requests: AtomicU64,
    upstream_completed: AtomicU64,
    pub(crate) upstream_errors: AtomicU64,
    clients_gone: AtomicU64,
    bytes_after_client_gone: AtomicU64,
}

/// A running lossy hop; dropping it stops accepting (upstream reads already running
/// continue until they end, as the leak requires).
pub struct LossyHandle {
    server: crate::http::Server,
    counters: Arc<Counters>,
}

impl LossyHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// Counters so far.
    pub fn stats(&self) -> LossyStats {
        self.counters.stats()
    }
}

impl Counters {
    pub(crate) fn stats(&self) -> LossyStats {
        let c = self;
        LossyStats {
            requests: c.requests.load(Ordering::Relaxed),
            upstream_completed: c.upstream_completed.load(Ordering::Relaxed),
            upstream_errors: c.upstream_errors.load(Ordering::Relaxed),
            clients_gone: c.clients_gone.load(Ordering::Relaxed),
            bytes_after_client_gone: c.bytes_after_client_gone.load(Ordering::Relaxed),
        }
    }
}

/// Starts a lossy hop on the current tokio runtime.
pub async fn spawn(config: LossyConfig) -> Result<LossyHandle> {
    let listener = crate::http::bind(config.listen)
        .await
        .context("binding the lossy hop")?;
    let counters = Arc::new(Counters::default());
    let c2 = counters.clone();
    let cfg = Arc::new(config);
    let server = crate::http::serve(listener, move |req, peer| {
        let (cfg, c) = (cfg.clone(), c2.clone());
        async move { Ok(forward(cfg, c, req, peer).await) }
    })?;
    Ok(LossyHandle { server, counters })
}

/// Request header asking the hop to hide a client's close before the response head too.
pub const HOLD_HEADER: &str = "x-lossy-hold";

pub(crate) const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
];

fn bad_gateway(msg: String) -> Response<RespBody> {
    bytes_response(502, "text/plain", msg)
}

async fn forward(
    cfg: Arc<LossyConfig>,
    c: Arc<Counters>,
    req: Request<Incoming>,
    _peer: SocketAddr,
) -> Response<RespBody> {
    c.requests.fetch_add(1, Ordering::Relaxed);
    let (parts, body) = req.into_parts();
    let body = match read_body(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => return bad_gateway(format!("reading the request: {e}")),
    };
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_else(|| "/".into());
    let uri = if cfg.upstream_http2 {
        format!("http://{}{path}", cfg.upstream)
    } else {
        path
    };
    let mut b = Request::builder().method(parts.method.clone()).uri(uri);
    for (k, v) in &parts.headers {
        if !HOP_BY_HOP.contains(&k.as_str()) {
            b = b.header(k, v);
        }
    }
    if !cfg.upstream_http2 {
        b = b.header("host", cfg.upstream.to_string());
    }
    let Ok(up_req) = b.body(Full::new(body)) else {
        return bad_gateway("building the upstream request".into());
    };
    let hold = parts.headers.get(HOLD_HEADER).is_some_and(|v| v == "1");
    let answer = if hold {
        // Sent and pumped from a task of its own: dropping this handler (the client left
        // before the head) does not drop the upstream request.
        let (htx, hrx) = tokio::sync::oneshot::channel();
        let (cfg, c) = (cfg.clone(), c.clone());
        tokio::spawn(async move {
            let _ = htx.send(send_and_pump(&cfg, up_req, c).await);
        });
        match hrx.await {
            Ok(r) => r,
            Err(_) => Err(anyhow::anyhow!("the upstream task ended")),
        }
    } else {
        send_and_pump(&cfg, up_req, c.clone()).await
    };
    let (rparts, rx) = match answer {
        Ok(a) => a,
        Err(e) => return bad_gateway(format!("upstream: {e:#}")),
    };
    let mut out = Response::new(ChannelBody { rx, taken: None }.boxed());
    *out.status_mut() = rparts.status;
    for (k, v) in &rparts.headers {
        if !HOP_BY_HOP.contains(&k.as_str()) && k != "content-length" {
            out.headers_mut().append(k, v.clone());
        }
    }
    out
}

/// The upstream's answer head and its body, pumped by [`pump`]; a failed send is counted.
async fn send_and_pump(
    cfg: &LossyConfig,
    up_req: Request<Full<Bytes>>,
    c: Arc<Counters>,
) -> Result<(
    hyper::http::response::Parts,
    mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>>,
)> {
    match send_upstream(cfg, up_req).await {
        Ok(resp) => {
            let (rparts, rbody) = resp.into_parts();
            Ok((rparts, pump(rbody, c)))
        }
        Err(e) => {
            c.upstream_errors.fetch_add(1, Ordering::Relaxed);
            Err(e)
        }
    }
}

/// Reads the upstream body to its end whatever the client does (detached), passing it on
/// while the client is there.
pub(crate) fn pump(
    mut rbody: Incoming,
    c: Arc<Counters>,
) -> mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>> {
    let (tx, rx) = mpsc::unbounded_channel::<Result<Bytes, std::io::Error>>();
    tokio::spawn(async move {
        let mut gone = false;
        loop {
            let frame = tokio::select! {
                f = rbody.frame() => f,
                _ = tx.closed(), if !gone => {
                    gone = true;
                    c.clients_gone.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            match frame {
                None => {
                    c.upstream_completed.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Some(Err(e)) => {
                    c.upstream_errors.fetch_add(1, Ordering::Relaxed);
                    // Pass the reset on to a client that is still there.
                    let _ = tx.send(Err(std::io::Error::other(e)));
                    break;
                }
                Some(Ok(f)) => {
                    let Ok(data) = f.into_data() else { continue };
                    let len = data.len() as u64;
                    if !gone && tx.send(Ok(data)).is_err() {
                        gone = true;
                        c.clients_gone.fetch_add(1, Ordering::Relaxed);
                    }
                    if gone {
                        c.bytes_after_client_gone.fetch_add(len, Ordering::Relaxed);
                    }
                }
            }
        }
    });
    rx
}

async fn send_upstream(cfg: &LossyConfig, req: Request<Full<Bytes>>) -> Result<Response<Incoming>> {
    send(cfg.upstream, cfg.upstream_http2, req).await
}

/// Sends `req` on a fresh connection to `upstream` (h2c when `http2`).
pub(crate) async fn send(
    upstream: SocketAddr,
    http2: bool,
    req: Request<Full<Bytes>>,
) -> Result<Response<Incoming>> {
    let tcp = TcpStream::connect(upstream)
        .await
        .with_context(|| format!("connecting to {upstream}"))?;
    let _ = tcp.set_nodelay(true);
    let io = TokioIo::new(tcp);
    if http2 {
        let (mut s, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(s.send_request(req).await?)
    } else {
        let (mut s, conn) = hyper::client::conn::http1::handshake(io).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(s.send_request(req).await?)
    }
}
