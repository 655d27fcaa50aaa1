//! The lease loop: every [`lease_tick`] it takes kvguard-control's own stall into
//! account, judges every lease ([`super::Leases::judge`]), connects to the listeners the
//! judgement asks about ([`probe`]) and ends (`enforce`) or counts (`observe`) the
//! in-flight requests of each expired instance, reason `gateway_lost`.

use super::{Expiry, LeaseMode, ProbeAnswer};
use crate::state::AppState;
use kvguard_contract::AbortReason;
use kvguard_control_core::lease::{Acts, Mode};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Runs the lease loop until `stop` (not at all with `--lease-mode off`).
pub fn spawn(st: Arc<AppState>, stop: CancellationToken) {
    if st.cfg.lease_mode == LeaseMode::Off {
        return;
    }
    let every = lease_tick(st.cfg.lease_ttl);
    crate::reaper::run_every(st, every, stop, move |st, gap| {
        note_loop_gap(st, gap, every);
        judge(st);
    });
}

/// Takes the gap since the lease loop's last pass: a stall in it (see
/// [`super::stall`]) is counted, logged and added to every lease, so that no gateway
/// loses its lease for renewals kvguard-control could not read. Returns the stall.
pub fn note_loop_gap(st: &AppState, gap: Duration, every: Duration) -> Duration {
    let stalled = super::stall(gap, every);
    if !stalled.is_zero() {
        st.metrics.lease.stalls.inc();
        tracing::warn!(
            stall_ms = stalled.as_millis() as u64,
            "the lease loop stalled; every lease is extended by the stall"
        );
        st.leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(stalled);
    }
    stalled
}

/// How often the lease loop looks: an eighth of the TTL, between 10 ms and 1 s.
pub fn lease_tick(ttl: Duration) -> Duration {
    (ttl / 8).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// One lease judgement: held expiries are counted; an expired instance's in-flight
/// requests are ended (`enforce`, unless the expiry is `unproven`) or counted. A request
/// of an expired instance admitted after the judgement is evidence of life: the lease is
/// taken back and nothing of it ended.
pub fn judge(st: &Arc<AppState>) {
    let Some(mode) = st.cfg.lease_mode.judged() else {
        return;
    };
    let now = st.clock.now();
    let j = {
        let mut leases = st.leases.lock().unwrap_or_else(|p| p.into_inner());
        let j = leases.judge(now);
        st.metrics.lease.census(leases.census());
        j
    };
    if j.held > 0 {
        st.metrics.lease.held_expiries.inc_by(j.held as u64);
        let instances: Vec<String> = j.holding.iter().map(ToString::to_string).collect();
        tracing::warn!(held = j.held, instances = %instances.join(","), "gateways went silent past the TTL and no other gateway was heard from since, or their listener still answers (frozen): expiries held");
    }
    for (instance, host) in &j.shared {
        st.metrics.lease.shared_host_keys.inc();
        tracing::warn!(%instance, %host, "two live gateways renew with one host key (the same Envoy node.id and vm_id): the key is not used to judge either as replaced; give each gateway its own node.id (--service-node \"$HOSTNAME\", or Istio's)");
    }
    for (instance, addr) in j.probes {
        probe(st, instance, addr);
    }
    if j.expired.is_empty() && j.lost.is_empty() {
        return;
    }
    let entries = st.entries();
    for (instance, vm) in j.lost {
        end_vm(st, &entries, now, instance, vm, mode);
    }
    for (instance, why) in j.expired {
        let mine: Vec<_> = entries
            .iter()
            .filter(|e| e.instance() == Some(instance))
            .collect();
        if let Some(late) = admitted_since(&mine, now) {
            st.leases
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .revive(instance, late);
            tracing::info!(%instance, "gateway lease taken back: a request of it arrived as it expired");
            continue;
        }
        let (mode, ended) = end_or_count(st, &mine, why, why.acts(mode));
        let ttl_ms = st.cfg.lease_ttl.as_millis() as u64;
        match why {
            Expiry::Silent => {
                tracing::warn!(%instance, mode, requests = ended, ttl_ms, "gateway lease expired: no renewal on either path and no request within the TTL")
            }
            Expiry::Replaced => {
                tracing::warn!(%instance, mode, requests = ended, "gateway lease expired: a process started after it renews with its host key, and it has been silent for the TTL (restarted in place, or a hot restart's parent that exited)")
            }
            Expiry::Dead => {
                tracing::warn!(%instance, mode, requests = ended, ttl_ms, "gateway lease expired: silent for the TTL and its listener refused or did not answer a handshake")
            }
            Expiry::Unproven => {
                tracing::warn!(%instance, mode, requests = ended, ttl_ms, "gateway lease expired unproven: silent for the TTL, but its data path carried no in-band renewal (a hop that does not route /v1/kvguard/lease) and no listener of it answered a handshake before, so its silence is no evidence of death: its requests are counted, not ended")
            }
            // Judged per VM ([`end_vm`]), never for a whole instance.
            Expiry::VmLost => {}
        }
    }
}

/// Connects to `addr`, the listener of `instance` from its verified proof, within
/// [`super::probe_timeout`], and gives the answer to the lease table; a refusal or no
/// answer is judged at once.
pub fn probe(
    st: &Arc<AppState>,
    instance: kvguard_contract::InstanceId,
    addr: std::net::SocketAddr,
) {
    let st = Arc::clone(st);
    tokio::spawn(async move {
        let bound = super::probe_timeout(st.cfg.lease_ttl);
        let answer = match tokio::time::timeout(bound, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(_)) => ProbeAnswer::Alive,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => ProbeAnswer::Refused,
            Ok(Err(_)) | Err(_) => ProbeAnswer::Timeout,
        };
        st.metrics.lease.probe(answer);
        tracing::debug!(%instance, %addr, answer = answer.as_str(), "gateway listener probed");
        {
            let mut leases = st.leases.lock().unwrap_or_else(|p| p.into_inner());
            leases.probed(instance, addr, answer, st.clock.now());
            st.metrics.lease.census(leases.census());
        }
        if answer != ProbeAnswer::Alive {
            judge(&st);
        }
    });
}

