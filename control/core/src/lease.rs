//! Liveness leases of gateway processes (contract §8): the evidence of life per instance,
//! judged on kvguard-control's own monotonic receipt clock.
//!
//! The rule: **a gateway's streams are ended only on the silence of evidence that travels
//! their own path, or on positive evidence that the gateway is dead.** So an instance has
//! two kinds of evidence, kept apart: the *data path* (an in-band renewal, sent over the
//! upstream cluster its streams use, or a verified [`Proof`] on a request it carries) and
//! the *admin path* (an out-of-band renewal). A proof on a request counts exactly as an
//! in-band renewal with its counter; a lease is *armed* by the first evidence its data path
//! carries. It expires when
//!
//! - **replaced**: a *successor* — an instance that started after it, as the counters
//!   tell — renews with its host key (same Envoy node and VM: a crash restart in place, a
//!   hot-restart child, a pod restarted with its identity) while it has been silent for the
//!   TTL, heard as the *silent* rule below requires — positive evidence, whatever its hops
//!   and listener. Not sooner: a hot restart's parent drains beside its child, and one
//!   frozen or whose renewals were lost looks like one that exited. A predecessor's
//!   renewals judge nothing (a child frozen while its parent drains). Nor does a
//!   **shared** key: two instances on different listeners were both heard while the
//!   other was (two gateways with one `node.id`); such a key is counted, never used;
//! - **silent** / **dead**: both kinds of evidence are older than the TTL, and — when
//!   other instances hold leases — another was heard from after this one went silent, at
//!   least a period and a half ago (one that hears from nobody holds: the network or
//!   kvguard-control is the suspect, whatever the phases of the renewals; and when the
//!   paths come back, every live gateway's renewal is due within that time of the first
//!   one heard, so the first back does not end the others; a trusted listener that
//!   refuses ends the hold: a reset comes from a reachable host). Then, where the gateway's
//!   listener is known and has answered a handshake before (*trusted*), and no successor
//!   proved its life there since (a hot restart's child listens on the parent's socket),
//!   it is asked again ([`Judgement::probes`]; the shell connects): refused or
//!   unanswered → **dead**; a handshake → held (a frozen process's kernel still answers),
//!   asked again each period.
//!   Without a trusted listener, silence is evidence only where it is of evidence that
//!   flows on its own: a data path that carried in-band renewals → **silent**; a data
//!   path that carried only proofs on requests (a hop that does not route the in-band
//!   renewal: no new request is no evidence of death) → **unproven**, counted, never
//!   ended; as is an instance whose data path carried nothing.
//!
//! Within a live instance, one **worker VM** can be gone (it trapped; Envoy cut its
//! streams at their next callback) while the others renew. Renewals from filters that
//! number their VMs list the live ones (`vms`), and each request names its VM
//! (`x-kvguard-instance: <id>.<vm>`). A VM is **lost** when the instance's renewals have
//! gone on without it for the TTL: a renewal listing VMs arrives more than the TTL after
//! the first renewal that left it out (since its last evidence: a renewal listing it, or
//! a request tagged with it). Both ends of that gap are renewals of the instance itself,
//! so neither the network nor kvguard-control's own stalls can open it, and a whole
//! gateway that stalls and resumes (whose first renewal may come before its other VMs
//! beat again) loses none: only the instance saying, for a TTL, that the VM is not among
//! its live ones. Its requests end (`why="vm_lost"`).
//!
//! Soft state: nothing is persisted; an instance is judged only after this process has
//! accepted a renewal from it. A stall of kvguard-control's own loop extends every lease
//! by the stall before anything is judged. An expired instance's counters are kept
//! (bounded) so a captured renewal replayed cannot revive it.

use kvguard_contract::lease::MAX_VMS;
use kvguard_contract::{HostKey, InstanceId, InstanceTag, Proof, RenewalBody, Via};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Why a renewal was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewError {
    /// Its counter is below the last one accepted on its path for the instance (also
    /// after the instance expired).
    Replay,
    /// Its counter is the last one accepted on its path: the same renewal again (sent
    /// to `control_cluster` and to the replica directly, or forwarded by a peer). No
    /// evidence of life.
    Duplicate,
    /// Its period is too long for this TTL: fewer than
    /// [`kvguard_contract::lease::MIN_TTL_PERIODS`] renewals fit in one.
    PeriodTooLong {
        /// The renewal's period.
        period_ms: u64,
        /// The longest period this TTL allows.
        max_ms: u64,
    },
}

