//! The simulator's engine: KV pool, FIFO admission, records, counters.

use super::{AbortApiCall, EndKind, KvRelease, RequestRecord, SeqState, SimConfig, SimState};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::{oneshot, watch};

/// Control handles of a live (waiting or running) sequence.
struct Live {
    admit: Option<oneshot::Sender<()>>,
    stop: watch::Sender<Option<EndKind>>,
}

struct Inner {
    blocks_used: u32,
    running: Vec<u64>,
    waiting: VecDeque<u64>,
    live: HashMap<u64, Live>,
    records: BTreeMap<u64, RequestRecord>,
    delivered: HashMap<u64, Arc<AtomicU64>>,
    ended_order: VecDeque<u64>,
    next_seq: u64,
    finished: u64,
    aborted: u64,
    disconnected: u64,
    clients_gone: u64,
    resets: u64,
    success: BTreeMap<&'static str, u64>,
    abort_calls: Vec<AbortApiCall>,
    shut_down: bool,
    /// Arrivals per request id of requests that carry `x-sim-first-attempts`.
    attempts: HashMap<String, u32>,
    /// Tokens generated, every request and choice (`vllm:generation_tokens_total`).
    generation_tokens: u64,
    /// LoRA adapters loaded now, in load order.
    lora: Vec<String>,
    /// Prefill role: sequences that keep their blocks for the decode side once finished.
    hold_on_finish: HashSet<u64>,
    /// Prefill role: finished sequences holding their blocks for the decode side, by
    /// engine id: (seq, blocks, lease deadline ms).
    held: HashMap<String, (u64, u32, u64)>,
}

/// The shared simulator engine (behind [`super::SimHandle`]).
pub struct Sim {
    pub(crate) cfg: SimConfig,
    /// Where it serves (a prefill replica names it in `kv_transfer_params`).
    pub(crate) addr: SocketAddr,
    started: Instant,
    /// Unix time of the start (`process_start_time_seconds`).
    started_unix: f64,
    inner: Mutex<Inner>,
}

/// What a new sequence gets back from [`Sim::enqueue`].
pub(crate) struct Ticket {
    pub(crate) seq: u64,
    pub(crate) admitted: oneshot::Receiver<()>,
    pub(crate) stop: watch::Receiver<Option<EndKind>>,
}

