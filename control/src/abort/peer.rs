//! Forwarding an abort to the other replicas (`--peers`, contract §4): an abort for an id
//! not in flight here goes to every peer at once, as a signed envelope on
//! `POST /v1/peer/abort`; the first peer that holds the id answers for it. An abort of a
//! disaggregated request's leg goes to every peer whatever is held here, and every
//! answer is collected ([`Peers::fan_out_abort`]).

use crate::peers::Peers;
use crate::state::AppState;
use bytes::Bytes;
use http::StatusCode;
use kvguard_contract::{Leg, PEER_ABORT_PATH};
use kvguard_control_core::abort::{answer_deferred, legs_of};
use std::net::SocketAddr;
use std::sync::Arc;

/// What the peers said to a forwarded abort ([`Peers::forward_abort`]).
#[derive(Debug)]
pub struct Forward {
    /// The first peer that holds the id, if any.
    pub holder: Option<PeerAnswer>,
    /// Every peer answered (200 or 404) rather than failed; without a holder, whether
    /// nobody holds the id is known ([`kvguard_control_core::abort::ask_again`]).
    pub every_peer_answered: bool,
}

/// What the peers said to an abort fanned out to every leg ([`Peers::fan_out_abort`]).
#[derive(Debug)]
pub struct FanOut {
    /// The legs every peer that held the id reported.
    pub legs: Vec<Leg>,
    /// A peer deferred the abort (it holds the stream, whose reader drains).
    pub deferred: bool,
    /// Every peer answered (200 or 404) rather than failed.
    pub every_peer_answered: bool,
}

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
    /// Whether it deferred the abort.
    pub deferred: bool,
}

impl Peers {
    /// Forwards an abort body (already verified here) to every peer at once; the first
    /// peer that holds the id (200) answers for it. Without one: whether every peer
    /// answered (404) rather than failed (counted per peer).
    pub async fn forward_abort(self: &Arc<Self>, st: &Arc<AppState>, body: &[u8]) -> Forward {
        let nobody = |every_peer_answered| Forward {
            holder: None,
            every_peer_answered,
        };
        let peers = self.addrs().await;
        let keys = st.keys();
        let Some((env, sig)) = self.envelope(keys.envelope_key(), st.clock.unix_secs(), body)
        else {
            return nobody(false);
        };
        if peers.is_empty() {
            return nobody(true);
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
                // `Err`: the peer did not answer.
                let found = match r {
                    Ok((s, b)) if s == StatusCode::OK => {
                        st.metrics.peer.forward("abort", "ok");
                        Ok(Some(PeerAnswer {
                            peer,
                            status: s,
                            deferred: answer_deferred(&b),
                            body: b,
                        }))
                    }
                    Ok((s, _)) if s == StatusCode::NOT_FOUND => {
                        st.metrics.peer.forward("abort", "not_found");
                        Ok(None)
                    }
                    Ok((s, b)) => {
                        st.metrics.peer.forward("abort", "failed");
                        tracing::warn!(%peer, status = s.as_u16(), answer = %String::from_utf8_lossy(&b), "forwarded abort refused by the peer (check that every replica has the same keys and a clock within 30 s)");
                        Err(())
                    }
                    Err(e) => {
                        st.metrics.peer.forward("abort", "failed");
                        tracing::warn!(%peer, error = %e, "forwarded abort: peer unreachable");
                        Err(())
                    }
                };
                let _ = tx.send(found).await;
            });
        }
        drop(tx);
        let mut every_peer_answered = true;
        while let Some(r) = rx.recv().await {
            match r {
                Ok(Some(a)) => {
                    return Forward {
                        holder: Some(a),
                        every_peer_answered,
                    }
                }
                Ok(None) => {}
                Err(()) => every_peer_answered = false,
            }
        }
        nobody(every_peer_answered)
    }
}

impl Peers {
    /// Sends an abort body (already verified here) to every peer at once and waits for
    /// each (each call is bounded, 500 ms): the legs every peer that held the id reports
    /// (its answer's `legs`; an answer without them, from a peer that is not part of a
    /// disaggregated pair, is one leg with no role). Peers that did not hold it (404) or
    /// failed (counted) add nothing.
    pub async fn fan_out_abort(self: &Arc<Self>, st: &Arc<AppState>, body: &[u8]) -> FanOut {
        let peers = self.addrs().await;
        let keys = st.keys();
        let Some((env, sig)) = self.envelope(keys.envelope_key(), st.clock.unix_secs(), body)
        else {
            return FanOut {
                legs: Vec::new(),
                deferred: false,
                every_peer_answered: false,
            };
        };
        let mut calls = tokio::task::JoinSet::new();
        for peer in peers {
            let (this, st, env, sig) = (self.clone(), st.clone(), env.clone(), sig.clone());
            // `None`: the peer did not answer.
            calls.spawn(async move {
                match this.post(peer, PEER_ABORT_PATH, env, sig).await {
                    Ok((s, b)) if s == StatusCode::OK => {
                        st.metrics.peer.forward("abort", "ok");
                        if answer_deferred(&b) {
                            return Some((Vec::new(), true));
                        }
                        Some((legs_of(&peer.to_string(), &b), false))
                    }
                    Ok((s, _)) if s == StatusCode::NOT_FOUND => {
                        st.metrics.peer.forward("abort", "not_found");
                        Some((Vec::new(), false))
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
                }
            });
        }
        let mut out = FanOut {
            legs: Vec::new(),
            deferred: false,
            every_peer_answered: true,
        };
        while let Some(r) = calls.join_next().await {
            match r.ok().flatten() {
                Some((legs, deferred)) => {
                    out.legs.extend(legs);
                    out.deferred |= deferred;
                }
                None => out.every_peer_answered = false,
            }
        }
        out
    }
}
