//! A block's MLP (steps 6–8: the gate/up projection, SwiGLU, the down projection), whole or
//! over the tokens in chunks (`--ffn-chunks`).
//!
//! The MLP's intermediates are the widest activations, `[N, 2F]` and `[N, F]`. When they are
//! recomputed (`--recompute-ffn` or `--recompute-block`) they live in one buffer shared by
//! every layer, and in chunks that buffer holds one chunk's rows: the forward runs the three
//! steps chunk by chunk, and the backward reruns them for each chunk just before that
//! chunk's backward. Each token's values are the same either way; the weight gradients are
//! summed chunk by chunk, which rounds in another order than one matmul over every token.

use std::ops::Range;

use anyhow::Result;

use super::activations::Activations;
use super::linear::{Input, Linear, NormOutput};
use super::transformer::Transformer;
use crate::backend::Backend;
use crate::tensor::Tensor;

impl<B: Backend> Transformer<B> {
    /// Steps 6–8 of block `l`: from the post-attention norm's output, the MLP's output into
    /// `branch`.
    pub(crate) fn mlp_forward(&self, b: &B, a: &Activations<B>, l: usize) -> Result<()> {
        let w = self.layer_weights(l);
        let down = (l, Linear::Down, w);
        if self.options.ffn_chunks > 1 {
            for rows in self.ffn_chunks() {
                let (_, swiglu) = self.mlp_chunk_inner(b, a, l, &rows)?;
                let out = a.branch.narrow_rows(rows.start, rows.end);
                self.linears
                    .forward(b, down, &out, Input::Tensor(&swiglu))?;
            }
            return Ok(());
        }
        // 6) gate/up projection, 7) SwiGLU
        let (gate_up, swiglu) = (a.gate_up.layer(l), a.swiglu.layer(l));
        let ln2 = self.ln2_rows(a, l, 0..self.tokens_per_step());
        self.linears
            .gate_up_swiglu(b, (l, w), (gate_up, swiglu), Input::Norm(ln2))?;
        // 8) down projection
        self.linears
            .forward(b, down, &a.branch, Input::Tensor(swiglu))
    }

    /// The MLP's part of `block_recompute`: the intermediates the backward reads (in chunks,
    /// none: the backward makes each chunk's itself), and where FP8 makes it again, the down
    /// projection's input copy from SwiGLU's output.
    pub(crate) fn mlp_recompute(&self, b: &B, a: &Activations<B>, l: usize) -> Result<()> {
        let (w, plan) = (self.layer_weights(l), self.recompute);
        let (gate_up, swiglu) = (a.gate_up.layer(l), a.swiglu.layer(l));
        let ln2 = || Input::Norm(self.ln2_rows(a, l, 0..self.tokens_per_step()));
        match (plan.gate_up, plan.swiglu) {
            (true, true) => self
                .linears
                .gate_up_swiglu(b, (l, w), (gate_up, swiglu), ln2()),
            (true, false) if self.linears.remakes_down_input() => {
                self.linears
                    .gate_up_swiglu(b, (l, w), (gate_up, swiglu), ln2())?;
                self.linears.stash_down_input(b, l, swiglu)
            }
            (true, false) => self
                .linears
                .forward(b, (l, Linear::GateUp, w), gate_up, ln2()),
            (false, true) => b.swiglu_forward(swiglu, gate_up, None),
            (false, false) => Ok(()),
        }
    }

    /// Steps 8–6 of block `l`'s backward, given `dresidual`: the MLP's weight gradients
    /// (written, or with `acc` added into) and the gradient of its input in `dln`. The two
    /// widest gradients overwrite the activations they are the gradients of, each dead once
    /// read: the SwiGLU output once the down projection's weight gradient has read it, and
    /// gate/up once SwiGLU's backward has (in place).
    pub(crate) fn mlp_backward(
        &self, b: &B, a: &Activations<B>, l: usize, acc: bool,
    ) -> Result<()> {
        let (w, g) = (self.layer_weights(l), self.layer_grads(l));
        let (down, gate_up_lin) = ((l, Linear::Down, w, g), (l, Linear::GateUp, w, g));
        if self.options.ffn_chunks > 1 {
            for (c, rows) in self.ffn_chunks().enumerate() {
                let (gate_up, swiglu) = self.mlp_chunk_inner(b, a, l, &rows)?;
                let narrow = |t: &Tensor<B>| t.narrow_rows(rows.start, rows.end);
                let (dres, dln, ln2) =
                    (narrow(&a.dresidual), narrow(&a.dln), narrow(a.ln2.layer(l)));
                let acc = acc || c > 0;
                self.linears
                    .backward(b, down, &swiglu, &dres, &swiglu, acc)?;
                b.swiglu_backward(&gate_up, &swiglu, &gate_up, None)?;
                self.linears
                    .backward(b, gate_up_lin, &dln, &gate_up, &ln2, acc)?;
            }
            return Ok(());
        }
        // 8) the down projection's gradients and 7) SwiGLU's backward; gate/up's gradient
        // overwrites gate/up
        let (swiglu, gate_up) = (a.swiglu.layer(l), a.gate_up.layer(l));
        let dswiglu = swiglu;
        self.linears.down_swiglu_backward(
            b,
            (l, w, g),
            (gate_up, swiglu, dswiglu),
            &a.dresidual,
            acc,
        )?;
        // 6) gate/up projection
        self.linears
            .backward(b, gate_up_lin, &a.dln, gate_up, a.ln2.layer(l), acc)
    }

    /// The token rows of each MLP chunk.
    fn ffn_chunks(&self) -> impl Iterator<Item = Range<usize>> + use<B> {
        let n = self.tokens_per_step();
        let rows = n.div_ceil(self.options.ffn_chunks);
        (0..n)
            .step_by(rows)
            .map(move |start| start..(start + rows).min(n))
    }

    /// Steps 6 and 7 for the tokens `rows`, into the first rows of the shared buffers: the
    /// chunk's gate/up and SwiGLU output.
    fn mlp_chunk_inner(
        &self, b: &B, a: &Activations<B>, l: usize, rows: &Range<usize>,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        let w = self.layer_weights(l);
        let len = rows.end - rows.start;
        let gate_up = a.gate_up.layer(l).narrow_rows(0, len);
        let swiglu = a.swiglu.layer(l).narrow_rows(0, len);
        let ln2 = Input::Norm(self.ln2_rows(a, l, rows.clone()));
        self.linears
            .gate_up_swiglu(b, (l, w), (&gate_up, &swiglu), ln2)?;
        Ok((gate_up, swiglu))
    }

    /// Block `l`'s post-attention norm output for the tokens `rows`, gate/up's input.
    fn ln2_rows<'a>(
        &'a self, a: &'a Activations<B>, l: usize, rows: Range<usize>,
    ) -> NormOutput<'a, B> {
        let w = &self.layer_weights(l).ln2;
        let narrow = |t: &Tensor<B>| t.narrow_rows(rows.start, rows.end);
        NormOutput {
            stored: narrow(a.ln2.layer(l)),
            x: narrow(a.residual_mid.layer(l)),
            rstd: narrow(a.rstd2.layer(l)),
            weight: w,
        }
    }
}
