//! The backward pass: the forward read in reverse.
//!
//! Gradient rule: parameter gradients are written by the first micro-step and added into by
//! later ones (`accumulate`); the residual-stream gradient `dresidual` is added into by each
//! branch; every other activation gradient is overwritten.

use anyhow::Result;

use super::forward::Pass;
use super::head::LossOptions;
use super::transformer::Transformer;
use crate::backend::{Backend, Matmul};

impl<B: Backend> Transformer<B> {
    /// Forward and backward of one micro-batch. `tokens` and `targets` are `[B·T]`; the
    /// per-token losses stay on the device (see `loss_sum`).
    pub fn forward_backward(
        &mut self,
        b: &B,
        tokens: &[i32],
        targets: &[i32],
        loss: LossOptions,
    ) -> Result<()> {
        self.forward_hidden(b, tokens)?;
        self.backward(b, targets, loss)
    }

    /// The second half of `forward_backward`, after `forward_hidden`: the LM head and its
    /// loss, then every block's backward. Apart for benchmarks that time the two.
    pub fn backward(&mut self, b: &B, targets: &[i32], loss: LossOptions) -> Result<()> {
        self.head(b, targets, loss.z_loss, Some(loss))?;
        let (a, p, g, acc) = (&self.acts, &self.params, &self.grads, loss.accumulate);
        let last = self.config.num_layers;
        b.fill(&a.dresidual, 0.0)?;
        b.rmsnorm_backward(
            &a.dresidual,
            &g.final_norm,
            &a.dln,
            &a.residual[last],
            &p.final_norm,
            &a.rstdf,
            acc,
        )?;
        for l in (0..last).rev() {
            self.block_forward(b, l, Pass::Recompute)?;
            self.block_backward(b, l, acc)?;
        }
        let (a, g) = (&self.acts, &self.grads);
        // With tied embeddings the head has already written this gradient.
        let tied = self.params.lm_head.is_none();
        b.embedding_backward(&g.embed, &a.tokens, &a.dresidual, acc || tied)
    }

    /// Block `l`, given `dresidual` = ∂loss/∂(block output); leaves ∂loss/∂(block input) there.
    fn block_backward(&self, b: &B, l: usize, acc: bool) -> Result<()> {
        let (a, w, g) = (&self.acts, &self.params.layers[l], &self.grads.layers[l]);
        let shape = self.attn_shape();
        let dres = &a.dresidual;
        // 8) down projection
        b.matmul(&a.dswiglu, dres, &w.down, None, Matmul::BACKWARD_INPUT)?;
        b.matmul(
            &g.down,
            dres,
            a.swiglu.layer(l),
            None,
            Matmul::backward_weight(acc),
        )?;
        // 7) SwiGLU
        b.swiglu_backward(&a.dgate_up, &a.dswiglu, a.gate_up.layer(l))?;
        // 6) gate/up projection
        b.matmul(
            &a.dln,
            &a.dgate_up,
            &w.gate_up,
            None,
            Matmul::BACKWARD_INPUT,
        )?;
        b.matmul(
            &g.gate_up,
            &a.dgate_up,
            a.ln2.layer(l),
            None,
            Matmul::backward_weight(acc),
        )?;
        // 5) post-attention norm, into the residual gradient
        b.rmsnorm_backward(
            dres,
            &g.ln2,
            &a.dln,
            a.residual_mid.layer(l),
            &w.ln2,
            a.rstd2.layer(l),
            acc,
        )?;
        // 4) output projection
        b.matmul(&a.datt, dres, &w.o, None, Matmul::BACKWARD_INPUT)?;
        b.matmul(
            &g.o,
            dres,
            a.att.layer(l),
            None,
            Matmul::backward_weight(acc),
        )?;
        // 3) attention, 2) RoPE and the QKV projection
        b.attention_backward(
            &a.dqkv,
            &a.datt,
            a.qkv.layer(l),
            a.att.layer(l),
            a.lse.layer(l),
            shape,
        )?;
        b.rope_backward(&a.dqkv, &self.rope, shape)?;
        if let Some(dbias) = &g.qkv_bias {
            b.bias_backward(dbias, &a.dqkv, acc)?;
        }
        b.matmul(&a.dln, &a.dqkv, &w.qkv, None, Matmul::BACKWARD_INPUT)?;
        b.matmul(
            &g.qkv,
            &a.dqkv,
            a.ln1.layer(l),
            None,
            Matmul::backward_weight(acc),
        )?;
        // 1) input norm, into the residual gradient
        b.rmsnorm_backward(
            dres,
            &g.ln1,
            &a.dln,
            &a.residual[l],
            &w.ln1,
            a.rstd1.layer(l),
            acc,
        )
    }
}
