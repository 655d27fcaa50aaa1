//! The one place with `unsafe`: thin wrappers over the raw proxy-wasm ABI imports that
//! return the host's status instead of panicking (the `proxy-wasm` 0.2.5 SDK's wrappers
//! panic on any unexpected status, and its string getters panic on non-UTF-8 header
//! values; one panic kills the worker's VM). Values are returned as bytes.
//!
//! Off wasm32 (native `cargo check`/clippy/test of the crate) the imports are replaced by
//! stubs that answer `NotFound`, so nothing links against a missing host.
#![allow(unsafe_code)]

/// A host status other than `Ok` (the raw ABI value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u32);

/// Status `NotFound`.
pub const NOT_FOUND: u32 = 1;
/// Status `Empty` (shared queue).
pub const EMPTY: u32 = 7;

/// Header maps (ABI values).
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
#[allow(clippy::enum_variant_names)]
pub enum Map {
    /// Request headers.
    RequestHeaders = 0,
    /// Response headers.
    ResponseHeaders = 2,
    /// Headers of an `http_call` answer.
    HttpCallResponseHeaders = 6,
}

/// Buffers (ABI values).
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum Buffer {
    /// The response body chunk.
    ResponseBody = 1,
    /// The body of an `http_call` answer.
    HttpCallResponseBody = 4,
    /// The plugin configuration.
    PluginConfiguration = 7,
}

/// Log levels (ABI values).
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum LogLevel {
    /// Trace.
    Trace = 0,
    /// Debug.
    Debug = 1,
    /// Info.
    Info = 2,
    /// Warn.
    Warn = 3,
    /// Error.
    Error = 4,
    /// Critical.
    Critical = 5,
}

#[cfg(target_arch = "wasm32")]
mod imports {
    #[link(wasm_import_module = "env")]
    extern "C" {
        pub fn proxy_log(level: u32, data: *const u8, size: usize) -> u32;
        pub fn proxy_get_log_level(return_level: *mut u32) -> u32;
        pub fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
        pub fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
        pub fn proxy_get_buffer_bytes(
            buffer_type: u32,
            start: usize,
            max_size: usize,
            return_data: *mut *mut u8,
            return_size: *mut usize,
        ) -> u32;
        pub fn proxy_get_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            return_data: *mut *mut u8,
            return_size: *mut usize,
        ) -> u32;
        pub fn proxy_get_header_map_pairs(
            map_type: u32,
            return_data: *mut *mut u8,
            return_size: *mut usize,
        ) -> u32;
        pub fn proxy_remove_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
        ) -> u32;
        pub fn proxy_replace_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        pub fn proxy_get_property(
            path_data: *const u8,
            path_size: usize,
            return_data: *mut *mut u8,
            return_size: *mut usize,
        ) -> u32;
        pub fn proxy_set_property(
            path_data: *const u8,
            path_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        pub fn proxy_register_shared_queue(
            name_data: *const u8,
            name_size: usize,
            return_id: *mut u32,
        ) -> u32;
        pub fn proxy_enqueue_shared_queue(
            queue_id: u32,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        pub fn proxy_dequeue_shared_queue(
            queue_id: u32,
            return_data: *mut *mut u8,
            return_size: *mut usize,
        ) -> u32;
        pub fn proxy_set_effective_context(context_id: u32) -> u32;
        pub fn proxy_close_stream(stream_type: u32) -> u32;
        pub fn proxy_define_metric(
            metric_type: u32,
            name_data: *const u8,
            name_size: usize,
            return_id: *mut u32,
        ) -> u32;
        pub fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
        pub fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
        pub fn proxy_get_shared_data(
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
            return_cas: *mut u32,
        ) -> u32;
        pub fn proxy_set_shared_data(
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
            cas: u32,
        ) -> u32;
    }

    // WASI's clock (the proxy-wasm host maps clock 1, MONOTONIC, to Envoy's monotonic
    // time). Declared here rather than through `std::time::Instant`, which panics when
    // the host refuses the read.
    #[link(wasm_import_module = "wasi_snapshot_preview1")]
    extern "C" {
        pub fn clock_time_get(clock_id: u32, precision: u64, time: *mut u64) -> u32;
    }
}

