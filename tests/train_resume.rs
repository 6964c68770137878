//! Resuming is exact, and a process killed while writing a checkpoint
//! leaves the previous one intact for `--continue`.
//!
//! The runs use bf16 weights with an f32 master copy, bf16 Adam moments (so stochastic
//! rounding is in play), gradient accumulation and a loss mask: every piece of state that
//! must be saved for a bitwise resume is exercised.

mod train_support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use smelt::train::checkpoint;
use smelt::train::log::Event;
use train_support::*;

/// The uninterrupted 6-step run of `args` with `extra` flags, in `name`.
fn uninterrupted(s: &Setup, name: &str, extra: &[&str]) -> PathBuf {
    let dir = s.root.join(name);
    run_with(&resume_args(&dir, &s.model, &s.data), extra);
    dir
}

#[test]
fn resume_is_bitwise_exact() {
    let s = setup();
    let full = uninterrupted(&s, "full", &[]);
    let resumed = resumed_at_step_2(&s, &full, "resumed", &[]);
    assert_same_run(&full, &resumed, 2);

    // Continuing at the end does no more steps and changes nothing.
    let before = checkpoint_files(&checkpoint::step_dir(&resumed.join("ckpt"), 6));
    run_with(&resume_args(&resumed, &s.model, &s.data), &["--continue"]);
    assert_eq!(
        before,
        checkpoint_files(&checkpoint::step_dir(&resumed.join("ckpt"), 6))
    );
    assert_eq!(steps(&resumed.join("log.jsonl")).len(), 4);
}

/// FP8 keeps no state across steps (its scales come from each step's tensors, its weight
/// copies from the weights), so an FP8 run resumes as exactly.
#[test]
fn fp8_resume_is_bitwise_exact() {
    let s = setup();
    let fp8 = ["--matmul-dtype", "e4m3", "--gradient-dtype", "e5m2"];
    let full = uninterrupted(&s, "full", &fp8);
    let resumed = resumed_at_step_2(&s, &full, "resumed", &fp8);
    assert_same_run(&full, &resumed, 2);
    // And it is not the bf16 run.
    let bf16 = uninterrupted(&s, "bf16", &[]);
    assert_ne!(
        steps(&full.join("log.jsonl")),
        steps(&bf16.join("log.jsonl"))
    );
}

/// INT8 keeps no state across steps either (its scales come from each row of each step's
/// tensors, its weight codes from the weights, its rounding seeds from the step), so an INT8
/// run resumes as exactly, with bf16 weight gradients and with INT8 ones rounded
/// stochastically.
#[test]
fn int8_resume_is_bitwise_exact() {
    let s = setup();
    for (name, flags) in [
        ("int8", &["--matmul-dtype", "int8"][..]),
        (
            "int8-sr",
            &[
                "--matmul-dtype",
                "int8",
                "--int8-weight-grad",
                "--int8-stochastic-rounding",
            ][..],
        ),
    ] {
        let full = uninterrupted(&s, &format!("{name}-full"), flags);
        let resumed = resumed_at_step_2(&s, &full, &format!("{name}-resumed"), flags);
        assert_same_run(&full, &resumed, 2);
    }
}

/// 8-bit moments resume as exactly: their codes and their blocks' abs-maxes are saved (as
/// u8 and f32) beside the other state, and read back into the same bits. (Of the tiny model's
/// tensors, the embeddings and the head have the 4,096 elements 8-bit moments need.)
#[test]
fn q8_moments_resume_is_bitwise_exact() {
    let s = setup();
    // `resume_args` with q8 moments in place of bf16 ones.
    let args = |dir: &Path| -> Vec<String> {
        let mut args = resume_args(dir, &s.model, &s.data);
        set_flags(&mut args, &MOMENT_FLAGS, "q8");
        args
    };
    let (full, resumed) = (s.root.join("full"), s.root.join("resumed"));
    run_with(&args(&full), &[]);
    copy_checkpoint(&full.join("ckpt"), 2, &resumed.join("ckpt"));
    run_with(&args(&resumed), &["--continue"]);
    assert_same_run(&full, &resumed, 2);
    let saved = checkpoint_files(&checkpoint::step_dir(&full.join("ckpt"), 2));
    for file in ["adam_m_absmax.safetensors", "adam_v_absmax.safetensors"] {
        assert!(saved.iter().any(|(name, _)| name == file), "no {file}");
    }
    // And it is not the run with bf16 moments.
    let bf16 = uninterrupted(&s, "bf16", &[]);
    assert_ne!(
        steps(&full.join("log.jsonl")),
        steps(&bf16.join("log.jsonl"))
    );
}

