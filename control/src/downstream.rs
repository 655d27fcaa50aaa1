//! Ending the downstream side of a request whose client stopped reading.
//!
//! After kvguard ends a request, its final SSE event (or the cut) reaches the client only
//! if the client reads. A client that stopped reading (the stalled case) leaves hyper with
//! a full send buffer: the response body is never polled again and never dropped. So every
//! request runs inside a [`Downstream`] scope, and once the post-abort deadline passes the
//! scope's task is dropped: on HTTP/2 that task is the one stream (hyper spawns each
//! stream on the executor, and dropping it resets that stream with `CANCEL`; the other
//! streams of the connection, other clients' behind a router or mesh, go on); on HTTP/1.1
//! it is the connection task, so the connection is closed.

use std::future::Future;
use tokio_util::sync::CancellationToken;

tokio::task_local! {
    static CURRENT: Downstream;
}

/// What ending the downstream side cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// An HTTP/1.1 connection (or an h2 connection before its streams are spawned).
    Connection,
    /// One HTTP/2 stream.
    H2Stream,
}

impl Scope {
    /// The log and metric form.
    pub const fn as_str(self) -> &'static str {
        match self {
            Scope::Connection => "connection",
            Scope::H2Stream => "h2_stream",
        }
    }
}

/// The handle that ends one downstream task.
#[derive(Debug, Clone)]
pub struct Downstream {
    token: CancellationToken,
    scope: Scope,
}

impl Downstream {
    /// A handle for a new task of this scope.
    pub fn new(scope: Scope) -> Downstream {
        Downstream {
            token: CancellationToken::new(),
            scope,
        }
    }

    /// The handle of the task polling the caller, if it runs in a scope.
    pub fn current() -> Option<Downstream> {
        CURRENT.try_with(Downstream::clone).ok()
    }

    /// What it cuts.
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// Ends the task (it is dropped at its next wake-up, at once if idle).
    pub fn cut(&self) {
        self.token.cancel();
    }

    /// Runs `fut` in this scope until it ends or [`Downstream::cut`] is called.
    pub async fn run<F: Future>(self, fut: F) {
        let token = self.token.clone();
        CURRENT
            .scope(self, async move {
                tokio::select! {
                    _ = fut => {}
                    _ = token.cancelled() => {}
                }
            })
            .await;
    }
}

/// The executor hyper spawns HTTP/2 streams on: each stream in its own [`Downstream`]
/// scope, so that ending a request resets its stream only.
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamExecutor;

impl<F> hyper::rt::Executor<F> for StreamExecutor
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        tokio::spawn(Downstream::new(Scope::H2Stream).run(fut));
    }
}