impl Sim {
    pub(crate) fn new(cfg: SimConfig, addr: SocketAddr) -> Self {
        let started_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let lora = cfg.lora_adapters.clone();
        Sim {
            cfg,
            addr,
            started: Instant::now(),
            started_unix,
            inner: Mutex::new(Inner {
                blocks_used: 0,
                running: Vec::new(),
                waiting: VecDeque::new(),
                live: HashMap::new(),
                records: BTreeMap::new(),
                delivered: HashMap::new(),
                ended_order: VecDeque::new(),
                next_seq: 0,
                finished: 0,
                aborted: 0,
                disconnected: 0,
                clients_gone: 0,
                resets: 0,
                success: BTreeMap::new(),
                abort_calls: Vec::new(),
                shut_down: false,
                attempts: HashMap::new(),
                generation_tokens: 0,
                lora,
                hold_on_finish: HashSet::new(),
                held: HashMap::new(),
            }),
        }
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    pub(crate) fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Counts one more arrival of `request_id` and returns its ordinal (1 = first). Only
    /// requests with `x-sim-first-attempts` are counted (a retrying hop resends the id).
    pub(crate) fn attempt(&self, request_id: &str) -> u32 {
        let mut g = self.lock();
        let n = g.attempts.entry(request_id.to_string()).or_insert(0);
        *n += 1;
        *n
    }

    /// Queues a sequence (FIFO) and admits what fits.
    pub(crate) fn enqueue(&self, mut rec: RequestRecord) -> Ticket {
        let (admit_tx, admitted) = oneshot::channel();
        let (stop_tx, stop) = watch::channel(None);
        let mut g = self.lock();
        let seq = g.next_seq;
        g.next_seq += 1;
        rec.arrived_ms = self.now_ms();
        rec.state = SeqState::Waiting;
        if g.shut_down {
            let _ = stop_tx.send(Some(EndKind::Shutdown));
        }
        g.records.insert(seq, rec);
        g.live.insert(
            seq,
            Live {
                admit: Some(admit_tx),
                stop: stop_tx,
            },
        );
        g.waiting.push_back(seq);
        self.schedule(&mut g);
        Ticket {
            seq,
            admitted,
            stop,
        }
    }

    /// Admits waiting sequences from the head while blocks and slots allow (FCFS: the
    /// head blocks the queue, like vLLM's default scheduler).
    fn schedule(&self, g: &mut Inner) {
        while let Some(&seq) = g.waiting.front() {
            let need = g.records.get(&seq).map(|r| r.blocks).unwrap_or(0);
            let slots = g.running.len() < self.cfg.max_running as usize;
            if !slots || g.blocks_used + need > self.cfg.kv_blocks {
                break;
            }
            g.waiting.pop_front();
            let sent = g
                .live
                .get_mut(&seq)
                .and_then(|l| l.admit.take())
                .map(|tx| tx.send(()).is_ok())
                .unwrap_or(false);
            if !sent {
                continue;
            }
            g.blocks_used += need;
            g.running.push(seq);
            let now = self.now_ms();
            if let Some(r) = g.records.get_mut(&seq) {
                r.state = SeqState::Running;
                r.started_ms = Some(now);
            }
        }
    }

    /// The counter of bytes delivered for `seq` (see `RequestRecord::bytes_delivered`).
    pub(crate) fn delivered_counter(&self, seq: u64) -> Arc<AtomicU64> {
        self.lock().delivered.entry(seq).or_default().clone()
    }

    /// One generation step of `seq`: `n` tokens (one per choice) at `now_ms`.
    pub(crate) fn token_step(&self, seq: u64, n: u32, now_ms: u64) {
        let mut g = self.lock();
        g.generation_tokens += u64::from(n);
        if let Some(r) = g.records.get_mut(&seq) {
            r.tokens_sent += u64::from(n);
            r.first_token_ms.get_or_insert(now_ms);
        }
    }

    /// The LoRA adapters loaded now, in load order.
    pub fn lora_adapters(&self) -> Vec<String> {
        self.lock().lora.clone()
    }

    /// Loads adapter `name` (vLLM's `POST /v1/load_lora_adapter`); `false` when it is
    /// loaded already.
    pub fn load_lora(&self, name: &str) -> bool {
        let mut g = self.lock();
        if g.lora.iter().any(|a| a == name) {
            return false;
        }
        g.lora.push(name.to_string());
        true
    }

    /// Unloads adapter `name` (vLLM's `POST /v1/unload_lora_adapter`); `false` when it
    /// is not loaded.
    pub fn unload_lora(&self, name: &str) -> bool {
        let mut g = self.lock();
        let before = g.lora.len();
        g.lora.retain(|a| a != name);
        g.lora.len() != before
    }

    /// Updates a live sequence's record.
    pub(crate) fn update(&self, seq: u64, f: impl FnOnce(&mut RequestRecord)) {
        let mut g = self.lock();
        if let Some(r) = g.records.get_mut(&seq) {
            f(r);
        }
    }

    /// Notes that the client of `seq` went away (counted once).
    pub(crate) fn client_gone(&self, seq: u64) {
        let mut g = self.lock();
        let first = match g.records.get_mut(&seq) {
            Some(r) if !r.client_gone => {
                r.client_gone = true;
                true
            }
            _ => false,
        };
        if first {
            g.clients_gone += 1;
        }
    }

    /// Ends `seq` (idempotent): frees its blocks, records how, admits waiting ones.
    pub(crate) fn finish(&self, seq: u64, how: EndKind) {
        let mut g = self.lock();
        self.finish_locked(&mut g, seq, how, None);
    }

    fn finish_locked(&self, g: &mut Inner, seq: u64, how: EndKind, by: Option<&str>) -> bool {
        let Some(live) = g.live.remove(&seq) else {
            return false;
        };
        let _ = live.stop.send(Some(how));
        let blocks = g.records.get(&seq).map(|r| r.blocks).unwrap_or(0);
        let now = self.now_ms();
        // A prefill for a remote decode that ran to its length keeps its blocks for the
        // decode side; ended any other way it frees them, as vLLM's connector does.
        let hold = g.hold_on_finish.remove(&seq) && how == EndKind::Length;
        if let Some(pos) = g.running.iter().position(|s| *s == seq) {
            g.running.remove(pos);
            if hold {
                let until = now.saturating_add(self.cfg.kv_lease_ms);
                if let Some(r) = g.records.get_mut(&seq) {
                    r.kv_held_ms = Some(now);
                    let id = r.engine_id.clone();
                    g.held.insert(id, (seq, blocks, until));
                }
            } else {
                g.blocks_used = g.blocks_used.saturating_sub(blocks);
            }
        } else if let Some(pos) = g.waiting.iter().position(|s| *s == seq) {
            g.waiting.remove(pos);
        }
        if let Some(r) = g.records.get_mut(&seq) {
            r.state = SeqState::Ended;
            r.ended = Some(how);
            r.ended_ms = Some(now);
            r.aborted_by = by.map(str::to_string);
        }
        let label = match how {
            EndKind::Stop => {
                g.finished += 1;
                "stop"
            }
            EndKind::Length => {
                g.finished += 1;
                "length"
            }
            EndKind::Disconnected => {
                g.disconnected += 1;
                "abort"
            }
            EndKind::Aborted => {
                g.aborted += 1;
                "abort"
            }
            EndKind::Shutdown => "abort",
            EndKind::Reset => {
                g.resets += 1;
                "error"
            }
        };
        *g.success.entry(label).or_insert(0) += 1;
        g.ended_order.push_back(seq);
        while g.records.len() > self.cfg.record_limit.max(1) {
            match g.ended_order.pop_front() {
                Some(old) => {
                    g.records.remove(&old);
                    g.delivered.remove(&old);
                }
                None => break,
            }
        }
        self.schedule(g);
        true
    }

    /// Ends the live sequences whose request id or engine id is in `ids`; records the call.
    /// Returns the request ids ended.
    pub fn abort_ids(&self, api: &str, ids: &[String]) -> Vec<String> {
        let mut g = self.lock();
        let matches: Vec<u64> = g
            .live
            .keys()
            .copied()
            .filter(|seq| {
                g.records.get(seq).is_some_and(|r| {
                    ids.iter()
                        .any(|id| *id == r.request_id || *id == r.engine_id)
                })
            })
            .collect();
        let mut ended = Vec::new();
        for seq in matches {
            let rid = g.records.get(&seq).map(|r| r.request_id.clone());
            if self.finish_locked(&mut g, seq, EndKind::Aborted, Some(api)) {
                ended.extend(rid);
            }
        }
        let at_ms = self.now_ms();
        g.abort_calls.push(AbortApiCall {
            api: api.to_string(),
            ids: ids.to_vec(),
            ended: ended.clone(),
            at_ms,
        });
        ended
    }

    /// Prefill role: `seq` keeps its blocks for the decode side when it finishes.
    pub(crate) fn hold_on_finish(&self, seq: u64) {
        self.lock().hold_on_finish.insert(seq);
    }

    /// Prefill role: lets go of the blocks held for the decode side under `engine_id`;
    /// `false` when none are held under it (released already, or never held).
    pub fn release_held(&self, engine_id: &str, why: KvRelease) -> bool {
        let mut g = self.lock();
        self.release_locked(&mut g, engine_id, why)
    }

    fn release_locked(&self, g: &mut Inner, engine_id: &str, why: KvRelease) -> bool {
        let Some((seq, blocks, _)) = g.held.remove(engine_id) else {
            return false;
        };
        g.blocks_used = g.blocks_used.saturating_sub(blocks);
        let now = self.now_ms();
        if let Some(r) = g.records.get_mut(&seq) {
            r.kv_released = Some((why, now));
        }
        self.schedule(g);
        true
    }

    /// Prefill role: a decode-side heartbeat for `engine_ids` extends each one's lease to
    /// at least two thirds of the lease from now (vLLM's `_handle_heartbeat`).
    pub fn heartbeat(&self, engine_ids: &[String]) {
        let mut g = self.lock();
        let until = self
            .now_ms()
            .saturating_add(self.cfg.kv_lease_ms.saturating_mul(2) / 3);
        for id in engine_ids {
            if let Some(h) = g.held.get_mut(id) {
                h.2 = h.2.max(until);
            }
        }
    }

    /// Prefill role: lets go of every hold whose lease ran out by now.
    pub(crate) fn expire_leases(&self) {
        let mut g = self.lock();
        let now = self.now_ms();
        let due: Vec<String> = g
            .held
            .iter()
            .filter(|(_, h)| h.2 <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            self.release_locked(&mut g, &id, KvRelease::LeaseExpired);
        }
    }

    /// Ends every live sequence and refuses new ones.
    pub fn shutdown(&self) {
        let mut g = self.lock();
        g.shut_down = true;
        let live: Vec<u64> = g.live.keys().copied().collect();
        for seq in live {
            self.finish_locked(&mut g, seq, EndKind::Shutdown, None);
        }
    }

    /// A snapshot.
    pub fn state(&self) -> SimState {
        let g = self.lock();
        let ids = |seqs: &mut dyn Iterator<Item = &u64>| -> Vec<String> {
            seqs.filter_map(|s| g.records.get(s).map(|r| r.request_id.clone()))
                .collect()
        };
        SimState {
            running: ids(&mut g.running.iter()),
            waiting: ids(&mut g.waiting.iter()),
            blocks_used: g.blocks_used,
            blocks_total: self.cfg.kv_blocks,
            finished: g.finished,
            aborted: g.aborted,
            disconnected: g.disconnected,
            clients_gone: g.clients_gone,
            resets: g.resets,
            preemptions: 0,
            requests: g
                .records
                .iter()
                .map(|(seq, r)| {
                    let mut r = r.clone();
                    if let Some(d) = g.delivered.get(seq) {
                        r.bytes_delivered = d.load(Ordering::Relaxed);
                    }
                    r
                })
                .collect(),
            abort_calls: g.abort_calls.clone(),
            held_for_decode: ids(&mut g.held.values().map(|h| &h.0)),
            blocks_held_for_decode: g.held.values().map(|h| h.1).sum(),
        }
    }

    /// Prometheus exposition text with vLLM 0.32's metric names and labels.
    pub fn metrics_text(&self) -> String {
        let g = self.lock();
        let m = &self.cfg.model;
        let usage = if self.cfg.kv_blocks == 0 {
            0.0
        } else {
            f64::from(g.blocks_used) / f64::from(self.cfg.kv_blocks)
        };
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name}{{engine=\"0\",model_name=\"{m}\"}} {v:?}");
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            g.running.len() as f64,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            g.waiting.len() as f64,
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            usage,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine."
        );
        let _ = writeln!(out, "# TYPE vllm:num_preemptions_total counter");
        let _ = writeln!(
            out,
            "vllm:num_preemptions_total{{engine=\"0\",model_name=\"{m}\"}} 0.0"
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests."
        );
        let _ = writeln!(out, "# TYPE vllm:request_success_total counter");
        for reason in ["stop", "length", "abort", "error", "repetition"] {
            let v = g.success.get(reason).copied().unwrap_or(0) as f64;
            let _ = writeln!(
                out,
                "vllm:request_success_total{{engine=\"0\",finished_reason=\"{reason}\",model_name=\"{m}\"}} {v:?}"
            );
        }
        // Names, types and help as in vllm-0.32-metrics.txt.
        let _ = writeln!(
            out,
            "# HELP vllm:generation_tokens_total Number of generation tokens processed."
        );
        let _ = writeln!(out, "# TYPE vllm:generation_tokens_total counter");
        let _ = writeln!(
            out,
            "vllm:generation_tokens_total{{engine=\"0\",model_name=\"{m}\"}} {:?}",
            g.generation_tokens as f64
        );
        let _ = writeln!(
            out,
            "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds."
        );
        let _ = writeln!(out, "# TYPE process_start_time_seconds gauge");
        let _ = writeln!(out, "process_start_time_seconds {:?}", self.started_unix);
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig"
        );
        let _ = writeln!(out, "# TYPE vllm:cache_config_info gauge");
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{}\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0",
            self.cfg.block_size, self.cfg.kv_blocks
        );
        out
    }
}
