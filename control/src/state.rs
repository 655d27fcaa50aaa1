//! Shared state: configuration, keys, the in-flight table, tombstones, replay memory,
//! engine and GPU status, leases, peers, metrics; and admission (a superseding retry
//! included). How a request is ended is [`crate::abort`].

use crate::clock::Clock;
use crate::config::Config;
use crate::engine::Engine;
use crate::expo::{EngineFigures, EngineFlavour};
use crate::gpu::GpuTracker;
use crate::metrics::Metrics;
use crate::replay::ReplayMemory;
use crate::table::Entry;
use kvguard_contract::{AbortReason, Key, RequestId};
pub use kvguard_control_core::inflight::{Held, Inflight, InflightConfig, Refusal};
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

/// The in-flight table and tombstones ([`Inflight`]), under one lock
/// so that admission and abort see one consistent view. The replay memory has its own
/// lock ([`AppState::replay`]): checking a signature never holds up admission.
pub type Inner = Inflight<Arc<Entry>>;

impl Held for Entry {
    fn id(&self) -> &RequestId {
        &self.id
    }

    fn seq(&self) -> u64 {
        self.seq
    }

    fn mark_ended(&self, reason: AbortReason) -> bool {
        Entry::mark_ended(self, reason)
    }

    fn times(&self) -> kvguard_control_core::request::Times {
        Entry::times(self)
    }
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
    /// Engine sequences of the requests in flight here when the last scrape was taken
    /// (the larger of the counts just before and just after it).
    pub tracked: Option<u64>,
}

/// The keys kvguard-control uses: those it accepts on abort calls, and the one it signs
/// its response stamp with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeySet {
    /// Accepted on `POST /v1/abort` (any of them).
    pub accept: Vec<Key>,
    /// Signs the `x-kvguard-control` stamp.
    pub stamp: Option<Key>,
}

impl KeySet {
    /// The key envelopes to the peers are signed with: the stamp key when there is one.
    /// During a rotation's last step (the old key leaves `--secret-file`) the replicas
    /// that reloaded first accept only the new key, which every replica accepts and signs
    /// its stamp with since step 3.
    pub fn envelope_key(&self) -> Option<&Key> {
        self.stamp.as_ref().or(self.accept.first())
    }
}

