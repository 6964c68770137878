//! Activation memory, planned once for a (batch, seq) shape, and the store the blocks read
//! and write their activations through.
//!
//! An activation the backward needs is either kept per layer, or, when the recompute
//! options say so, held in one buffer that all layers share and recomputed in the backward
//! from what was kept; one kept per layer may live in host memory (`Stash`). Which is
//! which is decided here, in one place. Where an activation lives is the store's business:
//! the forward and backward passes tell it when a block starts and ends, and a block sees
//! only tensors.

use std::ops::Range;

use anyhow::Result;

use super::recompute::Recompute;
use super::residuals::Residuals;
use super::stash::Stash;
use crate::backend::Backend;
use crate::tensor::{DType, Tensor, TensorSpec};

/// Collects the specs of one allocation; each `add` returns where its tensors will be.
struct Plan {
    specs: Vec<TensorSpec>,
}

impl Plan {
    fn add(&mut self, name: &str, shape: &[usize], dtype: DType, copies: usize) -> Range<usize> {
        let start = self.specs.len();
        for i in 0..copies {
            let name = if copies == 1 {
                name.to_string()
            } else {
                format!("{name}.{i}")
            };
            self.specs.push(TensorSpec::new(name, shape, dtype));
        }
        start..self.specs.len()
    }
}

/// Where a stash's tensors sit among the device and the host specs.
struct StashPlan {
    device: Range<usize>,
    host: Range<usize>,
}

/// The device and host allocations of the activations.
struct Plans {
    device: Plan,
    host: Plan,
    layers: usize,
}

impl Plans {
    /// A stash: one tensor per layer, or one for all when `shared` (recomputed, or not read
    /// again); offloaded (if kept per layer, and `offload`), two slots on the device and one
    /// per layer in host memory.
    fn stash(
        &mut self, name: &str, shape: &[usize], dtype: DType, shared: bool, offload: bool,
    ) -> StashPlan {
        let l = self.layers;
        let (device, host) = match (shared, offload) {
            (true, _) => (1, 0),
            (false, false) => (l, 0),
            (false, true) => (2.min(l), l),
        };
        StashPlan {
            device: self.device.add(name, shape, dtype, device),
            host: self.host.add(name, shape, dtype, host),
        }
    }
}

/// Sizes the activation buffers are planned for.
pub struct ActivationShape {
    pub tokens: usize, // N = batch · seq
    pub batch: usize,
    pub seq: usize,
    pub layers: usize,
    pub hidden: usize,
    pub q_dim: usize,
    pub qkv_dim: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub vocab: usize,
    pub head_rows: usize, // rows of one LM-head chunk
    pub ffn_rows: usize,  // rows of one MLP chunk (N unchunked; chunks are always recomputed)
    /// The heads a QK-norm normalizes (queries and keys), for a model with one (Qwen3).
    pub qk_norm_heads: Option<usize>,
    /// Whether sequences pack documents (`ModelOptions::documents`).
    pub documents: bool,
}

/// Every activation and activation gradient of one micro-batch. The MLP's gradients have no
/// buffers of their own: each overwrites the activation it is the gradient of, which the
/// backward no longer needs by then (`block_backward`).
pub struct Activations<B: Backend> {
    pub tokens: Tensor<B>,  // [N] i32
    pub targets: Tensor<B>, // [N] i32
    /// The packed documents' spans (`documents::spans`), where sequences pack documents.
    pub docs: Option<Tensor<B>>, // [2, N] i32
    pub residual: Residuals<B>, // [N, C]: each block's input, then the last output
    pub ln1: Stash<B>,      // [N, C]
    pub rstd1: Stash<B>,    // [N]
    pub qkv: Stash<B>,      // [N, W], after RoPE
    /// The QK-norm's input and statistics, for a model with one (Qwen3).
    pub qk_norm: Option<QkNormStash<B>>,
    pub att: Stash<B>,          // [N, Q]
    pub lse: Stash<B>,          // [B, H, T]
    pub residual_mid: Stash<B>, // [N, C]: residual after attention
    pub ln2: Stash<B>,          // [N, C]
    pub rstd2: Stash<B>,        // [N]
    pub gate_up: Stash<B>,      // [N, 2F]
    pub swiglu: Stash<B>,       // [N, F]
    pub lnf: Tensor<B>,         // [N, C]
    pub rstdf: Tensor<B>,       // [N]
    /// A block's branch output (attention projection, then MLP), added to the residual next.
    pub branch: Tensor<B>, // [N, C]
    pub logits: Tensor<B>,      // [head_rows, V]: one LM-head chunk, then its gradient
    pub losses: Tensor<B>,      // [N]
    pub dresidual: Tensor<B>,   // [N, C]
    pub dln: Tensor<B>,         // [N, C]: gradient of a norm's output
    pub datt: Tensor<B>,        // [N, Q]
    pub dqkv: Tensor<B>,        // [N, W]
}

