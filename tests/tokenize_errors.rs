//! `smelt tokenize` on bad input: the command fails with one line naming
//! the file or flag and the fix, and leaves nothing under the final file names.

mod tokenizing;

use std::path::Path;
use std::process::{Command, Output};

use parquet::basic::Compression;
use serde_json::json;
use tokenizing::*;

/// Runs `smelt tokenize INPUTS --tokenizer TOKENIZER --out-dir OUT EXTRA`.
fn smelt(inputs: &[&Path], tokenizer: &Path, out: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smelt"))
        // Two threads make the batches of `many_shards` 16 MiB on any machine.
        .env("RAYON_NUM_THREADS", "2")
        .arg("tokenize")
        .args(inputs)
        .arg("--tokenizer")
        .arg(tokenizer)
        .arg("--out-dir")
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

/// Runs `smelt`, which must fail with one line of error containing `want`, print no summary,
/// and leave no file in `out`.
fn refused(inputs: &[&Path], tokenizer: &Path, out: &Path, extra: &[&str], want: &str) {
    let output = smelt(inputs, tokenizer, out, extra);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "succeeded: {inputs:?} {extra:?}");
    assert!(output.stdout.is_empty(), "printed a summary");
    assert_eq!(stderr.lines().count(), 1, "one line of error: {stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains(want),
        "want {want:?}, got {stderr}"
    );
    assert_eq!(
        listing(out),
        Vec::<String>::new(),
        "no token file, complete or temporary"
    );
}

/// 17 documents of 1 MiB in `dir`: with two threads a batch is 16 MiB of text, so the first
/// batch is encoded and written, in shards of 100,000 tokens, while the reader reaches the
/// next input. A dozen shards are complete (under temporary names) when a bad input after
/// this one fails. The text is one long word repeated, which the tokenizer's cache makes fast.
fn many_shards(dir: &Path) -> (std::path::PathBuf, [&'static str; 4]) {
    let big = dir.join("big.jsonl");
    let text: String = "Supercalifragilisticexpialidocious ".repeat(30_000)[..1 << 20].into();
    write_jsonl(&big, (0..17).map(|_| json!({ "text": text })));
    (big, ["--shard-tokens", "100000", "--eval-fraction", "0.1"])
}

fn text_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("a.txt");
    std::fs::write(&path, "Hello world").unwrap();
    path
}

#[test]
fn a_missing_tokenizer_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (text, out) = (text_file(dir.path()), dir.path().join("out"));
    let missing = dir.path().join("no-such-tokenizer.json");
    let want = format!("--tokenizer {}: no such file", missing.display());
    refused(&[&text], &missing, &out, &[], &want);
    // A directory without a tokenizer.json.
    let want = format!(
        "--tokenizer {}: the directory has no tokenizer.json",
        dir.path().display()
    );
    refused(&[&text], dir.path(), &out, &[], &want);
}

#[test]
fn a_json_line_without_the_field_is_named_and_nothing_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let (big, flags) = many_shards(dir.path());
    let bad = dir.path().join("bad.jsonl");
    write_jsonl(
        &bad,
        [
            json!({"text": "fine"}),
            json!({"text": "also"}),
            json!({"content": "x"}),
        ],
    );
    let want = format!(
        "{}:3: no field \"text\" (the line has [\"content\"]); choose the field with --text-field",
        bad.display()
    );
    refused(&[&big, &bad], &qwen(), &out, &flags, &want);

    // A chat line without its response field names that flag.
    let chat = dir.path().join("chat.jsonl");
    write_jsonl(
        &chat,
        [json!({"q": "hi", "a": "hello"}), json!({"q": "bye"})],
    );
    let flags = ["--prompt-field", "q", "--response-field", "a"];
    let want = format!(
        "{}:2: no field \"a\" (the line has [\"q\"]); choose the field with --response-field",
        chat.display()
    );
    refused(&[&chat], &qwen(), &out, &flags, &want);
    // Chat fields with a file that is not JSONL.
    let text = text_file(dir.path());
    let want = format!(
        "{}: --prompt-field and --response-field apply to .jsonl inputs only",
        text.display()
    );
    refused(&[&chat, &text], &qwen(), &out, &flags, &want);
    // Conversations: a line whose messages are no list, or one without a role, is named.
    let flags = ["--messages-field", "messages"];
    let turns = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]);
    write_jsonl(
        &chat,
        [json!({"messages": turns}), json!({"messages": "hi"})],
    );
    let want = format!(
        "{}:2: field \"messages\" is not a list of messages but \"hi\"; choose the field with --messages-field",
        chat.display()
    );
    refused(&[&chat], &qwen(), &out, &flags, &want);
    write_jsonl(&chat, [json!({"messages": [{"content": "hi"}]})]);
    let want = format!("{}:1: message 0 has no string \"role\"", chat.display());
    refused(&[&chat], &qwen(), &out, &flags, &want);
    // Tools that are no list: a line without them, or with null, has none.
    let tool_flags = ["--messages-field", "messages", "--tools-field", "tools"];
    write_jsonl(
        &chat,
        [
            json!({"messages": turns}),
            json!({"messages": turns, "tools": null}),
            json!({"messages": turns, "tools": {"name": "f"}}),
        ],
    );
    let want = format!(
        "{}:3: field \"tools\" is not a list of tools but {{\"name\":\"f\"}}; choose the field with --tools-field",
        chat.display()
    );
    refused(&[&chat], &qwen(), &out, &tool_flags, &want);
    let want = format!(
        "{}: --messages-field applies to .jsonl inputs only",
        text.display()
    );
    refused(&[&chat, &text], &qwen(), &out, &flags, &want);
    // A line that is not JSON.
    std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"text\": \n").unwrap();
    refused(
        &[&bad],
        &qwen(),
        &out,
        &[],
        &format!("{}:2: not valid JSON", bad.display()),
    );
}

