//! Token embedding lookup and its gradient.

use rayon::prelude::*;

use anyhow::Result;

use super::{Cpu, Scalar, add_column_sums};
use crate::backend::EmbeddingOps;
use crate::tensor::Tensor;

/// out: `[N, C]`, tokens: `[N]`, wte: `[V, C]`.
pub fn embedding_forward<T: Scalar>(out: &mut [T], tokens: &[i32], wte: &[T], c: usize) {
    out.par_chunks_mut(c)
        .zip(tokens.par_iter())
        .for_each(|(row, &tok)| {
            let t = tok as usize;
            row.copy_from_slice(&wte[t * c..(t + 1) * c]);
        });
}

/// dwte: `[V, C]`; rows are added in token order, so the result is deterministic.
pub fn embedding_backward<T: Scalar>(
    dwte: &mut [T], tokens: &[i32], dout: &[T], c: usize, accumulate: bool,
) {
    if !accumulate {
        dwte.fill(T::zero());
    }
    // Each token's positions in order, its rows of dout summed in f64.
    let mut positions: Vec<usize> = (0..tokens.len()).collect();
    positions.sort_by_key(|&n| tokens[n]);
    for same in positions.chunk_by(|&a, &b| tokens[a] == tokens[b]) {
        let t = tokens[same[0]] as usize;
        let rows = same
            .iter()
            .map(|&n| dout[n * c..(n + 1) * c].iter().copied());
        add_column_sums(&mut dwte[t * c..(t + 1) * c], rows);
    }
}

impl<T: Scalar> EmbeddingOps for Cpu<T> {
    fn embedding_forward(
        &self, out: &Tensor<Self>, tokens: &Tensor<Self>, wte: &Tensor<Self>,
    ) -> Result<()> {
        let (tokens, wte_v) = (self.ints(tokens)?, self.floats(wte)?);
        self.update(out, |o| embedding_forward(o, &tokens, &wte_v, wte.cols()))
    }

    fn embedding_backward(
        &self, dwte: &Tensor<Self>, tokens: &Tensor<Self>, dout: &Tensor<Self>, accumulate: bool,
    ) -> Result<()> {
        let (tokens, dout) = (self.ints(tokens)?, self.floats(dout)?);
        self.update(dwte, |d| {
            embedding_backward(d, &tokens, &dout, dwte.cols(), accumulate)
        })
    }
}
