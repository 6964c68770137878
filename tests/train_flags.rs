//! Each `smelt train` flag reaches the run as given, and a flag that the run cannot follow
//! as given is named with what the run does instead.

mod train_support;

use smelt::train::log::Event;
use train_support::*;

/// `smelt train` on the tiny model and its corpus, in `set.root`, with `extra` flags: the
/// events it logs (into a log of its own).
fn train(set: &Setup, extra: &[&str]) -> Vec<Event> {
    train_printing(set, extra).0
}

/// `train`, and what the run printed.
fn train_printing(set: &Setup, extra: &[&str]) -> (Vec<Event>, String) {
    let log = set.root.join("log.jsonl");
    if log.exists() {
        std::fs::remove_file(&log).unwrap();
    }
    let mut args = vec!["train", "--model", s(&set.model), "--from-scratch"];
    args.extend(["--train-file", s(&set.data), "--log-file", s(&log)]);
    args.extend(["--batch-size", "2", "--seq-len", "16", "--lr", "1e-2"]);
    args.extend(extra);
    let printed = smelt_ok(&args);
    (events(&log), printed)
}

#[test]
fn eval_num_steps_sets_the_batches_of_each_periodic_eval() {
    let set = setup();
    // Unmasked, so that each eval batch trains all its targets.
    let eval = corpus_file(&set.root.join("eval.bin"), 2000, false);
    // --ffn-chunks sits beside --eval-num-steps in the list of flags that must be positive.
    let events = train(
        &set,
        &[
            "--eval-file",
            s(&eval),
            "--steps",
            "2",
            "--eval-every-n-steps",
            "1",
            "--eval-num-steps",
            "3",
            "--ffn-chunks",
            "2",
            "--recompute-ffn",
        ],
    );
    let option = events.iter().find_map(|e| match e {
        Event::Option { name, value } if name == "eval_num_steps" => Some(value.clone()),
        _ => None,
    });
    assert_eq!(option, Some(serde_json::json!(3)));
    let periodic: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::Eval {
                tokens,
                full: false,
                ..
            } => Some(*tokens),
            _ => None,
        })
        .collect();
    // One eval, at step 1, over 3 batches of 2 sequences of 16 targets.
    assert_eq!(periodic, [3 * 2 * 16]);
}

#[test]
fn a_warmup_longer_than_the_run_ends_at_its_last_step() {
    let set = setup();
    let events = train(&set, &["--steps", "2", "--warmup", "5"]);
    let warnings: Vec<&String> = events
        .iter()
        .filter_map(|e| match e {
            Event::Warning { message } => Some(message),
            _ => None,
        })
        .collect();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("--warmup 5 is longer than the run's 2 steps")),
        "{warnings:?}"
    );
    // As torchtitan does, the warmup is shortened to the run: the rate reaches --lr at the
    // last step.
    let lrs: Vec<f64> = events
        .iter()
        .filter_map(|e| match e {
            Event::Step { lr, .. } => Some(*lr),
            _ => None,
        })
        .collect();
    assert_eq!(lrs, [0.5e-2, 1e-2]);
}

/// `--doc-mask --doc-positions` train on the corpus's lines as documents (`--eos-id 10`, the
/// newline): the option is logged, the loss falls, and keeping the lines apart changes what
/// the model learns from the same batches.
#[test]
fn documents_train_apart() {
    let set = setup();
    let flags = ["--steps", "12", "--seed", "3"];
    let plain = train(&set, &flags);
    std::fs::remove_file(set.root.join("log.jsonl")).unwrap();
    let documents = ["--doc-mask", "--doc-positions", "--eos-id", "10"];
    let apart = train(&set, &[&flags[..], &documents].concat());
    let option = apart.iter().find_map(|e| match e {
        Event::Option { name, value } if name == "documents" => Some(value.clone()),
        _ => None,
    });
    assert_eq!(
        option,
        Some(serde_json::json!({"eos": 10, "mask": true, "positions": true}))
    );
    let losses = |events: &[Event]| -> Vec<f64> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Step { loss, .. } => Some(*loss),
                _ => None,
            })
            .collect()
    };
    let (plain, apart) = (losses(&plain), losses(&apart));
    assert_eq!(plain.len(), 12);
    assert_ne!(plain, apart, "the same losses with the lines kept apart");
    assert!(apart[11] < apart[0], "{apart:?}");
}

/// `--use-cuda-graphs` reaches the run, whose steps are those without it: on the CPU, which
/// records nothing, the passes run op by op through the same uploads (the loss scale among
/// them) that a replayed pass reads (`tests/cuda_graphs.rs` compares the replays on the GPU).
#[test]
fn use_cuda_graphs_trains_the_same_steps() {
    let set = setup();
    let eval = corpus_file(&set.root.join("eval.bin"), 2000, true);
    let flags = [
        "--eval-file",
        s(&eval),
        "--steps",
        "3",
        "--grad-accumulation",
        "2",
        "--eval-every-n-steps",
        "1",
        "--matmul-dtype",
        "e4m3",
    ];
    let losses = |events: &[Event]| -> Vec<f64> {
        let each = events.iter().filter_map(|e| match e {
            Event::Step { loss, .. } | Event::Eval { loss, .. } => Some(*loss),
            _ => None,
        });
        each.collect()
    };
    let op_by_op = losses(&train(&set, &flags));
    let (events, printed) = train_printing(&set, &[&flags[..], &["--use-cuda-graphs"]].concat());
    assert!(
        printed.contains("cuda graphs: this device records none; the passes run op by op"),
        "{printed}"
    );
    let option = events.iter().find_map(|e| match e {
        Event::Option { name, value } if name == "use_cuda_graphs" => Some(value.clone()),
        _ => None,
    });
    assert_eq!(option, Some(serde_json::json!(true)));
    assert_eq!(
        op_by_op.len(),
        3 + 2 + 1,
        "3 steps, the evals after 2 of them, the final one"
    );
    assert_eq!(losses(&events), op_by_op);
}
