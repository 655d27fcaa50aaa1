//! The world in virtual time: one event queue, gateways, replicas, the hop, the engines
//! behind the replicas and the clients, and the buffers between them.
//!
//! The data path of a stream, with its buffers (the gateway sees data only as its client
//! drains, which deferral depends on):
//!
//! ```text
//! engine ──▶ replica proxy ──(sockets, `net_cap`)──▶ hop ──▶ gateway (Envoy 32 KiB + client socket) ──▶ client
//! ```
//!
//! - The engine generates one SSE event per token whatever is read (vLLM keeps
//!   generating behind a full pipe) until its last token or until it is stopped.
//! - The replica's proxy takes a frame from the engine only when the sockets toward the
//!   gateway have room (`record_demand`, then `record_handed`), as hyper polls a body.
//! - Envoy reads the upstream while its buffer toward the client is under its high
//!   watermark and, once there, again only when the client drained it to the low one
//!   ([`HIGH`], [`LOW`]); each read is one `on_chunk` of the filter.
//! - Calls from the filter (aborts, renewals) reach a replica (the control cluster
//!   balances them) after 1–20 ms, may be lost, and time out on Envoy's timer.
//! - With P/D the hop is a P/D proxy: the prefill leg (a content-length answer of one
//!   frame) runs first, [`PREFILL_MS`]; the prefill engine then holds the prompt's
//!   blocks until the decode leg reads them, a release reaches the decode side, or its
//!   lease ends. A proxy whose client went sends no decode leg.

use crate::ablation::{Mechanism, Mutations};
use crate::fleet::Received;
use crate::gateway::{self, Gateway};
use crate::oracles::{Cause, Promise, Violation};
use crate::replica::flags::PD_KV_LEASE_MS;
use crate::replica::{
    abort_call, Ended, EntryRef, PeerPath, Releasing, Replica, Waits, PEER_TIMEOUT_MS,
};
use crate::rng::Rng;
use crate::schedule::{Client, Op, Schedule};
use crate::timeline::Timeline;
use kvguard_contract::lease::Renewal;
use kvguard_contract::Domain;
use kvguard_contract::{AbortReason, InstanceId, RequestId, ABORT_PATH, DATA_LEASE_PATH};
use kvguard_control_core::lease::{Expiry, ProbeAnswer};
use kvguard_control_core::scan::BodyKind;
use kvguard_filter_core::engine::Action;
use kvguard_filter_core::request::flags;
use kvguard_filter_core::Engine;
use kvguard_filter_core::OutcomeTag;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::time::Instant;

pub use crate::replica::flags::READER_TIMEOUT_MS;

/// Bytes of one token's SSE event.
pub const EV_BYTES: u64 = 256;
/// The stream's last event.
const DONE: &[u8] = b"data: [DONE]\n\n";
/// Envoy's high watermark toward the client: its 32 KiB buffer and the client's socket.
pub const HIGH: u64 = 36 * 1024;
/// What the client must drain before Envoy reads the upstream again (`G`; measured
/// G ≤ 33 KB with the shipped buffers, filter/README.md "Slow readers").
pub const G_BYTES: u64 = 32 * 1024;
/// Envoy's low watermark.
pub const LOW: u64 = HIGH - G_BYTES;
/// The filter's tick (shipped).
pub const TICK_MS: u64 = 250;
/// How often bytes move.
const FLOW_MS: u64 = 100;
/// How often kvguard-control's reaper and lease loop look (1 s with the shipped flags).
const CONTROL_TICK_MS: u64 = 1_000;
/// How long a prefill leg computes its prompt: drawn per request from this range.
pub const PREFILL_MS: (u64, u64) = (50, 3_000);
/// The longest a run goes on after its last operation.
const TAIL_MS: u64 = 3_600_000;

/// Where a client is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientState {
    /// Not started yet.
    Waiting,
    /// Reading (or meaning to).
    Reading,
    /// Read its whole response.
    Done,
    /// Left (reset).
    Left,
    /// Its stream was closed by kvguard.
    Cut,
    /// Its gateway died under it.
    Dropped,
}

/// How the engine's generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineEnd {
    /// Its last token.
    Finished,
    /// Stopped by kvguard-control (an abort, the reaper, the lease).
    Ended(AbortReason),
    /// Its connection closed under it (the client's side went away).
    Disconnected,
    /// It never reached the engine: refused by kvguard-control (a tombstone), or
    /// dropped by a passing hop whose client left while it queued.
    NotAdmitted,
    /// Its replica's pod was lost, the engine with it.
    Lost,
}

/// A P/D request's prefill leg and the blocks its engine holds for the decode side.
#[derive(Debug, Clone)]
pub struct Prefill {
    /// The prefill replica.
    pub replica: u8,
    entry: Option<EntryRef>,
    /// When its answer was handed on: the engine holds the blocks from then.
    pub held_since: Option<u64>,
    /// When and how the blocks were let go (`read` by the decode leg, `released` or
    /// `rejected` through the decode side); `None`: held until the engine's lease.
    pub freed: Option<(u64, &'static str)>,
    /// A release of them reached no decode side in time (counted `failed`), or the
    /// prefill replica restarted and forgot the hand-off: the engine's lease is their
    /// bound.
    pub lease_bound: bool,
}

impl Prefill {
    /// When the blocks are let go: freed, or at the engine's lease.
    pub fn blocks_end(&self) -> Option<u64> {
        let held = self.held_since?;
        Some(self.freed.map_or(held + PD_KV_LEASE_MS, |(t, _)| t))
    }
}

/// One stream, across every actor.
#[derive(Debug)]
pub struct Stream {
    /// Its operation.
    pub op: Op,
    /// Client kind.
    pub client: Client,
    /// Gateway.
    pub gw: u8,
    gw_generation: u32,
    ctx: u32,
    /// Replica.
    pub replica: u8,
    /// Its id (`x-request-id`).
    pub id: RequestId,
    start: u64,
    /// When kvguard-control admitted it (the engine starts then).
    admitted: Option<u64>,
    tokens: u64,
    token_ms: u64,
    content_len: u64,
    /// The gateway instance it came through.
    pub instance: Option<InstanceId>,
    /// The `x-kvguard-instance` value it carried (the proof of life).
    pub tag: Option<Vec<u8>>,
    /// When and how the engine stopped.
    pub engine_end: Option<(u64, EngineEnd)>,
    entry: Option<EntryRef>,
    handed: u64,
    upstream_end: Option<u64>,
    hop_drains: bool,
    pulled: u64,
    /// The proxy's socket toward the gateway filled, and its writer waits for Linux to
    /// wake it.
    socket_full: bool,
    envoy_reading: bool,
    eos_passed: bool,
    end_held: bool,
    gw_done: bool,
    read: u64,
    /// The client.
    pub state: ClientState,
    last_chunk: Option<u64>,
    /// Why and since when nobody reads it.
    pub orphan: Option<(Cause, u64)>,
    /// The first end kvguard made of it: when, who, reason.
    pub kvguard_end: Option<(u64, String, AbortReason)>,
    /// How the last abort call about it was decided.
    pub last_answer: Option<String>,
    /// When kvguard-control saw its response complete.
    pub completed_at: Option<u64>,
    /// The last abort call about it was lost, or its answer came late (it timed out at
    /// the gateway).
    pub last_call_lost: bool,
    /// How long its gateway was frozen in all (it counts as its client's silence).
    frozen_ms: u64,
    /// When its gateway died while it ran.
    gateway_died: Option<u64>,
    /// Generation time so far (the engine's pauses do not count).
    gen_ms: u64,
    /// The longest pause of its engine.
    pub engine_paused_ms: u64,
    /// Its replica restarted after it completed there (the completion forgotten).
    pub completion_forgotten: bool,
    /// The last abort call about it was decided while the replicas could not reach each
    /// other.
    pub peers_cut: bool,
    /// When its worker VM trapped before its response passed the filter, or while its
    /// engine ran.
    pub vm_trapped: Option<u64>,
    /// Its gateway process ran beside a hot restart's parent or child (one host key,
    /// one listener) while it ran.
    pub hot_restart: bool,
    /// With P/D: its prefill leg.
    pub prefill: Option<Prefill>,
    /// A figure about it was counted wrong: what (`prefill_end`, `release`,
    /// `expiry_mode`), for the findings' classification.
    pub miscounted: Option<&'static str>,
}

impl Stream {
    /// It reached kvguard-control only after its gateway had died (a hop's queue).
    pub fn admitted_after_its_gateway_died(&self) -> bool {
        matches!((self.admitted, self.gateway_died), (Some(a), Some(d)) if a > d)
    }

    /// Whether its client reads within the documented bound: at or above the floor,
    /// each silence at the filter — a pause, its gateway's freezes, and the time to
    /// drain [`G_BYTES`] — under `--reader-timeout` (with 2 s to spare).
    fn is_reader(&self) -> bool {
        let drain = |bps: u64| G_BYTES * 1000 / bps.max(1);
        let silence = match self.client {
            Client::Fast => 0,
            Client::Steady { bps } => drain(bps),
            Client::Pausing { bps, pause_ms, .. } => drain(bps) + pause_ms,
            Client::Silent | Client::Leaves { .. } => return false,
        };
        silence + self.frozen_ms + 2_000 < READER_TIMEOUT_MS
    }

    /// Bytes of the body from `a` to `b`.
    fn bytes(&self, a: u64, b: u64) -> Vec<u8> {
        let body = self.tokens * EV_BYTES;
        (a..b)
            .map(|o| {
                if o < body {
                    event_byte(o)
                } else {
                    DONE.get((o - body) as usize).copied().unwrap_or(b'\n')
                }
            })
            .collect()
    }

