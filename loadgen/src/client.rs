//! Small async HTTP helpers (the harness's and kvguard-leakcheck's): plain requests, SSE streams
//! that can be read event by event, dropped at any point (client disconnect), and a
//! silent client that stops reading while keeping its socket open (real back-pressure).
//!
//! Every call opens its own connection (HTTP/1.1, or h2c prior knowledge with
//! `http2: true`) and every wait is bounded.

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::HeaderMap;
use hyper::{Method, Request};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinHandle;

/// Default bound of a whole plain request, and of waiting for response headers.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);

/// A whole response.
#[derive(Debug, Clone)]
pub struct Resp {
    /// Status code.
    pub status: u16,
    /// Response headers.
    pub headers: HeaderMap,
    /// Whole body.
    pub body: Bytes,
}

impl Resp {
    /// The body as JSON.
    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body)
            .with_context(|| format!("response body is not JSON: {}", self.text()))
    }

    /// The body as (lossy) text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A response header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

/// How a streaming request connects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SseOptions {
    /// h2c with prior knowledge instead of HTTP/1.1.
    pub http2: bool,
    /// `SO_LINGER` 0: closing the connection sends a TCP RST instead of a FIN (an
    /// abortive close, like a killed process or a middlebox reset).
    pub rst_on_close: bool,
}

/// Opens a connection; returns the sender and the connection task.
async fn connect(addr: SocketAddr, http2: bool) -> Result<(Sender, JoinHandle<()>)> {
    connect_with(
        addr,
        SseOptions {
            http2,
            rst_on_close: false,
        },
    )
    .await
}

async fn connect_with(addr: SocketAddr, opts: SseOptions) -> Result<(Sender, JoinHandle<()>)> {
    let http2 = opts.http2;
    let sock = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if opts.rst_on_close {
        #[allow(deprecated)]
        sock.set_linger(Some(Duration::ZERO))
            .context("setting SO_LINGER")?;
    }
    let tcp = tokio::time::timeout(DEFAULT_TIMEOUT, sock.connect(addr))
        .await
        .map_err(|_| anyhow!("timed out connecting to {addr}"))?
        .with_context(|| format!("connecting to {addr}"))?;
    let _ = tcp.set_nodelay(true);
    let io = TokioIo::new(tcp);
    if http2 {
        let (s, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .context("h2c handshake")?;
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok((Sender::H2(s), task))
    } else {
        let (s, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .context("HTTP/1.1 handshake")?;
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok((Sender::H1(s), task))
    }
}

fn build(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
    http2: bool,
) -> Result<Request<Full<Bytes>>> {
    let uri = if http2 {
        format!("http://{addr}{path}")
    } else {
        path.to_string()
    };
    let mut b = Request::builder().method(method).uri(uri);
    if !http2 && !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        b = b.header("host", addr.to_string());
    }
    if !body.is_empty()
        && !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        b = b.header("content-type", "application/json");
    }
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(body)).context("building the request")
}

async fn send(sender: &mut Sender, req: Request<Full<Bytes>>) -> Result<hyper::Response<Incoming>> {
    match sender {
        Sender::H1(s) => {
            s.ready().await.context("connection not ready")?;
            s.send_request(req).await.context("sending the request")
        }
        Sender::H2(s) => {
            s.ready().await.context("connection not ready")?;
            s.send_request(req).await.context("sending the request")
        }
    }
}

/// Sends one request on a fresh connection and reads the whole response, within `timeout`.
pub async fn request(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
    http2: bool,
    timeout: Duration,
) -> Result<Resp> {
    let body = body.into();
    let what = format!("{method} http://{addr}{path}");
    let fut = async {
        let (mut sender, task) = connect(addr, http2).await?;
        let req = build(addr, method.clone(), path, headers, body, http2)?;
        let resp = send(&mut sender, req).await?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp
            .into_body()
            .collect()
            .await
            .context("reading the response body")?
            .to_bytes();
        task.abort();
        Ok::<_, anyhow::Error>(Resp {
            status,
            headers,
            body,
        })
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| anyhow!("{what}: no complete response within {timeout:?}"))?
        .with_context(|| what.clone())
}

