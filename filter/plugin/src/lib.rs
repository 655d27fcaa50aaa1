//! kvguard proxy-wasm glue: `RootContext` / `HttpContext` over the host-free core.
//!
//! - Per worker VM, one [`kvguard_filter_core::Engine`] shared by the root context and
//!   the stream contexts through `Rc<RefCell<_>>` (same thread, no locking). Borrows are
//!   held only across host calls that cannot call back into the VM (logs, metrics, time,
//!   `dispatch_http_call`: Envoy defers any callback made during a VM call); closing a
//!   stream, which can run that stream's `on_log` at once, happens with no borrow held.
//! - Aborts are sent from the root context only (the SDK drops answers addressed to a
//!   stream context that is gone). A stream that ends early queues its abort in the
//!   engine and wakes the root through a per-VM shared queue (`on_queue_ready`); the tick
//!   also pumps (retries after backoff).
//! - Every host call goes through [`host`], which returns statuses instead of panicking
//!   and reads header values as bytes.
#![deny(unsafe_code)]

mod host;
mod trap;

use core::cell::RefCell;
use kvguard_contract::{CONTROL_HEADER, REQUEST_ID_HEADER};
use kvguard_filter_core::engine::{Action as EngineAction, BodyNeed, Engine, Verdict};
use kvguard_filter_core::host::{Call, Clock, DispatchError, Host, Level};
use kvguard_filter_core::metrics::{Kind, Metric, Metrics};
use kvguard_filter_core::{Config, Mode, OutcomeTag};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::Duration;

/// The filter-state key of the outcome (Envoy stores it as `wasm.kvguard.outcome`).
pub const OUTCOME_PROPERTY: &str = "kvguard.outcome";

/// Largest abort answer body read.
const MAX_ANSWER_BODY: usize = 4096;

/// Per-VM state shared by the root and stream contexts.
struct Shared {
    engine: Option<Engine>,
    metric_ids: Vec<Option<u32>>,
    queue_id: Option<u32>,
}

type SharedRef = Rc<RefCell<Shared>>;

/// The host as the core sees it: clock, dispatch, log, metrics.
struct Platform<'a> {
    metric_ids: &'a mut Vec<Option<u32>>,
}

fn core_level(level: Level) -> host::LogLevel {
    match level {
        Level::Debug => host::LogLevel::Debug,
        Level::Info => host::LogLevel::Info,
        Level::Warn => host::LogLevel::Warn,
        Level::Error => host::LogLevel::Error,
        Level::Critical => host::LogLevel::Critical,
    }
}

impl Clock for Platform<'_> {
    fn now_ms(&self) -> u64 {
        host::now_nanos() / 1_000_000
    }
    fn unix_secs(&self) -> u64 {
        host::now_nanos() / 1_000_000_000
    }
}

impl Host for Platform<'_> {
    fn dispatch(&mut self, call: &Call<'_>) -> Result<u32, DispatchError> {
        let headers: Vec<(&str, &str)> =
            call.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        // The SDK's wrapper registers the token with the current (root) context so that
        // `on_http_call_response` reaches it; it returns BadArgument / InternalFailure as
        // errors.
        match proxy_wasm::hostcalls::dispatch_http_call(
            call.cluster,
            headers,
            Some(&call.body),
            vec![],
            Duration::from_millis(call.timeout_ms),
        ) {
            Ok(token) => Ok(token),
            Err(proxy_wasm::types::Status::BadArgument) => Err(DispatchError::BadArgument),
            Err(_) => Err(DispatchError::Other),
        }
    }

    fn log(&mut self, level: Level, msg: &str) {
        host::log(core_level(level), msg);
    }
}

impl Platform<'_> {
    /// The metric's id in this VM, defining it on first use.
    fn metric_id(&mut self, m: Metric) -> Option<u32> {
        let i = m.index();
        if self.metric_ids.len() < Metric::COUNT {
            self.metric_ids.resize(Metric::COUNT, None);
        }
        if let Some(id) = self.metric_ids.get(i).copied().flatten() {
            return Some(id);
        }
        let kind = match m.kind() {
            Kind::Counter => 0,
            Kind::Gauge => 1,
        };
        let id = host::define_metric(kind, &m.name()).ok()?;
        if let Some(slot) = self.metric_ids.get_mut(i) {
            *slot = Some(id);
        }
        Some(id)
    }
}

