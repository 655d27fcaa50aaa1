//! The gateway side of the liveness lease (contract §8): the process's instance id and
//! the renewal slot in proxy-wasm shared data, the election of the one VM that renews in
//! a period, and the signed renewal call.
//!
//! Shared data outlives VM reloads and module upgrades (it belongs to the `vm_id` in the
//! Envoy process), so a config push neither changes the instance id nor resets the
//! renewal counter; a new Envoy process (a restart, a hot restart's child) starts with
//! none and draws a fresh id.

use crate::config::Config;
use crate::host::{Call, Level, Platform};
use crate::metrics::{LeaseResult, Metric};
use kvguard_contract::{signature, InstanceId, Renewal};

/// Shared-data key of the instance id (value `v1:<32 hex>`).
pub const INSTANCE_KEY: &str = "kvguard.instance.v1";
/// Shared-data key of the renewal slot (value `v1:<due monotonic ms>:<counter>`).
pub const SLOT_KEY: &str = "kvguard.lease.v1";

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

/// Sends the renewal `counter` of `instance` to `control_cluster`; returns its token.
/// Renewals do not go through the abort queue: an abort storm never delays them.
pub fn send<P: Platform + ?Sized>(
    cfg: &Config,
    p: &mut P,
    instance: InstanceId,
    counter: u64,
) -> Option<u32> {
    let body = Renewal::new(instance, counter).to_json();
    let sig = signature::sign(&cfg.key, p.unix_secs(), &body);
    let call = Call {
        cluster: &cfg.control_cluster,
        headers: vec![
            (":method", "POST".to_owned()),
            (":path", cfg.lease_path.clone()),
            (":authority", cfg.control_authority.clone()),
            ("content-type", "application/json".to_owned()),
            (signature::SIGNATURE_HEADER, sig),
        ],
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
                &format!("lease renewal counter={counter} not sent: the host refused the call ({e:?}); check control_cluster"),
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
    fn renewal_call_is_signed_and_counted() {
        let cfg = config("");
        let mut h = MockHost {
            unix: 1_800_000_000,
            ..MockHost::default()
        };
        let id = InstanceId([1; 16]);
        let token = send(&cfg, &mut h, id, 4).unwrap();
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
}
