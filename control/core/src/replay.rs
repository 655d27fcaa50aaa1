//! Replay memory for abort signatures: a signature accepted once is refused (409) for the
//! rest of the skew window. Bounded without ever forgetting a live signature (which would
//! let its replay be answered as a new call): when every slot holds a live one, a new
//! signature is refused as [`Seen::Full`] (the caller answers 503, retry) until the oldest
//! leave the window. Kept apart from the admission lock; forgetting is by whole seconds of
//! `t` (a `BTreeMap` keyed by `t`), so no call scans the memory.

use kvguard_contract::signature::Signature;
use kvguard_contract::MAX_SKEW_SECS;
use std::collections::{BTreeMap, HashSet};

/// What [`ReplayMemory::check_and_remember`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Not seen before: remembered now.
    Fresh,
    /// Seen before within its window: a replay.
    Replay,
    /// Not seen, but the memory is full of live signatures: not remembered, so the call
    /// must be refused (it could not be recognised if it came again).
    Full,
}

/// Remembered signatures, keyed by `(t, v1)`.
#[derive(Debug)]
pub struct ReplayMemory {
    cap: usize,
    seen: HashSet<(u64, [u8; 32])>,
    by_t: BTreeMap<u64, Vec<[u8; 32]>>,
    full: u64,
}

impl ReplayMemory {
    /// An empty memory holding at most `cap` signatures.
    pub fn new(cap: usize) -> Self {
        ReplayMemory {
            cap: cap.max(1),
            seen: HashSet::new(),
            by_t: BTreeMap::new(),
            full: 0,
        }
    }

    /// Forgets signatures that can no longer verify (their `t` is out of the window):
    /// whole seconds at a time, oldest first; the work is what is forgotten.
    fn purge(&mut self, now_unix: u64) {
        while let Some(entry) = self.by_t.first_entry() {
            if entry.key().saturating_add(MAX_SKEW_SECS) >= now_unix {
                break;
            }
            let t = *entry.key();
            for v1 in entry.remove() {
                self.seen.remove(&(t, v1));
            }
        }
    }

    /// Records a verified signature at `now_unix`.
    pub fn check_and_remember(&mut self, sig: &Signature, now_unix: u64) -> Seen {
        self.purge(now_unix);
        let k = (sig.t, sig.mac);
        if self.seen.contains(&k) {
            return Seen::Replay;
        }
        if self.seen.len() >= self.cap {
            self.full += 1;
            return Seen::Full;
        }
        self.seen.insert(k);
        self.by_t.entry(sig.t).or_default().push(sig.mac);
        Seen::Fresh
    }

    /// Signatures remembered now.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether none are remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// Signatures refused so far because the memory was full.
    pub fn refused_full(&self) -> u64 {
        self.full
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(t: u64, b: u8) -> Signature {
        Signature { t, mac: [b; 32] }
    }

    #[test]
    fn replay_within_window_then_forgotten() {
        let mut m = ReplayMemory::new(100);
        assert!(m.is_empty());
        assert_eq!(m.check_and_remember(&sig(1000, 1), 1000), Seen::Fresh);
        assert!(!m.is_empty());
        assert_eq!(m.check_and_remember(&sig(1000, 1), 1010), Seen::Replay);
        assert_eq!(m.check_and_remember(&sig(1000, 2), 1010), Seen::Fresh);
        // At the window's last second the signature is still remembered.
        assert_eq!(
            m.check_and_remember(&sig(1000, 1), 1000 + MAX_SKEW_SECS),
            Seen::Replay
        );
        // Out of the window the signature is stale anyway; memory is released.
        assert_eq!(m.check_and_remember(&sig(1100, 3), 1100), Seen::Fresh);
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn when_full_stale_signatures_make_room_and_a_live_one_is_never_forgotten() {
        let mut m = ReplayMemory::new(2);
        assert_eq!(m.check_and_remember(&sig(1000, 1), 1000), Seen::Fresh);
        assert_eq!(
            m.check_and_remember(&sig(1000 - MAX_SKEW_SECS, 2), 1000),
            Seen::Fresh
        );
        // A second later the second one is out of the window: it makes room.
        assert_eq!(m.check_and_remember(&sig(1001, 3), 1001), Seen::Fresh);
        assert_eq!(m.refused_full(), 0);
        // Full of live signatures: a new one is refused, none is forgotten.
        assert_eq!(m.check_and_remember(&sig(1001, 4), 1001), Seen::Full);
        assert_eq!(m.refused_full(), 1);
        assert_eq!(m.check_and_remember(&sig(1000, 1), 1001), Seen::Replay);
        assert_eq!(m.check_and_remember(&sig(1001, 3), 1001), Seen::Replay);
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn bounded() {
        let mut m = ReplayMemory::new(3);
        for b in 0..10 {
            let want = if b < 3 { Seen::Fresh } else { Seen::Full };
            assert_eq!(m.check_and_remember(&sig(1000, b), 1000), want);
        }
        assert_eq!(m.len(), 3);
        assert_eq!(m.refused_full(), 7);
        // Each refused one is still not a replay of anything: once room is made, fresh.
        assert_eq!(
            m.check_and_remember(&sig(1000 + 2 * MAX_SKEW_SECS, 9), 1001 + MAX_SKEW_SECS),
            Seen::Fresh
        );
        assert_eq!(m.len(), 1);
    }
}
