//! `lossy-hop`: a reverse proxy that does not pass client disconnects on (it keeps reading
//! the upstream to the end). A test instrument that reproduces the KV leak.

use clap::Parser;
use kvguard_integration::lossy::{self, LossyConfig};
use std::net::SocketAddr;
use std::path::PathBuf;

/// An HTTP reverse proxy that keeps draining the upstream after the client went away.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Upstream address (ip:port).
    #[arg(long)]
    upstream: SocketAddr,
    /// Speak h2c (prior knowledge) to the upstream.
    #[arg(long)]
    upstream_http2: bool,
    /// Write the bound address to this file once listening.
    #[arg(long)]
    addr_file: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let h = lossy::spawn(LossyConfig {
            listen: Some(a.listen),
            upstream: a.upstream,
            upstream_http2: a.upstream_http2,
        })
        .await?;
        kvguard_integration::cli::announce(h.addr(), a.addr_file.as_deref())?;
        kvguard_integration::cli::wait_for_signal().await;
        eprintln!("lossy-hop stats: {}", serde_json::to_string(&h.stats())?);
        Ok(())
    })
}
