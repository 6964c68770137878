//! A checkpoint continues on another number of ranks, sharded or not, as long as the global
//! batch (ranks × --batch-size × --grad-accumulation) stays: each step trains the same
//! sequences (the log's data hash covers every rank's, in stream order), and the losses are
//! those of the uninterrupted run up to the rounding of sums over the ranks taken in another
//! order. Run as CPU ranks in one process (`--device cpu`).

mod train_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use smelt::backend::ops::adam8bit::{DynamicMap, Q8_BLOCK};
use smelt::io::tensors;
use smelt::train::checkpoint::{self, State};
use smelt::train::log::Event;
use train_support::*;

/// The flags of a 6-step run (checkpoints every 2 steps) on CPU ranks, with bf16 weights
/// rounded stochastically from an f32 master copy and bf16 moments.
#[rustfmt::skip]
const RUN: [&str; 14] = [
    "--device", "cpu", "--steps", "6", "--warmup", "2", "--ckpt-interval", "2",
    "--model-dtype", "bf16", "--opt-m-dtype", "bf16", "--opt-v-dtype", "bf16",
];

/// `RUN` on `ranks` ranks of `batch` sequences and `accumulation` micro-batches, with a full
/// eval at the end.
fn shape(set: &Setup, ranks: usize, batch: usize, accumulation: usize) -> Vec<String> {
    let mut flags: Vec<String> = RUN.map(String::from).to_vec();
    let counts = [
        ("--gpus", ranks),
        ("--batch-size", batch),
        ("--grad-accumulation", accumulation),
    ];
    for (flag, n) in counts {
        flags.extend([flag.to_string(), n.to_string()]);
    }
    flags.extend(["--eval-file".to_string(), s(&set.data).to_string()]);
    flags
}

/// Runs `smelt train` in `set.root/name` with `flags` (and `extra`), and returns the folder.
fn train(set: &Setup, name: &str, flags: &[String], extra: &[&str]) -> PathBuf {
    let dir = set.root.join(name);
    let mut all = strs(flags);
    all.extend(extra);
    smelt_ok(&strs(&run_args(set, &dir, &all)));
    dir
}

/// The run of `flags` continued in `set.root/name` from `full`'s step-4 checkpoint.
fn continued(set: &Setup, full: &Path, name: &str, flags: &[String], extra: &[&str]) -> PathBuf {
    copy_checkpoint(&full.join("ckpt"), 4, &set.root.join(name).join("ckpt"));
    let extra = [extra, &["--continue"]].concat();
    train(set, name, flags, &extra)
}

/// (tokens, data hash) of each step of a run, and the tokens of its full eval.
fn data(dir: &Path) -> (Vec<(u64, u64, String)>, Vec<u64>) {
    let (mut steps, mut evals) = (vec![], vec![]);
    for event in events(&dir.join("log.jsonl")) {
        match event {
            Event::Step {
                step, tokens, data, ..
            } => steps.push((step, tokens, data)),
            Event::Eval {
                tokens, full: true, ..
            } => evals.push(tokens),
            _ => {}
        }
    }
    (steps, evals)
}

/// The largest difference between the losses of two runs' common steps, relative to the loss.
fn worst_loss_difference(a: &Path, b: &Path) -> f64 {
    let (a, b) = (steps(&a.join("log.jsonl")), steps(&b.join("log.jsonl")));
    let b: BTreeMap<u64, f64> = b.into_iter().map(|(s, l, _)| (s, l)).collect();
    a.iter()
        .filter_map(|(step, la, _)| b.get(step).map(|lb| (la - lb).abs() / la.abs()))
        .fold(0.0, f64::max)
}

