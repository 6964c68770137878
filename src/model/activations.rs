//! Activation memory, planned once for a (batch, seq) shape.
//!
//! An activation the backward needs is either kept per layer, or, when the recompute
//! options say so, held in one buffer that all layers share and recomputed in the backward
//! from what was kept. Which is which is decided here, in one place.

use std::ops::Range;

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
}

/// Every activation and activation gradient of one micro-batch.
pub struct Activations<B: Backend> {
    pub tokens: Tensor<B>,        // [N] i32
    pub targets: Tensor<B>,       // [N] i32
    pub residual: Vec<Tensor<B>>, // L+1 × [N, C]: each block's input, then the last output
    pub ln1: Stash<B>,            // [N, C]
    pub rstd1: Stash<B>,          // [N]
    pub qkv: Stash<B>,            // [N, W], after RoPE
    pub att: Stash<B>,            // [N, Q]
    pub lse: Stash<B>,            // [B, H, T]
    pub residual_mid: Stash<B>,   // [N, C]: residual after attention
    pub ln2: Stash<B>,            // [N, C]
    pub rstd2: Stash<B>,          // [N]
    pub gate_up: Stash<B>,        // [N, 2F]
    pub swiglu: Stash<B>,         // [N, F]
    pub lnf: Tensor<B>,           // [N, C]
    pub rstdf: Tensor<B>,         // [N]
    /// A block's branch output (attention projection, then MLP), added to the residual next.
    pub branch: Tensor<B>, // [N, C]
    pub logits: Tensor<B>,        // [head_rows, V]: one LM-head chunk, then its gradient
    pub losses: Tensor<B>,        // [N]
    pub dresidual: Tensor<B>,     // [N, C]
    pub dln: Tensor<B>,           // [N, C]: gradient of a norm's output
    pub datt: Tensor<B>,          // [N, Q]
    pub dqkv: Tensor<B>,          // [N, W]
    pub dgate_up: Tensor<B>,      // [N, 2F]
    pub dswiglu: Tensor<B>,       // [N, F]
}

impl<B: Backend> Activations<B> {
    /// The specs of every buffer, then a constructor that takes them back once allocated.
    pub fn plan(
        s: &ActivationShape,
        recompute: Recompute,
        dtype: DType,
        stat_dtype: DType,
    ) -> (
        Vec<TensorSpec>,
        impl FnOnce(Vec<Tensor<B>>) -> Activations<B>,
    ) {
        let mut p = Plan { specs: vec![] };
        let (n, l) = (s.tokens, s.layers);
        let copies = |recomputed: bool| if recomputed { 1 } else { l };
        let tokens = p.add("tokens", &[n], DType::I32, 1);
        let targets = p.add("targets", &[n], DType::I32, 1);
        let residual = p.add("residual", &[n, s.hidden], dtype, l + 1);
        let ln1 = p.add("ln1", &[n, s.hidden], dtype, copies(recompute.norms()));
        let rstd1 = p.add("rstd1", &[n], stat_dtype, l);
        let qkv = p.add("qkv", &[n, s.qkv_dim], dtype, copies(recompute.qkv()));
        let att = p.add("att", &[n, s.q_dim], dtype, copies(recompute.attention()));
        let lse = p.add(
            "lse",
            &[s.batch, s.heads, s.seq],
            stat_dtype,
            copies(recompute.attention()),
        );
        let residual_mid = p.add(
            "residual_mid",
            &[n, s.hidden],
            dtype,
            copies(recompute.residual_mid()),
        );
        let ln2 = p.add("ln2", &[n, s.hidden], dtype, copies(recompute.norms()));
        let rstd2 = p.add("rstd2", &[n], stat_dtype, l);
        let gate_up = p.add(
            "gate_up",
            &[n, 2 * s.intermediate],
            dtype,
            copies(recompute.gate_up()),
        );
        let swiglu = p.add(
            "swiglu",
            &[n, s.intermediate],
            dtype,
            copies(recompute.swiglu_out()),
        );
        let lnf = p.add("lnf", &[n, s.hidden], dtype, 1);
        let rstdf = p.add("rstdf", &[n], stat_dtype, 1);
        let branch = p.add("branch", &[n, s.hidden], dtype, 1);
        let logits = p.add("logits", &[s.head_rows, s.vocab], dtype, 1);
        let losses = p.add("losses", &[n], stat_dtype, 1);
        let dresidual = p.add("dresidual", &[n, s.hidden], dtype, 1);
        let dln = p.add("dln", &[n, s.hidden], dtype, 1);
        let datt = p.add("datt", &[n, s.q_dim], dtype, 1);
        let dqkv = p.add("dqkv", &[n, s.qkv_dim], dtype, 1);
        let dgate_up = p.add("dgate_up", &[n, 2 * s.intermediate], dtype, 1);
        let dswiglu = p.add("dswiglu", &[n, s.intermediate], dtype, 1);

        let build = move |t: Vec<Tensor<B>>| {
            let many = |r: Range<usize>| t[r].to_vec();
            let stash = |r: Range<usize>| Stash {
                tensors: t[r].to_vec(),
            };
            let one = |r: Range<usize>| t[r.start].clone();
            Activations {
                tokens: one(tokens),
                targets: one(targets),
                residual: many(residual),
                ln1: stash(ln1),
                rstd1: stash(rstd1),
                qkv: stash(qkv),
                att: stash(att),
                lse: stash(lse),
                residual_mid: stash(residual_mid),
                ln2: stash(ln2),
                rstd2: stash(rstd2),
                gate_up: stash(gate_up),
                swiglu: stash(swiglu),
                lnf: one(lnf),
                rstdf: one(rstdf),
                branch: one(branch),
                logits: one(logits),
                losses: one(losses),
                dresidual: one(dresidual),
                dln: one(dln),
                datt: one(datt),
                dqkv: one(dqkv),
                dgate_up: one(dgate_up),
                dswiglu: one(dswiglu),
            }
        };
        (p.specs, build)
    }
}
