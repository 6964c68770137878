//! HF model directories: `config.json` plus `model.safetensors` or a sharded
//! `model.safetensors.index.json`, with HF tensor names, in and out.
//!
//! Fused tensors (qkv, gate_up) are stacked from, and split back into, the HF tensors that
//! `ParamSpec::hf` names, so an exported directory loads in transformers unchanged.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::atomic::write_bytes_atomically;
use super::tensors::{MappedFile, decode, encode, write_file};
use super::{refuse_earlier_outputs, same_path};
use crate::backend::Backend;
use crate::model::{ModelConfig, Transformer};
use crate::tensor::DType;

pub const CONFIG: &str = "config.json";
pub const WEIGHTS: &str = "model.safetensors";
pub const INDEX: &str = "model.safetensors.index.json";

/// Files that describe the tokenizer or generation defaults and travel with a model.
pub const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
];

/// Tensors HF checkpoints may carry that are derived, not learned.
fn is_derived(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join(CONFIG);
    if !path.exists() {
        bail!(
            "{}: no config.json; --model must be a HF model directory (config.json + model.safetensors)",
            dir.display()
        );
    }
    ModelConfig::from_file(&path)
}

/// Which file holds each tensor: one `model.safetensors`, or the shards an index names.
fn weight_files(dir: &Path) -> Result<BTreeMap<String, PathBuf>> {
    let index = dir.join(INDEX);
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("reading {}", index.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = json["weight_map"]
            .as_object()
            .with_context(|| format!("{}: no `weight_map` object", index.display()))?;
        return map
            .iter()
            .map(|(name, file)| {
                let file = file.as_str().with_context(|| {
                    format!(
                        "{}: `weight_map.{name}` is not a file name",
                        index.display()
                    )
                })?;
                Ok((name.clone(), dir.join(file)))
            })
            .collect();
    }
    let single = dir.join(WEIGHTS);
    if !single.exists() {
        bail!("{}: neither {WEIGHTS} nor {INDEX} is there", dir.display());
    }
    let file = MappedFile::open(&single)?;
    let names = file
        .tensors(&single)?
        .names()
        .into_iter()
        .map(|n| (n.to_string(), single.clone()))
        .collect();
    Ok(names)
}

/// Loads the weights of the HF directory `dir` into `model.params`.
pub fn import<B: Backend>(b: &B, model: &Transformer<B>, dir: &Path) -> Result<()> {
    let located = weight_files(dir)?;
    let mut files: BTreeMap<PathBuf, MappedFile> = BTreeMap::new();
    for path in located.values().collect::<BTreeSet<_>>() {
        files.insert(path.clone(), MappedFile::open(path)?);
    }
    let parsed = files
        .iter()
        .map(|(p, f)| Ok((p.clone(), f.tensors(p)?)))
        .collect::<Result<BTreeMap<_, _>>>()?;

    let mut used = BTreeSet::new();
    for (spec, tensor) in model.layout.zip(&model.params) {
        let mut values = Vec::with_capacity(spec.tensor.numel());
        for slice in spec.hf_slices() {
            let hf_name = slice.name;
            let Some(path) = located.get(hf_name) else {
                let hint = if hf_name == "lm_head.weight" {
                    " (or set tie_word_embeddings: true in config.json if the head is tied)"
                } else {
                    ""
                };
                let listing = if dir.join(INDEX).exists() {
                    INDEX
                } else {
                    WEIGHTS
                };
                bail!(
                    "{}: tensor `{hf_name}` is missing{hint}",
                    dir.join(listing).display()
                );
            };
            let view = parsed[path].tensor(hf_name).with_context(|| {
                format!(
                    "{}: tensor `{hf_name}` is listed but absent",
                    path.display()
                )
            })?;
            if view.shape() != slice.shape.as_slice() {
                bail!(
                    "{}: tensor `{hf_name}` has shape {:?}, but {} implies {:?}",
                    path.display(),
                    view.shape(),
                    dir.join(CONFIG).display(),
                    slice.shape
                );
            }
            values.extend(decode(&view, path, hf_name)?);
            used.insert(hf_name.to_string());
        }
        b.upload(tensor, &values)?;
    }
    model.weights_changed();
    let tied_head = model.params.lm_head.is_none().then_some("lm_head.weight");
    let unknown: Vec<&String> = located
        .keys()
        .filter(|n| !used.contains(*n) && !is_derived(n) && Some(n.as_str()) != tied_head)
        .collect();
    if !unknown.is_empty() {
        bail!(
            "{}: tensors {unknown:?} are not part of a {} model as configured",
            dir.display(),
            model.config.architecture.hf_class()
        );
    }
    Ok(())
}

