//! RMSNorm, alone or fused with the residual add before it, and its gradient; and Qwen3's
//! RMSNorm over each query and key head.

use anyhow::Result;

use super::attention::AttnShape;
use super::memory::MemoryOps;
use crate::tensor::Tensor;

/// The residual add a norm may do first: `out = inp + branch`, which the norm then reads as
/// its input (the residual stream of the block).
pub struct ResidualAdd<'a, B: MemoryOps> {
    pub out: &'a Tensor<B>,
    pub branch: &'a Tensor<B>,
}

pub trait NormOps: MemoryOps {
    /// `out = x · rstd · weight` with `rstd[n] = 1/sqrt(mean(x[n]²) + eps)`, where x is `inp`,
    /// or with `residual` given, `residual.out = inp + residual.branch` (written first, and
    /// read back as the norm's input as stored). x, out: `[N, C]`; weight: `[C]`; rstd: `[N]`
    /// f32. Without `out`, only rstd (and the abs-max of the output it would have stored),
    /// for a consumer that normalizes as it reads (`Fused::Norm` of `quantize`).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_forward(
        &self, out: Option<&Tensor<Self>>, rstd: &Tensor<Self>, inp: &Tensor<Self>,
        residual: Option<ResidualAdd<'_, Self>>, weight: &Tensor<Self>, eps: f32,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
    /// `dinp += ∂out/∂inp · dout` (the residual stream, always added into) and
    /// `dweight (+)= Σ_n dout[n] ⊙ inp[n] · rstd[n]`. With `amax`, also
    /// `amax[0] = max(amax[0], max |dinp|)` over dinp as stored: the residual gradient is the
    /// output gradient of the linear below, whose FP8 copy scales by it.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self, dinp: &Tensor<Self>, dweight: &Tensor<Self>, dout: &Tensor<Self>,
        inp: &Tensor<Self>, weight: &Tensor<Self>, rstd: &Tensor<Self>, accumulate: bool,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()>;

    /// Qwen3's QK-norm: an RMSNorm over each query head and each key head of the fused QKV
    /// rows `x` `[N, qkv_width]` (`shape`'s heads), by `weights.0` for the queries and
    /// `weights.1` for the keys (`[head_dim]` each), into `out` (the same shape), the value
    /// heads copied. rstd: `[N, q_heads + kv_heads]` f32.
    fn head_rmsnorm_forward(
        &self, out: &Tensor<Self>, rstd: &Tensor<Self>, x: &Tensor<Self>,
        weights: (&Tensor<Self>, &Tensor<Self>), shape: AttnShape, eps: f32,
    ) -> Result<()>;
    /// Its gradient, in place: the query and key heads of `dqkv` (the gradient of `out`)
    /// become the gradient of `x`, and the value heads stay; `dweights (+)= Σ dout ⊙ x · rstd`
    /// over every row and head of their kind. With `amax`, also the abs-max of all of dqkv as
    /// stored: the QKV projection's output gradient, whose FP8 copy scales by it.
    #[allow(clippy::too_many_arguments)]
    fn head_rmsnorm_backward(
        &self, dqkv: &Tensor<Self>, dweights: (&Tensor<Self>, &Tensor<Self>), x: &Tensor<Self>,
        weights: (&Tensor<Self>, &Tensor<Self>), rstd: &Tensor<Self>, shape: AttnShape,
        accumulate: bool, amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
}
