//! The P/D proxy: a test instrument shaped like vLLM's reference disaggregated proxies
//! (`toy_proxy_server.py`, the Mooncake proxy; docs/PD-ENGINES.md). For each completion it
//! sends the request to the prefill side with `max_tokens: 1`, `stream: false` and
//! `kv_transfer_params.do_remote_decode`, then sends the original request to the decode
//! side with the `kv_transfer_params` the prefill side answered, and streams the decode
//! side's answer back. Every request header but the hop-by-hop ones goes to both legs,
//! `x-request-id` included (the reference proxies mint their own id instead; a proxy in
//! front of kvguard must pass the client's on, as a LiteLLM in front of it must).
//!
//! Where the reference proxies lose a client's disconnect, so does this one:
//! - the prefill leg runs from a task of its own: a client that leaves meanwhile does not
//!   end it, and the decode leg is then never sent, so the prefill side holds the blocks
//!   until its lease runs out;
//! - with [`PdProxyConfig::hide_disconnects`] the decode leg is read to its end after the
//!   client left (a proxy that does not cancel its upstream call), as the lossy hop does;
//! - with [`PdProxyConfig::hand_off`] a test holds the request between the legs, so a
//!   client can leave there.

use crate::http::{bytes_response, read_body, ChannelBody, RespBody};
use crate::lossy::{self, Counters, LossyStats, HOP_BY_HOP};
use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// P/D proxy settings.
#[derive(Debug, Clone)]
pub struct PdProxyConfig {
    /// Address to bind; `None` = `127.0.0.1:0`.
    pub listen: Option<SocketAddr>,
    /// The prefill side (an engine, or the kvguard-control in front of it).
    pub prefill: SocketAddr,
    /// The decode side.
    pub decode: SocketAddr,
    /// Keep reading the decode side's answer after the client left.
    pub hide_disconnects: bool,
    /// Hold each request between its prefill answer and its decode leg until this reads
    /// `true` (a test's way to leave at the hand-off); `None`: no hold.
    pub hand_off: Option<tokio::sync::watch::Receiver<bool>>,
}

/// A running P/D proxy; dropping it stops accepting.
pub struct PdProxyHandle {
    server: crate::http::Server,
    counters: Arc<Counters>,
}

impl PdProxyHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// Counters so far (of the decode legs: `requests` counts client requests).
    pub fn stats(&self) -> LossyStats {
        self.counters.stats()
    }
}

/// Starts a P/D proxy on the current tokio runtime.
pub async fn spawn(config: PdProxyConfig) -> Result<PdProxyHandle> {
    let listener = crate::http::bind(config.listen)
        .await
        .context("binding the P/D proxy")?;
    let counters = Arc::new(Counters::default());
    let c2 = counters.clone();
    let cfg = Arc::new(config);
    let server = crate::http::serve(listener, move |req, _peer| {
        let (cfg, c) = (cfg.clone(), c2.clone());
        async move { Ok(forward(cfg, c, req).await) }
    })?;
    Ok(PdProxyHandle { server, counters })
}

fn error(status: u16, msg: String) -> Response<RespBody> {
    bytes_response(status, "text/plain", msg)
}

/// A request to `path` with `headers` (the client's, less the hop-by-hop ones) and a JSON
/// `body`.
fn leg(
    path: &str,
    to: SocketAddr,
    headers: &hyper::HeaderMap,
    body: &Value,
) -> Result<Request<Full<Bytes>>> {
    let mut b = Request::post(path).header("host", to.to_string());
    for (k, v) in headers {
        if !HOP_BY_HOP.contains(&k.as_str()) && k != "content-length" {
            b = b.header(k, v);
        }
    }
    Ok(b.body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?)
}

/// The prefill leg's body: the request with one token, no streaming, and the ask to hold
/// its blocks for a remote decode.
fn prefill_body(v: &Value) -> Value {
    let mut p = v.clone();
    p["max_tokens"] = json!(1);
    if p.get("max_completion_tokens").is_some() {
        p["max_completion_tokens"] = json!(1);
    }
    p["stream"] = json!(false);
    if let Some(o) = p.as_object_mut() {
        o.remove("stream_options");
    }
    p["kv_transfer_params"] = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null
    });
    p
}

async fn forward(
    cfg: Arc<PdProxyConfig>,
    c: Arc<Counters>,
    req: Request<Incoming>,
) -> Response<RespBody> {
    c.requests.fetch_add(1, Ordering::Relaxed);
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let body = match read_body(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => return error(400, format!("reading the request: {e}")),
    };
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        _ => return error(400, "the body must be a JSON object".into()),
    };
    let pre = match leg(&path, cfg.prefill, &parts.headers, &prefill_body(&v)) {
        Ok(r) => r,
        Err(e) => return error(500, format!("building the prefill request: {e:#}")),
    };
    // From a task of its own: a client that leaves now does not end the prefill.
    let (ptx, prx) = tokio::sync::oneshot::channel();
    let prefill = cfg.prefill;
    tokio::spawn(async move {
        let answer = async {
            let resp = lossy::send(prefill, false, pre).await?;
            let status = resp.status().as_u16();
            let bytes = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, bytes))
        };
        let _ = ptx.send(answer.await);
    });
    let (status, pbody) = match prx.await {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => return error(502, format!("prefill: {e:#}")),
        Err(_) => return error(502, "prefill: the task ended".into()),
    };
    if status != 200 {
        return bytes_response(status, "application/json", pbody);
    }
    let params = serde_json::from_slice::<Value>(&pbody)
        .ok()
        .and_then(|p| p.get("kv_transfer_params").cloned());
    let Some(params) = params else {
        return error(502, "prefill: no kv_transfer_params in the answer".into());
    };
    if let Some(mut gate) = cfg.hand_off.clone() {
        if gate.wait_for(|open| *open).await.is_err() {
            return error(503, "hand-off: the hold was dropped".into());
        }
    }
    let mut dec = v;
    dec["kv_transfer_params"] = params;
    let dreq = match leg(&path, cfg.decode, &parts.headers, &dec) {
        Ok(r) => r,
        Err(e) => return error(500, format!("building the decode request: {e:#}")),
    };
    let resp = match lossy::send(cfg.decode, false, dreq).await {
        Ok(r) => r,
        Err(e) => {
            c.upstream_errors.fetch_add(1, Ordering::Relaxed);
            return error(502, format!("decode: {e:#}"));
        }
    };
    let (rparts, rbody) = resp.into_parts();
    let mut out = if cfg.hide_disconnects {
        Response::new(
            ChannelBody {
                rx: lossy::pump(rbody, c.clone()),
                taken: None,
            }
            .boxed(),
        )
    } else {
        Response::new(rbody.map_err(std::io::Error::other).boxed())
    };
    *out.status_mut() = rparts.status;
    for (k, v) in &rparts.headers {
        if !HOP_BY_HOP.contains(&k.as_str()) && k != "content-length" {
            out.headers_mut().append(k, v.clone());
        }
    }
    out
}
