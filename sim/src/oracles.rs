//! The promises checked on every run, with their bounds (docs/DESIGN.md "The
//! simulation"):
//!
//! - **Invariant 1**: no stream whose client still reads — at or above the documented
//!   floor, pausing under the documented bound (each silence at the filter under
//!   `--reader-timeout`) — is ended by kvguard (the filter's close, or any end at
//!   kvguard-control).
//! - **Invariant 2**: every stream nobody reads ends at the engine within its bound per
//!   cause ([`Cause::bound_ms`]), counted from when nobody reads it; so do the blocks a
//!   prefill engine holds for it, or by the engine's lease where kvguard-control cannot
//!   release them (`World::check_orphans`).
//! - **Figures**: an end at kvguard-control is counted under its true cause; a prefill
//!   leg read to its end `complete`; a hand-off taken for a release once; a lease
//!   expiry under the configured `--lease-mode`.
//! - **Mass stall**: a gateway cuts at most `max(8, 20 %)` of its streams for a stall in
//!   their first idle window; the rest are held one more window.

use crate::replica::flags;
use kvguard_contract::AbortReason;
use std::fmt;

/// Why nobody reads a stream any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Its client reset the stream.
    Left,
    /// Its client never reads (counted from the last byte that passed the filter).
    Silent,
    /// Its gateway process died (its client's connection with it).
    GatewayGone,
    /// kvguard closed it at the gateway (the client may have been reading: that is
    /// invariant 1's business; the engine must still stop).
    Closed,
    /// Its worker VM trapped, and Envoy cut it downstream.
    VmLost,
}

impl Cause {
    /// The documented bound, from the moment nobody reads, to the engine's end (`idle_ms`:
    /// the route's idle timeout):
    ///
    /// - left: the abort's round trips with retries, 10 s;
    /// - silent: `R` + one idle window + two ticks + one abort round trip (1 s) + 1 s;
    /// - gateway gone: the lease TTL + 5 s;
    /// - closed by kvguard: 10 s, as left;
    /// - its worker VM lost: the VM falls out of the renewals' list within
    ///   [`SILENT_PERIODS`](kvguard_filter_core::vms::SILENT_PERIODS) periods and the next
    ///   renewal, is ended once a renewal comes more than the TTL after that one (a
    ///   period later at most): 3 periods + TTL + 2 periods + 5 s.
    pub fn bound_ms(self, idle_ms: u64) -> u64 {
        match self {
            Cause::Left | Cause::Closed => 10_000,
            Cause::Silent => flags::READER_TIMEOUT_MS + idle_ms + 2 * 250 + 1_000 + 1_000,
            Cause::GatewayGone => flags::LEASE_TTL_MS + 5_000,
            Cause::VmLost => {
                let period = kvguard_filter_core::config::DEFAULT_LEASE_RENEW_MS;
                (kvguard_filter_core::vms::SILENT_PERIODS + 2) * period
                    + flags::LEASE_TTL_MS
                    + 5_000
            }
        }
    }

    /// The reason an end at kvguard-control should be counted under.
    pub fn reason(self) -> Option<AbortReason> {
        match self {
            Cause::Left => Some(AbortReason::DownstreamReset),
            Cause::Silent => Some(AbortReason::Stalled),
            Cause::GatewayGone | Cause::VmLost => Some(AbortReason::GatewayLost),
            Cause::Closed => None,
        }
    }
}

/// Which promise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Promise {
    /// A read stream was ended by kvguard.
    Invariant1,
    /// An unread stream, or the prefill blocks held for it, ran past its bound.
    Invariant2,
    /// Something counted under another cause or label, or not counted once.
    Figures,
    /// More streams cut for a stall in one idle window than the valve lets through.
    MassStall,
}

/// A broken promise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which.
    pub promise: Promise,
    /// The stream.
    pub stream: usize,
    /// When (virtual ms).
    pub at: u64,
    /// What, in a line.
    pub what: String,
    /// The known finding it is (`"36.1"`: issue 36 point 1), `None`: unknown.
    pub finding: Option<&'static str>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} at {} ms, stream {}: {} [{}]",
            self.promise,
            self.at,
            self.stream,
            self.what,
            self.finding
                .map_or("unknown".to_owned(), |x| format!("finding {x}"))
        )
    }
}
