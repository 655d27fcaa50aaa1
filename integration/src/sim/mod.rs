//! The engine simulator: **a test instrument, the one engine simulator of the workspace**.
//! It is not an inference engine; it behaves like vLLM 0.32 where kvguard can see it:
//!
//! - OpenAI `POST /v1/completions` and `/v1/chat/completions`, streaming (SSE in vLLM's
//!   exact framing, see the fixtures) or not, `n` > 1, `max_tokens`,
//!   `stream_options.include_usage`, 400 bodies shaped like vLLM's.
//! - A paged KV pool: a request needs `ceil((prompt_tokens + max_tokens) / block_size) * n`
//!   blocks (prompt tokens ≈ prompt bytes / 4, at least 1); requests wait FIFO until blocks
//!   are free and fewer than `max_running` run.
//! - Tokens at `token_rate` per second per request; optional `: keep-alive` comments.
//! - Client gone (response body dropped, stream reset) → the sequence is aborted and its
//!   blocks freed at once, like vLLM; `abort_on_disconnect: false` models engines that leak.
//! - Per-request behaviour headers: `x-sim-stall-after: <n>` (after n tokens only
//!   keep-alives, forever), `x-sim-delay-first-ms`, `x-sim-tokens` (force the length),
//!   `x-sim-rate` (tokens/s), `x-sim-keepalive-ms` (0 = none), `x-sim-reset-after: <n>`
//!   (after n tokens the engine resets the stream: h2 RST_STREAM, HTTP/1.1 connection
//!   closed mid-body), `x-sim-status: <code>` (answer that error at once, vLLM-shaped),
//!   `x-sim-first-attempts: <k>` (stall, first-token delay, reset and status apply to the
//!   first k arrivals of the request id only: a hop's retry of it is served normally).
//! - `GET /metrics` with vLLM's names (`vllm:generation_tokens_total` counts every token
//!   generated, as vLLM's does, and `process_start_time_seconds` is the simulator's start,
//!   as vLLM's Python client exports its process's), `GET /health`, `GET /sim/state`
//!   ([`SimState`]).
//! - LoRA adapters ([`SimConfig::lora_adapters`]) in `GET /v1/models` (`parent` = the base
//!   model, as vLLM lists them), loaded and unloaded at run time with vLLM's
//!   `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
//!   `POST /v1/unload_lora_adapter {"lora_name"}`.
//! - Abort APIs:
//!   SGLang-style `POST /abort_request {"rid"}` and vLLM-style
//!   `POST /inference/v1/abort_requests {"request_ids": [..]}`.
//! - Prefill/decode disaggregation as vLLM 0.32's NixlConnector does it
//!   ([`SimConfig::pd_role`], [`pd`]; docs/PD-ENGINES.md): a prefill replica holds a
//!   finished request's blocks for the decode side until the decode side notifies it (after
//!   its read, or when it gives the request up) or the lease runs out; a decode replica
//!   reads them, then streams.
//! - HTTP/1.1 and h2c on the same port.

mod engine;
mod openai;
pub mod pd;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use engine::Sim;

