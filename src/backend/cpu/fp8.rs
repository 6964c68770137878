//! FP8 emulation: current per-tensor scaling computed the way the GPU does it (scale in f32,
//! saturating round-to-nearest-even), so that the CPU predicts an FP8 step. Scaled matmuls
//! are `matmul.rs`'s.

use anyhow::{Result, bail, ensure};

use super::rounding::round_fp8;
use super::{Cpu, Scalar};
use crate::backend::{Fused, MatmulOps, QuantizeOps, fp8_max};
use crate::tensor::{DType, Tensor};

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
    out: &mut [T], x: &[T], cols: usize, dtype: DType, scale: f32, transpose: bool,
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

impl<T: Scalar> QuantizeOps for Cpu<T> {
    fn abs_max(&self, amax: &Tensor<Self>, x: &Tensor<Self>) -> Result<()> {
        self.raise_abs_max(amax, &self.floats(x)?)
    }

    fn quantize(
        &self, rows: Option<&Tensor<Self>>, cols: Option<&Tensor<Self>>, descale: &Tensor<Self>,
        x: &Tensor<Self>, amax: &Tensor<Self>, fused: Fused<'_, Self>,
    ) -> Result<()> {
        let shape = [x.matrix_rows(), x.cols()];
        match fused {
            Fused::Nothing => {
                let xs = self.floats(x)?;
                self.quantize_values((rows, cols), descale, &xs, shape, amax)
            }
            Fused::Norm { rstd, weight } => {
                ensure!(
                    rows.is_some() && cols.is_some(),
                    "quantize: a norm's output is quantized in both layouts"
                );
                let y = self.normalized(x, rstd, weight)?;
                self.quantize_values((rows, cols), descale, &y, shape, amax)
            }
            Fused::ColumnSums { dbias, accumulate } => {
                {
                    let xs = self.floats(x)?;
                    self.quantize_values((rows, cols), descale, &xs, shape, amax)?;
                }
                self.bias_backward(dbias, x, accumulate)
            }
        }
    }
}

impl<T: Scalar> Cpu<T> {
    /// `quantize` of the values `xs` of an `[r, c]` tensor.
    fn quantize_values(
        &self, (rows, cols): (Option<&Tensor<Self>>, Option<&Tensor<Self>>),
        descale: &Tensor<Self>, xs: &[T], [r, c]: [usize; 2], amax: &Tensor<Self>,
    ) -> Result<()> {
        let outputs = [(rows, false, [r, c]), (cols, true, [c, r])];
        let outputs: Vec<_> = outputs
            .into_iter()
            .filter_map(|(t, transpose, shape)| t.map(|t| (t, transpose, shape)))
            .collect();
        let Some(&(first, _, _)) = outputs.first() else {
            bail!("quantize: neither layout of [{r}, {c}] asked for");
        };
        let scale = scale(first.dtype, self.scalar(amax)?);
        for (out, transpose, shape) in outputs {
            ensure!(
                out.numel() == xs.len()
                    && (out.shape.len() != 2 || out.shape == shape)
                    && out.dtype == first.dtype,
                "quantize: [{r}, {c}] into {:?} {} (transposed: {transpose})",
                out.shape,
                out.dtype
            );
            self.update(out, |o| quantize(o, xs, c, out.dtype, scale, transpose))?;
        }
        self.update(descale, |d| d[0] = T::of((1.0 / scale) as f64))
    }
}
