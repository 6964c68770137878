//! The CUDA kernels: their sources (the `.cu` files beside this one, each with the launch
//! constants it is compiled with), and the one table of kernels. Each table entry names its
//! source file, its template and the kinds of its template parameters. Launch sites pick a
//! `Kernel` variant (a typo there fails to build) and its arguments; `instance` checks them
//! against the table and spells the NVRTC name expression. The CPU-only compile test
//! instantiates every entry with every argument, so a misspelt template fails there.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::backend::UnsupportedDtype;
use crate::backend::cuda::nvrtc::{self, Source};
use crate::backend::cuda::tma::{TensorMaps2, TensorMaps4};
use crate::tensor::DType;

/// `cross_entropy_cluster`'s shape (classifier.cu compiles with these): blocks per row,
/// threads per block and the 16-byte units each thread holds.
pub const CLUSTER_BLOCKS: usize = 8;
pub const CLUSTER_THREADS: u32 = 256;
pub const CLUSTER_UNITS: usize = 12;
/// Rows per block and threads per block of the tensor-core kernels (attention_tc.cu's
/// `ATTENTION_TILE` and `ATTENTION_THREADS`).
pub const ATTENTION_TC_TILE: usize = 64;
pub const ATTENTION_TC_THREADS: u32 = 128;
/// Query (or key) rows per block of the CUDA-core kernels (attention.cu's `TILE`), whose
/// blocks are `BLOCK` threads.
pub const ATTENTION_TILE: usize = 32;
/// Threads of a `colsum_finish` block (colsum.cu compiles with it): 32 warps each add a share
/// of the partials of the block's 32 columns.
pub const COLSUM_FINISH_THREADS: u32 = 1024;
/// The bitonic sort's tile (embedding.cu's `SORT_TILE`): sorted in shared memory by one block
/// of half as many threads.
pub const EMBEDDING_SORT_TILE: usize = 1024;
/// Threads per block of the simple element-wise and row kernels.
pub const BLOCK: u32 = 256;

pub static MEMORY: Source = Source {
    name: "memory.cu",
    text: include_str!("memory.cu"),
    options: &[],
    defines: &[],
};
pub static EMBEDDING: Source = Source {
    name: "embedding.cu",
    text: include_str!("embedding.cu"),
    options: &[],
    defines: &[("SORT_TILE", EMBEDDING_SORT_TILE)],
};
pub static RMSNORM: Source = Source {
    name: "rmsnorm.cu",
    text: include_str!("rmsnorm.cu"),
    options: &[],
    defines: &[("BACKWARD_MAX_THREADS", BLOCK as usize)],
};
pub static COLSUM: Source = Source {
    name: "colsum.cu",
    text: include_str!("colsum.cu"),
    options: &[],
    defines: &[
        ("PARTIAL_THREADS", BLOCK as usize),
        ("FINISH_THREADS", COLSUM_FINISH_THREADS as usize),
    ],
};
pub static ROPE: Source = Source {
    name: "rope.cu",
    text: include_str!("rope.cu"),
    options: &[],
    defines: &[],
};
pub static SWIGLU: Source = Source {
    name: "swiglu.cu",
    text: include_str!("swiglu.cu"),
    options: &[],
    defines: &[],
};
pub static GEMV: Source = Source {
    name: "gemv.cu",
    text: include_str!("gemv.cu"),
    options: &[],
    defines: &[],
};
pub static ATTENTION: Source = Source {
    name: "attention.cu",
    text: include_str!("attention.cu"),
    options: &[],
    defines: &[("TILE", ATTENTION_TILE), ("THREADS", BLOCK as usize)],
};
pub static ATTENTION_TC: Source = Source {
    name: "attention_tc.cu",
    text: include_str!("attention_tc.cu"),
    options: &[],
    defines: &[
        ("ATTENTION_TILE", ATTENTION_TC_TILE),
        ("ATTENTION_THREADS", ATTENTION_TC_THREADS as usize),
    ],
};
pub static CLASSIFIER: Source = Source {
    name: "classifier.cu",
    text: include_str!("classifier.cu"),
    options: &[],
    defines: &[
        ("CLUSTER_BLOCKS", CLUSTER_BLOCKS),
        ("CLUSTER_THREADS", CLUSTER_THREADS as usize),
        ("CLUSTER_UNITS", CLUSTER_UNITS),
    ],
};
// No contracted multiply-adds (--fmad=false), so the f32 update is bitwise the CPU's (see
// adamw.cu).
pub static ADAMW: Source = Source {
    name: "adamw.cu",
    text: include_str!("adamw.cu"),
    options: &["--fmad=false"],
    defines: &[
        ("ADAMW_THREADS", BLOCK as usize),
        ("Q8_BLOCK", crate::backend::ops::adam8bit::Q8_BLOCK),
    ],
};

