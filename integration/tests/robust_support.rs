//! Helpers of the robustness tests (`robust_*.rs` include this file with
//! `#[path = "robust_support.rs"] mod rsupport;`). Compiled alone it is an empty test crate.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anyhow::{bail, Result};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One scripted answer of the [`RawUpstream`].
#[derive(Clone, Default)]
pub struct Answer {
    /// Response head lines after the status line (each without CRLF).
    pub headers: Vec<String>,
    /// Body bytes (sent chunked, `chunk` bytes at a time).
    pub body: Vec<u8>,
    /// Chunk size (0 = one chunk).
    pub chunk: usize,
    /// Wait before the response head.
    pub head_delay: Duration,
    /// After this many body bytes, wait `pause` (mid-event stall).
    pub pause_at: Option<usize>,
    /// How long to pause (the client resets meanwhile).
    pub pause: Duration,
    /// After the body, hold the stream open this long before the end (0: end at once).
    pub hold_end: Duration,
}

/// A raw HTTP/1.1 upstream answering each request with the [`Answer`] named by its
/// `x-case` header. Records the `x-request-id` it saw per case and whether the peer went
/// away before the end.
pub struct RawUpstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<(String, String)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn header(head: &[u8], name: &str) -> Option<String> {
    head.split(|b| *b == b'\n').find_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = line.iter().position(|b| *b == b':')?;
        if line[..colon].eq_ignore_ascii_case(name.as_bytes()) {
            Some(String::from_utf8_lossy(line[colon + 1..].trim_ascii()).into_owned())
        } else {
            None
        }
    })
}

async fn read_request(s: &mut TcpStream) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let (head, mut rest) = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(i + 4);
            break (buf, rest);
        }
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            bail!("closed before a request head");
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    if let Some(len) = header(&head, "content-length").and_then(|v| v.parse::<usize>().ok()) {
        while rest.len() < len {
            let n = s.read(&mut tmp).await?;
            if n == 0 {
                bail!("closed in the body");
            }
            rest.extend_from_slice(&tmp[..n]);
        }
    } else if header(&head, "transfer-encoding").is_some() {
        while !rest.ends_with(b"0\r\n\r\n") {
            let n = s.read(&mut tmp).await?;
            if n == 0 {
                bail!("closed in the body");
            }
            rest.extend_from_slice(&tmp[..n]);
        }
    }
    Ok(head)
}

async fn write_chunk(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    if b.is_empty() {
        return Ok(());
    }
    let mut c = format!("{:x}\r\n", b.len()).into_bytes();
    c.extend_from_slice(b);
    c.extend_from_slice(b"\r\n");
    s.write_all(&c).await
}

async fn serve(
    mut s: TcpStream,
    cases: Arc<HashMap<String, Answer>>,
    seen: Arc<Mutex<Vec<(String, String)>>>,
) -> Result<()> {
    loop {
        let head = read_request(&mut s).await?;
        let case = header(&head, "x-case").unwrap_or_default();
        let id = header(&head, "x-request-id").unwrap_or_default();
        seen.lock().unwrap().push((case.clone(), id));
        let Some(a) = cases.get(&case).cloned() else {
            s.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                .await?;
            continue;
        };
        tokio::time::sleep(a.head_delay).await;
        let mut out = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n".to_vec();
        for h in &a.headers {
            out.extend_from_slice(h.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        s.write_all(&out).await?;
        let chunk = if a.chunk == 0 {
            a.body.len().max(1)
        } else {
            a.chunk
        };
        let mut sent = 0usize;
        for piece in a.body.chunks(chunk) {
            if let Some(p) = a.pause_at {
                if sent <= p && p < sent + piece.len() {
                    let (x, y) = piece.split_at(p - sent);
                    write_chunk(&mut s, x).await?;
                    tokio::time::sleep(a.pause).await;
                    write_chunk(&mut s, y).await?;
                    sent += piece.len();
                    continue;
                }
            }
            write_chunk(&mut s, piece).await?;
            sent += piece.len();
        }
        tokio::time::sleep(a.hold_end).await;
        s.write_all(b"0\r\n\r\n").await?;
    }
}

impl RawUpstream {
    pub async fn start(cases: HashMap<String, Answer>) -> RawUpstream {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let cases = Arc::new(cases);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((s, _)) = l.accept().await else { return };
                let (c, sn) = (cases.clone(), seen2.clone());
                tokio::spawn(async move {
                    let _ = serve(s, c, sn).await;
                });
            }
        });
        RawUpstream { addr, seen, task }
    }

    /// The x-request-ids seen for `case`.
    pub fn ids(&self, case: &str) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(c, _)| c == case)
            .map(|(_, i)| i.clone())
            .collect()
    }
}

/// An SSE data event (vLLM chat chunk framing) carrying `text`.
pub fn event(i: usize, finish: bool) -> Vec<u8> {
    let fin = if finish { "\"stop\"" } else { "null" };
    format!("data: {{\"id\":\"x\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" t{i}\"}},\"finish_reason\":{fin}}}]}}\n\n").into_bytes()
}

/// `n` events, the last with a finish reason, then `[DONE]`.
pub fn healthy_sse(n: usize) -> Vec<u8> {
    let mut b = Vec::new();
    for i in 0..n {
        b.extend(event(i, i + 1 == n));
    }
    b.extend_from_slice(b"data: [DONE]\n\n");
    b
}
