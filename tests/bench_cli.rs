//! `smelt bench` on the CPU: the JSON line that scripts/gpu/bench.sh parses has every field,
//! and its figures agree with each other and with the model's size; `--fit-memory` runs
//! within its budget; bad input gets one clear error.

mod train_support;

use serde_json::Value;
use train_support::*;

/// `smelt bench --json` on the tiny model, parsed: 8 × 64 tokens, so that a step takes
/// tens of milliseconds and a busy machine's scheduling noise stays small against it.
fn bench_json(model: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "bench",
        "--device",
        "cpu",
        "--model",
        model,
        "--batch-size",
        "8",
        "--seq-len",
        "64",
        "--steps",
        "5",
        "--warmup",
        "1",
        "--lmhead-chunks",
        "2",
        "--json",
    ];
    args.extend(extra);
    let stdout = smelt_ok(&args);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "--json prints one line, got:\n{stdout}");
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn number(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("`{key}` is not a number in {v}"))
}

#[test]
fn json_figures_are_complete_and_consistent() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_model_dir(tmp.path());
    let v = bench_json(s(&dir), &[]);

    assert_eq!(v["model"], s(&dir));
    assert_eq!(v["dtype"], "bf16");
    assert_eq!(v["batch"], 8);
    assert_eq!(v["seq"], 64);
    assert!(v["device"].as_str().unwrap().starts_with("cpu"), "{v}");
    // The CPU has no datasheet peak, so there is no MFU rather than a made-up one.
    assert!(v["mfu"].is_null(), "{v}");

    let (tok_s, step_ms) = (number(&v, "tok_s"), number(&v, "step_ms"));
    assert!(tok_s > 0.0 && step_ms > 0.0, "{v}");
    // Throughput is the step's tokens over the step's time; only float rounding separates them.
    let tokens = tok_s * step_ms / 1e3;
    assert!(
        (tokens / 512.0 - 1.0).abs() < 1e-9,
        "tok_s·step = {tokens}, not 8·64"
    );

    let phases = v["phases_ms"].as_object().expect("phases_ms object");
    let names = ["forward", "backward", "optimizer", "other"];
    assert_eq!(phases.len(), names.len(), "{v}");
    let mut sum = 0.0;
    for name in names {
        let ms = phases[name].as_f64().expect("a number");
        // "other" (reading back 512 losses) can be microseconds, but never negative; the
        // three phases that compute are measurably long.
        assert!(
            ms >= 0.0 && (name == "other" || ms > 0.0),
            "{name}: {ms} ms"
        );
        sum += ms;
    }
    // The split is the median of each phase over 3 separately synchronised steps, and
    // split_step_ms the median of those same steps' totals, so the phases must add up to it
    // whatever the machine's load did to other steps: a phase missed or counted twice would
    // be off by the backward's ~60% or more, far past the spread of medians of 3.
    let split_step = number(&v, "split_step_ms");
    assert!(
        sum > 0.7 * split_step && sum < 1.4 * split_step,
        "phases sum to {sum} ms, their steps took {split_step} ms"
    );

    // On the CPU the memory figure is the plan, which holds at least bf16 weights, gradients
    // and both bf16 Adam moments: 4 × 2 bytes per parameter, counted from the config.
    assert_eq!(v["memory"], "planned");
    let config = smelt::io::hf::read_config(&dir).unwrap();
    let floor = (8 * config.num_parameters()) as f64 / (1u64 << 30) as f64;
    let gib = number(&v, "peak_mem_gib");
    assert!(gib >= floor && gib < 100.0 * floor, "{gib} GiB vs {floor}");

    // A model a few steps of lr 1e-4 away from a 0.02-std init predicts nearly uniformly, so
    // its loss on random tokens is close to ln(vocab).
    let loss = number(&v, "loss");
    let uniform = (config.vocab_size as f64).ln();
    assert!((loss - uniform).abs() < 0.5, "loss {loss}, ln V {uniform}");
}

