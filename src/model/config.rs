//! The model's shape, read from (and written back to) a HF `config.json`.
//!
//! Only what smelt implements is accepted. Anything that would change the computation and
//! is not implemented (sliding windows, other activations, other RoPE scalings, dropout) is
//! refused with a message naming the field, never ignored.
//!
//! Mistral's models without a sliding window (Mistral 7B v0.3, Nemo, Small 3) compute exactly
//! Llama's layers; they keep their own class name so that an export loads as what it was.
//! Qwen3 is Llama's layers with an RMSNorm over each query and key head before RoPE
//! (`qk_norm`).

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value, json};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Architecture {
    pub fn hf_class(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }
}

/// Llama 3.1's "llama3" RoPE frequency scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// Training FLOPs per token in matmuls, by the dtype they multiply in: the blocks' linear
/// layers in `--matmul-dtype`, the LM head in the model's dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatmulFlops {
    pub blocks: f64,
    pub head: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (always for Qwen2, never for the others here).
    pub qkv_bias: bool,
    /// An RMSNorm over each query and each key head before RoPE, one weight `[head_dim]` for
    /// the queries and one for the keys (Qwen3).
    pub qk_norm: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Not read by smelt, but kept so that an export says what the model pads with (any
    /// integer, as transformers takes it: some configs give -1).
    pub pad_token_id: Option<i64>,
}