#[cfg(not(target_arch = "wasm32"))]
#[allow(clippy::missing_safety_doc, missing_docs)]
mod imports {
    //! Native stubs: there is no host.
    use super::NOT_FOUND;
    pub unsafe fn proxy_log(_: u32, _: *const u8, _: usize) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_get_log_level(_: *mut u32) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_get_current_time_nanoseconds(_: *mut u64) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_set_tick_period_milliseconds(_: u32) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_get_buffer_bytes(
        _: u32,
        _: usize,
        _: usize,
        _: *mut *mut u8,
        _: *mut usize,
    ) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_get_header_map_value(
        _: u32,
        _: *const u8,
        _: usize,
        _: *mut *mut u8,
        _: *mut usize,
    ) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_get_header_map_pairs(_: u32, _: *mut *mut u8, _: *mut usize) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_remove_header_map_value(_: u32, _: *const u8, _: usize) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_replace_header_map_value(
        _: u32,
        _: *const u8,
        _: usize,
        _: *const u8,
        _: usize,
    ) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_get_property(
        _: *const u8,
        _: usize,
        _: *mut *mut u8,
        _: *mut usize,
    ) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_set_property(_: *const u8, _: usize, _: *const u8, _: usize) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_register_shared_queue(_: *const u8, _: usize, _: *mut u32) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_enqueue_shared_queue(_: u32, _: *const u8, _: usize) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_dequeue_shared_queue(_: u32, _: *mut *mut u8, _: *mut usize) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_set_effective_context(_: u32) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_close_stream(_: u32) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_define_metric(_: u32, _: *const u8, _: usize, _: *mut u32) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_increment_metric(_: u32, _: i64) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_record_metric(_: u32, _: u64) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_get_shared_data(
        _: *const u8,
        _: usize,
        _: *mut *mut u8,
        _: *mut usize,
        _: *mut u32,
    ) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn proxy_set_shared_data(
        _: *const u8,
        _: usize,
        _: *const u8,
        _: usize,
        _: u32,
    ) -> u32 {
        NOT_FOUND
    }
    pub unsafe fn clock_time_get(_: u32, _: u64, _: *mut u64) -> u32 {
        NOT_FOUND
    }
}

use imports::*;

fn check(status: u32) -> Result<(), Status> {
    if status == 0 {
        Ok(())
    } else {
        Err(Status(status))
    }
}

/// Takes ownership of a host-allocated buffer (the host allocates through the SDK's
/// `proxy_on_memory_allocate`, i.e. a `Vec<u8>` of exactly `size` capacity).
fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() || size == 0 {
        return Vec::new();
    }
    // SAFETY: the host wrote `size` bytes into memory it allocated through
    // `proxy_on_memory_allocate(size)`, which is `Vec::with_capacity(size)` leaked; we
    // are its only owner.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

/// Logs a message (errors ignored: there is nowhere else to report them).
pub fn log(level: LogLevel, msg: &str) {
    // SAFETY: pointer and length of a live `&str`.
    let _ = unsafe { proxy_log(level as u32, msg.as_ptr(), msg.len()) };
}

/// The host's log level (ABI value), if it tells.
pub fn log_level() -> Option<u32> {
    let mut level = 0u32;
    // SAFETY: a valid out-pointer.
    check(unsafe { proxy_get_log_level(&mut level) }).ok()?;
    Some(level)
}

/// The last monotonic reading, returned again when a read fails: a failed read makes
/// time stand still (streams look younger, never older), it never looks like a stall.
static LAST_MONOTONIC_NS: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);

/// Monotonic time in milliseconds (WASI `clock_time_get(MONOTONIC)`, which Envoy serves
/// from its monotonic clock: a wall-clock step does not move it). `Err` carries the last
/// good reading when the host refused this one.
pub fn monotonic_ms() -> Result<u64, u64> {
    use core::sync::atomic::Ordering::Relaxed;
    let mut t = 0u64;
    // SAFETY: a valid out-pointer. Clock 1 = MONOTONIC.
    let errno = unsafe { clock_time_get(1, 1_000_000, &mut t) };
    let last = LAST_MONOTONIC_NS.load(Relaxed);
    if errno != 0 {
        return Err(last / 1_000_000);
    }
    let t = t.max(last);
    LAST_MONOTONIC_NS.store(t, Relaxed);
    Ok(t / 1_000_000)
}