/// `GET` (HTTP/1.1), whole response.
pub async fn get(addr: SocketAddr, path: &str) -> Result<Resp> {
    request(
        addr,
        Method::GET,
        path,
        &[],
        Bytes::new(),
        false,
        DEFAULT_TIMEOUT,
    )
    .await
}

/// `GET` a JSON document; fails unless the status is 2xx.
pub async fn get_json(addr: SocketAddr, path: &str) -> Result<Value> {
    let r = get(addr, path).await?;
    if !(200..300).contains(&r.status) {
        bail!("GET {path}: status {}: {}", r.status, r.text());
    }
    r.json()
}

/// `POST` a JSON body (HTTP/1.1) with extra headers; whole response (any status).
pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Result<Resp> {
    let bytes = serde_json::to_vec(body)?;
    request(
        addr,
        Method::POST,
        path,
        headers,
        bytes,
        false,
        DEFAULT_TIMEOUT,
    )
    .await
}

/// One SSE event (a block ended by a blank line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The event's text as received, without the terminating blank line.
    pub raw: String,
    /// The `data:` lines joined by `\n` (`None` when there were none).
    pub data: Option<String>,
    /// The `event:` field.
    pub event: Option<String>,
    /// Only comment lines (`: keep-alive`).
    pub comment: bool,
}

impl SseEvent {
    /// `data: [DONE]`.
    pub fn is_done(&self) -> bool {
        self.data.as_deref() == Some("[DONE]")
    }

    /// The data as JSON.
    pub fn json(&self) -> Option<Value> {
        self.data
            .as_deref()
            .and_then(|d| serde_json::from_str(d).ok())
    }

    fn parse(raw: &str) -> SseEvent {
        let mut data: Option<String> = None;
        let mut event = None;
        let mut comment = true;
        for line in raw.lines() {
            if line.starts_with(':') {
                continue;
            }
            comment = false;
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            match field {
                "data" => match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => data = Some(value.to_string()),
                },
                "event" => event = Some(value.to_string()),
                _ => {}
            }
        }
        SseEvent {
            raw: raw.to_string(),
            data,
            event,
            comment: comment && !raw.is_empty(),
        }
    }
}

/// How a stream ended ([`SseStream::wait_end`]).
#[derive(Debug, Clone)]
pub struct Ended {
    /// The events read until the end (comments included).
    pub events: Vec<SseEvent>,
    /// `None`: the body ended cleanly; else the reset (h2 RST_STREAM, connection closed
    /// mid-body), as hyper reported it.
    pub reset: Option<String>,
}

impl Ended {
    /// It ended cleanly after `data: [DONE]`.
    pub fn completed(&self) -> bool {
        self.reset.is_none() && self.events.last().is_some_and(SseEvent::is_done)
    }

    /// `data: [DONE]` was among the events (however the stream ended).
    pub fn saw_done(&self) -> bool {
        self.events.iter().any(SseEvent::is_done)
    }
}

enum ChunkError {
    Timeout,
    Body(hyper::Error),
}

/// A streaming response being read. Dropping it closes the connection (a client
/// disconnect); [`SseStream::disconnect`] says so explicitly.
pub struct SseStream {
    /// Response status.
    pub status: u16,
    /// Response headers.
    pub headers: HeaderMap,
    body: Option<Incoming>,
    pending: Vec<u8>,
    raw: Vec<u8>,
    ended: bool,
    sender: Option<Sender>,
    conn: JoinHandle<()>,
}

/// Sends a streaming `POST` with a JSON body and waits (bounded) for the response head.
pub async fn stream_sse(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
    http2: bool,
) -> Result<SseStream> {
    stream_raw(
        addr,
        path,
        Bytes::from(serde_json::to_vec(body)?),
        headers,
        http2,
    )
    .await
}

/// [`stream_sse`] with a raw body.
pub async fn stream_raw(
    addr: SocketAddr,
    path: &str,
    body: Bytes,
    headers: &[(&str, &str)],
    http2: bool,
) -> Result<SseStream> {
    stream_with(
        addr,
        path,
        body,
        headers,
        SseOptions {
            http2,
            rst_on_close: false,
        },
    )
    .await
}

