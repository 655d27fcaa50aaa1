//! The gateway side of the liveness lease (contract §8), host-free: the process's
//! instance id, the renewal slot, the replicas and upstream clusters to renew (all in
//! proxy-wasm shared data, behind [`SharedData`]), the election of the one VM that renews
//! in a period, and the signed renewals it sends: out of band to kvguard-control's admin
//! listener (`control_cluster`, and each replica holding one of the process's streams),
//! and in band over each upstream cluster its streams use (`/v1/kvguard/lease`, through
//! every hop on the way).
//!
//! Shared data outlives VM reloads and module upgrades (it belongs to the `vm_id` in the
//! Envoy process), so a config push neither changes the instance id nor resets the
//! renewal counter; a new Envoy process (a restart, a hot restart's child) starts with
//! none and draws a fresh id, and renews with the same host key as the process it
//! replaced.

use crate::aborts::ORIGINAL_DST_HEADER;
use crate::config::Config;
use crate::host::{Call, Level, Platform, SharedData, SharedError};
use crate::metrics::{LeaseResult, Metric};
use crate::vms::{self, VMS_KEY};
use core::net::SocketAddr;
use kvguard_contract::{
    sign_proof, signature, unsigned_proof, Domain, HostKey, InstanceId, InstanceTag, Key, Renewal,
    Via, DATA_LEASE_PATH,
};

/// Shared-data key of the instance id (value `v1:<32 hex>`).
pub const INSTANCE_KEY: &str = "kvguard.instance.v1";
/// Shared-data key of the renewal slot (value `v1:<due monotonic ms>:<counter>`).
pub const SLOT_KEY: &str = "kvguard.lease.v1";

/// Shared-data key of the kvguard-control replicas that hold this process's streams
/// (value `v1:<ip:port>@<seen monotonic ms>,...`), named by verified `x-kvguard-control`
/// stamps and named again every period while a stream there is in flight: each
/// period's renewal goes to every one of them as well as to `control_cluster`.
pub const REPLICAS_KEY: &str = "kvguard.replicas.v1";
/// Most replicas remembered (the longest unseen is forgotten first).
pub const MAX_REPLICAS: usize = 16;
/// A replica (or upstream cluster) no stream has named for this many renewal periods is
/// forgotten; one with a stream in flight is named every period, whatever its answers.
pub const FORGET_PERIODS: u64 = 12;

/// Shared-data key of the upstream clusters this process's tracked streams use, with
/// the `:authority` they were sent with (value `v1` then, per line,
/// `<seen ms>\t<cluster>\t<authority>`): the in-band renewal goes over each.
pub const UPSTREAMS_KEY: &str = "kvguard.upstreams.v1";
/// Most upstream clusters remembered.
pub const MAX_UPSTREAMS: usize = 4;
/// Renewal calls awaiting their answer that a VM remembers (older ones are forgotten:
/// their answers count as nothing).
pub const MAX_TOKENS: usize = 64;

/// The replicas remembered in a [`REPLICAS_KEY`] value, with when each was last named
/// (unreadable entries are skipped).
pub fn parse_replicas(v: &[u8]) -> Vec<(SocketAddr, u64)> {
    let Some(text) = v
        .strip_prefix(b"v1:")
        .and_then(|t| core::str::from_utf8(t).ok())
    else {
        return Vec::new();
    };
    text.split(',')
        .filter_map(|e| {
            let (a, t) = e.rsplit_once('@')?;
            Some((a.parse().ok()?, t.parse().ok()?))
        })
        .collect()
}

/// The [`REPLICAS_KEY`] value of `list`.
pub fn replicas_value(list: &[(SocketAddr, u64)]) -> Vec<u8> {
    let mut s = String::from("v1:");
    for (i, (a, t)) in list.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!("{a}@{t}"));
    }
    s.into_bytes()
}

/// The replicas to renew at `now_ms`: those named within [`FORGET_PERIODS`] periods.
pub fn live_replicas(current: Option<&[u8]>, now_ms: u64, period_ms: u64) -> Vec<SocketAddr> {
    let horizon = period_ms.saturating_mul(FORGET_PERIODS);
    current
        .map(parse_replicas)
        .unwrap_or_default()
        .into_iter()
        .filter(|(_, t)| now_ms.saturating_sub(*t) <= horizon)
        .map(|(a, _)| a)
        .collect()
}

/// `current` with `addr` named at `now_ms` (`Some(new value)`), or `None` when nothing
/// needs writing (named less than a period ago). Forgotten and surplus entries go.
pub fn remember(
    current: Option<&[u8]>,
    addr: SocketAddr,
    now_ms: u64,
    period_ms: u64,
) -> Option<Vec<u8>> {
    let horizon = period_ms.saturating_mul(FORGET_PERIODS);
    let mut list: Vec<(SocketAddr, u64)> = current.map(parse_replicas).unwrap_or_default();
    if list
        .iter()
        .any(|(a, t)| *a == addr && now_ms.saturating_sub(*t) < period_ms)
    {
        return None;
    }
    // Most recent first (the value is always written so): the longest unseen goes first.
    list.retain(|(a, t)| *a != addr && now_ms.saturating_sub(*t) <= horizon);
    list.insert(0, (addr, now_ms));
    list.truncate(MAX_REPLICAS);
    Some(replicas_value(&list))
}

/// The shared-data value of an instance id.
pub fn instance_value(id: InstanceId) -> Vec<u8> {
    format!("v1:{id}").into_bytes()
}

/// Reads an instance id value (`None` for anything but `v1:<32 hex>`).
pub fn parse_instance_value(v: &[u8]) -> Option<InstanceId> {
    InstanceId::parse(v.strip_prefix(b"v1:")?)
}

/// The renewal slot: when the next renewal is due, and the last counter used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Monotonic ms (the host clock shared by every VM of the process).
    pub due_ms: u64,
    /// The last counter sent.
    pub counter: u64,
}

impl Slot {
    /// Parses `v1:<due>:<counter>`.
    pub fn parse(v: &[u8]) -> Option<Slot> {
        let text = core::str::from_utf8(v.strip_prefix(b"v1:")?).ok()?;
        let (due, counter) = text.split_once(':')?;
        Some(Slot {
            due_ms: due.parse().ok()?,
            counter: counter.parse().ok()?,
        })
    }

    /// The shared-data value.
    pub fn value(self) -> Vec<u8> {
        format!("v1:{}:{}", self.due_ms, self.counter).into_bytes()
    }
}

/// Whether this VM should renew now, given the slot as read: `Some(new slot)` to write
/// with compare-and-swap (the VM whose write lands sends the renewal with the new
/// slot's counter), `None` when a renewal is not due. `jitter_ms` (below a fifth of the
/// period) spreads the renewals of many gateways; a slot that is missing, unreadable or
/// due implausibly far ahead is due now.
pub fn elect(current: Option<&[u8]>, now_ms: u64, period_ms: u64, jitter_ms: u64) -> Option<Slot> {
    let next = |counter: u64| Slot {
        due_ms: now_ms.saturating_add(period_ms.saturating_sub(jitter_ms % (period_ms / 5).max(1))),
        counter: counter.saturating_add(1),
    };
    match current.and_then(Slot::parse) {
        Some(s) if now_ms < s.due_ms && s.due_ms <= now_ms.saturating_add(2 * period_ms) => None,
        Some(s) => Some(next(s.counter)),
        None => Some(next(0)),
    }
}

