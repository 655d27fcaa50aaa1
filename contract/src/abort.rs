//! The abort call: `POST /v1/abort`, its body and its answers (contract §3).

use crate::id::{IdError, RequestId};
use crate::reason::AbortReason;
use core::fmt;
use serde::{Deserialize, Serialize};

/// Default path of the abort endpoint on the control service's admin listener.
pub const ABORT_PATH: &str = "/v1/abort";

/// Largest abort body the control service reads, in bytes.
pub const MAX_ABORT_BODY: usize = 4096;

/// The abort body. Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortRequest {
    /// The request to end (validated on parse).
    pub request_id: String,
    /// Why.
    pub reason: AbortReason,
    /// Age of the request at the sender when the abort was decided, in ms.
    #[serde(default)]
    pub age_ms: u64,
    /// Data events the sender saw.
    #[serde(default)]
    pub tokens: u64,
    /// How long before this attempt was sent the sender last saw a data event, in ms
    /// (absent when it saw none). A duration on the sender's monotonic clock, never a
    /// wall-clock time: tests and operators check a stall abort against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_ms: Option<u64>,
    /// How long before this attempt was sent the client went away, in ms (absent when the
    /// client was still connected, e.g. a stall). The receiver adds the time it then spends
    /// ending the request to get the orphan's cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gone_ms: Option<u64>,
    /// Which attempt of this abort the sender is making (1 for the first call). Each
    /// attempt's body, so its signature, differs: a retry after a call that did land is
    /// answered as a fresh call (200 `already_aborted`), never taken for a replay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Present: the sender keeps the stream open until this answer and understands a
    /// deferral (`stalled` only); if deferred, it asks again after this long, in ms (its
    /// idle window). The receiver may then answer 200 `deferred` when the stream is not
    /// stalled at the engine, only slow to drain downstream ([`AbortAnswer::deferred`]).
    /// Absent from older senders, which never get a deferral.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recheck_ms: Option<u64>,
}

/// Why an abort body was refused (answer 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// Longer than [`MAX_ABORT_BODY`].
    TooLarge(usize),
    /// Not JSON of the contract's shape (serde's message).
    Json(String),
    /// `request_id` is not a valid id.
    Id(IdError),
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyError::TooLarge(n) => {
                write!(f, "abort body is {n} bytes, at most {MAX_ABORT_BODY}")
            }
            BodyError::Json(e) => write!(f, "abort body: {e}"),
            BodyError::Id(e) => write!(f, "abort body: {e}"),
        }
    }
}

impl std::error::Error for BodyError {}

impl AbortRequest {
    /// Builds a body for a validated id.
    pub fn new(request_id: &RequestId, reason: AbortReason, age_ms: u64, tokens: u64) -> Self {
        AbortRequest {
            request_id: request_id.as_str().to_owned(),
            reason,
            age_ms,
            tokens,
            idle_ms: None,
            gone_ms: None,
            attempt: None,
            recheck_ms: None,
        }
    }

    /// The same body allowing a deferred answer, asked again after `recheck_ms`
    /// ([`AbortRequest::recheck_ms`]).
    pub fn with_recheck(mut self, recheck_ms: Option<u64>) -> Self {
        self.recheck_ms = recheck_ms;
        self
    }

    /// The same body marked as attempt `n` (1 = the first call).
    pub fn with_attempt(mut self, n: u32) -> Self {
        self.attempt = Some(n);
        self
    }

    /// The same body with the sender's idle and client-gone durations.
    pub fn with_durations(mut self, idle_ms: Option<u64>, gone_ms: Option<u64>) -> Self {
        self.idle_ms = idle_ms;
        self.gone_ms = gone_ms;
        self
    }

