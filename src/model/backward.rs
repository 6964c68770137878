//! The backward pass: the LM head and loss, then every block from the last (its recompute
//! pass, then its backward: `block.rs`), then the embedding; the forward read in reverse.
//!
//! Gradient rule: parameter gradients are written by the first micro-step and added into by
//! later ones (`accumulate`); the residual-stream gradient `dresidual` is added into by each
//! branch; every other activation gradient is overwritten.

use anyhow::{Result, ensure};

use super::activations::Activations;
use super::head::LossOptions;
use super::linear::Linear;
use super::transformer::{Gradients, Transformer};
use crate::backend::{Backend, Range};
use crate::tensor::Tensor;

/// What the passes tell of a block's weights and of the parameter gradients, so that they can
/// move between the ranks while the rest of the pass runs.
pub enum BlockEvent<'a, B: Backend> {
    /// Block `layer`'s weights are about to be read (by its forward, or by its recompute and
    /// backward), where they are sharded (`Weights::Kept`): on the rank that keeps them they
    /// are its own, on the others a slot that must receive them first.
    Weights {
        layer: usize,
        weights: &'a [&'a Tensor<B>],
    },
    /// Block `layer`'s backward is about to write `grads`, which under ZeRO-2 may be a slot
    /// whose previous block is still being sent.
    Writing {
        layer: usize,
        grads: &'a [&'a Tensor<B>],
    },
    /// `grads` hold their final value for the micro-batch: block `Some(l)`'s, or (`None`)
    /// the final norm's and an untied head's first, then, after every block's from the
    /// last, the embedding's.
    Done {
        layer: Option<usize>,
        grads: &'a [&'a Tensor<B>],
    },
    /// In `backward_updating`, after block `layer`'s `Done`: its gradients are final for
    /// the step, and the event updates its `weights` from `grads` where the block's ops read
    /// them, before the weights go back to host memory (where streamed) and the slots pass
    /// to the blocks below.
    Update {
        layer: usize,
        weights: &'a [&'a Tensor<B>],
        grads: &'a [&'a Tensor<B>],
    },
}

pub type BlockEvents<'a, B> = dyn FnMut(BlockEvent<'_, B>) -> Result<()> + 'a;

impl<B: Backend> Transformer<B> {
    /// Forward and backward of one micro-batch. `tokens` and `targets` are `[B·T]`; the
    /// per-token losses stay on the device (see `loss_sum`).
    pub fn forward_backward(
        &mut self, b: &B, tokens: &[i32], targets: &[i32], loss: LossOptions,
    ) -> Result<()> {
        self.forward_hidden(b, tokens)?;
        self.backward(b, targets, loss, &mut |_| Ok(()))
    }

    /// The second half of `forward_backward`, after `forward_hidden`: the LM head and its
    /// loss, then every block's backward, telling `events` of the sharded weights it reads
    /// and of the parameter gradients.
    pub fn backward(
        &mut self, b: &B, targets: &[i32], loss: LossOptions, events: &mut BlockEvents<B>,
    ) -> Result<()> {
        self.backward_pass(b, targets, loss, events, false)
    }

    /// `backward` for the last micro-batch of a step whose optimizer runs in the backward
    /// (`--optimizer-in-backward`): `events` also gets each block's `BlockEvent::Update` as
    /// soon as its gradients are final, so that the update of a block runs beside the
    /// backward of those below it. Its gradients are consumed there: streamed, they do not
    /// go out to host memory, and the updated weights do.
    pub fn backward_updating(
        &mut self, b: &B, targets: &[i32], loss: LossOptions, events: &mut BlockEvents<B>,
    ) -> Result<()> {
        self.backward_pass(b, targets, loss, events, true)
    }

