//! The CUDA backend: one device, one compute stream, NVRTC-compiled kernels (one `.cu` file
//! per op family under `kernels/`, mirroring `cpu/`), cuBLASLt matmuls, and memory planned as
//! one allocation per category.
//!
//! Every op enqueues work on the stream and returns. What waits for the device (see the
//! trait's header): `download`, `synchronize`, `take_op_times` (op timing), and two one-time
//! events inside ops: the scratch buffer growing during the first step (freeing the old one
//! synchronizes), and the first matmul of a new shape timing cuBLASLt's candidate algorithms
//! (`matmul_algos`), which waits for the timings and allocates, then frees, an output buffer
//! of its own outside `Memory`. Nothing else in an op allocates.
//!
//! cudarc loads libcuda, libnvrtc and libcublasLt at run time, so building needs no CUDA;
//! `Cuda::new` checks that they can be loaded before touching them and says what to install.

mod adamw;
pub mod attention;
mod classifier;
pub mod cublaslt;
pub mod device;
mod disk_cache;
mod elementwise;
mod embedding;
mod fp8;
mod gemm;
mod gemv;
pub mod kernels;
mod matmul;
mod matmul_algos;
pub mod memory;
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
use cudarc::driver::{CudaContext, CudaStream};
use half::bf16;
use rayon::prelude::*;

use self::cublaslt::Blas;
use self::fp8::Fused;
use self::kernels::{Arg, KArg, Kernel, Kernels};
use self::matmul::op_dims;
use self::memory::{CudaStorage, Memory, MemoryReport, Place, carve};
use self::op_timer::OpTimer;
use super::datasheet::datasheet;
use super::op_times::{OpTime, matmul_name};
use super::{
    AdamW, AdamWTensor, AttnShape, Backend, Fp8Sum, Matmul, Normalized, Scaled, UnsupportedDtype,
};
use crate::tensor::{DType, Tensor, TensorSpec};

pub struct Cuda {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// Where `start_copy` runs, beside the compute stream.
    copies: Arc<CudaStream>,
    /// The end of the last copy into or out of each tensor.
    copies_pending: pending::Pending,
    kernels: Kernels,
    blas: Blas,
    memory: Memory,
    name: String,
    compute_capability: (i32, i32),
    multiprocessors: u32,
    attention: Cell<attention::AttentionKernels>,
    /// Whether smelt's own matmul (gemm.rs) may run where the GPU has it.
    own_gemm: Cell<bool>,
    op_timer: OpTimer,
}