/// Why an instance expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// Both kinds of evidence silent for the TTL.
    Silent,
    /// A successor renews with its host key and it has been silent for the TTL.
    Replaced,
    /// Silent for the TTL, but its silence proves nothing (its data path carried no
    /// in-band renewal, and no trusted listener answered for it): its requests are
    /// counted, never ended.
    Unproven,
    /// Silent for the TTL, and its listener refused a handshake or did not answer one.
    Dead,
    /// One worker VM of a live instance: its renewals left it out for the TTL.
    VmLost,
}

impl Expiry {
    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Expiry::Silent => "silent",
            Expiry::Replaced => "replaced",
            Expiry::Unproven => "unproven",
            Expiry::Dead => "dead",
            Expiry::VmLost => "vm_lost",
        }
    }

    /// What this expiry does under `mode`: its requests are ended under `enforce`
    /// unless it is `unproven` (its silence proves nothing: counted only). Its figures
    /// carry the configured mode whatever it does (`mode="enforce", why="unproven"`
    /// ends nothing; `why` says so), so that a dashboard's mode is the flag's.
    pub const fn acts(self, mode: Mode) -> Acts {
        Acts {
            ends: matches!(mode, Mode::Enforce) && !matches!(self, Expiry::Unproven),
            mode,
        }
    }
}

/// `--lease-mode` where leases are judged (`off` judges none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Judged, logged and counted; nothing ended (the rollout step).
    Observe,
    /// An expiry ends the instance's requests in flight (reason `gateway_lost`).
    Enforce,
}

impl Mode {
    /// The flag value and the `mode` label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Mode::Observe => "observe",
            Mode::Enforce => "enforce",
        }
    }
}

/// What an expiry does ([`Expiry::acts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Acts {
    /// Its requests in flight are ended (else counted only).
    pub ends: bool,
    /// The `mode` label its figures are counted under.
    pub mode: Mode,
}

#[derive(Debug, Clone)]
struct Lease {
    host: Option<HostKey>,
    period: Duration,
    /// Last accepted counter per path.
    counter: [u64; 2],
    /// Last out-of-band renewal.
    admin: Option<Instant>,
    /// Last in-band renewal or tagged request.
    data: Option<Instant>,
    /// Last renewal of either path (the host-key rule's "its own renewals").
    renewed: Instant,
    /// Its first evidence (the shared-host-key rule's overlap; the order of two processes
    /// whose dates cannot tell).
    first: Instant,
    /// When the process started, as its first renewal here tells: its receipt less its
    /// counter's periods (the period it states; a proof states none). `None` until
    /// then. Orders a hot restart's parent and child, also for a replica that restarted
    /// and heard the child first: each estimate carries its own drift, the older
    /// process's the larger.
    born: Option<Instant>,
    /// Whether its data path carried an in-band renewal (evidence that flows on its own).
    inband: bool,
    /// Its listener, from a verified proof, and whether it completed a handshake.
    listener: Option<(SocketAddr, bool)>,
    /// The last probe asked, and the last answer with when it came.
    asked: Option<Instant>,
    answer: Option<(Instant, ProbeAnswer)>,
    /// Its host key was found shared (counted once).
    shared: bool,
    /// Held in the current silent spell (counted once).
    held: bool,
    /// The first evidence from another instance after this one's silence began (a period
    /// and a half after its last evidence); cleared by its own evidence.
    others_heard: Option<Instant>,
    /// Receipt of the last renewal that listed the live VMs.
    listed: Option<Instant>,
    /// Listings until then follow a stall and mark no VM absent ([`Lease::listed`]).
    stale_until: Option<Instant>,
    /// Per worker VM: its last evidence (a renewal listing it or a request tagged with
    /// it), and the first renewal since that left it out.
    vms: HashMap<u32, Vm>,
}

#[derive(Debug, Clone, Copy)]
struct Vm {
    seen: Instant,
    absent: Option<Instant>,
}

