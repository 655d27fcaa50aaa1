//! Helpers shared by the filter's end-to-end tests (`filter_*.rs` include this file with
//! `#[path = "filter_support.rs"] mod support;`). Compiled alone it is an empty test crate.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anyhow::{bail, Context, Result};
use kvguard_contract::{stamp, Key, RequestId};
use kvguard_integration::envoy::{self, Envoy, EnvoyOptions};
use kvguard_integration::receiver::{self, Receiver, ReceiverConfig};
use kvguard_integration::sim::{self, SimConfig, SimHandle};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The secret shared by the filter (VM env `KVGUARD_SECRET`) and the receiver.
pub const SECRET: &str = "kvguard-e2e-secret-0123456789abcdef";
/// Bound of every test body.
pub const T: Duration = Duration::from_secs(120);
/// Bound of one wait.
pub const W: Duration = Duration::from_secs(20);
/// The quiet period after the event a "nothing more happens" check waits for (e.g. no
/// abort after a request's access log line): longer than several filter ticks.
pub const QUIET: Duration = Duration::from_millis(500);

pub fn key() -> Key {
    Key::try_new(SECRET.as_bytes()).unwrap()
}

/// The filter config: the harness's basic one plus `extra`'s members, with a fast tick.
pub fn filter_config(extra: Value) -> Value {
    let mut c = envoy::basic_filter_config();
    c["tick_ms"] = json!(50);
    if let Value::Object(m) = extra {
        for (k, v) in m {
            c[k] = v;
        }
    }
    c
}

/// Envoy options with the filter, the secret in the VM env, and wasm debug logs.
pub fn options(upstream: SocketAddr, control: SocketAddr, extra: Value) -> EnvoyOptions {
    let mut o = EnvoyOptions::with_filter(upstream, control, filter_config(extra));
    o = o.vm_env("KVGUARD_SECRET", SECRET);
    o.component_log_level = Some("wasm:debug".into());
    // The access log goes to stdout through Envoy's file logger, flushed every 10 s by
    // default: flush often so tests can read outcomes quickly.
    o.extra_args
        .extend(["--file-flush-interval-msec".to_string(), "100".to_string()]);
    o
}

/// A simulator, a verifying receiver and an Envoy with the filter in front of them.
pub struct Rig {
    pub sim: SimHandle,
    pub recv: Receiver,
    pub envoy: Envoy,
}

pub async fn rig(sim_cfg: SimConfig, extra: Value) -> Rig {
    rig_with(sim_cfg, extra, |_| {}).await
}

pub async fn rig_with(
    sim_cfg: SimConfig,
    extra: Value,
    tweak: impl FnOnce(&mut EnvoyOptions),
) -> Rig {
    let sim = sim::spawn(sim_cfg).await.unwrap();
    let recv = receiver::spawn(ReceiverConfig::new(vec![key()]))
        .await
        .unwrap();
    let mut o = options(sim.addr(), recv.addr(), extra);
    tweak(&mut o);
    let envoy = Envoy::start(o).await.unwrap();
    Rig { sim, recv, envoy }
}

pub fn chat(max_tokens: u32) -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "stream": true,
           "max_tokens": max_tokens, "stream_options": {"include_usage": true}})
}

pub fn completion(max_tokens: u32, stream: bool) -> Value {
    json!({"model": "tiny", "prompt": "hello", "stream": stream, "max_tokens": max_tokens})
}

/// A filter stat (the `wasmcustom.` namespace is added by `Envoy::stat`). Panics when
/// Envoy has no such stat: a missing stat is not 0 (the filter defines every one of its
/// metrics, labelled series included, when its VM starts).
pub async fn stat(envoy: &Envoy, name: &str) -> f64 {
    match envoy.stat(name).await.unwrap() {
        Some(v) => v,
        None => panic!(
            "Envoy has no stat {name:?}; the filter's are: {:?}",
            envoy
                .stats_matching("kvguard_filter")
                .await
                .unwrap()
                .keys()
                .collect::<Vec<_>>()
        ),
    }
}

pub fn aborts(reason: &str, outcome: &str) -> String {
    format!("kvguard_filter_aborts_total_reason=.={reason};.;_outcome=.={outcome};.;")
}

/// Envoy's access log line of request `id` (waits for it; ids are minted by Envoy: pass
/// the one the simulator saw).
pub async fn access_line(envoy: &Envoy, id: &str) -> String {
    let needle = format!("id={id} ");
    kvguard_integration::wait::poll_until("access log line", W, Duration::from_millis(50), || {
        envoy
            .log()
            .lines()
            .find(|l| l.starts_with("ACCESS") && l.contains(&needle))
            .map(str::to_owned)
    })
    .await
    .unwrap()
}

