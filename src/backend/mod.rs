//! The contract between the transformer and the hardware.
//!
//! The methods are the fused operations a Llama/Qwen2 training step needs, not general
//! tensor algebra. Each has a plainly written twin of the same name in `cpu/`, which is
//! the reference every other backend is tested against.
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
pub mod select;

use anyhow::Result;

use self::op_times::OpTime;
use crate::tensor::{DType, Tensor, TensorSpec};

/// Shape of one attention call. `qkv` rows hold `q_heads` query heads, then `kv_heads`
/// key heads, then `kv_heads` value heads, each `head_dim` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    pub fn qkv_width(&self) -> usize {
        (self.q_heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// `out (+)= op(a) · op(b) (+ bias)`, where `op` transposes when asked. Every operand is
/// read as a row-major matrix whose columns are its last dimension.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Matmul {
    pub trans_a: bool,
    pub trans_b: bool,
    pub accumulate: bool,
}

impl Matmul {
    /// `y = x · wᵀ`: the forward of a linear layer with `w` stored `[out, in]`.
    pub const FORWARD: Matmul = Matmul {
        trans_a: false,
        trans_b: true,
        accumulate: false,
    };
    /// `dx = dy · w`: a linear layer's input gradient.
    pub const BACKWARD_INPUT: Matmul = Matmul {
        trans_a: false,
        trans_b: false,
        accumulate: false,
    };
    /// `dw (+)= dyᵀ · x`: a linear layer's weight gradient.
    pub fn backward_weight(accumulate: bool) -> Matmul {
        Matmul {
            trans_a: true,
            trans_b: false,
            accumulate,
        }
    }
}

/// One AdamW step's hyper-parameters, shared by every tensor it updates. `step` counts from
/// 1 for the bias correction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Applies to the tensors that ask for it (`AdamWTensor::decays`).
    pub weight_decay: f32,
    pub step: u64,
    /// Gradients are scaled by `min(1, grad_clip / norm)` with `norm` read on the device;
    /// `0` disables clipping.
    pub grad_clip: f32,
}

/// One tensor of an AdamW step: the parameter (updated through its high-precision `master`
/// copy when there is one, `param` then receiving it rounded), its gradient and moments.
pub struct AdamWTensor<'a, B: Backend> {
    pub param: &'a Tensor<B>,
    pub master: Option<&'a Tensor<B>>,
    pub grad: &'a Tensor<B>,
    pub m: &'a Tensor<B>,
    pub v: &'a Tensor<B>,
    /// Whether weight decay applies: matrices and embeddings, not norms and biases.
    pub decays: bool,
    /// Seeds stochastic rounding; differs per tensor and per step.
    pub seed: u64,
    /// Receives the updated `param`'s abs-max, for its FP8 copy.
    pub amax: Option<&'a Tensor<B>>,
}

impl AdamW {
    /// The weight decay of a tensor that does or does not decay.
    pub fn weight_decay_for(&self, decays: bool) -> f32 {
        if decays { self.weight_decay } else { 0.0 }
    }

    /// `1 / (1 − β₁^step)` and `1 / √(1 − β₂^step)`, the factors of the bias-corrected
    /// moments, computed in f64 and rounded to f32 once per tensor on the host: every
    /// backend's update multiplies by exactly these.
    pub fn bias_factors(&self) -> (f32, f32) {
        let correction = |beta: f32| 1.0 - (beta as f64).powi(self.step as i32);
        (
            (1.0 / correction(self.beta1)) as f32,
            (1.0 / correction(self.beta2).sqrt()) as f32,
        )
    }
}

/// An FP8 operand of `matmul_scaled`: values quantized by `quantize`, and `descale` (`[1]`
/// f32, on the device), the factor that turns them back into real values.
#[derive(Debug)]
pub struct Scaled<'a, B: Backend> {
    pub data: &'a Tensor<B>,
    pub descale: &'a Tensor<B>,
}

// By hand: a derive would ask for `B: Copy`, but only references are copied.
impl<B: Backend> Clone for Scaled<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Scaled<'_, B> {}

