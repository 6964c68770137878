//! smelt: training and fine-tuning for Llama-, Mistral- and Qwen-family (Qwen2, Qwen3) language models.
//!
//! Layers, from the bottom: `tensor` and `backend` (the fused operations, with a CPU
//! reference); `model` (the transformer written once over any backend); `comm` (how the
//! ranks of a multi-device run exchange gradients, NCCL between GPUs); `io` (HF model
//! directories, safetensors), `data` (token files) and `tokenize` (text to token files);
//! `train` (the loop, the optimizer, checkpoints, logs, the benchmark); `plan` (the memory
//! flags that fit a run, and the fastest of them), `generate` (text from a trained model)
//! and `plot` (training logs drawn as a PNG); and `cli`, one module per `smelt` subcommand,
//! which `main.rs` runs. `hash` and `rng` are the small deterministic helpers every layer
//! shares, and `panic` turns caught panics into error text.

pub mod backend;
pub mod cli;
pub mod comm;
pub mod data;
pub mod generate;
pub mod hash;
pub mod io;
pub mod model;
pub mod panic;
pub mod plan;
pub mod plot;
pub mod rng;
pub mod tensor;
pub mod tokenize;
pub mod train;
