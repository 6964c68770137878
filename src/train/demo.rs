//! The demo that `smelt train` runs with no data arguments: a small byte-level Llama trained
//! on the text this binary carries (its README and its own sources, gathered by `build.rs`).
//! Bytes are the tokens, so it needs no tokenizer and no download. The corpus is written
//! out as ordinary token files and trained through the same path as any run.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{Value, json};

use super::options::Defaults;
use crate::data::tokfile::TokenWriter;
use crate::tensor::DType;

pub const CORPUS: &str = include_str!(concat!(env!("OUT_DIR"), "/demo_corpus.txt"));

/// A byte vocabulary: the token of a byte is its value.
pub const VOCAB: usize = 256;

/// The demo model: a Llama with grouped-query attention, sized so that a 2-core CPU trains
/// it in a few minutes. Heads of 64 are a size the CUDA attention kernels take.
pub fn config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
    })
}

/// The demo's run settings, where the command line leaves them open.
pub const DEFAULTS: Defaults = Defaults {
    batch_size: 16,
    seq_len: 128,
    steps: Some(250),
    lr: 3e-3,
    warmup: 20,
    final_lr_fraction: 0.1,
    model_dtype: DType::F32,
    eval_every_n_steps: 50,
    eval_num_steps: 8,
};

/// What the demo's closing sample starts from.
pub const SAMPLE_PROMPT: &str = "fn main() {\n    let ";
pub const SAMPLE_TOKENS: usize = 160;
pub const SAMPLE_TEMPERATURE: f32 = 0.7;

/// The token files `write_data` writes in `dir`: train, then eval.
pub fn data_paths(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("train.bin"), dir.join("eval.bin"))
}

/// Writes the corpus as token files in `dir` (`data_paths`): the train file, and its last
/// twentieth as the eval file.
pub fn write_data(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("{}: cannot create the demo's data folder", dir.display()))?;
    let bytes: Vec<i32> = CORPUS.bytes().map(i32::from).collect();
    let split = bytes.len() - bytes.len() / 20;
    let write = |path: PathBuf, tokens: &[i32]| -> Result<()> {
        let mut w = TokenWriter::create(&path, Some(VOCAB), false)?;
        w.write(tokens, None)?;
        w.finish().map(drop)
    };
    let (train, eval) = data_paths(dir);
    write(train, &bytes[..split])?;
    write(eval, &bytes[split..])
}

/// Bytes as text, for showing a sample.
pub fn decode(tokens: &[i32]) -> String {
    let bytes: Vec<u8> = tokens.iter().map(|&t| t as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
