//! Causal grouped-query attention over the fused QKV rows: training's forward and backward,
//! and generation's one new position over a KV cache.

use anyhow::Result;

use super::memory::MemoryOps;
use crate::tensor::Tensor;

/// Shape of one attention call. `qkv` rows hold `q_heads` query heads, then `kv_heads`
/// key heads, then `kv_heads` value heads, each `head_dim` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    pub fn qkv_width(&self) -> usize {
        (self.q_heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// Attention's ops. `docs`, where given, packs several documents into each sequence, each of
/// which attends only within itself: `[2, B, T]` i32, the position in its sequence where each
/// token's document starts, then where it ends (exclusive). A document is a run of tokens
/// (`model::documents` finds them), so within a sequence the starts and the ends never
/// decrease and each token lies in `[start, end)`. `None` is one document a sequence.
pub trait AttentionOps: MemoryOps {
    /// Causal grouped-query attention with scale `1/sqrt(head_dim)`, each query seeing the
    /// keys at or before it in its document (`docs`).
    /// qkv: `[B·T, qkv_width]`; out: `[B·T, q_heads·head_dim]`; lse: `[B, q_heads, T]` f32,
    /// the log-sum-exp of each score row, kept for the backward.
    fn attention_forward(
        &self, out: &Tensor<Self>, lse: &Tensor<Self>, qkv: &Tensor<Self>, shape: AttnShape,
        docs: Option<&Tensor<Self>>, amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
    /// Generation's attention over a KV cache: the query of position `at` against the keys
    /// and values of positions 0 to `at`, which is row `at` of `attention_forward`'s output
    /// over them. `at` is the i32 the device holds when the op runs (clamped into the
    /// cache), so that a recorded pass (`Backend::record`) attends at the position each
    /// replay puts there. qkv: `[capacity, qkv_width]` (one sequence, `shape.seq` its
    /// capacity); out: `[1, q_heads·head_dim]`.
    fn attention_decode(
        &self, out: &Tensor<Self>, qkv: &Tensor<Self>, at: &Tensor<Self>, shape: AttnShape,
    ) -> Result<()>;
    /// Writes `dqkv` (all three parts) from `dout`, for the forward of the same `docs`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self, dqkv: &Tensor<Self>, dout: &Tensor<Self>, qkv: &Tensor<Self>, out: &Tensor<Self>,
        lse: &Tensor<Self>, shape: AttnShape, docs: Option<&Tensor<Self>>,
    ) -> Result<()>;
}