/// What a TCP connect to a gateway's listener found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeAnswer {
    /// The handshake completed: the gateway's kernel still holds the listening socket
    /// (a running or a frozen process).
    Alive,
    /// Refused: nothing listens there (the process is gone).
    Refused,
    /// No answer within [`probe_timeout`] (the host or pod is gone, or unreachable).
    Timeout,
}

impl ProbeAnswer {
    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            ProbeAnswer::Alive => "alive",
            ProbeAnswer::Refused => "refused",
            ProbeAnswer::Timeout => "timeout",
        }
    }
}

/// A gateway's renewing VM lists the VMs that beat within this many lease periods (the
/// filter's `vms::SILENT_PERIODS`): a listing that comes longer than this after the last
/// one may leave out VMs that only stalled with their gateway.
pub const LIST_STALE_PERIODS: u32 = 3;

/// Most probes one judgement asks for.
pub const MAX_PROBES: usize = 64;

/// How long the shell waits for a probe's handshake: an eighth of the TTL, between
/// 100 ms and 1 s.
pub fn probe_timeout(ttl: Duration) -> Duration {
    (ttl / 8).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

impl Lease {
    /// `vm` was seen alive at `at` (the least recently seen is forgotten beyond
    /// [`MAX_VMS`]).
    fn saw_vm(&mut self, vm: u32, at: Instant) {
        if !self.vms.contains_key(&vm) && self.vms.len() >= MAX_VMS {
            if let Some(old) = self
                .vms
                .iter()
                .min_by_key(|(_, v)| v.seen)
                .map(|(id, _)| *id)
            {
                self.vms.remove(&old);
            }
        }
        let v = self.vms.entry(vm).or_insert(Vm {
            seen: at,
            absent: None,
        });
        if at >= v.seen {
            v.seen = at;
            v.absent = None;
        }
    }

    /// A renewal received at `at` listed `live`: every other VM known is absent from
    /// then on (unless it already was) — unless this listing follows the last one by
    /// more than [`LIST_STALE_PERIODS`]: the gateway (or the path) stalled meanwhile, and
    /// its renewing VM, which renews before it beats, lists only the VMs that beat within
    /// that many periods: none of its VMs had run either. The next listing says.
    fn listed(&mut self, live: &[u32], at: Instant) {
        let gap = self.listed.map(|t| at.saturating_duration_since(t));
        if gap.is_some_and(|g| g > self.period * LIST_STALE_PERIODS) {
            // Both paths' renewals of that tick carry the same list.
            self.stale_until = Some(at + self.period);
        }
        self.listed = Some(self.listed.map_or(at, |t| t.max(at)));
        for v in live {
            self.saw_vm(*v, at);
        }
        if self.stale_until.is_some_and(|t| at <= t) {
            return;
        }
        for (id, v) in &mut self.vms {
            if v.absent.is_none() && v.seen < at && !live.contains(id) {
                v.absent = Some(at);
            }
        }
    }
}

impl Lease {
    fn new(period: Duration, counter: [u64; 2], now: Instant) -> Lease {
        Lease {
            host: None,
            period,
            counter,
            admin: None,
            data: None,
            renewed: now,
            first: now,
            born: None,
            inband: false,
            listener: None,
            asked: None,
            answer: None,
            shared: false,
            held: false,
            others_heard: None,
            listed: None,
            stale_until: None,
            vms: HashMap::new(),
        }
    }

    /// Renewal `counter`, received at `at`: the first one here dates the process.
    fn counted(&mut self, counter: u64, at: Instant) {
        if self.born.is_none() {
            let ago = u32::try_from(counter)
                .ok()
                .and_then(|c| self.period.checked_mul(c));
            self.born = ago.and_then(|d| at.checked_sub(d));
        }
    }

    /// Whether this instance started after `older` did: a process that took over from it,
    /// not one it took over from. By the renewals' dates where they are more than the
    /// renewals' jitter (a fifth of a period) apart; otherwise (a process that lived a
    /// moment, one not dated yet) by which was heard first.
    fn succeeds(&self, older: &Lease) -> bool {
        let margin = self.period.max(older.period) / 5;
        let after = |x: Instant, y: Instant| y.checked_add(margin).is_some_and(|y| x > y);
        match (self.born, older.born) {
            (Some(b), Some(a)) if after(b, a) => true,
            (Some(b), Some(a)) if after(a, b) => false,
            _ => self.first > older.first,
        }
    }

    /// Its listener, if a handshake there has completed.
    fn trusted(&self) -> Option<SocketAddr> {
        self.listener.filter(|(_, t)| *t).map(|(a, _)| a)
    }

    /// Whether a probe may be asked at `now`: none asked within `every`.
    fn may_ask(&self, now: Instant, every: Duration) -> bool {
        self.asked
            .is_none_or(|t| now.saturating_duration_since(t) >= every)
    }

    fn last(&self) -> Instant {
        match (self.admin, self.data) {
            (Some(a), Some(d)) => a.max(d),
            (a, d) => a.or(d).unwrap_or(self.renewed),
        }
    }

    /// When this instance's silence begins: its next renewal was due, with room for
    /// jitter and tick lateness.
    fn silent_from(&self) -> Instant {
        self.last() + self.period * 3 / 2
    }
}

const fn slot(via: Via) -> usize {
    match via {
        Via::Admin => 0,
        Via::Data => 1,
    }
}

/// What a judgement does with one lease.
#[derive(Debug, Clone, Copy)]
enum Verdict {
    /// Held (counted once per silent spell).
    Hold,
    /// Held, and its listener asked again.
    HoldAndProbe(SocketAddr),
    /// Its listener asked; judged on the answer.
    Probe(SocketAddr),
    /// A probe is on its way.
    Wait,
    /// Expired.
    Expire(Expiry),
}

/// What one judgement found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Judgement {
    /// Instances whose lease expired now, and why (they leave the table).
    pub expired: Vec<(InstanceId, Expiry)>,
    /// Expiries held now because nobody else was heard from since, or because the
    /// gateway's listener still answered (counted once per silent spell).
    pub held: usize,
    /// Every instance past the TTL whose expiry is held at this judgement.
    pub holding: Vec<InstanceId>,
    /// Listeners to connect to (each from a verified proof), and the instance each
    /// answers for: [`Leases::probed`] takes the answer.
    pub probes: Vec<(InstanceId, SocketAddr)>,
    /// Instances whose host key another live instance, on another listener, renews
    /// with (found now; never used for a `replaced` verdict).
    pub shared: Vec<(InstanceId, HostKey)>,
    /// Worker VMs of live instances lost now (they leave the instance's VM list).
    pub lost: Vec<(InstanceId, u32)>,
}

