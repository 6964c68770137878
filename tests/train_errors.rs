//! Bad input gets one clear error naming the file (or flag) and the fix, and
//! leaves every file as it was.

mod train_support;

use std::path::PathBuf;

use smelt::data::tokfile::TokenWriter;
use train_support::*;

struct Case {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    model: PathBuf,
    good: PathBuf,
}

impl Case {
    fn new() -> Case {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let model = tiny_model_dir(&root);
        let good = corpus_file(&root.join("good.bin"), 2000, false);
        // An earlier run's model, which a refused run must leave alone (and which a new run
        // may not replace: `--out-dir` is new by default).
        std::fs::create_dir_all(root.join("out")).unwrap();
        std::fs::write(root.join("out/model.safetensors"), "earlier model").unwrap();
        let earlier = r#"{"time":1.0,"event":"option","name":"lr","value":0.1}"#;
        std::fs::write(root.join("log.jsonl"), format!("{earlier}\n")).unwrap();
        Case {
            _tmp: tmp,
            root,
            model,
            good,
        }
    }

    fn path(&self, name: &str) -> String {
        s(&self.root.join(name)).to_string()
    }

    /// `smelt train` on the tiny model with `train_file` and `extra` flags.
    fn args(&self, train_file: &str, extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = [
            "train",
            "--model",
            s(&self.model),
            "--from-scratch",
            "--train-file",
            train_file,
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        let defaults = [
            ("--batch-size", "2".to_string()),
            ("--seq-len", "16".to_string()),
            ("--steps", "2".to_string()),
            ("--out-dir", self.path("model")),
            ("--log-file", self.path("log.jsonl")),
            ("--checkpoint-dir", self.path("ckpt")),
        ];
        for (flag, value) in defaults {
            if !extra.contains(&flag) {
                args.extend([flag.to_string(), value]);
            }
        }
        args.extend(extra.iter().map(|a| a.to_string()));
        args
    }

    /// Runs a command that must fail without changing any file; returns its error.
    fn refused(&self, args: &[String]) -> String {
        let before = snapshot(&self.root);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = smelt_err(&args);
        assert_eq!(
            err.lines().filter(|l| l.starts_with("error:")).count(),
            1,
            "one error: {err}"
        );
        assert!(
            snapshot(&self.root) == before,
            "a refused run changed files: {err}"
        );
        err
    }

    fn check(&self, args: &[String], expected: &[&str]) {
        let err = self.refused(args);
        for e in expected {
            assert!(err.contains(e), "expected {e:?} in: {err}");
        }
    }
}

#[test]
fn missing_empty_and_foreign_train_files() {
    let c = Case::new();
    c.check(
        &c.args(&c.path("nope.bin"), &[]),
        &[
            "nope.bin: no such token file (--train-file)",
            "smelt tokenize",
        ],
    );
    c.check(
        &c.args(&c.path("nothing-*.bin"), &[]),
        &["--train-file", "nothing-*.bin: no file matches"],
    );
    std::fs::write(c.root.join("empty.bin"), "").unwrap();
    c.check(
        &c.args(&c.path("empty.bin"), &[]),
        &[
            "empty.bin: 0 bytes is too short",
            "recreate it with `smelt tokenize`",
        ],
    );
    std::fs::write(c.root.join("text.bin"), "not tokens ".repeat(200)).unwrap();
    c.check(
        &c.args(&c.path("text.bin"), &[]),
        &[
            "text.bin: not a BIN.TOK token file (wrong magic)",
            "smelt tokenize",
        ],
    );
    // An eval file is checked the same way.
    c.check(
        &c.args(s(&c.good), &["--eval-file", &c.path("nope.bin")]),
        &["nope.bin: no such token file (--eval-file)"],
    );
}

#[test]
fn token_out_of_vocabulary_and_file_shorter_than_a_sequence() {
    let c = Case::new();
    let bad = c.root.join("big-ids.bin");
    let mut w = TokenWriter::create(&bad, None, false).unwrap();
    w.write(&[1, 2, 3, 300, 4], None).unwrap();
    w.finish().unwrap();
    c.check(
        &c.args(s(&bad), &[]),
        &[
            "big-ids.bin: token 300 at position 3 is outside the model's vocabulary of 256",
            "tokenize with the model's own tokenizer",
        ],
    );
    let short = corpus_file(&c.root.join("short.bin"), 100, false);
    c.check(
        &c.args(s(&short), &["--seq-len", "128"]),
        &[
            "short.bin: 100 tokens is too short for one sequence of --seq-len 128",
            "use a smaller --seq-len",
        ],
    );
}

#[test]
fn unwritable_or_sharded_out_dir() {
    let c = Case::new();
    // A directory cannot be made inside a regular file, whoever runs the test (even root).
    let inside_file = format!("{}/out", s(&c.good));
    c.check(
        &c.args(s(&c.good), &["--out-dir", &inside_file]),
        &[
            "--out-dir",
            "good.bin/out: cannot write there",
            "choose a directory",
        ],
    );
    // A sharded model's index would shadow the exported single file, for `smelt train` and
    // `smelt export` alike; exporting over the model read is refused too.
    std::fs::write(c.root.join("out/model.safetensors.index.json"), "{}").unwrap();
    let sharded = [
        "out: holds a sharded model (model.safetensors.index.json)",
        "choose another --out-dir or remove the old shards",
    ];
    let out = c.path("out");
    c.check(&c.args(s(&c.good), &["--out-dir", &out]), &sharded);
    let export = |out: &str| -> Vec<String> {
        ["export", "--model", s(&c.model), "--out-dir", out]
            .iter()
            .map(|a| a.to_string())
            .collect()
    };
    c.check(&export(&c.path("out")), &sharded);
    let into_model = "is the --model directory";
    c.check(
        &c.args(s(&c.good), &["--out-dir", s(&c.model)]),
        &[into_model],
    );
    c.check(
        &export(s(&c.model)),
        &[into_model, "write into another directory"],
    );
}

#[test]
fn an_out_dir_holding_files_is_refused_before_any_work() {
    // `out` holds an earlier model's weights, which a new model would replace, leaving
    // whatever else the earlier one had (its tokenizer) beside the new weights.
    let c = Case::new();
    let holds = [
        "out: already holds files (model.safetensors)",
        "choose a new directory or delete them",
    ];
    let out = c.path("out");
    c.check(&c.args(s(&c.good), &["--out-dir", &out]), &holds);
    let export = |out: &str| -> Vec<String> {
        ["export", "--model", s(&c.model), "--out-dir", out]
            .iter()
            .map(|a| a.to_string())
            .collect()
    };
    c.check(&export(&c.path("out")), &holds);
    // Only an earlier model's tokenizer: the new weights would be read with it.
    std::fs::create_dir_all(c.root.join("other")).unwrap();
    std::fs::write(c.root.join("other/tokenizer.json"), "{}").unwrap();
    c.check(
        &export(&c.path("other")),
        &["other: already holds files (tokenizer.json)"],
    );
    // Refused before the demo writes its data.
    let demo = c.path("demo");
    c.check(
        &[
            "train".into(),
            "--demo-dir".into(),
            demo,
            "--out-dir".into(),
            c.path("out"),
        ],
        &holds,
    );
    // An empty directory is fine.
    std::fs::create_dir_all(c.root.join("empty")).unwrap();
    let args = c.args(s(&c.good), &["--steps", "1", "--out-dir", &c.path("empty")]);
    smelt_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(c.root.join("empty/model.safetensors").is_file());
}

#[test]
fn continue_refuses_an_incompatible_or_missing_checkpoint() {
    let c = Case::new();
    c.check(
        &c.args(s(&c.good), &["--continue"]),
        &["--continue: no checkpoint in", "run without --continue"],
    );
    // The run whose checkpoints the others try to continue, with a model directory of its
    // own, so that the default one stays new for the fresh run below.
    let fresh = c.path("fresh-out");
    let ok: Vec<String> = c.args(s(&c.good), &["--ckpt-interval", "1", "--out-dir", &fresh]);
    smelt_ok(&ok.iter().map(String::as_str).collect::<Vec<_>>());

    c.check(
        &c.args(s(&c.good), &["--continue", "--batch-size", "4"]),
        &[
            "--continue: checkpoint",
            "step-00000002 was written by an incompatible run",
            "global batch: checkpoint 1 rank × --batch-size 2 × --grad-accumulation 1 = 2 \
             sequences, this run 1 × 4 × 1 = 4; keep ranks × --batch-size × \
             --grad-accumulation at 2, e.g. --batch-size 2",
            "rerun with the checkpoint's settings",
        ],
    );
    let wider = c.root.join("wider");
    std::fs::create_dir_all(&wider).unwrap();
    let config = std::fs::read_to_string(c.model.join("config.json")).unwrap();
    std::fs::write(
        wider.join("config.json"),
        config.replace("\"hidden_size\":32", "\"hidden_size\":48"),
    )
    .unwrap();
    let mut args = c.args(s(&c.good), &["--continue"]);
    args[2] = s(&wider).to_string();
    c.check(
        &args,
        &["model config `hidden_size`: checkpoint 32, this run 48"],
    );
    // Starting afresh with checkpoints into that directory would mix two runs.
    c.check(
        &c.args(s(&c.good), &["--ckpt-interval", "1"]),
        &["already holds checkpoints", "pass --continue"],
    );
}

#[test]
fn flags_that_are_not_implemented_or_incomplete() {
    let c = Case::new();
    let graphs_with = [
        (&["--offload-residual"][..], "with --offload-residual yet"),
        (
            &["--grad-accumulation", "2", "--layer-major"],
            "with --layer-major yet",
        ),
        (
            &["--gpus", "2"],
            "records one GPU's passes, and this run has 2 ranks",
        ),
        (
            &[
                "--optimizer-in-backward",
                "--grad-clip",
                "0",
                "--on-spike",
                "warn",
            ],
            "with --optimizer-in-backward yet",
        ),
    ];
    for (flags, error) in graphs_with {
        let flags = [&["--use-cuda-graphs"], flags].concat();
        c.check(&c.args(s(&c.good), &flags), &["--use-cuda-graphs", error]);
    }
    c.check(
        &c.args(s(&c.good), &["--zero-level", "4"]),
        &["--zero-level 4 is not implemented yet", "use one of those"],
    );
    c.check(
        &c.args(
            s(&c.good),
            &["--zero-level", "2", "--grad-sum-after-backward"],
        ),
        &["--grad-sum-after-backward cannot be used with --zero-level 2"],
    );
    let precision_errors: [(&[&str], &str); 8] = [
        (
            &["--offload-master", "--model-dtype", "f32"],
            "--offload-master: this run keeps no master copy of the weights",
        ),
        // The values a dtype flag takes are listed, in its --help too.
        (
            &["--matmul-dtype", "e5m2"],
            "invalid value 'e5m2' for '--matmul-dtype <DTYPE>'\n  [possible values: bf16, e4m3, int8]",
        ),
        (
            &["--model-dtype", "f16"],
            "invalid value 'f16' for '--model-dtype <DTYPE>'\n  [possible values: f32, bf16]",
        ),
        (
            &["--master-dtype", "bf16", "--model-dtype", "f32"],
            "--master-dtype bf16: the master weights must be f32, or the same as --model-dtype (f32)",
        ),
        // The other spellings, in any case, mean the same.
        (
            &["--gradient-dtype", "FP8-E5M2"],
            "--gradient-dtype e5m2 needs --matmul-dtype e4m3",
        ),
        (
            &["--gradient-dtype", "e5m2"],
            "--gradient-dtype e5m2 needs --matmul-dtype e4m3",
        ),
        (
            &["--matmul-dtype", "e4m3", "--model-dtype", "float32"],
            "they need --model-dtype bf16 (not f32)",
        ),
        (
            &["--debug-log-abs-max", "1"],
            "--debug-log-abs-max logs FP8 statistics; it needs --matmul-dtype e4m3",
        ),
    ];
    for (flags, message) in precision_errors {
        c.check(&c.args(s(&c.good), flags), &[message]);
    }
    c.check(
        &["train".into(), "--train-file".into(), s(&c.good).into()],
        &["--train-file needs --model DIR"],
    );
    let nowhere = c.path("no-model");
    let mut args = c.args(s(&c.good), &[]);
    args[2] = nowhere;
    c.check(
        &args,
        &["no-model: no such directory, and not a built-in architecture"],
    );
    // A directory without a config is named as such.
    let mut args = c.args(s(&c.good), &[]);
    args[2] = c.path("out");
    c.check(&args, &["out: no config.json"]);
    // The tiny model has a config but no weights to fine-tune.
    let mut args = c.args(s(&c.good), &[]);
    args.retain(|a| a != "--from-scratch");
    c.check(&args, &["no model.safetensors", "pass --from-scratch"]);
}

#[test]
fn gpu_telemetry_is_refused_on_the_cpu() {
    // Whatever this machine has, a run on the CPU has no GPU for NVML to read.
    let c = Case::new();
    for extra in [
        &["--device", "cpu"][..],
        &["--device", "cpu", "--gpus", "2"],
    ] {
        let flags = [&["--log-gpu-util", "1"][..], extra].concat();
        c.check(
            &c.args(s(&c.good), &flags),
            &["--log-gpu-util reads GPUs through NVML, and this run is on the CPU"],
        );
    }
}

#[test]
fn flags_out_of_range() {
    let c = Case::new();
    let cases: [(&[&str], &str); 17] = [
        (&["--lr", "0"], "--lr 0: must be positive"),
        // A negative number is a value, not a flag, with or without `=`.
        (&["--lr", "-1"], "--lr -1: must be positive"),
        (&["--lr=-1"], "--lr -1: must be positive"),
        (&["--lr", "inf"], "--lr inf: must be a finite number"),
        // Finite in f64, but infinite in the f32 the optimizer computes in.
        (&["--lr", "1e39"], "--lr 1e39: beyond f32's range"),
        (
            &["--weight-decay", "-0.1"],
            "--weight-decay -0.1: must be at least 0",
        ),
        (
            &["--weight-decay", "inf"],
            "--weight-decay inf: must be a finite number",
        ),
        (
            &["--grad-clip", "inf"],
            "--grad-clip inf: must be a finite number",
        ),
        // clap reads `-inf` as a value only after `=`.
        (&["--beta-2=-inf"], "--beta-2 -inf: must be a finite number"),
        (
            &["--z-loss", "inf"],
            "--z-loss inf: must be a finite number",
        ),
        (
            &["--final-lr-fraction", "NaN"],
            "--final-lr-fraction NaN: must be a finite number",
        ),
        (
            &["--fit-memory", "-2"],
            "--fit-memory -2: give a positive number of GiB",
        ),
        (
            &["--final-lr-fraction", "2"],
            "--final-lr-fraction 2: must be between 0 and 1",
        ),
        (
            &["--beta-1", "1"],
            "--beta-1 1: must be at least 0 and below 1",
        ),
        (
            &["--grad-clip=-1"],
            "--grad-clip -1: must not be negative (0 turns clipping off)",
        ),
        (
            &["--adam-eps", "NaN"],
            "--adam-eps NaN: must be a finite number",
        ),
        (
            &["--eval-num-steps", "0"],
            "--eval-num-steps must be at least 1",
        ),
    ];
    for (flags, message) in cases {
        c.check(&c.args(s(&c.good), flags), &[message]);
    }
}

#[test]
fn log_file_that_is_not_a_log() {
    // A token file given as --log-file by mistake is not appended to.
    let c = Case::new();
    c.check(
        &c.args(s(&c.good), &["--log-file", s(&c.good)]),
        &[
            "good.bin: exists and is not a smelt log",
            "choose another file",
        ],
    );
}

#[test]
fn documents_need_an_eos_the_run_can_name() {
    let c = Case::new();
    let good = s(&c.good).to_string();
    // The tiny model's directory has no tokenizer files to name one.
    c.check(
        &c.args(&good, &["--doc-mask"]),
        &["has no tokenizer.json to name the EOS", "pass --eos-id"],
    );
    c.check(
        &c.args(&good, &["--doc-positions", "--eos-id", "256"]),
        &["--eos-id 256 is outside the model's vocabulary of 256"],
    );
    c.check(
        &c.args(&good, &["--eos-id", "10"]),
        &["--eos-id tells the documents apart", "--doc-mask"],
    );
}