/// The tile edge of `quantize_transposed` and its threads per block (fp8.cu compiles with
/// these).
pub const QUANTIZE_TILE: usize = 64;
pub const QUANTIZE_TILE_THREADS: u32 = 256;
pub static FP8: Source = Source {
    name: "fp8.cu",
    text: include_str!("fp8.cu"),
    options: &[],
    defines: &[
        ("QUANTIZE_TILE", QUANTIZE_TILE),
        ("QUANTIZE_THREADS", QUANTIZE_TILE_THREADS as usize),
    ],
};

/// The tile edge of `quantize_i8_cols` and the rows each block of `abs_max_cols` walks
/// (int8.cu compiles with these), and the threads per block the host launches each with.
pub const INT8_COL_TILE: usize = 64;
pub const INT8_COL_THREADS: u32 = 256;
pub const INT8_COL_ROWS: usize = 64;
pub const INT8_AMAX_THREADS: u32 = 128;
pub static INT8: Source = Source {
    name: "int8.cu",
    text: include_str!("int8.cu"),
    options: &[],
    defines: &[("COL_TILE", INT8_COL_TILE), ("COL_ROWS", INT8_COL_ROWS)],
};

/// The ring of shared buffers the producer fills ahead of the products, 40 KB each.
pub const GEMM_STAGES: usize = 4;
/// A producer warpgroup and two consumers.
pub const GEMM_THREADS: u32 = 384;
/// The epilogue's ring of 16 KB pieces, per consumer warpgroup.
pub const GEMM_EPI_BUFS: usize = 2;
pub static GEMM: Source = Source {
    name: "gemm_tn.cu",
    text: include_str!("gemm_tn.cu"),
    options: &[],
    defines: &[
        ("GEMM_STAGES", GEMM_STAGES),
        ("GEMM_THREADS", GEMM_THREADS as usize),
        ("GEMM_EPI_BUFS", GEMM_EPI_BUFS),
    ],
};

pub static SOURCES: [&Source; 14] = [
    &MEMORY,
    &EMBEDDING,
    &RMSNORM,
    &COLSUM,
    &ROPE,
    &SWIGLU,
    &GEMV,
    &ATTENTION,
    &ATTENTION_TC,
    &CLASSIFIER,
    &ADAMW,
    &FP8,
    &INT8,
    &GEMM,
];

/// The kind of one template parameter, and so the values it may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A storage type: f32 or bf16.
    Float,
    /// An attention head size.
    HeadDim,
    /// An attention head size the wgmma kernels take (a multiple of 64).
    WgmmaHeadDim,
    /// An FP8 format: e4m3 or e5m2.
    Fp8,
    Flag,
    /// Accesses per lane that a row kernel holds in registers for a whole row (0: it
    /// streams the row).
    Held,
    /// Consecutive elements a thread updates at once (1: one at a time).
    Width,
    /// What the own matmul computes (`GemmKind`).
    Gemm,
}

pub const HEAD_DIMS: [usize; 4] = [64, 80, 96, 128];

/// The values of `Param::Held`.
pub const HELD: [usize; 3] = [0, 4, 8];

/// The values of `Param::Width`.
pub const WIDTHS: [usize; 3] = [1, 4, 8];

/// What one launch of the own matmul computes (gemm_tn.cu's `gemm::Kind`): its operands' type and
/// its epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmKind {
    Plain,
    SwiGlu,
    /// SwiGLU's backward through the down projection.
    DSwiGlu,
    Fp8Plain,
    Fp8SwiGlu,
    /// `DSwiGlu` in FP8, dy in this format (the gradient's).
    Fp8DSwiGlu(DType),
    /// INT8 operands with a descale per row of each (and a bias).
    Int8Plain,
}

