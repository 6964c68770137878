//! The memory family: allocation by category, transfers between the host and the device,
//! copies, and waiting for the device.

use anyhow::{Result, ensure};

use crate::tensor::{DType, Tensor, TensorSpec};

/// Which tensor of `copy_row_at` its index is a row of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowAt {
    Dst,
    Src,
}

/// Checks a `copy_row_at` as every backend takes it, and returns the rows of the tensor `at`
/// indexes and their length (a row being the leading dimension's): one dtype and length,
/// `at` one i32.
pub fn check_row_copy<B: MemoryOps>(
    dst: &Tensor<B>, src: &Tensor<B>, at: &Tensor<B>, side: RowAt,
) -> Result<(usize, usize)> {
    let indexed = match side {
        RowAt::Dst => dst,
        RowAt::Src => src,
    };
    ensure!(
        dst.dtype == src.dtype
            && dst.numel() > 0
            && src.numel() > 0
            && dst.row_len() == src.row_len()
            && at.dtype == DType::I32
            && at.numel() == 1,
        "copy_row_at: {} {:?} into {} {:?} at {} {:?} (one dtype and row length, one i32 index)",
        src.dtype,
        src.shape,
        dst.dtype,
        dst.shape,
        at.dtype,
        at.shape
    );
    Ok((indexed.rows(), indexed.row_len()))
}

pub trait MemoryOps: Sized {
    /// A cheap, clonable handle to memory owned by the backend.
    type Storage: Clone;

    /// Allocates one category (weights, gradients, activations, ...) at once and returns its
    /// tensors in the order of `specs`. Contents are unspecified until written.
    fn allocate(&self, category: &str, specs: &[TensorSpec]) -> Result<Vec<Tensor<Self>>>;
    /// `allocate`, but in host memory that the device reads and writes over the bus, for
    /// state touched once per step (the optimizer's): it frees device memory for the price of
    /// moving those bytes over PCIe. Every op takes such tensors like any other. On a backend
    /// whose memory is the host's, the same as `allocate`.
    fn allocate_offloaded(
        &self, category: &str, specs: &[TensorSpec],
    ) -> Result<Vec<Tensor<Self>>> {
        self.allocate(category, specs)
    }
    /// The device's free and total memory in bytes, for the startup memory table; `None`
    /// where the planned tensors are all there is to report (the CPU).
    fn free_memory(&self) -> Option<(usize, usize)> {
        None
    }

    /// Copies host values in, rounding each to the tensor's dtype.
    fn upload(&self, dst: &Tensor<Self>, src: &[f32]) -> Result<()>;
    fn upload_i32(&self, dst: &Tensor<Self>, src: &[i32]) -> Result<()>;
    /// Waits for pending work and returns the tensor's values.
    fn download(&self, src: &Tensor<Self>) -> Result<Vec<f32>>;
    /// `download` at the storage's full precision, for values the host sums (losses, norms)
    /// and for gradient checks on an f64 backend.
    fn download_f64(&self, src: &Tensor<Self>) -> Result<Vec<f64>> {
        Ok(self.download(src)?.into_iter().map(f64::from).collect())
    }
    fn fill(&self, dst: &Tensor<Self>, value: f32) -> Result<()>;
    /// `dst = src`, converting between float dtypes with round-to-nearest-even.
    fn copy(&self, dst: &Tensor<Self>, src: &Tensor<Self>) -> Result<()>;
    /// One row (of the leading dimension) between two tensors of one dtype and row length:
    /// `dst[at] = src[0]` (`RowAt::Dst`) or `dst[0] = src[at]` (`RowAt::Src`), the row `at`
    /// being the i32 the device holds in `at` when the copy runs, so that a recorded pass
    /// (`Backend::record`) moves the row that `at` names at each replay. An index past the
    /// indexed tensor's rows is clamped into them.
    fn copy_row_at(
        &self, dst: &Tensor<Self>, src: &Tensor<Self>, at: &Tensor<Self>, side: RowAt,
    ) -> Result<()>;
    /// Starts `dst = src` (one dtype; one of them offloaded) once the ops enqueued so far are
    /// done, on a copy engine, so that it overlaps the ops enqueued after it; those must
    /// leave both tensors alone until `wait_for_copies_of` either. It also starts after the
    /// copies started before it into or out of either tensor, in whichever direction. Where
    /// nothing runs beside the caller (the CPU), the copy is made at once.
    fn start_copy(&self, dst: &Tensor<Self>, src: &Tensor<Self>) -> Result<()> {
        self.copy(dst, src)
    }
    /// Makes the ops enqueued from now on wait for the last copy started into or out of each
    /// of `tensors` (and so for every copy started before it), but not for later ones.
    fn wait_for_copies_of(&self, _tensors: &[&Tensor<Self>]) -> Result<()> {
        Ok(())
    }
    fn synchronize(&self) -> Result<()>;
}
