//! The admin listener: the abort API (contract §3), the in-flight table, GPU and engine
//! status, metrics, health and readiness.

use crate::state::AppState;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvguard_contract::abort::MAX_ABORT_BODY;
use kvguard_contract::signature::{self, SignatureError};
use kvguard_contract::{AbortAnswer, AbortRequest, ABORT_PATH, SIGNATURE_HEADER};
use serde_json::json;
use std::sync::Arc;

/// The admin listener's router.
pub fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .route(ABORT_PATH, post(abort))
        .route("/v1/requests", get(requests))
        .route("/v1/gpu", get(gpu))
        .route("/v1/engine", get(engine))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

fn refuse(status: StatusCode, error: &str, message: String) -> Response {
    (status, Json(json!({ "error": error, "message": message }))).into_response()
}

async fn abort(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, MAX_ABORT_BODY).await {
        Ok(b) => b,
        Err(_) => {
            st.metrics.abort_api("bad_request");
            return refuse(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("abort body larger than {MAX_ABORT_BODY} bytes or unreadable"),
            );
        }
    };
    let now_unix = st.clock.unix_secs();
    let sig_header = parts
        .headers
        .get(SIGNATURE_HEADER)
        .map(HeaderValue::as_bytes);
    let verified = signature::verify(&st.cfg.keys, sig_header, &body, now_unix).and_then(|sig| {
        if st.inner().replay.check_and_remember(&sig, now_unix) {
            Ok(sig)
        } else {
            Err(SignatureError::Replay)
        }
    });
    if let Err(e) = verified {
        if e == SignatureError::Replay {
            st.metrics.abort_api("replay");
            tracing::warn!("abort call refused: replayed signature");
            return refuse(StatusCode::CONFLICT, "replay", e.to_string());
        }
        st.metrics.abort_api("unauthorized");
        tracing::error!(
            why = e.as_str(),
            keys = st.cfg.keys.len(),
            "abort call refused: {e}"
        );
        return refuse(StatusCode::UNAUTHORIZED, "unauthorized", e.to_string());
    }
    let (abort, id) = match AbortRequest::parse(&body) {
        Ok(x) => x,
        Err(e) => {
            st.metrics.abort_api("bad_request");
            tracing::warn!(error = %e, "abort call refused: bad body");
            return refuse(StatusCode::BAD_REQUEST, "bad_request", e.to_string());
        }
    };
    let reason = abort.reason;
    let answer = |found, aborted, already| AbortAnswer {
        request_id: id.as_str().to_owned(),
        found,
        aborted,
        already_aborted: already,
    };
    if let Some(entry) = st.entry(&id) {
        if st.cfg.dry_run {
            st.end_request(&entry, reason, "abort_api");
            st.metrics.abort_api("dry_run");
            // Observe only: found, but not ended.
            return (StatusCode::OK, Json(answer(true, false, false))).into_response();
        }
        if entry.ended().is_some() {
            st.metrics.abort_api("already_aborted");
            return (StatusCode::OK, Json(answer(true, false, true))).into_response();
        }
        st.end_request(&entry, reason, "abort_api");
        st.metrics.abort_api("aborted");
        tracing::info!(request_id = %id, reason = %reason, sender_age_ms = abort.age_ms, sender_tokens = abort.tokens, "abort call: ended");
        return (StatusCode::OK, Json(answer(true, true, false))).into_response();
    }
    let now = st.clock.now();
    let tomb = st.inner().tombstones.get(&id, now);
    if tomb.is_some() {
        st.metrics.abort_api("already_aborted");
        return (StatusCode::OK, Json(answer(true, false, true))).into_response();
    }
    st.tombstone(id.clone(), reason);
    st.metrics.abort_api("not_found");
    tracing::info!(request_id = %id, reason = %reason, "abort call for an id not in flight: tombstoned");
    (StatusCode::NOT_FOUND, Json(answer(false, false, false))).into_response()
}

async fn requests(State(st): State<Arc<AppState>>) -> Response {
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
