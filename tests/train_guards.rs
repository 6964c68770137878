//! The guards against bad steps (`train::guard`) and the health log (`train::health`), end to
//! end on the CPU, with faults injected where real ones strike (`--debug-inject`): a step
//! whose loss or gradient norm is not finite, or a skipped spike, changes no weight or
//! optimizer state; too many in a row stop the run on a finite, resumable checkpoint; a
//! continued run judges as the uninterrupted one; health measures the update that happened
//! and changes none of it.

mod train_support;

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::SafeTensors;
use smelt::train::checkpoint;
use smelt::train::log::Event;
use train_support::*;

/// Every file of the step-`step` checkpoint of run folder `dir`, but its state.json.
fn ckpt(dir: &Path, step: u64) -> Vec<(String, Vec<u8>)> {
    checkpoint_files(&checkpoint::step_dir(&dir.join("ckpt"), step))
}

/// The steps of a run's log that were skipped, with their reasons.
fn skipped(dir: &Path) -> Vec<(u64, String)> {
    (events(&dir.join("log.jsonl")).into_iter())
        .filter_map(|e| match e {
            Event::Skipped { step, reason, .. } => Some((step, reason)),
            _ => None,
        })
        .collect()
}

/// The steps of a run's log that were applied, with their losses.
fn applied(dir: &Path) -> Vec<(u64, f64)> {
    let log = steps(&dir.join("log.jsonl"));
    log.into_iter()
        .map(|(step, loss, _)| (step, loss))
        .collect()
}

#[test]
fn a_non_finite_step_changes_nothing_and_the_run_goes_on() {
    let set = setup();
    for (fault, reason) in [
        ("nan-grad@3", "the gradient norm is NaN"),
        ("nan-loss@3", "the loss is NaN"),
    ] {
        let dir = set.root.join(fault);
        let extra = [
            "--ckpt-interval",
            "1",
            "--steps",
            "5",
            "--debug-inject",
            fault,
        ];
        smelt_ok(&strs(&run_args(&set, &dir, &extra)));
        assert_eq!(skipped(&dir), [(3, reason.to_string())], "{fault}");
        assert_eq!(
            ckpt(&dir, 2),
            ckpt(&dir, 3),
            "{fault}: a skipped step changed state"
        );
        assert_ne!(
            ckpt(&dir, 3),
            ckpt(&dir, 4),
            "{fault}: step 4 did not update"
        );
        let steps: Vec<u64> = applied(&dir).iter().map(|s| s.0).collect();
        assert_eq!(steps, [1, 2, 4, 5], "{fault}");
        assert!(applied(&dir).iter().all(|s| s.1.is_finite()));
        assert!(dir.join("out/model.safetensors").exists());
    }
}

#[test]
fn steps_skipped_in_a_row_stop_the_run_on_a_checkpoint_that_continues() {
    let set = setup();
    let dir = set.root.join("run");
    let faulty = [
        "--ckpt-interval",
        "1",
        "--steps",
        "6",
        "--max-skipped-steps",
        "2",
        "--debug-inject",
        "nan-grad@3,nan-loss@4",
    ];
    let out = smelt(&strs(&run_args(&set, &dir, &faulty)));
    assert_refused(
        &out,
        &[
            "step 4: 2 steps in a row",
            "--max-skipped-steps is 2",
            "checkpoint is of step 3",
            "steps 3–4",
        ],
    );
    let log = events(&dir.join("log.jsonl"));
    assert!(matches!(log.last(), Some(Event::Error { .. })));
    let ckpt_dir = dir.join("ckpt");
    assert_eq!(
        checkpoint::read_latest(&ckpt_dir).unwrap(),
        Some(checkpoint::step_dir(&ckpt_dir, 3))
    );
    // The skipped step's checkpoint holds the last good step's weights, and continues.
    assert_eq!(ckpt(&dir, 2), ckpt(&dir, 3));
    let again = ["--ckpt-interval", "1", "--steps", "6", "--continue"];
    smelt_ok(&strs(&run_args(&set, &dir, &again)));
    let steps: Vec<u64> = applied(&dir).iter().map(|s| s.0).collect();
    assert_eq!(steps, [1, 2, 4, 5, 6]);
    assert!(dir.join("out/model.safetensors").exists());
}

