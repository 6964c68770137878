//! The `smelt` command line: one subcommand per file, each with its arguments and `run`,
//! which turns them into the options of the module that does the work. `flags` holds the
//! flag groups several subcommands share.
//!
//! Every subcommand reads a negative number as a value (`--lr -1`, as `--lr=-1`), never as a
//! flag, so that its own check can name the flag and what it must be.

mod bench;
mod config;
mod export;
mod flags;
mod plan;
mod plot;
pub mod sample;
mod tokenize;
pub mod train;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "smelt",
    version,
    about = "Train and fine-tune Llama-, Mistral- and Qwen-family language models"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Bench(bench::BenchArgs),
    Config(config::ConfigArgs),
    /// Write a model, or the weights of a training checkpoint, as a HF directory (config.json
    /// + model.safetensors).
    Export(export::ExportArgs),
    Train(Box<train::TrainArgs>),
    Plan(plan::PlanArgs),
    Plot(plot::PlotArgs),
    Sample(sample::SampleArgs),
    /// Turn text, JSONL or Parquet files into token files with a HF tokenizer.json
    Tokenize(tokenize::TokenizeArgs),
}

impl Cli {
    pub fn run(self) -> Result<()> {
        match self.command {
            Command::Bench(args) => args.run(),
            Command::Config(args) => args.run(),
            Command::Export(args) => args.run(),
            Command::Train(args) => args.run(),
            Command::Plan(args) => args.run(),
            Command::Plot(args) => args.run(),
            Command::Sample(args) => args.run(),
            Command::Tokenize(args) => tokenize::run(args),
        }
    }
}
