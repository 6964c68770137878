//! The CPU backend against HF transformers: fixtures written by `scripts/hf_fixtures.py`
//! (tiny random Llama, Qwen2, Qwen3 and Mistral models, tied and untied, GQA, head_dim ≠ hidden/heads,
//! llama3 RoPE scaling, one stored in bf16), loaded through the real import path.

use std::path::{Path, PathBuf};

use smelt::backend::cpu::{Cpu, IGNORE_INDEX};
use smelt::backend::prelude::*;
use smelt::io::hf;
use smelt::io::tensors::{MappedFile, decode};
use smelt::model::{
    Gradients, LossOptions, MatmulPrecision, ModelOptions, Recompute, Transformer, Weights,
};
use smelt::tensor::DType;

const FIXTURES: [&str; 6] = [
    "llama_untied",
    "llama_tied",
    "qwen2_untied",
    "qwen2_tied",
    "mistral",
    "qwen3",
];

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// The reference file's tensors, decoded to f32 (tokens as i32).
struct Reference {
    file: MappedFile,
    path: PathBuf,
}

impl Reference {
    fn open(dir: &Path) -> Reference {
        let path = dir.join("reference.safetensors");
        Reference {
            file: MappedFile::open(&path).unwrap(),
            path,
        }
    }
    fn floats(&self, name: &str) -> Vec<f32> {
        let st = self.file.tensors(&self.path).unwrap();
        let view = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("{name} missing from the reference"));
        if view.dtype() == safetensors::Dtype::F64 {
            return view
                .data()
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap()) as f32)
                .collect();
        }
        decode(&view, &self.path, name).unwrap()
    }
    fn ints(&self, name: &str) -> Vec<i32> {
        let st = self.file.tensors(&self.path).unwrap();
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
}

#[test]
fn cpu_matches_transformers() {
    // The reference is float64 and smelt's CPU runs in float32: both tolerances leave a
    // margin of ~100x over f32 accumulation error at these sizes, while any wrong op (a
    // RoPE convention, a missing bias, a mis-split fused tensor) costs orders more.
    const MIN_COSINE: f64 = 0.9999;
    const MAX_LOSS_REL: f64 = 1e-4;
    let cpu = Cpu::<f32>::new();
    for name in FIXTURES {
        let dir = fixture_dir(name);
        let reference = Reference::open(&dir);
        let (tokens, targets) = (reference.ints("tokens"), reference.ints("targets"));
        let config = hf::read_config(&dir).unwrap();
        let vocab = config.vocab_size;
        let options = ModelOptions {
            batch: 2,
            seq: 16,
            dtype: DType::F32,
            recompute: Recompute::default(),
            offload_residual: false,
            offload_activations: false,
            lmhead_chunks: 3,
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
        let mut model = Transformer::new(&cpu, config, options).unwrap();
        hf::import(&cpu, &model, &dir).unwrap();

        let trained = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
        let loss = LossOptions {
            grad_scale: 1.0 / trained as f32,
            z_loss: 0.0,
            accumulate: false,
        };
        model
            .forward_backward(&cpu, &tokens, &targets, loss)
            .unwrap();
        let ours = model.loss_sum(&cpu).unwrap() / trained as f64;
        let theirs = reference.floats("loss")[0] as f64;
        let rel = (ours - theirs).abs() / theirs.abs();
        assert!(
            rel <= MAX_LOSS_REL,
            "{name}: loss {ours} vs transformers {theirs} (relative error {rel:e})"
        );

        let logits: Vec<f32> = (0..tokens.len())
            .flat_map(|row| model.logits_at(&cpu, row).unwrap())
            .collect();
        let ref_logits = reference.floats("logits");
        assert_eq!(logits.len(), tokens.len() * vocab);
        let c = cosine(&logits, &ref_logits);
        assert!(c >= MIN_COSINE, "{name}: logits cosine {c}");

        for (spec, grad) in model.layout.zip(model.grads()) {
            let values = cpu.download(grad).unwrap();
            for slice in spec.hf_slices() {
                let c = cosine(
                    &values[slice.range.clone()],
                    &reference.floats(&format!("grad.{}", slice.name)),
                );
                assert!(
                    c >= MIN_COSINE,
                    "{name}: gradient of {} has cosine {c}",
                    slice.name
                );
            }
        }
    }
}

#[test]
fn exported_directories_load_in_transformers() {
    // Written by `scripts/hf_fixtures.py --check-export target/release/smelt`, which exports
    // every fixture with `smelt export`, loads the result with transformers and recomputes
    // the loss there.
    let path = fixture_dir("export_check.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("{} is missing; run the fixture script", path.display()));
    let check: serde_json::Value = serde_json::from_str(&text).unwrap();
    for name in FIXTURES {
        let r = &check["models"][name];
        assert_eq!(
            r["keys_match"], true,
            "{name}: transformers saw different tensors after export"
        );
        // Mistral's config opens a 4096-token window unless told otherwise.
        let window = r["sliding_window"].as_array().unwrap();
        assert_eq!(
            window[0], window[1],
            "{name}: the export's attention window differs"
        );
        // The export stores f32, which holds the fixtures' f32 and bf16 weights exactly.
        assert_eq!(
            r["max_weight_diff"].as_f64(),
            Some(0.0),
            "{name}: weights changed in export"
        );
        let (a, b) = (
            r["reference_loss"].as_f64().unwrap(),
            r["exported_loss"].as_f64().unwrap(),
        );
        assert!(
            (a - b).abs() <= 1e-12 * a.abs(),
            "{name}: loss {b} after export vs {a}"
        );
    }
}
