//! The simulator at fleet scale (issue 35 point 7): `G` gateways × `R` replicas behind a
//! hop that hides disconnects, each gateway carrying the same load whatever the fleet's
//! size, a zone of gateways lost in the middle; what each kvguard-control replica
//! receives per second, by kind, and how long an abort and a lease take, so that the
//! docs can state how each grows with the fleet ([`run`], `scripts/sim --fleet`).
//!
//! The world is the same as every seed's (the real filter core in each gateway, the
//! real control core in each replica, every promise checked); only the schedule is
//! bigger. The balancing is the sim's: every call a gateway makes reaches a replica of
//! the control cluster at random (no per-replica target), as does the in-band renewal
//! over the upstream cluster.

use crate::oracles::Cause;
use crate::rng::Rng;
use crate::schedule::{Client, Op, Schedule, Setup};
use crate::world::EngineEnd;
use crate::Mutations;
use std::fmt;
use std::time::Instant;

/// What one replica received, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Received {
    /// Abort calls from gateways (stall asks included).
    pub aborts: u64,
    /// Aborts forwarded by a peer that did not hold the id (`Peers::forward_abort`).
    pub peer_aborts: u64,
    /// Aborts fanned out by a peer to every leg (P/D, `Peers::fan_out_abort`).
    pub pd_fan_out: u64,
    /// Lease renewals from gateways (out of band and in band).
    pub renewals: u64,
    /// Renewals a peer accepted and fanned out (`fan_out_renewal`).
    pub peer_renewals: u64,
}

/// How long a gateway's load lasts (virtual ms): streams start uniformly within it.
pub const LOAD_MS: u64 = 240_000;
/// When the zone is lost.
pub const ZONE_LOST_AT_MS: u64 = 120_000;

/// A fleet to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fleet {
    /// Gateways (at most 255).
    pub gateways: u8,
    /// kvguard-control replicas, peers of each other (at most 255).
    pub replicas: u8,
    /// Streams each gateway carries over [`LOAD_MS`].
    pub per_gateway: u32,
    /// The last third of the gateways (a zone; none of 1 or 2) killed for good at
    /// [`ZONE_LOST_AT_MS`].
    pub zone_lost: bool,
    /// Replica 0 (of two or more) lost for good at [`ZONE_LOST_AT_MS`], its engine with
    /// it.
    pub replica_lost: bool,
    /// Prefill/decode: the first half of the replicas `--pd-role prefill`, the rest
    /// `decode`; each stream's prefill leg on one, its decode leg on another.
    pub pd: bool,
    /// Seeds the schedule and the run.
    pub seed: u64,
}

impl Fleet {
    /// The same fleet with `k` times the gateways and replicas.
    #[must_use]
    pub fn times(self, k: u8) -> Fleet {
        Fleet {
            gateways: self.gateways.saturating_mul(k),
            replicas: self.replicas.saturating_mul(k),
            ..self
        }
    }

    /// The fleet's schedule: each gateway's streams at random times in [`LOAD_MS`], to
    /// a replica at random; 60 % read fast, 30 % leave after 1–20 s, 10 % read at
    /// 0.5–2 KB/s; 100–1500 tokens every 20–40 ms (slow readers' at most 300).
    pub fn schedule(&self) -> Schedule {
        let mut r = Rng::new(self.seed);
        let (g, rs) = (self.gateways.max(1), self.replicas.max(1));
        let mut ops = Vec::new();
        for gw in 0..g {
            for _ in 0..self.per_gateway {
                let (client, max_tokens) = match r.range(0, 9) {
                    0..=5 => (Client::Fast, 1500),
                    6..=8 => (
                        Client::Leaves {
                            after_ms: r.range(1_000, 20_000),
                        },
                        1500,
                    ),
                    _ => (
                        Client::Steady {
                            bps: r.range(500, 2_000),
                        },
                        300,
                    ),
                };
                ops.push(Op::stream(
                    r.range(0, LOAD_MS),
                    gw,
                    r.range(0, u64::from(rs) - 1) as u8,
                    client,
                    r.range(100, max_tokens) as u32,
                    r.range(20, 40) as u32,
                ));
            }
            if self.zone_lost && gw >= g - g / 3 {
                ops.push(Op::Kill {
                    at: ZONE_LOST_AT_MS,
                    gw,
                    restart_ms: None,
                });
            }
        }
        if self.replica_lost && rs >= 2 {
            ops.push(Op::ReplicaLost {
                at: ZONE_LOST_AT_MS,
                replica: 0,
            });
        }
        Schedule {
            seed: self.seed,
            setup: Setup {
                gateways: g,
                replicas: rs,
                hop_hides: true,
                pd: self.pd && rs >= 2,
                ..Setup::default()
            },
            ops,
        }
    }
}

/// Mean and largest over the replicas, per second.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rate {
    /// Mean over the replicas.
    pub mean: f64,
    /// The busiest replica's.
    pub max: f64,
}

/// Median and 99th percentile, ms (`None`: no sample).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Latency {
    /// Samples.
    pub n: usize,
    /// Median.
    pub p50: Option<u64>,
    /// 99th percentile.
    pub p99: Option<u64>,
}

impl Latency {
    fn of(mut v: Vec<u64>) -> Latency {
        v.sort_unstable();
        let at = |q: f64| (!v.is_empty()).then(|| v[((v.len() - 1) as f64 * q).round() as usize]);
        Latency {
            n: v.len(),
            p50: at(0.5),
            p99: at(0.99),
        }
    }
}

