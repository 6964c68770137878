//! What the backward recomputes instead of keeping: the user's choice (`Recompute`, llm.q's
//! `--recompute-*` set), and the steps of a block it reruns (`RecomputePlan`), decided once.
//!
//! An activation that is recomputed lives in one buffer shared by every layer
//! (`ActivationPlan`), and the backward's recompute pass (`block_recompute`) reruns the steps
//! that write it, with the same ops on the same inputs, so recomputed values are bitwise those
//! of the forward.

/// Activations to recompute in the backward instead of keeping them per layer.
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

/// The steps of a block that the backward's recompute pass reruns before the block's
/// backward: exactly those whose outputs the backward reads from a shared buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RecomputePlan {
    /// Step 1, the input norm's output (stored for matmuls in the model's dtype only).
    pub input_norm: bool,
    /// Step 2, the QKV projection and RoPE.
    pub qkv: bool,
    /// Step 3, attention and its log-sum-exp.
    pub attention: bool,
    /// Steps 4 and 5: the output projection, the residual add and the post-attention norm.
    pub residual_mid: bool,
    /// Step 5 alone, the post-attention norm's output.
    pub post_norm: bool,
    /// Step 6, the gate/up projection over every token (a chunked MLP remakes each chunk in
    /// its backward instead).
    pub gate_up: bool,
    /// Step 7, SwiGLU's output, where the backward reads it.
    pub swiglu: bool,
}

impl RecomputePlan {
    /// The plan for `recompute`, where the norms' and SwiGLU's outputs are read again by the
    /// backward only with `native` matmuls (FP8's weight gradients read the quantized copies
    /// their forward made), and where a `chunked_mlp` remakes its intermediates itself.
    pub fn new(recompute: Recompute, native: bool, chunked_mlp: bool) -> Self {
        let norms = recompute.norms() && native;
        RecomputePlan {
            input_norm: norms,
            qkv: recompute.qkv(),
            attention: recompute.attention(),
            residual_mid: recompute.residual_mid(),
            post_norm: norms && !recompute.residual_mid(),
            gate_up: recompute.gate_up() && !chunked_mlp,
            swiglu: recompute.swiglu_out() && native && !chunked_mlp,
        }
    }
}
