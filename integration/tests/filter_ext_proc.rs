//! An endpoint picker evicts a request (Gateway API Inference Extension): the EPP answers
//! Envoy's `ext_proc` stream with an `ImmediateResponse` while the response streams. Envoy
//! cuts the client's stream, but behind a hop that hides disconnects the engine generates
//! on for nobody (eviction frees nothing unless it reaches the engine). With kvguard in
//! the chain, the eviction reaches kvguard-control and the engine ends the request; a
//! stream the EPP lets through is untouched.
//!
//! Envoy runs the `ext_proc` wiring istiod gives a Gateway API gateway with an
//! InferencePool, read from `envoy-config/validate/upstream-facts.json` (every supported
//! Istio release): the listener-level filter after the WasmPlugins of phase STATS (so after
//! kvguard), headers skipped there, and per route an override to the EPP with the pool's
//! processing mode (full-duplex streamed bodies, trailers sent).
//!
//! The EPP here is a real `ext_proc` gRPC server (tonic, Envoy's own protos from
//! `envoy-types`) in the test process; it passes every body chunk back (full duplex) and
//! evicts a request after the number of response body chunks its `x-test-evict` request
//! header names.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeadersResponse, HttpBody, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse,
};
use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Control};
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::lossy::{self, LossyConfig};
use kvguard_integration::sim::{self, EndKind, SimConfig, SimHandle};
use kvguard_integration::wait::bounded;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use support::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

/// The request header naming after how many response body chunks the EPP evicts.
const EVICT_HEADER: &str = "x-test-evict";
/// Envoy's cluster for the EPP.
const EPP_CLUSTER: &str = "epp";

/// The EPP: continues every message, except the response body chunk its request asked
/// to be evicted at, which it answers with a 429 `ImmediateResponse`.
#[derive(Clone, Default)]
struct Epp {
    /// The `x-request-id` of each request evicted.
    evicted: Arc<Mutex<Vec<String>>>,
}

fn header(h: &HttpHeaders, name: &str) -> Option<String> {
    h.headers.as_ref()?.headers.iter().find_map(|v| {
        (v.key == name).then(|| {
            if v.raw_value.is_empty() {
                v.value.clone()
            } else {
                String::from_utf8_lossy(&v.raw_value).into_owned()
            }
        })
    })
}

/// What the EPP answers to one message of a request's ext_proc stream.
struct Decider {
    evict_after: Option<u32>,
    chunks: u32,
    id: String,
}

/// In full-duplex mode the EPP hands every body chunk back (Envoy forwards what it gets).
fn pass_on(b: HttpBody) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                    body: b.body,
                    end_of_stream: b.end_of_stream,
                    ..Default::default()
                })),
            }),
            ..Default::default()
        }),
    }
}

