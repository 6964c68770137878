//! The optimizer on the GPU: the gradients' deterministic sums of squares, and AdamW (the
//! CPU's f32 update, clipping by the device-side norm), each one launch for a whole list of
//! tensors.

use anyhow::{Result, ensure};

use super::kernels::{Arg, KArg, Kernel};
use super::multi_tensor::Runs;
use super::{
    BLOCK, Cuda, aligned_head, amax_ptr, blocks, ensure_dtype, ensure_dtype_in, float, ptr,
};
use crate::backend::ops::adam8bit::{DynamicMap, absmax_len};
use crate::backend::{AdamW, AdamWTensor, OptimizerOps};
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

/// The words of adamw.cu's `AdamWEntry`, and of its `AdamW8bitEntry`.
const ENTRY_WORDS: usize = 11;
const ENTRY_8BIT_WORDS: usize = 12;

/// What selects one instantiation of the kernel: the dtypes of param, grad, m and v, whether
/// there is a master copy, and the unit width.
type Variant = (DType, DType, DType, DType, bool, usize);

/// Blocks of the two-pass sum of squares: a function of the length only, so the reduction
/// tree (which also depends on x's address modulo 16), and hence the result, is the same on
/// every run and every GPU.
fn sum_squares_blocks(n: usize) -> u32 {
    blocks(n, BLOCK as usize * 8).min(1024)
}

/// The words of adamw.cu's `SquaresEntry`.
const SQUARES_ENTRY_WORDS: usize = 4;

impl OptimizerOps for Cuda {
    /// One partial pass over the tensors given (one launch per run of tensors of one dtype:
    /// one for a model's gradients) into consecutive runs of one scratch array, then one
    /// block per tensor sums its run of partials (none for an absent tensor: 0).
    fn sum_squares(&self, sums: &Tensor<Cuda>, xs: &[Option<&Tensor<Cuda>>]) -> Result<()> {
        let _timing = self.time_op("sum_squares")?;
        ensure_dtype(sums, DType::F32, "sum_squares")?;
        ensure!(
            sums.numel() == xs.len(),
            "sum_squares: {} sums for {} tensors",
            sums.numel(),
            xs.len()
        );
        let present: Vec<&Tensor<Cuda>> = xs.iter().flatten().copied().collect();
        // Each present tensor's table entry (adamw.cu's `SquaresEntry`: x, n, head,
        // then its first block within its launch and its block count in one word); a run per
        // dtype. Then where each tensor's partials start, and where the last one's end.
        let mut table: Vec<u64> = Vec::with_capacity(SQUARES_ENTRY_WORDS * xs.len() + 1);
        let mut offsets = Vec::with_capacity(xs.len() + 1);
        let mut runs = Runs::new();
        for x in xs {
            offsets.push(runs.blocks() as u64);
            let Some(x) = x else { continue };
            ensure_dtype_in(x, &[DType::F32, DType::BF16], "sum_squares")?;
            let n = x.numel();
            // The elements before the first 16-byte boundary.
            let head = aligned_head(&[x])
                .expect("a tensor of 2- or 4-byte values reaches a 16-byte boundary within 8")
                .min(n);
            let grid = sum_squares_blocks(n);
            let first_block = runs.push(x.dtype, grid);
            table.extend([
                ptr(x),
                n as u64,
                head as u64,
                first_block as u64 | (grid as u64) << 32,
            ]);
        }
        let count = runs.blocks();
        offsets.push(count as u64);
        let entries = table.len();
        table.extend(offsets);
        let (partials, list) = self.scratch_with_table(count as usize, &table)?;
        let mut next = partials;
        for run in &runs.0 {
            // SAFETY: block b of the launch finds its entry, reads that tensor's n elements
            // (16 bytes at a time from element `head`, which is 16-byte aligned) and writes
            // partial b from `next`; the launches' partials are consecutive, `count` in all.
            unsafe {
                self.launch(
                    Kernel::SumSquaresPartial,
                    &[float(present[run.first])],
                    (run.blocks, 1, 1),
                    BLOCK,
                    &[
                        next.into(),
                        run.entries_at(list, SQUARES_ENTRY_WORDS).into(),
                        (run.entries as i32).into(),
                    ],
                )?;
            }
            next += 4 * run.blocks as u64;
        }
        self.sum_ranges(sums, partials, list + 8 * entries as u64)
    }

