//! `smelt train --matmul-dtype int8` end to end on the CPU's INT8 emulation, with bf16 and
//! with INT8 weight gradients, and with stochastic rounding: each learns as bf16 does, and
//! `smelt plot` overlays the runs.

mod train_support;

use train_support::*;

/// The mean loss of the first and last five steps of the tiny run with `flags`, two
/// micro-batches a step.
fn train(root: &std::path::Path, name: &str, flags: &[&str]) -> (f64, f64) {
    let flags = [
        &["--model-dtype", "bf16", "--grad-accumulation", "2"][..],
        flags,
    ]
    .concat();
    first_and_last_losses(&tiny_run(root, name, &flags))
}

#[test]
fn int8_training_learns_like_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let (_, bf16_last) = train(dir.path(), "bf16", &[]);
    for (name, flags) in [
        ("int8", &["--matmul-dtype", "int8"][..]),
        (
            "int8-wgrad",
            &["--matmul-dtype", "int8", "--int8-weight-grad"][..],
        ),
        (
            "int8-wgrad-sr",
            &[
                "--matmul-dtype",
                "int8",
                "--int8-weight-grad",
                "--int8-stochastic-rounding",
            ][..],
        ),
    ] {
        let (first, last) = train(dir.path(), name, flags);
        println!("bf16 -> {bf16_last:.4}; {name} {first:.4} -> {last:.4}");
        assert!(
            last < 0.8 * first,
            "{name} loss {first} -> {last} did not fall"
        );
        // A broken INT8 path (no learning, or divergence) ends far off; 3% leaves room for
        // the noise of a 40-step run.
        assert!(
            (last - bf16_last).abs() < 0.03 * bf16_last,
            "{name} ends at {last}, bf16 at {bf16_last}"
        );
    }
    let png = dir.path().join("compare.png");
    let logs = ["bf16", "int8", "int8-wgrad"].map(|n| dir.path().join(format!("{n}.jsonl")));
    smelt_ok(&["plot", s(&logs[0]), s(&logs[1]), s(&logs[2]), "-o", s(&png)]);
    assert!(std::fs::metadata(&png).unwrap().len() > 0);
}

#[test]
fn int8_flags_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    for (extra, expected) in [
        (
            &["--int8-weight-grad"][..],
            "--int8-weight-grad needs --matmul-dtype int8",
        ),
        (
            &["--int8-stochastic-rounding"][..],
            "--int8-stochastic-rounding needs --matmul-dtype int8",
        ),
        (
            &["--matmul-dtype", "int8", "--gradient-dtype", "e5m2"][..],
            "--gradient-dtype e5m2 needs --matmul-dtype e4m3",
        ),
        (
            &["--matmul-dtype", "int8", "--model-dtype", "f32"][..],
            "INT8 matmuls write bf16",
        ),
    ] {
        let args = tiny_run_args(dir.path(), "refused", extra);
        let err = smelt_err(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(err.contains(expected), "{extra:?}: {err}");
    }
}
