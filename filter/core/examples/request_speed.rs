//! Times the filter's own work on one request, without any host: the engine's callbacks
//! for a one-event SSE request (headers, response headers, the event chunk, `[DONE]`,
//! `on_log`) against a host that does nothing, in ns per request, with 500 requests in
//! flight (the bench's per-request scenario). Build it natively or for wasm32-wasip1 and
//! run it under Node.js (`filter/wasi-runner.mjs`) to see what V8 does; the host calls
//! themselves are measured in Envoy by `kvguard-bench --sections requests
//! --host-call-costs 1000` (docs/BENCHMARKS.md).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use kvguard_filter_core::host::{Call, Clock, DispatchError, Host, Level};
use kvguard_filter_core::metrics::{Metric, Metrics};
use kvguard_filter_core::{Config, Engine};
use std::time::Instant;

/// A host that does nothing (time advances 1 ms per read).
struct Null {
    now: core::cell::Cell<u64>,
}

impl Clock for Null {
    fn now_ms(&self) -> u64 {
        let t = self.now.get() + 1;
        self.now.set(t);
        t
    }
    fn unix_secs(&self) -> u64 {
        1_700_000_000
    }
}

impl Host for Null {
    fn dispatch(&mut self, _: &Call<'_>) -> Result<u32, DispatchError> {
        Err(DispatchError::Other)
    }
    fn log(&mut self, _: Level, _: &str) {}
    fn log_enabled(&self, _: Level) -> bool {
        false
    }
}

impl Metrics for Null {
    fn add(&mut self, _: Metric, _: i64) {}
    fn record(&mut self, _: Metric, _: u64) {}
}

const IN_FLIGHT: u32 = 500;
const REQUESTS: u32 = 20_000;

fn main() {
    let cfg = Config::parse(
        br#"{"control_cluster":"kvguard","secret":"0123456789abcdef0123"}"#,
        &|_| None,
    )
    .unwrap();
    let event = b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" t0\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
    let done = b"data: [DONE]\n\n";
    let ids: Vec<String> = (0..REQUESTS)
        .map(|i| format!("0b3c5d1e-7f20-4a1b-9c3d-{i:012}"))
        .collect();
    let mut best = f64::MAX;
    for _ in 0..7 {
        let mut e = Engine::new(cfg.clone(), 1);
        let mut p = Null {
            now: core::cell::Cell::new(0),
        };
        let t = Instant::now();
        for i in 0..REQUESTS {
            let ctx = i + 2;
            let id = ids[i as usize].as_bytes();
            e.on_request_headers(&mut p, ctx, Some(b"/v1/chat/completions"), Some(id), true);
            e.on_response_headers(&mut p, ctx, Some(b"text/event-stream"), None, None, false);
            e.on_chunk(&mut p, ctx, event.len(), false, || Some(event.to_vec()));
            e.on_chunk(&mut p, ctx, done.len(), true, || Some(done.to_vec()));
            // Keep IN_FLIGHT requests in the table, as the bench does.
            if i >= IN_FLIGHT {
                let old = ctx - IN_FLIGHT;
                assert!(!e.end_details_needed(old));
                e.on_log(&mut p, old, b"", 0);
            }
        }
        best = best.min(t.elapsed().as_nanos() as f64 / f64::from(REQUESTS));
        assert_eq!(e.tracked(), IN_FLIGHT as usize);
    }
    println!("one-event SSE request, engine work only (no host): {best:.0} ns/request");
}
