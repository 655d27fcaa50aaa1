//! A kvguard-control replica: the REAL control core (`kvguard-control-core`: the
//! in-flight table with tombstones and its judgement of an ask
//! ([`Inflight::judge`]) and of the reaper's pass ([`Inflight::due`]), the
//! reaper's verdicts, leases) composed as the service's shell composes it. Each method
//! names the shell function it mirrors; what the shell does with sockets (closing the
//! engine connection, writing the final event) is returned for the world to carry out.
//!
//! Signatures are verified with the gateways' one key against this replica's wall clock,
//! and remembered in the real replay memory. P/D: a finished prefill's hand-off is
//! recorded in the real hand-off table and released through the decode side, whose
//! answer the world delivers. Not modelled: `--dry-run`, the abort flush deadline.

use crate::ablation::{Mechanism, Mutations};
use kvguard_contract::{signature, Domain};
use kvguard_contract::{
    AbortAnswer, AbortReason, AbortRequest, InstanceId, Key, Leg, RenewalBody, RequestId, TagHeader,
};
use kvguard_control_core::abort::{
    after_fan_out, after_forward, answer_deferred, ask_again, deferrable, leg_result, legs_of,
    release_result, route, summary, tombstones_missing, AbortFound, FannedOut, Forwarded, Route,
};
use kvguard_control_core::cut::{may_end, Ask, Cut, Deferral, Here};
use kvguard_control_core::inflight::{AbortHere, Held, Inflight, InflightConfig};
use kvguard_control_core::lease::{Expiry, Leases, Mode, ProbeAnswer};
use kvguard_control_core::limits::Limits;
use kvguard_control_core::pd::{Handoffs, Release};
use kvguard_control_core::replay::{ReplayMemory, Seen};
use kvguard_control_core::request::{Progress, Times};
use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// The replay memory's bound (`config::MAX_REPLAY_ENTRIES`).
const MAX_REPLAY_ENTRIES: usize = 100_000;

/// kvguard-control's shipped flags, as they matter here.
pub mod flags {
    /// `--idle-timeout`.
    pub const IDLE_TIMEOUT_MS: u64 = 120_000;
    /// `--reader-timeout`.
    pub const READER_TIMEOUT_MS: u64 = 90_000;
    /// `--tombstone-ttl`.
    pub const TOMBSTONE_TTL_MS: u64 = 60_000;
    /// `--lease-ttl`.
    pub const LEASE_TTL_MS: u64 = 30_000;
    /// `--pd-kv-lease` (and the prefill engine's own lease, vLLM `kv_lease_duration`).
    pub const PD_KV_LEASE_MS: u64 = 30_000;
}

/// `engine::release_prefill`'s bound on the decode side's answer to a release.
pub const RELEASE_TIMEOUT_MS: u64 = 2_000;

/// The filter's `abort_timeout_ms` (shipped): how long a gateway waits for an answer.
pub const FILTER_CALL_TIMEOUT_MS: u64 = 1_000;

/// A hand-off's release on its way to the decode side (`pd::release_handoff`): the world
/// delivers it (the decode engine rejects it and tells the prefill engine to let the
/// blocks go) and the replica counts it then ([`Replica::released`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Releasing {
    /// The world's index of the stream.
    pub stream: usize,
    /// When the decode side's answer comes back (virtual ms).
    pub at_ms: u64,
    /// Whether it rejects the request (within [`RELEASE_TIMEOUT_MS`]); `false`: the
    /// release failed, the blocks are held until the prefill engine's lease.
    pub rejected: bool,
}

