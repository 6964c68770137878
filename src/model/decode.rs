//! Generation over a KV cache: a prompt runs through the blocks in one pass, and each new
//! token then alone, attending over the rows its block kept of every earlier position.
//!
//! The cache keeps whole QKV rows, queries included (which only their own pass reads). A
//! prompt's projection writes straight into the cache's first rows and RoPE rotates them there,
//! and its causal attention runs over those rows as over a full pass's QKV. A token's pass
//! instead reads its position from the device (`KvCache::position`): it gathers that
//! position's RoPE angles, appends its rotated row to the cache there and attends up to it,
//! so that every token's pass is the same ops on the same memory. The backend records that
//! pass once and replays it for each later token (`Backend::record`: a CUDA graph), which
//! costs the host a fraction of enqueueing its few hundred ops one by one.

use anyhow::{Result, ensure};

use super::recorded::Recorded;
use super::transformer::{Transformer, rope_table};
use crate::backend::{AttnShape, Backend, RowAt};
use crate::tensor::{DType, Tensor, TensorSpec};

/// Every position's QKV rows so far, for the models that share one set of weights
/// (`Transformer::sharing_weights`).
pub struct KvCache<B: Backend> {
    /// Per layer `[capacity, qkv_width]`: row t holds position t's rotated query and key,
    /// and its value.
    rows: Vec<Tensor<B>>,
    /// `[capacity, head_dim/2, 2]`: the RoPE table of every position the cache holds.
    rope: Tensor<B>,
    /// `[1]` i32: the position of the token a pass after the prompt runs at, uploaded before
    /// each such pass, which its ops read.
    position: Tensor<B>,
    /// `[1, head_dim/2, 2]`: that position's row of `rope`, which the pass gathers.
    rope_row: Tensor<B>,
    /// Positions filled.
    len: usize,
    /// A token's pass (`Recorded`), with the `id` of the model whose buffers it runs on:
    /// another model's tokens drop it and record their own.
    recorded: Option<(u64, Recorded<B>)>,
}

impl<B: Backend> KvCache<B> {
    fn capacity(&self) -> usize {
        self.rope.rows()
    }

    /// Where block `l`'s projection writes the QKV rows of a prompt of `n` positions, and
    /// their rotations.
    pub(crate) fn prompt_rows(&self, l: usize, n: usize) -> (Tensor<B>, Tensor<B>) {
        (self.rows[l].narrow_rows(0, n), self.rope.narrow_rows(0, n))
    }

    /// Whether a pass runs one token after earlier ones (else a prompt, from the start).
    pub(crate) fn has_history(&self) -> bool {
        self.len > 0
    }

    /// The RoPE angles of the token's position, gathered by `gather_rope` at its pass's start.
    pub(crate) fn rope_row(&self) -> &Tensor<B> {
        &self.rope_row
    }

    /// Gathers the angles of the position the device holds into `rope_row`.
    pub(crate) fn gather_rope(&self, b: &B) -> Result<()> {
        b.copy_row_at(&self.rope_row, &self.rope, &self.position, RowAt::Src)
    }

    /// Block `l`'s rotated QKV row of the token into the cache at its position.
    pub(crate) fn append(&self, b: &B, l: usize, qkv: &Tensor<B>) -> Result<()> {
        b.copy_row_at(&self.rows[l], qkv, &self.position, RowAt::Dst)
    }

    /// The token's attention output over block `l`'s rows up to and including its own.
    pub(crate) fn attend(&self, b: &B, l: usize, out: &Tensor<B>, shape: AttnShape) -> Result<()> {
        let shape = AttnShape {
            batch: 1,
            seq: self.capacity(),
            ..shape
        };
        b.attention_decode(out, &self.rows[l], &self.position, shape)
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
        // Apart from the table, which the pass copies a row of into it.
        let specs = [
            TensorSpec::new("kv_cache.position", &[1], DType::I32),
            TensorSpec::new("kv_cache.rope_row", &[1, pairs, 2], self.rope.dtype),
        ];
        let mut own = b.allocate("kv cache", &specs)?;
        let rope_row = own.pop().expect("planned second");
        let position = own.pop().expect("planned first");
        Ok(KvCache {
            rows,
            rope,
            position,
            rope_row,
            len: 0,
            recorded: None,
        })
    }

    /// Runs `prompt` (the model's one sequence) into an empty cache's first positions,
    /// leaving their normalized hidden states for `logits_at`.
    pub fn forward_cached(&mut self, b: &B, prompt: &[i32], cache: &mut KvCache<B>) -> Result<()> {
        let n = prompt.len();
        ensure!(
            self.options.batch == 1 && n == self.options.seq,
            "a cached pass takes the model's one sequence of {} tokens, not {n}",
            self.options.seq
        );
        self.check_cache(cache, n)?;
        ensure!(
            !cache.has_history(),
            "a prompt must start the KV cache; the tokens after it go through forward_token"
        );
        self.forward_blocks(b, prompt, Some(cache), &mut |_| Ok(()))?;
        cache.len += n;
        Ok(())
    }

    /// Runs `token` at the cache's next position, after a prompt, and returns its logits. The
    /// pass is recorded on its second run and replayed from then on (`Backend::record`).
    pub fn forward_token(&mut self, b: &B, token: i32, cache: &mut KvCache<B>) -> Result<Vec<f32>> {
        ensure!(
            self.options.batch == 1 && self.options.seq == 1,
            "forward_token runs a model of one token a pass, not of {} × {}",
            self.options.batch,
            self.options.seq
        );
        self.check_cache(cache, 1)?;
        ensure!(
            cache.has_history(),
            "the first tokens go through forward_cached, as a prompt"
        );
        self.upload_tokens(b, self.acts(), &[token])?;
        b.upload_i32(&cache.position, &[cache.len as i32])?;
        let mut recorded = match cache.recorded.take() {
            Some((id, recorded)) if id == self.id => recorded,
            _ => Recorded::default(),
        };
        let ran = recorded.run(b, &mut || self.token_pass(b, cache));
        cache.recorded = Some((self.id, recorded));
        ran?;
        cache.len += 1;
        b.download(&self.acts().logits.narrow_rows(0, 1))
    }

    /// A token's pass after its uploads: every block and the final norm over the cache, then
    /// the LM head's row.
    fn token_pass(&self, b: &B, cache: &KvCache<B>) -> Result<()> {
        cache.gather_rope(b)?;
        self.run_blocks(b, Some(cache), &mut |_| Ok(()))?;
        self.head_row(b, 0)
    }

    /// That `cache` was made for this model and has room for `n` more positions.
    fn check_cache(&self, cache: &KvCache<B>, n: usize) -> Result<()> {
        ensure!(
            cache.rows.len() == self.config.num_layers
                && cache.rows[0].shape[1] == self.config.qkv_dim()
                && cache.rows[0].dtype == self.options.dtype,
            "the KV cache was made for another model (Transformer::kv_cache)"
        );
        let capacity = cache.capacity();
        ensure!(
            cache.len + n <= capacity,
            "the KV cache is full ({capacity} positions)"
        );
        Ok(())
    }
}
