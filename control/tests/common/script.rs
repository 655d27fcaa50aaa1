//! A scripted engine for the connection-path tests: bodies the simulator does not make.
//!
//! - `/flood`: SSE events of 16 KiB each, as fast as the connection takes them, forever
//!   (fills every buffer on the way when the client stops reading);
//! - `/short`: three SSE events and `[DONE]`;
//! - `/gzip-sse`, `/gzip-ndjson`: an SSE / NDJSON body with `content-encoding: gzip`, 15
//!   opaque chunks 100 ms apart; the first happens to read as one SSE event / NDJSON line
//!   (compressed bytes may), the others have no line end;
//! - `/plain`, `/octet`: 15 chunks of `text/plain` / `application/octet-stream`, 100 ms
//!   apart (a flowing body with nothing to count in it).
//!
//! It counts the response bodies that were dropped before their end (the engine saw its
//! connection close).

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;

/// Requests seen: path and `authorization` header.
pub type Seen = Arc<std::sync::Mutex<Vec<(String, Option<String>)>>>;

pub struct Script {
    pub addr: SocketAddr,
    pub cut: Arc<AtomicU64>,
    /// Every request's path and `authorization` header, in order.
    pub seen: Seen,
    task: tokio::task::JoinHandle<()>,
}

impl Script {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// Response bodies dropped before their end.
    pub fn cut(&self) -> u64 {
        self.cut.load(Ordering::Acquire)
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct ChanBody {
    rx: mpsc::Receiver<Bytes>,
    done: bool,
    cut: Arc<AtomicU64>,
}

impl HttpBody for ChanBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(b)) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for ChanBody {
    fn drop(&mut self) {
        if !self.done {
            self.cut.fetch_add(1, Ordering::AcqRel);
        }
    }
}

fn respond(path: &str, cut: Arc<AtomicU64>) -> Response<ChanBody> {
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let ct = match path {
        "/plain" => "text/plain",
        "/octet" => "application/octet-stream",
        "/gzip-ndjson" => "application/x-ndjson",
        _ => "text/event-stream",
    };
    let gzip = path.starts_with("/gzip-");
    let path = path.to_owned();
    tokio::spawn(async move {
        match path.as_str() {
            "/flood" => {
                let ev = Bytes::from(format!("data: {}\n\n", "x".repeat(16 * 1024)));
                while tx.send(ev.clone()).await.is_ok() {}
            }
            "/gzip-sse" | "/gzip-ndjson" => {
                let _ = tx.send(Bytes::from_static(b"data: \x1f\x8b\n\n")).await;
                for _ in 1..15 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if tx
                        .send(Bytes::from_static(b"\x8b\x08\x00\xf3\x48\xcd"))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
            "/plain" | "/octet" => {
                for i in 0..15 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if tx.send(Bytes::from(format!("chunk {i}\n"))).await.is_err() {
                        return;
                    }
                }
            }
            _ => {
                for i in 0..3 {
                    let _ = tx.send(Bytes::from(format!("data: {i}\n\n"))).await;
                }
                let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            }
        }
    });
    let mut b = Response::builder().header("content-type", ct);
    if gzip {
        b = b.header("content-encoding", "gzip");
    }
    b.body(ChanBody {
        rx,
        done: false,
        cut,
    })
    .unwrap()
}

pub async fn spawn() -> Script {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let cut = Arc::new(AtomicU64::new(0));
    let seen: Seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (c, sn) = (cut.clone(), seen.clone());
    let task = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let (c, sn) = (c.clone(), sn.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let c = c.clone();
                    let auth = req
                        .headers()
                        .get("authorization")
                        .map(|v| v.to_str().unwrap_or("?").to_owned());
                    sn.lock().unwrap().push((req.uri().path().to_owned(), auth));
                    async move { Ok::<_, Infallible>(respond(req.uri().path(), c)) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    Script {
        addr,
        cut,
        seen,
        task,
    }
}
