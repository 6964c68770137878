//! The optimizer: the gradients' global norm, for clipping, and the fused AdamW update.

use anyhow::{Result, bail, ensure};

use super::adam8bit::{Q8_BLOCK, absmax_len};
use super::memory::MemoryOps;
use crate::tensor::{DType, Tensor};

/// One AdamW step's hyper-parameters, shared by every tensor it updates. `step` counts from
/// 1 for the bias correction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Applies to the tensors that ask for it (`AdamWTensor::decays`).
    pub weight_decay: f32,
    pub step: u64,
    /// Gradients are scaled by `min(1, grad_clip / norm)` with `norm` read on the device;
    /// `0` disables clipping.
    pub grad_clip: f32,
}

impl AdamW {
    /// The weight decay of a tensor that does or does not decay.
    pub fn weight_decay_for(&self, decays: bool) -> f32 {
        if decays { self.weight_decay } else { 0.0 }
    }

    /// The factor that scales gradients of squared global norm `norm_sq` down to
    /// `grad_clip`, in f64 (every backend rounds it to f32 once).
    pub fn clip_scale(&self, norm_sq: f64) -> f64 {
        let norm = norm_sq.sqrt();
        if self.grad_clip > 0.0 && norm > self.grad_clip as f64 {
            self.grad_clip as f64 / norm
        } else {
            1.0
        }
    }

    /// `1 / (1 − β₁^step)` and `1 / √(1 − β₂^step)`, the factors of the bias-corrected
    /// moments, computed in f64 and rounded to f32 once per tensor on the host: every
    /// backend's update multiplies by exactly these.
    pub fn bias_factors(&self) -> (f32, f32) {
        let correction = |beta: f32| 1.0 - (beta as f64).powi(self.step as i32);
        (
            (1.0 / correction(self.beta1)) as f32,
            (1.0 / correction(self.beta2).sqrt()) as f32,
        )
    }
}

/// One tensor of an AdamW step: the parameter (updated through its high-precision `master`
/// copy when there is one, `param` then receiving it rounded), its gradient and moments.
pub struct AdamWTensor<'a, B: MemoryOps> {
    pub param: &'a Tensor<B>,
    pub master: Option<&'a Tensor<B>>,
    pub grad: &'a Tensor<B>,
    pub m: &'a Tensor<B>,
    pub v: &'a Tensor<B>,
    /// The abs-maxes of Q8 moments (`adam8bit`), present exactly when m and v are Q8.
    pub scales: Option<MomentScales<'a, B>>,
    /// Whether weight decay applies: matrices and embeddings, not norms and biases.
    pub decays: bool,
    /// Seeds stochastic rounding; differs per tensor and per step.
    pub seed: u64,
    /// Receives the updated `param`'s abs-max, for its FP8 copy.
    pub amax: Option<&'a Tensor<B>>,
}

/// The per-block abs-maxes of 8-bit moments, `[absmax_len(n)]` f32 each.
pub struct MomentScales<'a, B: MemoryOps> {
    pub m: &'a Tensor<B>,
    pub v: &'a Tensor<B>,
}

impl<B: MemoryOps> AdamWTensor<'_, B> {
    /// Checks that the moments are both Q8 with their scales, or neither with none.
    pub fn check_moments(&self, backend: &str) -> Result<()> {
        let q8 = [self.m.dtype, self.v.dtype].map(|d| d == DType::Q8);
        match (q8, &self.scales) {
            ([true, true], Some(s)) => {
                let blocks = absmax_len(self.param.numel());
                ensure!(
                    s.m.numel() == blocks && s.v.numel() == blocks,
                    "adamw ({backend}): param {:?} has {blocks} blocks of {Q8_BLOCK}, its \
                     moments' scales {:?} and {:?}",
                    self.param.shape,
                    s.m.shape,
                    s.v.shape
                );
                Ok(())
            }
            ([false, false], None) => Ok(()),
            _ => bail!(
                "adamw ({backend}): param {:?} has moments m {} and v {} with{} scales: 8-bit \
                 moments come in pairs, each with its scales",
                self.param.shape,
                self.m.dtype,
                self.v.dtype,
                if self.scales.is_some() { "" } else { "out" }
            ),
        }
    }
}

pub trait OptimizerOps: MemoryOps {
    /// `sums[i] = Σ xs[i]²`, summed in f32, or 0 where `xs[i]` is `None` (a gradient that
    /// another rank sums, under ZeRO-2); `sums` is `[xs.len()]` f32. Each sum depends only on
    /// its tensor, so ranks that each sum their own share, then add the vectors, get the bits
    /// of one rank summing everything.
    fn sum_squares(&self, sums: &Tensor<Self>, xs: &[Option<&Tensor<Self>>]) -> Result<()>;
    /// `out[0] = Σ x` in a fixed order; x f32 (the per-tensor sums above, into the squared
    /// global norm of the gradients, for clipping).
    fn sum(&self, out: &Tensor<Self>, x: &Tensor<Self>) -> Result<()>;
    /// One AdamW step on every tensor of `tensors`. `norm_sq` is the global gradient `Σ g²`
    /// from `sum_squares`, read on the device for clipping.
    fn adamw(
        &self, tensors: &[AdamWTensor<'_, Self>], norm_sq: &Tensor<Self>, hp: &AdamW,
    ) -> Result<()>;
}
