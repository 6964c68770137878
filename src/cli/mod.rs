//! The `smelt` command line: one subcommand per file, each with its arguments and `run`.

mod export;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "smelt",
    version,
    about = "Train and fine-tune Llama- and Qwen2-family language models"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a model as a HF directory (config.json + model.safetensors).
    Export(export::ExportArgs),
}

impl Cli {
    pub fn run(self) -> Result<()> {
        match self.command {
            Command::Export(args) => args.run(),
        }
    }
}