/// Simulator settings (the `engine-sim` flags mirror these).
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Address to bind; `None` = `127.0.0.1:0`.
    pub listen: Option<SocketAddr>,
    /// Served model name (echoed in responses and the `model_name` metric label).
    pub model: String,
    /// KV blocks in the pool.
    pub kv_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Most sequences running at once (vLLM's `max_num_seqs`).
    pub max_running: u32,
    /// Tokens per second per request.
    pub token_rate: f64,
    /// `: keep-alive` comment interval when no token went out; 0 = off.
    pub keepalive_ms: u64,
    /// Keep-alive interval of stalled streams (`x-sim-stall-after`) when `keepalive_ms`
    /// is 0 and the request sets no `x-sim-keepalive-ms`.
    pub stall_keepalive_ms: u64,
    /// Abort a sequence when its client goes away (vLLM does). `false` models a leak.
    pub abort_on_disconnect: bool,
    /// Largest prompt + completion, in tokens (vLLM's `max_model_len`).
    pub max_model_len: u32,
    /// `max_tokens` when the request has none.
    pub default_max_tokens: u32,
    /// Ended request records kept in the state (older ones are dropped).
    pub record_limit: usize,
    /// LoRA adapters loaded at start (vLLM's `--lora-modules`): `GET /v1/models` lists
    /// each as a model whose `parent` is `model`; `POST /v1/load_lora_adapter` and
    /// `/v1/unload_lora_adapter` change the list at run time.
    pub lora_adapters: Vec<String>,
    /// Its part in prefill/decode disaggregation.
    pub pd_role: PdRole,
    /// Prefill role: how long a finished request's blocks wait for the decode side's
    /// notification (vLLM's `kv_lease_duration`, 30 s); each decode-side heartbeat extends
    /// it to at least two thirds of this from then.
    pub kv_lease_ms: u64,
    /// Decode role: how long reading the blocks from the prefill side takes.
    pub kv_pull_ms: u64,
}

/// A simulator's part in prefill/decode disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PdRole {
    /// Prefill and decode in one engine (no `kv_transfer_params` handling).
    #[default]
    Both,
    /// A request with `kv_transfer_params.do_remote_decode` keeps its blocks after it
    /// finished, for the decode side, and answers the parameters to read them with.
    Prefill,
    /// A request with `kv_transfer_params.do_remote_prefill` reads its prompt's blocks
    /// from the prefill replica they name before it generates.
    Decode,
}

/// Why a prefill replica let go of blocks it held for the decode side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvRelease {
    /// The decode side read them and said so.
    Pulled,
    /// The decode side gave the request up before reading them (aborted there, or refused)
    /// and said so.
    NotPulled,
    /// Nobody said anything before the lease ran out.
    LeaseExpired,
}

