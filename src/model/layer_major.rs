//! A step's micro-batches run layer-major (`--layer-major`), as ml_dataflow runs them: each
//! block runs on every micro-batch before the next block runs on any, in the forward and
//! again, from the last block down, in the backward. A block's weights are then read once a
//! pass for all of them: where they stream from host memory (`streaming`) or come from
//! another rank (ZeRO-3), they cross the bus or the link once a pass of the step instead of
//! once a micro-batch, and a block's gradients are summed over the micro-batches in its own
//! slot before they go out or are updated (`backward_updating`'s `BlockEvent::Update`).
//!
//! Each micro-batch has its own activations only where they live from one block to the next
//! (`Activations`); what a block writes and reads again within its own work is shared. So a
//! block cannot leave its output in `branch` for the next block's input norm to add, as the
//! forward of one micro-batch does: right after its MLP, a block adds it into the next
//! block's input for that micro-batch (the next block's input norm, fused with the add, whose
//! normalized output the next block makes again from the sum, to the same bits), and after
//! the last block each micro-batch goes through the final norm, the LM head and the loss and
//! their backward, leaving its residual-stream gradient for the blocks' backward.
//!
//! Every parameter's gradient is summed over the micro-batches in their order, as the step of
//! one micro-batch at a time sums them, so the results are bitwise that step's, with one
//! exception: with tied embeddings, the embedding's gradient adds each micro-batch's head
//! part and lookup part in another order (all the head's first).

use anyhow::{Result, ensure};

use super::backward::BlockEvents;
use super::head::LossOptions;
use super::transformer::Transformer;
use crate::backend::{Backend, Range};

impl<B: Backend> Transformer<B> {
    /// The forward of the micro-batches `tokens` and `targets` (one `[B·T]` slice each, at
    /// most as many as the model holds, `ModelOptions::micro_batches`), layer-major, each
    /// ending in its LM head, loss and their backward: `loss` is each micro-batch's, the
    /// first writing the head's and final norm's gradients, or with `loss.accumulate` adding
    /// into them, the others adding into them. `events` is told of the sharded weights each
    /// block reads. The per-token losses stay on the device (`micro_batch_losses`);
    /// `backward_layer_major` follows.
    pub fn forward_layer_major(
        &mut self, b: &B, tokens: &[&[i32]], targets: &[&[i32]], loss: LossOptions,
        events: &mut BlockEvents<B>,
    ) -> Result<()> {
        let n = tokens.len();
        ensure!(
            (1..=self.micro_batches.len()).contains(&n) && targets.len() == n,
            "a layer-major pass of this model takes 1 to {} micro-batches of tokens and as many \
             of targets, not {n} and {}",
            self.micro_batches.len(),
            targets.len()
        );
        self.check_trains()?;
        self.in_pass = n;
        let micro_batches = &self.micro_batches[..n];
        for ((a, tokens), targets) in micro_batches.iter().zip(tokens).zip(targets) {
            self.upload_tokens(b, a, tokens)?;
            self.upload_targets(b, a, targets, Some(loss))?;
        }
        let _forward = Range::begin(b, format_args!("forward"));
        let p = &self.params;
        self.linears.begin_forward(b, p)?;
        // The gradients' abs-maxes are zeroed before the last block's forward, after which
        // each micro-batch's final norm backward reports its own.
        self.linears.begin_backward(b)?;
        self.streams.begin_forward(b)?;
        self.weights_for_forward(b, 0, events)?;
        for a in micro_batches {
            a.before_block_forward(b, 0)?;
            b.embedding_forward(a.residual.layer(0), &a.tokens, &p.embed)?;
        }
        let layers = self.config.num_layers;
        for l in 0..layers {
            let _layer = Range::begin(b, format_args!("layer {l} forward"));
            let next = l + 1 < layers;
            if next {
                // Each micro-batch's add into the next block's input norms with its weights.
                self.weights_for_forward(b, l + 1, events)?;
            }
            for (m, a) in micro_batches.iter().enumerate() {
                self.linears.set_micro_batch(m);
                self.block_forward(b, a, l, false)?;
                match next {
                    true => {
                        a.before_block_forward(b, l + 1)?;
                        self.input_norm(b, a, l + 1, true)?;
                    }
                    false => {
                        let loss = LossOptions {
                            accumulate: loss.accumulate || m > 0,
                            ..loss
                        };
                        self.final_norm(b, a)?;
                        self.head(b, a, loss.z_loss, Some(loss))?;
                        self.final_norm_backward(b, a, loss.accumulate)?;
                    }
                }
                a.block_forward_done(b, l)?;
            }
            self.streams.block_forward_done(b, l)?;
        }
        Ok(())
    }

    /// After `forward_layer_major`: every block's backward from the last, each on every
    /// micro-batch of that pass, then the embedding's. The first micro-batch writes the
    /// parameter gradients, or with `accumulate` adds into them. `events` is told of the
    /// sharded weights each block reads and of the parameter gradients once they are summed
    /// over the micro-batches; with `updates`, also of each block's update, as
    /// `backward_updating` tells it.
    pub fn backward_layer_major(
        &mut self, b: &B, accumulate: bool, events: &mut BlockEvents<B>, updates: bool,
    ) -> Result<()> {
        self.check_trains()?;
        ensure!(
            self.in_pass > 0,
            "backward_layer_major follows forward_layer_major"
        );
        let _backward = Range::begin(b, format_args!("backward"));
        self.head_done(events)?;
        let micro_batches = &self.micro_batches[..self.in_pass];
        self.backward_blocks(b, micro_batches, accumulate, events, updates)
    }
}