/// Threads per block of the simple element-wise and row kernels.
const BLOCK: u32 = 256;

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
        let multiprocessors =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let memory = Memory::new(ctx.clone());
        let workspace = memory.allocate("workspace", cublaslt::WORKSPACE_BYTES, Place::Device)?;
        let blas = Blas::new(stream.clone(), workspace)?;
        Ok(Cuda {
            kernels: Kernels::new(ctx.clone(), arch),
            copies: ctx.new_stream()?,
            copies_pending: pending::Pending::default(),
            ctx,
            stream,
            blas,
            memory,
            name,
            compute_capability: (major, minor),
            multiprocessors,
            attention: Cell::new(attention::AttentionKernels::from_env()?),
            own_gemm: Cell::new(gemm::own_gemm_from_env()?),
            op_timer: OpTimer::default(),
        })
    }

    /// Bytes per allocation category (plus scratch), and the device's free and total bytes.
    pub fn memory_report(&self) -> Result<MemoryReport> {
        self.memory.report()
    }

    /// One arena in `place` for `category`, carved into a view per spec.
    fn allocate_in(
        &self,
        category: &str,
        specs: &[TensorSpec],
        place: Place,
    ) -> Result<Vec<Tensor<Self>>> {
        for spec in specs {
            if !matches!(
                spec.dtype,
                DType::F32 | DType::BF16 | DType::E4M3 | DType::E5M2 | DType::I32
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
        &self,
        kernel: Kernel,
        targs: &[Arg],
        grid: (u32, u32, u32),
        block: u32,
        args: &[KArg],
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.launch_with_smem(kernel, targs, grid, block, 0, args) }
    }

    /// `launch` with `smem` bytes of dynamic shared memory.
    ///
    /// # Safety
    /// As `launch`, and `smem` must be what the kernel expects.
    unsafe fn launch_with_smem(
        &self,
        kernel: Kernel,
        targs: &[Arg],
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
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

    /// Runs one backend op, its device time filed under `op` while op timing is on.
    fn op(&self, op: &'static str, run: impl FnOnce() -> Result<()>) -> Result<()> {
        self.op_named(|| op.to_string(), run)
    }

    /// `op` for names built from the arguments (a matmul's shape), only while timing is on.
    fn op_named(
        &self,
        name: impl FnOnce() -> String,
        run: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.op_timer.time(&self.stream, name, run)
    }

    /// The f32 scratch buffer, at least `floats` long, for one op's transient partials.
    fn scratch_f32(&self, floats: usize) -> Result<u64> {
        self.memory.scratch(floats * 4)
    }
}

impl Backend for Cuda {
    type Storage = CudaStorage;

    fn describe(&self) -> String {
        format!("cuda ({}, {})", self.name, self.kernels.arch())
    }

    fn peak_flops(&self) -> Option<f64> {
        datasheet(&self.name).map(|g| g.bf16_flops)
    }

    fn free_memory(&self) -> Option<(usize, usize)> {
        self.memory.report().ok().map(|r| (r.free, r.total))
    }

    fn allocate(&self, category: &str, specs: &[TensorSpec]) -> Result<Vec<Tensor<Self>>> {
        self.allocate_in(category, specs, Place::Device)
    }

    fn allocate_offloaded(
        &self,
        category: &str,
        specs: &[TensorSpec],
    ) -> Result<Vec<Tensor<Self>>> {
        self.allocate_in(category, specs, Place::PinnedHost)
    }

    fn upload(&self, dst: &Tensor<Self>, src: &[f32]) -> Result<()> {
        ensure!(
            src.len() == dst.numel(),
            "upload of {} values into {:?}",
            src.len(),
            dst.shape
        );
        // The conversions run in parallel: checkpoints and the tests' model-sized inputs
        // are hundreds of millions of values.
        match dst.dtype {
            DType::F32 => self.copy_in(dst, src),
            DType::BF16 => {
                let v: Vec<bf16> = src.par_iter().map(|&x| bf16::from_f32(x)).collect();
                self.copy_in(dst, &v)
            }
            fp8 if fp8.is_fp8() => {
                let v: Vec<u8> = src.par_iter().map(|&x| fp8::encode(x, fp8)).collect();
                self.copy_in(dst, &v)
            }
            other => anyhow::bail!("upload of f32 values into a {other} tensor {:?}", dst.shape),
        }
    }

    fn upload_i32(&self, dst: &Tensor<Self>, src: &[i32]) -> Result<()> {
        ensure!(
            src.len() == dst.numel() && dst.dtype == DType::I32,
            "upload of {} i32 values into {:?} {}",
            src.len(),
            dst.shape,
            dst.dtype
        );
        self.copy_in(dst, src)
    }

    fn download(&self, src: &Tensor<Self>) -> Result<Vec<f32>> {
        Ok(match src.dtype {
            DType::F32 => self.copy_out::<f32>(src)?,
            DType::BF16 => self
                .copy_out::<bf16>(src)?
                .into_par_iter()
                .map(f32::from)
                .collect(),
            fp8 if fp8.is_fp8() => self
                .copy_out::<u8>(src)?
                .into_par_iter()
                .map(|code| fp8::decode(code, fp8))
                .collect(),
            DType::I32 => self
                .copy_out::<i32>(src)?
                .into_iter()
                .map(|x| x as f32)
                .collect(),
            other => anyhow::bail!("download of a {other} tensor"),
        })
    }

    fn fill(&self, dst: &Tensor<Self>, value: f32) -> Result<()> {
        self.op("fill", || self.fill_impl(dst, value))
    }

    fn copy(&self, dst: &Tensor<Self>, src: &Tensor<Self>) -> Result<()> {
        self.op("copy", || self.copy_impl(dst, src))
    }

    fn start_copy(&self, dst: &Tensor<Self>, src: &Tensor<Self>) -> Result<()> {
        ensure!(
            dst.dtype == src.dtype && dst.numel() == src.numel(),
            "start_copy of {} {:?} into {} {:?}",
            src.dtype,
            src.shape,
            dst.dtype,
            dst.shape
        );
        self.copies.join(&self.stream)?;
        // SAFETY: both ranges are the tensors' own bytes; the copy stream waits for the ops
        // enqueued so far, and the caller keeps later ops off both tensors until
        // `wait_for_copies_of` either. Unified addressing lets one call move device and
        // pinned host bytes.
        unsafe { sys::cuMemcpyAsync(ptr(dst), ptr(src), src.bytes(), self.copies.cu_stream()) }
            .result()
            .context("starting a copy between device and host memory")?;
        self.copies_pending
            .record(&self.copies, &[ptr(dst), ptr(src)])
    }

    fn wait_for_copies_of(&self, tensors: &[&Tensor<Self>]) -> Result<()> {
        let addresses: Vec<u64> = tensors.iter().map(|t| ptr(t)).collect();
        self.copies_pending.wait(&self.stream, &addresses)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().context("waiting for the GPU")
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

    fn embedding_forward(
        &self,
        out: &Tensor<Self>,
        tokens: &Tensor<Self>,
        wte: &Tensor<Self>,
    ) -> Result<()> {
        self.op("embedding_forward", || {
            self.embedding_forward_impl(out, tokens, wte)
        })
    }

    fn embedding_backward(
        &self,
        dwte: &Tensor<Self>,
        tokens: &Tensor<Self>,
        dout: &Tensor<Self>,
        accumulate: bool,
    ) -> Result<()> {
        self.op("embedding_backward", || {
            self.embedding_backward_impl(dwte, tokens, dout, accumulate)
        })
    }

    fn rmsnorm_forward(
        &self,
        out: Option<&Tensor<Self>>,
        rstd: &Tensor<Self>,
        inp: &Tensor<Self>,
        weight: &Tensor<Self>,
        eps: f32,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        self.op("rmsnorm_forward", || {
            self.rmsnorm_forward_impl(out, rstd, inp, None, weight, eps, amax)
        })
    }

    fn residual_rmsnorm_forward(
        &self,
        residual_out: &Tensor<Self>,
        out: Option<&Tensor<Self>>,
        rstd: &Tensor<Self>,
        residual: &Tensor<Self>,
        branch: &Tensor<Self>,
        weight: &Tensor<Self>,
        eps: f32,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        self.op("residual_rmsnorm_forward", || {
            self.rmsnorm_forward_impl(
                out,
                rstd,
                residual,
                Some((residual_out, branch)),
                weight,
                eps,
                amax,
            )
        })
    }

    fn rmsnorm_backward(
        &self,
        dinp: &Tensor<Self>,
        dweight: &Tensor<Self>,
        dout: &Tensor<Self>,
        inp: &Tensor<Self>,
        weight: &Tensor<Self>,
        rstd: &Tensor<Self>,
        accumulate: bool,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        self.op("rmsnorm_backward", || {
            self.rmsnorm_backward_impl(dinp, dweight, dout, inp, weight, rstd, accumulate, amax)
        })
    }

    fn matmul(
        &self,
        out: &Tensor<Self>,
        a: &Tensor<Self>,
        b: &Tensor<Self>,
        bias: Option<&Tensor<Self>>,
        spec: Matmul,
    ) -> Result<()> {
        self.op_named(
            || matmul_name(out.matrix_rows(), out.cols(), op_dims(a, spec.trans_a).1),
            || self.matmul_impl(out, a, b, bias, spec),
        )
    }

    fn bias_backward(
        &self,
        dbias: &Tensor<Self>,
        dout: &Tensor<Self>,
        accumulate: bool,
    ) -> Result<()> {
        self.op("bias_backward", || self.column_sum(dbias, dout, accumulate))
    }

    fn rope_forward(
        &self,
        qkv: &Tensor<Self>,
        freqs: &Tensor<Self>,
        shape: AttnShape,
    ) -> Result<()> {
        self.op("rope_forward", || {
            self.rope_impl(qkv, freqs, shape, false, None)
        })
    }

    fn rope_backward(
        &self,
        dqkv: &Tensor<Self>,
        freqs: &Tensor<Self>,
        shape: AttnShape,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        self.op("rope_backward", || {
            self.rope_impl(dqkv, freqs, shape, true, amax)
        })
    }

    fn rope_backward_and_bias(
        &self,
        dqkv: &Tensor<Self>,
        freqs: &Tensor<Self>,
        shape: AttnShape,
        dbias: &Tensor<Self>,
        accumulate: bool,
    ) -> Result<()> {
        self.op("rope_backward_and_bias", || {
            self.rope_backward_and_bias_impl(dqkv, freqs, shape, dbias, accumulate)
        })
    }

    fn attention_forward(
        &self,
        out: &Tensor<Self>,
        lse: &Tensor<Self>,
        qkv: &Tensor<Self>,
        shape: AttnShape,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        self.op("attention_forward", || {
            self.attention_forward_impl(out, lse, qkv, shape, amax)
        })
    }

    fn attention_decode(
        &self,
        out: &Tensor<Self>,
        qkv: &Tensor<Self>,
        shape: AttnShape,
    ) -> Result<()> {
        self.op("attention_decode", || {
            self.attention_decode_impl(out, qkv, shape)
        })
    }

    fn attention_backward(
        &self,
        dqkv: &Tensor<Self>,
        dout: &Tensor<Self>,
        qkv: &Tensor<Self>,
        out: &Tensor<Self>,
        lse: &Tensor<Self>,
        shape: AttnShape,
    ) -> Result<()> {
        self.op("attention_backward", || {
            self.attention_backward_impl(dqkv, dout, qkv, out, lse, shape)
        })
    }

    fn swiglu_forward(
        &self,
        out: &Tensor<Self>,
        gate_up: &Tensor<Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        self.op("swiglu_forward", || {
            self.swiglu_forward_impl(out, gate_up, amax)
        })
    }

    fn gate_up_swiglu(
        &self,
        gate_up: &Tensor<Self>,
        out: &Tensor<Self>,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
    ) -> Result<()> {
        if gemv::is_one_row(gate_up, x) {
            return self.op("gate_up_swiglu", || self.gemv_swiglu(gate_up, out, x, w));
        }
        if self.fuses(&[gate_up, out, x, w]) {
            return self.op("gate_up_swiglu", || self.gemm(gate_up, Some(out), x, w));
        }
        crate::backend::unfused_gate_up_swiglu(self, gate_up, out, x, w)
    }

    fn gate_up_swiglu_scaled(
        &self,
        gate_up: &Tensor<Self>,
        out: &Tensor<Self>,
        x: Scaled<'_, Self>,
        w: Scaled<'_, Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        if self.fuses_fp8(&[gate_up, out], (x.data, DType::E4M3), w.data) {
            return self.op("gate_up_swiglu", || {
                self.gemm_scaled(gate_up, Some(out), x, w, amax)
            });
        }
        crate::backend::unfused_gate_up_swiglu_scaled(self, gate_up, out, x, w, amax)
    }

    fn swiglu_backward_through_down(
        &self,
        gate_up: &Tensor<Self>,
        dh: &Tensor<Self>,
        dy: &Tensor<Self>,
        w: &Tensor<Self>,
    ) -> Result<()> {
        if self.fuses(&[gate_up, dy, w]) {
            return self.op("swiglu_backward_through_down", || {
                self.fused_swiglu_backward(gate_up, dy, w)
            });
        }
        crate::backend::unfused_swiglu_backward_through_down(self, gate_up, dh, dy, w)
    }

    fn swiglu_backward_through_down_scaled(
        &self,
        gate_up: &Tensor<Self>,
        dh: &Tensor<Self>,
        dy: Scaled<'_, Self>,
        w: Scaled<'_, Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        if self.fuses_fp8(&[gate_up], (dy.data, dy.data.dtype), w.data) {
            return self.op("swiglu_backward_through_down", || {
                self.fused_swiglu_backward_scaled(gate_up, dy, w, amax)
            });
        }
        crate::backend::unfused_swiglu_backward_through_down_scaled(self, gate_up, dh, dy, w, amax)
    }

    fn swiglu_backward(
        &self,
        dgate_up: &Tensor<Self>,
        dout: &Tensor<Self>,
        gate_up: &Tensor<Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        self.op("swiglu_backward", || {
            self.swiglu_backward_impl(dgate_up, dout, gate_up, amax)
        })
    }

    fn cross_entropy(
        &self,
        logits: &Tensor<Self>,
        losses: &Tensor<Self>,
        targets: &Tensor<Self>,
        z_loss: f32,
        grad_scale: Option<f32>,
    ) -> Result<()> {
        self.op("cross_entropy", || {
            self.cross_entropy_impl(logits, losses, targets, z_loss, grad_scale)
        })
    }

    fn sum_squares(&self, sums: &Tensor<Self>, xs: &[Option<&Tensor<Self>>]) -> Result<()> {
        self.op("sum_squares", || self.sum_squares_impl(sums, xs))
    }

    fn sum(&self, out: &Tensor<Self>, x: &Tensor<Self>) -> Result<()> {
        self.op("sum", || self.sum_impl(out, x))
    }

    fn adamw(
        &self,
        tensors: &[AdamWTensor<'_, Self>],
        norm_sq: &Tensor<Self>,
        hp: &AdamW,
    ) -> Result<()> {
        self.op("adamw", || self.adamw_impl(tensors, norm_sq, hp))
    }

    fn abs_max(&self, amax: &Tensor<Self>, x: &Tensor<Self>) -> Result<()> {
        self.op("abs_max", || self.abs_max_impl(amax, x))
    }

    fn quantize(
        &self,
        rows: Option<&Tensor<Self>>,
        cols: Option<&Tensor<Self>>,
        descale: &Tensor<Self>,
        x: &Tensor<Self>,
        amax: &Tensor<Self>,
    ) -> Result<()> {
        self.op_named(
            || fp8::quantize_name(rows, cols, x, ""),
            || self.quantize_impl(rows, cols, descale, x, amax, Fused::Nothing),
        )
    }

    fn quantize_normalized(
        &self,
        rows: &Tensor<Self>,
        cols: &Tensor<Self>,
        descale: &Tensor<Self>,
        x: Normalized<'_, Self>,
        amax: &Tensor<Self>,
    ) -> Result<()> {
        let (rows, cols) = (Some(rows), Some(cols));
        let norm = Fused::Norm {
            rstd: x.rstd,
            weight: x.weight,
        };
        self.op_named(
            || fp8::quantize_name(rows, cols, x.x, "+norm"),
            || self.quantize_impl(rows, cols, descale, x.x, amax, norm),
        )
    }

    fn quantize_summing_columns(
        &self,
        rows: Option<&Tensor<Self>>,
        cols: Option<&Tensor<Self>>,
        descale: &Tensor<Self>,
        x: &Tensor<Self>,
        amax: &Tensor<Self>,
        column_sums: (&Tensor<Self>, bool),
    ) -> Result<()> {
        self.op_named(
            || fp8::quantize_name(rows, cols, x, "+sums"),
            || {
                let (dbias, accumulate) = column_sums;
                let sums = Fused::ColumnSums(dbias, accumulate);
                self.quantize_impl(rows, cols, descale, x, amax, sums)
            },
        )
    }

    fn matmul_scaled(
        &self,
        out: &Tensor<Self>,
        a: Scaled<'_, Self>,
        b: Scaled<'_, Self>,
        bias: Option<&Tensor<Self>>,
        sum: Fp8Sum,
        accumulate: bool,
    ) -> Result<()> {
        let name = || matmul_name(out.matrix_rows(), out.cols(), a.data.cols());
        self.op_named(
            || format!("fp8 {}", name()),
            || self.matmul_scaled_impl(out, a, b, bias, sum, accumulate),
        )
    }
}
