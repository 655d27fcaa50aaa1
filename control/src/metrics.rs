//! Every Prometheus metric kvguard-control exports, registered in one place.
//! Names are prefixed `kvguard_control_`; engine figures are `kvguard_control_engine_*`.
//! (prometheus-client appends `_total` to counters.)

use kvguard_contract::AbortReason;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// A float gauge.
pub type FGauge = Gauge<f64, AtomicU64>;
/// Static labels.
pub type L1 = [(&'static str, &'static str); 1];
/// Static labels.
pub type L2 = [(&'static str, &'static str); 2];
/// Dynamic labels (GPU devices, processes).
pub type LDyn = Vec<(&'static str, String)>;

/// Outcome label of an end carried out by kvguard (abort API or reaper).
pub mod outcome {
    /// The engine connection was closed (and the engine's abort called, per strategy).
    pub const ABORTED: &str = "aborted";
    /// The connection was closed but the engine's own abort call failed.
    pub const ENGINE_CALL_FAILED: &str = "engine_call_failed";
    /// `--dry-run`: counted and logged only.
    pub const DRY_RUN: &str = "dry_run";
}

/// All metrics.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// Proxied requests by how they were admitted: `tracked`, `refused_tombstone`,
    /// `refused_full`, `refused_draining`, `bad_request_id` (the id was replaced by a
    /// minted one; the request is still tracked), `body_too_large`.
    pub requests: Family<L1, Counter>,
    /// Request ends: `end` = `clean` | `unclean`; `cause` = `complete`, `client_gone`,
    /// `aborted`, `upstream_error`, `engine_unreachable`.
    pub request_ends: Family<L2, Counter>,
    /// Requests in flight through kvguard.
    pub inflight: Gauge,
    /// Ends carried out by kvguard, by `reason` and `outcome`.
    pub aborts: Family<L2, Counter>,
    /// Abort API answers by `result`.
    pub abort_api: Family<L1, Counter>,
    /// Live tombstones.
    pub tombstones: Gauge,
    /// Tombstones evicted early (set full).
    pub tombstones_evicted: Counter,
    /// Requests that replaced an in-flight request with the same id (retries).
    pub superseded: Counter,
    /// Reaper passes that found kvguard-control stalled (the stall credited to every
    /// request in flight).
    pub reaper_stalls: Counter,
    /// Data events (SSE) / lines (NDJSON) proxied.
    pub data_events: Counter,
    /// Engine KV-cache usage, 0..1.
    pub engine_kv_usage_ratio: MaybeGauge,
    /// Engine running sequences.
    pub engine_requests_running: MaybeGauge,
    /// Engine waiting sequences.
    pub engine_requests_waiting: MaybeGauge,
    /// Engine preemptions (a counter following the engine's own).
    pub engine_preemptions: Counter<f64, AtomicU64>,
    /// Failed scrapes.
    pub engine_scrape_errors: Counter,
    /// 1 when the last scrape succeeded.
    pub engine_up: Gauge,
    /// Engine running + waiting − engine sequences of the requests in flight through
    /// kvguard (`n` × prompts each), floored at 0 (absent while the
    /// engine's figures are unknown).
    pub orphans: MaybeGauge,
    /// 1 when NVML answers.
    pub nvml_available: Gauge,
    /// Per device total memory.
    pub gpu_memory_total: Family<LDyn, Gauge>,
    /// Per device used memory.
    pub gpu_memory_used: Family<LDyn, Gauge>,
    /// Per device free memory.
    pub gpu_memory_free: Family<LDyn, Gauge>,
    /// Per process used GPU memory.
    pub gpu_process_memory_used: Family<LDyn, Gauge>,
    /// KV usage at the last quiet checkpoint.
    pub quiet_kv_usage: FGauge,
    /// GPU used memory (all devices) at the last quiet checkpoint.
    pub quiet_gpu_memory_bytes: Gauge,
    /// Unix time of the last quiet checkpoint.
    pub quiet_checkpoint_timestamp: Gauge,
    /// Quiet checkpoints taken.
    pub quiet_checkpoints: Counter,
    /// Engine process open file descriptors.
    pub engine_process_open_fds: Gauge,
    /// Engine process resident memory.
    pub engine_process_resident_memory: Gauge,
    /// Processes summed in the two above (`--engine-pid` and its descendants).
    pub engine_processes: Gauge,
    /// Downstream sides cut after the post-abort deadline, by `scope`.
    pub downstream_cuts: Family<L1, Counter>,
    /// NVML calls that did not return within their deadline.
    pub nvml_timeouts: Counter,
    /// Signed calls refused (503) because the replay memory was full of live signatures.
    pub replay_full: Counter,
    /// Key file reloads by `result` = `ok`, `error` (the old keys stay).
    pub key_reloads: Family<L1, Counter>,

    // ---- Leak cost and engine connections (register_leak_signals) ----
    /// Engine seconds spent on requests after their client had gone, by abort `reason`.
    pub orphan_seconds: Family<L1, Counter<f64, AtomicU64>>,
    /// Data events (tokens, one per event at vLLM's default stream interval) streamed
    /// after the client had gone, by abort `reason`.
    pub wasted_tokens: Family<L1, Counter>,
    /// Orphans whose cost was counted, by abort `reason` (the denominator).
    pub orphan_ends: Family<L1, Counter>,
    /// Open engine connections (one per proxied request).
    pub engine_connections: Gauge,
    /// LoRA adapters the engine lists in `/v1/models` (absent while unknown).
    pub engine_lora_adapters: MaybeGauge,
    /// Liveness leases (their own block, [`LeaseMetrics`]).
    pub lease: LeaseMetrics,
    /// Messages between replicas (`--peers`, [`PeerMetrics`]).
    pub peer: PeerMetrics,
    /// Prefill/decode disaggregation ([`PdMetrics`]).
    pub pd: PdMetrics,
}

