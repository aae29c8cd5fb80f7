//! The one seeded generator every room draws from where a draw must be reproducible from
//! a seed on every platform and with every version of our dependencies (checkpointed data
//! orders, built-in models, conformance inputs): `rand`'s `StdRng` does not promise that
//! across releases. SplitMix64 (Steele, Lea and Flood, 2014; the generator Java's
//! `SplittableRandom` uses): a 64-bit counter through a strong mixer.

/// SplitMix64 from a raw state.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// The golden-ratio increment.
    pub const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

    /// The generator whose state is `state` (its first draw is `mix(state + GAMMA)`).
    pub fn from_state(state: u64) -> Self {
        SplitMix64(state)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(Self::GAMMA);
        mix(self.0)
    }

    /// A uniform draw from `0..n` (`n > 0`), without modulo bias (Lemire, 2019).
    pub fn below(&mut self, n: u64) -> u64 {
        let threshold = n.wrapping_neg() % n;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(n);
            if (product as u64) >= threshold {
                return (product >> 64) as u64;
            }
        }
    }
}

/// The SplitMix64 output function: nearby inputs give unrelated outputs.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_the_reference() {
        // The first outputs of the reference SplitMix64 (Vigna's splitmix64.c) from state 0.
        let mut rng = SplitMix64::from_state(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(rng.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn below_is_in_range_and_covers_it() {
        let mut rng = SplitMix64::from_state(7);
        let mut seen = [0u32; 5];
        for _ in 0..5000 {
            seen[rng.below(5) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| (850..1150).contains(&c)), "{seen:?}");
    }
}
