//! What a run is made of: the world's setup and a list of operations at virtual times.
//! A seed generates one ([`Schedule::generate`]); the shrinker removes operations from
//! it; the findings registry writes them by hand. Times are virtual milliseconds.

use crate::rng::Rng;
use std::fmt;

/// The world's shape and configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    /// Gateways (Envoy processes running the filter).
    pub gateways: u8,
    /// kvguard-control replicas (with `--peers` when more than one).
    pub replicas: u8,
    /// The hop between gateways and kvguard-control hides a gateway's disconnects (an
    /// L7 proxy keeping its upstream connection, LiteLLM, a P/D proxy).
    pub hop_hides: bool,
    /// The hop routes `/v1/kvguard/lease` (the in-band renewal) to kvguard-control.
    pub hop_routes_lease: bool,
    /// Bytes the sockets between kvguard-control and the gateway hold (Linux grows them
    /// to megabytes).
    pub net_cap: u64,
    /// The filter's route `idle_timeout_ms` (shipped: 60 000).
    pub idle_ms: u64,
    /// Prefill/decode disaggregation: replica 0 is `--pd-role prefill`, replica 1
    /// `--pd-role decode` (peers of each other); each request's prefill leg runs on 0
    /// (a non-streaming answer), its decode leg, the stream, on 1.
    pub pd: bool,
    /// The hop queues each request this long before it reaches kvguard-control (a
    /// router's or LiteLLM's queue): a client may leave, and its abort arrive, first.
    pub hop_queue_ms: u64,
    /// A killed gateway goes with its pod: its listener's address answers nothing (a
    /// probe times out) instead of refusing.
    pub pods_deleted: bool,
    /// Every gateway was started from one config with a static `node.id`: they renew
    /// with one host key (finding 37.4's setup).
    pub shared_host_key: bool,
    /// Worker VMs per gateway process (Envoy `--concurrency`; 1: one).
    pub vms: u8,
    /// Clients speak HTTP/2 to the gateways: one that leaves cancels its stream
    /// (`RST_STREAM`: Envoy's `http2.remote_reset`, flag DR) rather than closing its
    /// connection (`downstream_remote_disconnect`, DC).
    pub h2: bool,
}

impl Default for Setup {
    /// The shipped defaults: one gateway, one replica, a plain hop, idle 60 s.
    fn default() -> Setup {
        Setup {
            gateways: 1,
            replicas: 1,
            hop_hides: false,
            hop_routes_lease: true,
            net_cap: 256 * 1024,
            idle_ms: 60_000,
            pd: false,
            hop_queue_ms: 0,
            pods_deleted: false,
            shared_host_key: false,
            vms: 1,
            h2: false,
        }
    }
}

/// How a client reads its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Client {
    /// Reads everything at once.
    Fast,
    /// Reads `bps` bytes per second, from the start to the end.
    Steady {
        /// Read rate, bytes/s.
        bps: u64,
    },
    /// Reads `bps`, but stops reading for `pause_ms` starting `after_ms` after its
    /// request.
    Pausing {
        /// Read rate, bytes/s.
        bps: u64,
        /// When the pause starts, from the request.
        after_ms: u64,
        /// How long it lasts.
        pause_ms: u64,
    },
    /// Never reads a byte, never leaves.
    Silent,
    /// Reads everything at once and leaves (a reset) `after_ms` after its request.
    Leaves {
        /// When it leaves, from the request.
        after_ms: u64,
    },
}

