//! Data parallelism (`--gpus N`), run here as CPU ranks in one process (`--device cpu`),
//! which exercise the trainer's multi-rank logic with the in-process collectives: sharded
//! batches and evals, summed gradients and losses, rank 0's log, checkpoints and export.

mod train_support;

use std::path::{Path, PathBuf};

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
    let mut all = strs(args);
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

/// Rank r of W takes every W-th sequence of the training stream, so 2 ranks of batch 2 train
/// on the same 4 sequences per step as 1 rank of batch 4 (the log's data hashes, which cover
/// every rank's sequences in stream order, are equal). The results differ only in the
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
    for ((step, la, da), (_, lb, db)) in a.iter().zip(&b) {
        assert!(
            (la - lb).abs() <= 1e-5 * la.abs(),
            "step {step}: loss {la} on one rank, {lb} on two"
        );
        assert_eq!(da, db, "step {step}: the data differ");
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

/// bf16 weights rounded stochastically from an f32 master copy, and bf16 moments: any
/// difference between the ranks' replicas, or between a sharded and an unsharded update,
/// shows in the bits.
const EXACT: [&str; 4] = ["--model-dtype", "bf16", "--opt-m-dtype", "bf16"];

/// The command line of an `EXACT` run on `ranks` ranks of batch 2 in `dir`, with checkpoints
/// every 2 steps, and `extra` flags.
fn command(set: &Setup, dir: &Path, ranks: usize, extra: &[&str]) -> Vec<String> {
    command_for(&set.model, set, dir, ranks, extra)
}

/// `command` for the model in folder `model`.
fn command_for(model: &Path, set: &Setup, dir: &Path, ranks: usize, extra: &[&str]) -> Vec<String> {
    let ckpt = dir.join("ckpt");
    let checkpoints = ["--ckpt-interval", "2", "--checkpoint-dir", s(&ckpt)];
    let mut all = args(dir, model, &set.data, ranks, 2);
    all.extend(
        EXACT
            .iter()
            .chain(&checkpoints)
            .chain(extra)
            .map(|f| f.to_string()),
    );
    all
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// A copy of `full`'s step-4 checkpoint in a fresh folder `name`, as its latest.
fn from_step_4(set: &Setup, full: &Path, name: &str) -> std::path::PathBuf {
    let dir = set.root.join(name);
    copy_checkpoint(&full.join("ckpt"), 4, &dir.join("ckpt"));
    dir
}

/// Steps 5 and 6 of the run in `resumed` are those of `full`, and so is the exported model.
fn assert_continues(full: &Path, resumed: &Path) {
    let (a, b) = (
        steps(&full.join("log.jsonl")),
        steps(&resumed.join("log.jsonl")),
    );
    assert_eq!(a[4..], b[..], "steps 5 and 6 of the continued run");
    assert_same_model(full, resumed);
}

fn assert_same_model(a: &Path, b: &Path) {
    assert!(
        std::fs::read(a.join("out/model.safetensors")).unwrap()
            == std::fs::read(b.join("out/model.safetensors")).unwrap(),
        "the exported weights of {} and {} differ",
        a.display(),
        b.display()
    );
}

/// Two ranks continue from a checkpoint bitwise like the uninterrupted two-rank run: rank 0
/// saved the state every rank holds, and every rank loads it. Each rank may offload its
/// residual stream in the continued run, which changes no bit. One rank of the same
/// --batch-size would train half the sequences per step, and is refused, with the sum.
#[test]
fn two_ranks_continue_exactly_and_refuse_another_global_batch() {
    let set = setup();
    let full = set.root.join("full");
    smelt_ok(&strs(&command(&set, &full, 2, &[])));

    let resumed = from_step_4(&set, &full, "resumed");
    let out = smelt(&strs(&command(&set, &resumed, 1, &["--continue"])));
    assert_refused(
        &out,
        &[
            "global batch: checkpoint 2 ranks × --batch-size 2 × --grad-accumulation 1 = 4 \
           sequences, this run 1 × 2 × 1 = 2; keep ranks × --batch-size × --grad-accumulation \
           at 4, e.g. --grad-accumulation 2",
        ],
    );
    assert!(
        !resumed.join("log.jsonl").exists(),
        "a refused run wrote its log"
    );
    let flags = ["--continue", "--offload-residual"];
    smelt_ok(&strs(&command(&set, &resumed, 2, &flags)));
    assert_continues(&full, &resumed);
}

/// ZeRO-1 gives the unsharded run's bits: each rank updates whole tensors with their own
/// seeds, then sends them. Its checkpoint holds each rank's share of the optimizer state in
/// a file of its own, and continues exactly, sharded or not: each rank reads each tensor it
/// keeps from whichever share holds it.
#[test]
fn zero_1_gives_the_same_bits_and_continues_exactly() {
    let set = setup();
    let (plain, sharded) = (set.root.join("plain"), set.root.join("sharded"));
    smelt_ok(&strs(&command(&set, &plain, 2, &[])));
    smelt_ok(&strs(&command(&set, &sharded, 2, &["--zero-level", "1"])));
    assert_eq!(
        steps(&plain.join("log.jsonl")),
        steps(&sharded.join("log.jsonl"))
    );
    assert_same_model(&plain, &sharded);

    let step4 = smelt::train::checkpoint::step_dir(&sharded.join("ckpt"), 4);
    let mut files: Vec<String> = std::fs::read_dir(&step4)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let want = [
        "adam_m.rank0",
        "adam_m.rank1",
        "adam_v.rank0",
        "adam_v.rank1",
        "master.rank0",
        "master.rank1",
        "model",
    ];
    let mut want: Vec<String> = want.iter().map(|f| format!("{f}.safetensors")).collect();
    want.push("state.json".into());
    assert_eq!(files, want);

    for level in ["0", "1"] {
        let resumed = from_step_4(&set, &sharded, &format!("resumed-{level}"));
        let flags = ["--zero-level", level, "--continue"];
        smelt_ok(&strs(&command(&set, &resumed, 2, &flags)));
        assert_continues(&sharded, &resumed);
    }
}

/// Under FP8, the abs-max that scales each weight's FP8 copy comes from the rank that
/// updated the weight, along with it: ZeRO-1 still gives the unsharded run's bits.
#[test]
fn zero_1_sends_the_fp8_weight_scales() {
    let set = setup();
    let (plain, sharded) = (set.root.join("plain"), set.root.join("sharded"));
    let fp8 = ["--matmul-dtype", "e4m3"];
    smelt_ok(&strs(&command(&set, &plain, 2, &fp8)));
    let flags = [fp8[0], fp8[1], "--zero-level", "1"];
    smelt_ok(&strs(&command(&set, &sharded, 2, &flags)));
    assert_eq!(
        steps(&plain.join("log.jsonl")),
        steps(&sharded.join("log.jsonl"))
    );
    assert_same_model(&plain, &sharded);
}

/// Each block's gradient sum starts as soon as the last micro-batch's backward has finished
/// the block, and gives the bits of sums after the whole backward. CPU ranks sum when the sum
/// starts, so a block handed over before its last write, or during an earlier micro-batch,
/// would show. Tied embeddings too: the head writes their gradient first and the embedding's
/// backward completes it last.
#[test]
fn gradient_sums_during_the_backward_give_the_bits_of_sums_after_it() {
    let set = setup();
    let tied = model_variant(&set, "tied-model", |c| {
        c["tie_word_embeddings"] = true.into()
    });

    for (name, model) in [("untied", &set.model), ("tied", &tied)] {
        let (during, after) = (set.root.join(name), set.root.join(format!("{name}-after")));
        let flags: Vec<&str> = EXACT
            .into_iter()
            .chain(["--grad-accumulation", "2"])
            .collect();
        run(&args(&during, model, &set.data, 2, 2), &flags);
        let flags = [flags, vec!["--grad-sum-after-backward"]].concat();
        run(&args(&after, model, &set.data, 2, 2), &flags);
        assert_eq!(
            steps(&during.join("log.jsonl")),
            steps(&after.join("log.jsonl")),
            "{name}"
        );
        assert_same_model(&during, &after);
    }
}

/// The gradient norm of each step of a run (before clipping).
fn norms(dir: &Path) -> Vec<f64> {
    (events(&dir.join("log.jsonl")).into_iter())
        .filter_map(|e| match e {
            Event::Step { norm, .. } => Some(norm),
            _ => None,
        })
        .collect()
}

/// The bytes of rank 0's allocation `name` (the gradients, the weights), from a run's memory
/// event.
fn category_bytes(dir: &Path, name: &str) -> u64 {
    (events(&dir.join("log.jsonl")).into_iter())
        .find_map(|e| match e {
            Event::Memory { category, bytes } if category == name => Some(bytes),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no memory event for the {name}"))
}

fn gradient_bytes(dir: &Path) -> u64 {
    category_bytes(dir, "gradients")
}

fn weight_bytes(dir: &Path) -> u64 {
    category_bytes(dir, "weights")
}

/// The run of `model` on `ranks` ranks with `flags`, unsharded in `name` and at ZeRO level
/// `level` in `name-zero-LEVEL`, which must give the same bits: the same steps (losses and
/// data), gradient norms and exported model. Returns both folders.
fn sharded_like_plain(
    set: &Setup, model: &Path, name: &str, ranks: usize, flags: &[&str], level: &str,
) -> (PathBuf, PathBuf) {
    let (plain, sharded) = (
        set.root.join(name),
        set.root.join(format!("{name}-zero-{level}")),
    );
    smelt_ok(&strs(&command_for(model, set, &plain, ranks, flags)));
    let with_level = [flags, &["--zero-level", level]].concat();
    smelt_ok(&strs(&command_for(
        model,
        set,
        &sharded,
        ranks,
        &with_level,
    )));
    assert_eq!(
        steps(&plain.join("log.jsonl")),
        steps(&sharded.join("log.jsonl")),
        "{name}"
    );
    assert_eq!(norms(&plain), norms(&sharded), "{name}");
    assert_same_model(&plain, &sharded);
    (plain, sharded)
}

/// ZeRO-2 gives the unsharded run's bits, FP8 too: each block's gradients are summed on the
/// rank that updates it, and each rank adds up the squared norms of only the gradients whose
/// sums it holds. With 6 blocks, each rank writes the 3 that it does not update into two
/// shared slots, one of them twice per backward. It continues exactly from its checkpoints.
#[test]
fn zero_2_gives_the_same_bits_and_continues_exactly() {
    let set = setup();
    let deep = model_variant(&set, "deep-model", |c| c["num_hidden_layers"] = 6.into());
    for (name, precision) in [("bf16", &[][..]), ("fp8", &["--matmul-dtype", "e4m3"][..])] {
        let (plain, sharded) = sharded_like_plain(&set, &deep, name, 2, precision, "2");
        // Rank 0 keeps 3 of the 6 blocks' gradients and two slots for the others', plus
        // every other parameter's: one block's fewer, 9,280 bf16 values.
        let (whole, shared) = (gradient_bytes(&plain), gradient_bytes(&sharded));
        assert_eq!(whole - shared, 2 * 9280, "{name}");

        if name == "bf16" {
            let resumed = from_step_4(&set, &sharded, "resumed");
            let flags = ["--zero-level", "2", "--continue"];
            smelt_ok(&strs(&command_for(&deep, &set, &resumed, 2, &flags)));
            assert_continues(&sharded, &resumed);
        }
    }
}

/// Three ranks, and tied embeddings (whose gradient the head writes first and the embedding's
/// backward completes last, whole on every rank): ZeRO-2 still gives the unsharded bits.
#[test]
fn zero_2_on_three_ranks_with_tied_embeddings_gives_the_same_bits() {
    let set = setup();
    let model = model_variant(&set, "deep-tied", |c| {
        c["num_hidden_layers"] = 6.into();
        c["tie_word_embeddings"] = true.into();
    });
    let (plain, sharded) = sharded_like_plain(&set, &model, "plain", 3, &[], "2");
    assert!(gradient_bytes(&sharded) < gradient_bytes(&plain));
}

/// ZeRO-3 gives the unsharded run's bits too, on two ranks and on three with tied
/// embeddings, and in FP8 and INT8: each block's weights are sent from their rank into the
/// others' slots before each pass (the forward, the eval, the backward) reads them, which
/// moves bits unchanged (FP8 and INT8 making their copies of them there), and stay with their
/// rank through the update. Each rank checkpoints the blocks it keeps in
/// a file of its own; the run continues from them exactly, also at level 0, and `smelt export
/// --checkpoint` gathers the run's own model from them.
#[test]
fn zero_3_gives_the_same_bits_continues_exactly_and_exports() {
    let set = setup();
    let deep = model_variant(&set, "deep-model", |c| c["num_hidden_layers"] = 6.into());
    let tied = model_variant(&set, "deep-tied", |c| {
        c["num_hidden_layers"] = 6.into();
        c["tie_word_embeddings"] = true.into();
    });
    let runs = [
        ("two", &deep, 2, &[][..]),
        ("three-tied", &tied, 3, &[]),
        ("two-fp8", &deep, 2, &["--matmul-dtype", "e4m3"]),
        ("two-int8", &deep, 2, &["--matmul-dtype", "int8"]),
    ];
    for (name, model, ranks, flags) in runs {
        let (plain, sharded) = sharded_like_plain(&set, model, name, ranks, flags, "3");
        assert!(weight_bytes(&sharded) < weight_bytes(&plain), "{name}");
        assert!(gradient_bytes(&sharded) < gradient_bytes(&plain), "{name}");
    }
    let sharded = set.root.join("two-zero-3");
    // On two ranks rank 0 keeps 3 of the 6 blocks' weights and two slots for the others', plus
    // every other parameter: one block's fewer, 9,280 bf16 values.
    let plain = set.root.join("two");
    assert_eq!(weight_bytes(&plain) - weight_bytes(&sharded), 2 * 9280);
    let files: Vec<String> =
        std::fs::read_dir(smelt::train::checkpoint::step_dir(&sharded.join("ckpt"), 6))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("model"))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
    assert_eq!(
        files,
        ["model.rank0.safetensors", "model.rank1.safetensors"]
    );
    for (level, name) in [("3", "resumed"), ("0", "resumed-at-level-0")] {
        let resumed = from_step_4(&set, &sharded, name);
        let flags = ["--zero-level", level, "--continue"];
        smelt_ok(&strs(&command_for(&deep, &set, &resumed, 2, &flags)));
        assert_continues(&sharded, &resumed);
    }
    let exported = set.root.join("exported");
    let checkpoint = sharded.join("ckpt");
    smelt_ok(&[
        "export",
        "--checkpoint",
        s(&checkpoint),
        "--out-dir",
        s(&exported),
    ]);
    assert_eq!(
        std::fs::read(exported.join("model.safetensors")).unwrap(),
        std::fs::read(sharded.join("out/model.safetensors")).unwrap()
    );
}

/// With --grad-accumulation, ZeRO-2 sums each micro-batch's block gradients on their rank,
/// which rounds in another order than summing the accumulated gradients once: close, not
/// the same bits. A shared slot that added into the block written there before would be far.
#[test]
fn zero_2_with_accumulation_sums_each_micro_batch() {
    let set = setup();
    let deep = model_variant(&set, "deep-model", |c| c["num_hidden_layers"] = 6.into());
    let accumulate = ["--grad-accumulation", "2"];
    let (plain, sharded) = (set.root.join("plain"), set.root.join("zero-2"));
    smelt_ok(&strs(&command_for(&deep, &set, &plain, 2, &accumulate)));
    let flags = [&accumulate[..], &["--zero-level", "2"]].concat();
    smelt_ok(&strs(&command_for(&deep, &set, &sharded, 2, &flags)));
    let (a, b) = (
        steps(&plain.join("log.jsonl")),
        steps(&sharded.join("log.jsonl")),
    );
    assert_eq!(a.len(), 6);
    for ((step, la, _), (_, lb, _)) in a.iter().zip(&b) {
        assert!(
            (la - lb).abs() <= 1e-3 * la.abs(),
            "step {step}: loss {la} unsharded, {lb} with ZeRO-2"
        );
    }
    // The first step's norm, from the same weights; later steps train apart by a little
    // more than their losses show.
    let (na, nb) = (norms(&plain)[0], norms(&sharded)[0]);
    assert!(
        (na - nb).abs() <= 1e-3 * na,
        "step 1: gradient norm {na} unsharded, {nb} with ZeRO-2"
    );
}

#[test]
fn zero_gpus_or_a_zero_timeout_is_refused() {
    let set = setup();
    let dir = set.root.join("zero");
    let refused = |gpus: usize, extra: &[&str]| {
        let mut all = args(&dir, &set.model, &set.data, gpus, 2);
        all.extend(extra.iter().map(|a| a.to_string()));
        let err = smelt_err(&all.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(!dir.exists(), "a refused run wrote {}", dir.display());
        err
    };
    let err = refused(0, &[]);
    assert!(err.contains("--gpus 0"), "{err}");
    let err = refused(2, &["--comm-timeout", "0"]);
    assert!(err.contains("--comm-timeout 0"), "{err}");
}
