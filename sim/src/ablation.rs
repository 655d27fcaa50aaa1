//! Which mechanism each promise needs (issue 35 point 6): every mechanism of the
//! protocol the simulator can switch off ([`Mechanism`]), the set of them switched off
//! for a run ([`Mutations`]), the schedule that shows why each exists
//! ([`Mechanism::witness`]), and the campaign that runs seeds with each switched off in
//! turn ([`ablate`]): which promises break, on how many seeds, first at which.
//!
//! The switches act on the simulator's composition, never on the product's code: the
//! control core's mechanisms are switched where `replica.rs` composes them (as the
//! shell would without them); the filter core's rules, which the simulator runs
//! unmodified, are switched by driving the core so that the rule cannot act (see each
//! variant).

use crate::oracles::Promise;
use crate::schedule::{Client, Op, Schedule, Setup};
use kvguard_control_core::limits::Limits;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// A mechanism of the protocol that can be switched off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mechanism {
    /// The filter's second-tick confirmation of idleness (`Hold::Unconfirmed`). Off: each
    /// gateway tick runs the core's tick twice with nothing between, so the first arms
    /// what the second confirms.
    SecondTick,
    /// The filter's mass-stall valve (`Hold::MassStall`, per VM). Off: each stream gets a
    /// VM of its own, whose valve, counting one stream, never holds.
    MassStallValve,
    /// The filter puts a stall to kvguard-control before cutting (`Hold::Asking`,
    /// `recheck_ms`). Off: the ask arrives as a plain `stalled` abort (no `recheck_ms`),
    /// which kvguard-control carries out; the filter cuts on its answer.
    StallAsks,
    /// kvguard-control defers a stall ask whose engine produces and whose reader drains
    /// (`Inflight::judge` → `Cut::Defer`). Off: never deferred.
    Deferral,
    /// Tombstones: an ended or aborted id is refused for `--tombstone-ttl`, and an abort
    /// that finds nothing tombstones the id. Off: a TTL of zero.
    Tombstones,
    /// Peers (`--peers`): an abort for an id not held here goes to every peer; an
    /// accepted renewal is fanned out to them. Off: neither.
    PeerForwarding,
    /// The liveness lease's judgement (`lease::enforce::judge`). Off: never judged, so
    /// no dead gateway's stream is ended by it.
    Lease,
    /// The reaper's idle clock (`--idle-timeout`, the engine's silence). Off: no limit.
    ReaperIdle,
    /// The reaper's reader clock (`--reader-timeout`, a reader that takes nothing; the
    /// deferral keeps its own). Off: it never fires in the reaper's verdicts (the idle
    /// clock still counts the engine's own silence).
    ReaperReader,
    /// The detection of a host key two live gateways renew with from two listeners
    /// (`Leases::shared_host`: never used for a `replaced` verdict; finding 37.4's fix).
    /// Off: the proofs reach the lease table without the listener they name, which is
    /// what the detection reads (the listener's probes go with it, as before that fix,
    /// which brought both).
    SharedHostKey,
    /// A prefill replica's hand-off table (`Handoffs`) and the release of its held blocks
    /// through the decode side on an abort (`pd::release_handoff`). Off: no hand-off is
    /// held here to release, as without P/D support.
    HandoffRelease,
    /// The lease's hold (`Leases::judge`: an expiry is held while nobody else was heard
    /// from since its silence began, or while its listener answers). Off: every held
    /// expiry ends its instance's requests, as a `silent` one does.
    LeaseHold,
}

/// Every switchable mechanism, in the table's order.
pub const ALL: [Mechanism; 12] = [
    Mechanism::SecondTick,
    Mechanism::MassStallValve,
    Mechanism::StallAsks,
    Mechanism::Deferral,
    Mechanism::Tombstones,
    Mechanism::PeerForwarding,
    Mechanism::Lease,
    Mechanism::ReaperIdle,
    Mechanism::ReaperReader,
    Mechanism::SharedHostKey,
    Mechanism::HandoffRelease,
    Mechanism::LeaseHold,
];

