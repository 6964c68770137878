//! Generation one token at a time over a KV cache: each block keeps every position's QKV
//! row, so a new token runs the blocks over itself alone and attends over the rows kept.
//!
//! The cache keeps whole QKV rows, queries included (which only their own step reads), so
//! that the QKV projection writes straight into the cache's next row and RoPE rotates it
//! there, with the ops of the full forward.

use anyhow::{Result, bail, ensure};

use super::transformer::{Transformer, rope_table};
use crate::backend::{AttnShape, Backend};
use crate::tensor::{Tensor, TensorSpec};

pub(crate) struct KvCache<B: Backend> {
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

    /// Where block `l`'s projection writes the new position's QKV row, and the rotation of
    /// that position.
    pub(crate) fn next_row(&self, l: usize) -> (Tensor<B>, Tensor<B>) {
        let t = self.len;
        (
            self.rows[l].narrow_rows(t, t + 1),
            self.rope.narrow_rows(t, t + 1),
        )
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
    /// Starts a generation of up to `capacity` positions, emptying any earlier cache. The
    /// model must take one token a pass (`ModelOptions::forward_only(1, _)`).
    pub fn start_kv_cache(&mut self, b: &B, capacity: usize) -> Result<()> {
        ensure!(
            self.tokens_per_step() == 1,
            "a KV cache needs a model of one token a pass, not {}",
            self.tokens_per_step()
        );
        ensure!(
            capacity > 0,
            "a KV cache needs room for one position at least"
        );
        // The old cache goes first, so that its memory can serve the new one.
        self.kv_cache = None;
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
        self.kv_cache = Some(KvCache { rows, rope, len: 0 });
        Ok(())
    }

    /// Runs `token` at the KV cache's next position, leaving its normalized hidden state for
    /// `logits_at(b, 0)`.
    pub fn forward_token(&mut self, b: &B, token: i32) -> Result<()> {
        let Some(cache) = &self.kv_cache else {
            bail!("forward_token needs a KV cache (start_kv_cache)");
        };
        let capacity = cache.capacity();
        ensure!(
            cache.len < capacity,
            "the KV cache is full ({capacity} positions)"
        );
        self.forward_hidden(b, &[token])?;
        if let Some(cache) = &mut self.kv_cache {
            cache.len += 1;
        }
        Ok(())
    }
}
