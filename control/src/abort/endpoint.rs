//! The abort endpoints of the admin listener: `POST /v1/abort` (a gateway's signed call,
//! contract §3) and `POST /v1/peer/abort` (an abort another replica forwarded, §4). Each
//! reads its body, verifies its signature of its own kind and remembers it (replay),
//! parses the abort, and answers what [`super`] decided.
//!
//! Opening a forwarded envelope ([`open_forwarded`]) is shared with the lease's
//! `POST /v1/peer/lease`.

use super::{AbortFound, Decided};
use crate::refusal::{refuse, REFUSALS, REFUSAL_LOG_PERIOD};
use crate::replay::Seen;
use crate::state::AppState;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvguard_contract::abort::MAX_ABORT_BODY;
use kvguard_contract::peer::MAX_PEER_BODY;
use kvguard_contract::signature::{self, SignatureError};
use kvguard_contract::{
    AbortAnswer, AbortReason, AbortRequest, Domain, Forwarded, Leg, RequestId, SIGNATURE_HEADER,
};
use kvguard_control_core::abort::legs_count;
use std::sync::Arc;

/// `POST /v1/abort`: reads, verifies and parses the call, has [`super::abort`] decide and
/// carry it out, and answers per contract §3.
pub async fn abort(State(st): State<Arc<AppState>>, req: Request) -> Response {
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
    let sig_header = parts
        .headers
        .get(SIGNATURE_HEADER)
        .map(HeaderValue::as_bytes);
    if let Err(e) = verify_fresh(&st, Domain::Abort, sig_header, &body) {
        let e = match e {
            Refused::Full => {
                st.metrics.abort_api("replay_full");
                return replay_full();
            }
            Refused::Sig(e) => e,
        };
        if e == SignatureError::Replay {
            st.metrics.abort_api("replay");
            tracing::warn!("abort call refused: replayed signature");
            return refuse(StatusCode::CONFLICT, "replay", e.to_string());
        }
        let result = refused_result(e);
        st.metrics.abort_api(result);
        let now_ms = st.clock.unix_secs().saturating_mul(1000);
        if let Some(held) = REFUSALS.admit(now_ms, REFUSAL_LOG_PERIOD) {
            tracing::warn!(
                why = e.as_str(),
                keys = st.keys().accept.len(),
                refused_since_last_line = held,
                "abort call refused: {e} (one line per {REFUSAL_LOG_PERIOD:?} at most; every refusal is counted in kvguard_control_abort_api_answers_total{{result=\"{result}\"}})"
            );
        }
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
    if let Some(why) = st.defers(&id, &abort) {
        st.metrics.abort_api("deferred");
        tracing::debug!(request_id = %id, sender_idle_ms = abort.idle_ms, "stalled abort deferred: {why}");
        return deferred(&id);
    }
    let gone = abort
        .gone_ms
        .map(|ms| (std::time::Duration::from_millis(ms), abort.tokens));
    let deferrable = super::deferrable(reason, abort.recheck_ms.is_some());
    let mut decided = super::abort(&st, &id, reason, gone, deferrable, &body).await;
    if decided.held_nowhere() {
        if let Some(why) = st.defers_held_nowhere(&abort) {
            tracing::debug!(request_id = %id, sender_idle_ms = abort.idle_ms, "stalled abort deferred: {why}");
            decided = Decided::Deferred;
        }
    }
    match decided {
        Decided::Here(found) => abort_answer(&st, &id, reason, &abort, found),
        Decided::Peer(a) => {
            st.metrics
                .abort_api(if a.deferred { "deferred" } else { "forwarded" });
            tracing::info!(request_id = %id, reason = %reason, peer = %a.peer, deferred = a.deferred, "abort call for an id a peer holds: forwarded, answered by the peer");
            let mut r = Response::new(Body::from(a.body));
            *r.status_mut() = a.status;
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        }
        Decided::Legs(legs) => legs_answer(&st, &id, reason, legs, "abort call"),
        Decided::Deferred => {
            st.metrics.abort_api("deferred");
            deferred(&id)
        }
        Decided::AskAgain => {
            st.metrics.abort_api("peer_unanswered");
            tracing::warn!(request_id = %id, reason = %reason, "abort call answered 503: a peer did not answer and may hold the request (kvguard_control_peer_forwards_total{{result=\"failed\"}}); the sender asks again");
            refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "peer_unanswered",
                "a peer did not answer and may hold the request; ask again".to_owned(),
            )
        }
    }
}