impl Metrics {
    /// Creates the metrics and registers them.
    pub fn register(reg: &mut Registry) -> Metrics {
        let m = Metrics::default();
        // Registered clones share their atomics with the fields.
        macro_rules! r {
            ($reg:expr, $name:expr, $help:expr, $metric:expr) => {
                $reg.register(concat!("kvguard_control_", $name), $help, $metric)
            };
        }
        r!(
            reg,
            "requests",
            "Proxied requests by admission result",
            m.requests.clone()
        );
        r!(
            reg,
            "request_ends",
            "Request ends: end=clean|unclean, and the cause",
            m.request_ends.clone()
        );
        r!(
            reg,
            "inflight",
            "Requests in flight through kvguard-control",
            m.inflight.clone()
        );
        r!(
            reg,
            "aborts",
            "Requests ended by kvguard-control (abort API, reaper, shutdown) by reason and outcome",
            m.aborts.clone()
        );
        r!(
            reg,
            "abort_api_answers",
            "Answers of POST /v1/abort by result",
            m.abort_api.clone()
        );
        r!(
            reg,
            "tombstones",
            "Live tombstones (aborted ids refused if they arrive)",
            m.tombstones.clone()
        );
        r!(
            reg,
            "tombstones_evicted",
            "Tombstones evicted before their TTL because the set was full",
            m.tombstones_evicted.clone()
        );
        r!(
            reg,
            "superseded",
            "In-flight requests ended because a request with the same id arrived (a retry)",
            m.superseded.clone()
        );
        r!(
            reg,
            "reaper_stalls",
            "Reaper passes that found kvguard-control stalled (the stall credited to every request in flight)",
            m.reaper_stalls.clone()
        );
        r!(
            reg,
            "data_events",
            "SSE data events and NDJSON lines proxied",
            m.data_events.clone()
        );
        reg.register_collector(Box::new(MaybeGaugeCollector { name: "kvguard_control_engine_kv_usage_ratio", help: "Engine KV-cache usage 0..1 (vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_perc, sglang:token_usage)", gauge: m.engine_kv_usage_ratio.clone() }));
        reg.register_collector(Box::new(MaybeGaugeCollector {
            name: "kvguard_control_engine_requests_running",
            help: "Engine running sequences (vllm:num_requests_running, sglang:num_running_reqs)",
            gauge: m.engine_requests_running.clone(),
        }));
        reg.register_collector(Box::new(MaybeGaugeCollector {
            name: "kvguard_control_engine_requests_waiting",
            help: "Engine waiting sequences (vllm:num_requests_waiting, sglang:num_queue_reqs)",
            gauge: m.engine_requests_waiting.clone(),
        }));
        r!(
            reg,
            "engine_preemptions",
            "Engine preemptions (vllm:num_preemptions_total)",
            m.engine_preemptions.clone()
        );
        r!(
            reg,
            "engine_scrape_errors",
            "Failed scrapes of the engine's metrics",
            m.engine_scrape_errors.clone()
        );
        r!(
            reg,
            "engine_up",
            "1 when the last scrape of the engine's metrics succeeded",
            m.engine_up.clone()
        );
        reg.register_collector(Box::new(MaybeGaugeCollector { name: "kvguard_control_orphans", help: "Engine running plus waiting sequences minus requests in flight through kvguard (floored at 0; absent while the engine does not answer; assumes one kvguard-control per engine)", gauge: m.orphans.clone() }));
        r!(
            reg,
            "nvml_available",
            "1 when NVML is loaded and answering",
            m.nvml_available.clone()
        );
        r!(
            reg,
            "gpu_memory_total_bytes",
            "GPU framebuffer memory, total",
            m.gpu_memory_total.clone()
        );
        r!(
            reg,
            "gpu_memory_used_bytes",
            "GPU framebuffer memory, used",
            m.gpu_memory_used.clone()
        );
        r!(
            reg,
            "gpu_memory_free_bytes",
            "GPU framebuffer memory, free",
            m.gpu_memory_free.clone()
        );
        r!(
            reg,
            "gpu_process_memory_used_bytes",
            "GPU memory used per process",
            m.gpu_process_memory_used.clone()
        );
        r!(
            reg,
            "quiet_kv_usage",
            "Engine KV usage at the last quiet checkpoint (in flight <= --quiet-max-inflight)",
            m.quiet_kv_usage.clone()
        );
        r!(
            reg,
            "quiet_gpu_memory_bytes",
            "GPU used memory (all devices) at the last quiet checkpoint",
            m.quiet_gpu_memory_bytes.clone()
        );
        r!(
            reg,
            "quiet_checkpoint_timestamp_seconds",
            "Unix time of the last quiet checkpoint",
            m.quiet_checkpoint_timestamp.clone()
        );
        r!(
            reg,
            "quiet_checkpoints",
            "Quiet checkpoints taken",
            m.quiet_checkpoints.clone()
        );
        r!(
            reg,
            "engine_process_open_fds",
            "Open file descriptors of --engine-pid and its descendant processes, summed",
            m.engine_process_open_fds.clone()
        );
        r!(
            reg,
            "engine_process_resident_memory_bytes",
            "Resident memory (VmRSS) of --engine-pid and its descendant processes, summed (shared pages count once per process)",
            m.engine_process_resident_memory.clone()
        );
        r!(
            reg,
            "engine_processes",
            "Processes summed in engine_process_open_fds and engine_process_resident_memory_bytes: --engine-pid and its descendants (vLLM V1: the API server and its EngineCore)",
            m.engine_processes.clone()
        );
        r!(
            reg,
            "downstream_cuts",
            "Downstream sides cut because the client did not take the end of its request within --abort-flush-timeout, by scope (h2_stream reset, connection closed)",
            m.downstream_cuts.clone()
        );
        r!(
            reg,
            "nvml_timeouts",
            "NVML calls that did not return within their deadline (no other call is started while one is outstanding)",
            m.nvml_timeouts.clone()
        );
        r!(
            reg,
            "replay_full",
            "Signed calls refused (503, retry) because the replay memory was full of live signatures",
            m.replay_full.clone()
        );
        r!(
            reg,
            "key_reloads",
            "Reloads of --secret-file / --stamp-key-file by result (error: the keys in use stay)",
            m.key_reloads.clone()
        );
        register_leak_signals(&m, reg);
        // Pre-create the closed label sets so dashboards see zeros, not gaps.
        for scope in ["h2_stream", "connection"] {
            let _ = m.downstream_cuts.get_or_create(&[("scope", scope)]);
        }
        for res in ["ok", "error"] {
            let _ = m.key_reloads.get_or_create(&[("result", res)]);
        }
        for reason in AbortReason::ALL {
            for o in [
                outcome::ABORTED,
                outcome::ENGINE_CALL_FAILED,
                outcome::DRY_RUN,
            ] {
                let _ = m
                    .aborts
                    .get_or_create(&[("reason", reason.as_str()), ("outcome", o)]);
            }
        }
        for res in [
            "tracked",
            "refused_tombstone",
            "refused_full",
            "refused_draining",
            "bad_request_id",
            "body_too_large",
        ] {
            let _ = m.requests.get_or_create(&[("result", res)]);
        }
        for res in ABORT_API_RESULTS {
            let _ = m.abort_api.get_or_create(&[("result", res)]);
        }
        for (end, cause) in [
            ("clean", "complete"),
            ("unclean", "client_gone"),
            ("unclean", "aborted"),
            ("unclean", "upstream_error"),
            ("unclean", "engine_unreachable"),
        ] {
            let _ = m
                .request_ends
                .get_or_create(&[("end", end), ("cause", cause)]);
        }
        m.lease.register(reg);
        m.peer.register(reg);
        m.pd.register(reg);
        m
    }