/// One operation of a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Gateway `gw` is hot-restarted: a child process (a new instance, the same host
    /// key, the same listener) takes the listen socket and every new request; the
    /// parent serves its open streams on, renewing, and exits `parent_ms` later
    /// (`--parent-shutdown-time-s`), its remaining streams cut downstream and the
    /// aborts its filter decides for them unsent.
    HotRestart {
        /// When.
        at: u64,
        /// Which.
        gw: u8,
        /// When the parent exits, from the child's start.
        parent_ms: u64,
    },
    /// Worker VM `vm` of gateway `gw` traps: nothing more runs in it, Envoy cuts each
    /// of its streams downstream at its next callback; the other VMs go on.
    Trap {
        /// When.
        at: u64,
        /// Which gateway.
        gw: u8,
        /// Which of its VMs.
        vm: u8,
    },
    /// A client sends a streaming request through gateway `gw` to replica `replica`.
    Stream {
        /// When.
        at: u64,
        /// Through which gateway.
        gw: u8,
        /// To which replica's proxy (the engine behind it).
        replica: u8,
        /// How the client reads.
        client: Client,
        /// Tokens the engine generates (one SSE event each).
        tokens: u32,
        /// Milliseconds between two tokens.
        token_ms: u32,
    },
    /// Gateway `gw` is SIGKILLed; restarted (a new process, the same host key)
    /// `restart_ms` later, or never.
    Kill {
        /// When.
        at: u64,
        /// Which.
        gw: u8,
        /// When it comes back, from the kill.
        restart_ms: Option<u64>,
    },
    /// Gateway `gw` is SIGSTOPped for `for_ms`.
    Freeze {
        /// When.
        at: u64,
        /// Which.
        gw: u8,
        /// How long.
        for_ms: u64,
    },
    /// The engine behind replica `replica` generates nothing for `for_ms` (every
    /// stream on it: an engine-wide pause).
    EnginePause {
        /// When.
        at: u64,
        /// Which replica's engine.
        replica: u8,
        /// How long.
        for_ms: u64,
    },
    /// Every call from gateways to kvguard-control (aborts, renewals) is lost for
    /// `for_ms`.
    LoseCalls {
        /// When.
        at: u64,
        /// How long.
        for_ms: u64,
    },
    /// Replica `replica`'s pod is lost for good, its engine with it: its streams are
    /// reset, the control cluster and the hop route around it from then on.
    ReplicaLost {
        /// When.
        at: u64,
        /// Which.
        replica: u8,
    },
    /// The replicas cannot reach each other for `for_ms` (a NetworkPolicy, a partition
    /// between zones): every peer call (forwarded abort, P/D fan-out, renewal fan-out)
    /// times out.
    PartitionPeers {
        /// When.
        at: u64,
        /// How long.
        for_ms: u64,
    },
    /// Replica `replica`'s process restarts (a crash, an OOM kill, a rollout): it comes
    /// back at once with empty memory (no table, tombstones or leases); the
    /// streams it relayed are reset both ways (its engine sees its client go).
    ReplicaRestart {
        /// When.
        at: u64,
        /// Which.
        replica: u8,
    },
    /// A hop on the admin path retries every call for `for_ms`: each reaches
    /// kvguard-control twice, the same bytes `retry_ms` apart, and the gateway gets the
    /// second delivery's answer (the first's is lost with the attempt the hop gave up).
    HopRetries {
        /// When.
        at: u64,
        /// How long.
        for_ms: u64,
        /// How long after the first delivery the copy arrives.
        retry_ms: u64,
    },
    /// kvguard-control's admin listener is saturated for `for_ms`: each call waits
    /// `delay_ms` before it is handled (past the caller's 1 s timeout, it is handled
    /// anyway, after the caller's retry may have been).
    SlowAdmin {
        /// When.
        at: u64,
        /// How long.
        for_ms: u64,
        /// Each call's wait.
        delay_ms: u64,
    },
    /// The data path from replica `replica` toward the gateways is partitioned for
    /// `for_ms`: no byte moves either way, no connection closes.
    PartitionData {
        /// When.
        at: u64,
        /// Whose.
        replica: u8,
        /// How long.
        for_ms: u64,
    },
    /// Gateway `gw`'s wall clock steps by `step_s` seconds (NTP, a VM resumed); its
    /// timers run on the monotonic clock, its signatures on the wall clock.
    ClockStep {
        /// When.
        at: u64,
        /// Which.
        gw: u8,
        /// By how much (negative: back).
        step_s: i64,
    },
}

impl Op {
    /// A stream (for schedules written by hand).
    pub fn stream(at: u64, gw: u8, replica: u8, client: Client, tokens: u32, token_ms: u32) -> Op {
        Op::Stream {
            at,
            gw,
            replica,
            client,
            tokens,
            token_ms,
        }
    }

