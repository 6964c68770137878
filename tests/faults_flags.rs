//! Every numeric flag of `smelt train` at 0, negative, NaN, infinite and absurdly large:
//! each run either fails at once with one error line naming the flag (and changes no file
//! but appending to its log), or, where the value means something, runs.

mod train_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use train_support::*;

/// What must happen to a run given a flag's value.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    /// Exit 1 (or 2 from the parser) with one error line naming the flag.
    Refused,
    /// The run succeeds.
    Runs,
    /// The run starts training (its first step is logged); it is then killed, as it would
    /// run for ever.
    Starts,
    /// Refused, or run with a warning naming the flag.
    Warned,
    /// Not run: `--gpus 100000` starts that many CPU ranks, each a thread with a replica of
    /// the model, which takes the machine down or panics when no more threads can start.
    NotRun,
}
use Expect::*;

const U64_MAX: &str = "18446744073709551615";

/// Each numeric flag with its values at 0, -1, NaN, infinity and absurdly large, and what
/// each must do. The demo's tiny model trains 2 steps of 2 × 16 tokens.
#[rustfmt::skip]
const FLAGS: [(&str, [(&str, Expect); 5]); 30] = [
    ("--batch-size", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("100000000", Refused)]),
    ("--seq-len", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1000000000000", Refused)]),
    ("--grad-accumulation", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1000000000", Refused)]),
    // 0 steps export the initial weights.
    ("--steps", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), (U64_MAX, Starts)]),
    ("--lr", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1e30", Refused)]),
    ("--warmup", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1000000", Warned)]),
    ("--final-lr-fraction", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1e30", Refused)]),
    ("--cooldown", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1000000", Warned)]),
    ("--seed", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), (U64_MAX, Runs)]),
    ("--weight-decay", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1e30", Refused)]),
    // 0 turns clipping off; clipping at 1e30 never clips.
    ("--grad-clip", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1e30", Runs)]),
    ("--beta-1", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1e30", Refused)]),
    ("--beta-2", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1e30", Refused)]),
    // ε = 0 divides 0 by 0 for a weight whose gradient has always been 0 (an unused token's
    // embedding row); a huge ε only makes the steps tiny.
    ("--adam-eps", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1e30", Runs)]),
    ("--z-loss", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1e30", Refused)]),
    ("--lmhead-chunks", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1000000000", Refused)]),
    ("--ffn-chunks", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1000000000", Refused)]),
    ("--gpus", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("100000", NotRun)]),
    ("--zero-level", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("300", Refused)]),
    // On the CPU the memory to fit is the host's, which a plan does not choose for.
    ("--fit-memory", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1e30", Runs)]),
    ("--comm-timeout", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), (U64_MAX, Runs)]),
    ("--ckpt-interval", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), (U64_MAX, Runs)]),
    ("--eval-every-n-steps", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), (U64_MAX, Runs)]),
    ("--eval-num-steps", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1000000000", Runs)]),
    ("--debug-log-abs-max", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), (U64_MAX, Refused)]),
    ("--health-every", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), (U64_MAX, Runs)]),
    ("--max-skipped-steps", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), (U64_MAX, Runs)]),
    ("--spike-window", [("0", Refused), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1000000000", Runs)]),
    ("--spike-zscore", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), ("1e30", Runs)]),
    // The CPU has no GPU for NVML to read.
    ("--log-gpu-util", [("0", Runs), ("-1", Refused), ("NaN", Refused), ("inf", Refused), (U64_MAX, Refused)]),
];

#[derive(Debug)]
struct Case {
    flag: &'static str,
    value: &'static str,
    expect: Expect,
}

fn cases() -> Vec<Case> {
    FLAGS
        .iter()
        .flat_map(|(flag, values)| {
            values.iter().map(move |&(value, expect)| Case {
                flag,
                value,
                expect,
            })
        })
        .filter(|c| c.expect != NotRun)
        .collect()
}

/// Runs case `c` in a folder of its own; what is wrong, if anything.
fn verdict(set: &Setup, i: usize, c: &Case) -> Result<(), String> {
    let dir = set.root.join(format!("case-{i}"));
    std::fs::create_dir_all(&dir).unwrap();
    let earlier = r#"{"time":1.0,"event":"option","name":"lr","value":0.1}"#;
    let log = dir.join("log.jsonl");
    std::fs::write(&log, format!("{earlier}\n")).unwrap();
    let mut extra = vec![c.flag, c.value];
    if c.flag != "--steps" {
        extra.extend(["--steps", "2"]);
    }
    let args = run_args(set, &dir, &extra);
    if c.expect == Starts {
        let logged_a_step =
            || std::fs::read_to_string(&log).is_ok_and(|l| l.contains(r#""event":"step""#));
        kill_when(Command::new(SMELT).args(&args), logged_a_step);
        return Ok(());
    }
    let before = snapshot(&dir);
    let out = smelt(&strs(&args));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let warned = out.status.success()
        && (stdout.lines().chain(stderr.lines()))
            .any(|l| l.starts_with("warning:") && l.contains(c.flag));
    match c.expect {
        Runs if out.status.success() => Ok(()),
        Runs => Err(format!("failed: {stderr}")),
        Warned if warned => Ok(()),
        Refused | Warned => match refusal_problem(&out, &[c.flag]) {
            Some(problem) => Err(problem),
            None => unchanged_but_the_log(&dir, &before),
        },
        Starts | NotRun => unreachable!("not run here"),
    }
}

/// Whether every file in `dir` is as in `before`, except the log, which may only have grown.
fn unchanged_but_the_log(dir: &Path, before: &BTreeMap<PathBuf, Vec<u8>>) -> Result<(), String> {
    let log = dir.join("log.jsonl");
    let (mut before, mut after) = (before.clone(), snapshot(dir));
    let (old, new) = (before.remove(&log).unwrap(), after.remove(&log).unwrap());
    match (new.starts_with(&old), after == before) {
        (true, true) => Ok(()),
        (false, _) => Err("the log was rewritten".into()),
        (_, false) => Err("a refused run changed files".into()),
    }
}

#[test]
fn numeric_flags_at_zero_negative_nan_infinite_and_huge() {
    let set = setup();
    let numbered: Vec<(usize, Case)> = cases().into_iter().enumerate().collect();
    in_parallel(numbered, |(i, c)| {
        if let Err(problem) = verdict(&set, *i, c) {
            panic!("{} {}: {problem}", c.flag, c.value);
        }
    });
}

/// Sizes whose tensors cannot be allocated are refused before allocating, naming the memory
/// category, its size and the flag to change (rather than aborting on a failed allocation).
#[test]
fn sizes_that_cannot_fit_are_refused_before_allocating() {
    let set = setup();
    let cases: [(&[&str], &[&str]); 3] = [
        // 100M sequences of 16 tokens: terabytes of activations.
        (
            &["--batch-size", "100000000"],
            &["cannot allocate the activations", "TiB", "--batch-size"],
        ),
        // The activations' shapes overflow 64 bits.
        (
            &["--batch-size", "100000000000000000"],
            &["the activations", "2^64 bytes", "--batch-size"],
        ),
        // A billion micro-batches' losses.
        (
            &["--grad-accumulation", "1000000000"],
            &["cannot allocate the losses", "--grad-accumulation"],
        ),
    ];
    for (flags, want) in cases {
        let dir = set.root.join("run");
        let out = smelt(&strs(&run_args(&set, &dir, flags)));
        assert_refused(&out, want);
    }
}
