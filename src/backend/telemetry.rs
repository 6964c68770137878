//! GPU telemetry through NVML, for `smelt train --log-gpu-util`: the utilisation, SM clock,
//! power, temperature and memory of the GPUs this process trains on.
//!
//! NVML (`libnvidia-ml.so.1`, which comes with the NVIDIA driver) is loaded at run time, as
//! the CUDA libraries are, so building needs none. NVML numbers every GPU of the machine,
//! while CUDA numbers only those CUDA_VISIBLE_DEVICES leaves, in its order: each CUDA device
//! is found in NVML by the UUID the CUDA driver gives it, never by its index.

use anyhow::{Context, Result, anyhow};
use cudarc::driver::result as cuda;
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use serde::{Deserialize, Serialize};

/// One GPU's readings. A figure NVML does not give for this GPU (a MIG slice has no power
/// reading of its own, say) is `None`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    /// The CUDA device index, as this process numbers its GPUs.
    pub gpu: usize,
    /// Percent of NVML's last sample period (1/6 s to 1 s, by GPU) in which a kernel ran.
    pub utilization: Option<u32>,
    pub sm_clock_mhz: Option<u32>,
    pub power_watts: Option<f64>,
    pub temperature_c: Option<u32>,
    /// Bytes in use on the device, by every process.
    pub memory_used: Option<u64>,
    pub memory_total: Option<u64>,
}

/// NVML, open on the GPUs to sample.
pub struct Telemetry {
    nvml: Nvml,
    /// Each GPU's CUDA index and NVML index.
    gpus: Vec<(usize, u32)>,
}

impl Telemetry {
    /// Opens NVML on the CUDA devices `gpus` (of a driver already initialised, by opening
    /// one of them). Fails, saying why and what to do, when NVML does not start or does not
    /// know a device.
    pub fn open(gpus: &[usize]) -> Result<Telemetry> {
        let nvml = Nvml::init().map_err(|e| {
            anyhow!(
                "--log-gpu-util: NVML, which reads the GPUs' utilisation, clocks, power and \
                 temperature, does not start ({e}); it comes with the NVIDIA driver as \
                 libnvidia-ml.so.1 (check that nvidia-smi runs), or leave --log-gpu-util out"
            )
        })?;
        let gpus = gpus
            .iter()
            .map(|&gpu| {
                let found = nvml_index(&nvml, gpu);
                found
                    .map(|index| (gpu, index))
                    .with_context(|| format!("--log-gpu-util: CUDA GPU {gpu}"))
            })
            .collect::<Result<_>>()?;
        Ok(Telemetry { nvml, gpus })
    }

    /// Every GPU's readings now, in the order they were given to `open`.
    pub fn sample(&self) -> Vec<GpuSample> {
        self.gpus
            .iter()
            .map(|&(gpu, index)| {
                let Ok(d) = self.nvml.device_by_index(index) else {
                    return GpuSample::unknown(gpu);
                };
                let memory = d.memory_info().ok();
                GpuSample {
                    gpu,
                    utilization: d.utilization_rates().ok().map(|u| u.gpu),
                    sm_clock_mhz: d.clock_info(Clock::SM).ok(),
                    power_watts: d.power_usage().ok().map(|mw| mw as f64 / 1e3),
                    temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
                    memory_used: memory.as_ref().map(|m| m.used),
                    memory_total: memory.as_ref().map(|m| m.total),
                }
            })
            .collect()
    }
}

impl GpuSample {
    fn unknown(gpu: usize) -> GpuSample {
        GpuSample {
            gpu,
            utilization: None,
            sm_clock_mhz: None,
            power_watts: None,
            temperature_c: None,
            memory_used: None,
            memory_total: None,
        }
    }
}

/// NVML's index of CUDA device `gpu`, found by its UUID: a whole GPU's (`GPU-`), or a MIG
/// slice's (`MIG-`), which is what CUDA sees of a GPU split with MIG.
fn nvml_index(nvml: &Nvml, gpu: usize) -> Result<u32> {
    let no_such_gpu =
        "the CUDA driver reports no such GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES)";
    let device = cuda::device::get(gpu as i32).context(no_such_gpu)?;
    let uuid = uuid_text(&cuda::device::get_uuid(device)?.bytes.map(|b| b as u8));
    let found = ["GPU", "MIG"]
        .iter()
        .find_map(|kind| nvml.device_by_uuid(format!("{kind}-{uuid}")).ok());
    let device = found.with_context(|| format!("NVML lists no GPU of its UUID, GPU-{uuid}"))?;
    Ok(device.index()?)
}

/// A UUID's 16 bytes as NVML writes them after its `GPU-`: 8-4-4-4-12 hex digits.
fn uuid_text(bytes: &[u8; 16]) -> String {
    let hex = |range: std::ops::Range<usize>| -> String {
        bytes[range].iter().map(|b| format!("{b:02x}")).collect()
    };
    [hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16)].join("-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_written_as_nvml_writes_them() {
        let bytes: [u8; 16] = std::array::from_fn(|i| (i * 17) as u8);
        assert_eq!(uuid_text(&bytes), "00112233-4455-6677-8899-aabbccddeeff");
    }

    #[test]
    fn without_nvml_opening_says_why() {
        if Nvml::init().is_ok() {
            return; // a machine with the driver; the GPU tests cover it
        }
        let err = Telemetry::open(&[0]).err().expect("no NVML here");
        let text = format!("{err:#}");
        assert!(
            text.contains("--log-gpu-util: NVML") && text.contains("libnvidia-ml.so.1"),
            "{text}"
        );
    }
}
