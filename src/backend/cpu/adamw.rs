//! AdamW with decoupled weight decay, global-norm clipping read from the device, and
//! stochastic rounding wherever a bf16 tensor is written. The update is f32 arithmetic in a
//! fixed order with nothing fused, which the GPU repeats bit for bit (adamw.cu). It is
//! PyTorch's AdamW with the bias corrections' reciprocals taken once per tensor, so that an
//! element costs one division and one square root.

use anyhow::{Result, ensure};

use super::rounding::{hash_u32, round_slice, stochastic_round_bf16};
use super::{Cpu, Scalar, sum_f64};
use crate::backend::{AdamW, AdamWTensor, OptimizerOps};
use crate::tensor::{DType, Tensor};

/// Writes `x` into an element of a `dtype` tensor: stochastically rounded when bf16 and 16
/// bits of noise are given, else rounded to nearest.
fn store<T: Scalar>(dst: &mut T, x: f32, dtype: DType, noise: Option<u32>) {
    *dst = if let (DType::BF16, Some(noise)) = (dtype, noise) {
        T::of(stochastic_round_bf16(x, noise) as f64)
    } else {
        let mut v = [T::of(x as f64)];
        round_slice(dtype, &mut v);
        v[0]
    };
}

/// Mixed into the tensor's seed for the moments' noise, to keep it apart from the
/// parameter's.
const MOMENTS_SEED: u64 = 0x6D;

/// The dtypes of the tensors one update writes, for choosing how each is rounded.
pub struct StateDtypes {
    pub param: DType,
    pub m: DType,
    pub v: DType,
    pub master: DType,
}

/// What differs between the tensors of one step.
pub struct TensorHyper {
    pub weight_decay: f32,
    /// Seeds stochastic rounding.
    pub seed: u64,
}

/// Updates `master` (when present, else `param`) and writes the rounded result to `param`.
/// The two moments round with the two halves of one hash and the parameter with another,
/// so that the three errors are independent.
#[allow(clippy::too_many_arguments)]
pub fn adamw<T: Scalar>(
    param: &mut [T], mut master: Option<&mut [T]>, grad: &[T], m: &mut [T], v: &mut [T],
    norm_sq: f64, hp: &AdamW, tensor_hp: &TensorHyper, dtypes: &StateDtypes,
) {
    let scale = hp.clip_scale(norm_sq) as f32;
    let (b1, b2) = (hp.beta1, hp.beta2);
    let (inv_bias1, inv_sqrt_bias2) = hp.bias_factors();
    let f32_of = |x: T| x.to_f32().unwrap_or(f32::NAN);
    for i in 0..param.len() {
        let g = f32_of(grad[i]) * scale;
        let m_new = b1 * f32_of(m[i]) + (1.0 - b1) * g;
        let v_new = b2 * f32_of(v[i]) + (1.0 - b2) * g * g;
        let noise = hash_u32(tensor_hp.seed ^ MOMENTS_SEED, i as u64);
        store(&mut m[i], m_new, dtypes.m, Some(noise & 0xFFFF));
        store(&mut v[i], v_new, dtypes.v, Some(noise >> 16));
        let update = (m_new * inv_bias1) / (v_new.sqrt() * inv_sqrt_bias2 + hp.eps);
        let p = match master.as_deref() {
            Some(master) => f32_of(master[i]),
            None => f32_of(param[i]),
        };
        let p_new = p - hp.lr * (update + tensor_hp.weight_decay * p);
        match master.as_deref_mut() {
            // With a master copy, the working weights are its round-to-nearest image.
            Some(master) => {
                store(&mut master[i], p_new, dtypes.master, None);
                store(&mut param[i], f32_of(master[i]), dtypes.param, None);
            }
            None => {
                let noise = hash_u32(tensor_hp.seed, i as u64) & 0xFFFF;
                store(&mut param[i], p_new, dtypes.param, Some(noise));
            }
        }
    }
}

impl<T: Scalar> OptimizerOps for Cpu<T> {
    fn sum_squares(&self, sums: &Tensor<Self>, xs: &[Option<&Tensor<Self>>]) -> Result<()> {
        ensure!(
            sums.numel() == xs.len(),
            "sum_squares: {} sums for {} tensors",
            sums.numel(),
            xs.len()
        );
        let mut each = Vec::with_capacity(xs.len());
        for x in xs {
            each.push(match x {
                Some(x) => sum_f64(self.floats(x)?.iter().map(|&v| v * v)),
                None => T::zero(),
            });
        }
        self.update(sums, |o| o.copy_from_slice(&each))
    }

    fn sum(&self, out: &Tensor<Self>, x: &Tensor<Self>) -> Result<()> {
        let total = sum_f64(self.floats(x)?.iter().copied());
        self.update(out, |o| o[0] = total)
    }

    fn adamw(
        &self, tensors: &[AdamWTensor<'_, Self>], norm_sq: &Tensor<Self>, hp: &AdamW,
    ) -> Result<()> {
        let norm_sq = self.floats(norm_sq)?[0].f64();
        for t in tensors {
            {
                let grad_v = self.floats(t.grad)?;
                let (mut m_v, mut v_v, mut p_v) = (
                    self.floats_mut(t.m)?,
                    self.floats_mut(t.v)?,
                    self.floats_mut(t.param)?,
                );
                let mut master_v = t.master.map(|m| self.floats_mut(m)).transpose()?;
                let dtypes = StateDtypes {
                    param: t.param.dtype,
                    m: t.m.dtype,
                    v: t.v.dtype,
                    master: t.master.map_or(t.param.dtype, |m| m.dtype),
                };
                let tensor_hp = TensorHyper {
                    weight_decay: hp.weight_decay_for(t.decays),
                    seed: t.seed,
                };
                adamw(
                    &mut p_v,
                    master_v.as_deref_mut(),
                    &grad_v,
                    &mut m_v,
                    &mut v_v,
                    norm_sq,
                    hp,
                    &tensor_hp,
                    &dtypes,
                );
            }
            self.report_abs_max(t.amax, t.param)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryOps;
    use crate::rng::fill_normal;
    use crate::tensor::TensorSpec;

    /// A gradient's sum of squares over millions of elements stays within f32 rounding of
    /// the f64 sum: the reference's global norm, which clipping reads, must not lose the
    /// small squares a sequential f32 sum drops once the total has grown.
    #[test]
    fn sums_of_squares_of_millions_of_elements_are_exact_to_f32_rounding() {
        let n = 4 << 20;
        let mut values = vec![0f32; n];
        fill_normal(&mut values, 1.0, 2, 0);
        let exact: f64 = values.iter().map(|&x| (x as f64).powi(2)).sum();
        let b = Cpu::<f32>::new();
        let spec = |name, n| TensorSpec::new(name, &[n], DType::F32);
        let t = b
            .allocate("test", &[spec("x", n), spec("sums", 1)])
            .unwrap();
        b.upload(&t[0], &values).unwrap();
        b.sum_squares(&t[1], &[Some(&t[0])]).unwrap();
        let got = b.download(&t[1]).unwrap()[0] as f64;
        let err = (got - exact).abs();
        assert!(
            err <= 1e-6 * exact,
            "sum of squares {got} against {exact}: {err:e}"
        );
    }
}
