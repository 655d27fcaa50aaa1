//! Times the body scanner on the recorded vLLM chat stream: ns per event for the full JSON
//! look, the completion pre-check (`json::inert`), and the scanner fed one event per
//! chunk (paced streams) and 16 KiB chunks (saturation). Build it natively or for
//! wasm32-wasip1 and run it under Node.js (`filter/wasi-runner.mjs`) to see what V8 does.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use kvguard_filter_core::json;
use kvguard_filter_core::scan::{Framing, Scanner};
use std::time::Instant;

const CHAT: &[u8] = include_bytes!("../../../integration/fixtures/sse/vllm-0.32-chat-usage.sse");

/// Events per timed run.
const ROUNDS: usize = 20_000;

/// Best of 7 runs of `run`, in ns per event; `run` returns how many events it counted,
/// which must be [`ROUNDS`].
fn best_ns_per_event(label: &str, mut run: impl FnMut() -> usize) {
    let mut best = f64::MAX;
    for _ in 0..7 {
        let t = Instant::now();
        let counted = run();
        best = best.min(t.elapsed().as_nanos() as f64 / ROUNDS as f64);
        assert_eq!(counted, ROUNDS, "{label}");
    }
    println!("{label}: {best:.1} ns/event");
}

fn main() {
    // The middle events (content chunks), each ending in a blank line.
    let text = std::str::from_utf8(CHAT).unwrap();
    let events: Vec<String> = text
        .split("\n\n")
        .filter(|e| e.contains("\"content\":\" "))
        .map(|e| format!("{e}\n\n"))
        .collect();
    let datas: Vec<&[u8]> = events
        .iter()
        .map(|e| e.trim_end().strip_prefix("data: ").unwrap().as_bytes())
        .collect();
    let body: Vec<u8> = (0..ROUNDS)
        .flat_map(|i| events[i % events.len()].bytes())
        .collect();
    println!("{} bytes/event", body.len() / ROUNDS);
    best_ns_per_event("look only", || {
        (0..ROUNDS)
            .filter(|i| !json::look(datas[i % datas.len()]).malformed)
            .count()
    });
    best_ns_per_event("inert only", || {
        (0..ROUNDS)
            .filter(|i| json::inert(datas[i % datas.len()]))
            .count()
    });
    best_ns_per_event("event-per-chunk", || {
        let mut s = Scanner::new(Framing::Sse, 65536);
        (0..ROUNDS)
            .map(|i| s.feed(events[i % events.len()].as_bytes()).events as usize)
            .sum()
    });
    best_ns_per_event("16KiB-chunks", || {
        let mut s = Scanner::new(Framing::Sse, 65536);
        body.chunks(16 * 1024)
            .map(|c| s.feed(c).events as usize)
            .sum()
    });
}
