//! `--layer-major`: a step's micro-batches run block by block give the bits of the run that
//! takes them one at a time, in bf16, FP8 and INT8 matmuls, with the residual stream, the blocks' weights, gradients and
//! optimizer state in host memory, with recompute, updated in the backward, with documents
//! kept apart and the MLP and LM head in chunks, in passes of fewer micro-batches than a step
//! has, and on two CPU ranks under ZeRO-2 and -3 (bitwise level 0, which ZeRO-3 of one
//! micro-batch at a time is not). With tied embeddings only the embedding's gradient sums in
//! another order. Checkpoints continue either way; what it cannot do is refused; `smelt plan`
//! halves the passes where host memory is short.

mod train_support;

use train_support::*;

/// Layer-major with the blocks' weights, gradients and residual stream in host memory.
const STREAMED: [&str; 5] = [
    "--layer-major",
    "--recompute-block",
    "--offload-residual",
    "--offload-weights",
    "--offload-gradients",
];

/// The same losses, data, final weights and optimizer state as the run of one micro-batch at
/// a time (`resume_args`' two a step), under each set of memory flags.
#[test]
fn layer_major_changes_no_bit() {
    let s = setup();
    let dir = |name: &str| s.root.join(name);
    let run = |name: &str, extra: &[&str]| {
        run_with(&resume_args(&dir(name), &s.model, &s.data), extra);
        dir(name)
    };
    let full = run("full", &[]);
    assert_same_run(&full, &run("layer_major", &["--layer-major"]), 0);
    let streamed = [&STREAMED[..], &["--offload-opt-m", "--offload-opt-v"]].concat();
    assert_same_run(&full, &run("streamed", &streamed), 0);
    // Each micro-batch's kept activations in host memory, with their own device slots.
    let kept = ["--layer-major", "--recompute-ffn", "--offload-activations"];
    assert_same_run(&full, &run("kept", &kept), 0);

    // Updated in the backward (which does not clip), against the plain run without clipping.
    let no_clip = run("no_clip", &["--grad-clip", "0"]);
    let mut in_backward = vec!["--grad-clip", "0", "--optimizer-in-backward"];
    in_backward.extend(&streamed);
    assert_same_run(&no_clip, &run("in_backward", &in_backward), 0);

    // A checkpoint of the plain run continues layer-major, and ends as the plain run does.
    assert_same_run(
        &full,
        &resumed_at_step_2(&s, &full, "resumed", &streamed),
        2,
    );
}

/// FP8 and INT8 matmuls layer-major: the bits of the same matmuls one micro-batch at a time,
/// with the weights kept on the device and streamed (their quantized copies then made in
/// their slot as they arrive), and updated in the backward. In FP8 each micro-batch has its
/// own abs-maxes and the recompute pass makes every linear's input copy again for it.
#[test]
fn quantized_layer_major_changes_no_bit() {
    let s = setup();
    let dir = |name: &str| s.root.join(name);
    for dtype in ["e4m3", "int8"] {
        let quantized = ["--matmul-dtype", dtype, "--grad-clip", "0"];
        let run = |name: &str, extra: &[&str]| {
            let name = format!("{dtype}_{name}");
            run_with(
                &resume_args(&dir(&name), &s.model, &s.data),
                &[&quantized[..], extra].concat(),
            );
            dir(&name)
        };
        let full = run("full", &[]);
        let layer_major = ["--layer-major", "--recompute-block"];
        assert_same_run(&full, &run("layer_major", &layer_major), 0);
        let streamed = [&STREAMED[..], &["--optimizer-in-backward"]].concat();
        assert_same_run(&full, &run("streamed", &streamed), 0);
    }
}

