//! `--optimizer-in-backward`: each block updated in the step's last backward gives the bits
//! of the update after it, on its own and with the blocks' weights, gradients and optimizer
//! state streamed from host memory; its checkpoints continue either way; and what it cannot
//! do (clip, skip) is refused or stops the run, with one error naming the flag.

mod train_support;

use train_support::*;

/// Clipping needs the step's norm before any update, so the runs compared do not clip.
const NO_CLIP: [&str; 2] = ["--grad-clip", "0"];

fn with(extra: &[&'static str]) -> Vec<&'static str> {
    NO_CLIP.iter().chain(extra).copied().collect()
}

/// The same losses, final weights and optimizer state as the update after the backward:
/// with the state where the plain run keeps it, and with the blocks' weights and gradients
/// streamed and every category of state offloaded, so that m, v and the master copy stream
/// through their device slots beside the gradient accumulation's copies. A run continues
/// the plain run's checkpoint updating in the backward, and ends as it does.
#[test]
fn updating_in_the_backward_changes_no_bit_and_may_change_on_continue() {
    let s = setup();
    let dir = |name: &str| s.root.join(name);
    let run = |name: &str, extra: &[&str]| {
        run_with(&resume_args(&dir(name), &s.model, &s.data), extra);
        dir(name)
    };
    let full = run("full", &with(&[]));
    let in_backward = run("in_backward", &with(&["--optimizer-in-backward"]));
    assert_same_run(&full, &in_backward, 0);
    let streamed = with(&[
        "--optimizer-in-backward",
        "--offload-weights",
        "--offload-gradients",
        "--offload-master",
        "--offload-opt-m",
        "--offload-opt-v",
    ]);
    assert_same_run(&full, &run("streamed", &streamed), 0);
    let log = std::fs::read_to_string(dir("streamed").join("log.jsonl")).unwrap();
    for category in ["adam_m slots", "adam_v slots", "master slots"] {
        assert!(log.contains(category), "no {category} in the memory table");
    }

    assert_same_run(
        &full,
        &resumed_at_step_2(&s, &full, "resumed", &streamed),
        2,
    );

    // FP8 and INT8 copies of blocks updated in the backward are made from their weights at
    // the next forward, with the bits of those the update after the backward reports for.
    for dtype in ["e4m3", "int8"] {
        let quantized = ["--matmul-dtype", dtype];
        let plain = run(&format!("{dtype}_full"), &with(&quantized));
        let mut updating = with(&quantized);
        updating.push("--optimizer-in-backward");
        assert_same_run(&plain, &run(&format!("{dtype}_in_backward"), &updating), 0);
    }
}

/// What the update in the backward cannot wait for is refused before anything is written.
#[test]
fn what_it_cannot_wait_for_is_refused() {
    let s = setup();
    let cases: [(&[&str], &str); 4] = [
        (&[], "--grad-clip 0"),
        (
            &["--grad-clip", "0", "--on-spike", "skip"],
            "--on-spike warn",
        ),
        (
            &["--grad-clip", "0", "--health-every", "2"],
            "--health-every",
        ),
        (&["--grad-clip", "0", "--gpus", "2"], "one GPU"),
    ];
    for (extra, want) in cases {
        let dir = s.root.join(format!("refused{}", extra.len()));
        let mut args = resume_args(&dir, &s.model, &s.data);
        args.push("--optimizer-in-backward".into());
        args.extend(extra.iter().map(|a| a.to_string()));
        let out = smelt(&strs(&args));
        assert_refused(&out, &["--optimizer-in-backward", want]);
        assert!(!dir.join("log.jsonl").exists(), "{extra:?} wrote a log");
    }
}

/// A step that is not finite has already been applied, so the run stops at it (rather than
/// skipping it as the update after the backward does), its last checkpoint intact.
#[test]
fn a_step_that_is_not_finite_stops_the_run() {
    let s = setup();
    let dir = s.root.join("nan");
    let mut args = resume_args(&dir, &s.model, &s.data);
    args.extend(
        with(&["--optimizer-in-backward", "--debug-inject", "nan-grad@3"])
            .iter()
            .map(|a| a.to_string()),
    );
    let out = smelt(&strs(&args));
    assert_refused(
        &out,
        &["step 3", "--optimizer-in-backward", "last checkpoint"],
    );
    assert_eq!(steps(&dir.join("log.jsonl")).len(), 2);
}
