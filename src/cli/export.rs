//! `smelt export`: reads a model (a HF directory, or the weights of a training checkpoint) and
//! writes it as a HF directory that transformers loads.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{ArgGroup, Args};

use super::flags::StorageDtype;
use crate::backend::cpu::Cpu;
use crate::io::{hf, hf_cache};
use crate::model::{ModelConfig, ModelOptions, Transformer};
use crate::tensor::DType;
use crate::train::checkpoint::{self, SavedModel};

#[derive(Args)]
#[command(
    allow_negative_numbers = true,
    group(ArgGroup::new("source").required(true).args(["model", "checkpoint"]))
)]
pub struct ExportArgs {
    /// HF model directory to read (config.json + model.safetensors or a sharded index), or a
    /// model's Hub name (owner/name) in the local HF cache.
    #[arg(long, value_name = "DIR|NAME")]
    model: Option<PathBuf>,
    /// A training checkpoint to read: a step-N directory, or a --checkpoint-dir (its latest
    /// checkpoint), of any number of ranks and ZeRO level. The config comes from its state,
    /// the tokenizer files from the model directory the run started from, if it still has
    /// them.
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    /// Directory to write config.json, model.safetensors and any tokenizer files into: a new
    /// or empty one.
    #[arg(long)]
    out_dir: PathBuf,
    /// Storage dtype of the written tensors [default: f32 for --model; for --checkpoint, the
    /// dtype the run trained in, as its own --out-dir got].
    #[arg(long, value_enum, ignore_case = true)]
    dtype: Option<StorageDtype>,
}

impl ExportArgs {
    pub fn run(self) -> Result<()> {
        let dtype = self.dtype.map(DType::from);
        let model_dir = self.model.as_deref().map(hf_cache::model_dir).transpose()?;
        hf::check_new_export_dir(&self.out_dir, model_dir.as_deref())?;
        let cpu = Cpu::<f32>::new();
        let (model, tokenizer_dir, dtype) = match (&model_dir, &self.checkpoint) {
            (Some(dir), _) => {
                let model = new_model(&cpu, hf::read_config(dir)?, DType::F32)?;
                hf::import(&cpu, &model, dir)?;
                (model, Some(dir.clone()), dtype.unwrap_or(DType::F32))
            }
            (None, Some(dir)) => {
                let saved = SavedModel::open(dir)?;
                // Held at the dtype it was trained in, so that it is read back exactly.
                let model = new_model(&cpu, saved.config, saved.dtype)?;
                checkpoint::load_weights(&cpu, &saved.path, &saved.state, &model)?;
                let tokenizer_dir = saved.state.model_dir.filter(|d| has_tokenizer(d));
                (model, tokenizer_dir, dtype.unwrap_or(saved.dtype))
            }
            (None, None) => unreachable!("clap requires --model or --checkpoint"),
        };
        hf::export(&cpu, &model, &self.out_dir, dtype)?;
        if let Some(dir) = &tokenizer_dir {
            hf::copy_tokenizer_files(dir, &self.out_dir)?;
        }
        let note = match (&tokenizer_dir, &self.checkpoint) {
            (None, Some(_)) => {
                "; no tokenizer files: the run's model directory has none, or is gone"
            }
            _ => "",
        };
        println!(
            "wrote {} ({} parameters, {dtype}{note})",
            self.out_dir.display(),
            model.config.num_parameters(),
        );
        Ok(())
    }
}

/// A model to hold weights in `dtype`, with the smallest activations: export only touches
/// the weights.
fn new_model(cpu: &Cpu, config: ModelConfig, dtype: DType) -> Result<Transformer<Cpu>> {
    Transformer::new(cpu, config, ModelOptions::forward_only(1, dtype))
}

fn has_tokenizer(dir: &Path) -> bool {
    hf::TOKENIZER_FILES.iter().any(|f| dir.join(f).is_file())
}