/// [`stream_sse`] with a raw body and connection options (e.g. RST on close).
pub async fn stream_with(
    addr: SocketAddr,
    path: &str,
    body: Bytes,
    headers: &[(&str, &str)],
    opts: SseOptions,
) -> Result<SseStream> {
    let http2 = opts.http2;
    let fut = async {
        let (mut sender, conn) = connect_with(addr, opts).await?;
        let req = build(addr, Method::POST, path, headers, body, http2)?;
        let resp = match send(&mut sender, req).await {
            Ok(r) => r,
            Err(e) => {
                conn.abort();
                return Err(e);
            }
        };
        Ok::<_, anyhow::Error>(SseStream {
            status: resp.status().as_u16(),
            headers: resp.headers().clone(),
            body: Some(resp.into_body()),
            pending: Vec::new(),
            raw: Vec::new(),
            ended: false,
            sender: Some(sender),
            conn,
        })
    };
    tokio::time::timeout(DEFAULT_TIMEOUT, fut)
        .await
        .map_err(|_| {
            anyhow!("POST http://{addr}{path}: no response head within {DEFAULT_TIMEOUT:?}")
        })?
}

impl SseStream {
    /// A response header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Every byte received so far.
    pub fn raw(&self) -> &[u8] {
        &self.raw
    }

    /// Whether the body ended (cleanly).
    pub fn is_ended(&self) -> bool {
        self.ended
    }

    /// The next data chunk as it arrived; `None` at the end of the body. Errors on a
    /// reset or when nothing arrives within `timeout`.
    pub async fn next_chunk(&mut self, timeout: Duration) -> Result<Option<Bytes>> {
        self.chunk(timeout).await.map_err(|e| match e {
            ChunkError::Timeout => anyhow!("no stream bytes within {timeout:?}"),
            ChunkError::Body(e) => anyhow!(e).context("stream body error (reset?)"),
        })
    }