impl Metrics for Platform<'_> {
    fn add(&mut self, m: Metric, delta: i64) {
        if let Some(id) = self.metric_id(m) {
            let _ = host::increment_metric(id, delta);
        }
    }
}

/// Runs `f` with the engine and the platform, unless the engine is missing or already
/// borrowed (then the filter fails open and `f` is skipped).
fn with_engine<R>(
    shared: &SharedRef,
    f: impl FnOnce(&mut Engine, &mut Platform<'_>) -> R,
) -> Option<R> {
    let Ok(mut guard) = shared.try_borrow_mut() else {
        host::log(
            host::LogLevel::Error,
            "kvguard: re-entrant call into the filter state; skipped (fail open)",
        );
        return None;
    };
    let s = &mut *guard;
    let engine = s.engine.as_mut()?;
    let mut p = Platform {
        metric_ids: &mut s.metric_ids,
    };
    Some(f(engine, &mut p))
}

/// Turns the tick on or off as the engine needs (no borrow held over the host call).
fn sync_tick(shared: &SharedRef) {
    let Some(Some(ms)) = with_engine(shared, |e, _| e.tick_change()) else {
        return;
    };
    let ms32 = u32::try_from(ms).unwrap_or(u32::MAX);
    if ms == 0 {
        host::log(
            host::LogLevel::Debug,
            "kvguard: tick off (nothing tracked or pending)",
        );
    } else {
        host::log(
            host::LogLevel::Debug,
            &format!("kvguard: tick on ({ms} ms)"),
        );
    }
    if host::set_tick_period_ms(ms32).is_err() {
        host::log(
            host::LogLevel::Warn,
            "kvguard: the host refused a tick period change",
        );
        let _ = with_engine(shared, |e, p| {
            e.set_tick_state(ms == 0);
            p.add(Metric::HostErrors, 1);
        });
    }
}

fn set_outcome(tag: OutcomeTag) {
    let _ = host::set_property(&[OUTCOME_PROPERTY], tag.as_string().as_bytes());
}

fn random_seed() -> u64 {
    // std's RandomState seeds from the host's random source (WASI `random_get`).
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(host::now_nanos());
    h.finish()
}

struct Logger;
static LOGGER: Logger = Logger;

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }
    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Error => host::LogLevel::Error,
            log::Level::Warn => host::LogLevel::Warn,
            log::Level::Info => host::LogLevel::Info,
            log::Level::Debug => host::LogLevel::Debug,
            log::Level::Trace => host::LogLevel::Trace,
        };
        host::log(level, &format!("kvguard: {}", record.args()));
    }
    fn flush(&self) {}
}

/// VM start: logger, panic hook, root context factory.
fn init() {
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Warn);
    std::panic::set_hook(Box::new(|info| {
        host::log(host::LogLevel::Critical, &format!("kvguard: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root {
            id: context_id,
            shared: Rc::new(RefCell::new(Shared {
                engine: None,
                metric_ids: Vec::new(),
                queue_id: None,
            })),
        })
    });
}

struct Root {
    id: u32,
    shared: SharedRef,
}

impl Root {
    fn report_memory(&self) {
        let bytes = host::memory_bytes();
        let _ = with_engine(&self.shared, |e, p| e.report_memory(p, bytes));
    }

    fn pump(&self) {
        let _ = with_engine(&self.shared, |e, p| e.pump(p));
        sync_tick(&self.shared);
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _: usize,
    ) {
        let status = if num_headers == 0 {
            None
        } else {
            host::get_header(host::Map::HttpCallResponseHeaders, ":status")
                .ok()
                .flatten()
                .and_then(|s| {
                    core::str::from_utf8(&s)
                        .ok()
                        .and_then(|s| s.trim().parse::<u16>().ok())
                })
        };
        let body = if body_size > 0 {
            host::get_buffer(
                host::Buffer::HttpCallResponseBody,
                0,
                body_size.min(MAX_ANSWER_BODY),
            )
            .unwrap_or_default()
        } else {
            Vec::new()
        };
        let _ = with_engine(&self.shared, |e, p| {
            e.on_abort_answer(p, token_id, status, &body)
        });
        sync_tick(&self.shared);
    }