/// Everything the handlers and tasks share. Each part that changes has its own lock, so
/// unrelated work never waits on another's: the table and tombstones (one lock, so that
/// admission and abort see one view), the replay memory, the keys (read-mostly, swapped
/// whole on reload), the engine status, the GPU status, the leases; the peer set is
/// immutable apart from its own resolution cache. No code holds two of them at once.
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
    inner: Mutex<Inner>,
    replay: Mutex<ReplayMemory>,
    keys: RwLock<Arc<KeySet>>,
    seq: AtomicU64,
    admissions: AtomicU64,
    draining: AtomicBool,
    /// Liveness leases of the gateways (contract §8).
    pub leases: Mutex<kvguard_control_core::lease::Leases>,
    /// The other replicas (`--peers`), if any.
    pub peers: Option<Arc<crate::peers::Peers>>,
    /// Finished prefills whose blocks the prefill engine may hold for a decode side.
    pub handoffs: Mutex<kvguard_control_core::pd::Handoffs>,
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
        let inner = Inflight::new(InflightConfig {
            max_inflight: cfg.max_inflight,
            dry_run: cfg.dry_run,
            tombstone_ttl: cfg.tombstone_ttl,
            max_tombstones: cfg.max_tombstones,
        });
        let replay = Mutex::new(ReplayMemory::new(cfg.max_replay_entries));
        let keys = KeySet {
            accept: cfg.keys.clone(),
            stamp: cfg.stamp_key.clone(),
        };
        let cfg_lease_ttl = cfg.lease_ttl;
        let handoffs =
            kvguard_control_core::pd::Handoffs::new(cfg.pd_kv_lease, cfg.max_pd_handoffs);
        let peers = cfg
            .peers
            .clone()
            .map(|p| Arc::new(crate::peers::Peers::new(p, metrics.peer.clone())));
        Arc::new(AppState {
            keys: RwLock::new(Arc::new(keys)),
            cfg,
            clock,
            metrics,
            registry,
            engine,
            gpu: Mutex::new(gpu),
            engine_status: Mutex::new(EngineStatus::default()),
            inner: Mutex::new(inner),
            replay,
            seq: AtomicU64::new(1),
            admissions: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            leases: Mutex::new(kvguard_control_core::lease::Leases::new(cfg_lease_ttl)),
            peers,
            handoffs: Mutex::new(handoffs),
        })
    }

    /// Locks the table and tombstones (a poisoned lock is recovered: the data stays
    /// consistent because every critical section is panic-free).
    pub fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Locks the replay memory (its own lock, apart from admission's).
    pub fn replay(&self) -> MutexGuard<'_, ReplayMemory> {
        self.replay.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests in flight.
    pub fn inflight(&self) -> usize {
        self.inner().len()
    }

    /// Engine sequences of the requests in flight ([`Entry::sequences`]).
    pub fn inflight_sequences(&self) -> u64 {
        self.inner()
            .entries()
            .map(|e| u64::from(e.sequences()))
            .sum()
    }

    /// Every entry in flight.
    pub fn entries(&self) -> Vec<Arc<Entry>> {
        self.inner().entries().cloned().collect()
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
    /// already in flight supersedes the older attempt (a retry of the same logical
    /// request, see [`AppState::supersede`]).
    pub fn admit(
        self: &Arc<Self>,
        id: RequestId,
        method: String,
        path: String,
    ) -> Result<Arc<Entry>, Refusal> {
        let now = self.clock.now();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(Entry::new(
            id,
            seq,
            method,
            path,
            now,
            self.clock.unix_secs(),
        ));
        let superseded = {
            let mut inner = self.inner();
            let old = inner.admit(entry.clone(), self.is_draining(), now)?;
            self.admissions.fetch_add(1, Ordering::AcqRel);
            self.metrics.inflight.set(inner.len() as i64);
            old
        };
        if let Some(old) = superseded {
            self.supersede(&old);
        }
        Ok(entry)
    }

    /// Ends an attempt a retry with the same id replaced: only its engine connection is
    /// closed (and its client stream ended). Its id now belongs to the live retry, so it
    /// is neither tombstoned nor passed to the engine's abort API (either would end the
    /// retry). `--dry-run`: counted and logged only; the attempt stays in flight (in
    /// the table) until its response ends.
    fn supersede(self: &Arc<Self>, old: &Arc<Entry>) {
        self.metrics.superseded.inc();
        if self.cfg.dry_run {
            tracing::info!(request_id = %old.id, "a retry with the same id arrived; would close the older attempt (dry run)");
            return;
        }
        if !old.mark_ended(AbortReason::Timeout) {
            return;
        }
        tracing::info!(request_id = %old.id, "a retry with the same id arrived; closed the older attempt's engine connection");
        old.end();
        self.arm_downstream_deadline(old);
    }

    /// Removes an entry (only this one, not a newer one with the same id).
    pub fn remove(&self, entry: &Arc<Entry>) {
        let mut inner = self.inner();
        inner.remove(entry);
        self.metrics.inflight.set(inner.len() as i64);
    }

    /// Tombstones an id.
    pub fn tombstone(&self, id: RequestId, reason: AbortReason) {
        let now = self.clock.now();
        let mut inner = self.inner();
        let evicted = inner.tombstone(id, reason, now);
        self.count_tombstones(&inner, evicted);
    }

    /// Sets the tombstone gauge and counts `evicted` early evictions.
    pub(crate) fn count_tombstones(&self, inner: &Inner, evicted: u64) {
        self.metrics.tombstones.set(inner.tombstones() as i64);
        if evicted > 0 {
            self.metrics.tombstones_evicted.inc_by(evicted);
        }
    }

    /// Purges expired tombstones.
    pub fn purge_tombstones(&self) {
        let now = self.clock.now();
        let mut inner = self.inner();
        inner.purge(now);
        self.count_tombstones(&inner, 0);
    }

    /// Successful admissions so far (quiet checkpoints: none may happen during a sample).
    pub fn admissions(&self) -> u64 {
        self.admissions.load(Ordering::Acquire)
    }

    /// The keys in use now (reloaded when the key files change).
    pub fn keys(&self) -> Arc<KeySet> {
        self.keys
            .read()
            .map(|k| k.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Replaces the keys in use.
    pub fn set_keys(&self, keys: KeySet) {
        match self.keys.write() {
            Ok(mut k) => *k = Arc::new(keys),
            Err(p) => *p.into_inner() = Arc::new(keys),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FakeEngine, ManualClock};

    #[test]
    fn admission_replay_keys_engine_gpu_and_leases_each_have_their_own_lock() {
        let key = Key::try_new(b"kvguard-state-test-key-0123456789").unwrap();
        let cfg = Config::for_tests("http://127.0.0.1:9", vec![key]).unwrap();
        let st = AppState::new(
            cfg,
            Arc::new(ManualClock::new(1_800_000_000)),
            Arc::new(FakeEngine),
            GpuTracker::unavailable("test".into()),
        );
        // With the admission lock held, every other part is free (a shared lock would
        // make these attempts fail, not wait).
        let inner = st.inner();
        assert!(st.replay.try_lock().is_ok(), "replay memory");
        assert!(st.keys.try_write().is_ok(), "keys");
        assert!(st.engine_status.try_lock().is_ok(), "engine status");
        assert!(st.gpu.try_lock().is_ok(), "gpu");
        assert!(st.leases.try_lock().is_ok(), "leases");
        drop(inner);
        // And the other way round: a held replay, lease or engine lock leaves admission free.
        let replay = st.replay();
        let leases = st.leases.lock().unwrap();
        let engine = st.engine_status.lock().unwrap();
        assert!(st.inner.try_lock().is_ok(), "admission");
        drop((replay, leases, engine));
    }
}
