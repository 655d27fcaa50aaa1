//! A gateway: one Envoy process running the REAL filter core ([`Engine`]) and its REAL
//! lease renewer ([`Renewer`]) behind a simulated host ([`SimHost`]): virtual clock,
//! shared data, and HTTP calls collected for the world to deliver. Each process runs
//! one worker VM per Envoy worker ([`Vm`]: engine, renewer, VM-table member), sharing
//! the process's shared data; a hot restart's parent drains beside its child
//! ([`Gateway::parent`]).
//!
//! How Envoy's callbacks map onto the core is `filter/plugin` (`on_tick`: the renewer's
//! tick, then the engine's; `on_http_call_response`: the renewer's answer first, else
//! the abort queue's; request headers tag the request with the instance and sample the
//! upstream for the in-band renewal).

use kvguard_contract::{HostKey, InstanceId};
use kvguard_filter_core::config::Config;
use kvguard_filter_core::host::{Call, Clock, DispatchError, Host, Level, SharedData, SharedError};
use kvguard_filter_core::lease::Renewer;
use kvguard_filter_core::metrics::{Metric, Metrics};
use kvguard_filter_core::vms;
use kvguard_filter_core::Engine;
use std::collections::BTreeMap;

/// The secret the gateways sign with (every replica's key).
pub const SECRET: &str = "kvguard-sim-secret-0123456789abcdef";

/// The wall clock's Unix seconds at virtual time 0 (every process's, unless stepped).
pub const UNIX_AT_ZERO: u64 = 1_700_000_000;

/// An HTTP call the filter dispatched, waiting for the world to deliver it.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// Its token.
    pub token: u32,
    /// The Envoy cluster it was sent to.
    pub cluster: String,
    /// Its `:path`.
    pub path: String,
    /// Its body.
    pub body: Vec<u8>,
    /// Its `x-kvguard-signature`.
    pub signature: Option<String>,
    /// Envoy's timeout for it.
    pub timeout_ms: u64,
}

/// The proxy-wasm host as the filter core sees it.
#[derive(Debug, Default)]
pub struct SimHost {
    /// Virtual monotonic ms.
    pub now: u64,
    /// How far the wall clock was stepped ([`crate::schedule::Op::ClockStep`]), seconds.
    pub wall_step_s: i64,
    next_token: u32,
    /// Calls dispatched since the world last took them.
    pub outbox: Vec<Outgoing>,
    /// Log lines at info or above since the world last took them.
    pub logs: Vec<String>,
    shared: BTreeMap<String, (Vec<u8>, u32)>,
    /// The VM calling into the host now.
    pub vm: usize,
    /// The VM that dispatched each call awaiting its answer (Envoy answers the root
    /// context that dispatched it).
    token_vm: BTreeMap<u32, usize>,
}

impl Clock for SimHost {
    fn now_ms(&self) -> u64 {
        self.now
    }
    fn unix_secs(&self) -> u64 {
        (UNIX_AT_ZERO + self.now / 1000).saturating_add_signed(self.wall_step_s)
    }
}

impl Host for SimHost {
    fn dispatch(&mut self, call: &Call<'_>) -> Result<u32, DispatchError> {
        self.next_token += 1;
        self.token_vm.insert(self.next_token, self.vm);
        let path = call
            .headers
            .iter()
            .find(|(k, _)| *k == ":path")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        let signature = call
            .headers
            .iter()
            .find(|(k, _)| *k == kvguard_contract::SIGNATURE_HEADER)
            .map(|(_, v)| v.clone());
        self.outbox.push(Outgoing {
            token: self.next_token,
            cluster: call.cluster.to_owned(),
            path,
            body: call.body.clone(),
            signature,
            timeout_ms: call.timeout_ms,
        });
        Ok(self.next_token)
    }
    fn log(&mut self, level: Level, msg: &str) {
        if level >= Level::Info {
            self.logs.push(msg.to_owned());
        }
    }
    fn log_enabled(&self, level: Level) -> bool {
        level >= Level::Info
    }
    /// Every simulated request is routed to the hop (an upstream was reached).
    fn upstream_reached(&mut self) -> bool {
        true
    }
}

impl SharedData for SimHost {
    fn shared_get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, SharedError> {
        Ok(self.shared.get(key).cloned())
    }
    fn shared_set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), SharedError> {
        // Envoy's rule: an absent key is written whatever `cas` says.
        let e = self.shared.entry(key.to_owned()).or_insert((Vec::new(), 0));
        if cas != 0 && e.1 != 0 && cas != e.1 {
            return Err(SharedError::CasMismatch);
        }
        *e = (value.to_vec(), e.1 + 1);
        Ok(())
    }
}