/// What a replica counted on its `/metrics`, for the figures oracle (a prefill leg's
/// `request_ends_total` cause is returned where it is counted, [`Replica::prefill_answered`]).
#[derive(Debug, Default, Clone)]
pub struct Counted {
    /// Hand-offs taken from the table for a release (the streams').
    pub taken: Vec<usize>,
    /// `pd_releases_total{kind="handoff", result}`: (stream, result).
    pub releases: Vec<(usize, &'static str)>,
}

/// One request in flight here (the shell's `table::Entry`, with what the table needs).
#[derive(Debug)]
pub struct Entry {
    id: RequestId,
    seq: u64,
    /// The world's index of the stream.
    pub stream: usize,
    ended: Cell<Option<AbortReason>>,
    /// Its clocks.
    pub progress: RefCell<Progress>,
    /// The gateway instance it came through (`x-kvguard-instance`).
    pub instance: Option<InstanceId>,
    /// The gateway's worker VM it came through (`<instance>.<vm>`).
    pub vm: Option<u32>,
}

/// The shell's `Arc<Entry>`.
#[derive(Debug, Clone)]
pub struct EntryRef(pub Rc<Entry>);

impl Held for EntryRef {
    fn id(&self) -> &RequestId {
        &self.0.id
    }
    fn seq(&self) -> u64 {
        self.0.seq
    }
    fn mark_ended(&self, reason: AbortReason) -> bool {
        if self.0.ended.get().is_some() {
            return false;
        }
        self.0.ended.set(Some(reason));
        true
    }
    fn times(&self) -> Times {
        Times {
            gateway: self.0.instance.is_some(),
            ..self.0.progress.borrow().times()
        }
    }
}

/// A request this replica ended: the world stops its engine and ends its response.
#[derive(Debug, Clone)]
pub struct Ended {
    /// The world's index of the stream.
    pub stream: usize,
    /// Why.
    pub reason: AbortReason,
    /// Which path ended it (`abort_api`, `reaper`, `lease: <expiry>`).
    pub via: &'static str,
}

/// One replica.
#[derive(Debug)]
pub struct Replica {
    /// Its index.
    pub index: u8,
    inflight: Inflight<EntryRef>,
    /// Its leases.
    pub leases: Leases,
    limits: Limits,
    next_seq: u64,
    base: Instant,
    mutations: Mutations,
    /// `--pd-role` (`None`: none).
    pub pd_role: Option<&'static str>,
    /// What it received, by kind (the fleet figures).
    pub received: crate::fleet::Received,
    /// Listeners its lease judgement or admission asked about (`lease::enforce::probe`:
    /// the world connects and gives the answer to [`Replica::probed`]).
    pub probes: Vec<(InstanceId, SocketAddr)>,
    replay: ReplayMemory,
    handoffs: Handoffs,
    /// Releases sent to the decode side, for the world to deliver.
    pub releasing: Vec<Releasing>,
    /// What it did that no answer shows, for the timeline: (stream, line).
    pub notes: Vec<(usize, String)>,
    /// Its figures.
    pub counted: Counted,
}

/// `peers::PEER_TIMEOUT`: how long the shell waits for a peer that does not answer.
pub const PEER_TIMEOUT_MS: u64 = 500;

/// How a replica's peer calls fare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerPath {
    /// Every peer answers.
    Up,
    /// Every peer call times out ([`crate::schedule::Op::PartitionPeers`]).
    Cut,
    /// No peer is asked (the peer-forwarding mutation).
    Off,
}

/// A virtual millisecond as an `Instant` (the core takes `Instant`s; only differences
/// matter).
fn at(base: Instant, ms: u64) -> Instant {
    base + Duration::from_millis(ms)
}

impl Replica {
    /// A replica started at virtual time 0 with the shipped flags.
    pub fn new(
        index: u8,
        base: Instant,
        mutations: Mutations,
        pd_role: Option<&'static str>,
    ) -> Replica {
        let ms = Duration::from_millis;
        let reader = Some(ms(flags::READER_TIMEOUT_MS));
        Replica {
            index,
            inflight: Inflight::new(InflightConfig {
                max_inflight: 4096,
                dry_run: false,
                tombstone_ttl: if mutations.off(Mechanism::Tombstones) {
                    Duration::ZERO
                } else {
                    ms(flags::TOMBSTONE_TTL_MS)
                },
                max_tombstones: 100_000,
            }),
            leases: Leases::new(ms(flags::LEASE_TTL_MS)),
            limits: Limits {
                max_age: None,
                idle_timeout: Some(ms(flags::IDLE_TIMEOUT_MS)),
                first_token_timeout: None,
                reader_timeout: reader,
            },
            next_seq: 0,
            base,
            mutations,
            pd_role,
            received: crate::fleet::Received::default(),
            probes: Vec::new(),
            replay: ReplayMemory::new(MAX_REPLAY_ENTRIES),
            handoffs: Handoffs::new(ms(flags::PD_KV_LEASE_MS), 100_000),
            releasing: Vec::new(),
            notes: Vec::new(),
            counted: Counted::default(),
        }
    }

