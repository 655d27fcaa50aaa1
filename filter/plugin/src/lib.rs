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
//! - Every host call goes through [`abi`], which returns statuses instead of panicking
//!   and reads header values as bytes.
#![deny(unsafe_code)]

mod abi;
mod trap;

use core::cell::RefCell;
use kvguard_contract::signature::SIGNATURE_HEADER;
use kvguard_contract::{InstanceId, INSTANCE_HEADER};
use kvguard_contract::{CONTROL_HEADER, REQUEST_ID_HEADER};
use kvguard_filter_core::engine::{self, Engine, Streams, Verdict};
use kvguard_filter_core::host::{Call, Clock, DispatchError, Host, Level, SharedData, SharedError};
use kvguard_filter_core::metrics::{Kind, Metric, Metrics};
use kvguard_filter_core::vms::{self, Share};
use kvguard_filter_core::{config, header_map, lease, Config, Mode, OutcomeTag};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use std::borrow::Cow;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::Duration;

/// The filter-state key of the outcome (Envoy stores it as `wasm.kvguard.outcome`).
pub const OUTCOME_PROPERTY: &str = "kvguard.outcome";

/// Longest a stopping VM waits for its pending aborts: every abort ends (delivered or
/// failed) within the queue's deadline; the rest is slack for the last call's timeout.
const STOP_BOUND_MS: u64 = kvguard_filter_core::aborts::DEADLINE_MS + 5_000;

/// Largest abort answer body read.
const MAX_ANSWER_BODY: usize = 4096;

/// Per-VM state shared by the root and stream contexts.
struct Shared {
    engine: Option<Engine>,
    metric_ids: Vec<Option<u32>>,
    /// Deltas of the per-request counters and gauge (requests tracked and completed,
    /// active requests) not yet handed to the host: while the tick runs, `add` only sums
    /// them here and the tick flushes (one host call per metric that moved, per tick,
    /// instead of three or four per request); see [`flush_metrics`].
    batch: Batch,
    queue_id: Option<u32>,
    /// The shared-data key of this plugin's mode (`kvguard.mode.<plugin name>`).
    mode_key: Option<String>,
    /// This VM's side of the liveness lease (instance id, renewals in flight).
    renewer: lease::Renewer,
    /// This VM's entry in the process's VM table (its id, its share of the gauges).
    member: vms::Member,
    /// Since when (monotonic ms) the host has been stopping this VM (`on_done`) while
    /// aborts were pending.
    stopping_since: Option<u64>,
    /// The stream (context id) sampled for the lease's upstream and its `:authority`,
    /// kept from its request headers to its response headers (where the cluster is
    /// known); a later sample replaces it. Here rather than in every [`Stream`]: one
    /// stream per period is sampled, and a stream context is kept to 12 bytes.
    sampled: Option<(u32, Vec<u8>)>,
}

type SharedRef = Rc<RefCell<Shared>>;

/// Metric deltas summed between flushes.
#[derive(Default)]
struct Batch {
    /// Whether `add` batches (the tick is on, so a flush comes within a tick).
    on: bool,
    /// Deltas by metric index.
    deltas: Vec<i64>,
    /// Whether any delta is non-zero.
    dirty: bool,
}

/// The host as the core sees it: clock, dispatch, log, metrics (the core's
/// `host::Platform`).
struct EnvoyHost<'a> {
    metric_ids: &'a mut Vec<Option<u32>>,
    batch: &'a mut Batch,
    member: &'a mut vms::Member,
}

/// Shared data and the clock, without the rest of the host (for the VM table, whose
/// member lives in [`EnvoyHost`]).
struct Abi;

impl Clock for Abi {
    fn now_ms(&self) -> u64 {
        abi::monotonic_ms().unwrap_or_else(|last| last)
    }
    fn unix_secs(&self) -> u64 {
        abi::now_nanos() / 1_000_000_000
    }
}

impl SharedData for Abi {
    fn shared_get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, SharedError> {
        abi::get_shared_data_cas(key).map_err(|_| SharedError::Other)
    }
    fn shared_set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), SharedError> {
        abi::set_shared_data_cas(key, value, cas).map_err(|e| match e {
            abi::Status(abi::CAS_MISMATCH) => SharedError::CasMismatch,
            _ => SharedError::Other,
        })
    }
}

fn core_level(level: Level) -> abi::LogLevel {
    match level {
        Level::Debug => abi::LogLevel::Debug,
        Level::Info => abi::LogLevel::Info,
        Level::Warn => abi::LogLevel::Warn,
        Level::Error => abi::LogLevel::Error,
        Level::Critical => abi::LogLevel::Critical,
    }
}

