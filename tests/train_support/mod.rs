//! Helpers for the trainer's end-to-end tests: a tiny model directory, token files, running
//! the `smelt` binary (also killed, or with a full disk), reading its log, and comparing runs.
#![allow(dead_code)]

pub mod python;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use smelt::data::tokfile::TokenWriter;
use smelt::train::checkpoint;
use smelt::train::demo::CORPUS;
use smelt::train::log::{self, Event};

pub const SMELT: &str = env!("CARGO_BIN_EXE_smelt");

/// A learning rate at the top of f32's range, with bf16 weights: the first update takes every
/// weight with a gradient to about 3.4e38, finite in the f32 master copy but past bf16's
/// largest value (3.39e38), so the bf16 weights are infinite (the rate held at every step,
/// and no weight decay, which such a rate refuses). The step's loss and gradient norm are
/// finite: they come before the update.
#[rustfmt::skip]
pub const DIVERGING: [&str; 10] = [
    "--lr", "3.4e38", "--lr-schedule", "constant", "--model-dtype", "bf16",
    "--weight-decay", "0", "--warmup", "0",
];

/// A tiny byte-level Llama's `config.json` in `dir`.
pub fn tiny_model_dir(dir: &Path) -> PathBuf {
    let model = dir.join("tiny-model");
    std::fs::create_dir_all(&model).unwrap();
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false,
    });
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    model
}

/// The first `n` bytes of the demo corpus as a token file, with every 7th target masked
/// out when `masked`.
pub fn corpus_file(path: &Path, n: usize, masked: bool) -> PathBuf {
    let tokens: Vec<i32> = CORPUS.bytes().take(n).map(i32::from).collect();
    let mut w = TokenWriter::create(path, Some(256), masked).unwrap();
    let mask: Vec<bool> = (0..tokens.len()).map(|i| i % 7 != 3).collect();
    w.write(&tokens, masked.then_some(mask.as_slice())).unwrap();
    w.finish().unwrap()
}

/// The arguments of a short `smelt train` of the tiny model from scratch on the CPU: 40 steps
/// of 4 × 32 tokens of the first 4000 bytes of the demo corpus at --lr 3e-3, logged to
/// `<root>/<name>.jsonl`, with `flags` added.
pub fn tiny_run_args(root: &Path, name: &str, flags: &[&str]) -> Vec<String> {
    model_run_args(root, &tiny_model_dir(root), name, flags)
}

/// `tiny_run_args` of the model in `model`.
pub fn model_run_args(root: &Path, model: &Path, name: &str, flags: &[&str]) -> Vec<String> {
    let data = corpus_file(&root.join("data.bin"), 4000, false);
    let log = root.join(format!("{name}.jsonl"));
    let mut args: Vec<String> = [
        "train",
        "--device",
        "cpu",
        "--model",
        s(model),
        "--from-scratch",
        "--train-file",
        s(&data),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--steps",
        "40",
        "--lr",
        "3e-3",
        "--log-file",
        s(&log),
    ]
    .map(String::from)
    .to_vec();
    args.extend(flags.iter().map(|f| f.to_string()));
    args
}

/// Runs `tiny_run_args` and returns its log's path.
pub fn tiny_run(root: &Path, name: &str, flags: &[&str]) -> PathBuf {
    let args = tiny_run_args(root, name, flags);
    smelt_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    root.join(format!("{name}.jsonl"))
}

/// The mean loss of the first and of the last five steps of a run's log.
pub fn first_and_last_losses(log: &Path) -> (f64, f64) {
    let losses: Vec<f64> = steps(log).into_iter().map(|(_, l, _)| l).collect();
    let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
    (mean(&losses[..5]), mean(&losses[losses.len() - 5..]))
}

/// Runs `smelt` with `args`.
pub fn smelt(args: &[&str]) -> Output {
    Command::new(SMELT).args(args).output().unwrap()
}

