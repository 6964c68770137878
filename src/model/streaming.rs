//! The blocks' weights and gradients kept in pinned host memory (`--offload-weights`,
//! `--offload-gradients`) and streamed through the device, so that it holds two blocks' worth
//! of each whatever the depth.
//!
//! Each streamed set has two device slots, which the blocks take in turn (`shared_slots`:
//! block l shares its slot with blocks l ± 2), and its host tensors are the real ones: `Transformer::params` (and the
//! gradients) hold them, so the optimizer, checkpoints and export read and write them there,
//! and only a block's own ops see the slot (`layer_weights`, `layer_grads`). Copies run on a
//! copy engine beside the blocks' work (`Backend::start_copy`):
//! - weights come in one block ahead: the forward fetches block l + 2 into the slot block l
//!   has just used, while block l + 1 runs; the backward goes down the same way from the two
//!   the forward left in the slots;
//! - gradients go out as each block's backward finishes them, and the block two below,
//!   which takes that slot next, waits for that copy before it writes. With gradient
//!   accumulation, a micro-batch after the first brings each block's sum so far in, one
//!   block ahead, for its backward to add to. The optimizer's work waits for every copy out
//!   (`end_backward`).
//! - in a backward that updates each block as it finishes it (`backward_updating`), the
//!   gradients stay in their slot for the update and the updated weights go out instead.
//!
//! The same rings carry the optimizer's offloaded state for those updates
//! (`train::block_updates`).
//!
//! So a step waits on the bus only where a block's copies outlast the work beside them.

use anyhow::Result;

use super::params::{LayerParams, ParamSpec, Params};
use super::shared_slots;
use crate::backend::Backend;
use crate::tensor::{Tensor, TensorSpec};

/// Where a set of parameter-shaped tensors (the weights, or the gradients) is planned: on the
/// device, the tensors outside the blocks and, when streamed, the slots; in host memory,
/// the streamed blocks.
pub struct SplitSpecs {
    pub device: Vec<TensorSpec>,
    pub host: Vec<TensorSpec>,
}

/// The specs of `layout`'s tensors named `prefix` + name, the blocks' in host memory with two
/// device slots (`shared_slots`, none of the blocks kept) when `streamed`, else all on the
/// device.
pub fn split_specs(layout: &Params<ParamSpec>, prefix: &str, streamed: bool) -> SplitSpecs {
    if !streamed {
        return SplitSpecs {
            device: shared_slots::specs(layout, prefix, None),
            host: vec![],
        };
    }
    let own = |p: &ParamSpec| {
        TensorSpec::new(
            format!("{prefix}{}", p.tensor.name),
            &p.tensor.shape,
            p.tensor.dtype,
        )
    };
    SplitSpecs {
        device: shared_slots::specs(layout, prefix, Some(&none_kept(layout))),
        host: layout
            .layers
            .iter()
            .flat_map(|l| l.iter())
            .map(own)
            .collect(),
    }
}

fn none_kept<T>(layout: &Params<T>) -> Vec<bool> {
    vec![false; layout.layers.len()]
}

/// The tensors of a set planned by `split_specs`, as the set (blocks from host memory where
/// streamed) and, where streamed, its ring of slots.
pub fn assemble<B: Backend>(
    layout: &Params<ParamSpec>, device: Vec<Tensor<B>>, host: Vec<Tensor<B>>,
) -> (Params<Tensor<B>>, Option<Ring<B>>) {
    if host.is_empty() {
        return (super::params::from_list(layout, device), None);
    }
    // Every block's view of its slot, and the tensors outside the blocks.
    let on_device = shared_slots::build(layout, Some(&none_kept(layout)), device);
    let per_block = layout.layers[0].iter().count();
    let layers: Vec<LayerParams<Tensor<B>>> = (host.chunks(per_block))
        .map(|tensors| block_of(&layout.layers[0], tensors))
        .collect();
    let ring = Ring {
        host: layers.clone(),
        slots: on_device.layers,
    };
    let params = Params {
        layers,
        ..on_device
    };
    (params, Some(ring))
}

/// `tensors`, one block's in field order, as the block `like` is laid out.
pub fn block_of<B: Backend>(
    like: &LayerParams<ParamSpec>, tensors: &[Tensor<B>],
) -> LayerParams<Tensor<B>> {
    let mut next = tensors.iter().cloned();
    (like.try_map(&mut |_| Ok(next.next().expect("one tensor per field")))).expect("infallible")
}

/// One streamed set: every block's tensors in host memory, and each block's view of the
/// device slot it passes through.
pub struct Ring<B: Backend> {
    host: Vec<LayerParams<Tensor<B>>>,
    slots: Vec<LayerParams<Tensor<B>>>,
}

impl<B: Backend> Ring<B> {
    /// Block `l`'s slot, where its ops read and write it.
    pub fn slot(&self, l: usize) -> &LayerParams<Tensor<B>> {
        &self.slots[l]
    }

