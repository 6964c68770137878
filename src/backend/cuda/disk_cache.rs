//! The on-disk caches of what is slow to find out at startup (compiled kernels, the fastest
//! matmul algorithms): where they live, how entries are named, and how they are written so
//! that a reader never sees half an entry.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::hash::{FNV1A_START, fnv1a_extend};

/// `$env_var`, else `$XDG_CACHE_HOME/smelt/name`, else `~/.cache/smelt/name`.
pub fn dir(env_var: &str, name: &str) -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os(env_var) {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("smelt").join(name))
}

/// FNV-1a over the parts, each followed by a separator: stable across Rust versions.
pub fn key(parts: &[&str]) -> String {
    let h = parts.iter().fold(FNV1A_START, |h, part| {
        fnv1a_extend(fnv1a_extend(h, part.as_bytes()), &[0])
    });
    format!("{h:016x}")
}

/// Writes `dir/file` through a temporary name and a rename, creating `dir` if needed.
pub fn write(dir: &Path, file: &str, bytes: &[u8]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("{file}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, dir.join(file))?;
    Ok(())
}
