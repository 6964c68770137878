//! Input files: the globs on the command line, expanded in order, each typed by its extension.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use super::compressed::Compression;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Plain text: the whole file is one document, or pieces between separators.
    Text,
    /// JSON Lines: one object per line, the document in a named field.
    Jsonl,
    /// Apache Parquet: one row per document, in a named string column.
    Parquet,
}

impl Format {
    /// The format of `path` by its extension, under a `.gz` or `.zst` one (text and JSONL:
    /// Parquet compresses its own columns).
    fn of(path: &std::path::Path) -> Option<Format> {
        let (compression, name) = Compression::of(path);
        let ext = name.rsplit_once('.')?.1.to_ascii_lowercase();
        match (ext.as_str(), compression) {
            ("txt" | "text" | "md", _) => Some(Format::Text),
            ("jsonl" | "ndjson", _) => Some(Format::Jsonl),
            ("parquet", Compression::None) => Some(Format::Parquet),
            _ => None,
        }
    }
}

pub struct Input {
    pub path: PathBuf,
    pub format: Format,
    /// Size on disk, for the progress bar.
    pub bytes: u64,
}

/// Expands each pattern (a glob or a plain path) in the order given; matches of one pattern
/// come in sorted order, so the output does not depend on the directory listing.
pub fn expand(patterns: &[String]) -> Result<Vec<Input>> {
    if patterns.is_empty() {
        bail!(
            "no input files: give globs of .txt, .jsonl or .parquet files (.txt and .jsonl also as .gz or .zst)"
        );
    }
    let mut inputs: Vec<Input> = Vec::new();
    for pattern in patterns {
        let mut paths: Vec<PathBuf> = glob::glob(pattern)
            .with_context(|| format!("input pattern {pattern:?} is not a valid glob"))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("listing the files of {pattern:?}"))?;
        paths.retain(|p| !p.is_dir());
        if paths.is_empty() {
            bail!("input {pattern:?} matches no file");
        }
        paths.sort();
        for path in paths {
            let Some(format) = Format::of(&path) else {
                bail!(
                    "{}: unknown input type; smelt tokenize reads .txt/.md, .jsonl and .parquet \
                     files, the first two also compressed (.gz, .zst)",
                    path.display()
                );
            };
            if inputs.iter().any(|i| i.path == path) {
                bail!(
                    "{}: matched by more than one input pattern; it would be tokenized twice",
                    path.display()
                );
            }
            let bytes = std::fs::metadata(&path)
                .with_context(|| format!("{}: cannot read", path.display()))?
                .len();
            inputs.push(Input {
                path,
                format,
                bytes,
            });
        }
    }
    Ok(inputs)
}
