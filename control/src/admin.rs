//! The admin listener: its router and work limit (the abort API is [`crate::abort`], the
//! lease renewals [`crate::lease`]), the in-flight table, GPU and engine status, metrics,
//! health and readiness.

use crate::refusal::refuse;
use crate::state::AppState;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvguard_contract::peer::MAX_PEER_BODY;
use kvguard_contract::{ABORT_PATH, LEASE_PATH, PEER_ABORT_PATH, PEER_LEASE_PATH};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;

/// Deadline for a whole admin request, body included (408 beyond): a slow sender cannot
/// hold one of the listener's connection slots for long.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline for a client to send its request head on the admin listener, counted from
/// the end of its previous answer: so also how long an idle keep-alive connection is kept.
/// Above the renewal period (~5 s) so a gateway's renewals reuse their connection, and
/// above the idle timeout of every shipped client (Envoy's control clusters 10 s,
/// [`crate::peers::POOL_IDLE`]), which so always closes first.
pub const HEAD_READ_TIMEOUT: Duration = Duration::from_secs(15);

/// Admin requests doing work at once (verifying, answering, forwarding to peers,
/// encoding metrics), whatever the number of connections: an idle keep-alive connection
/// holds none. A request's body is read before it takes a slot.
pub const MAX_ADMIN_WORK: usize = 64;
/// How long a request waits for a work slot before it is answered 503 (`Retry-After: 1`).
pub const WORK_WAIT: Duration = Duration::from_secs(1);

/// The admin listener's router: every request bounded in time ([`REQUEST_TIMEOUT`]) and
/// in body size (a forwarded envelope's limit; each handler reads at most its own); every
/// one but the health probes under the work limit ([`MAX_ADMIN_WORK`]).
pub fn app(state: Arc<AppState>) -> Router {
    let work = Arc::new(Semaphore::new(MAX_ADMIN_WORK));
    Router::new()
        .route(ABORT_PATH, post(crate::abort::endpoint::abort))
        .route(LEASE_PATH, post(crate::lease::endpoints::admin))
        .route(PEER_ABORT_PATH, post(crate::abort::endpoint::peer_abort))
        .route(PEER_LEASE_PATH, post(crate::lease::endpoints::peer))
        .route("/v1/requests", get(requests))
        .route("/v1/gpu", get(gpu))
        .route("/v1/engine", get(engine))
        .route("/metrics", get(metrics))
        .route_layer(axum::middleware::from_fn_with_state(work, limit_work))
        .merge(probes())
        .layer(RequestBodyLimitLayer::new(MAX_PEER_BODY))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .with_state(state)
}

/// The router of an admin connection beyond the connection bound
/// ([`crate::server::ADMIN_PROBE_RESERVE`]): health probes only, anything else 503.
pub fn probe_app(state: Arc<AppState>) -> Router {
    probes()
        .fallback(|| async {
            let mut r = refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "busy",
                "every admin connection is taken: this one serves health probes only; retry"
                    .to_owned(),
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        })
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .with_state(state)
}

fn probes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
}

/// Reads the request's body, then waits (up to [`WORK_WAIT`]) for a work slot, held
/// until the answer is made; 503 without one.
async fn limit_work(State(work): State<Arc<Semaphore>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, MAX_PEER_BODY).await {
        Ok(b) => Body::from(b),
        // The handler reads the error and answers it its own way.
        Err(e) => Body::new(FailedBody(Some(e.into_inner()))),
    };
    let Ok(Ok(permit)) = tokio::time::timeout(WORK_WAIT, work.acquire_owned()).await else {
        let mut r = refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy",
            format!("{MAX_ADMIN_WORK} admin requests are being answered; retry"),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return r;
    };
    let r = next.run(Request::from_parts(parts, body)).await;
    drop(permit);
    r
}

/// A body whose read failed before the handler ran: the handler gets the same error.
struct FailedBody(Option<axum::BoxError>);

impl http_body::Body for FailedBody {
    type Data = bytes::Bytes;
    type Error = axum::BoxError;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::task::Poll::Ready(self.0.take().map(Err))
    }
}

async fn requests(State(st): State<Arc<AppState>>) -> Response {
    if !st.cfg.list_requests {
        return refuse(
            StatusCode::NOT_FOUND,
            "off",
            "GET /v1/requests is off: start kvguard-control with --list-requests to list the ids in flight".to_owned(),
        );
    }
    let now = st.clock.now();
    let mut rows: Vec<_> = st.entries().iter().map(|e| e.view(now)).collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.age_ms));
    Json(json!({ "inflight": rows.len(), "requests": rows })).into_response()
}

async fn gpu(State(st): State<Arc<AppState>>) -> Response {
    let status = st
        .gpu
        .lock()
        .map(|g| g.status().clone())
        .unwrap_or_default();
    Json(status).into_response()
}

async fn engine(State(st): State<Arc<AppState>>) -> Response {
    let s = st
        .engine_status
        .lock()
        .map(|s| s.clone())
        .unwrap_or_default();
    let now = st.clock.now();
    Json(json!({
        "engine_url": st.cfg.engine.base,
        "metrics_url": st.cfg.engine_metrics_url.to_string(),
        "ready": st.engine_ready(),
        "last_ok_ms_ago": s.last_ok.map(|t| now.saturating_duration_since(t).as_millis() as u64),
        "last_error": s.last_error,
        "flavour": s.flavour,
        "figures": s.figures,
        "inflight": st.inflight(),
        "abort_strategy": st.cfg.abort_strategy.as_str(),
        "dry_run": st.cfg.dry_run,
    }))
    .into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.refresh_pd_gauges();
    let text = crate::metrics::encode(&st.registry);
    let mut r = Response::new(Body::from(text));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    r
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(st): State<Arc<AppState>>) -> Response {
    if st.is_draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response();
    }
    if st.engine_ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        let why = st
            .engine_status
            .lock()
            .ok()
            .and_then(|s| s.last_error.clone())
            .unwrap_or_else(|| "no answer from the engine yet".to_owned());
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("engine not reachable: {why}\n"),
        )
            .into_response()
    }
}
