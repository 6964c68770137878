//! Rotary position embeddings on the fused QKV rows, and their gradient.

use anyhow::Result;

use super::attention::AttnShape;
use super::memory::MemoryOps;
use crate::tensor::Tensor;

pub trait RopeOps: MemoryOps {
    /// Rotates the query and key heads of `qkv` `[B·T, qkv_width]` in place, HF rotate-half
    /// style. `freqs` is `[T, head_dim/2, 2]` f32 of (cos, sin) per position and pair. A
    /// token's position is its place in its sequence, or with `docs` in its document (only
    /// the starts are read; `AttentionOps` describes them).
    fn rope_forward(
        &self, qkv: &Tensor<Self>, freqs: &Tensor<Self>, shape: AttnShape,
        docs: Option<&Tensor<Self>>,
    ) -> Result<()>;
    /// The inverse rotation, applied in place to the gradient. With `amax`, also
    /// `amax[0] = max(amax[0], max |dqkv|)` over all of dqkv as stored, value heads included:
    /// the QKV projection's output gradient, whose FP8 copy scales by it. With `bias`
    /// `(dbias, accumulate)`, also the QKV projection's bias gradient from the rotated
    /// gradient, `dbias (+)= Σ_m dqkv[m]` as `bias_backward` gives it, in the same pass where
    /// the backend can.
    #[allow(clippy::too_many_arguments)]
    fn rope_backward(
        &self, dqkv: &Tensor<Self>, freqs: &Tensor<Self>, shape: AttnShape,
        docs: Option<&Tensor<Self>>, amax: Option<&Tensor<Self>>,
        bias: Option<(&Tensor<Self>, bool)>,
    ) -> Result<()>;
}
