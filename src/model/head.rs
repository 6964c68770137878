//! The LM head and cross-entropy, run over the tokens in chunks so that only one chunk of
//! logits exists at a time. In training, each chunk's logits are turned into their gradient
//! in place and consumed at once by the two backward matmuls.

use anyhow::Result;

use super::activations::Activations;
use super::backward::BlockEvents;
use super::transformer::Transformer;
use crate::backend::{Backend, Matmul};

/// What one training micro-step asks of the loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossOptions {
    /// Multiplies every token's loss gradient: 1 / (trained tokens over all micro-steps).
    pub grad_scale: f32,
    pub z_loss: f32,
    /// Add into the parameter gradients instead of overwriting them (micro-steps after the first).
    pub accumulate: bool,
}

impl<B: Backend> Transformer<B> {
    fn head_chunks(&self) -> impl Iterator<Item = (usize, usize)> + use<B> {
        let (n, rows) = (self.tokens_per_step(), self.acts().logits.rows());
        (0..n)
            .step_by(rows)
            .map(move |start| (start, (start + rows).min(n)))
    }

    /// `targets` into `a`'s buffer and, for training, the loss gradient's scale.
    pub(crate) fn upload_targets(
        &self, b: &B, a: &Activations<B>, targets: &[i32], train: Option<LossOptions>,
    ) -> Result<()> {
        b.upload_i32(&a.targets, targets)?;
        match train {
            Some(t) => b.upload(&a.grad_scale, &[t.grad_scale]),
            None => Ok(()),
        }
    }

    /// Per-token losses of `a`'s `lnf` against its `targets` (uploaded by `upload_targets`,
    /// with `train`'s scale), left in its `losses`; with `train` given, also the gradient of
    /// `lnf` into `dln` and the head's weight gradient.
    pub(crate) fn head(
        &self, b: &B, a: &Activations<B>, z_loss: f32, train: Option<LossOptions>,
    ) -> Result<()> {
        let head = self.params.head();
        for (i, (start, end)) in self.head_chunks().enumerate() {
            let logits = a.logits.narrow_rows(0, end - start);
            let lnf = a.lnf.narrow_rows(start, end);
            b.matmul(&logits, &lnf, head, None, Matmul::FORWARD)?;
            let (losses, targets) = (
                a.losses.narrow_rows(start, end),
                a.targets.narrow_rows(start, end),
            );
            let grad_scale = train.map(|_| &a.grad_scale);
            b.cross_entropy(&logits, &losses, &targets, z_loss, grad_scale)?;
            if let Some(t) = train {
                b.matmul(
                    &a.dln.narrow_rows(start, end),
                    &logits,
                    head,
                    None,
                    Matmul::BACKWARD_INPUT,
                )?;
                let dhead = self.grads().head();
                b.matmul(
                    dhead,
                    &logits,
                    &lnf,
                    None,
                    Matmul::backward_weight(t.accumulate || i > 0),
                )?;
            }
        }
        Ok(())
    }

    /// Forward only: per-token losses stay on the device (see `loss_sum`).
    pub fn forward_loss(
        &mut self, b: &B, tokens: &[i32], targets: &[i32], z_loss: f32,
    ) -> Result<()> {
        self.forward_hidden(b, tokens)?;
        self.upload_targets(b, self.acts(), targets, None)?;
        self.head(b, self.acts(), z_loss, None)
    }

    /// `forward_loss`, telling `events` of the sharded weights each block reads
    /// (`forward_hidden_with`).
    pub fn forward_loss_with(
        &mut self, b: &B, tokens: &[i32], targets: &[i32], z_loss: f32, events: &mut BlockEvents<B>,
    ) -> Result<()> {
        self.forward_hidden_with(b, tokens, events)?;
        self.upload_targets(b, self.acts(), targets, None)?;
        self.head(b, self.acts(), z_loss, None)
    }

    /// The last pass's per-token losses `[B·T]` (0 where the target is ignored).
    pub fn losses(&self) -> &crate::tensor::Tensor<B> {
        &self.acts().losses
    }

    /// Micro-batch `m`'s per-token losses after a layer-major pass (`layer_major`).
    pub fn micro_batch_losses(&self, m: usize) -> &crate::tensor::Tensor<B> {
        &self.micro_batches[m].losses
    }

    /// The sum of the last pass's per-token losses (ignored targets count 0). Waits for the device.
    pub fn loss_sum(&self, b: &B) -> Result<f64> {
        Ok(b.download_f64(&self.acts().losses)?.iter().sum())
    }

    /// Logits of one token position after `forward_hidden`, for sampling.
    pub fn logits_at(&self, b: &B, row: usize) -> Result<Vec<f32>> {
        self.head_row(b, row)?;
        b.download(&self.acts().logits.narrow_rows(0, 1))
    }

    /// The LM head of position `row` into the first row of `logits`.
    pub(crate) fn head_row(&self, b: &B, row: usize) -> Result<()> {
        b.matmul(
            &self.acts().logits.narrow_rows(0, 1),
            &self.acts().lnf.narrow_rows(row, row + 1),
            self.params.head(),
            None,
            Matmul::FORWARD,
        )
    }
}
