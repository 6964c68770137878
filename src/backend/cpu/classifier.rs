//! Softmax cross-entropy with z-loss, fused with its gradient, over one chunk of logits.

use rayon::prelude::*;

use anyhow::Result;

use super::{Cpu, Scalar, rounding};
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
            let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<T>().ln();
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
        grad_scale: Option<f32>,
    ) -> Result<()> {
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
