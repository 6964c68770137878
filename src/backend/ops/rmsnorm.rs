//! RMSNorm, alone or fused with the residual add before it, and its gradient.

use anyhow::Result;

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
        &self,
        out: Option<&Tensor<Self>>,
        rstd: &Tensor<Self>,
        inp: &Tensor<Self>,
        residual: Option<ResidualAdd<'_, Self>>,
        weight: &Tensor<Self>,
        eps: f32,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
    /// `dinp += ∂out/∂inp · dout` (the residual stream, always added into) and
    /// `dweight (+)= Σ_n dout[n] ⊙ inp[n] · rstd[n]`. With `amax`, also
    /// `amax[0] = max(amax[0], max |dinp|)` over dinp as stored: the residual gradient is the
    /// output gradient of the linear below, whose FP8 copy scales by it.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dinp: &Tensor<Self>,
        dweight: &Tensor<Self>,
        dout: &Tensor<Self>,
        inp: &Tensor<Self>,
        weight: &Tensor<Self>,
        rstd: &Tensor<Self>,
        accumulate: bool,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
}
