//! Which backend to run on: what `--device cpu|cuda` says, or by default the GPU when one is
//! present and the CPU otherwise. A GPU that is present but fails to start is an error, never
//! a silent fall back to the CPU.

use anyhow::{Context, Result};

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

/// Opens the backend `choice` asks for (GPU 0 for CUDA).
pub fn select(choice: DeviceChoice) -> Result<Device> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu(Cpu::new())),
        DeviceChoice::Cuda => Ok(Device::Cuda(Cuda::new(0)?)),
        DeviceChoice::Auto => {
            if device::gpu_count()? == 0 {
                return Ok(Device::Cpu(Cpu::new()));
            }
            // A bad setting is the user's to fix, not a sign that the GPU is unusable.
            AttentionKernels::from_env()?;
            let gpu = Cuda::new(0).context(
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
        assert!(matches!(select(DeviceChoice::Cpu).unwrap(), Device::Cpu(_)));
    }

    #[test]
    fn auto_without_a_gpu_gives_the_cpu_and_cuda_says_why_not() {
        if device::gpu_count().unwrap_or(0) > 0 {
            return; // this machine has a GPU; the GPU tests cover it
        }
        assert!(matches!(
            select(DeviceChoice::Auto).unwrap(),
            Device::Cpu(_)
        ));
        let err = select(DeviceChoice::Cuda).err().expect("no GPU here");
        let msg = format!("{err:#}");
        assert!(
            msg.contains("libcuda") || msg.contains("no CUDA GPU"),
            "unhelpful error: {msg}"
        );
    }
}
