//! smelt: training and fine-tuning for Llama- and Qwen2-family language models.
//!
//! Layers, from the bottom: `tensor` and `backend` (the fused operations, with a CPU
//! reference); `model` (the transformer written once over any backend); `io` (HF model
//! directories, safetensors), `data` (token files) and `tokenize` (text to token files);
//! `train` (the loop, checkpoints, logs, the benchmark); `generate` (text from a trained
//! model) and `plot` (training logs drawn as a PNG); and `cli`, one module per `smelt`
//! subcommand, which `main.rs` runs. `comm` is how the ranks of a multi-device run exchange
//! gradients. `hash` and `rng` are the small deterministic helpers every layer shares, and
//! `panic` turns caught panics into error text.

pub mod backend;
pub mod cli;
pub mod comm;
pub mod data;
pub mod generate;
pub mod hash;
pub mod io;
pub mod model;
pub mod panic;
pub mod plot;
pub mod rng;
pub mod tensor;
pub mod tokenize;
pub mod train;
