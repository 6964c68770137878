//! SIGKILL at many points of a run: during steps, while each file of a checkpoint is
//! written (its tensors, its state, the `latest` pointer), during the export at the end, at
//! moments picked by the clock, and during `smelt export` and `smelt tokenize`. Each killed
//! run is followed by what a user would do (`--continue` when there is a checkpoint, else a
//! rerun), which must end bit for bit as the run that was never killed and leave no
//! temporary file behind.
//!
//! Files are written whole under a temporary name and then renamed, so a kill leaves each
//! one either complete or absent; the test hook `atomic::DELAY_ENV` pauses before each
//! rename, so that a kill can land while a given file is pending.

mod train_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use smelt::io::atomic;
use smelt::train::checkpoint;
use train_support::*;

/// The pause before each rename in the killed runs, long enough for the test to see the
/// temporary file.
const PAUSE_MS: &str = "60";

/// Where a run is killed.
#[derive(Clone, Debug)]
enum Point {
    /// Once the log holds step `n`.
    Step(u64),
    /// Once the temporary file or folder `path` (relative to the run's folder) exists.
    Pending(&'static str),
    /// After this long, wherever the run is (possibly finished); with or without the pauses
    /// before renames, which make the run take about a second instead of a tenth.
    After(Duration, bool),
}

fn killed_run(set: &Setup, dir: &Path, point: &Point) {
    let args = resume_args(dir, &set.model, &set.data);
    let mut cmd = Command::new(SMELT);
    cmd.args(&args);
    if !matches!(point, Point::After(_, false)) {
        // The pauses also keep a run killed after a step from ending before the kill.
        cmd.env(atomic::DELAY_ENV, PAUSE_MS);
    }
    match point {
        Point::Step(n) => {
            let log = dir.join("log.jsonl");
            let logged = || {
                std::fs::read_to_string(&log)
                    .is_ok_and(|l| l.contains(&format!(r#""event":"step","step":{n},"#)))
            };
            kill_when(&mut cmd, logged);
        }
        Point::Pending(path) => {
            // Should the pause pass unseen (a loaded machine), the kill lands just after
            // the rename instead, a point as good, rather than never.
            let pending = dir.join(path);
            let renamed = dir.join(path.replace("/.", "/").replace(".tmp", ""));
            let in_folder =
                pending.with_file_name(&path[path.rfind("/.").unwrap() + 2..path.len() - 4]);
            kill_when(&mut cmd, || {
                pending.exists() || renamed.exists() || in_folder.exists()
            });
        }
        Point::After(delay, _) => {
            let mut child = cmd
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            std::thread::sleep(*delay);
            let _ = child.kill(); // it may have finished
            child.wait().unwrap();
        }
    }
}

/// After a kill: `latest` names a complete checkpoint or there is none, and no final file is
/// partial. Then continues (or reruns) as a user would; returns the step continued from.
fn recover(set: &Setup, dir: &Path) -> u64 {
    let ckpt = dir.join("ckpt");
    let latest = checkpoint::read_latest(&ckpt).expect("latest names a complete checkpoint");
    let args = resume_args(dir, &set.model, &set.data);
    let from = match latest {
        Some(path) => {
            let state = checkpoint::read_state(&path).unwrap();
            run_with(&args, &["--continue"]);
            state.step
        }
        None => {
            run_with(&args, &[]);
            0
        }
    };
    assert_eq!(
        hidden_files(dir),
        Vec::<String>::new(),
        "temporary files left"
    );
    from
}

fn uninterrupted(set: &Setup) -> PathBuf {
    let full = set.root.join("full");
    run_with(&resume_args(&full, &set.model, &set.data), &[]);
    full
}

#[test]
fn killed_anywhere_in_a_run_continues_bit_for_bit() {
    let set = setup();
    let full = uninterrupted(&set);
    let mut points: Vec<Point> = (1..=6).map(Point::Step).collect();
    points.extend(
        [
            // The step-4 checkpoint: after its weights, master copy and first moments, and
            // with its state written but the folder not yet renamed into place.
            "ckpt/.step-00000004.tmp/.master.safetensors.tmp",
            "ckpt/.step-00000004.tmp/.adam_v.safetensors.tmp",
            "ckpt/.step-00000004.tmp/.state.json.tmp",
            // The first checkpoint, with nothing before it; then renamed into place, but
            // with no `latest` yet.
            "ckpt/.step-00000002.tmp/.model.safetensors.tmp",
            "ckpt/.latest.tmp",
            // The export at the end.
            "out/.model.safetensors.tmp",
        ]
        .map(Point::Pending),
    );
    // Wherever the clock lands, from startup to the end.
    let ms = Duration::from_millis;
    points.extend([10, 25, 40, 55].map(|t| Point::After(ms(t), false)));
    points.extend([150, 350, 550, 750].map(|t| Point::After(ms(t), true)));
    let numbered: Vec<(usize, Point)> = points.into_iter().enumerate().collect();
    in_parallel(numbered, |(i, point)| {
        let dir = set.root.join(format!("killed-{i}"));
        killed_run(&set, &dir, point);
        let from = recover(&set, &dir);
        assert_same_run(&full, &dir, from);
    });
}

/// `smelt export` killed while it writes the weights (before any file is in place), then run
/// again: the same files.
#[test]
fn killed_export_reruns_to_the_same_files() {
    let set = setup();
    let full = uninterrupted(&set);
    let export = |out: &Path| {
        let model = full.join("out");
        [
            "export",
            "--model",
            s(&model),
            "--out-dir",
            s(out),
            "--dtype",
            "bf16",
        ]
        .map(String::from)
    };
    let reference = set.root.join("reference");
    smelt_ok(&strs(&export(&reference)));
    for pending in [".model.safetensors.tmp"] {
        let out = set.root.join(format!("killed{pending}"));
        let mut cmd = Command::new(SMELT);
        cmd.args(export(&out)).env(atomic::DELAY_ENV, PAUSE_MS);
        kill_when(&mut cmd, || out.join(pending).exists());
        smelt_ok(&strs(&export(&out)));
        assert_eq!(hidden_files(&out), Vec::<String>::new());
        assert_eq!(snapshot(&out).len(), snapshot(&reference).len());
        for (file, bytes) in snapshot(&reference) {
            let name = file.file_name().unwrap();
            assert!(
                std::fs::read(out.join(name)).unwrap() == bytes,
                "{name:?} differs"
            );
        }
    }
}

/// `smelt tokenize` killed at its start and in the middle of its shards, then run again: the
/// same token files, and no temporary file.
#[test]
fn killed_tokenize_reruns_to_the_same_files() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // A word-level tokenizer, and 2M words of text in documents of 100.
    let tokenizer = word_level_tokenizer(256);
    std::fs::write(root.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(root.join("text.txt"), word_text(2_000_000)).unwrap();
    let tokenize = |out: &Path| {
        let (text, tokenizer) = (root.join("text.txt"), root.join("tokenizer.json"));
        [
            "tokenize",
            s(&text),
            "--tokenizer",
            s(&tokenizer),
            "--out-dir",
            s(out),
            "--eos-id",
            "0",
            "--separator",
            "\\n",
            "--shard-tokens",
            "100000",
            "--eval-tokens",
            "5000",
        ]
        .map(String::from)
    };
    let reference = root.join("reference");
    smelt_ok(&strs(&tokenize(&reference)));
    assert!(reference.join("train-010.bin").exists(), "too few shards");
    for pending in [".train-000.bin.tmp", ".train-010.bin.tmp"] {
        let out = root.join(format!("killed{pending}"));
        kill_when(Command::new(SMELT).args(tokenize(&out)), || {
            out.join(pending).exists()
        });
        smelt_ok(&strs(&tokenize(&out)));
        assert_eq!(hidden_files(&out), Vec::<String>::new());
        let files = |d: &Path| -> Vec<(String, Vec<u8>)> {
            let mut v: Vec<_> = snapshot(d)
                .into_iter()
                .map(|(p, b)| (p.file_name().unwrap().to_string_lossy().into_owned(), b))
                .collect();
            v.sort();
            v
        };
        assert!(files(&out) == files(&reference), "the token files differ");
    }
}
