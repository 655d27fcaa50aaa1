//! Tombstones: ids that were aborted (or whose abort arrived before the request), refused
//! if they arrive later. Bounded in number, each kept for a TTL.

use kvguard_contract::{AbortReason, RequestId};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Why an id is tombstoned (`V`: the abort's reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tombstone<V = AbortReason> {
    /// The abort's reason.
    pub reason: V,
    /// When it stops refusing.
    pub expires: Instant,
}

/// A bounded TTL set of request ids. The TTL is the same for every entry, so insertion
/// order is expiry order: the queue front is always the next to expire (or to evict).
#[derive(Debug)]
pub struct Tombstones<V = AbortReason> {
    ttl: Duration,
    cap: usize,
    map: HashMap<RequestId, Tombstone<V>>,
    order: VecDeque<(RequestId, Instant)>,
    evicted: u64,
}

impl<V: Copy> Tombstones<V> {
    /// An empty set.
    pub fn new(ttl: Duration, cap: usize) -> Self {
        Tombstones {
            ttl,
            cap: cap.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
            evicted: 0,
        }
    }

    /// Drops expired entries.
    pub fn purge(&mut self, now: Instant) {
        while let Some((id, exp)) = self.order.front() {
            if *exp > now {
                break;
            }
            // Only remove the map entry if it is this queue entry's (not a refreshed one).
            if self.map.get(id).is_some_and(|t| t.expires == *exp) {
                self.map.remove(id);
            }
            self.order.pop_front();
        }
    }

    /// Tombstones `id` until `now + ttl`; the oldest entry is evicted when full.
    pub fn insert(&mut self, id: RequestId, reason: V, now: Instant) {
        self.purge(now);
        if !self.map.contains_key(&id) {
            while self.map.len() >= self.cap {
                match self.order.pop_front() {
                    Some((old, exp)) => {
                        if self.map.get(&old).is_some_and(|t| t.expires == exp) {
                            self.map.remove(&old);
                            self.evicted += 1;
                        }
                    }
                    None => break,
                }
            }
        }
        let expires = now + self.ttl;
        self.order.push_back((id.clone(), expires));
        // The first reason wins; the TTL is refreshed.
        let reason = self.map.get(&id).map_or(reason, |t| t.reason);
        self.map.insert(id, Tombstone { reason, expires });
        // Keep the queue from growing without bound through refreshes of the same ids.
        if self.order.len() > self.cap.saturating_mul(2) {
            self.compact();
        }
    }

    fn compact(&mut self) {
        let map = &self.map;
        self.order
            .retain(|(id, exp)| map.get(id).is_some_and(|t| t.expires == *exp));
    }

    /// The tombstone for `id`, if it is live at `now`.
    pub fn get(&self, id: &RequestId, now: Instant) -> Option<Tombstone<V>> {
        self.map.get(id).filter(|t| t.expires > now).copied()
    }

    /// Live entries (after a purge).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Entries evicted before their TTL because the set was full.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> RequestId {
        RequestId::try_new(s.as_bytes()).unwrap()
    }

    #[test]
    fn ttl() {
        let t0 = Instant::now();
        let mut t = Tombstones::new(Duration::from_secs(60), 10);
        t.insert(id("a"), AbortReason::Stalled, t0);
        assert_eq!(
            t.get(&id("a"), t0 + Duration::from_secs(59))
                .unwrap()
                .reason,
            AbortReason::Stalled
        );
        assert!(t.get(&id("a"), t0 + Duration::from_secs(60)).is_none());
        assert!(t.get(&id("b"), t0).is_none());
        t.purge(t0 + Duration::from_secs(61));
        assert!(t.is_empty());
    }

    #[test]
    fn a_tombstone_leaves_at_the_instant_it_stops_refusing() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(60);
        let mut t = Tombstones::new(ttl, 10);
        t.insert(id("a"), AbortReason::Stalled, t0);
        t.purge(t0 + ttl - Duration::from_nanos(1));
        assert_eq!(t.len(), 1);
        assert!(!t.is_empty());
        assert_eq!(t.evicted(), 0, "none evicted below the bound");
        t.purge(t0 + ttl);
        assert!(t.get(&id("a"), t0 + ttl).is_none());
        assert_eq!(t.len(), 0, "expired at its expiry instant, so purged then");
    }

    #[test]
    fn the_queue_stays_bounded_after_refreshes_at_one_instant() {
        let t0 = Instant::now();
        let mut t = Tombstones::new(Duration::from_secs(10), 1);
        // Two refreshes at one instant queue the same (id, expiry) twice.
        t.insert(id("a"), AbortReason::MaxAge, t0);
        t.insert(id("a"), AbortReason::MaxAge, t0);
        for i in 1..100 {
            t.insert(id("a"), AbortReason::MaxAge, t0 + Duration::from_millis(i));
            assert!(t.order.len() <= 3, "{} queued", t.order.len());
        }
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_tombstone_refreshed_many_times_still_expires_at_its_last_refresh() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(10);
        let mut t = Tombstones::new(ttl, 2);
        for i in 0..10 {
            t.insert(id("a"), AbortReason::MaxAge, t0 + Duration::from_secs(i));
        }
        let last = t0 + Duration::from_secs(9);
        t.purge(last + ttl - Duration::from_nanos(1));
        assert_eq!(t.len(), 1);
        t.purge(last + ttl);
        assert!(t.is_empty());
    }

    #[test]
    fn bound_evicts_oldest() {
        let t0 = Instant::now();
        let mut t = Tombstones::new(Duration::from_secs(60), 3);
        for (i, s) in ["a", "b", "c", "d"].into_iter().enumerate() {
            t.insert(
                id(s),
                AbortReason::Operator,
                t0 + Duration::from_millis(i as u64),
            );
        }
        assert_eq!(t.len(), 3);
        assert_eq!(t.evicted(), 1);
        assert!(t.get(&id("a"), t0).is_none());
        assert!(t.get(&id("d"), t0).is_some());
    }

    #[test]
    fn refresh_keeps_first_reason_and_queue_bounded() {
        let t0 = Instant::now();
        let mut t = Tombstones::new(Duration::from_secs(10), 2);
        t.insert(id("a"), AbortReason::MaxAge, t0);
        for i in 0..100 {
            t.insert(id("a"), AbortReason::Operator, t0 + Duration::from_secs(i));
        }
        let got = t.get(&id("a"), t0 + Duration::from_secs(105)).unwrap();
        assert_eq!(got.reason, AbortReason::MaxAge);
        assert!(t.order.len() <= 4);
        assert_eq!(t.len(), 1);
    }
}
