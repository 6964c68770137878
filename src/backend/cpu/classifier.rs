//! Softmax cross-entropy with z-loss, fused with its gradient, over one chunk of logits.

use rayon::prelude::*;

use anyhow::Result;

use super::{Cpu, Scalar, rounding, sum_f64};
use crate::backend::ClassifierOps;
use crate::tensor::Tensor;

/// Targets with this value are not trained (HF's and PyTorch's convention).
pub const IGNORE_INDEX: i32 = -100;

/// Per row: `loss = lse − x[target] + z · lse²`. With `grad_scale`, the row of logits is
/// replaced by `grad_scale · (softmax · (1 + 2 z lse) − onehot(target))`; ignored rows get
/// loss 0 and gradient 0.
pub fn cross_entropy<T: Scalar>(
    logits: &mut [T], losses: &mut [T], targets: &[i32], z_loss: f64, grad_scale: Option<f64>,
) {
    let v = logits.len() / losses.len();
    logits
        .par_chunks_mut(v)
        .zip(losses.par_iter_mut().zip(targets.par_iter()))
        .for_each(|(row, (loss, &target))| {
            if target == IGNORE_INDEX {
                *loss = T::zero();
                if grad_scale.is_some() {
                    row.fill(T::zero());
                }
                return;
            }
            let max = row.iter().fold(T::neg_infinity(), |m, &x| m.max(x));
            let lse = max + sum_f64(row.iter().map(|&x| (x - max).exp())).ln();
            let z = T::of(z_loss);
            *loss = lse - row[target as usize] + z * lse * lse;
            if let Some(scale) = grad_scale {
                let scale = T::of(scale);
                let softmax_scale = scale * (T::one() + T::of(2.0) * z * lse);
                for x in row.iter_mut() {
                    *x = (*x - lse).exp() * softmax_scale;
                }
                row[target as usize] = row[target as usize] - scale;
            }
        });
}

impl<T: Scalar> ClassifierOps for Cpu<T> {
    fn cross_entropy(
        &self, logits: &Tensor<Self>, losses: &Tensor<Self>, targets: &Tensor<Self>, z_loss: f32,
        grad_scale: Option<&Tensor<Self>>,
    ) -> Result<()> {
        let grad_scale = grad_scale.map(|s| self.scalar(s)).transpose()?;
        let targets = self.ints(targets)?;
        let mut losses_v = self.floats_mut(losses)?;
        self.update(logits, |l| {
            cross_entropy(
                l,
                &mut losses_v,
                &targets,
                z_loss as f64,
                grad_scale.map(f64::from),
            )
        })?;
        rounding::round_slice(losses.dtype, &mut losses_v);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::fill_normal;

    /// At a real vocabulary (Qwen's 151,936 entries) the f32 reference's loss stays within a
    /// few f32 roundings of the loss computed in f64 from the same logits: its sum of
    /// exponentials over the row must not lose the small terms a sequential f32 sum would.
    #[test]
    fn the_loss_at_a_real_vocabulary_is_exact_to_f32_rounding() {
        let v = 151_936;
        let mut logits = vec![0f32; v];
        fill_normal(&mut logits, 2.0, 1, 0);
        logits.iter_mut().for_each(|x| *x -= 4.0);
        let target = 1234;
        logits[target] = 9.0;
        let exact = {
            let max = logits
                .iter()
                .fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
            max + sum.ln() - logits[target] as f64
        };
        let mut loss = [0f32];
        cross_entropy(&mut logits, &mut loss, &[target as i32], 0.0, None);
        // The loss is ~2.5: its own rounding is ~1e-7, and each exponential's in f32 adds an
        // unbiased ~6e-8 relative error of its term.
        let err = (loss[0] as f64 - exact).abs();
        assert!(
            err <= 1e-6 * exact.abs(),
            "loss {} against {exact}: {err:e}",
            loss[0]
        );
    }
}
