//! Shared helpers of kvguard-control's integration tests: an in-process kvguard-control
//! in front of the workspace's engine simulator (`kvguard_integration::sim`).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod script;

use kvguard_contract::{signature, Key};
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
    let sig = key.map(|k| signature::sign(k, t, &bytes));
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