impl SimConfig {
    /// The default with room for thousands of streams at once (4,096 running, 131,072
    /// blocks): for tests about the gateway, not about KV pressure.
    pub fn roomy() -> SimConfig {
        SimConfig {
            max_running: 4096,
            kv_blocks: 131_072,
            ..SimConfig::default()
        }
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            listen: None,
            model: "tiny".into(),
            kv_blocks: 1024,
            block_size: 16,
            max_running: 256,
            token_rate: 200.0,
            keepalive_ms: 0,
            stall_keepalive_ms: 1000,
            abort_on_disconnect: true,
            max_model_len: 2048,
            default_max_tokens: 16,
            record_limit: 10_000,
            lora_adapters: Vec::new(),
            pd_role: PdRole::Both,
            kv_lease_ms: 30_000,
            kv_pull_ms: 20,
        }
    }
}

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SeqState {
    /// Queued for KV blocks or a running slot.
    Waiting,
    /// Admitted: holds its blocks, generating (or stalled).
    Running,
    /// Over; see [`EndKind`].
    Ended,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndKind {
    /// Finished early (`finish_reason: stop`, from `x-sim-tokens` < `max_tokens`).
    Stop,
    /// Finished at `max_tokens` (`finish_reason: length`).
    Length,
    /// The client went away and the sequence was aborted (abort on disconnect).
    Disconnected,
    /// Ended through an abort API (`/abort_request`, `/inference/v1/abort_requests`).
    Aborted,
    /// The simulator shut down.
    Shutdown,
    /// The engine reset the stream on purpose (`x-sim-reset-after`).
    Reset,
}

/// One request as the simulator saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// The `x-request-id` received (or the one generated when there was none).
    pub request_id: String,
    /// vLLM's id: `cmpl-<request_id>` or `chatcmpl-<request_id>`; SGLang's: the body's
    /// `rid` when it has one.
    pub engine_id: String,
    /// Request path.
    pub path: String,
    /// `stream: true`.
    pub stream: bool,
    /// Choices requested.
    pub n: u32,
    /// Estimated prompt tokens.
    pub prompt_tokens: u32,
    /// `max_tokens` (or the default).
    pub max_tokens: u32,
    /// KV blocks the request needs (held while running).
    pub blocks: u32,
    /// Tokens generated and handed to the response (all choices).
    pub tokens_sent: u64,
    /// Streaming: response bytes the HTTP server took from the stream (what the socket
    /// accepted, give or take hyper's buffer). Stops growing when the client stops reading
    /// (back-pressure), while `tokens_sent` keeps going, as in vLLM.
    #[serde(default)]
    pub bytes_delivered: u64,
    /// `: keep-alive` comments sent.
    pub keepalives_sent: u64,
    /// Where it is now.
    pub state: SeqState,
    /// How it ended.
    pub ended: Option<EndKind>,
    /// Which abort API ended it (`sglang` or `vllm`).
    pub aborted_by: Option<String>,
    /// The client went away (also when the sequence was not aborted for it).
    pub client_gone: bool,
    /// Arrival, ms since the simulator started.
    pub arrived_ms: u64,
    /// Admission (blocks allocated), ms since start.
    pub started_ms: Option<u64>,
    /// First token, ms since start.
    pub first_token_ms: Option<u64>,
    /// End, ms since start.
    pub ended_ms: Option<u64>,
    /// Request headers as received (lower-case names; repeated headers joined by `, `).
    pub headers: std::collections::BTreeMap<String, String>,
    /// Prefill role, a request for a remote decode: when it finished and began holding its
    /// blocks for the decode side, ms since start.
    #[serde(default)]
    pub kv_held_ms: Option<u64>,
    /// Prefill role: why and when those blocks were let go.
    #[serde(default)]
    pub kv_released: Option<(KvRelease, u64)>,
    /// Decode role: the prefill replica's id of the request whose blocks this one reads.
    #[serde(default)]
    pub kv_remote_id: Option<String>,
    /// Decode role: when the read finished, ms since start.
    #[serde(default)]
    pub kv_pulled_ms: Option<u64>,
}

/// A call to one of the abort APIs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AbortApiCall {
    /// `sglang` (`POST /abort_request`) or `vllm` (`POST /inference/v1/abort_requests`).
    pub api: String,
    /// Ids asked for.
    pub ids: Vec<String>,
    /// Request ids (`x-request-id`) of the live sequences it ended.
    pub ended: Vec<String>,
    /// When, ms since the simulator started.
    pub at_ms: u64,
}

/// A snapshot of the simulator (`GET /sim/state`, [`SimHandle::state`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimState {
    /// Request ids (`x-request-id`) running, in admission order.
    pub running: Vec<String>,
    /// Request ids waiting, in queue order.
    pub waiting: Vec<String>,
    /// KV blocks held by running sequences.
    pub blocks_used: u32,
    /// KV blocks in the pool.
    pub blocks_total: u32,
    /// Requests that finished (stop or length).
    pub finished: u64,
    /// Requests ended through an abort API.
    pub aborted: u64,
    /// Requests aborted because their client went away.
    pub disconnected: u64,
    /// Requests whose client went away (aborted or not).
    pub clients_gone: u64,
    /// Streams the engine reset on purpose (`x-sim-reset-after`).
    #[serde(default)]
    pub resets: u64,
    /// Preemptions (always 0: the simulator reserves blocks up front).
    pub preemptions: u64,
    /// Per-request records, oldest first (bounded by `record_limit`).
    pub requests: Vec<RequestRecord>,
    /// Abort API calls, oldest first.
    pub abort_calls: Vec<AbortApiCall>,
    /// Prefill role: request ids whose blocks are held for the decode side.
    #[serde(default)]
    pub held_for_decode: Vec<String>,
    /// Prefill role: the blocks those hold (part of `blocks_used`).
    #[serde(default)]
    pub blocks_held_for_decode: u32,
}

