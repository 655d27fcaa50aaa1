//! Shared HTTP plumbing for the instruments: an accept loop serving HTTP/1.1 and h2c
//! (hyper-util's auto builder), and body types.

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

/// The response body type of every instrument.
pub(crate) type RespBody = BoxBody<Bytes, std::io::Error>;

/// A whole body.
pub(crate) fn full(b: impl Into<Bytes>) -> RespBody {
    Full::new(b.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

/// A JSON response.
pub(crate) fn json_response(status: u16, v: &serde_json::Value) -> Response<RespBody> {
    bytes_response(
        status,
        "application/json",
        serde_json::to_vec(v).unwrap_or_default(),
    )
}

/// A response with a content type.
pub(crate) fn bytes_response(
    status: u16,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<RespBody> {
    let mut r = Response::new(full(body));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// A streaming body fed by a channel. When hyper drops it (client gone, stream reset),
/// the sender sees the channel closed: that is how the instruments detect disconnects.
/// An `Err` item ends the body with an error: hyper then resets the stream (h2
/// RST_STREAM) or closes the connection without finishing the body (HTTP/1.1).
pub(crate) struct ChannelBody {
    pub(crate) rx: mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>>,
    /// Counts the bytes hyper took from the body (what the socket accepted, roughly).
    pub(crate) taken: Option<Arc<std::sync::atomic::AtomicU64>>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let polled = self.rx.poll_recv(cx);
        if let (Poll::Ready(Some(Ok(b))), Some(t)) = (&polled, &self.taken) {
            t.fetch_add(b.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        polled.map(|o| o.map(|r| r.map(Frame::data)))
    }
}

/// Reads a whole request body, at most `limit` bytes.
pub(crate) async fn read_body(body: Incoming, limit: usize) -> Result<Bytes, String> {
    let limited = http_body_util::Limited::new(body, limit);
    limited
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| e.to_string())
}

/// A running accept loop; dropping the handle stops it and every connection.
pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Server {
    /// Stops accepting and drops every connection.
    pub(crate) fn stop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Serves `handler` on `listener` (HTTP/1.1 and h2c). A handler answering `Err` closes
/// the connection without a response.
pub(crate) fn serve<H, F>(listener: TcpListener, handler: H) -> std::io::Result<Server>
where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Send + Sync + 'static,
    F: Future<Output = Result<Response<RespBody>, std::io::Error>> + Send + 'static,
{
    let addr = listener.local_addr()?;
    let (stop, mut stop_rx) = watch::channel(false);
    let handler = Arc::new(handler);
    let task = tokio::spawn(async move {
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                _ = stop_rx.changed() => break,
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
                accepted = listener.accept() => {
                    let Ok((stream, peer)) = accepted else { continue };
                    let _ = stream.set_nodelay(true);
                    let handler = handler.clone();
                    conns.spawn(async move {
                        let svc = hyper::service::service_fn(move |req| handler(req, peer));
                        let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                        let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                    });
                }
            }
        }
        conns.abort_all();
    });
    Ok(Server {
        addr,
        stop,
        task: Some(task),
    })
}

/// Connections the kernel queues for an instrument's listener before it accepts them
/// (capped by `net.core.somaxconn`). tokio's `bind` asks for 1,024: e2e_sim's storm opens
/// 2,000 streams through the lossy hop within 500 ms, and on a loaded 2-core machine Envoy's
/// connections past the queue timed out (its 2 s connect timeout: 224 of 2,000 answered 503
/// "upstream connect error ... connection timeout").
const LISTEN_BACKLOG: u32 = 4096;

/// Binds `addr` (default `127.0.0.1:0`) with [`LISTEN_BACKLOG`] and address reuse (as
/// tokio's `bind` sets it).
pub(crate) async fn bind(addr: Option<SocketAddr>) -> std::io::Result<TcpListener> {
    let addr = addr.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let s = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    s.set_reuseaddr(true)?;
    s.bind(addr)?;
    s.listen(LISTEN_BACKLOG)
}
