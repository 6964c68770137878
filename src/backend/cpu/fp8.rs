//! FP8 emulation: current per-tensor scaling and scaled matmuls, computed the way the GPU
//! does (scale in f32, saturating round-to-nearest-even), so that the CPU predicts an FP8 step.

use super::Scalar;
use super::rounding::round_fp8;
use crate::backend::{Matmul, fp8_max};
use crate::tensor::DType;

/// The largest |x|, ignoring NaN as the GPU's `fmaxf` does.
pub fn abs_max<T: Scalar>(xs: &[T]) -> f32 {
    xs.iter()
        .map(|x| x.to_f32().unwrap_or(f32::NAN).abs())
        .fold(0.0, f32::max)
}

/// `s = max / amax` in f32, or 1 where there is nothing sensible to scale by.
pub fn scale(dtype: DType, amax: f32) -> f32 {
    let max = fp8_max(dtype).unwrap_or_else(|| panic!("{dtype} is not an fp8 dtype"));
    if amax > 0.0 && amax.is_finite() {
        max / amax
    } else {
        1.0
    }
}

/// `out = fp8(x · scale)`, transposing `[rows, cols]` to `[cols, rows]` when asked.
pub fn quantize<T: Scalar>(
    out: &mut [T],
    x: &[T],
    cols: usize,
    dtype: DType,
    scale: f32,
    transpose: bool,
) {
    let rows = x.len() / cols;
    for r in 0..rows {
        for c in 0..cols {
            let v = x[r * cols + c].to_f32().unwrap_or(f32::NAN) * scale;
            let dst = if transpose {
                c * rows + r
            } else {
                r * cols + c
            };
            out[dst] = T::of(round_fp8(v, dtype) as f64);
        }
    }
}

/// `out (+)= (a · a_descale) · (b · b_descale)ᵀ (+ bias)`, with the real values of the
/// operands formed first and multiplied in `T`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_scaled<T: Scalar>(
    out: &mut [T],
    a: &[T],
    a_descale: T,
    b: &[T],
    b_descale: T,
    k: usize,
    bias: Option<&[T]>,
    accumulate: bool,
) {
    let a: Vec<T> = a.iter().map(|&x| x * a_descale).collect();
    let b: Vec<T> = b.iter().map(|&x| x * b_descale).collect();
    let spec = Matmul {
        accumulate,
        ..Matmul::FORWARD
    };
    super::matmul::matmul(out, &a, k, &b, k, bias, spec);
}
