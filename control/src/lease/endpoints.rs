//! The three ways a renewal arrives (contract §8): out of band on the admin listener
//! (`POST /v1/lease`), in band on the proxy listener (`POST /v1/kvguard/lease`, over the
//! hops the gateway's streams take; answered here, never proxied), and forwarded by a
//! peer (`POST /v1/peer/lease`). Each is signed; freshness is the counter's, per path.

use super::{LeaseMode, RenewError};
use crate::abort::endpoint::{open_forwarded, refused_result};
use crate::refusal::{refuse, REFUSALS, REFUSAL_LOG_PERIOD};
use crate::state::AppState;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvguard_contract::lease::MAX_RENEWAL_BODY;
use kvguard_contract::signature;
use kvguard_contract::{Domain, Renewal, RenewalBody, Via, SIGNATURE_HEADER};
use serde_json::json;
use std::sync::Arc;

/// `POST /v1/lease` on the admin listener: an out-of-band renewal.
pub async fn admin(State(st): State<Arc<AppState>>, req: Request) -> Response {
    from_gateway(&st, Via::Admin, req).await
}

/// `POST /v1/kvguard/lease` on the proxy listener: an in-band renewal, proof that the
/// gateway's data path reaches kvguard-control.
pub async fn data(State(st): State<Arc<AppState>>, req: Request) -> Response {
    from_gateway(&st, Via::Data, req).await
}

fn off() -> Response {
    refuse(
        StatusCode::NOT_FOUND,
        "leases_off",
        "kvguard-control runs with --lease-mode off".to_owned(),
    )
}

async fn from_gateway(st: &Arc<AppState>, via: Via, req: Request) -> Response {
    if st.cfg.lease_mode == LeaseMode::Off {
        return off();
    }
    let path = via.as_str();
    let (parts, body) = req.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_RENEWAL_BODY).await else {
        st.metrics.lease.renewal(path, "bad_request");
        return refuse(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("renewal body larger than {MAX_RENEWAL_BODY} bytes or unreadable"),
        );
    };
    let header = parts
        .headers
        .get(SIGNATURE_HEADER)
        .map(HeaderValue::as_bytes);
    if let Err(e) = signature::verify_any_time(Domain::Renewal, &st.keys().accept, header, &body) {
        let result = refused_result(e);
        st.metrics.lease.renewal(path, result);
        let now_ms = st.clock.unix_secs().saturating_mul(1000);
        if let Some(held) = REFUSALS.admit(now_ms, REFUSAL_LOG_PERIOD) {
            tracing::warn!(path, why = e.as_str(), refused_since_last_line = held, "lease renewal refused: {e} (every refusal is counted in kvguard_control_lease_renewals_total{{result=\"{result}\"}})");
        }
        return refuse(StatusCode::UNAUTHORIZED, "unauthorized", e.to_string());
    }
    let Some(r) = Renewal::parse(&body) else {
        st.metrics.lease.renewal(path, "bad_request");
        return refuse(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "renewal body: expected {\"instance\":\"<32 hex>\",\"counter\":<u64>,...} (contract §8)"
                .to_owned(),
        );
    };
    if r.via != via {
        st.metrics.lease.renewal(path, "bad_request");
        return refuse(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!(
                "a renewal signed for the {} path arrived on the {path} path",
                r.via.as_str()
            ),
        );
    }
    let (answer, result) = take(st, &r, None);
    st.metrics.lease.renewal(path, result);
    if result == "accepted" && r.fanout {
        if let Some(peers) = &st.peers {
            peers.fan_out_renewal(
                st.keys().envelope_key().cloned(),
                st.clock.unix_secs(),
                body.to_vec(),
            );
        }
    }
    answer
}

/// `POST /v1/peer/lease`: a renewal another replica accepted (either path), taken here
/// too, so a renewal reaching any replica counts at every one. Never forwarded again.
pub async fn peer(State(st): State<Arc<AppState>>, req: Request) -> Response {
    if st.cfg.lease_mode == LeaseMode::Off {
        return off();
    }
    let env = match open_forwarded(&st, "renewal", req).await {
        Ok(e) => e,
        Err(r) => return r,
    };
    let Some(r) = Renewal::parse(env.body.as_bytes()) else {
        st.metrics.peer.receive("renewal", "bad_request");
        return refuse(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "forwarded renewal: bad inner body".to_owned(),
        );
    };
    let (answer, result) = take(&st, &r, Some(&env.forwarded_by));
    let result = match result {
        "accepted" | "duplicate" => result,
        _ => "refused",
    };
    st.metrics.peer.receive("renewal", result);
    answer
}

/// Applies a verified renewal and answers it: 200 (with `x-kvguard-lease: accepted` or
/// `duplicate`), 409 replay, 422 a period too long for the TTL; with the result's label
/// (`accepted`, `duplicate`, `replay`, `period_too_long`).
fn take(st: &AppState, r: &RenewalBody, forwarded_by: Option<&str>) -> (Response, &'static str) {
    let now = st.clock.now();
    let path = r.via.as_str();
    let result = {
        let mut leases = st.leases.lock().unwrap_or_else(|p| p.into_inner());
        let result = leases.renew(r, now);
        st.metrics.lease.census(leases.census());
        result
    };
    let ttl_ms = u64::try_from(st.cfg.lease_ttl.as_millis()).unwrap_or(u64::MAX);
    let instance = r.instance.to_string();
    let ok = |dup: bool| {
        let mut resp = (
            StatusCode::OK,
            Json(json!({ "instance": instance, "ttl_ms": ttl_ms, "duplicate": dup })),
        )
            .into_response();
        resp.headers_mut().insert(
            "x-kvguard-lease",
            HeaderValue::from_static(if dup { "duplicate" } else { "accepted" }),
        );
        resp
    };
    match result {
        Ok(new) => {
            if new {
                tracing::info!(instance = %r.instance, counter = r.counter, path, forwarded_by, host = ?r.host.map(|h| h.to_string()), "gateway lease taken");
            }
            (ok(false), "accepted")
        }
        // The same period's renewal again (to control_cluster and the replica directly, or
        // forwarded by a peer): no evidence of life, not the sender's fault.
        Err(RenewError::Duplicate) => (ok(true), "duplicate"),
        Err(RenewError::Replay) => {
            tracing::warn!(instance = %r.instance, counter = r.counter, path, forwarded_by, "lease renewal refused: counter not above the last accepted on its path (replay)");
            let answer = refuse(
                StatusCode::CONFLICT,
                "replay",
                "renewal counter not above the last accepted on its path".to_owned(),
            );
            (answer, "replay")
        }
        Err(RenewError::PeriodTooLong { period_ms, max_ms }) => {
            let msg = format!(
                "renewal period {period_ms} ms is too long for kvguard-control's --lease-ttl {ttl_ms} ms: \
                 at least {} renewals must fit in one TTL; set the filter's lease_renew_ms to at most {max_ms} \
                 or raise --lease-ttl",
                kvguard_contract::lease::MIN_TTL_PERIODS
            );
            let now_ms = st.clock.unix_secs().saturating_mul(1000);
            if let Some(held) = REFUSALS.admit(now_ms, REFUSAL_LOG_PERIOD) {
                tracing::error!(instance = %r.instance, refused_since_last_line = held, "lease renewal refused: {msg}");
            }
            (
                refuse(StatusCode::UNPROCESSABLE_ENTITY, "period_too_long", msg),
                "period_too_long",
            )
        }
    }
}
