//! `smelt train --matmul-dtype e4m3` end to end on the CPU's FP8 emulation: it learns as
//! bf16 does, `--debug-log-abs-max` logs every statistic, and `smelt plot` overlays the runs.

mod train_support;

use smelt::train::log::Event;
use train_support::*;

/// The mean loss of the first and last five steps of the tiny run with `flags`, and its log's
/// events.
fn train(root: &std::path::Path, name: &str, flags: &[&str]) -> (f64, f64, Vec<Event>) {
    let log = tiny_run(
        root,
        name,
        &[&["--model-dtype", "bf16"][..], flags].concat(),
    );
    let (first, last) = first_and_last_losses(&log);
    (first, last, events(&log))
}

#[test]
fn fp8_training_learns_like_bf16_and_logs_abs_maxes() {
    let dir = tempfile::tempdir().unwrap();
    let (bf16_first, bf16_last, _) = train(dir.path(), "bf16", &[]);
    let fp8 = [
        "--matmul-dtype",
        "e4m3",
        "--gradient-dtype",
        "e5m2",
        "--debug-log-abs-max",
        "20",
    ];
    let (first, last, events) = train(dir.path(), "fp8", &fp8);
    println!("bf16 {bf16_first:.4} -> {bf16_last:.4}; fp8 {first:.4} -> {last:.4}");
    assert!(
        last < 0.8 * first,
        "fp8 loss {first} -> {last} did not fall"
    );
    // Measured: the two runs end 0.02% apart; 3% leaves room for the noise
    // of a 40-step run while a broken FP8 path (no learning, or divergence) is far off.
    assert!(
        (last - bf16_last).abs() < 0.03 * bf16_last,
        "fp8 ends at {last}, bf16 at {bf16_last}"
    );

    let logged: Vec<_> = events
        .into_iter()
        .filter_map(|e| match e {
            Event::AbsMax { step, values } => Some((step, values)),
            _ => None,
        })
        .collect();
    assert_eq!(logged.iter().map(|l| l.0).collect::<Vec<_>>(), [20, 40]);
    for (step, values) in logged {
        // 2 layers × 4 linears × (input, weight, gradient)
        assert_eq!(values.len(), 24, "step {step}: {values:?}");
        assert!(
            values.values().all(|v| *v > 0.0 && v.is_finite()),
            "step {step}: {values:?}"
        );
        assert!(values.contains_key("layers.1.down.grad"));
    }

    // The two curves on one plot, as the convergence check's PNG is made.
    let png = dir.path().join("compare.png");
    let logs = [dir.path().join("bf16.jsonl"), dir.path().join("fp8.jsonl")];
    smelt_ok(&[
        "plot",
        s(&logs[0]),
        s(&logs[1]),
        "-o",
        s(&png),
        "--width",
        "800",
    ]);
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    let info = decoder.read_info().unwrap().info().clone();
    assert_eq!((info.width, info.height), (800, 900));
}