/// A fleet run's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetReport {
    /// What ran.
    pub fleet: Fleet,
    /// Streams.
    pub streams: usize,
    /// Virtual seconds simulated.
    pub simulated_s: f64,
    /// Wall seconds the run took.
    pub wall_s: f64,
    /// Per replica per second: abort calls from gateways.
    pub aborts: Rate,
    /// ... aborts forwarded by peers.
    pub peer_aborts: Rate,
    /// ... P/D fan-out from peers.
    pub pd_fan_out: Rate,
    /// ... renewals from gateways.
    pub renewals: Rate,
    /// ... renewals fanned out by peers.
    pub peer_renewals: Rate,
    /// From a client's leaving to its engine's end, for those ended by kvguard.
    pub abort_latency: Latency,
    /// From a gateway's death to its streams' engines' end by the lease.
    pub lease_latency: Latency,
    /// Violations: of known findings, unknown.
    pub violations: (usize, usize),
}

/// Runs `fleet` (the product: every mechanism on).
pub fn run(fleet: &Fleet) -> FleetReport {
    let sched = fleet.schedule();
    let wall = Instant::now();
    let r = crate::run(&sched, Mutations::default());
    let wall_s = wall.elapsed().as_secs_f64();
    let secs = (r.simulated_ms as f64 / 1000.0).max(1.0);
    let rate = |f: fn(&Received) -> u64| {
        let v: Vec<f64> = r
            .stats
            .received
            .iter()
            .map(|x| f(x) as f64 / secs)
            .collect();
        Rate {
            mean: v.iter().sum::<f64>() / v.len().max(1) as f64,
            max: v.iter().copied().fold(0.0, f64::max),
        }
    };
    let mut aborts = Vec::new();
    let mut leases = Vec::new();
    for e in &r.stats.ends {
        match (e.orphan, e.engine_end) {
            (Some((Cause::Left, since)), Some((t, EngineEnd::Ended(_)))) => {
                aborts.push(t.saturating_sub(since));
            }
            (Some((Cause::GatewayGone, _)), Some((t, EngineEnd::Ended(_)))) => {
                if let Some(died) = e.gateway_died {
                    leases.push(t.saturating_sub(died));
                }
            }
            _ => {}
        }
    }
    let known = r.violations.iter().filter(|v| v.finding.is_some()).count();
    FleetReport {
        fleet: *fleet,
        streams: r.streams,
        simulated_s: secs,
        wall_s,
        aborts: rate(|x| x.aborts),
        peer_aborts: rate(|x| x.peer_aborts),
        pd_fan_out: rate(|x| x.pd_fan_out),
        renewals: rate(|x| x.renewals),
        peer_renewals: rate(|x| x.peer_renewals),
        abort_latency: Latency::of(aborts),
        lease_latency: Latency::of(leases),
        violations: (known, r.violations.len() - known),
    }
}

/// The header of [`FleetReport`]'s table rows.
pub const TABLE_HEAD: &str = "| G × R | streams | simulated s | wall s | per replica per s, mean / busiest: aborts | peer aborts | P/D fan-out | renewals | peer renewals | abort latency p50 / p99 ms (n) | lease latency p50 / p99 ms (n) | violations known / unknown |\n|---|---|---|---|---|---|---|---|---|---|---|---|";

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2} / {:.2}", self.mean, self.max)
    }
}

impl fmt::Display for Latency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.p50, self.p99) {
            (Some(a), Some(b)) => write!(f, "{a} / {b} ({})", self.n),
            _ => write!(f, "— (0)"),
        }
    }
}

impl fmt::Display for FleetReport {
    /// One row of the table.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "| {} × {}{} | {} | {:.0} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
            self.fleet.gateways,
            self.fleet.replicas,
            match (self.fleet.pd, self.fleet.replica_lost) {
                (true, true) => " P/D, replica lost",
                (true, false) => " P/D",
                (false, true) => ", replica lost",
                (false, false) => "",
            },
            self.streams,
            self.simulated_s,
            self.wall_s,
            self.aborts,
            self.peer_aborts,
            self.pd_fan_out,
            self.renewals,
            self.peer_renewals,
            self.abort_latency,
            self.lease_latency,
            self.violations.0,
            self.violations.1
        )
    }
}

/// A message whose load on each replica grows with the fleet: a known finding at scale
/// (`scripts/sim --fleet`), asserted still found by `sim/tests/fleet.rs` so that a fix
/// shows (then it moves to a regression there).
#[derive(Debug, Clone, Copy)]
pub struct ScaleFinding {
    /// `"sim.3"`.
    pub name: &'static str,
    /// In a line.
    pub title: &'static str,
    /// The fleet that shows it, at its smaller size; it is run again at three times the
    /// gateways and replicas ([`Fleet::times`]).
    pub fleet: Fleet,
    /// The message, per replica per second.
    pub rate: fn(&FleetReport) -> f64,
}

/// The fleet's known findings.
pub fn known() -> Vec<ScaleFinding> {
    let fleet = Fleet {
        gateways: 3,
        replicas: 3,
        per_gateway: 20,
        zone_lost: false,
        replica_lost: false,
        pd: false,
        seed: 1,
    };
    vec![
        ScaleFinding {
            name: "sim.3",
            title: "an abort for an id its replica does not hold goes to every peer: each replica receives (R−1)/R of the fleet's unrouted aborts",
            fleet,
            rate: |r| r.peer_aborts.mean,
        },
        ScaleFinding {
            name: "sim.4",
            title: "P/D: every abort goes to every peer: each replica receives every abort of the fleet",
            fleet: Fleet { pd: true, ..fleet },
            rate: |r| r.pd_fan_out.mean,
        },
        ScaleFinding {
            name: "sim.5",
            title: "every accepted renewal is fanned out to every peer: each replica receives every gateway's renewals",
            fleet,
            rate: |r| r.peer_renewals.mean,
        },
    ]
}