    fn backward_pass(
        &mut self, b: &B, targets: &[i32], loss: LossOptions, events: &mut BlockEvents<B>,
        updates: bool,
    ) -> Result<()> {
        self.check_trains()?;
        let a = self.acts();
        self.upload_targets(b, a, targets, Some(loss))?;
        let mut pass = || {
            let _backward = Range::begin(b, format_args!("backward"));
            {
                let _head = Range::begin(b, format_args!("LM head and loss"));
                self.head(b, a, loss.z_loss, Some(loss))?;
            }
            self.linears.begin_backward(b)?;
            self.final_norm_backward(b, a, loss.accumulate)?;
            self.head_done(events)?;
            let micro_batch = &self.micro_batches[..1];
            self.backward_blocks(b, micro_batch, loss.accumulate, events, updates)
        };
        // A backward that updates the blocks takes each step's rate and seed: not recorded.
        match self.options.record_passes && !updates {
            true => {
                let mut recordings = self.recordings.borrow_mut();
                recordings.backward[loss.accumulate as usize].run(b, &mut pass)
            }
            false => pass(),
        }
    }

    pub(super) fn check_trains(&self) -> Result<()> {
        ensure!(
            self.options.gradients != Gradients::Absent,
            "this model was made forward-only (Gradients::Absent) and has no gradients"
        );
        Ok(())
    }

    /// The final norm's backward of `a`'s micro-batch, from the LM head's gradient in `dln`:
    /// the start of its residual-stream gradient. Its weight gradient is written, or with
    /// `acc` added into.
    pub(super) fn final_norm_backward(&self, b: &B, a: &Activations<B>, acc: bool) -> Result<()> {
        let (p, g) = (&self.params, self.grads());
        let last = self.config.num_layers;
        b.fill(&a.dresidual, 0.0)?;
        b.rmsnorm_backward(
            &a.dresidual,
            &g.final_norm,
            &a.dln,
            a.residual.layer(last),
            &p.final_norm,
            &a.rstdf,
            acc,
            self.linears.grad_amax(last - 1, Linear::Down).as_ref(),
        )
    }

    /// Tells `events` that the final norm's and an untied head's gradients are final.
    pub(super) fn head_done(&self, events: &mut BlockEvents<B>) -> Result<()> {
        let g = self.grads();
        events(BlockEvent::Done {
            layer: None,
            grads: &[&g.final_norm]
                .into_iter()
                .chain(&g.lm_head)
                .collect::<Vec<_>>(),
        })
    }

    /// Every block's backward from the last, then the embedding's, for each of
    /// `micro_batches` in turn within each block (their residual-stream gradients in
    /// `dresidual`, from the final norm's backward). The first micro-batch writes the
    /// parameter gradients, or with `acc` adds into them; the others add into them.
    pub(super) fn backward_blocks(
        &self, b: &B, micro_batches: &[Activations<B>], acc: bool, events: &mut BlockEvents<B>,
        updates: bool,
    ) -> Result<()> {
        self.streams.begin_backward(b, acc)?;
        for l in (0..self.config.num_layers).rev() {
            let _layer = Range::begin(b, format_args!("layer {l} backward"));
            for a in micro_batches {
                a.before_block_backward(b, l)?;
            }
            self.weights_for_backward(b, l, events)?;
            let grads: Vec<&Tensor<B>> = self.layer_grads(l).iter().collect();
            events(BlockEvent::Writing {
                layer: l,
                grads: &grads,
            })?;
            for (m, a) in micro_batches.iter().enumerate() {
                self.linears.set_micro_batch(m);
                self.block_recompute(b, a, l)?;
                // A shared slot starts afresh in every pass: its last block was sent.
                self.block_backward(b, a, l, (acc && self.keeps_grads(l)) || m > 0)?;
            }
            events(BlockEvent::Done {
                layer: Some(l),
                grads: &grads,
            })?;
            if updates {
                let weights: Vec<&Tensor<B>> = self.layer_weights(l).iter().collect();
                events(BlockEvent::Update {
                    layer: l,
                    weights: &weights,
                    grads: &grads,
                })?;
            }
            self.streams.block_backward_done(b, l, acc, updates)?;
        }
        self.streams.end_backward(b, updates)?;
        let g = self.grads();
        // With tied embeddings the head has already written this gradient.
        let tied = self.params.lm_head.is_none();
        for (m, a) in micro_batches.iter().enumerate() {
            b.embedding_backward(&g.embed, &a.tokens, &a.dresidual, acc || m > 0 || tied)?;
        }
        events(BlockEvent::Done {
            layer: None,
            grads: &[&g.embed],
        })
    }
}