/// Flags that change the numbers (documents kept apart, the MLP and the LM head in chunks)
/// change them the same way layer-major: each micro-batch's document spans are its own.
#[test]
fn documents_and_chunks_change_no_bit() {
    let s = setup();
    let dir = |name: &str| s.root.join(name);
    let flags = [
        "--doc-mask",
        "--doc-positions",
        "--eos-id",
        "10",
        "--recompute-ffn",
        "--ffn-chunks",
        "2",
        "--lmhead-chunks",
        "2",
    ];
    let run = |name: &str, extra: &[&str]| {
        run_with(
            &resume_args(&dir(name), &s.model, &s.data),
            &[&flags[..], extra].concat(),
        );
        dir(name)
    };
    assert_same_run(
        &run("plain", &[]),
        &run("layer_major", &["--layer-major"]),
        0,
    );
}

/// Steps of four micro-batches in passes of two, and of three and then one, with the
/// gradients streamed (each pass after the first brings each block's sum so far back in to
/// add to) and updated in the last pass's backward: bitwise four one at a time.
#[test]
fn passes_of_fewer_micro_batches_change_no_bit() {
    let s = setup();
    let dir = |name: &str| s.root.join(name);
    let run = |name: &str, extra: &[&str]| {
        let mut args = resume_args(&dir(name), &s.model, &s.data);
        set_flags(&mut args, &["--grad-accumulation"], "4");
        run_with(&args, &[&["--grad-clip", "0"], extra].concat());
        dir(name)
    };
    let full = run("full", &[]);
    let streamed = [
        "--recompute-block",
        "--offload-residual",
        "--offload-weights",
        "--offload-gradients",
        "--optimizer-in-backward",
    ];
    for per_pass in ["2", "3"] {
        let flag = format!("--layer-major={per_pass}");
        let run_dir = run(
            &format!("passes_of_{per_pass}"),
            &[&streamed[..], &[&flag]].concat(),
        );
        assert_same_run(&full, &run_dir, 0);
    }
}

/// With tied embeddings the embedding's gradient adds every micro-batch's LM-head part before
/// their lookup parts, so the runs part by rounding only: the first step's loss is the same,
/// and the others stay within 1e-3 of the plain run's.
#[test]
fn tied_embeddings_differ_by_rounding_only() {
    let s = setup();
    let tied = model_variant(&s, "tied", |c| c["tie_word_embeddings"] = true.into());
    let dir = |name: &str| s.root.join(name);
    let run = |name: &str, extra: &[&str]| {
        run_with(&resume_args(&dir(name), &tied, &s.data), extra);
        steps(&dir(name).join("log.jsonl"))
    };
    let (plain, layer_major) = (run("plain", &[]), run("layer_major", &["--layer-major"]));
    assert_eq!(plain.len(), 6);
    assert_eq!(plain[0].1.to_bits(), layer_major[0].1.to_bits());
    let mut differs = false;
    for (a, b) in plain.iter().zip(&layer_major) {
        assert_eq!(a.2, b.2, "step {} trained other data", a.0);
        assert!(
            (a.1 - b.1).abs() < 1e-3,
            "step {}: {} against {}",
            a.0,
            a.1,
            b.1
        );
        differs |= a.1 != b.1;
    }
    assert!(
        differs,
        "tied embeddings summed in the same order after all"
    );
}

/// Two CPU ranks: ZeRO-2 and -3 layer-major send each block's gradient sum to its rank once
/// a step, summed over the micro-batches first as level 0 sums them (ZeRO-3 also bringing
/// each block's weights once a pass): the losses and final weights of level 0's run, bit for
/// bit, which ZeRO-3 of one micro-batch at a time (each micro-batch's gradients sent) does
/// not give. (Their checkpoints differ in layout: ZeRO shards the optimizer state by rank.)
#[test]
fn zero_2_and_3_layer_major_are_bitwise_level_0() {
    let s = setup();
    let dir = |name: &str| s.root.join(name);
    let run = |name: &str, extra: &[&str]| {
        let mut flags = vec!["--device", "cpu", "--gpus", "2"];
        flags.extend(extra);
        run_with(&resume_args(&dir(name), &s.model, &s.data), &flags);
        let weights = std::fs::read(dir(name).join("out/model.safetensors")).unwrap();
        (steps(&dir(name).join("log.jsonl")), weights)
    };
    let level_0 = run("level_0", &[]);
    assert_eq!(level_0.0.len(), 6);
    assert_eq!(
        level_0,
        run("zero_3", &["--zero-level", "3", "--layer-major"])
    );
    assert_ne!(level_0.0, run("zero_3_plain", &["--zero-level", "3"]).0);
    let zero_2 = run("zero_2", &["--zero-level", "2", "--layer-major"]);
    assert_eq!(level_0, zero_2);
}

