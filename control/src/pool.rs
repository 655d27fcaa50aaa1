//! Pre-connected engine connections (`--engine-prewarm`).
//!
//! Every proxied request still gets its own engine connection and only that request ever
//! travels on it (ending a request closes exactly its TCP connection, and vLLM, TGI and
//! llama.cpp abort the sequence on disconnect). What the pool changes is *when* the
//! connection is opened: a background task keeps up to `--engine-prewarm` connections
//! connected and HTTP/1.1-handshaken ahead of time, so a request takes one instead of
//! waiting for `connect`. A taken connection is never returned: it carries its one
//! request and is closed, and the task opens a replacement.
//!
//! An idle pooled connection carries no sequence, so closing it (shutdown, age) aborts
//! nothing. It is discarded when the engine closed it or when it is older than
//! `--engine-prewarm-max-idle` (kept below the idle timeouts servers apply to a
//! connection that has not sent a request yet). If the engine closed a pooled connection
//! just before the request was written, hyper hands the request back untouched and it is
//! sent once more on a freshly dialled connection; once any byte of it was written, the
//! error is reported as without the pool. When the engine is down, the refill backs off
//! (50 ms doubling to 2 s, one log line per outage) and requests dial on their own, so
//! they get the usual `kvguard_engine_unreachable` answer.

use crate::metrics::Metrics;
use axum::body::Body;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Deadline for connecting to the engine.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// First refill back-off after a failure (doubles per consecutive failure).
pub const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest refill back-off.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Opens a byte stream to the engine (a trait so the pool can be tested in memory).
pub trait Dial: Send + Sync + 'static {
    /// The stream.
    type Io: AsyncRead + AsyncWrite + Send + Unpin + 'static;
    /// Connects, or says why not (the message is shown to the client in the 502).
    fn dial(&self) -> impl Future<Output = Result<Self::Io, String>> + Send;
}

/// TCP to the engine's `host:port`, TCP_NODELAY on, [`CONNECT_TIMEOUT`].
#[derive(Debug, Clone)]
pub struct TcpDial {
    authority: String,
}

impl TcpDial {
    /// Dials `authority` (`host:port`).
    pub fn new(authority: String) -> TcpDial {
        TcpDial { authority }
    }
}

impl Dial for TcpDial {
    type Io = TcpStream;

    async fn dial(&self) -> Result<TcpStream, String> {
        let tcp = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&self.authority))
            .await
        {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => return Err(format!("no connection within {CONNECT_TIMEOUT:?}")),
        };
        let _ = tcp.set_nodelay(true);
        Ok(tcp)
    }
}

/// One engine connection, handshaken (HTTP/1.1), whose connection task is running.
/// It carries at most one request. Dropping it before a request is sent closes it.
#[derive(Debug)]
pub struct EngineConn {
    sender: SendRequest<Body>,
    task: AbortHandle,
    born: Instant,
    pooled: Arc<AtomicBool>,
}

impl EngineConn {
    /// Handshakes over `io` and spawns the connection task; `wake` is notified if the
    /// connection ends while it sits in the pool.
    async fn handshake<I>(io: I, wake: Arc<Notify>) -> Result<EngineConn, String>
    where
        I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .handshake::<_, Body>(TokioIo::new(io))
            .await
            .map_err(|e| e.to_string())?;
        let pooled = Arc::new(AtomicBool::new(false));
        let flag = pooled.clone();
        let task = tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "engine connection ended with an error");
            }
            if flag.load(Ordering::Acquire) {
                wake.notify_one();
            }
        });
        Ok(EngineConn {
            sender,
            task: task.abort_handle(),
            born: Instant::now(),
            pooled,
        })
    }

    /// Closes the connection when aborted (the request's entry holds it).
    pub fn abort_handle(&self) -> AbortHandle {
        self.task.clone()
    }

    /// Whether the connection is known to be closed (by the engine, or by an error).
    pub fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }

    /// Closes it now.
    pub fn close(self) {
        self.task.abort();
    }
}

/// Why [`EnginePool::request`] got no response.
#[derive(Debug)]
pub enum SendError {
    /// No connection to the engine (the message says why).
    Unreachable(String),
    /// The request was sent (or could not be) and failed before a response head.
    Failed(hyper::Error),
}

#[derive(Debug, Default)]
struct Idle {
    conns: VecDeque<EngineConn>,
    /// Prune passes that found a connection closed by the engine, since a pooled
    /// connection last proved healthy (taken, or aged out still open): backs the refill
    /// off against an engine that accepts and then closes at once.
    strikes: u32,
}

