//! FP8 current scaling: abs-maxes and quantization, each fused with the pass that a
//! quantized tensor's neighbours would otherwise make over it again.
//!
//! An `amax` argument of any op, where given, is an FP8 input's abs-max reported by the op
//! that produces it: `amax[0] = max(amax[0], max |out|)` over the values as stored (`[1]`
//! f32, zeroed by the caller), so that quantizing needs no extra pass over the tensor.

use anyhow::Result;

use super::memory::MemoryOps;
use crate::tensor::{DType, Tensor};

/// The largest finite value of an FP8 dtype, which `quantize` scales a tensor's abs-max to.
pub fn fp8_max(dtype: DType) -> Option<f32> {
    match dtype {
        DType::E4M3 => Some(448.0),
        DType::E5M2 => Some(57344.0),
        _ => None,
    }
}

/// What a quantization pass does besides quantizing its input.
pub enum Fused<'a, B: MemoryOps> {
    Nothing,
    /// The input is a norm's input: the pass quantizes the norm's output,
    /// `x · rstd · weight` as `rmsnorm_forward` would have stored it (rstd `[N]` f32, weight
    /// `[C]`), which then is never stored. Both layouts are asked for.
    Norm {
        rstd: &'a Tensor<B>,
        weight: &'a Tensor<B>,
    },
    /// `bias_backward(dbias, x, accumulate)` from the same read of x: a linear's output
    /// gradient is both the FP8 input of its backward's matmuls and, summed over rows, its
    /// bias's gradient.
    ColumnSums {
        dbias: &'a Tensor<B>,
        accumulate: bool,
    },
}

// By hand: a derive would ask for `B: Copy`, but only references are copied.
impl<B: MemoryOps> Clone for Fused<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: MemoryOps> Copy for Fused<'_, B> {}

pub trait QuantizeOps: MemoryOps {
    /// `amax[0] = max(amax[0], max |x|)`, for tensors whose producer does not report it.
    fn abs_max(&self, amax: &Tensor<Self>, x: &Tensor<Self>) -> Result<()>;
    /// Current scaling: with `s = fp8_max(dtype) / amax[0]` (1 where amax is 0 or not
    /// finite), both in f32, writes `fp8(x · s)` (round-to-nearest-even, saturating at
    /// ±fp8_max) and `descale[0] = 1 / s`, and what `fused` asks. x: `[R, C]` bf16. `rows`
    /// receives it `[R, C]`, `cols` transposed `[C, R]` (the layout the backward's FP8
    /// matmuls need); asking for both costs one pass over x. At least one must be given, of
    /// one fp8 dtype.
    fn quantize(
        &self, rows: Option<&Tensor<Self>>, cols: Option<&Tensor<Self>>, descale: &Tensor<Self>,
        x: &Tensor<Self>, amax: &Tensor<Self>, fused: Fused<'_, Self>,
    ) -> Result<()>;
}