    /// `endpoint::verify_fresh`: a signed call's signature (`t` within ±30 s of this
    /// replica's wall clock, the gateways' key) remembered; the refusal's status if not:
    /// 401, 409 (a replay), 503 (the memory full of live signatures).
    pub fn verify_fresh(
        &mut self,
        domain: Domain,
        header: Option<&str>,
        body: &[u8],
        now_ms: u64,
    ) -> Result<(), u16> {
        let now_unix = crate::gateway::UNIX_AT_ZERO + now_ms / 1000;
        let key = Key::try_new(crate::gateway::SECRET.as_bytes()).map_err(|_| 401u16)?;
        let sig = signature::verify(
            domain,
            std::slice::from_ref(&key),
            header.map(str::as_bytes),
            body,
            now_unix,
        )
        .map_err(|_| 401u16)?;
        match self.replay.check_and_remember(&sig, now_unix) {
            Seen::Fresh => Ok(()),
            Seen::Replay => Err(409),
            Seen::Full => Err(503),
        }
    }

    fn now(&self, ms: u64) -> Instant {
        at(self.base, ms)
    }

    /// The same replica restarted: its flags and role, empty memory (what it received
    /// stays counted).
    pub fn restarted(&self) -> Replica {
        Replica {
            received: self.received,
            counted: self.counted.clone(),
            ..Replica::new(self.index, self.base, self.mutations, self.pd_role)
        }
    }

    /// `proxy::proxy` admission with `tag_instance`: the request enters the table; its
    /// `x-kvguard-instance` value, a proof verified with the gateways' key, is taken as an
    /// in-band renewal (the first one takes the lease, and its listener is asked at once);
    /// a plain tag touches a held lease. `None`: refused (tombstoned).
    pub fn admit(
        &mut self,
        stream: usize,
        id: RequestId,
        tag: Option<&[u8]>,
        now_ms: u64,
    ) -> Option<EntryRef> {
        let now = self.now(now_ms);
        let header = tag.and_then(TagHeader::parse);
        let key = Key::try_new(crate::gateway::SECRET.as_bytes()).ok();
        let instance = match &header {
            Some(TagHeader {
                tag,
                proof: Some(p),
            }) => {
                let value = verdict_key(p);
                let genuine = self.leases.verified(&value, || {
                    key.as_ref()
                        .is_some_and(|k| p.verify(std::slice::from_ref(k)))
                });
                genuine.then_some(*tag)
            }
            Some(h) => Some(h.tag),
            None => None,
        };
        self.next_seq += 1;
        let e = EntryRef(Rc::new(Entry {
            id,
            seq: self.next_seq,
            stream,
            ended: Cell::new(None),
            progress: RefCell::new(Progress::new(now)),
            instance: instance.map(|t| t.instance),
            vm: instance.and_then(|t| t.vm),
        }));
        self.inflight.admit(e.clone(), false, now).ok()?;
        match (instance, header.and_then(|h| h.proof)) {
            (Some(t), Some(p)) => {
                let mut proof = p.proof;
                if self.mutations.off(Mechanism::SharedHostKey) {
                    proof.listener = None;
                }
                let _ = self.leases.prove(t, &proof, now);
                if let Some(addr) = self.leases.calibrate(t.instance, now) {
                    self.probes.push((t.instance, addr));
                }
            }
            (Some(t), None) => self.leases.touch(t, now),
            _ => {}
        }
        Some(e)
    }

    /// `lease::enforce::probe`'s answer: given to the lease table.
    pub fn probed(&mut self, id: InstanceId, addr: SocketAddr, answer: ProbeAnswer, now_ms: u64) {
        let now = self.now(now_ms);
        self.leases.probed(id, addr, answer, now);
    }

    /// The instant of virtual ms `ms` on this replica's clock.
    pub fn instant(&self, ms: u64) -> Instant {
        self.now(ms)
    }

    /// Whether `entry` is still in the table (not ended, not removed).
    pub fn holds(&self, entry: &EntryRef) -> bool {
        self.inflight
            .get(entry.id())
            .is_some_and(|e| e.seq() == entry.seq())
    }

    /// `proxy::Guard::drop` → `AppState::remove`: the response ended here, or its
    /// client's side went away.
    pub fn remove(&mut self, entry: &EntryRef) {
        self.inflight.remove(entry);
    }

    /// `AppState::end_request` (enforce mode): leaves the table, tombstoned; `false`
    /// if it was already being ended.
    fn end_request(&mut self, entry: &EntryRef, reason: AbortReason, now_ms: u64) -> bool {
        let now = self.now(now_ms);
        self.inflight.end(entry, reason, now).is_some()
    }

