//! One transformer block, as numbered steps:
//!
//! 1. the input RMSNorm, fused with the previous block's residual add;
//! 2. the QKV projection (+ bias), Qwen3's RMSNorm of each query and key head, then RoPE on
//!    q and k;
//! 3. causal grouped-query attention;
//! 4. the output projection; 5. the residual add fused with the post-attention norm;
//! 6. the gate/up projection; 7. SwiGLU; 8. the down projection (`mlp.rs`).
//!
//! `block_forward` runs them all; `block_recompute`, in the backward, reruns those of the
//! `RecomputePlan` with the same ops on the same inputs, so recomputed values are bitwise
//! those of the forward; `block_decode` runs them for generation over a KV cache; and
//! `block_backward` is the forward read in reverse. A block reaches its weights only through
//! `layer_weights`, its activations through the `Activations` it is given (one micro-batch's,
//! which hide where they live, offloaded or not), and its linear layers through `linears`
//! (which hides FP8).

use anyhow::Result;

use super::activations::Activations;
use super::backward::BlockEvents;
use super::decode::KvCache;
use super::linear::{Input, Linear, NormOutput};
use super::params::LayerParams;
use super::transformer::Transformer;
use crate::backend::{Backend, ResidualAdd};
use crate::tensor::Tensor;

impl<B: Backend> Transformer<B> {
    /// Block `l`'s forward: from its input in the residual stream (or, with `fused_add`, the
    /// previous block's `residual_mid + branch`, which it writes as its input), its MLP output
    /// into `branch`.
    pub(crate) fn block_forward(
        &self, b: &B, a: &Activations<B>, l: usize, fused_add: bool,
    ) -> Result<()> {
        // 1) input norm, fused with the previous block's residual add
        self.input_norm(b, a, l, fused_add)?;
        // 2) QKV projection and RoPE
        self.qkv_projection(b, a, l, a.qkv.layer(l), &self.rope)?;
        // 3) causal attention
        self.attention(b, a, l, a.qkv.layer(l))?;
        // 4) output projection, 5) residual add and post-attention norm
        self.output_projection(b, a, l)?;
        // 6)–8) the MLP
        self.mlp_forward(b, a, l)
    }

    /// The steps of block `l` the backward recomputes before its backward (`RecomputePlan`).
    pub(crate) fn block_recompute(&self, b: &B, a: &Activations<B>, l: usize) -> Result<()> {
        let plan = self.recompute;
        if plan.input_norm {
            self.input_norm(b, a, l, false)?;
        }
        if plan.qkv {
            self.qkv_projection(b, a, l, a.qkv.layer(l), &self.rope)?;
        }
        if plan.attention {
            self.attention(b, a, l, a.qkv.layer(l))?;
        }
        if plan.residual_mid {
            self.output_projection(b, a, l)?;
        } else if plan.post_norm {
            self.post_attention_norm(b, a, l)?;
        }
        self.mlp_recompute(b, a, l)
    }

    /// Block `l` for generation: a prompt's positions go into `cache`'s first rows and attend
    /// among themselves; a token after them goes in at the position the cache holds on the
    /// device, and attends over every row up to its own.
    pub(crate) fn block_decode(
        &self, b: &B, a: &Activations<B>, l: usize, cache: &KvCache<B>,
    ) -> Result<()> {
        self.input_norm(b, a, l, l > 0)?;
        match cache.has_history() {
            true => {
                let qkv = a.qkv.layer(l);
                self.qkv_projection(b, a, l, qkv, cache.rope_row())?;
                cache.append(b, l, qkv)?;
                cache.attend(b, l, a.att.layer(l), self.attn_shape())?;
            }
            false => {
                let (qkv, rope) = cache.prompt_rows(l, self.options.seq);
                self.qkv_projection(b, a, l, &qkv, &rope)?;
                self.attention(b, a, l, &qkv)?;
            }
        }
        self.output_projection(b, a, l)?;
        self.mlp_forward(b, a, l)
    }

