//! The contract between the transformer and the hardware.
//!
//! `Backend` is the sum of the op families in `ops/` (memory, embedding, norms, matmuls,
//! RoPE, attention, SwiGLU, the loss, the optimizer, FP8 and INT8 quantization), plus what describes
//! and profiles the device. The methods are the fused operations a Llama/Qwen training step
//! needs, not general tensor algebra. Each family is implemented once per backend, in the
//! file of its name under `cpu/` (the reference every other backend is tested against) and
//! under `cuda/`.
//!
//! Asynchrony: an implementation may enqueue work and return before it is done (the CUDA
//! backend does). `download`, `synchronize` and `take_op_times` wait; an op may also wait
//! once, the first time it needs more scratch memory or meets a new matmul shape (see
//! `cuda/mod.rs`), but callers must not count on that. Callers therefore never read a tensor
//! except through `download`, and never reuse a host slice they passed in before the call
//! returns (uploads copy before returning).
//!
//! The accumulate rule, once for every op: an op writes (`=`) its outputs, except where an
//! `accumulate` flag is given, which makes it add (`+=`) instead. The model passes `true`
//! for parameter gradients after the first micro-step, and residual-stream gradients are
//! always added into.

pub mod cpu;
pub mod cuda;
pub mod datasheet;
pub mod op_times;
pub mod ops;
pub mod select;
pub mod telemetry;

pub use self::ops::adamw::{AdamW, AdamWTensor, MomentScales, OptimizerOps};
pub use self::ops::attention::{AttentionOps, AttnShape};
pub use self::ops::classifier::ClassifierOps;
pub use self::ops::embedding::EmbeddingOps;
pub use self::ops::fp8::{Fused, QuantizeOps, fp8_max};
pub use self::ops::int8::{
    INT8_MAX, INT8_MAX_K, Int8Layout, Int8Ops, Int8Rounding, check_int8_product,
};
pub use self::ops::matmul::{Fp8Sum, Matmul, MatmulOps, Operand};
pub use self::ops::memory::{MemoryOps, RowAt};
pub use self::ops::rmsnorm::{NormOps, ResidualAdd};
pub use self::ops::rope::RopeOps;
pub use self::ops::swiglu::SwigluOps;

use anyhow::Result;

use self::op_times::OpTime;
use crate::tensor::DType;

/// Everything a backend provides, for code generic over it (`B: Backend`), which may then
/// call every family's ops. Code that names a backend type instead brings the families it
/// calls into scope (`use smelt::backend::prelude::*`).
pub trait Backend:
    MemoryOps
    + EmbeddingOps
    + NormOps
    + MatmulOps
    + RopeOps
    + AttentionOps
    + SwigluOps
    + ClassifierOps
    + OptimizerOps
    + QuantizeOps
    + Int8Ops
{
    /// Work recorded once and replayed (`record`): a CUDA graph.
    type Recording;

    /// One line for logs: the device and its precision.
    fn describe(&self) -> String;
    /// Records the ops that `work` enqueues, without running them, as one recording that
    /// `replay` enqueues again at a fraction of their launch cost, on the same memory and with
    /// the same arguments: what differs between replays must come from the device's memory
    /// (the ops that read an index there, such as `copy_row_at`). `work` must enqueue ops only,
    /// and only ops that ran before (their kernels loaded, their scratch sized). `None` where
    /// the backend records nothing, or is told not to: the caller then runs `work` itself.
    fn record(&self, _work: &mut dyn FnMut() -> Result<()>) -> Result<Option<Self::Recording>> {
        Ok(None)
    }
    /// Enqueues a recording's ops again.
    fn replay(&self, recording: &Self::Recording) -> Result<()>;
    /// The device's datasheet dense tensor-core peak in FLOP/s for matmuls of `dtype`
    /// inputs (`Datasheet::peak_flops`), which MFU and SOL are measured against; `None`
    /// where there is no such figure (the CPU, or FP8 on a GPU without it), and the figure
    /// is not reported.
    fn peak_flops(&self, _dtype: DType) -> Option<f64> {
        None
    }
    /// Starts (`true`) or stops timing each op's device time, by name, for
    /// `smelt bench --op-times`. A no-op where the backend does not time ops (the CPU).
    fn time_ops(&self, _on: bool) {}
    /// Waits for the device and returns the op times since timing started or since the last
    /// call, in order of first appearance; empty where the backend does not time ops.
    fn take_op_times(&self) -> Result<Vec<OpTime>> {
        Ok(Vec::new())
    }
    /// Opens a range named `name` on this thread's timeline for profilers (NVTX, which
    /// Nsight Systems shows and `ncu --nvtx` filters by), until the matching `end_range`;
    /// see `Range`. Nothing where the backend has no profiler (the CPU).
    fn begin_range(&self, _name: std::fmt::Arguments<'_>) {}
    fn end_range(&self) {}
}

/// The traits a caller brings into scope to call ops on a named backend type.
pub mod prelude {
    pub use super::{
        AttentionOps, Backend, ClassifierOps, EmbeddingOps, Int8Ops, MatmulOps, MemoryOps, NormOps,
        OptimizerOps, QuantizeOps, RopeOps, SwigluOps,
    };
}

/// A profiler range (`Backend::begin_range`) that ends when dropped: the model marks each
/// layer's forward and backward with one, the trainer each step and the optimizer.
pub struct Range<'a, B: Backend>(&'a B);

impl<'a, B: Backend> Range<'a, B> {
    pub fn begin(b: &'a B, name: std::fmt::Arguments<'_>) -> Self {
        b.begin_range(name);
        Range(b)
    }
}

impl<B: Backend> Drop for Range<'_, B> {
    fn drop(&mut self) {
        self.0.end_range();
    }
}

/// A typed refusal for a dtype combination an op does not implement.
#[derive(Debug, thiserror::Error)]
#[error("{backend} backend: {op} does not support dtypes {dtypes:?}")]
pub struct UnsupportedDtype {
    pub backend: &'static str,
    pub op: &'static str,
    pub dtypes: Vec<DType>,
}