    /// `abort::AppState::defers`: whether a gateway's abort is answered `deferred`
    /// ([`Inflight::judge`]: [`may_end`] on what is known here; a deferred tail keeps its
    /// completion one more reader timeout).
    pub fn defers(
        &mut self,
        id: &RequestId,
        abort: &AbortRequest,
        now_ms: u64,
    ) -> Option<Deferral> {
        if self.mutations.off(Mechanism::Deferral) {
            return None;
        }
        let now = self.now(now_ms);
        let ask = Ask::of(abort);
        match self.inflight.judge(id, ask, now, &self.limits) {
            Cut::Defer(d) => Some(d),
            Cut::End(_) | Cut::Keep => None,
        }
    }

    /// `abort::AppState::defers_held_nowhere`: an abort nobody holds (not here, every
    /// peer answered so), judged on its sender's silence as a tail.
    pub fn defers_held_nowhere(&self, abort: &AbortRequest, now_ms: u64) -> Option<Deferral> {
        if self.mutations.off(Mechanism::Deferral) {
            return None;
        }
        let ask = Ask::of(abort);
        match may_end(Here::Nowhere, ask, self.now(now_ms), &self.limits) {
            Cut::Defer(d) => Some(d),
            Cut::End(_) | Cut::Keep => None,
        }
    }

    /// `abort::AppState::abort_here` (`abort_or_tombstone` when `tombstone_missing`,
    /// `abort_if_here` otherwise).
    pub fn abort_here(
        &mut self,
        id: &RequestId,
        reason: AbortReason,
        now_ms: u64,
        tombstone_missing: bool,
        ended: &mut Vec<Ended>,
    ) -> AbortFound {
        let now = self.now(now_ms);
        match self.inflight.abort_here(id, reason, now, tombstone_missing) {
            AbortHere::End(e) => {
                ended.push(Ended {
                    stream: e.0.stream,
                    reason,
                    via: "abort_api",
                });
                AbortFound::Ended
            }
            AbortHere::Observe(_) => AbortFound::Observed,
            AbortHere::Already => AbortFound::Already,
            AbortHere::NotFound { .. } => AbortFound::NotFound,
        }
    }