/// Six steps, each checkpointed, a spike injected at step 5 and judged against a window of
/// three, handled as `on_spike` says.
#[rustfmt::skip]
fn spiked_at_5(on_spike: &str) -> [&str; 10] {
    [
        "--ckpt-interval", "1", "--steps", "6", "--spike-window", "3", "--on-spike", on_spike,
        "--debug-inject", "spike@5",
    ]
}

#[test]
fn a_spike_is_skipped_or_only_logged_as_on_spike_says() {
    let set = setup();
    let spiked = |on_spike: &str| {
        let dir = set.root.join(on_spike);
        let extra = spiked_at_5(on_spike);
        smelt_ok(&strs(&run_args(&set, &dir, &extra)));
        let spikes: Vec<(u64, bool)> = (events(&dir.join("log.jsonl")).into_iter())
            .filter_map(|e| match e {
                Event::Spike {
                    step,
                    skipped,
                    zscore,
                    ..
                } => {
                    assert!(zscore > 5.0, "{zscore}");
                    Some((step, skipped))
                }
                _ => None,
            })
            .collect();
        (dir, spikes)
    };
    let (dir, spikes) = spiked("skip");
    assert_eq!(spikes, [(5, true)]);
    assert_eq!(skipped(&dir).len(), 1);
    assert!(
        skipped(&dir)[0].1.contains("is a spike"),
        "{:?}",
        skipped(&dir)
    );
    assert_eq!(ckpt(&dir, 4), ckpt(&dir, 5));

    let (dir, spikes) = spiked("warn");
    assert_eq!(spikes, [(5, false)]);
    assert_eq!(skipped(&dir), []);
    assert_ne!(ckpt(&dir, 4), ckpt(&dir, 5));
}

#[test]
fn a_continued_run_judges_its_steps_as_the_uninterrupted_one() {
    let set = setup();
    let flags = spiked_at_5("skip");
    let full = set.root.join("full");
    smelt_ok(&strs(&run_args(&set, &full, &flags)));
    // Continued from step 4, whose window holds steps 2–4: the spike at 5 is judged by it.
    let resumed = set.root.join("resumed");
    copy_checkpoint(&full.join("ckpt"), 4, &resumed.join("ckpt"));
    let mut again = flags.to_vec();
    again.push("--continue");
    smelt_ok(&strs(&run_args(&set, &resumed, &again)));
    assert_eq!(skipped(&resumed), skipped(&full));
    assert_eq!(ckpt(&resumed, 6), ckpt(&full, 6));
}

/// Each tensor's values in a safetensors file of f32 tensors, by name.
fn f32_tensors(path: &Path) -> BTreeMap<String, Vec<f64>> {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    (file.tensors().into_iter())
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = (view.data().chunks_exact(4))
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                .collect();
            (name, values)
        })
        .collect()
}

/// `‖after − before‖ / ‖before‖` and `‖before‖` over the tensors `pick` chooses.
fn update_ratio(
    before: &BTreeMap<String, Vec<f64>>, after: &BTreeMap<String, Vec<f64>>,
    pick: impl Fn(&str) -> bool,
) -> (f64, f64) {
    let (mut w, mut dw) = (0.0, 0.0);
    for (name, old) in before.iter().filter(|(n, _)| pick(n)) {
        for (x, y) in old.iter().zip(&after[name]) {
            w += x * x;
            dw += (y - x) * (y - x);
        }
    }
    (dw.sqrt() / w.sqrt(), w.sqrt())
}

