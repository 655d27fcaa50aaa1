//! Replay memory for abort signatures: a signature accepted once is refused (409) for the
//! rest of the skew window. Bounded: when full, the oldest are forgotten (counted).

use kvguard_contract::signature::Signature;
use kvguard_contract::MAX_SKEW_SECS;
use std::collections::{HashSet, VecDeque};

/// Remembered signatures, keyed by `(t, v1)`.
#[derive(Debug)]
pub struct ReplayMemory {
    cap: usize,
    seen: HashSet<(u64, [u8; 32])>,
    order: VecDeque<(u64, [u8; 32])>,
    evicted: u64,
}

impl ReplayMemory {
    /// An empty memory holding at most `cap` signatures.
    pub fn new(cap: usize) -> Self {
        ReplayMemory {
            cap: cap.max(1),
            seen: HashSet::new(),
            order: VecDeque::new(),
            evicted: 0,
        }
    }

    /// Forgets signatures that can no longer verify (their `t` is out of the window).
    fn purge(&mut self, now_unix: u64) {
        // `t` is not monotonic across senders, so scan; the set is small and bounded.
        if self
            .order
            .front()
            .is_some_and(|(t, _)| t.saturating_add(MAX_SKEW_SECS) < now_unix)
            || self.order.len() >= self.cap
        {
            let seen = &mut self.seen;
            self.order.retain(|k| {
                let live = k.0.saturating_add(MAX_SKEW_SECS) >= now_unix;
                if !live {
                    seen.remove(k);
                }
                live
            });
        }
    }

    /// Records a verified signature; `false` if it was already seen (a replay).
    pub fn check_and_remember(&mut self, sig: &Signature, now_unix: u64) -> bool {
        self.purge(now_unix);
        let k = (sig.t, sig.v1);
        if self.seen.contains(&k) {
            return false;
        }
        while self.seen.len() >= self.cap {
            match self.order.pop_front() {
                Some(old) => {
                    self.seen.remove(&old);
                    self.evicted += 1;
                }
                None => break,
            }
        }
        self.seen.insert(k);
        self.order.push_back(k);
        true
    }

    /// Signatures remembered now.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether none are remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// Forgotten early because the memory was full.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(t: u64, b: u8) -> Signature {
        Signature { t, v1: [b; 32] }
    }

    #[test]
    fn replay_within_window_then_forgotten() {
        let mut m = ReplayMemory::new(100);
        assert!(m.is_empty());
        assert!(m.check_and_remember(&sig(1000, 1), 1000));
        assert!(!m.is_empty());
        assert!(!m.check_and_remember(&sig(1000, 1), 1010));
        assert!(m.check_and_remember(&sig(1000, 2), 1010));
        // Out of the window the signature is stale anyway; memory is released.
        assert!(m.check_and_remember(&sig(1100, 3), 1100));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn when_full_stale_signatures_are_forgotten_before_a_live_one_is_evicted() {
        let mut m = ReplayMemory::new(2);
        // The oldest in arrival order is the newest in `t`: it stays live the longest.
        assert!(m.check_and_remember(&sig(1000, 1), 1000));
        assert!(m.check_and_remember(&sig(1000 - MAX_SKEW_SECS, 2), 1000));
        // A second later the second one is out of the window; the memory is full.
        assert!(m.check_and_remember(&sig(1001, 3), 1001));
        assert_eq!(m.evicted(), 0, "the stale one made room");
        assert!(
            !m.check_and_remember(&sig(1000, 1), 1001),
            "a live signature is still refused as a replay"
        );
    }

    #[test]
    fn bounded() {
        let mut m = ReplayMemory::new(3);
        for b in 0..10 {
            assert!(m.check_and_remember(&sig(1000, b), 1000));
        }
        assert_eq!(m.len(), 3);
        assert_eq!(m.evicted(), 7);
    }
}