impl Clock for EnvoyHost<'_> {
    fn now_ms(&self) -> u64 {
        // A refused read keeps the last reading (counted by `report_clock_errors`).
        abi::monotonic_ms().unwrap_or_else(|last| {
            CLOCK_ERRORS.with(|c| c.set(c.get() + 1));
            last
        })
    }
    fn now_exact(&self) -> Option<u64> {
        abi::monotonic_ms()
            .map_err(|_| CLOCK_ERRORS.with(|c| c.set(c.get() + 1)))
            .ok()
    }
    fn unix_secs(&self) -> u64 {
        abi::now_nanos() / 1_000_000_000
    }
}

impl SharedData for EnvoyHost<'_> {
    fn shared_get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, SharedError> {
        Abi.shared_get(key)
    }
    fn shared_set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), SharedError> {
        Abi.shared_set(key, value, cas)
    }
}

impl Host for EnvoyHost<'_> {
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
        abi::log(core_level(level), msg);
    }

    fn upstream_reached(&mut self) -> bool {
        // Set once the router picked an upstream host for the stream; absent for a local
        // reply sent before any upstream (a filter's, a missing route, direct_response).
        match abi::get_property(&["upstream", "address"]) {
            Ok(Some(a)) => !a.is_empty(),
            Ok(None) => false,
            Err(_) => {
                self.add(Metric::HostErrors, 1);
                false
            }
        }
    }

    fn log_enabled(&self, level: Level) -> bool {
        let filter = match level {
            Level::Debug => log::LevelFilter::Debug,
            Level::Info => log::LevelFilter::Info,
            Level::Warn => log::LevelFilter::Warn,
            Level::Error | Level::Critical => log::LevelFilter::Error,
        };
        filter <= log::max_level()
    }
}

impl EnvoyHost<'_> {
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
            Kind::Histogram => 2,
        };
        let id = abi::define_metric(kind, &m.name()).ok()?;
        if let Some(slot) = self.metric_ids.get_mut(i) {
            *slot = Some(id);
        }
        Some(id)
    }
}

impl EnvoyHost<'_> {
    /// Hands every batched delta to the host (one `increment_metric` per metric that
    /// moved). The gauges of this VM's share go through the VM table first (written
    /// before the host sees them, with the shares of VMs found gone taken back); when
    /// the table cannot be written they stay batched for the next flush.
    fn flush(&mut self) {
        let mut mine = Share::default();
        for (s, m) in mine.iter_mut().zip(vms::GAUGES) {
            if let Some(d) = self.batch.deltas.get_mut(m.index()) {
                *s = core::mem::take(d);
            }
        }
        let now = if self.member.joined() {
            self.now_ms()
        } else {
            0
        };
        let kept = match self.member.settle(&mut Abi, now, mine) {
            Some(out) => {
                self.hand(out);
                Share::default()
            }
            None => mine,
        };
        if self.batch.dirty {
            self.batch.dirty = false;
            let deltas = core::mem::take(&mut self.batch.deltas);
            for (m, d) in Metric::all().into_iter().zip(&deltas) {
                if *d != 0 {
                    if let Some(id) = self.metric_id(m) {
                        let _ = abi::increment_metric(id, *d);
                    }
                }
            }
            self.batch.deltas = deltas;
            self.batch.deltas.iter_mut().for_each(|d| *d = 0);
        }
        for (k, m) in kept.into_iter().zip(vms::GAUGES) {
            if let Some(d) = self.batch.deltas.get_mut(m.index()) {
                *d = k;
                self.batch.dirty |= k != 0;
            }
        }
    }

    /// Hands gauge deltas of a VM share to the host.
    fn hand(&mut self, share: Share) {
        for (d, m) in share.into_iter().zip(vms::GAUGES) {
            if d != 0 {
                if let Some(id) = self.metric_id(m) {
                    let _ = abi::increment_metric(id, d);
                }
            }
        }
    }

    /// This VM stops: its entry leaves the VM table and its share leaves the gauges.
    fn leave(&mut self) {
        let now = self.now_ms();
        if let Some(back) = self.member.leave(&mut Abi, now) {
            self.hand(back);
        }
    }
}

