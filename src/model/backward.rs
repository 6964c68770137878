//! The backward pass: the forward read in reverse.
//!
//! Gradient rule: parameter gradients are written by the first micro-step and added into by
//! later ones (`accumulate`); the residual-stream gradient `dresidual` is added into by each
//! branch; every other activation gradient is overwritten.

use anyhow::{Result, ensure};

use super::forward::Pass;
use super::fp8::Linear;
use super::head::LossOptions;
use super::transformer::{Gradients, Transformer};
use crate::backend::{Backend, Range};
use crate::tensor::Tensor;

/// What the backward tells of parameter gradients, so that they can be summed over the ranks
/// while the rest of the backward runs.
pub enum GradEvent<'a, B: Backend> {
    /// Block `layer`'s backward is about to write `grads`, which under ZeRO-2 may be a slot
    /// whose previous block is still being sent.
    Writing {
        layer: usize,
        grads: &'a [&'a Tensor<B>],
    },
    /// `grads` hold their final value for the micro-batch: block `Some(l)`'s, or (`None`)
    /// the final norm's and an untied head's first, then, after every block's from the
    /// last, the embedding's.
    Done {
        layer: Option<usize>,
        grads: &'a [&'a Tensor<B>],
    },
}

pub type GradEvents<'a, B> = dyn FnMut(GradEvent<'_, B>) -> Result<()> + 'a;

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
        self.backward(b, targets, loss, &mut |_| Ok(()))
    }

    /// The second half of `forward_backward`, after `forward_hidden`: the LM head and its
    /// loss, then every block's backward, telling `events` of the parameter gradients.
    pub fn backward(
        &mut self,
        b: &B,
        targets: &[i32],
        loss: LossOptions,
        events: &mut GradEvents<B>,
    ) -> Result<()> {
        ensure!(
            self.options.gradients != Gradients::Absent,
            "this model was made forward-only (Gradients::Absent) and has no gradients"
        );
        let _backward = Range::begin(b, format_args!("backward"));
        {
            let _head = Range::begin(b, format_args!("LM head and loss"));
            self.head(b, targets, loss.z_loss, Some(loss))?;
        }
        if let Some(fp8) = &self.fp8 {
            fp8.begin_backward(b)?;
        }
        let (a, p, g, acc) = (&self.acts, &self.params, self.grads(), loss.accumulate);
        let last = self.config.num_layers;
        b.fill(&a.dresidual, 0.0)?;
        b.rmsnorm_backward(
            &a.dresidual,
            &g.final_norm,
            &a.dln,
            a.residual.layer(last),
            &p.final_norm,
            &a.rstdf,
            acc,
            self.grad_amax(last - 1, Linear::Down).as_ref(),
        )?;
        events(GradEvent::Done {
            layer: None,
            grads: &[&g.final_norm]
                .into_iter()
                .chain(&g.lm_head)
                .collect::<Vec<_>>(),
        })?;
        for l in (0..last).rev() {
            let _layer = Range::begin(b, format_args!("layer {l} backward"));
            self.acts.before_block_backward(b, l)?;
            self.block_forward(b, l, Pass::Recompute, None)?;
            let grads: Vec<&Tensor<B>> = self.grads().layers[l].iter().collect();
            events(GradEvent::Writing {
                layer: l,
                grads: &grads,
            })?;
            // A shared slot starts afresh in every micro-batch: its last block was sent.
            self.block_backward(b, l, acc && self.keeps_grads(l))?;
            events(GradEvent::Done {
                layer: Some(l),
                grads: &grads,
            })?;
        }
        let (a, g) = (&self.acts, self.grads());
        // With tied embeddings the head has already written this gradient.
        let tied = self.params.lm_head.is_none();
        b.embedding_backward(&g.embed, &a.tokens, &a.dresidual, acc || tied)?;
        events(GradEvent::Done {
            layer: None,
            grads: &[&g.embed],
        })
    }

    /// Block `l`, given `dresidual` = ∂loss/∂(block output); leaves ∂loss/∂(block input) there.
    fn block_backward(&self, b: &B, l: usize, acc: bool) -> Result<()> {
        let (a, w, g) = (&self.acts, &self.params.layers[l], &self.grads().layers[l]);
        let shape = self.attn_shape();
        let dres = &a.dresidual;
        // 8)–6) the MLP, into `dln`
        self.mlp_backward(b, l, acc)?;
        // 5) post-attention norm, into the residual gradient
        b.rmsnorm_backward(
            dres,
            &g.ln2,
            &a.dln,
            a.residual_mid.layer(l),
            &w.ln2,
            a.rstd2.layer(l),
            acc,
            self.grad_amax(l, Linear::Out).as_ref(),
        )?;
        // 4) output projection
        self.linear_backward(b, (l, Linear::Out), &a.datt, dres, a.att.layer(l), acc)?;
        // 3) attention, 2) RoPE and the QKV projection
        b.attention_backward(
            &a.dqkv,
            &a.datt,
            a.qkv.layer(l),
            a.att.layer(l),
            a.lse.layer(l),
            shape,
        )?;
        let bias = Linear::Qkv
            .bias(g)
            .filter(|_| self.bias_with_rope(Linear::Qkv));
        match bias {
            Some(db) => b.rope_backward(&a.dqkv, &self.rope, shape, None, Some((db, acc)))?,
            None => {
                let amax = self.grad_amax(l, Linear::Qkv);
                b.rope_backward(&a.dqkv, &self.rope, shape, amax.as_ref(), None)?;
            }
        }
        self.linear_backward(b, (l, Linear::Qkv), &a.dln, &a.dqkv, a.ln1.layer(l), acc)?;
        // 1) input norm, into the residual gradient: the down projection's output gradient
        // in the block below
        let below = l
            .checked_sub(1)
            .and_then(|l| self.grad_amax(l, Linear::Down));
        b.rmsnorm_backward(
            dres,
            &g.ln1,
            &a.dln,
            a.residual.layer(l),
            &w.ln1,
            a.rstd1.layer(l),
            acc,
            below.as_ref(),
        )
    }
}