impl GemmKind {
    pub const ALL: [GemmKind; 8] = [
        GemmKind::Plain,
        GemmKind::SwiGlu,
        GemmKind::DSwiGlu,
        GemmKind::Fp8Plain,
        GemmKind::Fp8SwiGlu,
        GemmKind::Fp8DSwiGlu(DType::E4M3),
        GemmKind::Fp8DSwiGlu(DType::E5M2),
        GemmKind::Int8Plain,
    ];

    fn spelled(self) -> &'static str {
        match self {
            GemmKind::Plain => "gemm::Kind::PLAIN",
            GemmKind::SwiGlu => "gemm::Kind::SWIGLU",
            GemmKind::DSwiGlu => "gemm::Kind::DSWIGLU",
            GemmKind::Fp8Plain => "gemm::Kind::FP8_PLAIN",
            GemmKind::Fp8SwiGlu => "gemm::Kind::FP8_SWIGLU",
            GemmKind::Fp8DSwiGlu(DType::E5M2) => "gemm::Kind::FP8_DSWIGLU_E5M2",
            GemmKind::Fp8DSwiGlu(_) => "gemm::Kind::FP8_DSWIGLU_E4M3",
            GemmKind::Int8Plain => "gemm::Kind::INT8_PLAIN",
        }
    }
}

/// Whether the wgmma attention kernels take head size `d`: they multiply in blocks of 64
/// columns.
pub fn wgmma_head_dim(d: usize) -> bool {
    HEAD_DIMS.contains(&d) && d.is_multiple_of(64)
}

/// One template argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arg {
    Float(DType),
    HeadDim(usize),
    Fp8(DType),
    Flag(bool),
    Held(usize),
    Width(usize),
    Gemm(GemmKind),
}

impl Arg {
    fn spelled(self) -> String {
        match self {
            Arg::Float(DType::BF16) => "bf16".into(),
            Arg::Float(_) => "float".into(),
            Arg::HeadDim(d) => d.to_string(),
            Arg::Fp8(DType::E5M2) => "__NV_E5M2".into(),
            Arg::Fp8(_) => "__NV_E4M3".into(),
            Arg::Flag(f) => f.to_string(),
            Arg::Held(n) | Arg::Width(n) => n.to_string(),
            Arg::Gemm(kind) => kind.spelled().into(),
        }
    }

    fn fits(self, param: Param) -> bool {
        match (self, param) {
            (Arg::Float(d), Param::Float) => matches!(d, DType::F32 | DType::BF16),
            (Arg::HeadDim(d), Param::HeadDim) => HEAD_DIMS.contains(&d),
            (Arg::HeadDim(d), Param::WgmmaHeadDim) => wgmma_head_dim(d),
            (Arg::Fp8(d), Param::Fp8) => d.is_fp8(),
            (Arg::Flag(_), Param::Flag) => true,
            (Arg::Held(n), Param::Held) => HELD.contains(&n),
            (Arg::Width(n), Param::Width) => WIDTHS.contains(&n),
            (Arg::Gemm(_), Param::Gemm) => true,
            _ => false,
        }
    }
}

impl Param {
    fn values(self) -> Vec<Arg> {
        match self {
            Param::Float => vec![Arg::Float(DType::F32), Arg::Float(DType::BF16)],
            Param::HeadDim => HEAD_DIMS.iter().map(|&d| Arg::HeadDim(d)).collect(),
            Param::WgmmaHeadDim => HEAD_DIMS
                .into_iter()
                .filter(|&d| wgmma_head_dim(d))
                .map(Arg::HeadDim)
                .collect(),
            Param::Fp8 => vec![Arg::Fp8(DType::E4M3), Arg::Fp8(DType::E5M2)],
            Param::Flag => vec![Arg::Flag(false), Arg::Flag(true)],
            Param::Held => HELD.map(Arg::Held).to_vec(),
            Param::Width => WIDTHS.map(Arg::Width).to_vec(),
            Param::Gemm => GemmKind::ALL.map(Arg::Gemm).to_vec(),
        }
    }
}

