//! What happens to an abort: `POST /v1/abort` (contract §3), and how any request is ended
//! here (the abort API, the reaper, the lease, shutdown).
//!
//! 1. [`endpoint`] reads the call: the body (at most 4096 bytes), the signature (an
//!    abort's, any configured key, `t` within ±30 s), the replay memory
//!    ([`crate::replay`], its own lock), then the body's fields. A `stalled` abort for a
//!    stream here that is only slow to drain is answered `deferred` and changes nothing
//!    ([`AppState::defers`]).
//! 2. [`abort`] decides and carries it out. With `--peers`, an id not in flight here is
//!    forwarded to every peer ([`peer`]) and the first that holds it answers; otherwise,
//!    or when no peer holds it, it is decided here under the table lock
//!    ([`AppState::abort_or_tombstone`]): ended, already ended, or tombstoned so that the
//!    request is refused if it arrives later. A leg of a prefill/decode disaggregated
//!    request goes to every peer, and a held prefill hand-off is released
//!    ([`crate::pd`]); the answer lists the legs. Every decision on that way is the
//!    control core's ([`kvguard_control_core::abort`]: the route, what follows the
//!    peers' answers, the legs and the count); this module carries them out.
//! 3. Ending ([`AppState::end_request`], and the abort API's own path) removes the
//!    [`crate::table`] entry, tombstones the id ([`crate::tombstones`]), cancels the entry
//!    (the [`crate::proxy`]'s response body sends the final SSE event), closes the engine
//!    connection, calls the engine's abort API, and arms the deadline after which
//!    [`crate::downstream`] cuts the client's side.
//! 4. [`endpoint`] answers per contract §3's table and counts the answer.
//!
//! `POST /v1/peer/abort`, an abort another replica forwarded, is in [`endpoint`] too: opened
//! as an envelope, decided here only, never forwarded again.

pub mod endpoint;
pub mod peer;

use crate::config::PdRole;
use crate::metrics::outcome;
use crate::pd::PdLeg;
use crate::state::AppState;
use crate::table::{ClientGone, Entry};
use kvguard_contract::{AbortReason, AbortRequest, Leg, RequestId};
pub use kvguard_control_core::abort::deferrable;
use kvguard_control_core::abort::{
    after_fan_out, after_forward, ask_again, leg_result, release_result, route, tombstones_missing,
    FannedOut, Forwarded, Route,
};
pub use kvguard_control_core::abort::{summary, AbortFound};
use kvguard_control_core::cut::{self, Ask, Cut, Here};
use kvguard_control_core::inflight::AbortHere;
use peer::PeerAnswer;
use std::sync::Arc;
use std::time::Duration;

/// Where an abort was decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decided {
    /// Here: what this replica found.
    Here(AbortFound),
    /// By the peer that held the id (`--peers`): its answer, passed on as it is. This
    /// replica tombstoned the id too (not in a dry run).
    Peer(PeerAnswer),
    /// A leg of a disaggregated request: every holder's part, this replica's first
    /// (empty: nobody held it; it is tombstoned here and at every peer that answered).
    Legs(Vec<Leg>),
    /// Deferred: a leg of a disaggregated request whose holder deferred the abort (its
    /// reader drains), or a stall ask held nowhere
    /// ([`AppState::defers_held_nowhere`]). Nothing was ended, released or tombstoned.
    Deferred,
    /// A peer did not answer, and its answer could change this one
    /// ([`kvguard_control_core::abort::ask_again`]): 503, the sender asks again. What was
    /// found here was done all the same.
    AskAgain,
}

impl Decided {
    /// Nobody holds it: not here, and every peer answered so.
    pub fn held_nowhere(&self) -> bool {
        match self {
            Decided::Here(found) => *found == AbortFound::NotFound,
            Decided::Legs(legs) => legs.is_empty(),
            Decided::Peer(_) | Decided::Deferred | Decided::AskAgain => false,
        }
    }
}

