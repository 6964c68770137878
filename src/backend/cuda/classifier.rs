//! Cross-entropy with z-loss over one chunk of logits, fused with its gradient in place.

use anyhow::{Result, ensure};

use super::kernels::{Arg, Kernel};
use super::{Cuda, ensure_dtype, float, ptr, vec16};
use crate::tensor::{DType, Tensor};

/// Threads per row: a vocabulary of 150k is 300 elements per thread.
const THREADS: u32 = 512;

impl Cuda {
    pub(super) fn cross_entropy_impl(
        &self,
        logits: &Tensor<Cuda>,
        losses: &Tensor<Cuda>,
        targets: &Tensor<Cuda>,
        z_loss: f32,
        grad_scale: Option<f32>,
    ) -> Result<()> {
        ensure_dtype(losses, DType::F32, "cross_entropy (losses)")?;
        ensure_dtype(targets, DType::I32, "cross_entropy (targets)")?;
        let (n, v) = (logits.matrix_rows(), logits.cols());
        ensure!(
            losses.numel() == n && targets.numel() == n,
            "cross_entropy: logits {:?}, losses {:?}, targets {:?}",
            logits.shape,
            losses.shape,
            targets.shape
        );
        if n == 0 {
            return Ok(());
        }
        // SAFETY: block i reads targets[i], reads and (when training) rewrites row i of
        // logits [n, v], and writes losses[i].
        unsafe {
            self.launch(
                Kernel::CrossEntropy,
                &[float(logits), Arg::Flag(vec16(&[logits], v))],
                (n as u32, 1, 1),
                THREADS,
                &[
                    ptr(logits).into(),
                    ptr(losses).into(),
                    ptr(targets).into(),
                    (v as i32).into(),
                    z_loss.into(),
                    grad_scale.unwrap_or(0.0).into(),
                    (grad_scale.is_some() as i32).into(),
                ],
            )
        }
    }
}
