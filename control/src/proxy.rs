//! The proxy listener: every request is tracked by its `x-request-id` and streamed to the
//! engine and back without buffering. Each request gets its own engine connection, so
//! that ending it closes exactly its TCP connection (vLLM, TGI and llama.cpp abort the
//! sequence when the client connection closes); it is opened on the request's path and
//! closed after its one response.

use crate::config::AbortStrategy;
use crate::downstream::Downstream;
use crate::lease::{LeaseMode, RenewError};
use crate::refusal::{REFUSALS, REFUSAL_LOG_PERIOD};
use crate::scan::{BodyKind, Scanner};
use crate::state::{AppState, Refusal};
use crate::table::Entry;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::{BoxError, Router};
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{StatusCode, Version};
use http_body::{Body as HttpBody, Frame};
use http_body_util::Limited;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use kvguard_contract::{
    sse, stamp, AbortReason, RequestId, TagHeader, CONTROL_HEADER, INSTANCE_HEADER,
    REQUEST_ID_HEADER,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::task::AbortHandle;
use tokio_util::sync::WaitForCancellationFutureOwned;

/// Deadline for connecting to the engine.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the engine gave no response head.
#[derive(Debug)]
enum SendError {
    /// No connection to the engine (the message says why).
    Unreachable(String),
    /// The request was sent (or could not be) and failed before a response head.
    Failed(hyper::Error),
}

/// Sends `req` on a new engine connection of its own; `attach` receives the connection
/// task's handle before anything is sent (aborting it closes the connection).
async fn send_to_engine(
    authority: &str,
    req: http::Request<Body>,
    attach: impl FnOnce(AbortHandle),
    open_conns: prometheus_client::metrics::gauge::Gauge,
) -> Result<http::Response<Incoming>, SendError> {
    let tcp = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(authority)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Err(SendError::Unreachable(e.to_string())),
        Err(_) => {
            return Err(SendError::Unreachable(format!(
                "no connection within {CONNECT_TIMEOUT:?}"
            )))
        }
    };
    let _ = tcp.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(TokioIo::new(tcp))
        .await
        .map_err(|e| SendError::Unreachable(e.to_string()))?;
    // Counted from the handshake until the connection task ends (closed or aborted).
    let open = OpenConn::new(open_conns);
    let task = tokio::spawn(async move {
        let _open = open;
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "engine connection ended with an error");
        }
    });
    attach(task.abort_handle());
    sender.send_request(req).await.map_err(SendError::Failed)
}

/// One open engine connection in `kvguard_control_engine_connections`, for as long as
/// it lives.
struct OpenConn(prometheus_client::metrics::gauge::Gauge);

impl OpenConn {
    fn new(g: prometheus_client::metrics::gauge::Gauge) -> OpenConn {
        g.inc();
        OpenConn(g)
    }
}

impl Drop for OpenConn {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The proxy listener's router: every path goes to the engine, except the in-band lease
/// renewal (contract §8), which kvguard-control answers itself.
pub fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .route(
            kvguard_contract::DATA_LEASE_PATH,
            axum::routing::post(crate::lease::endpoints::data),
        )
        .fallback(proxy)
        .with_state(state)
}

/// A JSON error in the OpenAI shape: `{"error":{"message","type","code",...}}`.
pub fn error_response(
    status: StatusCode,
    kind: &str,
    message: String,
    request_id: Option<&RequestId>,
    reason: Option<AbortReason>,
) -> Response {
    error_response_with(status, kind, message, request_id, reason, None)
}

/// [`error_response`] with one more field in `error`.
fn error_response_with(
    status: StatusCode,
    kind: &str,
    message: String,
    request_id: Option<&RequestId>,
    reason: Option<AbortReason>,
    extra: Option<(&'static str, serde_json::Value)>,
) -> Response {
    let mut err = serde_json::json!({
        "message": message,
        "type": kind,
        "code": status.as_u16(),
    });
    if let Some(id) = request_id {
        err["request_id"] = id.as_str().into();
    }
    if let Some(r) = reason {
        err["reason"] = r.as_str().into();
    }
    if let Some((k, v)) = extra {
        err[k] = v;
    }
    let mut resp = (status, axum::Json(serde_json::json!({ "error": err }))).into_response();
    if let Some(id) = request_id {
        if let Ok(v) = HeaderValue::from_str(id.as_str()) {
            resp.headers_mut().insert(REQUEST_ID_HEADER, v);
        }
    }
    resp
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and those named by `Connection`, removed both ways.
fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
    ] {
        h.remove(n);
    }
    h.remove("keep-alive");
    h.remove("proxy-connection");
}

