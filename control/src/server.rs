//! Listeners, background tasks and graceful shutdown.

use crate::admin;
use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::downstream::{Downstream, Scope, StreamExecutor};
use crate::engine::{Engine, HttpEngine};
use crate::gpu::{GpuProbe, GpuTracker, NvmlProbe};
use crate::keys;
use crate::proxy;
use crate::reaper;
use crate::sampler;
use crate::state::AppState;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use kvguard_contract::AbortReason;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Largest request head (request line + headers) accepted on either listener.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// Most header fields in a request.
pub const MAX_HEADERS: usize = 100;
/// Deadline for a client to send its request head on the proxy listener, counted from the
/// end of its previous response: so also how long an idle keep-alive connection is kept.
/// Above the shipped Envoy `engine` cluster's idle timeout (20 s), which so always closes
/// first (a request never meets a connection kvguard-control is closing).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Open connections on the admin listener at most (an idle keep-alive connection costs a
/// file descriptor and a few KiB, no work slot: work is limited per request,
/// [`admin::MAX_ADMIN_WORK`]).
pub const MAX_ADMIN_CONNECTIONS: usize = 1024;
/// Connections the admin listener accepts beyond [`MAX_ADMIN_CONNECTIONS`], each served
/// for one request, health probes only (`/healthz`, `/readyz`; anything else 503): a
/// probe answers whatever holds the other connections.
pub const ADMIN_PROBE_RESERVE: usize = 64;
/// Concurrent HTTP/2 streams per admin connection (each is a request, under the same
/// work limit as the others).
pub const ADMIN_H2_STREAMS: u32 = 32;
/// Header list of an admin request over HTTP/2, at most (an abort's head is < 1 KiB).
pub const ADMIN_H2_HEADER_LIST: u32 = 16 * 1024;
/// Open connections on the proxy listener at most: `2 × --max-inflight`, at least this.
pub const MIN_PROXY_CONNECTIONS: usize = 1024;
/// After the drain timeout, how long the final SSE events get to reach clients.
pub const FINAL_FLUSH: Duration = Duration::from_secs(2);

/// What the service runs on: clock, engine, GPU probe.
pub struct Deps {
    /// Time.
    pub clock: Arc<dyn Clock>,
    /// The engine's metrics, health and abort API.
    pub engine: Arc<dyn Engine>,
    /// NVML (or a fake); `None` when unavailable.
    pub gpu_probe: Option<Arc<dyn GpuProbe>>,
    /// The GPU status to start from.
    pub gpu: GpuTracker,
}

impl Deps {
    /// The real clock, the engine over HTTP and NVML (unless `--no-nvml`).
    pub fn real(cfg: &Config) -> Deps {
        let (gpu_probe, gpu) = if cfg.no_nvml {
            (
                None,
                GpuTracker::unavailable("disabled by --no-nvml".to_owned()),
            )
        } else {
            match NvmlProbe::init() {
                Ok(p) => {
                    tracing::info!("NVML loaded");
                    (
                        Some(Arc::new(p) as Arc<dyn GpuProbe>),
                        GpuTracker::default(),
                    )
                }
                Err(why) => (None, GpuTracker::unavailable(why)),
            }
        };
        Deps {
            clock: Arc::new(SystemClock),
            engine: Arc::new(HttpEngine::new(cfg)),
            gpu_probe,
            gpu,
        }
    }
}

/// A running service.
pub struct Server {
    /// Bound proxy address.
    pub proxy_addr: SocketAddr,
    /// Bound admin address.
    pub admin_addr: SocketAddr,
    /// Shared state (tests inspect it).
    pub state: Arc<AppState>,
    shutdown: CancellationToken,
    done: JoinHandle<()>,
}

