//! Small helpers shared by the instrument binaries.

use anyhow::{Context, Result};
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;

/// Prints `listening on <addr>` (flushed) and, if asked, writes the address to `file`
/// atomically (written to a temp name, then renamed), so a harness never reads half of it.
pub fn announce(addr: SocketAddr, file: Option<&Path>) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening on {addr}")?;
    out.flush()?;
    if let Some(file) = file {
        let tmp = file.with_extension("tmp");
        std::fs::write(&tmp, addr.to_string())
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, file).with_context(|| format!("renaming to {}", file.display()))?;
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut i), Ok(mut t)) => {
            tokio::select! {
                _ = i.recv() => {}
                _ = t.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
