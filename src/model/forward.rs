//! The forward pass: the embedding, every block (`block.rs`) and the final norm, leaving the
//! normalized hidden states for the LM head (`head.rs`).

use anyhow::Result;

use anyhow::ensure;

use super::activations::Activations;
use super::backward::{BlockEvent, BlockEvents};
use super::decode::KvCache;
use super::documents;
use super::transformer::{Transformer, Weights};
use crate::backend::{Backend, Range, ResidualAdd};

impl<B: Backend> Transformer<B> {
    /// Embeds `tokens` (`[B·T]`) and runs every block and the final norm, leaving the
    /// normalized hidden states in `lnf` for the LM head. A model whose weights are sharded
    /// needs `forward_hidden_with`, which lets the caller bring them.
    pub fn forward_hidden(&mut self, b: &B, tokens: &[i32]) -> Result<()> {
        ensure!(
            self.options.weights == Weights::All,
            "this model's weights are sharded over ranks; its passes need forward_hidden_with"
        );
        self.forward_pass(b, tokens, &mut |_| Ok(()))
    }

    /// `forward_hidden`, telling `events` of the sharded weights each block reads.
    pub fn forward_hidden_with(
        &mut self, b: &B, tokens: &[i32], events: &mut BlockEvents<B>,
    ) -> Result<()> {
        self.forward_pass(b, tokens, events)
    }

    /// `forward_blocks` of a training or eval pass; with `ModelOptions::record_passes`, its
    /// ops recorded and replayed (`recorded`), by the state its quantized weight copies
    /// start from.
    fn forward_pass(&self, b: &B, tokens: &[i32], events: &mut BlockEvents<B>) -> Result<()> {
        if !self.options.record_passes {
            return self.forward_blocks(b, tokens, None, events);
        }
        self.upload_tokens(b, self.acts(), tokens)?;
        let state = self.linears.copies_state();
        let mut recordings = self.recordings.borrow_mut();
        recordings.forward[state].run(b, &mut || self.run_blocks(b, None, events))?;
        self.linears.copies_made();
        Ok(())
    }

    /// Where block `l`'s weights are sharded, has `events` bring them to this rank's copy
    /// (`BlockEvent::Weights`): before each pass reads them, and to gather them for export.
    pub fn fetch_sharded_weights(&self, l: usize, events: &mut BlockEvents<B>) -> Result<()> {
        if self.options.weights == Weights::All {
            return Ok(());
        }
        let weights: Vec<&crate::tensor::Tensor<B>> = self.layer_weights(l).iter().collect();
        events(BlockEvent::Weights {
            layer: l,
            weights: &weights,
        })
    }

    /// `forward_hidden`, each block's positions going into `cache` when one is given
    /// (`block_decode`). The activations' offloaded copies (`Activations`) move out beside the
    /// blocks' work: a block's stashes are made ready before it runs, and start their way out
    /// once it is done.
    pub(crate) fn forward_blocks(
        &self, b: &B, tokens: &[i32], cache: Option<&KvCache<B>>, events: &mut BlockEvents<B>,
    ) -> Result<()> {
        self.upload_tokens(b, self.acts(), tokens)?;
        self.run_blocks(b, cache, events)
    }

    /// `tokens` into the device's buffer of `a`'s micro-batch, and where sequences pack
    /// documents, their spans.
    pub(crate) fn upload_tokens(&self, b: &B, a: &Activations<B>, tokens: &[i32]) -> Result<()> {
        b.upload_i32(&a.tokens, tokens)?;
        if let (Some(docs), Some(d)) = (&a.docs, self.options.documents) {
            b.upload_i32(docs, &documents::spans(tokens, self.options.seq, d.eos))?;
        }
        Ok(())
    }

    /// `forward_blocks` after its uploads: ops only, which a token's pass records
    /// (`decode`).
    pub(crate) fn run_blocks(
        &self, b: &B, cache: Option<&KvCache<B>>, events: &mut BlockEvents<B>,
    ) -> Result<()> {
        let _forward = Range::begin(b, format_args!("forward"));
        let (a, p) = (self.acts(), &self.params);
        self.linears.begin_forward(b, p)?;
        self.streams.begin_forward(b)?;
        a.before_block_forward(b, 0)?;
        b.embedding_forward(a.residual.layer(0), &a.tokens, &p.embed)?;
        for l in 0..self.config.num_layers {
            let _layer = Range::begin(b, format_args!("layer {l} forward"));
            if l > 0 {
                a.before_block_forward(b, l)?;
            }
            self.weights_for_forward(b, l, events)?;
            match cache {
                Some(cache) => self.block_decode(b, a, l, cache)?,
                None => self.block_forward(b, a, l, l > 0)?,
            }
            a.block_forward_done(b, l)?;
            self.streams.block_forward_done(b, l)?;
        }
        self.final_norm(b, a)
    }

    /// The final norm of `a`'s micro-batch, fused with the last block's residual add (a
    /// config has at least one layer): the normalized hidden states in `lnf` for the LM head.
    pub(super) fn final_norm(&self, b: &B, a: &Activations<B>) -> Result<()> {
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
            &self.params.final_norm,
            eps,
            None,
        )
    }
}
