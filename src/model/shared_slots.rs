//! Parameter-shaped sets (the weights, or their gradients) of which a rank keeps only some
//! blocks' own tensors, the blocks it updates (`kept`): every other block's are one of two
//! shared slots, which the blocks take in turn, in the backward's order from the last. The
//! embedding's, final norm's and LM head's tensors always have their own.
//!
//! - ZeRO-2's gradients: a block not kept is written into its slot and sent to the block's
//!   rank as soon as its backward is done. A slot comes round again two such blocks later,
//!   so the block then written waits for that send (`BlockEvent::Writing`), not for the one
//!   before it.
//! - ZeRO-3's weights: a block not kept is received into its slot from the block's rank
//!   before each pass reads it (`BlockEvent::Weights`).

use super::params::{LayerParams, ParamSpec, Params, from_list};
use crate::backend::Backend;
use crate::tensor::{Tensor, TensorSpec};

/// The tensors of a set named `prefix` + parameter name: every kept block's and every
/// non-block parameter's in `Params` order, then the slots' (one block's shapes each, named
/// `{prefix}slot{s}.…`).
pub fn specs(layout: &Params<ParamSpec>, prefix: &str, kept: Option<&[bool]>) -> Vec<TensorSpec> {
    let grad = |s: &TensorSpec, name: String| TensorSpec::new(name, &s.shape, s.dtype);
    let own = |p: &ParamSpec| grad(&p.tensor, format!("{prefix}{}", p.tensor.name));
    let Some(kept) = kept else {
        return layout.iter().map(own).collect();
    };
    let mut out: Vec<TensorSpec> = std::iter::once(&layout.embed)
        .chain(kept_blocks(layout, kept).flat_map(|l| l.iter()))
        .chain(std::iter::once(&layout.final_norm))
        .chain(layout.lm_head.as_ref())
        .map(own)
        .collect();
    let block: Vec<TensorSpec> = layout.layers[0].iter().map(|p| p.tensor.clone()).collect();
    out.extend(slot_specs(layout, prefix, slot_count(kept), &block));
    out
}

/// `count` slots of one block's tensors, shaped and typed as `template` (one spec per field
/// of a block, in field order) and named `{prefix}slot{s}.{field}`.
pub fn slot_specs(
    layout: &Params<ParamSpec>, prefix: &str, count: usize, template: &[TensorSpec],
) -> Vec<TensorSpec> {
    let fields: Vec<(&ParamSpec, &TensorSpec)> = layout.layers[0].iter().zip(template).collect();
    (0..count)
        .flat_map(|s| {
            fields.iter().map(move |(p, t)| {
                // `layers.0.qkv` → `qkv`
                let field = p.tensor.name.splitn(3, '.').last().unwrap_or_default();
                TensorSpec::new(format!("{prefix}slot{s}.{field}"), &t.shape, t.dtype)
            })
        })
        .collect()
}

/// The set of `layout`'s tensors from the allocation of `specs(layout, _, kept)`: the blocks
/// not kept alias the slots.
pub fn build<B: Backend>(
    layout: &Params<ParamSpec>, kept: Option<&[bool]>, mut tensors: Vec<Tensor<B>>,
) -> Params<Tensor<B>> {
    let Some(kept) = kept else {
        return from_list(layout, tensors);
    };
    let per_block = layout.layers[0].iter().count();
    let slot_tensors = tensors.split_off(tensors.len() - slot_count(kept) * per_block);
    let slots: Vec<Vec<Tensor<B>>> = (slot_tensors.chunks(per_block))
        .map(<[Tensor<B>]>::to_vec)
        .collect();
    let homes = slots_of(kept);
    let mut own = tensors.into_iter();
    let mut take = || own.next().expect("one tensor per parameter kept");
    let embed = take();
    let layers = (layout.layers.iter().zip(&homes))
        .map(|(block, home)| {
            let mut from_slot = home.map(|s| slots[s].iter().cloned());
            block
                .try_map(&mut |_| {
                    Ok(match &mut from_slot {
                        Some(slot) => slot.next().expect("a slot holds one block"),
                        None => take(),
                    })
                })
                .expect("infallible")
        })
        .collect();
    let final_norm = take();
    let lm_head = layout.lm_head.as_ref().map(|_| take());
    Params {
        embed,
        layers,
        final_norm,
        lm_head,
    }
}

fn kept_blocks<'a, T>(
    layout: &'a Params<T>, kept: &'a [bool],
) -> impl Iterator<Item = &'a LayerParams<T>> {
    (layout.layers.iter().zip(kept))
        .filter(|(_, k)| **k)
        .map(|(l, _)| l)
}

fn slot_count(kept: &[bool]) -> usize {
    kept.iter().filter(|&&k| !k).count().min(2)
}

/// Each block's slot, `None` for a kept block: the others take slots 0, 1, 0, … in the
/// backward's order, from the last block down.
pub fn slots_of(kept: &[bool]) -> Vec<Option<usize>> {
    let mut out = vec![None; kept.len()];
    for (i, l) in (0..kept.len()).rev().filter(|&l| !kept[l]).enumerate() {
        out[l] = Some(i % 2);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryOps;
    use crate::backend::cpu::Cpu;
    use crate::model::ModelConfig;
    use crate::tensor::DType;

    #[test]
    fn blocks_not_kept_take_the_two_slots_in_turn_from_the_last() {
        assert_eq!(
            slots_of(&[false, true, false, false, true, false]),
            [Some(1), None, Some(0), Some(1), None, Some(0)]
        );
        assert_eq!(slots_of(&[true, false]), [None, Some(0)]);
    }

    #[test]
    fn kept_blocks_have_their_own_tensors_and_the_others_share_the_slots() {
        let json = serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 32, "tie_word_embeddings": false,
        });
        let config = ModelConfig::from_json(&json, "test").unwrap();
        let layout = Params::layout(&config, DType::F32);
        let kept = [true, false, false, false];
        let specs = specs(&layout, "grad.", Some(&kept));
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert!(names.contains(&"grad.layers.0.qkv"), "{names:?}");
        assert!(!names.iter().any(|n| n.starts_with("grad.layers.1")));
        assert!(names.contains(&"grad.slot1.down"), "{names:?}");
        assert!(!names.iter().any(|n| n.starts_with("grad.slot2")));
        let per_block = layout.layers[0].iter().count();
        assert_eq!(
            specs.len(),
            layout.iter().count() - 3 * per_block + 2 * per_block
        );

        let b = Cpu::<f32>::new();
        let tensors = b.allocate("gradients", &specs).unwrap();
        let grads = build(&layout, Some(&kept), tensors);
        let fill = |t: &Tensor<Cpu<f32>>, v: f32| b.fill(t, v).unwrap();
        let first = |t: &Tensor<Cpu<f32>>| b.download(t).unwrap()[0];
        // Blocks 3 and 1 share slot 0, block 2 has slot 1, block 0 its own.
        fill(&grads.layers[3].down, 3.0);
        assert_eq!(first(&grads.layers[1].down), 3.0);
        fill(&grads.layers[2].down, 2.0);
        fill(&grads.layers[0].down, 0.5);
        assert_eq!(first(&grads.layers[1].down), 3.0);
        assert_eq!(first(&grads.layers[2].down), 2.0);
        assert_eq!(grads.layers[2].qkv.shape, layout.layers[2].qkv.tensor.shape);
    }
}