impl Metrics for SimHost {
    fn add(&mut self, _: Metric, _: i64) {}
    fn record(&mut self, _: Metric, _: u64) {}
}

/// The filter configuration of every gateway: the shipped defaults but the route idle
/// timeout (`idle_ms`), `control_cluster: "kvguard"`, no per-replica target (aborts go
/// to the control cluster, which balances them over the replicas).
pub fn config(idle_ms: u64) -> Option<Config> {
    let json = format!(
        r#"{{"control_cluster":"kvguard","secret":"{SECRET}","idle_timeout_ms":{idle_ms}}}"#
    );
    Config::parse(json.as_bytes(), &|_| None).ok()
}

/// A fresh process of gateway `index` as `setup` has it: its worker VMs, and its host
/// key (the node's, or the one every gateway shares).
pub fn process(
    setup: &crate::schedule::Setup,
    cfg: Config,
    index: u8,
    generation: u32,
    seed: u64,
    now: u64,
) -> Gateway {
    let key = HostKey([if setup.shared_host_key { 0 } else { index }; 16]);
    Gateway::start(cfg, (index, key), generation, seed, now, setup.vms)
}

/// Gateway `index`'s listener as Envoy names it (`destination.address`): the same across
/// its restarts, as a node's address is.
pub fn listener(index: u8) -> String {
    format!("10.0.0.{index}:8080")
}

/// The gateway whose listener is `addr` ([`listener`]).
pub fn listening(addr: std::net::SocketAddr) -> Option<u8> {
    match addr {
        std::net::SocketAddr::V4(a) if a.port() == 8080 => Some(a.ip().octets()[3]),
        _ => None,
    }
}

/// One worker VM of a gateway process (Envoy `--concurrency N` runs N): the filter's
/// engine, its lease renewer and its entry in the process's VM table, as
/// `filter/plugin`'s per-VM `Shared` holds them.
#[derive(Debug)]
pub struct Vm {
    /// The filter's per-VM engine.
    pub engine: Engine,
    /// This VM's side of the lease.
    pub renewer: Renewer,
    /// Its entry in the VM table (`kvguard.vms.v1`).
    pub member: vms::Member,
    /// It trapped: nothing more runs in it (Envoy cuts its streams at their next
    /// callback).
    pub trapped: bool,
}

/// One gateway process (its state is lost with it: a restart starts a new one).
#[derive(Debug)]
pub struct Gateway {
    /// Its worker VMs.
    pub vms: Vec<Vm>,
    /// Its host (shared data is the process's: every VM reads and writes it).
    pub host: SimHost,
    /// Running (not killed).
    pub alive: bool,
    /// SIGSTOPped until then (virtual ms).
    pub frozen_until: u64,
    /// Which process this is (a call answered to an older one is dropped).
    pub generation: u32,
    /// Its instance-id source.
    ids: crate::rng::Rng,
    /// The VM each stream context runs on.
    ctx_vm: BTreeMap<u32, usize>,
    /// A hot restart's parent, draining its open streams, and when it exits.
    pub parent: Option<(Box<Gateway>, u64)>,
}

impl Gateway {
    /// A fresh process of gateway `index` with host key `key` (the node's: the same
    /// across restarts) and `vms` worker VMs, started at `now`. Each VM configures as
    /// `Root::on_configure` does: it joins the VM table, then reads (or creates) the
    /// process's instance id.
    pub fn start(
        cfg: Config,
        (index, key): (u8, HostKey),
        generation: u32,
        seed: u64,
        now: u64,
        vms: u8,
    ) -> Gateway {
        let mut host = SimHost {
            now,
            ..SimHost::default()
        };
        let mut ids = crate::rng::Rng::new(seed ^ (u64::from(index) << 32) ^ u64::from(generation));
        let period = cfg.lease_renew_ms;
        let vms = (0..u64::from(vms.max(1)))
            .map(|k| {
                host.vm = k as usize;
                let mut engine = Engine::new(cfg.clone(), seed ^ u64::from(generation) ^ (k << 40));
                engine.keep_ticking(true);
                let mut member = vms::Member::default();
                member.join(&mut host, period);
                let mut renewer = Renewer::new(Some(key));
                let mut fresh = || fresh_id(&mut ids);
                renewer.sync_instance(&mut host, &mut fresh);
                Vm {
                    engine,
                    renewer,
                    member,
                    trapped: false,
                }
            })
            .collect();
        Gateway {
            vms,
            host,
            alive: true,
            frozen_until: 0,
            generation,
            ids,
            ctx_vm: BTreeMap::new(),
            parent: None,
        }
    }

    /// Whether it runs at `now` (alive and not stopped).
    pub fn runs(&self, now: u64) -> bool {
        self.alive && now >= self.frozen_until
    }

