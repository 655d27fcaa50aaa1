//! Where an abort is decided and what its answer says (contract §3, §4): the route (here,
//! here then the peer that holds the id, or every leg of a disaggregated request), the
//! legs each replica reports, and the answer's summary and count.

use crate::pd::Release;
use kvguard_contract::{AbortAnswer, AbortReason, Leg, LegResult};

/// What an abort found here ([`crate::inflight::Inflight::abort_here`], as answered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortFound {
    /// In flight: ended by this call.
    Ended,
    /// In flight, `--dry-run`: observed only.
    Observed,
    /// Already ended, or tombstoned.
    Already,
    /// Not in flight (tombstoned now, where that was asked for).
    NotFound,
}

/// Where an abort is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Here only, under the table's lock: ended, already ended, or tombstoned.
    Here,
    /// Here if in flight here; else forwarded to every peer, the first that holds the id
    /// answering for it; else (no peer holds it) decided here.
    HereThenPeer,
    /// A leg of a disaggregated request: here and at every peer, every answer collected
    /// (the same id is held on a prefill and a decode replica at once, or the prefill
    /// engine holds a finished prefill's blocks for the decode side).
    EveryLeg,
}

/// The route of an abort: `pd` when this replica has a `--pd-role`, holds the id as a leg
/// (its body carried `kv_transfer_params`) or holds its prefill hand-off; `peers` when it
/// has `--peers`.
pub fn route(pd: bool, peers: bool) -> Route {
    match (peers, pd) {
        (false, _) => Route::Here,
        (true, true) => Route::EveryLeg,
        (true, false) => Route::HereThenPeer,
    }
}

/// Whether an abort may be answered `deferred` (a `stalled` abort whose sender allows it,
/// `recheck_ms`). Such an abort never tombstones an id it does not find: it is asked about
/// a stream that already flowed (no request can arrive after it), and a tombstone where the
/// stream is not would answer the sender's next ask `already_aborted` while the replica
/// that holds the stream defers it.
pub fn deferrable(reason: AbortReason, recheck: bool) -> bool {
    reason == AbortReason::Stalled && recheck
}

/// Whether a peer's answer (`body`) deferred the abort.
pub fn answer_deferred(body: &[u8]) -> bool {
    serde_json::from_slice::<AbortAnswer>(body).is_ok_and(|a| a.deferred)
}

/// This replica's leg of what it found (`None`: it did not hold the id).
pub fn leg_result(found: AbortFound) -> Option<LegResult> {
    match found {
        AbortFound::Ended => Some(LegResult::Aborted),
        AbortFound::Already => Some(LegResult::AlreadyAborted),
        AbortFound::Observed => Some(LegResult::DryRun),
        AbortFound::NotFound => None,
    }
}

/// What an abort that went to the peers ([`Route::HereThenPeer`]) does once they
/// answered: `holder` is the first 200 (`Some(deferred)`: whether that holder deferred
/// it), `None` when no peer holds the id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarded {
    /// The holder's answer is the answer. `tombstone_here`: it ended the request, so a
    /// request the abort overtook is refused here too; a deferral changes nothing
    /// anywhere, and a dry run tombstones nothing.
    Peer {
        /// Tombstone the id here.
        tombstone_here: bool,
    },
    /// Nobody holds it: decide here under the table's lock (ended if it arrived
    /// meanwhile, else tombstoned unless the ask is [`deferrable`]).
    DecideHere,
}

/// [`Forwarded`] for the peers' answer.
pub fn after_forward(holder: Option<bool>, dry_run: bool) -> Forwarded {
    match holder {
        Some(deferred) => Forwarded::Peer {
            tombstone_here: !dry_run && !deferred,
        },
        None => Forwarded::DecideHere,
    }
}

/// What an abort of a disaggregated request ([`Route::EveryLeg`]) does once every peer
/// answered: `here`, what it found here before the fan-out; `deferred`, whether a peer
/// that holds the stream deferred it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FannedOut {
    /// The stream's holder deferred it and nothing was ended here: the answer is
    /// `deferred`, and nothing is ended, released or tombstoned.
    Deferred,
    /// Not found here before: decide here again under the table's lock, then answer the
    /// legs.
    DecideHere,
    /// Answer the legs, this replica's being what it found.
    Legs(AbortFound),
}

/// [`FannedOut`] for what was found here and the peers' deferral.
pub fn after_fan_out(here: AbortFound, deferred: bool) -> FannedOut {
    match here {
        AbortFound::NotFound if deferred => FannedOut::Deferred,
        AbortFound::NotFound => FannedOut::DecideHere,
        found => FannedOut::Legs(found),
    }
}

