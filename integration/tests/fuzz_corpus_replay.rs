//! Replays the committed fuzz corpus (`fuzz/corpus/<target>/`) through the same oracles
//! the fuzzers use (`fuzz/src/checks.rs`), as ordinary stable tests: no panic, every
//! property holds, and the SSE scanner's memory stays bounded by `max_event_bytes`
//! (measured with a per-thread counting allocator). The long fuzz runs are in
//! `scripts/fuzz`; this keeps every input they ever found interesting in the suite.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../fuzz/src/checks.rs"]
#[allow(dead_code)]
mod checks;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;

/// Counts live bytes and the peak per thread (the scanner runs on one thread).
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn bump(delta: isize) {
    let _ = LIVE.try_with(|l| {
        let v = l.get() + delta;
        l.set(v);
        let _ = PEAK.try_with(|p| {
            if v > p.get() {
                p.set(v)
            }
        });
    });
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        bump(layout.size() as isize);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        bump(-(layout.size() as isize));
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        bump(new_size as isize - layout.size() as isize);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no corpus in {}", dir.display());
    files
        .into_iter()
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect()
}

fn replay(target: &str, check: fn(&[u8])) {
    let inputs = corpus(target);
    let mut failed = Vec::new();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for (path, data) in &inputs {
        if let Err(e) = std::panic::catch_unwind(|| check(data)) {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let short: String = msg.chars().take(300).collect();
            failed.push(format!("{}: {short}", path.display()));
        }
    }
    std::panic::set_hook(hook);
    assert!(
        failed.is_empty(),
        "{target}: {} of {} corpus inputs fail (rerun one with `RUSTC_BOOTSTRAP=1 cargo fuzz run -s none -a {target} <file>` in fuzz/):\n{}",
        failed.len(),
        inputs.len(),
        failed.join("\n")
    );
    eprintln!("{target}: {} corpus inputs replayed", inputs.len());
}

#[test]
fn sse_scanner_corpus() {
    replay("sse_scanner", checks::sse_scanner);
}

#[test]
fn json_look_corpus() {
    replay("json_look", checks::json_look);
}

#[test]
fn filter_config_corpus() {
    replay("filter_config", checks::filter_config);
}

#[test]
fn control_header_corpus() {
    replay("control_header", checks::control_header);
}

#[test]
fn abort_request_corpus() {
    replay("abort_request", checks::abort_request);
}

#[test]
fn control_abort_api_corpus() {
    replay("control_abort_api", checks::control_abort_api);
}

#[test]
fn control_scanner_corpus() {
    replay("control_scanner", checks::control_scanner);
}

#[test]
fn control_text_corpus() {
    replay("control_text", checks::control_text);
}

#[test]
fn filter_engine_corpus() {
    replay("filter_engine", checks::filter_engine);
}

/// The scanner holds at most one event (bounded by `max_event_bytes`) whatever the body:
/// its peak heap use while eating any corpus body, and a 4 MiB body of one endless event,
/// stays under 2 × max_event_bytes + 64 KiB.
#[test]
fn sse_scanner_memory_is_bounded_by_max_event_bytes() {
    use kvguard_filter_core::scan::{Framing, Scanner};
    let mut bodies: Vec<Vec<u8>> = corpus("sse_scanner")
        .into_iter()
        .map(|(_, d)| d.get(2..).unwrap_or_default().to_vec())
        .collect();
    let mut endless = b"data: ".to_vec();
    endless.resize(4 << 20, b'x');
    bodies.push(endless);
    let mut lines = Vec::new();
    while lines.len() < 4 << 20 {
        lines.extend_from_slice(b"data: 0123456789abcdef\n");
    }
    bodies.push(lines);
    for max_event in [256usize, 65536] {
        for framing in [Framing::Sse, Framing::Ndjson] {
            for body in &bodies {
                let before = LIVE.with(|l| l.get());
                PEAK.with(|p| p.set(before));
                let mut sc = Scanner::new(framing, max_event);
                for chunk in body.chunks(16 * 1024) {
                    let _ = sc.feed(chunk);
                }
                let _ = sc.finish(&mut |_| {});
                let peak = PEAK.with(|p| p.get()) - before;
                drop(sc);
                let bound = (2 * max_event + 64 * 1024) as isize;
                assert!(
                    peak <= bound,
                    "scanner peaked at {peak} bytes (bound {bound}) on a {}-byte body ({framing:?}, max_event_bytes {max_event})",
                    body.len()
                );
            }
        }
    }
}