/// Decides and carries out a verified abort of `id` for `reason` (`body`: the call's body
/// as signed, forwarded verbatim to the peers). `gone`: how long ago the sender saw the
/// client go and how many data events it had passed on (the body's `gone_ms`, `tokens`).
///
/// **Prefill/decode disaggregation**: the same id is held on a prefill replica and a
/// decode replica at once (or the prefill engine holds the finished prefill's blocks for
/// the decode side). When this replica has a `--pd-role`, holds the id as a leg (its body
/// carried `kv_transfer_params`) or holds its prefill hand-off, the abort goes to every
/// peer and waits for each ([`crate::peers::Peers::fan_out_abort`]); every holder ends
/// its leg, and a hand-off's blocks are released through a decode engine
/// ([`AppState::release_handoff`]). The answer lists the legs.
///
/// Otherwise one holder at most: without peers, or when no peer holds the id (each
/// answered 404 or failed), it is decided here under the table lock: ended if it arrived
/// meanwhile, else tombstoned. Every replica that got the forward tombstoned the id, and
/// so does this one when a peer ended it: a request the abort overtook is refused
/// wherever it lands.
pub async fn abort(
    st: &Arc<AppState>,
    id: &RequestId,
    reason: AbortReason,
    gone: Option<(Duration, u64)>,
    deferrable: bool,
    body: &[u8],
) -> Decided {
    // A deferrable abort tombstones nothing it does not find ([`deferrable`]).
    let tomb = !deferrable;
    let leg_here = st.leg_in_flight(id);
    let pd = st.cfg.pd_role != PdRole::None || leg_here.is_some() || st.holds_handoff(id);
    let peers = st.peers.clone();
    match (route(pd, peers.is_some()), peers) {
        (Route::EveryLeg, Some(peers)) => {
            let here = st.abort_if_here(id, reason, gone);
            let remote = peers.fan_out_abort(st, body).await;
            let here = match after_fan_out(here, remote.deferred) {
                FannedOut::Deferred => {
                    tracing::debug!(request_id = %id, "stalled abort of a disaggregated request deferred by the replica that holds its stream");
                    return Decided::Deferred;
                }
                FannedOut::DecideHere => st.abort_here(
                    id,
                    reason,
                    gone,
                    tombstones_missing(deferrable, remote.every_peer_answered),
                ),
                FannedOut::Legs(found) => found,
            };
            let mut legs = st.legs_here(id, here, leg_here).await;
            legs.extend(remote.legs);
            // (For every leg, what was found does not matter: a leg may be missing.)
            if ask_again(Route::EveryLeg, true, remote.every_peer_answered) {
                return Decided::AskAgain;
            }
            Decided::Legs(legs)
        }
        (Route::HereThenPeer, Some(peers)) => match st.abort_if_here(id, reason, gone) {
            AbortFound::NotFound => {
                let fwd = peers.forward_abort(st, body).await;
                let next = after_forward(fwd.holder.as_ref().map(|a| a.deferred), st.cfg.dry_run);
                match (next, fwd.holder) {
                    (Forwarded::Peer { tombstone_here }, Some(a)) => {
                        if tombstone_here {
                            st.tombstone(id.clone(), reason);
                        }
                        Decided::Peer(a)
                    }
                    _ => {
                        let tomb = tombstones_missing(deferrable, fwd.every_peer_answered);
                        let found = st.abort_here(id, reason, gone, tomb);
                        let here = found != AbortFound::NotFound;
                        if ask_again(Route::HereThenPeer, here, fwd.every_peer_answered) {
                            return Decided::AskAgain;
                        }
                        Decided::Here(found)
                    }
                }
            }
            found => Decided::Here(found),
        },
        _ => {
            let here = st.abort_here(id, reason, gone, tomb);
            if pd {
                return Decided::Legs(st.legs_here(id, here, leg_here).await);
            }
            Decided::Here(here)
        }
    }
}

impl AppState {
    /// The disaggregation leg of the request `id` in flight here, if its body asked for one.
    pub fn leg_in_flight(&self, id: &RequestId) -> Option<PdLeg> {
        self.inner().get(id).and_then(|e| e.pd_leg())
    }

    /// This replica's name in an answer's legs: its address among the peers, else its
    /// `--advertise`, else its admin listener.
    pub fn replica_name(&self) -> String {
        self.cfg
            .peers
            .as_ref()
            .map(|p| p.self_addr)
            .or(self.cfg.advertise)
            .unwrap_or(self.cfg.admin_listen)
            .to_string()
    }

    /// This replica's legs of an abort of `id`: the request it found (`here`, its body's
    /// leg `leg`), and a held prefill hand-off, released ([`AppState::release_handoff`]).
    pub async fn legs_here(
        self: &Arc<Self>,
        id: &RequestId,
        here: AbortFound,
        leg: Option<PdLeg>,
    ) -> Vec<Leg> {
        let replica = self.replica_name();
        let role = |leg: Option<PdLeg>| {
            self.cfg
                .pd_role
                .name()
                .or(leg.map(PdLeg::as_str))
                .map(str::to_owned)
        };
        let mut legs = Vec::new();
        if let Some(result) = leg_result(here) {
            legs.push(Leg {
                replica: replica.clone(),
                role: role(leg),
                result,
            });
        }
        if let Some(r) = self.release_handoff(id).await {
            legs.push(Leg {
                replica,
                role: Some(PdLeg::Prefill.as_str().to_owned()),
                result: release_result(r),
            });
        }
        legs
    }