/// Reads fields of one JSON object, naming the file and field in every error.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    source: &'a str,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<usize> {
        match self.get(key) {
            Some(v) => v.as_u64().map(|x| x as usize).with_context(|| {
                format!(
                    "{}: field `{key}` must be a non-negative integer, found {v}",
                    self.source
                )
            }),
            None => bail!("{}: field `{key}` is missing", self.source),
        }
    }

    /// A size that must be at least 1.
    fn positive(&self, key: &str) -> Result<usize> {
        let n = self.usize(key)?;
        if n == 0 {
            bail!("{}: field `{key}` must be at least 1", self.source);
        }
        Ok(n)
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.get(key).is_some() {
            self.usize(key)
        } else {
            Ok(default)
        }
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            Some(v) => v.as_f64().with_context(|| {
                format!("{}: field `{key}` must be a number, found {v}", self.source)
            }),
            None => Ok(default),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            Some(v) => v.as_bool().with_context(|| {
                format!(
                    "{}: field `{key}` must be true or false, found {v}",
                    self.source
                )
            }),
            None => Ok(default),
        }
    }

    fn str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// `bos/eos_token_id` may be an int or a list of ints.
    fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = || {
            format!(
                "{}: field `{key}` must be an integer or a list of integers",
                self.source
            )
        };
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().map(|x| x as u32).with_context(bad))
                .collect(),
            Some(v) => Ok(vec![v.as_u64().with_context(bad)? as u32]),
        }
    }

    fn refuse_if(&self, key: &str, unsupported: impl Fn(&Value) -> bool, why: &str) -> Result<()> {
        if let Some(v) = self.get(key)
            && unsupported(v)
        {
            bail!(
                "{}: field `{key}` = {v} is not supported: {why}",
                self.source
            );
        }
        Ok(())
    }
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let value: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_json(&value, &path.display().to_string())
    }

    /// Parses a HF config. `source` names the file in error messages.
    pub fn from_json(value: &Value, source: &str) -> Result<Self> {
        let map = value
            .as_object()
            .with_context(|| format!("{source}: expected a JSON object"))?;
        let f = Fields { map, source };

        let architecture = Self::architecture(&f)?;
        f.refuse_if(
            "hidden_act",
            |v| v != "silu",
            "only SiLU (SwiGLU) MLPs are implemented",
        )?;
        f.refuse_if(
            "mlp_bias",
            |v| v == &Value::Bool(true),
            "MLP biases are not implemented",
        )?;
        f.refuse_if(
            "use_sliding_window",
            |v| v == &Value::Bool(true),
            "sliding-window attention is not implemented",
        )?;
        f.refuse_if(
            "layer_types",
            |v| {
                v.as_array()
                    .is_none_or(|types| types.iter().any(|t| t != "full_attention"))
            },
            "only full attention is implemented (every entry \"full_attention\")",
        )?;
        f.refuse_if(
            "attention_dropout",
            |v| v.as_f64() != Some(0.0),
            "dropout is not implemented",
        )?;
        f.refuse_if(
            "pretraining_tp",
            |v| v.as_u64() != Some(1),
            "tensor-parallel pretraining slices are not implemented",
        )?;
        if architecture != Architecture::Qwen2 {
            f.refuse_if(
                "attention_bias",
                |v| v == &Value::Bool(true),
                "attention biases are implemented for Qwen2 only",
            )?;
        }

        let hidden_size = f.positive("hidden_size")?;
        let num_heads = f.usize("num_attention_heads")?;
        let num_kv_heads = f.usize_or("num_key_value_heads", num_heads)?;
        if num_heads == 0 || hidden_size % num_heads != 0 && f.get("head_dim").is_none() {
            bail!(
                "{source}: `hidden_size` {hidden_size} is not a multiple of `num_attention_heads` {num_heads}, and there is no `head_dim`"
            );
        }
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            bail!(
                "{source}: `num_attention_heads` {num_heads} must be a multiple of `num_key_value_heads` {num_kv_heads}"
            );
        }
        let head_dim = f.usize_or("head_dim", hidden_size / num_heads)?;
        if head_dim % 2 != 0 {
            bail!("{source}: `head_dim` {head_dim} must be even for rotary embeddings");
        }
        let (rope_theta, rope_scaling) = Self::rope(&f)?;
        let max_position_embeddings = f.usize_or("max_position_embeddings", 2048)?;
        // Qwen2 turns its window on with `use_sliding_window` (refused above); Mistral's
        // applies whenever it is set, and changes nothing only where it spans every position.
        if architecture == Architecture::Mistral {
            f.refuse_if(
                "sliding_window",
                |v| {
                    v.as_u64()
                        .is_none_or(|w| (w as usize) < max_position_embeddings)
                },
                "sliding-window attention is not implemented (null, or a window of at least \
                 `max_position_embeddings`, is)",
            )?;
        }

        Ok(ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: f.positive("intermediate_size")?,
            num_layers: f.positive("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: f.positive("vocab_size")?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            qkv_bias: architecture == Architecture::Qwen2,
            qk_norm: architecture == Architecture::Qwen3,
            max_position_embeddings,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            pad_token_id: (f.get("pad_token_id"))
                .map(|v| {
                    v.as_i64().with_context(|| {
                        format!(
                            "{}: field `pad_token_id` must be an integer, found {v}",
                            f.source
                        )
                    })
                })
                .transpose()?,
        })
    }

    fn architecture(f: &Fields) -> Result<Architecture> {
        let listed: Vec<&str> = match f.get("architectures") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let name = match (listed.as_slice(), f.str("model_type")) {
            ([one], _) => *one,
            ([], Some("llama")) => "LlamaForCausalLM",
            ([], Some("mistral")) => "MistralForCausalLM",
            ([], Some("qwen2")) => "Qwen2ForCausalLM",
            ([], Some("qwen3")) => "Qwen3ForCausalLM",
            ([], _) => bail!(
                "{}: field `architectures` is missing (expected one of [\"LlamaForCausalLM\"], [\"MistralForCausalLM\"], [\"Qwen2ForCausalLM\"], [\"Qwen3ForCausalLM\"])",
                f.source
            ),
            (many, _) => bail!(
                "{}: field `architectures` lists {many:?}; smelt expects exactly one",
                f.source
            ),
        };
        match name {
            "LlamaForCausalLM" => Ok(Architecture::Llama),
            "MistralForCausalLM" => Ok(Architecture::Mistral),
            "Qwen2ForCausalLM" => Ok(Architecture::Qwen2),
            "Qwen3ForCausalLM" => Ok(Architecture::Qwen3),
            other => bail!(
                "{}: field `architectures` is [\"{other}\"], which smelt does not support; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
                f.source
            ),
        }
    }

    /// `rope_theta` and `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5).
    fn rope(f: &Fields) -> Result<(f64, Option<RopeScaling>)> {
        let params = f.get("rope_parameters").or_else(|| f.get("rope_scaling"));
        let key = if f.get("rope_parameters").is_some() {
            "rope_parameters"
        } else {
            "rope_scaling"
        };
        let mut theta = f.f64_or("rope_theta", 10000.0)?;
        let Some(params) = params else {
            return Ok((theta, None));
        };
        let map = params
            .as_object()
            .with_context(|| format!("{}: field `{key}` must be an object", f.source))?;
        let p = Fields {
            map,
            source: f.source,
        };
        theta = p.f64_or("rope_theta", theta)?;
        let kind = p
            .str("rope_type")
            .or_else(|| p.str("type"))
            .unwrap_or("default");
        match kind {
            "default" => Ok((theta, None)),
            "llama3" => {
                let need = |k: &str| {
                    p.f64_or(k, f64::NAN).and_then(|x| {
                        if x.is_nan() {
                            bail!("{}: field `{key}.{k}` is missing", f.source)
                        } else {
                            Ok(x)
                        }
                    })
                };
                let original = p
                    .get("original_max_position_embeddings")
                    .and_then(Value::as_f64);
                Ok((
                    theta,
                    Some(RopeScaling {
                        factor: need("factor")?,
                        low_freq_factor: need("low_freq_factor")?,
                        high_freq_factor: need("high_freq_factor")?,
                        original_max_position_embeddings: match original {
                            Some(x) if x >= 1.0 && x.fract() == 0.0 => x as usize,
                            _ => bail!(
                                "{}: field `{key}.original_max_position_embeddings` must be a positive integer",
                                f.source
                            ),
                        },
                    }),
                ))
            }
            other => bail!(
                "{}: field `{key}` has rope type \"{other}\", which is not supported (supported: default, llama3)",
                f.source
            ),
        }
    }

    /// The HF `config.json` that describes this model, loadable by transformers.
    pub fn to_hf_json(&self) -> Value {
        let mut v = json!({
            "architectures": [self.architecture.hf_class()],
            "model_type": self.architecture.model_type(),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        });
        let obj = v.as_object_mut().expect("built as an object");
        if let Some(s) = &self.rope_scaling {
            obj.insert(
                "rope_scaling".into(),
                json!({
                    "rope_type": "llama3",
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                }),
            );
        }
        match self.architecture {
            Architecture::Llama | Architecture::Qwen3 => {
                obj.insert("attention_bias".into(), json!(false));
            }
            // transformers' MistralConfig defaults to a 4096-token window.
            Architecture::Mistral => {
                obj.insert("sliding_window".into(), Value::Null);
            }
            Architecture::Qwen2 => {}
        }
        if let Some(bos) = self.bos_token_id {
            obj.insert("bos_token_id".into(), json!(bos));
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => {
                obj.insert("eos_token_id".into(), json!(one));
            }
            many => {
                obj.insert("eos_token_id".into(), json!(many));
            }
        }
        if let Some(pad) = self.pad_token_id {
            obj.insert("pad_token_id".into(), json!(pad));
        }
        v
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Rows of the fused QKV weight: q heads, then k heads, then v heads.
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }

    /// Parameters in the model (tied embeddings counted once).
    pub fn num_parameters(&self) -> usize {
        let c = self.hidden_size;
        let heads = if self.tie_word_embeddings { 1 } else { 2 };
        self.num_layers * self.block_parameters() + c + heads * self.vocab_size * c
    }

    /// Parameters in one block.
    pub fn block_parameters(&self) -> usize {
        let (c, f) = (self.hidden_size, self.intermediate_size);
        let bias = if self.qkv_bias { self.qkv_dim() } else { 0 };
        let qk_norm = if self.qk_norm { 2 * self.head_dim } else { 0 };
        2 * c + self.qkv_dim() * c + bias + qk_norm + c * self.q_dim() + 3 * f * c
    }

    /// Training FLOPs per token at sequence length `seq`: forward plus backward (3x the
    /// forward) of every matmul, with causal attention counted at half of its square, as in
    /// ml_dataflow's and the PyTorch baseline's formula, so MFU figures compare directly.
    pub fn training_flops_per_token(&self, seq: usize) -> f64 {
        let matmuls = self.training_matmul_flops_per_token();
        matmuls.blocks + matmuls.head + self.training_attention_flops_per_token(seq)
    }

    /// The part of `training_flops_per_token` in matmuls (forward and backward), which
    /// does not depend on the sequence length.
    pub fn training_matmul_flops_per_token(&self) -> MatmulFlops {
        let (c, f) = (self.hidden_size as f64, self.intermediate_size as f64);
        let linear = 2.0 * c * (self.qkv_dim() as f64 + self.q_dim() as f64 + 3.0 * f);
        let head = 2.0 * c * self.vocab_size as f64;
        MatmulFlops {
            blocks: 3.0 * self.num_layers as f64 * linear,
            head: 3.0 * head,
        }
    }

    /// The part of `training_flops_per_token` in attention's score and value products, which
    /// grows with the sequence and runs in the attention kernels rather than in matmuls.
    pub fn training_attention_flops_per_token(&self, seq: usize) -> f64 {
        let forward = 0.5 * 2.0 * 2.0 * seq as f64 * self.q_dim() as f64;
        3.0 * self.num_layers as f64 * forward
    }

    /// The RoPE inverse frequencies, one per rotated pair, with llama3 scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        let base: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d))
            .collect();
        let Some(s) = &self.rope_scaling else {
            return base;
        };
        let context = s.original_max_position_embeddings as f64;
        let (low_wavelen, high_wavelen) =
            (context / s.low_freq_factor, context / s.high_freq_factor);
        base.into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    f / s.factor
                } else {
                    let smooth = (context / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen() -> Value {
        json!({
            "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": true,
            "eos_token_id": 7, "hidden_act": "silu", "use_sliding_window": false
        })
    }

    #[test]
    fn reads_qwen2_with_defaults() {
        let c = ModelConfig::from_json(&qwen(), "config.json").unwrap();
        assert_eq!(c.architecture, Architecture::Qwen2);
        assert!(c.qkv_bias && c.tie_word_embeddings);
        assert_eq!(
            (c.head_dim, c.qkv_dim(), c.eos_token_ids.clone()),
            (16, 128, vec![7])
        );
    }

    #[test]
    fn reads_llama31_head_dim_and_eos_list() {
        let v = json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 24,
            "vocab_size": 100, "eos_token_id": [1, 2], "bos_token_id": 0, "pad_token_id": -1,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        });
        let c = ModelConfig::from_json(&v, "config.json").unwrap();
        assert_eq!(
            (c.head_dim, c.q_dim(), c.eos_token_ids.clone()),
            (24, 96, vec![1, 2])
        );
        assert!(!c.qkv_bias && !c.tie_word_embeddings);
        assert_eq!(c.rope_scaling.as_ref().unwrap().factor, 8.0);
        assert_eq!(c.pad_token_id, Some(-1));
        // Round trip through the exported form.
        assert_eq!(ModelConfig::from_json(&c.to_hf_json(), "x").unwrap(), c);
    }

    #[test]
    fn reads_mistral_without_a_window_and_refuses_one() {
        let mistral = |window: Value| {
            let v = json!({
                "architectures": ["MistralForCausalLM"], "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": null, "vocab_size": 100,
                "max_position_embeddings": 32768, "sliding_window": window
            });
            ModelConfig::from_json(&v, "m/config.json")
        };
        let c = mistral(Value::Null).unwrap();
        assert_eq!(
            (c.architecture, c.head_dim, c.qkv_bias),
            (Architecture::Mistral, 16, false)
        );
        // Exported with the window spelled out as null, or transformers would open one of 4096.
        let exported = c.to_hf_json();
        assert_eq!(exported["sliding_window"], Value::Null);
        assert_eq!(exported["model_type"], "mistral");
        assert_eq!(ModelConfig::from_json(&exported, "x").unwrap(), c);
        assert!(
            mistral(json!(32768)).is_ok(),
            "a window over every position changes nothing"
        );
        let err = mistral(json!(4096)).unwrap_err().to_string();
        assert!(
            err.contains("m/config.json: field `sliding_window` = 4096"),
            "{err}"
        );
    }

    #[test]
    fn reads_transformers5_rope_parameters() {
        let mut v = qwen();
        v.as_object_mut().unwrap().remove("rope_theta");
        v["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 5e5});
        assert_eq!(ModelConfig::from_json(&v, "c").unwrap().rope_theta, 5e5);
    }

    #[test]
    fn refusals_name_the_field() {
        let err = |v: Value| {
            ModelConfig::from_json(&v, "m/config.json")
                .unwrap_err()
                .to_string()
        };
        let mut v = qwen();
        v["architectures"] = json!(["GemmaForCausalLM"]);
        assert!(err(v).contains("m/config.json: field `architectures` is [\"GemmaForCausalLM\"]"));
        let mut v = qwen();
        v["use_sliding_window"] = json!(true);
        assert!(err(v).contains("`use_sliding_window`"));
        let mut v = qwen();
        v["rope_scaling"] = json!({"type": "yarn", "factor": 4.0});
        assert!(err(v).contains("rope type \"yarn\""));
        let mut v = qwen();
        v.as_object_mut().unwrap().remove("vocab_size");
        assert!(err(v).contains("field `vocab_size` is missing"));
        let mut v = qwen();
        v["hidden_act"] = json!("gelu");
        assert!(err(v).contains("`hidden_act`"));
    }

    #[test]
    fn llama3_scaling_matches_hf_rule() {
        let mut c = ModelConfig::from_json(&qwen(), "c").unwrap();
        c.rope_theta = 500000.0;
        let plain = c.rope_inv_freq();
        c.rope_scaling = Some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        });
        let scaled = c.rope_inv_freq();
        // High frequencies (short wavelengths) are untouched, the lowest are divided by the factor.
        assert_eq!(scaled[0], plain[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-18);
    }
}
