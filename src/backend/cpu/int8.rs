//! INT8 emulation: row-wise quantization with the GPU's scale rule and roundings, and the
//! products of INT8 operands with exact integer sums and the epilogue in f32, in the order
//! `ops::int8` states, so that the CPU predicts an INT8 step.

use anyhow::{Result, ensure};
use rayon::prelude::*;

use super::rounding::hash_u32;
use super::{Cpu, Scalar};
use crate::backend::{INT8_MAX, Int8Layout, Int8Ops, Int8Rounding};
use crate::tensor::{DType, Tensor};

/// `s = 127 / amax` in f32, or 1 where there is nothing sensible to scale by.
pub fn int8_scale(amax: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        INT8_MAX / amax
    } else {
        1.0
    }
}

/// The code of `v` (already scaled): rounded as asked, saturated to ±127; NaN becomes 0, as
/// the GPU's float-to-integer conversion makes it.
pub fn int8_code(v: f32, rounding: Int8Rounding, index: usize) -> f32 {
    let r = match rounding {
        Int8Rounding::Nearest => v.round_ties_even(),
        Int8Rounding::Stochastic { seed } => {
            // 24 random bits: u is exact in f32, and v + u rounds at most once.
            let u = (hash_u32(seed, index as u64) >> 8) as f32 * (1.0 / (1u32 << 24) as f32);
            (v + u).floor()
        }
    };
    // `+ 0.0` makes a negative zero the code 0, which is all an integer can hold.
    if r.is_nan() {
        0.0
    } else {
        r.clamp(-INT8_MAX, INT8_MAX) + 0.0
    }
}

/// Quantizes the `[rows, cols]` values `x` in `layout`: the codes, in the output's layout, and
/// each output row's descale.
pub fn quantize_i8<T: Scalar>(
    x: &[T], cols: usize, layout: Int8Layout, rounding: Int8Rounding,
) -> (Vec<f32>, Vec<f32>) {
    let rows = x.len() / cols;
    let value = |r: usize, c: usize| x[r * cols + c].to_f32().unwrap_or(f32::NAN);
    // The output's rows: x's rows, or its columns when transposed.
    let (out_rows, k) = match layout {
        Int8Layout::Rows => (rows, cols),
        Int8Layout::Cols => (cols, rows),
    };
    let at = |i: usize, j: usize| match layout {
        Int8Layout::Rows => value(i, j),
        Int8Layout::Cols => value(j, i),
    };
    let mut codes = vec![0.0; rows * cols];
    let mut descales = vec![0.0; out_rows];
    for i in 0..out_rows {
        // fmaxf's rule: a NaN is passed over.
        let amax = (0..k).map(|j| at(i, j).abs()).fold(0.0, f32::max);
        let s = int8_scale(amax);
        for j in 0..k {
            codes[i * k + j] = int8_code(at(i, j) * s, rounding, i * k + j);
        }
        descales[i] = 1.0 / s;
    }
    (codes, descales)
}

/// `out[m, n] = f32(Σ_k a[m, k] · b[n, k]) · da[m] · db[n] (+ bias[n]) (+ old[m, n])`, the
/// sums exact (in i64, which the 32-bit accumulator equals within `INT8_MAX_K`).
pub fn int8_matmul(
    a: &[f32], da: &[f32], b: &[f32], db: &[f32], k: usize, bias: Option<&[f32]>,
    old: Option<&[f32]>,
) -> Vec<f32> {
    let (m, n) = (a.len() / k, b.len() / k);
    let to_int = |v: &[f32]| v.iter().map(|&x| x as i32).collect::<Vec<_>>();
    let (a, b) = (to_int(a), to_int(b));
    let mut out = vec![0.0; m * n];
    out.par_chunks_mut(n.max(1))
        .enumerate()
        .for_each(|(i, out)| {
            let row = &a[i * k..(i + 1) * k];
            for (j, o) in out.iter_mut().enumerate() {
                let col = &b[j * k..(j + 1) * k];
                let dot: i64 = row.iter().zip(col).map(|(&x, &y)| (x * y) as i64).sum();
                let mut v = dot as i32 as f32 * da[i] * db[j];
                if let Some(bias) = bias {
                    v += bias[j];
                }
                if let Some(old) = old {
                    v += old[i * n + j];
                }
                *o = v;
            }
        });
    out
}

