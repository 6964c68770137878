//! The memory family on the GPU: allocation by category (`arena.rs` carves each into views),
//! transfers between host and device, fill and convert-copy (memory.cu), and copies on the
//! copy engine beside the compute stream (offload).

use anyhow::{Context, Result, ensure};
use cudarc::driver::{result, sys};
use half::bf16;
use rayon::prelude::*;

use super::arena::{CudaStorage, Place};
use super::kernels::Kernel;
use super::{BLOCK, Cuda, blocks, float, fp8, ptr};
use crate::backend::ops::memory::check_row_copy;
use crate::backend::{MemoryOps, RowAt};
use crate::tensor::{DType, Tensor, TensorSpec};

/// Q8 codes (whole numbers in 0..=255; `as` saturates anything else).
fn q8_codes(values: &[f32]) -> Vec<u8> {
    values
        .par_iter()
        .map(|&x| x.round_ties_even() as u8)
        .collect()
}

/// Grid-stride element-wise kernels need no more blocks than this.
fn elementwise_blocks(n: usize) -> u32 {
    blocks(n, BLOCK as usize).min(1 << 16)
}

impl MemoryOps for Cuda {
    type Storage = CudaStorage;

    fn allocate(&self, category: &str, specs: &[TensorSpec]) -> Result<Vec<Tensor<Self>>> {
        self.allocate_in(category, specs, Place::Device)
    }

    fn allocate_offloaded(
        &self, category: &str, specs: &[TensorSpec],
    ) -> Result<Vec<Tensor<Self>>> {
        self.allocate_in(category, specs, Place::PinnedHost)
    }

    fn free_memory(&self) -> Option<(usize, usize)> {
        self.memory.report().ok().map(|r| (r.free, r.total))
    }

    fn upload(&self, dst: &Tensor<Self>, src: &[f32]) -> Result<()> {
        ensure!(
            src.len() == dst.numel(),
            "upload of {} values into {:?}",
            src.len(),
            dst.shape
        );
        // The conversions run in parallel: checkpoints and the tests' model-sized inputs
        // are hundreds of millions of values.
        match dst.dtype {
            DType::F32 => self.copy_in(dst, src),
            DType::BF16 => {
                let v: Vec<bf16> = src.par_iter().map(|&x| bf16::from_f32(x)).collect();
                self.copy_in(dst, &v)
            }
            fp8 if fp8.is_fp8() => {
                let v: Vec<u8> = src.par_iter().map(|&x| fp8::encode(x, fp8)).collect();
                self.copy_in(dst, &v)
            }
            DType::I8 => {
                // Codes are whole numbers in ±127; `as` saturates anything else.
                let v: Vec<i8> = src.par_iter().map(|&x| x.round_ties_even() as i8).collect();
                self.copy_in(dst, &v)
            }
            DType::Q8 => self.copy_in(dst, &q8_codes(src)),
            other => anyhow::bail!("upload of f32 values into a {other} tensor {:?}", dst.shape),
        }
    }

    fn upload_i32(&self, dst: &Tensor<Self>, src: &[i32]) -> Result<()> {
        ensure!(
            src.len() == dst.numel() && dst.dtype == DType::I32,
            "upload of {} i32 values into {:?} {}",
            src.len(),
            dst.shape,
            dst.dtype
        );
        self.copy_in(dst, src)
    }

    fn download(&self, src: &Tensor<Self>) -> Result<Vec<f32>> {
        Ok(match src.dtype {
            DType::F32 => self.copy_out::<f32>(src)?,
            DType::BF16 => self
                .copy_out::<bf16>(src)?
                .into_par_iter()
                .map(f32::from)
                .collect(),
            fp8 if fp8.is_fp8() => self
                .copy_out::<u8>(src)?
                .into_par_iter()
                .map(|code| fp8::decode(code, fp8))
                .collect(),
            DType::I8 => self
                .copy_out::<i8>(src)?
                .into_iter()
                .map(f32::from)
                .collect(),
            DType::Q8 => self
                .copy_out::<u8>(src)?
                .into_iter()
                .map(f32::from)
                .collect(),
            DType::I32 => self
                .copy_out::<i32>(src)?
                .into_iter()
                .map(|x| x as f32)
                .collect(),
            other => anyhow::bail!("download of a {other} tensor"),
        })
    }

