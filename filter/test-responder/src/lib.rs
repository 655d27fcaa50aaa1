//! A test-only proxy-wasm HTTP filter that answers the client itself, with
//! `proxy_send_local_response`, at the point the request header `x-test-reply` names:
//!
//! - `response-headers`: in its response-headers callback (the upstream has answered);
//! - `response-body`: in its first response-body callback;
//! - `request-headers`: in its request-headers callback (before any upstream);
//! - `after-ms=<N>`: from its root context's tick, N ms after the request headers
//!   (before the upstream's response headers if the upstream is slower than that).
//!
//! Placed after kvguard in `http_filters`, it sees the response before kvguard does. Its
//! local replies carry `x-test-reply: local` and the body `test-responder local reply`.
//! Built by `scripts/build` into the wasm target dir as `kvguard_test_responder.wasm`
//! for `integration/tests/filter_local_reply.rs`; never shipped.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::cell::RefCell;
use std::time::{Duration, SystemTime};

/// The request header that asks for a local reply.
const HEADER: &str = "x-test-reply";
/// The local reply's body.
const BODY: &[u8] = b"test-responder local reply\n";
/// The root context's tick while replies are scheduled.
const TICK: Duration = Duration::from_millis(20);

/// When to answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    None,
    ResponseHeaders,
    ResponseBody,
    RequestHeaders,
    AfterMs(u64),
}

impl Mode {
    fn parse(v: &str) -> Mode {
        match v {
            "response-headers" => Mode::ResponseHeaders,
            "response-body" => Mode::ResponseBody,
            "request-headers" => Mode::RequestHeaders,
            _ => v
                .strip_prefix("after-ms=")
                .and_then(|n| n.parse().ok())
                .map_or(Mode::None, Mode::AfterMs),
        }
    }
}

thread_local! {
    /// Stream contexts waiting for a timed reply, with their due time.
    static DUE: RefCell<Vec<(u32, SystemTime)>> = const { RefCell::new(Vec::new()) };
}

fn log(msg: &str) {
    let _ = hostcalls::log(LogLevel::Info, &format!("test-responder: {msg}"));
}

fn reply(ctx: u32, at: &str) {
    log(&format!("local reply {at} (context {ctx})"));
    let _ = hostcalls::send_http_response(500, vec![("x-test-reply", "local")], Some(BODY));
}

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn on_tick(&mut self) {
        let now = hostcalls::get_current_time().unwrap_or(SystemTime::UNIX_EPOCH);
        let due: Vec<u32> = DUE.with(|d| {
            let mut d = d.borrow_mut();
            let (due, rest): (Vec<_>, Vec<_>) = d.drain(..).partition(|(_, t)| *t <= now);
            *d = rest;
            due.into_iter().map(|(c, _)| c).collect()
        });
        for ctx in due {
            if hostcalls::set_effective_context(ctx).is_ok() {
                reply(ctx, "from the tick");
            }
        }
        if DUE.with(|d| d.borrow().is_empty()) {
            let _ = hostcalls::set_tick_period(Duration::ZERO);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream {
            id: context_id,
            mode: Mode::None,
            replied: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    id: u32,
    mode: Mode,
    replied: bool,
}

impl Context for Stream {}

impl Drop for Stream {
    fn drop(&mut self) {
        let id = self.id;
        DUE.with(|d| d.borrow_mut().retain(|(c, _)| *c != id));
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
        self.mode = self
            .get_http_request_header(HEADER)
            .map_or(Mode::None, |v| Mode::parse(&v));
        if self.mode == Mode::RequestHeaders {
            reply(self.id, "in the request headers");
            return Action::Pause;
        }
        if let Mode::AfterMs(ms) = self.mode {
            let now = hostcalls::get_current_time().unwrap_or(SystemTime::UNIX_EPOCH);
            DUE.with(|d| {
                d.borrow_mut()
                    .push((self.id, now + Duration::from_millis(ms)))
            });
            let _ = hostcalls::set_tick_period(TICK);
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _: usize, _: bool) -> Action {
        match self.mode {
            Mode::ResponseHeaders => {
                self.replied = true;
                reply(self.id, "in the response headers");
                Action::Pause
            }
            _ => Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, _: usize, _: bool) -> Action {
        match self.mode {
            Mode::ResponseBody if !self.replied => {
                self.replied = true;
                reply(self.id, "in the response body");
                Action::Pause
            }
            _ => Action::Continue,
        }
    }
}
