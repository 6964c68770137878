//! Helpers for the trainer's end-to-end tests: a tiny model directory, token files, running
//! the `smelt` binary, and reading its log.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::json;
use smelt::data::tokfile::TokenWriter;
use smelt::train::checkpoint;
use smelt::train::demo::CORPUS;
use smelt::train::log::{self, Event};

pub const SMELT: &str = env!("CARGO_BIN_EXE_smelt");

/// A tiny byte-level Llama's `config.json` in `dir`.
pub fn tiny_model_dir(dir: &Path) -> PathBuf {
    let model = dir.join("tiny-model");
    std::fs::create_dir_all(&model).unwrap();
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false,
    });
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    model
}

/// The first `n` bytes of the demo corpus as a token file, with every 7th target masked
/// out when `masked`.
pub fn corpus_file(path: &Path, n: usize, masked: bool) -> PathBuf {
    let tokens: Vec<i32> = CORPUS.bytes().take(n).map(i32::from).collect();
    let mut w = TokenWriter::create(path, Some(256), masked).unwrap();
    let mask: Vec<bool> = (0..tokens.len()).map(|i| i % 7 != 3).collect();
    w.write(&tokens, masked.then_some(mask.as_slice())).unwrap();
    w.finish().unwrap()
}

/// Runs `smelt` with `args`.
pub fn smelt(args: &[&str]) -> Output {
    Command::new(SMELT).args(args).output().unwrap()
}

/// Runs `smelt` and fails the test, showing its output, unless it succeeds.
pub fn smelt_ok(args: &[&str]) -> String {
    let out = smelt(args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "smelt {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs `smelt`, expecting it to fail; returns its stderr.
pub fn smelt_err(args: &[&str]) -> String {
    let out = smelt(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "smelt {args:?} should have failed:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// (step, loss, data hash) of every step event in a log, in order.
pub fn steps(log_path: &Path) -> Vec<(u64, f64, String)> {
    log::read(log_path)
        .unwrap()
        .events
        .into_iter()
        .filter_map(|e| match e {
            Event::Step {
                step, loss, data, ..
            } => Some((step, loss, data)),
            _ => None,
        })
        .collect()
}

pub fn events(log_path: &Path) -> Vec<Event> {
    log::read(log_path).unwrap().events
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A temporary folder holding the tiny model and a 3000-token corpus with masked targets.
pub struct Setup {
    _tmp: tempfile::TempDir,
    pub root: PathBuf,
    pub model: PathBuf,
    pub data: PathBuf,
}

pub fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let model = tiny_model_dir(&root);
    let data = corpus_file(&root.join("train.bin"), 3000, true);
    Setup {
        _tmp: tmp,
        root,
        model,
        data,
    }
}

/// Copies the step-`step` checkpoint of checkpoint folder `from` into `to` (created), as
/// its latest: where a run that stopped after that checkpoint would have left it.
pub fn copy_checkpoint(from: &Path, step: u64, to: &Path) {
    let copy = checkpoint::step_dir(to, step);
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(checkpoint::step_dir(from, step)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    let name = copy.file_name().unwrap();
    std::fs::write(to.join(checkpoint::LATEST), name.as_encoded_bytes()).unwrap();
}

/// A copy of the tiny model's config in folder `name`, changed by `edit`.
pub fn model_variant(
    set: &Setup, name: &str, edit: impl FnOnce(&mut serde_json::Value),
) -> PathBuf {
    let dir = set.root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(set.model.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}
