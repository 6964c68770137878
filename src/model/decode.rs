//! Generation over a KV cache: a prompt runs through the blocks in one pass, and each new
//! token then alone, attending over the rows its block kept of every earlier position.
//!
//! The cache keeps whole QKV rows, queries included (which only their own pass reads), so
//! that the QKV projection writes straight into the cache's next rows and RoPE rotates them
//! there, and a prompt's causal attention runs over those rows as over a full pass's QKV.

use anyhow::{Result, ensure};

use super::transformer::{Transformer, rope_table};
use crate::backend::{AttnShape, Backend};
use crate::tensor::{Tensor, TensorSpec};

/// Every position's QKV rows so far, for the models that share one set of weights
/// (`Transformer::sharing_weights`).
pub struct KvCache<B: Backend> {
    /// Per layer `[capacity, qkv_width]`: row t holds position t's rotated query and key,
    /// and its value.
    rows: Vec<Tensor<B>>,
    /// `[capacity, head_dim/2, 2]`: the RoPE table of every position the cache holds.
    rope: Tensor<B>,
    /// Positions filled.
    len: usize,
}

impl<B: Backend> KvCache<B> {
    fn capacity(&self) -> usize {
        self.rope.rows()
    }

    /// Where block `l`'s projection writes the QKV rows of the next `n` positions, and their
    /// rotations.
    pub(crate) fn next_rows(&self, l: usize, n: usize) -> (Tensor<B>, Tensor<B>) {
        let (start, end) = (self.len, self.len + n);
        (
            self.rows[l].narrow_rows(start, end),
            self.rope.narrow_rows(start, end),
        )
    }

    /// Whether the pass's attention runs over earlier positions' rows too: a token after
    /// the first. A pass from the start of the cache attends within itself.
    pub(crate) fn has_history(&self) -> bool {
        self.len > 0
    }

    /// The new position's attention output over block `l`'s rows up to and including it.
    pub(crate) fn attend(&self, b: &B, l: usize, out: &Tensor<B>, shape: AttnShape) -> Result<()> {
        let seq = self.len + 1;
        let shape = AttnShape {
            batch: 1,
            seq,
            ..shape
        };
        b.attention_decode(out, &self.rows[l].narrow_rows(0, seq), shape)
    }
}

impl<B: Backend> Transformer<B> {
    /// An empty cache of up to `capacity` positions for this model's config and dtype.
    pub fn kv_cache(&self, b: &B, capacity: usize) -> Result<KvCache<B>> {
        ensure!(
            capacity > 0,
            "a KV cache needs room for one position at least"
        );
        let (width, pairs) = (self.config.qkv_dim(), self.config.head_dim / 2);
        let mut specs: Vec<TensorSpec> = (0..self.config.num_layers)
            .map(|l| {
                TensorSpec::new(
                    format!("kv_cache.{l}"),
                    &[capacity, width],
                    self.options.dtype,
                )
            })
            .collect();
        specs.push(TensorSpec::new(
            "kv_cache.rope",
            &[capacity, pairs, 2],
            self.rope.dtype,
        ));
        let mut rows = b.allocate("kv cache", &specs)?;
        let rope = rows.pop().expect("the rope table was planned last");
        b.upload(&rope, &rope_table(&self.config, capacity))?;
        Ok(KvCache { rows, rope, len: 0 })
    }

    /// Runs `tokens` (the model's one sequence) at the cache's next positions, leaving
    /// their normalized hidden states for `logits_at`. A pass of more than one token must
    /// start the cache (a prompt); after it, tokens go one a pass.
    pub fn forward_cached(&mut self, b: &B, tokens: &[i32], cache: &mut KvCache<B>) -> Result<()> {
        let n = tokens.len();
        ensure!(
            self.options.batch == 1 && n == self.options.seq,
            "a cached pass takes the model's one sequence of {} tokens, not {n}",
            self.options.seq
        );
        ensure!(
            cache.rows.len() == self.config.num_layers
                && cache.rows[0].shape[1] == self.config.qkv_dim()
                && cache.rows[0].dtype == self.options.dtype,
            "the KV cache was made for another model (Transformer::kv_cache)"
        );
        ensure!(
            n == 1 || !cache.has_history(),
            "a pass of {n} tokens must start the KV cache; later ones go one at a time"
        );
        let capacity = cache.capacity();
        ensure!(
            cache.len + n <= capacity,
            "the KV cache is full ({capacity} positions)"
        );
        self.forward_blocks(b, tokens, Some(cache), &mut |_| Ok(()))?;
        cache.len += n;
        Ok(())
    }
}
