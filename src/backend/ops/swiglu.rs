//! The MLP's SwiGLU, alone or fused with the matmul next to it: the gate/up projection in
//! the forward, the down projection's input gradient in the backward.

use anyhow::Result;

use super::matmul::{Matmul, MatmulOps, Operand};
use crate::tensor::Tensor;

pub trait SwigluOps: MatmulOps {
    /// `out = silu(gate) ⊙ up` where `gate_up` is `[N, 2F]`: gate columns first, then up.
    fn swiglu_forward(
        &self, out: &Tensor<Self>, gate_up: &Tensor<Self>, amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
    /// `dgate_up` may be `gate_up` itself (in place). `amax`, where given, receives
    /// `dgate_up`'s abs-max: the gate/up projection's output gradient, which FP8 quantizes
    /// next.
    fn swiglu_backward(
        &self, dgate_up: &Tensor<Self>, dout: &Tensor<Self>, gate_up: &Tensor<Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
    /// The MLP's gate/up projection and SwiGLU: `gate_up = x · wᵀ` (`[N, 2F]`, `w` being
    /// `[2F, K]`, both plain or both scaled), then `out = silu(gate) ⊙ up`, as `matmul` and
    /// `swiglu_forward` compute them, `amax` receiving out's abs-max. A backend with a kernel
    /// doing both at once overrides it.
    fn gate_up_swiglu<'a>(
        &self, gate_up: &Tensor<Self>, out: &Tensor<Self>, x: impl Into<Operand<'a, Self>>,
        w: impl Into<Operand<'a, Self>>, amax: Option<&Tensor<Self>>,
    ) -> Result<()>
    where
        Self: 'a,
    {
        unfused_gate_up_swiglu(self, gate_up, out, x.into(), w.into(), amax)
    }
    /// SwiGLU's backward through the down projection: `dh = dy · W` for the down weight `W`
    /// `[H, F]`, given as stored when plain and as its transposed FP8 copy `[F, H]` when
    /// scaled (`input_gradient_spec`), written into `dh`, which a backend may leave
    /// untouched; then gate/up's gradient over `gate_up`, as `matmul` and `swiglu_backward`
    /// compute them, `amax` receiving its abs-max. A backend with a kernel doing both at once
    /// overrides it.
    fn swiglu_backward_through_down<'a>(
        &self, gate_up: &Tensor<Self>, dh: &Tensor<Self>, dy: impl Into<Operand<'a, Self>>,
        w: impl Into<Operand<'a, Self>>, amax: Option<&Tensor<Self>>,
    ) -> Result<()>
    where
        Self: 'a,
    {
        unfused_swiglu_backward_through_down(self, gate_up, dh, dy.into(), w.into(), amax)
    }
}

/// The layout of a linear layer's input-gradient product: plain operands multiply by the
/// weight as stored (`dy · w`), scaled ones by its transposed FP8 copy (`dy · (wᵀ)ᵀ`), since
/// FP8 matmuls take K-contiguous operands only.
pub fn input_gradient_spec<B: MatmulOps>(w: &Operand<'_, B>) -> Matmul {
    match w.descale {
        Some(_) => Matmul::FORWARD,
        None => Matmul::BACKWARD_INPUT,
    }
}

/// `SwigluOps::gate_up_swiglu` as two ops, for a backend without the fused kernel (or
/// operands it does not take).
pub fn unfused_gate_up_swiglu<'a, B: SwigluOps + 'a>(
    b: &B, gate_up: &Tensor<B>, out: &Tensor<B>, x: Operand<'a, B>, w: Operand<'a, B>,
    amax: Option<&Tensor<B>>,
) -> Result<()> {
    b.matmul(gate_up, x, w, None, Matmul::FORWARD)?;
    b.swiglu_forward(out, gate_up, amax)
}

/// `SwigluOps::swiglu_backward_through_down` as two ops, likewise.
pub fn unfused_swiglu_backward_through_down<'a, B: SwigluOps + 'a>(
    b: &B, gate_up: &Tensor<B>, dh: &Tensor<B>, dy: Operand<'a, B>, w: Operand<'a, B>,
    amax: Option<&Tensor<B>>,
) -> Result<()> {
    b.matmul(dh, dy, w, None, input_gradient_spec(&w))?;
    b.swiglu_backward(gate_up, dh, gate_up, amax)
}