/// The `outcome=` field of request `id`'s access log line (waits for it).
pub async fn access_outcome(envoy: &Envoy, id: &str) -> String {
    access_line(envoy, id)
        .await
        .rsplit("outcome=")
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// Waits until Envoy's log contains `needle`.
pub async fn wait_log(envoy: &Envoy, needle: &str) {
    kvguard_integration::wait::poll_until(needle, W, Duration::from_millis(50), || {
        envoy.log().contains(needle).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}:\n{}", envoy.log()));
}

/// The engine's record of request `id` once it ended (bounded wait).
pub async fn engine_end(sim: &SimHandle, id: &str) -> sim::RequestRecord {
    sim.wait_state("the engine ends the request", W, |s| {
        s.request(id).is_some_and(|r| r.ended.is_some())
    })
    .await
    .unwrap()
    .request(id)
    .cloned()
    .unwrap()
}

/// The id of the last request the simulator saw.
pub fn last_id(sim: &SimHandle) -> String {
    sim.state()
        .requests
        .last()
        .expect("a request")
        .request_id
        .clone()
}

/// No VM panic or crash in Envoy's log.
pub fn assert_vm_healthy(envoy: &Envoy) {
    let log = envoy.log();
    for bad in [
        "kvguard: panic",
        "unreachable",
        "Wasm VM failed",
        "Function: proxy_on",
    ] {
        assert!(!log.contains(bad), "Envoy log contains {bad:?}:\n{log}");
    }
}

/// A port nothing listens on.
pub async fn dead_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    drop(l);
    a
}

/// How the scripted upstream stamps its responses.
#[derive(Clone)]
pub enum Stamp {
    /// No `x-kvguard-control`.
    None,
    /// A valid stamp naming `addr`, signed with `key`.
    Valid { addr: SocketAddr, key: Key },
    /// These raw bytes (forged, malformed, non-UTF-8...).
    Raw(Vec<u8>),
}

/// A tiny HTTP/1.1 upstream for cases the simulator does not cover: it answers every
/// request with SSE (`content_type` raw bytes, optional stamp, `extra_headers` raw), sends
/// `events` data events every `interval`, then `[DONE]` (or, if `events` is 0, streams
/// forever until the client is gone).
pub struct ScriptedUpstream {
    pub addr: SocketAddr,
    pub served: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
pub struct Script {
    pub stamp: Stamp,
    pub content_type: Vec<u8>,
    pub extra_headers: Vec<u8>,
    pub events: usize,
    pub interval: Duration,
    /// Close the connection abruptly after this many events (an upstream reset).
    pub reset_after: Option<usize>,
}

impl Default for Script {
    fn default() -> Self {
        Script {
            stamp: Stamp::None,
            content_type: b"text/event-stream".to_vec(),
            extra_headers: Vec::new(),
            events: 0,
            interval: Duration::from_millis(100),
            reset_after: None,
        }
    }
}

pub async fn scripted_upstream(script: Script) -> ScriptedUpstream {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let served = Arc::new(AtomicUsize::new(0));
    let served2 = served.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                return;
            };
            let script = script.clone();
            let served = served2.clone();
            tokio::spawn(async move {
                let _ = serve_one(s, script, served).await;
            });
        }
    });
    ScriptedUpstream { addr, served, task }
}

/// Reads a request head; returns it and the bytes read past it.
pub async fn read_head(s: &mut TcpStream) -> Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(i + 4);
            return Ok((buf, rest));
        }
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            bail!("closed before a request head");
        }
        buf.extend_from_slice(&tmp[..n]);
        if buf.len() > 65536 {
            bail!("head too large");
        }
    }
}

fn header<'a>(head: &'a [u8], name: &str) -> Option<&'a [u8]> {
    head.split(|b| *b == b'\n').find_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = line.iter().position(|b| *b == b':')?;
        if line[..colon].eq_ignore_ascii_case(name.as_bytes()) {
            Some(line[colon + 1..].trim_ascii())
        } else {
            None
        }
    })
}