/// Every tensor of a checkpoint's files of `category` (its shares, or the one file), by name.
fn state_tensors(step_dir: &Path, category: &str) -> BTreeMap<String, Vec<f32>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(step_dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.split('.').next() != Some(category) {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (tensor, view) in file.tensors() {
            let values = match view.dtype() {
                // 8-bit moments' codes, which `moments` decodes.
                safetensors::Dtype::U8 => view.data().iter().map(|&c| f32::from(c)).collect(),
                _ => tensors::decode(&view, &path, &tensor).unwrap(),
            };
            assert!(
                out.insert(tensor.clone(), values).is_none(),
                "{tensor} twice"
            );
        }
    }
    out
}

/// A checkpoint's Adam moments of `category` (`adam_m` or `adam_v`), by name: those stored in
/// 8 bits decoded with their blocks' abs-maxes.
fn moments(step_dir: &Path, category: &str) -> BTreeMap<String, Vec<f32>> {
    let scales = state_tensors(step_dir, &format!("{category}_absmax"));
    let map = match category {
        "adam_m" => DynamicMap::signed(),
        _ => DynamicMap::unsigned(),
    };
    let mut values = state_tensors(step_dir, category);
    for (name, absmax) in &scales {
        let codes = values.get_mut(name).unwrap();
        for (i, x) in codes.iter_mut().enumerate() {
            *x = map.value(*x as u8) * absmax[i / Q8_BLOCK];
        }
    }
    values
}

/// How far a run continued on another number of ranks may be from the uninterrupted run: its
/// losses as a fraction of the loss, and its Adam moments after the last step as a fraction of
/// each tensor's largest value. The sums over the ranks (of the gradients, and of the losses)
/// are taken in another order, and the stochastic rounding to bf16 of the weights and moments
/// turns their last bits into whole bf16 steps here and there. Measured over the cases below
/// and 16 more (8 seeds; 2 ranks under ZeRO-1 to 1, and 1 to 2 under ZeRO-2): the losses of
/// steps 5 and 6 differ by at most 4.3e-5 (step 5's by none: the same weights see the same
/// sequences), the moments by 2.5e-2; the bounds leave 4× or more. A moment tensor left at
/// zero, or read from another tensor of the same shape, moved that tensor's moments by 0.24
/// to 1 or more (and the losses by 4e-6 to 0.3: the losses alone would miss some).
const CLOSE_LOSS: f64 = 2e-4;
const CLOSE_MOMENTS: f32 = 0.1;

/// `resumed`, continued from `full`'s step 4 on another number of ranks, trained steps 5 and
/// 6 on the sequences that `full` did, to losses and moments within `CLOSE_*` of its, and
/// evaluated the same tokens at the end.
fn assert_continues_closely(full: &Path, resumed: &Path) {
    let ((a, eval_a), (b, eval_b)) = (data(full), data(resumed));
    assert_eq!(a[4..], b[..], "the steps' tokens and data");
    assert_eq!(eval_a, eval_b, "the full eval's tokens");
    let worst = worst_loss_difference(full, resumed);
    let shown = resumed.display();
    assert!(
        worst <= CLOSE_LOSS,
        "{shown}: losses differ by up to {worst:.2e}"
    );
    let last = |d: &Path| checkpoint::step_dir(&d.join("ckpt"), 6);
    for category in ["adam_m", "adam_v"] {
        let (x, y) = (
            moments(&last(full), category),
            moments(&last(resumed), category),
        );
        assert_eq!(
            x.keys().collect::<Vec<_>>(),
            y.keys().collect::<Vec<_>>(),
            "{category}"
        );
        for ((name, x), y) in x.iter().zip(y.values()) {
            let largest = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let differs = x.iter().zip(y).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                differs <= CLOSE_MOMENTS * largest,
                "{shown}: {category} of {name} differs by {differs:.2e} of {largest:.2e}"
            );
        }
    }
}

/// `resumed` continued `full` bit for bit: the same losses and data, and the same model.
fn assert_continues_exactly(full: &Path, resumed: &Path) {
    let (a, b) = (
        steps(&full.join("log.jsonl")),
        steps(&resumed.join("log.jsonl")),
    );
    assert_eq!(a[4..], b[..], "{}", resumed.display());
    let model = |d: &Path| std::fs::read(d.join("out/model.safetensors")).unwrap();
    assert!(
        model(full) == model(resumed),
        "{}: the model differs",
        resumed.display()
    );
}