    /// The blocks streamed through `slots` (each block's view of its slot) from `host`.
    pub fn new(host: Vec<LayerParams<Tensor<B>>>, slots: Vec<LayerParams<Tensor<B>>>) -> Self {
        assert_eq!(host.len(), slots.len(), "one slot view per streamed block");
        Ring { host, slots }
    }

    /// Starts block `l`'s copy into its slot, after the ops enqueued so far (the last block
    /// to use the slot among them).
    pub fn fetch(&self, b: &B, l: usize) -> Result<()> {
        for (slot, host) in self.slot(l).iter().zip(self.host[l].iter()) {
            b.start_copy(slot, host)?;
        }
        Ok(())
    }

    /// Starts block `l`'s copy out of its slot, after the ops enqueued so far.
    pub fn store(&self, b: &B, l: usize) -> Result<()> {
        for (slot, host) in self.slot(l).iter().zip(self.host[l].iter()) {
            b.start_copy(host, slot)?;
        }
        Ok(())
    }

    /// Makes the ops enqueued from now on wait for the last copy into or out of block `l`'s
    /// slot.
    pub fn wait(&self, b: &B, l: usize) -> Result<()> {
        b.wait_for_copies_of(&self.slot(l).iter().collect::<Vec<_>>())
    }

    /// Makes the ops enqueued from now on wait for the last copy into or out of every
    /// block's host tensors.
    pub fn wait_for_host(&self, b: &B) -> Result<()> {
        let all: Vec<&Tensor<B>> = self.host.iter().flat_map(|l| l.iter()).collect();
        b.wait_for_copies_of(&all)
    }

    fn blocks(&self) -> usize {
        self.host.len()
    }
}

/// The streamed sets of a model, and what each pass does with them around each block.
pub struct Streams<B: Backend> {
    pub weights: Option<Ring<B>>,
    pub grads: Option<Ring<B>>,
}

impl<B: Backend> Streams<B> {
    /// Before the forward: the first two blocks' weights start coming in.
    pub fn begin_forward(&self, b: &B) -> Result<()> {
        if let Some(w) = &self.weights {
            (0..w.blocks().min(2)).try_for_each(|l| w.fetch(b, l))?;
        }
        Ok(())
    }

    /// Before block `l`'s forward: its weights are in.
    pub fn before_block_forward(&self, b: &B, l: usize) -> Result<()> {
        match &self.weights {
            Some(w) => w.wait(b, l),
            None => Ok(()),
        }
    }

    /// After block `l`'s forward is enqueued: block l + 2 starts into the slot it used.
    pub fn block_forward_done(&self, b: &B, l: usize) -> Result<()> {
        match &self.weights {
            Some(w) if l + 2 < w.blocks() => w.fetch(b, l + 2),
            _ => Ok(()),
        }
    }

    /// Before the backward: with `accumulate`, the top block's sum so far starts coming in.
    pub fn begin_backward(&self, b: &B, accumulate: bool) -> Result<()> {
        match &self.grads {
            Some(g) if accumulate => g.fetch(b, g.blocks() - 1),
            _ => Ok(()),
        }
    }

    /// Before block `l`'s recompute and backward: its weights are in (the forward left the
    /// last two in their slots), and its gradient slot is ready: the block that had it has
    /// gone out, and with accumulation its own sum so far has come in.
    pub fn before_block_backward(&self, b: &B, l: usize) -> Result<()> {
        if let Some(w) = &self.weights {
            w.wait(b, l)?;
        }
        match &self.grads {
            Some(g) => g.wait(b, l),
            None => Ok(()),
        }
    }

    /// After block `l`'s backward is enqueued: its gradients start out (unless `updated`,
    /// where its update has consumed them and its weights start out instead), and with
    /// `accumulate` block l − 1's sum so far comes into the slot after block l + 1's has gone
    /// out of it; block l − 2's weights start into the slot block l used. A copy into a slot
    /// starts after the last copy out of it (`Backend::start_copy`).
    pub fn block_backward_done(
        &self, b: &B, l: usize, accumulate: bool, updated: bool,
    ) -> Result<()> {
        if let Some(g) = &self.grads {
            if !updated {
                g.store(b, l)?;
            }
            if accumulate && l >= 1 {
                g.fetch(b, l - 1)?;
            }
        }
        if let Some(w) = &self.weights {
            if updated {
                w.store(b, l)?;
            }
            if l >= 2 {
                w.fetch(b, l - 2)?;
            }
        }
        Ok(())
    }

    /// After the backward: what follows (the optimizer, or after `updated` blocks anything
    /// that reads the weights in host memory) waits until every block's gradients, or
    /// weights, are out.
    pub fn end_backward(&self, b: &B, updated: bool) -> Result<()> {
        let out = match updated {
            true => &self.weights,
            false => &self.grads,
        };
        match out {
            Some(ring) => ring.wait_for_host(b),
            None => Ok(()),
        }
    }
}
