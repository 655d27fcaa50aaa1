//! Key rotation without a restart: `--secret-file` and `--stamp-key-file` are read again
//! when their content changes (polled every [`KEY_POLL`]: Kubernetes updates a Secret
//! volume by swapping a symlink and sends no signal) or on SIGHUP. A file that does not
//! parse leaves the keys in use as they are (logged, counted). SIGHUP's handler is
//! installed first thing in `main` and never removed: a SIGHUP never ends the process,
//! with or without key files.

use crate::config::{accepted_keys, read_stamp_key, Config, ConfigError};
use crate::state::{AppState, KeySet};
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio_util::sync::CancellationToken;

/// How often the key files are read for changes.
pub const KEY_POLL: Duration = Duration::from_secs(1);

/// The keys the files (and `KVGUARD_SECRET`) hold now.
pub fn load(cfg: &Config) -> Result<KeySet, ConfigError> {
    let accept = accepted_keys(cfg.secret_file.as_deref(), cfg.env_key.as_ref())?;
    let stamp = match &cfg.stamp_key_file {
        Some(p) => Some(read_stamp_key(p)?),
        None => cfg.stamp_key.clone(),
    };
    Ok(KeySet { accept, stamp })
}

/// The raw bytes of the key files (`None` where unreadable), to notice a change.
fn contents(cfg: &Config) -> [Option<Vec<u8>>; 2] {
    [&cfg.secret_file, &cfg.stamp_key_file].map(|p| p.as_ref().and_then(|p| std::fs::read(p).ok()))
}

async fn hangup(s: &mut Option<Signal>) {
    match s {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// Reloads the keys now; `true` if they changed.
pub fn reload(st: &AppState) -> bool {
    match load(&st.cfg) {
        Ok(keys) => {
            st.metrics
                .key_reloads
                .get_or_create(&[("result", "ok")])
                .inc();
            if let Some(s) = &keys.stamp {
                if !keys.accept.contains(s) {
                    tracing::warn!("the stamp key (--stamp-key-file) is not among the accepted keys: add it to --secret-file too");
                }
            }
            if *st.keys() == keys {
                return false;
            }
            tracing::info!(keys = keys.accept.len(), "keys reloaded");
            st.set_keys(keys);
            true
        }
        Err(e) => {
            st.metrics
                .key_reloads
                .get_or_create(&[("result", "error")])
                .inc();
            tracing::error!(error = %e, "key files changed but do not load; the keys in use stay");
            false
        }
    }
}

/// Installs SIGHUP's handler for the rest of the process's life: tokio never uninstalls a
/// handler it installed, so from this call on a SIGHUP never ends the process (its default
/// action). `main` calls it as its first instruction, before the runtime and the
/// configuration exist; [`spawn_watcher`] then answers each SIGHUP.
pub fn install_hangup_handler() -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    rt.block_on(async { signal(SignalKind::hangup()).map(drop) })
}

/// What one SIGHUP does: reloads the key files if there are any, and logs it.
pub fn on_hangup(st: &AppState) {
    if st.cfg.secret_file.is_none() && st.cfg.stamp_key_file.is_none() {
        tracing::info!("SIGHUP: nothing to reload (no --secret-file or --stamp-key-file; KVGUARD_SECRET is read at start only)");
        return;
    }
    let changed = reload(st);
    tracing::info!(changed, "SIGHUP: key files read again");
}

/// Answers SIGHUP ([`on_hangup`]) and watches the key files, if any, until `stop`. The
/// SIGHUP stream is taken here, before the task starts, so a SIGHUP after `start` is
/// never missed.
pub fn spawn_watcher(st: Arc<AppState>, stop: CancellationToken) {
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP");
            None
        }
    };
    let files = st.cfg.secret_file.is_some() || st.cfg.stamp_key_file.is_some();
    tokio::spawn(async move {
        let mut last = contents(&st.cfg);
        let mut iv = tokio::time::interval(KEY_POLL);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = iv.tick(), if files => {
                    let now = contents(&st.cfg);
                    if now != last {
                        last = now;
                        reload(&st);
                    }
                }
                _ = hangup(&mut hup) => {
                    last = contents(&st.cfg);
                    on_hangup(&st);
                }
            }
        }
    });
}