/// Two ranks read the stream that one rank reads, across the end of an epoch whose 31
/// sequences do not divide over them: steps of 4 sequences train the same ones on 1 rank of
/// batch 4 and on 2 of batch 2 (none left out at the epoch's end), and without --steps both
/// run one epoch, 31 / 4 = 7 steps.
#[test]
fn two_ranks_read_one_ranks_stream_across_epochs() {
    let set = setup();
    let short = corpus_file(&set.root.join("short.bin"), 500, true);
    let run = |name: &str, ranks: &str, batch: &str, steps: &[&str]| {
        let mut flags = vec!["--device", "cpu", "--gpus", ranks, "--batch-size", batch];
        flags.extend(["--train-file", s(&short), "--ckpt-interval", "0"]);
        let dir = set.root.join(name);
        let mut args = run_args(&set, &dir, &flags);
        // run_args gives --steps 4; these runs set it, or leave it to the epoch.
        let at = args.iter().position(|a| a == "--steps").unwrap();
        args.drain(at..at + 2);
        args.extend(steps.iter().map(|a| a.to_string()));
        smelt_ok(&strs(&args));
        data(&dir).0
    };
    let one = run("one", "1", "4", &["--steps", "10"]);
    assert_eq!(one.len(), 10);
    assert_eq!(one, run("two", "2", "2", &["--steps", "10"]));
    let epoch = run("one-epoch", "1", "4", &[]);
    assert_eq!(epoch.len(), 7);
    assert_eq!(epoch, run("two-epoch", "2", "2", &[]));
}

/// A two-rank ZeRO-1 run continues on one rank, unsharded (each tensor's state read from the
/// share that holds it), with the global batch of 8 kept by twice the accumulation; the same
/// --grad-accumulation would halve it, and is refused with the sum.
#[test]
fn zero_1_on_two_ranks_continues_on_one() {
    let set = setup();
    let full = train(&set, "full", &shape(&set, 2, 2, 2), &["--zero-level", "1"]);
    let resumed = continued(&set, &full, "resumed", &shape(&set, 1, 2, 4), &[]);
    assert_continues_closely(&full, &resumed);
    let log = std::fs::read_to_string(resumed.join("log.jsonl")).unwrap();
    assert!(
        log.contains("the world size changed on continuing: checkpoint 2 ranks, this run 1 rank")
    );
    // The uninterrupted run on one rank trained the same sequences at every step.
    let one = train(&set, "one", &shape(&set, 1, 2, 4), &[]);
    assert_eq!(data(&one), data(&full));

    let halved = set.root.join("halved");
    copy_checkpoint(&full.join("ckpt"), 4, &halved.join("ckpt"));
    let args = run_args(
        &set,
        &halved,
        &strs(&[shape(&set, 1, 2, 2), vec!["--continue".into()]].concat()),
    );
    assert_refused(
        &smelt(&strs(&args)),
        &[
            "global batch: checkpoint 2 ranks × --batch-size 2 × --grad-accumulation 2 = 8 \
           sequences, this run 1 × 2 × 2 = 4; keep ranks × --batch-size × --grad-accumulation \
           at 8, e.g. --grad-accumulation 4",
        ],
    );
}

