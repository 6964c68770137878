//! The CUDA backend: one device, one compute stream, NVRTC-compiled kernels, cuBLASLt
//! matmuls, and memory planned as one allocation per category (`arena.rs`). Each op family is
//! implemented in the file of its name, beside its kernels (`kernels/<family>.cu`, listed in
//! the one kernel table of `kernels/mod.rs`), mirroring `cpu/`; this file holds the device
//! and what every family's launches share.
//!
//! Every op enqueues work on the stream and returns. What waits for the device (see the
//! trait's header): `download`, `synchronize`, `take_op_times` (op timing), and two one-time
//! events inside ops: the scratch buffer growing during the first step (freeing the old one
//! synchronizes), and the first matmul of a new shape timing cuBLASLt's candidate algorithms
//! (`matmul_algos`), which waits for the timings and allocates, then frees, an output buffer
//! of its own outside the arenas. Nothing else in an op allocates.
//!
//! cudarc loads libcuda, libnvrtc and libcublasLt at run time, so building needs no CUDA;
//! `Cuda::new` checks that they can be loaded before touching them and says what to install.

mod adamw;
pub mod arena;
pub mod attention;
mod classifier;
pub mod cublaslt;
pub mod device;
mod disk_cache;
mod embedding;
mod fp8;
mod gemm;
mod gemv;
mod int8;
pub mod kernel_choice;
pub mod kernels;
mod matmul;
mod matmul_algos;
mod memory;
mod multi_tensor;
pub mod nvrtc;
mod op_timer;
pub(crate) mod pending;
mod rmsnorm;
mod rope;
mod swiglu;
mod tma;

use std::cell::Cell;
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{CudaContext, CudaGraph, CudaStream};

use self::arena::{CudaStorage, Memory, MemoryReport, Place, carve};
use self::cublaslt::Blas;
use self::kernel_choice::AttentionKernels;
use self::kernels::{Arg, BLOCK, KArg, Kernel, Kernels};
use self::op_timer::{OpTimer, OpTiming};
use super::datasheet::datasheet;
use super::op_times::OpTime;
use super::{Backend, UnsupportedDtype};
use crate::tensor::{DType, Tensor, TensorSpec};

pub struct Cuda {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// Where `start_copy` runs, beside the compute stream: one stream a direction, so that
    /// copies in and out use the two directions of the bus at once.
    copies_in: Arc<CudaStream>,
    copies_out: Arc<CudaStream>,
    /// The end of the last copy into or out of each tensor.
    copies_pending: pending::Pending,
    kernels: Kernels,
    blas: Blas,
    memory: Memory,
    name: String,
    compute_capability: (i32, i32),
    /// The driver's CUDA version and the NVRTC and cuBLASLt that loaded (`device::toolchain`).
    toolchain: String,
    multiprocessors: u32,
    attention: Cell<AttentionKernels>,
    /// Whether smelt's own matmul (gemm.rs) may run where the GPU has it.
    own_gemm: Cell<bool>,
    /// Whether `record` records graphs.
    graphs: Cell<bool>,
    op_timer: OpTimer,
}

/// `ceil(n / per)` blocks, at least one.
fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

/// The device address of a tensor's first element.
pub(crate) fn ptr(t: &Tensor<Cuda>) -> u64 {
    t.storage.address(t.offset, t.dtype.size_bytes())
}

fn float(t: &Tensor<Cuda>) -> Arg {
    Arg::Float(t.dtype)
}

/// Whether a kernel may move rows of `cols` elements of each of `tensors` 16 bytes at a time:
/// every tensor starts 16-byte aligned (a view from `narrow_rows` need not) and a row is a
/// whole number of 16 bytes.
fn vec16(tensors: &[&Tensor<Cuda>], cols: usize) -> bool {
    tensors
        .iter()
        .all(|t| ptr(t).is_multiple_of(16) && (cols * t.dtype.size_bytes()).is_multiple_of(16))
}

/// The first element, below 8, at which every one of `tensors` is 16-byte aligned, if there is
/// one. Views into the 16-byte aligned arenas at the same element offset always have one, and
/// so does any single tensor of 2- or 4-byte values.
fn aligned_head(tensors: &[&Tensor<Cuda>]) -> Option<usize> {
    (0..8).find(|&h| {
        tensors
            .iter()
            .all(|t| (ptr(t) + (h * t.dtype.size_bytes()) as u64).is_multiple_of(16))
    })
}

/// Elements of `t` per access, with or without the 16-byte path (common.cuh's
/// `access_width`).
fn width(t: &Tensor<Cuda>, vec: bool) -> usize {
    if vec { 16 / t.dtype.size_bytes() } else { 1 }
}

