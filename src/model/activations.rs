//! Activation memory, planned once for a (batch, seq) shape.
//!
//! An activation the backward needs is either kept per layer, or, when the recompute
//! options say so, held in one buffer that all layers share and recomputed in the backward
//! from what was kept. Which is which is decided here, in one place.

use std::ops::Range;

use super::residuals::Residuals;
use crate::backend::Backend;
use crate::tensor::{DType, Tensor, TensorSpec};

/// Activations to recompute in the backward instead of keeping them per layer
/// (llm.q's `--recompute-*` set).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Recompute {
    /// The SwiGLU output.
    pub swiglu: bool,
    /// Both RMSNorm outputs of a block.
    pub norm: bool,
    /// The QKV projection and its RoPE.
    pub qkv: bool,
    /// The attention output and its log-sum-exp.
    pub att: bool,
    /// The gate/up projection and SwiGLU.
    pub ffn: bool,
    /// Everything but each block's input residual.
    pub block: bool,
}

impl Recompute {
    pub fn all() -> Self {
        Recompute {
            swiglu: true,
            norm: true,
            qkv: true,
            att: true,
            ffn: true,
            block: true,
        }
    }

    /// Each option alone, under its flag's name less `--recompute-`, then all of them: the
    /// variants the recompute tests hold against no recompute.
    pub fn variants() -> Vec<(&'static str, Self)> {
        let none = Self::default();
        vec![
            (
                "swiglu",
                Self {
                    swiglu: true,
                    ..none
                },
            ),
            ("norm", Self { norm: true, ..none }),
            ("qkv", Self { qkv: true, ..none }),
            ("att", Self { att: true, ..none }),
            ("ffn", Self { ffn: true, ..none }),
            (
                "block",
                Self {
                    block: true,
                    ..none
                },
            ),
            ("all", Self::all()),
        ]
    }

    pub(crate) fn norms(&self) -> bool {
        self.norm || self.block
    }
    pub(crate) fn qkv(&self) -> bool {
        self.qkv || self.block
    }
    pub(crate) fn attention(&self) -> bool {
        self.att || self.block
    }
    pub(crate) fn residual_mid(&self) -> bool {
        self.block
    }
    pub(crate) fn gate_up(&self) -> bool {
        self.ffn || self.block
    }
    pub(crate) fn swiglu_out(&self) -> bool {
        self.swiglu || self.ffn || self.block
    }
}

/// One activation for every layer, or one buffer shared by all layers when recomputed.
pub struct Stash<B: Backend> {
    tensors: Vec<Tensor<B>>,
}

impl<B: Backend> Stash<B> {
    pub fn layer(&self, l: usize) -> &Tensor<B> {
        &self.tensors[l.min(self.tensors.len() - 1)]
    }
}

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
}

