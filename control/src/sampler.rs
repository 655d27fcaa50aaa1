//! Periodic sampling: engine metrics (and health), NVML, the engine process, quiet
//! checkpoints and the orphan gauge.

use crate::expo::EngineFigures;
use crate::gpu::{GpuProbe, GpuSnapshot};
use crate::metrics::orphans;
use crate::state::AppState;
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

static PROC_WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// One sampling round.
pub async fn sample_once(st: &Arc<AppState>, probe: Option<&Arc<dyn GpuProbe>>) {
    scrape_engine(st).await;
    if let Some(p) = probe {
        let p = p.clone();
        let result = tokio::task::spawn_blocking(move || p.sample())
            .await
            .unwrap_or_else(|e| Err(format!("NVML sample task failed: {e}")));
        record_gpu(st, result);
    }
    if let Some(pid) = st.cfg.engine_pid {
        match crate::procfs::read(Path::new("/proc"), pid) {
            Ok(s) => {
                st.metrics.engine_process_open_fds.set(s.open_fds as i64);
                st.metrics
                    .engine_process_resident_memory
                    .set(s.rss_bytes as i64);
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
    checkpoint(st);
}

async fn scrape_engine(st: &Arc<AppState>) {
    let result = st.engine.scrape().await;
    let now = st.clock.now();
    match result {
        Ok(text) => {
            let figures = EngineFigures::from_text(&text);
            let flavour = EngineFigures::flavour(&text);
            let m = &st.metrics;
            if let Some(v) = figures.kv_usage {
                m.engine_kv_usage_ratio.set(v);
            }
            if let Some(v) = figures.running {
                m.engine_requests_running.set(v);
            }
            if let Some(v) = figures.waiting {
                m.engine_requests_waiting.set(v);
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
            }
        }
        Err(e) => {
            st.metrics.engine_scrape_errors.inc();
            st.metrics.engine_up.set(0);
            // Metrics may be disabled or on another port: the health URL still says
            // whether the engine is reachable.
            let health = st.engine.health().await;
            if let Ok(mut s) = st.engine_status.lock() {
                match health {
                    Ok(()) => {
                        s.last_ok = Some(st.clock.now());
                        s.last_error = None;
                    }
                    Err(h) => {
                        if s.last_error.is_none() {
                            tracing::warn!(error = %e, health = %h, "engine unreachable");
                        }
                        s.last_error = Some(format!("{e}; {h}"));
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

/// A quiet checkpoint when few enough requests are in flight; updates the orphan gauge.
pub fn checkpoint(st: &AppState) {
    let inflight = st.inflight();
    let (figures, engine_ok) = st
        .engine_status
        .lock()
        .map(|s| (s.figures, s.last_error.is_none()))
        .unwrap_or((None, false));
    let figures = if engine_ok { figures } else { None };
    if let Some(running) = figures.and_then(|f| f.running) {
        st.metrics.orphans.set(orphans(running, inflight));
    }
    if inflight > st.cfg.quiet_max_inflight {
        return;
    }
    let gpu_used = st.gpu.lock().ok().and_then(|g| {
        let s = g.status();
        s.nvml_available
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
