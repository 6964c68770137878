//! Rotary position embedding in HF's rotate-half layout: element `i` of a head pairs with
//! element `i + head_dim/2`.

use rayon::prelude::*;

use anyhow::Result;

use super::attention::Spans;
use super::{Cpu, Scalar};
use crate::backend::{AttnShape, MatmulOps, RopeOps};
use crate::tensor::Tensor;

/// Rotates each query and key head of every `qkv` row by its position's angles: its place in
/// its sequence, or in its document by `spans`. `freqs`: `[T, head_dim/2, 2]` of (cos, sin).
/// `inverse` rotates back, which is the gradient of the forward rotation.
fn rope_rotate<T: Scalar>(
    qkv: &mut [T], freqs: &[T], shape: AttnShape, spans: Spans, inverse: bool,
) {
    let d = shape.head_dim;
    let half = d / 2;
    let rotated_heads = shape.q_heads + shape.kv_heads;
    qkv.par_chunks_mut(shape.qkv_width())
        .enumerate()
        .for_each(|(n, row)| {
            let (b, t) = (n / shape.seq, n % shape.seq);
            let position = t - spans.start(b, t);
            let table = &freqs[position * d..(position + 1) * d];
            for head in row[..rotated_heads * d].chunks_mut(d) {
                let (lo, hi) = head.split_at_mut(half);
                for ((x1, x2), cs) in lo.iter_mut().zip(hi.iter_mut()).zip(table.chunks(2)) {
                    let (cos, sin) = (cs[0], if inverse { -cs[1] } else { cs[1] });
                    let (a, b) = (*x1, *x2);
                    *x1 = a * cos - b * sin;
                    *x2 = b * cos + a * sin;
                }
            }
        });
}

impl<T: Scalar> RopeOps for Cpu<T> {
    fn rope_forward(
        &self, qkv: &Tensor<Self>, freqs: &Tensor<Self>, shape: AttnShape,
        docs: Option<&Tensor<Self>>,
    ) -> Result<()> {
        let freqs = self.floats(freqs)?;
        let docs = self.documents(docs, shape)?;
        let spans = Spans::new(docs.as_deref(), shape);
        self.update(qkv, |x| rope_rotate(x, &freqs, shape, spans, false))
    }

    fn rope_backward(
        &self, dqkv: &Tensor<Self>, freqs: &Tensor<Self>, shape: AttnShape,
        docs: Option<&Tensor<Self>>, amax: Option<&Tensor<Self>>,
        bias: Option<(&Tensor<Self>, bool)>,
    ) -> Result<()> {
        {
            let freqs = self.floats(freqs)?;
            let docs = self.documents(docs, shape)?;
            let spans = Spans::new(docs.as_deref(), shape);
            self.update(dqkv, |x| rope_rotate(x, &freqs, shape, spans, true))?;
        }
        self.report_abs_max(amax, dqkv)?;
        match bias {
            Some((dbias, accumulate)) => self.bias_backward(dbias, dqkv, accumulate),
            None => Ok(()),
        }
    }
}