/// Refuses an `--out-dir` that an export must not write into: the `--model` directory it
/// reads (whose weights it would replace), or one that holds a sharded model (loaders read
/// its index before a single `model.safetensors`, so the old shards would shadow the
/// export). Checked before any work, so that a run does not find out at its end.
pub fn check_export_dir(out_dir: &Path, model_dir: Option<&Path>) -> Result<()> {
    if model_dir.is_some_and(|m| same_path(m, out_dir)) {
        bail!(
            "--out-dir {} is the --model directory; write into another directory, so that the model read stays as it is",
            out_dir.display()
        );
    }
    if out_dir.join(INDEX).exists() {
        bail!(
            "--out-dir {}: holds a sharded model ({INDEX}), which loaders would read instead of the exported {WEIGHTS}; choose another --out-dir or remove the old shards and their index",
            out_dir.display()
        );
    }
    Ok(())
}

/// `check_export_dir`, and refuses an `--out-dir` that holds any file: a model written there
/// would overwrite an earlier one, and leave those of its files that the new one lacks (its
/// tokenizer's, say) beside the new weights. (The demo replaces its own model, and checks
/// only `check_export_dir`.)
pub fn check_new_export_dir(out_dir: &Path, model_dir: Option<&Path>) -> Result<()> {
    check_export_dir(out_dir, model_dir)?;
    refuse_earlier_outputs(out_dir, "--out-dir", "files", |_| true)
}

/// Writes `config.json` and `model.safetensors` (tensors stored as `dtype`) into `out_dir`,
/// each atomically. The caller has checked `out_dir` with `check_export_dir`.
pub fn export<B: Backend>(
    b: &B, model: &Transformer<B>, out_dir: &Path, dtype: DType,
) -> Result<()> {
    let values = (model.params.iter())
        .map(|t| b.download(t))
        .collect::<Result<Vec<_>>>()?;
    export_values(model, &values, out_dir, dtype)
}

/// `export` of `model`'s parameters given as `values` (each parameter's, in `Params` order),
/// as a run whose weights are sharded over ranks gathers them.
pub fn export_values<B: Backend>(
    model: &Transformer<B>, values: &[Vec<f32>], out_dir: &Path, dtype: DType,
) -> Result<()> {
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("{}: cannot create the output directory", out_dir.display()))?;
    let mut entries = vec![];
    for (spec, values) in model.layout.iter().zip(values) {
        for slice in spec.hf_slices() {
            let (st_dtype, bytes) = encode(&values[slice.range], dtype)?;
            entries.push((slice.name.to_string(), st_dtype, slice.shape, bytes));
        }
    }
    write_file(&out_dir.join(WEIGHTS), &entries)?;
    let mut config = model.config.to_hf_json();
    config["torch_dtype"] = serde_json::json!(torch_dtype(dtype));
    write_bytes_atomically(
        &out_dir.join(CONFIG),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )
}

fn torch_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

/// Copies whichever tokenizer files `from_dir` has into `to_dir`.
pub fn copy_tokenizer_files(from_dir: &Path, to_dir: &Path) -> Result<()> {
    for name in TOKENIZER_FILES {
        let src = from_dir.join(name);
        if src.exists() {
            let bytes =
                std::fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
            write_bytes_atomically(&to_dir.join(name), &bytes)?;
        }
    }
    Ok(())
}