    /// Whether a gateway's abort of `id` is deferred rather than carried out, and why (for
    /// the log): [`cut::may_end`] on what is known here (in flight, with its clocks).
    /// Nothing changes: a deferral is only an answer.
    pub fn defers(&self, id: &RequestId, abort: &AbortRequest) -> Option<&'static str> {
        let ask = Ask::of(abort);
        let now = self.clock.now();
        match self.inner().judge(id, ask, now, &self.cfg.limits) {
            Cut::Defer(d) => Some(d.why()),
            Cut::End(_) | Cut::Keep => None,
        }
    }

    /// Whether an abort nobody holds (not here, and every peer answered so) is deferred
    /// rather than answered 404, and why: [`cut::may_end`] on [`Here::Nowhere`]. Nothing
    /// is held to free, and the stream may be a completed response whose gateway still
    /// drains its tail to a slow reader: a 404 would have the gateway cut that reader.
    pub fn defers_held_nowhere(&self, abort: &AbortRequest) -> Option<&'static str> {
        let ask = Ask::of(abort);
        match cut::may_end(Here::Nowhere, ask, self.clock.now(), &self.cfg.limits) {
            Cut::Defer(d) => Some(d.why()),
            Cut::End(_) | Cut::Keep => None,
        }
    }

    /// What the abort API does for `id`, decided under one lock: the request is in flight
    /// (it is ended), already ended (tombstoned), or not yet here (it is tombstoned, so it
    /// is refused when it arrives). An abort racing its request's admission therefore
    /// either ends it or refuses it, never answers 404 while it runs.
    ///
    /// `gone`: how long ago the sender saw the client go and how many data events it had
    /// passed on (the abort body's `gone_ms`, `tokens`), for the orphan's cost.
    pub fn abort_or_tombstone(
        self: &Arc<Self>,
        id: &RequestId,
        reason: AbortReason,
        gone: Option<(Duration, u64)>,
    ) -> AbortFound {
        self.abort_here(id, reason, gone, true)
    }

    /// Like [`AppState::abort_or_tombstone`], but an id not in flight here is left alone
    /// (no tombstone): a peer may hold it (`--peers`), and a tombstone here would be
    /// useless at best. [`AbortFound::NotFound`] then means "nothing written".
    pub fn abort_if_here(
        self: &Arc<Self>,
        id: &RequestId,
        reason: AbortReason,
        gone: Option<(Duration, u64)>,
    ) -> AbortFound {
        self.abort_here(id, reason, gone, false)
    }

    /// [`AppState::abort_or_tombstone`] (`tombstone_missing`) or
    /// [`AppState::abort_if_here`].
    pub fn abort_here(
        self: &Arc<Self>,
        id: &RequestId,
        reason: AbortReason,
        gone: Option<(Duration, u64)>,
        tombstone_missing: bool,
    ) -> AbortFound {
        let now = self.clock.now();
        let mut inner = self.inner();
        if let (Some(entry), Some((ago, delivered))) = (inner.get(id), gone) {
            entry.mark_client_gone(ClientGone {
                at: now.checked_sub(ago).unwrap_or(now),
                delivered,
                reason,
            });
        }
        let evicted_before = inner.tombstones_evicted();
        let outcome = inner.abort_here(id, reason, now, tombstone_missing);
        let evicted = inner.tombstones_evicted() - evicted_before;
        match outcome {
            AbortHere::End(entry) => {
                self.metrics.inflight.set(inner.len() as i64);
                self.count_tombstones(&inner, evicted);
                drop(inner);
                self.finish_end(&entry, reason, "abort_api");
                AbortFound::Ended
            }
            AbortHere::Observe(entry) => {
                drop(inner);
                self.observe(&entry, reason, "abort_api");
                AbortFound::Observed
            }
            AbortHere::Already => AbortFound::Already,
            AbortHere::NotFound { tombstoned } => {
                if tombstoned {
                    self.count_tombstones(&inner, evicted);
                } else if tombstone_missing {
                    drop(inner);
                    tracing::info!(request_id = %id, reason = %reason, outcome = outcome::DRY_RUN, "abort call for an id not in flight: would tombstone it (dry run)");
                }
                AbortFound::NotFound
            }
        }
    }

    /// Ends a request in flight for `reason` (`via`: `reaper`, `shutdown`, for the log).
    /// Returns `false` if it was already being ended.
    ///
    /// Enforce mode: the entry leaves the table and its id is tombstoned at once; the
    /// client's stream gets the final SSE event and ends, the engine connection is closed
    /// (vLLM, TGI, llama.cpp abort on disconnect), the engine's own abort is called per
    /// strategy, and if the client does not take its end within `--abort-flush-timeout`
    /// the downstream side is cut ([`crate::downstream`]). `--dry-run`: logged and
    /// counted once per request, nothing else.
    pub fn end_request(
        self: &Arc<Self>,
        entry: &Arc<Entry>,
        reason: AbortReason,
        via: &'static str,
    ) -> bool {
        if self.cfg.dry_run && via != "shutdown" {
            self.observe(entry, reason, via);
            return false;
        }
        {
            let now = self.clock.now();
            let mut inner = self.inner();
            let Some(evicted) = inner.end(entry, reason, now) else {
                return false;
            };
            self.metrics.inflight.set(inner.len() as i64);
            self.count_tombstones(&inner, evicted);
        }
        self.finish_end(entry, reason, via);
        true
    }

    /// `--dry-run`: what would be ended, logged and counted once per request.
    fn observe(&self, entry: &Entry, reason: AbortReason, via: &'static str) {
        if entry.mark_observed() {
            self.metrics.abort(reason, outcome::DRY_RUN);
            tracing::info!(request_id = %entry.id, reason = %reason, via, strategy = self.cfg.abort_strategy.as_str(), outcome = outcome::DRY_RUN, age_ms = self.age_ms(entry), events = entry.events(), "would end request (dry run)");
        }
    }

    fn age_ms(&self, entry: &Entry) -> u64 {
        let age = self
            .clock
            .now()
            .saturating_duration_since(entry.times().started);
        u64::try_from(age.as_millis()).unwrap_or(u64::MAX)
    }

    /// The part of ending that happens outside the lock: the client stream and the engine
    /// connection, the downstream deadline, the engine's abort API, the log line.
    fn finish_end(self: &Arc<Self>, entry: &Arc<Entry>, reason: AbortReason, via: &'static str) {
        entry.end();
        self.count_orphan_cost(entry);
        self.arm_downstream_deadline(entry);
        let this = self.clone();
        let entry = entry.clone();
        let age_ms = self.age_ms(&entry);
        let events = entry.events();
        let strategy = self.cfg.abort_strategy.as_str();
        tokio::spawn(async move {
            let (outcome, error) = match this.engine.abort(entry.id.clone()).await {
                Ok(()) => (outcome::ABORTED, None),
                Err(e) => (outcome::ENGINE_CALL_FAILED, Some(e)),
            };
            this.metrics.abort(reason, outcome);
            match error {
                None => {
                    tracing::info!(request_id = %entry.id, reason = %reason, via, strategy, outcome, age_ms, events, "ended request")
                }
                Some(e) => {
                    tracing::warn!(request_id = %entry.id, reason = %reason, via, strategy, outcome, age_ms, events, error = %e, "ended request; the engine's abort call failed (the connection was closed)")
                }
            }
        });
    }

    /// Adds an ended request's orphan cost (if its client was known to have gone) to
    /// `kvguard_control_orphan_seconds_total` / `wasted_tokens_total` under the abort's
    /// reason. Called where the engine connection closes (an end by kvguard, or the
    /// response ending by itself: `--dry-run`, or an abort that lost the race).
    pub fn count_orphan_cost(&self, entry: &Entry) {
        if let Some(c) = entry.take_orphan_cost(self.clock.now()) {
            self.metrics.orphan_cost(c.reason, c.seconds, c.events);
        }
    }

    /// Cuts the request's downstream side if its response is still not gone after
    /// `--abort-flush-timeout` (a client that stopped reading never takes the final event).
    pub(crate) fn arm_downstream_deadline(&self, entry: &Arc<Entry>) {
        let Some(down) = entry.downstream().cloned() else {
            return;
        };
        let entry = entry.clone();
        let grace = self.cfg.abort_flush_timeout;
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = entry.finished_token().cancelled() => {}
                _ = tokio::time::sleep(grace) => {
                    let scope = down.scope().as_str();
                    metrics.downstream_cut(scope);
                    tracing::info!(request_id = %entry.id, scope, "the client did not take the end of its request within --abort-flush-timeout; cut its downstream side");
                    down.cut();
                }
            }
        });
    }
}