/// Whether an abort that went to the peers is answered 503 (ask again) instead of what
/// was found, because a peer did not answer (a partition, a peer restarting) and its
/// answer could change this one: on [`Route::HereThenPeer`] when nobody was found (the
/// silent peer may hold the id; a 404 would have the sender cut a stall ask's reader, or
/// give up on a gone client's engine); on [`Route::EveryLeg`] always (a leg may be
/// missing). What was done here stays done; the sender's next attempt finds it ended.
pub fn ask_again(route: Route, found: bool, every_peer_answered: bool) -> bool {
    !every_peer_answered && (route == Route::EveryLeg || !found)
}

/// Whether an abort that went to the peers and found nothing tombstones the id here: not
/// a [`deferrable`] ask, and only once every peer answered. While one did not, the answer
/// is 503 and the sender asks again ([`ask_again`]); a tombstone placed now would answer
/// that retry `already_aborted` here, and the silent peer, which may hold the stream, would
/// never be asked (simulator finding sim.16).
pub fn tombstones_missing(deferrable: bool, every_peer_answered: bool) -> bool {
    !deferrable && every_peer_answered
}

/// The leg of a held prefill hand-off, by what became of its blocks.
pub fn release_result(r: Release) -> LegResult {
    match r {
        Release::Released => LegResult::Released,
        Release::DryRun => LegResult::DryRun,
        Release::HeldUntilLease => LegResult::HeldUntilLease,
    }
}

/// The legs of a peer's 200 answer (`body`) from `peer`: its `legs`, or one leg from its
/// summary.
pub fn legs_of(peer: &str, body: &[u8]) -> Vec<Leg> {
    let Ok(a) = serde_json::from_slice::<AbortAnswer>(body) else {
        return Vec::new();
    };
    if !a.legs.is_empty() {
        return a.legs;
    }
    let result = if a.aborted {
        LegResult::Aborted
    } else if a.already_aborted {
        LegResult::AlreadyAborted
    } else if a.found {
        LegResult::DryRun
    } else {
        return Vec::new();
    };
    vec![Leg {
        replica: peer.to_owned(),
        role: None,
        result,
    }]
}

/// The answer's summary of `legs`: `(found, aborted, already_aborted)`. Found when any
/// replica held the id; aborted when this call ended a leg (a request, or held blocks
/// released); already aborted when found and nothing was ended now but a leg had been.
pub fn summary(legs: &[Leg]) -> (bool, bool, bool) {
    let found = !legs.is_empty();
    let aborted = legs.iter().any(|l| l.result.ended());
    let already = !aborted && legs.iter().any(|l| l.result == LegResult::AlreadyAborted);
    (found, aborted, already)
}

