//! Writes that never leave a partial file under the final name: write to a hidden temporary
//! name in the same directory, fsync, rename over the target, fsync the directory. The file
//! is made by `File::create`, so its mode is what the umask gives any new file. A write that
//! fails removes its temporary file, and one that failed for a full disk says so.

use std::fs::File;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};

/// A test hook: with this set to N, each write pauses N ms once its temporary file is
/// complete and synced, before the rename, so that a test can kill the process in the middle
/// of one.
pub const DELAY_ENV: &str = "SMELT_TEST_WRITE_DELAY_MS";

/// `dir/.name.tmp`: hidden, and in the same directory so that the rename is atomic.
pub fn temporary_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp"))
}

/// Whether a file name is one that `temporary_name` gives.
pub fn is_temporary(name: &str) -> bool {
    name.len() > ".tmp".len() + 1 && name.starts_with('.') && name.ends_with(".tmp")
}

/// Runs `write` on a temporary path, then makes the result durable and moves it to `path`.
pub fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temporary_name(path);
    let result = write(&tmp).and_then(|()| {
        File::open(&tmp)?.sync_all()?;
        if let Some(ms) = std::env::var(DELAY_ENV).ok().and_then(|v| v.parse().ok()) {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        std::fs::rename(&tmp, path)?;
        sync_dir(path)
    });
    let Err(e) = result else {
        return Ok(());
    };
    let _ = std::fs::remove_file(&tmp);
    Err(match is_disk_full(&e) {
        true => anyhow!(
            "writing {}: {e:#}; free space on its disk, or write elsewhere",
            path.display()
        ),
        false => e.context(format!("writing {}", path.display())),
    })
}

/// Whether `e` comes from a full disk (`is_disk_full_io`).
pub fn is_disk_full(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .any(is_disk_full_io)
}

/// Whether a write failed for a full disk: no space left, a quota, or a limit on file sizes.
pub fn is_disk_full_io(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::StorageFull | ErrorKind::FileTooLarge | ErrorKind::QuotaExceeded
    )
}

/// Makes a rename in `path`'s directory durable.
pub fn sync_dir(path: &Path) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing the directory {}", dir.display()))
}

pub fn write_bytes_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically(path, |tmp| Ok(std::fs::write(tmp, bytes)?))
}
