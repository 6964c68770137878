//! Throughput figures: model FLOPs per token and MFU.

use crate::model::ModelConfig;

/// Training FLOPs per token of a `seq`-long sequence: 6 per weight used in a matmul (2 in the
/// forward, 4 in the backward; the embedding lookup is no matmul, the LM head is), plus
/// attention's QKᵀ and AV, counted at half because the mask is causal (ml_dataflow's
/// formula). Recomputation is not counted: it is work the model does not need.
pub fn flops_per_token(config: &ModelConfig, seq: usize) -> f64 {
    let (c, f, v) = (
        config.hidden_size as f64,
        config.intermediate_size as f64,
        config.vocab_size as f64,
    );
    let layer_weights = config.qkv_dim() as f64 * c + c * config.q_dim() as f64 + 3.0 * f * c;
    let weights = config.num_layers as f64 * layer_weights + v * c;
    // Per layer and token: QKᵀ and AV are 2·T·q_dim FLOPs each in the forward, ×3 with the
    // backward, ×½ for the causal mask.
    let attention = config.num_layers as f64 * 6.0 * seq as f64 * config.q_dim() as f64;
    6.0 * weights + attention
}

/// Model FLOPs utilisation: achieved model FLOP/s over the device's peak.
pub fn mfu(flops_per_token: f64, tokens_per_second: f64, peak_flops: Option<f64>) -> Option<f64> {
    peak_flops.map(|peak| flops_per_token * tokens_per_second / peak)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn qwen_half_b_costs_about_three_gflop_per_token() {
        // Qwen2.5-0.5B's shape. DESIGN.md quotes ~3.0 GFLOP per token at seq 1024.
        let config = ModelConfig::from_json(
            &json!({
                "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
                "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": true
            }),
            "qwen2.5-0.5b",
        )
        .unwrap();
        let gflop = flops_per_token(&config, 1024) / 1e9;
        // 6·(358M matmul weights + 136M head) ≈ 2.96 G, plus 6·24·1024·896 ≈ 0.13 G attention.
        assert!((gflop - 3.1).abs() < 0.1, "{gflop}");
        assert_eq!(mfu(1e9, 100.0, None), None);
        assert_eq!(mfu(1e9, 100.0, Some(1e12)), Some(0.1));
    }
}