/// The device address of a producer's `amax` (`[1]` f32), or null when none was asked for.
pub(super) fn amax_ptr(op: &'static str, amax: Option<&Tensor<Cuda>>) -> Result<u64> {
    let Some(amax) = amax else { return Ok(0) };
    ensure_dtype(amax, DType::F32, op)?;
    ensure!(
        amax.numel() == 1,
        "{op}: amax must be one f32, got {:?}",
        amax.shape
    );
    Ok(ptr(amax))
}

fn ensure_dtype(t: &Tensor<Cuda>, dtype: DType, op: &'static str) -> Result<()> {
    ensure_dtype_in(t, &[dtype], op)
}

fn ensure_dtype_in(t: &Tensor<Cuda>, dtypes: &[DType], op: &'static str) -> Result<()> {
    if dtypes.contains(&t.dtype) {
        Ok(())
    } else {
        Err(unsupported_dtype(op, vec![t.dtype]))
    }
}

fn ensure_same_dtype(op: &'static str, tensors: &[&Tensor<Cuda>]) -> Result<()> {
    if tensors.windows(2).all(|w| w[0].dtype == w[1].dtype) {
        Ok(())
    } else {
        Err(unsupported_dtype(
            op,
            tensors.iter().map(|t| t.dtype).collect(),
        ))
    }
}

/// This backend's typed refusal of `dtypes` for `op`.
fn unsupported_dtype(op: &'static str, dtypes: Vec<DType>) -> anyhow::Error {
    UnsupportedDtype {
        backend: "cuda",
        op,
        dtypes,
    }
    .into()
}

impl Cuda {
    /// The GPU's name, as the driver gives it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The GPU's CUDA device index.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Opens GPU `ordinal`. Fails with a message naming what is missing when libcuda,
    /// libnvrtc or libcublasLt cannot be loaded, or when there is no such GPU.
    pub fn new(ordinal: usize) -> Result<Self> {
        device::ensure_libraries()?;
        // cudarc panics when a loaded library lacks a symbol it wants (a driver older than
        // CUDA 13): turn that into an error too.
        std::panic::catch_unwind(|| Self::open(ordinal)).unwrap_or_else(|panic| {
            Err(anyhow::anyhow!(
                "the CUDA libraries failed to start ({}); smelt needs a driver and libraries \
                 for CUDA 13",
                crate::panic::message(&*panic)
            ))
        })
    }

    fn open(ordinal: usize) -> Result<Self> {
        let count = device::gpu_count()?;
        ensure!(
            ordinal < count,
            "--device cuda: no CUDA GPU {ordinal}, the driver reports {count} device(s) (check \
             nvidia-smi and CUDA_VISIBLE_DEVICES); --device cpu runs on the CPU, and --device \
             auto picks the GPU when there is one"
        );
        let ctx =
            CudaContext::new(ordinal).with_context(|| format!("opening CUDA GPU {ordinal}"))?;
        let stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        // Hopper's arch-specific target unlocks wgmma.
        let arch = if major == 9 {
            format!("sm_{major}{minor}a")
        } else {
            format!("sm_{major}{minor}")
        };
        let name = ctx.name()?;
        let toolchain = device::toolchain()?;
        let multiprocessors =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let memory = Memory::new(ctx.clone());
        let workspace = memory.allocate("workspace", cublaslt::WORKSPACE_BYTES, Place::Device)?;
        let blas = Blas::new(stream.clone(), workspace)?;
        Ok(Cuda {
            kernels: Kernels::new(ctx.clone(), arch),
            copies_in: ctx.new_stream()?,
            copies_out: ctx.new_stream()?,
            copies_pending: pending::Pending::default(),
            ctx,
            stream,
            blas,
            memory,
            name,
            compute_capability: (major, minor),
            toolchain,
            multiprocessors,
            attention: Cell::new(AttentionKernels::from_env()?),
            own_gemm: Cell::new(kernel_choice::own_gemm_from_env()?),
            graphs: Cell::new(kernel_choice::graphs_from_env()?),
            op_timer: OpTimer::default(),
        })
    }

    /// Switches the recording of graphs (`Backend::record`) on or off for the calls that
    /// follow (`SMELT_CUDA_GRAPHS=off` starts with it off); tests compare the two.
    pub fn set_graphs(&self, on: bool) {
        self.graphs.set(on);
    }

    /// Bytes per allocation category (plus scratch), and the device's free and total bytes.
    pub fn memory_report(&self) -> Result<MemoryReport> {
        self.memory.report()
    }