/// How an answer that lists `legs` is counted by the replica named `me`: by what it did
/// itself (`aborted` also when it released a hand-off's blocks), else `forwarded` when a
/// peer ended a leg.
pub fn legs_count(legs: &[Leg], me: &str) -> &'static str {
    let (found, aborted, already) = summary(legs);
    let mine = || legs.iter().filter(|l| l.replica == me);
    if mine().any(|l| l.result.ended()) {
        "aborted"
    } else if aborted {
        "forwarded"
    } else if mine().any(|l| l.result == LegResult::DryRun) {
        "dry_run"
    } else if already {
        "already_aborted"
    } else if found {
        "forwarded"
    } else {
        "not_found"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn after_the_peers_answered_the_holder_decides_and_a_deferral_changes_nothing() {
        assert_eq!(
            after_forward(Some(false), false),
            Forwarded::Peer {
                tombstone_here: true
            }
        );
        for (deferred, dry_run) in [(true, false), (false, true), (true, true)] {
            assert_eq!(
                after_forward(Some(deferred), dry_run),
                Forwarded::Peer {
                    tombstone_here: false
                },
                "deferred {deferred}, dry run {dry_run}"
            );
        }
        assert_eq!(after_forward(None, false), Forwarded::DecideHere);
        assert_eq!(
            after_fan_out(AbortFound::NotFound, true),
            FannedOut::Deferred
        );
        assert_eq!(
            after_fan_out(AbortFound::NotFound, false),
            FannedOut::DecideHere
        );
        // A leg ended here is ended, whatever another holder said.
        for found in [AbortFound::Ended, AbortFound::Already, AbortFound::Observed] {
            for deferred in [false, true] {
                assert_eq!(after_fan_out(found, deferred), FannedOut::Legs(found));
            }
        }
    }

    #[test]
    fn a_peer_that_did_not_answer_makes_the_answer_ask_again_where_it_could_change_it() {
        for route in [Route::Here, Route::HereThenPeer, Route::EveryLeg] {
            for found in [false, true] {
                assert!(!ask_again(route, found, true), "{route:?} {found}");
            }
        }
        assert!(ask_again(Route::HereThenPeer, false, false));
        assert!(
            !ask_again(Route::HereThenPeer, true, false),
            "one holder at most: the one found here"
        );
        for found in [false, true] {
            assert!(
                ask_again(Route::EveryLeg, found, false),
                "a leg may be missing"
            );
        }
    }

    #[test]
    fn an_abort_that_found_nothing_tombstones_only_once_every_peer_answered() {
        assert!(tombstones_missing(false, true));
        assert!(
            !tombstones_missing(false, false),
            "a silent peer: asked again"
        );
        assert!(!tombstones_missing(true, true), "a deferrable ask");
        assert!(!tombstones_missing(true, false));
    }

    fn leg(replica: &str, result: LegResult) -> Leg {
        Leg {
            replica: replica.into(),
            role: None,
            result,
        }
    }

    #[test]
    fn the_route_is_here_without_peers_every_leg_for_pd_else_here_then_a_peer() {
        assert_eq!(route(false, false), Route::Here);
        assert_eq!(route(true, false), Route::Here);
        assert_eq!(route(true, true), Route::EveryLeg);
        assert_eq!(route(false, true), Route::HereThenPeer);
    }

    #[test]
    fn only_a_stalled_abort_that_allows_it_is_deferrable_and_a_peer_s_deferral_is_read() {
        assert!(deferrable(AbortReason::Stalled, true));
        assert!(!deferrable(AbortReason::Stalled, false));
        assert!(!deferrable(AbortReason::DownstreamReset, true));
        assert!(answer_deferred(
            br#"{"request_id":"r","found":true,"deferred":true}"#
        ));
        assert!(!answer_deferred(br#"{"request_id":"r","found":true}"#));
        assert!(!answer_deferred(b"not json"));
    }

    #[test]
    fn legs_name_what_each_replica_did() {
        assert_eq!(leg_result(AbortFound::Ended), Some(LegResult::Aborted));
        assert_eq!(
            leg_result(AbortFound::Already),
            Some(LegResult::AlreadyAborted)
        );
        assert_eq!(leg_result(AbortFound::Observed), Some(LegResult::DryRun));
        assert_eq!(leg_result(AbortFound::NotFound), None);
        assert_eq!(
            [Release::Released, Release::DryRun, Release::HeldUntilLease].map(release_result),
            [
                LegResult::Released,
                LegResult::DryRun,
                LegResult::HeldUntilLease
            ]
        );
    }

    #[test]
    fn a_peers_legs_are_its_own_or_one_from_its_summary() {
        let peer = "10.0.0.2:9902";
        let with = br#"{"request_id":"r","found":true,"aborted":true,"legs":[{"replica":"10.0.0.9:9902","role":"decode","result":"aborted"}]}"#;
        assert_eq!(
            legs_of(peer, with),
            [Leg {
                replica: "10.0.0.9:9902".into(),
                role: Some("decode".into()),
                result: LegResult::Aborted
            }]
        );
        for (body, result) in [
            (
                &br#"{"request_id":"r","found":true,"aborted":true}"#[..],
                LegResult::Aborted,
            ),
            (
                br#"{"request_id":"r","found":true,"already_aborted":true}"#,
                LegResult::AlreadyAborted,
            ),
            (br#"{"request_id":"r","found":true}"#, LegResult::DryRun),
        ] {
            assert_eq!(legs_of(peer, body), [leg(peer, result)]);
        }
        assert!(legs_of(peer, br#"{"request_id":"r","found":false}"#).is_empty());
        assert!(legs_of(peer, b"not json").is_empty());
    }

    #[test]
    fn the_summary_and_the_count_say_what_this_call_did_and_where() {
        use LegResult::*;
        assert_eq!(summary(&[]), (false, false, false));
        assert_eq!(legs_count(&[], "me"), "not_found");
        type Case<'a> = (&'a [Leg], (bool, bool, bool), &'a str);
        let cases: [Case; 7] = [
            (&[leg("me", Aborted)], (true, true, false), "aborted"),
            (&[leg("me", Released)], (true, true, false), "aborted"),
            (
                &[leg("me", AlreadyAborted), leg("p", Aborted)],
                (true, true, false),
                "forwarded",
            ),
            (&[leg("me", DryRun)], (true, false, false), "dry_run"),
            (
                &[leg("me", AlreadyAborted), leg("p", HeldUntilLease)],
                (true, false, true),
                "already_aborted",
            ),
            (
                &[leg("p", HeldUntilLease)],
                (true, false, false),
                "forwarded",
            ),
            (&[leg("p", DryRun)], (true, false, false), "forwarded"),
        ];
        for (legs, sum, count) in cases {
            assert_eq!(summary(legs), sum, "{legs:?}");
            assert_eq!(legs_count(legs, "me"), count, "{legs:?}");
        }
    }
}