/// What a QK-norm keeps for its backward.
pub struct QkNormStash<B: Backend> {
    pub raw: Stash<B>,  // [N, W]: the QKV projection's output, the norm's input
    pub rstd: Stash<B>, // [N, q_heads + kv_heads]
}

impl<B: Backend> Activations<B> {
    /// Every activation kept per layer (or shared) but the residual stream.
    fn stashes(&self) -> impl Iterator<Item = &Stash<B>> {
        let qk_norm = self.qk_norm.iter().flat_map(|q| [&q.raw, &q.rstd]);
        [
            &self.ln1,
            &self.rstd1,
            &self.qkv,
            &self.att,
            &self.lse,
            &self.residual_mid,
            &self.ln2,
            &self.rstd2,
            &self.gate_up,
            &self.swiglu,
        ]
        .into_iter()
        .chain(qk_norm)
    }

    /// Before block `l`'s forward writes its activations, its input in the residual stream
    /// among them (`Stash::before_write`): before the embedding for block 0.
    pub fn before_block_forward(&self, b: &B, l: usize) -> Result<()> {
        self.residual.before_write(b, l)?;
        self.stashes().try_for_each(|s| s.before_write(b, l))
    }

    /// After block `l`'s forward: its offloaded activations start their way out.
    pub fn block_forward_done(&self, b: &B, l: usize) -> Result<()> {
        self.residual.written(b, l)?;
        self.stashes().try_for_each(|s| s.written(b, l))
    }

    /// Before block `l`'s backward (and its recompute pass), with the residual stream.
    pub fn before_block_backward(&self, b: &B, l: usize) -> Result<()> {
        self.residual.before_backward(b, l)?;
        self.stashes().try_for_each(|s| s.before_backward(b, l))
    }
}

/// Where each activation's tensors sit among the planned specs, so that the allocated
/// tensors can be handed back in the same order.
pub struct ActivationPlan {
    pub specs: Vec<TensorSpec>,
    /// The offloaded stashes' copies in host memory (empty when nothing is offloaded).
    pub offloaded: Vec<TensorSpec>,
    layers: usize,
    tokens: Range<usize>,
    targets: Range<usize>,
    docs: Option<Range<usize>>,
    residual: StashPlan,
    residual_out: Range<usize>,
    ln1: StashPlan,
    rstd1: StashPlan,
    qkv: StashPlan,
    qk_norm: Option<(StashPlan, StashPlan)>,
    att: StashPlan,
    lse: StashPlan,
    residual_mid: StashPlan,
    ln2: StashPlan,
    rstd2: StashPlan,
    gate_up: StashPlan,
    swiglu: StashPlan,
    lnf: Range<usize>,
    rstdf: Range<usize>,
    branch: Range<usize>,
    logits: Range<usize>,
    losses: Range<usize>,
    dresidual: Range<usize>,
    dln: Range<usize>,
    datt: Range<usize>,
    dqkv: Range<usize>,
}

/// What goes to host memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct ActivationOffload {
    /// The residual stream's block inputs (`--offload-residual`).
    pub residual: bool,
    /// Every other activation kept per layer (`--offload-activations`).
    pub kept: bool,
}

