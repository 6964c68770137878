//! Every kind of input file, truncated, corrupted and inconsistent: a model's safetensors and
//! config.json, tokenizer.json, token files, and a checkpoint's tensors, state.json and
//! `latest`. Each damaged file is given to every command that reads it, which must fail with
//! one error line naming the file and what is wrong with it (and, where there is one, the
//! fix), and change no file that was there before (a log is only appended to).

mod train_support;

use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};
use train_support::*;

/// A command that reads the damaged input (`input` below: a model directory, a token file
/// or a checkpoint folder).
#[derive(Clone, Copy, Debug)]
enum Cmd {
    /// `smelt train` fine-tuning the weights of `input`.
    FineTune,
    /// `smelt train --from-scratch` with `input`'s config.
    FromScratch,
    Export,
    /// `smelt sample --model input`.
    Sample,
    /// `smelt tokenize` with `input`'s tokenizer.json.
    Tokenize,
    /// `smelt train` on the token file `input`.
    TrainFile,
    /// `smelt train` evaluating on the token file `input`.
    EvalFile,
    /// `smelt train --continue` from the checkpoint folder `input`.
    Continue,
    /// `smelt sample --checkpoint input`.
    SampleCheckpoint,
    /// `smelt export --checkpoint input`.
    ExportCheckpoint,
}

/// Where a case's input comes from.
#[derive(Clone, Copy, Debug)]
enum Source {
    Model,
    Tokens,
    Checkpoints,
}

type Damage = Box<dyn Fn(&Path) + Send + Sync>;