/// An upstream cluster the in-band renewal goes over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// The Envoy cluster a tracked stream was routed to.
    pub cluster: String,
    /// The `:authority` that stream was sent with (hops route by it).
    pub authority: String,
}

fn plain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 256 && !s.bytes().any(|b| b.is_ascii_control())
}

/// The upstreams remembered in an [`UPSTREAMS_KEY`] value, with when each was last named
/// (unreadable lines are skipped).
pub fn parse_upstreams(v: &[u8]) -> Vec<(Upstream, u64)> {
    let Some(text) = v
        .strip_prefix(b"v1\n")
        .and_then(|t| core::str::from_utf8(t).ok())
    else {
        return Vec::new();
    };
    text.split_terminator('\n')
        .filter_map(|line| {
            let (seen, rest) = line.split_once('\t')?;
            let (cluster, authority) = rest.split_once('\t')?;
            Some((
                Upstream {
                    cluster: cluster.to_owned(),
                    authority: authority.to_owned(),
                },
                seen.parse().ok()?,
            ))
        })
        .collect()
}

fn upstreams_value(list: &[(Upstream, u64)]) -> Vec<u8> {
    let mut s = String::from("v1\n");
    for (u, t) in list {
        s.push_str(&t.to_string());
        for f in [&u.cluster, &u.authority] {
            s.push('\t');
            s.push_str(f);
        }
        s.push('\n');
    }
    s.into_bytes()
}

/// `current` with `up` named at `now_ms` (`Some(new value)`), or `None` when nothing
/// needs writing (named less than a period ago, or not storable).
pub fn remember_upstream(
    current: Option<&[u8]>,
    up: &Upstream,
    now_ms: u64,
    period_ms: u64,
) -> Option<Vec<u8>> {
    if !plain(&up.cluster) || !plain(&up.authority) {
        return None;
    }
    let horizon = period_ms.saturating_mul(FORGET_PERIODS);
    let mut list = current.map(parse_upstreams).unwrap_or_default();
    if list
        .iter()
        .any(|(u, t)| u == up && now_ms.saturating_sub(*t) < period_ms)
    {
        return None;
    }
    // Most recent first: the longest unseen is dropped first.
    list.retain(|(u, t)| u != up && now_ms.saturating_sub(*t) <= horizon);
    list.insert(0, (up.clone(), now_ms));
    list.truncate(MAX_UPSTREAMS);
    Some(upstreams_value(&list))
}

/// The upstreams to renew over at `now_ms`: those named within [`FORGET_PERIODS`] periods.
pub fn live_upstreams(current: Option<&[u8]>, now_ms: u64, period_ms: u64) -> Vec<Upstream> {
    let horizon = period_ms.saturating_mul(FORGET_PERIODS);
    current
        .map(parse_upstreams)
        .unwrap_or_default()
        .into_iter()
        .filter(|(_, t)| now_ms.saturating_sub(*t) <= horizon)
        .map(|(u, _)| u)
        .collect()
}

/// Names `up` at `now_ms` in [`UPSTREAMS_KEY`] (a lost race leaves it for the next time).
fn write_upstream<H: SharedData + ?Sized>(h: &mut H, up: &Upstream, now_ms: u64, period_ms: u64) {
    let (current, cas) = match h.shared_get(UPSTREAMS_KEY) {
        Ok(Some((v, cas))) => (Some(v), cas),
        Ok(None) => (None, 0),
        Err(_) => return,
    };
    if let Some(v) = remember_upstream(current.as_deref(), up, now_ms, period_ms) {
        let _ = h.shared_set(UPSTREAMS_KEY, &v, cas);
    }
}

/// Where one renewal went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dest {
    /// Out of band: `control_cluster` (`None`) or one replica through the target cluster.
    Admin(Option<SocketAddr>),
    /// In band, over an upstream cluster.
    Data(Upstream),
}

impl Dest {
    fn metric(&self, r: LeaseResult) -> Metric {
        match self {
            Dest::Admin(_) => Metric::LeaseRenewals(r),
            Dest::Data(_) => Metric::LeaseDataRenewals(r),
        }
    }
}

/// Sends renewal `counter` of `instance`, listing the live worker VMs `vms` (none: the
/// VM table is unreadable), to `dest`; returns its token. Renewals do not go through the
/// abort queue: an abort storm never delays them.
pub fn send<P: Platform + ?Sized>(
    cfg: &Config,
    p: &mut P,
    (instance, vms): (InstanceId, Option<&[u32]>),
    host: Option<HostKey>,
    counter: u64,
    dest: &Dest,
) -> Option<u32> {
    let mut renewal = Renewal::new(instance, counter);
    if let Some(v) = vms {
        renewal = renewal.with_vms(v);
    }
    if let Some(h) = host {
        renewal = renewal.from_host(h, cfg.lease_renew_ms);
    } else {
        renewal.period_ms = Some(cfg.lease_renew_ms);
    }
    let (cluster, path, authority, replica) = match dest {
        // To control_cluster: forwarded to the peers only when no replica is renewed
        // directly (without a target route there is no other way to reach them).
        Dest::Admin(None) => {
            renewal = renewal.sent(Via::Admin, cfg.target.is_none());
            (
                cfg.control_cluster.as_str(),
                cfg.lease_path.as_str(),
                cfg.control_authority.as_str(),
                None,
            )
        }
        Dest::Admin(Some(addr)) => {
            let t = cfg.target.as_ref()?;
            renewal = renewal.sent(Via::Admin, false);
            (
                t.cluster.as_str(),
                cfg.lease_path.as_str(),
                cfg.control_authority.as_str(),
                Some(addr),
            )
        }
        Dest::Data(u) => {
            renewal = renewal.sent(Via::Data, true);
            (
                u.cluster.as_str(),
                DATA_LEASE_PATH,
                u.authority.as_str(),
                None,
            )
        }
    };
    let body = renewal.to_json();
    let sig = signature::sign(Domain::Renewal, &cfg.key, p.unix_secs(), &body);
    let mut headers = vec![
        (":method", "POST".to_owned()),
        (":path", path.to_owned()),
        (":authority", authority.to_owned()),
        ("content-type", "application/json".to_owned()),
        (signature::SIGNATURE_HEADER, sig),
    ];
    if let Some(addr) = replica {
        headers.push((ORIGINAL_DST_HEADER, addr.to_string()));
    }
    let call = Call {
        cluster,
        headers,
        body,
        timeout_ms: cfg.abort_timeout_ms,
    };
    match p.dispatch(&call) {
        Ok(token) => {
            p.add(dest.metric(LeaseResult::Sent), 1);
            Some(token)
        }
        Err(e) => {
            p.add(dest.metric(LeaseResult::Failed), 1);
            p.log(
                Level::Warn,
                &format!("lease renewal counter={counter} not sent to {cluster}: the host refused the call ({e:?}); check control_cluster / control_target_cluster"),
            );
            None
        }
    }
}