    /// One arena in `place` for `category`, carved into a view per spec.
    fn allocate_in(
        &self, category: &str, specs: &[TensorSpec], place: Place,
    ) -> Result<Vec<Tensor<Self>>> {
        for spec in specs {
            if !matches!(
                spec.dtype,
                DType::F32
                    | DType::BF16
                    | DType::E4M3
                    | DType::E5M2
                    | DType::I8
                    | DType::Q8
                    | DType::I32
            ) {
                return Err(unsupported_dtype("allocate", vec![spec.dtype]));
            }
        }
        let (offsets, total) = carve(specs);
        let arena = self.memory.allocate(category, total, place)?;
        Ok(specs
            .iter()
            .zip(offsets)
            .map(|(spec, base)| {
                let storage = CudaStorage {
                    arena: arena.clone(),
                    base,
                };
                Tensor::new(storage, spec.shape.clone(), spec.dtype)
            })
            .collect())
    }

    /// # Safety
    /// `args` must match the kernel's parameters, with every pointer valid for the accesses
    /// the kernel makes with the sizes passed.
    unsafe fn launch(
        &self, kernel: Kernel, targs: &[Arg], grid: (u32, u32, u32), block: u32, args: &[KArg],
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.launch_with_smem(kernel, targs, grid, block, 0, args) }
    }

    /// `launch` with `smem` bytes of dynamic shared memory.
    ///
    /// # Safety
    /// As `launch`, and `smem` must be what the kernel expects.
    unsafe fn launch_with_smem(
        &self, kernel: Kernel, targs: &[Arg], grid: (u32, u32, u32), block: u32, smem: u32,
        args: &[KArg],
    ) -> Result<()> {
        let inst = kernel.instance(targs)?;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(()); // an empty tensor: nothing to do, and CUDA refuses empty grids
        }
        // SAFETY: forwarded contract.
        unsafe {
            self.kernels
                .launch(&self.stream, &inst, grid, block, smem, args)
        }
    }

    /// How many blocks of `kernel` (`block` threads, `smem` bytes of dynamic shared memory)
    /// the whole GPU runs at once.
    fn block_slots(&self, kernel: Kernel, targs: &[Arg], block: u32, smem: u32) -> Result<usize> {
        let per_sm = self
            .kernels
            .resident_blocks(&kernel.instance(targs)?, block, smem)?;
        Ok(per_sm as usize * self.multiprocessors as usize)
    }

    /// Times the op that calls it, until the returned value drops: its device time is filed
    /// under `op` while op timing is on (`Backend::time_ops`).
    fn time_op(&self, op: &'static str) -> Result<OpTiming<'_>> {
        self.op_timer.begin(&self.stream, || op.to_string())
    }

    /// `time_op` for names built from the arguments (a matmul's shape), only while timing is
    /// on.
    fn time_op_named(&self, name: impl FnOnce() -> String) -> Result<OpTiming<'_>> {
        self.op_timer.begin(&self.stream, name)
    }

    /// The f32 scratch buffer, at least `floats` long, for one op's transient partials.
    fn scratch_f32(&self, floats: usize) -> Result<u64> {
        self.memory.scratch(floats * 4)
    }
}

impl Backend for Cuda {
    type Recording = CudaGraph;

    /// Captures the stream into a graph, in relaxed mode: the ops' own bookkeeping (looking
    /// up a loaded kernel, setting its shared-memory limit) may call the driver meanwhile.
    /// `SMELT_CUDA_GRAPHS=off` (or `set_graphs(false)`) records nothing, and neither does
    /// timing ops, whose events are for each op's launches, not for a replay.
    fn record(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<Option<CudaGraph>> {
        if !self.graphs.get() || self.op_timer.is_on() {
            return Ok(None);
        }
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let worked = work();
        // The capture ends whatever `work` did, so that the stream runs ops again.
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        self.memory.hold_scratch();
        worked?;
        graph?
            .map(Some)
            .ok_or_else(|| anyhow::anyhow!("recording a graph: the capture came back empty"))
    }

    fn replay(&self, recording: &CudaGraph) -> Result<()> {
        Ok(recording.launch()?)
    }

    fn describe(&self) -> String {
        format!(
            "cuda ({}, {}; {})",
            self.name,
            self.kernels.arch(),
            self.toolchain
        )
    }

    fn peak_flops(&self, dtype: DType) -> Option<f64> {
        datasheet(&self.name).and_then(|g| g.peak_flops(dtype))
    }

    fn time_ops(&self, on: bool) {
        self.op_timer.set(on);
    }

    fn take_op_times(&self) -> Result<Vec<OpTime>> {
        self.op_timer.take(&self.stream)
    }

    fn begin_range(&self, name: std::fmt::Arguments<'_>) {
        nvtx::range_push!("{name}");
    }

    fn end_range(&self) {
        nvtx::range_pop!();
    }
}