impl SimState {
    /// The record of `request_id` (the `x-request-id`), or of an engine id.
    pub fn request(&self, id: &str) -> Option<&RequestRecord> {
        self.requests
            .iter()
            .rev()
            .find(|r| r.request_id == id || r.engine_id == id)
    }

    /// `blocks_used / blocks_total` (vLLM's `kv_cache_usage_perc`).
    pub fn kv_usage(&self) -> f64 {
        if self.blocks_total == 0 {
            0.0
        } else {
            f64::from(self.blocks_used) / f64::from(self.blocks_total)
        }
    }

    /// Whether nothing runs or waits, and no block is held for a decode side.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty() && self.held_for_decode.is_empty()
    }
}

/// A running in-process simulator. Dropping it shuts it down.
pub struct SimHandle {
    sim: Arc<Sim>,
    server: crate::http::Server,
}

impl SimHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// `http://<addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.server.addr)
    }

    /// A snapshot of the state.
    pub fn state(&self) -> SimState {
        self.sim.state()
    }

    /// The Prometheus text `GET /metrics` answers.
    pub fn metrics_text(&self) -> String {
        self.sim.metrics_text()
    }

    /// The shared engine (for tests that drive it directly).
    pub fn sim(&self) -> &Arc<Sim> {
        &self.sim
    }

    /// Polls the state until `pred` holds (every 10 ms, at most `timeout`).
    pub async fn wait_state(
        &self,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&SimState) -> bool,
    ) -> Result<SimState> {
        let sim = self.sim.clone();
        crate::wait::poll_until(what, timeout, Duration::from_millis(10), move || {
            let s = sim.state();
            pred(&s).then_some(s)
        })
        .await
        .with_context(|| format!("simulator state: {}", short_state(&self.sim.state())))
    }

    /// Stops serving and ends every live sequence (`EndKind::Shutdown`).
    pub fn shutdown(&mut self) {
        self.server.stop();
        self.sim.shutdown();
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn short_state(s: &SimState) -> String {
    format!(
        "running={:?} waiting={:?} blocks={}/{} finished={} aborted={} disconnected={} clients_gone={}",
        s.running,
        s.waiting,
        s.blocks_used,
        s.blocks_total,
        s.finished,
        s.aborted,
        s.disconnected,
        s.clients_gone
    )
}

/// A prefill and a decode simulator on the current tokio runtime, shaped like vLLM's
/// NixlConnector pair: P holds a prefill's blocks for D for `lease_ms` (or until D's
/// read), D reads them `pull_ms` after it admits the decode leg; both at `token_rate`.
pub async fn spawn_pd(
    lease_ms: u64,
    pull_ms: u64,
    token_rate: f64,
) -> Result<(SimHandle, SimHandle)> {
    let role = |pd_role| SimConfig {
        pd_role,
        kv_lease_ms: lease_ms,
        kv_pull_ms: pull_ms,
        token_rate,
        ..SimConfig::default()
    };
    Ok((
        spawn(role(PdRole::Prefill)).await?,
        spawn(role(PdRole::Decode)).await?,
    ))
}

/// Starts a simulator on the current tokio runtime.
pub async fn spawn(config: SimConfig) -> Result<SimHandle> {
    let listener = crate::http::bind(config.listen)
        .await
        .context("binding the engine simulator")?;
    let addr = listener.local_addr().context("the simulator's address")?;
    let sim = Arc::new(Sim::new(config, addr));
    if sim.cfg.pd_role == PdRole::Prefill {
        tokio::spawn(pd::reap_leases(Arc::downgrade(&sim)));
    }
    let s2 = sim.clone();
    let server = crate::http::serve(listener, move |req, _peer| {
        let sim = s2.clone();
        async move { openai::handle(sim, req).await }
    })?;
    Ok(SimHandle { sim, server })
}
