//! An inference pool's endpoint picker (EPP) evicts a request mid-stream the way the Gateway
//! API Inference Extension does: its ext_proc stream answers a response-body message with an
//! `ImmediateResponse` (issue 26.8). Headers were already sent, so Envoy resets the client's
//! stream and the upstream one. Behind a hop that hides resets (the lossy hop), the engine's
//! request ends only if kvguard's filter aborts it through kvguard-control; without the filter
//! the engine keeps generating for nobody. Eviction is valid only if revocation reaches the
//! engine (llm-d's design notes); this shows kvguard provides that path.
//!
//! The ext_proc server is a few lines of gRPC over hyper's HTTP/2 server with hand-encoded
//! protobuf: the test needs six message tags of `envoy.service.ext_proc.v3`, not the crates
//! (`tonic`, `envoy-types`) that would compile all of Envoy's API for them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::{Request, Response};
use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Control};
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::lossy::{self, LossyConfig};
use kvguard_integration::sim::{self, EndKind, SimConfig};
use kvguard_integration::wait::bounded;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use support::*;
use tokio::sync::mpsc;

/// Response-body messages answered with CONTINUE before the eviction.
const EVICT_AT_CHUNK: usize = 3;

/// A response body fed by a channel (the gRPC stream's messages).
struct ChannelBody(mpsc::UnboundedReceiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|m| m.map(|b| Ok(Frame::data(b))))
    }
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn read_varint(b: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.first()?;
        b.advance(1);
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Some(v);
        }
    }
    None
}

/// A length-delimited field.
fn field(number: u64, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    varint(number << 3 | 2, &mut out);
    varint(body.len() as u64, &mut out);
    out.extend_from_slice(body);
    out
}

/// Which `ProcessingRequest.request` is set: 2 request_headers, 3 response_headers,
/// 4 request_body, 5 response_body, 6/7 trailers.
fn request_kind(mut msg: &[u8]) -> Option<u64> {
    while !msg.is_empty() {
        let tag = read_varint(&mut msg)?;
        let (number, wire) = (tag >> 3, tag & 7);
        match wire {
            0 => {
                read_varint(&mut msg)?;
            }
            2 => {
                let len = read_varint(&mut msg)? as usize;
                if len > msg.len() {
                    return None;
                }
                msg.advance(len);
                if (2..=7).contains(&number) {
                    return Some(number);
                }
            }
            _ => return None,
        }
    }
    None
}

/// The `ProcessingResponse` for a request of `kind`: an empty (CONTINUE) answer of the
/// matching type (1..=6 = kind - 1), or `immediate_response` (7) with status 503.
fn answer(kind: u64, evict: bool) -> Vec<u8> {
    if evict {
        let mut status = Vec::new();
        varint(1 << 3, &mut status); // HttpStatus.code
        varint(503, &mut status);
        let mut imm = field(1, &status);
        imm.extend(field(5, b"evicted_by_endpoint_picker"));
        field(7, &imm)
    } else {
        field(kind - 1, &[])
    }
}

/// gRPC message framing: no compression, big-endian length.
fn frame(msg: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + msg.len());
    b.extend_from_slice(&[0]);
    b.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    b.extend_from_slice(msg);
    b.freeze()
}

/// One ext_proc stream: continue everything, evict at the `EVICT_AT_CHUNK`th response body
/// message.
async fn process(req: Request<Incoming>, evictions: Arc<AtomicUsize>) -> Response<ChannelBody> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut body = req.into_body();
        let mut buf = BytesMut::new();
        let mut chunks = 0;
        while let Some(Ok(f)) = body.frame().await {
            let Ok(data) = f.into_data() else { continue };
            buf.extend_from_slice(&data);
            while buf.len() >= 5 {
                let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                if buf.len() < 5 + len {
                    break;
                }
                let msg = buf.split_to(5 + len);
                let Some(kind) = request_kind(&msg[5..]) else {
                    return;
                };
                chunks += usize::from(kind == 5);
                let evict = kind == 5 && chunks == EVICT_AT_CHUNK;
                if tx.send(frame(&answer(kind, evict))).is_err() {
                    return;
                }
                if evict {
                    evictions.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    });
    Response::builder()
        .header("content-type", "application/grpc")
        .body(ChannelBody(rx))
        .unwrap()
}

/// The ext_proc server (HTTP/2 cleartext, as Envoy's gRPC client speaks it); the task ends
/// with the test's runtime.
async fn ext_proc_server() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let evictions = Arc::new(AtomicUsize::new(0));
    let count = evictions.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let count = count.clone();
                    async move { Ok::<_, std::convert::Infallible>(process(req, count).await) }
                });
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                        .await;
            });
        }
    });
    (addr, evictions)
}

/// Envoy's ext_proc filter, streaming response bodies to the server, and its cluster:
/// just before the router (after kvguard: it sees the response first), or first in the
/// chain (`first`: before kvguard; where a gateway puts the EPP's filter is its own choice).
fn with_ext_proc(o: &mut EnvoyOptions, server: SocketAddr, first: bool) {
    o.patch = Some(Arc::new(move |b| {
        let filters = b
            .pointer_mut(
                "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/http_filters",
            )
            .and_then(Value::as_array_mut)
            .unwrap();
        let at = if first { 0 } else { filters.len() - 1 };
        filters.insert(
            at,
            json!({
                "name": "envoy.filters.http.ext_proc",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "5s"},
                    "failure_mode_allow": false,
                    "message_timeout": "5s",
                    "processing_mode": {
                        "request_header_mode": "SEND", "response_header_mode": "SEND",
                        "request_body_mode": "NONE", "response_body_mode": "STREAMED",
                        "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"
                    }
                }
            }),
        );
        b["static_resources"]["clusters"]
            .as_array_mut()
            .unwrap()
            .push(json!({
                "name": "epp",
                "type": "STATIC",
                "connect_timeout": "2s",
                "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": server.ip().to_string(), "port_value": server.port()}}}}]}]},
                "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}
                }}
            }));
    }));
}

