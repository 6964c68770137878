//! AdamW: the CPU's f32 update on the device, clipping by the device-side norm.

use anyhow::{Result, ensure};

use super::fp8::amax_ptr;
use super::kernels::{Arg, Kernel};
use super::{BLOCK, Cuda, aligned_head, blocks, ensure_dtype, float, ptr};
use crate::backend::AdamW;
use crate::tensor::{DType, Tensor};

/// Elements per vector unit of adamw.cu: 16 bytes of bf16, two 16-byte accesses of f32.
const VECTOR: usize = 8;

/// The most blocks of the grid-stride kernel: some 16 waves of the ~500 blocks an H100 holds
/// at once (so the last, partial wave costs little), while the largest tensors (embeddings)
/// loop over several units per thread and pay for their block's clip factor once.
const MAX_BLOCKS: u32 = 8192;

impl Cuda {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn adamw_impl(
        &self,
        param: &Tensor<Cuda>,
        master: Option<&Tensor<Cuda>>,
        grad: &Tensor<Cuda>,
        m: &Tensor<Cuda>,
        v: &Tensor<Cuda>,
        norm_sq: &Tensor<Cuda>,
        hp: &AdamW,
        amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let amax = amax_ptr("adamw", amax)?;
        ensure_dtype(norm_sq, DType::F32, "adamw (norm_sq)")?;
        if let Some(master) = master {
            ensure_dtype(master, DType::F32, "adamw (master)")?;
        }
        let n = param.numel();
        ensure!(
            [grad, m, v].iter().all(|t| t.numel() == n) && master.is_none_or(|t| t.numel() == n),
            "adamw: tensors of different sizes"
        );
        let (inv_bias1, inv_sqrt_bias2) = hp.bias_factors();
        let mut tensors = vec![param, grad, m, v];
        tensors.extend(master);
        let head = aligned_head(&tensors).filter(|&h| h <= n);
        let units = head.map_or(n, |h| (n - h) / VECTOR);
        // SAFETY: adamw<..., VEC>(...) updates elements 0..n of param, master, grad, m and v
        // (all n long), with 16-byte accesses only from `head` on, where every one of them is
        // 16-byte aligned; norm_sq is one f32, amax one f32 or null.
        unsafe {
            self.launch(
                Kernel::AdamW,
                &[
                    float(param),
                    float(grad),
                    float(m),
                    float(v),
                    Arg::Flag(master.is_some()),
                    Arg::Flag(head.is_some()),
                ],
                (blocks(units, BLOCK as usize).min(MAX_BLOCKS), 1, 1),
                BLOCK,
                &[
                    ptr(param).into(),
                    master.map_or(0, ptr).into(),
                    ptr(grad).into(),
                    ptr(m).into(),
                    ptr(v).into(),
                    ptr(norm_sq).into(),
                    (n as i64).into(),
                    (head.unwrap_or(0) as i64).into(),
                    hp.lr.into(),
                    hp.beta1.into(),
                    hp.beta2.into(),
                    hp.eps.into(),
                    hp.weight_decay.into(),
                    inv_bias1.into(),
                    inv_sqrt_bias2.into(),
                    hp.grad_clip.into(),
                    hp.seed.into(),
                    amax.into(),
                ],
            )
        }
    }
}