    /// Counts a request end.
    pub fn request_end(&self, cause: &'static str) {
        let end = if cause == "complete" {
            "clean"
        } else {
            "unclean"
        };
        self.request_ends
            .get_or_create(&[("end", end), ("cause", cause)])
            .inc();
    }

    /// Counts an end carried out by kvguard.
    pub fn abort(&self, reason: AbortReason, outcome: &'static str) {
        self.aborts
            .get_or_create(&[("reason", reason.as_str()), ("outcome", outcome)])
            .inc();
    }

    /// Counts an abort API answer.
    pub fn abort_api(&self, result: &'static str) {
        self.abort_api.get_or_create(&[("result", result)]).inc();
    }

    /// Counts a downstream side cut after the post-abort deadline.
    pub fn downstream_cut(&self, scope: &'static str) {
        self.downstream_cuts
            .get_or_create(&[("scope", scope)])
            .inc();
    }

    /// Counts a proxied request's admission.
    pub fn request(&self, result: &'static str) {
        self.requests.get_or_create(&[("result", result)]).inc();
    }
}

// ---- Leak cost and engine connections ----

/// Registers the orphan-cost counters and the engine-connection gauge.
fn register_leak_signals(m: &Metrics, reg: &mut Registry) {
    reg.register(
        "kvguard_control_orphan_seconds",
        "Engine seconds spent on requests after their client had gone: from the departure the abort's sender reported (gone_ms) to the engine connection closing, by abort reason",
        m.orphan_seconds.clone(),
    );
    reg.register(
        "kvguard_control_wasted_tokens",
        "Data events (one per token at vLLM's default stream interval) streamed after the client had gone, beyond those the sender passed on, by abort reason; streams only (a non-streaming answer's tokens are unknowable before it completes)",
        m.wasted_tokens.clone(),
    );
    reg.register(
        "kvguard_control_orphan_ends",
        "Requests ended after their client had gone whose cost is in orphan_seconds, by abort reason",
        m.orphan_ends.clone(),
    );
    reg.register(
        "kvguard_control_engine_connections",
        "Engine connections open (one per proxied request, closed when it ends)",
        m.engine_connections.clone(),
    );
    reg.register_collector(Box::new(MaybeGaugeCollector {
        name: "kvguard_control_engine_lora_adapters",
        help: "LoRA adapters the engine lists in GET /v1/models (models whose parent is the base model); absent while unknown",
        gauge: m.engine_lora_adapters.clone(),
    }));
    for reason in AbortReason::ALL {
        let l = [("reason", reason.as_str())];
        let _ = m.orphan_seconds.get_or_create(&l);
        let _ = m.wasted_tokens.get_or_create(&l);
        let _ = m.orphan_ends.get_or_create(&l);
    }
}