/// Wall-clock time in nanoseconds since the epoch (0 if the host refuses). Only for
/// signatures and seeds, never for a timer.
pub fn now_nanos() -> u64 {
    let mut t = 0u64;
    // SAFETY: a valid out-pointer.
    match check(unsafe { proxy_get_current_time_nanoseconds(&mut t) }) {
        Ok(()) => t,
        Err(_) => 0,
    }
}

/// Sets the root context's tick period (0 = off). From a stream context the host
/// applies it to that stream's root context.
pub fn set_tick_period_ms(ms: u32) -> Result<(), Status> {
    // SAFETY: plain value.
    check(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

/// Reads `max` bytes of a buffer from `start`.
pub fn get_buffer(buffer: Buffer, start: usize, max: usize) -> Result<Vec<u8>, Status> {
    let mut data: *mut u8 = core::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: valid out-pointers; the returned buffer is taken over by `take`.
    let status = unsafe { proxy_get_buffer_bytes(buffer as u32, start, max, &mut data, &mut size) };
    match status {
        0 => Ok(take(data, size)),
        NOT_FOUND => Ok(Vec::new()),
        s => Err(Status(s)),
    }
}

/// A header value as raw bytes (`None` when absent or when the host refuses, e.g. the
/// map is not readable in this phase).
pub fn get_header(map: Map, key: &str) -> Result<Option<Vec<u8>>, Status> {
    let mut data: *mut u8 = core::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: `key` is a live `&str`; valid out-pointers; buffer taken over by `take`.
    let status = unsafe {
        proxy_get_header_map_value(map as u32, key.as_ptr(), key.len(), &mut data, &mut size)
    };
    match status {
        0 => Ok(Some(take(data, size))),
        NOT_FOUND => Ok(None),
        s => Err(Status(s)),
    }
}

/// A whole header map, serialized as the host writes it (read with
/// [`kvguard_filter_core::header_map::values`]): one host call and one copy for several
/// headers.
pub fn get_header_pairs(map: Map) -> Result<Vec<u8>, Status> {
    let mut data: *mut u8 = core::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: valid out-pointers; the returned buffer is taken over by `take`.
    let status = unsafe { proxy_get_header_map_pairs(map as u32, &mut data, &mut size) };
    match status {
        0 => Ok(take(data, size)),
        s => Err(Status(s)),
    }
}

/// Removes a header.
pub fn remove_header(map: Map, key: &str) -> Result<(), Status> {
    // SAFETY: `key` is a live `&str`.
    check(unsafe { proxy_remove_header_map_value(map as u32, key.as_ptr(), key.len()) })
}

/// Sets a header, replacing any value it had.
pub fn replace_header(map: Map, key: &str, value: &[u8]) -> Result<(), Status> {
    // SAFETY: `key` and `value` are live.
    check(unsafe {
        proxy_replace_header_map_value(
            map as u32,
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

fn path_bytes(path: &[&str]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, p) in path.iter().enumerate() {
        if i > 0 {
            out.push(0);
        }
        out.extend_from_slice(p.as_bytes());
    }
    out
}

/// A property (e.g. `["response", "code_details"]`) as raw bytes.
pub fn get_property(path: &[&str]) -> Result<Option<Vec<u8>>, Status> {
    let p = path_bytes(path);
    let mut data: *mut u8 = core::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: `p` is live; valid out-pointers; buffer taken over by `take`.
    let status = unsafe { proxy_get_property(p.as_ptr(), p.len(), &mut data, &mut size) };
    match status {
        0 => Ok(Some(take(data, size))),
        NOT_FOUND => Ok(None),
        s => Err(Status(s)),
    }
}

/// Sets a property (filter state for an unknown path).
pub fn set_property(path: &[&str], value: &[u8]) -> Result<(), Status> {
    let p = path_bytes(path);
    // SAFETY: both slices are live.
    check(unsafe { proxy_set_property(p.as_ptr(), p.len(), value.as_ptr(), value.len()) })
}

/// Registers (or finds) a shared queue of this VM; its `on_queue_ready` goes to the
/// calling root context.
pub fn register_queue(name: &str) -> Result<u32, Status> {
    let mut id = 0u32;
    // SAFETY: `name` is live; a valid out-pointer.
    check(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// Enqueues a message.
pub fn enqueue(queue: u32, value: &[u8]) -> Result<(), Status> {
    // SAFETY: `value` is live.
    check(unsafe { proxy_enqueue_shared_queue(queue, value.as_ptr(), value.len()) })
}

/// Dequeues a message (`None` when empty).
pub fn dequeue(queue: u32) -> Result<Option<Vec<u8>>, Status> {
    let mut data: *mut u8 = core::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: valid out-pointers; buffer taken over by `take`.
    let status = unsafe { proxy_dequeue_shared_queue(queue, &mut data, &mut size) };
    match status {
        0 => Ok(Some(take(data, size))),
        EMPTY => Ok(None),
        s => Err(Status(s)),
    }
}

/// Makes `context_id` the context later calls act on.
pub fn set_effective_context(context_id: u32) -> Result<(), Status> {
    // SAFETY: plain value.
    check(unsafe { proxy_set_effective_context(context_id) })
}

/// Resets the effective context's HTTP stream (`reset_http_response` in the SDK).
pub fn reset_stream() -> Result<(), Status> {
    // SAFETY: plain value (StreamType::HttpResponse).
    check(unsafe { proxy_close_stream(1) })
}

/// Defines a metric (0 = counter, 1 = gauge, 2 = histogram); returns its id.
pub fn define_metric(kind: u32, name: &str) -> Result<u32, Status> {
    let mut id = 0u32;
    // SAFETY: `name` is live; a valid out-pointer.
    check(unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// Adds `delta` to a metric.
pub fn increment_metric(id: u32, delta: i64) -> Result<(), Status> {
    // SAFETY: plain values.
    check(unsafe { proxy_increment_metric(id, delta) })
}

/// Records one observation of a histogram.
pub fn record_metric(id: u32, value: u64) -> Result<(), Status> {
    // SAFETY: plain values.
    check(unsafe { proxy_record_metric(id, value) })
}

/// A shared-data value (shared by the VMs of one `vm_id`); `None` when absent.
pub fn get_shared_data(key: &str) -> Result<Option<Vec<u8>>, Status> {
    let mut data: *mut u8 = core::ptr::null_mut();
    let mut size = 0usize;
    let mut cas = 0u32;
    // SAFETY: `key` is live; valid out-pointers; buffer taken over by `take`.
    let status =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    match status {
        0 => Ok(Some(take(data, size))),
        NOT_FOUND => Ok(None),
        s => Err(Status(s)),
    }
}

/// Sets a shared-data value (no compare-and-swap: the last writer wins).
pub fn set_shared_data(key: &str, value: &[u8]) -> Result<(), Status> {
    // SAFETY: both slices are live.
    check(unsafe { proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), 0) })
}

/// Status `CasMismatch` (shared data changed since it was read).
pub const CAS_MISMATCH: u32 = 8;

/// A shared-data value with its compare-and-swap version; `None` when absent.
pub fn get_shared_data_cas(key: &str) -> Result<Option<(Vec<u8>, u32)>, Status> {
    let mut data: *mut u8 = core::ptr::null_mut();
    let mut size = 0usize;
    let mut cas = 0u32;
    // SAFETY: `key` is live; valid out-pointers; buffer taken over by `take`.
    let status =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    match status {
        0 => Ok(Some((take(data, size), cas))),
        NOT_FOUND => Ok(None),
        s => Err(Status(s)),
    }
}

/// Sets a shared-data value if its version is still `cas` (`Err(CAS_MISMATCH)` if
/// another VM wrote it since). A key that is absent is written whatever `cas` says
/// (Envoy's rule), so two VMs racing to create a key may both "win": callers re-read.
pub fn set_shared_data_cas(key: &str, value: &[u8], cas: u32) -> Result<(), Status> {
    // SAFETY: both slices are live.
    check(unsafe {
        proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
    })
}

/// Bytes of the VM's linear memory.
pub fn memory_bytes() -> u64 {
    #[cfg(target_arch = "wasm32")]
    {
        (core::arch::wasm32::memory_size::<0>() as u64).saturating_mul(65_536)
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        0
    }
}

// The proxy-wasm entry point (`_initialize`, `#[no_mangle]`) lives here, with the
// rest of the unsafe-adjacent code.
proxy_wasm::main! {{
    crate::init();
}}