impl Mechanism {
    /// Its name on the command line (`--off NAME`).
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::SecondTick => "second-tick",
            Mechanism::MassStallValve => "valve",
            Mechanism::StallAsks => "stall-asks",
            Mechanism::Deferral => "deferral",
            Mechanism::Tombstones => "tombstones",
            Mechanism::PeerForwarding => "peer-forwarding",
            Mechanism::Lease => "lease",
            Mechanism::ReaperIdle => "reaper-idle",
            Mechanism::ReaperReader => "reaper-reader",
            Mechanism::SharedHostKey => "shared-key",
            Mechanism::HandoffRelease => "handoff-release",
            Mechanism::LeaseHold => "hold",
        }
    }

    /// The mechanism named `name`.
    pub fn parse(name: &str) -> Option<Mechanism> {
        ALL.into_iter().find(|m| m.name() == name)
    }

    /// A schedule that keeps every promise with everything on and breaks `promise` with
    /// this mechanism off: the fault it exists for. `None`: none found yet.
    pub fn witness(self) -> Option<(Promise, Schedule)> {
        let one = |setup: Setup, ops: Vec<Op>| Schedule {
            seed: 1,
            setup,
            ops,
        };
        let fast = |at| Op::stream(at, 0, 0, Client::Fast, 3_000, 30);
        Some(match self {
            // A node's gateways stopped past their idle timeout; when they resume,
            // kvguard-control is unreachable past the abort deadline (30 s; nobody is
            // heard from meanwhile, so the lease holds every expiry). The data read before the second tick shows
            // the stream flows; an ask at the first would go unanswered, and cut it.
            Mechanism::SecondTick => (
                Promise::Invariant1,
                one(
                    Setup {
                        gateways: 2,
                        idle_ms: 20_000,
                        ..Setup::default()
                    },
                    vec![
                        fast(0),
                        Op::Freeze {
                            at: 10_000,
                            gw: 0,
                            for_ms: 21_000,
                        },
                        Op::Freeze {
                            at: 10_000,
                            gw: 1,
                            for_ms: 21_000,
                        },
                        Op::LoseCalls {
                            at: 30_900,
                            for_ms: 33_000,
                        },
                    ],
                ),
            ),
            // An engine-wide pause longer than the idle timeout under 20 streams.
            Mechanism::MassStallValve => (
                Promise::MassStall,
                crate::findings::guards().into_iter().nth(1)?.schedule,
            ),
            Mechanism::StallAsks | Mechanism::Deferral => (Promise::Invariant1, slow_readers()),
            // The hop queues the request 1 s; its client leaves after 100 ms, and its
            // abort arrives first: the tombstone refuses the request when it comes.
            Mechanism::Tombstones => (
                Promise::Invariant2,
                one(
                    Setup {
                        hop_hides: true,
                        hop_queue_ms: 1_000,
                        ..Setup::default()
                    },
                    vec![Op::stream(
                        0,
                        0,
                        0,
                        Client::Leaves { after_ms: 100 },
                        3_000,
                        30,
                    )],
                ),
            ),
            // Two replicas; the abort of a client that left reaches the one that does
            // not hold its stream (the seed's balancing), behind a hop that hides the
            // disconnect.
            Mechanism::PeerForwarding => (
                Promise::Invariant2,
                Schedule {
                    seed: 2,
                    setup: Setup {
                        replicas: 2,
                        hop_hides: true,
                        ..Setup::default()
                    },
                    ops: vec![Op::stream(
                        0,
                        0,
                        1,
                        Client::Leaves { after_ms: 10_000 },
                        3_000,
                        30,
                    )],
                },
            ),
            // A gateway killed for good behind a hiding hop while another renews.
            Mechanism::Lease => (
                Promise::Invariant2,
                one(
                    Setup {
                        gateways: 2,
                        hop_hides: true,
                        ..Setup::default()
                    },
                    vec![
                        fast(0),
                        Op::stream(0, 1, 0, Client::Fast, 200, 30),
                        Op::Kill {
                            at: 20_000,
                            gw: 0,
                            restart_ms: None,
                        },
                    ],
                ),
            ),
            // None behind a kvguard gateway: an engine that hangs under a reading client
            // is the filter's stall (asked, not deferred: ended); under a client that
            // left, its abort ends it, or — every call lost for the abort's 9 attempts,
            // which span about the lease TTL — the lease. The reaper's idle clock is for
            // requests no kvguard gateway carries (direct clients, other gateways), which
            // the simulator does not model.
            Mechanism::ReaperIdle => return None,
            Mechanism::ReaperReader => return None,
            // Two gateways sharing one host key; one is frozen for three periods while
            // the other renews (finding 37.4's schedule).
            Mechanism::SharedHostKey => (
                Promise::Invariant1,
                crate::findings::regressions()
                    .into_iter()
                    .find(|f| f.name == "37.4")?
                    .schedule,
            ),
            // A client leaving in the prefill's last moments behind a hiding P/D proxy,
            // which sends no decode leg: the prefill engine holds the blocks until its
            // lease, 30 s, unless the abort releases them (36.3's schedule).
            Mechanism::HandoffRelease => (
                Promise::Invariant2,
                crate::findings::regressions()
                    .into_iter()
                    .find(|f| f.name == "36.3")?
                    .schedule,
            ),
            // Every call from two gateways to kvguard-control lost for 40 s, past the
            // TTL (kvguard-control cut off from its gateways): nobody is heard from, so
            // no silence is evidence of death; a fast reader reads on.
            Mechanism::LeaseHold => (
                Promise::Invariant1,
                one(
                    Setup {
                        gateways: 2,
                        ..Setup::default()
                    },
                    vec![
                        fast(0),
                        Op::LoseCalls {
                            at: 10_000,
                            for_ms: 40_000,
                        },
                    ],
                ),
            ),
        })
    }
}