/// Every activation and activation gradient of one micro-batch. The MLP's gradients have no
/// buffers of their own: each overwrites the activation it is the gradient of, which the
/// backward no longer needs by then (`block_backward`).
pub struct Activations<B: Backend> {
    pub tokens: Tensor<B>,      // [N] i32
    pub targets: Tensor<B>,     // [N] i32
    pub residual: Residuals<B>, // [N, C]: each block's input, then the last output
    pub ln1: Stash<B>,          // [N, C]
    pub rstd1: Stash<B>,        // [N]
    pub qkv: Stash<B>,          // [N, W], after RoPE
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

/// Where each activation's tensors sit among the planned specs, so that the allocated
/// tensors can be handed back in the same order.
pub struct ActivationPlan {
    pub specs: Vec<TensorSpec>,
    /// The residual stream's copies in host memory, when it is offloaded.
    pub offloaded: Vec<TensorSpec>,
    tokens: Range<usize>,
    targets: Range<usize>,
    residual: Range<usize>,
    ln1: Range<usize>,
    rstd1: Range<usize>,
    qkv: Range<usize>,
    att: Range<usize>,
    lse: Range<usize>,
    residual_mid: Range<usize>,
    ln2: Range<usize>,
    rstd2: Range<usize>,
    gate_up: Range<usize>,
    swiglu: Range<usize>,
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

impl ActivationPlan {
    /// The specs of every buffer, kept per layer or shared as `recompute` says; with
    /// `offload_residual`, the residual stream in host memory and two slots of it (and the
    /// output) on the device.
    pub fn new(
        s: &ActivationShape,
        recompute: Recompute,
        offload_residual: bool,
        dtype: DType,
        stat_dtype: DType,
    ) -> Self {
        let mut p = Plan { specs: vec![] };
        let (n, l) = (s.tokens, s.layers);
        let copies = |recomputed: bool| if recomputed { 1 } else { l };
        let mut host = Plan { specs: vec![] };
        let on_device = match offload_residual {
            true => {
                host.add("residual", &[n, s.hidden], dtype, l);
                3
            }
            false => l + 1,
        };
        ActivationPlan {
            offloaded: host.specs,
            tokens: p.add("tokens", &[n], DType::I32, 1),
            targets: p.add("targets", &[n], DType::I32, 1),
            residual: p.add("residual", &[n, s.hidden], dtype, on_device),
            ln1: p.add("ln1", &[n, s.hidden], dtype, copies(recompute.norms())),
            rstd1: p.add("rstd1", &[n], stat_dtype, l),
            qkv: p.add("qkv", &[n, s.qkv_dim], dtype, copies(recompute.qkv())),
            att: p.add("att", &[n, s.q_dim], dtype, copies(recompute.attention())),
            lse: p.add(
                "lse",
                &[s.batch, s.heads, s.seq],
                stat_dtype,
                copies(recompute.attention()),
            ),
            residual_mid: p.add(
                "residual_mid",
                &[n, s.hidden],
                dtype,
                copies(recompute.residual_mid()),
            ),
            ln2: p.add("ln2", &[n, s.hidden], dtype, copies(recompute.norms())),
            rstd2: p.add("rstd2", &[n], stat_dtype, l),
            gate_up: p.add(
                "gate_up",
                &[s.ffn_rows, 2 * s.intermediate],
                dtype,
                copies(recompute.gate_up()),
            ),
            swiglu: p.add(
                "swiglu",
                &[s.ffn_rows, s.intermediate],
                dtype,
                copies(recompute.swiglu_out()),
            ),
            lnf: p.add("lnf", &[n, s.hidden], dtype, 1),
            rstdf: p.add("rstdf", &[n], stat_dtype, 1),
            branch: p.add("branch", &[n, s.hidden], dtype, 1),
            logits: p.add("logits", &[s.head_rows, s.vocab], dtype, 1),
            losses: p.add("losses", &[n], stat_dtype, 1),
            dresidual: p.add("dresidual", &[n, s.hidden], dtype, 1),
            dln: p.add("dln", &[n, s.hidden], dtype, 1),
            datt: p.add("datt", &[n, s.q_dim], dtype, 1),
            dqkv: p.add("dqkv", &[n, s.qkv_dim], dtype, 1),
            specs: p.specs,
        }
    }

    /// The per-token losses of a pass.
    pub fn losses(&self) -> &TensorSpec {
        &self.specs[self.losses.start]
    }

    /// The activations, from tensors allocated for `specs` and `offloaded` in their order.
    pub fn build<B: Backend>(
        &self,
        t: Vec<Tensor<B>>,
        offloaded: Vec<Tensor<B>>,
    ) -> Activations<B> {
        let many = |r: &Range<usize>| t[r.clone()].to_vec();
        let stash = |r: &Range<usize>| Stash {
            tensors: t[r.clone()].to_vec(),
        };
        let one = |r: &Range<usize>| t[r.start].clone();
        Activations {
            tokens: one(&self.tokens),
            targets: one(&self.targets),
            residual: Residuals::new(many(&self.residual), offloaded),
            ln1: stash(&self.ln1),
            rstd1: stash(&self.rstd1),
            qkv: stash(&self.qkv),
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
