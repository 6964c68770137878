//! Collectives between the ranks of a data-parallel run: one rank per device, each with its
//! own backend and its own replica of the model. The ranks are threads of this process
//! (`--gpus N`) or processes started by a launcher (torchrun, Slurm, mpirun), possibly on
//! several machines (`launch`).
//!
//! `Comm` is what the trainer asks of them. Three implementations: `Solo` (one rank, nothing
//! to exchange), `Host` (any backend: tensors pass through host memory and the group, so that
//! the multi-rank logic runs and is tested on the CPU) and, on GPUs, `nccl::Nccl`. Host values
//! (losses, token counts) always meet in the ranks' `Group`, which is shared memory between
//! threads and rank 0's TCP store between processes. `ranks` starts the ranks and runs a
//! command's body on each.

pub mod group;
pub mod host;
pub mod launch;
pub mod nccl;
pub mod ranks;
mod tcp;
mod torch_store;

use std::sync::Arc;

use anyhow::Result;

use self::group::Group;
use crate::backend::Backend;
use crate::tensor::Tensor;

pub use self::host::Host;

pub trait Comm<B: Backend> {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Starts replacing each tensor, on every rank, by its sum over the ranks, once the ops
    /// enqueued so far are done. Later ops may run while it does, and must leave the tensors
    /// alone until `join_all_reduce_sums`: this is how the gradient sums overlap the backward.
    fn start_all_reduce_sum(&self, b: &B, tensors: &[&Tensor<B>]) -> Result<()>;
    /// Like `start_all_reduce_sum`, but only rank `root`'s tensors receive the sums; the
    /// others' are left as they were (ZeRO-2: each block's gradients to the rank updating it).
    fn start_reduce_sum(&self, b: &B, tensors: &[&Tensor<B>], root: usize) -> Result<()>;
    /// Makes the ops enqueued from now on wait for the sums started so far over any of
    /// `tensors`, before they write them again.
    fn wait_for_sums_of(&self, b: &B, tensors: &[&Tensor<B>]) -> Result<()>;
    /// Makes the ops enqueued from now on wait for every sum started so far.
    fn join_all_reduce_sums(&self, b: &B) -> Result<()>;
    /// Copies each tensor from the rank given with it to every other rank.
    fn broadcast(&self, b: &B, tensors: &[(&Tensor<B>, usize)]) -> Result<()>;
    /// `values` summed over the ranks, element by element, in rank order (so every rank gets
    /// the same bits). Waits for every rank, and fails if one has failed.
    fn sum(&self, values: &[f64]) -> Result<Vec<f64>>;
}

/// The one rank of a single-device run.
pub struct Solo;

impl<B: Backend> Comm<B> for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn start_all_reduce_sum(&self, _: &B, _: &[&Tensor<B>]) -> Result<()> {
        Ok(())
    }
    fn start_reduce_sum(&self, _: &B, _: &[&Tensor<B>], _: usize) -> Result<()> {
        Ok(())
    }
    fn wait_for_sums_of(&self, _: &B, _: &[&Tensor<B>]) -> Result<()> {
        Ok(())
    }
    fn join_all_reduce_sums(&self, _: &B) -> Result<()> {
        Ok(())
    }
    fn broadcast(&self, _: &B, _: &[(&Tensor<B>, usize)]) -> Result<()> {
        Ok(())
    }
    fn sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        Ok(values.to_vec())
    }
}

/// One rank's place in its group: what every multi-rank `Comm` shares for host values.
pub struct Member {
    pub rank: usize,
    pub group: Arc<dyn Group>,
}

impl Member {
    pub fn world(&self) -> usize {
        self.group.world()
    }

    /// `Comm::sum`.
    pub fn sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        let all = self.group.exchange(self.rank, values.to_vec())?;
        Ok((0..values.len())
            .map(|i| all.iter().map(|rank| rank[i]).sum())
            .collect())
    }
}