/// What a replica knows of the instances it judges, for `/metrics`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Census {
    /// Instances holding a lease.
    pub held: usize,
    /// Of those, instances whose silence ends their streams: their data path carried an
    /// in-band renewal, or a proof and their listener answered a handshake.
    pub enforceable: usize,
}

/// Most expired instances whose counters are kept.
pub const MAX_GONE: usize = 4096;

/// Most verified proof values remembered (all forgotten at once beyond: each is good for
/// one period of one worker VM).
pub const MAX_VERIFIED: usize = 4096;

/// Every lease this process holds.
#[derive(Debug)]
pub struct Leases {
    ttl: Duration,
    table: HashMap<InstanceId, Lease>,
    /// Counters of expired instances, and when they expired.
    gone: HashMap<InstanceId, ([u64; 2], Instant)>,
    /// `x-kvguard-instance` values whose proof verified.
    verified: HashSet<Vec<u8>>,
}

impl Leases {
    /// Leases expiring after `ttl` without evidence of life.
    pub fn new(ttl: Duration) -> Leases {
        Leases {
            ttl,
            table: HashMap::new(),
            gone: HashMap::new(),
            verified: HashSet::new(),
        }
    }

    /// Whether the proof in header value `value` is genuine: `check` verifies it the
    /// first time (every tracked request of a worker VM carries the same value for a
    /// period; it is verified once).
    pub fn verified(&mut self, value: &[u8], check: impl FnOnce() -> bool) -> bool {
        if self.verified.contains(value) {
            return true;
        }
        if !check() {
            return false;
        }
        if self.verified.len() >= MAX_VERIFIED {
            self.verified.clear();
        }
        self.verified.insert(value.to_vec());
        true
    }