    /// Block `l`'s backward, given `dresidual` = ∂loss/∂(block output); leaves
    /// ∂loss/∂(block input) there. Parameter gradients are written, or with `acc` added into.
    pub(crate) fn block_backward(
        &self, b: &B, a: &Activations<B>, l: usize, acc: bool,
    ) -> Result<()> {
        let (w, g) = (self.layer_weights(l), self.layer_grads(l));
        let shape = self.attn_shape();
        let dres = &a.dresidual;
        // 8)–6) the MLP, into `dln`
        self.mlp_backward(b, a, l, acc)?;
        // 5) post-attention norm, into the residual gradient
        let amax = self.linears.grad_amax(l, Linear::Out);
        let (mid, rstd2) = (a.residual_mid.layer(l), a.rstd2.layer(l));
        b.rmsnorm_backward(dres, &g.ln2, &a.dln, mid, &w.ln2, rstd2, acc, amax.as_ref())?;
        // 4) output projection
        let out = (l, Linear::Out, w, g);
        self.linears
            .backward(b, out, &a.datt, dres, a.att.layer(l), acc)?;
        // 3) attention
        let (qkv, att, lse) = (a.qkv.layer(l), a.att.layer(l), a.lse.layer(l));
        b.attention_backward(
            &a.dqkv,
            &a.datt,
            qkv,
            att,
            lse,
            shape,
            self.attention_docs(a),
        )?;
        // 2) RoPE (with the bias gradient where it comes along), the QK-norm where the model
        // has one (Qwen3, which has no bias), and the QKV projection; the last of them reports
        // the projection's output gradient's abs-max
        let amax = self.linears.grad_amax(l, Linear::Qkv);
        match (w.qk_norm(), g.qk_norm(), &a.qk_norm) {
            (Some(weights), Some(dweights), Some(stash)) => {
                let (raw, rstd) = (stash.raw.layer(l), stash.rstd.layer(l));
                b.rope_backward(&a.dqkv, &self.rope, shape, self.rope_docs(a), None, None)?;
                let amax = amax.as_ref();
                b.head_rmsnorm_backward(&a.dqkv, dweights, raw, weights, rstd, shape, acc, amax)?;
            }
            _ => {
                let bias = (Linear::Qkv.bias(g))
                    .filter(|_| self.linears.bias_with_rope(Linear::Qkv))
                    .map(|db| (db, acc));
                let rope_amax = amax.as_ref().filter(|_| bias.is_none());
                let docs = self.rope_docs(a);
                b.rope_backward(&a.dqkv, &self.rope, shape, docs, rope_amax, bias)?;
            }
        }
        let qkv = (l, Linear::Qkv, w, g);
        self.linears
            .backward(b, qkv, &a.dln, &a.dqkv, a.ln1.layer(l), acc)?;
        // 1) input norm, into the residual gradient: the down projection's output gradient
        // in the block below
        let below = l
            .checked_sub(1)
            .and_then(|l| self.linears.grad_amax(l, Linear::Down));
        let (inp, rstd1) = (a.residual.layer(l), a.rstd1.layer(l));
        b.rmsnorm_backward(
            dres,
            &g.ln1,
            &a.dln,
            inp,
            &w.ln1,
            rstd1,
            acc,
            below.as_ref(),
        )
    }

    /// Block `l`'s weights: the one place a block reads them from (their slot, where they
    /// are streamed).
    pub(crate) fn layer_weights(&self, l: usize) -> &LayerParams<Tensor<B>> {
        match &self.streams.weights {
            Some(ring) => ring.slot(l),
            None => &self.params.layers[l],
        }
    }

    /// Before block `l`'s forward: its weights are in, where they stream or are sharded
    /// (`events` bringing them), and the FP8 or INT8 copies of them made where they pass
    /// through a slot.
    pub(crate) fn weights_for_forward(
        &self, b: &B, l: usize, events: &mut BlockEvents<B>,
    ) -> Result<()> {
        self.streams.before_block_forward(b, l)?;
        self.fetch_sharded_weights(l, events)?;
        self.linears.weights_arrived(b, l, self.layer_weights(l))
    }

    /// Before block `l`'s recompute and backward: as `weights_for_forward`, and its gradient
    /// slot ready where the gradients stream.
    pub(crate) fn weights_for_backward(
        &self, b: &B, l: usize, events: &mut BlockEvents<B>,
    ) -> Result<()> {
        self.streams.before_block_backward(b, l)?;
        self.fetch_sharded_weights(l, events)?;
        self.linears.weights_arrived(b, l, self.layer_weights(l))
    }

    /// Block `l`'s weights as this rank holds them, for a caller outside the model
    /// (gathering them for export): its own, or for a block another rank keeps, the slot
    /// that `fetch_sharded_weights` last filled.
    pub fn held_weights(&self, l: usize) -> Vec<&Tensor<B>> {
        match self.keeps_weights(l) {
            true => self.params.layers[l].iter().collect(),
            false => self.layer_weights(l).iter().collect(),
        }
    }

    /// Block `l`'s parameter gradients, where its backward writes them.
    pub(crate) fn layer_grads(&self, l: usize) -> &LayerParams<Tensor<B>> {
        match &self.streams.grads {
            Some(ring) => ring.slot(l),
            None => &self.grads().layers[l],
        }
    }

