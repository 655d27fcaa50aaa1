//! The known findings: violations the simulator finds on today's code, each named by
//! its issue and point, with the schedule that finds it. A violation that matches none
//! is unknown and fails the seed campaign; a finding whose schedule no longer fails
//! fails its test, telling the one who fixed it to move it to the regression list.

use crate::oracles::{Cause, Promise};
use crate::schedule::{Client, Op, Schedule, Setup};
use crate::world::{EngineEnd, Stream};
use kvguard_contract::{AbortReason, InstanceId};
use std::collections::HashSet;

/// Which known finding a violation is, from what the world knows of its stream.
pub fn classify(
    promise: Promise,
    s: &Stream,
    setup: &Setup,
    unproven: &HashSet<InstanceId>,
) -> Option<&'static str> {
    let answer = s.last_answer.as_deref().unwrap_or("");
    let by_gateway = s
        .kvguard_end
        .as_ref()
        .is_some_and(|(_, who, _)| who.starts_with("gw"));
    let by_lease = s
        .kvguard_end
        .as_ref()
        .is_some_and(|(_, who, r)| who.contains("lease") && *r == AbortReason::GatewayLost);
    let gateway_gone = s.orphan.is_some_and(|(c, _)| c == Cause::GatewayGone);
    let closed_or_left = s
        .orphan
        .is_some_and(|(c, _)| matches!(c, Cause::Left | Cause::Closed));
    match promise {
        Promise::Invariant1 if by_lease => Some("37.3"),
        Promise::Invariant1 if by_gateway && s.last_call_lost => Some("36.4"),
        Promise::Invariant2 if closed_or_left && setup.hop_hides && s.last_call_lost => {
            Some("sim.1")
        }
        // The false `already_aborted` also leaves the holder's engine running.
        Promise::Invariant2 if answer.contains("already_aborted") => Some("36.5"),
        // The lease ended a live (frozen) gateway's stream: counted `gateway_lost`.
        Promise::Figures if by_lease && !gateway_gone => Some("37.3"),
        Promise::Invariant1
            if by_gateway && s.completed_at.is_some() && answer.contains("not_found") =>
        {
            Some("36.1")
        }
        Promise::Invariant1 if by_gateway && answer.contains("already_aborted") => Some("36.5"),
        Promise::Invariant2
            if matches!(s.engine_end, None | Some((_, EngineEnd::Finished)))
                && s.instance.is_some_and(|i| unproven.contains(&i)) =>
        {
            Some(if setup.hop_routes_lease {
                "37.1"
            } else {
                "37.2"
            })
        }
        _ => None,
    }
}

/// A known finding and the schedule that finds it.
#[derive(Debug, Clone)]
pub struct Finding {
    /// `"36.1"`: issue 36, point 1.
    pub name: &'static str,
    /// In a line.
    pub title: &'static str,
    /// What finds it.
    pub schedule: Schedule,
}

fn stream(at: u64, gw: u8, replica: u8, client: Client, tokens: u32, token_ms: u32) -> Op {
    Op::Stream {
        at,
        gw,
        replica,
        client,
        tokens,
        token_ms,
    }
}

/// Every known finding, with a hand-written schedule (the shrunk form of what the seed
/// campaign finds).
pub fn known() -> Vec<Finding> {
    vec![
        Finding {
            name: "36.1",
            title: "a reader draining the tail is cut once the completion memory expires",
            schedule: Schedule {
                seed: 1,
                setup: Setup::default(),
                // 1000 tokens (256 KB) in 10 s, all of it in the sockets toward the
                // gateway at once; a 2 KB/s reader pausing 65 s 90 s after its engine
                // finished, its tail still on the way.
                ops: vec![stream(
                    0,
                    0,
                    0,
                    Client::Pausing {
                        bps: 2_000,
                        after_ms: 100_000,
                        pause_ms: 65_000,
                    },
                    1_000,
                    10,
                )],
            },
        },
        Finding {
            name: "36.5",
            title: "a forwarded deferral tombstones the id on every non-holder",
            schedule: Schedule {
                seed: 3,
                setup: Setup {
                    replicas: 2,
                    idle_ms: 30_000,
                    ..Setup::default()
                },
                ops: vec![stream(0, 0, 1, Client::Steady { bps: 600 }, 3_000, 20)],
            },
        },
        Finding {
            name: "37.1",
            title: "a gateway that dies young never ends its orphans",
            schedule: Schedule {
                seed: 1,
                setup: Setup {
                    hop_hides: true,
                    ..Setup::default()
                },
                ops: vec![
                    stream(0, 0, 0, Client::Fast, 3_000, 30),
                    Op::Kill {
                        at: 2_000,
                        gw: 0,
                        restart_ms: None,
                    },
                ],
            },
        },
        Finding {
            name: "37.3",
            title: "a lone gateway frozen for the TTL loses every stream",
            schedule: Schedule {
                seed: 1,
                setup: Setup {
                    hop_hides: true,
                    ..Setup::default()
                },
                ops: vec![
                    stream(0, 0, 0, Client::Fast, 3_000, 30),
                    Op::Freeze {
                        at: 20_000,
                        gw: 0,
                        for_ms: 35_000,
                    },
                ],
            },
        },
        // Found by the seed campaign (the schedule is the seed's; `kvguard-sim --seed N`
        // prints it with its timeline).
        Finding {
            name: "36.4",
            title: "a lost answer to a stall ask becomes a real end: the reader is cut",
            schedule: Schedule::generate(514),
        },
        Finding {
            name: "37.2",
            title: "a hop that answers 404 to /v1/kvguard/lease never arms the lease",
            schedule: Schedule::generate(157),
        },
        Finding {
            name: "sim.1",
            title: "an abort lost for its whole retry window leaves an orphan behind a hiding hop running to the end",
            schedule: Schedule::generate(474),
        },
    ]
}