impl Metrics {
    /// Counts an orphan's cost: `seconds` of engine time and, for a stream, `events`
    /// produced after its client had gone.
    pub fn orphan_cost(&self, reason: AbortReason, seconds: f64, events: Option<u64>) {
        let l = [("reason", reason.as_str())];
        self.orphan_seconds
            .get_or_create(&l)
            .inc_by(seconds.max(0.0));
        self.orphan_ends.get_or_create(&l).inc();
        if let Some(n) = events {
            self.wasted_tokens.get_or_create(&l).inc_by(n);
        }
    }
}

/// The abort API's `result` label values.
pub const ABORT_API_RESULTS: [&str; 10] = [
    "dry_run",
    "deferred",
    "forwarded",
    "aborted",
    "already_aborted",
    "not_found",
    "peer_unanswered",
    "bad_request",
    "unauthorized",
    "replay",
];

/// Orphans: sequences the engine holds (running and waiting) that no request in flight
/// through kvguard accounts for, floored at 0. Exact only with one kvguard-control in
/// front of the engine (other clients' sequences count as orphans).
pub fn orphans(engine_running: f64, engine_waiting: f64, tracked_sequences: u64) -> f64 {
    (engine_running + engine_waiting - tracked_sequences as f64).max(0.0)
}

/// A float gauge whose series exists only while its value is known: cleared, it
/// disappears from `/metrics` (never a stale value, never a made-up 0).
#[derive(Debug, Clone, Default)]
pub struct MaybeGauge(Arc<Mutex<Option<f64>>>);