/// Streams a 1000-token completion (50 s at 20 tokens/s) through `envoy` until the EPP
/// evicts it; returns the engine's request id and the tokens it had sent by then.
async fn evicted_stream(
    envoy: &Envoy,
    sim: &sim::SimHandle,
    evictions: &AtomicUsize,
) -> (String, u64) {
    let mut s = client::stream_sse(
        envoy.listener_addr(),
        "/v1/completions",
        &completion(1000, true),
        &[],
        false,
    )
    .await
    .unwrap();
    assert_eq!(s.status, 200);
    let end = s.wait_end(W).await.unwrap();
    assert!(!end.completed(), "the stream was not evicted: {end:?}");
    assert_eq!(evictions.load(Ordering::SeqCst), 1, "the EPP evicted once");
    let id = last_id(sim);
    let sent = sim.state().request(&id).unwrap().tokens_sent;
    (id, sent)
}

/// The path: engine simulator (20 tokens/s), kvguard-control, the lossy hop, an Envoy with
/// the EPP's ext_proc filter (and kvguard's filter with `kvguard`), the ext_proc server.
struct Path {
    sim: sim::SimHandle,
    control: Control,
    _hop: lossy::LossyHandle,
    envoy: Envoy,
    evictions: Arc<AtomicUsize>,
}

async fn path(kvguard: bool, ext_proc_first: bool) -> Path {
    let sim = sim::spawn(SimConfig {
        token_rate: 20.0,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let off = ["--idle-timeout", "off", "--max-age", "off"].map(String::from);
    let control = Control::start(sim.addr(), any, any, &off).await.unwrap();
    let hop = lossy::spawn(LossyConfig::to(control.proxy)).await.unwrap();
    let (epp, evictions) = ext_proc_server().await;
    let mut o = if kvguard {
        EnvoyOptions::with_filter(hop.addr(), control.admin, stack::filter_config(0, 0))
            .vm_env("KVGUARD_SECRET", stack::SECRET)
    } else {
        EnvoyOptions::new(hop.addr())
    };
    with_ext_proc(&mut o, epp, ext_proc_first);
    let envoy = Envoy::start(o).await.unwrap();
    Path {
        sim,
        control,
        _hop: hop,
        envoy,
        evictions,
    }
}

/// With kvguard: the engine's request ends soon after the eviction; kvguard-control's
/// aborts by reason.
async fn eviction_with_kvguard(ext_proc_first: bool) -> std::collections::BTreeMap<String, f64> {
    let p = path(true, ext_proc_first).await;
    let (id, at_eviction) = evicted_stream(&p.envoy, &p.sim, &p.evictions).await;
    let rec = p
        .sim
        .wait_state("the engine ends the evicted request", W, |s| {
            s.request(&id).is_some_and(|r| r.ended.is_some())
        })
        .await
        .unwrap()
        .request(&id)
        .cloned()
        .unwrap();
    assert_eq!(rec.ended, Some(EndKind::Disconnected), "{rec:?}");
    assert!(
        rec.tokens_sent < at_eviction + 100,
        "the engine generated on after the eviction: {rec:?}"
    );
    assert_vm_healthy(&p.envoy);
    p.control.aborts_by_reason().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epp_eviction_mid_stream_reaches_the_engine_through_kvguard() {
    let by_reason = bounded("ext_proc after kvguard", T, eviction_with_kvguard(false))
        .await
        .unwrap();
    // kvguard sees the ext_proc's reply after the upstream was reached: `local_reply` (so
    // it does with the ext_proc filter first, below).
    assert_eq!(by_reason.get("local_reply"), Some(&1.0), "{by_reason:?}");
    assert_eq!(by_reason.values().sum::<f64>(), 1.0, "{by_reason:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_by_an_ext_proc_placed_before_kvguard_reaches_the_engine_too() {
    let by_reason = bounded("ext_proc before kvguard", T, eviction_with_kvguard(true))
        .await
        .unwrap();
    assert_eq!(by_reason.get("local_reply"), Some(&1.0), "{by_reason:?}");
    assert_eq!(by_reason.values().sum::<f64>(), 1.0, "{by_reason:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_kvguard_the_engine_generates_on_after_an_eviction() {
    bounded("ext_proc eviction without kvguard", T, async {
        let p = path(false, false).await;
        let (id, at_eviction) = evicted_stream(&p.envoy, &p.sim, &p.evictions).await;
        // 40 more tokens (2 s at 20/s) for a client that is gone: the reset stopped at the hop.
        let st = p
            .sim
            .wait_state("the engine generates on", W, |s| {
                s.request(&id)
                    .is_some_and(|r| r.tokens_sent >= at_eviction + 40)
            })
            .await
            .unwrap();
        assert_eq!(st.request(&id).unwrap().ended, None);
        let by_reason = p.control.aborts_by_reason().await.unwrap();
        assert_eq!(by_reason.values().sum::<f64>(), 0.0, "{by_reason:?}");
    })
    .await
    .unwrap();
}