#[test]
fn fp8_recompute_and_offload_flags_reach_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_model_dir(tmp.path());
    let fp8 = ["--matmul-dtype", "e4m3", "--gradient-dtype", "e4m3"];
    let kept = bench_json(s(&dir), &fp8);
    let recomputed = bench_json(
        s(&dir),
        &[fp8.as_slice(), &["--recompute-att", "--recompute-ffn"]].concat(),
    );
    assert_eq!(recomputed["dtype"], "e4m3/e4m3");
    assert!(number(&recomputed, "tok_s") > 0.0, "{recomputed}");
    // The same flags as `smelt train`'s: recomputed activations are not planned per layer.
    let (kept, recomputed) = (
        number(&kept, "peak_mem_gib"),
        number(&recomputed, "peak_mem_gib"),
    );
    assert!(
        recomputed < kept,
        "recompute planned {recomputed} GiB, not under {kept}"
    );
    // The residual stream goes to host memory, which the report counts apart.
    let offloaded = bench_json(s(&dir), &["--offload-residual"]);
    assert!(number(&offloaded, "offloaded_gib") > 0.0, "{offloaded}");
}

#[test]
fn op_times_on_the_cpu_say_they_are_not_measured() {
    // Only the CUDA backend times ops (tests/cuda_op_times.rs checks the figures there); the
    // CPU must say so rather than print an empty or made-up table.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_model_dir(tmp.path());
    let v = bench_json(s(&dir), &["--op-times"]);
    assert_eq!(v["ops"], serde_json::json!([]), "{v}");
    let stdout = smelt_ok(&[
        "bench",
        "--device",
        "cpu",
        "--model",
        s(&dir),
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--op-times",
    ]);
    assert!(
        stdout.contains("op times: not measured (only the CUDA backend times ops)"),
        "{stdout}"
    );
}

/// scripts/gpu/bench.sh itself, on the CPU with the tiny model (its SMELT, DEVICE and
/// BENCH_ROWS switches): one row that meets its target (warmed up, so that a busy machine's
/// first step does not decide it) and one that cannot, no baseline. The
/// closing table marks the second short, and the note under it says what the CPU cannot
/// give (op times) rather than leave the cost out.
#[test]
fn the_gpu_bench_script_marks_short_rows_and_notes_their_costs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_model_dir(tmp.path());
    let model = s(&dir);
    let rows = format!(
        "{model} bf16 2 1000 --steps 3 --warmup 2 --seq-len 8;{model} bf16 4 1000000000000 --steps 1 --warmup 0"
    );
    let out = tmp.path().join("logs");
    let run = std::process::Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gpu/bench.sh"))
        .env("SMELT", env!("CARGO_BIN_EXE_smelt"))
        .env("DEVICE", "cpu")
        .env("SEQ", "16")
        .env("SKIP_TORCH", "1")
        .env("BENCH_ROWS", rows)
        .env("OUT", &out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let table = std::fs::read_to_string(out.join("bench-table.txt")).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("model") && lines[0].ends_with("target"),
        "{table}"
    );
    assert!(
        lines[1].ends_with(" 1k"),
        "the first row meets its target:\n{table}"
    );
    // Each row's sequence length (the fourth word of its line in bench-rows.txt, and a
    // column of the table): its own --seq-len, or SEQ.
    let listed = std::fs::read_to_string(out.join("bench-rows.txt")).unwrap();
    let seqs: Vec<&str> = (listed.lines())
        .map(|l| l.split_whitespace().nth(3).unwrap())
        .collect();
    assert_eq!(seqs, ["8", "16"], "{listed}");
    assert!(lines[0].contains(" batch  seq "), "{table}");
    assert!(lines[2].ends_with("1000000000k (short)"), "{table}");
    let note = lines.last().unwrap();
    assert!(
        note.contains(
            "-b4_--steps_1_--warmup_0: 0.00 of its target; op times not measured on this device"
        ),
        "{table}"
    );
}

/// `--fit-memory` benches `smelt plan`'s pick: in a budget a KiB short of the plain run's
/// tensors, the run's tensors fit, and the choice is printed before the JSON line.
#[test]
fn fit_memory_benches_the_plans_pick_within_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_model_dir(tmp.path());
    let base = [
        "bench",
        "--device",
        "cpu",
        "--model",
        s(&dir),
        "--batch-size",
        "8",
    ];
    let run = |extra: &[&str]| -> (Vec<String>, f64) {
        let mut args = base.to_vec();
        args.extend(["--seq-len", "64", "--steps", "1", "--warmup", "0", "--json"]);
        args.extend(extra);
        let lines: Vec<String> = smelt_ok(&args).lines().map(String::from).collect();
        let v: Value = serde_json::from_str(lines.last().unwrap()).unwrap();
        (lines, number(&v, "peak_mem_gib"))
    };
    let (_, plain) = run(&[]);
    let budget = plain - 1024.0 / (1u64 << 30) as f64;
    let (lines, fitted) = run(&["--fit-memory", &format!("{budget:.12}")]);
    assert!(fitted <= budget, "{fitted} GiB in a budget of {budget}");
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].starts_with("--fit-memory: --"), "{lines:?}");

    let mut args = base.to_vec();
    args.extend(["--fit-memory", "1", "--lmhead-chunks", "2"]);
    let err = smelt_err(&args);
    assert!(err.contains("--fit-memory chooses"), "{err}");
}