    /// When it happens.
    pub fn at(&self) -> u64 {
        match *self {
            Op::HotRestart { at, .. }
            | Op::Trap { at, .. }
            | Op::Stream { at, .. }
            | Op::Kill { at, .. }
            | Op::Freeze { at, .. }
            | Op::EnginePause { at, .. }
            | Op::LoseCalls { at, .. }
            | Op::ReplicaLost { at, .. }
            | Op::PartitionPeers { at, .. }
            | Op::ReplicaRestart { at, .. }
            | Op::HopRetries { at, .. }
            | Op::SlowAdmin { at, .. }
            | Op::PartitionData { at, .. }
            | Op::ClockStep { at, .. } => at,
        }
    }
}

/// A whole run: seed (for latencies and losses), setup, operations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Seeds the run's own randomness (call latencies, losses, jitter).
    pub seed: u64,
    /// The world.
    pub setup: Setup,
    /// What happens, in any order (the world sorts them by time).
    pub ops: Vec<Op>,
}

/// `--parent-shutdown-time-s` of the generated hot restarts: `robust_hot_restart.rs`'s
/// 6 s (with `--drain-time-s 4`), 60 s, and Envoy's default 900 s (with 600 s). The drain
/// time only closes the parent's idle connections (each simulated stream is one request
/// on its own connection), so it is not modelled.
pub const PARENT_SHUTDOWN_MS: [u64; 3] = [6_000, 60_000, 900_000];

/// Readers are generated at or above this rate: the documented floor is
/// `G / max(R, idle)` ≈ 0.37 KB/s with the shipped buffers and `--reader-timeout`.
pub const MIN_READER_BPS: u64 = 400;