/// What it cannot do is refused before anything is written, naming the flag.
#[test]
fn what_it_cannot_do_is_refused() {
    let s = setup();
    let cases: [(&str, &str, &[&str], &str); 5] = [
        ("1", "--layer-major", &[], "--grad-accumulation 2"),
        (
            "2",
            "--layer-major=1",
            &[],
            "between 2 and --grad-accumulation (2)",
        ),
        (
            "2",
            "--layer-major=3",
            &[],
            "between 2 and --grad-accumulation (2)",
        ),
        (
            "2",
            "--layer-major",
            &["--matmul-dtype", "int8", "--int8-stochastic-rounding"],
            "--int8-stochastic-rounding",
        ),
        (
            "2",
            "--layer-major",
            &["--matmul-dtype", "e4m3", "--recompute-ffn"],
            "--recompute-block",
        ),
    ];
    for (i, (accumulation, flag, extra, want)) in cases.into_iter().enumerate() {
        let dir = s.root.join(format!("refused{i}"));
        let mut args = resume_args(&dir, &s.model, &s.data);
        set_flags(&mut args, &["--grad-accumulation"], accumulation);
        args.push(flag.into());
        args.extend(extra.iter().map(|a| a.to_string()));
        let out = smelt(&strs(&args));
        assert_refused(&out, &["--layer-major", want]);
        assert!(!dir.join("log.jsonl").exists(), "{extra:?} wrote a log");
    }
}

/// Llama-3-8B at 24 GiB, eight sequences of 8192 tokens a step: with the host memory for
/// every micro-batch's residual stream, `smelt plan` runs all eight in one pass; with less,
/// it halves the passes until one fits, rather than give up layer-major or the batch.
#[test]
fn plan_halves_the_passes_where_host_memory_is_short() {
    let passes = |host_gib: &str| {
        let out = smelt_ok(&[
            "plan",
            "--model",
            "llama-3-8b",
            "--batch-size",
            "1",
            "--seq-len",
            "8192",
            "--grad-accumulation",
            "8",
            "--layer-major",
            "--device-memory",
            "24",
            "--host-memory",
            host_gib,
            "--gpu",
            "h200",
            "--opt-m-dtype",
            "bf16",
            "--opt-v-dtype",
            "bf16",
            "--master-dtype",
            "bf16",
            "--json",
        ]);
        let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
        let plans = plan["plans"].as_array().unwrap().clone();
        let picked = plans.last().unwrap();
        let rows = picked["rows"].as_array().unwrap();
        let row = rows
            .iter()
            .find(|r| r["fits"] == true)
            .expect("a plan that fits");
        let flag = format!("--layer-major={}", picked["layer_major"]);
        assert!(
            row["flags"]
                .as_array()
                .unwrap()
                .contains(&flag.clone().into())
        );
        let tried: Vec<u64> = plans
            .iter()
            .map(|p| p["layer_major"].as_u64().unwrap())
            .collect();
        assert!(
            plans
                .iter()
                .all(|p| p["batch_size"] == 1 && p["grad_accumulation"] == 8)
        );
        tried
    };
    assert_eq!(passes("110"), [8]);
    assert_eq!(passes("50"), [8, 4]);
    assert_eq!(passes("45"), [8, 4, 2]);
}