impl Decider {
    fn answer(&mut self, msg: Msg) -> Option<(Answer, bool)> {
        Some(match msg {
            Msg::RequestHeaders(h) => {
                self.evict_after = header(&h, EVICT_HEADER).and_then(|v| v.parse().ok());
                self.id = header(&h, "x-request-id").unwrap_or_default();
                (Answer::RequestHeaders(HeadersResponse::default()), false)
            }
            Msg::RequestBody(b) => (Answer::RequestBody(pass_on(b)), false),
            Msg::RequestTrailers(_) => {
                (Answer::RequestTrailers(TrailersResponse::default()), false)
            }
            Msg::ResponseHeaders(_) => (Answer::ResponseHeaders(HeadersResponse::default()), false),
            Msg::ResponseBody(b) => {
                self.chunks += 1;
                if Some(self.chunks) == self.evict_after {
                    let evict = ImmediateResponse {
                        status: Some(HttpStatus { code: 429 }),
                        body: b"evicted by the endpoint picker\n".to_vec(),
                        details: "epp_evicted".into(),
                        ..Default::default()
                    };
                    (Answer::ImmediateResponse(evict), true)
                } else {
                    (Answer::ResponseBody(pass_on(b)), false)
                }
            }
            Msg::ResponseTrailers(_) => {
                (Answer::ResponseTrailers(TrailersResponse::default()), false)
            }
        })
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Epp {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let evicted = self.evicted.clone();
        tokio::spawn(async move {
            let mut d = Decider {
                evict_after: None,
                chunks: 0,
                id: String::new(),
            };
            while let Ok(Some(m)) = inbound.message().await {
                let Some((answer, evict)) = m.request.and_then(|r| d.answer(r)) else {
                    continue;
                };
                if evict {
                    evicted.lock().unwrap().push(d.id.clone());
                }
                let r = ProcessingResponse {
                    response: Some(answer),
                    ..Default::default()
                };
                if tx.send(Ok(r)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Starts the EPP on a loopback port (the task ends with the test's runtime).
async fn spawn_epp() -> (SocketAddr, Epp) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let epp = Epp::default();
    let svc = ExternalProcessorServer::new(epp.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (addr, epp)
}

/// What istiod configures for a pool route, from upstream-facts.json: the per-route
/// processing mode, the same on every supported release, and the placement (after the
/// WasmPlugins of phase STATS, kvguard's).
fn istio_pool_mode() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../envoy-config/validate/upstream-facts.json"
    );
    let facts: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let releases = facts["istio"]["releases"].as_object().unwrap();
    let mut modes = releases
        .values()
        .map(|r| &r["facts"]["inferenceExtProcRouteModes"]["value"]);
    let mode = modes.next().unwrap().clone();
    assert!(
        modes.all(|m| *m == mode),
        "Istio releases differ in the pool's ext_proc mode: test each"
    );
    for r in releases.values() {
        let after = r["facts"]["inferenceExtProcPlacement"]["value"]["after"]
            .as_str()
            .unwrap();
        assert!(
            after.contains("STATS"),
            "istiod moved the ext_proc filter: {after}"
        );
    }
    // The stand-in EPP below speaks these modes only.
    for (k, want) in [
        ("request_body_mode", "FULL_DUPLEX_STREAMED"),
        ("response_body_mode", "FULL_DUPLEX_STREAMED"),
    ] {
        assert_eq!(
            mode[k], want,
            "istiod's pool mode changed ({mode}): teach the stand-in EPP"
        );
    }
    mode
}

/// Adds the EPP's cluster (HTTP/2) and the `ext_proc` wiring istiod gives a gateway with an
/// InferencePool: the listener's filter right after kvguard (headers skipped, a placeholder
/// service, fail open) and, on the route, the override to the EPP with the pool's mode.
fn with_epp(o: &mut EnvoyOptions, epp: SocketAddr, kvguard: bool) {
    let mode = istio_pool_mode();
    o.patch = Some(Arc::new(move |b| {
        b["static_resources"]["clusters"]
            .as_array_mut()
            .unwrap()
            .push(json!({
                "name": EPP_CLUSTER,
                "type": "STATIC",
                "connect_timeout": "2s",
                "load_assignment": {"cluster_name": EPP_CLUSTER, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {
                        "address": epp.ip().to_string(), "port_value": epp.port()}}}}]}]},
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}
                    }
                }
            }));
        let hcm = b
            .pointer_mut("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config")
            .unwrap();
        for route in hcm["route_config"]["virtual_hosts"][0]["routes"]
            .as_array_mut()
            .unwrap()
        {
            route["typed_per_filter_config"] = json!({"envoy.filters.http.ext_proc": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "overrides": {
                    "failure_mode_allow": true,
                    "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
                    "processing_mode": mode.clone()
                }
            }});
        }
        let filters = hcm["http_filters"].as_array_mut().unwrap();
        let at = if kvguard {
            assert_eq!(filters[0]["name"], "kvguard");
            1
        } else {
            0
        };
        filters.insert(
            at,
            json!({
                "name": "envoy.filters.http.ext_proc",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "dummy"}, "timeout": "10s"},
                    "failure_mode_allow": true,
                    "processing_mode": {"request_header_mode": "SKIP", "response_header_mode": "SKIP"},
                    "message_timeout": "1000s",
                    "metadata_options": {
                        "receiving_namespaces": {"untyped": ["envoy.lb"]},
                        "forwarding_namespaces": {"untyped": ["envoy.lb"]}
                    }
                }
            }),
        );
    }));
}