/// The pool of pre-connected engine connections (see the module docs).
#[derive(Debug)]
pub struct EnginePool<D: Dial = TcpDial> {
    dial: D,
    size: usize,
    max_idle: Duration,
    idle: Mutex<Idle>,
    wake: Arc<Notify>,
    stop: CancellationToken,
    started: AtomicBool,
    metrics: Metrics,
}

impl<D: Dial> EnginePool<D> {
    /// A pool of `size` connections (0: disabled, every request dials) each kept at most
    /// `max_idle`. Nothing is connected until [`EnginePool::start`].
    pub fn new(dial: D, size: usize, max_idle: Duration, metrics: Metrics) -> Arc<Self> {
        Arc::new(EnginePool {
            dial,
            size,
            max_idle,
            idle: Mutex::new(Idle::default()),
            wake: Arc::new(Notify::new()),
            stop: CancellationToken::new(),
            started: AtomicBool::new(false),
            metrics,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the refill task (once; nothing when the pool is disabled or closed).
    pub fn start(self: &Arc<Self>) {
        if self.size == 0 || self.stop.is_cancelled() || self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move { this.refill().await });
    }

    /// Stops refilling and closes the idle connections (shutdown). Requests still dial.
    pub fn close(&self) {
        self.stop.cancel();
        let conns = std::mem::take(&mut self.lock().conns);
        self.metrics.engine_pool_idle.set(0);
        for c in conns {
            c.close();
        }
    }

    /// Connections ready now.
    pub fn idle(&self) -> usize {
        self.lock().conns.len()
    }

    /// Dials and handshakes a new connection.
    pub async fn connect(&self) -> Result<EngineConn, String> {
        let io = self.dial.dial().await?;
        EngineConn::handshake(io, self.wake.clone()).await
    }

    /// Drops closed and too old connections; returns when the oldest left expires.
    fn prune(&self, idle: &mut Idle, now: Instant) -> Option<Instant> {
        let mut peer_closed = false;
        let mut aged = false;
        idle.conns.retain(|c| {
            if c.is_closed() {
                self.metrics.pool_discard("peer_closed");
                peer_closed = true;
                false
            } else if now.saturating_duration_since(c.born) >= self.max_idle {
                self.metrics.pool_discard("aged");
                aged = true;
                c.task.abort();
                false
            } else {
                true
            }
        });
        if peer_closed {
            idle.strikes = idle.strikes.saturating_add(1);
        } else if aged {
            idle.strikes = 0;
        }
        self.metrics.engine_pool_idle.set(idle.conns.len() as i64);
        idle.conns.front().map(|c| c.born + self.max_idle)
    }

    /// Takes a ready connection (the oldest one still usable), if any, and wakes the
    /// refill. Counted as a hit or a miss.
    pub fn take(&self) -> Option<EngineConn> {
        let got = if self.size == 0 {
            None
        } else {
            let mut idle = self.lock();
            self.prune(&mut idle, Instant::now());
            let c = idle.conns.pop_front();
            if c.is_some() {
                idle.strikes = 0;
            }
            self.metrics.engine_pool_idle.set(idle.conns.len() as i64);
            c
        };
        match &got {
            Some(c) => {
                c.pooled.store(false, Ordering::Release);
                self.metrics.pool_take("hit");
            }
            None => self.metrics.pool_take("miss"),
        }
        if self.size > 0 {
            self.wake.notify_one();
        }
        got
    }

    /// Sends `req` on its own engine connection: a pooled one if ready, else a new one.
    /// `attach` receives the connection's abort handle before anything is sent (again
    /// for the retry). If a pooled connection turns out closed before any byte of the
    /// request was written, the request is sent once more on a new connection. Returns
    /// the response head and the connection (drop it once the head is in: the
    /// connection then closes after this one response).
    pub async fn request(
        &self,
        req: Request<Body>,
        mut attach: impl FnMut(AbortHandle),
    ) -> Result<(Response<Incoming>, EngineConn), SendError> {
        let (mut conn, pooled) = match self.take() {
            Some(c) => (c, true),
            None => (self.connect().await.map_err(SendError::Unreachable)?, false),
        };
        attach(conn.abort_handle());
        let mut err = match conn.sender.try_send_request(req).await {
            Ok(resp) => return Ok((resp, conn)),
            Err(e) => e,
        };
        let req = match err.take_message() {
            Some(req) if pooled => req,
            _ => return Err(SendError::Failed(err.into_error())),
        };
        self.metrics.engine_pool_retries.inc();
        tracing::debug!(error = %err.into_error(), "a pre-connected engine connection closed before the request was written; sending it on a new connection");
        conn.close();
        let mut fresh = self.connect().await.map_err(SendError::Unreachable)?;
        attach(fresh.abort_handle());
        match fresh.sender.try_send_request(req).await {
            Ok(resp) => Ok((resp, fresh)),
            Err(e) => Err(SendError::Failed(e.into_error())),
        }
    }

    /// Adds a new connection unless the pool is full or closed.
    fn push(&self, conn: EngineConn) {
        let mut idle = self.lock();
        if self.stop.is_cancelled() || idle.conns.len() >= self.size {
            drop(idle);
            conn.close();
            return;
        }
        conn.pooled.store(true, Ordering::Release);
        idle.conns.push_back(conn);
        self.metrics.engine_pool_idle.set(idle.conns.len() as i64);
    }

    /// The refill task: keeps `size` connections ready, replaces expired and closed
    /// ones, backs off while dialling fails or the engine closes what it accepted.
    async fn refill(self: Arc<Self>) {
        let mut dial_failures: u32 = 0;
        loop {
            let (deficit, strikes, expiry) = {
                let mut idle = self.lock();
                let expiry = self.prune(&mut idle, Instant::now());
                (
                    self.size.saturating_sub(idle.conns.len()),
                    idle.strikes,
                    expiry,
                )
            };
            if deficit == 0 {
                let expiry = expiry.unwrap_or_else(|| Instant::now() + self.max_idle);
                tokio::select! {
                    _ = self.stop.cancelled() => break,
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep_until(expiry) => {}
                }
                continue;
            }
            let failures = dial_failures.saturating_add(strikes);
            if failures > 0 {
                tokio::select! {
                    _ = self.stop.cancelled() => break,
                    _ = tokio::time::sleep(backoff(failures)) => {}
                }
            }
            let dialled = tokio::select! {
                _ = self.stop.cancelled() => break,
                r = self.connect() => r,
            };
            match dialled {
                Ok(conn) => {
                    if dial_failures > 0 {
                        tracing::info!(
                            failed_attempts = dial_failures,
                            "pre-connecting to the engine works again"
                        );
                    }
                    dial_failures = 0;
                    self.push(conn);
                }
                Err(e) => {
                    self.metrics.engine_pool_dial_errors.inc();
                    if dial_failures == 0 {
                        tracing::info!(error = %e, "cannot pre-connect to the engine; retrying with back-off (requests connect on their own meanwhile)");
                    } else {
                        tracing::debug!(error = %e, attempt = dial_failures + 1, "cannot pre-connect to the engine");
                    }
                    dial_failures = dial_failures.saturating_add(1);
                }
            }
        }
        self.close();
    }
}

/// The refill back-off after `failures` consecutive failures (≥ 1).
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    BACKOFF_MIN
        .saturating_mul(1u32 << doublings)
        .min(BACKOFF_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::BodyExt;
    use prometheus_client::registry::Registry;
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
    use tokio::sync::mpsc;

    /// Dials in memory: each dial hands the far end to the test (the "engine").
    struct MemDial {
        engine: mpsc::UnboundedSender<DuplexStream>,
        attempts: AtomicUsize,
        down: AtomicBool,
    }

    impl Dial for MemDial {
        type Io = DuplexStream;
        async fn dial(&self) -> Result<DuplexStream, String> {
            self.attempts.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return Err("Connection refused (os error 111)".into());
            }
            let (near, far) = tokio::io::duplex(64 * 1024);
            self.engine.send(far).map_err(|e| e.to_string())?;
            Ok(near)
        }
    }

    fn pool(
        size: usize,
        max_idle: Duration,
    ) -> (
        Arc<EnginePool<MemDial>>,
        mpsc::UnboundedReceiver<DuplexStream>,
        Registry,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut reg = Registry::default();
        let metrics = Metrics::register(&mut reg);
        let p = EnginePool::new(
            MemDial {
                engine: tx,
                attempts: AtomicUsize::new(0),
                down: AtomicBool::new(false),
            },
            size,
            max_idle,
            metrics,
        );
        (p, rx, reg)
    }

    fn attempts(p: &EnginePool<MemDial>) -> usize {
        p.dial.attempts.load(Ordering::SeqCst)
    }

    fn series(reg: &Registry, s: &str) -> f64 {
        crate::metrics::encode(reg)
            .lines()
            .find_map(|l| l.strip_prefix(s).and_then(|v| v.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(f64::NAN)
    }

    /// Waits (paused clock: virtual time) until `f` holds; panics after 60 virtual s.
    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    fn req(path: &str) -> Request<Body> {
        Request::post(path)
            .header("host", "engine")
            .body(Body::from("{}"))
            .unwrap()
    }

    /// Answers one request on `io` with a fixed body; returns the request head's bytes.
    async fn answer_one(mut io: DuplexStream) -> String {
        let mut buf = vec![0u8; 4096];
        let mut got = Vec::new();
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = io.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before a request");
            got.extend_from_slice(&buf[..n]);
        }
        io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await
            .unwrap();
        String::from_utf8_lossy(&got).into_owned()
    }

    #[tokio::test(start_paused = true)]
    async fn take_hits_and_refills() {
        let (p, mut engine, reg) = pool(2, Duration::from_secs(2));
        p.start();
        until("pool filled", || p.idle() == 2).await;
        assert_eq!(attempts(&p), 2);
        assert_eq!(
            series(&reg, "kvguard_control_engine_pool_idle"),
            2.0,
            "idle gauge"
        );
        let first = engine.recv().await.unwrap();
        let _second = engine.recv().await.unwrap();
        // A request takes the oldest pooled connection: no dial on its path.
        let server = tokio::spawn(answer_one(first));
        let (resp, conn) = p.request(req("/v1/x"), |_| {}).await.unwrap();
        drop(conn);
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, Bytes::from_static(b"ok"));
        assert!(server.await.unwrap().starts_with("POST /v1/x HTTP/1.1"));
        assert_eq!(
            series(
                &reg,
                "kvguard_control_engine_pool_takes_total{result=\"hit\"}"
            ),
            1.0
        );
        // The refill replaces it.
        until("refilled", || p.idle() == 2).await;
        assert_eq!(attempts(&p), 3);
        // Close: the idle connections are closed, nothing refills.
        p.close();
        assert_eq!(p.idle(), 0);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(attempts(&p), 3);
        // Closed pool: a request dials on its own (a miss).
        assert!(p.take().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn connections_age_out_and_are_replaced() {
        let (p, mut engine, reg) = pool(1, Duration::from_secs(2));
        p.start();
        until("pool filled", || p.idle() == 1).await;
        let mut far = engine.recv().await.unwrap();
        let t0 = Instant::now();
        // At the age limit it is closed (the engine sees EOF) and replaced.
        let mut b = [0u8; 1];
        assert_eq!(far.read(&mut b).await.unwrap(), 0);
        assert!(
            t0.elapsed() >= Duration::from_millis(1999),
            "{:?}",
            t0.elapsed()
        );
        assert!(
            t0.elapsed() < Duration::from_millis(2100),
            "{:?}",
            t0.elapsed()
        );
        until("replaced", || attempts(&p) == 2 && p.idle() == 1).await;
        assert_eq!(
            series(
                &reg,
                "kvguard_control_engine_pool_discards_total{reason=\"aged\"}"
            ),
            1.0
        );
        // take() itself never hands out an expired connection, even when the refill
        // task has not run (here: none).
        let (q, _engine, _reg) = pool(1, Duration::from_secs(2));
        let c = q.connect().await.unwrap();
        q.push(c);
        assert_eq!(q.idle(), 1);
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(q.take().is_none());
        assert_eq!(q.idle(), 0);
        p.close();
    }

    #[tokio::test(start_paused = true)]
    async fn peer_closed_connections_are_discarded() {
        let (p, mut engine, reg) = pool(2, Duration::from_secs(60));
        p.start();
        until("pool filled", || p.idle() == 2).await;
        let first = engine.recv().await.unwrap();
        let _second = engine.recv().await.unwrap();
        // The engine closes one idle connection: it is dropped and replaced.
        drop(first);
        until("replaced", || attempts(&p) == 3 && p.idle() == 2).await;
        assert_eq!(
            series(
                &reg,
                "kvguard_control_engine_pool_discards_total{reason=\"peer_closed\"}"
            ),
            1.0
        );
        // An engine that accepts and closes at once is not redialled in a busy loop:
        // the refill backs off.
        let before = attempts(&p);
        let closer = tokio::spawn(async move {
            while let Some(io) = engine.recv().await {
                drop(io);
            }
        });
        // Close the current idle ones too.
        drop(_second);
        tokio::time::sleep(Duration::from_secs(10)).await;
        let n = attempts(&p) - before;
        assert!(n >= 3, "{n} dials in 10 s");
        assert!(n <= 16, "{n} dials in 10 s: no back-off");
        p.close();
        closer.abort();
    }

    #[tokio::test]
    async fn retries_once_when_the_request_was_not_sent() {
        let (p, mut engine, reg) = pool(1, Duration::from_secs(60));
        let c = p.connect().await.unwrap();
        p.push(c);
        let stale = engine.recv().await.unwrap();
        // The engine closes the pooled connection; its connection task has not run yet,
        // so it still looks open: the request is queued, hyper finds the EOF first and
        // hands the request back unsent; it goes out on a new connection.
        drop(stale);
        let mut attached = 0;
        let fut = p.request(req("/retry"), |_| attached += 1);
        let server = tokio::spawn(async move {
            let io = engine.recv().await.unwrap();
            answer_one(io).await
        });
        let (resp, _conn) = fut.await.unwrap();
        assert_eq!(resp.status(), 200);
        assert!(server.await.unwrap().starts_with("POST /retry HTTP/1.1"));
        assert_eq!(attached, 2);
        assert_eq!(attempts(&p), 2);
        assert_eq!(
            series(&reg, "kvguard_control_engine_pool_retries_total"),
            1.0
        );
    }

    #[tokio::test]
    async fn a_request_that_was_written_is_not_retried() {
        let (p, mut engine, reg) = pool(1, Duration::from_secs(60));
        let c = p.connect().await.unwrap();
        p.push(c);
        // The engine reads the request, then closes without answering.
        let server = tokio::spawn(async move {
            let mut io = engine.recv().await.unwrap();
            let mut buf = [0u8; 4096];
            let n = io.read(&mut buf).await.unwrap();
            assert!(n > 0);
            drop(io);
            engine
        });
        let err = p.request(req("/once"), |_| {}).await.unwrap_err();
        assert!(matches!(err, SendError::Failed(_)), "{err:?}");
        let _engine = server.await.unwrap();
        assert_eq!(attempts(&p), 1);
        assert_eq!(
            series(&reg, "kvguard_control_engine_pool_retries_total"),
            0.0
        );
    }

    #[tokio::test(start_paused = true)]
    async fn engine_down_error_and_back_off() {
        let (p, _engine, reg) = pool(4, Duration::from_secs(2));
        p.dial.down.store(true, Ordering::SeqCst);
        p.start();
        // A request gets the dial error (shown in the 502).
        match p.request(req("/"), |_| {}).await {
            Err(SendError::Unreachable(e)) => assert!(e.contains("refused"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            series(
                &reg,
                "kvguard_control_engine_pool_takes_total{result=\"miss\"}"
            ),
            1.0
        );
        // Back-off: 50 ms doubling to 2 s, so about 10 dials in 10 s, not thousands.
        let before = attempts(&p);
        tokio::time::sleep(Duration::from_secs(10)).await;
        let n = attempts(&p) - before;
        assert!((5..=13).contains(&n), "{n} dials in 10 s");
        assert!(series(&reg, "kvguard_control_engine_pool_dial_errors_total") >= 5.0);
        // The engine comes back: the pool fills within one back-off period.
        p.dial.down.store(false, Ordering::SeqCst);
        let t0 = Instant::now();
        until("pool filled", || p.idle() == 4).await;
        assert!(t0.elapsed() <= BACKOFF_MAX + Duration::from_millis(10));
        p.close();
    }

    #[tokio::test]
    async fn disabled_pool_always_dials() {
        let (p, mut engine, reg) = pool(0, Duration::from_secs(2));
        p.start();
        assert!(p.take().is_none());
        let server = tokio::spawn(async move {
            let io = engine.recv().await.unwrap();
            answer_one(io).await
        });
        let (resp, _c) = p.request(req("/"), |_| {}).await.unwrap();
        assert_eq!(resp.status(), 200);
        server.await.unwrap();
        assert_eq!(attempts(&p), 1);
        assert_eq!(p.idle(), 0);
        assert_eq!(
            series(
                &reg,
                "kvguard_control_engine_pool_takes_total{result=\"miss\"}"
            ),
            2.0
        );
    }

    #[test]
    fn back_off_doubles_to_the_cap() {
        assert_eq!(backoff(1), Duration::from_millis(50));
        assert_eq!(backoff(2), Duration::from_millis(100));
        assert_eq!(backoff(6), Duration::from_millis(1600));
        assert_eq!(backoff(7), BACKOFF_MAX);
        assert_eq!(backoff(u32::MAX), BACKOFF_MAX);
    }
}