    /// The client's read rate now (bytes per [`FLOW_MS`]).
    fn read_budget(&self, now: u64) -> u64 {
        let per_step = |bps: u64| (bps * FLOW_MS / 1000).max(1);
        match self.client {
            Client::Fast | Client::Leaves { .. } => u64::MAX,
            Client::Steady { bps } => per_step(bps),
            Client::Pausing {
                bps,
                after_ms,
                pause_ms,
            } => {
                let t = now.saturating_sub(self.start);
                if t >= after_ms && t < after_ms + pause_ms {
                    0
                } else {
                    per_step(bps)
                }
            }
            Client::Silent => 0,
        }
    }
}

/// Byte `o` of the token events: `data: {"choices":[{"delta":{"content":"xx…"}}]}\n\n`,
/// each [`EV_BYTES`] long.
fn event_byte(o: u64) -> u8 {
    const HEAD: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"";
    const TAIL: &[u8] = b"\"}}]}\n\n";
    let i = (o % EV_BYTES) as usize;
    let tail_at = EV_BYTES as usize - TAIL.len();
    if i < HEAD.len() {
        HEAD[i]
    } else if i >= tail_at {
        TAIL[i - tail_at]
    } else {
        b'x'
    }
}

/// What the event queue holds.
#[derive(Debug, Clone)]
enum Ev {
    ParentExits(u8, u32),
    Op(usize),
    Flow,
    GwTick(u8),
    ControlTick,
    Deliver(Call),
    Answer {
        gw: u8,
        generation: u32,
        token: u32,
        status: Option<u16>,
        body: Vec<u8>,
        stream: Option<usize>,
    },
    Leave(usize),
    GwSeesReset(usize),
    Admit(usize),
    Prefilled(usize),
    Released(usize, Releasing),
    Unfreeze(u8),
    Restart(u8),
}

#[derive(Debug, Clone)]
struct Call {
    gw: u8,
    generation: u32,
    token: u32,
    path: String,
    body: Vec<u8>,
    signature: Option<String>,
    stream: Option<usize>,
    /// A retrying hop's second delivery ([`Op::HopRetries`]): its answer is the one the
    /// gateway gets.
    copy: bool,
    /// How long the gateway waits for the answer.
    timeout_ms: u64,
}

#[derive(Debug)]
struct Queued {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// The result of one run.
#[derive(Debug)]
pub struct Report {
    /// Broken promises.
    pub violations: Vec<Violation>,
    /// Everything that happened.
    pub timeline: Timeline,
    /// Virtual ms simulated.
    pub simulated_ms: u64,
    /// Streams.
    pub streams: usize,
    /// What each replica received and when each stream ended (for the fleet figures).
    pub stats: Stats,
}

/// A run's figures ([`crate::fleet`]).
#[derive(Debug, Default)]
pub struct Stats {
    /// Per replica, the messages it received.
    pub received: Vec<Received>,
    /// Per stream.
    pub ends: Vec<StreamEnd>,
}

/// When a stream's reader went and its engine stopped.
#[derive(Debug, Clone, Copy)]
pub struct StreamEnd {
    /// Why and since when nobody reads it.
    pub orphan: Option<(Cause, u64)>,
    /// When and how its engine stopped.
    pub engine_end: Option<(u64, EngineEnd)>,
    /// When its gateway died under it.
    pub gateway_died: Option<u64>,
}

/// The world.
pub struct World {
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<Queued>>,
    sched: Schedule,
    rng: Rng,
    gateways: Vec<Gateway>,
    replicas: Vec<Replica>,
    streams: Vec<Stream>,
    answered: HashSet<(u8, u32, u32)>,
    lose_until: u64,
    engine_paused_until: Vec<u64>,
    stall_closes: Vec<(u8, u64, usize)>,
    /// Every event.
    pub timeline: Timeline,
    violations: Vec<Violation>,
    slack: u64,
    last_op: u64,
    mutations: Mutations,
    /// With the mass-stall valve off: each stream's own VM, by its context id.
    solo: HashMap<u32, Engine>,
    /// Streams before this index were settled when last looked at ([`World::settled`]).
    settled_to: usize,
    /// Replicas lost for good ([`Op::ReplicaLost`]).
    lost: Vec<bool>,
    /// Peer calls time out until then ([`Op::PartitionPeers`]).
    peers_cut_until: u64,
    /// A hop sends each call twice until then, the copy this long after
    /// ([`Op::HopRetries`]).
    hop_retries: (u64, u64),
    /// Each call waits this long at kvguard-control's admin listener until then
    /// ([`Op::SlowAdmin`]).
    slow_admin: (u64, u64),
    /// Each gateway's wall-clock step, seconds (its node's: a restart keeps it).
    wall_steps: Vec<i64>,
    /// Per replica, bytes it hands on do not move until then ([`Op::PartitionData`]).
    data_cut_until: Vec<u64>,
    /// Releases to a decode side not answered yet.
    releasing: usize,
}

impl World {
    /// A world for `sched`; `mutations` switch rules of the modelled composition off.
    pub fn new(sched: Schedule, mutations: Mutations) -> Option<World> {
        let base = Instant::now();
        let cfg = gateway::config(sched.setup.idle_ms)?;
        let w_gateways = sched.setup.gateways;
        let gateways = (0..sched.setup.gateways)
            .map(|g| gateway::process(&sched.setup, cfg.clone(), g, 0, sched.seed, 0))
            .collect();
        let n = sched.setup.replicas.max(1);
        // With P/D the first half prefill, the rest decode (two: replica 0 and replica 1).
        let role = |r: u8| {
            (sched.setup.pd && n >= 2).then_some(if r < n / 2 { "prefill" } else { "decode" })
        };
        let replicas: Vec<Replica> = (0..n)
            .map(|r| Replica::new(r, base, mutations, role(r)))
            .collect();
        // Faults stretch every bound by their length: a lease expiry is held while no
        // other gateway is heard from, an abort waits out lost calls.
        let slack = sched
            .ops
            .iter()
            .map(|op| match *op {
                Op::Freeze { for_ms, .. }
                | Op::LoseCalls { for_ms, .. }
                | Op::PartitionPeers { for_ms, .. }
                | Op::PartitionData { for_ms, .. }
                | Op::EnginePause { for_ms, .. } => for_ms,
                Op::HopRetries {
                    for_ms, retry_ms, ..
                } => for_ms + retry_ms,
                Op::SlowAdmin {
                    for_ms, delay_ms, ..
                } => for_ms + delay_ms,
                _ => 0,
            })
            .sum();
        let last_op = sched.ops.iter().map(Op::at).max().unwrap_or(0);
        let replicas_n = usize::from(sched.setup.replicas.max(1));
        let mut w = World {
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            rng: Rng::new(sched.seed ^ 0x5EED),
            sched,
            gateways,
            replicas,
            streams: Vec::new(),
            answered: HashSet::new(),
            lose_until: 0,
            engine_paused_until: vec![0; replicas_n],
            stall_closes: Vec::new(),
            timeline: Timeline::default(),
            violations: Vec::new(),
            slack,
            last_op,
            mutations,
            solo: HashMap::new(),
            settled_to: 0,
            lost: vec![false; replicas_n],
            peers_cut_until: 0,
            hop_retries: (0, 0),
            slow_admin: (0, 0),
            wall_steps: vec![0; usize::from(w_gateways)],
            data_cut_until: vec![0; replicas_n],
            releasing: 0,
        };
        for i in 0..w.sched.ops.len() {
            let at = w.sched.ops[i].at();
            w.at(at, Ev::Op(i));
        }
        w.at(0, Ev::Flow);
        w.at(0, Ev::ControlTick);
        for g in 0..w.gateways.len() {
            let phase = w.rng.range(0, TICK_MS - 1);
            w.at(phase, Ev::GwTick(g as u8));
        }
        Some(w)
    }

    fn at(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Queued {
            at,
            seq: self.seq,
            ev,
        }));
    }

    fn note(&mut self, actor: impl Into<String>, stream: Option<usize>, what: impl Into<String>) {
        self.timeline.push(self.now, actor, stream, what);
    }

    /// Runs to the end and checks the promises.
    pub fn run(mut self) -> Report {
        while let Some(Reverse(q)) = self.queue.pop() {
            self.now = q.at;
            if self.now > self.last_op + TAIL_MS || (self.now > self.last_op && self.settled()) {
                break;
            }
            self.handle(q.ev);
        }
        self.check_releases();
        self.check_orphans();
        let stats = Stats {
            received: self
                .replicas
                .iter()
                .zip(&self.lost)
                .filter(|(_, lost)| !**lost)
                .map(|(r, _)| r.received)
                .collect(),
            ends: self
                .streams
                .iter()
                .map(|s| StreamEnd {
                    orphan: self.orphan_since(s),
                    engine_end: s.engine_end,
                    gateway_died: s.gateway_died,
                })
                .collect(),
        };
        Report {
            violations: self.violations,
            timeline: self.timeline,
            simulated_ms: self.now,
            streams: self.streams.len(),
            stats,
        }
    }

    /// Nothing left to happen: every stream's engine stopped and its client is done
    /// with it, or its orphan bound has passed. A stream mostly stays so once it is, and
    /// every stream has started by then (after the last operation): a cursor skips those
    /// found so before, and the whole check confirms when it reaches the end.
    fn settled(&mut self) -> bool {
        while self
            .streams
            .get(self.settled_to)
            .is_some_and(|s| self.stream_settled(s))
        {
            self.settled_to += 1;
        }
        if self.settled_to < self.streams.len() || self.releasing > 0 {
            return false;
        }
        match self.streams.iter().position(|s| !self.stream_settled(s)) {
            Some(i) => {
                self.settled_to = i;
                false
            }
            None => true,
        }
    }

    fn stream_settled(&self, s: &Stream) -> bool {
        let blocks_held = s.prefill.as_ref().is_some_and(|p| {
            p.entry.is_some() || p.blocks_end().is_some_and(|end| self.now <= end)
        });
        if blocks_held {
            return false;
        }
        let client_done = s.state != ClientState::Reading || s.client == Client::Silent;
        let engine_done = s.engine_end.is_some()
            || self
                .orphan_since(s)
                .is_some_and(|(c, o)| self.now > o + self.orphan_bound(s, c, o));
        client_done && engine_done
    }

