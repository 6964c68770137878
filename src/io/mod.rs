//! Files: HF model directories in and out (and found in the HF cache by name), safetensors
//! of named tensors, atomic writes.

pub mod atomic;
pub mod hf;
pub mod hf_cache;
pub mod tensors;

use std::path::Path;

use anyhow::{Context, Result, bail};

/// Whether two paths name one existing file or directory (a path that does not exist yet
/// names nothing that could be overwritten).
pub fn same_path(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Creates `dir`, given as `flag`, and checks that this user can write there, so that a run
/// does not find out only when it first writes.
pub fn create_writable_dir(dir: &Path, flag: &str) -> Result<()> {
    let fail = || {
        format!(
            "{flag} {}: cannot write there; choose a directory this user can write to",
            dir.display()
        )
    };
    std::fs::create_dir_all(dir).with_context(fail)?;
    let probe = dir.join(".smelt-write-check.tmp");
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .with_context(fail)
}

/// Refuses to write into `dir`, given as `flag`, while it holds files of an earlier run that
/// `earlier` picks out by name (`what` says what they are): new outputs would overwrite some
/// and be mixed with the rest. Names them and the fix; checked before any work. A path that
/// is not a directory (yet) holds nothing; creating it is the writer's to check. A writer's
/// temporary file (`atomic::temporary_name`), left by a run killed before its rename, holds
/// nothing that was written whole: the rerun writes it anew.
pub fn refuse_earlier_outputs(
    dir: &Path, flag: &str, what: &str, earlier: impl Fn(&str) -> bool,
) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    let name = dir.display();
    let listing = std::fs::read_dir(dir).with_context(|| format!("{flag} {name}: cannot list"))?;
    let mut found = vec![];
    for entry in listing {
        let file = entry?.file_name().to_string_lossy().into_owned();
        if earlier(&file) && !atomic::is_temporary(&file) {
            found.push(file);
        }
    }
    if found.is_empty() {
        return Ok(());
    }
    found.sort();
    let more = if found.len() > 3 { ", ..." } else { "" };
    found.truncate(3);
    bail!(
        "{flag} {name}: already holds {what} ({}{more}); choose a new directory or delete them",
        found.join(", ")
    )
}