impl Metrics for EnvoyHost<'_> {
    fn add(&mut self, m: Metric, delta: i64) {
        // The per-request ones batch, and so does the memory gauge once this VM is in the
        // VM table (the batched gauges reach the host through it, written there first);
        // the rest (aborts, pending aborts, errors: rare, and read as "now") go to the
        // host at once, the pending ones noted in this VM's share (written to the table
        // at the next tick: a VM that dies within a tick of an abort queue change leaves
        // that change in the gauge).
        let share = self.member.joined() && vms::GAUGES.contains(&m);
        let batched = matches!(
            m,
            Metric::RequestsTracked | Metric::RequestsCompleted | Metric::ActiveRequests
        ) || (share && m == Metric::VmMemoryBytes);
        if batched && self.batch.on {
            if self.batch.deltas.len() < Metric::COUNT {
                self.batch.deltas.resize(Metric::COUNT, 0);
            }
            if let Some(d) = self.batch.deltas.get_mut(m.index()) {
                *d += delta;
                self.batch.dirty = true;
                return;
            }
        }
        if share {
            self.member.note(m, delta);
        }
        if let Some(id) = self.metric_id(m) {
            let _ = abi::increment_metric(id, delta);
        }
    }

    fn record(&mut self, m: Metric, value: u64) {
        if let Some(id) = self.metric_id(m) {
            let _ = abi::record_metric(id, value);
        }
    }
}