struct Case {
    name: &'static str,
    source: Source,
    damage: Damage,
    cmds: Vec<Cmd>,
    want: Vec<&'static str>,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

fn case(
    name: &'static str, source: Source, damage: impl Fn(&Path) + Send + Sync + 'static,
    cmds: &[Cmd], want: &[&'static str],
) -> Case {
    Case {
        name,
        source,
        damage: Box::new(damage),
        cmds: cmds.to_vec(),
        want: want.to_vec(),
    }
}

/// A trained tiny model (config.json, model.safetensors in f32, and a word-level
/// tokenizer.json of its 256 tokens), and the checkpoints of that run (steps 2 and 4).
struct Sources {
    set: Setup,
    model: PathBuf,
    ckpt: PathBuf,
}

/// The flags of the run that wrote `Sources::ckpt`.
const TRAINED: [&str; 4] = ["--ckpt-interval", "2", "--model-dtype", "f32"];

fn sources() -> Sources {
    let set = setup();
    let run = set.root.join("trained");
    smelt_ok(&strs(&run_args(&set, &run, &TRAINED)));
    let model = run.join("out");
    std::fs::write(
        model.join("tokenizer.json"),
        word_level_tokenizer(256).to_string(),
    )
    .unwrap();
    Sources {
        set,
        model,
        ckpt: run.join("ckpt"),
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        match entry.file_type().unwrap().is_dir() {
            true => copy_dir(&entry.path(), &target),
            false => drop(std::fs::copy(entry.path(), target).unwrap()),
        }
    }
}

/// Runs one case: copies its source into a folder of its own beside earlier outputs, damages
/// it, and runs each command on it.
fn check(src: &Sources, c: &Case) {
    let dir = src.set.root.join(c.name.replace(' ', "-"));
    let input = match c.source {
        Source::Model => dir.join("model"),
        Source::Tokens => dir.join("tokens.bin"),
        Source::Checkpoints => dir.join("ckpt"),
    };
    std::fs::create_dir_all(&dir).unwrap();
    match c.source {
        Source::Model => copy_dir(&src.model, &input),
        Source::Tokens => drop(std::fs::copy(&src.set.data, &input).unwrap()),
        Source::Checkpoints => copy_dir(&src.ckpt, &input),
    }
    (c.damage)(&input);
    // The log of an earlier run, which a refused one may only append to.
    let earlier = r#"{"time":1.0,"event":"option","name":"lr","value":0.1}"#;
    std::fs::write(dir.join("log.jsonl"), format!("{earlier}\n")).unwrap();
    std::fs::write(dir.join("text.txt"), "w1 w2 w3 w300 w7 ".repeat(20)).unwrap();
    for &cmd in &c.cmds {
        let before = snapshot(&dir);
        let out = smelt(&strs(&args(src, &dir, &input, cmd)));
        if let Some(problem) = refusal_problem(&out, &c.want) {
            panic!("{cmd:?}: {problem}");
        }
        let err = String::from_utf8_lossy(&out.stderr);
        let mut after = snapshot(&dir);
        let log = dir.join("log.jsonl");
        let (old, new) = (&before[&log], after.remove(&log).unwrap());
        assert!(new.starts_with(old), "{cmd:?}: the log was rewritten");
        let mut before = before;
        before.remove(&log);
        assert!(after == before, "{cmd:?} changed files: {err}");
    }
}

fn args(src: &Sources, dir: &Path, input: &Path, cmd: Cmd) -> Vec<String> {
    let input = s(input).to_string();
    let p = |name: &str| s(&dir.join(name)).to_string();
    let out = p("new-out");
    let train = |extra: &[&str]| {
        let mut a = run_args(&src.set, dir, &["--steps", "1", "--out-dir", &out]);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let own: Vec<String> = match cmd {
        Cmd::FineTune => {
            let mut a = train(&[]);
            a.retain(|x| x != "--from-scratch");
            let at = a.iter().position(|x| x == "--model").unwrap();
            a[at + 1] = input;
            return a;
        }
        Cmd::FromScratch => {
            let mut a = train(&[]);
            let at = a.iter().position(|x| x == "--model").unwrap();
            a[at + 1] = input;
            return a;
        }
        Cmd::TrainFile => {
            let mut a = train(&[]);
            let at = a.iter().position(|x| x == "--train-file").unwrap();
            a[at + 1] = input;
            return a;
        }
        Cmd::EvalFile => return train(&["--eval-file", &input]),
        Cmd::Continue => {
            let mut flags = TRAINED.to_vec();
            flags.extend(["--steps", "6", "--continue", "--checkpoint-dir", &input]);
            flags.extend(["--out-dir", &out]);
            return run_args(&src.set, dir, &flags);
        }
        Cmd::Export | Cmd::ExportCheckpoint => {
            let flag = match cmd {
                Cmd::Export => "--model",
                _ => "--checkpoint",
            };
            ["export", flag, &input, "--out-dir", &out]
                .into_iter()
                .map(String::from)
                .collect()
        }
        Cmd::Sample | Cmd::SampleCheckpoint => {
            let flag = match cmd {
                Cmd::Sample => "--model",
                _ => "--checkpoint",
            };
            let prompt = ["--prompt", "w1 w2 w300", "--max-new-tokens", "1"];
            let mut a = vec!["sample", flag, &input];
            a.extend(prompt);
            a.into_iter().map(String::from).collect()
        }
        Cmd::Tokenize => {
            let tokenizer = format!("{input}/tokenizer.json");
            let (text, out) = (p("text.txt"), p("tok"));
            [
                "tokenize",
                &text,
                "--tokenizer",
                &tokenizer,
                "--out-dir",
                &out,
            ]
            .into_iter()
            .chain(["--eos-id", "0"])
            .map(String::from)
            .collect()
        }
    };
    own
}

// ----- damage -----

fn write(path: impl AsRef<Path>, bytes: impl AsRef<[u8]>) {
    std::fs::write(path, bytes).unwrap();
}

/// Keeps the first `keep(length)` bytes of a file.
fn truncate(path: &Path, keep: impl Fn(usize) -> usize) {
    let bytes = std::fs::read(path).unwrap();
    write(path, &bytes[..keep(bytes.len())]);
}

/// A safetensors file's header and data.
fn read_st(path: &Path) -> (Map<String, Value>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

fn write_st(path: &Path, header: &Map<String, Value>, data: &[u8]) {
    let mut h = serde_json::to_vec(header).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h);
    bytes.extend(data);
    write(path, bytes);
}

/// Changes tensor `name`'s header entry.
fn edit_tensor(path: &Path, name: &str, edit: impl Fn(&mut Value)) {
    let (mut header, data) = read_st(path);
    edit(&mut header[name]);
    write_st(path, &header, &data);
}

/// Removes tensor `name` and its bytes: a valid file without it.
fn drop_tensor(path: &Path, name: &str) {
    let (header, data) = read_st(path);
    let range = |v: &Value| {
        (
            v["data_offsets"][0].as_u64().unwrap() as usize,
            v["data_offsets"][1].as_u64().unwrap() as usize,
        )
    };
    let mut tensors: Vec<(String, Value)> = header
        .into_iter()
        .filter(|(k, _)| k != name && k != "__metadata__")
        .collect();
    tensors.sort_by_key(|(_, v)| range(v));
    let (mut out, mut kept) = (Map::new(), vec![]);
    for (k, mut v) in tensors {
        let (a, b) = range(&v);
        v["data_offsets"] = json!([kept.len(), kept.len() + b - a]);
        kept.extend_from_slice(&data[a..b]);
        out.insert(k, v);
    }
    write_st(path, &out, &kept);
}

/// Overwrites the first tensor data bytes with 0xff: NaN in f32 and bf16.
fn nan_data(path: &Path) {
    let (header, mut data) = read_st(path);
    data[..64].fill(0xff);
    write_st(path, &header, &data);
}

fn edit_json(path: &Path, edit: impl Fn(&mut Value)) {
    let mut v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    edit(&mut v);
    write(path, v.to_string());
}

/// Sets int32 word `i` of a token file's header.
fn header_word(path: &Path, i: usize, value: i32) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[4 * i..4 * i + 4].copy_from_slice(&value.to_le_bytes());
    write(path, bytes);
}

/// Sets the token at `position` of a token file.
fn token(path: &Path, position: usize, value: i32) {
    let mut bytes = std::fs::read(path).unwrap();
    let at = 1024 + 4 * position;
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    write(path, bytes);
}

/// In a checkpoint folder, the latest checkpoint's file `name`.
fn last(ckpt: &Path, name: &str) -> PathBuf {
    ckpt.join("step-00000004").join(name)
}

fn run_cases(cases: Vec<Case>) {
    let src = sources();
    in_parallel(cases, |c| check(&src, c));
}

// ----- the cases -----

#[test]
fn damaged_model_weights() {
    use Cmd::*;
    use Source::Model;
    let st = |d: &Path| d.join("model.safetensors");
    let cmds = [FineTune, Export, Sample];
    let corrupt = [
        "model.safetensors",
        "truncated or corrupt",
        "write or download it again",
    ];
    run_cases(vec![
        case(
            "weights empty",
            Model,
            move |d| write(st(d), ""),
            &cmds,
            &corrupt,
        ),
        case(
            "weights cut in the header",
            Model,
            move |d| truncate(&st(d), |_| 100),
            &cmds,
            &corrupt,
        ),
        case(
            "weights cut in the data",
            Model,
            move |d| truncate(&st(d), |n| n / 2),
            &cmds,
            &corrupt,
        ),
        case(
            "weights cut by a byte",
            Model,
            move |d| truncate(&st(d), |n| n - 1),
            &cmds,
            &corrupt,
        ),
        case(
            "weights with bytes appended",
            Model,
            move |d| {
                let mut bytes = std::fs::read(st(d)).unwrap();
                bytes.extend(b"junk");
                write(st(d), bytes);
            },
            &cmds,
            &corrupt,
        ),
        case(
            "weights header not JSON",
            Model,
            move |d| {
                let mut bytes = std::fs::read(st(d)).unwrap();
                bytes[8..40].fill(b'#');
                write(st(d), bytes);
            },
            &cmds,
            &corrupt,
        ),
        case(
            "weights header length absurd",
            Model,
            move |d| {
                let mut bytes = std::fs::read(st(d)).unwrap();
                bytes[..8].copy_from_slice(&(1u64 << 60).to_le_bytes());
                write(st(d), bytes);
            },
            &cmds,
            &corrupt,
        ),
        case(
            "weights holding NaN",
            Model,
            move |d| nan_data(&st(d)),
            &cmds,
            &[
                "model.safetensors",
                "holds NaN",
                "write or download it again",
            ],
        ),
        case(
            "weights without a tensor",
            Model,
            move |d| drop_tensor(&st(d), "lm_head.weight"),
            &cmds,
            &["model.safetensors", "tensor `lm_head.weight` is missing"],
        ),
        case(
            "weights of another shape",
            Model,
            move |d| {
                edit_tensor(&st(d), "lm_head.weight", |t| {
                    t["shape"] = json!([1, 256, 32])
                })
            },
            &cmds,
            &[
                "model.safetensors",
                "has shape [1, 256, 32]",
                "config.json implies [256, 32]",
            ],
        ),
        case(
            "weights of an integer dtype",
            Model,
            move |d| edit_tensor(&st(d), "lm_head.weight", |t| t["dtype"] = json!("I32")),
            &cmds,
            &[
                "model.safetensors",
                "dtype I32",
                "smelt reads F32, BF16 and F16",
            ],
        ),
        case(
            "config wider than the weights",
            Model,
            move |d| edit_json(&d.join("config.json"), |c| c["hidden_size"] = json!(48)),
            &cmds,
            &[
                "model.safetensors",
                "has shape [256, 32]",
                "config.json implies [256, 48]",
            ],
        ),
        case(
            "config deeper than the weights",
            Model,
            move |d| {
                edit_json(&d.join("config.json"), |c| {
                    c["num_hidden_layers"] = json!(3)
                })
            },
            &cmds,
            &["model.safetensors", "tensor `model.layers.2.", "is missing"],
        ),
    ]);
}

#[test]
fn damaged_model_configs() {
    use Cmd::*;
    use Source::Model;
    let config = |d: &Path| d.join("config.json");
    let cmds = [FromScratch, Export, Sample];
    let edit = |edit: fn(&mut Value)| move |d: &Path| edit_json(&config(d), edit);
    run_cases(vec![
        case(
            "config empty",
            Model,
            move |d| write(config(d), ""),
            &cmds,
            &["config.json is not valid JSON"],
        ),
        case(
            "config cut",
            Model,
            move |d| truncate(&config(d), |n| n / 2),
            &cmds,
            &["config.json is not valid JSON", "EOF"],
        ),
        case(
            "config binary",
            Model,
            move |d| write(config(d), [0u8, 0xff, 0xfe, 7]),
            &cmds,
            &["config.json", "UTF-8"],
        ),
        case(
            "config not an object",
            Model,
            move |d| write(config(d), "[1, 2]"),
            &cmds,
            &["config.json: expected a JSON object"],
        ),
        case(
            "config heads not a multiple of kv heads",
            Model,
            edit(|c| c["num_attention_heads"] = json!(3)),
            &cmds,
            &[
                "config.json",
                "`num_attention_heads` 3 must be a multiple of `num_key_value_heads` 2",
            ],
        ),
        case(
            "config vocabulary 0",
            Model,
            edit(|c| c["vocab_size"] = json!(0)),
            &cmds,
            &["config.json", "`vocab_size` must be at least 1"],
        ),
        case(
            "config hidden size negative",
            Model,
            edit(|c| c["hidden_size"] = json!(-32)),
            &cmds,
            &[
                "config.json",
                "`hidden_size` must be a non-negative integer",
            ],
        ),
        case(
            "config layers a string",
            Model,
            edit(|c| c["num_hidden_layers"] = json!("2")),
            &cmds,
            &[
                "config.json",
                "`num_hidden_layers` must be a non-negative integer",
            ],
        ),
        case(
            "config of another architecture",
            Model,
            edit(|c| c["architectures"] = json!(["GPT2LMHeadModel"])),
            &cmds,
            &["config.json", "GPT2LMHeadModel", "supported:"],
        ),
        // Too large for any host: refused before allocating, naming what sets the size.
        case(
            "config vocabulary 1e12",
            Model,
            edit(|c| c["vocab_size"] = json!(1_000_000_000_000u64)),
            &cmds,
            &["cannot allocate the weights", "vocab_size"],
        ),
        case(
            "config hidden size 1e9",
            Model,
            edit(|c| c["hidden_size"] = json!(1_000_000_000)),
            &cmds,
            &["cannot allocate the weights", "hidden_size"],
        ),
    ]);
}

#[test]
fn damaged_tokenizers() {
    use Cmd::*;
    use Source::Model;
    let tokenizer = |d: &Path| d.join("tokenizer.json");
    let cmds = [Tokenize, Sample, FineTune];
    run_cases(vec![
        case(
            "tokenizer empty",
            Model,
            move |d| write(tokenizer(d), ""),
            &cmds,
            &["tokenizer.json"],
        ),
        case(
            "tokenizer cut",
            Model,
            move |d| truncate(&tokenizer(d), |n| n / 2),
            &cmds,
            &["tokenizer.json", "EOF"],
        ),
        case(
            "tokenizer binary",
            Model,
            move |d| write(tokenizer(d), [0u8, 1, 2, 0xff]),
            &cmds,
            &["tokenizer.json"],
        ),
        case(
            "tokenizer of no known kind",
            Model,
            move |d| write(tokenizer(d), r#"{"hello": 1}"#),
            &cmds,
            &["tokenizer.json"],
        ),
        // Valid, but of another model: its ids reach past the model's vocabulary.
        case(
            "tokenizer with more tokens than the model",
            Model,
            move |d| write(tokenizer(d), word_level_tokenizer(400).to_string()),
            &[Sample, FineTune],
            &["vocab"],
        ),
    ]);
}

#[test]
fn damaged_token_files() {
    use Cmd::*;
    use Source::Tokens;
    let cmds = [TrainFile, EvalFile];
    let again = "recreate it with `smelt tokenize`";
    run_cases(vec![
        case(
            "tokens cut in the header",
            Tokens,
            |p| truncate(p, |_| 500),
            &cmds,
            &["tokens.bin: 500 bytes is too short", again],
        ),
        case(
            "tokens cut in the data",
            Tokens,
            |p| truncate(p, |n| n / 2 + 1),
            &cmds,
            &["tokens.bin: truncated", again],
        ),
        case(
            "tokens cut in the mask",
            Tokens,
            |p| truncate(p, |n| n - 10),
            &cmds,
            &["tokens.bin: truncated", again],
        ),
        case(
            "tokens with bytes appended",
            Tokens,
            |p| {
                let mut bytes = std::fs::read(p).unwrap();
                bytes.extend([1, 2, 3]);
                write(p, bytes);
            },
            &cmds,
            &["tokens.bin: longer than its header says", again],
        ),
        case(
            "tokens version 3",
            Tokens,
            |p| header_word(p, 2, 3),
            &cmds,
            &["tokens.bin: BIN.TOK version 3 is not supported", again],
        ),
        case(
            "tokens of 2 bytes",
            Tokens,
            |p| header_word(p, 3, 2),
            &cmds,
            &["tokens.bin: 2 bytes per token", again],
        ),
        case(
            "tokens count negative",
            Tokens,
            |p| header_word(p, 4, -5),
            &cmds,
            &["tokens.bin: the header is corrupt", again],
        ),
        case(
            "tokens count past the end",
            Tokens,
            |p| header_word(p, 4, 1 << 30),
            &cmds,
            &["tokens.bin: truncated", again],
        ),
        case(
            "tokens count zero",
            Tokens,
            |p| header_word(p, 4, 0),
            &cmds,
            &["tokens.bin: longer than its header says", "smelt tokenize"],
        ),
        case(
            "tokens of another vocabulary",
            Tokens,
            |p| header_word(p, 5, 1000),
            &cmds,
            &[
                "tokens.bin: tokenized for a vocabulary of 1000, but the model has 256",
                "tokenize with the model's tokenizer",
            ],
        ),
        case(
            "tokens vocabulary negative",
            Tokens,
            |p| header_word(p, 5, -1),
            &cmds,
            &["tokens.bin: the header is corrupt", again],
        ),
        // The corpus has a loss mask; without the flag its bytes are left over.
        case(
            "tokens mask flag off",
            Tokens,
            |p| header_word(p, 6, 0),
            &cmds,
            &["tokens.bin: longer than its header says", again],
        ),
        case(
            "token past the vocabulary",
            Tokens,
            |p| token(p, 7, 300),
            &cmds,
            &[
                "tokens.bin: token 300 at position 7 is outside the model's vocabulary of 256",
                "tokenize with the model's own tokenizer",
            ],
        ),
        case(
            "token negative",
            Tokens,
            |p| token(p, 0, -7),
            &cmds,
            &[
                "tokens.bin: token -7 at position 0",
                "tokenize with the model's own tokenizer",
            ],
        ),
    ]);
}

#[test]
fn damaged_checkpoint_tensors() {
    use Cmd::*;
    use Source::Checkpoints;
    let readers = [Continue, SampleCheckpoint, ExportCheckpoint];
    let damaged = "step-00000004 is damaged";
    run_cases(vec![
        case(
            "checkpoint weights empty",
            Checkpoints,
            move |c| write(last(c, "model.safetensors"), ""),
            &readers,
            &[
                "step-00000004/model.safetensors",
                "truncated or corrupt",
                damaged,
            ],
        ),
        case(
            "checkpoint weights cut",
            Checkpoints,
            move |c| truncate(&last(c, "model.safetensors"), |n| n / 2),
            &readers,
            &[
                "step-00000004/model.safetensors",
                "truncated or corrupt",
                damaged,
            ],
        ),
        case(
            "checkpoint weights holding NaN",
            Checkpoints,
            move |c| nan_data(&last(c, "model.safetensors")),
            &readers,
            &[
                "step-00000004/model.safetensors: tensor `embed` holds NaN",
                damaged,
            ],
        ),
        case(
            "checkpoint weights of another shape",
            Checkpoints,
            move |c| {
                edit_tensor(&last(c, "model.safetensors"), "embed", |t| {
                    t["shape"] = json!([1, 256, 32])
                })
            },
            &readers,
            &[
                "model.safetensors: tensor `embed` has shape [1, 256, 32], expected [256, 32]",
                damaged,
            ],
        ),
        case(
            "checkpoint weights without a tensor",
            Checkpoints,
            move |c| drop_tensor(&last(c, "model.safetensors"), "embed"),
            &readers,
            &["model.safetensors: tensor `embed` is missing", damaged],
        ),
        case(
            "checkpoint moments header not JSON",
            Checkpoints,
            move |c| {
                let mut bytes = std::fs::read(last(c, "adam_m.safetensors")).unwrap();
                bytes[8..24].fill(b'{');
                write(last(c, "adam_m.safetensors"), bytes);
            },
            &[Continue],
            &["adam_m.safetensors", "truncated or corrupt", damaged],
        ),
        case(
            "checkpoint moments missing",
            Checkpoints,
            |c| std::fs::remove_file(last(c, "adam_v.safetensors")).unwrap(),
            &[Continue],
            &["adam_v.safetensors: cannot open", damaged],
        ),
        case(
            "checkpoint moments without a tensor",
            Checkpoints,
            move |c| drop_tensor(&last(c, "adam_m.safetensors"), "embed"),
            &[Continue],
            &["adam_m.safetensors: tensor `embed` is missing", damaged],
        ),
        case(
            "checkpoint moments holding NaN",
            Checkpoints,
            move |c| nan_data(&last(c, "adam_v.safetensors")),
            &[Continue],
            &["adam_v.safetensors: tensor", "holds NaN", damaged],
        ),
    ]);
}

#[test]
fn damaged_checkpoint_states() {
    use Cmd::*;
    use Source::Checkpoints;
    let readers = [Continue, SampleCheckpoint, ExportCheckpoint];
    let edit = move |edit: fn(&mut Value)| move |c: &Path| edit_json(&last(c, "state.json"), edit);
    let earlier = "point `latest` at an earlier step-N directory";
    let unreadable = [
        "step-00000004/state.json: not a smelt checkpoint state",
        earlier,
    ];
    let incompatible = [
        "step-00000004 was written by an incompatible run",
        "rerun with the checkpoint's settings",
    ];
    run_cases(vec![
        case(
            "state empty",
            Checkpoints,
            move |c| write(last(c, "state.json"), ""),
            &readers,
            &unreadable,
        ),
        case(
            "state cut",
            Checkpoints,
            move |c| truncate(&last(c, "state.json"), |n| n / 2),
            &readers,
            &unreadable,
        ),
        case(
            "state binary",
            Checkpoints,
            move |c| write(last(c, "state.json"), [0u8; 40]),
            &readers,
            &unreadable,
        ),
        case(
            "state without its RNG",
            Checkpoints,
            edit(|s| drop(s.as_object_mut().unwrap().remove("rng"))),
            &readers,
            &["missing field `rng`", earlier],
        ),
        case(
            "state missing",
            Checkpoints,
            move |c| std::fs::remove_file(last(c, "state.json")).unwrap(),
            &readers,
            &[
                "latest: names",
                "step-00000004, which is not a complete checkpoint",
                "point it at an existing step-N directory",
            ],
        ),
        case(
            "state of another step",
            Checkpoints,
            edit(|s| s["step"] = json!(2)),
            &readers,
            &[
                "step-00000004/state.json: is the state of step 2, not of step 4",
                earlier,
            ],
        ),
        case(
            "state hash edited",
            Checkpoints,
            edit(|s| s["config_hash"] = json!("0123456789abcdef")),
            &readers,
            &[
                "step-00000004/state.json: its config_hash does not match",
                earlier,
            ],
        ),
        case(
            "state fixed settings edited",
            Checkpoints,
            edit(|s| s["fixed"]["--batch-size"] = json!(4)),
            &readers,
            &[
                "step-00000004/state.json: its config_hash does not match",
                earlier,
            ],
        ),
        case(
            "state model config edited",
            Checkpoints,
            edit(|s| s["model_config"]["hidden_size"] = json!(48)),
            &readers,
            &[
                "step-00000004/state.json: its config_hash does not match",
                earlier,
            ],
        ),
        case(
            "state data position past the end",
            Checkpoints,
            edit(|s| s["loader"]["taken"] = json!(1u64 << 40)),
            &[Continue],
            &[
                "--continue from",
                "step-00000004",
                "past the end of an epoch",
                "the training files differ",
            ],
        ),
        case(
            "state of a future format",
            Checkpoints,
            edit(|s| s["version"] = json!(99)),
            &[Continue],
            &["format version 99", incompatible[0], incompatible[1]],
        ),
        case(
            "state of two ranks",
            Checkpoints,
            edit(|s| s["world_size"] = json!(2)),
            &[Continue],
            &[
                "global batch: checkpoint 2 ranks × --batch-size 2 × --grad-accumulation 1 = 4 \
                 sequences, this run 1 × 2 × 1 = 2",
                incompatible[0],
            ],
        ),
        case(
            "state without its batch size",
            Checkpoints,
            edit(|s| drop(s["options"].as_object_mut().unwrap().remove("batch_size"))),
            &[Continue],
            &[
                "step-00000004/state.json: `options.batch_size` is not a positive integer",
                earlier,
            ],
        ),
        case(
            "latest names nothing",
            Checkpoints,
            |c| write(c.join("latest"), "step-00000099"),
            &readers,
            &[
                "latest: names",
                "step-00000099, which is not a complete checkpoint",
                "point it at an existing step-N directory",
            ],
        ),
        case(
            "latest empty",
            Checkpoints,
            |c| write(c.join("latest"), ""),
            &readers,
            &["latest: names", "which is not a complete checkpoint"],
        ),
        case(
            "latest outside the folder",
            Checkpoints,
            |c| write(c.join("latest"), "../../.."),
            &readers,
            &["latest: names", "which is not a complete checkpoint"],
        ),
    ]);
}
