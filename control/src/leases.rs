//! Liveness leases of gateway processes (contract §8): the evidence of life per instance
//! (a renewal, or a request tagged with that instance), judged on kvguard-control's own
//! monotonic receipt clock.
//!
//! Soft state: nothing is persisted, and an instance is judged only after this process
//! has accepted a renewal from it (a replica never expires an instance it has not seen
//! renew since it started). A stall of kvguard-control's own loop extends every lease by
//! the stall before anything is judged; if every instance with a lease (two or more) goes
//! silent in the same window, the expiries are held (the network or kvguard-control is
//! the suspect, not every gateway at once).

use kvguard_contract::InstanceId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What the lease does when it expires (`--lease-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LeaseMode {
    /// No lease handling: renewals are answered 404, requests' instances ignored.
    Off,
    /// Expiries are judged, logged and counted; nothing is ended.
    Observe,
    /// An expiry ends every in-flight request of the instance (reason `gateway_lost`).
    Enforce,
}

impl LeaseMode {
    /// The flag value.
    pub const fn as_str(self) -> &'static str {
        match self {
            LeaseMode::Off => "off",
            LeaseMode::Observe => "observe",
            LeaseMode::Enforce => "enforce",
        }
    }
}

/// Why a renewal was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewError {
    /// Its counter is below the last one accepted for the instance.
    Replay,
    /// Its counter is the last one accepted: the same renewal again (the gateway sends
    /// each period's renewal to `control_cluster` and to every replica it has seen, and
    /// peers forward it, so one replica may get it several times). No evidence of life:
    /// the lease is not extended.
    Duplicate,
}

#[derive(Debug, Clone, Copy)]
struct Lease {
    /// The last evidence of life (receipt time here).
    last: Instant,
    /// The last accepted counter.
    counter: u64,
}

/// What one judgement found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Judgement {
    /// Instances whose lease expired now (they leave the table).
    pub expired: Vec<InstanceId>,
    /// Expiries held because every instance went silent at once.
    pub held: usize,
}

/// Every lease this process holds.
#[derive(Debug)]
pub struct Leases {
    ttl: Duration,
    table: HashMap<InstanceId, Lease>,
    /// Instances expired (or held) in the current silent spell, so a held expiry is
    /// counted once, not at every judgement.
    held: HashMap<InstanceId, ()>,
}

impl Leases {
    /// Leases expiring after `ttl` without evidence of life.
    pub fn new(ttl: Duration) -> Leases {
        Leases {
            ttl,
            table: HashMap::new(),
            held: HashMap::new(),
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

    /// A renewal received at `now` (from the gateway or forwarded by a peer): accepted if
    /// its counter is above the last accepted. The counter is the gateway process's and
    /// the same value reaches every replica, so each replica keeps the highest it saw.
    pub fn renew(&mut self, id: InstanceId, counter: u64, now: Instant) -> Result<(), RenewError> {
        match self.table.get_mut(&id) {
            Some(l) if counter < l.counter => Err(RenewError::Replay),
            Some(l) if counter == l.counter => Err(RenewError::Duplicate),
            Some(l) => {
                l.counter = counter;
                l.last = l.last.max(now);
                self.held.remove(&id);
                Ok(())
            }
            None => {
                self.table.insert(id, Lease { last: now, counter });
                self.held.remove(&id);
                Ok(())
            }
        }
    }

    /// A request tagged with `id` arrived at `now`: evidence of life for a held lease
    /// (an instance never seen renewing gets none: it is never judged).
    pub fn touch(&mut self, id: &InstanceId, now: Instant) {
        if let Some(l) = self.table.get_mut(id) {
            l.last = l.last.max(now);
            self.held.remove(id);
        }
    }

    /// kvguard-control's own loop stalled for `stall`: every lease is extended by it
    /// (the silence may be ours).
    pub fn extend(&mut self, stall: Duration) {
        for l in self.table.values_mut() {
            l.last += stall;
        }
    }

    /// Judges every lease at `now`. Expired instances leave the table, unless every
    /// instance with a lease (two or more) is expired at once: then nothing is expired
    /// and the silent ones are counted as held (once per silent spell).
    pub fn judge(&mut self, now: Instant) -> Judgement {
        let ttl = self.ttl;
        let silent: Vec<InstanceId> = self
            .table
            .iter()
            .filter(|(_, l)| now.saturating_duration_since(l.last) > ttl)
            .map(|(id, _)| *id)
            .collect();
        if silent.is_empty() {
            return Judgement::default();
        }
        if self.table.len() >= 2 && silent.len() == self.table.len() {
            let mut held = 0;
            for id in silent {
                if self.held.insert(id, ()).is_none() {
                    held += 1;
                }
            }
            return Judgement {
                expired: Vec::new(),
                held,
            };
        }
        for id in &silent {
            self.table.remove(id);
            self.held.remove(id);
        }
        Judgement {
            expired: silent,
            held: 0,
        }
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
mod tests {
    use super::*;

    const A: InstanceId = InstanceId([1; 16]);
    const B: InstanceId = InstanceId([2; 16]);

    #[test]
    fn expires_after_ttl_without_evidence_only_once_seen_renewing() {
        let t0 = Instant::now();
        let mut l = Leases::new(Duration::from_secs(30));
        l.touch(&A, t0); // never renewed: no lease, never judged
        assert!(l.is_empty());
        l.renew(A, 1, t0).unwrap();
        assert_eq!(l.judge(t0 + Duration::from_secs(30)), Judgement::default());
        l.touch(&A, t0 + Duration::from_secs(20)); // a request is evidence of life
        assert_eq!(l.judge(t0 + Duration::from_secs(45)), Judgement::default());
        assert_eq!(l.judge(t0 + Duration::from_secs(51)).expired, vec![A]);
        assert!(l.is_empty());
    }

    #[test]
    fn a_lease_is_held_from_its_first_renewal_until_it_expires() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(30);
        let mut l = Leases::new(ttl);
        assert_eq!(l.ttl(), ttl);
        assert!(l.is_empty());
        assert!(!l.holds(&A));
        l.renew(A, 1, t0).unwrap();
        assert!(!l.is_empty());
        assert!(l.holds(&A));
        assert!(!l.holds(&B), "only the instance that renewed holds a lease");
        assert_eq!(l.judge(t0 + Duration::from_secs(31)).expired, vec![A]);
        assert!(!l.holds(&A));
    }

    #[test]
    fn counters_refuse_replays() {
        let t0 = Instant::now();
        let mut l = Leases::new(Duration::from_secs(30));
        l.renew(A, 5, t0).unwrap();
        assert_eq!(l.renew(A, 5, t0), Err(RenewError::Duplicate));
        assert_eq!(l.renew(A, 4, t0), Err(RenewError::Replay));
        assert_eq!(l.renew(A, 6, t0), Ok(()));
    }

    #[test]
    fn a_duplicate_or_a_replay_is_no_evidence_of_life() {
        let t0 = Instant::now();
        let mut l = Leases::new(Duration::from_secs(30));
        l.renew(A, 5, t0).unwrap();
        let later = t0 + Duration::from_secs(20);
        assert_eq!(l.renew(A, 5, later), Err(RenewError::Duplicate));
        assert_eq!(l.renew(A, 3, later), Err(RenewError::Replay));
        assert_eq!(l.judge(t0 + Duration::from_secs(31)).expired, vec![A]);
    }

    #[test]
    fn all_silent_at_once_is_held_one_silent_is_expired() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(30);
        let mut l = Leases::new(ttl);
        l.renew(A, 1, t0).unwrap();
        l.renew(B, 1, t0).unwrap();
        let late = t0 + Duration::from_secs(31);
        assert_eq!(
            l.judge(late),
            Judgement {
                expired: vec![],
                held: 2
            }
        );
        // Counted once per spell.
        assert_eq!(l.judge(late + Duration::from_secs(1)).held, 0);
        assert_eq!(l.len(), 2);
        // B comes back: A alone is silent, so A expires.
        l.renew(B, 2, late).unwrap();
        assert_eq!(l.judge(late + Duration::from_secs(2)).expired, vec![A]);
    }

    #[test]
    fn a_stall_of_our_own_extends_every_lease() {
        let t0 = Instant::now();
        let mut l = Leases::new(Duration::from_secs(30));
        l.renew(A, 1, t0).unwrap();
        l.extend(Duration::from_secs(20));
        assert!(l.judge(t0 + Duration::from_secs(45)).expired.is_empty());
        assert_eq!(l.judge(t0 + Duration::from_secs(51)).expired, vec![A]);
        let p = Duration::from_millis(100);
        assert_eq!(stall(Duration::from_millis(150), p), Duration::ZERO);
        assert_eq!(
            stall(Duration::from_millis(1100), p),
            Duration::from_millis(1000)
        );
    }
}