/// The latest admission among `mine` at or after the judgement at `now` (evidence of life
/// that the judgement could not see).
fn admitted_since(
    mine: &[&Arc<crate::table::Entry>],
    now: std::time::Instant,
) -> Option<std::time::Instant> {
    mine.iter()
        .map(|e| e.times().started)
        .filter(|t| *t >= now)
        .max()
}

/// Counts the expiry `why`, then ends `mine` (reason `gateway_lost`) or only counts
/// them, as [`Expiry::acts`] says: the mode label and how many.
fn end_or_count(
    st: &Arc<AppState>,
    mine: &[&Arc<crate::table::Entry>],
    why: Expiry,
    acts: Acts,
) -> (&'static str, u64) {
    let mode = acts.mode.as_str();
    st.metrics.lease.expired(mode, why);
    let mut ended = 0u64;
    for e in mine {
        if !acts.ends || st.end_request(e, AbortReason::GatewayLost, "lease") {
            ended += 1;
        }
    }
    st.metrics.lease.ended(mode, why, ended);
    (mode, ended)
}

/// Ends (`enforce`) or counts the requests of worker VM `vm` of a live `instance`, lost:
/// its instance's renewals left it out for the TTL (it trapped; Envoy cut its streams).
/// A VM with no request here is dropped silently (a VM stopped by a config push).
fn end_vm(
    st: &Arc<AppState>,
    entries: &[Arc<crate::table::Entry>],
    now: std::time::Instant,
    instance: kvguard_contract::InstanceId,
    vm: u32,
    mode: Mode,
) {
    let mine: Vec<_> = entries
        .iter()
        .filter(|e| e.instance() == Some(instance) && e.vm() == Some(vm))
        .collect();
    if mine.is_empty() {
        tracing::debug!(%instance, vm, "gateway VM no longer listed, no request of it here");
        return;
    }
    if let Some(late) = admitted_since(&mine, now) {
        st.leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .revive_vm(instance, vm, late);
        return;
    }
    let (mode, ended) = end_or_count(st, &mine, Expiry::VmLost, Expiry::VmLost.acts(mode));
    let ttl_ms = st.cfg.lease_ttl.as_millis() as u64;
    tracing::warn!(%instance, vm, mode, requests = ended, ttl_ms, "gateway VM lost: its gateway's renewals have left it out for the TTL (a worker VM that trapped or was replaced)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_loop_looks_eight_times_per_ttl_within_10_ms_and_1_s() {
        assert_eq!(
            lease_tick(Duration::from_secs(2)),
            Duration::from_millis(250)
        );
        assert_eq!(
            lease_tick(Duration::from_millis(40)),
            Duration::from_millis(10)
        );
        assert_eq!(lease_tick(Duration::from_secs(30)), Duration::from_secs(1));
    }
}