/// Ends tracking when dropped: removes the entry, closes the engine connection, counts
/// the end (clean or not).
struct Guard {
    state: Arc<AppState>,
    entry: Arc<Entry>,
    cause: Option<&'static str>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let cause = if self.entry.ended().is_some() && self.cause != Some("complete") {
            "aborted"
        } else {
            self.cause.unwrap_or("client_gone")
        };
        self.state.remove(&self.entry);
        self.entry.close_engine_conn();
        self.state.count_orphan_cost(&self.entry);
        self.entry.finish();
        let v = self.entry.view(self.state.clock.now());
        tracing::debug!(
            request_id = %self.entry.id,
            path = %self.entry.path,
            cause,
            status = v.status,
            events = v.events,
            age_ms = v.age_ms,
            "request ended"
        );
        self.state.metrics.request_end(cause);
    }
}

/// Records the gateway instance a request came through (`x-kvguard-instance`, set by the
/// filter) and takes it as that instance's evidence of life (contract §8): a signed proof
/// is verified (once per value) and taken as an in-band renewal; a tag without one (an
/// older filter) refreshes a lease already held; a value that is neither, or a proof
/// that does not verify, tags nothing (counted).
fn tag_instance(st: &Arc<AppState>, entry: &Entry, headers: &axum::http::HeaderMap) {
    if st.cfg.lease_mode == LeaseMode::Off {
        return;
    }
    let Some(value) = headers.get(INSTANCE_HEADER) else {
        return;
    };
    let Some(h) = TagHeader::parse(value.as_bytes()) else {
        st.metrics.lease.proof("bad_request");
        return;
    };
    let now = st.clock.now();
    let Some(p) = &h.proof else {
        entry.set_instance(h.tag);
        st.leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .touch(h.tag, now);
        return;
    };
    let keys = st.keys();
    let mut leases = st.leases.lock().unwrap_or_else(|p| p.into_inner());
    if !leases.verified(value.as_bytes(), || p.verify(&keys.accept)) {
        drop(leases);
        st.metrics.lease.proof("unauthorized");
        let now_ms = st.clock.unix_secs().saturating_mul(1000);
        if let Some(held) = REFUSALS.admit(now_ms, REFUSAL_LOG_PERIOD) {
            tracing::warn!(instance = %h.tag.instance, refused_since_last_line = held, "a request's proof of life does not verify under any key: the request is not tagged (the filter's first key is not one of kvguard-control's keys, or the header was forged)");
        }
        return;
    }
    entry.set_instance(h.tag);
    let taken = leases.prove(h.tag, &p.proof, now);
    st.metrics.lease.census(leases.census());
    // A listener not yet known to answer is asked at once, while the gateway surely lives.
    let ask = leases.calibrate(h.tag.instance, now);
    drop(leases);
    if let Some(addr) = ask {
        crate::lease::enforce::probe(st, h.tag.instance, addr);
    }
    st.metrics.lease.proof(match taken {
        Ok(_) => "accepted",
        Err(RenewError::Duplicate) => "duplicate",
        Err(_) => "replay",
    });
    if taken == Ok(true) {
        tracing::info!(instance = %h.tag.instance, counter = p.proof.counter, host = ?p.proof.host.map(|h| h.to_string()), listener = ?p.proof.listener, "gateway lease taken (proof of life on a request)");
    }
}

