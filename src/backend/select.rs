//! Which backend to run on: what `--device cpu|cuda` says, or by default the GPU when one is
//! present and the CPU otherwise. A GPU that is present but fails to start is an error, never
//! a silent fall back to the CPU.

use anyhow::{Context, Result, ensure};

use super::Backend;
use super::cpu::Cpu;
use super::cuda::kernel_choice::AttentionKernels;
use super::cuda::{Cuda, device};

/// The `--device` choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// The GPU if the driver reports one, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// The backend picked. Callers match on it once and run generic code over `B: Backend`.
// Made once per run, so the size difference between the variants does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Device {
    Cpu(Cpu<f32>),
    Cuda(Cuda),
}

impl Device {
    pub fn describe(&self) -> String {
        match self {
            Device::Cpu(b) => b.describe(),
            Device::Cuda(b) => b.describe(),
        }
    }
}

/// Opens the backend `choice` asks for: GPU `gpu` for CUDA (0, or the one a launcher gave
/// this process as its `LOCAL_RANK`), or the one GPU where the driver shows only one.
pub fn select(choice: DeviceChoice, gpu: usize) -> Result<Device> {
    let open = |count: usize| -> Result<Cuda> {
        // A launcher that gives each process one GPU of its own (`srun --gpus-per-task=1`
        // sets CUDA_VISIBLE_DEVICES so) leaves it that one, whatever its local rank.
        let gpu = if count == 1 { 0 } else { gpu };
        ensure!(
            gpu < count,
            "GPU {gpu}: the driver reports {count} GPU(s) on this machine; check nvidia-smi and \
             CUDA_VISIBLE_DEVICES (under a launcher, LOCAL_RANK picks the GPU: start at most \
             {count} processes per machine)"
        );
        Cuda::new(gpu)
    };
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu(Cpu::new())),
        DeviceChoice::Cuda => Ok(Device::Cuda(match device::gpu_count()? {
            // No driver or no GPU: Cuda::new says which.
            0 => Cuda::new(gpu)?,
            n => open(n)?,
        })),
        DeviceChoice::Auto => {
            let count = device::gpu_count()?;
            if count == 0 {
                return Ok(Device::Cpu(Cpu::new()));
            }
            // A bad setting is the user's to fix, not a sign that the GPU is unusable.
            AttentionKernels::from_env()?;
            let gpu = open(count).context(
                "a GPU is present but could not be used (pass --device cpu to run on the CPU)",
            )?;
            Ok(Device::Cuda(gpu))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asking_for_the_cpu_gives_the_cpu() {
        assert!(matches!(
            select(DeviceChoice::Cpu, 0).unwrap(),
            Device::Cpu(_)
        ));
    }

    #[test]
    fn auto_without_a_gpu_gives_the_cpu_and_cuda_says_why_not() {
        if device::gpu_count().unwrap_or(0) > 0 {
            return; // this machine has a GPU; the GPU tests cover it
        }
        assert!(matches!(
            select(DeviceChoice::Auto, 0).unwrap(),
            Device::Cpu(_)
        ));
        let err = select(DeviceChoice::Cuda, 0).err().expect("no GPU here");
        let msg = format!("{err:#}");
        assert!(
            msg.contains("libcuda") || msg.contains("no CUDA GPU"),
            "unhelpful error: {msg}"
        );
    }
}