/// The answer to an abort that reached every leg of a disaggregated request (contract §3:
/// the summary, and `legs`); counted by what this replica did (`aborted` also when it
/// released a hand-off's blocks), else `forwarded` when a peer ended a leg.
fn legs_answer(
    st: &AppState,
    id: &RequestId,
    reason: AbortReason,
    legs: Vec<Leg>,
    what: &'static str,
) -> Response {
    let (found, aborted, already) = super::summary(&legs);
    let result = legs_count(&legs, &st.replica_name());
    st.metrics.abort_api(result);
    let summary = legs
        .iter()
        .map(|l| {
            format!(
                "{}{}{}={}",
                l.replica,
                if l.role.is_some() { "/" } else { "" },
                l.role.as_deref().unwrap_or(""),
                l.result.as_str()
            )
        })
        .collect::<Vec<_>>()
        .join(",");
    tracing::info!(request_id = %id, reason = %reason, legs = %summary, "{what} for a disaggregated request: every leg asked");
    let status = if found {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    };
    let body = AbortAnswer {
        request_id: id.as_str().to_owned(),
        found,
        aborted,
        already_aborted: already,
        legs,
        deferred: false,
    };
    (status, Json(body)).into_response()
}

/// Why a signed call was refused before its body was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// The signature (missing, malformed, stale, unknown key, or a replay).
    Sig(SignatureError),
    /// The replay memory is full of live signatures: this one could not be remembered,
    /// so it is refused (503, retry) rather than accepted unrecognisable.
    Full,
}

/// The result label of a refused signature: `outdated` names a sender that predates the
/// signatures' domain prefixes (contract §3: upgrade the gateways first), any other
/// refusal is `unauthorized`. Both answer 401.
pub(crate) fn refused_result(e: SignatureError) -> &'static str {
    if e == SignatureError::Outdated {
        "outdated"
    } else {
        "unauthorized"
    }
}

/// Verifies a signature of a `domain` message (any key, `t` within the window) and
/// remembers it: a second call with the same signature is [`SignatureError::Replay`].
fn verify_fresh(
    st: &AppState,
    domain: Domain,
    header: Option<&[u8]>,
    body: &[u8],
) -> Result<(), Refused> {
    let now_unix = st.clock.unix_secs();
    let keys = st.keys();
    let sig =
        signature::verify(domain, &keys.accept, header, body, now_unix).map_err(Refused::Sig)?;
    let seen = st.replay().check_and_remember(&sig, now_unix);
    match seen {
        Seen::Fresh => Ok(()),
        Seen::Replay => Err(Refused::Sig(SignatureError::Replay)),
        Seen::Full => {
            st.metrics.replay_full.inc();
            Err(Refused::Full)
        }
    }
}

/// The 503 of a signed call the replay memory has no room for.
fn replay_full() -> Response {
    let mut r = refuse(
        StatusCode::SERVICE_UNAVAILABLE,
        "busy",
        "the replay memory is full of live signatures; retry".to_owned(),
    );
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

fn answer(id: &RequestId, found: bool, aborted: bool, already: bool) -> Json<AbortAnswer> {
    Json(AbortAnswer {
        request_id: id.as_str().to_owned(),
        found,
        aborted,
        already_aborted: already,
        legs: Vec::new(),
        deferred: false,
    })
}

/// 200 `{"request_id","found":true,"deferred":true}`: in flight, not ended (contract §3).
fn deferred(id: &RequestId) -> Response {
    let a = AbortAnswer {
        request_id: id.as_str().to_owned(),
        found: true,
        aborted: false,
        already_aborted: false,
        legs: Vec::new(),
        deferred: true,
    };
    (StatusCode::OK, Json(a)).into_response()
}

/// The answer to an abort call decided here (contract §3's table).
fn abort_answer(
    st: &AppState,
    id: &RequestId,
    reason: AbortReason,
    abort: &AbortRequest,
    found: AbortFound,
) -> Response {
    match found {
        AbortFound::Observed => {
            st.metrics.abort_api("dry_run");
            // Observe only: found, but not ended.
            (StatusCode::OK, answer(id, true, false, false)).into_response()
        }
        AbortFound::Ended => {
            st.metrics.abort_api("aborted");
            tracing::info!(request_id = %id, reason = %reason, sender_age_ms = abort.age_ms, sender_tokens = abort.tokens, sender_idle_ms = abort.idle_ms, sender_gone_ms = abort.gone_ms, "abort call: ended");
            (StatusCode::OK, answer(id, true, true, false)).into_response()
        }
        AbortFound::Already => {
            st.metrics.abort_api("already_aborted");
            (StatusCode::OK, answer(id, true, false, true)).into_response()
        }
        AbortFound::NotFound => {
            st.metrics.abort_api("not_found");
            if !st.cfg.dry_run {
                tracing::info!(request_id = %id, reason = %reason, "abort call for an id not in flight: tombstoned");
            }
            (StatusCode::NOT_FOUND, answer(id, false, false, false)).into_response()
        }
    }
}

/// Reads, verifies (signature, freshness, replay) and opens a forwarded envelope; the
/// refusal is counted under `kind` and returned as the response.
pub(crate) async fn open_forwarded(
    st: &AppState,
    kind: &'static str,
    req: Request,
) -> Result<Forwarded, Response> {
    let (parts, body) = req.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_PEER_BODY).await else {
        st.metrics.peer.receive(kind, "bad_request");
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("forwarded body larger than {MAX_PEER_BODY} bytes or unreadable"),
        ));
    };
    let header = parts
        .headers
        .get(SIGNATURE_HEADER)
        .map(HeaderValue::as_bytes);
    if let Err(e) = verify_fresh(st, Domain::Envelope, header, &body) {
        let e = match e {
            Refused::Full => {
                st.metrics.peer.receive(kind, "replay_full");
                return Err(replay_full());
            }
            Refused::Sig(e) => e,
        };
        if e == SignatureError::Replay {
            st.metrics.peer.receive(kind, "replay");
            tracing::warn!(kind, "forwarded {kind} refused: replayed signature");
            return Err(refuse(StatusCode::CONFLICT, "replay", e.to_string()));
        }
        let result = refused_result(e);
        st.metrics.peer.receive(kind, result);
        let now_ms = st.clock.unix_secs().saturating_mul(1000);
        if let Some(held) = REFUSALS.admit(now_ms, REFUSAL_LOG_PERIOD) {
            tracing::warn!(kind, why = e.as_str(), refused_since_last_line = held, "forwarded {kind} refused: {e} (every replica needs the same keys and a clock within 30 s; counted in kvguard_control_peer_received_total{{result=\"{result}\"}})");
        }
        return Err(refuse(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            e.to_string(),
        ));
    }
    Forwarded::parse(&body).ok_or_else(|| {
        st.metrics.peer.receive(kind, "bad_request");
        refuse(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "forwarded body: expected {\"forwarded_by\":\"<ip:port>\",\"body\":\"<original body>\"}".to_owned(),
        )
    })
}

