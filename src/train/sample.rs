//! Text generation from a trained model, to see what a run learned: greedy (temperature 0)
//! or temperature sampling.
//!
//! There is no KV cache: each new token reruns the whole context. The model is sized to the
//! next power of two above the context and regrown as it lengthens, so a short prompt does
//! not pay for the longest context. That is slow for long outputs, and fine for a check.

use anyhow::{Result, bail};

use crate::backend::Backend;
use crate::model::{ModelConfig, ModelOptions, Transformer};
use crate::rng::Rng;
use crate::tensor::DType;

#[derive(Clone, Debug)]
pub struct SampleOptions {
    pub max_new_tokens: usize,
    /// 0 picks the most likely token.
    pub temperature: f32,
    pub seed: u64,
    /// Tokens that end the sample (the model's EOS).
    pub stop: Vec<i32>,
}

/// A batch-1 model for generation.
pub struct Generator<B: Backend> {
    model: Transformer<B>,
    /// The longest context the model accepts.
    max_context: usize,
}

impl<B: Backend> Generator<B> {
    /// A generator with weights of `dtype`, which `load` fills in.
    pub fn new(
        b: &B,
        config: ModelConfig,
        dtype: DType,
        load: impl FnOnce(&Transformer<B>) -> Result<()>,
    ) -> Result<Self> {
        let max_context = config.max_position_embeddings.max(1);
        let model = Transformer::new(
            b,
            config,
            ModelOptions::forward_only(max_context.min(64), dtype),
        )?;
        load(&model)?;
        Ok(Generator { model, max_context })
    }

    /// Regrows the model so that it holds `len` positions.
    fn reserve(&mut self, b: &B, len: usize) -> Result<()> {
        if len <= self.model.options.seq {
            return Ok(());
        }
        let seq = len.next_power_of_two().min(self.max_context);
        let options = ModelOptions::forward_only(seq, self.model.options.dtype);
        let bigger = Transformer::new(b, self.model.config.clone(), options)?;
        for (dst, src) in bigger.params.zip(&self.model.params) {
            b.copy(dst, src)?;
        }
        self.model = bigger;
        Ok(())
    }

    /// Continues `prompt`, calling `emit` with each new token; returns the new tokens. The
    /// context slides once it is longer than the model's `max_position_embeddings`.
    pub fn generate(
        &mut self,
        b: &B,
        prompt: &[i32],
        o: &SampleOptions,
        mut emit: impl FnMut(i32) -> Result<()>,
    ) -> Result<Vec<i32>> {
        if prompt.is_empty() {
            bail!("the prompt is empty; give at least one token");
        }
        let vocab = self.model.config.vocab_size;
        if let Some(t) = prompt.iter().find(|&&t| t < 0 || t as usize >= vocab) {
            bail!("prompt token {t} is outside the model's vocabulary of {vocab}");
        }
        let mut rng = Rng::new(o.seed);
        let mut tokens = prompt.to_vec();
        let mut new = vec![];
        for _ in 0..o.max_new_tokens {
            let context = &tokens[tokens.len().saturating_sub(self.max_context)..];
            self.reserve(b, context.len())?;
            let mut input = vec![0; self.model.options.seq];
            input[..context.len()].copy_from_slice(context);
            // Causal attention: the padding after the context does not change its logits.
            self.model.forward_hidden(b, &input)?;
            let logits = self.model.logits_at(b, context.len() - 1)?;
            let next = pick(&logits, o.temperature, &mut rng);
            tokens.push(next);
            new.push(next);
            emit(next)?;
            if o.stop.contains(&next) {
                break;
            }
        }
        Ok(new)
    }
}

/// The most likely token at temperature 0, else a draw from softmax(logits / temperature).
fn pick(logits: &[f32], temperature: f32, rng: &mut Rng) -> i32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if temperature <= 0.0 {
        return logits.iter().position(|&l| l == max).unwrap_or(0) as i32;
    }
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| (((l - max) / temperature) as f64).exp())
        .collect();
    let mut u = rng.uniform() * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i as i32;
        }
        u -= w;
    }
    (weights.len() - 1) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum_and_sampling_follows_the_softmax() {
        let mut rng = Rng::new(1);
        assert_eq!(pick(&[0.0, 3.0, 3.0, 1.0], 0.0, &mut rng), 1);
        // Probabilities ∝ exp([0, ln 3]) = [1/4, 3/4].
        let logits = [0.0, 3f32.ln()];
        let n = 20_000;
        let ones = (0..n).filter(|_| pick(&logits, 1.0, &mut rng) == 1).count();
        let p = ones as f64 / n as f64;
        // Standard error sqrt(p(1-p)/n) ≈ 0.003; allow 5σ.
        assert!((p - 0.75).abs() < 0.015, "{p}");
    }
}
