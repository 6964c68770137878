//! `--optimizer-in-backward`: each block's AdamW update runs in the step's last backward, as
//! soon as that backward has finished the block's gradients, instead of in a pass of its own
//! after it (torchtitan's optimizer in backward). The blocks below are still to come, so the
//! update of one block runs beside the backward of the next, and where the blocks stream from
//! host memory (`--offload-weights`, `--offload-gradients`) their gradients never leave the
//! device: the bus carries the updated weights out instead.
//!
//! Offloaded state (`--offload-opt-m`, `--offload-opt-v`, `--offload-master`) streams through
//! two device slots a category, which the blocks take in turn as the weights' do
//! (`shared_slots`): a block's state comes in one block ahead of its update, on a copy
//! engine, and goes back out after it. So the step waits on the bus only where a block's
//! copies outlast the backward beside them, not for a pass that reads all the state over it.
//!
//! Every element's update depends only on its own tensor, so updating a block at a time
//! gives the bits of the update of all at once. What it cannot do is wait for the step's
//! gradient norm, which is known only once the last block's backward is done: it needs
//! `--grad-clip 0`, a guard that does not skip (`--on-spike warn`), and a run that stops,
//! rather than skips, a step whose loss or norm is not finite (`refuse_after_update`).

use std::ops::Range;

use anyhow::{Result, bail};

use super::Options;
use super::guard::OnSpike;
use crate::backend::Backend;
use crate::model::params::{LayerParams, ParamSpec, Params};
use crate::model::shared_slots;
use crate::model::streaming::{self, Ring};
use crate::tensor::{DType, Tensor};

/// Checks that a run of `world` ranks can update in the backward, naming the flag in the way.
pub fn check(o: &Options, world: usize) -> Result<()> {
    let why = if world > 1 || o.optimizer.zero_level > 0 {
        "it runs on one GPU, without --zero-level and --gpus"
    } else if o.optimizer.grad_clip != 0.0 {
        "the update runs before the step's gradient norm is known, so it cannot clip by it: add \
         --grad-clip 0"
    } else if o.guard.on_spike == OnSpike::Skip {
        "the update runs before the step's loss is known, so a spike cannot skip it: use \
         --on-spike warn"
    } else if o.health_every > 0 {
        "--health-every measures every tensor before and after the update, which runs in the \
         backward: leave it out"
    } else if o.optimizer.opt_m_dtype == DType::Q8
        && (o.optimizer.offload.opt_m || o.optimizer.offload.opt_v)
    {
        "offloaded Q8 moments do not stream through the device: keep them on it, or use bf16 \
         moments"
    } else {
        return Ok(());
    };
    bail!("--optimizer-in-backward cannot be used here: {why}")
}

/// What stops a run that updated in the backward, where the step turns out not to be finite
/// (`reason`): the update has already happened.
pub fn refuse_after_update(step: u64, reason: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "step {step}: {reason}, and --optimizer-in-backward had already applied the step's \
         update; the run stops so that no later step builds on it. Continue from the last \
         checkpoint, with a lower --lr or without --optimizer-in-backward (whose guard skips \
         such a step)"
    )
}

/// One offloaded category of state: its tensors in host memory, in `Params` order, and its
/// device slots (an allocation of `shared_slots::slot_specs`, two blocks' worth).
pub struct Streamed<'a, B: Backend> {
    pub state: &'a [Tensor<B>],
    pub slots: Vec<Tensor<B>>,
}

/// The blocks' state as the updates in the backward reach it: where each block's tensors of
/// each category are, and the rings of the offloaded ones.
pub struct BlockState<B: Backend> {
    /// Each block's tensors, as indices in `Params` order (and in the state's: one rank keeps
    /// all of it).
    blocks: Vec<Range<usize>>,
    /// The rings of m, v and the master copy, where offloaded; in the update, each block's
    /// slot takes the place of its own tensors.
    rings: [Option<Ring<B>>; 3],
}

impl<B: Backend> BlockState<B> {
    /// For a model laid out as `layout`, where m, v and the master copy stream: each
    /// offloaded one's tensors (in `Params` order) with its slots (`Streamed`),
    /// `None` for one on the device or absent.
    pub fn new(layout: &Params<ParamSpec>, streamed: [Option<Streamed<'_, B>>; 3]) -> Self {
        let layers = layout.layers.len();
        let blocks: Vec<Range<usize>> = (0..layers).map(|l| layout.block_indices(l)).collect();
        let none_kept = vec![false; layers];
        let ring = |Streamed { state, slots }: Streamed<B>| {
            let host: Vec<LayerParams<Tensor<B>>> = (layout.layers.iter().zip(&blocks))
                .map(|(block, range)| streaming::block_of(block, &state[range.clone()]))
                .collect();
            // The tensors outside the blocks keep their own; only the blocks' views of the
            // slots are taken.
            let outside = (state.iter().zip(layout.in_blocks()))
                .filter(|(_, in_block)| !in_block)
                .map(|(t, _)| t.clone());
            let tensors = outside.chain(slots).collect();
            let on_device = shared_slots::build(layout, Some(&none_kept), tensors);
            Ring::new(host, on_device.layers)
        };
        BlockState {
            rings: streamed.map(|s| s.map(ring)),
            blocks,
        }
    }

    /// Block `l`'s tensors, as indices in `Params` order.
    pub fn block(&self, l: usize) -> Range<usize> {
        self.blocks[l].clone()
    }

    /// Before the backward's first update: the top two blocks' offloaded state starts in.
    pub fn begin(&self, b: &B) -> Result<()> {
        let layers = self.blocks.len();
        for ring in self.rings.iter().flatten() {
            (layers.saturating_sub(2)..layers)
                .rev()
                .try_for_each(|l| ring.fetch(b, l))?;
        }
        Ok(())
    }

    /// Before block `l`'s update: its offloaded state is in.
    pub fn before_update(&self, b: &B, l: usize) -> Result<()> {
        self.rings.iter().flatten().try_for_each(|r| r.wait(b, l))
    }

    /// Where block `l`'s update finds field `f` of m, v and the master copy: its slot where
    /// offloaded, else `own` (the state's own tensor).
    pub fn place<'a>(
        &'a self, l: usize, f: usize, own: [Option<&'a Tensor<B>>; 3],
    ) -> [Option<&'a Tensor<B>>; 3] {
        std::array::from_fn(|c| match &self.rings[c] {
            Some(ring) => ring.slot(l).iter().nth(f),
            None => own[c],
        })
    }

    /// After block `l`'s update is enqueued: its offloaded state starts out, and block
    /// l − 2's into the slots after it.
    pub fn after_update(&self, b: &B, l: usize) -> Result<()> {
        for ring in self.rings.iter().flatten() {
            ring.store(b, l)?;
            if l >= 2 {
                ring.fetch(b, l - 2)?;
            }
        }
        Ok(())
    }

    /// After the backward: what reads the state in host memory (the next step's updates,
    /// a checkpoint) waits until every block's is back.
    pub fn end(&self, b: &B) -> Result<()> {
        self.rings
            .iter()
            .flatten()
            .try_for_each(|r| r.wait_for_host(b))
    }
}