/// 8-bit moments sharded by ZeRO-1 over two ranks continue on one rank: each tensor's codes
/// and abs-maxes are read from the share that holds them (only the tensors large enough for
/// 8-bit moments have abs-maxes).
#[test]
fn zero_1_q8_moments_continue_on_one_rank() {
    let set = setup();
    let q8 = |mut flags: Vec<String>| {
        set_flags(&mut flags, &MOMENT_FLAGS, "q8");
        flags
    };
    let full = train(
        &set,
        "full",
        &q8(shape(&set, 2, 2, 2)),
        &["--zero-level", "1"],
    );
    let ckpt = checkpoint::step_dir(&full.join("ckpt"), 4);
    for share in ["adam_m_absmax.rank0", "adam_m_absmax.rank1"] {
        assert!(
            ckpt.join(format!("{share}.safetensors")).exists(),
            "no {share}"
        );
    }
    let resumed = continued(&set, &full, "resumed", &q8(shape(&set, 1, 2, 4)), &[]);
    assert_continues_closely(&full, &resumed);
}

/// A ZeRO-1 checkpoint with a share missing, or with a share in the place of another (so that
/// its tensors are in two files and the other's in none), is refused, naming the files.
#[test]
fn a_sharded_checkpoint_with_a_share_missing_or_doubled_is_refused() {
    let set = setup();
    let full = train(&set, "full", &shape(&set, 2, 2, 2), &["--zero-level", "1"]);
    let damaged = |name: &str, damage: fn(&Path)| -> String {
        let dir = set.root.join(name);
        copy_checkpoint(&full.join("ckpt"), 4, &dir.join("ckpt"));
        damage(&checkpoint::step_dir(&dir.join("ckpt"), 4));
        let flags = [shape(&set, 1, 2, 4), vec!["--continue".into()]].concat();
        let out = smelt(&strs(&run_args(&set, &dir, &strs(&flags))));
        assert_refused(&out, &["step-00000004 is damaged"])
    };
    let err = damaged("missing", |c| {
        std::fs::remove_file(c.join("adam_v.rank1.safetensors")).unwrap()
    });
    assert!(
        err.contains("adam_v.rank1.safetensors: cannot open"),
        "{err}"
    );
    let err = damaged("doubled", |c| {
        let (from, to) = (
            c.join("master.rank0.safetensors"),
            c.join("master.rank1.safetensors"),
        );
        std::fs::copy(from, to).unwrap();
    });
    assert!(
        err.contains("is in both") && err.contains("master.rank0.safetensors and"),
        "{err}"
    );
}

/// A one-rank run continues on two ranks: unsharded, under ZeRO-2 (each rank reading its
/// blocks' state from the one file), and under ZeRO-1 with the global batch of 8 made up as
/// 2 × 4 × 1 instead.
#[test]
fn one_rank_continues_on_two() {
    let set = setup();
    let full = train(&set, "full", &shape(&set, 1, 2, 4), &[]);
    for (name, flags, extra) in [
        ("two", shape(&set, 2, 2, 2), &[][..]),
        ("zero-2", shape(&set, 2, 2, 2), &["--zero-level", "2"][..]),
        (
            "zero-1-batch-4",
            shape(&set, 2, 4, 1),
            &["--zero-level", "1"][..],
        ),
    ] {
        let resumed = continued(&set, &full, name, &flags, extra);
        assert_continues_closely(&full, &resumed);
    }
}

/// A two-rank ZeRO-2 checkpoint continues on the same ranks at another level bit for bit
/// (without accumulation ZeRO-2 gives level 0's bits), and on one rank closely; so does a
/// ZeRO-3 one, whose weights are split over the ranks' files.
#[test]
fn zero_2_and_3_continue_at_another_level_and_on_one_rank() {
    let set = setup();
    let two = shape(&set, 2, 4, 1);
    for (level, others) in [("2", ["0", "1"]), ("3", ["0", "2"])] {
        let full = train(
            &set,
            &format!("full-{level}"),
            &two,
            &["--zero-level", level],
        );
        for other in others {
            let name = format!("{level}-at-level-{other}");
            let resumed = continued(&set, &full, &name, &two, &["--zero-level", other]);
            assert_continues_exactly(&full, &resumed);
        }
        let name = format!("{level}-on-one");
        let one = continued(&set, &full, &name, &shape(&set, 1, 4, 2), &[]);
        assert_continues_closely(&full, &one);
    }
}

