//! AdamW with decoupled weight decay, global-norm clipping read from the device, and
//! stochastic rounding wherever a bf16 tensor is written. The update is f32 arithmetic in a
//! fixed order with nothing fused, which the GPU repeats bit for bit (adamw.cu). It is
//! PyTorch's AdamW with the bias corrections' reciprocals taken once per tensor, so that an
//! element costs one division and one square root.

use anyhow::{Result, ensure};

use super::rounding::{hash_u32, round_slice, stochastic_round_bf16};
use super::{Cpu, Scalar, sum_f64};
use crate::backend::ops::adam8bit::{DynamicMap, Q8_BLOCK, block_absmax};
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

/// The weights an update writes: `param`, through `master` when there is one.
struct Weights<'a, T> {
    param: &'a mut [T],
    master: Option<&'a mut [T]>,
}

impl<T: Scalar> Weights<'_, T> {
    /// Element i's weight before the update: the master copy's where there is one.
    fn get(&self, i: usize) -> f32 {
        f32_of(match &self.master {
            Some(master) => master[i],
            None => self.param[i],
        })
    }

    /// Stores element i's updated weight: into the master copy, the working weight then
    /// being its round-to-nearest image; without one, into the weight, stochastically rounded.
    fn set(&mut self, i: usize, p_new: f32, tensor_hp: &TensorHyper, dtypes: &StateDtypes) {
        match self.master.as_deref_mut() {
            Some(master) => {
                store(&mut master[i], p_new, dtypes.master, None);
                store(&mut self.param[i], f32_of(master[i]), dtypes.param, None);
            }
            None => {
                let noise = hash_u32(tensor_hp.seed, i as u64) & 0xFFFF;
                store(&mut self.param[i], p_new, dtypes.param, Some(noise));
            }
        }
    }
}

fn f32_of<T: Scalar>(x: T) -> f32 {
    x.to_f32().unwrap_or(f32::NAN)
}

/// One element's step in f32, in the order every backend computes it: the clipped gradient
/// `g` into the moments, then the weight `p` from the new moments (not from their rounded
/// images). Returns `(m, v, p)` updated.
#[inline]
fn step(g: f32, m: f32, v: f32, p: f32, hp: &Hyper) -> (f32, f32, f32) {
    let (b1, b2) = (hp.adam.beta1, hp.adam.beta2);
    let m_new = b1 * m + (1.0 - b1) * g;
    let v_new = b2 * v + (1.0 - b2) * g * g;
    let update = (m_new * hp.inv_bias1) / (v_new.sqrt() * hp.inv_sqrt_bias2 + hp.adam.eps);
    let p_new = p - hp.adam.lr * (update + hp.weight_decay * p);
    (m_new, v_new, p_new)
}

/// What every element of one tensor's update shares.
struct Hyper<'a> {
    adam: &'a AdamW,
    /// The clip factor of the gradients.
    scale: f32,
    inv_bias1: f32,
    inv_sqrt_bias2: f32,
    weight_decay: f32,
}

impl<'a> Hyper<'a> {
    fn new(adam: &'a AdamW, norm_sq: f64, tensor_hp: &TensorHyper) -> Self {
        let (inv_bias1, inv_sqrt_bias2) = adam.bias_factors();
        Hyper {
            adam,
            scale: adam.clip_scale(norm_sq) as f32,
            inv_bias1,
            inv_sqrt_bias2,
            weight_decay: tensor_hp.weight_decay,
        }
    }
}