    /// How long after `since` the engine of `s`, which nobody reads for `cause`, must
    /// have stopped: its cause's bound; if its gateway or its worker VM died since (with
    /// the abort it had queued), the lease's bound from then; faults stretch either.
    fn orphan_bound(&self, s: &Stream, cause: Cause, since: u64) -> u64 {
        let idle = self.sched.setup.idle_ms;
        let from = |at: u64, c: Cause| at.saturating_sub(since) + c.bound_ms(idle);
        let bound = [
            Some(cause.bound_ms(idle)),
            s.gateway_died.map(|t| from(t, Cause::GatewayGone)),
            s.vm_trapped.map(|t| from(t, Cause::VmLost)),
        ];
        bound.into_iter().flatten().max().unwrap_or(0) + self.slack
    }

    fn orphan_since(&self, s: &Stream) -> Option<(Cause, u64)> {
        if let Some(o) = s.orphan {
            return Some(o);
        }
        // From the last byte that passed the filter: before the first, the wait is the
        // engine's (a first-token timeout is off by default).
        let last = s.last_chunk?;
        (s.client == Client::Silent && s.state == ClientState::Reading)
            .then_some((Cause::Silent, last))
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::ParentExits(g, generation) => self.parent_exits(g, generation),
            Ev::Op(i) => self.op(i),
            Ev::Flow => {
                self.flow();
                self.at(self.now + FLOW_MS, Ev::Flow);
            }
            Ev::GwTick(g) => {
                self.gw_tick(g);
                self.at(self.now + TICK_MS, Ev::GwTick(g));
            }
            Ev::ControlTick => {
                self.control_tick();
                self.at(self.now + CONTROL_TICK_MS, Ev::ControlTick);
            }
            Ev::Deliver(c) => self.deliver(c),
            Ev::Answer {
                gw,
                generation,
                token,
                status,
                body,
                stream,
            } => self.answer(gw, generation, token, (status, body), stream),
            Ev::Leave(s) => self.leave(s),
            Ev::Admit(s) => self.admit(s),
            Ev::Prefilled(s) => self.prefilled(s),
            Ev::Released(r, rel) => self.released(r, rel),
            Ev::GwSeesReset(s) => self.gw_sees_reset(s),
            Ev::Unfreeze(g) => {
                self.note(
                    format!("gw{g}"),
                    None,
                    "resumes (SIGCONT): its timers run first",
                );
                self.gw_tick(g);
            }
            Ev::Restart(g) => self.restart(g),
        }
    }

    fn op(&mut self, i: usize) {
        let op = self.sched.ops[i];
        match op {
            Op::HotRestart { gw, parent_ms, .. } => {
                // The child starts once the parent answers its hot-restart RPC (passes
                // its listen sockets): a stopped parent answers when it resumes.
                match self.gateways.get(gw as usize).map(|g| g.frozen_until) {
                    Some(until) if until > self.now => self.at(until, Ev::Op(i)),
                    _ => self.hot_restart(gw, parent_ms),
                }
            }
            // A stopped process runs nothing, so traps nothing until it resumes.
            Op::Trap { gw, vm, .. } => match self.gateways.get(gw as usize) {
                Some(g) if g.frozen_until > self.now => self.at(g.frozen_until, Ev::Op(i)),
                _ => self.trap(gw, vm),
            },
            Op::Stream {
                gw,
                replica,
                client,
                tokens,
                token_ms,
                ..
            } => self.start_stream(op, gw, replica, client, tokens, token_ms),
            Op::Kill { gw, restart_ms, .. } => self.kill(gw, restart_ms),
            Op::Freeze { gw, for_ms, .. } => {
                for s in &mut self.streams {
                    if s.gw == gw && !s.gw_done {
                        s.frozen_ms += for_ms;
                    }
                }
                if let Some(g) = self.gateways.get_mut(gw as usize) {
                    g.frozen_until = g.frozen_until.max(self.now + for_ms);
                    let until = g.frozen_until;
                    self.note(
                        format!("gw{gw}"),
                        None,
                        format!("frozen (SIGSTOP) for {for_ms} ms"),
                    );
                    self.at(until, Ev::Unfreeze(gw));
                }
            }
            Op::EnginePause {
                replica, for_ms, ..
            } => {
                let r = usize::from(replica).min(self.engine_paused_until.len() - 1);
                self.engine_paused_until[r] = self.engine_paused_until[r].max(self.now + for_ms);
                for s in &mut self.streams {
                    if usize::from(s.replica) == r && s.engine_end.is_none() {
                        s.engine_paused_ms = s.engine_paused_ms.max(for_ms);
                    }
                }
                self.note(
                    format!("engine{r}"),
                    None,
                    format!("the engine behind replica{r} pauses {for_ms} ms"),
                );
            }
            Op::ReplicaLost { replica, .. } => self.lose_replica(usize::from(replica)),
            Op::ReplicaRestart { replica, .. } => self.restart_replica(usize::from(replica)),
            Op::HopRetries {
                for_ms, retry_ms, ..
            } => {
                self.hop_retries = (self.now + for_ms, retry_ms);
                self.note(
                    "world",
                    None,
                    format!("a hop sends every call to kvguard-control twice, {retry_ms} ms apart, for {for_ms} ms"),
                );
            }
            Op::SlowAdmin {
                for_ms, delay_ms, ..
            } => {
                self.slow_admin = (self.now + for_ms, delay_ms);
                self.note(
                    "world",
                    None,
                    format!("kvguard-control's admin listener saturated for {for_ms} ms: each call waits {delay_ms} ms"),
                );
            }
            Op::PartitionData {
                replica, for_ms, ..
            } => {
                let r = usize::from(replica).min(self.data_cut_until.len() - 1);
                self.data_cut_until[r] = self.data_cut_until[r].max(self.now + for_ms);
                // Its clients get nothing meanwhile: their silence at the filter grows by
                // it, and one as long as the idle timeout is a stall the filter cuts.
                for s in &mut self.streams {
                    if usize::from(s.replica) == r && !s.gw_done {
                        s.frozen_ms += for_ms;
                        s.engine_paused_ms = s.engine_paused_ms.max(for_ms);
                    }
                }
                self.note(
                    "world",
                    None,
                    format!("the data path from replica{r} is partitioned for {for_ms} ms"),
                );
            }
            Op::ClockStep { gw, step_s, .. } => {
                if let Some(g) = self.gateways.get_mut(usize::from(gw)) {
                    self.wall_steps[usize::from(gw)] += step_s;
                    g.host.wall_step_s = self.wall_steps[usize::from(gw)];
                    self.note(
                        format!("gw{gw}"),
                        None,
                        format!("its wall clock steps {step_s:+} s"),
                    );
                }
            }
            Op::PartitionPeers { for_ms, .. } => {
                self.peers_cut_until = self.peers_cut_until.max(self.now + for_ms);
                self.note(
                    "world",
                    None,
                    format!("the replicas cannot reach each other for {for_ms} ms"),
                );
            }
            Op::LoseCalls { for_ms, .. } => {
                self.lose_until = self.lose_until.max(self.now + for_ms);
                self.note(
                    "world",
                    None,
                    format!("every call to kvguard-control is lost for {for_ms} ms"),
                );
            }
        }
    }

    fn start_stream(
        &mut self,
        op: Op,
        gw: u8,
        replica: u8,
        client: Client,
        tokens: u32,
        token_ms: u32,
    ) {
        let i = self.streams.len();
        let Ok(id) = RequestId::try_new(format!("req-{i}").as_bytes()) else {
            return;
        };
        let (gw, replica) = (
            gw.min(self.sched.setup.gateways.saturating_sub(1)),
            replica.min(self.sched.setup.replicas.saturating_sub(1)),
        );
        let Some(g) = self.gateways.get_mut(gw as usize) else {
            return;
        };
        if !g.alive || self.now < g.frozen_until {
            // The request never reaches a running gateway: nothing to track.
            return;
        }
        let ctx = i as u32 + 2;
        g.host.now = self.now;
        // On a worker whose VM trapped: with `FAIL_OPEN` the request passes untracked.
        let Some(k) = g.assign(ctx) else {
            return;
        };
        if self.mutations.off(Mechanism::MassStallValve) {
            let mut vm = Engine::new(g.cfg().clone(), self.sched.seed ^ u64::from(ctx));
            vm.keep_ticking(true);
            self.solo.insert(ctx, vm);
        }
        let (engine, host) = g.engine_for(ctx);
        let vm = self.solo.get_mut(&ctx).unwrap_or(engine);
        vm.on_request_headers(
            host,
            ctx,
            Some(b"/v1/chat/completions"),
            Some(id.as_str().as_bytes()),
            false,
        );
        // `x-kvguard-instance`: the tag and the period's proof of life.
        let (instance, tag) = g.tag(k, &crate::gateway::listener(gw));
        let (engine, host) = g.engine_for(ctx);
        let vm = self.solo.get_mut(&ctx).unwrap_or(engine);
        vm.on_response_headers(host, ctx, Some(b"text/event-stream"), None, None, false);
        let generation = g.generation;
        let now = self.now;
        let replica = if self.sched.setup.pd && self.replicas.len() >= 2 {
            // The decode leg streams on a decode replica (1 of two).
            let (half, n) = (self.replicas.len() / 2, self.replicas.len());
            (half + usize::from(replica) % (n - half)) as u8
        } else {
            replica
        };
        // The hop routes around a lost replica: the next one that is not.
        let n = self.replicas.len();
        let Some(replica) = (0..n)
            .map(|k| (usize::from(replica) + k) % n)
            .find(|r| !self.lost[*r])
        else {
            return;
        };
        let replica = replica as u8;
        let tokens = u64::from(tokens.max(1));
        let paused = self.engine_paused_until[usize::from(replica)].saturating_sub(now);
        self.streams.push(Stream {
            op,
            client,
            gw,
            gw_generation: generation,
            ctx,
            replica,
            id,
            start: now,
            admitted: None,
            tokens,
            token_ms: u64::from(token_ms.max(1)),
            content_len: tokens * EV_BYTES + DONE.len() as u64,
            instance,
            tag,
            engine_end: None,
            entry: None,
            handed: 0,
            upstream_end: None,
            hop_drains: false,
            pulled: 0,
            socket_full: false,
            envoy_reading: true,
            eos_passed: false,
            end_held: false,
            gw_done: false,
            read: 0,
            state: ClientState::Reading,
            last_chunk: None,
            orphan: None,
            kvguard_end: None,
            last_answer: None,
            completed_at: None,
            last_call_lost: false,
            completion_forgotten: false,
            peers_cut: false,
            frozen_ms: 0,
            gen_ms: 0,
            engine_paused_ms: paused,
            gateway_died: None,
            vm_trapped: None,
            hot_restart: g.parent.is_some(),
            prefill: None,
            miscounted: None,
        });
        self.note(format!("client{i}"), Some(i), format!("requests via gw{gw} to replica{replica}: {tokens} tokens every {token_ms} ms; client {client}"));
        match self.sched.setup.hop_queue_ms {
            0 => self.admit(i),
            q => self.at(now + q, Ev::Admit(i)),
        }
        if let Client::Leaves { after_ms } = client {
            self.at(now + after_ms, Ev::Leave(i));
        }
        self.drain_gateway(gw);
    }

    /// Stream `i` reaches kvguard-control (at once, or after the hop's queue): admitted,
    /// its engine starts; or refused (a tombstone: its response is an error); or, behind
    /// a passing hop whose client already left, dropped by the hop.
    fn admit(&mut self, i: usize) {
        let now = self.now;
        let s = &self.streams[i];
        let (id, tag) = (s.id.clone(), s.tag.clone());
        if s.gw_done && !self.sched.setup.hop_hides {
            self.streams[i].engine_end = Some((now, EngineEnd::NotAdmitted));
            self.note("hop", Some(i), "drops the queued request: its client left");
            return;
        }
        if self.sched.setup.pd && self.replicas.len() >= 2 && self.streams[i].prefill.is_none() {
            // The prefill leg (`max_tokens: 1`, a non-streaming answer) on a prefill
            // replica (0 of two): admitted (its proof of life taken); its answer comes
            // when the prompt is computed ([`World::prefilled`]), the decode leg then.
            let p = usize::from(self.op_replica(i)) % (self.replicas.len() / 2);
            let leg = (!self.lost[p])
                .then(|| self.replicas[p].admit(i, id.clone(), tag.as_deref(), now))
                .flatten();
            self.answer_probes(p);
            if let Some(e) = leg {
                let ms = self.rng.range(PREFILL_MS.0, PREFILL_MS.1);
                self.streams[i].prefill = Some(Prefill {
                    replica: p as u8,
                    entry: Some(e),
                    held_since: None,
                    freed: None,
                    lease_bound: false,
                });
                self.at(now + ms, Ev::Prefilled(i));
                return;
            }
        }
        self.admit_decode(i);
    }

    /// Stream `i`'s prefill leg computed its prompt: its answer (one frame, its length
    /// written) is handed on, its engine holds the blocks; the P/D proxy sends the
    /// decode leg, unless its client went. A prefill leg ended meanwhile (an abort, the
    /// lease) or whose replica restarted or was lost answers nothing: no decode leg.
    fn prefilled(&mut self, i: usize) {
        let now = self.now;
        let Some(pf) = self.streams[i].prefill.as_mut() else {
            return;
        };
        let p = usize::from(pf.replica);
        let Some(e) = pf.entry.take() else {
            return;
        };
        if self.lost[p] || !self.replicas[p].holds(&e) {
            if self.streams[i].engine_end.is_none() {
                self.note(
                    "hop",
                    Some(i),
                    "the prefill leg failed (its replica restarted or was lost): no decode leg",
                );
                self.reset_stream(i, EngineEnd::Disconnected);
            }
            return;
        }
        let cause = self.replicas[p].prefill_answered(&e, now);
        if let Some(pf) = self.streams[i].prefill.as_mut() {
            pf.held_since = Some(now);
        }
        self.note(
            format!("replica{p}"),
            Some(i),
            format!("the prefill leg's answer is handed on, its engine holds the blocks; counted {cause}"),
        );
        // Figures: the engine finished it and the proxy read all of it.
        if cause != "complete" {
            self.streams[i].miscounted = Some("prefill_end");
            self.violation(
                Promise::Figures,
                i,
                format!("its prefill leg's answer was read to its end at replica{p}, but counted {cause}"),
            );
        }
        if self.streams[i].gw_done {
            self.note(
                "hop",
                Some(i),
                "its client went: the P/D proxy sends no decode leg, the prefill's blocks stay held",
            );
            let s = &mut self.streams[i];
            if s.engine_end.is_none() {
                s.engine_end = Some((now, EngineEnd::NotAdmitted));
            }
            return;
        }
        self.admit_decode(i);
    }

    /// The decode side answered a release of stream `i`'s prefill hand-off, sent by
    /// replica `r`: the prefill engine lets the blocks go (if still held), the replica
    /// counts it.
    fn released(&mut self, r: usize, rel: Releasing) {
        self.releasing = self.releasing.saturating_sub(1);
        let now = self.now;
        self.replicas[r].released(rel);
        let Some(pf) = self.streams[rel.stream].prefill.as_mut() else {
            return;
        };
        if !rel.rejected {
            pf.lease_bound = true;
            self.note(
                format!("replica{r}"),
                Some(rel.stream),
                "the release reached no decode side in time: the blocks are held until the prefill engine's lease",
            );
            return;
        }
        if pf.held_since.is_some() && pf.freed.is_none() {
            pf.freed = Some((now, "released"));
            self.note(
                format!("replica{r}"),
                Some(rel.stream),
                "the decode side rejected the release: the prefill engine lets the blocks go",
            );
        }
    }

    /// The releases replica `r` sent to the decode side, delivered when it answers.
    fn take_releases(&mut self, r: usize) {
        for (i, line) in std::mem::take(&mut self.replicas[r].notes) {
            self.note(format!("replica{r}"), Some(i), line);
        }
        for rel in std::mem::take(&mut self.replicas[r].releasing) {
            self.releasing += 1;
            self.at(rel.at_ms, Ev::Released(r, rel));
        }
    }

    /// How long the decode side takes to answer a release sent now: at once, unless its
    /// data path is partitioned (the release waits for it, no connection closes); a
    /// lost decode replica refuses at once.
    fn release_ms(&mut self) -> u64 {
        let d = self.replicas.len() / 2;
        if !self.sched.setup.pd || self.lost.get(d).copied().unwrap_or(true) {
            return 1;
        }
        self.data_cut_until[d].saturating_sub(self.now) + self.rng.range(1, 20)
    }

    /// Stream `i`'s (decode) request reaches its replica: admitted, its engine starts;
    /// or refused (a tombstone).
    fn admit_decode(&mut self, i: usize) {
        let now = self.now;
        let s = &self.streams[i];
        let (id, tag, replica) = (s.id.clone(), s.tag.clone(), usize::from(s.replica));
        let admitted = self.replicas[replica].admit(i, id, tag.as_deref(), now);
        // The decode leg reads the prefill's blocks; refused for a tombstoned id, its
        // parameters go to the decode engine first (`reject_tombstoned_decode`): either
        // way the prefill engine lets them go.
        if let Some(pf) = self.streams[i].prefill.as_mut() {
            if pf.freed.is_none() {
                pf.freed = Some((
                    now,
                    if admitted.is_some() {
                        "read"
                    } else {
                        "rejected"
                    },
                ));
            }
        }
        self.answer_probes(replica);
        let Some(e) = admitted else {
            self.note(
                format!("replica{replica}"),
                Some(i),
                "refuses the request (409: tombstoned)",
            );
            self.streams[i].engine_end = Some((now, EngineEnd::NotAdmitted));
            self.kvguard_end(
                i,
                format!("replica{replica} (tombstone)"),
                AbortReason::DownstreamReset,
            );
            let s = &mut self.streams[i];
            if s.state == ClientState::Reading {
                s.state = ClientState::Cut;
            }
            s.gw_done = true;
            let g = self.gateways[s.gw as usize].process_mut(s.gw_generation);
            if let Some(g) = g.filter(|g| !g.trapped(s.ctx)) {
                g.host.now = now;
                let (engine, host) = g.engine_for(s.ctx);
                let vm = self.solo.get_mut(&s.ctx).unwrap_or(engine);
                vm.on_log(host, s.ctx, b"via_upstream", 0);
            }
            return;
        };
        e.0.progress.borrow_mut().record_response(
            200,
            BodyKind::Sse,
            self.replicas[replica].instant(now),
        );
        let s = &mut self.streams[i];
        s.entry = Some(e);
        s.admitted = Some(now);
        if self.sched.setup.hop_queue_ms > 0 {
            self.note(format!("replica{replica}"), Some(i), "admits the request");
        }
    }

    /// Replica `r`'s pod is lost: its engine stops, its in-flight table with it (a peer
    /// that asks it finds nothing); each of its streams is reset toward its gateway,
    /// whose filter sends its abort (`upstream_reset`).
    fn lose_replica(&mut self, r: usize) {
        if self.lost.get(r).copied().unwrap_or(true) {
            return;
        }
        self.lost[r] = true;
        self.note(
            format!("replica{r}"),
            None,
            "lost for good, its engine with it",
        );
        self.reset_streams_of(r, EngineEnd::Lost);
    }

    /// Replica `r`'s process restarts: it comes back at once with empty memory; the
    /// engine sees each stream's connection close (vLLM aborts a request whose client
    /// went), its gateway an upstream reset.
    fn restart_replica(&mut self, r: usize) {
        if self.lost.get(r).copied().unwrap_or(true) {
            return;
        }
        self.note(
            format!("replica{r}"),
            None,
            "restarts: its table, tombstones and leases are gone",
        );
        self.reset_streams_of(r, EngineEnd::Disconnected);
        for s in &mut self.streams {
            if usize::from(s.replica) == r && s.completed_at.is_some() {
                s.completion_forgotten = true;
            }
            // Its hand-offs are forgotten: the prefill engine's lease lets them go.
            if let Some(p) = s.prefill.as_mut().filter(|p| usize::from(p.replica) == r) {
                p.lease_bound = true;
            }
        }
        self.replicas[r] = self.replicas[r].restarted();
    }

    /// Every stream replica `r` relays ends both ways: `how` at the engine, an upstream
    /// reset at the gateway (whose filter sends its abort). A response the engine had
    /// finished but the replica had not yet handed on whole is cut short too.
    fn reset_streams_of(&mut self, r: usize, how: EngineEnd) {
        for i in 0..self.streams.len() {
            let s = &self.streams[i];
            let cut_short = matches!(s.engine_end, Some((_, EngineEnd::Finished)))
                && s.upstream_end.is_none_or(|e| s.handed < e);
            // A P/D request still in its prefill has no decode leg here yet.
            let prefilling = s.prefill.as_ref().is_some_and(|p| p.entry.is_some());
            if usize::from(s.replica) != r || (s.engine_end.is_some() && !cut_short) || prefilling {
                continue;
            }
            self.reset_stream(i, how);
        }
    }

    /// Stream `i` is reset both ways: its engine's request ends `how`, its gateway sees
    /// an upstream reset (its filter sends its abort).
    fn reset_stream(&mut self, i: usize, how: EngineEnd) {
        let now = self.now;
        let s = &mut self.streams[i];
        if let Some(e) = s.entry.take() {
            self.replicas[usize::from(s.replica)].remove(&e);
        }
        if s.engine_end.is_none() {
            s.engine_end = Some((now, how));
        }
        if s.state == ClientState::Reading {
            s.state = ClientState::Dropped;
        }
        let Some(g) = self.gateways[s.gw as usize].process_mut(s.gw_generation) else {
            return;
        };
        if s.gw_done {
            return;
        }
        s.gw_done = true;
        if g.trapped(s.ctx) {
            return;
        }
        g.host.now = now;
        let (engine, host) = g.engine_for(s.ctx);
        let vm = self.solo.get_mut(&s.ctx).unwrap_or(engine);
        vm.on_log(
            host,
            s.ctx,
            b"upstream_reset_after_response_started{connection_termination}",
            0,
        );
        let gw = s.gw;
        self.drain_gateway(gw);
    }

    /// The replica its operation named.
    fn op_replica(&self, i: usize) -> u8 {
        match self.streams[i].op {
            Op::Stream { replica, .. } => replica,
            _ => 0,
        }
    }

    /// Bytes move one step: engines produce, proxies hand frames on, Envoy reads, clients
    /// drain.
    fn flow(&mut self) {
        for i in 0..self.streams.len() {
            self.flow_stream(i);
        }
    }

    fn flow_stream(&mut self, i: usize) {
        let now = self.now;
        let net_cap = self.sched.setup.net_cap;
        // The engine.
        let paused = now < self.engine_paused_until[self.streams[i].replica as usize];
        let s = &mut self.streams[i];
        if let Some(a) = s
            .admitted
            .filter(|a| !paused && s.engine_end.is_none() && now > *a)
        {
            s.gen_ms += FLOW_MS.min(now - a);
        }
        let due = (s.gen_ms / s.token_ms).min(s.tokens);
        let produced = match s.engine_end {
            None if due == s.tokens => {
                let at = now;
                s.engine_end = Some((at, EngineEnd::Finished));
                self.timeline.push(
                    at,
                    format!("engine{i}"),
                    Some(i),
                    "generated its last token",
                );
                self.streams[i].content_len
            }
            None => due * EV_BYTES,
            Some((_, EngineEnd::Finished)) => s.content_len,
            Some(_) => s.handed,
        };
        // The replica's proxy hands frames on while the sockets have room.
        let s = &mut self.streams[i];
        if let Some(e) = s.entry.clone() {
            let r = &mut self.replicas[s.replica as usize];
            let t = r.instant(now);
            if r.holds(&e) {
                let mut complete = false;
                loop {
                    // Linux wakes a writer blocked on a full socket only once a third of
                    // it drained (`sk_stream_min_wspace`): until then the proxy polls no
                    // frame, however steadily the reader drains.
                    if s.socket_full && s.handed - s.pulled > net_cap / 3 * 2 {
                        break;
                    }
                    s.socket_full = s.handed - s.pulled >= net_cap;
                    if s.socket_full {
                        break;
                    }
                    e.0.progress.borrow_mut().record_demand(t);
                    if s.handed >= produced {
                        break;
                    }
                    let frame = if s.handed < s.tokens * EV_BYTES {
                        EV_BYTES
                    } else {
                        s.content_len - s.handed
                    };
                    s.handed += frame;
                    let mut p = e.0.progress.borrow_mut();
                    p.record_handed(t);
                    p.record_events(1, t);
                    if s.handed >= s.content_len {
                        complete = true;
                        break;
                    }
                }
                if complete {
                    r.remove(&e);
                    s.entry = None;
                    s.upstream_end = Some(s.content_len);
                    s.completed_at = Some(now);
                    self.timeline.push(
                        now,
                        format!("replica{}", s.replica),
                        Some(i),
                        "response complete",
                    );
                }
            } else {
                s.entry = None;
            }
        }
        // A partition of the data path: nothing the replica handed on moves on.
        let cut = now < self.data_cut_until[usize::from(self.streams[i].replica)];
        let s = &mut self.streams[i];
        if s.hop_drains && !cut {
            s.pulled = s.handed;
        }
        // Envoy reads the upstream, the filter sees the chunk (a trapped VM's stream is
        // cut at that callback).
        let mut cut = false;
        let done = s.gw_done;
        let g = self.gateways[s.gw as usize].process_mut(s.gw_generation);
        if let Some(g) = g.filter(|g| !done && g.runs(now)) {
            let trapped = g.trapped(s.ctx);
            let down = s.pulled - s.read;
            if down <= LOW {
                s.envoy_reading = true;
            }
            if s.envoy_reading && !s.end_held && !cut {
                let n = (s.handed - s.pulled).min(HIGH - down);
                let eos = s.upstream_end == Some(s.pulled + n) && !s.eos_passed;
                if (n > 0 || eos) && trapped {
                    cut = true;
                } else if n > 0 || eos {
                    let bytes = s.bytes(s.pulled, s.pulled + n);
                    s.pulled += n;
                    s.last_chunk = Some(now);
                    g.host.now = now;
                    let (engine, host) = g.engine_for(s.ctx);
                    let vm = self.solo.get_mut(&s.ctx).unwrap_or(engine);
                    let out = vm.on_chunk(host, s.ctx, n as usize, eos, move || Some(bytes));
                    if eos {
                        if matches!(out, Some(OutcomeTag::Aborted(_))) {
                            s.end_held = true;
                            self.timeline.push(
                                now,
                                format!("gw{}", s.gw),
                                Some(i),
                                "holds the upstream's end (a stall was asked about)",
                            );
                        } else {
                            s.eos_passed = true;
                        }
                    }
                }
                if s.pulled - s.read >= HIGH {
                    s.envoy_reading = false;
                }
            }
            // The client drains.
            if s.state == ClientState::Reading && !cut {
                let n = (s.pulled - s.read).min(s.read_budget(now));
                s.read += n;
                if s.eos_passed && s.read == s.pulled {
                    s.state = ClientState::Done;
                    s.gw_done = true;
                    g.host.now = now;
                    let (engine, host) = g.engine_for(s.ctx);
                    let vm = self.solo.get_mut(&s.ctx).unwrap_or(engine);
                    vm.on_log(host, s.ctx, b"via_upstream", 0);
                    self.timeline.push(
                        now,
                        format!("client{i}"),
                        Some(i),
                        format!("read its whole response ({} bytes)", s.read),
                    );
                }
            }
        }
        if cut {
            self.vm_cut(i);
        }
        self.drain_gateway(self.streams[i].gw);
    }

    /// Gateway `gw`'s tick: its process's, then a draining hot-restart parent's.
    fn gw_tick(&mut self, gw: u8) {
        let jitter = self.rng.next_u64();
        let Some(g) = self.gateways.get(gw as usize) else {
            return;
        };
        let (generation, parent) = (g.generation, g.parent.as_ref().map(|(p, _)| p.generation));
        self.tick_process(gw, generation, jitter);
        if let Some(p) = parent {
            let jitter = self.rng.next_u64();
            self.tick_process(gw, p, jitter);
        }
        self.drain_gateway(gw);
    }

    fn tick_process(&mut self, gw: u8, generation: u32, jitter: u64) {
        let now = self.now;
        let Some(g) = self.gateways[gw as usize].process_mut(generation) else {
            return;
        };
        if !g.runs(now) {
            return;
        }
        if self.mutations.off(Mechanism::MassStallValve) {
            // The renewer asks the process's VM whether streams run (its in-band path is
            // kept named while they do): a stand-in request there says so while a
            // stream's own VM tracks one.
            const STAND_IN: u32 = 1;
            let busy = self.streams.iter().any(|s| {
                s.gw == gw
                    && s.gw_generation == g.generation
                    && self.solo.get(&s.ctx).is_some_and(|vm| vm.tracked() > 0)
            });
            g.host.now = now;
            let (engine, host) = g.engine_for(STAND_IN);
            if !busy {
                engine.forget(host, STAND_IN);
            } else if engine.request(STAND_IN).is_none() {
                let path = Some(&b"/v1/chat/completions"[..]);
                engine.on_request_headers(host, STAND_IN, path, Some(b"stand-in"), false);
            }
        }
        let mut actions = g.tick(now, jitter);
        if self.mutations.off(Mechanism::SecondTick) {
            // The first tick armed what this one confirms: idle is cut at once.
            for vm in g.vms.iter_mut().filter(|v| !v.trapped) {
                actions.extend(vm.engine.tick(&mut g.host));
            }
        }
        let solo = !self.solo.is_empty();
        for s in self.streams.iter().filter(|_| solo) {
            if s.gw != gw || s.gw_generation != generation {
                continue;
            }
            if let Some(vm) = self.solo.get_mut(&s.ctx) {
                actions.extend(vm.on_host_tick(&mut g.host));
                if self.mutations.off(Mechanism::SecondTick) {
                    actions.extend(vm.tick(&mut g.host));
                }
            }
        }
        // In stream order (the filter's table is a hash map with a per-process seed).
        actions.sort_by_key(|a| match a {
            Action::Close { ctx, .. } | Action::Mark { ctx, .. } => *ctx,
        });
        for a in actions {
            let Action::Close { ctx, tag } = a else {
                continue;
            };
            let Some(i) = self.streams.iter().position(|s| {
                s.gw == gw && s.gw_generation == generation && s.ctx == ctx && !s.gw_done
            }) else {
                continue;
            };
            let reason = match tag {
                OutcomeTag::Aborted(r) | OutcomeTag::Observed(r) => r,
                _ => AbortReason::Stalled,
            };
            self.note(
                format!("gw{gw}"),
                Some(i),
                format!("filter closes the stream ({})", reason.as_str()),
            );
            self.kvguard_end(i, format!("gw{gw} (filter close)"), reason);
            if reason == AbortReason::Stalled {
                self.mass_stall(gw, i);
            }
            let before = self.orphan_since(&self.streams[i]);
            let s = &mut self.streams[i];
            if s.state == ClientState::Reading {
                s.state = ClientState::Cut;
                s.orphan = Some(before.unwrap_or((Cause::Closed, now)));
            }
            if let Some(g) = self.gateways[gw as usize].process_mut(generation) {
                g.host.now = now;
                let (engine, host) = g.engine_for(ctx);
                let vm = self.solo.get_mut(&ctx).unwrap_or(engine);
                vm.on_log(host, ctx, b"filter_closed", 0);
            }
            self.upstream_gone(i);
        }
    }

    /// The gateway's side of stream `i` is gone (its client left, it was closed, the
    /// gateway died): a passing hop tells kvguard-control's proxy (its client's side
    /// went away: `Guard::drop`, the engine connection closes); a hiding one keeps its
    /// upstream connection and drains it.
    fn upstream_gone(&mut self, i: usize) {
        let now = self.now;
        let hides = self.sched.setup.hop_hides;
        let s = &mut self.streams[i];
        s.gw_done = true;
        if hides {
            s.hop_drains = true;
            return;
        }
        // A passing P/D proxy closes the prefill leg's connection too: its engine
        // aborts the unfinished prefill (nothing held).
        if let Some(e) = s.prefill.as_mut().and_then(|p| p.entry.take()) {
            let p = usize::from(s.prefill.as_ref().map_or(0, |p| p.replica));
            if self.replicas[p].holds(&e) {
                self.replicas[p].remove(&e);
                if s.engine_end.is_none() {
                    s.engine_end = Some((now, EngineEnd::Disconnected));
                }
                self.timeline.push(
                    now,
                    format!("replica{p}"),
                    Some(i),
                    "the gateway's side went away: the prefill leg's engine connection closed",
                );
            }
        }
        if let Some(e) = s.entry.take() {
            let r = &mut self.replicas[s.replica as usize];
            if r.holds(&e) {
                r.remove(&e);
                if s.engine_end.is_none() {
                    s.engine_end = Some((now, EngineEnd::Disconnected));
                    self.timeline.push(
                        now,
                        format!("replica{}", s.replica),
                        Some(i),
                        "the gateway's side went away: engine connection closed",
                    );
                }
            }
        }
    }

    fn leave(&mut self, i: usize) {
        let now = self.now;
        let s = &mut self.streams[i];
        if s.state != ClientState::Reading {
            return;
        }
        s.state = ClientState::Left;
        s.orphan = Some((Cause::Left, now));
        let (gw, generation) = (s.gw, s.gw_generation);
        self.note(format!("client{i}"), Some(i), "leaves (resets its stream)");
        let until = self.gateways[gw as usize]
            .process_mut(generation)
            .map_or(now, |g| g.frozen_until.max(now));
        self.at(until, Ev::GwSeesReset(i));
    }

    fn gw_sees_reset(&mut self, i: usize) {
        let now = self.now;
        let s = &self.streams[i];
        let Some(g) = self.gateways[s.gw as usize].process_mut(s.gw_generation) else {
            return;
        };
        if s.gw_done {
            return;
        }
        if !g.runs(now) {
            let until = g.frozen_until;
            self.at(until, Ev::GwSeesReset(i));
            return;
        }
        // A trapped VM hears nothing of it: Envoy resets the upstream.
        if !g.trapped(s.ctx) {
            g.host.now = now;
            let (engine, host) = g.engine_for(s.ctx);
            let vm = self.solo.get_mut(&s.ctx).unwrap_or(engine);
            // Envoy 1.40 (`filter_lifecycle.rs`): an h2 client's RST_STREAM is
            // `http2.remote_reset` with DR; an h1 client's close, DC.
            let (details, flag): (&[u8], u64) = if self.sched.setup.h2 {
                (b"http2.remote_reset", flags::DR)
            } else {
                (b"downstream_remote_disconnect", flags::DC)
            };
            vm.on_log(host, s.ctx, details, flag);
        }
        let gw = s.gw;
        self.upstream_gone(i);
        self.drain_gateway(gw);
    }

    fn kill(&mut self, gw: u8, restart_ms: Option<u64>) {
        let now = self.now;
        let Some(g) = self.gateways.get_mut(gw as usize) else {
            return;
        };
        if !g.alive {
            return;
        }
        g.alive = false;
        let generation = g.generation;
        self.note(
            format!("gw{gw}"),
            None,
            match restart_ms {
                Some(r) => format!("killed (SIGKILL); restarts in {r} ms"),
                None => "killed (SIGKILL) for good".to_owned(),
            },
        );
        self.process_died(gw, generation);
        if let Some(r) = restart_ms {
            self.at(now + r, Ev::Restart(gw));
        }
    }

    /// Process `generation` of gateway `gw` is gone: each of its streams' client
    /// connections with it (its client sees a reset), with any abort it had queued.
    fn process_died(&mut self, gw: u8, generation: u32) {
        let now = self.now;
        for i in 0..self.streams.len() {
            let before = self.orphan_since(&self.streams[i]);
            let s = &mut self.streams[i];
            if s.gw != gw || s.gw_generation != generation {
                continue;
            }
            if s.engine_end.is_none() || s.entry.is_some() {
                // With any abort it had queued for it (a response the engine finished but
                // the replica still holds, its data path stalled, is its gateway's too).
                s.gateway_died = Some(now);
            }
            if s.gw_done {
                continue;
            }
            if s.state == ClientState::Reading {
                s.state = ClientState::Dropped;
            }
            s.orphan = Some(before.unwrap_or((Cause::GatewayGone, now)));
            self.upstream_gone(i);
        }
    }

    fn restart(&mut self, gw: u8) {
        let Some(cfg) = gateway::config(self.sched.setup.idle_ms) else {
            return;
        };
        let old = &mut self.gateways[gw as usize];
        let (generation, parent) = (old.generation + 1, old.parent.take());
        let mut new = gateway::process(
            &self.sched.setup,
            cfg,
            gw,
            generation,
            self.sched.seed,
            self.now,
        );
        new.parent = parent;
        self.gateways[gw as usize] = new;
        self.gateways[gw as usize].host.wall_step_s = self.wall_steps[gw as usize];
        self.note(
            format!("gw{gw}"),
            None,
            "a new process starts (same host key)",
        );
    }

    /// Envoy's hot restart of gateway `gw`: the child (a new process: a new instance,
    /// the same host key and listener) takes the listen socket, so every new request;
    /// the parent drains its open streams, renewing, and exits `parent_ms` later. A
    /// parent still draining from an earlier restart exits now (two epochs at most).
    fn hot_restart(&mut self, gw: u8, parent_ms: u64) {
        let Some(cfg) = gateway::config(self.sched.setup.idle_ms) else {
            return;
        };
        let Some(old) = self.gateways.get(gw as usize) else {
            return;
        };
        if !old.alive {
            return;
        }
        if let Some((p, _)) = &old.parent {
            let p = p.generation;
            self.parent_exits(gw, p);
        }
        let now = self.now;
        let generation = self.gateways[gw as usize].generation + 1;
        let child = gateway::process(&self.sched.setup, cfg, gw, generation, self.sched.seed, now);
        let parent = std::mem::replace(&mut self.gateways[gw as usize], child);
        let exiting = parent.generation;
        for s in self.streams.iter_mut() {
            s.hot_restart |= s.gw == gw && s.gw_generation == exiting && !s.gw_done;
        }
        self.gateways[gw as usize].parent = Some((Box::new(parent), now + parent_ms));
        self.note(
            format!("gw{gw}"),
            None,
            format!("hot restart: a child process starts (same host key, same listener); the parent drains, exits in {parent_ms} ms"),
        );
        self.at(now + parent_ms, Ev::ParentExits(gw, exiting));
    }

    /// A hot restart's parent exits (`--parent-shutdown-time-s`): its filter sees each
    /// open stream end (`downstream_local_disconnect`) and decides its abort, but the
    /// process is gone before any leaves; each client sees a reset.
    fn parent_exits(&mut self, gw: u8, generation: u32) {
        let now = self.now;
        let g = &mut self.gateways[gw as usize];
        if g.parent
            .as_ref()
            .is_none_or(|(p, _)| p.generation != generation)
        {
            return;
        }
        let Some((mut parent, exits)) = g.parent.take() else {
            return;
        };
        let alive = parent.alive;
        for s in self
            .streams
            .iter()
            .filter(|s| s.gw == gw && s.gw_generation == generation && !s.gw_done && alive)
        {
            if parent.trapped(s.ctx) {
                continue;
            }
            parent.host.now = now;
            let (engine, host) = parent.engine_for(s.ctx);
            let vm = self.solo.get_mut(&s.ctx).unwrap_or(engine);
            vm.on_log(host, s.ctx, b"downstream_local_disconnect", 0);
        }
        let unsent = parent.host.outbox.len()
            + parent
                .vms
                .iter()
                .filter(|v| !v.trapped)
                .map(|v| v.engine.pending_aborts())
                .sum::<usize>();
        self.note(
            format!("gw{gw}"),
            None,
            format!("the hot restart's parent exits: its open streams are cut downstream; {unsent} abort(s) its filter decided never leave"),
        );
        // Back in place for a moment, so that its streams are found dead with it.
        parent.host.outbox.clear();
        parent.host.logs.clear();
        self.gateways[gw as usize].parent = Some((parent, exits));
        self.process_died(gw, generation);
        self.gateways[gw as usize].parent = None;
    }

    /// Worker VM `vm` of gateway `gw` traps: nothing more runs in it; its streams are
    /// cut at their next callback ([`World::vm_cut`]), their engines left to the lease's
    /// `vm_lost`.
    fn trap(&mut self, gw: u8, vm: u8) {
        let now = self.now;
        let Some(g) = self.gateways.get_mut(gw as usize) else {
            return;
        };
        let Some(v) = g.vms.get_mut(usize::from(vm)) else {
            return;
        };
        if !g.alive || v.trapped {
            return;
        }
        v.trapped = true;
        let generation = g.generation;
        let k = usize::from(vm);
        let mine: Vec<usize> = (0..self.streams.len())
            .filter(|i| {
                let s = &self.streams[*i];
                s.gw == gw && s.gw_generation == generation && g.vm_of(s.ctx) == k
            })
            .collect();
        for i in mine {
            // Its response not all through the filter yet (Envoy will call into the VM),
            // or its engine still running (an abort the VM had queued dies with it).
            let s = &mut self.streams[i];
            if (!s.gw_done && !s.eos_passed) || s.engine_end.is_none() {
                s.vm_trapped = Some(now);
            }
        }
        self.note(
            format!("gw{gw}"),
            None,
            format!("worker VM {vm} traps: its streams are cut at their next callback"),
        );
    }

    /// Stream `i`'s VM trapped, and Envoy called into it: the stream is reset both ways
    /// (its client sees a reset, not kvguard's cut).
    fn vm_cut(&mut self, i: usize) {
        let now = self.now;
        let before = self.orphan_since(&self.streams[i]);
        let s = &mut self.streams[i];
        if s.state == ClientState::Reading {
            s.state = ClientState::Dropped;
        }
        s.orphan = Some(before.unwrap_or((Cause::VmLost, now)));
        let gw = s.gw;
        self.note(
            format!("gw{gw}"),
            Some(i),
            "its VM trapped: Envoy cuts the stream downstream",
        );
        self.upstream_gone(i);
    }

    /// Sends what the gateway's filter dispatched and logs what it logged (its
    /// process's, then a draining hot-restart parent's).
    fn drain_gateway(&mut self, gw: u8) {
        let g = &self.gateways[gw as usize];
        let (generation, parent) = (g.generation, g.parent.as_ref().map(|(p, _)| p.generation));
        self.drain_process(gw, generation);
        if let Some(p) = parent {
            self.drain_process(gw, p);
        }
    }

    fn drain_process(&mut self, gw: u8, generation: u32) {
        let Some(g) = self.gateways[gw as usize].process_mut(generation) else {
            return;
        };
        let mut calls = std::mem::take(&mut g.host.outbox);
        // The filter's table is a hash map with a per-process seed: calls dispatched at
        // one instant go in an order of their own, so that a seed replays alike.
        calls.sort_by(|a, b| (&a.path, &a.body).cmp(&(&b.path, &b.body)));
        let logs = std::mem::take(&mut g.host.logs);
        for l in logs {
            let stream = stream_of(&l);
            self.note(format!("gw{gw}"), stream, l);
        }
        for c in calls {
            let stream = if c.path == ABORT_PATH {
                serde_json::from_slice::<serde_json::Value>(&c.body)
                    .ok()
                    .and_then(|v| v.get("request_id")?.as_str().map(str::to_owned))
                    .and_then(|id| stream_of(&format!("request_id={id}")))
            } else {
                None
            };
            let call = Call {
                gw,
                generation,
                token: c.token,
                path: c.path,
                body: c.body,
                signature: c.signature,
                stream,
                copy: false,
                timeout_ms: c.timeout_ms,
            };
            if stream.is_some() {
                let body = String::from_utf8_lossy(&call.body).into_owned();
                self.note(format!("gw{gw}"), stream, format!("abort call {body}"));
            }
            let lost = self.now < self.lose_until || self.rng.chance(2);
            if let Some(i) = stream {
                self.streams[i].last_call_lost = lost;
            }
            if lost {
                if stream.is_some() {
                    self.note("world", stream, "the call is lost");
                }
            } else {
                let mut at = self.now + self.rng.range(1, 20);
                if self.now < self.slow_admin.0 {
                    at += self.slow_admin.1;
                }
                self.at(at, Ev::Deliver(call));
            }
            // Envoy's timer answers nothing after the timeout.
            self.at(
                self.now + c.timeout_ms,
                Ev::Answer {
                    gw,
                    generation,
                    token: c.token,
                    status: None,
                    body: Vec::new(),
                    stream,
                },
            );
        }
    }

    fn deliver(&mut self, c: Call) {
        let now = self.now;
        // A retrying hop: this delivery's answer is lost with the attempt it gave up; the
        // same bytes arrive again, and that answer goes back.
        let answered = c.copy || now >= self.hop_retries.0;
        if !answered {
            let copy = Call {
                copy: true,
                ..c.clone()
            };
            self.at(now + self.hop_retries.1, Ev::Deliver(copy));
        }
        let n = self.replicas.len();
        let at = self.rng.range(0, n as u64 - 1) as usize;
        // The control cluster routes around a lost replica.
        let Some(at) = (0..n).map(|k| (at + k) % n).find(|r| !self.lost[*r]) else {
            return;
        };
        let mut late = 0;
        let verified = if c.path == ABORT_PATH {
            self.replicas[at].verify_fresh(Domain::Abort, c.signature.as_deref(), &c.body, now)
        } else {
            Ok(())
        };
        let (status, body) = if let Err(status) = verified {
            if c.stream.is_some() {
                let what = format!(
                    "abort call refused {status} (signature: a replay, stale, or the memory full)"
                );
                self.note(format!("replica{at}"), c.stream, what);
            }
            (status, Vec::new())
        } else if c.path == ABORT_PATH {
            let mut ended = Vec::new();
            let body = if self.mutations.off(Mechanism::StallAsks) {
                without_recheck(&c.body)
            } else {
                c.body.clone()
            };
            let peers = self.peer_path();
            self.replicas[at].received.aborts += 1;
            let waits = Waits {
                release_ms: self.release_ms(),
                caller_ms: c.timeout_ms,
            };
            let a = abort_call(&mut self.replicas, at, &body, now, peers, waits, &mut ended);
            for r in 0..self.replicas.len() {
                self.take_releases(r);
            }
            // The shell waits out each unreachable peer's deadline, and a release.
            if a.waited_on_peers && peers == PeerPath::Cut {
                late = PEER_TIMEOUT_MS;
            }
            late = late.max(a.late_ms);
            if let Some(i) = c.stream {
                self.streams[i].peers_cut = a.waited_on_peers && peers == PeerPath::Cut;
                self.streams[i].last_answer = Some(format!("replica{at}: {}", a.how));
                self.note(
                    format!("replica{at}"),
                    Some(i),
                    format!("abort call answered {}: {}", a.status, a.how),
                );
            }
            for e in ended {
                self.ended(e, at);
            }
            (a.status, a.body)
        } else if c.path == DATA_LEASE_PATH && !self.sched.setup.hop_routes_lease {
            (404, Vec::new())
        } else if let Some(r) = Renewal::parse(&c.body) {
            // Accepted on one replica, forwarded to every peer (`fan_out_renewal`).
            let peers = self.peer_path();
            for (i, rep) in self.replicas.iter_mut().enumerate() {
                if self.lost[i] {
                    continue;
                }
                if i == at {
                    rep.received.renewals += 1;
                } else if peers != PeerPath::Up {
                    continue;
                } else {
                    rep.received.peer_renewals += 1;
                }
                rep.renew(&r, now);
            }
            (200, Vec::new())
        } else {
            (400, Vec::new())
        };
        if !answered {
            return;
        }
        let back = now + late + self.rng.range(1, 20);
        self.at(
            back,
            Ev::Answer {
                gw: c.gw,
                generation: c.generation,
                token: c.token,
                status: Some(status),
                body,
                stream: c.stream,
            },
        );
    }

    /// How the replicas reach each other now.
    fn peer_path(&self) -> PeerPath {
        if self.mutations.off(Mechanism::PeerForwarding) {
            PeerPath::Off
        } else if self.now < self.peers_cut_until {
            PeerPath::Cut
        } else {
            PeerPath::Up
        }
    }

    fn answer(
        &mut self,
        gw: u8,
        generation: u32,
        token: u32,
        (status, body): (Option<u16>, Vec<u8>),
        stream: Option<usize>,
    ) {
        let now = self.now;
        let Some(g) = self.gateways[gw as usize].process_mut(generation) else {
            return;
        };
        if self.answered.contains(&(gw, generation, token)) {
            return;
        }
        if !g.runs(now) {
            // It waits in the socket of a stopped gateway: late.
            let until = g.frozen_until;
            if let Some(i) = stream {
                self.streams[i].last_call_lost = true;
            }
            self.at(
                until,
                Ev::Answer {
                    gw,
                    generation,
                    token,
                    status,
                    body,
                    stream,
                },
            );
            return;
        }
        self.answered.insert((gw, generation, token));
        g.answer(now, token, status, &body);
        // With the valve off, the call may be a stream's own VM's (an unknown token is
        // ignored).
        let solo = !self.solo.is_empty();
        for s in self.streams.iter().filter(|_| solo) {
            if s.gw == gw && s.gw_generation == generation {
                if let Some(vm) = self.solo.get_mut(&s.ctx) {
                    vm.on_abort_answer(&mut g.host, token, status, &body);
                }
            }
        }
        self.drain_gateway(gw);
    }

    /// A replica ended stream `e.stream`: its engine stops, its response ends after what
    /// was handed on.
    fn ended(&mut self, e: Ended, replica: usize) {
        let now = self.now;
        let i = e.stream;
        self.note(
            format!("replica{replica}"),
            Some(i),
            format!("ends the request ({}, via {})", e.reason.as_str(), e.via),
        );
        self.kvguard_end(i, format!("replica{replica} ({})", e.via), e.reason);
        let s = &mut self.streams[i];
        s.entry = None;
        s.upstream_end = Some(s.handed);
        if s.engine_end.is_none() {
            s.engine_end = Some((now, EngineEnd::Ended(e.reason)));
        }
        // Figures: an end at kvguard-control counted under the stream's true cause.
        if let Some(want) = self
            .orphan_since(&self.streams[i])
            .and_then(|(c, _)| c.reason())
        {
            let s = &self.streams[i];
            let lost = e.reason == AbortReason::GatewayLost
                && (s.gateway_died.is_some() || s.vm_trapped.is_some());
            // An engine that stopped producing for an idle timeout is ended `stalled`.
            let stalled =
                e.reason == AbortReason::Stalled && s.engine_paused_ms >= self.sched.setup.idle_ms;
            if want != e.reason && !lost && !stalled {
                self.violation(
                    Promise::Figures,
                    i,
                    format!(
                        "ended as {} at replica{replica} ({}), but its cause is {}",
                        e.reason.as_str(),
                        e.via,
                        want.as_str()
                    ),
                );
            }
        }
    }

    fn control_tick(&mut self) {
        let now = self.now;
        for r in 0..self.replicas.len() {
            if self.lost[r] {
                continue;
            }
            let mut ended = Vec::new();
            self.replicas[r].reap(now, &mut ended);
            let (expired, held) = if self.mutations.off(Mechanism::Lease) {
                (Vec::new(), 0)
            } else {
                self.replicas[r].judge_leases(now, &mut ended)
            };
            self.answer_probes(r);
            if held > 0 {
                let what = format!(
                    "{held} lease expiries held: no other gateway heard from, or its listener answers"
                );
                self.note(format!("replica{r}"), None, what);
            }
            for x in expired {
                let (n, why) = (x.streams.len(), x.why);
                self.note(
                    format!("replica{r}"),
                    None,
                    format!(
                        "lease of {} expired ({}), {n} of its requests in flight here{}; counted mode={}",
                        short(x.instance),
                        why.as_str(),
                        if why == Expiry::Unproven {
                            ": counted, not ended"
                        } else {
                            ": ended"
                        },
                        x.mode
                    ),
                );
                // Figures: every expiry is counted under the replica's `--lease-mode`.
                if x.mode != "enforce" {
                    let on = x.streams.first().copied().or_else(|| {
                        self.streams
                            .iter()
                            .position(|s| s.instance == Some(x.instance))
                    });
                    if let Some(i) = on {
                        self.streams[i].miscounted = Some("expiry_mode");
                        self.violation(
                            Promise::Figures,
                            i,
                            format!(
                                "replica{r} counted the {} expiry of its gateway's lease mode={} under --lease-mode enforce",
                                why.as_str(),
                                x.mode
                            ),
                        );
                    }
                }
            }
            for e in ended {
                self.ended(e, r);
            }
        }
    }

    /// `lease::enforce::probe` for replica `r`'s asks: a gateway's listener completes a
    /// handshake while its process lives, frozen or not (its kernel answers), and refuses
    /// once it is dead (a restart on the node listens there again). The shell judges at
    /// once on a refusal; here the next judgement (a tick later) does.
    fn answer_probes(&mut self, r: usize) {
        let now = self.now;
        for (id, addr) in std::mem::take(&mut self.replicas[r].probes) {
            let alive = crate::gateway::listening(addr)
                .and_then(|g| self.gateways.get(usize::from(g)))
                .is_some_and(|g| g.alive);
            let answer = match (alive, self.sched.setup.pods_deleted) {
                (true, _) => ProbeAnswer::Alive,
                (false, false) => ProbeAnswer::Refused,
                (false, true) => ProbeAnswer::Timeout,
            };
            if !alive {
                self.note(
                    format!("replica{r}"),
                    None,
                    format!("asks {addr} ({}): {}", short(id), answer.as_str()),
                );
            }
            self.replicas[r].probed(id, addr, answer, now);
        }
    }

    /// kvguard ended stream `i` (first time only): invariant 1 if its client reads.
    fn kvguard_end(&mut self, i: usize, who: String, reason: AbortReason) {
        let now = self.now;
        let s = &mut self.streams[i];
        if s.kvguard_end.is_some() {
            return;
        }
        s.kvguard_end = Some((now, who.clone(), reason));
        // An engine that stopped producing for the idle timeout is cut: that is the
        // filter's job, whoever reads.
        let engine_stalled = s.engine_paused_ms >= self.sched.setup.idle_ms;
        // A stream whose worker VM trapped before its response passed is lost already:
        // Envoy cuts it at its next callback.
        let doomed = s.vm_trapped.is_some();
        if s.is_reader() && s.state == ClientState::Reading && !engine_stalled && !doomed {
            let what = format!(
                "{who} ended a stream its client reads ({}), {} of {} bytes read",
                reason.as_str(),
                s.read,
                s.content_len
            );
            self.violation(Promise::Invariant1, i, what);
        }
    }

    /// The mass-stall promise (filter/README.md "Mass-stall valve"): within one idle
    /// window a gateway closes for a stall at most `max(8, 20 %)` of its streams on their
    /// first window; those past it are held one more window (closes of streams silent for
    /// two windows or more are such held ones, and not counted).
    fn mass_stall(&mut self, gw: u8, i: usize) {
        let (now, idle) = (self.now, self.sched.setup.idle_ms);
        let first_window = self.streams[i]
            .last_chunk
            .is_none_or(|t| now < t + 2 * idle - TICK_MS);
        if !first_window {
            return;
        }
        self.stall_closes.push((gw, now, i));
        let recent = self
            .stall_closes
            .iter()
            .filter(|(g, t, _)| *g == gw && now < t + idle)
            .count();
        let open = self
            .streams
            .iter()
            .filter(|s| s.gw == gw && !s.gw_done)
            .count();
        let threshold = 8.max((open + recent) / 5);
        if recent > threshold {
            let what = format!("gw{gw} closed {recent} streams for a stall within one idle window (threshold {threshold})");
            self.violation(Promise::MassStall, i, what);
        }
    }

    /// A violation, labelled with the open finding whose shape it has. The shape of a
    /// fixed one is no label: that finding is back, and the campaign fails on it.
    fn violation(&mut self, promise: Promise, stream: usize, what: String) {
        let finding = crate::findings::classify(promise, &self.streams[stream], &self.sched.setup)
            .filter(|name| crate::findings::known().iter().any(|f| f.name == *name));
        self.violations.push(Violation {
            promise,
            stream,
            at: self.now,
            what,
            finding,
        });
    }

    /// Figures: every hand-off a replica took for a release was counted once released or
    /// failed.
    fn check_releases(&mut self) {
        for r in 0..self.replicas.len() {
            let c = self.replicas[r].counted.clone();
            for i in c.taken {
                let n = c.releases.iter().filter(|(s, _)| *s == i).count();
                if n != 1 {
                    self.streams[i].miscounted = Some("release");
                    self.violation(
                        Promise::Figures,
                        i,
                        format!("replica{r} took its prefill hand-off for a release, and counted {n} releases of it"),
                    );
                }
            }
        }
    }

    /// Invariant 2 over every stream nobody reads, and over the prefill blocks held for
    /// it: let go within its bound, or the prefill engine's lease where kvguard-control
    /// cannot release them (the decode side unreachable, the hand-off forgotten).
    fn check_orphans(&mut self) {
        for i in 0..self.streams.len() {
            let s = &self.streams[i];
            let (Some((cause, since)), Some(pf)) = (self.orphan_since(s), &s.prefill) else {
                continue;
            };
            let (Some(held), Some(end)) = (pf.held_since, pf.blocks_end()) else {
                continue;
            };
            let mut bound = since + self.orphan_bound(s, cause, since);
            if pf.lease_bound {
                bound = bound.max(held + PD_KV_LEASE_MS);
            }
            if end > bound {
                let what = format!(
                    "nobody reads it since {since} ms ({cause:?}); the prefill's blocks, held since {held} ms, {} — bound {bound} ms",
                    match pf.freed {
                        Some((t, how)) => format!("let go at {t} ms ({how})"),
                        None => format!("held until the engine's lease at {end} ms"),
                    }
                );
                self.violation(Promise::Invariant2, i, what);
            }
        }
        for i in 0..self.streams.len() {
            let s = &self.streams[i];
            let Some((cause, since)) = self.orphan_since(s) else {
                continue;
            };
            let bound = self.orphan_bound(s, cause, since);
            let end = s.engine_end.map_or(self.now, |(t, _)| t);
            if end > since + bound {
                let what = format!(
                    "nobody reads it since {since} ms ({cause:?}); its engine {} — bound {bound} ms",
                    match s.engine_end {
                        Some((t, how)) => format!("stopped at {t} ms ({how:?})"),
                        None => format!("still generates at {} ms", self.now),
                    }
                );
                self.now = end.min(self.now);
                self.violation(Promise::Invariant2, i, what);
            }
        }
    }

    /// The streams, for the findings' classification and the tests.
    pub fn streams(&self) -> &[Stream] {
        &self.streams
    }
}

/// An abort call's body without `recheck_ms`: the stall ask as a plain abort (the
/// stall-asks switch; the simulated replicas check no signature).
fn without_recheck(body: &[u8]) -> Vec<u8> {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(mut o)) => {
            o.remove("recheck_ms");
            serde_json::to_vec(&o).unwrap_or_else(|_| body.to_vec())
        }
        _ => body.to_vec(),
    }
}

/// The stream a log line names (`request_id=req-N`).
fn stream_of(line: &str) -> Option<usize> {
    let rest = &line[line.find("request_id=req-")? + "request_id=req-".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn short(id: InstanceId) -> String {
    id.to_string().chars().take(8).collect()
}
