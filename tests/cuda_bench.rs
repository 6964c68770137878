//! Training throughput of Qwen2.5-0.5B's architecture at batch 32 × 1024 in bf16 on the GPU:
//! forward, backward, global norm and AdamW per step, on random tokens. The GPU script runs
//! the PyTorch baseline in the same device call and prints the ratio.

mod common;

use std::time::Instant;

use common::gpu::*;
use common::{batch, options, trained_tokens};
use smelt::backend::Backend;
use smelt::model::{LossOptions, ModelConfig, Recompute, Transformer};
use smelt::tensor::DType;

/// The datasheet's dense bf16 peak of an H100 SXM, as in the PyTorch baseline's MFU.
const PEAK_FLOPS: f64 = 989e12;

/// Model FLOPs per token, as `torch_baseline.py` counts them (causal attention at half).
fn flops_per_token(c: &ModelConfig, seq: usize) -> f64 {
    let (d, f, l, v) = (
        c.hidden_size as f64,
        c.intermediate_size as f64,
        c.num_layers as f64,
        c.vocab_size as f64,
    );
    let dkv = c.kv_dim() as f64;
    let layer = 2.0 * d * (2.0 * d + 2.0 * dkv + 3.0 * f);
    let attn = 0.5 * 2.0 * 2.0 * seq as f64 * d;
    l * (3.0 * layer + 3.0 * attn) + 3.0 * 2.0 * d * v
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn qwen2_5_0_5b_throughput() {
    let gpu = cuda();
    let config = ModelConfig::from_json(
        &serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "tie_word_embeddings": true, "eos_token_id": 151643,
        }),
        "Qwen2.5-0.5B architecture",
    )
    .unwrap();
    let (batch_size, seq) = (32, 1024);
    let model = Transformer::new(
        &gpu,
        config.clone(),
        options(batch_size, seq, DType::BF16, Recompute::default(), 8),
    );
    let mut model = match model {
        Ok(m) => m,
        Err(e) => panic!("{e:#}"),
    };
    model.init_weights(&gpu, 1).unwrap();
    let optimizer = Optimizer::new(&gpu, &model, DType::BF16);
    let test = "bench qwen2.5-0.5b 32x1024 bf16";
    let mut times = vec![];
    let mut last_loss = 0.0;
    for step in 1..=10u64 {
        let (tokens, targets) = batch(batch_size * seq, config.vocab_size, step);
        let loss = LossOptions {
            grad_scale: 1.0 / trained_tokens(&targets) as f32,
            z_loss: 0.0,
            accumulate: false,
        };
        gpu.synchronize().unwrap();
        let start = Instant::now();
        model
            .forward_backward(&gpu, &tokens, &targets, loss)
            .unwrap();
        optimizer.step(&gpu, &model, step, 1e-4);
        gpu.synchronize().unwrap();
        times.push(start.elapsed().as_secs_f64());
        last_loss = model.loss_sum(&gpu).unwrap() / trained_tokens(&targets) as f64;
    }
    // The first steps compile kernels and pick cuBLASLt algorithms.
    let mut steady = times[3..].to_vec();
    steady.sort_by(f64::total_cmp);
    let step_s = steady[steady.len() / 2];
    let tokens = (batch_size * seq) as f64;
    let tok_s = tokens / step_s;
    let mfu = flops_per_token(&config, seq) * tokens / step_s / PEAK_FLOPS;
    figure(
        test,
        format!(
            "{tok_s:.0} tok/s, step {:.1} ms, MFU {mfu:.3}, loss {last_loss:.3}",
            step_s * 1e3
        ),
    );
    println!("SMELT_TOK_S {tok_s:.0}");
    let memory = gpu.memory_report().unwrap();
    println!("memory:\n{memory}");
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let table: Vec<String> = memory
        .categories
        .iter()
        .map(|(name, bytes)| format!("{name} {:.2}", gib(*bytes)))
        .collect();
    figure(
        test,
        format!(
            "memory GiB: {}; device used {:.1} of {:.1}",
            table.join(", "),
            gib(memory.total - memory.free),
            gib(memory.total)
        ),
    );
    assert!(last_loss.is_finite(), "{test}: loss {last_loss}");
}