/// Readers just above the floor of engines producing ten times faster, at the shipped
/// defaults: the filter sees a chunk only every G / rate (82 s and 73 s, over the 60 s
/// idle timeout), so each stall ask must be deferred.
pub fn slow_readers() -> Schedule {
    Schedule {
        seed: 7,
        setup: Setup::default(),
        ops: vec![
            Op::stream(0, 0, 0, Client::Steady { bps: 400 }, 3_000, 30),
            Op::stream(1_000, 0, 0, Client::Steady { bps: 450 }, 3_000, 40),
        ],
    }
}

/// The mechanisms switched off for a run (none: the product).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mutations(u32);

impl Mutations {
    /// These, with `m` off too.
    #[must_use]
    pub fn without(self, m: Mechanism) -> Mutations {
        Mutations(self.0 | 1 << m as u32)
    }

    /// Whether `m` is switched off.
    pub fn off(self, m: Mechanism) -> bool {
        self.0 & (1 << m as u32) != 0
    }

    /// The reaper's limits with its switched-off clocks removed (the deferral keeps the
    /// replica's own).
    pub fn reaper(self, mut limits: Limits) -> Limits {
        if self.off(Mechanism::ReaperIdle) {
            limits.idle_timeout = None;
        }
        if self.off(Mechanism::ReaperReader) {
            // A reader clock that never fires. (None would also change the idle clock:
            // with no reader timeout it counts from the last data event, whoever is
            // slow, instead of the engine's own silence.)
            limits.reader_timeout = limits
                .reader_timeout
                .map(|_| Duration::from_secs(u64::from(u32::MAX)));
        }
        limits
    }
}

/// Mechanisms of the protocol that have no switch here, and why (the table's last rows).
pub const UNSWITCHED: [(&str, &str); 3] = [
    (
        "replay memory",
        "modelled (every abort call's signature is verified and remembered), not switched: no simulated actor replays a captured call; it exists against one replayed within its ±30 s window",
    ),
    (
        "reaper max age",
        "off at the shipped defaults (`--max-age` unset): nothing to switch off",
    ),
    (
        "end held at the gateway",
        "the world takes the filter's verdict at the upstream's end as it comes; it exists so that kvguard-control's end of a stream it does not defer is not read as complete",
    ),
];

