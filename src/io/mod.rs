//! Files: HF model directories in and out, safetensors of named tensors, atomic writes.

pub mod atomic;
pub mod hf;
pub mod tensors;

use std::path::Path;

/// Whether two paths name one existing file or directory (a path that does not exist yet
/// names nothing that could be overwritten).
pub fn same_path(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}
