//! Gathers the demo's training text: the repository's README and Rust sources, concatenated
//! in a fixed order, for `smelt train` to carry inside the binary (see `src/train/demo.rs`).

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let mut files = vec![root.join("README.md")];
    let mut sources = vec![];
    rust_files(&root.join("src"), &mut sources);
    sources.sort();
    files.extend(sources);
    let mut corpus = String::new();
    for file in &files {
        let name = file.strip_prefix(&root).unwrap_or(file);
        let text = std::fs::read_to_string(file).unwrap_or_default();
        corpus.push_str(&format!("==> {} <==\n{text}\n", name.display()));
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("set by cargo"));
    std::fs::write(out.join("demo_corpus.txt"), corpus).expect("OUT_DIR is writable");
    println!("cargo::rerun-if-changed=src");
    println!("cargo::rerun-if-changed=README.md");
}