    /// `proxy::TrackedBody` and `Guard::drop` for a prefill leg's answer (`max_tokens:
    /// 1`, a content-length body of one frame) that its engine finished and the P/D proxy
    /// read to its end: hyper stops polling a body whose length is written once it has
    /// it all, so the shell sees that frame (its body at its end after it), then never
    /// `Ready(None)` ([`Progress::record_frame`]). Complete, its hand-off is recorded
    /// (`record_handoff`); else the guard, dropped when hyper is done with the body,
    /// counts it `client_gone`. Returns the cause counted.
    pub fn prefill_answered(&mut self, entry: &EntryRef, now_ms: u64) -> &'static str {
        let now = self.now(now_ms);
        let complete = entry.0.progress.borrow_mut().record_frame(now, true);
        if complete {
            self.handoffs
                .insert(entry.0.id.clone(), handoff_params(entry.0.stream), now);
        }
        let cause = if complete { "complete" } else { "client_gone" };
        self.remove(entry);
        cause
    }

    /// `AppState::release_handoff`: the hand-off of `id` taken from the table, its
    /// release to the decode side runs in a task of its own, which the handler awaits: a
    /// caller that gives up first (`caller_ms`, its timeout) cancels the handler, not the
    /// release nor its figures. `release_ms`: how long the decode side takes to answer
    /// now. Returns the leg's result and how long the handler waited. `None`: no
    /// hand-off of `id` is held here.
    fn release_handoff(
        &mut self,
        id: &RequestId,
        now_ms: u64,
        Waits {
            release_ms,
            caller_ms,
        }: Waits,
    ) -> Option<(Release, u64)> {
        if self.mutations.off(Mechanism::HandoffRelease) {
            return None;
        }
        let now = self.now(now_ms);
        self.handoffs.take(id, now)?;
        let stream = stream_of(id)?;
        self.counted.taken.push(stream);
        let rejected = release_ms <= RELEASE_TIMEOUT_MS;
        let took = release_ms.min(RELEASE_TIMEOUT_MS);
        let release = if rejected {
            Release::Released
        } else {
            Release::HeldUntilLease
        };
        self.releasing.push(Releasing {
            stream,
            at_ms: now_ms + took,
            rejected,
        });
        let caller = if took > caller_ms {
            format!(", after the caller's {caller_ms} ms: the release runs on without it")
        } else {
            String::new()
        };
        self.notes.push((stream, format!("takes the prefill hand-off and releases it through the decode side (its answer in {took} ms{caller})")));
        Some((release, took))
    }

    /// The decode side answered the release of stream `stream`'s hand-off: counted
    /// (`pd::release_handoff`'s task).
    pub fn released(&mut self, r: Releasing) {
        let result = if r.rejected { "released" } else { "failed" };
        self.counted.releases.push((r.stream, result));
    }

    /// `AppState::tombstone`.
    pub fn tombstone(&mut self, id: RequestId, reason: AbortReason, now_ms: u64) {
        let now = self.now(now_ms);
        self.inflight.tombstone(id, reason, now);
    }

    /// `reaper::reap_once`: every request in flight whose clocks are due
    /// ([`Inflight::due`]) is ended (`end_request`), then expired tombstones go.
    pub fn reap(&mut self, now_ms: u64, ended: &mut Vec<Ended>) {
        let now = self.now(now_ms);
        let mut due = self.inflight.due(now, &self.mutations.reaper(self.limits));
        // The table is a HashMap: in admission order, so that a seed replays alike.
        due.sort_by_key(|(e, _)| e.0.seq);
        for (e, reason) in due {
            if self.end_request(&e, reason, now_ms) {
                ended.push(Ended {
                    stream: e.0.stream,
                    reason,
                    via: "reaper",
                });
            }
        }
        self.inflight.purge(now);
    }

    /// `lease::endpoints` (either path, and `POST /v1/peer/lease` from a peer):
    /// the renewal is taken.
    pub fn renew(&mut self, r: &RenewalBody, now_ms: u64) {
        let now = self.now(now_ms);
        let _ = self.leases.renew(r, now);
    }

    /// The requests in flight here of `instance` (of its worker VM `vm`, if given), in
    /// admission order (the table is a HashMap: so that a seed replays alike), and the
    /// latest of them admitted at or after `now` (`admitted_since`).
    fn of_instance(
        &self,
        instance: InstanceId,
        vm: Option<u32>,
        now: Instant,
    ) -> (Vec<EntryRef>, Option<Instant>) {
        let mut mine: Vec<EntryRef> = self
            .inflight
            .entries()
            .filter(|e| e.0.instance == Some(instance) && vm.is_none_or(|v| e.0.vm == Some(v)))
            .cloned()
            .collect();
        mine.sort_by_key(|e| e.0.seq);
        let late = mine
            .iter()
            .map(|e| e.0.progress.borrow().times().started)
            .filter(|t| *t >= now)
            .max();
        (mine, late)
    }

    /// `end_or_count` in enforce mode: `mine` are ended `gateway_lost` for expiry `why`.
    fn end_lost(&mut self, mine: &[EntryRef], why: Expiry, now_ms: u64, ended: &mut Vec<Ended>) {
        for e in mine {
            if self.end_request(e, AbortReason::GatewayLost, now_ms) {
                ended.push(Ended {
                    stream: e.0.stream,
                    reason: AbortReason::GatewayLost,
                    via: lease_via(why),
                });
            }
        }
    }

    /// `lease::enforce::judge` (`--lease-mode enforce`): an expired instance's requests
    /// are ended `gateway_lost` unless the expiry is unproven (counted only); a request
    /// of it admitted since the judgement revives it; the listeners it asks about go to
    /// [`Replica::probes`]. Returns the expiries as counted, and how many were held
    /// (nobody else heard from, or a listener still answers), for the timeline.
    pub fn judge_leases(&mut self, now_ms: u64, ended: &mut Vec<Ended>) -> (Vec<Expired>, usize) {
        let now = self.now(now_ms);
        let mut j = self.leases.judge(now);
        self.probes.extend(j.probes.iter().copied());
        if self.mutations.off(Mechanism::LeaseHold) {
            j.expired
                .extend(j.holding.iter().map(|id| (*id, Expiry::Silent)));
        }
        let mut out = Vec::new();
        // `end_vm`: a lost worker VM's requests (none here: nothing to do; one admitted
        // since the judgement: the VM lives).
        for (instance, vm) in j.lost {
            let (mine, late) = self.of_instance(instance, Some(vm), now);
            if mine.is_empty() {
                continue;
            }
            if let Some(late) = late {
                self.leases.revive_vm(instance, vm, late);
                continue;
            }
            let acts = Expiry::VmLost.acts(Mode::Enforce);
            if acts.ends {
                self.end_lost(&mine, Expiry::VmLost, now_ms, ended);
            }
            out.push(Expired {
                instance,
                why: Expiry::VmLost,
                streams: mine.iter().map(|e| e.0.stream).collect(),
                mode: acts.mode.as_str(),
            });
        }
        for (instance, why) in j.expired {
            let (mine, late) = self.of_instance(instance, None, now);
            if let Some(late) = late {
                self.leases.revive(instance, late);
                continue;
            }
            // `end_or_count`: what the expiry does, the mode label it is counted under.
            let acts = why.acts(Mode::Enforce);
            if acts.ends {
                self.end_lost(&mine, why, now_ms, ended);
            }
            out.push(Expired {
                instance,
                why,
                streams: mine.iter().map(|e| e.0.stream).collect(),
                mode: acts.mode.as_str(),
            });
        }
        (out, j.held)
    }
}

