//! The token embedding and its gradient.

use anyhow::Result;

use super::memory::MemoryOps;
use crate::tensor::Tensor;

pub trait EmbeddingOps: MemoryOps {
    /// `out[n, :] = wte[tokens[n], :]`. tokens: `[N]` i32, wte: `[V, C]`, out: `[N, C]`.
    fn embedding_forward(
        &self, out: &Tensor<Self>, tokens: &Tensor<Self>, wte: &Tensor<Self>,
    ) -> Result<()>;
    /// `dwte[tokens[n], :] (+)= dout[n, :]`, summed in token order so that it is deterministic.
    fn embedding_backward(
        &self, dwte: &Tensor<Self>, tokens: &Tensor<Self>, dout: &Tensor<Self>, accumulate: bool,
    ) -> Result<()>;
}
