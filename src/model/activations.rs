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
#[derive(Clone)]
struct StashPlan {
    device: Range<usize>,
    host: Range<usize>,
}

/// The device and host allocations of the activations.
struct Plans {
    device: Plan,
    host: Plan,
    layers: usize,
    micro_batches: usize,
}

impl Plans {
    /// A stash of each micro-batch: one tensor per layer, or one for all layers and
    /// micro-batches when `shared` (recomputed, or not read again); offloaded (if kept per
    /// layer, and `offload`), two slots on the device and one per layer in host memory.
    fn stash(
        &mut self, name: &str, shape: &[usize], dtype: DType, shared: bool, offload: bool,
    ) -> Vec<StashPlan> {
        if shared {
            let one = StashPlan {
                device: self.device.add(name, shape, dtype, 1),
                host: 0..0,
            };
            return vec![one; self.micro_batches];
        }
        let l = self.layers;
        let (device, host) = match offload {
            false => (l, 0),
            true => (2.min(l), l),
        };
        (0..self.micro_batches)
            .map(|m| {
                let name = micro_batch_name(name, m);
                StashPlan {
                    device: self.device.add(&name, shape, dtype, device),
                    host: self.host.add(&name, shape, dtype, host),
                }
            })
            .collect()
    }

    /// A device tensor of each micro-batch's own (`own`), or one they all share.
    fn tensor(
        &mut self, name: &str, shape: &[usize], dtype: DType, own: bool,
    ) -> Vec<Range<usize>> {
        if !own {
            return vec![self.device.add(name, shape, dtype, 1); self.micro_batches];
        }
        (0..self.micro_batches)
            .map(|m| (self.device).add(&micro_batch_name(name, m), shape, dtype, 1))
            .collect()
    }
}

