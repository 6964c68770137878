//! AdamW: the CPU's f32 update on the device, clipping by the device-side norm, one launch
//! for a whole list of tensors.

use anyhow::{Result, ensure};

use super::fp8::amax_ptr;
use super::kernels::{Arg, Kernel};
use super::multi_tensor::Runs;
use super::{BLOCK, Cuda, aligned_head, blocks, ensure_dtype, float, ptr};
use crate::backend::{AdamW, AdamWTensor};
use crate::tensor::{DType, Tensor};

/// Elements a thread updates at once when every tensor is 16-byte aligned at `head`: as
/// many as fill 16 bytes of the widest one (adamw.cu says why); else 1.
fn unit_width(t: &AdamWTensor<'_, Cuda>, aligned: bool) -> usize {
    let widest = [t.param, t.grad, t.m, t.v]
        .iter()
        .chain(&t.master)
        .map(|x| x.dtype.size_bytes())
        .max()
        .expect("four tensors at least");
    if aligned { 16 / widest } else { 1 }
}

/// The most blocks of one tensor: some 16 waves of the ~500 blocks an H100 holds at once (so
/// the last, partial wave costs little), while the largest tensors (embeddings) loop over
/// several units per thread and pay for their block's clip factor once.
const MAX_BLOCKS: u32 = 8192;

/// The words of adamw.cu's `AdamWEntry`.
const ENTRY_WORDS: usize = 11;

/// What selects one instantiation of the kernel: the dtypes of param, grad, m and v, whether
/// there is a master copy, and the unit width.
type Variant = (DType, DType, DType, DType, bool, usize);

impl Cuda {
    pub(super) fn adamw_impl(
        &self,
        tensors: &[AdamWTensor<'_, Cuda>],
        norm_sq: &Tensor<Cuda>,
        hp: &AdamW,
    ) -> Result<()> {
        ensure_dtype(norm_sq, DType::F32, "adamw (norm_sq)")?;
        let mut table: Vec<u64> = Vec::with_capacity(ENTRY_WORDS * tensors.len());
        let mut runs: Runs<Variant> = Runs::new();
        for t in tensors {
            let amax = amax_ptr("adamw", t.amax)?;
            if let Some(master) = t.master {
                ensure_dtype(master, DType::F32, "adamw (master)")?;
            }
            let n = t.param.numel();
            ensure!(
                [t.grad, t.m, t.v].iter().all(|x| x.numel() == n)
                    && t.master.is_none_or(|x| x.numel() == n),
                "adamw: param {:?}, grad {:?}, m {:?}, v {:?} and master {:?} must all have the \
                 same number of elements",
                t.param.shape,
                t.grad.shape,
                t.m.shape,
                t.v.shape,
                t.master.map(|x| &x.shape)
            );
            // Stochastic rounding hashes each element's index in 32 bits (adamw.cu's and the
            // CPU's `hash_u32`, which requires it): past that, indices would wrap and share
            // their noise.
            ensure!(
                n <= u32::MAX as usize,
                "adamw: param {:?} has {n} elements, more than the {} the GPU optimizer supports \
                 in one tensor; train a model whose largest parameter (usually the embedding, \
                 vocab × hidden) is smaller",
                t.param.shape,
                u32::MAX
            );
            let mut all = vec![t.param, t.grad, t.m, t.v];
            all.extend(t.master);
            let head = aligned_head(&all).filter(|&h| h <= n);
            let width = unit_width(t, head.is_some());
            let variant = (
                t.param.dtype,
                t.grad.dtype,
                t.m.dtype,
                t.v.dtype,
                t.master.is_some(),
                width,
            );
            let units = head.map_or(n, |h| (n - h) / width);
            let grid = blocks(units, BLOCK as usize).min(MAX_BLOCKS);
            let first_block = runs.push(variant, grid);
            let weight_decay = hp.weight_decay_for(t.decays).to_bits() as u64;
            table.extend([
                ptr(t.param),
                t.master.map_or(0, ptr),
                ptr(t.grad),
                ptr(t.m),
                ptr(t.v),
                amax,
                n as u64,
                head.unwrap_or(0) as u64,
                t.seed,
                weight_decay | (first_block as u64) << 32,
                grid as u64,
            ]);
        }
        let (_, list) = self.scratch_with_table(0, &table)?;
        let (inv_bias1, inv_sqrt_bias2) = hp.bias_factors();
        for run in &runs.0 {
            let (.., master, width) = run.variant;
            let t = &tensors[run.first];
            // SAFETY: block b of the launch finds the entry whose run holds it and updates
            // elements of that entry's param, master, grad, m and v (all n long), with wide
            // accesses only from `head` on, where every one of them is 16-byte aligned (the
            // variant's width says so for every entry of the run); norm_sq is one f32, each
            // amax one f32 or null.
            unsafe {
                self.launch(
                    Kernel::AdamW,
                    &[
                        float(t.param),
                        float(t.grad),
                        float(t.m),
                        float(t.v),
                        Arg::Flag(master),
                        Arg::Width(width),
                    ],
                    (run.blocks, 1, 1),
                    BLOCK,
                    &[
                        run.entries_at(list, ENTRY_WORDS).into(),
                        (run.entries as i32).into(),
                        ptr(norm_sq).into(),
                        hp.lr.into(),
                        hp.beta1.into(),
                        hp.beta2.into(),
                        hp.eps.into(),
                        inv_bias1.into(),
                        inv_sqrt_bias2.into(),
                        hp.grad_clip.into(),
                    ],
                )?;
            }
        }
        Ok(())
    }
}
