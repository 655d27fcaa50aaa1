//! A TCP relay that can be shut like a gate: open, it copies bytes both ways; shut, it
//! drops every connection it carries and every new one at once. Tests put it on one path
//! only (e.g. the gateway's lease renewals to kvguard-control) to black-hole that path
//! while the others keep flowing.

use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running gate; dropping it stops it (and drops its connections).
pub struct Gate {
    addr: SocketAddr,
    open: Arc<watch::Sender<bool>>,
    task: tokio::task::JoinHandle<()>,
}

impl Gate {
    /// Relays `127.0.0.1:<any port>` to `upstream`, open.
    pub async fn spawn(upstream: SocketAddr) -> Result<Gate> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .context("binding the gate")?;
        let addr = listener.local_addr()?;
        let (tx, rx) = watch::channel(true);
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                if !*rx.borrow() {
                    drop(down);
                    continue;
                }
                let mut rx = rx.clone();
                tokio::spawn(async move {
                    let Ok(up) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut down, mut up) = (down, up);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                        _ = rx.wait_for(|open| !*open) => {}
                    }
                });
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
        self.open.send_replace(open);
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.set_open(false);
        self.task.abort();
    }
}