async fn proxy(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let id = match parts.headers.get(REQUEST_ID_HEADER) {
        Some(v) => match RequestId::try_new(v.as_bytes()) {
            Ok(id) => Some(id),
            Err(e) => {
                // Refused as a key (contract §1): counted, replaced by a fresh id.
                st.metrics.request("bad_request_id");
                tracing::debug!(error = %e, "x-request-id refused as a key; minting a new one");
                None
            }
        },
        None => None,
    };
    let id = match id {
        Some(id) => id,
        None => match RequestId::try_new(uuid::Uuid::new_v4().to_string().as_bytes()) {
            Ok(id) => id,
            Err(e) => {
                return error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "kvguard_internal",
                    format!("cannot mint a request id: {e}"),
                    None,
                    None,
                )
            }
        },
    };
    let max_body = st.cfg.max_request_body;
    if let Some(len) = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if len > max_body as u64 {
            st.metrics.request("body_too_large");
            return error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                "kvguard_body_too_large",
                format!("request body is {len} bytes, at most {max_body} are accepted"),
                Some(&id),
                None,
            );
        }
    }
    let entry = match st.admit(
        id.clone(),
        parts.method.to_string(),
        parts.uri.path().to_owned(),
    ) {
        Ok(e) => {
            tag_instance(&st, &e, &parts.headers);
            e
        }
        Err(Refusal::Tombstoned(t)) => {
            st.metrics.request("refused_tombstone");
            tracing::info!(request_id = %id, reason = %t.reason, "refused a request whose id was aborted before it arrived");
            // A decode leg carries a prefill engine's held blocks: this engine rejects
            // them on its behalf, so that the prefill engine lets them go.
            let params = match axum::body::to_bytes(body, max_body).await {
                Ok(b) => crate::pd::remote_prefill_params(&b),
                Err(_) => None,
            };
            let released = match params {
                Some(p) => Some(st.reject_tombstoned_decode(&id, &p).await),
                None => None,
            };
            return error_response_with(
                StatusCode::CONFLICT,
                "kvguard_aborted",
                "this request id was aborted (it is tombstoned): the abort overtook the request; \
                 it is not sent to the engine. Retry with a new request id."
                    .to_owned(),
                Some(&id),
                Some(t.reason),
                released.map(|r| ("kv_released", serde_json::Value::Bool(r))),
            );
        }
        Err(Refusal::Full(n)) => {
            st.metrics.request("refused_full");
            let mut r = error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "kvguard_overloaded",
                format!("{n} requests are in flight (--max-inflight); retry later"),
                Some(&id),
                None,
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return r;
        }
        Err(Refusal::Draining) => {
            st.metrics.request("refused_draining");
            let mut r = error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "kvguard_draining",
                "kvguard-control is shutting down; retry on another replica".to_owned(),
                Some(&id),
                None,
            );
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
    };
    st.metrics.request("tracked");
    if let Some(d) = Downstream::current() {
        entry.set_downstream(d);
    }
    let mut guard = Guard {
        state: st.clone(),
        entry: entry.clone(),
        cause: None,
    };

    // The engine request: origin-form URI, hop-by-hop headers removed, the id passed on.
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    if let Ok(v) = HeaderValue::from_str(&st.cfg.engine.authority) {
        headers.insert(header::HOST, v);
    }
    if let Ok(v) = HeaderValue::from_str(id.as_str()) {
        headers.insert(REQUEST_ID_HEADER, v);
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let body = if st.cfg.abort_strategy == AbortStrategy::Sglang {
        // SGLang knows a request by its body's `rid` only: abort_request needs it.
        match axum::body::to_bytes(body, max_body).await {
            Ok(b) => match crate::pd::inject_rid(&b, &id) {
                Some(with_rid) => {
                    headers.remove(header::CONTENT_LENGTH);
                    Body::from(with_rid)
                }
                None => Body::from(b),
            },
            Err(_) => {
                guard.cause = Some("client_gone");
                st.metrics.request("body_too_large");
                return error_response(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "kvguard_body_too_large",
                    format!("request body over {max_body} bytes, or unreadable"),
                    Some(&id),
                    None,
                );
            }
        }
    } else {
        body
    };
    let mut ureq = http::Request::new(Body::new(SequenceBody {
        inner: Limited::new(body, max_body),
        kept: Vec::new(),
        len: 0,
        entry: Some(entry.clone()),
    }));
    *ureq.method_mut() = parts.method;
    *ureq.version_mut() = Version::HTTP_11;
    *ureq.headers_mut() = headers;
    match path.parse() {
        Ok(u) => *ureq.uri_mut() = u,
        Err(_) => {
            guard.cause = Some("upstream_error");
            return error_response(
                StatusCode::BAD_REQUEST,
                "kvguard_bad_request",
                "bad path".into(),
                Some(&id),
                None,
            );
        }
    }

    let cancelled = entry.cancel_token().clone();
    let aborted = |entry: &Entry| {
        let reason = entry.ended().unwrap_or(AbortReason::Operator);
        let status = match reason {
            AbortReason::Operator
            | AbortReason::DownstreamReset
            | AbortReason::UpstreamReset
            | AbortReason::LocalReply => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::GATEWAY_TIMEOUT,
        };
        error_response(
            status,
            "kvguard_aborted",
            format!("kvguard-control ended this request before the engine answered ({reason})"),
            Some(&entry.id),
            Some(reason),
        )
    };
    let engine_down = |e: String| {
        tracing::warn!(request_id = %id, engine = %st.cfg.engine.base, error = %e, "engine unreachable");
        error_response(
            StatusCode::BAD_GATEWAY,
            "kvguard_engine_unreachable",
            format!(
                "kvguard-control could not reach the engine at {}: {e}",
                st.cfg.engine.base
            ),
            Some(&id),
            None,
        )
    };

    // Its own engine connection: closing it ends exactly this request. The handle is
    // attached before anything is sent; the sender is dropped with the response head, so
    // the connection closes once this one response ends.
    let sent = tokio::select! {
        biased;
        _ = cancelled.cancelled() => { guard.cause = Some("aborted"); return aborted(&entry); }
        r = send_to_engine(&st.cfg.engine.authority, ureq, |h| entry.set_conn(h), st.metrics.engine_connections.clone()) => r,
    };
    let resp = match sent {
        Ok(resp) => Ok(resp),
        Err(SendError::Unreachable(e)) => {
            guard.cause = Some("engine_unreachable");
            return engine_down(e);
        }
        Err(SendError::Failed(e)) => Err(e),
    };
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            if entry.ended().is_some() {
                guard.cause = Some("aborted");
                return aborted(&entry);
            }
            if is_length_limit(&e) {
                guard.cause = Some("client_gone");
                st.metrics.request("body_too_large");
                return error_response(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "kvguard_body_too_large",
                    format!("request body over {max_body} bytes"),
                    Some(&id),
                    None,
                );
            }
            guard.cause = Some("upstream_error");
            return error_response(
                StatusCode::BAD_GATEWAY,
                "kvguard_engine_error",
                format!("the engine failed before answering: {e}"),
                Some(&id),
                None,
            );
        }
    };
    let (mut rparts, rbody) = resp.into_parts();
    strip_hop_by_hop(&mut rparts.headers);
    rparts.version = Version::default();
    let kind = BodyKind::from_response(
        rparts
            .headers
            .get(header::CONTENT_TYPE)
            .map(HeaderValue::as_bytes),
        rparts
            .headers
            .get(header::CONTENT_ENCODING)
            .map(HeaderValue::as_bytes),
    );
    entry.record_response(rparts.status.as_u16(), kind, st.clock.now());
    if let (Some(addr), Some(key)) = (st.cfg.advertise, st.keys().stamp.as_ref()) {
        let v = stamp::stamp(key, addr, &id, st.clock.unix_secs());
        if let Ok(v) = HeaderValue::from_str(&v) {
            rparts.headers.insert(CONTROL_HEADER, v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(id.as_str()) {
        rparts.headers.insert(REQUEST_ID_HEADER, v);
    }
    // A finished prefill leg's answer names the blocks its engine now holds for the
    // decode side: kept for the hand-off table.
    let handoff = (entry.pd_leg() == Some(crate::pd::PdLeg::Prefill) && rparts.status.is_success())
        .then(Vec::new);
    let body = TrackedBody {
        inner: Some(rbody),
        scanner: Scanner::new(kind),
        cancelled: Box::pin(cancelled.cancelled_owned()),
        guard,
        done: false,
        handoff,
    };
    Response::from_parts(rparts, Body::new(body))
}

/// Request bodies up to this size are read for the engine sequences they make
/// ([`crate::table::engine_sequences`]); a larger one counts as one sequence.
pub const SEQUENCE_SCAN_MAX: usize = 1024 * 1024;

/// The request body on its way to the engine, unchanged: its frames (up to
/// [`SEQUENCE_SCAN_MAX`] bytes, kept as shared `Bytes`, not copied) are read once it ends
/// for the engine sequences the request makes (`n` × prompts), set on its entry.
struct SequenceBody<B> {
    inner: B,
    kept: Vec<Bytes>,
    len: usize,
    /// Until the count is set.
    entry: Option<Arc<Entry>>,
}

impl<B> SequenceBody<B> {
    fn count(&mut self) {
        let Some(entry) = self.entry.take() else {
            return;
        };
        if self.len <= SEQUENCE_SCAN_MAX {
            let body = self.kept.concat();
            entry.set_sequences(crate::table::engine_sequences(&body));
            if let Some(leg) = crate::pd::leg_of(&body) {
                entry.set_pd_leg(leg);
            }
        }
        self.kept = Vec::new();
    }
}

impl<B> HttpBody for SequenceBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(_)) = (frame.data_ref(), &this.entry) {
                    this.len = this.len.saturating_add(data.len());
                    if this.len <= SEQUENCE_SCAN_MAX {
                        this.kept.push(data.clone());
                    } else {
                        this.kept = Vec::new();
                    }
                }
                // hyper stops polling a body that says it has ended.
                if this.inner.is_end_stream() {
                    this.count();
                }
            }
            Poll::Ready(None) => this.count(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Whether an error (or one of its sources) is the request body's size limit.
fn is_length_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    false
}