    fn fill(&self, dst: &Tensor<Self>, value: f32) -> Result<()> {
        let _timing = self.time_op("fill")?;
        self.fill_untimed(dst, value)
    }

    fn copy(&self, dst: &Tensor<Self>, src: &Tensor<Self>) -> Result<()> {
        let _timing = self.time_op("copy")?;
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

    fn copy_row_at(
        &self, dst: &Tensor<Self>, src: &Tensor<Self>, at: &Tensor<Self>, side: RowAt,
    ) -> Result<()> {
        let _timing = self.time_op("copy_row_at")?;
        let (rows, cols) = check_row_copy(dst, src, at, side)?;
        // SAFETY: the kernel reads one i32 at `at` and clamps it into the indexed tensor's
        // `rows` rows, then moves `cols` elements of one dtype from a row of src within it to
        // a row of dst within it (`check_row_copy`: both hold a row of that width).
        unsafe {
            self.launch(
                Kernel::CopyRowAt,
                &[float(src)],
                (elementwise_blocks(cols), 1, 1),
                BLOCK,
                &[
                    ptr(dst).into(),
                    ptr(src).into(),
                    ptr(at).into(),
                    (rows as i64).into(),
                    (cols as i64).into(),
                    ((side == RowAt::Dst) as i32).into(),
                ],
            )
        }
    }

    fn start_copy(&self, dst: &Tensor<Self>, src: &Tensor<Self>) -> Result<()> {
        ensure!(
            dst.dtype == src.dtype && dst.numel() == src.numel(),
            "start_copy of {} {:?} into {} {:?}",
            src.dtype,
            src.shape,
            dst.dtype,
            dst.shape
        );
        let copies = match dst.storage.in_host() {
            true => &self.copies_out,
            false => &self.copies_in,
        };
        let both = [ptr(dst), ptr(src)];
        copies.join(&self.stream)?;
        // The other direction's last copy into or out of either tensor (a slot's block going
        // out before the next comes in) ends first.
        self.copies_pending.wait(copies, &both)?;
        // SAFETY: both ranges are the tensors' own bytes; the copy stream waits for the ops
        // enqueued so far and for the earlier copies of either tensor, and the caller keeps
        // later ops off both until `wait_for_copies_of` either. Unified addressing lets one
        // call move device and pinned host bytes.
        unsafe { sys::cuMemcpyAsync(ptr(dst), ptr(src), src.bytes(), copies.cu_stream()) }
            .result()
            .context("starting a copy between device and host memory")?;
        self.copies_pending.record(copies, &both)
    }

    fn wait_for_copies_of(&self, tensors: &[&Tensor<Self>]) -> Result<()> {
        let addresses: Vec<u64> = tensors.iter().map(|t| ptr(t)).collect();
        self.copies_pending.wait(&self.stream, &addresses)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().context("waiting for the GPU")
    }
}

impl Cuda {
    /// `fill`, for ops that fill as one of their steps and are timed whole.
    pub(super) fn fill_untimed(&self, dst: &Tensor<Cuda>, value: f32) -> Result<()> {
        let n = dst.numel();
        if dst.dtype == DType::Q8 {
            // Codes are filled once, when the state starts: from the host.
            return self.copy_in(dst, &q8_codes(&vec![value; n]));
        }
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

    /// Copies host elements of the tensor's storage type in. Pageable host memory is staged
    /// before the call returns, so `src` may be reused at once.
    fn copy_in<T>(&self, dst: &Tensor<Cuda>, src: &[T]) -> Result<()> {
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
    fn copy_out<T: Default + Clone>(&self, src: &Tensor<Cuda>) -> Result<Vec<T>> {
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
}