    /// The TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Leases held.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether no lease is held.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Whether `id` holds a lease.
    pub fn holds(&self, id: &InstanceId) -> bool {
        self.table.contains_key(id)
    }

    /// How many leases are held and enforceable.
    pub fn census(&self) -> Census {
        Census {
            held: self.table.len(),
            enforceable: self
                .table
                .values()
                .filter(|l| l.inband || l.trusted().is_some())
                .count(),
        }
    }

    /// The period assumed for a sender that does not say its own: the filter's default,
    /// a sixth of the default TTL.
    fn default_period(&self) -> Duration {
        self.ttl / 6
    }

    /// The longest renewal period this TTL allows.
    pub fn max_period(&self) -> Duration {
        self.ttl / kvguard_contract::lease::MIN_TTL_PERIODS
    }

    /// A renewal received at `now` (from the gateway on either path, or forwarded by a
    /// peer): accepted if its counter is above the last accepted on its path. The
    /// counter is the gateway process's and reaches every replica, so each keeps the
    /// highest it saw. `Ok(true)`: this replica held no lease for the instance yet.
    pub fn renew(&mut self, r: &RenewalBody, now: Instant) -> Result<bool, RenewError> {
        if let Some(p) = r.period_ms {
            let max_ms = u64::try_from(self.max_period().as_millis()).unwrap_or(u64::MAX);
            if p > max_ms {
                return Err(RenewError::PeriodTooLong {
                    period_ms: p,
                    max_ms,
                });
            }
        }
        let i = slot(r.via);
        let period = r
            .period_ms
            .map_or(self.default_period(), Duration::from_millis)
            .max(Duration::from_millis(1));
        let fresh = |l: &mut Lease| {
            match r.via {
                Via::Admin => l.admin = Some(l.admin.map_or(now, |t| t.max(now))),
                Via::Data => {
                    l.data = Some(l.data.map_or(now, |t| t.max(now)));
                    l.inband = true;
                }
            }
            l.renewed = l.renewed.max(now);
            l.held = false;
            l.others_heard = None;
            if let Some(vms) = &r.vms {
                l.listed(vms, now);
            }
            if r.host.is_some() {
                l.host = r.host;
            }
            l.period = period;
        };
        if let Some(l) = self.table.get_mut(&r.instance) {
            if r.counter < l.counter[i] {
                return Err(RenewError::Replay);
            }
            if r.counter == l.counter[i] {
                // No new evidence, but proof that the path carries in-band renewals (a
                // proof on a request may have brought the counter first).
                l.inband |= r.via == Via::Data;
                return Err(RenewError::Duplicate);
            }
            l.counter[i] = r.counter;
            fresh(l);
            l.counted(r.counter, now);
            self.heard(r.instance, now);
            return Ok(false);
        }
        let mut counter = [0; 2];
        if let Some((kept, _)) = self.gone.get(&r.instance) {
            if r.counter <= kept[i] {
                return Err(RenewError::Replay);
            }
            counter = *kept;
            self.gone.remove(&r.instance);
        }
        counter[i] = r.counter;
        let mut l = Lease::new(period, counter, now);
        fresh(&mut l);
        l.counted(r.counter, now);
        self.table.insert(r.instance, l);
        self.heard(r.instance, now);
        Ok(true)
    }

    /// Whether `l`'s host key is shared: another instance renews with it from another
    /// listener, and each was heard while the other was (two gateways given one
    /// `node.id`). A hot restart's parent and child share a listener; a process restarted
    /// in place is heard only after the old one's last evidence.
    fn shared_host(&self, id: &InstanceId, l: &Lease) -> bool {
        let (Some(h), Some((a, _))) = (l.host, l.listener) else {
            return false;
        };
        let last = l.last();
        self.table.iter().any(|(o, ol)| {
            o != id
                && ol.host == Some(h)
                && ol.listener.is_some_and(|(b, _)| b != a)
                && ol.first < last
                && l.first < ol.last()
        })
    }

