//! A proxy-wasm HTTP filter that does nothing: every stream gets a context whose
//! callbacks (request headers, response headers, response body, log) are entered and
//! return `Continue`. The overhead benchmark compares Envoy with no filter, with this
//! filter, and with kvguard: the difference between this one and no filter is the price of
//! the wasm runtime itself; between kvguard and this one, kvguard's own work.
//!
//! With the plugin configuration `{"read_body": true}` it also copies every response body
//! chunk into the VM (`get_http_response_body`) and does nothing with it: the price of
//! the host ABI copy alone, which kvguard pays to scan SSE.
//!
//! With `{"repeat": "<call>", "times": N}` it makes one host call N times per request (in
//! `on_http_request_headers`), so that the bench's `requests` section can measure what
//! one host call costs: (CPU/request − the do-nothing filter's) / N. `<call>` is one of
//! `clock` (`get_current_time`), `header` (`get_http_request_header(":path")`),
//! `wasi_clock` (WASI `clock_time_get(MONOTONIC)`, the clock kvguard reads),
//! `header_absent` (a header the request does not have), `header_pairs` (all request
//! headers at once, `proxy_get_header_map_pairs`), `remove_header` (removing one
//! it does not have),
//! `metric` (`increment_metric`), `record` (`record_metric` on a histogram),
//! `set_property` (a filter-state write), `get_property` (`response.code_details`).
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(NoopRoot { read_body: false, repeat: Repeat::None, times: 0, counter: 0, histogram: 0 }) });
}}

/// The host call a configured filter repeats per request.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Repeat {
    None,
    Clock,
    WasiClock,
    Header,
    HeaderPairs,
    HeaderAbsent,
    RemoveHeader,
    Metric,
    Record,
    SetProperty,
    GetProperty,
}

struct NoopRoot {
    read_body: bool,
    repeat: Repeat,
    times: u32,
    counter: u32,
    histogram: u32,
}

/// The number after `"key":` in a flat JSON object (no JSON parser in the baseline).
fn number_after(cfg: &str, key: &str) -> Option<u32> {
    let at = cfg.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = cfg[at..].trim_start().strip_prefix(':')?.trim_start();
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

impl Context for NoopRoot {}

impl RootContext for NoopRoot {
    fn on_configure(&mut self, _: usize) -> bool {
        let cfg = self.get_plugin_configuration().unwrap_or_default();
        self.read_body = cfg.windows(9).any(|w| w == b"read_body");
        let text = String::from_utf8_lossy(&cfg);
        self.repeat = [
            ("clock", Repeat::Clock),
            ("wasi_clock", Repeat::WasiClock),
            ("header", Repeat::Header),
            ("header_absent", Repeat::HeaderAbsent),
            ("header_pairs", Repeat::HeaderPairs),
            ("remove_header", Repeat::RemoveHeader),
            ("metric", Repeat::Metric),
            ("record", Repeat::Record),
            ("set_property", Repeat::SetProperty),
            ("get_property", Repeat::GetProperty),
        ]
        .into_iter()
        .find(|(name, _)| text.contains(&format!("\"repeat\": \"{name}\"")))
        .map_or(Repeat::None, |(_, r)| r);
        self.times = number_after(&text, "times").unwrap_or(0);
        self.counter = hostcalls::define_metric(MetricType::Counter, "bench_noop_calls").unwrap_or(0);
        self.histogram =
            hostcalls::define_metric(MetricType::Histogram, "bench_noop_hist").unwrap_or(0);
        true
    }
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Noop {
            read_body: self.read_body,
            repeat: self.repeat,
            times: self.times,
            counter: self.counter,
            histogram: self.histogram,
        }))
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Noop {
    read_body: bool,
    repeat: Repeat,
    times: u32,
    counter: u32,
    histogram: u32,
}

impl Context for Noop {}

impl HttpContext for Noop {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
        for i in 0..self.times {
            match self.repeat {
                Repeat::None => break,
                Repeat::Clock => {
                    let _ = hostcalls::get_current_time();
                }
                Repeat::Header => {
                    let _ = self.get_http_request_header(":path");
                }
                Repeat::WasiClock => {
                    let _ = std::hint::black_box(std::time::Instant::now());
                }
                Repeat::HeaderPairs => {
                    let _ = hostcalls::get_map_bytes(proxy_wasm::types::MapType::HttpRequestHeaders);
                }
                Repeat::HeaderAbsent => {
                    let _ = self.get_http_request_header("x-kvguard-control");
                }
                Repeat::RemoveHeader => {
                    self.set_http_request_header("x-kvguard-control", None);
                }
                Repeat::Metric => {
                    let _ = hostcalls::increment_metric(self.counter, 1);
                }
                Repeat::Record => {
                    let _ = hostcalls::record_metric(self.histogram, u64::from(i));
                }
                Repeat::SetProperty => {
                    self.set_property(vec!["bench.noop"], Some(b"completed"));
                }
                Repeat::GetProperty => {
                    let _ = self.get_property(vec!["request", "path"]);
                }
            }
        }
        Action::Continue
    }
    fn on_http_response_headers(&mut self, _: usize, _: bool) -> Action {
        Action::Continue
    }
    fn on_http_response_body(&mut self, body_size: usize, _: bool) -> Action {
        if self.read_body {
            let _ = self.get_http_response_body(0, body_size);
        }
        Action::Continue
    }
    fn on_log(&mut self) {}
}
