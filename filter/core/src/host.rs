//! The small traits the core needs from its host (Envoy through proxy-wasm, or mocks).

use crate::metrics::Metrics;

/// Log levels (proxy-wasm's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Debug.
    Debug,
    /// Info.
    Info,
    /// Warning.
    Warn,
    /// Error.
    Error,
    /// Critical.
    Critical,
}

/// Time.
pub trait Clock {
    /// Milliseconds on the host clock (wall clock; only differences are used, and
    /// they saturate at zero if it steps back).
    fn now_ms(&self) -> u64;
    /// The monotonic clock when the host could read it now, `None` when it could not
    /// ([`Clock::now_ms`] then answers an earlier reading). What times a stream's
    /// progress or start uses this: a stale reading would make a stream look idle or old
    /// earlier than it is.
    fn now_exact(&self) -> Option<u64> {
        Some(self.now_ms())
    }
    /// Unix seconds, for signatures.
    fn unix_secs(&self) -> u64;
}

/// An HTTP call to dispatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call<'a> {
    /// Upstream cluster.
    pub cluster: &'a str,
    /// Headers, pseudo-headers first.
    pub headers: Vec<(&'static str, String)>,
    /// Body.
    pub body: Vec<u8>,
    /// Per-call timeout, ms.
    pub timeout_ms: u64,
}

/// Why the host refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchError {
    /// Bad argument (unknown cluster, bad headers): permanent.
    BadArgument,
    /// Anything else (e.g. the call failed inline): retried.
    Other,
}

/// Host calls.
pub trait Host {
    /// Dispatches an HTTP call; returns its token.
    fn dispatch(&mut self, call: &Call<'_>) -> Result<u32, DispatchError>;
    /// Logs a line.
    fn log(&mut self, level: Level, msg: &str);
    /// Whether the current stream reached an upstream (Envoy: its `upstream.address`
    /// is set). Asked only in a stream's `on_log`, and only when nothing else explains
    /// how the stream ended (so never for a healthy stream). A host that cannot tell
    /// answers false: such an end is then settled as before (no abort after an end of
    /// stream), since a false abort is the worse error.
    fn upstream_reached(&mut self) -> bool {
        false
    }
    /// Whether a line at `level` would be logged at all (so that it is not formatted
    /// for nothing: the per-request debug lines cost more than the rest of the request
    /// when the host's level drops them).
    fn log_enabled(&self, level: Level) -> bool {
        let _ = level;
        true
    }
}

/// Why a shared-data write failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedError {
    /// The value changed since it was read (compare-and-swap lost).
    CasMismatch,
    /// Anything else.
    Other,
}

/// The process-wide store every worker VM shares (proxy-wasm shared data): the lease's
/// instance id, renewal slot, replicas and upstreams.
pub trait SharedData {
    /// The value of `key` and its compare-and-swap token (`Ok(None)`: absent).
    fn shared_get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, SharedError>;
    /// Writes `value` if `key`'s token is still `cas` (0: whatever it is).
    fn shared_set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), SharedError>;
}

/// Everything the engine needs from the host.
pub trait Platform: Clock + Host + Metrics {}

impl<T: Clock + Host + Metrics> Platform for T {}
