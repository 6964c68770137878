//! The loss: softmax cross-entropy with z-loss, fused with its gradient.

use anyhow::Result;

use super::memory::MemoryOps;
use crate::tensor::Tensor;

pub trait ClassifierOps: MemoryOps {
    /// Softmax cross-entropy over `logits` `[N, V]` against `targets` `[N]` (i32; -100 is
    /// ignored), with z-loss `z · lse²`. Writes `losses[N]` (f32). With `grad_scale` given
    /// (`[1]` f32, read on the device, so that a recorded pass takes each step's), replaces
    /// the logits in place by `grad_scale · ∂loss/∂logits`.
    fn cross_entropy(
        &self, logits: &Tensor<Self>, losses: &Tensor<Self>, targets: &Tensor<Self>, z_loss: f32,
        grad_scale: Option<&Tensor<Self>>,
    ) -> Result<()>;
}
