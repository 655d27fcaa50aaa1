//! Shared state: configuration, the in-flight table, tombstones, replay memory, engine and
//! GPU status, metrics; and how a request is ended.

use crate::clock::Clock;
use crate::config::Config;
use crate::engine::Engine;
use crate::expo::{EngineFigures, EngineFlavour};
use crate::gpu::GpuTracker;
use crate::metrics::{outcome, Metrics};
use crate::pool::{EnginePool, TcpDial};
use crate::replay::ReplayMemory;
use crate::table::Entry;
use crate::tombstones::{Tombstone, Tombstones};
use kvguard_contract::{AbortReason, RequestId};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Most signatures remembered for replay detection.
pub const MAX_REPLAY_ENTRIES: usize = 100_000;

/// Table, tombstones and replay memory, under one lock so that admission and abort see
/// one consistent view (an abort cannot slip between a tombstone check and an insert).
#[derive(Debug)]
pub struct Inner {
    /// In flight.
    pub table: HashMap<RequestId, Arc<Entry>>,
    /// Refused ids.
    pub tombstones: Tombstones,
    /// Seen signatures.
    pub replay: ReplayMemory,
}

/// The engine as last seen.
#[derive(Debug, Clone, Default)]
pub struct EngineStatus {
    /// Last time the engine answered (metrics or health).
    pub last_ok: Option<Instant>,
    /// The last error, if the last attempt failed.
    pub last_error: Option<String>,
    /// Figures of the last successful scrape.
    pub figures: Option<EngineFigures>,
    /// Whose names the scrape matched.
    pub flavour: Option<EngineFlavour>,
    /// Last preemption count seen (for the counter's deltas).
    pub last_preemptions: Option<f64>,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Its id is tombstoned.
    Tombstoned(Tombstone),
    /// The table is full.
    Full(usize),
    /// Shutting down.
    Draining,
}

/// Everything the handlers and tasks share.
pub struct AppState {
    /// Validated configuration.
    pub cfg: Config,
    /// Time.
    pub clock: Arc<dyn Clock>,
    /// Metrics (registered in `registry`).
    pub metrics: Metrics,
    /// The registry `/metrics` encodes.
    pub registry: Registry,
    /// The engine's metrics, health and abort API.
    pub engine: Arc<dyn Engine>,
    /// GPU status.
    pub gpu: Mutex<GpuTracker>,
    /// Engine status.
    pub engine_status: Mutex<EngineStatus>,
    /// Pre-connected engine connections (`--engine-prewarm`); filled once started.
    pub pool: Arc<EnginePool>,
    inner: Mutex<Inner>,
    seq: AtomicU64,
    draining: AtomicBool,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").finish_non_exhaustive()
    }
}

impl AppState {
    /// Builds the state.
    pub fn new(
        cfg: Config,
        clock: Arc<dyn Clock>,
        engine: Arc<dyn Engine>,
        gpu: GpuTracker,
    ) -> Arc<AppState> {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics
            .nvml_available
            .set(i64::from(gpu.status().nvml_available));
        let inner = Inner {
            table: HashMap::new(),
            tombstones: Tombstones::new(cfg.tombstone_ttl, cfg.max_tombstones),
            replay: ReplayMemory::new(MAX_REPLAY_ENTRIES),
        };
        let pool = EnginePool::new(
            TcpDial::new(cfg.engine.authority.clone()),
            cfg.engine_prewarm,
            cfg.engine_prewarm_max_idle,
            metrics.clone(),
        );
        Arc::new(AppState {
            pool,
            cfg,
            clock,
            metrics,
            registry,
            engine,
            gpu: Mutex::new(gpu),
            engine_status: Mutex::new(EngineStatus::default()),
            inner: Mutex::new(inner),
            seq: AtomicU64::new(1),
            draining: AtomicBool::new(false),
        })
    }

    /// Locks the table, tombstones and replay memory (a poisoned lock is recovered: the
    /// data stays consistent because every critical section is panic-free).
    pub fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests in flight.
    pub fn inflight(&self) -> usize {
        self.inner().table.len()
    }

    /// Every entry in flight.
    pub fn entries(&self) -> Vec<Arc<Entry>> {
        self.inner().table.values().cloned().collect()
    }

    /// The entry for `id`, if in flight.
    pub fn entry(&self, id: &RequestId) -> Option<Arc<Entry>> {
        self.inner().table.get(id).cloned()
    }

