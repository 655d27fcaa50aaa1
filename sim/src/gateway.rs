//! A gateway: one Envoy process running the REAL filter core ([`Engine`]) and its REAL
//! lease renewer ([`Renewer`]) behind a simulated host ([`SimHost`]): virtual clock,
//! shared data, and HTTP calls collected for the world to deliver. One worker VM per
//! process (the filter's per-VM logic is the same for each).
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

/// One gateway process (its state is lost with it: a restart starts a new one).
#[derive(Debug)]
pub struct Gateway {
    /// The filter's per-VM engine.
    pub engine: Engine,
    /// The lease renewer.
    pub renewer: Renewer,
    /// Its host.
    pub host: SimHost,
    /// Running (not killed).
    pub alive: bool,
    /// SIGSTOPped until then (virtual ms).
    pub frozen_until: u64,
    /// Which process this is (a call answered to an older one is dropped).
    pub generation: u32,
    /// Its instance-id source.
    ids: crate::rng::Rng,
}

impl Gateway {
    /// A fresh process of gateway `index` (its host key is the node's: the same across
    /// restarts) started at `now`.
    pub fn start(cfg: Config, index: u8, generation: u32, seed: u64, now: u64) -> Gateway {
        let mut host = SimHost {
            now,
            ..SimHost::default()
        };
        let mut engine = Engine::new(cfg, seed ^ u64::from(generation));
        engine.keep_ticking(true);
        let mut renewer = Renewer::new(Some(HostKey([index; 16])));
        let mut ids = crate::rng::Rng::new(seed ^ (u64::from(index) << 32) ^ u64::from(generation));
        let mut fresh = || fresh_id(&mut ids);
        renewer.sync_instance(&mut host, &mut fresh);
        Gateway {
            engine,
            renewer,
            host,
            alive: true,
            frozen_until: 0,
            generation,
            ids,
        }
    }

    /// Whether it runs at `now` (alive and not stopped).
    pub fn runs(&self, now: u64) -> bool {
        self.alive && now >= self.frozen_until
    }

    /// `filter/plugin` `Root::on_tick`: the renewal, then the engine's tick; returns the
    /// streams to close.
    pub fn tick(&mut self, now: u64, jitter: u64) -> Vec<kvguard_filter_core::Action> {
        self.host.now = now;
        let targets = self.engine.targets();
        let busy = self.engine.tracked() > 0;
        let ids = &mut self.ids;
        let mut fresh = || fresh_id(ids);
        self.renewer.on_tick(
            &self.engine.cfg,
            &mut self.host,
            (&targets, busy),
            jitter,
            &mut fresh,
        );
        self.engine.on_host_tick(&mut self.host)
    }

    /// `filter/plugin` `Root::on_http_call_response`.
    pub fn answer(&mut self, now: u64, token: u32, status: Option<u16>, body: &[u8]) {
        self.host.now = now;
        if self.renewer.on_answer(&mut self.host, token, status) {
            return;
        }
        self.engine
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