/// A renewal's answer (`None`: timeout or reset) on the in-band path (`data`) or not.
/// A failure is logged when its path's last answer was not one (a hop that never carries
/// the in-band renewal is said once, not every period).
fn on_answer<P: Platform + ?Sized>(
    p: &mut P,
    data: bool,
    status: Option<u16>,
    was_ok: Option<bool>,
) {
    let ok = status == Some(200);
    let r = if ok {
        LeaseResult::Accepted
    } else {
        LeaseResult::Failed
    };
    p.add(
        if data {
            Metric::LeaseDataRenewals(r)
        } else {
            Metric::LeaseRenewals(r)
        },
        1,
    );
    if ok || was_ok == Some(false) {
        return;
    }
    let shown = status.map_or_else(|| "none (timeout or reset)".to_owned(), |s| s.to_string());
    let hint = match (data, status) {
        (true, _) => " (a hop does not pass /v1/kvguard/lease: see docs/DESIGN.md#hops)",
        (false, Some(401)) => " (the filter's first key is not one of kvguard-control's keys)",
        (false, Some(404)) => " (kvguard-control runs --lease-mode off, or lease_path is wrong)",
        (false, Some(422)) => " (lease_renew_ms is over a third of kvguard-control's --lease-ttl)",
        (false, _) => "",
    };
    let what = if data {
        "in-band lease renewal"
    } else {
        "lease renewal"
    };
    p.log(Level::Warn, &format!("{what} failed: status {shown}{hint}"));
}

/// The renewal state of one worker VM; what the process shares lives in [`SharedData`].
#[derive(Debug, Default)]
pub struct Renewer {
    instance: Option<InstanceId>,
    host: Option<HostKey>,
    /// Renewals awaiting their answer, and whether each went in band.
    tokens: Vec<(u32, bool)>,
    /// Replicas this VM wrote to [`REPLICAS_KEY`], and when (a write at most once per
    /// period per replica).
    replicas_noted: Vec<(SocketAddr, u64)>,
    /// When this VM last noted an upstream (one sample per period).
    upstream_noted: Option<u64>,
    /// Whether the next tracked stream's upstream is to be noted.
    upstream_wanted: bool,
    /// Whether the last answer on each path (out of band, in band) was 200 (for the log).
    last_ok: [Option<bool>; 2],
    /// The last renewal counter this VM read or wrote (its proofs carry it).
    counter: Option<u64>,
    /// The gateway's listener as Envoy wrote it (`destination.address` of a tracked
    /// request, sampled once a period with the upstream).
    listener: Option<Vec<u8>>,
    /// The tag of this period: what it was made of, and the header value.
    tag: Option<(TagInputs, Vec<u8>)>,
}

/// What one [`INSTANCE_HEADER`](kvguard_contract::INSTANCE_HEADER) value is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TagInputs {
    instance: InstanceId,
    vm: Option<u32>,
    counter: u64,
}

impl Renewer {
    /// A renewer for the process on host `host` (`None`: the host key is unknown).
    pub fn new(host: Option<HostKey>) -> Renewer {
        Renewer {
            host,
            upstream_wanted: true,
            ..Renewer::default()
        }
    }

    /// The instance id this VM tags requests with.
    pub fn instance(&self) -> Option<InstanceId> {
        self.instance
    }

    /// Reads the process's instance id from shared data, creating it (`fresh()`) if
    /// absent. Called at configure and every tick: two VMs creating it at once both
    /// write, and each adopts the value that stayed by its next tick.
    pub fn sync_instance<H: SharedData + Platform + ?Sized>(
        &mut self,
        h: &mut H,
        fresh: &mut dyn FnMut() -> InstanceId,
    ) {
        let read = |h: &H| {
            h.shared_get(INSTANCE_KEY)
                .map(|v| v.and_then(|(v, _)| parse_instance_value(&v)))
        };
        match read(h) {
            Ok(Some(id)) => {
                self.instance = Some(id);
                return;
            }
            // Shared data unreadable: keep the id this VM has.
            Err(_) if self.instance.is_some() => return,
            _ => {}
        }
        let id = fresh();
        if h.shared_set(INSTANCE_KEY, &instance_value(id), 0).is_err() {
            h.add(Metric::HostErrors, 1);
            h.log(
                Level::Warn,
                "cannot write the lease instance id to shared data; this VM uses its own",
            );
            self.instance = Some(id);
            return;
        }
        h.log(
            Level::Info,
            &format!("lease instance id {id} created for this Envoy process"),
        );
        self.instance = read(h).ok().flatten().or(Some(id));
    }

    /// Whether this VM should note the upstream of a tracked stream now: once per period
    /// (reading the cluster name and the authority costs host calls), set by the tick.
    /// The gateway's listener is sampled with it.
    pub fn wants_upstream(&self) -> bool {
        self.upstream_wanted
    }

    /// Records the listener a tracked request arrived on (Envoy's `destination.address`,
    /// as written; kept only if it is short and plain, and the next tag carries it).
    pub fn note_listener(&mut self, addr: &[u8]) {
        if addr.len() > 64 || addr.contains(&b';') || self.listener.as_deref() == Some(addr) {
            return;
        }
        self.listener = Some(addr.to_vec());
        self.tag = None;
    }

    /// The `x-kvguard-instance` value for a tracked request of worker VM `vm`: the tag
    /// and its proof of life signed with `key` (contract §8). Made once per period (a new
    /// counter, or a new listener) and reused for every request until then. `None`
    /// without an instance id.
    pub fn tag_value(&mut self, key: &Key, vm: Option<u32>) -> Option<&[u8]> {
        let instance = self.instance?;
        // Before this VM's first tick: 0 (a new process's first counter; a reloaded VM's
        // first requests then prove nothing new until its tick reads the slot).
        let counter = self.counter.unwrap_or(0);
        let inputs = TagInputs {
            instance,
            vm,
            counter,
        };
        if self.tag.as_ref().map(|(i, _)| *i) != Some(inputs) {
            let tag = InstanceTag { instance, vm };
            let unsigned = unsigned_proof(tag, counter, self.host, self.listener.as_deref());
            self.tag = Some((inputs, sign_proof(key, unsigned)));
        }
        self.tag.as_ref().map(|(_, v)| v.as_slice())
    }

    /// Records the upstream cluster a tracked stream uses.
    pub fn note_upstream<H: SharedData + Platform + ?Sized>(
        &mut self,
        cfg: &Config,
        h: &mut H,
        up: &Upstream,
    ) {
        let now_ms = h.now_ms();
        self.upstream_noted = Some(now_ms);
        self.upstream_wanted = false;
        write_upstream(h, up, now_ms, cfg.lease_renew_ms);
    }

