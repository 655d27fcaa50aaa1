//! Liveness leases of gateway processes (contract §8): the evidence of life per instance,
//! judged on kvguard-control's own monotonic receipt clock.
//!
//! The rule: **a gateway's streams are ended only on the silence of evidence that travels
//! their own path, or on positive evidence that the gateway is dead.** So an instance has
//! two kinds of evidence, kept apart: the *data path* (an in-band renewal, sent over the
//! upstream cluster its streams use, or a request tagged with it) and the *admin path* (an
//! out-of-band renewal). It expires when
//!
//! - **replaced**: another instance renews with its host key (same Envoy node and VM:
//!   a crash restart in place, a hot-restart child, a pod restarted with its identity)
//!   while its own renewals have stopped for two of its periods — positive evidence,
//!   whatever its hops; or
//! - **silent**: both kinds of evidence are older than the TTL, its data path has carried
//!   [`DATA_RENEWALS_TO_ENFORCE`] renewals (else the path cannot carry one and silence
//!   proves nothing: it stays observe-only), and — when other instances hold leases —
//!   another was heard from after this one went silent, at least a period and a half
//!   ago (one that hears from nobody holds: the network or kvguard-control is the
//!   suspect, whatever the phases of the renewals; and when the paths come back, every
//!   live gateway's renewal is due within that time of the first one heard, so the
//!   first back does not end the others).
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

use kvguard_contract::lease::DATA_RENEWALS_TO_ENFORCE;
use kvguard_contract::lease::MAX_VMS;
use kvguard_contract::{HostKey, InstanceId, InstanceTag, RenewalBody, Via};
use std::collections::HashMap;
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
    /// Another instance renews with its host key and its own renewals stopped.
    Replaced,
    /// Silent for the TTL, but its data path never carried a renewal: its requests are
    /// counted, never ended.
    Unproven,
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
            Expiry::VmLost => "vm_lost",
        }
    }
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
    /// In-band renewals accepted (saturating).
    data_renewals: u32,
    /// Held in the current silent spell (counted once).
    held: bool,
    /// The first evidence from another instance after this one's silence began (a period
    /// and a half after its last evidence); cleared by its own evidence.
    others_heard: Option<Instant>,
    /// Receipt of the last renewal that listed the live VMs.
    listed: Option<Instant>,
    /// Per worker VM: its last evidence (a renewal listing it or a request tagged with
    /// it), and the first renewal since that left it out.
    vms: HashMap<u32, Vm>,
}

#[derive(Debug, Clone, Copy)]
struct Vm {
    seen: Instant,
    absent: Option<Instant>,
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
    /// then on (unless it already was).
    fn listed(&mut self, live: &[u32], at: Instant) {
        self.listed = Some(self.listed.map_or(at, |t| t.max(at)));
        for v in live {
            self.saw_vm(*v, at);
        }
        for (id, v) in &mut self.vms {
            if v.absent.is_none() && v.seen < at && !live.contains(id) {
                v.absent = Some(at);
            }
        }
    }
}

impl Lease {
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

/// What one judgement found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Judgement {
    /// Instances whose lease expired now, and why (they leave the table).
    pub expired: Vec<(InstanceId, Expiry)>,
    /// Expiries held now because nobody else was heard from since (counted once per
    /// silent spell).
    pub held: usize,
    /// Worker VMs of live instances lost now (they leave the instance's VM list).
    pub lost: Vec<(InstanceId, u32)>,
}

/// What a replica knows of the instances it judges, for `/metrics`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Census {
    /// Instances holding a lease.
    pub held: usize,
    /// Of those, instances whose data path has carried enough renewals to be enforced.
    pub enforceable: usize,
}

/// Most expired instances whose counters are kept.
pub const MAX_GONE: usize = 4096;

/// Every lease this process holds.
#[derive(Debug)]
pub struct Leases {
    ttl: Duration,
    table: HashMap<InstanceId, Lease>,
    /// Counters of expired instances, and when they expired.
    gone: HashMap<InstanceId, ([u64; 2], Instant)>,
}

impl Leases {
    /// Leases expiring after `ttl` without evidence of life.
    pub fn new(ttl: Duration) -> Leases {
        Leases {
            ttl,
            table: HashMap::new(),
            gone: HashMap::new(),
        }
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
                .filter(|l| l.data_renewals >= DATA_RENEWALS_TO_ENFORCE)
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
                    l.data_renewals = l.data_renewals.saturating_add(1);
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
                return Err(RenewError::Duplicate);
            }
            l.counter[i] = r.counter;
            fresh(l);
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
        let mut l = Lease {
            host: None,
            period,
            counter,
            admin: None,
            data: None,
            renewed: now,
            data_renewals: 0,
            held: false,
            others_heard: None,
            listed: None,
            vms: HashMap::new(),
        };
        fresh(&mut l);
        self.table.insert(r.instance, l);
        self.heard(r.instance, now);
        Ok(true)
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

    /// A request tagged with `tag` arrived at `now`: data-path evidence of life for a
    /// held lease, and of its VM (an instance never seen renewing gets none: it is
    /// never judged).
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
    /// counters, and not enforceable until its data path renews again).
    pub fn revive(&mut self, id: InstanceId, at: Instant) {
        let Some((counter, _)) = self.gone.remove(&id) else {
            return;
        };
        self.table.insert(
            id,
            Lease {
                host: None,
                period: self.default_period(),
                counter,
                admin: None,
                data: Some(at),
                renewed: at,
                data_renewals: 0,
                held: false,
                others_heard: None,
                listed: None,
                vms: HashMap::new(),
            },
        );
    }

    /// kvguard-control's own loop stalled for `stall`: every lease is extended by it
    /// (the silence may be ours).
    pub fn extend(&mut self, stall: Duration) {
        for l in self.table.values_mut() {
            l.admin = l.admin.map(|t| t + stall);
            l.data = l.data.map(|t| t + stall);
            l.renewed += stall;
            l.others_heard = l.others_heard.map(|t| t + stall);
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
        let ids: Vec<InstanceId> = self.table.keys().copied().collect();
        let mut verdicts = Vec::new();
        for id in ids {
            let Some(l) = self.table.get(&id) else {
                continue;
            };
            let last = l.last();
            let silent_for = now.saturating_duration_since(last);
            let replaced = l.host.is_some()
                && silent_for > l.period * 2
                && self
                    .table
                    .iter()
                    .any(|(o, ol)| *o != id && ol.host == l.host && ol.renewed > last);
            if replaced {
                verdicts.push((id, Some(Expiry::Replaced)));
                continue;
            }
            if silent_for <= self.ttl {
                continue;
            }
            // Has anyone else been heard from since its silence began, long enough ago
            // for its own renewal to have arrived had its path come back with theirs?
            let others = self.table.len() > 1;
            let heard = l
                .others_heard
                .is_some_and(|t| now.saturating_duration_since(t) >= l.period * 3 / 2);
            if others && !heard {
                verdicts.push((id, None));
            } else if l.data_renewals >= DATA_RENEWALS_TO_ENFORCE {
                verdicts.push((id, Some(Expiry::Silent)));
            } else {
                verdicts.push((id, Some(Expiry::Unproven)));
            }
        }
        for (id, v) in verdicts {
            match v {
                None => {
                    if let Some(l) = self.table.get_mut(&id) {
                        if !l.held {
                            l.held = true;
                            j.held += 1;
                        }
                    }
                }
                Some(why) => {
                    if let Some(l) = self.table.remove(&id) {
                        self.keep_gone(id, l.counter, now);
                    }
                    j.expired.push((id, why));
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
