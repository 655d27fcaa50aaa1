//! The final SSE event kvguard-control sends a client before ending its stream (contract §6).

use crate::reason::AbortReason;

/// The event bytes: `event: error` then a JSON `data:` line naming the reason.
pub fn abort_event(reason: AbortReason) -> String {
    format!(
        "event: error\ndata: {{\"error\":{{\"type\":\"kvguard_aborted\",\"reason\":\"{}\"}}}}\n\n",
        reason.as_str()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_shape() {
        let e = abort_event(AbortReason::MaxAge);
        assert_eq!(e, "event: error\ndata: {\"error\":{\"type\":\"kvguard_aborted\",\"reason\":\"max_age\"}}\n\n");
        let json: serde_json::Value =
            serde_json::from_str(e.lines().nth(1).unwrap().trim_start_matches("data: ")).unwrap();
        assert_eq!(json["error"]["reason"], "max_age");
    }
}