impl MaybeGauge {
    /// Sets the value.
    pub fn set(&self, v: f64) {
        *self.lock() = Some(v);
    }

    /// Removes the series.
    pub fn clear(&self) {
        *self.lock() = None;
    }

    /// The value, if known.
    pub fn get(&self) -> Option<f64> {
        *self.lock()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<f64>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A [`MaybeGauge`] under its name, as the registry encodes it.
#[derive(Debug)]
struct MaybeGaugeCollector {
    name: &'static str,
    help: &'static str,
    gauge: MaybeGauge,
}

impl Collector for MaybeGaugeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(v) = self.gauge.get() {
            let g = ConstGauge::new(v);
            let me = encoder.encode_descriptor(self.name, self.help, None, g.metric_type())?;
            g.encode(me)?;
        }
        Ok(())
    }
}

/// Encodes the registry in the OpenMetrics text format.
pub fn encode(reg: &Registry) -> String {
    let mut s = String::new();
    if prometheus_client::encoding::text::encode(&mut s, reg).is_err() {
        s.clear();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orphan_gauge() {
        assert_eq!(orphans(5.0, 0.0, 3), 2.0);
        assert_eq!(orphans(2.0, 0.0, 3), 0.0);
        assert_eq!(orphans(0.0, 0.0, 0), 0.0);
        // A leaked running sequence is not hidden behind a queued one in flight.
        assert_eq!(orphans(1.0, 1.0, 1), 1.0);
    }

    #[test]
    fn names_are_prefixed_and_encoded() {
        let mut reg = Registry::default();
        let m = Metrics::register(&mut reg);
        m.abort(AbortReason::Stalled, outcome::ABORTED);
        m.request_end("complete");
        m.nvml_available.set(0);
        let text = encode(&reg);
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            assert!(line.starts_with("kvguard_control_"), "{line}");
        }
        assert!(
            text.contains("kvguard_control_aborts_total{reason=\"stalled\",outcome=\"aborted\"} 1")
        );
        assert!(
            text.contains("kvguard_control_request_ends_total{end=\"clean\",cause=\"complete\"} 1")
        );
        assert!(text.contains("kvguard_control_nvml_available 0"));
        for name in [
            "kvguard_control_engine_preemptions_total",
            "kvguard_control_engine_scrape_errors_total",
            "kvguard_control_engine_up",
            "kvguard_control_quiet_kv_usage",
            "kvguard_control_quiet_gpu_memory_bytes",
            "kvguard_control_quiet_checkpoint_timestamp_seconds",
            "kvguard_control_inflight",
            "kvguard_control_tombstones",
            "kvguard_control_engine_process_open_fds",
            "kvguard_control_engine_process_resident_memory_bytes",
            "kvguard_control_engine_processes",
            "kvguard_control_nvml_timeouts_total",
            "kvguard_control_replay_full_total",
            "kvguard_control_downstream_cuts_total{scope=\"h2_stream\"}",
            "kvguard_control_key_reloads_total{result=\"error\"}",
            "kvguard_control_orphan_seconds_total{reason=\"downstream_reset\"} 0",
            "kvguard_control_wasted_tokens_total{reason=\"stalled\"} 0",
            "kvguard_control_orphan_ends_total{reason=\"stalled\"} 0",
            "kvguard_control_engine_connections 0",
        ] {
            assert!(text.contains(&format!("\n{name}")), "{name} missing");
        }
        m.orphan_cost(AbortReason::DownstreamReset, 1.5, Some(4));
        m.orphan_cost(AbortReason::DownstreamReset, 0.5, None);
        let t = encode(&reg);
        assert!(
            t.contains("kvguard_control_orphan_seconds_total{reason=\"downstream_reset\"} 2.0"),
            "{t}"
        );
        assert!(t.contains("kvguard_control_wasted_tokens_total{reason=\"downstream_reset\"} 4"));
        assert!(t.contains("kvguard_control_orphan_ends_total{reason=\"downstream_reset\"} 2"));
        // Unknown engine figures are absent, not 0; known ones appear.
        assert!(!text.contains("kvguard_control_orphans"), "{text}");
        m.orphans.set(2.0);
        assert!(encode(&reg).contains("\nkvguard_control_orphans 2"));
        m.orphans.clear();
        assert!(!encode(&reg).contains("kvguard_control_orphans"));
    }
}