    async fn chunk(&mut self, timeout: Duration) -> Result<Option<Bytes>, ChunkError> {
        let Some(body) = self.body.as_mut() else {
            return Ok(None);
        };
        loop {
            let frame = tokio::time::timeout(timeout, body.frame())
                .await
                .map_err(|_| ChunkError::Timeout)?;
            match frame {
                None => {
                    self.ended = true;
                    self.body = None;
                    return Ok(None);
                }
                Some(Err(e)) => {
                    self.body = None;
                    return Err(ChunkError::Body(e));
                }
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.raw.extend_from_slice(&data);
                        return Ok(Some(data));
                    }
                }
            }
        }
    }

    /// Reads every remaining event until the stream ends, cleanly or by a reset (a cut
    /// stream), within `timeout`. Errors only when it has not ended by then: a hung stream
    /// is a failure, never taken for an end.
    pub async fn wait_end(&mut self, timeout: Duration) -> Result<Ended> {
        // A chunk may take the whole time: no quieter bound than the cap.
        self.wait_end_flowing(timeout, timeout).await
    }

    /// [`Self::wait_end`] for a stream that flows however slowly: it fails only when no
    /// chunk came for `quiet`, or when the stream did not end within `cap` in all. A speed
    /// a loaded machine can fall to is no failure; a stall is.
    pub async fn wait_end_flowing(&mut self, quiet: Duration, cap: Duration) -> Result<Ended> {
        let deadline = tokio::time::Instant::now() + cap;
        let mut events = Vec::new();
        loop {
            if let Some(ev) = self.take_event() {
                events.push(ev);
                continue;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.chunk(left.min(quiet)).await {
                Ok(Some(c)) => self.pending.extend_from_slice(&c),
                Ok(None) => {
                    if !self.pending.iter().all(|b| b.is_ascii_whitespace()) {
                        let rest = String::from_utf8_lossy(&self.pending).into_owned();
                        events.push(SseEvent::parse(rest.trim_end()));
                    }
                    self.pending.clear();
                    return Ok(Ended {
                        events,
                        reset: None,
                    });
                }
                Err(ChunkError::Body(e)) => {
                    return Ok(Ended {
                        events,
                        reset: Some(e.to_string()),
                    })
                }
                Err(ChunkError::Timeout) if left <= quiet => bail!(
                    "the stream did not end within {cap:?} ({} more events read, last {:?})",
                    events.len(),
                    events.last()
                ),
                Err(ChunkError::Timeout) => bail!(
                    "the stream sent nothing for {quiet:?} ({} more events read, last {:?})",
                    events.len(),
                    events.last()
                ),
            }
        }
    }

    /// The next SSE event (comments included); `None` at the end of the body.
    pub async fn next_event(&mut self, timeout: Duration) -> Result<Option<SseEvent>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(ev) = self.take_event() {
                return Ok(Some(ev));
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_chunk(left).await? {
                Some(c) => self.pending.extend_from_slice(&c),
                None => {
                    if self.pending.iter().all(|b| b.is_ascii_whitespace()) {
                        return Ok(None);
                    }
                    let rest = String::from_utf8_lossy(&self.pending).into_owned();
                    self.pending.clear();
                    return Ok(Some(SseEvent::parse(rest.trim_end())));
                }
            }
        }
    }

    /// The next event that has `data:` (skips comments).
    pub async fn next_data(&mut self, timeout: Duration) -> Result<Option<SseEvent>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_event(left).await? {
                Some(ev) if ev.data.is_some() => return Ok(Some(ev)),
                Some(_) => {}
                None => return Ok(None),
            }
        }
    }

    /// Reads `n` events (comments included), within `timeout` in all.
    pub async fn read_events(&mut self, n: usize, timeout: Duration) -> Result<Vec<SseEvent>> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_event(left).await? {
                Some(ev) => out.push(ev),
                None => bail!("stream ended after {} of {n} events", out.len()),
            }
        }
        Ok(out)
    }

    /// Reads every event to the end of the body, within `timeout` in all.
    pub async fn collect(&mut self, timeout: Duration) -> Result<Vec<SseEvent>> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut out = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_event(left).await {
                Ok(Some(ev)) => out.push(ev),
                Ok(None) => return Ok(out),
                Err(e) => return Err(e.context(format!("after {} events", out.len()))),
            }
        }
    }

    /// Reads the whole body as bytes, within `timeout`.
    pub async fn collect_bytes(&mut self, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if self.next_chunk(left).await?.is_none() {
                return Ok(self.raw.clone());
            }
        }
    }

    /// Closes the connection now (the client goes away mid-stream).
    pub fn disconnect(mut self) {
        self.close();
    }

    /// Drops only the response body: for h2 this resets the stream (RST_STREAM) and keeps
    /// the connection; for HTTP/1.1 hyper closes the connection. Returns the connection
    /// task so that the test can keep the connection alive.
    pub fn reset_stream(mut self) -> JoinHandle<()> {
        self.body = None;
        let conn = std::mem::replace(&mut self.conn, tokio::spawn(async {}));
        std::mem::forget(self.sender.take());
        conn
    }

    fn close(&mut self) {
        self.body = None;
        self.sender = None;
        self.conn.abort();
    }

    fn take_event(&mut self) -> Option<SseEvent> {
        let (end, sep) = find_event_end(&self.pending)?;
        let raw = String::from_utf8_lossy(&self.pending[..end]).into_owned();
        self.pending.drain(..end + sep);
        Some(SseEvent::parse(&raw))
    }
}

impl Drop for SseStream {
    fn drop(&mut self) {
        self.close();
    }
}

fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    for i in 0..buf.len() {
        if buf[i..].starts_with(b"\n\n") {
            return Some((i, 2));
        }
        if buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
    }
    None
}

/// A client that sends an HTTP/1.1 request and then stops reading, keeping the socket
/// open: with a small receive buffer the server side is back-pressured for real.
pub struct SilentClient {
    stream: TcpStream,
    head: Option<String>,
    read: Vec<u8>,
}