/// One row of the table: a mechanism off, over a campaign.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Row {
    /// Per promise: seeds that break it with the mechanism off and kept it with
    /// everything on, and the first of them.
    pub broken: BTreeMap<Promise, (u64, u64)>,
    /// The witness's verdict: `Some(true)` it breaks its promise with the mechanism off
    /// and keeps every promise with it on; `None`: no witness.
    pub witness: Option<bool>,
}

/// The promises a run breaks.
fn broken(s: &Schedule, m: Mutations) -> BTreeSet<Promise> {
    crate::run(s, m)
        .violations
        .iter()
        .map(|v| v.promise)
        .collect()
}

/// Whether `m`'s witness shows it: every promise kept with everything on, its promise
/// broken with `m` off. `None`: no witness.
pub fn witness_holds(m: Mechanism) -> Option<bool> {
    let (promise, s) = m.witness()?;
    Some(
        broken(&s, Mutations::default()).is_empty()
            && broken(&s, Mutations::default().without(m)).contains(&promise),
    )
}

/// Runs `seeds` with everything on, then with each of `mechanisms` off in turn, on
/// `threads` threads; one row per mechanism.
pub fn ablate(seeds: std::ops::Range<u64>, mechanisms: &[Mechanism], threads: usize) -> Vec<Row> {
    let threads = threads.max(1) as u64;
    let chunks: Vec<std::ops::Range<u64>> = (0..threads)
        .map(|t| {
            let n = seeds.end - seeds.start;
            let a = seeds.start + n * t / threads;
            a..seeds.start + n * (t + 1) / threads
        })
        .collect();
    let parts: Vec<Vec<Row>> = std::thread::scope(|scope| {
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|range| {
                scope.spawn(move || {
                    let mut rows = vec![Row::default(); mechanisms.len()];
                    for seed in range {
                        let s = Schedule::generate(seed);
                        let base = broken(&s, Mutations::default());
                        for (row, m) in rows.iter_mut().zip(mechanisms) {
                            for p in broken(&s, Mutations::default().without(*m)) {
                                if !base.contains(&p) {
                                    let e = row.broken.entry(p).or_insert((0, seed));
                                    e.0 += 1;
                                }
                            }
                        }
                    }
                    rows
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut rows = vec![Row::default(); mechanisms.len()];
    for part in parts {
        for (row, p) in rows.iter_mut().zip(part) {
            for (promise, (n, first)) in p.broken {
                let e = row.broken.entry(promise).or_insert((0, first));
                e.0 += n;
                e.1 = e.1.min(first);
            }
        }
    }
    for (row, m) in rows.iter_mut().zip(mechanisms) {
        row.witness = witness_holds(*m);
    }
    rows
}

/// The table in Markdown: mechanism off → promises broken (seeds, first seed), the
/// witness; then the mechanisms with no switch.
pub fn table(seeds: u64, mechanisms: &[Mechanism], rows: &[Row]) -> String {
    let mut out = format!(
        "| mechanism off (`--off NAME`) | promises broken on {seeds} seeds (seeds, first seed) | its witness |\n|---|---|---|\n"
    );
    for (m, row) in mechanisms.iter().zip(rows) {
        let broken = if row.broken.is_empty() {
            "none".to_owned()
        } else {
            row.broken
                .iter()
                .map(|(p, (n, first))| format!("{p:?} ({n}, seed {first})"))
                .collect::<Vec<_>>()
                .join("; ")
        };
        let witness = match (row.witness, m.witness()) {
            (Some(true), Some((p, _))) => format!("breaks {p:?}"),
            (Some(false), Some((p, _))) => format!("**does not break {p:?}**"),
            _ => "none".to_owned(),
        };
        out += &format!("| `{}` | {broken} | {witness} |\n", m.name());
    }
    for (name, why) in UNSWITCHED {
        out += &format!("| {name} | no switch: {why} | — |\n");
    }
    out
}