    /// Serialises the body (compact JSON, field order as in the contract).
    pub fn to_json(&self) -> Vec<u8> {
        // Serialising plain strings and integers cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses and validates a body; returns it with its validated id.
    pub fn parse(body: &[u8]) -> Result<(AbortRequest, RequestId), BodyError> {
        if body.len() > MAX_ABORT_BODY {
            return Err(BodyError::TooLarge(body.len()));
        }
        let req: AbortRequest =
            serde_json::from_slice(body).map_err(|e| BodyError::Json(e.to_string()))?;
        let id = RequestId::try_new(req.request_id.as_bytes()).map_err(BodyError::Id)?;
        Ok((req, id))
    }
}

/// The JSON answer of the abort endpoint (200 and 404).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortAnswer {
    /// Echo of the request id.
    pub request_id: String,
    /// Whether the request was in flight or tombstoned.
    pub found: bool,
    /// It was in flight and is now ended.
    #[serde(default, skip_serializing_if = "core::ops::Not::not")]
    pub aborted: bool,
    /// It had ended earlier.
    #[serde(default, skip_serializing_if = "core::ops::Not::not")]
    pub already_aborted: bool,
    /// With prefill/decode disaggregation (contract §4): every replica that held the id
    /// and what it did. Absent when the abort was not fanned out (one holder at most).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub legs: Vec<Leg>,
    /// Not ended: a `stalled` abort that allowed it ([`AbortRequest::recheck_ms`]) found the
    /// stream producing at the engine and its reader still draining; the sender keeps the
    /// stream and asks again after another idle window.
    #[serde(default, skip_serializing_if = "core::ops::Not::not")]
    pub deferred: bool,
}

/// One replica's part of a fanned-out abort (prefill/decode disaggregation, §4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leg {
    /// The replica (its `ip:port` identity among the peers).
    pub replica: String,
    /// `prefill` or `decode` (the replica's `--pd-role`, else what the request's body
    /// asked for); absent when neither is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// What it did.
    pub result: LegResult,
}

/// What one replica did with a fanned-out abort.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LegResult {
    /// The request was in flight there and is now ended.
    Aborted,
    /// It had ended earlier there (or its id was tombstoned).
    AlreadyAborted,
    /// `--dry-run`: found, not ended.
    DryRun,
    /// A finished prefill's blocks, held by the prefill engine for a decode side, were
    /// released (a decode engine rejected a request carrying their transfer parameters
    /// and so told the prefill engine to let them go).
    Released,
    /// A finished prefill's blocks are held by the prefill engine and could not be
    /// released from outside: they go at the engine's own lease (vLLM
    /// `kv_lease_duration`, 30 s).
    HeldUntilLease,
}

impl LegResult {
    /// The wire form.
    pub const fn as_str(self) -> &'static str {
        match self {
            LegResult::Aborted => "aborted",
            LegResult::AlreadyAborted => "already_aborted",
            LegResult::DryRun => "dry_run",
            LegResult::Released => "released",
            LegResult::HeldUntilLease => "held_until_lease",
        }
    }

    /// Whether this call ended that leg (a request ended, or held blocks released).
    pub const fn ended(self) -> bool {
        matches!(self, LegResult::Aborted | LegResult::Released)
    }
}

/// What the sender does with an answer status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// 200: the request was in flight and is ended, or was ended earlier.
    Done,
    /// 404: not in flight; a tombstone now refuses it if it arrives later.
    NotFound,
    /// 400: malformed body or id. No retry.
    BadRequest,
    /// 401: missing, bad or stale signature. No retry; log loudly.
    Unauthorized,
    /// 409: replayed signature. No retry.
    Replay,
    /// 429, 5xx, timeout, reset: retry with backoff.
    Transient,
    /// Any other status: treated as a permanent failure.
    Unexpected,
}