/// Rewrites the state of checkpoint `step_dir` as format version 1 wrote it: the data
/// position counted per rank, the batch size and the accumulation (and the ZeRO level, where
/// it sharded) among the fixed settings, and the hash over those.
fn as_version_1(step_dir: &Path) {
    let path = step_dir.join("state.json");
    let mut state: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let (world, options) = (
        state["world_size"].as_u64().unwrap(),
        state["options"].clone(),
    );
    state["version"] = json!(1);
    // In the first epoch, where every rank has taken as many.
    let taken = state["loader"]["taken"].as_u64().unwrap();
    state["loader"]["taken"] = json!(taken / world);
    let fixed = state["fixed"].as_object_mut().unwrap();
    fixed.insert("--batch-size".into(), options["batch_size"].clone());
    fixed.insert(
        "--grad-accumulation".into(),
        options["grad_accumulation"].clone(),
    );
    if options["zero_level"] != json!(0) && world > 1 {
        fixed.insert("--zero-level".into(), options["zero_level"].clone());
    }
    let fixed: BTreeMap<String, Value> = fixed.clone().into_iter().collect();
    state["config_hash"] = json!(State::hash(&state["model_config"], &fixed));
    std::fs::write(&path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
}

/// Checkpoints of format version 1 continue bit for bit like the uninterrupted run: one
/// rank's as they are (its position counted the stream already), several ranks' with their
/// position converted from each rank's own count (exact in the first epoch, where version 1
/// took the same sequences).
#[test]
fn version_1_checkpoints_continue() {
    let set = setup();
    for (name, flags, extra) in [
        ("one", shape(&set, 1, 2, 4), &[][..]),
        ("zero-1", shape(&set, 2, 2, 2), &["--zero-level", "1"][..]),
    ] {
        let full = train(&set, name, &flags, extra);
        let old = format!("{name}-version-1");
        copy_checkpoint(&full.join("ckpt"), 4, &set.root.join(&old).join("ckpt"));
        as_version_1(&checkpoint::step_dir(&set.root.join(&old).join("ckpt"), 4));
        let resumed = train(&set, &old, &flags, &[extra, &["--continue"]].concat());
        assert_continues_exactly(&full, &resumed);
    }
}

/// `smelt export --checkpoint` writes the model of a checkpoint, sharded or not, named by its
/// folder or by its --checkpoint-dir, as the run's own --out-dir got it at that step: the
/// same weights byte for byte, the same config, and the tokenizer of the model the run
/// started from.
#[test]
fn export_writes_a_checkpoints_model_as_the_run_did() {
    let set = setup();
    let model = model_variant(&set, "with-tokenizer", |_| {});
    let tokenizer = word_level_tokenizer(256).to_string();
    std::fs::write(model.join("tokenizer.json"), tokenizer).unwrap();
    for (name, flags, extra) in [
        ("one", shape(&set, 1, 2, 4), &[][..]),
        ("zero-1", shape(&set, 2, 2, 2), &["--zero-level", "1"][..]),
    ] {
        let run = train(
            &set,
            name,
            &flags,
            &[extra, &["--model", s(&model)]].concat(),
        );
        let files = |dir: &Path| -> BTreeMap<PathBuf, Vec<u8>> {
            let all = snapshot(dir).into_iter();
            all.map(|(p, bytes)| (p.strip_prefix(dir).unwrap().to_path_buf(), bytes))
                .collect()
        };
        let own = files(&run.join("out"));
        assert!(own.contains_key(Path::new("tokenizer.json")));
        let ckpt = run.join("ckpt");
        for (i, source) in [checkpoint::step_dir(&ckpt, 6), ckpt].iter().enumerate() {
            let out = set.root.join(format!("{name}-export-{i}"));
            smelt_ok(&["export", "--checkpoint", s(source), "--out-dir", s(&out)]);
            assert!(
                files(&out) == own,
                "{name}: {} exports otherwise",
                source.display()
            );
        }
    }
}
