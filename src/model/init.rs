//! Initialisation from scratch: N(0, 0.02) for matrices and embeddings, scaled by
//! 1/sqrt(2·layers) for the projections that feed the residual stream (GPT-2's rule, which
//! keeps the residual's variance from growing with depth), ones for norms, zeros for biases.

use anyhow::Result;

use super::params::ParamKind;
use super::transformer::Transformer;
use crate::backend::Backend;
use crate::rng::fill_normal;

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
                    let mut v = vec![0f32; n];
                    fill_normal(&mut v, std, seed, i as u64);
                    v
                }
            };
            b.upload(tensor, &values)?;
        }
        self.weights_changed();
        Ok(())
    }
}
