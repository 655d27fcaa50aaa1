//! Messages between kvguard-control replicas (contract §4, §8): an abort for an id not in
//! flight at the replica that received it, and a lease renewal, forwarded to the other
//! replicas (`--peers`).
//!
//! A forwarded message is an envelope naming the replica that forwarded it and carrying
//! the original body verbatim. It goes to its own path ([`PEER_ABORT_PATH`],
//! [`PEER_LEASE_PATH`]) and a replica never forwards what reached it there: one hop,
//! loop-free. The envelope is signed as an `x-kvguard-signature` of its own kind
//! ([`crate::Domain::Envelope`]: its MAC never verifies as an abort's or a renewal's, nor
//! theirs as its), with the replica's stamp key, `t` within ±30 s, a signature seen before
//! is a replay; and its body is never a valid abort or renewal body (nor the reverse).

use serde::{Deserialize, Serialize};

/// Where a replica forwards an abort for an id it does not hold.
pub const PEER_ABORT_PATH: &str = "/v1/peer/abort";
/// Where a replica forwards a renewal it accepted.
pub const PEER_LEASE_PATH: &str = "/v1/peer/lease";
/// Largest envelope body: the inner body (at most 4096 bytes) escaped as a JSON string,
/// plus the replica's name.
pub const MAX_PEER_BODY: usize = 2 * crate::abort::MAX_ABORT_BODY + 512;
/// Longest `forwarded_by` accepted.
pub const MAX_PEER_NAME: usize = 256;

/// The envelope: `{"forwarded_by":"<replica>","body":"<the original body>"}`. Unknown
/// fields are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Forwarded {
    /// The replica that forwarded it (its `ip:port` identity), for logs.
    pub forwarded_by: String,
    /// The original body (an abort body, or a renewal body), verbatim.
    pub body: String,
}

impl Forwarded {
    /// Wraps `body` (which must be UTF-8, as every abort and renewal body is; `None`
    /// otherwise).
    pub fn new(forwarded_by: &str, body: &[u8]) -> Option<Forwarded> {
        Some(Forwarded {
            forwarded_by: forwarded_by.to_owned(),
            body: core::str::from_utf8(body).ok()?.to_owned(),
        })
    }

    /// Compact JSON.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses an envelope (bounded sizes).
    pub fn parse(body: &[u8]) -> Option<Forwarded> {
        if body.len() > MAX_PEER_BODY {
            return None;
        }
        let f: Forwarded = serde_json::from_slice(body).ok()?;
        (f.forwarded_by.len() <= MAX_PEER_NAME && f.body.len() <= crate::abort::MAX_ABORT_BODY)
            .then_some(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abort::MAX_ABORT_BODY;
    use crate::{AbortReason, AbortRequest, Renewal, RequestId};

    #[test]
    fn envelope_round_trips_and_is_never_an_abort_or_a_renewal() {
        let id = RequestId::try_new(b"r1").unwrap();
        let abort = AbortRequest::new(&id, AbortReason::DownstreamReset, 5, 0).to_json();
        let env = Forwarded::new("10.0.0.1:9902", &abort).unwrap();
        let json = env.to_json();
        let back = Forwarded::parse(&json).unwrap();
        assert_eq!(back, env);
        assert_eq!(back.body.as_bytes(), abort.as_slice());
        // An envelope is neither an abort nor a renewal body, and neither is an envelope.
        assert!(AbortRequest::parse(&json).is_err());
        assert!(Renewal::parse(&json).is_none());
        assert!(Forwarded::parse(&abort).is_none());
        assert!(Forwarded::new("x", &[0xff]).is_none());
        let long = Forwarded::new(&"a".repeat(MAX_PEER_NAME + 1), b"{}").unwrap();
        assert!(Forwarded::parse(&long.to_json()).is_none());
    }

    #[test]
    fn the_largest_abort_forwarded_by_the_longest_name_fits_the_envelope_bound() {
        // Every byte of the inner body that JSON escapes to two (here newlines between
        // tokens, still a valid abort body) at the largest size, forwarded by the longest
        // name: the bound of 2 × 4096 + 512 bytes must still take it.
        let mut abort = br#"{"request_id":"r1","reason":"operator"}"#.to_vec();
        abort.resize(MAX_ABORT_BODY, b'\n');
        assert!(AbortRequest::parse(&abort).is_ok());
        let env = Forwarded::new(&"n".repeat(MAX_PEER_NAME), &abort).unwrap();
        let json = env.to_json();
        assert!(json.len() > 2 * MAX_ABORT_BODY, "{}", json.len());
        assert_eq!(Forwarded::parse(&json), Some(env));
    }

    #[test]
    fn an_envelope_of_exactly_max_peer_body_bytes_is_read_and_one_more_is_refused() {
        assert_eq!(MAX_PEER_BODY, 2 * 4096 + 512);
        let env = Forwarded::new("10.0.0.1:9902", br#"{"counter":1}"#).unwrap();
        let padded = |len: usize| {
            let mut json = env.to_json();
            json.resize(len, b' ');
            json
        };
        assert_eq!(Forwarded::parse(&padded(8704)), Some(env.clone()));
        assert_eq!(Forwarded::parse(&padded(8705)), None);
        assert_eq!(Forwarded::parse(&padded(20_000)), None);
    }
}
