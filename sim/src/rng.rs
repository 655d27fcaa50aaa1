//! The one source of randomness: SplitMix64 from a `u64` seed (no clock, no OS entropy),
//! so a seed replays the same run on any machine.

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and good enough for schedules.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (`lo` when `hi <= lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `per_mille` / 1000.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.next_u64() % 1000 < per_mille
    }

    /// One of `items` (the first when empty is impossible: callers pass a non-empty slice).
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        let i = self.next_u64() % items.len().max(1) as u64;
        items[i as usize]
    }
}
