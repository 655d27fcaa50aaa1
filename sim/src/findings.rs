//! The known findings: violations the simulator finds on today's code, each named by
//! its issue and point, with the schedule that finds it. A violation that matches none,
//! or matches a fixed one (a regression), is unknown and fails the seed campaign; a
//! finding whose schedule no longer fails fails its test, telling the one who fixed it to
//! move it to the regression list.

use crate::oracles::{Cause, Promise};
use crate::schedule::{Client, Op, Schedule, Setup};
use crate::world::Stream;
use kvguard_contract::AbortReason;

/// Which finding, open or fixed, a violation's shape is, from what the world knows of its
/// stream (the first arm that matches: a fixed finding's arm keeps its shape from being
/// taken for a later, open one's). The world keeps the name of an open one only.
pub fn classify(promise: Promise, s: &Stream, setup: &Setup) -> Option<&'static str> {
    let answer = s.last_answer.as_deref().unwrap_or("");
    let by_gateway = s
        .kvguard_end
        .as_ref()
        .is_some_and(|(_, who, _)| who.starts_with("gw"));
    let by_reaper = s
        .kvguard_end
        .as_ref()
        .is_some_and(|(_, who, r)| who.contains("reaper") && *r == AbortReason::Stalled);
    match promise {
        // A prefill leg's content-length answer was never completed (hyper does not poll
        // it to `Ready(None)`): counted `client_gone`, no hand-off recorded, its blocks
        // held until the prefill engine's lease.
        Promise::Figures | Promise::Invariant2 if s.miscounted == Some("prefill_end") => {
            Some("36.3")
        }
        // A release cancelled with a caller that gave up: neither sent nor counted.
        Promise::Figures | Promise::Invariant2 if s.miscounted == Some("release") => Some("36.6"),
        // An `unproven` expiry counted `mode="observe"` under `--lease-mode enforce`.
        Promise::Figures if s.miscounted == Some("expiry_mode") => Some("37.5"),
        // A peer that did not answer was taken for one that does not hold the id.
        Promise::Invariant1 | Promise::Invariant2 if s.peers_cut => Some("sim.9"),
        // A restarted replica forgot the completion of a stream whose reader drains its
        // tail, and answered its stall ask 404.
        Promise::Invariant1 if by_gateway && s.completion_forgotten => Some("sim.8"),
        // Two gateways share a host key, and the replica that judges knows the listener
        // of only one of them: it cannot see the key shared, and the one that started
        // first, frozen past the TTL (its listener still answering), is `replaced` by
        // the other's renewals, as a hot restart's parent that exited is by its child's.
        Promise::Invariant1 | Promise::Figures
            if setup.shared_host_key
                && s.kvguard_end
                    .as_ref()
                    .is_some_and(|(_, who, _)| who.contains("lease: replaced")) =>
        {
            Some("sim.19")
        }
        // A live worker VM judged lost: the first renewal after a gateway's stall of 3
        // periods lists none of its VMs (the renewing VM beats after it renews), which
        // marks each absent; a second stall before the next renewal, to past the TTL,
        // brings a renewal that leaves them out again, more than the TTL after.
        Promise::Invariant1 | Promise::Figures
            if s.vm_trapped.is_none()
                && s.kvguard_end
                    .as_ref()
                    .is_some_and(|(_, who, _)| who.contains("lease: vm_lost")) =>
        {
            Some("sim.14")
        }
        // kvguard-control's own wait on the reader, which lags the drain by a third of its
        // socket, ended the stream of a client that reads.
        Promise::Invariant1 if by_reaper => Some("36.7"),
        Promise::Invariant1 if by_gateway && s.last_call_lost => Some("36.4"),
        // The decode side's deferral became a `dry_run` leg of a 200 that defers nothing.
        Promise::Invariant1 if by_gateway && setup.pd && answer.contains("dry_run") => Some("36.2"),
        // ... and nothing ends the decode leg: it runs on, and is counted under
        // whatever ends it later.
        Promise::Invariant2 | Promise::Figures if setup.pd && answer.contains("dry_run") => {
            Some("36.2")
        }
        Promise::Invariant2 if setup.hop_hides && s.last_call_lost => Some("sim.1"),
        // Its gateway gone with its pod: a listener that answers nothing keeps the hold
        // (no other gateway heard from: kvguard-control may be the one cut off).
        Promise::Invariant2
            if setup.pods_deleted && s.orphan.is_some_and(|(c, _)| c == Cause::GatewayGone) =>
        {
            Some("sim.6")
        }
        // A shared host key is never used for `replaced`; a dead instance's listener is
        // then answered by the process that took it over (a restart in place, a hot
        // restart's child) before that one proved its life there: held for good.
        Promise::Invariant2
            if setup.shared_host_key && s.orphan.is_some_and(|(c, _)| c == Cause::GatewayGone) =>
        {
            Some("sim.12")
        }
        // A hop queued the request past its gateway's death: the first proof of life
        // reaches kvguard-control when the listener already refuses, so it is never
        // trusted, and the lease expires `unproven` (counted, not ended).
        Promise::Invariant2 if setup.hop_queue_ms > 0 && s.admitted_after_its_gateway_died() => {
            Some("sim.17")
        }
        // The false `already_aborted` also leaves the holder's engine running.
        Promise::Invariant2 if answer.contains("already_aborted") => Some("36.5"),
        Promise::Invariant1
            if by_gateway
                && s.completed_at.is_some()
                && (answer.contains("not_found") || answer.contains("legs []")) =>
        {
            Some("36.1")
        }
        Promise::Invariant1 if by_gateway && answer.contains("already_aborted") => Some("36.5"),
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

/// Two gateways given one host key (one Envoy `node.id` for both).
fn two_sharing_a_key() -> Setup {
    Setup {
        gateways: 2,
        shared_host_key: true,
        ..Setup::default()
    }
}

/// The reader of seed 144: 2.7 KB/s, pausing 60 s in its tail (sim.8, sim.10).
fn tail_reader() -> Op {
    let client = Client::Pausing {
        bps: 2_700,
        after_ms: 10_321,
        pause_ms: 59_606,
    };
    stream(22_044, 0, 0, client, 277, 41)
}

/// Every known finding, with a hand-written schedule (the shrunk form of what the seed
/// campaign finds).
pub fn known() -> Vec<Finding> {
    vec![
        Finding {
            name: "sim.17",
            title: "a hop queues a request past its gateway's death (killed 0.3 s after sending it): its first proof of life reaches kvguard-control when the listener already refuses, so the lease never trusts it and expires `unproven`; behind a hiding hop the orphan runs to its end",
            schedule: Schedule {
                seed: 42255,
                setup: Setup {
                    hop_hides: true,
                    hop_queue_ms: 1_904,
                    net_cap: 64 * 1024,
                    ..Setup::default()
                },
                ops: vec![
                    stream(10_191, 0, 0, Client::Steady { bps: 3_425 }, 1_130, 31),
                    Op::Kill {
                        at: 10_496,
                        gw: 0,
                        restart_ms: None,
                    },
                ],
            },
        },
        Finding {
            name: "sim.19",
            title: "two gateways share a host key and a replica knows the listener of only one: the one that started first, frozen past the TTL, is judged replaced by the other's renewals",
            schedule: Schedule {
                seed: 49165,
                setup: Setup {
                    replicas: 2,
                    ..two_sharing_a_key()
                },
                ops: vec![
                    stream(35_078, 1, 1, Client::Fast, 1_840, 42),
                    stream(43_873, 0, 0, Client::Fast, 2_426, 40),
                    Op::Freeze {
                        at: 74_516,
                        gw: 0,
                        for_ms: 31_884,
                    },
                ],
            },
        },
        Finding {
            name: "sim.12",
            title: "a shared host key is never used for replaced: a hot restart's parent that exits is asked at its listener, which its child (no request yet) answers; held for good, its orphans behind a hiding hop run to the end",
            schedule: Schedule {
                seed: 1,
                setup: Setup {
                    hop_hides: true,
                    ..two_sharing_a_key()
                },
                ops: vec![
                    stream(0, 0, 0, Client::Fast, 3_000, 30),
                    stream(0, 1, 0, Client::Fast, 3_000, 30),
                    Op::HotRestart {
                        at: 10_000,
                        gw: 0,
                        parent_ms: 6_000,
                    },
                ],
            },
        },
        Finding {
        name: "sim.6",
        title: "every gateway gone at once with its pod: no listener answers, so each expiry stays held (kvguard-control cannot tell it from being cut off); their orphans behind a hiding hop run to the end",
        schedule: Schedule {
            seed: 1,
            setup: Setup {
                gateways: 2,
                hop_hides: true,
                pods_deleted: true,
                ..Setup::default()
            },
            ops: vec![
                stream(0, 1, 0, Client::Fast, 3_000, 40),
                Op::Kill {
                    at: 43_000,
                    gw: 0,
                    restart_ms: None,
                },
                Op::Kill {
                    at: 46_000,
                    gw: 1,
                    restart_ms: None,
                },
            ],
        },
    },
    ]
}

/// A schedule that passes today and fails when the named rule is removed (how the
/// rules of the real filter core, which the simulator cannot switch, are shown to be
/// needed: docs/TESTING.md "The simulation").
#[derive(Debug, Clone)]
pub struct Guard {
    /// The rule, as its code names it.
    pub rule: &'static str,
    /// What needs it.
    pub schedule: Schedule,
}

/// The guards of the rules.
pub fn guards() -> Vec<Guard> {
    let fast = |at| stream(at, 0, 0, Client::Fast, 3_000, 30);
    vec![
        Guard {
            // A gateway stopped past its idle timeout, its first ask after resuming lost:
            // the first tick must not ask; the data read before the second one shows
            // the stream flows.
            rule: "filter/core/src/cut.rs: idle is confirmed by a second tick (Hold::Unconfirmed)",
            schedule: Schedule {
                seed: 1,
                setup: Setup {
                    idle_ms: 20_000,
                    ..Setup::default()
                },
                ops: vec![
                    fast(0),
                    Op::Freeze {
                        at: 10_000,
                        gw: 0,
                        for_ms: 21_000,
                    },
                    Op::LoseCalls {
                        at: 30_900,
                        for_ms: 3_000,
                    },
                ],
            },
        },
        Guard {
            // An engine-wide pause longer than the idle timeout under 20 streams: the
            // valve cuts 8 and holds 12, which resume.
            rule: "filter/core/src/cut.rs: the mass-stall valve (Hold::MassStall)",
            schedule: Schedule {
                seed: 1,
                setup: Setup::default(),
                ops: (0..20)
                    .map(|i| fast(i * 50))
                    .chain([Op::EnginePause {
                        at: 10_000,
                        replica: 0,
                        for_ms: 70_000,
                    }])
                    .collect(),
            },
        },
    ]
}

/// Findings fixed since they were found: each schedule must run with no violation at
/// all. A finding of [`known`] whose fix lands moves here, with its schedule.
pub fn regressions() -> Vec<Finding> {
    vec![
        Finding {
            name: "sim.14",
            title: "a gateway frozen past three periods, then again, a second after it resumed, for the TTL: its worker VM is judged lost and its read stream ended",
            schedule: Schedule {
                seed: 1,
                setup: Setup::default(),
                ops: vec![
                    stream(0, 0, 0, Client::Fast, 3_000, 30),
                    Op::Freeze {
                        at: 10_000,
                        gw: 0,
                        for_ms: 20_000,
                    },
                    Op::Freeze {
                        at: 31_000,
                        gw: 0,
                        for_ms: 31_000,
                    },
                ],
            },
        },
        Finding {
            name: "sim.21",
            title: "a hot restart's parent exits and its child dies within a period and a half: the parent's listener is its successor's, not asked for it, and nobody is heard after its silence: held until the child's own expiry, its orphans end past the bound",
            schedule: Schedule {
                seed: 43948,
                setup: Setup {
                    replicas: 2,
                    pd: true,
                    hop_hides: true,
                    ..Setup::default()
                },
                ops: vec![
                    stream(11_876, 0, 1, Client::Steady { bps: 641 }, 777, 14),
                    stream(20_022, 0, 1, Client::Fast, 2_341, 29),
                    Op::HotRestart {
                        at: 20_277,
                        gw: 0,
                        parent_ms: 6_000,
                    },
                    stream(23_545, 0, 1, Client::Steady { bps: 742 }, 729, 41),
                    Op::Kill {
                        at: 31_973,
                        gw: 0,
                        restart_ms: None,
                    },
                ],
            },
        },
        Finding {
            name: "36.6",
            title: "a held prefill's release is cancelled with a caller that gives up (the decode side slow to answer): neither sent nor counted, and the retry finds nothing to release",
            schedule: Schedule {
                seed: 1164,
                setup: Setup {
                    gateways: 2,
                    replicas: 2,
                    pd: true,
                    hop_hides: true,
                    idle_ms: 30_000,
                    ..Setup::default()
                },
                ops: vec![
                    Op::PartitionData {
                        at: 17_455,
                        replica: 1,
                        for_ms: 52_538,
                    },
                    stream(24_122, 1, 0, Client::Leaves { after_ms: 4_424 }, 2_864, 16),
                ],
            },
        },
        Finding {
            name: "36.3",
            title: "a prefill leg's content-length answer read to its end is never completed: counted client_gone, its hand-off never recorded",
            // Seed 21280's first stream: its client leaves in the prefill's last
            // 150 ms, the hiding P/D proxy sends no decode leg, the abort releases the
            // held blocks through the decode side (without the hand-off: held until the
            // prefill engine's lease, 30 s).
            schedule: Schedule {
                seed: 21280,
                setup: Setup {
                    replicas: 2,
                    pd: true,
                    hop_hides: true,
                    net_cap: 1024 * 1024,
                    pods_deleted: true,
                    ..Setup::default()
                },
                ops: vec![stream(
                    3_336,
                    0,
                    1,
                    Client::Leaves { after_ms: 1_041 },
                    1_189,
                    45,
                )],
            },
        },
        Finding {
            name: "37.5",
            title: "an unproven lease expiry is counted mode=\"observe\" under --lease-mode enforce",
            schedule: Schedule {
                seed: 34,
                setup: Setup {
                    gateways: 2,
                    replicas: 2,
                    hop_routes_lease: false,
                    net_cap: 64 * 1024,
                    idle_ms: 30_000,
                    ..Setup::default()
                },
                ops: vec![
                    stream(11_698, 1, 1, Client::Fast, 259, 31),
                    Op::Kill {
                        at: 21_598,
                        gw: 1,
                        restart_ms: None,
                    },
                    // Keeps the world running past the lease's expiry.
                    stream(39_112, 0, 1, Client::Fast, 2_685, 55),
                ],
            },
        },
        Finding {
            name: "sim.20",
            title: "a stall ask sent just before its gateway froze past the abort deadline: its answer lost with the freeze, the ask was given up on resuming and the filter cut a stream its client read",
            schedule: Schedule {
                seed: 94448,
                setup: Setup {
                    gateways: 2,
                    replicas: 2,
                    hop_hides: true,
                    net_cap: 1024 * 1024,
                    idle_ms: 30_000,
                    pods_deleted: true,
                    ..Setup::default()
                },
                ops: vec![
                    stream(20_963, 0, 1, Client::Steady { bps: 988 }, 2_347, 41),
                    Op::EnginePause {
                        at: 45_235,
                        replica: 1,
                        for_ms: 5_936,
                    },
                    Op::SlowAdmin {
                        at: 48_600,
                        for_ms: 18_323,
                        delay_ms: 1_428,
                    },
                    Op::Freeze {
                        at: 59_895,
                        gw: 0,
                        for_ms: 40_712,
                    },
                ],
            },
        },
        Finding {
            name: "sim.18",
            title: "a hot restart's parent whose renewals are lost for two periods, its child first heard meanwhile, is judged replaced by the child: its read streams are ended",
            schedule: Schedule {
                seed: 2969,
                setup: Setup::default(),
                ops: vec![
                    stream(21_645, 0, 0, Client::Fast, 3_000, 30),
                    Op::LoseCalls {
                        at: 29_221,
                        for_ms: 8_064,
                    },
                    Op::HotRestart {
                        at: 35_732,
                        gw: 0,
                        parent_ms: 900_000,
                    },
                    stream(39_537, 0, 0, Client::Fast, 399, 52),
                ],
            },
        },
        Finding {
            name: "sim.13",
            title: "a hot restart's child frozen for two periods while its parent drains is judged replaced by the parent's renewals: its read streams are ended",
            schedule: Schedule {
                seed: 1,
                setup: Setup::default(),
                ops: vec![
                    Op::HotRestart {
                        at: 10_000,
                        gw: 0,
                        parent_ms: 60_000,
                    },
                    stream(12_000, 0, 0, Client::Fast, 3_000, 30),
                    Op::Freeze {
                        at: 20_000,
                        gw: 0,
                        for_ms: 15_000,
                    },
                ],
            },
        },
        Finding {
            name: "sim.11",
            title: "two gateways share a host key and one carried no request yet: its listener is unknown, the key is not seen shared, and the other, frozen for two periods, is judged replaced",
            schedule: Schedule {
                seed: 1,
                setup: two_sharing_a_key(),
                ops: vec![
                    stream(0, 1, 0, Client::Fast, 3_000, 30),
                    Op::Freeze {
                        at: 20_000,
                        gw: 1,
                        for_ms: 15_000,
                    },
                ],
            },
        },
        Finding {
            name: "sim.16",
            title: "a disconnect's abort answered 503 (a peer did not answer) had tombstoned the id on the replica that got it: the retry landing there was answered already_aborted, the holder never asked, its engine ran on behind a hiding hop",
            schedule: Schedule {
                seed: 13090,
                setup: Setup {
                    replicas: 2,
                    hop_hides: true,
                    pods_deleted: true,
                    net_cap: 1024 * 1024,
                    ..Setup::default()
                },
                ops: vec![
                    stream(96, 0, 0, Client::Pausing { bps: 1_605, after_ms: 72_657, pause_ms: 40_090 }, 2_129, 24),
                    stream(12_820, 0, 1, Client::Leaves { after_ms: 25_479 }, 1_693, 43),
                    stream(27_363, 0, 0, Client::Pausing { bps: 2_230, after_ms: 103_636, pause_ms: 66_167 }, 1_761, 30),
                    Op::PartitionPeers {
                        at: 28_002,
                        for_ms: 13_175,
                    },
                    stream(30_860, 0, 1, Client::Fast, 1_088, 57),
                    stream(55_722, 0, 1, Client::Steady { bps: 2_729 }, 894, 24),
                ],
            },
        },
        Finding {
            name: "sim.15",
            title: "an abort decided just before its gateway froze past the abort deadline was given up unsent when it resumed: behind a hiding hop its engine ran to the end",
            schedule: Schedule {
                seed: 37106,
                setup: Setup {
                    hop_hides: true,
                    pods_deleted: true,
                    net_cap: 1024 * 1024,
                    idle_ms: 30_000,
                    ..Setup::default()
                },
                ops: vec![
                    stream(21_731, 0, 0, Client::Leaves { after_ms: 2_299 }, 2_970, 34),
                    Op::Freeze {
                        at: 24_039,
                        gw: 0,
                        for_ms: 41_298,
                    },
                ],
            },
        },
        Finding {
            name: "sim.8",
            title: "a replica restart forgets a completion: the stall ask of a reader draining its tail is answered 404, the reader cut",
            schedule: Schedule {
                seed: 144,
                setup: Setup {
                    hop_routes_lease: false,
                    idle_ms: 30_000,
                    ..Setup::default()
                },
                ops: vec![
                    tail_reader(),
                    Op::ReplicaRestart {
                        at: 64_581,
                        replica: 0,
                    },
                ],
            },
        },
        Finding {
            name: "sim.10",
            title: "a hop that sends an abort call twice: the second delivery is a replay (409), and the filter took that for a verdict: a deferred reader cut",
            schedule: Schedule {
                seed: 144,
                setup: Setup {
                    hop_routes_lease: false,
                    idle_ms: 30_000,
                    ..Setup::default()
                },
                ops: vec![
                    tail_reader(),
                    Op::HopRetries {
                        at: 55_696,
                        for_ms: 19_500,
                        retry_ms: 535,
                    },
                ],
            },
        },
        Finding {
            name: "sim.9",
            title: "P/D: a peer that does not answer is taken for one that does not hold the id: a disconnect's abort is answered 404, the decode leg runs on",
            schedule: Schedule {
                seed: 2031,
                setup: Setup {
                    gateways: 2,
                    replicas: 2,
                    pd: true,
                    hop_hides: true,
                    hop_routes_lease: false,
                    pods_deleted: true,
                    ..Setup::default()
                },
                ops: vec![
                    stream(27_491, 1, 1, Client::Steady { bps: 1_444 }, 2_154, 16),
                    stream(36_723, 0, 0, Client::Leaves { after_ms: 30_942 }, 2_989, 24),
                    Op::PartitionPeers {
                        at: 61_772,
                        for_ms: 15_135,
                    },
                ],
            },
        },
        Finding {
            name: "37.4",
            title: "two gateways started from one config share a host key: one frozen past the TTL while the other, restarted since, renews is judged replaced, its read streams ended",
            schedule: Schedule {
                seed: 1,
                setup: two_sharing_a_key(),
                ops: vec![
                    stream(0, 0, 0, Client::Fast, 3_000, 30),
                    stream(0, 1, 0, Client::Fast, 3_000, 30),
                    // gw1 restarted: a process started after gw0's, with its key.
                    Op::HotRestart {
                        at: 10_000,
                        gw: 1,
                        parent_ms: 60_000,
                    },
                    stream(12_000, 1, 0, Client::Fast, 3_000, 30),
                    Op::Freeze {
                        at: 20_000,
                        gw: 0,
                        for_ms: 35_000,
                    },
                ],
            },
        },
        Finding {
            name: "sim.7",
            title: "a lone gateway gone with its pod 2 s after it started: its listener answers nothing, which ends its orphans",
            schedule: Schedule {
                seed: 1,
                setup: Setup {
                    hop_hides: true,
                    hop_routes_lease: false,
                    pods_deleted: true,
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
            name: "sim.1",
            title: "an abort lost for its whole retry window leaves an orphan behind a hiding hop running to the end",
            schedule: Schedule {
                seed: 1,
                setup: Setup {
                    hop_hides: true,
                    ..Setup::default()
                },
                ops: vec![
                    stream(0, 0, 0, Client::Leaves { after_ms: 10_000 }, 3_000, 30),
                    Op::LoseCalls {
                        at: 9_000,
                        for_ms: 8_000,
                    },
                ],
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
        Finding {
            name: "37.2",
            title: "a hop that answers 404 to /v1/kvguard/lease never arms the lease",
            schedule: Schedule {
                seed: 1,
                setup: Setup {
                    hop_hides: true,
                    hop_routes_lease: false,
                    ..Setup::default()
                },
                ops: vec![
                    stream(0, 0, 0, Client::Fast, 3_000, 30),
                    Op::Kill {
                        at: 20_000,
                        gw: 0,
                        restart_ms: None,
                    },
                ],
            },
        },
        Finding {
            name: "sim.2",
            title: "every gateway gone at once: each expiry is held for good, their orphans behind a hiding hop run to the end",
            schedule: Schedule {
                seed: 1,
                setup: Setup {
                    gateways: 2,
                    hop_hides: true,
                    ..Setup::default()
                },
                ops: vec![
                    stream(0, 1, 0, Client::Fast, 3_000, 40),
                    Op::Kill {
                        at: 43_000,
                        gw: 0,
                        restart_ms: None,
                    },
                    Op::Kill {
                        at: 46_000,
                        gw: 1,
                        restart_ms: None,
                    },
                ],
            },
        },
        Finding {
            name: "36.7",
            title: "kvguard-control's view of the drain lags by a third of its socket: its reaper ends a steady reader above the floor",
            schedule: Schedule {
                seed: 24,
                setup: Setup::default(),
                ops: vec![stream(0, 0, 0, Client::Steady { bps: 751 }, 1_952, 24)],
            },
        },
        Finding {
            name: "36.4",
            title: "a lost answer to a stall ask becomes a real end: the reader is cut",
            schedule: Schedule {
                seed: 1,
                setup: Setup::default(),
                ops: vec![
                    stream(0, 0, 0, Client::Steady { bps: 450 }, 3_000, 30),
                    // Its first stall ask goes at 64.96 s.
                    Op::LoseCalls {
                        at: 64_500,
                        for_ms: 2_000,
                    },
                ],
            },
        },
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
            name: "36.2",
            title: "P/D: a deferral is lost in the fan-out, the reader cut",
            schedule: Schedule {
                seed: 2,
                setup: Setup {
                    replicas: 2,
                    pd: true,
                    ..Setup::default()
                },
                ops: vec![stream(0, 0, 1, Client::Steady { bps: 450 }, 3_000, 30)],
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
    ]
}