/// A lease expiry, as `lease::enforce` counts it (`lease_expired_total{mode, why}`).
#[derive(Debug, Clone)]
pub struct Expired {
    /// The gateway instance.
    pub instance: InstanceId,
    /// Why.
    pub why: Expiry,
    /// Its requests in flight here (the world's streams).
    pub streams: Vec<usize>,
    /// The `mode` label it is counted under.
    pub mode: &'static str,
}

/// The path that ended a request for lease expiry `why`, for the timeline.
fn lease_via(why: Expiry) -> &'static str {
    match why {
        Expiry::Silent => "lease: silent",
        Expiry::Replaced => "lease: replaced",
        Expiry::Unproven => "lease: unproven",
        Expiry::Dead => "lease: dead",
        Expiry::VmLost => "lease: vm_lost",
    }
}

/// What a replica answered to an abort call: status and JSON body (contract §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// Body.
    pub body: Vec<u8>,
    /// How it was decided, for the timeline.
    pub how: String,
    /// Peers were asked (the answer waits for them).
    pub waited_on_peers: bool,
    /// How long a release to the decode side kept the handler (its answer is that late).
    pub late_ms: u64,
}

/// `endpoint::deferred`: 200 `deferred`, and why, for the timeline.
fn deferred_answer(id: &RequestId, d: Deferral) -> Answer {
    answer(
        id,
        200,
        true,
        false,
        false,
        true,
        format!("deferred ({})", d.why()),
    )
}

fn answer(
    id: &RequestId,
    status: u16,
    found: bool,
    aborted: bool,
    already: bool,
    deferred: bool,
    how: String,
) -> Answer {
    let a = AbortAnswer {
        request_id: id.as_str().to_owned(),
        found,
        aborted,
        already_aborted: already,
        legs: Vec::new(),
        deferred,
    };
    Answer {
        status,
        body: serde_json::to_vec(&a).unwrap_or_default(),
        how,
        waited_on_peers: false,
        late_ms: 0,
    }
}

fn found_answer(id: &RequestId, found: AbortFound, how: &str) -> Answer {
    match found {
        AbortFound::Ended => answer(id, 200, true, true, false, false, format!("{how}: aborted")),
        AbortFound::Observed => answer(
            id,
            200,
            true,
            false,
            false,
            false,
            format!("{how}: dry_run"),
        ),
        AbortFound::Already => answer(
            id,
            200,
            true,
            false,
            true,
            false,
            format!("{how}: already_aborted"),
        ),
        AbortFound::NotFound => answer(
            id,
            404,
            false,
            false,
            false,
            false,
            format!("{how}: not_found (tombstoned)"),
        ),
    }
}

/// `abort::endpoint::abort` with `abort::abort` (no P/D): `POST /v1/abort` on replica
/// `here` of `replicas` (peers: all the others, reached as `peers` says). `ended`
/// collects the requests ended, wherever.
pub fn abort_call(
    replicas: &mut [Replica],
    here: usize,
    body: &[u8],
    now_ms: u64,
    peers: PeerPath,
    waits: Waits,
    ended: &mut Vec<Ended>,
) -> Answer {
    let mut asked = false;
    let mut a = decide_abort(
        replicas, here, body, now_ms, peers, waits, &mut asked, ended,
    );
    // `endpoint::abort`: `Decided::held_nowhere` (a 404: not here, every peer said so).
    if a.status == 404 {
        if let Ok((abort, id)) = AbortRequest::parse(body) {
            if let Some(d) = replicas[here].defers_held_nowhere(&abort, now_ms) {
                a = deferred_answer(&id, d);
            }
        }
    }
    a.waited_on_peers = asked;
    a
}