impl Server {
    /// Binds both listeners and starts serving, reaping and sampling.
    pub async fn start(cfg: Config, deps: Deps) -> Result<Server, String> {
        let proxy_l = TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| format!("--listen {}: {e}", cfg.listen))?;
        let admin_l = TcpListener::bind(cfg.admin_listen)
            .await
            .map_err(|e| format!("--admin-listen {}: {e}", cfg.admin_listen))?;
        let proxy_addr = proxy_l.local_addr().map_err(|e| format!("--listen: {e}"))?;
        let admin_addr = admin_l
            .local_addr()
            .map_err(|e| format!("--admin-listen: {e}"))?;
        let addr_file = cfg.addr_file.clone();
        let st = AppState::new(cfg, deps.clock, deps.engine, deps.gpu);
        tracing::info!(
            engine = %st.cfg.engine.base,
            strategy = st.cfg.abort_strategy.as_str(),
            dry_run = st.cfg.dry_run,
            keys = st.keys().accept.len(),
            "kvguard-control listening proxy={proxy_addr} admin={admin_addr}"
        );
        if st.keys().accept.is_empty() {
            tracing::warn!("no key configured (--secret-file, KVGUARD_SECRET): every abort call will be refused with 401; the reaper still works");
        }
        if let Some(path) = addr_file {
            let json = serde_json::json!({ "proxy": proxy_addr.to_string(), "admin": admin_addr.to_string() });
            // Written whole then renamed, so a reader never sees half a file.
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, json.to_string())
                .and_then(|()| std::fs::rename(&tmp, &path))
                .map_err(|e| format!("--addr-file {}: {e}", path.display()))?;
        }

        let background = CancellationToken::new();
        reaper::spawn(st.clone(), background.clone());
        crate::lease::enforce::spawn(st.clone(), background.clone());
        keys::spawn_watcher(st.clone(), background.clone());
        sampler::spawn(st.clone(), background.clone());
        if let Some(probe) = deps.gpu_probe {
            sampler::spawn_gpu(st.clone(), probe, background.clone());
        }

        let proxy_stop = CancellationToken::new();
        let admin_stop = CancellationToken::new();
        let max_conns = st
            .cfg
            .max_inflight
            .saturating_mul(2)
            .max(MIN_PROXY_CONNECTIONS);
        let proxy_task = tokio::spawn(accept_loop(
            proxy_l,
            Listener {
                app: proxy::app(st.clone()),
                max_conns,
                builder: builder(HEADER_READ_TIMEOUT, 1024, MAX_HEADER_BYTES as u32),
                overflow: None,
            },
            proxy_stop.clone(),
        ));
        let admin_task = tokio::spawn(accept_loop(
            admin_l,
            Listener {
                app: admin::app(st.clone()),
                max_conns: MAX_ADMIN_CONNECTIONS,
                builder: builder(
                    admin::HEAD_READ_TIMEOUT,
                    ADMIN_H2_STREAMS,
                    ADMIN_H2_HEADER_LIST,
                ),
                overflow: Some((admin::probe_app(st.clone()), ADMIN_PROBE_RESERVE)),
            },
            admin_stop.clone(),
        ));
        let shutdown = CancellationToken::new();
        let sd = shutdown.clone();
        let st2 = st.clone();
        let done = tokio::spawn(async move {
            sd.cancelled().await;
            let drain = st2.cfg.drain_timeout;
            tracing::info!(inflight = st2.inflight(), drain_timeout = ?drain, "shutting down: no new connections, draining");
            st2.start_draining();
            proxy_stop.cancel();
            if let Ok(graceful) = proxy_task.await {
                let shut = graceful.shutdown();
                tokio::pin!(shut);
                if tokio::time::timeout(drain, &mut shut).await.is_err() {
                    let rest = st2.entries();
                    tracing::warn!(
                        remaining = rest.len(),
                        "drain timeout reached: ending the remaining requests"
                    );
                    for e in rest {
                        st2.end_request(&e, AbortReason::Operator, "shutdown");
                    }
                    if tokio::time::timeout(FINAL_FLUSH, &mut shut).await.is_err() {
                        tracing::warn!("some proxy connections did not close; exiting anyway");
                    }
                }
            }
            admin_stop.cancel();
            if let Ok(graceful) = admin_task.await {
                let _ = tokio::time::timeout(Duration::from_secs(1), graceful.shutdown()).await;
            }
            background.cancel();
            tracing::info!("kvguard-control stopped");
        });
        Ok(Server {
            proxy_addr,
            admin_addr,
            state: st,
            shutdown,
            done,
        })
    }

    /// Begins the graceful shutdown.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Waits until the shutdown has finished.
    pub async fn wait(self) {
        let _ = self.done.await;
    }

    /// Shuts down and waits.
    pub async fn stop(self) {
        self.shutdown();
        self.wait().await;
    }
}

