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

use super::forward::Pass;
use super::fp8::Linear;
use super::linear::{Input, NormRows};
use super::transformer::Transformer;
use crate::backend::{Backend, Matmul};
use crate::tensor::Tensor;

impl<B: Backend> Transformer<B> {
    /// The token rows of each MLP chunk.
    fn ffn_chunks(&self) -> impl Iterator<Item = Range<usize>> + use<B> {
        let n = self.options.batch * self.options.seq;
        let rows = n.div_ceil(self.options.ffn_chunks);
        (0..n)
            .step_by(rows)
            .map(move |start| start..(start + rows).min(n))
    }

    /// Steps 6–8 of block `l`: from `ln2`, the MLP's output into `branch` in the forward,
    /// and in the recompute pass the intermediates the backward reads (in chunks, none: the
    /// backward makes each chunk's itself).
    pub(crate) fn mlp_forward(&self, b: &B, l: usize, pass: Pass) -> Result<()> {
        let (a, rc) = (&self.acts, self.options.recompute);
        if self.options.ffn_chunks > 1 {
            if pass == Pass::Forward {
                for rows in self.ffn_chunks() {
                    let (_, swiglu) = self.mlp_chunk_inner(b, l, &rows)?;
                    let out = a.branch.narrow_rows(rows.start, rows.end);
                    let x = Input::Tensor(&swiglu);
                    self.linear_forward(b, (l, Linear::Down), &out, x, None)?;
                }
            }
            return Ok(());
        }
        let (gate_up, swiglu) = (a.gate_up.layer(l), a.swiglu.layer(l));
        let ln2 = self.ln2_rows(l, 0..self.options.batch * self.options.seq);
        let run = |recomputed: bool| pass == Pass::Forward || recomputed;
        // 6) gate/up projection, 7) SwiGLU (whose output FP8's backward does not read again)
        match (
            run(rc.gate_up()),
            run(rc.swiglu_out() && self.fp8.is_none()),
        ) {
            (true, true) => self.gate_up_swiglu(b, l, gate_up, swiglu, ln2.input())?,
            (true, false) => {
                self.linear_forward(b, (l, Linear::GateUp), gate_up, ln2.input(), None)?
            }
            (false, true) => self.swiglu(b, l, swiglu, gate_up)?,
            (false, false) => {}
        }
        // 8) down projection; the backward never needs it again
        if pass == Pass::Forward {
            let x = Input::Tensor(swiglu);
            self.linear_forward(b, (l, Linear::Down), &a.branch, x, None)?;
        }
        Ok(())
    }

    /// Steps 8–6 of block `l`'s backward, given `dresidual`: the MLP's weight gradients
    /// (written, or with `acc` added into) and the gradient of its input in `dln`. The two
    /// widest gradients overwrite the activations they are the gradients of, each dead once
    /// read: the SwiGLU output once the down projection's weight gradient has read it, and
    /// gate/up once SwiGLU's backward has (in place).
    pub(crate) fn mlp_backward(&self, b: &B, l: usize, acc: bool) -> Result<()> {
        let a = &self.acts;
        if self.options.ffn_chunks > 1 {
            for (c, rows) in self.ffn_chunks().enumerate() {
                let (gate_up, swiglu) = self.mlp_chunk_inner(b, l, &rows)?;
                let (dres, dln, ln2) = (
                    a.dresidual.narrow_rows(rows.start, rows.end),
                    a.dln.narrow_rows(rows.start, rows.end),
                    a.ln2.layer(l).narrow_rows(rows.start, rows.end),
                );
                let acc = acc || c > 0;
                self.linear_backward(b, (l, Linear::Down), &swiglu, &dres, &swiglu, acc)?;
                b.swiglu_backward(&gate_up, &swiglu, &gate_up, None)?;
                self.linear_backward(b, (l, Linear::GateUp), &dln, &gate_up, &ln2, acc)?;
            }
            return Ok(());
        }
        // 8) the down projection's gradients and 7) SwiGLU's backward, the backend perhaps
        // doing the input gradient and SwiGLU's backward in one kernel; gate/up's gradient
        // overwrites gate/up
        let (swiglu, gate_up) = (a.swiglu.layer(l), a.gate_up.layer(l));
        let dswiglu = swiglu;
        let dw = Linear::Down.weight(&self.grads().layers[l]);
        match &self.fp8 {
            Some(fp8) => {
                let dres = &a.dresidual;
                fp8.down_swiglu_backward(b, l, (gate_up, dswiglu), dw, dres, acc)?
            }
            None => {
                let w = Linear::Down.weight(&self.params.layers[l]);
                b.matmul(dw, &a.dresidual, swiglu, None, Matmul::backward_weight(acc))?;
                b.swiglu_backward_through_down(gate_up, dswiglu, &a.dresidual, w, None)?;
            }
        }
        // 6) gate/up projection
        let ln2 = a.ln2.layer(l);
        self.linear_backward(b, (l, Linear::GateUp), &a.dln, gate_up, ln2, acc)
    }

    /// Steps 6 and 7 for the tokens `rows`, into the first rows of the shared buffers: the
    /// chunk's gate/up and SwiGLU output.
    fn mlp_chunk_inner(
        &self,
        b: &B,
        l: usize,
        rows: &Range<usize>,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        let a = &self.acts;
        let len = rows.end - rows.start;
        let gate_up = a.gate_up.layer(l).narrow_rows(0, len);
        let swiglu = a.swiglu.layer(l).narrow_rows(0, len);
        let ln2 = self.ln2_rows(l, rows.clone());
        self.gate_up_swiglu(b, l, &gate_up, &swiglu, ln2.input())?;
        Ok((gate_up, swiglu))
    }

    /// Block `l`'s post-attention norm output for the tokens `rows`, gate/up's input.
    fn ln2_rows(&self, l: usize, rows: Range<usize>) -> NormRows<'_, B> {
        let (a, w) = (&self.acts, &self.params.layers[l].ln2);
        let narrow = |t: &Tensor<B>| t.narrow_rows(rows.start, rows.end);
        NormRows {
            stored: narrow(a.ln2.layer(l)),
            x: narrow(a.residual_mid.layer(l)),
            rstd: narrow(a.rstd2.layer(l)),
            weight: w,
        }
    }

    /// Steps 6 and 7 of block `l`: the gate/up projection of `ln2`, then SwiGLU of it, which
    /// the backend may do in one kernel.
    fn gate_up_swiglu(
        &self,
        b: &B,
        l: usize,
        gate_up: &Tensor<B>,
        swiglu: &Tensor<B>,
        ln2: Input<'_, B>,
    ) -> Result<()> {
        if let Some(fp8) = &self.fp8 {
            return fp8.gate_up_swiglu(b, l, gate_up, swiglu, ln2);
        }
        let w = Linear::GateUp.weight(&self.params.layers[l]);
        b.gate_up_swiglu(gate_up, swiglu, ln2.stored(), w, None)
    }

    /// Step 7 alone, reporting its output's abs-max where FP8 quantizes it next.
    fn swiglu(&self, b: &B, l: usize, swiglu: &Tensor<B>, gate_up: &Tensor<B>) -> Result<()> {
        let amax_down = self.input_amax(l, Linear::Down);
        b.swiglu_forward(swiglu, gate_up, amax_down.as_ref())
    }
}