#[allow(clippy::too_many_arguments)]
fn decide_abort(
    replicas: &mut [Replica],
    here: usize,
    body: &[u8],
    now_ms: u64,
    peers_path: PeerPath,
    waits: Waits,
    asked: &mut bool,
    ended: &mut Vec<Ended>,
) -> Answer {
    let peers_up = peers_path == PeerPath::Up;
    let Ok((abort, id)) = AbortRequest::parse(body) else {
        return Answer {
            status: 400,
            body: Vec::new(),
            how: "bad_request".into(),
            waited_on_peers: false,
            late_ms: 0,
        };
    };
    let reason = abort.reason;
    // `abort::deferrable`: such an ask tombstones nothing it does not find.
    let deferrable = deferrable(reason, abort.recheck_ms.is_some());
    let mut every_peer_answered = peers_path != PeerPath::Cut;
    if let Some(d) = replicas[here].defers(&id, &abort, now_ms) {
        return deferred_answer(&id, d);
    }
    let peers = replicas.len() > 1;
    match route(replicas[here].pd_role.is_some(), peers) {
        Route::HereThenPeer => {
            match replicas[here].abort_here(&id, reason, now_ms, false, ended) {
                AbortFound::NotFound => {
                    // `Peers::forward_abort`: every peer at once; the first 200 answers.
                    let mut first = None;
                    *asked = peers_path != PeerPath::Off;
                    if peers_up {
                        for p in 0..replicas.len() {
                            if p == here {
                                continue;
                            }
                            replicas[p].received.peer_aborts += 1;
                            let (a, _) = peer_abort(replicas, p, &abort, &id, now_ms, waits, ended);
                            if a.status == 200 && first.is_none() {
                                first = Some((p, a));
                            }
                        }
                    }
                    let holder = first.as_ref().map(|(_, a)| answer_deferred(&a.body));
                    match (after_forward(holder, false), first) {
                        (Forwarded::Peer { tombstone_here }, Some((p, mut a))) => {
                            if tombstone_here {
                                replicas[here].tombstone(id.clone(), reason, now_ms);
                            }
                            a.how = format!("forwarded: replica{p} answered {}", a.how);
                            a
                        }
                        _ => {
                            let tomb = tombstones_missing(deferrable, every_peer_answered);
                            let found = replicas[here].abort_here(&id, reason, now_ms, tomb, ended);
                            let held = found != AbortFound::NotFound;
                            if ask_again(Route::HereThenPeer, held, every_peer_answered) {
                                return ask_again_answer();
                            }
                            found_answer(&id, found, "no peer holds it, decided here")
                        }
                    }
                }
                found => found_answer(&id, found, "here"),
            }
        }
        // `abort::abort`'s `Route::EveryLeg`: here if in flight, every peer at once
        // (`Peers::fan_out_abort`, each answer's legs by `legs_of`), then here again
        // under the lock; `endpoint::legs_answer`.
        Route::EveryLeg => {
            let found = replicas[here].abort_here(&id, reason, now_ms, false, ended);
            let (mut remote, mut deferred) = (Vec::new(), false);
            *asked = peers_path != PeerPath::Off;
            if peers_up {
                for p in 0..replicas.len() {
                    if p != here {
                        replicas[p].received.pd_fan_out += 1;
                        let (a, took) = peer_abort(replicas, p, &abort, &id, now_ms, waits, ended);
                        // `Peers::fan_out_abort`: a peer that answers after the peer
                        // timeout is one that did not answer.
                        if took > PEER_TIMEOUT_MS {
                            every_peer_answered = false;
                        } else if a.status == 200 {
                            if answer_deferred(&a.body) {
                                deferred = true;
                            } else {
                                remote.extend(legs_of(&format!("replica{p}"), &a.body));
                            }
                        }
                    }
                }
            }
            let found = match after_fan_out(found, deferred) {
                // `Decided::Deferred`: the stream's holder deferred it, nothing was ended
                // here.
                FannedOut::Deferred => {
                    return answer(
                        &id,
                        200,
                        true,
                        false,
                        false,
                        true,
                        "deferred by a leg".into(),
                    );
                }
                FannedOut::DecideHere => {
                    let tomb = tombstones_missing(deferrable, every_peer_answered);
                    replicas[here].abort_here(&id, reason, now_ms, tomb, ended)
                }
                FannedOut::Legs(f) => f,
            };
            let (mut legs, late_ms) = legs_here(&mut replicas[here], &id, found, now_ms, waits);
            legs.extend(remote);
            if ask_again(Route::EveryLeg, true, every_peer_answered) {
                return Answer {
                    late_ms,
                    ..ask_again_answer()
                };
            }
            Answer {
                late_ms,
                ..legs_answer(&id, legs)
            }
        }
        Route::Here => {
            let found = replicas[here].abort_here(&id, reason, now_ms, !deferrable, ended);
            if replicas[here].pd_role.is_some() {
                let (legs, late_ms) = legs_here(&mut replicas[here], &id, found, now_ms, waits);
                return Answer {
                    late_ms,
                    ..legs_answer(&id, legs)
                };
            }
            found_answer(&id, found, "here")
        }
    }
}

