//! A TCP relay that can be shut like a gate: open, it copies bytes both ways; shut, it
//! drops every connection it carries and every new one at once; refusing new ones, it
//! keeps carrying the connections it has and drops every new one (a hop forwarding each
//! request on a fresh connection then passes the streams already running and fails every
//! new request); forbidding, it answers every HTTP/1.1 request itself with 403 (an
//! AuthorizationPolicy's answer). Tests put it on one path only (e.g. the gateway's lease
//! renewals to kvguard-control) to cut that path while the others keep flowing.

use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the gate does with a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Open,
    Shut,
    RefuseNew,
    Forbid,
}

/// A running gate; dropping it stops it (and drops its connections).
pub struct Gate {
    addr: SocketAddr,
    open: Arc<watch::Sender<Mode>>,
    task: tokio::task::JoinHandle<()>,
}

/// Answers each HTTP/1.1 request on `conn` with 403 until the client closes it.
async fn forbid(mut conn: TcpStream) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < end + 4 + len {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..end + 4 + len);
        let answer = b"HTTP/1.1 403 Forbidden\r\ncontent-type: text/plain\r\ncontent-length: 14\r\n\r\nRBAC: denied\r\n";
        if conn.write_all(answer).await.is_err() {
            return;
        }
    }
}

impl Gate {
    /// Relays `127.0.0.1:<any port>` to `upstream`, open.
    pub async fn spawn(upstream: SocketAddr) -> Result<Gate> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .context("binding the gate")?;
        let addr = listener.local_addr()?;
        let (tx, rx) = watch::channel(Mode::Open);
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let mode = *rx.borrow();
                let mut rx = rx.clone();
                match mode {
                    Mode::Shut | Mode::RefuseNew => drop(down),
                    Mode::Forbid => {
                        tokio::spawn(async move {
                            tokio::select! {
                                _ = forbid(down) => {}
                                _ = rx.wait_for(|m| *m != Mode::Forbid) => {}
                            }
                        });
                    }
                    Mode::Open => {
                        tokio::spawn(async move {
                            let Ok(up) = TcpStream::connect(upstream).await else {
                                return;
                            };
                            let (mut down, mut up) = (down, up);
                            tokio::select! {
                                _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                                _ = rx.wait_for(|m| !matches!(m, Mode::Open | Mode::RefuseNew)) => {}
                            }
                        });
                    }
                }
            }
        });
        Ok(Gate {
            addr,
            open: Arc::new(tx),
            task,
        })
    }

    /// The address to connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Opens or shuts the gate (shutting drops every connection it carries).
    pub fn set_open(&self, open: bool) {
        self.open
            .send_replace(if open { Mode::Open } else { Mode::Shut });
    }

    /// Drops every new connection from now on and keeps carrying the ones it has, until
    /// [`Gate::set_open`].
    pub fn refuse_new(&self) {
        self.open.send_replace(Mode::RefuseNew);
    }

    /// Answers every request with 403 from now on (connections it relays are dropped),
    /// until [`Gate::set_open`].
    pub fn forbid(&self) {
        self.open.send_replace(Mode::Forbid);
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.set_open(false);
        self.task.abort();
    }
}