macro_rules! kernel_table {
    ($($variant:ident => $source:ident, $template:literal, [$($param:ident),*];)*) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel { $($variant),* }

        impl Kernel {
            pub const ALL: &[Kernel] = &[$(Kernel::$variant),*];

            pub fn source(self) -> &'static Source {
                match self { $(Kernel::$variant => &$source),* }
            }

            pub fn template(self) -> &'static str {
                match self { $(Kernel::$variant => $template),* }
            }

            pub fn params(self) -> &'static [Param] {
                match self { $(Kernel::$variant => &[$(Param::$param),*]),* }
            }
        }
    };
}

kernel_table! {
    Fill => MEMORY, "fill", [Float];
    Copy => MEMORY, "copy", [Float, Float];
    CopyRowAt => MEMORY, "copy_row_at", [Float];
    EmbeddingForward => EMBEDDING, "embedding_forward", [Float];
    EmbeddingSortKeys => EMBEDDING, "embedding_sort_keys", [];
    BitonicGlobal => EMBEDDING, "bitonic_global", [];
    BitonicLocal => EMBEDDING, "bitonic_local", [];
    EmbeddingBackward => EMBEDDING, "embedding_backward", [Float];
    RmsnormForward => RMSNORM, "rmsnorm_forward", [Float, Flag, Flag];
    RmsnormBackward => RMSNORM, "rmsnorm_backward", [Float, Flag, Held];
    HeadRmsnormForward => RMSNORM, "head_rmsnorm_forward", [Float, HeadDim];
    HeadRmsnormBackward => RMSNORM, "head_rmsnorm_backward", [Float, HeadDim];
    ColsumPartial => COLSUM, "colsum_partial", [Float, Flag, Flag];
    ColsumFinish => COLSUM, "colsum_finish", [Float];
    Rope => ROPE, "rope", [Float, Flag];
    SwigluForward => SWIGLU, "swiglu_forward", [Float, Flag];
    SwigluBackward => SWIGLU, "swiglu_backward", [Float, Flag];
    Gemv => GEMV, "gemv", [Float, Flag];
    GemvSwiglu => GEMV, "gemv_swiglu", [Float, Flag];
    AttentionForward => ATTENTION, "attention_forward", [Float, HeadDim];
    AttentionDecode => ATTENTION, "attention_decode", [Float, HeadDim];
    AttentionDecodeCombine => ATTENTION, "attention_decode_combine", [Float, HeadDim];
    AttentionBackwardDelta => ATTENTION, "attention_backward_delta", [Float, HeadDim, Flag];
    AttentionBackwardDkDv => ATTENTION, "attention_backward_dkdv", [Float, HeadDim];
    AttentionBackwardDq => ATTENTION, "attention_backward_dq", [Float, HeadDim];
    AttentionForwardMma => ATTENTION_TC, "attention_forward_mma", [HeadDim];
    AttentionBackwardDkDvMma => ATTENTION_TC, "attention_backward_dkdv_mma", [HeadDim];
    AttentionBackwardDqMma => ATTENTION_TC, "attention_backward_dq_mma", [HeadDim];
    AttentionForwardWgmma => ATTENTION_TC, "attention_forward_wgmma", [WgmmaHeadDim];
    AttentionBackwardDkDvWgmma => ATTENTION_TC, "attention_backward_dkdv_wgmma", [WgmmaHeadDim];
    AttentionBackwardDqWgmma => ATTENTION_TC, "attention_backward_dq_wgmma", [WgmmaHeadDim];
    AttentionDkDvSum => ATTENTION_TC, "attention_dkdv_sum", [];
    CrossEntropy => CLASSIFIER, "cross_entropy", [Float, Flag];
    CrossEntropyCluster => CLASSIFIER, "cross_entropy_cluster", [Float];
    AdamW => ADAMW, "adamw", [Float, Float, Float, Float, Flag, Width];
    AdamW8bit => ADAMW, "adamw_8bit", [Float, Float, Flag];
    SumSquaresPartial => ADAMW, "sum_squares_partial", [Float];
    SumRanges => ADAMW, "sum_ranges", [];
    AbsMax => FP8, "abs_max", [Float, Flag];
    Quantize => FP8, "quantize", [Float, Fp8, Flag];
    QuantizeTransposed => FP8, "quantize_transposed", [Float, Fp8, Flag, Flag, Flag];
    QuantizeI8Rows => INT8, "quantize_i8_rows", [Float, Flag, Flag];
    AbsMaxCols => INT8, "abs_max_cols", [Float, Flag];
    QuantizeI8Cols => INT8, "quantize_i8_cols", [Float, Flag, Flag];
    DequantizeI32 => INT8, "dequantize_i32", [Float, Flag, Flag];
    GemmTn => GEMM, "gemm_tn", [Gemm];
}

