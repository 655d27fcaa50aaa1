//! Abort reasons: a closed set, used as metric labels on both sides (contract §3).

use core::fmt;
use serde::{Deserialize, Serialize};

/// Why a request is being ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AbortReason {
    /// The client went away before the response completed.
    DownstreamReset,
    /// The upstream connection was reset before the response completed.
    UpstreamReset,
    /// A proxy timeout (route, stream idle, max stream duration) ended the request.
    Timeout,
    /// No data event arrived within the first-token timeout.
    FirstTokenTimeout,
    /// No data event arrived within the idle timeout after the first one.
    Stalled,
    /// The request outlived the max age.
    MaxAge,
    /// An operator asked for it.
    Operator,
    /// The gateway that carried it stopped renewing its liveness lease (kvguard-control
    /// only: the request's instance lease expired, contract §8).
    GatewayLost,
    /// Envoy or another filter answered the client itself (a local reply: ext_proc's
    /// `immediate_response`, `response_payload_too_large`, a filter's
    /// `send_http_response`...) after the request had reached an upstream, which may
    /// still be generating for it (filter only, contract §3).
    LocalReply,
}

impl AbortReason {
    /// Every reason, in a stable order (for pre-registering metrics).
    pub const ALL: [AbortReason; 9] = [
        AbortReason::DownstreamReset,
        AbortReason::UpstreamReset,
        AbortReason::Timeout,
        AbortReason::FirstTokenTimeout,
        AbortReason::Stalled,
        AbortReason::MaxAge,
        AbortReason::Operator,
        AbortReason::GatewayLost,
        AbortReason::LocalReply,
    ];

    /// The wire and label form, e.g. `downstream_reset`.
    pub const fn as_str(self) -> &'static str {
        match self {
            AbortReason::DownstreamReset => "downstream_reset",
            AbortReason::UpstreamReset => "upstream_reset",
            AbortReason::Timeout => "timeout",
            AbortReason::FirstTokenTimeout => "first_token_timeout",
            AbortReason::Stalled => "stalled",
            AbortReason::MaxAge => "max_age",
            AbortReason::Operator => "operator",
            AbortReason::GatewayLost => "gateway_lost",
            AbortReason::LocalReply => "local_reply",
        }
    }

    /// Index into [`AbortReason::ALL`] (for per-reason metric arrays).
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl core::str::FromStr for AbortReason {
    type Err = UnknownReason;
    fn from_str(s: &str) -> Result<Self, UnknownReason> {
        AbortReason::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or(UnknownReason)
    }
}

/// A reason string outside the closed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownReason;

impl fmt::Display for UnknownReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("unknown abort reason")
    }
}

impl std::error::Error for UnknownReason {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_indexes() {
        for (i, r) in AbortReason::ALL.into_iter().enumerate() {
            assert_eq!(r.index(), i);
            assert_eq!(r.as_str().parse::<AbortReason>(), Ok(r));
            assert_eq!(
                serde_json::to_string(&r).unwrap(),
                format!("\"{}\"", r.as_str())
            );
        }
        assert!("nope".parse::<AbortReason>().is_err());
    }

    #[test]
    fn display_is_the_wire_label_and_unknown_reason_says_so() {
        for r in AbortReason::ALL {
            assert_eq!(r.to_string(), r.as_str());
        }
        assert_eq!(
            AbortReason::FirstTokenTimeout.to_string(),
            "first_token_timeout"
        );
        assert_eq!(AbortReason::LocalReply.to_string(), "local_reply");
        let err = "Stalled".parse::<AbortReason>().unwrap_err();
        assert_eq!(err, UnknownReason);
        assert_eq!(err.to_string(), "unknown abort reason");
    }
}
