//! `smelt export`: reads a model and writes it as a HF directory that transformers loads.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;

use crate::backend::cpu::Cpu;
use crate::io::hf;
use crate::model::{ModelOptions, Transformer};
use crate::tensor::DType;

#[derive(Args)]
#[command(allow_negative_numbers = true)]
pub struct ExportArgs {
    /// HF model directory to read (config.json + model.safetensors or a sharded index).
    #[arg(long)]
    model: PathBuf,
    /// Directory to write config.json, model.safetensors and any tokenizer files into: a new
    /// or empty one.
    #[arg(long)]
    out_dir: PathBuf,
    /// Storage dtype of the written tensors: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
}

impl ExportArgs {
    pub fn run(self) -> Result<()> {
        let Some(dtype) = DType::parse(&self.dtype)
            .filter(|d| matches!(d, DType::F32 | DType::BF16 | DType::F16))
        else {
            bail!("--dtype {}: choose f32, bf16 or f16", self.dtype);
        };
        hf::check_new_export_dir(&self.out_dir, Some(&self.model))?;
        let config = hf::read_config(&self.model)?;
        let cpu = Cpu::<f32>::new();
        // The smallest activation shape: export only touches the weights.
        let model = Transformer::new(&cpu, config, ModelOptions::forward_only(1, DType::F32))?;
        hf::import(&cpu, &model, &self.model)?;
        hf::export(&cpu, &model, &self.out_dir, dtype)?;
        hf::copy_tokenizer_files(&self.model, &self.out_dir)?;
        println!(
            "wrote {} ({} parameters, {dtype})",
            self.out_dir.display(),
            model.config.num_parameters()
        );
        Ok(())
    }
}