    /// `out[0] = Σ x`, by one block.
    fn sum(&self, out: &Tensor<Cuda>, x: &Tensor<Cuda>) -> Result<()> {
        let _timing = self.time_op("sum")?;
        ensure_dtype(out, DType::F32, "sum")?;
        ensure_dtype(x, DType::F32, "sum")?;
        ensure!(out.numel() == 1, "sum: out must hold one value");
        let (_, offsets) = self.scratch_with_table(0, &[0, x.numel() as u64])?;
        self.sum_ranges(out, ptr(x), offsets)
    }

    /// The tensors with 8-bit moments in one launch per instantiation, the others in
    /// another.
    fn adamw(
        &self, tensors: &[AdamWTensor<'_, Cuda>], norm_sq: &Tensor<Cuda>, hp: &AdamW,
    ) -> Result<()> {
        let _timing = self.time_op("adamw")?;
        ensure_dtype(norm_sq, DType::F32, "adamw (norm_sq)")?;
        let mut wide = Vec::with_capacity(tensors.len());
        let mut narrow = Vec::new();
        for t in tensors {
            check_tensor(t)?;
            match t.scales {
                Some(_) => narrow.push(t),
                None => wide.push(t),
            }
        }
        self.adamw_wide(&wide, norm_sq, hp)?;
        self.adamw_narrow(&narrow, norm_sq, hp)
    }
}

/// Checks what both kernels require of a tensor's buffers.
fn check_tensor(t: &AdamWTensor<'_, Cuda>) -> Result<()> {
    if let Some(master) = t.master {
        ensure_dtype(master, DType::F32, "adamw (master)")?;
    }
    t.check_moments("cuda")?;
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
    // Stochastic rounding hashes each element's index in 32 bits (adamw.cu's and the CPU's
    // `hash_u32`, which requires it): past that, indices would wrap and share their noise.
    ensure!(
        n <= u32::MAX as usize,
        "adamw: param {:?} has {n} elements, more than the {} the GPU optimizer supports in \
         one tensor; train a model whose largest parameter (usually the embedding, vocab × \
         hidden) is smaller",
        t.param.shape,
        u32::MAX
    );
    Ok(())
}

/// The first words of both kernels' entries: param, master (or null), grad, m and v.
fn buffers(t: &AdamWTensor<'_, Cuda>) -> [u64; 5] {
    [
        ptr(t.param),
        t.master.map_or(0, ptr),
        ptr(t.grad),
        ptr(t.m),
        ptr(t.v),
    ]
}

/// The launch arguments both kernels end with: the norm, then the step's hyper-parameters.
fn hyper_args(norm_sq: &Tensor<Cuda>, hp: &AdamW) -> [KArg; 8] {
    let (inv_bias1, inv_sqrt_bias2) = hp.bias_factors();
    [
        ptr(norm_sq).into(),
        hp.lr.into(),
        hp.beta1.into(),
        hp.beta2.into(),
        hp.eps.into(),
        inv_bias1.into(),
        inv_sqrt_bias2.into(),
        hp.grad_clip.into(),
    ]
}

impl Cuda {
    /// The tensors with f32 or bf16 moments.
    fn adamw_wide(
        &self, tensors: &[&AdamWTensor<'_, Cuda>], norm_sq: &Tensor<Cuda>, hp: &AdamW,
    ) -> Result<()> {
        let mut table: Vec<u64> = Vec::with_capacity(ENTRY_WORDS * tensors.len());
        let mut runs: Runs<Variant> = Runs::new();
        for t in tensors {
            let amax = amax_ptr("adamw", t.amax)?;
            let n = t.param.numel();
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
            table.extend(buffers(t));
            table.extend([
                amax,
                n as u64,
                head.unwrap_or(0) as u64,
                t.seed,
                weight_decay | (first_block as u64) << 32,
                grid as u64,
            ]);
        }
        if table.is_empty() {
            return Ok(());
        }
        let (_, list) = self.scratch_with_table(0, &table)?;
        for run in &runs.0 {
            let (.., master, width) = run.variant;
            let t = &tensors[run.first];
            let mut args = vec![
                run.entries_at(list, ENTRY_WORDS).into(),
                (run.entries as i32).into(),
            ];
            args.extend(hyper_args(norm_sq, hp));
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
                    &args,
                )?;
            }
        }
        Ok(())
    }