    /// Evidence from `from` accepted at `now`: for every other instance silent by then,
    /// the first evidence from another since its silence began.
    fn heard(&mut self, from: InstanceId, now: Instant) {
        for (id, l) in &mut self.table {
            if *id != from && l.others_heard.is_none() && l.silent_from() < now {
                l.others_heard = Some(now);
            }
        }
    }

    /// A request tagged with `tag` carried `proof`, verified, at `now`: taken as an
    /// in-band renewal with the proof's counter (a counter at or below the last accepted
    /// on the data path is no new evidence), which also takes a lease for an instance
    /// not held yet (the first tracked request arms it). `Ok(true)`: a lease was taken.
    pub fn prove(
        &mut self,
        tag: InstanceTag,
        proof: &Proof,
        now: Instant,
    ) -> Result<bool, RenewError> {
        let i = slot(Via::Data);
        let id = tag.instance;
        let new = !self.table.contains_key(&id);
        if new {
            let mut counter = [0; 2];
            if let Some((kept, _)) = self.gone.get(&id) {
                if proof.counter <= kept[i] {
                    return Err(RenewError::Replay);
                }
                counter = *kept;
                self.gone.remove(&id);
            }
            let period = self.default_period();
            self.table.insert(id, Lease::new(period, counter, now));
        }
        let Some(l) = self.table.get_mut(&id) else {
            return Err(RenewError::Replay);
        };
        // What the proof says of the gateway is its own (signed), fresh or not (a hop that
        // queues requests delivers a period's proof after the next period's renewal).
        if proof.host.is_some() {
            l.host = proof.host;
        }
        if let Some(a) = proof.listener {
            // The first listener stays once a handshake there completed (a gateway with
            // several listeners names each in turn; any of them answers for the process).
            if !l.listener.is_some_and(|(_, t)| t) && l.listener.map(|(b, _)| b) != Some(a) {
                l.listener = Some((a, false));
            }
        }
        if !new && proof.counter < l.counter[i] {
            return Err(RenewError::Replay);
        }
        if !new && proof.counter == l.counter[i] {
            return Err(RenewError::Duplicate);
        }
        l.counter[i] = proof.counter;
        l.data = Some(l.data.map_or(now, |t| t.max(now)));
        l.renewed = l.renewed.max(now);
        l.held = false;
        l.others_heard = None;
        if let Some(vm) = tag.vm {
            l.saw_vm(vm, now);
        }
        self.heard(id, now);
        Ok(new)
    }

    /// The listener of `id` to ask now, while the gateway lives, if one is known and not
    /// yet known to answer (and none was asked within the TTL): the shell asks at once
    /// when a proof takes a lease, so that a gateway that dies young is told from a
    /// silent one. The judgement asks the same later.
    pub fn calibrate(&mut self, id: InstanceId, now: Instant) -> Option<SocketAddr> {
        let ttl = self.ttl;
        let l = self.table.get_mut(&id)?;
        match l.listener {
            Some((a, false)) if l.may_ask(now, ttl) => {
                l.asked = Some(now);
                Some(a)
            }
            _ => None,
        }
    }

    /// The answer of a probe of `addr` for `id`, at `now`: a handshake makes the
    /// listener trusted (its later silence can be told from death); any answer is kept
    /// for the next judgement. An answer for another listener is ignored. A refusal is
    /// kept for every instance that proved its life on `addr`: nothing listens there.
    pub fn probed(&mut self, id: InstanceId, addr: SocketAddr, answer: ProbeAnswer, now: Instant) {
        if answer == ProbeAnswer::Refused {
            // Nothing listens at `addr`: that is also every other instance's answer there
            // (a hot restart's parent whose child took the socket, then died).
            for (o, l) in &mut self.table {
                if *o != id && l.listener.is_some_and(|(a, _)| a == addr) {
                    l.answer = Some((now, answer));
                }
            }
        }
        let Some(l) = self.table.get_mut(&id) else {
            return;
        };
        let Some((mine, trusted)) = &mut l.listener else {
            return;
        };
        if *mine != addr {
            return;
        }
        *trusted |= answer == ProbeAnswer::Alive;
        l.answer = Some((now, answer));
    }