/// A kernel with its template arguments, e.g. `rmsnorm_forward<bf16, true>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Instance {
    pub kernel: Kernel,
    pub name: String,
}

impl Kernel {
    /// Checks `args` against the table. A storage type the kernel has no instance for comes
    /// back as `UnsupportedDtype`.
    pub fn instance(self, args: &[Arg]) -> Result<Instance> {
        let unsupported =
            |a: &Arg| matches!(a, Arg::Float(d) if !matches!(d, DType::F32 | DType::BF16));
        if args.iter().any(unsupported) {
            let dtypes = args
                .iter()
                .filter_map(|a| match a {
                    Arg::Float(d) => Some(*d),
                    _ => None,
                })
                .collect();
            return Err(UnsupportedDtype {
                backend: "cuda",
                op: self.template(),
                dtypes,
            }
            .into());
        }
        let params = self.params();
        if args.len() != params.len() || args.iter().zip(params).any(|(a, &p)| !a.fits(p)) {
            bail!("{}: no instance for {args:?}", self.template());
        }
        Ok(self.spell(args))
    }

    fn spell(self, args: &[Arg]) -> Instance {
        let name = if args.is_empty() {
            self.template().to_string()
        } else {
            let spelled: Vec<String> = args.iter().map(|a| a.spelled()).collect();
            format!("{}<{}>", self.template(), spelled.join(", "))
        };
        Instance { kernel: self, name }
    }

    /// Every instantiation the table allows, for the compile test.
    pub fn all_instances(self) -> Vec<Instance> {
        let mut combos: Vec<Vec<Arg>> = vec![vec![]];
        for p in self.params() {
            combos = combos
                .into_iter()
                .flat_map(|prefix| {
                    p.values().into_iter().map(move |v| {
                        let mut c = prefix.clone();
                        c.push(v);
                        c
                    })
                })
                .collect();
        }
        combos.iter().map(|args| self.spell(args)).collect()
    }
}

/// Every instance of every kernel in `source`, as NVRTC name expressions.
pub fn all_names(source: &Source) -> Vec<String> {
    Kernel::ALL
        .iter()
        .filter(|k| std::ptr::eq(k.source(), source))
        .flat_map(|k| k.all_instances())
        .map(|i| i.name)
        .collect()
}

/// Shared memory, static and dynamic together, a block may use without opting in.
pub const DEFAULT_SHARED_LIMIT: u32 = 48 * 1024;

/// A kernel argument: device pointers travel as `u64`.
#[derive(Clone, Debug)]
pub enum KArg {
    U64(u64),
    I64(i64),
    I32(i32),
    F32(f32),
    /// Two TMA descriptors, passed by value (boxed: 256 bytes, where the others take 8).
    Maps(Box<TensorMaps2>),
    /// Four TMA descriptors, by value.
    Maps4(Box<TensorMaps4>),
}

impl From<u64> for KArg {
    fn from(x: u64) -> Self {
        KArg::U64(x)
    }
}
impl From<i64> for KArg {
    fn from(x: i64) -> Self {
        KArg::I64(x)
    }
}
impl From<i32> for KArg {
    fn from(x: i32) -> Self {
        KArg::I32(x)
    }
}
impl From<f32> for KArg {
    fn from(x: f32) -> Self {
        KArg::F32(x)
    }
}

/// Compiles kernels for this device at first use and keeps the loaded functions.
pub struct Kernels {
    ctx: Arc<CudaContext>,
    arch: String,
    include: RefCell<Option<Vec<PathBuf>>>,
    loaded: RefCell<HashMap<String, CudaFunction>>,
}

