//! Times training steps of a ~10M-parameter Llama on the CPU backend:
//! `cargo run --release --example cpu_step [batch] [seq]`.

use std::time::Instant;

use serde_json::json;
use smelt::backend::cpu::Cpu;
use smelt::model::{
    Gradients, LossOptions, MatmulPrecision, ModelConfig, ModelOptions, Recompute, Transformer,
    Weights,
};
use smelt::rng::Rng;
use smelt::tensor::DType;

fn main() -> anyhow::Result<()> {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    };
    let (batch, seq) = (arg(1, 8), arg(2, 256));
    let config = ModelConfig::from_json(
        &json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 384, "intermediate_size": 1024,
                "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 2,
                "vocab_size": 8192, "tie_word_embeddings": true}),
        "cpu_step config",
    )?;
    let params = config.num_parameters();
    let cpu = Cpu::<f32>::new();
    let options = ModelOptions {
        batch,
        seq,
        dtype: DType::F32,
        recompute: Recompute::default(),
        offload_residual: false,
        offload_activations: false,
        lmhead_chunks: 4,
        ffn_chunks: 1,
        matmul: MatmulPrecision::Native,
        gradients: Gradients::All,
        weights: Weights::All,
        offload_weights: false,
        offload_gradients: false,
        documents: None,
        micro_batches: 1,
        record_passes: false,
    };
    let mut model = Transformer::new(&cpu, config, options)?;
    model.init_weights(&cpu, 1)?;
    let mut rng = Rng::new(2);
    let tokens: Vec<i32> = (0..batch * seq + 1)
        .map(|_| rng.below(8192) as i32)
        .collect();
    let loss = LossOptions {
        grad_scale: 1.0 / (batch * seq) as f32,
        z_loss: 0.0,
        accumulate: false,
    };
    for step in 0..4 {
        let start = Instant::now();
        model.forward_backward(&cpu, &tokens[..batch * seq], &tokens[1..], loss)?;
        let mean = model.loss_sum(&cpu)? / (batch * seq) as f64;
        let secs = start.elapsed().as_secs_f64();
        println!(
            "step {step}: {params} params, loss {mean:.4}, {secs:.2} s, {:.0} tok/s",
            (batch * seq) as f64 / secs
        );
    }
    Ok(())
}
