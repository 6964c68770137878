//! SwiGLU, `out = silu(gate) ⊙ up`, with gate and up side by side in one `[N, 2F]` tensor.

use rayon::prelude::*;

use super::Scalar;

fn sigmoid<T: Scalar>(x: T) -> T {
    (T::one() + (-x).exp()).recip()
}

pub fn swiglu_forward<T: Scalar>(out: &mut [T], gate_up: &[T], f: usize) {
    out.par_chunks_mut(f)
        .zip(gate_up.par_chunks(2 * f))
        .for_each(|(o, gu)| {
            let (gate, up) = gu.split_at(f);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = g * sigmoid(g) * u;
            }
        });
}

/// `d gate = dout · up · σ(g)(1 + g(1 − σ(g)))`, `d up = dout · silu(g)`.
pub fn swiglu_backward<T: Scalar>(dgate_up: &mut [T], dout: &[T], gate_up: &[T], f: usize) {
    dgate_up
        .par_chunks_mut(2 * f)
        .zip(dout.par_chunks(f).zip(gate_up.par_chunks(2 * f)))
        .for_each(|(dgu, (dy, gu))| {
            let (dgate, dup) = dgu.split_at_mut(f);
            let (gate, up) = gu.split_at(f);
            for i in 0..f {
                let s = sigmoid(gate[i]);
                dgate[i] = dy[i] * up[i] * s * (T::one() + gate[i] * (T::one() - s));
                dup[i] = dy[i] * gate[i] * s;
            }
        });
}