impl Schedule {
    /// The schedule of `seed`: a small world at mostly shipped defaults, a few streams of
    /// every kind of client, and a few faults.
    pub fn generate(seed: u64) -> Schedule {
        let mut r = Rng::new(seed);
        let gateways = r.range(1, 2) as u8;
        let pd = r.chance(100);
        let replicas = if pd { 2 } else { r.range(1, 2) as u8 };
        let setup = Setup {
            pd,
            gateways,
            replicas,
            hop_hides: r.chance(500),
            hop_routes_lease: !r.chance(150),
            net_cap: r.pick(&[64 * 1024, 256 * 1024, 1024 * 1024]),
            // Mostly the shipped 60 s; any route may set a shorter one.
            idle_ms: r.pick(&[60_000, 60_000, 60_000, 30_000]),
            hop_queue_ms: 0,
            pods_deleted: false,
            shared_host_key: false,
            vms: 1,
            h2: false,
        };
        let mut ops = Vec::new();
        for _ in 0..r.range(1, 6) {
            let client = match r.range(0, 9) {
                0..=2 => Client::Fast,
                3..=4 => Client::Steady {
                    bps: r.range(MIN_READER_BPS, 4000),
                },
                5..=6 => {
                    let bps = r.range(1500, 6000);
                    Client::Pausing {
                        bps,
                        after_ms: r.range(1_000, 120_000),
                        pause_ms: r.range(1_000, max_pause_ms(bps)),
                    }
                }
                7 => Client::Silent,
                _ => Client::Leaves {
                    after_ms: r.range(0, 60_000),
                },
            };
            ops.push(Op::Stream {
                at: r.range(0, 60_000),
                gw: r.range(0, u64::from(gateways) - 1) as u8,
                replica: r.range(0, u64::from(replicas) - 1) as u8,
                client,
                tokens: r.range(50, 3000) as u32,
                token_ms: r.range(10, 60) as u32,
            });
        }
        for _ in 0..r.range(0, 2) {
            let at = r.range(0, 90_000);
            let gw = r.range(0, u64::from(gateways) - 1) as u8;
            ops.push(match r.range(0, 3) {
                // Short (under half the idle timeout: nothing may be cut) or long (over
                // it: cutting is the filter's job).
                3 => Op::EnginePause {
                    at,
                    replica: r.range(0, u64::from(replicas) - 1) as u8,
                    for_ms: if r.chance(500) {
                        r.range(100, setup.idle_ms / 2 - 1_000)
                    } else {
                        r.range(setup.idle_ms + 5_000, 3 * setup.idle_ms)
                    },
                },
                0 => Op::Kill {
                    at,
                    gw,
                    restart_ms: r.chance(500).then(|| r.range(100, 20_000)),
                },
                1 => Op::Freeze {
                    at,
                    gw,
                    for_ms: r.range(100, 45_000),
                },
                _ => Op::LoseCalls {
                    at,
                    for_ms: r.range(100, 10_000),
                },
            });
        }
        // Drawn last, so that the rest of each seed's schedule is what it was before.
        let mut setup = setup;
        if r.chance(100) {
            setup.hop_queue_ms = r.range(50, 2_000);
        }
        setup.pods_deleted = r.chance(300);
        if replicas > 1 && r.chance(150) {
            ops.push(Op::PartitionPeers {
                at: r.range(0, 90_000),
                for_ms: r.range(500, 20_000),
            });
        }
        if r.chance(100) {
            ops.push(Op::ReplicaRestart {
                at: r.range(0, 90_000),
                replica: r.range(0, u64::from(replicas) - 1) as u8,
            });
        }
        if r.chance(100) {
            ops.push(Op::HopRetries {
                at: r.range(0, 90_000),
                for_ms: r.range(500, 20_000),
                retry_ms: r.range(50, 900),
            });
        }
        if r.chance(100) {
            ops.push(Op::SlowAdmin {
                at: r.range(0, 90_000),
                for_ms: r.range(500, 20_000),
                delay_ms: r.range(100, 3_000),
            });
        }
        if r.chance(100) {
            // Within the signatures' ±30 s window: a step there must change nothing.
            let step = r.range(1, 25) as i64;
            ops.push(Op::ClockStep {
                at: r.range(0, 90_000),
                gw: r.range(0, u64::from(gateways) - 1) as u8,
                step_s: if r.chance(500) { step } else { -step },
            });
        }
        if r.chance(100) {
            // Short (under half the idle timeout: nothing may be cut) or long (past it: a
            // stall to its readers).
            ops.push(Op::PartitionData {
                at: r.range(0, 90_000),
                replica: r.range(0, u64::from(replicas) - 1) as u8,
                for_ms: if r.chance(500) {
                    r.range(100, setup.idle_ms / 2 - 1_000)
                } else {
                    r.range(setup.idle_ms + 5_000, 2 * setup.idle_ms)
                },
            });
        }
        // The gateway-side faults of worker VMs, hot restarts and shared host keys,
        // drawn after everything above.
        setup.shared_host_key = gateways > 1 && r.chance(100);
        if r.chance(100) {
            setup.vms = r.range(2, 4) as u8;
        }
        if r.chance(100) {
            ops.push(Op::HotRestart {
                at: r.range(0, 90_000),
                gw: r.range(0, u64::from(gateways) - 1) as u8,
                // The real-process test's 6 s, and Envoy's default 900 s.
                parent_ms: r.pick(&PARENT_SHUTDOWN_MS),
            });
        }
        if setup.vms > 1 && r.chance(500) {
            ops.push(Op::Trap {
                at: r.range(0, 90_000),
                gw: r.range(0, u64::from(gateways) - 1) as u8,
                vm: r.range(0, u64::from(setup.vms) - 1) as u8,
            });
        }
        // Drawn last, so that the rest of each seed's schedule is what it was before.
        setup.h2 = r.chance(300);
        Schedule { seed, setup, ops }
    }
}

/// The longest pause a `bps` reader may take and still read within the documented bound:
/// its silence at the filter (the pause, plus the time to drain what Envoy must release
/// before reading again, [`crate::world::G_BYTES`]) stays under `--reader-timeout`, with
/// 5 s to spare.
pub fn max_pause_ms(bps: u64) -> u64 {
    let drain = crate::world::G_BYTES * 1000 / bps.max(1);
    crate::world::READER_TIMEOUT_MS
        .saturating_sub(drain)
        .saturating_sub(5_000)
        .max(1_000)
}

