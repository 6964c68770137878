//! The op families a backend implements, one trait per family; `Backend` is their sum.
//!
//! Each trait lists the fused operations one part of the transformer needs, with the shapes
//! and the contract of each. A backend implements a family in the file of the same name
//! (`cpu/rmsnorm.rs`, `cuda/rmsnorm.rs` beside `cuda/kernels/rmsnorm.cu`), so an op lives
//! in one place per backend.

pub mod adam8bit;
pub mod adamw;
pub mod attention;
pub mod classifier;
pub mod embedding;
pub mod fp8;
pub mod int8;
pub mod matmul;
pub mod memory;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;
