//! RMSNorm, `y = x · rstd · w` with `rstd = 1/sqrt(mean(x²) + eps)`, and its gradient.

use rayon::prelude::*;

use anyhow::{Result, ensure};

use super::{Cpu, Scalar, add_column_sums, rounding, sum_f64};
use crate::backend::{AttnShape, NormOps, ResidualAdd};
use crate::tensor::Tensor;

/// `rstd[n] = 1/sqrt(mean(inp[n]²) + eps)`; inp: `[N, C]`; rstd: `[N]`.
pub fn rstd<T: Scalar>(rstd: &mut [T], inp: &[T], c: usize, eps: f64) {
    rstd.par_iter_mut()
        .zip(inp.par_chunks(c))
        .for_each(|(r, x)| {
            let mean_sq = sum_f64(x.iter().map(|&v| v * v)) / T::of(c as f64);
            *r = (mean_sq + T::of(eps)).sqrt().recip();
        });
}

/// `out[n] = inp[n] · rstd[n] · weight`; inp, out: `[N, C]`; weight: `[C]`.
pub fn normalize<T: Scalar>(out: &mut [T], inp: &[T], rstd: &[T], weight: &[T]) {
    let c = weight.len();
    out.par_chunks_mut(c)
        .zip(rstd.par_iter())
        .zip(inp.par_chunks(c))
        .for_each(|((y, &r), x)| {
            for ((y, &x), &w) in y.iter_mut().zip(x).zip(weight) {
                *y = x * r * w;
            }
        });
}

/// `dinp += ∂y/∂x · dout`; `dweight (+)= Σ_n dout ⊙ x · rstd`.
///
/// With `g = dout ⊙ w`: `dx = rstd · g − x · rstd³ · (g·x) / C`.
pub fn rmsnorm_backward<T: Scalar>(
    dinp: &mut [T], dweight: &mut [T], dout: &[T], inp: &[T], weight: &[T], rstd: &[T],
    accumulate: bool,
) {
    let c = weight.len();
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(inp.par_chunks(c).zip(rstd.par_iter()))
        .for_each(|((dx, dy), (x, &r))| {
            let dot = sum_f64(
                dy.iter()
                    .zip(weight)
                    .zip(x)
                    .map(|((&dy, &w), &x)| dy * w * x),
            );
            let k = r * r * r * dot / T::of(c as f64);
            for (((dx, &dy), &w), &x) in dx.iter_mut().zip(dy).zip(weight).zip(x) {
                *dx += r * dy * w - x * k;
            }
        });
    if !accumulate {
        dweight.fill(T::zero());
    }
    let rows = dout.chunks(c).zip(inp.chunks(c)).zip(rstd);
    add_column_sums(
        dweight,
        rows.map(|((dy, x), &r)| dy.iter().zip(x).map(move |(&dy, &x)| dy * x * r)),
    );
}

/// Qwen3's QK-norm of one fused QKV row: each of its `normed` first heads (`[D]` each, the
/// queries' then the keys') normalized by its `rstd` and the weight of its kind (`q_weight`
/// for the first `q_heads`, `k_weight` after); the value heads copied.
fn head_norm_row<T: Scalar>(
    out: &mut [T], x: &[T], rstd: &[T], (q_weight, k_weight): (&[T], &[T]), q_heads: usize,
) {
    let d = q_weight.len();
    let normed = rstd.len();
    for (h, &r) in rstd.iter().enumerate() {
        let w = if h < q_heads { q_weight } else { k_weight };
        let head = h * d..(h + 1) * d;
        for ((y, &x), &w) in out[head.clone()].iter_mut().zip(&x[head]).zip(w) {
            *y = x * r * w;
        }
    }
    out[normed * d..].copy_from_slice(&x[normed * d..]);
}

