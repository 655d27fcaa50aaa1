//! Bounded polling. Every wait in the harness goes through here or has its own timeout.

use anyhow::{bail, Result};
use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `f` every `interval` until it returns `Some`, for at most `timeout`.
/// The error names `what` was awaited.
pub async fn poll_until<T>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> Result<T> {
    poll_until_async(what, timeout, interval, || {
        let v = f();
        async move { v }
    })
    .await
}

/// Like [`poll_until`] with an async probe (e.g. an HTTP request). Each probe is itself
/// bounded by what is left of `timeout`.
pub async fn poll_until_async<T, F, Fut>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut f: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Ok(Some(v)) = tokio::time::timeout(left, f()).await {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(interval).await;
    }
}

/// Blocking flavour of [`poll_until`] (for non-async tests and `Drop`).
pub fn poll_until_blocking<T>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(interval);
    }
}

/// Runs `fut` with a deadline; the error names `what`. Wrap every test body in it.
pub async fn bounded<T>(what: &str, timeout: Duration, fut: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| anyhow::anyhow!("{what}: did not finish within {timeout:?}"))
}
