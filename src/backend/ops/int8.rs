//! INT8 with row-wise scales (SwitchBack): every row of a quantized operand, K contiguous, has
//! its own scale, so one outlier costs precision in its own token or channel only.
//!
//! A product of two quantized operands is `matmul` on `Operand::scaled` INT8 tensors in
//! `Matmul::FORWARD`'s layouts, `out[m, n] = a[m, :] · b[n, :]`: the K-long dot products are
//! exact in 32-bit integers (|a|, |b| ≤ 127 keep every sum of K < 2³¹ / 127² = 133,144 terms
//! exact), and the epilogue, in f32 and in this order, is
//! `f32(dot) · descale_a[m] · descale_b[n] (+ bias[n]) (+ out[m, n] when accumulating)`,
//! rounded once to the output's dtype.

use anyhow::{Result, bail, ensure};

use super::matmul::{Matmul, Operand};
use super::memory::MemoryOps;
use crate::tensor::{DType, Tensor};

/// The largest INT8 magnitude quantization uses: the range is kept symmetric (±127), so that
/// negating a tensor negates its codes.
pub const INT8_MAX: f32 = 127.0;

/// The longest K an INT8 product sums exactly in its 32-bit accumulator.
pub const INT8_MAX_K: usize = (i32::MAX as usize) / (127 * 127);

/// Which way a quantization reduces, and so which layout it writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Layout {
    /// `x [R, C]` into `q [R, C]`, one scale per row (over its C values): a forward input, an
    /// input gradient's output gradient, or a weight per output channel.
    Rows,
    /// `x [R, C]` into `q [C, R]`, x transposed, one scale per column (over its R values): a
    /// weight per input channel for the input gradient, or, for an INT8 weight gradient, the
    /// activations and output gradients per channel over the tokens.
    Cols,
}

impl Int8Layout {
    /// The codes' shape (and the descales' count, its first) for `x` of `[rows, cols]`.
    pub fn codes_shape(self, rows: usize, cols: usize) -> [usize; 2] {
        match self {
            Int8Layout::Rows => [rows, cols],
            Int8Layout::Cols => [cols, rows],
        }
    }
}

/// How quantized values are rounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Rounding {
    /// To the nearest integer, ties to even.
    Nearest,
    /// Down or up with the probability of being that close to the other side, so that the
    /// rounding is unbiased: `floor(v + u)`, u uniform in [0, 1) from `hash_u32(seed, i)` of
    /// the output element's index i (`cpu::rounding`), the same bits on every backend.
    Stochastic { seed: u64 },
}

/// Checks an INT8 product `out = a · bᵀ` as every backend takes it: both operands int8 codes
/// `[rows, K]` with one f32 descale per row, K contiguous in both (`Matmul::FORWARD`'s
/// layouts) and within `INT8_MAX_K`, and out `[M, N]`.
pub fn check_int8_product<B: MemoryOps>(
    out: &Tensor<B>, a: Operand<'_, B>, b: Operand<'_, B>, spec: Matmul,
) -> Result<()> {
    for (name, operand) in [("a", a), ("b", b)] {
        let (q, Some(descale)) = (operand.data, operand.descale) else {
            bail!(
                "INT8 matmul: {name} {:?} has no descales",
                operand.data.shape
            );
        };
        ensure!(
            q.dtype == DType::I8 && descale.dtype == DType::F32,
            "INT8 matmul: {name} is {} with a {} descale; it takes int8 codes and f32 descales",
            q.dtype,
            descale.dtype
        );
        ensure!(
            descale.numel() == q.matrix_rows(),
            "INT8 matmul: {name} {:?} has {} descales, not one per row",
            q.shape,
            descale.numel()
        );
    }
    let (m, n, k) = (a.data.matrix_rows(), b.data.matrix_rows(), a.data.cols());
    ensure!(
        k <= INT8_MAX_K,
        "INT8 matmul: K = {k} is past the {INT8_MAX_K} that a 32-bit accumulator sums exactly"
    );
    ensure!(
        !spec.trans_a && spec.trans_b && b.data.cols() == k && out.numel() == m * n,
        "INT8 matmul: a {:?} · b {:?}ᵀ into {:?} ({spec:?}; INT8 operands take K contiguous in \
         both)",
        a.data.shape,
        b.data.shape,
        out.shape
    );
    Ok(())
}

pub trait Int8Ops: MemoryOps {
    /// Row-wise INT8 quantization of `x` (`[R, C]`, in the model's dtype) in `layout`: each
    /// output row's scale is `s = 127 / amax` in f32 (1 where its abs-max is 0 or not
    /// finite), its codes `clamp(round(x · s), -127, 127)` and its `descale` (`[R]` or `[C]`
    /// f32) `1 / s`.
    fn quantize_i8(
        &self, q: &Tensor<Self>, descale: &Tensor<Self>, x: &Tensor<Self>, layout: Int8Layout,
        rounding: Int8Rounding,
    ) -> Result<()>;
}
