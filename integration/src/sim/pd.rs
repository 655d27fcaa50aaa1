//! Prefill/decode disaggregation in the simulator, shaped like vLLM 0.32's NixlConnector
//! (docs/PD-ENGINES.md has the engine's source behind each rule):
//!
//! - **Prefill role.** A request whose body has `kv_transfer_params.do_remote_decode`
//!   (the P/D proxy sends it with `max_tokens: 1`) runs as usual; once it finished at its
//!   length its blocks stay allocated, held for the decode side, and the answer carries the
//!   `kv_transfer_params` to read them with (`remote_request_id` = this replica's engine id,
//!   `remote_host`/`remote_port` = this simulator). The blocks go when the decode side
//!   notifies (`POST /sim/kv/notify`, vLLM's NIXL notification) or when the lease runs out
//!   ([`SimConfig::kv_lease_ms`](super::SimConfig::kv_lease_ms), extended by decode-side
//!   heartbeats, `POST /sim/kv/heartbeat`). Nothing else frees them: a finished request is
//!   out of reach of the abort APIs and of its closed connection, as in vLLM.
//! - **Decode role.** A request whose body has `kv_transfer_params.do_remote_prefill`
//!   heartbeats the prefill replica while it waits, reads the blocks once admitted
//!   ([`SimConfig::kv_pull_ms`](super::SimConfig::kv_pull_ms)) and notifies, then
//!   generates. Ended before its read (client gone, abort API) or refused with an error, it
//!   notifies at once (`pulled: false`), so the prefill side lets go (vllm#19223, #41269).

use super::engine::Sim;
use super::KvRelease;
use crate::http::{json_response, read_body, RespBody};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Weak;
use std::time::Duration;

/// The prefill replica a decode request reads from (its `kv_transfer_params`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    /// The prefill simulator (`remote_host`:`remote_port`).
    pub addr: SocketAddr,
    /// The prefill replica's id of the request (`remote_request_id`).
    pub request_id: String,
}

/// Whether `v` (a request body) asks the prefill side to hold its blocks for a remote
/// decode.
pub fn wants_remote_decode(v: &Value) -> bool {
    v.pointer("/kv_transfer_params/do_remote_decode")
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// The prefill replica named by `v` (a request body) when it asks to read its prompt's
/// blocks from one.
pub fn remote_prefill(v: &Value) -> Option<Remote> {
    let p = v.get("kv_transfer_params")?;
    if !p.get("do_remote_prefill")?.as_bool()? {
        return None;
    }
    let host = p.get("remote_host")?.as_str()?;
    let port = u16::try_from(p.get("remote_port")?.as_u64()?).ok()?;
    Some(Remote {
        addr: SocketAddr::new(host.parse().ok()?, port),
        request_id: p.get("remote_request_id")?.as_str()?.to_string(),
    })
}

/// The `kv_transfer_params` a prefill replica answers with for request `engine_id`
/// holding `blocks` blocks.
pub fn transfer_params(sim: &Sim, engine_id: &str, blocks: u32) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_request_id": engine_id,
        "remote_engine_id": format!("sim-{}", sim.addr.port()),
        "remote_host": sim.addr.ip().to_string(),
        "remote_port": sim.addr.port(),
        "remote_block_ids": (0..blocks).collect::<Vec<_>>(),
        "tp_size": 1
    })
}

/// `POST /sim/kv/notify {"request_id", "pulled"}`: the decode side is done with the
/// blocks held under `request_id`.
pub(crate) async fn notify_endpoint(sim: &Sim, req: Request<Incoming>) -> Response<RespBody> {
    let body = read_body(req.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(id) = v.get("request_id").and_then(Value::as_str) else {
        return json_response(400, &json!({"error": "missing \"request_id\""}));
    };
    let why = if v.get("pulled").and_then(Value::as_bool).unwrap_or(true) {
        KvRelease::Pulled
    } else {
        KvRelease::NotPulled
    };
    let released = sim.release_held(id, why);
    json_response(200, &json!({"released": released}))
}

/// `POST /sim/kv/heartbeat {"request_ids": [..]}`: the decode side still holds these.
pub(crate) async fn heartbeat_endpoint(sim: &Sim, req: Request<Incoming>) -> Response<RespBody> {
    let body = read_body(req.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let ids: Vec<String> = v
        .get("request_ids")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|i| i.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    sim.heartbeat(&ids);
    json_response(200, &json!({}))
}

/// The prefill replica's lease reaper: every 50 ms (vLLM's engine steps while it holds
/// blocks for a decode side), lets go of the holds whose lease ran out; ends with the
/// simulator.
pub(crate) async fn reap_leases(sim: Weak<Sim>) {
    let mut every = tokio::time::interval(Duration::from_millis(50));
    loop {
        every.tick().await;
        let Some(sim) = sim.upgrade() else {
            return;
        };
        sim.expire_leases();
    }
}

/// Posts `body` to `path` on the prefill simulator at `addr` (bounded; an error is
/// dropped: a prefill replica that is gone holds nothing).
async fn post(addr: SocketAddr, path: &str, body: Value) {
    let call = async {
        let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .ok()?;
        tokio::spawn(conn);
        let req = Request::post(path)
            .header(hyper::header::HOST, addr.to_string())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .ok()?;
        let resp = send.send_request(req).await.ok()?;
        resp.into_body().collect().await.ok()
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), call).await;
}

/// The decode side's NIXL notification: done with `remote`'s blocks (`pulled`: read them;
/// else gave the request up).
pub async fn notify(remote: &Remote, pulled: bool) {
    post(
        remote.addr,
        "/sim/kv/notify",
        json!({"request_id": remote.request_id, "pulled": pulled}),
    )
    .await;
}

/// The decode side's heartbeat for `remote`'s blocks.
pub async fn heartbeat(remote: &Remote) {
    post(
        remote.addr,
        "/sim/kv/heartbeat",
        json!({"request_ids": [remote.request_id]}),
    )
    .await;
}

/// A decode request's duty to tell its prefill replica it is done with the blocks: the
/// read does it ([`PullDuty::pulled`]); dropped before that (the request ended or was
/// refused), it tells the prefill side it gave them up.
pub(crate) struct PullDuty {
    remote: Option<Remote>,
}

impl PullDuty {
    pub(crate) fn new(remote: Option<Remote>) -> PullDuty {
        PullDuty { remote }
    }

    /// The prefill replica still waiting for this request's read.
    pub(crate) fn pending(&self) -> Option<&Remote> {
        self.remote.as_ref()
    }

    /// The read finished: notifies the prefill side.
    pub(crate) async fn pulled(&mut self) {
        if let Some(r) = self.remote.take() {
            notify(&r, true).await;
        }
    }
}

impl Drop for PullDuty {
    fn drop(&mut self) {
        if let Some(r) = self.remote.take() {
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move { notify(&r, false).await });
            }
        }
    }
}