/// Connects with `SO_RCVBUF = recv_buf` (set before connecting), sends `POST path` with
/// the JSON body, and — when `read_head` — reads until the response head has arrived
/// (bounded), then stops reading.
pub async fn silent_client(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
    recv_buf: u32,
    read_head: bool,
) -> Result<SilentClient> {
    let sock = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    sock.set_recv_buffer_size(recv_buf)
        .context("setting SO_RCVBUF")?;
    let mut stream = tokio::time::timeout(DEFAULT_TIMEOUT, sock.connect(addr))
        .await
        .map_err(|_| anyhow!("timed out connecting to {addr}"))?
        .with_context(|| format!("connecting to {addr}"))?;
    let body = serde_json::to_vec(body)?;
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).await?;
    stream.write_all(&body).await?;
    stream.flush().await?;
    let mut c = SilentClient {
        stream,
        head: None,
        read: Vec::new(),
    };
    if read_head {
        let deadline = tokio::time::Instant::now() + DEFAULT_TIMEOUT;
        while c.head.is_none() {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if c.read_some(left).await? == 0 {
                bail!("connection closed before the response head");
            }
        }
    }
    Ok(c)
}

impl SilentClient {
    /// Reads up to `chunk` bytes every 100 ms, and nothing during each `(from, length)`
    /// of `pauses` (offsets from now), until `until` or the end of an SSE response
    /// (`[DONE]`): a client that reads at a pace. Returns the bytes read so far, or why it
    /// stopped early: its connection closed, a read error, or a `kvguard_aborted` event.
    pub async fn read_paced(
        &mut self,
        chunk: usize,
        until: std::time::Instant,
        pauses: &[(Duration, Duration)],
    ) -> std::result::Result<usize, String> {
        let start = std::time::Instant::now();
        let mut next = start;
        while std::time::Instant::now() < until {
            next += Duration::from_millis(100);
            let t = next - start;
            if let Some((from, len)) = pauses.iter().find(|(f, l)| t >= *f && t < *f + *l) {
                next = start + *from + *len;
                tokio::time::sleep_until(next.into()).await;
            }
            let n = self.read.len();
            match self.read_up_to(chunk, DEFAULT_TIMEOUT).await {
                Ok(0) => return Err(format!("closed after {n} bytes")),
                Ok(_) => {}
                Err(e) => return Err(format!("{e:#} after {n} bytes")),
            }
            if self.read.windows(15).any(|w| w == b"kvguard_aborted") {
                return Err(format!("abort event after {} bytes", self.read.len()));
            }
            if self.read.windows(6).any(|w| w == b"[DONE]") {
                break;
            }
            tokio::time::sleep_until(next.into()).await;
        }
        Ok(self.read.len())
    }

    /// The response head (status line and headers), once read.
    pub fn head(&self) -> Option<&str> {
        self.head.as_deref()
    }

    /// The status code from the head.
    pub fn status(&self) -> Option<u16> {
        self.head
            .as_deref()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    }

    /// Every byte read so far.
    pub fn bytes_read(&self) -> &[u8] {
        &self.read
    }

    /// Reads once (up to 4 KiB) within `timeout`; 0 means the server closed.
    pub async fn read_some(&mut self, timeout: Duration) -> Result<usize> {
        self.read_up_to(4096, timeout).await
    }

    /// Reads once, at most `max` bytes (at most 4 KiB), within `timeout`: a slow reader
    /// takes a little at a time. 0 means the server closed.
    pub async fn read_up_to(&mut self, max: usize, timeout: Duration) -> Result<usize> {
        let mut buf = [0u8; 4096];
        let max = max.clamp(1, buf.len());
        let n = tokio::time::timeout(timeout, self.stream.read(&mut buf[..max]))
            .await
            .map_err(|_| anyhow!("nothing to read within {timeout:?}"))?
            .context("reading")?;
        self.read.extend_from_slice(&buf[..n]);
        if self.head.is_none() {
            if let Some(i) = self.read.windows(4).position(|w| w == b"\r\n\r\n") {
                self.head = Some(String::from_utf8_lossy(&self.read[..i]).into_owned());
            }
        }
        Ok(n)
    }

    /// Reads until the server closes the connection (or resets it), within `timeout`;
    /// returns the bytes read in all.
    pub async fn read_to_close(&mut self, timeout: Duration) -> Result<usize> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.read_some(left).await {
                Ok(0) => return Ok(self.read.len()),
                Ok(_) => {}
                Err(e) if e.to_string().contains("nothing to read") => return Err(e),
                Err(_) => return Ok(self.read.len()),
            }
        }
    }

    /// The local address of the socket.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.stream.local_addr()?)
    }

    /// Closes the socket.
    pub fn close(self) {}
}
