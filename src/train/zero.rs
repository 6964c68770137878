//! ZeRO sharding over the ranks of a data-parallel run (`--zero-level`).
//!
//! Level 1: each rank keeps the optimizer state (moments and master copy) of some of the
//! parameter tensors, updates only those, and sends the updated weights to the other ranks.
//! Level 2 also shards the blocks' gradients: each block's go to the rank that updates it,
//! which alone keeps memory for them (`model::shared_slots`). Level 3 also shards the
//! blocks' weights: each block's are kept by the same rank, and the others receive them into
//! two slots before each pass reads them (`model::BlockEvent::Weights`). Whole tensors are
//! shared out, so each
//! update is the one an unsharded run computes, bit for bit: AdamW treats every element on
//! its own, seeded by its tensor's place in the model, not by its place in a rank's share.

use super::options::OptimizerOptions;
use crate::model::Params;
use crate::model::params::ParamSpec;

/// Which rank updates what, when the state is sharded.
pub struct Owners {
    /// The rank that updates each parameter tensor, in `Params` order.
    pub tensors: Vec<usize>,
    /// Level 2: the rank that updates each block, and keeps its gradients.
    pub blocks: Option<Vec<usize>>,
}

impl Owners {
    /// Whether rank `rank` keeps each block's gradients; `None` where every rank keeps all.
    pub fn kept_blocks(&self, rank: usize) -> Option<Vec<bool>> {
        let blocks = self.blocks.as_ref()?;
        Some(blocks.iter().map(|&r| r == rank).collect())
    }
}

/// The owners of `layout`'s tensors over `world` ranks under `options.zero_level`; `None`
/// where nothing is sharded (level 0, or one rank).
pub fn owners_of(
    layout: &Params<ParamSpec>, world: usize, options: &OptimizerOptions,
) -> Option<Owners> {
    let numel = |p: &ParamSpec| p.tensor.numel();
    if !shards(world, options.zero_level) {
        return None;
    }
    match options.zero_level {
        1 => Some(Owners {
            tensors: owners(&layout.iter().map(numel).collect::<Vec<_>>(), world),
            blocks: None,
        }),
        _ => {
            // Each unit weighs the bytes it holds on its owner: a block its gradients and
            // state (and at level 3 its weights), any other tensor its state only (its
            // gradient and weight are whole on every rank).
            let state_bytes = options.opt_m_dtype.size_bytes()
                + options.opt_v_dtype.size_bytes()
                + options.master_dtype.map_or(0, |d| d.size_bytes());
            let element = layout.embed.tensor.dtype.size_bytes();
            // A block's gradient, and at level 3 its weight.
            let block_bytes = element * if options.zero_level >= 3 { 2 } else { 1 };
            let others: Vec<&ParamSpec> = layout.outside_blocks().collect();
            let weights: Vec<usize> = (layout.layers.iter())
                .map(|l| l.iter().map(numel).sum::<usize>() * (block_bytes + state_bytes))
                .chain(others.iter().map(|p| numel(p) * state_bytes))
                .collect();
            let units = owners(&weights, world);
            let (blocks, others) = units.split_at(layout.layers.len());
            let tensors = std::iter::once(others[0])
                .chain(
                    (layout.layers.iter().zip(blocks)).flat_map(|(l, &r)| l.iter().map(move |_| r)),
                )
                .chain(others[1..].iter().copied())
                .collect();
            Some(Owners {
                tensors,
                blocks: Some(blocks.to_vec()),
            })
        }
    }
}

/// Whether ZeRO level `level` shares anything out over `world` ranks (one rank keeps all).
pub fn shards(world: usize, level: u8) -> bool {
    level > 0 && world > 1
}

/// Whether it shares out the blocks' weights too (ZeRO-3).
pub fn shards_weights(world: usize, level: u8) -> bool {
    level >= 3 && world > 1
}

/// The rank that keeps each of the units of `sizes` (tensors, or level 2's blocks): largest
/// first, each to the rank holding the fewest so far (the lowest such rank on ties), so that
/// no rank holds more than the smallest share plus one unit.
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
    use super::{OptimizerOptions, ParamSpec, owners, owners_of};
    use crate::model::{Params, presets};
    use crate::tensor::DType;
    use crate::train::bench::bf16_adamw_options;

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

    /// Qwen2.5-0.5B on two ranks at level 2: every block's tensors go to one rank, and the
    /// bytes each rank holds (its blocks' gradients and state, its other tensors' state)
    /// differ by less than one block's.
    #[test]
    fn level_2_gives_each_block_to_one_rank_and_balances_the_bytes() {
        let layout = Params::layout(&presets::preset("qwen2.5-0.5b").unwrap(), DType::BF16);
        let options = OptimizerOptions {
            zero_level: 2,
            ..bf16_adamw_options()
        };
        let owned = owners_of(&layout, 2, &options).unwrap();
        let blocks = owned.blocks.as_ref().unwrap();
        let (grad, state) = (2, 4); // bf16 gradients; bf16 m and v, no master
        let mut held = [0; 2];
        let mut tensors = owned.tensors.iter();
        let mut take = |p: &ParamSpec, bytes: usize| {
            let rank = *tensors.next().unwrap();
            held[rank] += p.tensor.numel() * bytes;
            rank
        };
        take(&layout.embed, state);
        for (l, block) in layout.layers.iter().enumerate() {
            for p in block.iter() {
                assert_eq!(take(p, grad + state), blocks[l], "block {l}");
            }
        }
        take(&layout.final_norm, state);
        assert!(layout.lm_head.is_none() && tensors.next().is_none());
        let block: usize = layout.layers[0].iter().map(|p| p.tensor.numel()).sum();
        assert!(
            held[0].abs_diff(held[1]) < block * (grad + state),
            "{held:?}"
        );
        assert_eq!(
            owned.kept_blocks(1).unwrap().iter().filter(|&&k| k).count(),
            blocks.iter().filter(|&&r| r == 1).count()
        );
    }
}
