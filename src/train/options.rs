//! A training run's settings, resolved from the command line (or the demo's defaults): where
//! the model comes from, and the groups that the planner and the benchmark share, how the
//! activations are kept and the optimizer's settings.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::guard::GuardOptions;
use super::inject::Injection;
use super::schedule::Decay;
use crate::backend::select::Device;
use crate::backend::telemetry::Telemetry;
use crate::comm::ranks::Ranks;
use crate::io::hf;
use crate::io::hf_cache::{self, HubName};
use crate::model::{
    Documents, Gradients, MatmulPrecision, ModelConfig, ModelOptions, Recompute, Weights, presets,
};
use crate::tensor::DType;

/// Where the model comes from.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelSource {
    /// A built-in HF `config.json` (the demo's, or a named architecture), trained from random
    /// weights.
    Config { name: String, config: Value },
    /// A HF model directory: its weights, or only its config with `from_scratch`.
    Dir { path: PathBuf, from_scratch: bool },
}

impl ModelSource {
    /// `--model`: a HF model directory, a model in the HF cache by its Hub name
    /// (`owner/name`, see `io::hf_cache`), or one of the built-in architectures (see
    /// `model::presets`) to train from random weights.
    pub fn new(model: &Path, from_scratch: bool) -> Result<ModelSource> {
        // A path that exists is a directory, even where it shares a preset's or a Hub name.
        if model.exists() || HubName::parse(model).is_some() {
            return Ok(ModelSource::Dir {
                path: hf_cache::model_dir(model)?,
                from_scratch,
            });
        }
        let Some(name) = model
            .to_str()
            .filter(|name| presets::names().contains(name))
        else {
            bail!(
                "--model {}: no such directory, and not a built-in architecture; give a HF model directory (with config.json), a model's Hub name (owner/name) in the HF cache, or one of {}",
                model.display(),
                presets::names().join(", ")
            );
        };
        if !from_scratch {
            bail!(
                "--model {name} is a built-in architecture without weights: add --from-scratch to train it from random weights"
            );
        }
        Ok(ModelSource::Config {
            name: name.to_string(),
            config: presets::preset(name)?.to_hf_json(),
        })
    }

    /// The config of `model` (a directory, of which only config.json is read, or a built-in
    /// architecture), resolved as `smelt train --from-scratch` resolves it.
    pub fn architecture(model: &str) -> Result<ModelConfig> {
        Ok(ModelSource::new(Path::new(model), true)?.config()?.0)
    }