impl fmt::Display for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Client::Fast => write!(f, "fast"),
            Client::Steady { bps } => write!(f, "steady {bps} B/s"),
            Client::Pausing {
                bps,
                after_ms,
                pause_ms,
            } => write!(f, "{bps} B/s, pauses {pause_ms} ms at +{after_ms} ms"),
            Client::Silent => write!(f, "silent"),
            Client::Leaves { after_ms } => write!(f, "leaves at +{after_ms} ms"),
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Op::HotRestart { at, gw, parent_ms } => write!(
                f,
                "{at:>9} gw{gw} hot-restarted: the parent drains, exits {parent_ms} ms later"
            ),
            Op::Trap { at, gw, vm } => write!(f, "{at:>9} gw{gw}'s worker VM {vm} traps"),
            Op::Stream {
                at,
                gw,
                replica,
                client,
                tokens,
                token_ms,
            } => write!(
                f,
                "{at:>9} stream via gw{gw} to replica{replica}: {tokens} tokens every {token_ms} ms, client {client}"
            ),
            Op::Kill { at, gw, restart_ms } => match restart_ms {
                Some(r) => write!(f, "{at:>9} gw{gw} killed, restarted {r} ms later"),
                None => write!(f, "{at:>9} gw{gw} killed for good"),
            },
            Op::Freeze { at, gw, for_ms } => write!(f, "{at:>9} gw{gw} frozen {for_ms} ms"),
            Op::EnginePause {
                at,
                replica,
                for_ms,
            } => write!(f, "{at:>9} the engine behind replica{replica} pauses {for_ms} ms"),
            Op::LoseCalls { at, for_ms } => write!(f, "{at:>9} calls to kvguard-control lost for {for_ms} ms"),
            Op::ReplicaLost { at, replica } => write!(f, "{at:>9} replica{replica} lost for good (its engine with it)"),
            Op::PartitionPeers { at, for_ms } => write!(f, "{at:>9} the replicas cannot reach each other for {for_ms} ms"),
            Op::ReplicaRestart { at, replica } => write!(f, "{at:>9} replica{replica} restarts with empty memory"),
            Op::HopRetries { at, for_ms, retry_ms } => write!(f, "{at:>9} a hop on the admin path sends every call twice, {retry_ms} ms apart, for {for_ms} ms"),
            Op::SlowAdmin { at, for_ms, delay_ms } => write!(f, "{at:>9} kvguard-control's admin listener saturated for {for_ms} ms: each call waits {delay_ms} ms"),
            Op::ClockStep { at, gw, step_s } => write!(f, "{at:>9} gw{gw}'s wall clock steps {step_s:+} s"),
            Op::PartitionData { at, replica, for_ms } => write!(f, "{at:>9} the data path from replica{replica} is partitioned for {for_ms} ms"),
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.setup;
        writeln!(
            f,
            "seed {}: {} gateway(s){}{}{}{}, {} replica(s){}, hop {} disconnects{}{}, sockets {} KiB, filter idle {} ms",
            self.seed,
            s.gateways,
            if s.vms > 1 { format!(" of {} worker VMs", s.vms) } else { String::new() },
            if s.shared_host_key { " sharing one host key" } else { "" },
            if s.pods_deleted { " (a killed one's address answers nothing)" } else { "" },
            if s.h2 { " (clients on HTTP/2)" } else { "" },
            s.replicas,
            if s.pd { " (prefill, decode)" } else { "" },
            if s.hop_hides { "hiding" } else { "passing" },
            if s.hop_routes_lease { "" } else { " and answering 404 to /v1/kvguard/lease" },
            if s.hop_queue_ms > 0 { format!(", queueing each request {} ms", s.hop_queue_ms) } else { String::new() },
            s.net_cap / 1024,
            s.idle_ms
        )?;
        let mut ops = self.ops.clone();
        ops.sort_by_key(Op::at);
        for op in ops {
            writeln!(f, "  {op}")?;
        }
        Ok(())
    }
}
