//! Files: HF model directories in and out, safetensors of named tensors, atomic writes.

pub mod atomic;
pub mod hf;
pub mod tensors;
