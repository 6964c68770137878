//! SwiGLU, `out = silu(gate) ⊙ up`, with gate and up side by side in one `[N, 2F]` tensor.

use rayon::prelude::*;

use anyhow::Result;

use super::{Cpu, Scalar};
use crate::backend::SwigluOps;
use crate::tensor::Tensor;

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

impl<T: Scalar> SwigluOps for Cpu<T> {
    fn swiglu_forward(
        &self, out: &Tensor<Self>, gate_up: &Tensor<Self>, amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        {
            let gu = self.floats(gate_up)?;
            self.update(out, |o| swiglu_forward(o, &gu, out.cols()))?;
        }
        self.report_abs_max(amax, out)
    }

    fn swiglu_backward(
        &self, dgate_up: &Tensor<Self>, dout: &Tensor<Self>, gate_up: &Tensor<Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        {
            // gate_up copied, as the contract lets `dgate_up` be `gate_up` itself.
            let (dy, gu) = (self.floats(dout)?, self.values(gate_up)?);
            self.update(dgate_up, |d| swiglu_backward(d, &dy, &gu, dout.cols()))?;
        }
        self.report_abs_max(amax, dgate_up)
    }
}