    /// A request tagged with `tag` arrived at `now`, with no proof (an older filter):
    /// data-path evidence of life for a held lease, and of its VM (an instance never
    /// seen renewing gets none: it is never judged).
    pub fn touch(&mut self, tag: impl Into<InstanceTag>, now: Instant) {
        let tag = tag.into();
        if let Some(l) = self.table.get_mut(&tag.instance) {
            l.data = Some(l.data.map_or(now, |t| t.max(now)));
            l.held = false;
            l.others_heard = None;
            if let Some(vm) = tag.vm {
                l.saw_vm(vm, now);
            }
            self.heard(tag.instance, now);
        }
    }

    /// An instance judged expired at `judged` had a request admitted at `at`, after the
    /// judgement: evidence of life after all, so its lease is taken back (with its
    /// counters, and not armed until its data path carries new evidence).
    pub fn revive(&mut self, id: InstanceId, at: Instant) {
        let Some((counter, _)) = self.gone.remove(&id) else {
            return;
        };
        let mut l = Lease::new(self.default_period(), counter, at);
        l.data = Some(at);
        self.table.insert(id, l);
    }

    /// kvguard-control's own loop stalled for `stall`: every lease is extended by it
    /// (the silence may be ours).
    pub fn extend(&mut self, stall: Duration) {
        for l in self.table.values_mut() {
            l.admin = l.admin.map(|t| t + stall);
            l.data = l.data.map(|t| t + stall);
            l.renewed += stall;
            l.others_heard = l.others_heard.map(|t| t + stall);
            l.asked = l.asked.map(|t| t + stall);
            l.answer = l.answer.map(|(t, a)| (t + stall, a));
            // The renewals kvguard-control could not read meanwhile are no stall of the
            // gateway's.
            l.listed = l.listed.map(|t| t + stall);
            l.stale_until = l.stale_until.map(|t| t + stall);
            // A VM left out before the stall: the renewals that might list it again may
            // not have been read yet.
            for v in l.vms.values_mut() {
                v.absent = v.absent.map(|t| t + stall);
            }
        }
    }