    /// The model's config, and the directory it came from (whose tokenizer files belong to
    /// it).
    pub fn config(&self) -> Result<(ModelConfig, Option<PathBuf>)> {
        match self {
            ModelSource::Config { name, config } => Ok((
                ModelConfig::from_json(config, &format!("the config of {name}"))?,
                None,
            )),
            ModelSource::Dir { path, from_scratch } => {
                let config = hf::read_config(path)?;
                if !from_scratch
                    && ![hf::WEIGHTS, hf::INDEX]
                        .iter()
                        .any(|f| path.join(f).exists())
                {
                    bail!(
                        "--model {}: no {} (or {}) to fine-tune; pass --from-scratch to train its config from random weights",
                        path.display(),
                        hf::WEIGHTS,
                        hf::INDEX
                    );
                }
                Ok((config, Some(path.clone())))
            }
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Options {
    pub model: ModelSource,
    pub train_file: String,
    pub eval_file: Option<String>,
    pub batch_size: usize,
    pub seq_len: usize,
    pub grad_accumulation: usize,
    /// `None`: one epoch of the training data.
    pub steps: Option<u64>,
    pub lr: f64,
    pub warmup: u64,
    pub final_lr_fraction: f64,
    pub lr_schedule: Decay,
    pub cooldown: u64,
    #[serde(flatten)]
    pub optimizer: OptimizerOptions,
    pub z_loss: f64,
    pub model_dtype: DType,
    /// `--matmul-dtype` with `--gradient-dtype`; listed (and warned about) under the first.
    #[serde(rename = "matmul_dtype")]
    pub matmul: MatmulPrecision,
    #[serde(flatten)]
    pub memory: MemoryOptions,
    /// `--doc-mask` and `--doc-positions`.
    pub documents: Option<Documents>,
    pub seed: u64,
    /// Steps between checkpoints; 0 for none.
    pub ckpt_interval: u64,
    pub checkpoint_dir: PathBuf,
    /// Continue from the latest checkpoint in `checkpoint_dir`.
    pub resume: bool,
    pub out_dir: Option<PathBuf>,
    pub log_file: Option<PathBuf>,
    /// Where a TensorBoard event file gets the log's scalars.
    pub tensorboard_dir: Option<PathBuf>,
    /// Steps between evals; 0 evaluates only at the end.
    pub eval_every_n_steps: u64,
    /// Batches in each periodic eval (the final eval reads all the eval data).
    pub eval_num_steps: usize,
    /// Steps between logs of the FP8 abs-max statistics; 0 for none.
    pub debug_log_abs_max: u64,
    /// Steps between readings of the GPUs (`--log-gpu-util`); 0 for none.
    pub log_gpu_util: u64,
    /// With several ranks, sum the gradients once the backward has ended, instead of each
    /// block's while the backward goes on.
    pub grad_sum_after_backward: bool,
    /// Record each micro-batch's forward and backward as CUDA graphs and replay them
    /// (`ModelOptions::record_passes`).
    pub use_cuda_graphs: bool,
    /// Steps between logs of the training health (`train::health`); 0 for none.
    pub health_every: u64,
    #[serde(flatten)]
    pub guard: GuardOptions,
    /// Faults to inject, for testing the guards.
    pub debug_inject: Vec<Injection>,
}

impl Options {
    /// The options as (name, value) pairs, for the log and the startup listing.
    pub fn listing(&self) -> Vec<(String, Value)> {
        match serde_json::to_value(self).expect("options serialize") {
            Value::Object(map) => map.into_iter().collect(),
            _ => unreachable!("a struct serializes to an object"),
        }
    }

    /// Options that may differ between a run and the run it continues, since they do not
    /// change what has already been computed (later ones may change with a warning).
    /// `recompute`, the offloads, `grad_sum_after_backward` and `use_cuda_graphs` are among
    /// them because they give bitwise the same results.
    pub const FREE_ON_CONTINUE: [&str; 25] = [
        "resume",
        "out_dir",
        "log_file",
        "tensorboard_dir",
        "ckpt_interval",
        "checkpoint_dir",
        "eval_file",
        "eval_every_n_steps",
        "eval_num_steps",
        "recompute",
        "offload",
        "offload_residual",
        "offload_activations",
        "offload_weights",
        "offload_gradients",
        "debug_log_abs_max",
        "log_gpu_util",
        "grad_sum_after_backward",
        "use_cuda_graphs",
        "health_every",
        "max_skipped_steps",
        "spike_window",
        "spike_zscore",
        "on_spike",
        "debug_inject",
    ];
}

/// A run as the command line resolved it: its options, where its ranks come from and the
/// device they start on.
pub struct Resolved {
    pub options: Options,
    pub device: Device,
    pub ranks: Ranks,
    /// `--comm-timeout`.
    pub timeout: Duration,
    /// The GPUs to read with `--log-gpu-util`, on the process of rank 0.
    pub telemetry: Option<Telemetry>,
}

/// The settings that the demo and an ordinary run default differently.
#[derive(Clone, Copy, Debug)]
pub struct Defaults {
    pub batch_size: usize,
    pub seq_len: usize,
    pub steps: Option<u64>,
    pub lr: f64,
    pub warmup: u64,
    pub final_lr_fraction: f64,
    pub model_dtype: DType,
    pub eval_every_n_steps: u64,
    pub eval_num_steps: usize,
}

/// How a run keeps what its blocks read: which activations it recomputes and which it keeps
/// in host memory, in how many chunks the LM head and the MLP run, and whether the blocks'
/// weights and gradients stream from host memory. `smelt plan` chooses them, with the
/// optimizer's offload and ZeRO level.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MemoryOptions {
    pub recompute: Recompute,
    /// `--offload-residual`: the residual stream in host memory.
    pub offload_residual: bool,
    /// `--offload-activations`: every other activation kept per layer in host memory.
    pub offload_activations: bool,
    pub lmhead_chunks: usize,
    /// `ModelOptions::ffn_chunks`.
    pub ffn_chunks: usize,
    /// `--offload-weights`: the blocks' weights in host memory, streamed through the device.
    pub offload_weights: bool,
    /// `--offload-gradients`: the same for the blocks' gradients.
    pub offload_gradients: bool,
    /// `--layer-major`: a step's micro-batches run layer-major, this many a pass
    /// (`ModelOptions::micro_batches`); 0 runs them one at a time.
    pub layer_major: usize,
}

impl MemoryOptions {
    /// That `--layer-major` has micro-batches to run layer-major: `accumulation` of them a
    /// step, at least two a pass.
    pub fn check_layer_major(&self, accumulation: usize) -> anyhow::Result<()> {
        let n = self.layer_major;
        anyhow::ensure!(
            n == 0 || accumulation >= 2,
            "--layer-major runs the micro-batches of a step block by block, and this run has \
             {accumulation} a step: add --grad-accumulation 2 or more, or leave --layer-major out"
        );
        anyhow::ensure!(
            n != 1 && n <= accumulation,
            "--layer-major={n}: a pass runs between 2 and --grad-accumulation ({accumulation}) \
             micro-batches; give a number in that range, or none for all of them"
        );
        Ok(())
    }

    /// The model's options for training on micro-batches of `batch` sequences of `seq`
    /// tokens, its weights and activations in `dtype`, keeping the gradients `gradients`
    /// says and every block's weights, the sequences packing `documents` where given.
    pub fn model_options(
        &self, batch: usize, seq: usize, dtype: DType, matmul: MatmulPrecision,
        gradients: Gradients, documents: Option<Documents>,
    ) -> ModelOptions {
        ModelOptions {
            batch,
            seq,
            dtype,
            recompute: self.recompute,
            offload_residual: self.offload_residual,
            offload_activations: self.offload_activations,
            lmhead_chunks: self.lmhead_chunks,
            ffn_chunks: self.ffn_chunks,
            matmul,
            gradients,
            weights: Weights::All,
            offload_weights: self.offload_weights,
            offload_gradients: self.offload_gradients,
            documents,
            micro_batches: self.layer_major.max(1),
            record_passes: false,
        }
    }
}

/// AdamW's settings, and where its state lives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerOptions {
    pub beta_1: f64,
    pub beta_2: f64,
    pub adam_eps: f64,
    pub weight_decay: f64,
    /// Global gradient-norm clip; 0 disables it.
    pub grad_clip: f64,
    pub opt_m_dtype: DType,
    pub opt_v_dtype: DType,
    /// The dtype of a master copy of the weights; `None` updates the weights in place.
    pub master_dtype: Option<DType>,
    /// Which of the state lives in host memory.
    pub offload: Offload,
    /// 1: the state is sharded over the ranks (ZeRO-1); 2: the blocks' gradients too
    /// (ZeRO-2); 3: the blocks' weights too (ZeRO-3); 0: every rank keeps all of it.
    pub zero_level: u8,
    /// `--optimizer-in-backward`: each block is updated in the step's last backward, as soon
    /// as its gradients are final (`block_updates`).
    #[serde(default)]
    pub in_backward: bool,
}

/// Which optimizer state lives in host memory (llm.q's `--offload-*`). The update reads and
/// writes it over the bus once per step, which costs that traffic at PCIe speed and saves
/// its size in device memory. Where the state lives changes no result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offload {
    pub master: bool,
    pub opt_m: bool,
    pub opt_v: bool,
}