impl Disposition {
    /// Classifies an HTTP status of the abort endpoint.
    pub const fn of_status(status: u16) -> Disposition {
        match status {
            200 => Disposition::Done,
            404 => Disposition::NotFound,
            400 => Disposition::BadRequest,
            401 => Disposition::Unauthorized,
            409 => Disposition::Replay,
            429 | 500..=599 => Disposition::Transient,
            _ => Disposition::Unexpected,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_round_trip_and_unknown_fields() {
        let id = RequestId::try_new(b"r1").unwrap();
        let req = AbortRequest::new(&id, AbortReason::Stalled, 5, 6);
        let json = req.to_json();
        assert_eq!(
            json,
            br#"{"request_id":"r1","reason":"stalled","age_ms":5,"tokens":6}"#
        );
        let (back, bid) = AbortRequest::parse(&json).unwrap();
        assert_eq!((back, bid), (req.clone(), id));
        let timed = req.with_durations(Some(7), Some(8));
        assert_eq!(
            timed.to_json(),
            br#"{"request_id":"r1","reason":"stalled","age_ms":5,"tokens":6,"idle_ms":7,"gone_ms":8}"#
        );
        assert_eq!(AbortRequest::parse(&timed.to_json()).unwrap().0, timed);
        let second = timed.clone().with_attempt(2);
        assert!(second.to_json().ends_with(br#","gone_ms":8,"attempt":2}"#));
        assert_ne!(second.to_json(), timed.clone().with_attempt(1).to_json());
        let extra = br#"{"request_id":"r1","reason":"operator","future":[1,2]}"#;
        assert_eq!(
            AbortRequest::parse(extra).unwrap().0.reason,
            AbortReason::Operator
        );
    }

    #[test]
    fn body_errors() {
        assert!(matches!(AbortRequest::parse(b"{"), Err(BodyError::Json(_))));
        assert!(matches!(
            AbortRequest::parse(br#"{"request_id":"r1","reason":"bored"}"#),
            Err(BodyError::Json(_))
        ));
        assert!(matches!(
            AbortRequest::parse(br#"{"request_id":"a b","reason":"stalled"}"#),
            Err(BodyError::Id(IdError::BadByte(1)))
        ));
        assert!(matches!(
            AbortRequest::parse(&[b' '; 5000]),
            Err(BodyError::TooLarge(5000))
        ));
    }

    /// A valid abort body padded with trailing whitespace to exactly `len` bytes.
    fn body_of_len(len: usize) -> Vec<u8> {
        let mut body = br#"{"request_id":"r1","reason":"stalled"}"#.to_vec();
        body.resize(len, b' ');
        body
    }

    #[test]
    fn a_body_of_exactly_max_abort_body_bytes_is_read_and_one_more_is_refused() {
        let (req, id) = AbortRequest::parse(&body_of_len(MAX_ABORT_BODY)).unwrap();
        assert_eq!((req.reason, id.as_str()), (AbortReason::Stalled, "r1"));
        assert_eq!(
            AbortRequest::parse(&body_of_len(MAX_ABORT_BODY + 1)),
            Err(BodyError::TooLarge(MAX_ABORT_BODY + 1))
        );
        assert_eq!(MAX_ABORT_BODY, 4096);
    }

    #[test]
    fn body_error_messages_say_what_is_wrong() {
        assert_eq!(
            BodyError::TooLarge(5000).to_string(),
            "abort body is 5000 bytes, at most 4096"
        );
        let json = AbortRequest::parse(b"{").unwrap_err();
        assert!(json.to_string().starts_with("abort body: EOF"), "{json}");
        assert_eq!(
            BodyError::Id(IdError::Empty).to_string(),
            "abort body: request id is empty"
        );
        let bad_id = AbortRequest::parse(br#"{"request_id":"a b","reason":"stalled"}"#);
        assert_eq!(
            bad_id.unwrap_err().to_string(),
            "abort body: request id has a byte outside [A-Za-z0-9._:-] at offset 1"
        );
    }

    #[test]
    fn a_body_may_allow_a_deferral_and_an_answer_defer() {
        let id = RequestId::try_new(b"r1").unwrap();
        let req = AbortRequest::new(&id, AbortReason::Stalled, 5, 6).with_recheck(Some(3000));
        assert_eq!(
            req.to_json(),
            br#"{"request_id":"r1","reason":"stalled","age_ms":5,"tokens":6,"recheck_ms":3000}"#
        );
        assert_eq!(AbortRequest::parse(&req.to_json()).unwrap().0, req);
        // Older senders: absent.
        let (old, _) = AbortRequest::parse(br#"{"request_id":"r1","reason":"stalled"}"#).unwrap();
        assert_eq!(old.recheck_ms, None);
        let d = AbortAnswer {
            request_id: "r".into(),
            found: true,
            aborted: false,
            already_aborted: false,
            legs: Vec::new(),
            deferred: true,
        };
        assert_eq!(
            serde_json::to_string(&d).unwrap(),
            r#"{"request_id":"r","found":true,"deferred":true}"#
        );
    }

    #[test]
    fn answers_serialise_per_contract() {
        let a = AbortAnswer {
            request_id: "r".into(),
            found: true,
            aborted: true,
            already_aborted: false,
            legs: Vec::new(),
            deferred: false,
        };
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            r#"{"request_id":"r","found":true,"aborted":true}"#
        );
        let n = AbortAnswer {
            request_id: "r".into(),
            found: false,
            aborted: false,
            already_aborted: false,
            legs: Vec::new(),
            deferred: false,
        };
        assert_eq!(
            serde_json::to_string(&n).unwrap(),
            r#"{"request_id":"r","found":false}"#
        );
    }

    #[test]
    fn a_fanned_out_answer_names_each_leg_and_an_old_one_parses() {
        let a = AbortAnswer {
            request_id: "r".into(),
            found: true,
            aborted: true,
            already_aborted: false,
            legs: vec![
                Leg {
                    replica: "10.0.0.1:9902".into(),
                    role: Some("prefill".into()),
                    result: LegResult::Released,
                },
                Leg {
                    replica: "10.0.0.2:9902".into(),
                    role: None,
                    result: LegResult::HeldUntilLease,
                },
            ],
            deferred: false,
        };
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(
            json,
            r#"{"request_id":"r","found":true,"aborted":true,"legs":[{"replica":"10.0.0.1:9902","role":"prefill","result":"released"},{"replica":"10.0.0.2:9902","result":"held_until_lease"}]}"#
        );
        assert_eq!(serde_json::from_str::<AbortAnswer>(&json).unwrap(), a);
        let old: AbortAnswer =
            serde_json::from_str(r#"{"request_id":"r","found":true,"aborted":true}"#).unwrap();
        assert!(old.legs.is_empty());
        for (r, s, ended) in [
            (LegResult::Aborted, "aborted", true),
            (LegResult::AlreadyAborted, "already_aborted", false),
            (LegResult::DryRun, "dry_run", false),
            (LegResult::Released, "released", true),
            (LegResult::HeldUntilLease, "held_until_lease", false),
        ] {
            assert_eq!(r.as_str(), s);
            assert_eq!(r.ended(), ended, "{s}");
            assert_eq!(serde_json::to_string(&r).unwrap(), format!("\"{s}\""));
        }
    }

    #[test]
    fn dispositions() {
        assert_eq!(Disposition::of_status(200), Disposition::Done);
        assert_eq!(Disposition::of_status(404), Disposition::NotFound);
        assert_eq!(Disposition::of_status(401), Disposition::Unauthorized);
        assert_eq!(Disposition::of_status(409), Disposition::Replay);
        assert_eq!(Disposition::of_status(302), Disposition::Unexpected);
        assert_eq!(Disposition::of_status(503), Disposition::Transient);
        assert_eq!(Disposition::of_status(429), Disposition::Transient);
        assert_eq!(Disposition::of_status(400), Disposition::BadRequest);
    }
}
