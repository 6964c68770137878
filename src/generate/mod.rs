//! Text generation from a trained model, to see what a run learned (`smelt sample`, and the
//! demo's closing sample).
//!
//! The prompt runs through the model in one pass, which fills a KV cache
//! (`Transformer::forward_cached`); each new token then costs one position's work and its
//! attention over the context (`forward_token`, whose pass the GPU records once and
//! replays). `sampling` draws each token from the logits, `codec` turns a
//! prompt's text into tokens and the new tokens back into text, and `text_stream` prints
//! that text as the tokens come.

pub mod codec;
pub mod sampling;
pub mod text_stream;

use anyhow::{Result, bail};

use self::sampling::pick;
use crate::backend::Backend;
use crate::model::{KvCache, ModelConfig, ModelOptions, Transformer};
use crate::rng::Rng;
use crate::tensor::DType;

pub use self::codec::Codec;
pub use self::sampling::Sampling;
pub use self::text_stream::TextStream;

#[derive(Clone, Debug)]
pub struct SampleOptions {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    pub seed: u64,
    /// Tokens that end the sample (the model's EOS).
    pub stop: Vec<i32>,
}

/// A model of one token a pass, for generation.
pub struct Generator<B: Backend> {
    model: Transformer<B>,
    /// The longest context the model accepts.
    max_context: usize,
}

impl<B: Backend> Generator<B> {
    /// A generator with weights of `dtype`, which `load` fills in.
    pub fn new(
        b: &B, config: ModelConfig, dtype: DType, load: impl FnOnce(&Transformer<B>) -> Result<()>,
    ) -> Result<Self> {
        let max_context = config.max_position_embeddings.max(1);
        let model = Transformer::new(b, config, ModelOptions::forward_only(1, dtype))?;
        load(&model)?;
        Ok(Generator { model, max_context })
    }

    /// The longest context the model accepts: its `max_position_embeddings`.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// How many of the first tokens of a prompt of `prompt_len` `generate` leaves out: none
    /// if it fits the model's context, else all but the newest half context, as when the
    /// context outgrows the model while sampling.
    pub fn prompt_dropped(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        let capacity = self.capacity(prompt_len, max_new_tokens);
        match max_new_tokens > 0 && prompt_len > capacity {
            true => prompt_len - capacity.div_ceil(2),
            false => 0,
        }
    }

    /// The cache's positions: the whole context if it fits the model.
    fn capacity(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        (prompt_len + max_new_tokens).min(self.max_context)
    }

    /// Continues `prompt`, calling `emit` with each new token; returns the new tokens. Once
    /// the context outgrows the model's `max_position_embeddings`, it restarts from its
    /// newest half (the cache is refilled from those tokens), so that long outputs pay for
    /// the refill once every half context rather than at every token. A prompt longer than
    /// that context starts so (`prompt_dropped`).
    pub fn generate(
        &mut self, b: &B, prompt: &[i32], o: &SampleOptions,
        mut emit: impl FnMut(i32) -> Result<()>,
    ) -> Result<Vec<i32>> {
        if prompt.is_empty() {
            bail!("the prompt is empty; give at least one token");
        }
        let vocab = self.model.config.vocab_size;
        if let Some(t) = prompt.iter().find(|&&t| t < 0 || t as usize >= vocab) {
            bail!("prompt token {t} is outside the model's vocabulary of {vocab}");
        }
        let capacity = self.capacity(prompt.len(), o.max_new_tokens);
        let mut rng = Rng::new(o.seed);
        let mut tokens = prompt.to_vec();
        // The context is tokens[start..], all of it in the cache but the newest token.
        let (mut start, mut cache) = (0, None);
        let mut new = vec![];
        for _ in 0..o.max_new_tokens {
            let overflow = tokens.len() - start > capacity;
            if overflow {
                start = tokens.len() - capacity.div_ceil(2);
            }
            let logits = match cache.as_mut().filter(|_| !overflow) {
                Some(cache) => self
                    .model
                    .forward_token(b, tokens[tokens.len() - 1], cache)?,
                None => {
                    // The old cache goes first, so that its memory can serve the new one.
                    drop(cache.take());
                    let (filled, logits) = self.prompt_pass(b, &tokens[start..], capacity)?;
                    cache = Some(filled);
                    logits
                }
            };
            let next = pick(&logits, &o.sampling, &mut rng);
            tokens.push(next);
            new.push(next);
            emit(next)?;
            if o.stop.contains(&next) {
                break;
            }
        }
        Ok(new)
    }

    /// Runs `context` through the model in one pass, filling a new cache of `capacity`
    /// positions; returns the cache and the logits of the context's last position.
    fn prompt_pass(
        &self, b: &B, context: &[i32], capacity: usize,
    ) -> Result<(KvCache<B>, Vec<f32>)> {
        let options = ModelOptions::forward_only(context.len(), self.model.options.dtype);
        let mut pass = Transformer::sharing_weights(b, &self.model, options)?;
        let mut cache = self.model.kv_cache(b, capacity)?;
        pass.forward_cached(b, context, &mut cache)?;
        Ok((cache, pass.logits_at(b, context.len() - 1)?))
    }
}
