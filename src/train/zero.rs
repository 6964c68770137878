//! ZeRO-1 (`--zero-level 1`): each rank keeps the optimizer state (moments and master copy)
//! of some of the parameter tensors, updates only those, and sends the updated weights to
//! the other ranks. Whole tensors are shared out, so each update is the one an unsharded
//! run computes, bit for bit: AdamW treats every element on its own, seeded by its tensor's
//! place in the model, not by its place in a rank's share.

/// The rank that keeps each tensor's state, for tensors of `sizes` elements (in `Params`
/// order): largest first, each to the rank holding the fewest elements so far (the lowest
/// such rank on ties), so that no rank holds more than the smallest share plus one tensor.
pub fn owners(sizes: &[usize], world: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    // Stable: equal sizes keep their model order.
    order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
    let mut held = vec![0usize; world];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let rank = (0..world).min_by_key(|&r| held[r]).expect("world ≥ 1");
        owner[i] = rank;
        held[rank] += sizes[i];
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::owners;

    #[test]
    fn one_rank_owns_everything() {
        assert_eq!(owners(&[5, 1, 9], 1), vec![0, 0, 0]);
    }

    #[test]
    fn shares_are_balanced_to_within_one_tensor() {
        // An embedding much larger than the rest, then layers of equal tensors.
        let mut sizes = vec![1000];
        for _ in 0..8 {
            sizes.extend([64, 192, 64, 16, 400, 200]);
        }
        for world in 2..=4 {
            let owner = owners(&sizes, world);
            let mut held = vec![0; world];
            for (i, &r) in owner.iter().enumerate() {
                held[r] += sizes[i];
            }
            let (min, max) = (held.iter().min().unwrap(), held.iter().max().unwrap());
            assert!(max - min <= 1000, "world {world}: {held:?}");
            assert!(held.iter().all(|&h| h > 0), "world {world}: {held:?}");
        }
        assert_eq!(owners(&[3, 3, 3, 3], 2), vec![0, 1, 0, 1]);
    }
}