async fn serve_one(mut s: TcpStream, script: Script, served: Arc<AtomicUsize>) -> Result<()> {
    // Keep-alive: serve requests on this connection until it closes.
    loop {
        let (head, mut rest) = read_head(&mut s).await?;
        let len: usize = header(&head, "content-length")
            .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
            .unwrap_or(0);
        while rest.len() < len {
            let mut tmp = [0u8; 4096];
            let n = s.read(&mut tmp).await?;
            if n == 0 {
                bail!("closed in the body");
            }
            rest.extend_from_slice(&tmp[..n]);
        }
        served.fetch_add(1, Ordering::SeqCst);
        let id = header(&head, "x-request-id").unwrap_or(b"none").to_vec();
        let mut out = Vec::new();
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\ncontent-type: ");
        out.extend_from_slice(&script.content_type);
        out.extend_from_slice(b"\r\ntransfer-encoding: chunked\r\n");
        match &script.stamp {
            Stamp::None => {}
            Stamp::Valid { addr, key } => {
                let rid = RequestId::try_new(&id).context("request id")?;
                let v = stamp::stamp(key, *addr, &rid, now_unix());
                out.extend_from_slice(format!("x-kvguard-control: {v}\r\n").as_bytes());
            }
            Stamp::Raw(raw) => {
                out.extend_from_slice(b"x-kvguard-control: ");
                out.extend_from_slice(raw);
                out.extend_from_slice(b"\r\n");
            }
        }
        out.extend_from_slice(&script.extra_headers);
        out.extend_from_slice(b"\r\n");
        s.write_all(&out).await?;
        let mut sent = 0usize;
        loop {
            let ev = if script.events > 0 && sent == script.events {
                b"data: [DONE]\n\n".to_vec()
            } else {
                format!("data: {{\"choices\":[{{\"index\":0,\"text\":\" t{sent}\",\"finish_reason\":null}}]}}\n\n").into_bytes()
            };
            let mut chunk = format!("{:x}\r\n", ev.len()).into_bytes();
            chunk.extend_from_slice(&ev);
            chunk.extend_from_slice(b"\r\n");
            s.write_all(&chunk).await?;
            if script.events > 0 && sent == script.events {
                s.write_all(b"0\r\n\r\n").await?;
                break;
            }
            sent += 1;
            if script.reset_after == Some(sent) {
                // Close with the chunked body unfinished: an upstream reset for Envoy.
                return Ok(());
            }
            tokio::time::sleep(script.interval).await;
        }
    }
}

pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Sends a raw HTTP/1.1 request (bytes as given) and reads the response until the
/// connection closes or `timeout` passes; returns what was read.
pub async fn raw_request(addr: SocketAddr, request: &[u8], timeout: Duration) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(timeout, s.read_to_end(&mut out)).await;
    out
}

/// Opens `n` streams of `max_tokens` at `rate` tokens/s (HTTP/1.1 and HTTP/2 alternately)
/// and reads each one's first data event.
pub async fn open_streams(
    entry: SocketAddr,
    n: usize,
    max_tokens: u32,
    rate: &'static str,
) -> Vec<kvguard_integration::client::SseStream> {
    open_streams_with_first(entry, n, max_tokens, rate)
        .await
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

/// [`open_streams`], each stream with its first data event.
pub async fn open_streams_with_first(
    entry: SocketAddr,
    n: usize,
    max_tokens: u32,
    rate: &'static str,
) -> Vec<(
    kvguard_integration::client::SseStream,
    kvguard_integration::client::SseEvent,
)> {
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        set.spawn(async move {
            let mut s = kvguard_integration::client::stream_sse(
                entry,
                "/v1/chat/completions",
                &chat(max_tokens),
                &[("x-sim-rate", rate)],
                i % 2 == 0,
            )
            .await
            .unwrap();
            assert_eq!(s.status, 200);
            let first = s.next_data(W).await.unwrap().unwrap();
            (s, first)
        });
    }
    let mut out = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        out.push(r.unwrap());
    }
    out
}

/// The sum of the filter's `<name>{result="<result>"}` counter on `envoy`.
pub async fn filter_counter(
    envoy: &kvguard_integration::envoy::Envoy,
    name: &str,
    result: &str,
) -> f64 {
    envoy
        .stats_matching(name)
        .await
        .unwrap()
        .into_iter()
        .filter(|(k, _)| k.contains(&format!("result=.={result};")))
        .map(|(_, v)| v)
        .sum()
}

/// The value of one series of kvguard-control's `/metrics` (`name{labels}` as written
/// there); panics naming it when it is missing (a series that does not exist is not 0).
pub async fn control_metric(
    control: &kvguard_integration::demo::stack::Control,
    series: &str,
) -> f64 {
    let text = control.metrics_text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from kvguard-control's /metrics"))
}
