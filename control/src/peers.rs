//! The other kvguard-control replicas (`--peers`, contract §4, §8).
//!
//! With several replicas behind one `control_cluster`, an abort sent before the
//! `x-kvguard-control` stamp arrived (a request abandoned while queued) usually reaches
//! the wrong replica, and a renewal reaches one replica per period. So a replica forwards
//! an abort for an id it does not hold to every peer, and an accepted renewal too:
//! signed envelopes ([`kvguard_contract::Forwarded`]) on their own paths, which a replica
//! never forwards again (one hop, loop-free). A peer that does not answer within
//! [`PEER_TIMEOUT`] is counted and skipped, never fatal. Forwarding an abort is
//! [`crate::abort::peer`]; this module is the peer set, its client and the envelope.
//!
//! `--peers` entries are resolved every [`RESOLVE_EVERY`] (a headless Service name
//! resolves to every replica); this replica's own address (`--peer-self`) is left out.

use crate::config::PeerConfig;
use crate::engine::error_chain;
use crate::metrics::PeerMetrics;
use bytes::Bytes;
use http::{Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvguard_contract::{signature, Domain, Forwarded, Key, PEER_LEASE_PATH, SIGNATURE_HEADER};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Deadline of one forwarded call: well inside the filter's per-attempt abort timeout
/// (1 s by default), so a forwarded abort is answered before the filter gives up on it.
pub const PEER_TIMEOUT: Duration = Duration::from_millis(500);
/// How often `--peers` names are resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(5);
/// How long an idle connection to a peer is kept: below the admin listener's keep-alive
/// idle ([`crate::admin::HEAD_READ_TIMEOUT`]), so this side closes it first.
pub const POOL_IDLE: Duration = Duration::from_secs(10);
/// Largest peer answer body read.
const MAX_ANSWER: usize = 4096;

/// The peer set and the client that talks to it.
pub struct Peers {
    cfg: PeerConfig,
    name: String,
    client: Client<HttpConnector, Full<Bytes>>,
    resolved: Mutex<Option<(Instant, Vec<SocketAddr>)>>,
    refreshing: AtomicBool,
    metrics: PeerMetrics,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("urls", &self.cfg.urls)
            .field("self", &self.cfg.self_addr)
            .finish_non_exhaustive()
    }
}

