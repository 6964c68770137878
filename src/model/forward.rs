//! The forward pass, and the recomputation of activations that were not kept.
//!
//! A block is a numbered list of steps. The forward runs them all; the recompute pass in the
//! backward reruns exactly those whose outputs live in shared buffers, with the same ops on
//! the same inputs, so recomputed values are bitwise those of the forward.

use anyhow::Result;

use super::decode::KvCache;
use super::fp8::Linear;
use super::linear::Input;
use super::linear::Normalized;
use super::transformer::Transformer;
use crate::backend::{Backend, Range, ResidualAdd};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward,
    Recompute,
}

impl<B: Backend> Transformer<B> {
    /// Embeds `tokens` (`[B·T]`) and runs every block and the final norm, leaving the
    /// normalized hidden states in `lnf` for the LM head.
    pub fn forward_hidden(&mut self, b: &B, tokens: &[i32]) -> Result<()> {
        self.forward_blocks(b, tokens, None)
    }

    /// `forward_hidden`, the blocks' QKV rows going into `cache` when one is given.
    pub(crate) fn forward_blocks(
        &mut self,
        b: &B,
        tokens: &[i32],
        cache: Option<&KvCache<B>>,
    ) -> Result<()> {
        let _forward = Range::begin(b, format_args!("forward"));
        let (a, p) = (&self.acts, &self.params);
        if let Some(fp8) = &self.fp8 {
            fp8.begin_forward(b, p)?;
        }
        b.upload_i32(&a.tokens, tokens)?;
        a.residual.before_write(b, 0)?;
        b.embedding_forward(a.residual.layer(0), &a.tokens, &p.embed)?;
        a.residual.written(b, 0)?;
        for l in 0..self.config.num_layers {
            let _layer = Range::begin(b, format_args!("layer {l} forward"));
            self.block_forward(b, l, Pass::Forward, cache)?;
        }
        // The last block's residual sum is fused into the final norm (a config has at least
        // one layer).
        let (a, p, last) = (&self.acts, &self.params, self.config.num_layers);
        b.rmsnorm_forward(
            Some(&a.lnf),
            &a.rstdf,
            a.residual_mid.layer(last - 1),
            Some(ResidualAdd {
                out: a.residual.layer(last),
                branch: &a.branch,
            }),
            &p.final_norm,
            self.config.rms_norm_eps as f32,
            None,
        )
    }

    /// Block `l`. In the forward it reads its input (or, fused, the previous block's
    /// `residual_mid + branch`, which it writes as its input) and leaves its MLP output in
    /// `branch`; when generating, its QKV rows go into `cache`.
    pub(crate) fn block_forward(
        &self,
        b: &B,
        l: usize,
        pass: Pass,
        cache: Option<&KvCache<B>>,
    ) -> Result<()> {
        let (a, w, rc) = (&self.acts, &self.params.layers[l], self.options.recompute);
        let eps = self.config.rms_norm_eps as f32;
        let shape = self.attn_shape();
        let run = |recomputed: bool| pass == Pass::Forward || recomputed;
        // bf16's backward reads the norms' outputs again; FP8 never stores them.
        let stored = self.fp8.is_none();
        let amax = |lin| self.input_amax(l, lin);
        let (amax_qkv, amax_out, amax_gate_up) =
            (amax(Linear::Qkv), amax(Linear::Out), amax(Linear::GateUp));
        let (ln1, qkv, att, lse) = (
            a.ln1.layer(l),
            a.qkv.layer(l),
            a.att.layer(l),
            a.lse.layer(l),
        );
        let (mid, ln2) = (a.residual_mid.layer(l), a.ln2.layer(l));

        if pass == Pass::Forward {
            a.before_block_forward(b, l)?;
        }
        // 1) input norm, fused with the previous block's residual add in the forward
        if pass == Pass::Forward && l > 0 {
            let prev_mid = a.residual_mid.layer(l - 1);
            a.residual.before_write(b, l)?;
            b.rmsnorm_forward(
                self.norm_out(ln1),
                a.rstd1.layer(l),
                prev_mid,
                Some(ResidualAdd {
                    out: a.residual.layer(l),
                    branch: &a.branch,
                }),
                &w.ln1,
                eps,
                amax_qkv.as_ref(),
            )?;
            a.residual.written(b, l)?;
        } else if run(rc.norms() && stored) {
            let (out, inp, rstd) = (self.norm_out(ln1), a.residual.layer(l), a.rstd1.layer(l));
            b.rmsnorm_forward(out, rstd, inp, None, &w.ln1, eps, amax_qkv.as_ref())?;
        }
        // 2) QKV projection (+ bias), then RoPE on q and k; when generating, into the KV
        // cache's next rows, rotated to their positions
        let (qkv, rope) = match cache {
            Some(cache) => cache.next_rows(l, shape.seq),
            None => (qkv.clone(), self.rope.clone()),
        };
        if run(rc.qkv()) {
            let bias = w.qkv_bias.as_ref();
            let x = Input::Norm {
                stored: ln1,
                normalized: Normalized {
                    x: a.residual.layer(l),
                    rstd: a.rstd1.layer(l),
                    weight: &w.ln1,
                },
            };
            self.linear_forward(b, (l, Linear::Qkv), &qkv, x, bias)?;
            b.rope_forward(&qkv, &rope, shape)?;
        }
        // 3) causal attention; when generating a token after the first, the new position's
        // over the cache
        if run(rc.attention()) {
            match cache.filter(|c| c.has_history()) {
                Some(cache) => cache.attend(b, l, att, shape)?,
                None => b.attention_forward(att, lse, &qkv, shape, amax_out.as_ref())?,
            }
        }
        // 4) output projection, 5) residual add and post-attention norm
        if run(rc.residual_mid()) {
            self.linear_forward(b, (l, Linear::Out), &a.branch, Input::Tensor(att), None)?;
            b.rmsnorm_forward(
                self.norm_out(ln2),
                a.rstd2.layer(l),
                a.residual.layer(l),
                Some(ResidualAdd {
                    out: mid,
                    branch: &a.branch,
                }),
                &w.ln2,
                eps,
                amax_gate_up.as_ref(),
            )?;
        } else if run(rc.norms() && stored) {
            let (out, rstd) = (self.norm_out(ln2), a.rstd2.layer(l));
            b.rmsnorm_forward(out, rstd, mid, None, &w.ln2, eps, amax_gate_up.as_ref())?;
        }
        // 6)–8) the MLP
        self.mlp_forward(b, l, pass)?;
        match pass {
            Pass::Forward => a.block_forward_done(b, l),
            Pass::Recompute => Ok(()),
        }
    }
}