impl<T: Scalar> Int8Ops for Cpu<T> {
    fn quantize_i8(
        &self, q: &Tensor<Self>, descale: &Tensor<Self>, x: &Tensor<Self>, layout: Int8Layout,
        rounding: Int8Rounding,
    ) -> Result<()> {
        let (rows, cols) = (x.matrix_rows(), x.cols());
        let shape = layout.codes_shape(rows, cols);
        ensure!(
            q.dtype == DType::I8
                && q.numel() == rows * cols
                && (q.shape.len() != 2 || q.shape == shape)
                && descale.dtype == DType::F32
                && descale.numel() == shape[0],
            "quantize_i8: [{rows}, {cols}] ({layout:?}) into {:?} {} with descale {:?} {}",
            q.shape,
            q.dtype,
            descale.shape,
            descale.dtype
        );
        let (codes, descales) = quantize_i8(&self.floats(x)?, cols, layout, rounding);
        self.update(q, |o| {
            o.iter_mut()
                .zip(&codes)
                .for_each(|(o, &c)| *o = T::of(c as f64))
        })?;
        self.update(descale, |d| {
            d.iter_mut()
                .zip(&descales)
                .for_each(|(d, &s)| *d = T::of(s as f64))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A few rows of mixed magnitudes, a zero row and a NaN.
    fn values() -> (Vec<f32>, usize) {
        let cols = 37;
        let mut x: Vec<f32> = (0..5 * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1 + i / cols) as f32)
            .collect();
        x[2 * cols..3 * cols].fill(0.0);
        x[4 * cols + 5] = f32::NAN;
        (x, cols)
    }

    #[test]
    fn nearest_codes_are_within_half_a_step_and_each_row_reaches_127() {
        let (x, cols) = values();
        let (codes, descales) = quantize_i8(&x, cols, Int8Layout::Rows, Int8Rounding::Nearest);
        for r in 0..x.len() / cols {
            let row = &codes[r * cols..(r + 1) * cols];
            let top = row.iter().fold(0.0f32, |m, c| m.max(c.abs()));
            // A zero row keeps the scale 1 (descale 1) and all-zero codes.
            assert_eq!(top, if r == 2 { 0.0 } else { 127.0 }, "row {r}");
            for (c, &q) in row.iter().enumerate() {
                let v = x[r * cols + c];
                assert!(q == q.round() && q.abs() <= 127.0 && q.to_bits() != (-0.0f32).to_bits());
                if v.is_nan() {
                    assert_eq!(q, 0.0);
                } else {
                    let err = (q * descales[r] - v).abs();
                    assert!(err <= 0.5001 * descales[r], "row {r} col {c}: {v} as {q}");
                }
            }
        }
    }

    #[test]
    fn columns_are_the_rows_of_the_transpose() {
        let (x, cols) = values();
        let rows = x.len() / cols;
        let t: Vec<f32> = (0..x.len())
            .map(|i| x[(i % rows) * cols + i / rows])
            .collect();
        for rounding in [Int8Rounding::Nearest, Int8Rounding::Stochastic { seed: 3 }] {
            assert_eq!(
                quantize_i8(&x, cols, Int8Layout::Cols, rounding),
                quantize_i8(&t, rows, Int8Layout::Rows, rounding)
            );
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        // One row: 127 at index 0 sets the scale to 1, the rest sit a third of the way up.
        let mut x = vec![10.0 + 1.0 / 3.0; 4096];
        x[0] = 127.0;
        let (codes, _) = quantize_i8(
            &x,
            x.len(),
            Int8Layout::Rows,
            Int8Rounding::Stochastic { seed: 9 },
        );
        assert!(codes[1..].iter().all(|&c| c == 10.0 || c == 11.0));
        let mean = codes[1..].iter().sum::<f32>() / (codes.len() - 1) as f32;
        assert!((mean - x[1]).abs() < 0.02, "mean {mean}");
    }

    #[test]
    fn products_are_the_exact_dot_products_scaled() {
        let k = 64;
        let a: Vec<f32> = (0..3 * k).map(|i| (i % 255) as f32 - 127.0).collect();
        let b: Vec<f32> = (0..2 * k).map(|i| 127.0 - (i * 3 % 255) as f32).collect();
        let (da, db) = ([0.5, 0.25, 2.0], [0.125, 1.0]);
        let out = int8_matmul(&a, &da, &b, &db, k, Some(&[1.0, -1.0]), None);
        for i in 0..3 {
            for j in 0..2 {
                let dot: f64 = (0..k)
                    .map(|t| a[i * k + t] as f64 * b[j * k + t] as f64)
                    .sum();
                let want = dot * da[i] as f64 * db[j] as f64 + [1.0, -1.0][j];
                assert_eq!(out[i * 2 + j] as f64, want, "({i}, {j})");
            }
        }
    }
}