#[test]
fn a_parquet_file_without_the_column_is_named_and_nothing_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let (big, flags) = many_shards(dir.path());
    let bad = dir.path().join("docs.parquet");
    write_parquet(
        &bad,
        "content",
        &[Some("a"), Some("b")],
        1,
        Compression::SNAPPY,
    );
    let want = format!(
        "{}: no column \"text\" (the file has [\"id\", \"content\"]); choose the text column with --text-column",
        bad.display()
    );
    refused(&[&big, &bad], &qwen(), &out, &flags, &want);

    // A null in the column: its row is named.
    let nulls = dir.path().join("nulls.parquet");
    let rows = [Some("a"), Some("b"), Some("c"), None, Some("e")];
    write_parquet(&nulls, "text", &rows, 2, Compression::SNAPPY);
    let want = format!("{}: row 3: column \"text\" is null", nulls.display());
    refused(&[&nulls], &qwen(), &out, &[], &want);
}

#[test]
fn an_unwritable_output_dir_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let text = text_file(dir.path());
    // Tests may run as root, which ignores permission bits: a directory that cannot be made
    // because a plain file stands in its path is unwritable for everyone.
    let blocker = dir.path().join("a-file");
    std::fs::write(&blocker, "").unwrap();
    let out = blocker.join("out");
    let want = format!("--out-dir {}: cannot create", out.display());
    refused(&[&text], &qwen(), &out, &[], &want);
    assert_eq!(listing(dir.path()), ["a-file", "a.txt"]);

    // A directory holding an earlier run's files: refused, and they are kept as they were.
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let earlier = out.join("train-000.bin");
    std::fs::write(&earlier, "earlier run").unwrap();
    let output = smelt(&[&text], &qwen(), &out, &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let want = format!(
        "error: --out-dir {}: already holds token files (train-000.bin)",
        out.display()
    );
    assert!(
        !output.status.success() && stderr.starts_with(&want),
        "{stderr}"
    );
    assert_eq!(listing(&out), ["train-000.bin"]);
    assert_eq!(std::fs::read(&earlier).unwrap(), b"earlier run");
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
        "model": {"type": "WordLevel", "unk_token": "[UNK]",
                  "vocab": {"[UNK]": 0, "a": 1, "b": 3_000_000_000u64}},
    });
    std::fs::write(&tokenizer, model.to_string()).unwrap();
    let (text, out) = (text_file(dir.path()), dir.path().join("out"));
    let want = format!(
        "{}: token id 3000000000 does not fit BIN.TOK's int32 tokens",
        tokenizer.display()
    );
    refused(&[&text], &tokenizer, &out, &["--eos-id", "1"], &want);
}

/// Without --eos-id and with no configuration naming one, the EOS is never guessed.
#[test]
fn a_tokenizer_without_an_eos_asks_for_eos_id() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::copy(qwen(), &tokenizer).unwrap();
    let (text, out) = (text_file(dir.path()), dir.path().join("out"));
    let want = format!(
        "{}: no EOS token: none of tokenizer_config.json, config.json, generation_config.json beside it names one; pass --eos-id (the tokenizer's special tokens: <|endoftext|> = 151643, ",
        tokenizer.display()
    );
    refused(&[&text], &tokenizer, &out, &[], &want);
    let want = "--eos-id: EOS id 151665 is outside the tokenizer's vocabulary of 151665";
    refused(&[&text], &tokenizer, &out, &["--eos-id", "151665"], want);

    // A config.json naming the EOS by id (a list: the first is taken) is enough.
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"eos_token_id": [151643, 151645]}"#,
    )
    .unwrap();
    let ok = smelt(&[&text], &tokenizer, &out, &[]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains("EOS 151643 \"<|endoftext|>\""));
    assert_eq!(tokens(&token_files(&out)[0]), [9707, 1879, 151643]);
}

#[test]
fn inputs_that_match_nothing_or_are_of_unknown_type_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pattern = dir.path().join("*.txt");
    let want = format!("input {:?} matches no file", pattern.display().to_string());
    refused(&[&pattern], &qwen(), &out, &[], &want);
    let csv = dir.path().join("data.csv");
    std::fs::write(&csv, "a,b").unwrap();
    let want = format!("{}: unknown input type", csv.display());
    refused(&[&csv], &qwen(), &out, &[], &want);
}