    /// Whether shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Starts draining: new requests are refused, `/readyz` fails.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Admits a request: refuses tombstoned ids and a full table; a request whose id is
    /// already in flight supersedes the older one (a retry of the same logical request:
    /// the older attempt is orphaned and is ended).
    pub fn admit(
        self: &Arc<Self>,
        id: RequestId,
        method: String,
        path: String,
    ) -> Result<Arc<Entry>, Refusal> {
        if self.is_draining() {
            return Err(Refusal::Draining);
        }
        let now = self.clock.now();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(Entry::new(
            id.clone(),
            seq,
            method,
            path,
            now,
            self.clock.unix_secs(),
        ));
        let superseded = {
            let mut inner = self.inner();
            if let Some(t) = inner.tombstones.get(&id, now) {
                return Err(Refusal::Tombstoned(t));
            }
            let old = inner.table.remove(&id);
            if old.is_none() && inner.table.len() >= self.cfg.max_inflight {
                return Err(Refusal::Full(self.cfg.max_inflight));
            }
            inner.table.insert(id, entry.clone());
            self.metrics.inflight.set(inner.table.len() as i64);
            old
        };
        if let Some(old) = superseded {
            self.metrics.superseded.inc();
            tracing::warn!(request_id = %old.id, "a request with an id already in flight arrived; ending the older one (reason timeout)");
            self.end_request(&old, AbortReason::Timeout, "superseded");
        }
        Ok(entry)
    }

    /// Removes an entry (only this one, not a newer one with the same id).
    pub fn remove(&self, entry: &Entry) {
        let mut inner = self.inner();
        if inner
            .table
            .get(&entry.id)
            .is_some_and(|e| e.seq == entry.seq)
        {
            inner.table.remove(&entry.id);
        }
        self.metrics.inflight.set(inner.table.len() as i64);
    }

    /// Tombstones an id.
    pub fn tombstone(&self, id: RequestId, reason: AbortReason) {
        let now = self.clock.now();
        let mut inner = self.inner();
        let before = inner.tombstones.evicted();
        inner.tombstones.insert(id, reason, now);
        let evicted = inner.tombstones.evicted() - before;
        self.metrics.tombstones.set(inner.tombstones.len() as i64);
        if evicted > 0 {
            self.metrics.tombstones_evicted.inc_by(evicted);
        }
    }

    /// Purges expired tombstones.
    pub fn purge_tombstones(&self) {
        let now = self.clock.now();
        let mut inner = self.inner();
        inner.tombstones.purge(now);
        self.metrics.tombstones.set(inner.tombstones.len() as i64);
    }

    /// Ends a request in flight for `reason` (`via`: `abort_api`, `reaper`, `shutdown`,
    /// `superseded`, for the log). Returns `false` if it was already being ended.
    ///
    /// Enforce mode: the client's stream gets the final SSE event and ends, the engine
    /// connection is closed (vLLM, TGI, llama.cpp abort on disconnect), the engine's own
    /// abort is called per strategy, the id is tombstoned. `--dry-run`: logged and counted
    /// once per request, nothing else.
    pub fn end_request(
        self: &Arc<Self>,
        entry: &Arc<Entry>,
        reason: AbortReason,
        via: &'static str,
    ) -> bool {
        let age_ms = self
            .clock
            .now()
            .saturating_duration_since(entry.times().started)
            .as_millis();
        let strategy = self.cfg.abort_strategy.as_str();
        if self.cfg.dry_run && via != "shutdown" {
            if entry.mark_observed() {
                self.metrics.abort(reason, outcome::DRY_RUN);
                tracing::info!(request_id = %entry.id, reason = %reason, via, strategy, outcome = outcome::DRY_RUN, age_ms = age_ms as u64, events = entry.events(), "would end request (dry run)");
            }
            return false;
        }
        if !entry.mark_ended(reason) {
            return false;
        }
        entry.end();
        self.tombstone(entry.id.clone(), reason);
        let this = self.clone();
        let entry = entry.clone();
        let events = entry.events();
        tokio::spawn(async move {
            let (outcome, error) = match this.engine.abort(entry.id.clone()).await {
                Ok(()) => (outcome::ABORTED, None),
                Err(e) => (outcome::ENGINE_CALL_FAILED, Some(e)),
            };
            this.metrics.abort(reason, outcome);
            match error {
                None => {
                    tracing::info!(request_id = %entry.id, reason = %reason, via, strategy, outcome, age_ms = age_ms as u64, events, "ended request")
                }
                Some(e) => {
                    tracing::warn!(request_id = %entry.id, reason = %reason, via, strategy, outcome, age_ms = age_ms as u64, events, error = %e, "ended request; the engine's abort call failed (the connection was closed)")
                }
            }
        });
        true
    }

    /// Whether the engine answered recently: within three sample intervals (at least 1 s).
    pub fn engine_ready(&self) -> bool {
        let window = (self.cfg.sample_interval * 3).max(Duration::from_secs(1));
        let now = self.clock.now();
        self.engine_status
            .lock()
            .map(|s| {
                s.last_error.is_none()
                    && s.last_ok
                        .is_some_and(|t| now.saturating_duration_since(t) <= window)
            })
            .unwrap_or(false)
    }
}