/// Runs `f` with the engine and the platform, unless the engine is missing or already
/// borrowed (then the filter fails open and `f` is skipped).
fn with_engine<R>(
    shared: &SharedRef,
    f: impl FnOnce(&mut Engine, &mut EnvoyHost<'_>) -> R,
) -> Option<R> {
    with_lease(shared, |e, _, p| f(e, p))
}

/// Runs `f` with the engine, this VM's lease renewer and the host (fail open: `None`
/// on a re-entrant call or before the configuration).
fn with_lease<R>(
    shared: &SharedRef,
    f: impl FnOnce(&mut Engine, &mut lease::Renewer, &mut EnvoyHost<'_>) -> R,
) -> Option<R> {
    let Ok(mut guard) = shared.try_borrow_mut() else {
        abi::log(
            abi::LogLevel::Error,
            "re-entrant call into the filter state; skipped (fail open)",
        );
        return None;
    };
    let s = &mut *guard;
    let engine = s.engine.as_mut()?;
    let mut p = EnvoyHost {
        metric_ids: &mut s.metric_ids,
        batch: &mut s.batch,
        member: &mut s.member,
    };
    Some(f(engine, &mut s.renewer, &mut p))
}

/// A fresh instance id: 128 random bits.
fn fresh_instance() -> InstanceId {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&random_seed().to_le_bytes());
    bytes[8..].copy_from_slice(&random_seed().to_le_bytes());
    InstanceId(bytes)
}

/// This Envoy node's host key: its node id and this plugin's VM id (`None` when the
/// node has no id: then no two processes can be told to be the same host).
fn host_key() -> Option<kvguard_contract::HostKey> {
    let node = abi::get_property(&["xds", "node", "id"])
        .ok()
        .flatten()
        .filter(|n| !n.is_empty())?;
    let vm = abi::get_property(&["plugin_vm_id"])
        .ok()
        .flatten()
        .unwrap_or_default();
    Some(kvguard_contract::HostKey::derive(&node, &vm))
}

/// Flushes the batched metric deltas; with `batching`, later `add`s batch (the tick is
/// on), else they go to the host at once.
fn flush_metrics(shared: &SharedRef, batching: bool) {
    let _ = with_engine(shared, |_, p| {
        p.flush();
        p.batch.on = batching;
    });
}

/// Turns the tick on or off as the engine needs (no borrow held over the host call).
fn sync_tick(shared: &SharedRef) {
    let Some(Some(ms)) = with_engine(shared, |e, _| e.tick_change()) else {
        return;
    };
    let ms32 = u32::try_from(ms).unwrap_or(u32::MAX);
    if log::max_level() >= log::LevelFilter::Debug {
        if ms == 0 {
            abi::log(
                abi::LogLevel::Debug,
                "tick off (nothing tracked or pending)",
            );
        } else {
            abi::log(abi::LogLevel::Debug, &format!("tick on ({ms} ms)"));
        }
    }
    let refused = abi::set_tick_period_ms(ms32).is_err();
    if refused {
        abi::log(abi::LogLevel::Warn, "the host refused a tick period change");
        let _ = with_engine(shared, |e, p| {
            e.tick_refused();
            p.add(Metric::HostErrors, 1);
        });
    }
    // Batch only while a tick is there to flush: a tick going off flushes what is left.
    flush_metrics(shared, ms != 0 && !refused);
}

std::thread_local! {
    /// Monotonic clock reads the host refused since the last report.
    static CLOCK_ERRORS: core::cell::Cell<i64> = const { core::cell::Cell::new(0) };
}

/// Counts refused clock reads as host errors.
fn report_clock_errors(p: &mut EnvoyHost<'_>) {
    let n = CLOCK_ERRORS.with(|c| c.replace(0));
    if n > 0 {
        p.add(Metric::HostErrors, n);
    }
}

/// The shared-data key holding a plugin's mode: every root context of that plugin (one
/// per configuration version and worker) reads it, so a pushed `"mode"` reaches the
/// streams already in flight; plugins of other names keep their own.
fn mode_key(plugin_name: &[u8]) -> String {
    format!("kvguard.mode.{}", String::from_utf8_lossy(plugin_name))
}

/// The kill switch: a configuration new to this Envoy process that names its `mode`
/// publishes it to every root context of the plugin (and one loaded for the first time
/// when none was published yet, its default). A configuration loaded again (another
/// worker, a VM reloaded after a trap, a draining listener) publishes nothing, so a pushed
/// `observe` stays until a new configuration names `enforce` ([`config::first_load`]).
fn publish_mode(key: &str, raw: &[u8], cfg: &Config) {
    let seen_key = format!("{key}.seen");
    let digest = config::config_digest(raw);
    // Two workers loading the same new configuration race: the loser reads it as seen.
    for _ in 0..4 {
        let (seen, cas) = match abi::get_shared_data_cas(&seen_key) {
            Ok(Some((v, cas))) => (Some(v), cas),
            Ok(None) => (None, 0),
            Err(_) => break,
        };
        let Some(list) = config::first_load(seen.as_deref(), digest) else {
            return;
        };
        match abi::set_shared_data_cas(&seen_key, &list, cas) {
            Ok(()) => {}
            Err(abi::Status(abi::CAS_MISMATCH)) => continue,
            Err(_) => break,
        }
        let unset = matches!(abi::get_shared_data(key), Ok(None));
        if (cfg.mode_named || unset)
            && abi::set_shared_data(key, cfg.mode.as_str().as_bytes()).is_err()
        {
            break;
        }
        return;
    }
    abi::log(
        abi::LogLevel::Warn,
        &format!("cannot write shared data {key}; a mode change reaches new streams only"),
    );
}

/// Reads this plugin's mode from shared data and hands it to the engine (the kill
/// switch). An unreadable or unknown value keeps the mode the engine has.
fn sync_mode(shared: &SharedRef) {
    let key = shared.try_borrow().ok().and_then(|s| s.mode_key.clone());
    let Some(key) = key else { return };
    let mode = match abi::get_shared_data(&key) {
        Ok(Some(v)) => Mode::parse(&v),
        Ok(None) => None,
        Err(_) => {
            let _ = with_engine(shared, |_, p| p.add(Metric::HostErrors, 1));
            None
        }
    };
    if let Some(mode) = mode {
        let _ = with_engine(shared, |e, p| e.set_mode(p, mode));
    }
}

/// The tick's stream operations (`proxy_set_effective_context` + `proxy_close_stream`).
struct EnvoyStreams {
    root: u32,
}

impl Streams for EnvoyStreams {
    fn select(&mut self, ctx: u32) -> bool {
        abi::set_effective_context(ctx).is_ok()
    }
    fn set_outcome(&mut self, tag: OutcomeTag) {
        set_outcome(tag);
    }
    fn close(&mut self) -> bool {
        abi::reset_stream().is_ok()
    }
    fn restore(&mut self) {
        let _ = abi::set_effective_context(self.root);
    }
}

fn set_outcome(tag: OutcomeTag) {
    let _ = abi::set_property(&[OUTCOME_PROPERTY], tag.as_string().as_bytes());
}

fn random_seed() -> u64 {
    // std's RandomState seeds from the host's random source (WASI `random_get`).
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(abi::now_nanos());
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
            log::Level::Error => abi::LogLevel::Error,
            log::Level::Warn => abi::LogLevel::Warn,
            log::Level::Info => abi::LogLevel::Info,
            log::Level::Debug => abi::LogLevel::Debug,
            log::Level::Trace => abi::LogLevel::Trace,
        };
        abi::log(level, &format!("{}", record.args()));
    }
    fn flush(&self) {}
}