    /// Records a replica holding one of this process's streams (a verified stamp, or a
    /// stream still in flight there), at most once per period per replica.
    pub fn note_replica<H: SharedData + ?Sized>(
        &mut self,
        cfg: &Config,
        h: &mut H,
        addr: SocketAddr,
        now_ms: u64,
    ) {
        let period = cfg.lease_renew_ms;
        if period == 0
            || self
                .replicas_noted
                .iter()
                .any(|(a, t)| *a == addr && now_ms.saturating_sub(*t) < period)
        {
            return;
        }
        let (current, cas) = match h.shared_get(REPLICAS_KEY) {
            Ok(Some((v, cas))) => (Some(v), cas),
            Ok(None) => (None, 0),
            Err(_) => return,
        };
        if let Some(v) = remember(current.as_deref(), addr, now_ms, period) {
            if h.shared_set(REPLICAS_KEY, &v, cas).is_err() {
                // A lost race: noted again on the next stamp or tick.
                return;
            }
        }
        self.replicas_noted.retain(|(a, _)| *a != addr);
        self.replicas_noted.truncate(MAX_REPLICAS);
        self.replicas_noted.push((addr, now_ms));
    }

    /// One tick: re-reads the instance id, names the replicas of this VM's streams in
    /// flight (`in_flight`) and, while it has any stream (`busy`), the upstreams it
    /// noted, and, if this VM wins the period's slot, sends the period's renewal to every
    /// destination.
    pub fn on_tick<H: SharedData + Platform + ?Sized>(
        &mut self,
        cfg: &Config,
        h: &mut H,
        (in_flight, busy): (&[SocketAddr], bool),
        jitter: u64,
        fresh: &mut dyn FnMut() -> InstanceId,
    ) {
        let period = cfg.lease_renew_ms;
        if period == 0 {
            return;
        }
        let now = h.now_ms();
        self.upstream_wanted = self
            .upstream_noted
            .is_none_or(|t| now.saturating_sub(t) >= period);
        self.sync_instance(h, fresh);
        for addr in in_flight {
            self.note_replica(cfg, h, *addr, now);
        }
        // While streams run, every upstream remembered stays named (a long stream's path
        // keeps its in-band renewal with no new request to sample it).
        if busy {
            if let Ok(Some((v, cas))) = h.shared_get(UPSTREAMS_KEY) {
                let mut list = parse_upstreams(&v);
                if list.iter().any(|(_, t)| now.saturating_sub(*t) >= period) {
                    for e in &mut list {
                        e.1 = now;
                    }
                    let _ = h.shared_set(UPSTREAMS_KEY, &upstreams_value(&list), cas);
                }
            }
        }
        let (current, cas) = match h.shared_get(SLOT_KEY) {
            Ok(Some((v, cas))) => (Some(v), cas),
            Ok(None) => {
                // No slot yet. A write with cas 0 is unconditional, so two workers that
                // both found none would both "win" and send counter 1 twice: create the
                // slot (due now, nothing sent), and elect on the next tick under a real cas.
                let init = Slot {
                    due_ms: now,
                    counter: 0,
                };
                if h.shared_set(SLOT_KEY, &init.value(), 0).is_err() {
                    h.add(Metric::HostErrors, 1);
                }
                return;
            }
            Err(_) => {
                h.add(Metric::HostErrors, 1);
                return;
            }
        };
        if let Some(s) = current.as_deref().and_then(Slot::parse) {
            self.counter = Some(s.counter);
        }
        let Some(slot) = elect(current.as_deref(), now, period, jitter) else {
            return;
        };
        match h.shared_set(SLOT_KEY, &slot.value(), cas) {
            Ok(()) => self.counter = Some(slot.counter),
            // Another worker renews this period.
            Err(SharedError::CasMismatch) => return,
            Err(SharedError::Other) => {
                h.add(Metric::HostErrors, 1);
                return;
            }
        }
        let Some(instance) = self.instance else {
            return;
        };
        let replicas = match h.shared_get(REPLICAS_KEY) {
            Ok(v) => live_replicas(v.as_ref().map(|(v, _)| v.as_slice()), now, period),
            Err(_) => Vec::new(),
        };
        let upstreams = match h.shared_get(UPSTREAMS_KEY) {
            Ok(v) => live_upstreams(v.as_ref().map(|(v, _)| v.as_slice()), now, period),
            Err(_) => Vec::new(),
        };
        // The live worker VMs (kvguard-control ends the streams of one left out for its
        // TTL); none listed when the table is missing or unreadable.
        let vms = match h.shared_get(VMS_KEY) {
            Ok(Some((v, _))) => vms::live(&v, now, period),
            _ => None,
        };
        let dests = core::iter::once(Dest::Admin(None))
            .chain(
                replicas
                    .into_iter()
                    .filter(|_| cfg.target.is_some())
                    .map(|a| Dest::Admin(Some(a))),
            )
            .chain(upstreams.into_iter().map(Dest::Data));
        for dest in dests {
            if let Some(t) = send(
                cfg,
                h,
                (instance, vms.as_deref()),
                self.host,
                slot.counter,
                &dest,
            ) {
                if self.tokens.len() >= MAX_TOKENS {
                    self.tokens.remove(0);
                }
                self.tokens.push((t, matches!(dest, Dest::Data(_))));
            }
        }
    }