/// `endpoint::abort`'s `Decided::AskAgain`: 503, the sender asks again.
fn ask_again_answer() -> Answer {
    Answer {
        status: 503,
        body: Vec::new(),
        how: "ask again: a peer did not answer".into(),
        waited_on_peers: true,
        late_ms: 0,
    }
}

/// The decode side's answer time to a release now, and how long a caller waits.
#[derive(Debug, Clone, Copy)]
pub struct Waits {
    /// How long the decode side takes to answer a release sent now (virtual ms).
    pub release_ms: u64,
    /// How long the caller waits for this answer (the gateway, or a peer fanning out).
    pub caller_ms: u64,
}

/// `AppState::legs_here`: the request found here, and a held prefill hand-off,
/// released ([`Replica::release_handoff`]). Also returns how long the release kept the
/// handler (its answer is that late).
fn legs_here(
    r: &mut Replica,
    id: &RequestId,
    found: AbortFound,
    now_ms: u64,
    waits: Waits,
) -> (Vec<Leg>, u64) {
    let replica = format!("replica{}", r.index);
    let mut legs: Vec<Leg> = leg_result(found)
        .map(|result| Leg {
            replica: replica.clone(),
            role: r.pd_role.map(str::to_owned),
            result,
        })
        .into_iter()
        .collect();
    let mut took = 0;
    if let Some((release, t)) = r.release_handoff(id, now_ms, waits) {
        took = t;
        legs.push(Leg {
            replica,
            role: Some("prefill".to_owned()),
            result: release_result(release),
        });
    }
    (legs, took)
}

/// A hand-off's transfer parameters for stream `stream` (what a prefill answer carries).
fn handoff_params(stream: usize) -> serde_json::Value {
    serde_json::json!({
        "do_remote_prefill": true,
        "remote_block_ids": [stream],
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.1.0",
        "remote_port": 5600,
    })
}

/// The world's stream of a request id (`req-N`).
pub fn stream_of(id: &RequestId) -> Option<usize> {
    id.as_str().strip_prefix("req-")?.parse().ok()
}

/// `endpoint::legs_answer`.
fn legs_answer(id: &RequestId, legs: Vec<Leg>) -> Answer {
    let (found, aborted, already) = summary(&legs);
    let how = legs
        .iter()
        .map(|l| {
            format!(
                "{}/{}={}",
                l.replica,
                l.role.as_deref().unwrap_or(""),
                l.result.as_str()
            )
        })
        .collect::<Vec<_>>()
        .join(",");
    let a = AbortAnswer {
        request_id: id.as_str().to_owned(),
        found,
        aborted,
        already_aborted: already,
        legs,
        deferred: false,
    };
    Answer {
        status: if found { 200 } else { 404 },
        body: serde_json::to_vec(&a).unwrap_or_default(),
        how: format!("legs [{how}]"),
        waited_on_peers: false,
        late_ms: 0,
    }
}

/// `abort::endpoint::peer_abort`: a forwarded abort, decided here only (with P/D, its
/// legs here, a held hand-off released, the caller waiting [`PEER_TIMEOUT_MS`]). Also
/// returns how long the answer took.
fn peer_abort(
    replicas: &mut [Replica],
    at: usize,
    abort: &AbortRequest,
    id: &RequestId,
    now_ms: u64,
    waits: Waits,
    ended: &mut Vec<Ended>,
) -> (Answer, u64) {
    if let Some(d) = replicas[at].defers(id, abort, now_ms) {
        return (deferred_answer(id, d), 0);
    }
    let tomb = !deferrable(abort.reason, abort.recheck_ms.is_some());
    let found = replicas[at].abort_here(id, abort.reason, now_ms, tomb, ended);
    if replicas[at].pd_role.is_some() {
        let (legs, took) = legs_here(
            &mut replicas[at],
            id,
            found,
            now_ms,
            Waits {
                caller_ms: PEER_TIMEOUT_MS,
                ..waits
            },
        );
        return (legs_answer(id, legs), took);
    }
    (found_answer(id, found, "peer"), 0)
}

/// The key a proof's verdict is remembered under (the shell keys it on the header value:
/// the signed text and its MAC are that value).
fn verdict_key(p: &kvguard_contract::SignedProof<'_>) -> Vec<u8> {
    let mut v = p.signed.to_vec();
    v.extend_from_slice(&p.mac);
    v
}