impl<'a, B: Backend> Scaled<'a, B> {
    pub fn new(data: &'a Tensor<B>, descale: &'a Tensor<B>) -> Self {
        Scaled { data, descale }
    }
}

/// The output of `rmsnorm_forward` described by its input rows `x` `[N, C]`, their `rstd`
/// `[N]` (f32) and the norm's `weight` `[C]`, for an op that normalizes as it reads instead
/// of reading the stored output.
#[derive(Debug)]
pub struct Normalized<'a, B: Backend> {
    pub x: &'a Tensor<B>,
    pub rstd: &'a Tensor<B>,
    pub weight: &'a Tensor<B>,
}

impl<B: Backend> Clone for Normalized<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Normalized<'_, B> {}

/// How an FP8 matmul sums along K.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Sum {
    /// In the tensor cores' own accumulator, without promotion to f32 along the way: faster,
    /// and what Transformer Engine does in the forward. smelt sums so wherever K is a model
    /// width: the forward and the input gradients.
    Fast,
    /// Promoted to f32 at intervals along K: for the weight gradients, which sum over every
    /// token of the batch.
    Promoted,
}

/// The largest finite value of an FP8 dtype, which `quantize` scales a tensor's abs-max to.
pub fn fp8_max(dtype: DType) -> Option<f32> {
    match dtype {
        DType::E4M3 => Some(448.0),
        DType::E5M2 => Some(57344.0),
        _ => None,
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

pub trait Backend: Sized {
    /// A cheap, clonable handle to memory owned by the backend.
    type Storage: Clone;

    /// One line for logs: the device and its precision.
    fn describe(&self) -> String;
    /// The device's datasheet dense bf16 peak in FLOP/s, which MFU is measured against;
    /// `None` where there is no such figure (the CPU), and MFU is not reported.
    fn peak_flops(&self) -> Option<f64> {
        None
    }
    /// The device's free and total memory in bytes, for the startup memory table; `None`
    /// where the planned tensors are all there is to report (the CPU).
    fn free_memory(&self) -> Option<(usize, usize)> {
        None
    }

    // ----- memory -----

    /// Allocates one category (weights, gradients, activations, ...) at once and returns its
    /// tensors in the order of `specs`. Contents are unspecified until written.
    fn allocate(&self, category: &str, specs: &[TensorSpec]) -> Result<Vec<Tensor<Self>>>;
    /// `allocate`, but in host memory that the device reads and writes over the bus, for
    /// state touched once per step (the optimizer's): it frees device memory for the price of
    /// moving those bytes over PCIe. Every op takes such tensors like any other. On a backend
    /// whose memory is the host's, the same as `allocate`.
    fn allocate_offloaded(
        &self,
        category: &str,
        specs: &[TensorSpec],
    ) -> Result<Vec<Tensor<Self>>> {
        self.allocate(category, specs)
    }
    /// Copies host values in, rounding each to the tensor's dtype.
    fn upload(&self, dst: &Tensor<Self>, src: &[f32]) -> Result<()>;
    fn upload_i32(&self, dst: &Tensor<Self>, src: &[i32]) -> Result<()>;
    /// Waits for pending work and returns the tensor's values.
    fn download(&self, src: &Tensor<Self>) -> Result<Vec<f32>>;
    /// `download` at the storage's full precision, for values the host sums (losses, norms)
    /// and for gradient checks on an f64 backend.
    fn download_f64(&self, src: &Tensor<Self>) -> Result<Vec<f64>> {
        Ok(self.download(src)?.into_iter().map(f64::from).collect())
    }
    fn fill(&self, dst: &Tensor<Self>, value: f32) -> Result<()>;
    /// `dst = src`, converting between float dtypes with round-to-nearest-even.
    fn copy(&self, dst: &Tensor<Self>, src: &Tensor<Self>) -> Result<()>;
    /// Starts `dst = src` (one dtype; one of them offloaded) once the ops enqueued so far are
    /// done, on a copy engine, so that it overlaps the ops enqueued after it; those must
    /// leave both tensors alone until `wait_for_copies_of` either. Where nothing runs beside
    /// the caller (the CPU), the copy is made at once.
    fn start_copy(&self, dst: &Tensor<Self>, src: &Tensor<Self>) -> Result<()> {
        self.copy(dst, src)
    }
    /// Makes the ops enqueued from now on wait for the last copy started into or out of each
    /// of `tensors` (and so for every copy started before it), but not for later ones.
    fn wait_for_copies_of(&self, _tensors: &[&Tensor<Self>]) -> Result<()> {
        Ok(())
    }
    fn synchronize(&self) -> Result<()>;
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

    // ----- the transformer's operations -----
    //
    // An `amax` argument, where given, is an FP8 input's abs-max reported by the op that
    // produces it: `amax[0] = max(amax[0], max |out|)` over the values as stored (`[1]` f32,
    // zeroed by the caller), so that quantizing needs no extra pass over the tensor.

    /// `out[n, :] = wte[tokens[n], :]`. tokens: `[N]` i32, wte: `[V, C]`, out: `[N, C]`.
    fn embedding_forward(
        &self,
        out: &Tensor<Self>,
        tokens: &Tensor<Self>,
        wte: &Tensor<Self>,
    ) -> Result<()>;
    /// `dwte[tokens[n], :] (+)= dout[n, :]`, summed in token order so that it is deterministic.
    fn embedding_backward(
        &self,
        dwte: &Tensor<Self>,
        tokens: &Tensor<Self>,
        dout: &Tensor<Self>,
        accumulate: bool,
    ) -> Result<()>;

    /// `out = inp · rstd · weight` with `rstd[n] = 1/sqrt(mean(inp[n]²) + eps)`.
    /// inp, out: `[N, C]`; weight: `[C]`; rstd: `[N]` f32. Without `out`, only rstd (and the
    /// abs-max of the output it would have stored), for a consumer that normalizes as it
    /// reads (`quantize_normalized`).
    fn rmsnorm_forward(
        &self,
        out: Option<&Tensor<Self>>,
        rstd: &Tensor<Self>,
        inp: &Tensor<Self>,
        weight: &Tensor<Self>,
        eps: f32,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
    /// `residual_out = residual + branch`, then `rmsnorm_forward` of `residual_out`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<()>;
    /// `dinp += ∂out/∂inp · dout` (the residual stream, always added into) and
    /// `dweight (+)= Σ_n dout[n] ⊙ inp[n] · rstd[n]`. With `amax`, also
    /// `amax[0] = max(amax[0], max |dinp|)` over dinp as stored: the residual gradient is the
    /// output gradient of the linear below, whose FP8 copy scales by it.
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<()>;

    /// `out[M, N] (+)= op(a)[M, K] · op(b)[K, N] (+ bias[N])`.
    fn matmul(
        &self,
        out: &Tensor<Self>,
        a: &Tensor<Self>,
        b: &Tensor<Self>,
        bias: Option<&Tensor<Self>>,
        spec: Matmul,
    ) -> Result<()>;
    /// `dbias[N] (+)= Σ_m dout[m, N]`.
    fn bias_backward(
        &self,
        dbias: &Tensor<Self>,
        dout: &Tensor<Self>,
        accumulate: bool,
    ) -> Result<()>;

    /// Rotates the query and key heads of `qkv` `[B·T, qkv_width]` in place, HF rotate-half
    /// style. `freqs` is `[T, head_dim/2, 2]` f32 of (cos, sin) per position and pair.
    fn rope_forward(
        &self,
        qkv: &Tensor<Self>,
        freqs: &Tensor<Self>,
        shape: AttnShape,
    ) -> Result<()>;
    /// The inverse rotation, applied in place to the gradient. With `amax`, also
    /// `amax[0] = max(amax[0], max |dqkv|)` over all of dqkv as stored, value heads included:
    /// the QKV projection's output gradient, whose FP8 copy scales by it.
    fn rope_backward(
        &self,
        dqkv: &Tensor<Self>,
        freqs: &Tensor<Self>,
        shape: AttnShape,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
    /// `rope_backward` (no abs-max) and then the QKV projection's bias gradient from the
    /// rotated gradient, `dbias (+)= Σ_m dqkv[m]` as `bias_backward` gives it. A backend that
    /// does both in one pass over dqkv overrides it.
    fn rope_backward_and_bias(
        &self,
        dqkv: &Tensor<Self>,
        freqs: &Tensor<Self>,
        shape: AttnShape,
        dbias: &Tensor<Self>,
        accumulate: bool,
    ) -> Result<()> {
        self.rope_backward(dqkv, freqs, shape, None)?;
        self.bias_backward(dbias, dqkv, accumulate)
    }

    /// Causal grouped-query attention with scale `1/sqrt(head_dim)`.
    /// qkv: `[B·T, qkv_width]`; out: `[B·T, q_heads·head_dim]`; lse: `[B, q_heads, T]` f32,
    /// the log-sum-exp of each score row, kept for the backward.
    fn attention_forward(
        &self,
        out: &Tensor<Self>,
        lse: &Tensor<Self>,
        qkv: &Tensor<Self>,
        shape: AttnShape,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
    /// Generation's attention over a KV cache: the query of the last of `shape.seq`
    /// positions against the keys and values of all of them, which is the last row of
    /// `attention_forward`'s output. qkv: `[T, qkv_width]` (one sequence); out:
    /// `[1, q_heads·head_dim]`.
    fn attention_decode(
        &self,
        out: &Tensor<Self>,
        qkv: &Tensor<Self>,
        shape: AttnShape,
    ) -> Result<()>;
    /// Writes `dqkv` (all three parts) from `dout`.
    fn attention_backward(
        &self,
        dqkv: &Tensor<Self>,
        dout: &Tensor<Self>,
        qkv: &Tensor<Self>,
        out: &Tensor<Self>,
        lse: &Tensor<Self>,
        shape: AttnShape,
    ) -> Result<()>;

    /// `out = silu(gate) ⊙ up` where `gate_up` is `[N, 2F]`: gate columns first, then up.
    fn swiglu_forward(
        &self,
        out: &Tensor<Self>,
        gate_up: &Tensor<Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()>;
    /// The MLP's gate/up projection and SwiGLU: `gate_up = x · wᵀ` (`[N, 2F]`, `w` being
    /// `[2F, K]`), then `out = silu(gate) ⊙ up`, as `matmul` and `swiglu_forward` compute
    /// them. A backend with a kernel doing both at once overrides it.
    fn gate_up_swiglu(
        &self,
        gate_up: &Tensor<Self>,
        out: &Tensor<Self>,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
    ) -> Result<()> {
        unfused_gate_up_swiglu(self, gate_up, out, x, w)
    }
    /// `gate_up_swiglu` in FP8: `gate_up` is `matmul_scaled`'s product of x and w (the
    /// forward's: e4m3, fast accumulation), `out` SwiGLU of it, and `amax`, where given,
    /// receives `out`'s abs-max as `swiglu_forward` reports it (FP8 quantizes `out` next). A
    /// backend with a kernel doing both at once overrides it.
    fn gate_up_swiglu_scaled(
        &self,
        gate_up: &Tensor<Self>,
        out: &Tensor<Self>,
        x: Scaled<'_, Self>,
        w: Scaled<'_, Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        unfused_gate_up_swiglu_scaled(self, gate_up, out, x, w, amax)
    }
    /// SwiGLU's backward through the down projection: `dh = dy · w` (`w` the down weight
    /// `[H, F]`, written into `dh`, which a backend may leave untouched), then gate/up's
    /// gradient over `gate_up`, as `matmul` and `swiglu_backward` compute them. A backend with
    /// a kernel doing both at once overrides it.
    fn swiglu_backward_through_down(
        &self,
        gate_up: &Tensor<Self>,
        dh: &Tensor<Self>,
        dy: &Tensor<Self>,
        w: &Tensor<Self>,
    ) -> Result<()> {
        unfused_swiglu_backward_through_down(self, gate_up, dh, dy, w)
    }
    /// `swiglu_backward_through_down` in FP8: `dh` is `matmul_scaled`'s product of dy (in the
    /// gradient's format) and w, the down weight's transposed copy `[F, H]`, summed fast (K is
    /// the hidden width), and `amax`, where given, receives gate/up's gradient's abs-max as
    /// `swiglu_backward` reports it. A backend with a kernel doing both at once overrides it.
    fn swiglu_backward_through_down_scaled(
        &self,
        gate_up: &Tensor<Self>,
        dh: &Tensor<Self>,
        dy: Scaled<'_, Self>,
        w: Scaled<'_, Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        unfused_swiglu_backward_through_down_scaled(self, gate_up, dh, dy, w, amax)
    }
    /// `dgate_up` may be `gate_up` itself (in place). `amax`, where given, receives
    /// `dgate_up`'s abs-max: the gate/up projection's output gradient, which FP8 quantizes
    /// next.
    fn swiglu_backward(
        &self,
        dgate_up: &Tensor<Self>,
        dout: &Tensor<Self>,
        gate_up: &Tensor<Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()>;

    /// Softmax cross-entropy over `logits` `[N, V]` against `targets` `[N]` (i32; -100 is
    /// ignored), with z-loss `z · lse²`. Writes `losses[N]` (f32). With `grad_scale` given,
    /// replaces the logits in place by `grad_scale · ∂loss/∂logits`.
    fn cross_entropy(
        &self,
        logits: &Tensor<Self>,
        losses: &Tensor<Self>,
        targets: &Tensor<Self>,
        z_loss: f32,
        grad_scale: Option<f32>,
    ) -> Result<()>;

    // ----- the optimizer -----

    /// `sums[i] = Σ xs[i]²`, summed in f32, or 0 where `xs[i]` is `None` (a gradient that
    /// another rank sums, under ZeRO-2); `sums` is `[xs.len()]` f32. Each sum depends only on
    /// its tensor, so ranks that each sum their own share, then add the vectors, get the bits
    /// of one rank summing everything.
    fn sum_squares(&self, sums: &Tensor<Self>, xs: &[Option<&Tensor<Self>>]) -> Result<()>;
    /// `out[0] = Σ x` in a fixed order; x f32 (the per-tensor sums above, into the squared
    /// global norm of the gradients, for clipping).
    fn sum(&self, out: &Tensor<Self>, x: &Tensor<Self>) -> Result<()>;
    /// One AdamW step on every tensor of `tensors`. `norm_sq` is the global gradient `Σ g²`
    /// from `sum_squares`, read on the device for clipping.
    fn adamw(
        &self,
        tensors: &[AdamWTensor<'_, Self>],
        norm_sq: &Tensor<Self>,
        hp: &AdamW,
    ) -> Result<()>;

    // ----- FP8 -----

    /// `amax[0] = max(amax[0], max |x|)`, for tensors whose producer does not report it.
    fn abs_max(&self, amax: &Tensor<Self>, x: &Tensor<Self>) -> Result<()>;
    /// Current scaling: with `s = fp8_max(dtype) / amax[0]` (1 where amax is 0 or not
    /// finite), both in f32, writes `fp8(x · s)` (round-to-nearest-even, saturating at
    /// ±fp8_max) and `descale[0] = 1 / s`. x: `[R, C]` bf16. `rows` receives it `[R, C]`,
    /// `cols` transposed `[C, R]` (the layout the backward's FP8 matmuls need); asking for
    /// both costs one pass over x. At least one must be given, of one fp8 dtype.
    fn quantize(
        &self,
        rows: Option<&Tensor<Self>>,
        cols: Option<&Tensor<Self>>,
        descale: &Tensor<Self>,
        x: &Tensor<Self>,
        amax: &Tensor<Self>,
    ) -> Result<()>;
    /// `quantize` of both layouts of `rmsnorm_forward`'s output, as it would have stored it,
    /// from its input: the FP8 forward's quantization of a norm's output, which then is never
    /// stored. `amax` is the norm's report.
    fn quantize_normalized(
        &self,
        rows: &Tensor<Self>,
        cols: &Tensor<Self>,
        descale: &Tensor<Self>,
        x: Normalized<'_, Self>,
        amax: &Tensor<Self>,
    ) -> Result<()>;
    /// `quantize`, and `dbias (+)= Σ_m x[m, N]` (`bias_backward`) from the same read of x: a
    /// linear's output gradient is both the FP8 input of its backward's matmuls and, summed
    /// over rows, its bias's gradient.
    fn quantize_summing_columns(
        &self,
        rows: Option<&Tensor<Self>>,
        cols: Option<&Tensor<Self>>,
        descale: &Tensor<Self>,
        x: &Tensor<Self>,
        amax: &Tensor<Self>,
        (dbias, accumulate): (&Tensor<Self>, bool),
    ) -> Result<()> {
        self.quantize(rows, cols, descale, x, amax)?;
        self.bias_backward(dbias, x, accumulate)
    }
    /// `out[M, N] (+)= (a[M, K] · a.descale) · (b[N, K] · b.descale)ᵀ (+ bias[N])`, the one
    /// form FP8 matmuls take on Hopper (K contiguous in both operands). a and b are e4m3 or
    /// e5m2, not both e5m2; out and bias are bf16. `sum` may be ignored by a backend that
    /// always sums exactly (the CPU).
    #[allow(clippy::too_many_arguments)]
    fn matmul_scaled(
        &self,
        out: &Tensor<Self>,
        a: Scaled<'_, Self>,
        b: Scaled<'_, Self>,
        bias: Option<&Tensor<Self>>,
        sum: Fp8Sum,
        accumulate: bool,
    ) -> Result<()>;
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

/// `Backend::gate_up_swiglu` as two ops, for a backend without the fused kernel (or operands
/// it does not take).
pub fn unfused_gate_up_swiglu<B: Backend>(
    b: &B,
    gate_up: &Tensor<B>,
    out: &Tensor<B>,
    x: &Tensor<B>,
    w: &Tensor<B>,
) -> Result<()> {
    b.matmul(gate_up, x, w, None, Matmul::FORWARD)?;
    b.swiglu_forward(out, gate_up, None)
}

/// `Backend::gate_up_swiglu_scaled` as two ops, likewise.
pub fn unfused_gate_up_swiglu_scaled<B: Backend>(
    b: &B,
    gate_up: &Tensor<B>,
    out: &Tensor<B>,
    x: Scaled<'_, B>,
    w: Scaled<'_, B>,
    amax: Option<&Tensor<B>>,
) -> Result<()> {
    b.matmul_scaled(gate_up, x, w, None, Fp8Sum::Fast, false)?;
    b.swiglu_forward(out, gate_up, amax)
}

/// `Backend::swiglu_backward_through_down` as two ops, likewise.
pub fn unfused_swiglu_backward_through_down<B: Backend>(
    b: &B,
    gate_up: &Tensor<B>,
    dh: &Tensor<B>,
    dy: &Tensor<B>,
    w: &Tensor<B>,
) -> Result<()> {
    b.matmul(dh, dy, w, None, Matmul::BACKWARD_INPUT)?;
    b.swiglu_backward(gate_up, dh, gate_up, None)
}

/// `Backend::swiglu_backward_through_down_scaled` as two ops, likewise.
pub fn unfused_swiglu_backward_through_down_scaled<B: Backend>(
    b: &B,
    gate_up: &Tensor<B>,
    dh: &Tensor<B>,
    dy: Scaled<'_, B>,
    w: Scaled<'_, B>,
    amax: Option<&Tensor<B>>,
) -> Result<()> {
    b.matmul_scaled(dh, dy, w, None, Fp8Sum::Fast, false)?;
    b.swiglu_backward(gate_up, dh, gate_up, amax)
}
