//! NCCL collectives between GPUs, one communicator per rank. Broadcasts run on the rank's
//! compute stream, ordered with its ops like any other; sums run on a stream of their own,
//! of the highest priority, so that the backward goes on while the gradients of the blocks
//! it has finished are summed. Tensors are reduced in their own dtype (bf16 gradients as
//! bf16, NCCL summing in f32 and rounding the result).

use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use cudarc::driver::{CudaStream, result::stream};
use cudarc::nccl::{result, sys};

use super::{Cuda, ptr};
use crate::comm::{Comm, Member};
use crate::tensor::{DType, Tensor};

pub struct Nccl {
    comm: sys::ncclComm_t,
    compute: Arc<CudaStream>,
    /// Where the sums run, behind the compute stream's ops enqueued before each.
    sums: Arc<CudaStream>,
    member: Member,
}

/// What every rank's communicator is created from: made once, before the ranks start.
#[derive(Clone, Copy)]
pub struct UniqueId(sys::ncclUniqueId);

impl UniqueId {
    /// Fails, saying what to install, where libnccl cannot be loaded.
    pub fn new() -> Result<UniqueId> {
        // SAFETY: only tries to dlopen the library under its usual names.
        if !unsafe { sys::is_culib_present() } {
            bail!(
                "--gpus: cannot load libnccl.so.2 (NCCL), which multi-GPU runs need: install \
                 NCCL (`pip install nvidia-nccl-cu13` and its lib directory on \
                 LD_LIBRARY_PATH), or run on one GPU"
            );
        }
        let id = result::get_uniqueid().map_err(|e| anyhow::anyhow!("NCCL: {e:?}"))?;
        Ok(UniqueId(id))
    }
}

impl Nccl {
    /// Joins rank `member.rank`'s communicator; returns once every rank has joined.
    pub fn new(cuda: &Cuda, id: UniqueId, member: Member) -> Result<Nccl> {
        // A rank whose GPU failed to open never joins, and NCCL would wait for it for ever.
        member.sum(&[])?;
        cuda.ctx.bind_to_thread()?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the communicator; the id is the one every rank was given.
        unsafe {
            result::comm_init_rank(&mut comm, member.world() as i32, id.0, member.rank as i32)
        }
        .map_err(|e| anyhow::anyhow!("{e:?}"))
        .with_context(|| format!("NCCL: creating rank {}'s communicator", member.rank))?;
        // Lower numbers are higher priorities: a sum's blocks start as soon as an SM frees up,
        // instead of queueing behind the rest of the backward's. (Over NVLink the default
        // priority measured the same.)
        let (_, highest) = stream::get_priority_range()?;
        Ok(Nccl {
            comm,
            compute: cuda.stream.clone(),
            sums: cuda.ctx.new_stream_with_priority(highest)?,
            member,
        })
    }

    /// Enqueues one collective per tensor (`launches`) inside one NCCL group, so that they
    /// run as one operation. First meets the other ranks on the host: a rank that has failed
    /// since the last meeting then releases them with an error, where NCCL would wait for it
    /// for ever.
    fn grouped(
        &self,
        what: &str,
        mut launches: impl Iterator<Item = Result<sys::ncclResult_t>>,
    ) -> Result<()> {
        self.member.sum(&[])?;
        result::group_start().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let launched = launches.try_for_each(|status| {
            let status = status?;
            ensure!(
                status == sys::ncclResult_t::ncclSuccess,
                "NCCL {what}: {status:?}"
            );
            Ok(())
        });
        let ended = result::group_end().map_err(|e| anyhow::anyhow!("NCCL {what}: {e:?}"));
        launched.and(ended.map(|_| ()))
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: the communicator is ours and no longer used.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}

/// NCCL's name for a dtype that it sums.
fn summed_dtype(t: &Tensor<Cuda>) -> Result<sys::ncclDataType_t> {
    Ok(match t.dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        other => bail!("NCCL all-reduce: no sum of {other} tensors"),
    })
}

impl Comm<Cuda> for Nccl {
    fn rank(&self) -> usize {
        self.member.rank
    }

    fn world(&self) -> usize {
        self.member.world()
    }

    fn start_all_reduce_sum(&self, _: &Cuda, tensors: &[&Tensor<Cuda>]) -> Result<()> {
        self.sums.join(&self.compute)?;
        self.grouped(
            "all-reduce",
            tensors.iter().map(|t| {
                let p = ptr(t) as *mut std::ffi::c_void;
                // SAFETY: in place over the tensor's own elements, on this rank's stream.
                Ok(unsafe {
                    sys::ncclAllReduce(
                        p,
                        p,
                        t.numel(),
                        summed_dtype(t)?,
                        sys::ncclRedOp_t::ncclSum,
                        self.comm,
                        self.sums.cu_stream() as sys::cudaStream_t,
                    )
                })
            }),
        )
    }

    fn join_all_reduce_sums(&self, _: &Cuda) -> Result<()> {
        Ok(self.compute.join(&self.sums)?)
    }

    fn broadcast(&self, _: &Cuda, tensors: &[(&Tensor<Cuda>, usize)]) -> Result<()> {
        self.grouped(
            "broadcast",
            tensors.iter().map(|&(t, owner)| {
                let p = ptr(t) as *mut std::ffi::c_void;
                // SAFETY: in place over the tensor's bytes, on this rank's stream.
                Ok(unsafe {
                    sys::ncclBroadcast(
                        p,
                        p,
                        t.bytes(),
                        sys::ncclDataType_t::ncclUint8,
                        owner as i32,
                        self.comm,
                        self.compute.cu_stream() as sys::cudaStream_t,
                    )
                })
            }),
        )
    }

    fn sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        self.member.sum(values)
    }
}