/// The engine's response body on its way to the client: counts data events, and ends
/// with the contract's final SSE event when kvguard ends the request.
struct TrackedBody {
    inner: Option<Incoming>,
    scanner: Scanner,
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    guard: Guard,
    done: bool,
    /// A prefill leg's answer, kept (up to [`HANDOFF_ANSWER_MAX`] bytes) for its
    /// `kv_transfer_params`.
    handoff: Option<Vec<u8>>,
}

/// Largest prefill answer read for its `kv_transfer_params` (one token and the block ids).
pub const HANDOFF_ANSWER_MAX: usize = 1024 * 1024;

impl TrackedBody {
    /// The response ended cleanly: a prefill leg's hand-off is recorded.
    fn record_handoff(&mut self) {
        let Some(answer) = self.handoff.take() else {
            return;
        };
        if let Some(params) = crate::pd::params_of(&answer) {
            let st = &self.guard.state;
            st.record_handoff(self.guard.entry.id.clone(), params);
        }
    }

    /// The engine's body ended and all of it was handed on: the request completed.
    fn complete(&mut self) {
        self.done = true;
        self.inner = None;
        self.guard.cause = Some("complete");
        self.record_handoff();
    }

    fn finish_aborted(&mut self) -> Option<Result<Frame<Bytes>, BoxError>> {
        self.done = true;
        self.inner = None;
        self.guard.cause = Some("aborted");
        self.guard.entry.close_engine_conn();
        let reason = self.guard.entry.ended().unwrap_or(AbortReason::Operator);
        if self.scanner.kind() == BodyKind::Sse {
            let event = format!(
                "{}{}",
                self.scanner.event_boundary_prefix(),
                sse::abort_event(reason)
            );
            Some(Ok(Frame::data(Bytes::from(event))))
        } else {
            Some(Err(
                format!("kvguard-control ended the request ({reason})").into()
            ))
        }
    }
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if this.cancelled.as_mut().poll(cx).is_ready() {
            return Poll::Ready(this.finish_aborted());
        }
        let Some(inner) = this.inner.as_mut() else {
            this.done = true;
            return Poll::Ready(None);
        };
        // The gateway's connection asks for a frame only once it has room for one: the
        // drain's progress, and from here a silence is the engine's ([`crate::table::Flow`]).
        let entry = &this.guard.entry;
        entry.record_demand(this.guard.state.clock.now());
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                // hyper stops polling a response whose content-length is written, so the
                // end of such a body is seen here, not as `Ready(None)`.
                let at_end = this.inner.as_ref().is_some_and(HttpBody::is_end_stream);
                let complete = entry.record_frame(this.guard.state.clock.now(), at_end);
                if let Some(data) = frame.data_ref() {
                    if let Some(kept) = this.handoff.as_mut() {
                        if kept.len() + data.len() <= HANDOFF_ANSWER_MAX {
                            kept.extend_from_slice(data);
                        } else {
                            this.handoff = None;
                        }
                    }
                    if this.scanner.kind() == BodyKind::Other {
                        // Nothing to count in it: any frame is progress.
                        if !data.is_empty() {
                            this.guard
                                .entry
                                .record_progress(this.guard.state.clock.now());
                        }
                    } else {
                        let n = this.scanner.feed(data);
                        if n > 0 {
                            this.guard
                                .entry
                                .record_events(n, this.guard.state.clock.now());
                            this.guard.state.metrics.data_events.inc_by(n);
                        }
                    }
                }
                if complete {
                    this.complete();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                if this.guard.entry.cancel_token().is_cancelled() {
                    return Poll::Ready(this.finish_aborted());
                }
                this.done = true;
                this.inner = None;
                this.guard.cause = Some("upstream_error");
                tracing::info!(request_id = %this.guard.entry.id, error = %e, "engine stream ended with an error");
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(None) => {
                this.complete();
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret-hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("x-request-id", HeaderValue::from_static("abc"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-request-id"));
    }
}
