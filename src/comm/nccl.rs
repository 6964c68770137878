//! NCCL collectives between GPUs, one communicator per rank. Broadcasts run on the rank's
//! compute stream, ordered with its ops like any other; sums (all-reduces, and ZeRO-2's
//! reduces to one rank) run on a stream of their own, of the highest priority, so that the
//! backward goes on while the gradients of the blocks it has finished are summed. Tensors
//! are reduced in their own dtype (bf16 gradients as bf16, NCCL summing in f32 and rounding
//! the result).
//!
//! Ranks meet on the host before each collective, so a rank that failed since the last
//! meeting releases the others there. One that fails after it (its device faulted, or its
//! host code erred before enqueueing its part) would leave the others' collectives waiting
//! for it on the device for ever: a watcher thread per rank aborts the communicator as soon
//! as the group has failed, which ends those kernels, and so too once the ranks have stalled
//! (none met or waited to meet for `--comm-timeout`). Out of the watcher's reach: a rank
//! that fails during the first collective of a kind, where NCCL connects the ranks and its
//! peer blocks inside NCCL while holding the communicator. `comm::ranks::run` then ends the
//! run the timeout after the failure, leaving that peer behind; `NCCL_RUNTIME_CONNECT=0`,
//! which makes NCCL connect the ranks at creation, avoids the block.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use cudarc::driver::{CudaStream, result::stream};
use cudarc::nccl::{result, sys};

use super::group::Group;
use super::{Comm, Member};
use crate::backend::cuda::pending::Pending;
use crate::backend::cuda::{Cuda, ptr};
use crate::tensor::{DType, Tensor};

pub struct Nccl {
    /// `None` once the watcher has aborted it.
    comm: Arc<Mutex<Option<Handle>>>,
    compute: Arc<CudaStream>,
    /// Where the sums run, behind the compute stream's ops enqueued before each.
    sums: Arc<CudaStream>,
    /// The end of the last sum started over each tensor, until the compute stream joins
    /// them all.
    pending: Pending,
    member: Member,
    stop_watching: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
}

/// A communicator, which NCCL lets any one thread at a time use.
struct Handle(sys::ncclComm_t);

// SAFETY: see `Handle`; the mutex around it keeps the uses apart.
unsafe impl Send for Handle {}

/// How often the watcher looks whether it should stop (the rank's end waits that long).
const WATCH_PERIOD: Duration = Duration::from_millis(100);

/// Aborts `comm` once any rank of `group` has failed, or the ranks have stalled, unless
/// `stop` is set first.
fn watch(group: Arc<dyn Group>, comm: Arc<Mutex<Option<Handle>>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        if group.fails_within(WATCH_PERIOD) {
            abort(&comm);
            return;
        }
    }
}