/// The gradient of `head_norm_row` in place of one row's `dqkv` (value heads untouched), as
/// `rmsnorm_backward`'s input gradient per head, written rather than added.
fn head_norm_row_backward<T: Scalar>(
    dqkv: &mut [T], x: &[T], rstd: &[T], (q_weight, k_weight): (&[T], &[T]), q_heads: usize,
) {
    let d = q_weight.len();
    for (h, &r) in rstd.iter().enumerate() {
        let w = if h < q_heads { q_weight } else { k_weight };
        let head = h * d..(h + 1) * d;
        let (dy, x) = (&mut dqkv[head.clone()], &x[head]);
        let dot = sum_f64(dy.iter().zip(w).zip(x).map(|((&dy, &w), &x)| dy * w * x));
        let k = r * r * r * dot / T::of(d as f64);
        for ((dy, &w), &x) in dy.iter_mut().zip(w).zip(x) {
            *dy = r * *dy * w - x * k;
        }
    }
}

impl<T: Scalar> NormOps for Cpu<T> {
    fn rmsnorm_forward(
        &self, out: Option<&Tensor<Self>>, rstd: &Tensor<Self>, inp: &Tensor<Self>,
        residual: Option<ResidualAdd<'_, Self>>, weight: &Tensor<Self>, eps: f32,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        // The norm reads the rounded sum, as a kernel reading back its bf16 output would.
        let x = match residual {
            Some(ResidualAdd { out: sum, branch }) => {
                let (residual, branch) = (self.floats(inp)?, self.floats(branch)?);
                self.update(sum, |s| {
                    s.iter_mut()
                        .zip(residual.iter().zip(branch.iter()))
                        .for_each(|(s, (&a, &b))| *s = a + b)
                })?;
                sum
            }
            None => inp,
        };
        ensure!(
            out.is_none_or(|o| o.dtype == x.dtype),
            "rmsnorm_forward: out {:?} is not inp's {}",
            out.map(|o| o.dtype),
            x.dtype
        );
        {
            let x_v = self.floats(x)?;
            let c = weight.numel();
            self.update(rstd, |r| self::rstd(r, &x_v, c, eps as f64))?;
        }
        // From rstd as stored, as the quantization of a norm's output reads it.
        let y = self.normalized(x, rstd, weight)?;
        if let Some(amax) = amax {
            self.raise_abs_max(amax, &y)?;
        }
        match out {
            Some(out) => self.update(out, |o| o.copy_from_slice(&y)),
            None => Ok(()),
        }
    }

    fn rmsnorm_backward(
        &self, dinp: &Tensor<Self>, dweight: &Tensor<Self>, dout: &Tensor<Self>,
        inp: &Tensor<Self>, weight: &Tensor<Self>, rstd: &Tensor<Self>, accumulate: bool,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        let (dout, inp, weight, rstd) = (
            self.floats(dout)?,
            self.floats(inp)?,
            self.floats(weight)?,
            self.floats(rstd)?,
        );
        let mut dweight_v = self.floats_mut(dweight)?;
        self.update(dinp, |dx| {
            rmsnorm_backward(dx, &mut dweight_v, &dout, &inp, &weight, &rstd, accumulate)
        })?;
        rounding::round_slice(dweight.dtype, &mut dweight_v);
        self.report_abs_max(amax, dinp)
    }

    fn head_rmsnorm_forward(
        &self, out: &Tensor<Self>, rstd: &Tensor<Self>, x: &Tensor<Self>,
        (q_weight, k_weight): (&Tensor<Self>, &Tensor<Self>), shape: AttnShape, eps: f32,
    ) -> Result<()> {
        let (w, d, normed) = head_norm_shape(x, rstd, shape)?;
        let x_v = self.floats(x)?;
        // Each head's rstd as `rstd` computes a row's, rounded as stored before it is used.
        {
            let heads: Vec<T> = x_v
                .chunks(w)
                .flat_map(|row| row[..normed * d].to_vec())
                .collect();
            self.update(rstd, |r| self::rstd(r, &heads, d, eps as f64))?;
        }
        let (rstd_v, q_w, k_w) = (
            self.floats(rstd)?,
            self.floats(q_weight)?,
            self.floats(k_weight)?,
        );
        let (q_w, k_w): (&[T], &[T]) = (&q_w, &k_w);
        self.update(out, |o| {
            o.par_chunks_mut(w)
                .zip(x_v.par_chunks(w).zip(rstd_v.par_chunks(normed)))
                .for_each(|(o, (x, r))| head_norm_row(o, x, r, (q_w, k_w), shape.q_heads))
        })
    }