/// Runs `smelt` and fails the test, showing its output, unless it succeeds.
pub fn smelt_ok(args: &[&str]) -> String {
    let out = smelt(args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "smelt {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs `smelt`, expecting it to fail; returns its stderr.
pub fn smelt_err(args: &[&str]) -> String {
    let out = smelt(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "smelt {args:?} should have failed:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// (step, loss, data hash) of every step event in a log, in order.
pub fn steps(log_path: &Path) -> Vec<(u64, f64, String)> {
    log::read(log_path)
        .unwrap()
        .events
        .into_iter()
        .filter_map(|e| match e {
            Event::Step {
                step, loss, data, ..
            } => Some((step, loss, data)),
            _ => None,
        })
        .collect()
}

pub fn events(log_path: &Path) -> Vec<Event> {
    log::read(log_path).unwrap().events
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A temporary folder holding the tiny model and a 3000-token corpus with masked targets.
pub struct Setup {
    _tmp: tempfile::TempDir,
    pub root: PathBuf,
    pub model: PathBuf,
    pub data: PathBuf,
}

pub fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let model = tiny_model_dir(&root);
    let data = corpus_file(&root.join("train.bin"), 3000, true);
    Setup {
        _tmp: tmp,
        root,
        model,
        data,
    }
}

/// Copies the step-`step` checkpoint of checkpoint folder `from` into `to` (created), as
/// its latest: where a run that stopped after that checkpoint would have left it.
pub fn copy_checkpoint(from: &Path, step: u64, to: &Path) {
    let copy = checkpoint::step_dir(to, step);
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(checkpoint::step_dir(from, step)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    let name = copy.file_name().unwrap();
    std::fs::write(to.join(checkpoint::LATEST), name.as_encoded_bytes()).unwrap();
}

/// A `resume_args` run continued from `full`'s step-2 checkpoint, in `name`, with the same `extra` flags:
/// a run that stopped after step 3 leaves that checkpoint as the latest, so take it.
pub fn resumed_at_step_2(s: &Setup, full: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let resumed = s.root.join(name);
    copy_checkpoint(&full.join("ckpt"), 2, &resumed.join("ckpt"));
    let mut flags = extra.to_vec();
    flags.push("--continue");
    run_with(&resume_args(&resumed, &s.model, &s.data), &flags);
    resumed
}

/// A copy of the tiny model's config in folder `name`, changed by `edit`.
pub fn model_variant(
    set: &Setup, name: &str, edit: impl FnOnce(&mut serde_json::Value),
) -> PathBuf {
    let dir = set.root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(set.model.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

/// Sets the value that follows each of `flags` in `args` to `value`.
pub fn set_flags(args: &mut [String], flags: &[&str], value: &str) {
    for i in 1..args.len() {
        if flags.contains(&args[i - 1].as_str()) {
            args[i] = value.into();
        }
    }
}

/// The Adam moment flags, which `set_flags` turns to q8.
pub const MOMENT_FLAGS: [&str; 2] = ["--opt-m-dtype", "--opt-v-dtype"];

/// The `String` arguments as `&str`s.
pub fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// `smelt train` on the set-up's tiny model and corpus, writing into `dir` (`ckpt/`,
/// `out/`, `log.jsonl`): 4 steps of 2 × 16 tokens. A flag of `extra` replaces the default
/// of the same name; the others are appended.
pub fn run_args(set: &Setup, dir: &Path, extra: &[&str]) -> Vec<String> {
    let p = |name: &str| s(&dir.join(name)).to_string();
    let defaults = [
        ("--model", s(&set.model).to_string()),
        ("--train-file", s(&set.data).to_string()),
        ("--batch-size", "2".into()),
        ("--seq-len", "16".into()),
        ("--steps", "4".into()),
        ("--lr", "1e-2".into()),
        ("--warmup", "1".into()),
        ("--checkpoint-dir", p("ckpt")),
        ("--out-dir", p("out")),
        ("--log-file", p("log.jsonl")),
    ];
    let given = |flag: &str| {
        extra
            .iter()
            .any(|a| *a == flag || a.starts_with(&format!("{flag}=")))
    };
    let mut args = vec!["train".to_string(), "--from-scratch".to_string()];
    for (flag, value) in defaults {
        if !given(flag) {
            args.extend([flag.to_string(), value]);
        }
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// Every file under `dir` with its contents.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

/// The names under `dir` (recursively, relative to it) that are hidden: temporary files and
/// folders a write left behind.
pub fn hidden_files(dir: &Path) -> Vec<String> {
    let mut found = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with('.') {
                found.push(path.strip_prefix(dir).unwrap().display().to_string());
            }
            if path.is_dir() {
                stack.push(path);
            }
        }
    }
    found
}

/// The stderr of a run that must have failed with exactly one `error:` line, whose message
/// (with any lines it continues on) holds each of `want`; and no panic or abort (exit 1, or
/// 2 for a command line the parser refused).
pub fn assert_refused(out: &Output, want: &[&str]) -> String {
    if let Some(problem) = refusal_problem(out, want) {
        panic!("{problem}");
    }
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// What is wrong with `out` as `assert_refused` sees it, if anything.
pub fn refusal_problem(out: &Output, want: &[&str]) -> Option<String> {
    let err = String::from_utf8_lossy(&out.stderr);
    if !matches!(out.status.code(), Some(1 | 2)) {
        let stdout = String::from_utf8_lossy(&out.stdout);
        return Some(format!(
            "expected a clean failure (exit 1 or 2), got {}: {err}\n{stdout}",
            out.status
        ));
    }
    let errors = err.lines().filter(|l| l.starts_with("error:")).count();
    if errors != 1 {
        return Some(format!("expected one error line: {err}"));
    }
    let message = &err[err.find("error:").expect("counted above")..];
    let missing: Vec<&&str> = want.iter().filter(|w| !message.contains(**w)).collect();
    (!missing.is_empty()).then(|| format!("expected {missing:?} in: {err}"))
}

/// Gives `cmd`'s process files of at most `bytes` (RLIMIT_FSIZE), which needs no root: a
/// write past that fails with EFBIG ("File too large"), as one to a full disk fails with
/// ENOSPC. SIGXFSZ, which would kill the process instead, is ignored.
pub fn limit_file_size(cmd: &mut Command, bytes: u64) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec only async-signal-safe calls are made (signal and
    // setrlimit), on values owned by the closure.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            match libc::setrlimit(libc::RLIMIT_FSIZE, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        })
    }
}

/// Starts `cmd`, polls until `ready()` holds, then kills it with SIGKILL and waits for it.
/// Fails the test if the process ends by itself first, or `ready` takes over a minute.
pub fn kill_when(cmd: &mut Command, ready: impl Fn() -> bool) {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !ready() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "{cmd:?} ended before it was killed"
        );
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{cmd:?}: never ready"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

/// Runs `f` on every item, on as many threads as the machine has cores (the cases are
/// independent processes), and then fails with every case's failure, if any failed.
pub fn in_parallel<T: Send + std::fmt::Debug>(items: Vec<T>, f: impl Fn(&T) + Sync) {
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let queue = std::sync::Mutex::new(items.into_iter());
    let failures = std::sync::Mutex::new(vec![]);
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    let next = queue.lock().unwrap().next();
                    let Some(item) = next else { break };
                    let caught =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&item)));
                    if let Err(panic) = caught {
                        let message = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        failures
                            .lock()
                            .unwrap()
                            .push(format!("{item:?}: {message}"));
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// The command line of a 6-step run in `dir` (checkpoints every 2 steps, into `ckpt/`; the
/// model into `out/`, the log into `log.jsonl`), with bf16 weights and an f32 master copy,
/// bf16 Adam moments (stochastic rounding), gradient accumulation and z-loss: every piece of
/// state a bitwise resume must save.
pub fn resume_args(dir: &Path, model: &Path, data: &Path) -> Vec<String> {
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    [
        "train",
        "--model",
        s(model),
        "--from-scratch",
        "--train-file",
        s(data),
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--grad-accumulation",
        "2",
        "--steps",
        "6",
        "--warmup",
        "2",
        "--lr",
        "1e-2",
        "--model-dtype",
        "bf16",
        "--opt-m-dtype",
        "bf16",
        "--opt-v-dtype",
        "bf16",
        "--z-loss",
        "1e-4",
        "--ckpt-interval",
        "2",
    ]
    .iter()
    .map(|a| a.to_string())
    .chain([
        "--checkpoint-dir".into(),
        p("ckpt"),
        "--out-dir".into(),
        p("out"),
        "--log-file".into(),
        p("log.jsonl"),
    ])
    .collect()
}

/// Runs `smelt` with `args` and `extra`, which must succeed.
pub fn run_with(args: &[String], extra: &[&str]) {
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    all.extend(extra);
    smelt_ok(&all);
}

/// The bytes of every file in a checkpoint, by name.
pub fn checkpoint_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    names
        .into_iter()
        .filter(|p| p.file_name().unwrap() != "state.json")
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(p).unwrap())
        })
        .collect()
}

/// Asserts that `resumed` (a run folder of `resume_args`) did after step `from_step` what
/// the uninterrupted `full` did: the same losses and data, step by step, bit for bit, and the
/// same final weights and optimizer state.
pub fn assert_same_run(full: &Path, resumed: &Path, from_step: u64) {
    let (a, b) = (
        steps(&full.join("log.jsonl")),
        steps(&resumed.join("log.jsonl")),
    );
    // By step; a step the killed run did before it died is replaced by its replay.
    let after = |v: &[(u64, f64, String)]| {
        v.iter()
            .filter(|x| x.0 > from_step)
            .map(|(step, loss, data)| (*step, (loss.to_bits(), data.clone())))
            .collect::<std::collections::BTreeMap<_, _>>()
            .into_iter()
            .collect::<Vec<_>>()
    };
    assert_eq!(after(&a).len(), (6 - from_step) as usize);
    // Bitwise: the same losses (as f64 bits) and the same input tokens, step by step.
    assert_eq!(after(&a), after(&b));
    assert_eq!(
        std::fs::read(full.join("out/model.safetensors")).unwrap(),
        std::fs::read(resumed.join("out/model.safetensors")).unwrap(),
        "final weights differ"
    );
    let last = |d: &Path| checkpoint::step_dir(&d.join("ckpt"), 6);
    assert_eq!(
        checkpoint_files(&last(full)),
        checkpoint_files(&last(resumed)),
        "final optimizer state differs"
    );
}

/// A word-level tokenizer.json of `n` tokens: `<eos>`, `[UNK]`, then `w0`, `w1`, ... (fast to
/// load and to run, unlike a real one).
pub fn word_level_tokenizer(n: usize) -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<eos>".into(), 0.into());
    vocab.insert("[UNK]".into(), 1.into());
    for i in 2..n {
        vocab.insert(format!("w{}", i - 2), i.into());
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    })
}

/// `words` pseudo-random words of that tokenizer (`w0` to `w199`), a document (line) of
/// every 100.
pub fn word_text(words: usize) -> String {
    let mut x = 1u64;
    let mut text = String::with_capacity(5 * words);
    for i in 0..words {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        text.push_str(&format!("w{} ", (x >> 33) % 200));
        if i % 100 == 99 {
            text.push('\n');
        }
    }
    text
}
