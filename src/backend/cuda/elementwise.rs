//! Host transfers, fill, convert-copy and the deterministic sum of squares.

use anyhow::{Result, ensure};
use cudarc::driver::result;

use super::kernels::Kernel;
use super::multi_tensor::Runs;
use super::{BLOCK, Cuda, aligned_head, blocks, ensure_dtype, ensure_dtype_in, float, ptr};
use crate::tensor::{DType, Tensor};

/// Blocks of the two-pass sum of squares: a function of the length only, so the reduction
/// tree (which also depends on x's address modulo 16), and hence the result, is the same on
/// every run and every GPU.
fn sum_squares_blocks(n: usize) -> u32 {
    blocks(n, BLOCK as usize * 8).min(1024)
}

/// The words of elementwise.cu's `SquaresEntry`.
const SQUARES_ENTRY_WORDS: usize = 4;

/// Grid-stride element-wise kernels need no more blocks than this.
fn elementwise_blocks(n: usize) -> u32 {
    blocks(n, BLOCK as usize).min(1 << 16)
}

impl Cuda {
    /// Copies host elements of the tensor's storage type in. Pageable host memory is staged
    /// before the call returns, so `src` may be reused at once.
    pub(super) fn copy_in<T>(&self, dst: &Tensor<Cuda>, src: &[T]) -> Result<()> {
        ensure!(
            std::mem::size_of_val(src) == dst.bytes(),
            "upload size mismatch"
        );
        self.ctx.bind_to_thread()?;
        // SAFETY: `dst` spans `dst.bytes()` bytes of a live arena, equal to `src`'s size.
        unsafe { result::memcpy_htod_async(ptr(dst), src, self.stream.cu_stream()) }?;
        Ok(())
    }

    /// Waits for the stream and copies the tensor's raw elements out.
    pub(super) fn copy_out<T: Default + Clone>(&self, src: &Tensor<Cuda>) -> Result<Vec<T>> {
        ensure!(
            src.bytes().is_multiple_of(std::mem::size_of::<T>()),
            "download size mismatch"
        );
        let mut out = vec![T::default(); src.bytes() / std::mem::size_of::<T>()];
        self.ctx.bind_to_thread()?;
        // SAFETY: `src` spans exactly `out`'s bytes of a live arena.
        unsafe { result::memcpy_dtoh_async(&mut out, ptr(src), self.stream.cu_stream()) }?;
        self.stream.synchronize()?;
        Ok(out)
    }

    pub(super) fn fill_impl(&self, dst: &Tensor<Cuda>, value: f32) -> Result<()> {
        let n = dst.numel();
        // SAFETY: fill<T>(T* dst, long long n, float value) writes n elements of dst.
        unsafe {
            self.launch(
                Kernel::Fill,
                &[float(dst)],
                (elementwise_blocks(n), 1, 1),
                BLOCK,
                &[ptr(dst).into(), (n as i64).into(), value.into()],
            )
        }
    }

    pub(super) fn copy_impl(&self, dst: &Tensor<Cuda>, src: &Tensor<Cuda>) -> Result<()> {
        let n = dst.numel();
        ensure!(
            n == src.numel(),
            "copy {:?} into {:?}",
            src.shape,
            dst.shape
        );
        // SAFETY: copy<S, D>(D* dst, const S* src, long long n) touches n elements of each.
        unsafe {
            self.launch(
                Kernel::Copy,
                &[float(src), float(dst)],
                (elementwise_blocks(n), 1, 1),
                BLOCK,
                &[ptr(dst).into(), ptr(src).into(), (n as i64).into()],
            )
        }
    }

    /// One partial pass over the tensors given (one launch per run of tensors of one dtype:
    /// one for a model's gradients) into consecutive runs of one scratch array, then one
    /// block per tensor sums its run of partials (none for an absent tensor: 0).
    pub(super) fn sum_squares_impl(
        &self,
        sums: &Tensor<Cuda>,
        xs: &[Option<&Tensor<Cuda>>],
    ) -> Result<()> {
        ensure_dtype(sums, DType::F32, "sum_squares")?;
        ensure!(
            sums.numel() == xs.len(),
            "sum_squares: {} sums for {} tensors",
            sums.numel(),
            xs.len()
        );
        let present: Vec<&Tensor<Cuda>> = xs.iter().flatten().copied().collect();
        // Each present tensor's table entry (elementwise.cu's `SquaresEntry`: x, n, head,
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
    pub(super) fn sum_impl(&self, out: &Tensor<Cuda>, x: &Tensor<Cuda>) -> Result<()> {
        ensure_dtype(out, DType::F32, "sum")?;
        ensure_dtype(x, DType::F32, "sum")?;
        ensure!(out.numel() == 1, "sum: out must hold one value");
        let (_, offsets) = self.scratch_with_table(0, &[0, x.numel() as u64])?;
        self.sum_ranges(out, ptr(x), offsets)
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
