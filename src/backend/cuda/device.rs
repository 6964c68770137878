//! Finding the GPU: checks that the CUDA libraries load before cudarc touches them (cudarc
//! panics on a missing library), and counts devices.

use anyhow::{Result, bail};
use cudarc::driver::CudaContext;

/// Whether libcuda (the driver) can be loaded at all: false on machines without an NVIDIA
/// driver, where the CPU backend is the right choice.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library under its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Fails, naming the library and what to install, unless libcuda, libnvrtc and libcublasLt
/// can all be loaded.
pub fn ensure_libraries() -> Result<()> {
    if !driver_present() {
        bail!(
            "cannot load libcuda.so (the NVIDIA driver): install the NVIDIA driver, or run with \
             --device cpu"
        );
    }
    super::nvrtc::ensure_available()?;
    // SAFETY: as above.
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        bail!(
            "cannot load libcublasLt.so.13 or .so.12 (cuBLASLt): install the CUDA 13 or 12 \
             toolkit, or `pip install nvidia-cublas` (or `nvidia-cublas-cu12`), and put its lib \
             directory on LD_LIBRARY_PATH"
        );
    }
    Ok(())
}

/// What smelt runs on, for the logs: the driver's CUDA version and the NVRTC and cuBLASLt
/// that loaded, e.g. `driver CUDA 13.0, NVRTC 13.0, cuBLASLt 130000`; an NVRTC newer than
/// the driver is refused.
pub fn toolchain() -> Result<String> {
    let mut driver = 0;
    // SAFETY: one valid out-pointer; the driver library is loaded (`ensure_libraries`).
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
        .result()
        .map_err(|e| anyhow::anyhow!("cuDriverGetVersion: {e}"))?;
    let (major, minor) = super::nvrtc::version()?;
    // A driver loads the CUBIN of any NVRTC of its own major version or older, not newer.
    if major > driver / 1000 {
        bail!(
            "NVRTC {major}.{minor} loaded, but the driver supports CUDA {}.{} only, and cannot \
             load what NVRTC {major} compiles: put CUDA {}'s NVRTC (a toolkit's lib64, or the \
             nvidia-cuda-nvrtc-cu{} wheel's nvidia/cuda_nvrtc/lib) first on LD_LIBRARY_PATH, or \
             update the driver",
            driver / 1000,
            driver % 1000 / 10,
            driver / 1000,
            driver / 1000
        );
    }
    // SAFETY: a plain query with no arguments.
    let blas = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
    Ok(format!(
        "driver CUDA {}.{}, NVRTC {major}.{minor}, cuBLASLt {blas}",
        driver / 1000,
        driver % 1000 / 10
    ))
}

/// The number of CUDA devices the driver reports (0 when it reports none).
pub fn gpu_count() -> Result<usize> {
    if !driver_present() {
        return Ok(0);
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        Err(e) if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => Ok(0),
        Err(e) => bail!(
            "the CUDA driver failed to initialise ({e}): check that nvidia-smi works and lists \
             the GPU, or run with --device cpu"
        ),
    }
}
