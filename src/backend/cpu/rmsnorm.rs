//! RMSNorm, `y = x · rstd · w` with `rstd = 1/sqrt(mean(x²) + eps)`, and its gradient.

use rayon::prelude::*;

use super::Scalar;

/// `rstd[n] = 1/sqrt(mean(inp[n]²) + eps)`; inp: `[N, C]`; rstd: `[N]`.
pub fn rstd<T: Scalar>(rstd: &mut [T], inp: &[T], c: usize, eps: f64) {
    rstd.par_iter_mut()
        .zip(inp.par_chunks(c))
        .for_each(|(r, x)| {
            let mean_sq = x.iter().map(|&v| v * v).sum::<T>() / T::of(c as f64);
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
    dinp: &mut [T],
    dweight: &mut [T],
    dout: &[T],
    inp: &[T],
    weight: &[T],
    rstd: &[T],
    accumulate: bool,
) {
    let c = weight.len();
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(inp.par_chunks(c).zip(rstd.par_iter()))
        .for_each(|((dx, dy), (x, &r))| {
            let dot = dy
                .iter()
                .zip(weight)
                .zip(x)
                .map(|((&dy, &w), &x)| dy * w * x)
                .sum::<T>();
            let k = r * r * r * dot / T::of(c as f64);
            for (((dx, &dy), &w), &x) in dx.iter_mut().zip(dy).zip(weight).zip(x) {
                *dx += r * dy * w - x * k;
            }
        });
    if !accumulate {
        dweight.fill(T::zero());
    }
    for ((dy, x), &r) in dout.chunks(c).zip(inp.chunks(c)).zip(rstd) {
        for ((dw, &dy), &x) in dweight.iter_mut().zip(dy).zip(x) {
            *dw += dy * x * r;
        }
    }
}
