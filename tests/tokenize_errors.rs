//! `smelt tokenize` on bad input (issue 4, point 4): the command fails with one line naming
//! the file or flag and the fix, and leaves nothing under the final file names.

mod tokenizing;

use std::path::Path;
use std::process::Command;

use parquet::basic::Compression;
use serde_json::json;
use tokenizing::*;

/// Runs `smelt tokenize ARGS`, which must fail; returns its one line of error.
fn fails(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_smelt"))
        .arg("tokenize")
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "succeeded: {args:?}");
    assert!(
        output.stdout.is_empty(),
        "printed a summary: {}",
        String::from_utf8_lossy(&output.stdout)
    );
    assert_eq!(stderr.lines().count(), 1, "one line of error: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Runs `smelt tokenize` on 17 documents of 1 MiB, then `bad`, in shards of 100,000 tokens.
/// With two threads a batch is 16 MiB of text, so the first batch is encoded and written
/// while the reader reaches `bad`: a dozen shards are complete (under temporary names) when
/// the run fails. The text is one long word repeated, which the tokenizer's cache makes fast.
fn after_many_shards(bad: &Path, out: &Path) -> String {
    let dir = bad.parent().unwrap();
    let big = dir.join("big.jsonl");
    let text: String = "Supercalifragilisticexpialidocious ".repeat(30_000)[..1 << 20].into();
    write_jsonl(&big, (0..17).map(|_| json!({ "text": text })));
    let output = Command::new(env!("CARGO_BIN_EXE_smelt"))
        .env("RAYON_NUM_THREADS", "2")
        .args([
            "tokenize",
            &s(&big),
            &s(bad),
            "--tokenizer",
            &s(&qwen()),
            "--out-dir",
            &s(out),
        ])
        .args(["--shard-tokens", "100000", "--eval-fraction", "0.1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !output.status.success() && stderr.lines().count() == 1,
        "{stderr}"
    );
    stderr
}

#[test]
fn a_missing_tokenizer_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("a.txt");
    std::fs::write(&text, "some text").unwrap();
    let out = dir.path().join("out");
    let missing = dir.path().join("no-such-tokenizer.json");
    let err = fails(&[
        &s(&text),
        "--tokenizer",
        &s(&missing),
        "--out-dir",
        &s(&out),
    ]);
    assert!(
        err.contains(&format!("--tokenizer {}: no such file", missing.display())),
        "{err}"
    );
    // A directory without a tokenizer.json.
    let err = fails(&[
        &s(&text),
        "--tokenizer",
        &s(dir.path()),
        "--out-dir",
        &s(&out),
    ]);
    assert!(err.contains("has no tokenizer.json"), "{err}");
    assert!(listing(&out).is_empty());
}

#[test]
fn a_json_line_without_the_field_is_named_and_nothing_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    write_jsonl(
        &bad,
        [
            json!({"text": "fine"}),
            json!({"text": "also fine"}),
            json!({"content": "no text"}),
        ],
    );
    let out = dir.path().join("out");
    let err = after_many_shards(&bad, &out);
    let want = format!(
        "{}:3: no field \"text\" (the line has [\"content\"]); choose the field with --text-field",
        bad.display()
    );
    assert!(err.contains(&want), "{err}");
    assert_eq!(
        listing(&out),
        Vec::<String>::new(),
        "no token file, complete or temporary"
    );

    // A chat line without its response field names that flag.
    let chat = dir.path().join("chat.jsonl");
    write_jsonl(
        &chat,
        [json!({"q": "hi", "a": "hello"}), json!({"q": "bye"})],
    );
    let err = fails(&[
        &s(&chat),
        "--tokenizer",
        &s(&qwen()),
        "--out-dir",
        &s(&out),
        "--prompt-field",
        "q",
        "--response-field",
        "a",
    ]);
    assert!(
        err.contains(&format!("{}:2: no field \"a\"", chat.display())),
        "{err}"
    );
    assert!(err.contains("--response-field"), "{err}");
    assert!(listing(&out).is_empty());
}

#[test]
fn a_parquet_file_without_the_column_is_named_and_nothing_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("docs.parquet");
    write_parquet(
        &bad,
        "content",
        &[Some("a"), Some("b")],
        1,
        Compression::SNAPPY,
    );
    let out = dir.path().join("out");
    let err = after_many_shards(&bad, &out);
    let want = format!(
        "{}: no column \"text\" (the file has [\"id\", \"content\"]); choose the text column with --text-column",
        bad.display()
    );
    assert!(err.contains(&want), "{err}");
    assert!(listing(&out).is_empty());

    // A null in the column: the row is named.
    let nulls = dir.path().join("nulls.parquet");
    write_parquet(
        &nulls,
        "text",
        &[Some("a"), Some("b"), Some("c"), None, Some("e")],
        2,
        Compression::SNAPPY,
    );
    let text = dir.path().join("a.txt");
    std::fs::write(&text, "some text").unwrap();
    let err = fails(&[
        &s(&text),
        &s(&nulls),
        "--tokenizer",
        &s(&qwen()),
        "--out-dir",
        &s(&out),
    ]);
    assert!(
        err.contains(&format!(
            "{}: row 3: column \"text\" is null",
            nulls.display()
        )),
        "{err}"
    );
    assert!(listing(&out).is_empty());
}