/// Updates `master` (when present, else `param`) and writes the rounded result to `param`.
/// The two moments round with the two halves of one hash and the parameter with another,
/// so that the three errors are independent.
#[allow(clippy::too_many_arguments)]
pub fn adamw<T: Scalar>(
    param: &mut [T], master: Option<&mut [T]>, grad: &[T], m: &mut [T], v: &mut [T], norm_sq: f64,
    hp: &AdamW, tensor_hp: &TensorHyper, dtypes: &StateDtypes,
) {
    let hyper = Hyper::new(hp, norm_sq, tensor_hp);
    let mut weights = Weights { param, master };
    for i in 0..grad.len() {
        let g = f32_of(grad[i]) * hyper.scale;
        let (m_new, v_new, p_new) = step(g, f32_of(m[i]), f32_of(v[i]), weights.get(i), &hyper);
        let noise = hash_u32(tensor_hp.seed ^ MOMENTS_SEED, i as u64);
        store(&mut m[i], m_new, dtypes.m, Some(noise & 0xFFFF));
        store(&mut v[i], v_new, dtypes.v, Some(noise >> 16));
        weights.set(i, p_new, tensor_hp, dtypes);
    }
}

/// A Q8 moment: its codes and its blocks' abs-maxes.
pub struct Q8Moment<'a, T> {
    pub codes: &'a mut [T],
    pub absmax: &'a mut [T],
}

/// `adamw` with 8-bit moments (`adam8bit`): each block of `Q8_BLOCK` elements is read from
/// its codes, updated, and written back as the codes of its new abs-max.
#[allow(clippy::too_many_arguments)]
pub fn adamw_8bit<T: Scalar>(
    param: &mut [T], master: Option<&mut [T]>, grad: &[T], m: Q8Moment<'_, T>, v: Q8Moment<'_, T>,
    norm_sq: f64, hp: &AdamW, tensor_hp: &TensorHyper, dtypes: &StateDtypes,
) {
    let hyper = Hyper::new(hp, norm_sq, tensor_hp);
    let (m_map, v_map) = (DynamicMap::signed(), DynamicMap::unsigned());
    let mut weights = Weights { param, master };
    let (mut ms, mut vs) = ([0f32; Q8_BLOCK], [0f32; Q8_BLOCK]);
    for block in 0..grad.len().div_ceil(Q8_BLOCK) {
        let start = block * Q8_BLOCK;
        let len = Q8_BLOCK.min(grad.len() - start);
        let (m_scale, v_scale) = (f32_of(m.absmax[block]), f32_of(v.absmax[block]));
        for k in 0..len {
            let i = start + k;
            let g = f32_of(grad[i]) * hyper.scale;
            let m_old = m_map.value(code_of(m.codes[i])) * m_scale;
            let v_old = v_map.value(code_of(v.codes[i])) * v_scale;
            let p_new;
            (ms[k], vs[k], p_new) = step(g, m_old, v_old, weights.get(i), &hyper);
            weights.set(i, p_new, tensor_hp, dtypes);
        }
        let m_absmax = block_absmax(&ms[..len]);
        let v_absmax = block_absmax(&vs[..len]);
        for k in 0..len {
            m.codes[start + k] = T::of(m_map.quantize(ms[k] / m_absmax) as f64);
            v.codes[start + k] = T::of(v_map.quantize(vs[k] / v_absmax) as f64);
        }
        m.absmax[block] = T::of(m_absmax as f64);
        v.absmax[block] = T::of(v_absmax as f64);
    }
}

/// A code as the CPU holds it (a whole number in 0..=255).
fn code_of<T: Scalar>(x: T) -> u8 {
    f32_of(x) as u8
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
            t.check_moments("cpu")?;
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
                let (p, master) = (&mut p_v[..], master_v.as_deref_mut());
                match &t.scales {
                    None => adamw(
                        p, master, &grad_v, &mut m_v, &mut v_v, norm_sq, hp, &tensor_hp, &dtypes,
                    ),
                    Some(scales) => {
                        let (mut m_absmax, mut v_absmax) =
                            (self.floats_mut(scales.m)?, self.floats_mut(scales.v)?);
                        let m = Q8Moment {
                            codes: &mut m_v,
                            absmax: &mut m_absmax,
                        };
                        let v = Q8Moment {
                            codes: &mut v_v,
                            absmax: &mut v_absmax,
                        };
                        adamw_8bit(p, master, &grad_v, m, v, norm_sq, hp, &tensor_hp, &dtypes);
                    }
                }
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