/// `POST /v1/peer/abort`: an abort another replica forwarded because it does not hold
/// the id. Ended here if in flight here; otherwise tombstoned here too and answered 404,
/// so that a request the abort overtook is refused whichever replica it lands on. Never
/// forwarded again.
pub async fn peer_abort(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let env = match open_forwarded(&st, "abort", req).await {
        Ok(e) => e,
        Err(r) => return r,
    };
    let (abort, id) = match AbortRequest::parse(env.body.as_bytes()) {
        Ok(x) => x,
        Err(e) => {
            st.metrics.peer.receive("abort", "bad_request");
            return refuse(StatusCode::BAD_REQUEST, "bad_request", e.to_string());
        }
    };
    let reason = abort.reason;
    if st.defers(&id, &abort).is_some() {
        st.metrics.peer.receive("abort", "deferred");
        return deferred(&id);
    }
    let gone = abort
        .gone_ms
        .map(|ms| (std::time::Duration::from_millis(ms), abort.tokens));
    let leg = st.leg_in_flight(&id);
    if st.cfg.pd_role != crate::config::PdRole::None || leg.is_some() || st.holds_handoff(&id) {
        // A leg of a disaggregated request: this replica's legs, released hand-off included.
        let tomb = !super::deferrable(reason, abort.recheck_ms.is_some());
        let found = st.abort_here(&id, reason, gone, tomb);
        st.metrics.peer.receive(
            "abort",
            match found {
                AbortFound::Ended => "aborted",
                AbortFound::Already => "already_aborted",
                AbortFound::Observed => "dry_run",
                AbortFound::NotFound => "not_found",
            },
        );
        let legs = st.legs_here(&id, found, leg).await;
        let (found, aborted, already) = super::summary(&legs);
        tracing::info!(request_id = %id, reason = %reason, forwarded_by = %env.forwarded_by, legs = legs.len(), aborted, "forwarded abort for a disaggregated request");
        let status = if found {
            StatusCode::OK
        } else {
            StatusCode::NOT_FOUND
        };
        let body = AbortAnswer {
            request_id: id.as_str().to_owned(),
            found,
            aborted,
            already_aborted: already,
            legs,
            deferred: false,
        };
        return (status, Json(body)).into_response();
    }
    let tomb = !super::deferrable(reason, abort.recheck_ms.is_some());
    match st.abort_here(&id, reason, gone, tomb) {
        AbortFound::Observed => {
            st.metrics.peer.receive("abort", "dry_run");
            (StatusCode::OK, answer(&id, true, false, false)).into_response()
        }
        AbortFound::Ended => {
            st.metrics.peer.receive("abort", "aborted");
            tracing::info!(request_id = %id, reason = %reason, forwarded_by = %env.forwarded_by, sender_age_ms = abort.age_ms, sender_gone_ms = abort.gone_ms, "forwarded abort: ended");
            (StatusCode::OK, answer(&id, true, true, false)).into_response()
        }
        AbortFound::Already => {
            st.metrics.peer.receive("abort", "already_aborted");
            (StatusCode::OK, answer(&id, true, false, true)).into_response()
        }
        AbortFound::NotFound => {
            st.metrics.peer.receive("abort", "not_found");
            (StatusCode::NOT_FOUND, answer(&id, false, false, false)).into_response()
        }
    }
}
