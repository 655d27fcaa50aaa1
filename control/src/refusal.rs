//! How the admin listener answers a call it refuses, and how refusals are logged without
//! flooding the log (a flood of bad calls is counted, one line per period).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Refused abort calls are logged at most once per this period (with the count since).
pub const REFUSAL_LOG_PERIOD: Duration = Duration::from_secs(10);

/// Lets one log line through per period and counts the ones held back (a flood of bad
/// calls must not flood the log).
#[derive(Debug, Default)]
pub struct LogLimiter {
    next_ms: AtomicU64,
    held: AtomicU64,
}

impl LogLimiter {
    /// `Some(lines held back since the last one)` if a line may be logged at `now_ms`.
    pub fn admit(&self, now_ms: u64, period: Duration) -> Option<u64> {
        let next = self.next_ms.load(Ordering::Acquire);
        let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
        if now_ms >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now_ms.saturating_add(period_ms),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
        {
            return Some(self.held.swap(0, Ordering::AcqRel));
        }
        self.held.fetch_add(1, Ordering::AcqRel);
        None
    }
}

/// Refused signed calls (aborts, renewals), one log limiter for all.
pub static REFUSALS: LogLimiter = LogLimiter {
    next_ms: AtomicU64::new(0),
    held: AtomicU64::new(0),
};

/// A refusal's answer: `status` with `{"error", "message"}`.
pub fn refuse(status: StatusCode, error: &str, message: String) -> Response {
    (status, Json(json!({ "error": error, "message": message }))).into_response()
}
