//! Checkpoints under faults: `latest` names only a checkpoint that was verified (its
//! tensors finite, its files complete, its `state.json` its own), an update that made the
//! weights non-finite stops the run without saving them, and a checkpoint damaged on disk is
//! refused by `--continue` with the file named.

mod train_support;

use std::path::Path;

use smelt::train::checkpoint;
use train_support::*;

/// What a checkpoint folder holds, hidden entries included.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn an_update_that_makes_the_weights_non_finite_is_never_checkpointed() {
    let set = setup();
    let dir = set.root.join("run");
    let mut extra = DIVERGING.to_vec();
    extra.extend(["--ckpt-interval", "1", "--steps", "3"]);
    let out = smelt(&strs(&run_args(&set, &dir, &extra)));
    assert_refused(&out, &["step 1", "not finite", "lower --lr"]);
    // Nothing was written: no `latest`, no step folder, no temporary folder.
    assert_eq!(listing(&dir.join("ckpt")), Vec::<String>::new());
    assert!(!dir.join("out/model.safetensors").exists());
}

#[test]
fn a_non_finite_update_leaves_latest_on_the_last_good_checkpoint() {
    let set = setup();
    let reference = set.root.join("reference");
    smelt_ok(&strs(&run_args(
        &set,
        &reference,
        &["--ckpt-interval", "1"],
    )));

    // Where a run stopped after step 1 would have left its checkpoints.
    let dir = set.root.join("run");
    let ckpt = dir.join("ckpt");
    copy_checkpoint(&reference.join("ckpt"), 1, &ckpt);
    let good = snapshot(&ckpt);
    // Continued with a rate that diverges at step 2.
    let mut extra = DIVERGING.to_vec();
    extra.extend(["--ckpt-interval", "1", "--continue"]);
    let out = smelt(&strs(&run_args(&set, &dir, &extra)));
    assert_refused(
        &out,
        &["step 2", "not finite", "`latest` still names step-00000001"],
    );
    assert_eq!(snapshot(&ckpt), good, "the good checkpoint changed");
    assert_eq!(
        checkpoint::read_latest(&ckpt).unwrap(),
        Some(checkpoint::step_dir(&ckpt, 1))
    );
    assert_eq!(hidden_files(&ckpt), Vec::<String>::new());

    // Continuing with the run's own rate ends as the run that never diverged.
    smelt_ok(&strs(&run_args(
        &set,
        &dir,
        &["--ckpt-interval", "1", "--continue"],
    )));
    let last = |d: &Path| checkpoint::step_dir(&d.join("ckpt"), 4);
    assert_eq!(
        checkpoint_files(&last(&reference)),
        checkpoint_files(&last(&dir))
    );
    assert_eq!(
        std::fs::read(reference.join("out/model.safetensors")).unwrap(),
        std::fs::read(dir.join("out/model.safetensors")).unwrap()
    );
}

/// Without checkpoints, the last step's update is checked before the model is exported.
#[test]
fn non_finite_weights_are_not_exported() {
    let set = setup();
    let dir = set.root.join("run");
    let mut extra = DIVERGING.to_vec();
    extra.extend(["--steps", "1"]);
    let out = smelt(&strs(&run_args(&set, &dir, &extra)));
    assert_refused(&out, &["step 1", "not finite", "lower --lr"]);
    assert!(!dir.join("out/model.safetensors").exists());
    assert_eq!(hidden_files(&dir), Vec::<String>::new());
}
