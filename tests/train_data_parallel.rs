//! Data parallelism (`--gpus N`), run here as CPU ranks in one process (`--device cpu`),
//! which exercise the trainer's multi-rank logic with the in-process collectives: sharded
//! batches and evals, summed gradients and losses, rank 0's log, checkpoints and export.

mod train_support;

use std::path::Path;

use smelt::train::log::Event;
use train_support::*;

/// A 6-step run of the tiny model on `ranks` CPU ranks of `batch` sequences each, in `dir`.
fn args(dir: &Path, model: &Path, data: &Path, ranks: usize, batch: usize) -> Vec<String> {
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let flags = [
        "train",
        "--device",
        "cpu",
        "--model",
        s(model),
        "--from-scratch",
        "--train-file",
        s(data),
        "--eval-file",
        s(data),
        "--seq-len",
        "16",
        "--steps",
        "6",
        "--warmup",
        "2",
        "--lr",
        "1e-2",
    ];
    let gpus = ranks.to_string();
    let batch = batch.to_string();
    flags
        .iter()
        .map(|a| a.to_string())
        .chain([
            "--gpus".into(),
            gpus,
            "--batch-size".into(),
            batch,
            "--out-dir".into(),
            p("out"),
            "--log-file".into(),
            p("log.jsonl"),
        ])
        .collect()
}

fn run(args: &[String], extra: &[&str]) -> String {
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    all.extend(extra);
    smelt_ok(&all)
}

/// Every tensor of an f32 safetensors file, by name.
fn weights(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Rank r of W takes every W-th sequence of the shuffled epoch, so 2 ranks of batch 2 train
/// on the same 4 sequences per step as 1 rank of batch 4. The results differ only in the
/// order of f32 sums (each rank's matmuls sum over its own tokens, then the ranks' sums are
/// added): the losses agree to ~1e-6, and so do the weights after 6 AdamW steps.
#[test]
fn two_ranks_train_like_one_rank_with_both_batches() {
    let set = setup();
    let one = set.root.join("one");
    let two = set.root.join("two");
    let f32 = ["--model-dtype", "f32"];
    run(&args(&one, &set.model, &set.data, 1, 4), &f32);
    let stdout = run(&args(&two, &set.model, &set.data, 2, 2), &f32);
    assert!(stdout.contains("(rank 0 of 2)"), "{stdout}");

    let (a, b) = (steps(&one.join("log.jsonl")), steps(&two.join("log.jsonl")));
    assert_eq!(a.len(), 6);
    assert_eq!(b.len(), 6);
    for ((step, la, _), (_, lb, _)) in a.iter().zip(&b) {
        assert!(
            (la - lb).abs() <= 1e-5 * la.abs(),
            "step {step}: loss {la} on one rank, {lb} on two"
        );
    }
    let tokens = |dir: &Path| {
        events(&dir.join("log.jsonl"))
            .into_iter()
            .filter_map(|e| match e {
                Event::Step { tokens, .. } => Some(tokens),
                Event::Eval {
                    tokens, full: true, ..
                } => Some(tokens),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    // Every step counts both ranks' tokens, and the full eval reads every eval sequence once.
    assert_eq!(tokens(&one), tokens(&two));

    let (wa, wb) = (
        weights(&one.join("out/model.safetensors")),
        weights(&two.join("out/model.safetensors")),
    );
    assert_eq!(wa.len(), wb.len());
    for ((name, x), (_, y)) in wa.iter().zip(&wb) {
        let worst = x
            .iter()
            .zip(y)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-4, "{name}: weights differ by up to {worst}");
    }
}

/// Two ranks continue from a checkpoint bitwise like the uninterrupted two-rank run: rank 0
/// saved the state every rank holds, and every rank loads it. The bf16 weights with
/// stochastic rounding and an f32 master copy make any difference between replicas show.
#[test]
fn two_ranks_continue_exactly_and_refuse_another_world_size() {
    let set = setup();
    let bf16 = [
        "--model-dtype",
        "bf16",
        "--opt-m-dtype",
        "bf16",
        "--ckpt-interval",
        "2",
    ];
    let with_ckpt = |dir: &Path| {
        let mut flags: Vec<String> = bf16.iter().map(|f| f.to_string()).collect();
        flags.extend(["--checkpoint-dir".into(), s(&dir.join("ckpt")).to_string()]);
        flags
    };
    let full = set.root.join("full");
    let flags = with_ckpt(&full);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    run(&args(&full, &set.model, &set.data, 2, 2), &flags);

    // Continue the run from its step-4 checkpoint.
    let resumed = set.root.join("resumed");
    copy_checkpoint(&full.join("ckpt"), 4, &resumed.join("ckpt"));
    let flags = with_ckpt(&resumed);
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    flags.push("--continue");

    let err = smelt_err(
        &args(&resumed, &set.model, &set.data, 1, 2)
            .iter()
            .map(String::as_str)
            .chain(flags.iter().copied())
            .collect::<Vec<_>>(),
    );
    assert!(
        err.contains("world size: checkpoint 2, this run 1"),
        "{err}"
    );

    run(&args(&resumed, &set.model, &set.data, 2, 2), &flags);
    let (a, b) = (
        steps(&full.join("log.jsonl")),
        steps(&resumed.join("log.jsonl")),
    );
    assert_eq!(a[4..], b[..], "steps 5 and 6 of the continued run");
    assert_eq!(
        std::fs::read(full.join("out/model.safetensors")).unwrap(),
        std::fs::read(resumed.join("out/model.safetensors")).unwrap(),
        "the exported weights"
    );
}

#[test]
fn zero_gpus_is_refused() {
    let set = setup();
    let dir = set.root.join("zero");
    let all = args(&dir, &set.model, &set.data, 0, 2);
    let err = smelt_err(&all.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(err.contains("--gpus 0"), "{err}");
    assert!(!dir.exists(), "a refused run wrote {}", dir.display());
}
