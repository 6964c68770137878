//! The on-disk caches of what is slow to find out at startup (compiled kernels, the fastest
//! matmul algorithms): where they live, how entries are named, and how they are written so
//! that a reader never sees half an entry.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Writes `dir/file` through a temporary name and a rename, creating `dir` if needed. The
/// temporary name is unique to the write, since the ranks of a multi-GPU run are threads of
/// one process that may write the same entry at once.
pub fn write(dir: &Path, file: &str, bytes: &[u8]) -> Result<()> {
    static WRITES: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(dir)?;
    let write = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!("{file}.{}-{write}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, dir.join(file))?;
    Ok(())
}
