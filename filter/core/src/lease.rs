//! The gateway side of the liveness lease (contract §8): the process's instance id and
//! the renewal slot in proxy-wasm shared data, the election of the one VM that renews in
//! a period, and the signed renewal call.
//!
//! Shared data outlives VM reloads and module upgrades (it belongs to the `vm_id` in the
//! Envoy process), so a config push neither changes the instance id nor resets the
//! renewal counter; a new Envoy process (a restart, a hot restart's child) starts with
//! none and draws a fresh id.

use crate::aborts::ORIGINAL_DST_HEADER;
use crate::config::Config;
use crate::host::{Call, Level, Platform};
use crate::metrics::{LeaseResult, Metric};
use core::net::SocketAddr;
use kvguard_contract::{signature, InstanceId, Renewal};

/// Shared-data key of the instance id (value `v1:<32 hex>`).
pub const INSTANCE_KEY: &str = "kvguard.instance.v1";
/// Shared-data key of the renewal slot (value `v1:<due monotonic ms>:<counter>`).
pub const SLOT_KEY: &str = "kvguard.lease.v1";

/// Shared-data key of the kvguard-control replicas this process has seen in verified
/// `x-kvguard-control` stamps (value `v1:<ip:port>@<seen monotonic ms>,...`): each
/// period's renewal goes to every one of them as well as to `control_cluster`.
pub const REPLICAS_KEY: &str = "kvguard.replicas.v1";
/// Most replicas remembered (the longest unseen is forgotten first).
pub const MAX_REPLICAS: usize = 16;
/// A replica no stamp has named for this many renewal periods is forgotten.
pub const FORGET_PERIODS: u64 = 120;

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
    list.retain(|(a, t)| *a != addr && now_ms.saturating_sub(*t) <= horizon);
    list.push((addr, now_ms));
    list.sort_by_key(|e| core::cmp::Reverse(e.1));
    list.truncate(MAX_REPLICAS);
    Some(replicas_value(&list))
}

/// `current` without `addr` (`None`: it was not there).
pub fn forget(current: Option<&[u8]>, addr: SocketAddr) -> Option<Vec<u8>> {
    let mut list = current.map(parse_replicas).unwrap_or_default();
    let before = list.len();
    list.retain(|(a, _)| *a != addr);
    (list.len() != before).then(|| replicas_value(&list))
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

/// Sends the renewal `counter` of `instance` to `control_cluster`, or with `replica` to
/// that kvguard-control replica through `control_target_cluster` (nothing without one);
/// returns its token. Renewals do not go through the abort queue: an abort storm never
/// delays them.
pub fn send<P: Platform + ?Sized>(
    cfg: &Config,
    p: &mut P,
    instance: InstanceId,
    counter: u64,
    replica: Option<SocketAddr>,
) -> Option<u32> {
    let cluster = match (replica, &cfg.target) {
        (None, _) => &cfg.control_cluster,
        (Some(_), Some(t)) => &t.cluster,
        (Some(_), None) => return None,
    };
    let body = Renewal::new(instance, counter).to_json();
    let sig = signature::sign(&cfg.key, p.unix_secs(), &body);
    let mut headers = vec![
        (":method", "POST".to_owned()),
        (":path", cfg.lease_path.clone()),
        (":authority", cfg.control_authority.clone()),
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
            p.add(Metric::LeaseRenewals(LeaseResult::Sent), 1);
            Some(token)
        }
        Err(e) => {
            p.add(Metric::LeaseRenewals(LeaseResult::Failed), 1);
            p.log(
                Level::Warn,
                &format!("lease renewal counter={counter} not sent to {cluster}: the host refused the call ({e:?}); check control_cluster / control_target_cluster"),
            );
            None
        }
    }
}