/// Takes the communicator out and aborts it: frees it without waiting for any peer, ending
/// whatever of its work is still running.
fn abort(comm: &Mutex<Option<Handle>>) {
    if let Some(handle) = lock(comm).take() {
        // SAFETY: the communicator is taken out, so no other use follows.
        let _ = unsafe { result::comm_abort(handle.0) };
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update is a single assignment or insertion, so a panic while holding the lock
    // left no half state.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What every rank's communicator is created from: made by rank 0 and taken to the others
/// by the group, each byte as a value.
fn shared_id(member: &Member) -> Result<sys::ncclUniqueId> {
    // SAFETY: only tries to dlopen the library under its usual names.
    if !unsafe { sys::is_culib_present() } {
        bail!(
            "--gpus: cannot load libnccl.so.2 (NCCL), which multi-GPU runs need: install \
             NCCL (`pip install nvidia-nccl-cu13` and its lib directory on \
             LD_LIBRARY_PATH), or run on one GPU"
        );
    }
    let mine = match member.rank {
        0 => {
            let id = result::get_uniqueid().map_err(|e| anyhow::anyhow!("NCCL: {e:?}"))?;
            id.internal.iter().map(|&b| b as u8 as f64).collect()
        }
        _ => vec![],
    };
    // A rank whose GPU failed to open never comes, and NCCL would wait for it for ever; this
    // meeting fails or times out instead.
    let all = member.group.exchange(member.rank, mine)?;
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    ensure!(all[0].len() == id.internal.len(), "NCCL: rank 0 sent no id");
    for (byte, &value) in id.internal.iter_mut().zip(&all[0]) {
        *byte = value as u8 as std::ffi::c_char;
    }
    Ok(id)
}

impl Nccl {
    /// Joins rank `member.rank`'s communicator; returns once every rank has joined.
    pub fn new(cuda: &Cuda, member: Member) -> Result<Nccl> {
        // Lower numbers are higher priorities: a sum's blocks start as soon as an SM frees up,
        // instead of queueing behind the rest of the backward's.
        let (_, highest) = stream::get_priority_range()?;
        let sums = cuda.ctx.new_stream_with_priority(highest)?;
        let id = shared_id(&member)?;
        cuda.ctx.bind_to_thread()?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the communicator; the id is the one every rank was given.
        unsafe { result::comm_init_rank(&mut comm, member.world() as i32, id, member.rank as i32) }
            .map_err(|e| anyhow::anyhow!("{e:?}"))
            .with_context(|| format!("NCCL: creating rank {}'s communicator", member.rank))?;
        let comm = Arc::new(Mutex::new(Some(Handle(comm))));
        let stop_watching = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (group, comm, stop) = (member.group.clone(), comm.clone(), stop_watching.clone());
            std::thread::spawn(move || watch(group, comm, stop))
        };
        Ok(Nccl {
            comm,
            compute: cuda.stream.clone(),
            sums,
            pending: Pending::default(),
            member,
            stop_watching,
            watcher: Some(watcher),
        })
    }

    /// Enqueues one collective per item (`launch`) inside one NCCL group, so that they run
    /// as one operation. First meets the other ranks on the host: a rank that has failed
    /// since the last meeting then releases them with an error, where NCCL would wait for it
    /// for ever.
    fn grouped<T>(
        &self, what: &str, items: &[T],
        launch: impl Fn(&T, sys::ncclComm_t) -> Result<sys::ncclResult_t>,
    ) -> Result<()> {
        self.member.sum(&[])?;
        let comm = lock(&self.comm);
        let Some(Handle(comm)) = *comm else {
            bail!("NCCL {what}: the communicator was aborted after another rank failed");
        };
        result::group_start().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let launched = items.iter().try_for_each(|item| {
            let status = launch(item, comm)?;
            ensure!(
                status == sys::ncclResult_t::ncclSuccess,
                "NCCL {what}: {status:?}"
            );
            Ok(())
        });
        let ended = result::group_end().map_err(|e| anyhow::anyhow!("NCCL {what}: {e:?}"));
        launched.and(ended.map(|_| ()))
    }

    /// Sums each tensor over the ranks, in place, on the sums stream behind the compute
    /// stream's ops so far: into every rank's, or only `root`'s (the others' are only read).
    /// Notes where the sums end, for `wait_for_sums_of`.
    fn start_sums(&self, tensors: &[&Tensor<Cuda>], root: Option<usize>) -> Result<()> {
        self.sums.join(&self.compute)?;
        let stream = self.sums.cu_stream() as sys::cudaStream_t;
        let what = match root {
            Some(_) => "reduce",
            None => "all-reduce",
        };
        self.grouped(what, tensors, |t, comm| {
            let p = ptr(t) as *mut std::ffi::c_void;
            let (n, dtype, sum) = (t.numel(), summed_dtype(t)?, sys::ncclRedOp_t::ncclSum);
            // SAFETY: in place over the tensor's own elements, on this rank's stream.
            Ok(unsafe {
                match root {
                    None => sys::ncclAllReduce(p, p, n, dtype, sum, comm, stream),
                    Some(r) => sys::ncclReduce(p, p, n, dtype, sum, r as i32, comm, stream),
                }
            })
        })?;
        let addresses: Vec<u64> = tensors.iter().map(|t| ptr(t)).collect();
        self.pending.record(&self.sums, &addresses)
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        self.stop_watching.store(true, Ordering::Relaxed);
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
        // Not ncclCommDestroy, which may wait for the peers: a rank that failed ends here
        // too, before its group learns of it, and a rank that ends cleanly has nothing left
        // running (its last download waited for it).
        abort(&self.comm);
    }
}

/// NCCL's name for a dtype that it sums.
fn summed_dtype(t: &Tensor<Cuda>) -> Result<sys::ncclDataType_t> {
    Ok(match t.dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        other => bail!("NCCL: no sum of {other} tensors"),
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
        self.start_sums(tensors, None)
    }

    fn start_reduce_sum(&self, _: &Cuda, tensors: &[&Tensor<Cuda>], root: usize) -> Result<()> {
        self.start_sums(tensors, Some(root))
    }

    fn wait_for_sums_of(&self, _: &Cuda, tensors: &[&Tensor<Cuda>]) -> Result<()> {
        let addresses: Vec<u64> = tensors.iter().map(|t| ptr(t)).collect();
        self.pending.wait(&self.compute, &addresses)
    }

    fn join_all_reduce_sums(&self, _: &Cuda) -> Result<()> {
        self.compute.join(&self.sums)?;
        self.pending.clear();
        Ok(())
    }

    fn broadcast(&self, _: &Cuda, tensors: &[(&Tensor<Cuda>, usize)]) -> Result<()> {
        self.grouped("broadcast", tensors, |&(t, owner), comm| {
            let p = ptr(t) as *mut std::ffi::c_void;
            // SAFETY: in place over the tensor's bytes, on this rank's stream.
            Ok(unsafe {
                sys::ncclBroadcast(
                    p,
                    p,
                    t.bytes(),
                    sys::ncclDataType_t::ncclUint8,
                    owner as i32,
                    comm,
                    self.compute.cu_stream() as sys::cudaStream_t,
                )
            })
        })
    }

    fn sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        self.member.sum(values)
    }
}