/// Where the optimizer state lives changes no bit, so a run may continue with other
/// `--offload-*` flags and end as the uninterrupted run did. (On the CPU the state is in host
/// memory either way; `tests/cuda_offload.rs` checks the same where it moves off the GPU.)
#[test]
fn offload_may_change_on_continue() {
    let s = setup();
    let full = uninterrupted(&s, "full", &[]);
    let offload = ["--offload-master", "--offload-opt-m", "--offload-opt-v"];
    let resumed = resumed_at_step_2(&s, &full, "offloaded", &offload);
    assert_same_run(&full, &resumed, 2);
    let log = std::fs::read_to_string(resumed.join("log.jsonl")).unwrap();
    for category in ["host adam_m", "host adam_v", "host master"] {
        assert!(log.contains(category), "no {category} in the memory table");
    }
    assert!(
        !log.contains("offload changed"),
        "offload warned on continuing"
    );
}

/// Streaming the blocks' weights and gradients through the device changes no bit either: a
/// run that streams them (with gradient accumulation, so each block's sum comes back in
/// before the next micro-batch adds to it) trains as one that does not, and continues the
/// other's checkpoint. (`tests/cuda_streaming.rs` checks the same where the copies run beside
/// the GPU's work.)
#[test]
fn streaming_weights_and_gradients_changes_no_bit_and_may_change_on_continue() {
    let s = setup();
    let full = uninterrupted(&s, "full", &[]);
    let stream = ["--offload-weights", "--offload-gradients"];
    let streamed = uninterrupted(&s, "streamed", &stream);
    assert_same_run(&full, &streamed, 0);
    let resumed = resumed_at_step_2(&s, &full, "resumed", &stream);
    assert_same_run(&full, &resumed, 2);
    let log = std::fs::read_to_string(resumed.join("log.jsonl")).unwrap();
    for category in ["host weights", "host gradients"] {
        assert!(log.contains(category), "no {category} in the memory table");
    }
    assert!(
        !log.contains("changed on continuing"),
        "a streaming flag warned on continuing"
    );
}

#[test]
fn killed_while_writing_a_checkpoint_continues_from_the_previous_one() {
    let s = setup();
    let full = uninterrupted(&s, "full", &[]);

    let killed = s.root.join("killed");
    let mut child = std::process::Command::new(SMELT)
        .args(resume_args(&killed, &s.model, &s.data))
        // Pause 400 ms after each tensor file of a checkpoint (see checkpoint::DELAY_ENV).
        .env(checkpoint::DELAY_ENV, "400")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill as soon as the step-4 checkpoint is half written.
    let tmp = killed.join("ckpt/.step-00000004.tmp");
    let start = Instant::now();
    while !tmp.join("model.safetensors").exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it was killed"
        );
        assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    // The half-written checkpoint never became `latest`; the one before is complete.
    let ckpt = killed.join("ckpt");
    let latest = checkpoint::read_latest(&ckpt).unwrap().unwrap();
    assert_eq!(latest, checkpoint::step_dir(&ckpt, 2));
    assert!(!checkpoint::step_dir(&ckpt, 4).exists());
    assert_eq!(checkpoint::read_state(&latest).unwrap().step, 2);

    run_with(&resume_args(&killed, &s.model, &s.data), &["--continue"]);
    let loaded: Vec<u64> = events(&killed.join("log.jsonl"))
        .into_iter()
        .filter_map(|e| match e {
            Event::Checkpoint {
                step, loaded: true, ..
            } => Some(step),
            _ => None,
        })
        .collect();
    assert_eq!(loaded, [2]);
    assert!(
        !tmp.exists(),
        "the stale temporary checkpoint was not cleared"
    );
    // Steps 3 and 4 ran before the kill and again after it, identically.
    let log = steps(&killed.join("log.jsonl"));
    let runs_of = |step| log.iter().filter(|x| x.0 == step).collect::<Vec<_>>();
    for step in [3, 4] {
        let runs = runs_of(step);
        assert_eq!(runs.len(), 2, "step {step}");
        assert_eq!(runs[0], runs[1], "step {step} replayed differently");
    }
    assert_same_run(&full, &killed, 2);
}