fn builder(
    header_read_timeout: Duration,
    h2_streams: u32,
    h2_header_list: u32,
) -> auto::Builder<StreamExecutor> {
    let mut b = auto::Builder::new(StreamExecutor);
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .max_buf_size(MAX_HEADER_BYTES)
        .max_headers(MAX_HEADERS);
    b.http2()
        .timer(TokioTimer::new())
        .max_header_list_size(h2_header_list)
        .max_concurrent_streams(h2_streams)
        .keep_alive_interval(Duration::from_secs(30));
    b
}

/// How one listener serves: its router, its connection bound, its protocol settings and,
/// for the admin listener, the probe-only router of the connections beyond the bound.
struct Listener {
    app: Router,
    max_conns: usize,
    builder: auto::Builder<StreamExecutor>,
    overflow: Option<(Router, usize)>,
}

/// Accepts connections (HTTP/1.1 and h2c) until `stop`; returns the graceful-shutdown
/// handle of the connections it started. Each connection task (and, through
/// [`StreamExecutor`], each h2 stream) runs in a [`Downstream`] scope, so that a request
/// whose client does not take its end can be cut.
///
/// At most `max_conns` connections are open at once; beyond, `overflow` (if any) serves up
/// to its count more, one HTTP/1.1 request each with its own router (the admin listener's
/// health probes). When every slot is taken, accepting pauses (the kernel backlog holds
/// the rest) instead of running out of file descriptors.
async fn accept_loop(
    listener: TcpListener,
    l: Listener,
    stop: CancellationToken,
) -> GracefulShutdown {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(l.max_conns));
    let reserve = l.overflow.as_ref().map_or(0, |(_, n)| *n);
    let spare = Arc::new(tokio::sync::Semaphore::new(reserve));
    let one_shot = one_request_builder();
    loop {
        // A regular slot first; the reserve only when none is free.
        let (permit, overflow) = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => (p, None),
                Err(_) => break,
            },
            p = spare.clone().acquire_owned(), if reserve > 0 => match (p, &l.overflow) {
                (Ok(p), Some((app, _))) => (p, Some(app)),
                _ => break,
            },
        };
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((s, _peer)) => s,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (b, app) = match overflow {
            Some(app) => (&one_shot, app),
            None => (&l.builder, &l.app),
        };
        let svc = TowerToHyperService::new(app.clone());
        let conn = b
            .serve_connection_with_upgrades(TokioIo::new(stream), svc)
            .into_owned();
        let fut = graceful.watch(conn);
        tokio::spawn(Downstream::new(Scope::Connection).run(async move {
            if let Err(e) = fut.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        }));
    }
    drop(listener);
    graceful
}

/// The builder of a connection beyond the bound: HTTP/1.1, one request, then closed.
fn one_request_builder() -> auto::Builder<StreamExecutor> {
    let mut b = auto::Builder::new(StreamExecutor);
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(admin::HEAD_READ_TIMEOUT)
        .max_buf_size(MAX_HEADER_BYTES)
        .max_headers(MAX_HEADERS)
        .keep_alive(false);
    b.http1_only()
}
