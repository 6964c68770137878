//! Named architectures for training from scratch and benchmarks, with the shapes of the
//! published models (and of the PyTorch baseline that `scripts/gpu/bench.sh` runs, so
//! comparisons are like for like; Qwen3's have no such baseline), plus `qwen2-100m`: Qwen2.5's vocabulary around ~100M
//! non-embedding parameters, for experiments (the FP8 convergence check) that need a real
//! model but not a big one.

use anyhow::{Result, bail};
use serde_json::json;

use super::config::ModelConfig;

/// (name, arch, hidden, intermediate, layers, heads, kv heads, head size (0: hidden / heads),
/// vocab, tied, rope theta)
type Shape = (
    &'static str,
    &'static str,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    bool,
    f64,
);

#[rustfmt::skip]
const PRESETS: [Shape; 10] = [
    ("qwen2.5-0.5b",  "Qwen2ForCausalLM",  896,   4864,   24,  14,  2,  0,    151936,  true,   1e6),
    ("qwen2.5-1.5b",  "Qwen2ForCausalLM",  1536,  8960,   28,  12,  2,  0,    151936,  true,   1e6),
    ("qwen2.5-3b",    "Qwen2ForCausalLM",  2048,  11008,  36,  16,  2,  0,    151936,  true,   1e6),
    ("qwen2-100m",    "Qwen2ForCausalLM",  768,   3072,   12,  12,  4,  0,    151936,  true,   1e6),
    ("llama-3.2-1b",  "LlamaForCausalLM",  2048,  8192,   16,  32,  8,  0,    128256,  true,   5e5),
    ("llama-3-8b",    "LlamaForCausalLM",  4096,  14336,  32,  32,  8,  0,    128256,  false,  5e5),
    ("qwen3-0.6b",    "Qwen3ForCausalLM",  1024,  3072,   28,  16,  8,  128,  151936,  true,   1e6),
    ("qwen3-1.7b",    "Qwen3ForCausalLM",  2048,  6144,   28,  16,  8,  128,  151936,  true,   1e6),
    ("qwen3-4b",      "Qwen3ForCausalLM",  2560,  9728,   36,  32,  8,  128,  151936,  true,   1e6),
    ("qwen3-8b",      "Qwen3ForCausalLM",  4096,  12288,  36,  32,  8,  128,  151936,  false,  1e6),
];

pub fn names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.0).collect()
}

/// The config of a named architecture.
pub fn preset(name: &str) -> Result<ModelConfig> {
    let Some(&(_, arch, hidden, inter, layers, heads, kv, head_dim, vocab, tied, theta)) =
        PRESETS.iter().find(|p| p.0 == name)
    else {
        bail!(
            "unknown model preset `{name}`; choose one of {} or give a HF model directory",
            names().join(", ")
        );
    };
    let qwen = arch.starts_with("Qwen");
    let config = json!({
        "architectures": [arch], "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": if head_dim > 0 { head_dim } else { hidden / heads },
        "vocab_size": vocab, "tie_word_embeddings": tied, "rope_theta": theta,
        "rms_norm_eps": if qwen { 1e-6 } else { 1e-5 },
        "max_position_embeddings": if qwen { 32768 } else { 131072 },
        "eos_token_id": if qwen { 151643 } else { 128001 },
    });
    ModelConfig::from_json(&config, &format!("preset {name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen05b_has_its_published_size() {
        // Qwen2.5-0.5B has 494M parameters (0.49B in its model card).
        let c = preset("qwen2.5-0.5b").unwrap();
        assert_eq!(c.num_parameters(), 494_032_768);
        // The performance targets' estimate: about 3.0 GFLOP per token at seq 1024
        // (docs/performance.md).
        let flops = c.training_flops_per_token(1024);
        assert!((flops / 3.0e9 - 1.0).abs() < 0.05, "{flops}");
        // Outside the 117M embedding: 12 × (q, k, v, o and the QKV bias; the MLP; two
        // norms), and the final norm.
        let small = preset("qwen2-100m").unwrap();
        let attention = 768 * 768 * 2 + 2 * 256 * 768 + (768 + 512);
        let layer = attention + 3 * 768 * 3072 + 2 * 768;
        assert_eq!(small.num_parameters() - 151936 * 768, 12 * layer + 768);
        // Qwen3-0.6B: 0.44B outside the embedding (its model card), with 128-wide heads
        // wider than hidden / heads, and each head's q and k norms.
        let qwen3 = preset("qwen3-0.6b").unwrap();
        assert_eq!(
            (qwen3.head_dim, qwen3.q_dim(), qwen3.qk_norm),
            (128, 2048, true)
        );
        assert_eq!(qwen3.num_parameters() - 151936 * 1024, 440_467_456);
        assert!(
            preset("gpt-5")
                .unwrap_err()
                .to_string()
                .contains("qwen2.5-0.5b")
        );
    }
}
