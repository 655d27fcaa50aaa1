//! Periodic sampling: engine metrics (and health), the engine process, quiet checkpoints
//! and the orphan gauge; NVML in a task of its own, so that a hung driver call delays
//! nothing else.

use crate::expo::EngineFigures;
use crate::gpu::{GpuProbe, GpuSnapshot};
use crate::metrics::orphans;
use crate::state::AppState;
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Longest an NVML call may take before it counts as hung (at most one sample interval).
pub const NVML_TIMEOUT: Duration = Duration::from_secs(2);

/// The period a quiet checkpoint covers: from one sample to the next. The checkpoint is
/// taken only if no request was admitted during it and none was in flight (beyond
/// `--quiet-max-inflight`) at either end, so none ran during the engine scrape.
#[derive(Debug, Clone, Copy)]
pub struct QuietWindow {
    admissions: u64,
    quiet_at_start: bool,
    opened: Instant,
}

impl QuietWindow {
    /// Opens a window now.
    pub fn open(st: &AppState) -> QuietWindow {
        QuietWindow {
            admissions: st.admissions(),
            quiet_at_start: st.inflight() <= st.cfg.quiet_max_inflight,
            opened: st.clock.now(),
        }
    }

    /// Whether it was quiet from its opening until now.
    pub fn quiet_until_now(&self, st: &AppState) -> bool {
        self.quiet_at_start
            && st.admissions() == self.admissions
            && st.inflight() <= st.cfg.quiet_max_inflight
    }
}

/// Runs the engine sampler every `--sample-interval` until `stop`.
pub fn spawn(st: Arc<AppState>, stop: CancellationToken) {
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(st.cfg.sample_interval);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut window = QuietWindow::open(&st);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = iv.tick() => {}
            }
            sample_once(&st, &mut window).await;
        }
    });
}

/// Runs the NVML sampler every `--sample-interval` until `stop`. At most one call is
/// outstanding: a call that does not return within [`NVML_TIMEOUT`] is counted
/// (`nvml_timeouts_total`), NVML is reported unavailable, and no other call starts until
/// it returns (a blocking call cannot be cancelled; piling more on a hung driver would
/// only use up threads).
pub fn spawn_gpu(st: Arc<AppState>, probe: Arc<dyn GpuProbe>, stop: CancellationToken) {
    tokio::spawn(async move {
        let every = st.cfg.sample_interval;
        let deadline = NVML_TIMEOUT.min(every);
        let mut iv = tokio::time::interval(every);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let busy = Arc::new(AtomicBool::new(false));
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = iv.tick() => {}
            }
            if busy.swap(true, Ordering::AcqRel) {
                continue;
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            let p = probe.clone();
            let b = busy.clone();
            tokio::task::spawn_blocking(move || {
                let r = p.sample();
                b.store(false, Ordering::Release);
                let _ = tx.send(r);
            });
            let result = match tokio::time::timeout(deadline, rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err("NVML sample task failed".to_owned()),
                Err(_) => {
                    st.metrics.nvml_timeouts.inc();
                    Err(format!("an NVML call did not return within {deadline:?} (hung driver?); no other call is made until it returns"))
                }
            };
            record_gpu(&st, result);
        }
    });
}

static PROC_WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// One sampling round: the engine, the engine process, then the checkpoint over the
/// window since the previous round (a new window opens).
pub async fn sample_once(st: &Arc<AppState>, window: &mut QuietWindow) {
    scrape_engine(st).await;
    count_lora_adapters(st).await;
    if let Some(pid) = st.cfg.engine_pid {
        // The whole tree: vLLM V1's EngineCore is a child of the API server.
        match crate::procfs::read_tree(Path::new("/proc"), pid) {
            Ok(t) => {
                let m = &st.metrics;
                m.engine_process_open_fds
                    .set(i64::try_from(t.total.open_fds).unwrap_or(i64::MAX));
                m.engine_process_resident_memory
                    .set(i64::try_from(t.total.rss_bytes).unwrap_or(i64::MAX));
                m.engine_processes
                    .set(i64::try_from(t.pids.len()).unwrap_or(i64::MAX));
            }
            Err(e) => {
                // Said once at warn level (a wrong --engine-pid), then at debug.
                if !PROC_WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(pid, error = %e, "cannot read the engine process (--engine-pid)");
                } else {
                    tracing::debug!(pid, error = %e, "cannot read the engine process");
                }
            }
        }
    }
    checkpoint(st, window);
    *window = QuietWindow::open(st);
}

/// `kvguard_control_engine_lora_adapters` from the engine's `/v1/models` (cleared when it
/// does not answer such a list).
async fn count_lora_adapters(st: &Arc<AppState>) {
    match st
        .engine
        .models()
        .await
        .ok()
        .as_deref()
        .and_then(crate::engine::lora_adapters)
    {
        Some(n) => st.metrics.engine_lora_adapters.set(n as f64),
        None => st.metrics.engine_lora_adapters.clear(),
    }
}

