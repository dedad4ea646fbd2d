//! Deriving an epoch's read order from a seed, exactly as
//! `docs/protocol.md` specifies, so the trainer and the stage compute the same
//! permutation independently.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64: small, fast, and trivial to reimplement bit for bit in Python.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64, epoch: u64) -> Self {
        Self(seed.wrapping_add(epoch.wrapping_mul(GOLDEN)))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Returns a uniform value in `0..m` by rejection sampling.
    fn below(&mut self, m: u64) -> u64 {
        let limit = (u128::from(u64::MAX) + 1) / u128::from(m) * u128::from(m);
        loop {
            let r = self.next();
            if u128::from(r) < limit {
                return r % m;
            }
        }
    }
}

/// Returns the order of `n` files for one epoch: the identity, or a
/// Fisher-Yates shuffle driven by SplitMix64 seeded with `seed` and `epoch`.
pub fn permutation(n: u32, seed: u64, epoch: u64, shuffle: bool) -> Vec<u32> {
    let mut order: Vec<u32> = (0..n).collect();
    if shuffle {
        let mut rng = SplitMix64::new(seed, epoch);
        for i in (1..order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// Returns rank `rank`'s share of `order` among `world_size` ranks: every
/// `world_size`-th entry starting at `rank`. Shares are disjoint, cover every
/// entry, and differ in length by at most one.
pub fn shard(order: &[u32], rank: u32, world_size: u32) -> Vec<u32> {
    order
        .iter()
        .skip(rank as usize)
        .step_by(world_size.max(1) as usize)
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_permutation() {
        // The same vectors are checked by the Python client's tests.
        assert_eq!(permutation(10, 42, 0, true), [0, 9, 5, 8, 6, 4, 7, 2, 1, 3]);
        assert_eq!(permutation(10, 42, 1, true), [2, 3, 9, 7, 5, 8, 6, 4, 0, 1]);
        assert_eq!(permutation(4, 42, 0, false), [0, 1, 2, 3]);
        assert!(permutation(0, 1, 1, true).is_empty());
        assert_eq!(permutation(1, 1, 1, true), [0]);
    }

    #[test]
    fn epochs_differ() {
        assert_ne!(permutation(1000, 7, 0, true), permutation(1000, 7, 1, true));
    }

    proptest! {
        #[test]
        fn permutation_is_a_permutation(n in 0u32..2000, seed: u64, epoch: u64) {
            let mut order = permutation(n, seed, epoch, true);
            order.sort_unstable();
            prop_assert_eq!(order, (0..n).collect::<Vec<_>>());
        }

        #[test]
        fn shards_cover_without_loss_or_duplication(n in 0u32..3000, world in 1u32..17, seed: u64) {
            let order = permutation(n, seed, 0, true);
            let shards: Vec<Vec<u32>> = (0..world).map(|r| shard(&order, r, world)).collect();
            let lengths: Vec<usize> = shards.iter().map(Vec::len).collect();
            let (min, max) = (lengths.iter().min().unwrap(), lengths.iter().max().unwrap());
            prop_assert!(max - min <= 1);
            let mut all: Vec<u32> = shards.concat();
            all.sort_unstable();
            prop_assert_eq!(all, (0..n).collect::<Vec<_>>());
        }
    }
}