    fn on_done(&mut self) -> bool {
        // The VM is going away: take its memory out of the shared gauge.
        let _ = with_engine(&self.shared, |e, p| e.report_memory(p, 0));
        true
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let raw = match host::get_buffer(
            host::Buffer::PluginConfiguration,
            0,
            plugin_configuration_size,
        ) {
            Ok(b) => b,
            Err(s) => {
                host::log(
                    host::LogLevel::Critical,
                    &format!(
                        "kvguard: invalid configuration: cannot read it (host status {})",
                        s.0
                    ),
                );
                return false;
            }
        };
        let env = |name: &str| std::env::var(name).ok();
        let cfg = match Config::parse(&raw, &env) {
            Ok(c) => c,
            Err(e) => {
                host::log(
                    host::LogLevel::Critical,
                    &format!("kvguard: invalid configuration: {e}"),
                );
                return false;
            }
        };
        let summary = format!(
            "kvguard: configured: mode={} control_cluster={} per_replica={} idle_timeout_ms={} first_token_timeout_ms={} max_age_ms={} tick_ms={} paths={:?} routes={}",
            match cfg.mode {
                Mode::Enforce => "enforce",
                Mode::Observe => "observe",
            },
            cfg.control_cluster,
            cfg.target.as_ref().map_or("off", |t| t.cluster.as_str()),
            cfg.limits.idle_timeout_ms,
            cfg.limits.first_token_timeout_ms,
            cfg.limits.max_age_ms,
            cfg.tick_ms,
            cfg.paths,
            cfg.routes.len(),
        );
        let need_queue = {
            let Ok(mut s) = self.shared.try_borrow_mut() else {
                return false;
            };
            match s.engine.as_mut() {
                Some(e) => e.reconfigure(cfg),
                None => s.engine = Some(Engine::new(cfg, random_seed())),
            }
            s.queue_id.is_none()
        };
        if need_queue {
            // Unique per VM: every worker's VM registers its own queue, and the host
            // delivers `on_queue_ready` to the root context that registered it.
            let name = format!("kvguard.wake.{}.{:016x}", self.id, random_seed());
            match host::register_queue(&name) {
                Ok(id) => {
                    host::log(
                        host::LogLevel::Debug,
                        &format!("kvguard: wake-up queue {name} registered (id {id})"),
                    );
                    if let Ok(mut s) = self.shared.try_borrow_mut() {
                        s.queue_id = Some(id);
                    }
                }
                Err(st) => host::log(
                    host::LogLevel::Warn,
                    &format!(
                        "kvguard: cannot register the wake-up queue (status {}); aborts go out on the tick",
                        st.0
                    ),
                ),
            }
        }
        if let Some(level) = host::log_level() {
            log::set_max_level(match level {
                0 => log::LevelFilter::Trace,
                1 => log::LevelFilter::Debug,
                2 => log::LevelFilter::Info,
                3 => log::LevelFilter::Warn,
                _ => log::LevelFilter::Error,
            });
        }
        host::log(host::LogLevel::Info, &summary);
        // Define every metric now, so that all series exist (at 0) from the start.
        let _ = with_engine(&self.shared, |_, p| {
            for m in Metric::all() {
                let _ = p.metric_id(m);
            }
        });
        self.report_memory();
        true
    }

