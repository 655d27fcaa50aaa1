//! Forwarding an abort to the other replicas (`--peers`, contract §4): an abort for an id
//! not in flight here goes to every peer at once, as a signed envelope on
//! `POST /v1/peer/abort`; the first peer that holds the id answers for it.

use crate::peers::Peers;
use crate::state::AppState;
use bytes::Bytes;
use http::StatusCode;
use kvguard_contract::PEER_ABORT_PATH;
use std::net::SocketAddr;
use std::sync::Arc;

/// A peer's answer to a forwarded abort that found the id: status and body, passed on
/// to the abort's sender as they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAnswer {
    /// The peer that held the id.
    pub peer: SocketAddr,
    /// Its status (200).
    pub status: StatusCode,
    /// Its JSON body.
    pub body: Bytes,
}

impl Peers {
    /// Forwards an abort body (already verified here) to every peer at once; the first
    /// peer that holds the id (200) answers for it. `None`: no peer holds it (each
    /// answered 404, or failed: counted per peer).
    pub async fn forward_abort(
        self: &Arc<Self>,
        st: &Arc<AppState>,
        body: &[u8],
    ) -> Option<PeerAnswer> {
        let peers = self.addrs(st).await;
        let (env, sig) = self.envelope(st, body)?;
        if peers.is_empty() {
            return None;
        }
        let (tx, mut rx) = tokio::sync::mpsc::channel(peers.len());
        for peer in peers {
            let (this, st, env, sig, tx) = (
                self.clone(),
                st.clone(),
                env.clone(),
                sig.clone(),
                tx.clone(),
            );
            // Each call finishes (and is counted) on its own, even after another peer
            // answered.
            tokio::spawn(async move {
                let r = this.post(peer, PEER_ABORT_PATH, env, sig).await;
                let found = match r {
                    Ok((s, b)) if s == StatusCode::OK => {
                        st.metrics.peer.forward("abort", "ok");
                        Some(PeerAnswer {
                            peer,
                            status: s,
                            body: b,
                        })
                    }
                    Ok((s, _)) if s == StatusCode::NOT_FOUND => {
                        st.metrics.peer.forward("abort", "not_found");
                        None
                    }
                    Ok((s, b)) => {
                        st.metrics.peer.forward("abort", "failed");
                        tracing::warn!(%peer, status = s.as_u16(), answer = %String::from_utf8_lossy(&b), "forwarded abort refused by the peer (check that every replica has the same keys and a clock within 30 s)");
                        None
                    }
                    Err(e) => {
                        st.metrics.peer.forward("abort", "failed");
                        tracing::warn!(%peer, error = %e, "forwarded abort: peer unreachable");
                        None
                    }
                };
                let _ = tx.send(found).await;
            });
        }
        drop(tx);
        while let Some(r) = rx.recv().await {
            if r.is_some() {
                return r;
            }
        }
        None
    }
}
