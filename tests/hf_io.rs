//! HF directories in and out: exact round trips, sharded checkpoints, other storage dtypes,
//! and one clear error for each kind of bad input.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use smelt::backend::cpu::Cpu;
use smelt::backend::prelude::*;
use smelt::io::hf;
use smelt::io::tensors::{MappedFile, write_file};
use smelt::model::{ModelConfig, Recompute, Transformer};
use smelt::tensor::DType;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// A scratch copy of a fixture directory, to damage.
fn copy_of(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn model_for(cpu: &Cpu<f32>, config: ModelConfig, dtype: DType) -> Transformer<Cpu<f32>> {
    Transformer::new(cpu, config, options(1, 4, dtype, Recompute::default(), 1)).unwrap()
}

fn weights(cpu: &Cpu<f32>, model: &Transformer<Cpu<f32>>) -> Vec<Vec<u32>> {
    model
        .params
        .iter()
        .map(|t| {
            cpu.download(t)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

/// Replaces `from` by `to` in a copy of a fixture's config.json and returns the import error.
fn error_after_config_edit(name: &str, from: &str, to: &str) -> (String, PathBuf) {
    let dir = copy_of(name);
    let config_path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config_path).unwrap();
    assert!(text.contains(from), "{from} is not in {name}'s config");
    std::fs::write(&config_path, text.replace(from, to)).unwrap();
    (import_error(dir.path()), config_path)
}

fn import_error(dir: &Path) -> String {
    let cpu = Cpu::<f32>::new();
    let config = match hf::read_config(dir) {
        Ok(c) => c,
        Err(e) => return format!("{e:#}"),
    };
    let model = model_for(&cpu, config, DType::F32);
    format!("{:#}", hf::import(&cpu, &model, dir).unwrap_err())
}

#[test]
fn export_then_import_is_bitwise() {
    let cpu = Cpu::<f32>::new();
    for (name, config) in tiny_configs() {
        for dtype in [DType::F32, DType::BF16] {
            let original = model_for(&cpu, config.clone(), dtype);
            original.init_weights(&cpu, 17).unwrap();
            let dir = tempfile::tempdir().unwrap();
            hf::export(&cpu, &original, dir.path(), dtype).unwrap();
            let loaded = model_for(&cpu, hf::read_config(dir.path()).unwrap(), dtype);
            hf::import(&cpu, &loaded, dir.path()).unwrap();
            assert_eq!(
                loaded.config, original.config,
                "{name}: config changed in the round trip"
            );
            assert!(
                weights(&cpu, &loaded) == weights(&cpu, &original),
                "{name} {dtype}: weights changed in the round trip"
            );
        }
    }
}

#[test]
fn export_keeps_pad_token_id() {
    let cpu = Cpu::<f32>::new();
    let dir = copy_of("llama_tied");
    let config_path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config_path).unwrap();
    assert!(text.contains(r#""pad_token_id": null"#));
    std::fs::write(
        &config_path,
        text.replace(r#""pad_token_id": null"#, r#""pad_token_id": 3"#),
    )
    .unwrap();
    let model = model_for(&cpu, hf::read_config(dir.path()).unwrap(), DType::F32);
    hf::import(&cpu, &model, dir.path()).unwrap();
    let out = tempfile::tempdir().unwrap();
    hf::export(&cpu, &model, out.path(), DType::F32).unwrap();
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(written["pad_token_id"], 3);
    assert_eq!(hf::read_config(out.path()).unwrap(), model.config);
}

#[test]
fn reads_sharded_checkpoints() {
    let cpu = Cpu::<f32>::new();
    let single = fixture("qwen2_untied");
    let config = hf::read_config(&single).unwrap();
    let reference = model_for(&cpu, config.clone(), DType::F32);
    hf::import(&cpu, &reference, &single).unwrap();

    // Split the single file into two shards with an index, as transformers does for large models.
    let sharded = copy_of("qwen2_untied");
    let path = single.join("model.safetensors");
    let file = MappedFile::open(&path).unwrap();
    let st = file.tensors(&path).unwrap();
    let mut names: Vec<&str> = st.names();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in names.chunks(names.len() / 2 + 1).enumerate() {
        let file_name = format!("model-0000{}-of-00002.safetensors", shard + 1);
        let entries: Vec<_> = part
            .iter()
            .map(|n| {
                let v = st.tensor(n).unwrap();
                weight_map.insert(n.to_string(), file_name.clone().into());
                (
                    n.to_string(),
                    v.dtype(),
                    v.shape().to_vec(),
                    v.data().to_vec(),
                )
            })
            .collect();
        write_file(&sharded.path().join(&file_name), &entries).unwrap();
    }
    std::fs::remove_file(sharded.path().join("model.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        sharded.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();

    let loaded = model_for(&cpu, config, DType::F32);
    hf::import(&cpu, &loaded, sharded.path()).unwrap();
    assert!(weights(&cpu, &loaded) == weights(&cpu, &reference));
}

#[test]
fn reads_f16_and_bf16_storage() {
    let cpu = Cpu::<f32>::new();
    let config = hf::read_config(&fixture("llama_untied")).unwrap();
    let original = model_for(&cpu, config.clone(), DType::F32);
    hf::import(&cpu, &original, &fixture("llama_untied")).unwrap();
    for (dtype, round) in [
        (
            DType::F16,
            (|x| half::f16::from_f32(x).to_f32()) as fn(f32) -> f32,
        ),
        (DType::BF16, |x| half::bf16::from_f32(x).to_f32()),
    ] {
        let dir = tempfile::tempdir().unwrap();
        hf::export(&cpu, &original, dir.path(), dtype).unwrap();
        let loaded = model_for(&cpu, config.clone(), DType::F32);
        hf::import(&cpu, &loaded, dir.path()).unwrap();
        for (a, b) in original.params.iter().zip(loaded.params.iter()) {
            let expected: Vec<f32> = cpu.download(a).unwrap().into_iter().map(round).collect();
            assert_eq!(
                cpu.download(b).unwrap(),
                expected,
                "{dtype} storage is read as the rounded values"
            );
        }
    }
}

#[test]
fn truncated_file_is_named() {
    let dir = copy_of("llama_tied");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = import_error(dir.path());
    assert!(
        err.contains(&path.display().to_string()) && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn wrong_shape_names_file_and_tensor() {
    let (err, _) = error_after_config_edit(
        "llama_tied",
        "\"intermediate_size\": 48",
        "\"intermediate_size\": 40",
    );
    assert!(
        err.contains(
            "model.safetensors: tensor `model.layers.0.mlp.gate_proj.weight` has shape [48, 32]"
        ),
        "{err}"
    );
    assert!(
        err.contains("[40, 32]") && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_of("qwen2_untied");
    let path = dir.path().join("model.safetensors");
    let file = MappedFile::open(&fixture("qwen2_untied").join("model.safetensors")).unwrap();
    let st = file.tensors(&path).unwrap();
    let entries: Vec<_> = st
        .names()
        .into_iter()
        .filter(|n| *n != "model.layers.1.self_attn.k_proj.bias")
        .map(|n| {
            let v = st.tensor(n).unwrap();
            (
                n.to_string(),
                v.dtype(),
                v.shape().to_vec(),
                v.data().to_vec(),
            )
        })
        .collect();
    write_file(&path, &entries).unwrap();
    let err = import_error(dir.path());
    assert!(
        err.contains(&format!(
            "{}: tensor `model.layers.1.self_attn.k_proj.bias` is missing",
            path.display()
        )),
        "{err}"
    );
}

#[test]
fn unsupported_architecture_is_named() {
    let (err, config_path) =
        error_after_config_edit("llama_tied", "LlamaForCausalLM", "GemmaForCausalLM");
    assert!(
        err.contains(&format!(
            "{}: field `architectures` is [\"GemmaForCausalLM\"]",
            config_path.display()
        )),
        "{err}"
    );
}

#[test]
fn untied_head_missing_suggests_the_config_field() {
    let (err, _) = error_after_config_edit(
        "llama_tied",
        "\"tie_word_embeddings\": true",
        "\"tie_word_embeddings\": false",
    );
    assert!(
        err.contains("tensor `lm_head.weight` is missing") && err.contains("tie_word_embeddings"),
        "{err}"
    );
}

#[test]
fn zero_sizes_are_named() {
    let (err, config_path) = error_after_config_edit(
        "llama_tied",
        "\"num_hidden_layers\": 2",
        "\"num_hidden_layers\": 0",
    );
    assert!(
        err.contains(&format!(
            "{}: field `num_hidden_layers` must be at least 1",
            config_path.display()
        )),
        "{err}"
    );
}