    /// The tensors with 8-bit moments, whose scales `check_tensor` has checked.
    fn adamw_narrow(
        &self, tensors: &[&AdamWTensor<'_, Cuda>], norm_sq: &Tensor<Cuda>, hp: &AdamW,
    ) -> Result<()> {
        if tensors.is_empty() {
            return Ok(());
        }
        // The two maps first, two f32s a word, then the entries.
        let maps: Vec<f32> = [DynamicMap::signed(), DynamicMap::unsigned()]
            .iter()
            .flat_map(|m| m.0)
            .collect();
        let mut table: Vec<u64> = (maps.chunks_exact(2))
            .map(|p| p[0].to_bits() as u64 | (p[1].to_bits() as u64) << 32)
            .collect();
        let map_words = table.len();
        let mut runs: Runs<(DType, DType, bool)> = Runs::new();
        let warps = BLOCK as usize / 32;
        for t in tensors {
            let scales = t
                .scales
                .as_ref()
                .expect("only tensors with scales come here");
            let n = t.param.numel();
            let grid = blocks(absmax_len(n), warps).min(MAX_BLOCKS);
            let first_block = runs.push((t.param.dtype, t.grad.dtype, t.master.is_some()), grid);
            let weight_decay = hp.weight_decay_for(t.decays).to_bits() as u64;
            table.extend(buffers(t));
            table.extend([
                ptr(scales.m),
                ptr(scales.v),
                amax_ptr("adamw", t.amax)?,
                n as u64,
                t.seed,
                weight_decay | (first_block as u64) << 32,
                grid as u64,
            ]);
        }
        let (_, maps_at) = self.scratch_with_table(0, &table)?;
        let list = maps_at + 8 * map_words as u64;
        for run in &runs.0 {
            let (.., master) = run.variant;
            let t = &tensors[run.first];
            let mut args = vec![
                run.entries_at(list, ENTRY_8BIT_WORDS).into(),
                (run.entries as i32).into(),
                maps_at.into(),
            ];
            args.extend(hyper_args(norm_sq, hp));
            // SAFETY: block b of the launch finds the entry whose run holds it; its warps
            // update whole blocks of Q8_BLOCK elements of that entry's param, master, grad,
            // m and v (all n long) and one abs-max of each of its scales (absmax_len(n)
            // long); maps_at holds 512 f32s, norm_sq one, each amax one or is null.
            unsafe {
                self.launch(
                    Kernel::AdamW8bit,
                    &[float(t.param), float(t.grad), Arg::Flag(master)],
                    (run.blocks, 1, 1),
                    BLOCK,
                    &args,
                )?;
            }
        }
        Ok(())
    }
    /// `out[r] = Σ x[offsets[r]..offsets[r + 1]]` for each of out's elements, one block each;
    /// `offsets` is a device array of `out.numel() + 1` words.
    fn sum_ranges(&self, out: &Tensor<Cuda>, x: u64, offsets: u64) -> Result<()> {
        // SAFETY: block r reads x over its range of the offsets and writes out[r].
        unsafe {
            self.launch(
                Kernel::SumRanges,
                &[],
                (out.numel() as u32, 1, 1),
                1024,
                &[ptr(out).into(), x.into(), offsets.into()],
            )
        }
    }
}