    /// Step 1: the input norm of block `l`'s residual input, or with `fused_add` first that
    /// input itself, the previous block's `residual_mid + branch`.
    pub(super) fn input_norm(
        &self, b: &B, a: &Activations<B>, l: usize, fused_add: bool,
    ) -> Result<()> {
        let w = self.layer_weights(l);
        let eps = self.config.rms_norm_eps as f32;
        let out = self.linears.norm_output(a.ln1.layer(l));
        let amax = self.linears.input_amax(l, Linear::Qkv);
        let (inp, residual) = match fused_add {
            true => (
                a.residual_mid.layer(l - 1),
                Some(ResidualAdd {
                    out: a.residual.layer(l),
                    branch: &a.branch,
                }),
            ),
            false => (a.residual.layer(l), None),
        };
        let rstd = a.rstd1.layer(l);
        b.rmsnorm_forward(out, rstd, inp, residual, &w.ln1, eps, amax.as_ref())
    }

    /// Step 2: the QKV projection of the input norm's output into `qkv`, through the QK-norm
    /// where the model has one (Qwen3: the projection into `qk_norm.raw`, then each query and
    /// key head normalized into `qkv`), then RoPE on its q and k heads by the table `rope`.
    fn qkv_projection(
        &self, b: &B, a: &Activations<B>, l: usize, qkv: &Tensor<B>, rope: &Tensor<B>,
    ) -> Result<()> {
        let w = self.layer_weights(l);
        let x = Input::Norm(NormOutput {
            stored: a.ln1.layer(l).clone(),
            x: a.residual.layer(l).clone(),
            rstd: a.rstd1.layer(l).clone(),
            weight: &w.ln1,
        });
        let qkv_linear = (l, Linear::Qkv, w);
        match (w.qk_norm(), &a.qk_norm) {
            (Some(weights), Some(stash)) => {
                let (raw, rstd) = (stash.raw.layer(l), stash.rstd.layer(l));
                let eps = self.config.rms_norm_eps as f32;
                self.linears.forward(b, qkv_linear, raw, x)?;
                b.head_rmsnorm_forward(qkv, rstd, raw, weights, self.attn_shape(), eps)?;
            }
            _ => self.linears.forward(b, qkv_linear, qkv, x)?,
        }
        b.rope_forward(qkv, rope, self.attn_shape(), self.rope_docs(a))
    }

    /// The documents' spans where attention keeps them apart (`--doc-mask`).
    fn attention_docs<'a>(&self, a: &'a Activations<B>) -> Option<&'a Tensor<B>> {
        let masked = self.options.documents.is_some_and(|d| d.mask);
        a.docs.as_ref().filter(|_| masked)
    }

    /// The documents' spans where RoPE counts positions from each (`--doc-positions`).
    fn rope_docs<'a>(&self, a: &'a Activations<B>) -> Option<&'a Tensor<B>> {
        let restarted = self.options.documents.is_some_and(|d| d.positions);
        a.docs.as_ref().filter(|_| restarted)
    }

    /// Step 3: causal attention over the rows `qkv`, into block `l`'s attention output and
    /// log-sum-exp, reporting the output's abs-max where FP8 quantizes it next.
    fn attention(&self, b: &B, a: &Activations<B>, l: usize, qkv: &Tensor<B>) -> Result<()> {
        let amax = self.linears.input_amax(l, Linear::Out);
        let (att, lse) = (a.att.layer(l), a.lse.layer(l));
        let docs = self.attention_docs(a);
        b.attention_forward(att, lse, qkv, self.attn_shape(), docs, amax.as_ref())
    }

    /// Steps 4 and 5: the output projection into `branch`, then the residual add (into
    /// `residual_mid`) fused with the post-attention norm.
    fn output_projection(&self, b: &B, a: &Activations<B>, l: usize) -> Result<()> {
        let w = self.layer_weights(l);
        let x = Input::Tensor(a.att.layer(l));
        self.linears.forward(b, (l, Linear::Out, w), &a.branch, x)?;
        let residual = ResidualAdd {
            out: a.residual_mid.layer(l),
            branch: &a.branch,
        };
        self.post_norm_of(b, a, l, a.residual.layer(l), Some(residual))
    }

    /// Step 5 alone: the post-attention norm of `residual_mid`.
    fn post_attention_norm(&self, b: &B, a: &Activations<B>, l: usize) -> Result<()> {
        self.post_norm_of(b, a, l, a.residual_mid.layer(l), None)
    }

    fn post_norm_of(
        &self, b: &B, a: &Activations<B>, l: usize, inp: &Tensor<B>,
        residual: Option<ResidualAdd<'_, B>>,
    ) -> Result<()> {
        let w = self.layer_weights(l);
        let eps = self.config.rms_norm_eps as f32;
        let out = self.linears.norm_output(a.ln2.layer(l));
        let amax = self.linears.input_amax(l, Linear::GateUp);
        let rstd = a.rstd2.layer(l);
        b.rmsnorm_forward(out, rstd, inp, residual, &w.ln2, eps, amax.as_ref())
    }
}