/// client → Envoy (kvguard when `kvguard`, and the EPP's ext_proc) → a hop that hides
/// disconnects → kvguard-control (no reaper: only an abort ends a request) → simulator at
/// 20 tokens/s.
struct Stack {
    sim: SimHandle,
    control: Control,
    envoy: Envoy,
    epp: Epp,
    _hop: lossy::LossyHandle,
}

async fn stack(kvguard: bool) -> Stack {
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
    let (epp_addr, epp) = spawn_epp().await;
    let mut o = if kvguard {
        EnvoyOptions::with_filter(hop.addr(), control.admin, stack::filter_config(0, 0))
            .vm_env("KVGUARD_SECRET", stack::SECRET)
    } else {
        EnvoyOptions::new(hop.addr())
    };
    with_epp(&mut o, epp_addr, kvguard);
    let envoy = Envoy::start(o).await.unwrap();
    Stack {
        sim,
        control,
        envoy,
        epp,
        _hop: hop,
    }
}

/// A stream of 1,000 tokens (50 s of generation) the EPP evicts after `chunks` response
/// body chunks; returns its request id once the client's stream has ended.
async fn evicted_stream(s: &Stack, chunks: u32) -> String {
    let n = chunks.to_string();
    let mut c = client::stream_sse(
        s.envoy.listener_addr(),
        "/v1/completions",
        &completion(1000, true),
        &[(EVICT_HEADER, n.as_str())],
        false,
    )
    .await
    .unwrap();
    assert_eq!(c.status, 200);
    let end = c.wait_end(W).await.unwrap();
    assert!(!end.saw_done(), "the evicted stream completed: {end:?}");
    let id = last_id(&s.sim);
    assert_eq!(*s.epp.evicted.lock().unwrap(), std::slice::from_ref(&id));
    id
}

/// With kvguard where Istio puts it: the evicted request ends in the engine (one abort,
/// `reason`: Envoy ends the stream with a local reply after the upstream was reached), a
/// request the EPP lets through completes with none.
async fn eviction_reaches_the_engine(reason: &str) {
    let s = stack(true).await;
    let id = evicted_stream(&s, 3).await;
    let rec = engine_end(&s.sim, &id).await;
    assert_eq!(rec.ended, Some(EndKind::Disconnected), "{rec:?}");
    assert!(rec.tokens_sent < 100, "the engine generated on: {rec:?}");
    let by_reason = s.control.aborts_by_reason().await.unwrap();
    assert_eq!(by_reason.get(reason), Some(&1.0), "{by_reason:?}");
    eprintln!("{}", access_line(&s.envoy, &id).await);
    assert_eq!(
        access_outcome(&s.envoy, &id).await,
        format!("aborted:{reason}")
    );

    let mut c = client::stream_sse(
        s.envoy.listener_addr(),
        "/v1/completions",
        &completion(8, true),
        &[],
        false,
    )
    .await
    .unwrap();
    assert!(c.wait_end(W).await.unwrap().completed());
    let healthy = last_id(&s.sim);
    assert_eq!(access_outcome(&s.envoy, &healthy).await, "completed");
    let rec = engine_end(&s.sim, &healthy).await;
    assert_eq!(rec.ended, Some(EndKind::Length), "{rec:?}");
    let by_reason = s.control.aborts_by_reason().await.unwrap();
    assert_eq!(by_reason.values().sum::<f64>(), 1.0, "{by_reason:?}");
    assert_vm_healthy(&s.envoy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_kvguard_an_evicted_request_generates_on_for_nobody() {
    bounded("eviction without kvguard", T, async {
        let s = stack(false).await;
        let id = evicted_stream(&s, 3).await;
        let at_eviction = s.sim.state().request(&id).unwrap().tokens_sent;
        // One second of generation after the client's stream was cut: nobody reads it.
        let st = s
            .sim
            .wait_state("the engine generates on", W, |st| {
                st.request(&id)
                    .is_some_and(|r| r.ended.is_none() && r.tokens_sent >= at_eviction + 20)
            })
            .await
            .unwrap();
        assert!(st.running.contains(&id), "{:?}", st.running);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_where_istio_puts_ext_proc_reaches_the_engine() {
    bounded("eviction, Istio's ext_proc wiring", T, async {
        eviction_reaches_the_engine("local_reply").await;
    })
    .await
    .unwrap();
}