impl Kernels {
    pub fn new(ctx: Arc<CudaContext>, arch: String) -> Self {
        Kernels {
            ctx,
            arch,
            include: RefCell::new(None),
            loaded: RefCell::new(HashMap::new()),
        }
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    fn function(&self, inst: &Instance) -> Result<CudaFunction> {
        if let Some(f) = self.loaded.borrow().get(&inst.name) {
            return Ok(f.clone());
        }
        let include = {
            let mut slot = self.include.borrow_mut();
            if slot.is_none() {
                *slot = Some(nvrtc::include_dirs()?);
            }
            slot.clone().expect("set above")
        };
        let compiled = nvrtc::compile_cached(
            inst.kernel.source(),
            std::slice::from_ref(&inst.name),
            &self.arch,
            &include,
        )?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(compiled.cubin))
            .with_context(|| format!("loading the CUBIN of {}", inst.name))?;
        let f = module
            .load_function(&compiled.lowered[0])
            .with_context(|| format!("finding kernel {} in its CUBIN", inst.name))?;
        self.loaded
            .borrow_mut()
            .insert(inst.name.clone(), f.clone());
        Ok(f)
    }

    /// How many blocks of `block` threads and `smem` bytes of dynamic shared memory fit on
    /// one multiprocessor at once.
    pub fn resident_blocks(&self, inst: &Instance, block: u32, smem: u32) -> Result<u32> {
        let f = self.function_with_smem(inst, smem)?;
        f.occupancy_max_active_blocks_per_multiprocessor(block, smem as usize, None)
            .with_context(|| format!("occupancy of {}", inst.name))
    }

    /// How many clusters of `inst` (its cluster shape compiled in, `cluster` blocks of `block`
    /// threads and `smem` bytes of dynamic shared memory each) the whole GPU runs at once.
    pub fn resident_clusters(
        &self, stream: &CudaStream, inst: &Instance, (cluster, block, smem): (u32, u32, u32),
    ) -> Result<u32> {
        let f = self.function_with_smem(inst, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (cluster, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem,
        };
        f.occupancy_max_active_clusters(cfg, stream)
            .with_context(|| format!("cluster occupancy of {}", inst.name))
    }

    /// The kernel, allowed `smem` bytes of dynamic shared memory. Past 48 KB in all a kernel
    /// must opt in to more; reading its static size and setting the limit are cheap driver
    /// calls, not stream operations.
    fn function_with_smem(&self, inst: &Instance, smem: u32) -> Result<CudaFunction> {
        let f = self.function(inst)?;
        let fixed = if smem > 0 {
            f.shared_size_bytes()? as u32
        } else {
            0
        };
        if smem + fixed > DEFAULT_SHARED_LIMIT {
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .with_context(|| format!("allowing {} {smem} bytes of shared memory", inst.name))?;
        }
        Ok(f)
    }

    /// Enqueues `inst` on `stream` with a 1-D block and `smem` bytes of dynamic shared memory.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and size, every pointer
    /// must be valid for what the kernel accesses with these sizes, and `smem` must be what
    /// the kernel expects.
    pub unsafe fn launch(
        &self, stream: &CudaStream, inst: &Instance, grid: (u32, u32, u32), block: u32, smem: u32,
        args: &[KArg],
    ) -> Result<()> {
        let f = self.function_with_smem(inst, smem)?;
        let mut builder = stream.launch_builder(&f);
        for a in args {
            match a {
                KArg::U64(x) => builder.arg(x),
                KArg::I64(x) => builder.arg(x),
                KArg::I32(x) => builder.arg(x),
                KArg::F32(x) => builder.arg(x),
                KArg::Maps(x) => builder.arg(x.as_ref()),
                KArg::Maps4(x) => builder.arg(x.as_ref()),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: forwarded contract.
        unsafe { builder.launch(cfg) }
            .with_context(|| format!("launching {} with grid {grid:?}", inst.name))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A define the source never reads is a launch constant that no longer reaches the kernel
    /// it sizes; one the source also `#define`s would be overridden there.
    #[test]
    fn every_define_is_read_by_its_source_and_set_only_by_the_host() {
        for source in SOURCES {
            for (name, _) in source.defines {
                let used = source
                    .text
                    .split(|c: char| !c.is_alphanumeric() && c != '_');
                assert!(
                    used.into_iter().any(|word| word == *name),
                    "{} never reads {name}",
                    source.name
                );
                assert!(
                    !source.text.contains(&format!("#define {name}")),
                    "{} defines {name} itself",
                    source.name
                );
            }
        }
    }
}
