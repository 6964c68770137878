//! Tiny models and batches shared by the integration tests.
#![allow(dead_code)]

use serde_json::json;
use smelt::backend::cpu::{Cpu, IGNORE_INDEX, Scalar};
use smelt::backend::prelude::*;
use smelt::model::{
    Gradients, MatmulPrecision, ModelConfig, ModelOptions, Recompute, Transformer, Weights,
};
use smelt::rng::Rng;
use smelt::tensor::DType;

/// A tiny config with GQA (4 query heads, 2 kv heads) and head_dim 6 ≠ hidden/heads = 4.
pub fn tiny_config(arch: &str, tied: bool) -> ModelConfig {
    let v = json!({
        "architectures": [arch], "hidden_size": 16, "intermediate_size": 20, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6, "vocab_size": 23,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tied, "eos_token_id": [1, 2],
    });
    ModelConfig::from_json(&v, "tiny config").unwrap()
}

/// The shapes every model-level test runs on.
pub fn tiny_configs() -> Vec<(&'static str, ModelConfig)> {
    vec![
        ("llama untied", tiny_config("LlamaForCausalLM", false)),
        ("llama tied", tiny_config("LlamaForCausalLM", true)),
        ("qwen2 untied", tiny_config("Qwen2ForCausalLM", false)),
        ("qwen2 tied", tiny_config("Qwen2ForCausalLM", true)),
        ("qwen3 tied", tiny_config("Qwen3ForCausalLM", true)),
    ]
}

pub fn options(
    batch: usize, seq: usize, dtype: DType, recompute: Recompute, lmhead_chunks: usize,
) -> ModelOptions {
    ModelOptions {
        batch,
        seq,
        dtype,
        recompute,
        offload_residual: false,
        offload_activations: false,
        lmhead_chunks,
        ffn_chunks: 1,
        matmul: MatmulPrecision::Native,
        gradients: Gradients::All,
        weights: Weights::All,
        offload_weights: false,
        offload_gradients: false,
        documents: None,
        micro_batches: 1,
        record_passes: false,
    }
}

/// Weights large enough that every path contributes visibly to the gradient (the usual
/// 0.02 init makes attention nearly uniform and hides mistakes in it).
pub fn randomize<T: Scalar>(cpu: &Cpu<T>, model: &Transformer<Cpu<T>>, seed: u64) {
    let mut rng = Rng::new(seed);
    for (spec, t) in model.layout.zip(&model.params) {
        let is_norm = spec.tensor.shape.len() == 1 && spec.hf[0].0.contains("norm");
        cpu.update(t, |v| {
            for x in v.iter_mut() {
                let r = rng.normal();
                *x = T::of(if is_norm { 1.0 + 0.2 * r } else { 0.4 * r });
            }
        })
        .unwrap();
    }
}

/// Random tokens, targets shifted by one, and a few ignored targets.
pub fn batch(n: usize, vocab: usize, seed: u64) -> (Vec<i32>, Vec<i32>) {
    let mut rng = Rng::new(seed);
    let stream: Vec<i32> = (0..=n).map(|_| rng.below(vocab) as i32).collect();
    let mut targets = stream[1..].to_vec();
    targets[n / 3] = IGNORE_INDEX;
    targets[n - 1] = IGNORE_INDEX;
    (stream[..n].to_vec(), targets)
}

/// The token that ends each document of `packed_batch`.
pub const EOS: i32 = 0;

/// `batch`'s tokens and targets with documents packed into each sequence of `seq`: each ends
/// with `EOS`, which no other token is, and their lengths are drawn from [1, 2·mean) (the
/// last of a sequence cut where it ends).
pub fn packed_batch(
    n: usize, seq: usize, mean: usize, vocab: usize, seed: u64,
) -> (Vec<i32>, Vec<i32>) {
    let (mut tokens, mut targets) = batch(n, vocab, seed);
    let mut rng = Rng::new(seed ^ 0x5eed);
    for sequence in tokens.chunks_mut(seq) {
        let mut t = 0;
        for token in sequence.iter_mut() {
            *token = (*token).max(1);
        }
        loop {
            t += 1 + rng.below(2 * mean - 1);
            if t > sequence.len() {
                break;
            }
            sequence[t - 1] = EOS;
        }
    }
    // Each target is the next token, where it is trained.
    for i in 0..n - 1 {
        if targets[i] != IGNORE_INDEX {
            targets[i] = tokens[i + 1];
        }
    }
    (tokens, targets)
}

pub fn trained_tokens(targets: &[i32]) -> usize {
    targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
}

/// Every gradient tensor's values, by parameter name.
pub fn gradients<B: Backend>(b: &B, model: &Transformer<B>) -> Vec<(String, Vec<f64>)> {
    model
        .layout
        .zip(model.grads())
        .map(|(spec, g)| (spec.tensor.name.clone(), b.download_f64(g).unwrap()))
        .collect()
}

/// The largest |a − b| over the pairs of elements.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The largest |x|.
pub fn max_abs(a: &[f64]) -> f64 {
    a.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// Each position's logits of `tokens` as generation makes them: the first `prompt` in one
/// pass that fills a KV cache, then one token a pass by `model` (a model of one token a
/// pass, `ModelOptions::forward_only(1, _)`).
pub fn cached_logits<B: Backend>(
    b: &B, model: &mut Transformer<B>, tokens: &[i32], prompt: usize,
) -> Vec<Vec<f32>> {
    let options = ModelOptions::forward_only(prompt, model.options.dtype);
    let mut prompt_pass = Transformer::sharing_weights(b, model, options).unwrap();
    let mut cache = model.kv_cache(b, tokens.len()).unwrap();
    prompt_pass
        .forward_cached(b, &tokens[..prompt], &mut cache)
        .unwrap();
    let mut logits: Vec<Vec<f32>> = (0..prompt)
        .map(|t| prompt_pass.logits_at(b, t).unwrap())
        .collect();
    for &t in &tokens[prompt..] {
        logits.push(model.forward_token(b, t, &mut cache).unwrap());
    }
    logits
}

/// Each position's logits of `tokens` from one forward pass over all of them, with the
/// weights of `like`.
pub fn full_logits<B: Backend>(b: &B, like: &Transformer<B>, tokens: &[i32]) -> Vec<Vec<f32>> {
    let options = ModelOptions::forward_only(tokens.len(), like.options.dtype);
    let mut model = Transformer::new(b, like.config.clone(), options).unwrap();
    for (dst, src) in model.params.zip(&like.params) {
        b.copy(dst, src).unwrap();
    }
    model.forward_hidden(b, tokens).unwrap();
    (0..tokens.len())
        .map(|t| model.logits_at(b, t).unwrap())
        .collect()
}

/// The largest |a − b| over all positions' logits, relative to the largest |b|.
pub fn logits_rel_err(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (a, b): (Vec<f64>, Vec<f64>) = (
        a.iter().flatten().map(|&x| x as f64).collect(),
        b.iter().flatten().map(|&x| x as f64).collect(),
    );
    assert_eq!(a.len(), b.len());
    max_abs_diff(&a, &b) / max_abs(&b)
}

pub mod gpu;