impl Peers {
    /// From the validated `--peers` / `--peer-self`; counts into `metrics`.
    pub fn new(cfg: PeerConfig, metrics: PeerMetrics) -> Peers {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(PEER_TIMEOUT));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_max_idle_per_host(8)
            .build(conn);
        Peers {
            name: cfg.self_addr.to_string(),
            cfg,
            client,
            resolved: Mutex::new(None),
            refreshing: AtomicBool::new(false),
            metrics,
        }
    }

    /// This replica's name in the envelopes it sends.
    pub fn self_name(&self) -> &str {
        &self.name
    }

    /// The peer addresses now: `--peers` resolved, this replica left out. Only the first
    /// call waits for the resolution; later ones get the last answer at once while a
    /// resolution older than [`RESOLVE_EVERY`] is redone in the background (an abort
    /// never waits for DNS once the replica has resolved its peers).
    pub async fn addrs(self: &Arc<Self>) -> Vec<SocketAddr> {
        let cached = self.resolved.lock().ok().and_then(|g| g.clone());
        match cached {
            Some((at, addrs)) => {
                if at.elapsed() >= RESOLVE_EVERY && !self.refreshing.swap(true, Ordering::AcqRel) {
                    let this = self.clone();
                    tokio::spawn(async move {
                        this.resolve().await;
                        this.refreshing.store(false, Ordering::Release);
                    });
                }
                addrs
            }
            None => self.resolve().await,
        }
    }

    /// Resolves `--peers` (a failed name keeps its last addresses) and caches the answer.
    async fn resolve(&self) -> Vec<SocketAddr> {
        let now = Instant::now();
        let previous = self
            .resolved
            .lock()
            .ok()
            .and_then(|g| g.clone())
            .map(|(_, a)| a)
            .unwrap_or_default();
        let mut out: Vec<SocketAddr> = Vec::new();
        for url in &self.cfg.urls {
            let target = if url.host.contains(':') {
                format!("[{}]:{}", url.host, url.port)
            } else {
                format!("{}:{}", url.host, url.port)
            };
            match tokio::time::timeout(PEER_TIMEOUT, tokio::net::lookup_host(target.clone())).await
            {
                Ok(Ok(it)) => out.extend(it),
                Ok(Err(e)) => {
                    tracing::warn!(peer = %url, error = %e, "--peers: cannot resolve; keeping its last addresses");
                    out.extend(previous.iter().filter(|a| a.port() == url.port));
                }
                Err(_) => {
                    tracing::warn!(peer = %url, "--peers: resolution timed out; keeping its last addresses");
                    out.extend(previous.iter().filter(|a| a.port() == url.port));
                }
            }
        }
        out.retain(|a| *a != self.cfg.self_addr);
        out.sort();
        out.dedup();
        self.metrics.peers.set(out.len() as i64);
        if let Ok(mut g) = self.resolved.lock() {
            *g = Some((now, out.clone()));
        }
        out
    }

    /// The envelope of `body` signed with `key` at `unix_secs`, or `None` without a key
    /// (never: `--peers` needs one; see [`crate::state::KeySet::envelope_key`]).
    pub(crate) fn envelope(
        &self,
        key: Option<&Key>,
        unix_secs: u64,
        body: &[u8],
    ) -> Option<(Bytes, String)> {
        let env = Forwarded::new(&self.name, body)?.to_json();
        let sig = signature::sign(Domain::Envelope, key?, unix_secs, &env);
        Some((Bytes::from(env), sig))
    }

    pub(crate) async fn post(
        &self,
        peer: SocketAddr,
        path: &'static str,
        body: Bytes,
        sig: String,
    ) -> Result<(StatusCode, Bytes), String> {
        let uri: Uri = format!("http://{peer}{path}")
            .parse()
            .map_err(|e| format!("{peer}: {e}"))?;
        let req = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(SIGNATURE_HEADER, sig)
            .body(Full::new(body))
            .map_err(|e| format!("{peer}: {e}"))?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| format!("{peer}: {}", error_chain(&e)))?;
            let status = resp.status();
            let bytes = Limited::new(resp.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| format!("{peer}: reading the answer: {e}"))?
                .to_bytes();
            Ok::<_, String>((status, bytes))
        };
        tokio::time::timeout(PEER_TIMEOUT, fut)
            .await
            .map_err(|_| format!("{peer}: no answer within {PEER_TIMEOUT:?}"))?
    }

    /// Forwards a renewal body this replica accepted to every peer, in the background.
    /// Signed with `key` at `unix_secs` ([`Peers::envelope`]).
    pub fn fan_out_renewal(self: &Arc<Self>, key: Option<Key>, unix_secs: u64, body: Vec<u8>) {
        let this = self.clone();
        tokio::spawn(async move {
            let peers = this.addrs().await;
            let Some((env, sig)) = this.envelope(key.as_ref(), unix_secs, &body) else {
                return;
            };
            for peer in peers {
                let (this, env, sig) = (this.clone(), env.clone(), sig.clone());
                tokio::spawn(async move {
                    match this.post(peer, PEER_LEASE_PATH, env, sig).await {
                        Ok((s, _)) if s == StatusCode::OK => this.metrics.forward("renewal", "ok"),
                        Ok((s, b)) => {
                            this.metrics.forward("renewal", "failed");
                            tracing::warn!(%peer, status = s.as_u16(), answer = %String::from_utf8_lossy(&b), "forwarded renewal refused by the peer");
                        }
                        Err(e) => {
                            this.metrics.forward("renewal", "failed");
                            tracing::debug!(%peer, error = %e, "forwarded renewal: peer unreachable");
                        }
                    }
                });
            }
        });
    }
}
