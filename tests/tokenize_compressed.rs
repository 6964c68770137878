//! `smelt tokenize` of compressed inputs (`.gz`, `.zst`): the same token files, bit for bit,
//! as from the same text uncompressed, for plain text (whole files and separated documents)
//! and JSONL; and how fast, against the uncompressed input.

mod tokenizing;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::json;
use smelt::tokenize::{Options, tokenize};
use tokenizing::*;

/// `text` written as `name`, `name.gz` and `name.zst` in `dir`.
fn three_ways(dir: &Path, name: &str, text: &[u8]) -> [PathBuf; 3] {
    std::fs::create_dir_all(dir).unwrap();
    let plain = dir.join(name);
    std::fs::write(&plain, text).unwrap();
    let gz = dir.join(format!("{name}.gz"));
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(text).unwrap();
    std::fs::write(&gz, e.finish().unwrap()).unwrap();
    let zst = dir.join(format!("{name}.zst"));
    std::fs::write(&zst, zstd::encode_all(text, 3).unwrap()).unwrap();
    [plain, gz, zst]
}

/// The files of an output folder, by name, with their bytes.
type Files = Vec<(String, Vec<u8>)>;

/// Every file `tokenize` wrote into `out`.
fn outputs(out: &Path) -> Files {
    (listing(out).into_iter())
        .map(|name| {
            let bytes = std::fs::read(out.join(&name)).unwrap();
            (name, bytes)
        })
        .collect()
}

/// Tokenizes each of `inputs` (one glob per way of storing the same text) with `configure`'s
/// options; the outputs of each, and the seconds each took.
fn each(
    root: &Path, what: &str, inputs: [String; 3], configure: impl Fn(&mut Options),
) -> Vec<(Files, f64)> {
    (inputs.into_iter().enumerate())
        .map(|(i, glob)| {
            let out = root.join(format!("{what}-{i}"));
            let mut options = Options::new(qwen(), vec![glob], out.clone());
            configure(&mut options);
            let start = Instant::now();
            tokenize(&options).unwrap();
            (outputs(&out), start.elapsed().as_secs_f64())
        })
        .collect()
}

fn assert_same(runs: &[(Files, f64)], what: &str) {
    assert!(!runs[0].0.is_empty());
    for (i, way) in ["gzip", "zstd"].iter().enumerate() {
        assert!(
            runs[i + 1].0 == runs[0].0,
            "{what}: {way} gave other token files"
        );
    }
}

#[test]
fn compressed_text_and_jsonl_give_the_same_token_files() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // The plays, each a file, in three folders.
    for (way, folder) in ["plain", "gz", "zst"].iter().enumerate() {
        std::fs::create_dir_all(root.join(folder)).unwrap();
        for play in plays() {
            let text = std::fs::read(&play).unwrap();
            let name = play.file_name().unwrap().to_str().unwrap();
            let files = three_ways(&root.join("scratch"), name, &text);
            std::fs::rename(
                &files[way],
                root.join(folder).join(files[way].file_name().unwrap()),
            )
            .unwrap();
        }
    }
    let globs =
        ["plain/*.md", "gz/*.md.gz", "zst/*.md.zst"].map(|g| format!("{}/{g}", root.display()));
    let runs = each(root, "plays", globs, |o| {
        o.eval = smelt::tokenize::EvalSplit::Tokens(20_000)
    });
    assert_same(&runs, "the plays");

    // All the plays in one file, split on a separator, and as JSONL.
    let all: Vec<String> = plays()
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    let joined = all.join("\n<|doc|>\n");
    let files = three_ways(root, "all.txt", joined.as_bytes());
    let globs = files.map(|f| f.display().to_string());
    let runs = each(root, "separated", globs, |o| {
        o.separator = Some("\n<|doc|>\n".into())
    });
    assert_same(&runs, "separated documents");

    let lines: String = all
        .iter()
        .map(|t| json!({ "text": t }).to_string() + "\n")
        .collect();
    let files = three_ways(root, "all.jsonl", lines.repeat(3).as_bytes());
    let globs = files.map(|f| f.display().to_string());
    let runs = each(root, "jsonl", globs, |_| {});
    assert_same(&runs, "JSONL");
    for (way, run) in ["gzip", "zstd"].iter().zip(&runs[1..]) {
        println!(
            "[figure] tokenize {way} JSONL ({:.1} MB of text): {:.0}% of the uncompressed input's rate",
            lines.len() as f64 * 3.0 / 1e6,
            100.0 * runs[0].1 / run.1
        );
    }
}
