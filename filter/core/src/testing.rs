//! Mocks for the core's traits (tests only).

use crate::config::Config;
use crate::host::{Call, Clock, DispatchError, Host, Level, SharedData, SharedError};
use crate::metrics::{Metric, Metrics};

pub(crate) const SECRET: &str = "kvguard-test-secret-0123456789";

/// A config with `control_cluster: "kvguard"`, a secret, and `extra` JSON members
/// (starting with a comma).
pub(crate) fn config(extra: &str) -> Config {
    let json = format!(r#"{{"control_cluster":"kvguard","secret":"{SECRET}"{extra}}}"#);
    match Config::parse(json.as_bytes(), &|_| None) {
        Ok(c) => c,
        Err(e) => panic!("test config: {e}"),
    }
}

/// A recorded call: token, cluster, headers, body.
pub(crate) type Recorded = (u32, String, Vec<(&'static str, String)>, Vec<u8>);

/// Records calls, logs and metrics; time is settable.
#[derive(Debug, Clone, Default)]
pub(crate) struct MockHost {
    pub now: u64,
    pub unix: u64,
    pub next_token: u32,
    pub calls: Vec<Recorded>,
    pub logs: Vec<(Level, String)>,
    pub metrics: Vec<i64>,
    /// Calls to [`Metrics::add`] (each is a host call in the plugin).
    pub adds: usize,
    /// Histogram observations, in order.
    pub observations: Vec<(Metric, u64)>,
    pub refuse: Option<DispatchError>,
    /// What [`Host::upstream_reached`] answers.
    pub upstream: bool,
    /// How many times it was asked.
    pub upstream_asked: usize,
    /// Shared data: key → (value, cas).
    pub shared: std::collections::BTreeMap<String, (Vec<u8>, u32)>,
    /// Shared-data calls fail.
    pub shared_broken: bool,
    /// Shared-data reads so far (each is a host call in the plugin).
    pub shared_reads: core::cell::Cell<usize>,
    /// The clock cannot be read: `now_exact` answers `None`, `now_ms` this stale value.
    pub stale: Option<u64>,
}

impl MockHost {
    pub fn metric(&self, m: Metric) -> i64 {
        self.metrics.get(m.index()).copied().unwrap_or(0)
    }

    /// The observations of histogram `m`.
    pub fn observed(&self, m: Metric) -> Vec<u64> {
        self.observations
            .iter()
            .filter(|(x, _)| *x == m)
            .map(|(_, v)| *v)
            .collect()
    }
}

impl Clock for MockHost {
    fn now_ms(&self) -> u64 {
        self.stale.unwrap_or(self.now)
    }
    fn now_exact(&self) -> Option<u64> {
        match self.stale {
            Some(_) => None,
            None => Some(self.now),
        }
    }
    fn unix_secs(&self) -> u64 {
        self.unix
    }
}

impl Host for MockHost {
    fn dispatch(&mut self, call: &Call<'_>) -> Result<u32, DispatchError> {
        if let Some(e) = self.refuse {
            return Err(e);
        }
        self.next_token += 1;
        self.calls.push((
            self.next_token,
            call.cluster.to_owned(),
            call.headers.clone(),
            call.body.clone(),
        ));
        Ok(self.next_token)
    }
    fn log(&mut self, level: Level, msg: &str) {
        self.logs.push((level, msg.to_owned()));
    }
    fn upstream_reached(&mut self) -> bool {
        self.upstream_asked += 1;
        self.upstream
    }
}

impl SharedData for MockHost {
    fn shared_get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, SharedError> {
        self.shared_reads.set(self.shared_reads.get() + 1);
        if self.shared_broken {
            return Err(SharedError::Other);
        }
        Ok(self.shared.get(key).cloned())
    }
    fn shared_set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), SharedError> {
        if self.shared_broken {
            return Err(SharedError::Other);
        }
        // Envoy's rule: a key that is absent is written whatever `cas` says.
        let e = self.shared.entry(key.to_owned()).or_insert((Vec::new(), 0));
        if cas != 0 && e.1 != 0 && cas != e.1 {
            return Err(SharedError::CasMismatch);
        }
        *e = (value.to_vec(), e.1 + 1);
        Ok(())
    }
}

impl Metrics for MockHost {
    fn add(&mut self, m: Metric, delta: i64) {
        self.adds += 1;
        if self.metrics.len() < Metric::COUNT {
            self.metrics.resize(Metric::COUNT, 0);
        }
        self.metrics[m.index()] += delta;
    }

    fn record(&mut self, m: Metric, value: u64) {
        self.observations.push((m, value));
    }
}