// ---- Liveness leases (contract §8) -------------------------------------------------------

/// The liveness-lease metrics.
#[derive(Debug, Clone, Default)]
pub struct LeaseMetrics {
    /// Gateway instances holding a lease here.
    pub held: Gauge,
    /// Of those, instances whose silence ends their streams (an in-band renewal arrived,
    /// or a proof and their listener answered a handshake).
    pub enforceable: Gauge,
    /// Renewals received from gateways, by `path` = `admin` | `data` and `result` =
    /// `accepted`, `duplicate` (the last accepted counter again: no effect), `replay`
    /// (counter not above the last accepted), `period_too_long`, `unauthorized`
    /// (signature), `bad_request` (body).
    pub renewals: Family<L2, Counter>,
    /// Leases expired, by `mode` = `enforce` | `observe` (`--lease-mode`), and `why` =
    /// `silent` | `dead` | `replaced` | `unproven` (counted, never ended) | `vm_lost` (one
    /// worker VM of a live gateway).
    pub expiries: Family<L2, Counter>,
    /// Expiries held because no other gateway was heard from since the silent one went
    /// silent, or because its listener still answered a handshake.
    pub held_expiries: Counter,
    /// Proofs of life on requests (`x-kvguard-instance`), by `result` = `accepted`,
    /// `duplicate` (the period's counter again: no new evidence), `replay`,
    /// `unauthorized` (signature), `bad_request` (unreadable value).
    pub proofs: Family<L1, Counter>,
    /// Handshakes asked of gateways' listeners, by `answer` = `alive` | `refused` |
    /// `timeout` (no answer within the bound, or unreachable).
    pub probes: Family<L1, Counter>,
    /// Instances found renewing with a host key another live instance renews with from
    /// another listener (two gateways with one `node.id`): the key judges nothing.
    pub shared_host_keys: Counter,
    /// In-flight requests ended (or, observe mode, that would have been) by an expiry, by
    /// `mode` and `why`.
    pub requests_ended: Family<L2, Counter>,
    /// Passes of the lease loop that found kvguard-control itself stalled (every lease
    /// was extended by the stall).
    pub stalls: Counter,
}