/// `--doc-mask --doc-positions` bench documents of about `--doc-length` tokens, which the
/// JSON line names; a length too short for a document is refused.
#[test]
fn documents_are_benched_as_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_model_dir(tmp.path());
    let v = bench_json(
        s(&dir),
        &["--doc-mask", "--doc-positions", "--doc-length", "12"],
    );
    assert_eq!(
        v["documents"],
        serde_json::json!({"mask": true, "positions": true, "length": 12}),
        "{v}"
    );
    assert!(number(&v, "loss").is_finite(), "{v}");
    assert!(bench_json(s(&dir), &[])["documents"].is_null());
    let short = ["--doc-mask", "--doc-length", "1"];
    let err = smelt_err(
        &[
            &["bench", "--model", "qwen2.5-0.5b", "--batch-size", "2"],
            &short[..],
        ]
        .concat(),
    );
    assert!(err.contains("--doc-length must be at least 2"), "{err}");
}

#[test]
fn bad_input_gets_one_clear_error() {
    let base = ["bench", "--device", "cpu", "--batch-size", "2"];
    let run = |extra: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        smelt_err(&args)
    };
    let err = run(&["--model", "qwen9-0.1b"]);
    assert!(
        err.contains("--model qwen9-0.1b") && err.contains("qwen2.5-0.5b"),
        "unhelpful error: {err}"
    );
    assert_eq!(err.lines().count(), 1, "one error line, got:\n{err}");

    let err = run(&["--model", "qwen2.5-0.5b", "--steps", "0"]);
    assert!(err.contains("--steps"), "unhelpful error: {err}");
    let err = run(&["--model", "qwen2.5-0.5b", "--gradient-dtype", "e5m2"]);
    assert!(err.contains("--matmul-dtype e4m3"), "{err}");
}

/// A step of `--grad-accumulation` micro-batches counts all their tokens, and layer-major
/// says how many a pass held; `--layer-major` without micro-batches to run is refused.
#[test]
fn accumulated_steps_count_every_micro_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_model_dir(tmp.path());
    let accumulated = ["--grad-accumulation", "3", "--layer-major=2"];
    let v = bench_json(s(&dir), &accumulated);
    assert_eq!(
        (v["grad_accumulation"].clone(), v["layer_major"].clone()),
        (3.into(), 2.into())
    );
    let (tok_s, step_ms) = (number(&v, "tok_s"), number(&v, "step_ms"));
    let tokens = tok_s * step_ms / 1e3;
    assert!((tokens / (3.0 * 8.0 * 64.0) - 1.0).abs() < 1e-6, "{v}");
    assert!(number(&v, "loss").is_finite(), "{v}");

    let model = s(&dir);
    let out = smelt(&[
        "bench",
        "--model",
        model,
        "--batch-size",
        "1",
        "--layer-major",
    ]);
    assert_refused(&out, &["--layer-major", "--grad-accumulation 2"]);
}

/// `--use-cuda-graphs` reaches the run, which on the CPU (recording nothing) gives the loss of
/// the run without it; what a recording cannot replay is refused.
#[test]
fn cuda_graphs_reach_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_model_dir(tmp.path());
    let int8 = ["--matmul-dtype", "int8", "--grad-accumulation", "2"];
    let op_by_op = bench_json(s(&dir), &int8);
    let graphs = bench_json(s(&dir), &[&int8[..], &["--use-cuda-graphs"]].concat());
    assert_eq!(graphs["cuda_graphs"], true, "{graphs}");
    assert_eq!(graphs["loss"], op_by_op["loss"]);
    for flags in [&["--offload-activations"][..], &["--optimizer-in-backward"]] {
        let bench = [
            "bench",
            "--model",
            s(&dir),
            "--batch-size",
            "1",
            "--use-cuda-graphs",
        ];
        let args = [&bench[..], flags].concat();
        assert_refused(
            &smelt(&args),
            &["--use-cuda-graphs cannot be used with", flags[0]],
        );
    }
}
