//! Fault injection for the integration tests (cargo feature `trap-injection`, off by
//! default; scripts/build builds it to a separate `kvguard_filter_trap.wasm`, never the
//! shipped module). Without the feature every hook is an empty inline function.
//!
//! With it:
//! - every request gets `x-kvguard-test-vm: <id>` towards the upstream, `<id>` a random
//!   number drawn once per VM instance, so a test can tell which worker's VM (and which
//!   instance of it, after a reload) saw a request;
//! - a request carrying `x-kvguard-test-trap: request-headers` or `response-body` traps
//!   the VM (wasm `unreachable`) in that callback; a trapped VM is gone, and Envoy's
//!   `failure_policy` decides what happens next.

/// Hook at the start of `on_http_request_headers` of stream context `ctx`.
#[inline(always)]
pub fn on_request_headers(ctx: u32) {
    #[cfg(feature = "trap-injection")]
    imp::on_request_headers(ctx);
    #[cfg(not(feature = "trap-injection"))]
    let _ = ctx;
}

/// Hook at the start of `on_http_response_body` of stream context `ctx`.
#[inline(always)]
pub fn on_response_body(ctx: u32) {
    #[cfg(feature = "trap-injection")]
    imp::on_response_body(ctx);
    #[cfg(not(feature = "trap-injection"))]
    let _ = ctx;
}

#[cfg(feature = "trap-injection")]
mod imp {
    use crate::abi;
    use std::cell::RefCell;
    use std::hash::{BuildHasher, Hasher};
    use std::sync::OnceLock;

    /// The request header that asks for a trap.
    const TRAP_HEADER: &str = "x-kvguard-test-trap";
    /// The request header (towards the upstream) naming the VM instance.
    const VM_HEADER: &str = "x-kvguard-test-vm";

    /// Most streams armed for a response-body trap that are remembered.
    const MAX_ARMED: usize = 64;

    static VM_ID: OnceLock<u64> = OnceLock::new();

    thread_local! {
        /// Stream contexts that asked for a trap in their response body (request headers
        /// are no longer readable then).
        static ARMED: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    }

    fn vm_id() -> u64 {
        *VM_ID.get_or_init(|| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(abi::now_nanos());
            h.finish()
        })
    }

    pub fn on_request_headers(ctx: u32) {
        let id = format!("{:016x}", vm_id());
        let _ = abi::replace_header(abi::Map::RequestHeaders, VM_HEADER, id.as_bytes());
        let asked = abi::get_header(abi::Map::RequestHeaders, TRAP_HEADER)
            .ok()
            .flatten();
        match asked.as_deref() {
            Some(b"request-headers") => trap("request headers"),
            Some(b"response-body") => ARMED.with(|a| {
                if let Ok(mut a) = a.try_borrow_mut() {
                    if a.len() >= MAX_ARMED {
                        a.remove(0);
                    }
                    a.push(ctx);
                }
            }),
            _ => {}
        }
    }

    pub fn on_response_body(ctx: u32) {
        let armed = ARMED.with(|a| a.try_borrow().map(|a| a.contains(&ctx)).unwrap_or(false));
        if armed {
            trap("the response body");
        }
    }

    fn trap(phase: &str) -> ! {
        abi::log(
            abi::LogLevel::Warn,
            &format!(
                "test trap in {phase} (vm {:016x}; trap-injection build)",
                vm_id()
            ),
        );
        #[cfg(target_arch = "wasm32")]
        core::arch::wasm32::unreachable();
        #[cfg(not(target_arch = "wasm32"))]
        std::process::abort();
    }
}
