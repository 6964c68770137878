//! Training throughput of a built-in architecture (Qwen2.5-0.5B at batch 32 × 1024 unless
//! SMELT_BENCH_MODEL and SMELT_BENCH_BATCH say otherwise) in bf16 on the GPU: forward,
//! backward, global norm and AdamW per step, on random tokens. The GPU script runs
//! the PyTorch baseline in the same device call and prints the ratio.

mod common;

use std::time::Instant;

use common::gpu::*;
use common::{batch, options, trained_tokens};
use smelt::backend::Backend;
use smelt::model::{LossOptions, Recompute, Transformer, presets};
use smelt::tensor::DType;

/// The datasheet's dense bf16 peak of an H100 SXM, as in the PyTorch baseline's MFU.
const PEAK_FLOPS: f64 = 989e12;

#[test]
#[ignore = "needs a CUDA GPU"]
fn throughput() {
    let gpu = cuda();
    // The row to measure: SMELT_BENCH_MODEL (a built-in architecture) and SMELT_BENCH_BATCH;
    // scripts/gpu/bench.sh runs the rows this way.
    let name = std::env::var("SMELT_BENCH_MODEL").unwrap_or_else(|_| "qwen2.5-0.5b".into());
    let config = presets::preset(&name).unwrap();
    let batch_size: usize =
        std::env::var("SMELT_BENCH_BATCH").map_or(32, |b| b.parse().expect("SMELT_BENCH_BATCH"));
    let seq = 1024;
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
    let optimizer = bf16_adamw(&gpu, &model);
    let test = format!("bench {name} {batch_size}x{seq} bf16");
    let test = test.as_str();
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
        optimizer.step(&gpu, &model, 1e-4, step, 7).unwrap();
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
    let mfu = config.training_flops_per_token(seq) * tokens / step_s / PEAK_FLOPS;
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