    fn head_rmsnorm_backward(
        &self, dqkv: &Tensor<Self>, (dq_weight, dk_weight): (&Tensor<Self>, &Tensor<Self>),
        x: &Tensor<Self>, (q_weight, k_weight): (&Tensor<Self>, &Tensor<Self>),
        rstd: &Tensor<Self>, shape: AttnShape, accumulate: bool, amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        let (w, d, normed) = head_norm_shape(x, rstd, shape)?;
        let (x_v, rstd_v, q_w, k_w) = (
            self.floats(x)?,
            self.floats(rstd)?,
            self.floats(q_weight)?,
            self.floats(k_weight)?,
        );
        // The weights' gradients first, from dout, in row then head order.
        {
            let dy = self.floats(dqkv)?;
            let (mut dq, mut dk) = (self.floats_mut(dq_weight)?, self.floats_mut(dk_weight)?);
            if !accumulate {
                dq.fill(T::zero());
                dk.fill(T::zero());
            }
            // Every head's `dout ⊙ x · rstd`, in row then head order, those of the query
            // heads (`true`) or the key heads.
            let products = |queries: bool| {
                let rows = dy.chunks(w).zip(x_v.chunks(w)).zip(rstd_v.chunks(normed));
                rows.flat_map(move |((dy, x), r)| {
                    let heads = r.iter().enumerate();
                    heads
                        .filter(move |&(h, _)| (h < shape.q_heads) == queries)
                        .map(move |(h, &r)| {
                            let head = h * d..(h + 1) * d;
                            (dy[head.clone()].iter().zip(&x[head])).map(move |(&dy, &x)| dy * x * r)
                        })
                })
            };
            add_column_sums(&mut dq, products(true));
            add_column_sums(&mut dk, products(false));
            rounding::round_slice(dq_weight.dtype, &mut dq);
            rounding::round_slice(dk_weight.dtype, &mut dk);
        }
        let (q_w, k_w): (&[T], &[T]) = (&q_w, &k_w);
        self.update(dqkv, |dy| {
            dy.par_chunks_mut(w)
                .zip(x_v.par_chunks(w).zip(rstd_v.par_chunks(normed)))
                .for_each(|(dy, (x, r))| {
                    head_norm_row_backward(dy, x, r, (q_w, k_w), shape.q_heads)
                })
        })?;
        self.report_abs_max(amax, dqkv)
    }
}

impl<T: Scalar> Cpu<T> {
    /// The output of the norm of `x` by `rstd` and `weight`, rounded to x's dtype as
    /// `rmsnorm_forward` stores it.
    pub(super) fn normalized(
        &self, x: &Tensor<Self>, rstd: &Tensor<Self>, weight: &Tensor<Self>,
    ) -> Result<Vec<T>> {
        let (inp, rstd_v, weight_v) = (self.floats(x)?, self.floats(rstd)?, self.floats(weight)?);
        ensure!(
            inp.len() == rstd_v.len() * weight_v.len(),
            "the norm of {:?} with rstd {:?} and weight {:?}",
            x.shape,
            rstd.shape,
            weight.shape
        );
        let mut y = vec![T::zero(); inp.len()];
        normalize(&mut y, &inp, &rstd_v, &weight_v);
        rounding::round_slice(x.dtype, &mut y);
        Ok(y)
    }
}

/// The QKV width, head size and normed heads of a head norm over `x` with `rstd`, checked.
fn head_norm_shape<T: Scalar>(
    x: &Tensor<Cpu<T>>, rstd: &Tensor<Cpu<T>>, shape: AttnShape,
) -> Result<(usize, usize, usize)> {
    let (w, d, normed) = (
        shape.qkv_width(),
        shape.head_dim,
        shape.q_heads + shape.kv_heads,
    );
    ensure!(
        x.cols() == w && rstd.numel() == x.matrix_rows() * normed,
        "head_rmsnorm: x {:?}, rstd {:?} for {shape:?}",
        x.shape,
        rstd.shape
    );
    Ok((w, d, normed))
}
