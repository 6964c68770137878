//! A full disk, simulated without root by a limit on the size of the files a process may
//! write (RLIMIT_FSIZE): for checkpoints, the log, the exported model and token files. Each
//! run fails with one error naming the file, leaves no temporary file behind, and damages
//! nothing written before.

mod train_support;

use std::path::Path;
use std::process::{Command, Output};

use smelt::train::checkpoint;
use train_support::*;

/// Runs `smelt` with `args`, its files limited to `bytes` each.
fn with_limit(bytes: u64, args: &[String]) -> Output {
    let mut cmd = Command::new(SMELT);
    cmd.args(args);
    limit_file_size(&mut cmd, bytes).output().unwrap()
}

/// The tiny model in f32: its weights' file is 141 kB, the optimizer's files as large, the
/// log of a short run a few kB.
const F32: [&str; 2] = ["--model-dtype", "f32"];

/// Room for the log and the config, not for a tensor file.
const SMALL_DISK: u64 = 100_000;

#[test]
fn a_full_disk_during_the_first_checkpoint_leaves_nothing_behind() {
    let set = setup();
    let dir = set.root.join("run");
    let mut flags = F32.to_vec();
    flags.extend(["--ckpt-interval", "2"]);
    let out = with_limit(SMALL_DISK, &run_args(&set, &dir, &flags));
    assert_refused(
        &out,
        &["checkpoint", "step-00000002", "model.safetensors", "free"],
    );
    let ckpt = dir.join("ckpt");
    assert_eq!(hidden_files(&ckpt), Vec::<String>::new());
    assert_eq!(checkpoint::read_latest(&ckpt).unwrap(), None);
    assert!(!checkpoint::step_dir(&ckpt, 2).exists());
}

/// A checkpoint that does not fit leaves the one before as the latest, and a run continued
/// from it on a disk with room ends as the run that never failed.
#[test]
fn a_full_disk_during_a_later_checkpoint_keeps_the_one_before() {
    let set = setup();
    let mut flags = F32.to_vec();
    flags.extend(["--ckpt-interval", "2"]);
    let reference = set.root.join("reference");
    smelt_ok(&strs(&run_args(&set, &reference, &flags)));

    let dir = set.root.join("run");
    let ckpt = dir.join("ckpt");
    copy_checkpoint(&reference.join("ckpt"), 2, &ckpt);
    let before = snapshot(&ckpt);
    flags.push("--continue");
    let out = with_limit(SMALL_DISK, &run_args(&set, &dir, &flags));
    assert_refused(&out, &["step-00000004", "free"]);
    assert_eq!(snapshot(&ckpt), before, "the step-2 checkpoint changed");
    assert_eq!(hidden_files(&dir), Vec::<String>::new());

    smelt_ok(&strs(&run_args(&set, &dir, &flags)));
    let last = |d: &Path| checkpoint::step_dir(&d.join("ckpt"), 4);
    assert_eq!(
        checkpoint_files(&last(&reference)),
        checkpoint_files(&last(&dir))
    );
}

/// The log fills the disk in the middle of a run: the error names it, what the log held
/// before is intact, and a later run appends to it as to a log cut by a crash.
#[test]
fn a_full_disk_for_the_log_keeps_what_it_held() {
    let set = setup();
    let dir = set.root.join("run");
    let log = dir.join("log.jsonl");
    smelt_ok(&strs(&run_args(
        &set,
        &dir,
        &["--out-dir", s(&set.root.join("first"))],
    )));
    let earlier = std::fs::read(&log).unwrap();
    let second = run_args(&set, &dir, &["--out-dir", s(&set.root.join("second"))]);
    let out = with_limit(earlier.len() as u64 + 1000, &second);
    assert_refused(
        &out,
        &["writing the log", "log.jsonl", "free space", "--log-file"],
    );
    assert!(std::fs::read(&log).unwrap().starts_with(&earlier));
    assert_eq!(hidden_files(&dir), Vec::<String>::new());
    smelt_ok(&strs(&second));
    // The first run's 4 steps, the second's until the disk was full, then its rerun's 4.
    let steps = steps(&log);
    assert!(steps.len() >= 8, "{steps:?}");
    assert_eq!(steps[..4], steps[steps.len() - 4..]);
}

/// The export at the end does not fit: the checkpoints are whole, the model folder holds no
/// partial file, and continuing on a disk with room exports the same model.
#[test]
fn a_full_disk_for_the_export_keeps_the_checkpoints() {
    let set = setup();
    let mut flags = F32.to_vec();
    flags.extend(["--ckpt-interval", "2"]);
    let reference = set.root.join("reference");
    smelt_ok(&strs(&run_args(&set, &reference, &flags)));
    let size = |p: &Path| std::fs::metadata(p).unwrap().len();
    let largest_checkpoint_file = snapshot(&reference.join("ckpt"))
        .keys()
        .map(|p| size(p))
        .max()
        .unwrap();
    let exported = reference.join("out/model.safetensors");
    // HF's names are longer, and q, k and v are stored apart, so the header is larger.
    assert!(size(&exported) > largest_checkpoint_file);

    let dir = set.root.join("run");
    let out = with_limit(largest_checkpoint_file, &run_args(&set, &dir, &flags));
    assert_refused(&out, &["out/model.safetensors", "free space"]);
    assert!(!dir.join("out/model.safetensors").exists());
    assert_eq!(hidden_files(&dir), Vec::<String>::new());
    let last = |d: &Path| checkpoint::step_dir(&d.join("ckpt"), 4);
    assert_eq!(
        checkpoint_files(&last(&reference)),
        checkpoint_files(&last(&dir))
    );

    flags.push("--continue");
    smelt_ok(&strs(&run_args(&set, &dir, &flags)));
    assert!(
        std::fs::read(dir.join("out/model.safetensors")).unwrap()
            == std::fs::read(exported).unwrap()
    );
}

/// `smelt export` and `smelt tokenize` on a full disk: one error naming the file, and
/// nothing left in the output folder.
#[test]
fn export_and_tokenize_on_a_full_disk_leave_nothing() {
    let set = setup();
    let trained = set.root.join("trained");
    smelt_ok(&strs(&run_args(&set, &trained, &F32)));
    let out = set.root.join("exported");
    let model = trained.join("out");
    let export = ["export", "--model", s(&model), "--out-dir", s(&out)].map(String::from);
    let refused = with_limit(SMALL_DISK, &export);
    assert_refused(&refused, &["exported/model.safetensors", "free space"]);
    assert_eq!(snapshot(&out).len(), 0);
    assert_eq!(hidden_files(&out), Vec::<String>::new());

    let tokenizer = set.root.join("tokenizer.json");
    std::fs::write(&tokenizer, word_level_tokenizer(256).to_string()).unwrap();
    let text = set.root.join("text.txt");
    std::fs::write(&text, word_text(100_000)).unwrap();
    let tokens = set.root.join("tokens");
    let tokenize = [
        "tokenize",
        s(&text),
        "--tokenizer",
        s(&tokenizer),
        "--out-dir",
        s(&tokens),
        "--eos-id",
        "0",
        "--separator",
        "\\n",
    ]
    .map(String::from);
    let refused = with_limit(SMALL_DISK, &tokenize);
    assert_refused(
        &refused,
        &["tokens/train-000.bin: cannot write", "free space"],
    );
    assert_eq!(snapshot(&tokens).len(), 0);
    assert_eq!(hidden_files(&tokens), Vec::<String>::new());
}