impl ActivationPlan {
    /// The specs of every buffer, kept per layer or shared as `recompute` says, and offloaded
    /// as `offload` says. With `fp8` matmuls the backward does not read the norms' and
    /// SwiGLU's outputs again, as bf16's weight gradients do (FP8's read the FP8 copies their
    /// forward made): one buffer of each serves every layer. FP8 does not even write the
    /// norms' (their projections normalize as they quantize, `linear::Input`), so theirs go
    /// unused.
    pub fn new(
        s: &ActivationShape, recompute: Recompute, fp8: bool, offload: ActivationOffload,
        dtype: DType, stat_dtype: DType,
    ) -> Self {
        let mut p = Plans {
            device: Plan { specs: vec![] },
            host: Plan { specs: vec![] },
            layers: s.layers,
        };
        let n = s.tokens;
        let kept = offload.kept;
        let tokens = p.device.add("tokens", &[n], DType::I32, 1);
        let targets = p.device.add("targets", &[n], DType::I32, 1);
        let docs = s
            .documents
            .then(|| p.device.add("docs", &[2, n], DType::I32, 1));
        let residual = p.stash("residual", &[n, s.hidden], dtype, false, offload.residual);
        let residual_out = p.device.add("residual_out", &[n, s.hidden], dtype, 1);
        let kept_ln1 = !fp8 && !recompute.norms();
        let ln1 = p.stash("ln1", &[n, s.hidden], dtype, !kept_ln1, kept);
        let rstd1 = p.stash("rstd1", &[n], stat_dtype, false, kept);
        let qkv = p.stash("qkv", &[n, s.qkv_dim], dtype, recompute.qkv(), kept);
        let qk_norm = s.qk_norm_heads.map(|heads| {
            (
                p.stash("qkv_raw", &[n, s.qkv_dim], dtype, recompute.qkv(), kept),
                p.stash("rstd_qk", &[n, heads], stat_dtype, recompute.qkv(), kept),
            )
        });
        let att = p.stash("att", &[n, s.q_dim], dtype, recompute.attention(), kept);
        let lse_shape = [s.batch, s.heads, s.seq];
        let lse = p.stash("lse", &lse_shape, stat_dtype, recompute.attention(), kept);
        let mid_recomputed = recompute.residual_mid();
        let residual_mid = p.stash("residual_mid", &[n, s.hidden], dtype, mid_recomputed, kept);
        let kept_ln2 = !fp8 && !recompute.norms();
        let ln2 = p.stash("ln2", &[n, s.hidden], dtype, !kept_ln2, kept);
        let rstd2 = p.stash("rstd2", &[n], stat_dtype, false, kept);
        let gate_up_shape = [s.ffn_rows, 2 * s.intermediate];
        let gate_up = p.stash("gate_up", &gate_up_shape, dtype, recompute.gate_up(), kept);
        let swiglu_shape = [s.ffn_rows, s.intermediate];
        let kept_swiglu = !fp8 && !recompute.swiglu_out();
        let swiglu = p.stash("swiglu", &swiglu_shape, dtype, !kept_swiglu, kept);
        let d = &mut p.device;
        ActivationPlan {
            layers: s.layers,
            tokens,
            targets,
            docs,
            residual,
            residual_out,
            ln1,
            rstd1,
            qkv,
            qk_norm,
            att,
            lse,
            residual_mid,
            ln2,
            rstd2,
            gate_up,
            swiglu,
            lnf: d.add("lnf", &[n, s.hidden], dtype, 1),
            rstdf: d.add("rstdf", &[n], stat_dtype, 1),
            branch: d.add("branch", &[n, s.hidden], dtype, 1),
            logits: d.add("logits", &[s.head_rows, s.vocab], dtype, 1),
            losses: d.add("losses", &[n], stat_dtype, 1),
            dresidual: d.add("dresidual", &[n, s.hidden], dtype, 1),
            dln: d.add("dln", &[n, s.hidden], dtype, 1),
            datt: d.add("datt", &[n, s.q_dim], dtype, 1),
            dqkv: d.add("dqkv", &[n, s.qkv_dim], dtype, 1),
            specs: p.device.specs,
            offloaded: p.host.specs,
        }
    }

    /// The per-token losses of a pass.
    pub fn losses(&self) -> &TensorSpec {
        &self.specs[self.losses.start]
    }

    /// The activations, from tensors allocated for `specs` and `offloaded` in their order.
    pub fn build<B: Backend>(
        &self, t: Vec<Tensor<B>>, offloaded: Vec<Tensor<B>>,
    ) -> Activations<B> {
        let stash = |p: &StashPlan| {
            Stash::new(
                t[p.device.clone()].to_vec(),
                offloaded[p.host.clone()].to_vec(),
            )
        };
        let one = |r: &Range<usize>| t[r.start].clone();
        Activations {
            tokens: one(&self.tokens),
            targets: one(&self.targets),
            docs: self.docs.as_ref().map(one),
            residual: Residuals::new(stash(&self.residual), one(&self.residual_out), self.layers),
            ln1: stash(&self.ln1),
            rstd1: stash(&self.rstd1),
            qkv: stash(&self.qkv),
            qk_norm: (self.qk_norm.as_ref()).map(|(raw, rstd)| QkNormStash {
                raw: stash(raw),
                rstd: stash(rstd),
            }),
            att: stash(&self.att),
            lse: stash(&self.lse),
            residual_mid: stash(&self.residual_mid),
            ln2: stash(&self.ln2),
            rstd2: stash(&self.rstd2),
            gate_up: stash(&self.gate_up),
            swiglu: stash(&self.swiglu),
            lnf: one(&self.lnf),
            rstdf: one(&self.rstdf),
            branch: one(&self.branch),
            logits: one(&self.logits),
            losses: one(&self.losses),
            dresidual: one(&self.dresidual),
            dln: one(&self.dln),
            datt: one(&self.datt),
            dqkv: one(&self.dqkv),
        }
    }
}
