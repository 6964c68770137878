//! Cross-entropy with z-loss over one chunk of logits, fused with its gradient in place.

use anyhow::{Result, ensure};

use super::kernels::{Arg, CLUSTER_BLOCKS, CLUSTER_THREADS, CLUSTER_UNITS, Kernel};
use super::{Cuda, ensure_dtype, float, ptr, vec16};
use crate::backend::ClassifierOps;
use crate::tensor::{DType, Tensor};

/// Threads per row of `cross_entropy`: a vocabulary of 150k is 300 elements per thread.
const THREADS: u32 = 512;

/// Whether a cluster's registers hold a row of `v` values of `size` bytes: the kernel gives
/// each block a share of whole 16-byte units.
fn cluster_fits(v: usize, size: usize) -> bool {
    let units = (v * size).div_ceil(16);
    units.div_ceil(CLUSTER_BLOCKS) <= CLUSTER_THREADS as usize * CLUSTER_UNITS
}

impl ClassifierOps for Cuda {
    fn cross_entropy(
        &self, logits: &Tensor<Cuda>, losses: &Tensor<Cuda>, targets: &Tensor<Cuda>, z_loss: f32,
        grad_scale: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let _timing = self.time_op("cross_entropy")?;
        ensure_dtype(losses, DType::F32, "cross_entropy (losses)")?;
        ensure_dtype(targets, DType::I32, "cross_entropy (targets)")?;
        if let Some(scale) = grad_scale {
            ensure_dtype(scale, DType::F32, "cross_entropy (grad_scale)")?;
            ensure!(
                scale.numel() == 1,
                "cross_entropy: grad_scale {:?}",
                scale.shape
            );
        }
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
        let args = [
            ptr(logits).into(),
            ptr(losses).into(),
            ptr(targets).into(),
            (v as i32).into(),
            z_loss.into(),
            grad_scale.map_or(0, ptr).into(),
        ];
        let vec = vec16(&[logits], v);
        if vec && self.compute_capability.0 >= 9 && cluster_fits(v, logits.dtype.size_bytes()) {
            // SAFETY: the cluster of blocks 8i..8i+8 reads targets[i] and grad_scale (one f32
            // or null), reads and (when training) rewrites row i of logits [n, v], whose
            // 16-byte units it holds, and writes losses[i].
            return unsafe {
                self.launch(
                    Kernel::CrossEntropyCluster,
                    &[float(logits)],
                    ((n * CLUSTER_BLOCKS) as u32, 1, 1),
                    CLUSTER_THREADS,
                    &args,
                )
            };
        }
        // SAFETY: block i reads targets[i] and grad_scale (one f32 or null), reads and (when
        // training) rewrites row i of logits [n, v], and writes losses[i].
        unsafe {
            self.launch(
                Kernel::CrossEntropy,
                &[float(logits), Arg::Flag(vec)],
                (n as u32, 1, 1),
                THREADS,
                &args,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_holds_the_qwen_and_llama_vocabularies_in_bf16_only() {
        assert!(cluster_fits(151_936, 2));
        assert!(cluster_fits(128_256, 2));
        assert!(cluster_fits(196_608, 2));
        assert!(!cluster_fits(196_616, 2));
        assert!(!cluster_fits(151_936, 4));
    }
}
