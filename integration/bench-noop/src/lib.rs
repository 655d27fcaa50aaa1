//! A proxy-wasm HTTP filter that does nothing: every stream gets a context whose
//! callbacks (request headers, response headers, response body, log) are entered and
//! return `Continue`. The overhead benchmark compares Envoy with no filter, with this
//! filter, and with kvguard: the difference between this one and no filter is the price of
//! the wasm runtime itself; between kvguard and this one, kvguard's own work.
//!
//! With the plugin configuration `{"read_body": true}` it also copies every response body
//! chunk into the VM (`get_http_response_body`) and does nothing with it: the price of
//! the host ABI copy alone, which kvguard pays to scan SSE.
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(NoopRoot { read_body: false }) });
}}

struct NoopRoot {
    read_body: bool,
}

impl Context for NoopRoot {}

impl RootContext for NoopRoot {
    fn on_configure(&mut self, _: usize) -> bool {
        let cfg = self.get_plugin_configuration().unwrap_or_default();
        self.read_body = cfg.windows(9).any(|w| w == b"read_body");
        true
    }
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Noop {
            read_body: self.read_body,
        }))
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Noop {
    read_body: bool,
}

impl Context for Noop {}

impl HttpContext for Noop {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
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