    /// An HTTP call's answer: `true` if it was one of this VM's renewals (counted and,
    /// when its path's answer changed, logged).
    pub fn on_answer<P: Platform + ?Sized>(
        &mut self,
        p: &mut P,
        token: u32,
        status: Option<u16>,
    ) -> bool {
        let Some(i) = self.tokens.iter().position(|(t, _)| *t == token) else {
            return false;
        };
        let (_, data) = self.tokens.remove(i);
        let last = &mut self.last_ok[usize::from(data)];
        on_answer(p, data, status, *last);
        *last = Some(status == Some(200));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{config, MockHost, Recorded};

    #[test]
    fn values_round_trip() {
        let id = InstanceId([9; 16]);
        assert_eq!(parse_instance_value(&instance_value(id)), Some(id));
        assert_eq!(parse_instance_value(b"v2:abc"), None);
        let s = Slot {
            due_ms: 12,
            counter: 3,
        };
        assert_eq!(Slot::parse(&s.value()), Some(s));
        assert_eq!(Slot::parse(b"v1:x:3"), None);
    }

    #[test]
    fn one_renewal_per_period_with_a_growing_counter() {
        let first = elect(None, 1000, 5000, 0).unwrap();
        assert_eq!(first.counter, 1);
        assert_eq!(first.due_ms, 6000);
        let v = first.value();
        assert_eq!(elect(Some(&v), 5999, 5000, 0), None);
        let second = elect(Some(&v), 6000, 5000, 700).unwrap();
        assert_eq!(second.counter, 2);
        assert_eq!(second.due_ms, 6000 + 5000 - 700);
        // Jitter stays below a fifth of the period.
        assert!(elect(None, 0, 5000, 123_456).unwrap().due_ms >= 4000);
        // A slot due implausibly far ahead is due now.
        let far = Slot {
            due_ms: 1_000_000,
            counter: 7,
        };
        assert_eq!(elect(Some(&far.value()), 10, 5000, 0).unwrap().counter, 8);
        assert_eq!(elect(Some(b"garbage"), 10, 5000, 0).unwrap().counter, 1);
    }

    #[test]
    fn replicas_are_remembered_bounded_and_forgotten() {
        let a: SocketAddr = "10.0.0.1:9902".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:9902".parse().unwrap();
        let v = remember(None, a, 1000, 5000).unwrap();
        assert_eq!(live_replicas(Some(&v), 1000, 5000), vec![a]);
        // Named again within a period: nothing to write.
        assert_eq!(remember(Some(&v), a, 5999, 5000), None);
        let v = remember(Some(&v), b, 2000, 5000).unwrap();
        let mut live = live_replicas(Some(&v), 2000, 5000);
        live.sort();
        assert_eq!(live, vec![a, b]);
        // Unnamed for FORGET_PERIODS periods: forgotten.
        let late = 1000 + 5000 * FORGET_PERIODS + 1;
        assert_eq!(live_replicas(Some(&v), late, 5000), vec![b]);
        // Bounded: the longest unseen goes.
        let mut v = Vec::new();
        for i in 0..(MAX_REPLICAS as u64 + 4) {
            let addr: SocketAddr = format!("10.0.1.{i}:9902").parse().unwrap();
            v = remember(Some(&v), addr, 10 + i, 5000).unwrap();
        }
        let live = live_replicas(Some(&v), 100, 5000);
        assert_eq!(live.len(), MAX_REPLICAS);
        assert!(!live.contains(&"10.0.1.0:9902".parse().unwrap()));
        assert!(parse_replicas(b"v1:garbage,10.0.0.1:1@x").is_empty());
    }

    #[test]
    fn the_replicas_value_lists_each_address_with_when_it_was_named() {
        let a: SocketAddr = "10.0.0.1:9902".parse().unwrap();
        let b: SocketAddr = "[fd00::2]:9902".parse().unwrap();
        let v = replicas_value(&[(a, 1), (b, 2)]);
        assert_eq!(v, b"v1:10.0.0.1:9902@1,[fd00::2]:9902@2");
        assert_eq!(parse_replicas(&v), vec![(a, 1), (b, 2)]);
        assert_eq!(replicas_value(&[]), b"v1:");
        assert!(parse_replicas(b"v1:").is_empty());
        assert!(parse_replicas(b"v2:10.0.0.1:9902@1").is_empty());
    }

    #[test]
    fn a_replica_is_remembered_for_exactly_forget_periods() {
        let a: SocketAddr = "10.0.0.1:9902".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:9902".parse().unwrap();
        let horizon = 5000 * FORGET_PERIODS;
        let v = remember(None, a, 1000, 5000).unwrap();
        assert_eq!(live_replicas(Some(&v), 1000 + horizon, 5000), vec![a]);
        assert!(live_replicas(Some(&v), 1001 + horizon, 5000).is_empty());
        // Naming another replica keeps it up to the horizon, and drops it past it.
        let kept = remember(Some(&v), b, 1000 + horizon, 5000).unwrap();
        assert_eq!(parse_replicas(&kept).len(), 2);
        let dropped = remember(Some(&v), b, 1001 + horizon, 5000).unwrap();
        assert_eq!(parse_replicas(&dropped), vec![(b, 1001 + horizon)]);
    }

    #[test]
    fn a_replica_named_again_a_period_later_is_written_again() {
        let a: SocketAddr = "10.0.0.1:9902".parse().unwrap();
        let v = remember(None, a, 1000, 5000).unwrap();
        assert_eq!(remember(Some(&v), a, 5999, 5000), None);
        let again = remember(Some(&v), a, 6000, 5000).unwrap();
        assert_eq!(parse_replicas(&again), vec![(a, 6000)]);
    }

    #[test]
    fn a_slot_due_within_two_periods_is_trusted() {
        let slot = |due_ms| Slot { due_ms, counter: 7 }.value();
        assert_eq!(elect(Some(&slot(10 + 7_500)), 10, 5000, 0), None);
        assert_eq!(elect(Some(&slot(10 + 10_000)), 10, 5000, 0), None);
        assert_eq!(
            elect(Some(&slot(10 + 10_001)), 10, 5000, 0).map(|s| s.counter),
            Some(8)
        );
    }

    const P: u64 = 5000;

    fn lease_config(extra: &str) -> Config {
        config(&format!(r#","lease_renew_ms":{P}{extra}"#))
    }

    const TARGET: &str = r#","control_target_cluster":"t","control_target_cidrs":["10.0.0.0/8"]"#;

    fn ids() -> impl FnMut() -> InstanceId {
        let mut n = 0u8;
        move || {
            n += 1;
            InstanceId([n; 16])
        }
    }

    fn up(cluster: &str) -> Upstream {
        Upstream {
            cluster: cluster.to_owned(),
            authority: "llm.example".to_owned(),
        }
    }

    fn header<'a>(call: &'a Recorded, name: &str) -> Option<&'a str> {
        call.2
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Ticks `r` until it sends (the first tick creates the slot); returns the calls sent.
    fn renew_once(
        r: &mut Renewer,
        cfg: &Config,
        h: &mut MockHost,
        in_flight: &[SocketAddr],
    ) -> Vec<Recorded> {
        let before = h.calls.len();
        let mut fresh = ids();
        r.on_tick(cfg, h, (in_flight, false), 0, &mut fresh);
        if h.calls.len() == before {
            r.on_tick(cfg, h, (in_flight, false), 0, &mut fresh);
        }
        h.calls[before..].to_vec()
    }

    #[test]
    fn a_period_renews_control_cluster_each_replica_in_flight_and_each_upstream_in_band() {
        let cfg = lease_config(TARGET);
        let host = HostKey([7; 16]);
        let mut h = MockHost {
            now: 1_000,
            unix: 1_800_000_000,
            ..MockHost::default()
        };
        let mut r = Renewer::new(Some(host));
        assert!(r.wants_upstream(), "the first stream's upstream is noted");
        r.on_tick(&cfg, &mut h, (&[], false), 0, &mut ids());
        assert!(r.wants_upstream());
        r.note_upstream(&cfg, &mut h, &up("outbound|8000||vllm"));
        assert!(!r.wants_upstream());
        h.now = 1_000 + P - 1;
        r.on_tick(&cfg, &mut h, (&[], false), 0, &mut ids());
        assert!(!r.wants_upstream());
        h.now = 1_000 + P;
        r.on_tick(&cfg, &mut h, (&[], false), 0, &mut ids());
        assert!(r.wants_upstream(), "a period later");
        h.now = 1_000 + 3 * P;
        let sent_before = h.calls.len();
        assert_eq!(
            sent_before, 2,
            "the first period: control_cluster and in band"
        );
        let replica: SocketAddr = "10.1.2.3:9902".parse().unwrap();
        let calls = renew_once(&mut r, &cfg, &mut h, &[replica]);
        assert_eq!(calls.len(), 3, "{calls:?}");
        let instance = r.instance().unwrap();
        let parsed: Vec<_> = calls
            .iter()
            .map(|c| Renewal::parse(&c.3).unwrap())
            .collect();
        for (c, b) in calls.iter().zip(&parsed) {
            assert_eq!(
                (b.instance, b.counter, b.host, b.period_ms),
                (instance, 2, Some(host), Some(P))
            );
            let sig = header(c, signature::SIGNATURE_HEADER).unwrap();
            assert!(signature::verify_any_time(
                Domain::Renewal,
                std::slice::from_ref(&cfg.key),
                Some(sig.as_bytes()),
                &c.3
            )
            .is_ok());
            assert_eq!(header(c, ":method"), Some("POST"));
        }
        // control_cluster: not forwarded to peers (every replica is renewed directly).
        assert_eq!(calls[0].1, "kvguard");
        assert_eq!(header(&calls[0], ":path"), Some("/v1/lease"));
        assert_eq!((parsed[0].via, parsed[0].fanout), (Via::Admin, false));
        // The replica, through the target cluster.
        assert_eq!(calls[1].1, "t");
        assert_eq!(
            header(&calls[1], ORIGINAL_DST_HEADER),
            Some("10.1.2.3:9902")
        );
        assert_eq!((parsed[1].via, parsed[1].fanout), (Via::Admin, false));
        // In band, over the upstream cluster, with its authority; forwarded to peers.
        assert_eq!(calls[2].1, "outbound|8000||vllm");
        assert_eq!(header(&calls[2], ":path"), Some(DATA_LEASE_PATH));
        assert_eq!(header(&calls[2], ":authority"), Some("llm.example"));
        assert_eq!((parsed[2].via, parsed[2].fanout), (Via::Data, true));
        // Both periods' renewals counted.
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Sent)), 3);
        assert_eq!(h.metric(Metric::LeaseDataRenewals(LeaseResult::Sent)), 2);
    }

    #[test]
    fn without_a_target_route_control_cluster_forwards_to_peers_and_no_replica_is_named() {
        let cfg = lease_config("");
        let mut h = MockHost::default();
        let mut r = Renewer::new(None);
        let calls = renew_once(&mut r, &cfg, &mut h, &["10.1.2.3:9902".parse().unwrap()]);
        assert_eq!(calls.len(), 1);
        let b = Renewal::parse(&calls[0].3).unwrap();
        assert_eq!(
            (b.via, b.fanout, b.host, b.period_ms),
            (Via::Admin, true, None, Some(P))
        );
        assert!(send(
            &cfg,
            &mut h,
            (InstanceId([1; 16]), None),
            None,
            2,
            &Dest::Admin(Some("10.0.0.1:1".parse().unwrap()))
        )
        .is_none());
    }

    #[test]
    fn one_vm_renews_per_period_and_vms_agree_on_one_instance_id() {
        let cfg = lease_config("");
        let mut h = MockHost::default();
        let (mut a, mut b) = (Renewer::new(None), Renewer::new(None));
        // Both VMs configure at once: each draws and writes its own id.
        a.sync_instance(&mut h, &mut || InstanceId([1; 16]));
        h.shared.remove(INSTANCE_KEY);
        b.sync_instance(&mut h, &mut || InstanceId([2; 16]));
        assert_ne!(a.instance(), b.instance());
        let mut never = || -> InstanceId { panic!("an id exists: nothing to draw") };
        for t in 0..10u64 {
            h.now = t * P;
            a.on_tick(&cfg, &mut h, (&[], false), 0, &mut never);
            b.on_tick(&cfg, &mut h, (&[], false), 0, &mut never);
            // By the first tick both tag with the id that stayed.
            assert_eq!(a.instance(), Some(InstanceId([2; 16])));
            assert_eq!(b.instance(), a.instance());
        }
        // The first tick's first VM creates the slot, the second renews; then one renewal
        // per period, counters 1, 2, ...
        let counters: Vec<u64> = h
            .calls
            .iter()
            .map(|c| Renewal::parse(&c.3).unwrap().counter)
            .collect();
        assert_eq!(counters, (1..=10).collect::<Vec<_>>());
    }

    #[test]
    fn a_replica_with_a_stream_in_flight_is_renewed_whatever_its_answers_and_forgotten_after_without(
    ) {
        let cfg = lease_config(TARGET);
        let mut h = MockHost::default();
        let mut r = Renewer::new(None);
        let replica: SocketAddr = "10.1.2.3:9902".parse().unwrap();
        let mut fresh = ids();
        let to_replica =
            |h: &MockHost, from: usize| h.calls[from..].iter().filter(|c| c.1 == "t").count();
        // A long stream there: renewed every period for far longer than FORGET_PERIODS,
        // even though the replica refuses every renewal.
        for k in 0..(3 * FORGET_PERIODS) {
            h.now = k * P;
            let before = h.calls.len();
            r.on_tick(&cfg, &mut h, (&[replica], false), 0, &mut fresh);
            if k > 0 {
                assert_eq!(to_replica(&h, before), 1, "period {k}");
            }
            let sent: Vec<u32> = h.calls[before..].iter().map(|c| c.0).collect();
            for t in sent {
                assert!(r.on_answer(&mut h, t, Some(503)));
            }
        }
        // The stream ends: still renewed for FORGET_PERIODS periods, then forgotten.
        let end = 3 * FORGET_PERIODS * P;
        let mut renewed = 0;
        for k in 0..(2 * FORGET_PERIODS) {
            h.now = end + k * P;
            let before = h.calls.len();
            r.on_tick(&cfg, &mut h, (&[], false), 0, &mut fresh);
            renewed += to_replica(&h, before);
        }
        assert_eq!(renewed as u64, FORGET_PERIODS);
    }

    #[test]
    fn answers_of_overlapping_renewals_are_all_counted_and_a_failure_is_logged_once() {
        let cfg = lease_config("");
        let mut h = MockHost::default();
        let mut r = Renewer::new(None);
        r.note_upstream(&cfg, &mut h, &up("llm"));
        let first = renew_once(&mut r, &cfg, &mut h, &[]);
        h.now += P;
        let second = renew_once(&mut r, &cfg, &mut h, &[]);
        assert_eq!((first.len(), second.len()), (2, 2));
        // The second period's calls went out before the first's were answered.
        for c in first.iter().chain(&second) {
            let status = if c.1 == "llm" { Some(404) } else { Some(200) };
            assert!(r.on_answer(&mut h, c.0, status));
        }
        assert!(!r.on_answer(&mut h, first[0].0, Some(200)), "answered once");
        assert!(!r.on_answer(&mut h, 999, Some(200)), "not a renewal");
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Accepted)), 2);
        assert_eq!(h.metric(Metric::LeaseDataRenewals(LeaseResult::Failed)), 2);
        let warned: Vec<_> = h.logs.iter().filter(|(l, _)| *l == Level::Warn).collect();
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(warned[0]
            .1
            .contains("in-band lease renewal failed: status 404"));
        assert!(warned[0].1.contains("docs/DESIGN.md#hops"));
    }

    #[test]
    fn a_failed_renewal_says_why_when_its_answer_changes() {
        let cfg = lease_config("");
        let mut h = MockHost::default();
        let mut r = Renewer::new(None);
        let mut answer = |h: &mut MockHost, status: Option<u16>| {
            let c = renew_once(&mut r, &cfg, h, &[]);
            h.now += P;
            r.on_answer(h, c[0].0, status);
        };
        for s in [
            Some(401),
            Some(401),
            Some(200),
            Some(404),
            Some(422),
            Some(500),
            None,
        ] {
            answer(&mut h, s);
        }
        let logs: Vec<&str> = h
            .logs
            .iter()
            .filter(|(l, _)| *l == Level::Warn)
            .map(|(_, m)| m.as_str())
            .collect();
        assert_eq!(logs.len(), 2, "{logs:?}");
        assert!(logs[0].contains("status 401") && logs[0].contains("first key"));
        assert!(logs[1].contains("status 404") && logs[1].contains("--lease-mode off"));
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Failed)), 6);
        // Each hint, whatever came before.
        let mut h = MockHost::default();
        for (s, hint) in [
            (Some(422), "over a third"),
            (Some(500), "status 500"),
            (None, "none (timeout or reset)"),
        ] {
            on_answer(&mut h, false, s, None);
            assert!(h.logs.last().unwrap().1.contains(hint), "{:?}", h.logs);
        }
    }

    #[test]
    fn a_renewal_the_host_refuses_is_counted_and_logged() {
        let cfg = lease_config("");
        let mut h = MockHost {
            refuse: Some(crate::host::DispatchError::Other),
            ..MockHost::default()
        };
        assert_eq!(
            send(
                &cfg,
                &mut h,
                (InstanceId([1; 16]), None),
                None,
                4,
                &Dest::Admin(None)
            ),
            None
        );
        assert_eq!(
            send(
                &cfg,
                &mut h,
                (InstanceId([1; 16]), None),
                None,
                4,
                &Dest::Data(up("llm"))
            ),
            None
        );
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Failed)), 1);
        assert_eq!(h.metric(Metric::LeaseDataRenewals(LeaseResult::Failed)), 1);
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Sent)), 0);
        assert!(h
            .logs
            .iter()
            .any(|(l, m)| *l == Level::Warn && m.contains("counter=4 not sent to kvguard")));
    }

    #[test]
    fn shared_data_that_fails_is_counted_and_nothing_is_sent() {
        let cfg = lease_config("");
        let mut h = MockHost {
            shared_broken: true,
            ..MockHost::default()
        };
        let mut r = Renewer::new(None);
        let mut fresh = ids();
        r.on_tick(&cfg, &mut h, (&[], false), 0, &mut fresh);
        r.on_tick(&cfg, &mut h, (&[], false), 0, &mut fresh);
        assert!(h.calls.is_empty());
        assert!(h.metric(Metric::HostErrors) >= 2);
        // Its own id, still: requests are tagged.
        assert_eq!(r.instance(), Some(InstanceId([1; 16])));
        // Lease off: nothing at all.
        let mut h = MockHost::default();
        r.on_tick(
            &config(r#","lease_renew_ms":0"#),
            &mut h,
            (&[], false),
            0,
            &mut fresh,
        );
        assert!(h.shared.is_empty());
        assert!(!Renewer::default().wants_upstream());
    }

    #[test]
    fn a_vm_with_streams_in_flight_keeps_its_upstreams_renewed_in_band() {
        let cfg = lease_config("");
        let mut h = MockHost::default();
        let mut r = Renewer::new(None);
        r.note_upstream(&cfg, &mut h, &up("llm"));
        let mut fresh = ids();
        let in_band =
            |h: &MockHost, from: usize| h.calls[from..].iter().filter(|c| c.1 == "llm").count();
        // A long stream and no new request: renewed in band every period, far past
        // FORGET_PERIODS.
        for k in 0..(3 * FORGET_PERIODS) {
            h.now = k * P;
            let before = h.calls.len();
            r.on_tick(&cfg, &mut h, (&[], true), 0, &mut fresh);
            if k > 0 {
                assert_eq!(in_band(&h, before), 1, "period {k}");
            }
        }
        // Nothing in flight: forgotten FORGET_PERIODS periods later.
        let end = 3 * FORGET_PERIODS * P;
        let mut renewed = 0;
        for k in 0..(2 * FORGET_PERIODS) {
            h.now = end + k * P;
            let before = h.calls.len();
            r.on_tick(&cfg, &mut h, (&[], false), 0, &mut fresh);
            renewed += in_band(&h, before);
        }
        assert!(
            (FORGET_PERIODS..=FORGET_PERIODS + 1).contains(&(renewed as u64)),
            "{renewed}"
        );
    }

    #[test]
    fn a_vm_writes_a_replica_at_most_once_a_period_and_each_replica_apart() {
        let cfg = lease_config("");
        let mut h = MockHost::default();
        let mut r = Renewer::new(None);
        let (a, b): (SocketAddr, SocketAddr) = (
            "10.0.0.1:9902".parse().unwrap(),
            "10.0.0.2:9902".parse().unwrap(),
        );
        let version = |h: &MockHost| h.shared.get(REPLICAS_KEY).map_or(0, |(_, cas)| *cas);
        r.note_replica(&cfg, &mut h, a, 1000);
        assert_eq!(version(&h), 1);
        // Within the period: no shared-data write at all.
        r.note_replica(&cfg, &mut h, a, 1000 + P - 1);
        assert_eq!(version(&h), 1);
        // Another replica is written at once.
        r.note_replica(&cfg, &mut h, b, 1000 + P - 1);
        assert_eq!(version(&h), 2);
        // Noting either again within its period costs no shared-data call at all.
        let reads = h.shared_reads.get();
        r.note_replica(&cfg, &mut h, a, 1000 + P - 1);
        r.note_replica(&cfg, &mut h, b, 1000 + P - 1);
        assert_eq!(
            h.shared_reads.get(),
            reads,
            "no host call within the period"
        );
        let mut live = live_replicas(
            h.shared.get(REPLICAS_KEY).map(|(v, _)| v.as_slice()),
            1000 + P,
            P,
        );
        live.sort();
        assert_eq!(live, vec![a, b]);
        // A period later: written again, once.
        r.note_replica(&cfg, &mut h, a, 1000 + P);
        assert_eq!(version(&h), 3);
        r.note_replica(&cfg, &mut h, a, 1000 + P + 1);
        assert_eq!(version(&h), 3);
        assert_eq!(r.replicas_noted.iter().filter(|(x, _)| *x == a).count(), 1);
        // Lease off: nothing.
        r.note_replica(
            &config(r#","lease_renew_ms":0"#),
            &mut h,
            "10.0.0.3:9902".parse().unwrap(),
            99_999,
        );
        assert_eq!(version(&h), 3);
    }

    #[test]
    fn an_upstream_is_written_again_exactly_a_period_later_and_others_beside_it() {
        let v = remember_upstream(None, &up("a"), 1000, P).unwrap();
        assert_eq!(remember_upstream(Some(&v), &up("a"), 1000 + P - 1, P), None);
        let again = remember_upstream(Some(&v), &up("a"), 1000 + P, P).unwrap();
        assert_eq!(parse_upstreams(&again), vec![(up("a"), 1000 + P)]);
        // Another upstream named at the same instant is added, not skipped.
        let both = remember_upstream(Some(&v), &up("b"), 1000, P).unwrap();
        assert_eq!(
            parse_upstreams(&both),
            vec![(up("b"), 1000), (up("a"), 1000)]
        );
        // The same cluster under another authority is another upstream.
        let other = Upstream {
            cluster: "a".to_owned(),
            authority: "other.example".to_owned(),
        };
        assert!(remember_upstream(Some(&v), &other, 1000, P).is_some());
    }

    #[test]
    fn upstreams_are_remembered_bounded_and_forgotten() {
        let v = remember_upstream(None, &up("a"), 1000, P).unwrap();
        assert_eq!(live_upstreams(Some(&v), 1000, P), vec![up("a")]);
        assert_eq!(remember_upstream(Some(&v), &up("a"), 1000 + P - 1, P), None);
        let mut v = v;
        for (i, c) in ["b", "c", "d", "e"].iter().enumerate() {
            v = remember_upstream(Some(&v), &up(c), 2000 + i as u64, P).unwrap();
        }
        let live = live_upstreams(Some(&v), 3000, P);
        assert_eq!(live.len(), MAX_UPSTREAMS);
        assert!(!live.contains(&up("a")), "the longest unseen goes first");
        let late = 2003 + P * FORGET_PERIODS;
        assert_eq!(live_upstreams(Some(&v), late, P), vec![up("e")]);
        assert!(live_upstreams(Some(&v), late + 1, P).is_empty());
        // Names that cannot be stored are not.
        let bad = Upstream {
            cluster: "a\tb".to_owned(),
            authority: "x".to_owned(),
        };
        assert_eq!(remember_upstream(None, &bad, 0, P), None);
        assert!(parse_upstreams(b"v1\n1\ta\nx\ta\tb\n").is_empty());
        assert!(parse_upstreams(b"v2\n1\ta\tb\n").is_empty());
    }

    #[test]
    fn each_renewal_lists_the_live_vms_and_leaves_a_silent_one_out() {
        let cfg = lease_config("");
        let mut h = MockHost::default();
        // Without a VM table: no list (kvguard-control judges no VM).
        let mut r = Renewer::new(None);
        let first = renew_once(&mut r, &cfg, &mut h, &[]);
        assert_eq!(Renewal::parse(&first[0].3).unwrap().vms, None);
        let (mut a, mut b) = (vms::Member::default(), vms::Member::default());
        a.join(&mut h, P);
        b.join(&mut h, P);
        let listed = |h: &mut MockHost, r: &mut Renewer| {
            h.now += P;
            let c = renew_once(r, &cfg, h, &[]);
            let mut v = Renewal::parse(&c[0].3).unwrap().vms.unwrap();
            v.sort();
            v
        };
        assert_eq!(listed(&mut h, &mut r), vec![1, 2]);
        // b (seen at 0) falls silent; a beats every period.
        while h.now + P <= vms::SILENT_PERIODS * P {
            let now = h.now;
            a.settle(&mut h, now, [0; 3]);
            assert_eq!(listed(&mut h, &mut r), vec![1, 2]);
        }
        let now = h.now;
        a.settle(&mut h, now, [0; 3]);
        assert_eq!(listed(&mut h, &mut r), vec![1]);
    }

    fn proof_of(v: &[u8], key: &Key) -> (InstanceTag, kvguard_contract::Proof) {
        let h = kvguard_contract::TagHeader::parse(v)
            .unwrap_or_else(|| panic!("{}", String::from_utf8_lossy(v)));
        let p = h.proof.unwrap();
        assert!(
            p.verify(std::slice::from_ref(key)),
            "signed with the first key"
        );
        (h.tag, p.proof)
    }

    #[test]
    fn every_tracked_request_carries_the_periods_signed_proof_made_once_per_counter() {
        let cfg = lease_config("");
        let host = HostKey([7; 16]);
        let mut h = MockHost::default();
        let mut r = Renewer::new(Some(host));
        assert_eq!(r.tag_value(&cfg.key, Some(1)), None, "no instance id yet");
        r.sync_instance(&mut h, &mut ids());
        let id = r.instance().unwrap();
        // Before this VM's first tick: counter 0.
        let first = r.tag_value(&cfg.key, Some(2)).unwrap().to_vec();
        let (tag, proof) = proof_of(&first, &cfg.key);
        assert_eq!(
            tag,
            InstanceTag {
                instance: id,
                vm: Some(2)
            }
        );
        assert_eq!(
            proof,
            kvguard_contract::Proof {
                counter: 0,
                host: Some(host),
                listener: None
            }
        );
        // The listener sampled with the upstream joins the proof; one that is long or
        // would add a field is not kept.
        r.note_listener(b"10.1.2.3:8080");
        let v = r.tag_value(&cfg.key, Some(2)).unwrap().to_vec();
        let addr: SocketAddr = "10.1.2.3:8080".parse().unwrap();
        assert_eq!(proof_of(&v, &cfg.key).1.listener, Some(addr));
        r.note_listener(b"10.1.2.3:8080;c=9");
        r.note_listener(&[b'1'; 65]);
        assert_eq!(r.tag_value(&cfg.key, Some(2)).unwrap(), &v[..]);
        let longest = "x".repeat(64);
        r.note_listener(longest.as_bytes());
        let v = r.tag_value(&cfg.key, Some(2)).unwrap().to_vec();
        let (_, p) = proof_of(&v, &cfg.key);
        assert_eq!(p.listener, None, "kept, but not an address: none");
        assert!(String::from_utf8(v).unwrap().contains(&longest));
        r.note_listener(b"10.1.2.3:8080");
        // A tick that renews carries the new counter into the proofs.
        let sent = renew_once(&mut r, &cfg, &mut h, &[]);
        let renewed = Renewal::parse(&sent[0].3).unwrap().counter;
        assert!(renewed > 0);
        let v = r.tag_value(&cfg.key, Some(2)).unwrap().to_vec();
        assert_eq!(proof_of(&v, &cfg.key).1.counter, renewed);
        // Until the counter changes, every request carries the same value.
        assert_eq!(r.tag_value(&cfg.key, Some(2)).unwrap(), &v[..]);
        // Another VM's tag is its own.
        let other = r.tag_value(&cfg.key, Some(3)).unwrap().to_vec();
        assert_eq!(proof_of(&other, &cfg.key).0.vm, Some(3));
        // A VM that loses the period's election reads the winner's counter.
        let mut loser = Renewer::new(Some(host));
        loser.sync_instance(&mut h, &mut ids());
        h.now += 1;
        loser.on_tick(&cfg, &mut h, (&[], false), 0, &mut ids());
        let v = loser.tag_value(&cfg.key, Some(4)).unwrap().to_vec();
        assert_eq!(proof_of(&v, &cfg.key).1.counter, renewed);
    }
}
