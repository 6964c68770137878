//! The exporters of a run's scalars (of the tiny test model's run and of the built-in
//! demo's): `--tensorboard-dir`'s event file read back by
//! TensorBoard's own reader, and scripts/wandb_log.py following the log into an offline W&B
//! run read back by wandb's (tests/python/check_exporters.py says what it checks); and a
//! `--tensorboard-dir` that cannot be written, refused before anything is.

mod train_support;

use std::path::Path;

use train_support::*;

#[test]
fn tensorboard_and_wandb_hold_every_scalar_of_the_log() {
    if !python::has(&["tensorboard", "wandb"]) {
        return;
    }
    let set = setup();
    let eval = corpus_file(&set.root.join("eval.bin"), 600, false);
    let (run, bare) = (set.root.join("run"), set.root.join("bare"));
    let tb = |dir: &Path| s(&dir.join("tb")).to_string();
    // Periodic evals, a full one at the end, and a warning (the warmup is longer than the run);
    let flags = [
        "--eval-file",
        s(&eval),
        "--eval-every-n-steps",
        "2",
        "--warmup",
        "8",
        // Health at steps 2 and 4, a spike at 3 (applied), step 4 skipped.
        "--health-every",
        "2",
        "--spike-window",
        "2",
        "--debug-inject",
        "spike@3,nan-loss@4",
    ];
    let with = |dir: &Path, more: &[&str]| {
        let tb_dir = tb(dir);
        let mut args = flags.to_vec();
        args.extend(["--tensorboard-dir", &tb_dir]);
        args.extend(more);
        run_args(&set, dir, &args)
    };
    smelt_ok(&strs(&with(&run, &[])));
    // No --log-file, and two ranks: rank 0 alone writes the event file.
    let mut args = with(&bare, &["--device", "cpu", "--gpus", "2"]);
    let log = args.iter().position(|a| a == "--log-file").unwrap();
    args.drain(log..log + 2);
    smelt_ok(&strs(&args));
    assert!(!bare.join("log.jsonl").exists());

    // The built-in demo, with the same events.
    let demo = set.root.join("demo");
    let mut args = vec![
        "train",
        "--demo-dir",
        s(&demo),
        "--steps",
        "4",
        "--eval-num-steps",
        "2",
    ];
    args.extend(flags.iter().skip(2)); // the demo has its own eval data
    let demo_tb = tb(&demo);
    args.extend(["--tensorboard-dir", &demo_tb]);
    smelt_ok(&args);

    check_exporters(&[s(&run.join("log.jsonl")), &tb(&run), &tb(&bare)]);
    check_exporters(&[s(&demo.join("log.jsonl")), &demo_tb]);
}

/// tests/python/check_exporters.py on a log and event folders.
fn check_exporters(args: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/check_exporters.py");
    let out = python::command().arg(&script).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "check_exporters.py {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn a_tensorboard_dir_that_cannot_be_written_is_refused_before_anything_is_written() {
    let set = setup();
    let file = set.root.join("notes.txt");
    std::fs::write(&file, "not a folder").unwrap();
    let run = set.root.join("run");
    let bad = file.join("tb");
    let out = smelt(&strs(&run_args(
        &set,
        &run,
        &["--tensorboard-dir", s(&bad)],
    )));
    assert_refused(
        &out,
        &[
            "--tensorboard-dir",
            "notes.txt/tb: cannot write there",
            "choose a directory this user can write to",
        ],
    );
    assert!(
        !run.exists(),
        "the refused run wrote into {}",
        run.display()
    );
}