    /// Judges every lease at `now` (see the module doc). Expired instances leave the
    /// table; their counters are kept.
    pub fn judge(&mut self, now: Instant) -> Judgement {
        let mut j = Judgement::default();
        let mut ids: Vec<InstanceId> = self.table.keys().copied().collect();
        // In id order: the probes asked within the bound, and every list, do not depend
        // on the table's order.
        ids.sort_unstable();
        let mut verdicts = Vec::new();
        for id in ids {
            let Some(l) = self.table.get(&id) else {
                continue;
            };
            let last = l.last();
            let silent_for = now.saturating_duration_since(last);
            let shared = self.shared_host(&id, l);
            if let (true, Some(h)) = (shared && !l.shared, l.host) {
                j.shared.push((id, h));
            }
            if silent_for <= self.ttl {
                // A listener not yet known to answer is asked while the gateway lives
                // (once a TTL): only one that answered can tell its death later.
                if let Some((a, false)) = l.listener {
                    if l.may_ask(now, self.ttl) {
                        verdicts.push((id, Verdict::Probe(a)));
                    }
                }
                continue;
            }
            // Has anyone else been heard from since its silence began, long enough ago
            // for its own renewal to have arrived had its path come back with theirs?
            let others = self.table.len() > 1;
            let heard = l
                .others_heard
                .is_some_and(|t| now.saturating_duration_since(t) >= l.period * 3 / 2);
            // A successor (a process that started after it, by the counters) renews with
            // its host key: it was restarted in place, or it is a hot restart's parent
            // that exited. Evidence of its end whatever its hops and listener (which its
            // successor may answer); a predecessor's renewals say nothing of it (a hot
            // restart's child frozen while its parent drains).
            let replaced = heard
                && !shared
                && l.host.is_some()
                && self.table.iter().any(|(o, ol)| {
                    *o != id && ol.host == l.host && ol.renewed > last && ol.succeeds(l)
                });
            if replaced {
                verdicts.push((id, Verdict::Expire(Expiry::Replaced)));
                continue;
            }
            // Its listener speaks for it unless a successor proved its life there since
            // and is not silent itself (a hot restart's child, or a restart in place, on
            // the same address): the socket is the newest process's. A successor silent
            // too may have died after it: the socket then speaks for both, and a refusal
            // (nothing listens) ends both.
            let trusted = l.trusted().filter(|a| {
                !self.table.iter().any(|(o, ol)| {
                    *o != id
                        && ol.listener.is_some_and(|(b, _)| b == *a)
                        && ol.last() > last
                        && ol.succeeds(l)
                        && ol.silent_from() > now
                })
            });
            // Asked since the silence reached the TTL: the kernel's answer.
            let answer = l
                .answer
                .filter(|(t, _)| *t >= last + self.ttl)
                .map(|(_, a)| a);
            // A refusal at the listener it proved (asked for it, or for a successor on the
            // same socket) is unambiguous where a handshake is not: nothing listens there,
            // and the host is reachable, so the network is not the suspect either.
            let refused = l.trusted().is_some() && answer == Some(ProbeAnswer::Refused);
            let v = if refused {
                Verdict::Expire(Expiry::Dead)
            } else if others && !heard {
                // Nobody heard: the network may be the suspect.
                match trusted {
                    Some(a) if l.may_ask(now, l.period) => Verdict::HoldAndProbe(a),
                    _ => Verdict::Hold,
                }
            } else if let Some(a) = trusted {
                match answer {
                    Some(ProbeAnswer::Alive) if l.may_ask(now, l.period) => {
                        Verdict::HoldAndProbe(a)
                    }
                    Some(ProbeAnswer::Alive) => Verdict::Hold,
                    Some(_) => Verdict::Expire(Expiry::Dead),
                    None if l.may_ask(now, l.period) => Verdict::Probe(a),
                    None => Verdict::Wait,
                }
            } else if l.inband {
                Verdict::Expire(Expiry::Silent)
            } else {
                Verdict::Expire(Expiry::Unproven)
            };
            verdicts.push((id, v));
        }
        for (id, v) in verdicts {
            let Some(l) = self.table.get_mut(&id) else {
                continue;
            };
            if j.shared.iter().any(|(s, _)| *s == id) {
                l.shared = true;
            }
            let (hold, probe) = match v {
                Verdict::Hold => (true, None),
                Verdict::HoldAndProbe(a) => (true, Some(a)),
                Verdict::Probe(a) => (false, Some(a)),
                Verdict::Wait => (false, None),
                Verdict::Expire(why) => {
                    if let Some(l) = self.table.remove(&id) {
                        self.keep_gone(id, l.counter, now);
                    }
                    j.expired.push((id, why));
                    continue;
                }
            };
            if hold {
                j.holding.push(id);
                if !l.held {
                    l.held = true;
                    j.held += 1;
                }
            }
            if let Some(a) = probe {
                if j.probes.len() < MAX_PROBES {
                    l.asked = Some(now);
                    j.probes.push((id, a));
                }
            }
        }
        j.expired.sort_by_key(|(id, _)| *id);
        // Worker VMs the live instances' renewals have left out for the TTL.
        let ttl = self.ttl;
        for (id, l) in &mut self.table {
            let Some(listed) = l.listed else {
                continue;
            };
            l.vms.retain(|vm, v| {
                let lost = v
                    .absent
                    .is_some_and(|a| listed.saturating_duration_since(a) > ttl);
                if lost {
                    j.lost.push((*id, *vm));
                }
                !lost
            });
        }
        j.lost.sort_unstable();
        j
    }

    /// A request of VM `vm` of `id`, judged lost, was admitted at `at`, after the
    /// judgement: the VM is alive after all.
    pub fn revive_vm(&mut self, id: InstanceId, vm: u32, at: Instant) {
        if let Some(l) = self.table.get_mut(&id) {
            l.saw_vm(vm, at);
        }
    }

    fn keep_gone(&mut self, id: InstanceId, counter: [u64; 2], now: Instant) {
        if self.gone.len() >= MAX_GONE {
            if let Some(oldest) = self
                .gone
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| *k)
            {
                self.gone.remove(&oldest);
            }
        }
        self.gone.insert(id, (counter, now));
    }
}

/// How much of the gap between two passes of a loop meant to run every `period` was a
/// stall (anything beyond twice the period; none below).
pub fn stall(gap: Duration, period: Duration) -> Duration {
    if gap > period * 2 {
        gap - period
    } else {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests;
