//! Times the body scanner on the recorded vLLM chat stream: ns per event, one event per
//! chunk (paced streams) and 16 KiB chunks (saturation). Build it natively or for
//! wasm32-wasip1 and run it under Node.js (`filter/wasi-runner.mjs`) to see what V8 does.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use kvguard_filter_core::scan::{Framing, Scanner};
use std::time::Instant;

const CHAT: &[u8] = include_bytes!("../../../../shared/fixtures/sse/vllm-0.32-chat-usage.sse");

fn main() {
    // The middle events (content chunks), each ending in a blank line.
    let text = std::str::from_utf8(CHAT).unwrap();
    let events: Vec<String> = text
        .split("\n\n")
        .filter(|e| e.contains("\"content\":\" "))
        .map(|e| format!("{e}\n\n"))
        .collect();
    let rounds = 20_000;
    let mut body = Vec::new();
    for i in 0..rounds {
        body.extend_from_slice(events[i % events.len()].as_bytes());
    }
    let n_events = rounds as f64;
    look_only(&events);
    for (label, chunk) in [("event-per-chunk", 0usize), ("16KiB-chunks", 16 * 1024)] {
        let mut best = f64::MAX;
        for _ in 0..7 {
            let mut s = Scanner::new(Framing::Sse, 65536);
            let t = Instant::now();
            let mut seen = 0u64;
            if chunk == 0 {
                for i in 0..rounds {
                    seen += u64::from(s.feed(events[i % events.len()].as_bytes()).events);
                }
            } else {
                for c in body.chunks(chunk) {
                    seen += u64::from(s.feed(c).events);
                }
            }
            let ns = t.elapsed().as_nanos() as f64 / n_events;
            assert_eq!(seen, rounds as u64);
            best = best.min(ns);
        }
        println!(
            "{label}: {best:.1} ns/event ({} bytes/event)",
            body.len() / rounds
        );
    }
}

#[allow(dead_code)]
fn look_only(events: &[String]) {
    let datas: Vec<&[u8]> = events
        .iter()
        .map(|e| e.trim_end().strip_prefix("data: ").unwrap().as_bytes())
        .collect();
    let mut best = f64::MAX;
    for _ in 0..7 {
        let t = Instant::now();
        let mut n = 0usize;
        for i in 0..20_000 {
            n += kvguard_filter_core::json::look(datas[i % datas.len()])
                .choices
                .len();
        }
        best = best.min(t.elapsed().as_nanos() as f64 / 20_000.0);
        assert_eq!(n, 20_000);
    }
    println!("look only: {best:.1} ns/event");
    let mut best = f64::MAX;
    for _ in 0..7 {
        let t = Instant::now();
        let mut n = 0usize;
        for i in 0..20_000 {
            n += usize::from(kvguard_filter_core::json::inert(datas[i % datas.len()]).is_some());
        }
        best = best.min(t.elapsed().as_nanos() as f64 / 20_000.0);
        assert_eq!(n, 20_000);
    }
    println!("inert only: {best:.1} ns/event");
}
