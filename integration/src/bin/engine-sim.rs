//! `engine-sim`: the kvguard engine simulator as a process (a test instrument, not an
//! engine). See `kvguard_integration::sim` for the behaviour.

use clap::Parser;
use kvguard_integration::sim::{self, PdRole, SimConfig};
use std::net::SocketAddr;
use std::path::PathBuf;

/// A vLLM-like engine simulator for kvguard's tests (OpenAI streaming API, paged KV pool
/// with admission control, vLLM metric names, abort APIs).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Write the bound address to this file once listening.
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// Served model name.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// KV blocks in the pool.
    #[arg(long, default_value_t = 1024)]
    kv_blocks: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 256)]
    max_running: u32,
    /// Tokens per second per request.
    #[arg(long, default_value_t = 200.0)]
    token_rate: f64,
    /// SSE `: keep-alive` interval when no token went out (0 = off).
    #[arg(long, default_value_t = 0)]
    keepalive_ms: u64,
    /// Keep-alive interval of stalled streams when --keepalive-ms is 0.
    #[arg(long, default_value_t = 1000)]
    stall_keepalive_ms: u64,
    /// Do not abort a sequence when its client goes away (models a leaking engine).
    #[arg(long)]
    no_abort_on_disconnect: bool,
    /// Largest prompt + completion in tokens.
    #[arg(long, default_value_t = 2048)]
    max_model_len: u32,
    /// max_tokens when a request has none.
    #[arg(long, default_value_t = 16)]
    default_max_tokens: u32,
    /// Ended request records kept for /sim/state.
    #[arg(long, default_value_t = 10_000)]
    record_limit: usize,
    /// A LoRA adapter loaded at start and listed in /v1/models (repeat for more; vLLM's
    /// --lora-modules).
    #[arg(long = "lora-adapter")]
    lora_adapters: Vec<String>,
    /// Its part in prefill/decode disaggregation (vLLM NixlConnector-like; see the
    /// simulator's `pd` module).
    #[arg(long, value_enum, default_value_t = PdRole::Both)]
    pd_role: PdRole,
    /// Prefill role: how long finished requests' blocks wait for the decode side, ms.
    #[arg(long, default_value_t = 30_000)]
    kv_lease_ms: u64,
    /// Decode role: how long reading the blocks from the prefill side takes, ms.
    #[arg(long, default_value_t = 20)]
    kv_pull_ms: u64,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let cfg = SimConfig {
        listen: Some(a.listen),
        model: a.model,
        kv_blocks: a.kv_blocks,
        block_size: a.block_size,
        max_running: a.max_running,
        token_rate: a.token_rate,
        keepalive_ms: a.keepalive_ms,
        stall_keepalive_ms: a.stall_keepalive_ms,
        abort_on_disconnect: !a.no_abort_on_disconnect,
        max_model_len: a.max_model_len,
        default_max_tokens: a.default_max_tokens,
        record_limit: a.record_limit,
        lora_adapters: a.lora_adapters,
        pd_role: a.pd_role,
        kv_lease_ms: a.kv_lease_ms,
        kv_pull_ms: a.kv_pull_ms,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let handle = sim::spawn(cfg).await?;
        kvguard_integration::cli::announce(handle.addr(), a.addr_file.as_deref())?;
        kvguard_integration::cli::wait_for_signal().await;
        drop(handle);
        Ok(())
    })
}
