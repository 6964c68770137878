//! Writes that never leave a partial file under the final name: write to a hidden temporary
//! name in the same directory, fsync, rename over the target, fsync the directory.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// `dir/.name.tmp`: hidden, and in the same directory so that the rename is atomic.
pub fn temporary_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp"))
}

/// Runs `write` on a temporary path, then makes the result durable and moves it to `path`.
pub fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temporary_name(path);
    let result = write(&tmp).and_then(|()| {
        File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, path)?;
        sync_dir(path)
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("writing {}", path.display()))
}

/// Makes a rename in `path`'s directory durable.
pub fn sync_dir(path: &Path) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(dir)?.sync_all()?;
    Ok(())
}

pub fn write_bytes_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically(path, |tmp| Ok(std::fs::write(tmp, bytes)?))
}
