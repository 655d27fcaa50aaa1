//! Shared helpers of kvguard-control's integration tests: an in-process kvguard-control
//! in front of the workspace's engine simulator (`kvguard_integration::sim`).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod script;

use kvguard_contract::{signature, Domain, Key};
use kvguard_control::config::Config;
use kvguard_control::{Deps, Server};
use kvguard_integration::client;
use kvguard_integration::sim::{self, SimConfig, SimHandle};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub const KEY: &[u8] = b"kvguard-control-test-key-0123456789";
pub const OTHER_KEY: &[u8] = b"some-other-key-that-is-not-configured";

pub fn key() -> Key {
    Key::try_new(KEY).unwrap()
}

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A slow, long simulator (tokens every 50 ms).
pub fn slow_sim() -> SimConfig {
    SimConfig {
        token_rate: 20.0,
        default_max_tokens: 400,
        ..SimConfig::default()
    }
}

pub async fn sim(cfg: SimConfig) -> SimHandle {
    sim::spawn(cfg).await.unwrap()
}

/// kvguard-control in front of `engine_url`, with the test key, a 100 ms sample interval.
pub async fn control(engine_url: &str, tweak: impl FnOnce(&mut Config)) -> Server {
    let mut cfg = Config::for_tests(engine_url, vec![key()]).unwrap();
    cfg.sample_interval = Duration::from_millis(100);
    cfg.advertise = Some("127.0.0.1:9902".parse().unwrap());
    tweak(&mut cfg);
    let deps = Deps::real(&cfg);
    Server::start(cfg, deps).await.unwrap()
}

pub fn completion(max_tokens: u32) -> Value {
    json!({"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "stream": true})
}

/// A long (400-token) streamed completion with request id `id`, sent over HTTP/1.1 to
/// `addr` (kvguard-control's proxy listener or the engine itself).
pub async fn long_completion(addr: SocketAddr, id: &str) -> client::SseStream {
    client::stream_sse(
        addr,
        "/v1/completions",
        &completion(400),
        &[("x-request-id", id)],
        false,
    )
    .await
    .unwrap()
}

/// POSTs a signed abort body with `key` at unix time `t`; returns (status, json body).
pub async fn abort_signed(
    admin: SocketAddr,
    body: &Value,
    key: Option<&Key>,
    t: u64,
) -> (u16, Value, String) {
    let bytes = serde_json::to_vec(body).unwrap();
    let sig = key.map(|k| signature::sign(Domain::Abort, k, t, &bytes));
    let mut headers = vec![];
    if let Some(s) = &sig {
        headers.push(("x-kvguard-signature", s.as_str()));
    }
    let r = client::request(
        admin,
        hyper::Method::POST,
        "/v1/abort",
        &headers,
        bytes,
        false,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    (
        r.status,
        r.json().unwrap_or(Value::Null),
        sig.unwrap_or_default(),
    )
}

/// A signed abort; each call's body differs (`age_ms`), so two calls within the same
/// second are not the same signature (which would be a replay, 409).
pub async fn abort(admin: SocketAddr, id: &str, reason: &str) -> (u16, Value) {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let body = json!({"request_id": id, "reason": reason, "age_ms": n, "tokens": 2});
    let (s, v, _) = abort_signed(admin, &body, Some(&key()), now_unix()).await;
    (s, v)
}

/// The value of a metric line (exact name + labels) in the admin's /metrics.
pub async fn metric(admin: SocketAddr, series: &str) -> Option<f64> {
    let text = client::get(admin, "/metrics").await.unwrap().text();
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

pub const T: Duration = Duration::from_secs(10);

/// Admin clients that keep their connection open and send a request every `period`
/// (Envoy's abort pools, peers): odd requests a signed abort for an id nobody holds,
/// even ones `GET /v1/engine`.
pub struct KeepAliveClients {
    stop: tokio_util::sync::CancellationToken,
    /// Requests answered.
    pub answered: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Requests failed (no answer, or an answer other than 200 / 404), with the last error.
    pub failed: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// Clients that got their first answer.
    pub started: std::sync::Arc<std::sync::atomic::AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl KeepAliveClients {
    pub fn spawn(admin: SocketAddr, n: usize, period: Duration) -> KeepAliveClients {
        use std::sync::atomic::Ordering;
        let stop = tokio_util::sync::CancellationToken::new();
        let answered = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let started = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let failed = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let tasks = (0..n)
            .map(|i| {
                let (stop, answered, started, failed) =
                    (stop.clone(), answered.clone(), started.clone(), failed.clone());
                tokio::spawn(async move {
                    let fail = |e: String| failed.lock().unwrap().push(format!("client {i}: {e}"));
                    let tcp = match tokio::net::TcpStream::connect(admin).await {
                        Ok(t) => t,
                        Err(e) => return fail(format!("connect: {e}")),
                    };
                    let io = hyper_util::rt::TokioIo::new(tcp);
                    let (mut tx, conn) = match hyper::client::conn::http1::handshake(io).await {
                        Ok(x) => x,
                        Err(e) => return fail(format!("handshake: {e}")),
                    };
                    tokio::spawn(conn);
                    // Spread the clients over the period.
                    let phase = period.mul_f64(i as f64 / n as f64);
                    let mut iv = tokio::time::interval_at(tokio::time::Instant::now() + phase, period);
                    for k in 0u64.. {
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = iv.tick() => {}
                        }
                        let req = if k % 2 == 0 {
                            let body = serde_json::to_vec(&json!({"request_id": format!("ka-{i}-{k}"), "reason": "downstream_reset"})).unwrap();
                            let sig = signature::sign(Domain::Abort, &key(), now_unix(), &body);
                            hyper::Request::post("/v1/abort")
                                .header("host", "control")
                                .header("x-kvguard-signature", sig)
                                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                                .unwrap()
                        } else {
                            hyper::Request::get("/v1/engine")
                                .header("host", "control")
                                .body(http_body_util::Full::new(bytes::Bytes::new()))
                                .unwrap()
                        };
                        let r = async {
                            tx.ready().await?;
                            let resp = tx.send_request(req).await?;
                            let status = resp.status().as_u16();
                            http_body_util::BodyExt::collect(resp.into_body()).await?;
                            Ok::<_, hyper::Error>(status)
                        };
                        match tokio::time::timeout(Duration::from_secs(10), r).await {
                            Ok(Ok(200 | 404)) => {
                                if k == 0 {
                                    started.fetch_add(1, Ordering::AcqRel);
                                }
                                answered.fetch_add(1, Ordering::AcqRel);
                            }
                            Ok(Ok(s)) => return fail(format!("status {s}")),
                            Ok(Err(e)) => return fail(e.to_string()),
                            Err(_) => return fail("no answer within 10 s".to_owned()),
                        }
                    }
                })
            })
            .collect();
        KeepAliveClients {
            stop,
            answered,
            failed,
            started,
            tasks,
        }
    }

    /// Stops every client; the failures.
    pub async fn stop(self) -> Vec<String> {
        self.stop.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
        self.failed.lock().unwrap().clone()
    }
}
