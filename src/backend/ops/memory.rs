//! The memory family: allocation by category, transfers between the host and the device,
//! copies, and waiting for the device.

use anyhow::Result;

use crate::tensor::{Tensor, TensorSpec};

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
    /// Starts `dst = src` (one dtype; one of them offloaded) once the ops enqueued so far are
    /// done, on a copy engine, so that it overlaps the ops enqueued after it; those must
    /// leave both tensors alone until `wait_for_copies_of` either. Where nothing runs beside
    /// the caller (the CPU), the copy is made at once.
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
