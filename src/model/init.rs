//! Initialisation from scratch: N(0, 0.02) for matrices and embeddings, scaled by
//! 1/sqrt(2·layers) for the projections that feed the residual stream (GPT-2's rule, which
//! keeps the residual's variance from growing with depth), ones for norms, zeros for biases.

use anyhow::Result;
use rayon::prelude::*;

use super::params::ParamKind;
use super::transformer::Transformer;
use crate::backend::Backend;
use crate::rng::Rng;

pub const INIT_STD: f64 = 0.02;

impl<B: Backend> Transformer<B> {
    /// Fills every parameter from `seed`; each tensor draws from its own stream, so the
    /// result does not depend on the thread count.
    pub fn init_weights(&self, b: &B, seed: u64) -> Result<()> {
        let residual_std = INIT_STD / (2.0 * self.config.num_layers.max(1) as f64).sqrt();
        for (i, (spec, tensor)) in self.layout.zip(&self.params).enumerate() {
            let n = spec.tensor.numel();
            let values: Vec<f32> = match spec.kind {
                ParamKind::Norm => vec![1.0; n],
                ParamKind::Bias => vec![0.0; n],
                kind => {
                    let std = if kind == ParamKind::ResidualMatrix {
                        residual_std
                    } else {
                        INIT_STD
                    };
                    // Blocks of rows get their own streams so large tensors fill in parallel.
                    const BLOCK: usize = 1 << 16;
                    let mut v = vec![0f32; n];
                    v.par_chunks_mut(BLOCK).enumerate().for_each(|(j, chunk)| {
                        let mut rng = Rng::derived(seed, ((i as u64) << 32) | j as u64);
                        chunk
                            .iter_mut()
                            .for_each(|x| *x = (rng.normal() * std) as f32);
                    });
                    v
                }
            };
            b.upload(tensor, &values)?;
        }
        self.weights_changed();
        Ok(())
    }
}