    fn on_tick(&mut self) {
        let actions = with_engine(&self.shared, |e, p| e.tick(p)).unwrap_or_default();
        self.report_memory();
        let mut closed = 0i64;
        let mut failed = 0i64;
        for a in &actions {
            let (ctx, tag, close) = match *a {
                EngineAction::Close { ctx, tag } => (ctx, tag, true),
                EngineAction::Mark { ctx, tag } => (ctx, tag, false),
            };
            if host::set_effective_context(ctx).is_err() {
                failed += 1;
                continue;
            }
            set_outcome(tag);
            if close {
                // May run the stream's on_log right here: no borrow is held.
                match host::reset_stream() {
                    Ok(()) => closed += 1,
                    Err(_) => failed += 1,
                }
            }
        }
        if !actions.is_empty() {
            let _ = host::set_effective_context(self.id);
        }
        if closed > 0 || failed > 0 {
            let _ = with_engine(&self.shared, |_, p| {
                if closed > 0 {
                    p.add(Metric::StreamsClosed, closed);
                }
                if failed > 0 {
                    p.add(Metric::HostErrors, failed);
                }
            });
        }
        sync_tick(&self.shared);
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        // Drain the wake-ups; the jobs themselves are in the engine.
        for _ in 0..10_000 {
            match host::dequeue(queue_id) {
                Ok(Some(_)) => continue,
                _ => break,
            }
        }
        self.pump();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream {
            id: context_id,
            shared: Rc::clone(&self.shared),
            tracked: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    id: u32,
    shared: SharedRef,
    tracked: bool,
}

impl Context for Stream {}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.tracked {
            let id = self.id;
            let _ = with_engine(&self.shared, |e, p| e.forget(p, id));
        }
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
        trap::on_request_headers(self.id);
        let path = host::get_header(host::Map::RequestHeaders, ":path")
            .ok()
            .flatten();
        let rid = host::get_header(host::Map::RequestHeaders, REQUEST_ID_HEADER)
            .ok()
            .flatten();
        let id = self.id;
        let verdict = with_engine(&self.shared, |e, p| {
            e.on_request_headers(p, id, path.as_deref(), rid.as_deref())
        });
        match verdict {
            Some(Verdict::Tracked) => {
                self.tracked = true;
                sync_tick(&self.shared);
            }
            _ => set_outcome(OutcomeTag::Untracked),
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        // Always strip the control stamp, tracked or not, genuine or forged.
        let stamp = host::get_header(host::Map::ResponseHeaders, CONTROL_HEADER)
            .ok()
            .flatten();
        if stamp.is_some() {
            let _ = host::remove_header(host::Map::ResponseHeaders, CONTROL_HEADER);
        }
        if !self.tracked {
            return Action::Continue;
        }
        let ct = host::get_header(host::Map::ResponseHeaders, "content-type")
            .ok()
            .flatten();
        let ce = host::get_header(host::Map::ResponseHeaders, "content-encoding")
            .ok()
            .flatten();
        let id = self.id;
        let _ = with_engine(&self.shared, |e, p| {
            e.on_response_headers(
                p,
                id,
                ct.as_deref(),
                ce.as_deref(),
                stamp.as_deref(),
                end_of_stream,
            )
        });
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        trap::on_response_body(self.id);
        if !self.tracked {
            return Action::Continue;
        }
        let id = self.id;
        // One borrow for the whole chunk: reading the body buffer only calls back into the
        // module's allocator, never into the filter.
        let tag = with_engine(&self.shared, |e, p| {
            let chunk = match e.body_need(id) {
                BodyNeed::Bytes if body_size > 0 => {
                    match host::get_buffer(host::Buffer::ResponseBody, 0, body_size) {
                        Ok(b) => b,
                        Err(_) => {
                            p.add(Metric::HostErrors, 1);
                            Vec::new()
                        }
                    }
                }
                _ => Vec::new(),
            };
            e.on_response_body(p, id, &chunk, body_size, end_of_stream)
        })
        .flatten();
        if let Some(tag) = tag {
            set_outcome(tag);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if !self.tracked {
            return;
        }
        self.tracked = false;
        let id = self.id;
        let needed = with_engine(&self.shared, |e, _| e.end_details_needed(id)).unwrap_or(true);
        let (details, flags) = if needed {
            let details = host::get_property(&["response", "code_details"])
                .ok()
                .flatten()
                .unwrap_or_default();
            let flags = host::get_property(&["response", "flags"])
                .ok()
                .flatten()
                .and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
                .map_or(0, u64::from_le_bytes);
            (details, flags)
        } else {
            (Vec::new(), 0)
        };
        let result = with_engine(&self.shared, |e, p| {
            let tag = e.on_log(p, id, &details, flags);
            let wake = e.has_ready_aborts(p.now_ms());
            (tag, wake)
        });
        let Some((tag, wake)) = result else {
            return;
        };
        if let Some(tag) = tag {
            set_outcome(tag);
        }
        if wake {
            let queue = self.shared.try_borrow().ok().and_then(|s| s.queue_id);
            if let Some(q) = queue {
                if host::enqueue(q, b"1").is_err() {
                    host::log(
                        host::LogLevel::Warn,
                        "kvguard: wake-up enqueue failed; the tick sends the abort",
                    );
                }
            }
        }
        sync_tick(&self.shared);
    }
}