/// The name of micro-batch `m`'s copy of an activation: the first's is the activation's own.
fn micro_batch_name(name: &str, m: usize) -> String {
    match m {
        0 => name.to_string(),
        _ => format!("micro{m}.{name}"),
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
    /// The micro-batches a pass holds at once (`ModelOptions::micro_batches`).
    pub micro_batches: usize,
}

/// Every activation and activation gradient of one micro-batch. The MLP's gradients have no
/// buffers of their own: each overwrites the activation it is the gradient of, which the
/// backward no longer needs by then (`block_backward`).
///
/// A pass that holds several micro-batches (`layer_major`) has one `Activations` for each,
/// which share every buffer that a block writes and reads again within its own work (the
/// shared stashes, the branch, the head's and the gradients' scratch): a micro-batch has
/// tensors of its own only for what lives from one block to the next, its tokens and
/// targets, the stashes kept per layer (the residual stream's among them), its losses and its
/// residual-stream gradient.
pub struct Activations<B: Backend> {
    pub tokens: Tensor<B>,  // [N] i32
    pub targets: Tensor<B>, // [N] i32
    /// `[1]` f32: the scale of the loss's gradient (`LossOptions::grad_scale`), uploaded with
    /// the targets and read on the device, so that a recorded backward takes each step's.
    pub grad_scale: Tensor<B>,
    /// The packed documents' spans (`documents::spans`), where sequences pack documents.
    pub docs: Option<Tensor<B>>, // [2, N] i32
    pub residual: Residuals<B>, // [N, C]: each block's input, then the last output
    pub ln1: Stash<B>,          // [N, C]
    pub rstd1: Stash<B>,        // [N]
    pub qkv: Stash<B>,          // [N, W], after RoPE
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
    micro_batches: Vec<MicroBatchPlan>,
}

/// Where one micro-batch's activations sit among the planned specs (the shared ones at the
/// same place in every micro-batch's), so that the allocated tensors can be handed back in
/// the same order.
struct MicroBatchPlan {
    tokens: Range<usize>,
    targets: Range<usize>,
    grad_scale: Range<usize>,
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
    /// as `offload` says, for each micro-batch a pass holds. With `fp8` matmuls the backward
    /// does not read the norms' and SwiGLU's outputs again, as bf16's weight gradients do
    /// (FP8's read the FP8 copies their forward made): one buffer of each serves every layer.
    /// FP8 does not even write the norms' (their projections normalize as they quantize,
    /// `linear::Input`), so theirs go unused.
    pub fn new(
        s: &ActivationShape, recompute: Recompute, fp8: bool, offload: ActivationOffload,
        dtype: DType, stat_dtype: DType,
    ) -> Self {
        let mut p = Plans {
            device: Plan { specs: vec![] },
            host: Plan { specs: vec![] },
            layers: s.layers,
            micro_batches: s.micro_batches,
        };
        let n = s.tokens;
        let kept = offload.kept;
        let tokens = p.tensor("tokens", &[n], DType::I32, true);
        let targets = p.tensor("targets", &[n], DType::I32, true);
        let grad_scale = p.tensor("grad_scale", &[1], DType::F32, false);
        let docs = (s.documents).then(|| p.tensor("docs", &[2, n], DType::I32, true));
        let residual = p.stash("residual", &[n, s.hidden], dtype, false, offload.residual);
        // Read by the final norm and its backward as soon as it is written.
        let residual_out = p.tensor("residual_out", &[n, s.hidden], dtype, false);
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
        let lnf = p.tensor("lnf", &[n, s.hidden], dtype, false);
        let rstdf = p.tensor("rstdf", &[n], stat_dtype, false);
        let branch = p.tensor("branch", &[n, s.hidden], dtype, false);
        let logits = p.tensor("logits", &[s.head_rows, s.vocab], dtype, false);
        let losses = p.tensor("losses", &[n], stat_dtype, true);
        // Carried from each block's backward to the one below.
        let dresidual = p.tensor("dresidual", &[n, s.hidden], dtype, true);
        let dln = p.tensor("dln", &[n, s.hidden], dtype, false);
        let datt = p.tensor("datt", &[n, s.q_dim], dtype, false);
        let dqkv = p.tensor("dqkv", &[n, s.qkv_dim], dtype, false);
        let micro_batches = (0..s.micro_batches)
            .map(|m| MicroBatchPlan {
                tokens: tokens[m].clone(),
                targets: targets[m].clone(),
                grad_scale: grad_scale[m].clone(),
                docs: docs.as_ref().map(|d| d[m].clone()),
                residual: residual[m].clone(),
                residual_out: residual_out[m].clone(),
                ln1: ln1[m].clone(),
                rstd1: rstd1[m].clone(),
                qkv: qkv[m].clone(),
                qk_norm: (qk_norm.as_ref()).map(|(raw, rstd)| (raw[m].clone(), rstd[m].clone())),
                att: att[m].clone(),
                lse: lse[m].clone(),
                residual_mid: residual_mid[m].clone(),
                ln2: ln2[m].clone(),
                rstd2: rstd2[m].clone(),
                gate_up: gate_up[m].clone(),
                swiglu: swiglu[m].clone(),
                lnf: lnf[m].clone(),
                rstdf: rstdf[m].clone(),
                branch: branch[m].clone(),
                logits: logits[m].clone(),
                losses: losses[m].clone(),
                dresidual: dresidual[m].clone(),
                dln: dln[m].clone(),
                datt: datt[m].clone(),
                dqkv: dqkv[m].clone(),
            })
            .collect();
        ActivationPlan {
            layers: s.layers,
            micro_batches,
            specs: p.device.specs,
            offloaded: p.host.specs,
        }
    }

    /// The per-token losses of a pass (of its first micro-batch).
    pub fn losses(&self) -> &TensorSpec {
        &self.specs[self.micro_batches[0].losses.start]
    }

    /// Each micro-batch's activations, from tensors allocated for `specs` and `offloaded` in
    /// their order.
    pub fn build<B: Backend>(
        &self, t: Vec<Tensor<B>>, offloaded: Vec<Tensor<B>>,
    ) -> Vec<Activations<B>> {
        let stash = |p: &StashPlan| {
            Stash::new(
                t[p.device.clone()].to_vec(),
                offloaded[p.host.clone()].to_vec(),
            )
        };
        let one = |r: &Range<usize>| t[r.start].clone();
        let build = |m: &MicroBatchPlan| Activations {
            tokens: one(&m.tokens),
            targets: one(&m.targets),
            grad_scale: one(&m.grad_scale),
            docs: m.docs.as_ref().map(one),
            residual: Residuals::new(stash(&m.residual), one(&m.residual_out), self.layers),
            ln1: stash(&m.ln1),
            rstd1: stash(&m.rstd1),
            qkv: stash(&m.qkv),
            qk_norm: (m.qk_norm.as_ref()).map(|(raw, rstd)| QkNormStash {
                raw: stash(raw),
                rstd: stash(rstd),
            }),
            att: stash(&m.att),
            lse: stash(&m.lse),
            residual_mid: stash(&m.residual_mid),
            ln2: stash(&m.ln2),
            rstd2: stash(&m.rstd2),
            gate_up: stash(&m.gate_up),
            swiglu: stash(&m.swiglu),
            lnf: one(&m.lnf),
            rstdf: one(&m.rstdf),
            branch: one(&m.branch),
            logits: one(&m.logits),
            losses: one(&m.losses),
            dresidual: one(&m.dresidual),
            dln: one(&m.dln),
            datt: one(&m.datt),
            dqkv: one(&m.dqkv),
        };
        self.micro_batches.iter().map(build).collect()
    }
}
