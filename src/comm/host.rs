//! Collectives on any backend through host memory: each rank downloads its tensors, the
//! values meet in the ranks' `Group` (in this process, or over TCP through rank 0's store),
//! and each rank uploads the result. Slow (every value crosses the bus twice and waits for
//! every rank), and meant for what it makes possible: running and testing the multi-rank
//! trainer, threads and processes alike, on the CPU, and checking NCCL's results on GPUs.
//!
//! Values travel as f64 and are summed in rank order, then rounded once to the tensor's
//! dtype on upload. For two ranks and dtypes up to f32 that is exactly what NCCL computes:
//! one rounding of the exact sum.

use anyhow::{Result, ensure};

use super::{Comm, Member};
use crate::backend::Backend;
use crate::tensor::Tensor;

/// Uploads values that travelled as f64 (`Backend::upload` rounds them to `t`'s dtype).
fn upload<B: Backend>(b: &B, t: &Tensor<B>, values: &[f64]) -> Result<()> {
    let values: Vec<f32> = values.iter().map(|&x| x as f32).collect();
    b.upload(t, &values)
}

pub struct Host {
    pub member: Member,
}

impl Host {
    /// Replaces `tensors` by their sums over the ranks on every rank, or on `root` only.
    fn sum_into<B: Backend>(
        &self, b: &B, tensors: &[&Tensor<B>], root: Option<usize>,
    ) -> Result<()> {
        let mut mine = Vec::with_capacity(tensors.iter().map(|t| t.numel()).sum());
        for t in tensors {
            mine.extend(b.download_f64(t)?);
        }
        let sums = self.member.sum(&mine)?;
        if root.is_some_and(|root| root != self.member.rank) {
            return Ok(());
        }
        let mut at = 0;
        for t in tensors {
            upload(b, t, &sums[at..at + t.numel()])?;
            at += t.numel();
        }
        Ok(())
    }
}

impl<B: Backend> Comm<B> for Host {
    fn rank(&self) -> usize {
        self.member.rank
    }

    fn world(&self) -> usize {
        self.member.world()
    }

    /// Sums at once: downloading waits for the ops that wrote the tensors, and nothing is
    /// left running to finish.
    fn start_all_reduce_sum(&self, b: &B, tensors: &[&Tensor<B>]) -> Result<()> {
        self.sum_into(b, tensors, None)
    }

    fn start_reduce_sum(&self, b: &B, tensors: &[&Tensor<B>], root: usize) -> Result<()> {
        self.sum_into(b, tensors, Some(root))
    }

    fn wait_for_sums_of(&self, _: &B, _: &[&Tensor<B>]) -> Result<()> {
        Ok(())
    }

    fn join_all_reduce_sums(&self, _: &B) -> Result<()> {
        Ok(())
    }

    fn broadcast(&self, b: &B, tensors: &[(&Tensor<B>, usize)]) -> Result<()> {
        let rank = self.member.rank;
        let mut mine = vec![];
        for (t, _) in tensors.iter().filter(|(_, owner)| *owner == rank) {
            mine.extend(b.download_f64(t)?);
        }
        let all = self.member.group.exchange(rank, mine)?;
        // Where the next tensor of each owner starts in that owner's list.
        let mut at = vec![0; all.len()];
        for &(t, owner) in tensors {
            ensure!(
                owner < all.len(),
                "broadcast from rank {owner} of {}",
                all.len()
            );
            let values = &all[owner][at[owner]..at[owner] + t.numel()];
            at[owner] += t.numel();
            if owner != rank {
                upload(b, t, values)?;
            }
        }
        Ok(())
    }

    fn sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        self.member.sum(values)
    }
}