async fn scrape_engine(st: &Arc<AppState>) {
    // What this replica tracks, read around the scrape: a request that starts or ends
    // meanwhile is counted (the larger count), so it is never taken for an orphan.
    let before = st.inflight_sequences();
    let result = st.engine.scrape().await;
    let tracked = before.max(st.inflight_sequences());
    let now = st.clock.now();
    match result {
        Ok(text) => {
            let figures = EngineFigures::from_text(&text);
            let flavour = EngineFigures::flavour(&text);
            let m = &st.metrics;
            for (gauge, v) in [
                (&m.engine_kv_usage_ratio, figures.kv_usage),
                (&m.engine_requests_running, figures.running),
                (&m.engine_requests_waiting, figures.waiting),
            ] {
                match v {
                    Some(v) => gauge.set(v),
                    None => gauge.clear(),
                }
            }
            m.engine_up.set(1);
            if let Ok(mut s) = st.engine_status.lock() {
                if let Some(p) = figures.preemptions {
                    // The engine's counter, followed by deltas (a restart counts from 0).
                    let delta = match s.last_preemptions {
                        Some(last) if p >= last => p - last,
                        Some(_) => p,
                        None => 0.0,
                    };
                    if delta > 0.0 {
                        m.engine_preemptions.inc_by(delta);
                    }
                    s.last_preemptions = Some(p);
                }
                if s.last_error.is_some() {
                    tracing::info!(url = %st.cfg.engine_metrics_url, "engine metrics answer again");
                }
                s.last_ok = Some(now);
                s.last_error = None;
                s.figures = Some(figures);
                s.flavour = Some(flavour);
                s.tracked = Some(tracked);
            }
        }
        Err(e) => {
            let m = &st.metrics;
            m.engine_scrape_errors.inc();
            m.engine_up.set(0);
            // No figures while the engine does not answer: no stale value stays exported.
            m.engine_kv_usage_ratio.clear();
            m.engine_requests_running.clear();
            m.engine_requests_waiting.clear();
            // Metrics may be disabled or on another port: the health URL still says
            // whether the engine is reachable.
            let health = st.engine.health().await;
            if let Ok(mut s) = st.engine_status.lock() {
                match health {
                    Ok(()) => {
                        s.last_ok = Some(st.clock.now());
                        s.last_error = None;
                        s.figures = None;
                    }
                    Err(h) => {
                        if s.last_error.is_none() {
                            tracing::warn!(error = %e, health = %h, "engine unreachable");
                        }
                        s.last_error = Some(format!("{e}; {h}"));
                        s.figures = None;
                    }
                }
            }
        }
    }
}

/// Folds a GPU probe result into the status and the per-device/per-process gauges.
pub fn record_gpu(st: &AppState, result: Result<GpuSnapshot, String>) {
    let now_unix = st.clock.unix_secs();
    let Ok(mut g) = st.gpu.lock() else {
        return;
    };
    if result.is_ok() {
        g.last_ok_at = Some(st.clock.now());
    }
    g.record(result, now_unix);
    let status = g.status().clone();
    let m = &st.metrics;
    m.nvml_available.set(i64::from(status.nvml_available));
    let mut live_dev = HashSet::new();
    let mut live_proc = HashSet::new();
    for d in &status.devices {
        let l = vec![("gpu", d.index.to_string()), ("uuid", d.uuid.clone())];
        m.gpu_memory_total
            .get_or_create(&l)
            .set(d.total_bytes as i64);
        m.gpu_memory_used.get_or_create(&l).set(d.used_bytes as i64);
        m.gpu_memory_free.get_or_create(&l).set(d.free_bytes as i64);
        live_dev.insert(l);
        for p in &d.processes {
            if let Some(b) = p.used_bytes {
                let pl = vec![("gpu", d.index.to_string()), ("pid", p.pid.to_string())];
                m.gpu_process_memory_used.get_or_create(&pl).set(b as i64);
                live_proc.insert(pl);
            }
        }
    }
    // Processes that ended and devices that vanished disappear from /metrics.
    for stale in g.exported_devices.difference(&live_dev) {
        m.gpu_memory_total.remove(stale);
        m.gpu_memory_used.remove(stale);
        m.gpu_memory_free.remove(stale);
    }
    for stale in g.exported_processes.difference(&live_proc) {
        m.gpu_process_memory_used.remove(stale);
    }
    g.exported_devices = live_dev;
    g.exported_processes = live_proc;
}

/// Updates the orphan gauge, and takes a quiet checkpoint if `window` was quiet through
/// (no admission, nothing in flight beyond `--quiet-max-inflight` at either end): the
/// engine's KV usage of this round's scrape, GPU memory of an NVML sample taken within the
/// window.
pub fn checkpoint(st: &AppState, window: &QuietWindow) {
    let (figures, tracked) = st
        .engine_status
        .lock()
        .ok()
        .map(|s| (s.figures, s.tracked))
        .unwrap_or_default();
    let tracked = tracked.unwrap_or_else(|| st.inflight_sequences());
    match figures.and_then(|f| f.running.map(|r| (r, f.waiting.unwrap_or(0.0)))) {
        Some((running, waiting)) => st.metrics.orphans.set(orphans(running, waiting, tracked)),
        None => st.metrics.orphans.clear(),
    }
    if !window.quiet_until_now(st) {
        return;
    }
    let gpu_used = st.gpu.lock().ok().and_then(|g| {
        let s = g.status();
        (s.nvml_available && g.last_ok_at.is_some_and(|t| t >= window.opened))
            .then(|| s.devices.iter().map(|d| d.used_bytes).sum::<u64>())
    });
    let kv = figures.and_then(|f| f.kv_usage);
    if kv.is_none() && gpu_used.is_none() {
        return;
    }
    if let Some(kv) = kv {
        st.metrics.quiet_kv_usage.set(kv);
    }
    if let Some(b) = gpu_used {
        st.metrics.quiet_gpu_memory_bytes.set(b as i64);
    }
    st.metrics
        .quiet_checkpoint_timestamp
        .set(st.clock.unix_secs() as i64);
    st.metrics.quiet_checkpoints.inc();
}