    /// The filter configuration (every VM's is the same).
    pub fn cfg(&self) -> &Config {
        &self.vms[0].engine.cfg
    }

    /// The live process `generation` of this gateway: this one, or the hot-restart
    /// parent it replaced, while it drains.
    pub fn process_mut(&mut self, generation: u32) -> Option<&mut Gateway> {
        if self.generation == generation {
            return self.alive.then_some(self);
        }
        match &mut self.parent {
            Some((p, _)) if p.generation == generation && p.alive => Some(p),
            _ => None,
        }
    }

    /// Puts stream context `ctx` on a worker VM (the kernel spreads connections over the
    /// workers: here in turn, by context); `None` when that VM trapped: with the shipped
    /// `FAIL_OPEN` its worker passes every later request untracked.
    pub fn assign(&mut self, ctx: u32) -> Option<usize> {
        let k = ctx as usize % self.vms.len().max(1);
        if self.vms.get(k)?.trapped {
            return None;
        }
        self.ctx_vm.insert(ctx, k);
        Some(k)
    }

    /// The VM of stream context `ctx`.
    pub fn vm_of(&self, ctx: u32) -> usize {
        self.ctx_vm.get(&ctx).copied().unwrap_or(0)
    }

    /// Whether the VM of stream context `ctx` trapped.
    pub fn trapped(&self, ctx: u32) -> bool {
        self.vms.get(self.vm_of(ctx)).is_some_and(|v| v.trapped)
    }

    /// The engine of stream context `ctx`'s VM, with the host (set to that VM).
    pub fn engine_for(&mut self, ctx: u32) -> (&mut Engine, &mut SimHost) {
        let k = self.vm_of(ctx).min(self.vms.len() - 1);
        self.host.vm = k;
        (&mut self.vms[k].engine, &mut self.host)
    }

    /// `Stream::on_http_request_headers`'s lease part for a tracked request on VM `k`
    /// arriving on `listener`: once a period the upstream and the listener are sampled;
    /// the request is tagged `<instance>.<vm>` with the period's proof. Returns the
    /// instance and the `x-kvguard-instance` value.
    pub fn tag(&mut self, k: usize, listener: &str) -> (Option<InstanceId>, Option<Vec<u8>>) {
        self.host.vm = k;
        let Some(vm) = self.vms.get_mut(k) else {
            return (None, None);
        };
        if vm.renewer.wants_upstream() {
            let up = kvguard_filter_core::lease::Upstream {
                cluster: "engine".into(),
                authority: "engine".into(),
            };
            vm.renewer.note_listener(listener.as_bytes());
            vm.renewer
                .note_upstream(&vm.engine.cfg, &mut self.host, &up);
        }
        let id = vm.member.id();
        let tag = vm
            .renewer
            .tag_value(&vm.engine.cfg.key, id)
            .map(<[u8]>::to_vec);
        (vm.renewer.instance(), tag)
    }

    /// `filter/plugin` `Root::on_tick` of every VM that runs, in turn: the renewal, the
    /// engine's tick, then the flush, which beats in the VM table; returns the streams
    /// to close.
    pub fn tick(&mut self, now: u64, jitter: u64) -> Vec<kvguard_filter_core::Action> {
        self.host.now = now;
        let mut actions = Vec::new();
        for (k, vm) in self.vms.iter_mut().enumerate() {
            if vm.trapped {
                continue;
            }
            self.host.vm = k;
            let targets = vm.engine.targets();
            let busy = vm.engine.tracked() > 0;
            let ids = &mut self.ids;
            let mut fresh = || fresh_id(ids);
            vm.renewer.on_tick(
                &vm.engine.cfg,
                &mut self.host,
                (&targets, busy),
                jitter,
                &mut fresh,
            );
            actions.extend(vm.engine.on_host_tick(&mut self.host));
            vm.member.settle(&mut self.host, now, vms::Share::default());
        }
        actions
    }

    /// `filter/plugin` `Root::on_http_call_response`, in the VM that dispatched the call
    /// (none, if it trapped since).
    pub fn answer(&mut self, now: u64, token: u32, status: Option<u16>, body: &[u8]) {
        self.host.now = now;
        let k = self.host.token_vm.remove(&token).unwrap_or(0);
        let Some(vm) = self.vms.get_mut(k).filter(|v| !v.trapped) else {
            return;
        };
        self.host.vm = k;
        if vm.renewer.on_answer(&mut self.host, token, status) {
            return;
        }
        vm.engine
            .on_abort_answer(&mut self.host, token, status, body);
    }
}

fn fresh_id(r: &mut crate::rng::Rng) -> InstanceId {
    let (a, b) = (r.next_u64().to_le_bytes(), r.next_u64().to_le_bytes());
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&a);
    id[8..].copy_from_slice(&b);
    InstanceId(id)
}
