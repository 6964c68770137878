//! The forward pass: the embedding, every block (`block.rs`) and the final norm, leaving the
//! normalized hidden states for the LM head (`head.rs`).

use anyhow::Result;

use super::decode::KvCache;
use super::transformer::Transformer;
use crate::backend::{Backend, Range, ResidualAdd};

impl<B: Backend> Transformer<B> {
    /// Embeds `tokens` (`[B·T]`) and runs every block and the final norm, leaving the
    /// normalized hidden states in `lnf` for the LM head.
    pub fn forward_hidden(&mut self, b: &B, tokens: &[i32]) -> Result<()> {
        self.forward_blocks(b, tokens, None)
    }

    /// `forward_hidden`, each block's positions going into `cache` when one is given
    /// (`block_decode`). The activations' offloaded copies (`Activations`) move out beside the
    /// blocks' work: a block's stashes are made ready before it runs, and start their way out
    /// once it is done.
    pub(crate) fn forward_blocks(
        &mut self, b: &B, tokens: &[i32], cache: Option<&KvCache<B>>,
    ) -> Result<()> {
        let _forward = Range::begin(b, format_args!("forward"));
        let (a, p) = (&self.acts, &self.params);
        self.linears.begin_forward(b, p)?;
        self.streams.begin_forward(b)?;
        b.upload_i32(&a.tokens, tokens)?;
        a.before_block_forward(b, 0)?;
        b.embedding_forward(a.residual.layer(0), &a.tokens, &p.embed)?;
        for l in 0..self.config.num_layers {
            let _layer = Range::begin(b, format_args!("layer {l} forward"));
            if l > 0 {
                a.before_block_forward(b, l)?;
            }
            self.streams.before_block_forward(b, l)?;
            match cache {
                Some(cache) => self.block_decode(b, l, cache)?,
                None => self.block_forward(b, l)?,
            }
            a.block_forward_done(b, l)?;
            self.streams.block_forward_done(b, l)?;
        }
        // The last block's residual sum is fused into the final norm (a config has at least
        // one layer).
        let last = self.config.num_layers;
        let sum = ResidualAdd {
            out: a.residual.layer(last),
            branch: &a.branch,
        };
        let eps = self.config.rms_norm_eps as f32;
        let inp = a.residual_mid.layer(last - 1);
        b.rmsnorm_forward(
            Some(&a.lnf),
            &a.rstdf,
            inp,
            Some(sum),
            &p.final_norm,
            eps,
            None,
        )
    }
}