impl LeaseMetrics {
    fn register(&self, reg: &mut Registry) {
        reg.register(
            "kvguard_control_leases",
            "Gateway instances holding a liveness lease here",
            self.held.clone(),
        );
        reg.register(
            "kvguard_control_leases_enforceable",
            "Gateway instances whose data path has carried enough in-band renewals for their lease to be enforced",
            self.enforceable.clone(),
        );
        reg.register(
            "kvguard_control_lease_renewals",
            "Lease renewals received from gateways by path (admin, data) and result (accepted, duplicate, replay, period_too_long, unauthorized, bad_request)",
            self.renewals.clone(),
        );
        reg.register(
            "kvguard_control_lease_expiries",
            "Gateway leases expired by mode (enforce: its requests were ended; observe: counted only) and why (silent, dead, replaced, unproven: counted, never ended; vm_lost: one worker VM of a live gateway)",
            self.expiries.clone(),
        );
        reg.register(
            "kvguard_control_lease_held_expiries",
            "Lease expiries held because no other gateway was heard from since the silent one went silent, or its listener still answered",
            self.held_expiries.clone(),
        );
        reg.register(
            "kvguard_control_lease_requests_ended",
            "In-flight requests ended by a lease expiry (observe, and why=unproven: counted, not ended), by mode and why",
            self.requests_ended.clone(),
        );
        reg.register(
            "kvguard_control_lease_proofs",
            "Proofs of life on gateway requests by result (accepted, duplicate, replay, unauthorized, bad_request)",
            self.proofs.clone(),
        );
        reg.register(
            "kvguard_control_lease_probes",
            "Handshakes asked of silent gateways' listeners by answer (alive, refused, timeout)",
            self.probes.clone(),
        );
        reg.register(
            "kvguard_control_lease_shared_host_keys",
            "Gateway instances renewing with a host key another live gateway uses (give each gateway its own node.id)",
            self.shared_host_keys.clone(),
        );
        reg.register(
            "kvguard_control_lease_loop_stalls",
            "Lease loop passes that found kvguard-control stalled (leases extended by the stall)",
            self.stalls.clone(),
        );
        for path in ["admin", "data"] {
            for r in [
                "accepted",
                "duplicate",
                "replay",
                "period_too_long",
                "unauthorized",
                "bad_request",
            ] {
                let _ = self
                    .renewals
                    .get_or_create(&[("path", path), ("result", r)]);
            }
        }
        for r in [
            "accepted",
            "duplicate",
            "replay",
            "unauthorized",
            "bad_request",
        ] {
            let _ = self.proofs.get_or_create(&[("result", r)]);
        }
        for a in ["alive", "refused", "timeout"] {
            let _ = self.probes.get_or_create(&[("answer", a)]);
        }
        for m in ["enforce", "observe"] {
            for w in ["silent", "dead", "replaced", "unproven", "vm_lost"] {
                let _ = self.expiries.get_or_create(&[("mode", m), ("why", w)]);
                let _ = self
                    .requests_ended
                    .get_or_create(&[("mode", m), ("why", w)]);
            }
        }
    }

    /// Counts a renewal answer.
    pub fn renewal(&self, path: &'static str, result: &'static str) {
        self.renewals
            .get_or_create(&[("path", path), ("result", result)])
            .inc();
    }

    /// Counts a proof of life on a request.
    pub fn proof(&self, result: &'static str) {
        self.proofs.get_or_create(&[("result", result)]).inc();
    }

    /// Counts a probe's answer.
    pub fn probe(&self, answer: kvguard_control_core::lease::ProbeAnswer) {
        self.probes
            .get_or_create(&[("answer", answer.as_str())])
            .inc();
    }

    /// Sets the lease gauges.
    pub fn census(&self, c: kvguard_control_core::lease::Census) {
        self.held.set(c.held as i64);
        self.enforceable.set(c.enforceable as i64);
    }

    /// Counts an expiry.
    pub fn expired(&self, mode: &'static str, why: kvguard_control_core::lease::Expiry) {
        self.expiries
            .get_or_create(&[("mode", mode), ("why", why.as_str())])
            .inc();
    }

    /// Counts the requests an expiry ended (or would have).
    pub fn ended(&self, mode: &'static str, why: kvguard_control_core::lease::Expiry, n: u64) {
        self.requests_ended
            .get_or_create(&[("mode", mode), ("why", why.as_str())])
            .inc_by(n);
    }
}

// ---- Messages between replicas (`--peers`, contract §4, §8) ------------------------------

/// Forwarded aborts and renewals, sent and received.
#[derive(Debug, Clone, Default)]
pub struct PeerMetrics {
    /// Messages this replica forwarded, one per peer, by `kind` = `abort` | `renewal` and
    /// `result` = `ok` (the peer held the id / took the renewal), `not_found` (an abort
    /// for an id the peer does not hold), `failed` (no answer, a refusal, a peer down).
    pub forwards: Family<L2, Counter>,
    /// Forwarded messages received, by `kind` and `result` = `aborted`, `already_aborted`,
    /// `dry_run`, `not_found`, `accepted`, `duplicate` (a renewal counter already taken
    /// here), `unauthorized`, `replay`, `bad_request`.
    pub received: Family<L2, Counter>,
    /// Peer addresses this replica forwards to now (names resolved, itself left out).
    pub peers: Gauge,
}