#[test]
fn an_unwritable_output_dir_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("a.txt");
    std::fs::write(&text, "some text").unwrap();
    // Tests may run as root, which ignores permission bits: a directory that cannot be made
    // because a plain file stands in its path is unwritable for everyone.
    let blocker = dir.path().join("a-file");
    std::fs::write(&blocker, "").unwrap();
    let out = blocker.join("out");
    let err = fails(&[&s(&text), "--tokenizer", &s(&qwen()), "--out-dir", &s(&out)]);
    assert!(
        err.contains(&format!("--out-dir {}: cannot create", out.display())),
        "{err}"
    );
    assert_eq!(listing(dir.path()), ["a-file", "a.txt"]);

    // A directory holding an earlier run's files: refused, and they are kept as they were.
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("train-000.bin"), "earlier run").unwrap();
    let err = fails(&[&s(&text), "--tokenizer", &s(&qwen()), "--out-dir", &s(&out)]);
    assert!(
        err.contains(&format!(
            "--out-dir {}: already holds token files (train-000.bin)",
            out.display()
        )),
        "{err}"
    );
    assert_eq!(listing(&out), ["train-000.bin"]);
    assert_eq!(
        std::fs::read(out.join("train-000.bin")).unwrap(),
        b"earlier run"
    );
}

/// A hand-built WordLevel tokenizer whose vocabulary has the id 3,000,000,000 (the
/// tokenizers crate takes any u32): too large for BIN.TOK's int32 tokens.
#[test]
fn a_vocabulary_beyond_int32_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    let model = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 3_000_000_000u64}, "unk_token": "[UNK]"},
    });
    std::fs::write(&tokenizer, model.to_string()).unwrap();
    let text = dir.path().join("a.txt");
    std::fs::write(&text, "a b").unwrap();
    let out = dir.path().join("out");
    let err = fails(&[
        &s(&text),
        "--tokenizer",
        &s(&tokenizer),
        "--out-dir",
        &s(&out),
        "--eos-id",
        "1",
    ]);
    assert!(
        err.contains(&format!(
            "{}: token id 3000000000 does not fit BIN.TOK's int32 tokens",
            tokenizer.display()
        )),
        "{err}"
    );
    assert!(listing(&out).is_empty());
}

/// Without --eos-id and with no configuration naming one, the EOS is never guessed.
#[test]
fn a_tokenizer_without_an_eos_asks_for_eos_id() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::copy(qwen(), &tokenizer).unwrap();
    let text = dir.path().join("a.txt");
    std::fs::write(&text, "Hello world").unwrap();
    let out = dir.path().join("out");
    let err = fails(&[
        &s(&text),
        "--tokenizer",
        &s(&tokenizer),
        "--out-dir",
        &s(&out),
    ]);
    assert!(
        err.contains(&format!("{}: no EOS token", tokenizer.display())),
        "{err}"
    );
    assert!(
        err.contains("pass --eos-id (the tokenizer's special tokens: <|endoftext|> = 151643"),
        "{err}"
    );
    assert!(listing(&out).is_empty());

    // An id outside the vocabulary is refused too; a good one works.
    let err = fails(&[
        &s(&text),
        "--tokenizer",
        &s(&tokenizer),
        "--out-dir",
        &s(&out),
        "--eos-id",
        "151665",
    ]);
    assert!(
        err.contains("--eos-id: EOS id 151665 is outside the tokenizer's vocabulary of 151665"),
        "{err}"
    );
    let ok = Command::new(env!("CARGO_BIN_EXE_smelt"))
        .args([
            "tokenize",
            &s(&text),
            "--tokenizer",
            &s(&tokenizer),
            "--out-dir",
            &s(&out),
            "--eos-id",
            "151643",
        ])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let files = token_files(&out);
    assert_eq!(tokens(&files[0]), [9707, 1879, 151643]);
}

#[test]
fn inputs_that_match_nothing_or_are_of_unknown_type_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pattern = format!("{}/*.txt", dir.path().display());
    let err = fails(&[&pattern, "--tokenizer", &s(&qwen()), "--out-dir", &s(&out)]);
    assert!(
        err.contains(&format!("input {pattern:?} matches no file")),
        "{err}"
    );
    let md = dir.path().join("a.md");
    std::fs::write(&md, "text").unwrap();
    let flags = ["--prompt-field", "q", "--response-field", "a"];
    let err = fails(
        &[
            &[&s(&md), "--tokenizer", &s(&qwen()), "--out-dir", &s(&out)][..],
            &flags,
        ]
        .concat(),
    );
    assert!(
        err.contains(&format!(
            "{}: --prompt-field and --response-field apply to .jsonl inputs only",
            md.display()
        )),
        "{err}"
    );
    let csv = dir.path().join("data.csv");
    std::fs::write(&csv, "a,b").unwrap();
    let err = fails(&[&s(&csv), "--tokenizer", &s(&qwen()), "--out-dir", &s(&out)]);
    assert!(
        err.contains(&format!("{}: unknown input type", csv.display())),
        "{err}"
    );
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"text\": \n").unwrap();
    let err = fails(&[&s(&bad), "--tokenizer", &s(&qwen()), "--out-dir", &s(&out)]);
    assert!(
        err.contains(&format!("{}:2: not valid JSON", bad.display())),
        "{err}"
    );
    assert!(listing(&out).is_empty());
}
