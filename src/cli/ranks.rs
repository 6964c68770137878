//! `--gpus N`: runs a subcommand's body once per rank, each on its own device and thread,
//! joined by the collectives that fit the device (NCCL between GPUs, host memory between
//! CPU ranks), or once on the device already open when N is 1.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail, ensure};

use crate::backend::Backend;
use crate::backend::cpu::Cpu;
use crate::backend::cuda::nccl::{Nccl, UniqueId};
use crate::backend::cuda::{Cuda, device};
use crate::backend::select::Device;
use crate::comm::{Comm, InProcess, Solo, ranks};

/// What each rank runs: the same code on every backend.
pub trait RankMain: Sync {
    type Output: Send;
    fn run<B: Backend>(&self, b: &B, comm: &dyn Comm<B>) -> Result<Self::Output>;
}

/// Runs `main` on `gpus` ranks of `device`'s kind, whose meetings give up on a stuck rank
/// after `timeout`; rank 0's output, or the error of the rank that failed first.
pub fn on_ranks<M: RankMain + Send + 'static>(
    device: Device,
    gpus: usize,
    timeout: Duration,
    main: M,
) -> Result<M::Output>
where
    M::Output: 'static,
{
    if gpus == 0 {
        bail!("--gpus 0: give the number of devices to train on, 1 or more");
    }
    let main = Arc::new(main);
    match device {
        Device::Cpu(b) if gpus == 1 => main.run(&b, &Solo),
        Device::Cuda(b) if gpus == 1 => main.run(&b, &Solo),
        Device::Cpu(_) => ranks::run(gpus, timeout, move |member| {
            main.run(&Cpu::<f32>::new(), &InProcess { member })
        }),
        Device::Cuda(first) => {
            let count = device::gpu_count()?;
            ensure!(
                gpus <= count,
                "--gpus {gpus}: the driver reports {count} GPU(s); check nvidia-smi and \
                 CUDA_VISIBLE_DEVICES, or ask for fewer"
            );
            // Each rank opens its own GPU on its own thread.
            drop(first);
            let id = UniqueId::new()?;
            ranks::run(gpus, timeout, move |member| {
                let b = Cuda::new(member.rank)?;
                let comm = Nccl::new(&b, id, member)?;
                main.run(&b, &comm)
            })
        }
    }
}
