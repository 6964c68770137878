//! `smelt config`: the HF `config.json` of a model as smelt reads it (a built-in
//! architecture's, or a model directory's), so that other tools build the same model, as the
//! PyTorch baseline does (scripts/torch_baseline.py).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use crate::train::ModelSource;

#[derive(Args, Debug)]
#[command(about = "Print the HF config.json of a built-in architecture or a model directory")]
pub struct ConfigArgs {
    /// A built-in architecture (qwen2.5-0.5b, llama-3-8b, ...), a HF model directory, or a
    /// model's Hub name (owner/name) in the local HF cache.
    #[arg(long, value_name = "DIR|NAME")]
    model: PathBuf,
}

impl ConfigArgs {
    pub fn run(self) -> Result<()> {
        let (config, _) = ModelSource::new(&self.model, true)?.config()?;
        println!("{}", serde_json::to_string_pretty(&config.to_hf_json())?);
        Ok(())
    }
}