impl PeerMetrics {
    fn register(&self, reg: &mut Registry) {
        reg.register(
            "kvguard_control_peer_forwards",
            "Aborts and renewals forwarded to other replicas, per peer, by kind and result (ok, not_found, failed)",
            self.forwards.clone(),
        );
        reg.register(
            "kvguard_control_peer_received",
            "Forwarded aborts and renewals received from other replicas, by kind and result",
            self.received.clone(),
        );
        reg.register(
            "kvguard_control_peers",
            "Peer replicas this replica forwards to (--peers resolved, itself left out)",
            self.peers.clone(),
        );
        for kind in ["abort", "renewal"] {
            for r in ["ok", "not_found", "failed"] {
                let _ = self
                    .forwards
                    .get_or_create(&[("kind", kind), ("result", r)]);
            }
            for r in ["unauthorized", "replay", "bad_request"] {
                let _ = self
                    .received
                    .get_or_create(&[("kind", kind), ("result", r)]);
            }
        }
    }

    /// Counts a forward.
    pub fn forward(&self, kind: &'static str, result: &'static str) {
        self.forwards
            .get_or_create(&[("kind", kind), ("result", result)])
            .inc();
    }

    /// Counts a received forwarded message.
    pub fn receive(&self, kind: &'static str, result: &'static str) {
        self.received
            .get_or_create(&[("kind", kind), ("result", result)])
            .inc();
    }
}

// ---- Prefill/decode disaggregation ([`crate::pd`]) -----------------------------------

/// Prefill hand-offs held for a remote decode, and the releases of their blocks.
#[derive(Debug, Clone, Default)]
pub struct PdMetrics {
    /// Finished prefills within `--pd-kv-lease` whose blocks the prefill engine may hold
    /// for a decode side (set when scraped).
    pub handoffs_held: Gauge,
    /// Age of the oldest of them, seconds (0 when none; set when scraped).
    pub handoff_oldest_age: FGauge,
    /// Hand-offs forgotten early because the table was full.
    pub handoffs_evicted: Counter,
    /// Requests sent to a decode engine to release a prefill's held blocks, by `via` =
    /// `handoff` (an abort of a recorded hand-off, sent to `--pd-decode-url`),
    /// `tombstoned_decode` (a decode leg arriving for an aborted id, sent to this
    /// replica's engine), and `result` = `released` (the decode engine rejected it, and so
    /// told the prefill engine), `failed` (any other answer, or none), `no_route` (no
    /// `--pd-decode-url`: the blocks are held until the prefill engine's lease).
    pub releases: Family<L2, Counter>,
}

impl PdMetrics {
    fn register(&self, reg: &mut Registry) {
        reg.register(
            "kvguard_control_pd_handoffs_held",
            "Finished prefills within --pd-kv-lease whose blocks the prefill engine may hold for a remote decode",
            self.handoffs_held.clone(),
        );
        reg.register(
            "kvguard_control_pd_handoff_oldest_age_seconds",
            "Age of the oldest prefill hand-off held for a remote decode (0 when none)",
            self.handoff_oldest_age.clone(),
        );
        reg.register(
            "kvguard_control_pd_handoffs_evicted",
            "Prefill hand-offs forgotten before --pd-kv-lease because the table was full",
            self.handoffs_evicted.clone(),
        );
        reg.register(
            "kvguard_control_pd_releases",
            "Requests sent to a decode engine to release a prefill's held blocks, by via and result",
            self.releases.clone(),
        );
        let _ = self
            .releases
            .get_or_create(&[("via", "handoff"), ("result", "no_route")]);
        for via in ["handoff", "tombstoned_decode"] {
            for r in ["released", "failed"] {
                let _ = self.releases.get_or_create(&[("via", via), ("result", r)]);
            }
        }
    }

    /// Counts a release attempt.
    pub fn release(&self, via: &'static str, result: &'static str) {
        self.releases
            .get_or_create(&[("via", via), ("result", result)])
            .inc();
    }
}