#[test]
fn health_measures_the_update_and_changes_none_of_it() {
    let set = setup();
    let plain = set.root.join("plain");
    let measured = set.root.join("measured");
    let flags = ["--ckpt-interval", "1", "--steps", "4"];
    smelt_ok(&strs(&run_args(&set, &plain, &flags)));
    let mut with_health = flags.to_vec();
    with_health.extend(["--health-every", "2"]);
    smelt_ok(&strs(&run_args(&set, &measured, &with_health)));
    // Bit for bit the same run.
    let bits =
        |d: &Path| -> Vec<(u64, u64)> { applied(d).iter().map(|s| (s.0, s.1.to_bits())).collect() };
    assert_eq!(bits(&plain), bits(&measured));
    assert_eq!(ckpt(&plain, 4), ckpt(&measured, 4));

    let log = events(&measured.join("log.jsonl"));
    let health: Vec<_> = (log.iter())
        .filter_map(|e| match e {
            Event::Health { step, health } => Some((*step, health.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(health.iter().map(|h| h.0).collect::<Vec<_>>(), [2, 4]);
    let h = &health[0].1;
    // Against the master weights (bf16 weights, f32 master) of the checkpoints around step 2.
    let master = |step| {
        let dir = checkpoint::step_dir(&measured.join("ckpt"), step);
        f32_tensors(&dir.join("master.safetensors"))
    };
    let (before, after) = (master(1), master(2));
    // f64 sums of the same f32 values in another order: equal to ~1e-12.
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
    let (ratio, norm) = update_ratio(&before, &after, |_| true);
    assert!(
        close(h.all.update_ratio, ratio),
        "{} vs {ratio}",
        h.all.update_ratio
    );
    assert!(
        close(h.all.param_norm, norm),
        "{} vs {norm}",
        h.all.param_norm
    );
    let (ratio, _) = update_ratio(&before, &after, |n| n.ends_with(".down"));
    assert!(close(h.families["down"].update_ratio, ratio));
    let (ratio, _) = update_ratio(&before, &after, |n| n.starts_with("layers.1."));
    assert!(close(h.layers[1].update_ratio, ratio));
    // The gradient norm is the step's (summed per tensor in f32 on the device, then in f64
    // here rather than in f32 there: equal to f32 rounding).
    let norm_at_2 = (log.iter())
        .find_map(|e| match e {
            Event::Step { step: 2, norm, .. } => Some(*norm),
            _ => None,
        })
        .unwrap();
    assert!((h.all.grad_norm - norm_at_2).abs() <= 1e-6 * norm_at_2);
    let family_sq: f64 = h.families.values().map(|f| f.grad_norm.powi(2)).sum();
    assert!(close(family_sq.sqrt(), h.all.grad_norm));
}

#[test]
fn ranks_measure_and_skip_as_one() {
    let set = setup();
    let run = |name: &str, zero: &str| {
        let dir = set.root.join(name);
        let extra = [
            "--device",
            "cpu",
            "--gpus",
            "2",
            "--zero-level",
            zero,
            "--ckpt-interval",
            "1",
            "--steps",
            "4",
            "--health-every",
            "2",
            "--debug-inject",
            "nan-grad@3",
        ];
        smelt_ok(&strs(&run_args(&set, &dir, &extra)));
        let health: Vec<Event> = (events(&dir.join("log.jsonl")).into_iter())
            .filter(|e| matches!(e, Event::Health { .. }))
            .collect();
        (dir, health)
    };
    let (whole, health) = run("whole", "0");
    assert_eq!(health.len(), 2);
    assert_eq!(skipped(&whole).len(), 1);
    assert_eq!(ckpt(&whole, 2), ckpt(&whole, 3));
    // Sharded, each rank measures its own tensors: the same figures, bit for bit.
    for zero in ["2", "3"] {
        let (_, sharded) = run(&format!("zero-{zero}"), zero);
        assert_eq!(sharded, health, "--zero-level {zero}");
    }
}