/// A renewal's answer (`None`: timeout or reset).
pub fn on_answer<P: Platform + ?Sized>(p: &mut P, status: Option<u16>) {
    if status == Some(200) {
        p.add(Metric::LeaseRenewals(LeaseResult::Accepted), 1);
        return;
    }
    p.add(Metric::LeaseRenewals(LeaseResult::Failed), 1);
    let shown = status.map_or_else(|| "none (timeout or reset)".to_owned(), |s| s.to_string());
    let hint = match status {
        Some(401) => " (kvguard-control refused the signature: the filter's first key must be one of its keys)",
        Some(404) => " (kvguard-control runs with --lease-mode off, or lease_path is wrong)",
        _ => "",
    };
    p.log(
        Level::Warn,
        &format!("lease renewal failed: status {shown}{hint}"),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{config, MockHost};

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
        let v = forget(Some(&v), b).unwrap();
        assert_eq!(live_replicas(Some(&v), 2000, 5000), vec![a]);
        assert_eq!(forget(Some(&v), b), None);
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
    fn a_renewal_to_a_replica_goes_through_the_target_cluster() {
        let extra = r#","control_target_cluster":"t","control_target_cidrs":["10.0.0.0/8"]"#;
        let cfg = config(extra);
        let mut h = MockHost::default();
        let id = InstanceId([1; 16]);
        let addr: SocketAddr = "10.1.2.3:9902".parse().unwrap();
        send(&cfg, &mut h, id, 4, Some(addr)).unwrap();
        let (_, cluster, headers, _) = &h.calls[0];
        assert_eq!(cluster, "t");
        assert!(headers.contains(&(ORIGINAL_DST_HEADER, "10.1.2.3:9902".to_owned())));
        // Without a target route there is no way to name a replica.
        assert_eq!(send(&config(""), &mut h, id, 5, Some(addr)), None);
    }

    #[test]
    fn renewal_call_is_signed_and_counted() {
        let cfg = config("");
        let mut h = MockHost {
            unix: 1_800_000_000,
            ..MockHost::default()
        };
        let id = InstanceId([1; 16]);
        let token = send(&cfg, &mut h, id, 4, None).unwrap();
        let (t, cluster, headers, body) = &h.calls[0];
        assert_eq!((*t, cluster.as_str()), (token, "kvguard"));
        assert_eq!(Renewal::parse(body), Some((id, 4)));
        let sig = headers
            .iter()
            .find(|(k, _)| *k == signature::SIGNATURE_HEADER)
            .unwrap();
        assert!(signature::verify_any_time(
            std::slice::from_ref(&cfg.key),
            Some(sig.1.as_bytes()),
            body
        )
        .is_ok());
        assert!(headers.contains(&(":path", "/v1/lease".to_owned())));
        on_answer(&mut h, Some(200));
        on_answer(&mut h, None);
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Sent)), 1);
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Accepted)), 1);
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Failed)), 1);
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

    #[test]
    fn a_failed_renewal_says_why() {
        let mut h = MockHost::default();
        on_answer(&mut h, Some(401));
        on_answer(&mut h, Some(404));
        on_answer(&mut h, Some(500));
        on_answer(&mut h, None);
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Failed)), 4);
        let logs: Vec<&str> = h.logs.iter().map(|(_, m)| m.as_str()).collect();
        assert!(h.logs.iter().all(|(l, _)| *l == Level::Warn));
        assert!(logs[0].contains("status 401") && logs[0].contains("refused the signature"));
        assert!(logs[1].contains("status 404") && logs[1].contains("--lease-mode off"));
        assert!(logs[2].ends_with("status 500"));
        assert!(logs[3].contains("none (timeout or reset)"));
    }

    #[test]
    fn a_renewal_the_host_refuses_is_counted_and_logged() {
        let mut h = MockHost {
            refuse: Some(crate::host::DispatchError::Other),
            ..MockHost::default()
        };
        assert_eq!(
            send(&config(""), &mut h, InstanceId([1; 16]), 4, None),
            None
        );
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Failed)), 1);
        assert_eq!(h.metric(Metric::LeaseRenewals(LeaseResult::Sent)), 0);
        assert!(h
            .logs
            .iter()
            .any(|(l, m)| *l == Level::Warn && m.contains("counter=4 not sent to kvguard")));
    }
}