/// VM start: logger, panic hook, root context factory.
fn init() {
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Warn);
    std::panic::set_hook(Box::new(|info| {
        abi::log(abi::LogLevel::Critical, &format!("panic: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root {
            id: context_id,
            shared: Rc::new(RefCell::new(Shared {
                engine: None,
                metric_ids: Vec::new(),
                batch: Batch::default(),
                queue_id: None,
                mode_key: None,
                renewer: lease::Renewer::default(),
                member: vms::Member::default(),
                stopping_since: None,
                sampled: None,
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
        let bytes = abi::memory_bytes();
        let _ = with_engine(&self.shared, |e, p| e.report_memory(p, bytes));
    }

    fn pump(&self) {
        let _ = with_engine(&self.shared, |e, p| e.pump(p));
        sync_tick(&self.shared);
    }
}

impl Root {
    /// While the host stops this VM (`on_done` returned false): pumps the aborts, and once
    /// none is pending or `STOP_BOUND_MS` passed, gives up what is left and tells the host
    /// it is done. Returns whether the VM is stopping.
    fn finish_stopping(&self) -> bool {
        let Some(since) = self.shared.try_borrow().ok().and_then(|s| s.stopping_since) else {
            return false;
        };
        let done = with_engine(&self.shared, |e, p| {
            e.pump(p);
            // A stopping VM's tick returns here: what was batched goes out now.
            p.flush();
            p.batch.on = false;
            let now = p.now_ms();
            let left = e.pending_aborts();
            if left == 0 || now.saturating_sub(since) >= STOP_BOUND_MS {
                if left > 0 {
                    p.log(
                        Level::Warn,
                        &format!("stopping VM: {left} aborts undelivered after {STOP_BOUND_MS} ms, given up"),
                    );
                    e.abandon_pending(p);
                } else {
                    p.log(Level::Info, "stopping VM: every pending abort delivered");
                }
                e.report_memory(p, 0);
                p.leave();
                true
            } else {
                false
            }
        })
        .unwrap_or(true);
        if done {
            let _ = abi::set_tick_period_ms(0);
            if proxy_wasm::hostcalls::done().is_err() {
                abi::log(abi::LogLevel::Warn, "proxy_done refused by the host");
            }
        }
        true
    }

    /// The lease's tick: re-reads the instance id, names the replicas of this VM's
    /// streams in flight, and renews if this VM wins the period's slot (one renewal per
    /// process per period, whichever worker's tick comes first).
    fn renew_lease(&self) {
        let jitter = random_seed();
        let _ = with_lease(&self.shared, |e, r, p| {
            let targets = e.targets();
            let busy = e.tracked() > 0;
            r.on_tick(&e.cfg, p, (&targets, busy), jitter, &mut fresh_instance);
        });
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
            abi::get_header(abi::Map::HttpCallResponseHeaders, ":status")
                .ok()
                .flatten()
                .and_then(|s| {
                    core::str::from_utf8(&s)
                        .ok()
                        .and_then(|s| s.trim().parse::<u16>().ok())
                })
        };
        let body = if body_size > 0 {
            abi::get_buffer(
                abi::Buffer::HttpCallResponseBody,
                0,
                body_size.min(MAX_ANSWER_BODY),
            )
            .unwrap_or_default()
        } else {
            Vec::new()
        };
        if with_lease(&self.shared, |_, r, p| r.on_answer(p, token_id, status)) == Some(true) {
            return;
        }
        let _ = with_engine(&self.shared, |e, p| {
            e.on_abort_answer(p, token_id, status, &body)
        });
        sync_tick(&self.shared);
    }

    fn on_done(&mut self) -> bool {
        // Whatever was batched reaches the host before the VM may go.
        flush_metrics(&self.shared, false);
        // A config push, listener drain or module upgrade stops this VM: aborts queued,
        // backing off or in flight would die with it. Keep it until they are delivered
        // (the tick goes on pumping), at most `STOP_BOUND_MS`; then `proxy_done`.
        let pending = with_engine(&self.shared, |e, p| {
            let n = e.pending_aborts();
            if n > 0 {
                p.log(
                    Level::Info,
                    &format!("the host stops this VM with {n} aborts pending: delivering them first (at most {STOP_BOUND_MS} ms)"),
                );
                e.pump(p);
            }
            (n, p.now_ms())
        });
        match pending {
            Some((n, now)) if n > 0 => {
                if let Ok(mut s) = self.shared.try_borrow_mut() {
                    s.stopping_since = Some(now);
                }
                sync_tick(&self.shared);
                false
            }
            _ => {
                // The VM is going away: take its memory out of the shared gauge.
                let _ = with_engine(&self.shared, |e, p| {
                    e.report_memory(p, 0);
                    p.leave();
                });
                true
            }
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let raw = match abi::get_buffer(
            abi::Buffer::PluginConfiguration,
            0,
            plugin_configuration_size,
        ) {
            Ok(b) => b,
            Err(s) => {
                abi::log(
                    abi::LogLevel::Critical,
                    &format!(
                        "invalid configuration: cannot read it (host status {})",
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
                abi::log(
                    abi::LogLevel::Critical,
                    &format!("invalid configuration: {e}"),
                );
                return false;
            }
        };
        let summary = format!(
            "configured: mode={} control_cluster={} per_replica={} idle_timeout_ms={} first_token_timeout_ms={} max_age_ms={} tick_ms={} paths={:?} routes={}",
            cfg.mode.as_str(),
            cfg.control_cluster,
            cfg.target.as_ref().map_or("off", |t| t.cluster.as_str()),
            cfg.limits.idle_timeout_ms,
            cfg.limits.first_token_timeout_ms,
            cfg.limits.max_age_ms,
            cfg.tick_ms,
            cfg.paths,
            cfg.routes.len(),
        );
        // The mode every root context of this plugin reads (see `sync_mode`).
        let plugin = abi::get_property(&["plugin_name"])
            .ok()
            .flatten()
            .unwrap_or_else(|| b"kvguard".to_vec());
        let key = mode_key(&plugin);
        publish_mode(&key, &raw, &cfg);
        let need_queue = {
            let Ok(mut guard) = self.shared.try_borrow_mut() else {
                return false;
            };
            let s = &mut *guard;
            s.mode_key = Some(key);
            match s.engine.as_mut() {
                Some(e) => {
                    let mut p = EnvoyHost {
                        metric_ids: &mut s.metric_ids,
                        batch: &mut s.batch,
                        member: &mut s.member,
                    };
                    e.reconfigure(&mut p, cfg);
                }
                None => s.engine = Some(Engine::new(cfg, random_seed())),
            }
            s.queue_id.is_none()
        };
        // The mode in force is the published one (this configuration may be an old one
        // loaded again, whose mode is not).
        sync_mode(&self.shared);
        if need_queue {
            // Unique per VM: every worker's VM registers its own queue, and the host
            // delivers `on_queue_ready` to the root context that registered it.
            let name = format!("kvguard.wake.{}.{:016x}", self.id, random_seed());
            match abi::register_queue(&name) {
                Ok(id) => {
                    abi::log(
                        abi::LogLevel::Debug,
                        &format!("wake-up queue {name} registered (id {id})"),
                    );
                    if let Ok(mut s) = self.shared.try_borrow_mut() {
                        s.queue_id = Some(id);
                    }
                }
                Err(st) => abi::log(
                    abi::LogLevel::Warn,
                    &format!(
                        "cannot register the wake-up queue (status {}); aborts go out on the tick",
                        st.0
                    ),
                ),
            }
        }
        if let Some(level) = abi::log_level() {
            log::set_max_level(match level {
                0 => log::LevelFilter::Trace,
                1 => log::LevelFilter::Debug,
                2 => log::LevelFilter::Info,
                3 => log::LevelFilter::Warn,
                _ => log::LevelFilter::Error,
            });
        }
        abi::log(abi::LogLevel::Info, &summary);
        // Define every metric now, so that all series exist (at 0) from the start.
        let _ = with_engine(&self.shared, |_, p| {
            for m in Metric::all() {
                let _ = p.metric_id(m);
            }
        });
        // With the lease on, this VM joins the process's VM table: renewals list it while
        // it beats, and its share of the gauges is taken back once it is gone.
        let renew = with_engine(&self.shared, |e, p| {
            let period = e.cfg.lease_renew_ms;
            e.keep_ticking(period > 0);
            if period > 0 && p.member.join(&mut Abi, period).is_none() {
                p.add(Metric::HostErrors, 1);
            }
            period > 0
        })
        .unwrap_or(false);
        if renew {
            let host = host_key();
            let _ = with_lease(&self.shared, |_, r, p| {
                if r.instance().is_none() {
                    *r = lease::Renewer::new(host);
                }
                r.sync_instance(p, &mut fresh_instance);
            });
        }
        sync_tick(&self.shared);
        self.report_memory();
        true
    }

    fn on_tick(&mut self) {
        if self.finish_stopping() {
            return;
        }
        sync_mode(&self.shared);
        self.renew_lease();
        let actions = with_engine(&self.shared, |e, p| {
            let a = e.on_host_tick(p);
            report_clock_errors(p);
            a
        })
        .unwrap_or_default();
        self.report_memory();
        // No borrow held: closing a stream may run its on_log right here.
        let done = engine::apply(&actions, &mut EnvoyStreams { root: self.id });
        let _ = with_engine(&self.shared, |_, p| {
            if done.closed > 0 {
                p.add(Metric::StreamsClosed, done.closed);
            }
            if done.failed > 0 {
                p.add(Metric::HostErrors, done.failed);
            }
            // The batched counters of the last tick period reach the host.
            p.flush();
        });
        sync_tick(&self.shared);
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        // Drain the wake-ups; the jobs themselves are in the engine.
        for _ in 0..10_000 {
            match abi::dequeue(queue_id) {
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
            sampled: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// The request headers [`Stream::on_http_request_headers`] strips or reads, in the order
/// it takes them from the map.
const REQUEST_HEADERS: [&str; 6] = [
    CONTROL_HEADER,
    SIGNATURE_HEADER,
    INSTANCE_HEADER,
    ":path",
    REQUEST_ID_HEADER,
    ":authority",
];

/// Whether a header may be in the request: present in the map, or the map unread.
fn sent(seen: Option<Option<&[u8]>>) -> bool {
    seen.is_none_or(|v| v.is_some())
}

/// A request header's value: from the map, or read alone when the map was unread.
fn value<'a>(seen: Option<Option<&'a [u8]>>, name: &str) -> Option<Cow<'a, [u8]>> {
    match seen {
        Some(v) => v.map(Cow::Borrowed),
        None => abi::get_header(abi::Map::RequestHeaders, name)
            .ok()
            .flatten()
            .map(Cow::Owned),
    }
}

/// One HTTP stream: 12 bytes, a 16-byte block per stream (the SDK boxes every stream
/// context); what only a few streams need lives in [`Shared`].
struct Stream {
    id: u32,
    shared: SharedRef,
    tracked: bool,
    /// Its `:authority` was sampled for the lease's upstream ([`Shared::sampled`]).
    sampled: bool,
}

impl Context for Stream {}

impl Stream {
    /// This stream's `:authority`, if it is the one sampled for the lease's upstream.
    fn take_sample(&mut self) -> Option<Vec<u8>> {
        if !core::mem::take(&mut self.sampled) {
            return None;
        }
        let mut s = self.shared.try_borrow_mut().ok()?;
        match s.sampled.take() {
            Some((id, a)) if id == self.id => Some(a),
            other => {
                s.sampled = other;
                None
            }
        }
    }

    /// The request body ended: the first-token clock starts.
    fn request_ended(&self) {
        let id = self.id;
        let _ = with_engine(&self.shared, |e, p| {
            e.on_request_end(p, id);
            report_clock_errors(p);
        });
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.tracked {
            let id = self.id;
            let _ = with_engine(&self.shared, |e, p| e.forget(p, id));
        }
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        trap::on_request_headers(self.id);
        // Every request header kvguard strips or reads, from one copy of the map (one host
        // call instead of a read per value and a remove per header a client might have
        // sent). Each: `None` when the map could not be read or parsed (then read and
        // stripped one by one), `Some(None)` when absent.
        let map = abi::get_header_pairs(abi::Map::RequestHeaders).ok();
        let [control, signature, instance, path, rid, authority] = map
            .as_deref()
            .and_then(|m| header_map::values(m, REQUEST_HEADERS))
            .map_or([None; 6], |found| found.map(Some));
        // A client never speaks for kvguard: its stamp or signature headers go, on every
        // request, tracked or not (the edge's header mutation does the same; this is the
        // belt under it). Its instance header goes too: replaced below on a tracked
        // request (one host call instead of two), removed on any other.
        for (seen, h) in [(control, CONTROL_HEADER), (signature, SIGNATURE_HEADER)] {
            if sent(seen) {
                let _ = abi::remove_header(abi::Map::RequestHeaders, h);
            }
        }
        let path = value(path, ":path");
        // The request id only for a path kvguard tracks: a header read (with its copy into
        // the VM) less on every other request when the map could not be read.
        let tracks = |p: &[u8]| with_engine(&self.shared, |e, _| e.cfg.limits_for(p).is_some());
        let rid = if path.as_deref().and_then(tracks).unwrap_or(false) {
            value(rid, REQUEST_ID_HEADER)
        } else {
            None
        };
        let id = self.id;
        let verdict = with_engine(&self.shared, |e, p| {
            e.on_request_headers(p, id, path.as_deref(), rid.as_deref(), !end_of_stream)
        });
        // The gateway process and worker VM that carry it, with the period's signed proof
        // of life (contract §8); untracked: no filter state is written (contract §7: an
        // access log shows `-`), which saves a host call on every request the filter does
        // not track.
        let mut tagged = false;
        if verdict == Some(Verdict::Tracked) {
            self.tracked = true;
            let sample = self
                .shared
                .try_borrow()
                .is_ok_and(|s| s.renewer.wants_upstream());
            // Once a period, with the upstream: the listener it arrived on, where
            // kvguard-control may ask whether the gateway is still there.
            let mut listener = None;
            if sample {
                let authority = value(authority, ":authority");
                if let (Some(a), Ok(mut s)) = (authority, self.shared.try_borrow_mut()) {
                    s.sampled = Some((self.id, a.into_owned()));
                    self.sampled = true;
                }
                listener = abi::get_property(&["destination", "address"])
                    .ok()
                    .flatten();
            }
            tagged = with_lease(&self.shared, |e, r, p| {
                if let Some(a) = &listener {
                    r.note_listener(a);
                }
                let vm = p.member.id();
                r.tag_value(&e.cfg.key, vm).is_some_and(|v| {
                    abi::replace_header(abi::Map::RequestHeaders, INSTANCE_HEADER, v).is_ok()
                })
            }) == Some(true);
        }
        if !tagged && sent(instance) {
            let _ = abi::remove_header(abi::Map::RequestHeaders, INSTANCE_HEADER);
        }
        if self.tracked {
            sync_tick(&self.shared);
        }
        Action::Continue
    }

    fn on_http_request_body(&mut self, _: usize, end_of_stream: bool) -> Action {
        if self.tracked && end_of_stream {
            self.request_ended();
        }
        Action::Continue
    }

    fn on_http_request_trailers(&mut self, _: usize) -> Action {
        if self.tracked {
            self.request_ended();
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        // The stamp, and for a tracked stream the body's type and encoding: read in one host
        // call (one copy into the VM) instead of one per header; one by one if the map
        // cannot be read or parsed.
        let names = [CONTROL_HEADER, "content-type", "content-encoding"];
        let map = self
            .tracked
            .then(|| abi::get_header_pairs(abi::Map::ResponseHeaders).ok())
            .flatten();
        let singles: [Option<Vec<u8>>; 3];
        let [stamp, ct, ce] = match map.as_deref().and_then(|m| header_map::values(m, names)) {
            Some(found) => found,
            None => {
                singles = names.map(|h| {
                    (self.tracked || h == CONTROL_HEADER)
                        .then(|| abi::get_header(abi::Map::ResponseHeaders, h).ok().flatten())
                        .flatten()
                });
                singles.each_ref().map(Option::as_deref)
            }
        };
        // Always strip the control stamp, tracked or not, genuine or forged.
        if stamp.is_some() {
            let _ = abi::remove_header(abi::Map::ResponseHeaders, CONTROL_HEADER);
        }
        if !self.tracked {
            return Action::Continue;
        }
        let id = self.id;
        let _ = with_engine(&self.shared, |e, p| {
            e.on_response_headers(p, id, ct, ce, stamp, end_of_stream);
        });
        // One tracked stream per period per VM names its upstream cluster (the in-band
        // renewal goes over it); the replica a stamp names is renewed from the next tick.
        if let Some(a) = self.take_sample() {
            if let Ok(Some(c)) = abi::get_property(&["xds", "cluster_name"]) {
                let up = lease::Upstream {
                    cluster: String::from_utf8_lossy(&c).into_owned(),
                    authority: String::from_utf8_lossy(&a).into_owned(),
                };
                let _ = with_lease(&self.shared, |e, r, p| r.note_upstream(&e.cfg, p, &up));
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        trap::on_response_body(self.id);
        if !self.tracked {
            return Action::Continue;
        }
        let id = self.id;
        // One borrow and one table lookup for the whole chunk: reading the body buffer
        // only calls back into the module's allocator, never into the filter. No clock is
        // read (the tick stamps progress), no metric host call is made (batched).
        let tag = with_engine(&self.shared, |e, p| {
            e.on_chunk(p, id, body_size, end_of_stream, || {
                match abi::get_buffer(abi::Buffer::ResponseBody, 0, body_size) {
                    Ok(b) if !b.is_empty() => Some(b),
                    // Unreadable: progress and a host error, never a stall.
                    _ => None,
                }
            })
        })
        .flatten();
        match tag {
            Some(OutcomeTag::Completed) => set_outcome(OutcomeTag::Completed),
            // The end is held: the next tick cuts the stream (closing it here could run
            // its on_log inside this call).
            Some(_) => return Action::Pause,
            None => {}
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _: usize) -> Action {
        let id = self.id;
        if self.tracked
            && with_engine(&self.shared, |e, _| e.on_response_trailers(id)).unwrap_or(false)
        {
            return Action::Pause;
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
            // An abort may be decided now: with the mode in force now.
            sync_mode(&self.shared);
            let details = abi::get_property(&["response", "code_details"])
                .ok()
                .flatten()
                .unwrap_or_default();
            let flags = abi::get_property(&["response", "flags"])
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
            // No clock read when nothing is pending (the healthy request).
            let wake = e.pending_aborts() > 0 && e.has_ready_aborts(p.now_ms());
            report_clock_errors(p);
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
                if abi::enqueue(q, b"1").is_err() {
                    abi::log(
                        abi::LogLevel::Warn,
                        "wake-up enqueue failed; the tick sends the abort",
                    );
                }
            }
        }
        sync_tick(&self.shared);
    }
}
