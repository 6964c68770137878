//! `smelt plan` on the CPU: its memory is what `smelt train` allocates for the same flags,
//! its activation figures match the sizes written out by hand, its table is ordered and
//! picks the fastest row that fits, it falls back to smaller micro-batches, and bad input
//! gets one clear error. `smelt train --fit-memory` trains within its budget, and chooses
//! alike when the run continues; where only a smaller micro-batch fits, `smelt train` and
//! `smelt bench` each name it in their own flags.

mod train_support;

use std::collections::BTreeMap;

use serde_json::Value;
use smelt::backend::datasheet::datasheet;
use smelt::io::hf;
use smelt::model::{Int8Options, MatmulPrecision, ModelConfig, Recompute};
use smelt::plan::{Candidate, Choice, Request, candidates};
use smelt::tensor::DType;
use smelt::train::bench::bf16_adamw_options;
use smelt::train::log::Event;
use smelt::train::options::{MemoryOptions, Offload, OptimizerOptions};
use train_support::*;

/// The plan's figures for `choice`, for the tiny model at batch 2 × 16 on one GPU.
fn planned(config: &ModelConfig, micro_steps: usize, fp8: bool, choice: Choice) -> Candidate {
    planned_in(
        config,
        micro_steps,
        fp8.then(fp8_e4m3).unwrap_or_default(),
        choice,
    )
}

fn fp8_e4m3() -> MatmulPrecision {
    MatmulPrecision::new(DType::E4M3, None, Int8Options::default()).unwrap()
}

/// `planned` with the blocks' matmuls in `matmul`.
fn planned_in(
    config: &ModelConfig, micro_steps: usize, matmul: MatmulPrecision, choice: Choice,
) -> Candidate {
    planned_matmul_on(1, config, micro_steps, matmul, choice)
}

/// `planned` on `gpus` GPUs: the figures of the GPU that needs the most.
fn planned_on(
    gpus: usize, config: &ModelConfig, micro_steps: usize, fp8: bool, choice: Choice,
) -> Candidate {
    let matmul = fp8.then(fp8_e4m3).unwrap_or_default();
    planned_matmul_on(gpus, config, micro_steps, matmul, choice)
}

fn planned_matmul_on(
    gpus: usize, config: &ModelConfig, micro_steps: usize, matmul: MatmulPrecision, choice: Choice,
) -> Candidate {
    let request = Request {
        config: config.clone(),
        batch: 2,
        seq: 16,
        micro_steps,
        model_dtype: DType::BF16,
        matmul,
        optimizer: OptimizerOptions {
            opt_m_dtype: DType::F32,
            opt_v_dtype: DType::F32,
            master_dtype: Some(DType::F32),
            ..bf16_adamw_options()
        },
        gpus,
        lmhead_chunks: Some(choice.memory.lmhead_chunks),
        ffn_chunks: Some(choice.memory.ffn_chunks),
        allow_zero_2: true,
        documents: None,
        layer_major: choice.memory.layer_major,
        cuda_graphs: false,
    };
    let gpu = datasheet("H100").unwrap();
    candidates(&request, gpu)
        .unwrap()
        .into_iter()
        .find(|c| c.choice == choice)
        .expect("every choice is a candidate")
}

/// `recompute` alone: nothing offloaded, no ZeRO, one LM-head and one MLP chunk.
fn recomputing(recompute: Recompute) -> Choice {
    Choice {
        memory: MemoryOptions {
            recompute,
            offload_residual: false,
            offload_activations: false,
            lmhead_chunks: 1,
            ffn_chunks: 1,
            offload_weights: false,
            offload_gradients: false,
            layer_major: 0,
        },
        offload: Offload::default(),
        zero_level: 0,
    }
}

/// The memory events of a training run's log: device categories, then host ones.
fn logged(log: &std::path::Path) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let (mut device, mut host) = (BTreeMap::new(), BTreeMap::new());
    for e in events(log) {
        if let Event::Memory { category, bytes } = e {
            match category.strip_prefix("host ") {
                Some(name) => host.insert(name.to_string(), bytes),
                None => device.insert(category, bytes),
            };
        }
    }
    device.remove("total");
    host.remove("total");
    (device, host)
}

fn by_name(categories: &[(&'static str, u64)]) -> BTreeMap<String, u64> {
    categories
        .iter()
        .map(|(n, b)| (n.to_string(), *b))
        .collect()
}

/// One step of the tiny model on the CPU at batch 2 × 16, logged to `log`; its stdout.
fn train(setup: &Setup, log: &std::path::Path, flags: &[&str]) -> String {
    train_steps(setup, log, "1", flags)
}

/// `steps` steps of `train`'s run.
fn train_steps(setup: &Setup, log: &std::path::Path, steps: &str, flags: &[&str]) -> String {
    smelt_ok(&train_args(setup, log, steps, flags))
}

/// The command line of `train_steps`.
fn train_args<'a>(
    setup: &'a Setup, log: &'a std::path::Path, steps: &'a str, flags: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "train",
        "--device",
        "cpu",
        "--model",
        s(&setup.model),
        "--from-scratch",
        "--train-file",
        s(&setup.data),
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--steps",
        steps,
        "--eval-every-n-steps",
        "0",
        "--log-file",
        s(log),
    ];
    args.extend(flags);
    args
}

#[test]
fn the_plan_counts_what_training_allocates() {
    let setup = setup();
    let config = hf::read_config(&setup.model).unwrap();
    let none = Recompute::default();
    let cases: [(&[&str], usize, bool, Choice); 6] = [
        (
            &[
                "--recompute-ffn",
                "--offload-activations",
                "--offload-opt-m",
                "--lmhead-chunks",
                "2",
                "--grad-accumulation",
                "2",
            ],
            2,
            false,
            Choice {
                memory: MemoryOptions {
                    recompute: Recompute { ffn: true, ..none },
                    offload_residual: false,
                    offload_activations: true,
                    lmhead_chunks: 2,
                    ffn_chunks: 1,
                    offload_weights: false,
                    offload_gradients: false,
                    layer_major: 0,
                },
                offload: Offload {
                    opt_m: true,
                    ..Offload::default()
                },
                zero_level: 0,
            },
        ),
        (
            &[
                "--recompute-block",
                "--offload-residual",
                "--offload-master",
                "--offload-opt-v",
            ],
            1,
            false,
            Choice {
                memory: MemoryOptions {
                    recompute: Recompute {
                        block: true,
                        ..none
                    },
                    offload_residual: true,
                    offload_activations: false,
                    lmhead_chunks: 1,
                    ffn_chunks: 1,
                    offload_weights: false,
                    offload_gradients: false,
                    layer_major: 0,
                },
                offload: Offload {
                    master: true,
                    opt_v: true,
                    ..Offload::default()
                },
                zero_level: 0,
            },
        ),
        (
            &[
                "--recompute-block",
                "--offload-weights",
                "--offload-gradients",
                "--offload-opt-m",
                "--grad-accumulation",
                "2",
            ],
            2,
            false,
            {
                let mut choice = recomputing(Recompute {
                    block: true,
                    ..none
                });
                choice.memory.offload_weights = true;
                choice.memory.offload_gradients = true;
                choice.offload.opt_m = true;
                choice
            },
        ),
        (&["--recompute-ffn", "--ffn-chunks", "2"], 1, false, {
            let mut choice = recomputing(Recompute { ffn: true, ..none });
            choice.memory.ffn_chunks = 2;
            choice
        }),
        (
            &["--matmul-dtype", "e4m3", "--recompute-norm"],
            1,
            true,
            recomputing(Recompute { norm: true, ..none }),
        ),
        // FP8's copies in the streamed weights' slots, each micro-batch's abs-maxes.
        (
            &[
                "--matmul-dtype",
                "e4m3",
                "--recompute-block",
                "--offload-weights",
                "--offload-gradients",
                "--grad-accumulation",
                "2",
                "--layer-major",
            ],
            2,
            true,
            {
                let mut choice = recomputing(Recompute {
                    block: true,
                    ..none
                });
                choice.memory.offload_weights = true;
                choice.memory.offload_gradients = true;
                choice.memory.layer_major = 2;
                choice
            },
        ),
    ];
    let int8 = |weight_grad| {
        MatmulPrecision::Int8(Int8Options {
            weight_grad,
            stochastic: false,
        })
    };
    let cases = cases
        .into_iter()
        .map(|(flags, micro_steps, fp8, choice)| {
            let matmul = fp8.then(fp8_e4m3).unwrap_or_default();
            (flags, micro_steps, matmul, choice)
        })
        .chain([
            (
                &["--matmul-dtype", "int8", "--recompute-ffn"][..],
                1,
                int8(false),
                recomputing(Recompute { ffn: true, ..none }),
            ),
            (
                &["--matmul-dtype", "int8", "--int8-weight-grad"][..],
                1,
                int8(true),
                recomputing(none),
            ),
        ]);
    for (i, (flags, micro_steps, matmul, choice)) in cases.enumerate() {
        let log = setup.root.join(format!("log{i}.jsonl"));
        train(&setup, &log, flags);
        let plan = planned_in(&config, micro_steps, matmul, choice);
        let (device, host) = logged(&log);
        assert_eq!(
            by_name(&plan.device),
            device,
            "device memory with {flags:?}"
        );
        assert_eq!(by_name(&plan.host), host, "host memory with {flags:?}");
    }
}

#[test]
fn recompute_saves_the_activations_written_out_by_hand() {
    let setup = setup();
    let config = hf::read_config(&setup.model).unwrap();
    let activations = |recompute| {
        let choice = recomputing(recompute);
        let plan = planned(&config, 1, false, choice);
        by_name(&plan.device)["activations"]
    };
    // The tiny model: 2 layers, hidden 32, 4 heads of 8 (2 kv heads), intermediate 64;
    // 2 × 16 tokens, bf16 activations and f32 statistics.
    let (layers, n, c, q, w, f) = (2u64, 32u64, 32u64, 32u64, 64u64, 64u64);
    let lse = 2 * 4 * 16 * 4;
    // What one layer's copy of each recomputable activation takes.
    let ln = n * c * 2;
    let qkv = n * w * 2;
    let att = n * q * 2 + lse;
    let mid = n * c * 2;
    let gate_up = n * 2 * f * 2;
    let swiglu = n * f * 2;
    let none = activations(Recompute::default());
    let saved = |r: Recompute| none - activations(r);
    let shared = layers - 1; // recomputed activations keep one buffer for all layers
    let r = Recompute::default();
    assert_eq!(saved(Recompute { swiglu: true, ..r }), shared * swiglu);
    assert_eq!(saved(Recompute { norm: true, ..r }), shared * 2 * ln);
    assert_eq!(saved(Recompute { qkv: true, ..r }), shared * qkv);
    assert_eq!(saved(Recompute { att: true, ..r }), shared * att);
    assert_eq!(
        saved(Recompute { ffn: true, ..r }),
        shared * (gate_up + swiglu)
    );
    assert_eq!(
        saved(Recompute { block: true, ..r }),
        shared * (2 * ln + qkv + att + mid + gate_up + swiglu)
    );

    // Offloaded, the residual stream keeps two slots and the output on the device, and
    // every block's input in host memory: of a 5-layer model's 6 tensors, 3 stay. The other
    // activations kept per layer (with their norms' f32 statistics) do the same: 2 of 5.
    let deep = ModelConfig {
        num_layers: 5,
        ..config.clone()
    };
    let offloaded = |recompute, offload_residual, offload_activations| {
        let mut choice = recomputing(recompute);
        choice.memory.offload_residual = offload_residual;
        choice.memory.offload_activations = offload_activations;
        let plan = planned(&deep, 1, false, choice);
        let host = by_name(&plan.host).get("activations").copied();
        (by_name(&plan.device)["activations"], host)
    };
    let rstd = n * 4;
    let block_kept = 2 * ln + 2 * rstd + qkv + att + mid + gate_up + swiglu;
    let ffn_kept = 2 * ln + 2 * rstd + qkv + att + mid;
    let ffn = Recompute { ffn: true, ..r };
    for (recompute, kept) in [(r, block_kept), (ffn, ffn_kept)] {
        let (on_device, none_in_host) = offloaded(recompute, false, false);
        assert_eq!(none_in_host, None);
        for (residual, others, per_block) in [
            (true, false, mid),
            (false, true, kept),
            (true, true, mid + kept),
        ] {
            let (slots, in_host) = offloaded(recompute, residual, others);
            let what = format!("{recompute:?}, residual {residual}, others {others}");
            assert_eq!(on_device - slots, 3 * per_block, "{what}");
            assert_eq!(in_host, Some(5 * per_block), "{what}");
        }
    }
}

/// FP8's weight gradients read the FP8 copies of their inputs that the forward made, so
/// SwiGLU's output is kept once for all layers unless a projection the backward reruns reads
/// it, and the norms' outputs always (FP8 never stores them: their projections normalize as
/// they quantize); and an input copy is kept once when its projection reruns.
#[test]
fn fp8_keeps_its_matmul_inputs_once_written_out_by_hand() {
    let setup = setup();
    let config = hf::read_config(&setup.model).unwrap();
    let memory = |fp8, recompute, category| {
        let choice = recomputing(recompute);
        by_name(&planned(&config, 1, fp8, choice).device)[category]
    };
    // The tiny model of the test above: 2 layers, so one copy fewer when shared.
    let (n, c, q, f) = (32u64, 32u64, 32u64, 64u64);
    let (ln, swiglu) = (n * c * 2, n * f * 2);
    let r = Recompute::default();
    let (qkv, ffn, norm) = (
        Recompute { qkv: true, ..r },
        Recompute { ffn: true, ..r },
        Recompute { norm: true, ..r },
    );
    let fp8_saves = |recompute| {
        memory(false, recompute, "activations") - memory(true, recompute, "activations")
    };
    assert_eq!(fp8_saves(r), 2 * ln + swiglu);
    // Rerun, QKV and gate/up normalize the norms' inputs again; bf16 recomputes its SwiGLU
    // outputs under `ffn`, and its norms' under `norm`, into buffers shared as FP8's.
    assert_eq!(fp8_saves(qkv), 2 * ln + swiglu);
    assert_eq!(fp8_saves(ffn), 2 * ln);
    assert_eq!(fp8_saves(norm), swiglu);
    // An input copy: [in, tokens] in e4m3 and its f32 descale.
    let copy = |width| n * width + 4;
    let copies_saved = |recompute| memory(true, r, "fp8") - memory(true, recompute, "fp8");
    assert_eq!(copies_saved(qkv), copy(c));
    assert_eq!(copies_saved(ffn), copy(c));
    let block = Recompute { block: true, ..r };
    assert_eq!(copies_saved(block), copy(c) + copy(q) + copy(c));
}

/// ZeRO-2 on two GPUs: of a 6-block model, each GPU keeps the gradients of the 3 blocks it
/// updates and two slots for the other 3, so one block's fewer (the tiny model's blocks
/// alternate between the GPUs, before the embedding and head, which weigh less); ZeRO-1
/// keeps them all.
#[test]
fn zero_2_and_3_plan_the_blocks_kept_and_two_slots() {
    let setup = setup();
    let config = ModelConfig {
        num_layers: 6,
        ..hf::read_config(&setup.model).unwrap()
    };
    let planned = |zero_level, category: &str| {
        let choice = Choice {
            zero_level,
            ..recomputing(Recompute::default())
        };
        by_name(&planned_on(2, &config, 1, false, choice).device)[category]
    };
    // ln1, qkv (q and two kv heads of 8 by 32), o, ln2, gate/up and down, in bf16.
    let (c, f, kv) = (32, 64, 2 * 16);
    let block = 2 * (c + (c + kv) * c + c * c + c + 2 * f * c + c * f) as u64;
    // Each rank keeps 3 of the 6 blocks' gradients (level 2) and weights (level 3), and two
    // slots for the others'.
    assert_eq!(planned(1, "gradients"), planned(0, "gradients"));
    assert_eq!(planned(0, "gradients") - planned(2, "gradients"), block);
    assert_eq!(planned(3, "gradients"), planned(2, "gradients"));
    assert_eq!(planned(2, "weights"), planned(0, "weights"));
    assert_eq!(planned(0, "weights") - planned(3, "weights"), block);
}

fn plan_json(extra: &[&str]) -> Value {
    let mut args = vec!["plan", "--device", "cpu", "--host-memory", "64", "--json"];
    args.extend(extra);
    let stdout = smelt_ok(&args);
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn device_bytes(row: &Value) -> u64 {
    row["device"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum()
}

#[test]
fn rows_run_fastest_first_each_smaller_and_the_pick_is_the_first_that_fits() {
    let budget: f64 = 24.0;
    let v = plan_json(&[
        "--model",
        "qwen2.5-0.5b",
        "--batch-size",
        "32",
        "--device-memory",
        &budget.to_string(),
    ]);
    let plan = &v["plans"][0];
    let rows = plan["rows"].as_array().unwrap();
    assert!(rows.len() > 3, "{plan}");
    for pair in rows.windows(2) {
        assert!(
            pair[0]["step_ms"].as_f64() <= pair[1]["step_ms"].as_f64(),
            "{pair:?}"
        );
        assert!(device_bytes(&pair[0]) > device_bytes(&pair[1]), "{pair:?}");
    }
    let pick = plan["pick"].as_u64().expect("a row fits in 24 GiB") as usize;
    let budget_bytes = v["device_budget_bytes"].as_u64().unwrap();
    assert!(
        budget_bytes < (budget * (1u64 << 30) as f64) as u64,
        "the reserve comes off"
    );
    for (i, row) in rows.iter().enumerate() {
        let fits = device_bytes(row) <= budget_bytes;
        assert_eq!(row["fits"], fits, "{row}");
        if i < pick {
            assert!(!fits, "row {i} fits but comes before the pick {pick}");
        }
    }
    assert_eq!(rows[pick]["fits"], true);
    // The fastest row of all recomputes nothing and offloads nothing.
    assert_eq!(rows[0]["flags"], serde_json::json!(["--lmhead-chunks 1"]));

    // With room for everything, that row is the pick.
    let roomy = plan_json(&[
        "--model",
        "qwen2.5-0.5b",
        "--batch-size",
        "32",
        "--device-memory",
        "1000",
    ]);
    assert_eq!(roomy["plans"][0]["pick"], 0);
}

#[test]
fn when_nothing_fits_smaller_micro_batches_keep_the_sequences_per_step() {
    let v = plan_json(&[
        "--model",
        "qwen2.5-1.5b",
        "--batch-size",
        "16",
        "--seq-len",
        "4096",
        "--device-memory",
        "4",
    ]);
    let plans = v["plans"].as_array().unwrap();
    let picks: Vec<_> = plans
        .iter()
        .map(|p| (&p["batch_size"], &p["pick"]))
        .collect();
    assert!(
        plans.len() > 1,
        "batch 16 × 4096 should not fit in 4 GiB: {picks:?}"
    );
    for p in &plans[..plans.len() - 1] {
        assert!(p["pick"].is_null(), "{picks:?}");
    }
    let last = plans.last().unwrap();
    assert!(last["pick"].is_u64(), "{picks:?}");
    let (batch, accumulation) = (
        last["batch_size"].as_u64().unwrap(),
        last["grad_accumulation"].as_u64().unwrap(),
    );
    assert!(batch < 16);
    assert_eq!(batch * accumulation, 16);
}

#[test]
fn bad_input_gets_one_clear_error() {
    let model = ["--model", "qwen2.5-0.5b"];
    let cases: [(&[&str], &str); 4] = [
        (&[], "--device-memory"),
        (&["--device-memory", "0"], "--device-memory 0"),
        (
            &["--device-memory", "80", "--gpu", "abacus"],
            "--gpu abacus",
        ),
        (
            &["--device-memory", "2", "--seq-len", "65536"],
            "nothing fits in 0.5 GiB",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["plan", "--device", "cpu"];
        args.extend(model);
        args.extend(extra);
        let err = smelt_err(&args);
        assert!(err.contains(expected), "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{extra:?}: {err}");
    }
}

/// A `--fit-memory` figure a KiB short of what keeping every activation of the tiny model
/// needs, so that something must give; with the bytes it needs, and the bytes it allows.
fn tight_budget(setup: &Setup) -> (String, u64, u64) {
    let config = hf::read_config(&setup.model).unwrap();
    let keep_all = recomputing(Recompute::default());
    let needed: u64 = planned(&config, 1, false, keep_all)
        .device
        .iter()
        .map(|c| c.1)
        .sum();
    let gib = format!("{:.12}", (needed - 1024) as f64 / (1u64 << 30) as f64);
    let budget = (gib.parse::<f64>().unwrap() * (1u64 << 30) as f64) as u64;
    (gib, needed, budget)
}

#[test]
fn fit_memory_trains_with_the_plans_pick_within_the_budget() {
    let setup = setup();
    let (gib, needed, budget) = tight_budget(&setup);
    let log = setup.root.join("log.jsonl");
    let stdout = train(&setup, &log, &["--fit-memory", &gib]);
    let (device, _) = logged(&log);
    let total: u64 = device.values().sum();
    assert!(
        total <= budget,
        "{total} bytes allocated in a budget of {budget}"
    );
    assert!(total < needed, "{total}");
    let chosen = stdout
        .lines()
        .find_map(|l| l.strip_prefix("--fit-memory: "))
        .unwrap_or_else(|| panic!("no --fit-memory line in:\n{stdout}"));
    let logged_option = |name: &str| {
        events(&log).into_iter().find_map(|e| match e {
            Event::Option { name: n, value } if n == name => Some(value),
            _ => None,
        })
    };
    let chunks = logged_option("lmhead_chunks").unwrap();
    assert!(
        chosen.contains(&format!("--lmhead-chunks {chunks}")),
        "{chosen}"
    );

    // Flags it would choose are refused beside it, and the CPU needs a figure.
    let err = smelt_err(&[
        "train",
        "--device",
        "cpu",
        "--fit-memory",
        "1",
        "--recompute-block",
    ]);
    assert!(err.contains("--fit-memory chooses"), "{err}");
    let err = smelt_err(&["train", "--device", "cpu", "--fit-memory"]);
    assert!(err.contains("on the CPU give the memory"), "{err}");
}

/// On several GPUs `--fit-memory` picks ZeRO-2 where it saves memory at no cost (6 blocks
/// here), but never beside `--grad-sum-after-backward`, which would then refuse the run.
#[test]
fn fit_memory_leaves_zero_2_out_when_the_sums_come_after_the_backward() {
    let setup = setup();
    let deep = model_variant(&setup, "deep-model", |c| c["num_hidden_layers"] = 6.into());
    let log = setup.root.join("log.jsonl");
    let chosen = |extra: &[&str]| {
        let flags = [&["--gpus", "2", "--fit-memory", "64"], extra].concat();
        let mut args = train_args(&setup, &log, "1", &flags);
        let model = args.iter().position(|a| *a == "--model").unwrap() + 1;
        args[model] = s(&deep);
        let stdout = smelt_ok(&args);
        (stdout.lines())
            .find_map(|l| l.strip_prefix("--fit-memory: ").map(str::to_string))
            .unwrap_or_else(|| panic!("no --fit-memory line in:\n{stdout}"))
    };
    let free = chosen(&[]);
    assert!(free.contains("--zero-level 2"), "{free}");
    let after = chosen(&["--grad-sum-after-backward"]);
    assert!(!after.contains("--zero-level 2"), "{after}");
}

/// The least device memory any choice needs for the tiny model at `batch` × 16, with
/// `optimizer`.
fn least_device_bytes(
    config: &ModelConfig, optimizer: OptimizerOptions, batch: usize, micro_steps: usize,
) -> u64 {
    let request = Request {
        config: config.clone(),
        batch,
        seq: 16,
        micro_steps,
        model_dtype: DType::BF16,
        matmul: MatmulPrecision::Native,
        optimizer,
        gpus: 1,
        lmhead_chunks: None,
        ffn_chunks: None,
        allow_zero_2: true,
        documents: None,
        layer_major: 0,
        cuda_graphs: false,
    };
    (candidates(&request, datasheet("H100").unwrap())
        .unwrap()
        .iter())
    .map(Candidate::device_bytes)
    .min()
    .unwrap()
}

/// Where nothing fits at `--batch-size 2` but something does at 1, `--fit-memory` names
/// the smaller micro-batch in the flags of the command: with `--grad-accumulation` for
/// `smelt train`, alone for `smelt bench`, which has no such flag.
#[test]
fn fit_memory_names_the_micro_batch_that_would_fit_in_each_commands_flags() {
    let setup = setup();
    let config = hf::read_config(&setup.model).unwrap();
    let trained = OptimizerOptions {
        opt_m_dtype: DType::F32,
        opt_v_dtype: DType::F32,
        master_dtype: Some(DType::F32),
        ..bf16_adamw_options()
    };
    let least = |optimizer: &OptimizerOptions, batch, micro_steps| {
        least_device_bytes(&config, optimizer.clone(), batch, micro_steps)
    };
    let budget = least(&trained, 2, 1).min(least(&bf16_adamw_options(), 2, 1)) - 1024;
    assert!(budget > least(&trained, 1, 2).max(least(&bf16_adamw_options(), 1, 2)));
    let gib = format!("{:.12}", budget as f64 / (1u64 << 30) as f64);

    let log = setup.root.join("log.jsonl");
    let err = smelt_err(&train_args(&setup, &log, "1", &["--fit-memory", &gib]));
    assert!(
        err.contains("nothing fits at --batch-size 2")
            && err.contains("; --batch-size 1 --grad-accumulation 2 would"),
        "{err}"
    );
    let err = smelt_err(&[
        "bench",
        "--device",
        "cpu",
        "--model",
        s(&setup.model),
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--fit-memory",
        &gib,
    ]);
    assert!(err.contains("; --batch-size 1 would"), "{err}");
    assert!(!err.contains("--grad-accumulation"), "{err}");
}

/// `--fit-memory` chooses from the flags and the budget alone, so a run continued with the
/// same budget makes the same choice and goes on as if it had not stopped.
#[test]
fn fit_memory_continues_bit_for_bit() {
    let setup = setup();
    let (gib, _, _) = tight_budget(&setup);
    let run = |name: &str, extra: &[&str]| {
        let dir = setup.root.join(name);
        let log = dir.join("log.jsonl");
        let ckpt = dir.join("ckpt");
        if extra.contains(&"--continue") {
            copy_checkpoint(&setup.root.join("full/ckpt"), 2, &ckpt);
        }
        let mut flags = vec!["--ckpt-interval", "2", "--fit-memory", &gib];
        flags.extend(["--checkpoint-dir", s(&ckpt)]);
        flags.extend(extra);
        let stdout = train_steps(&setup, &log, "4", &flags);
        let chosen = (stdout.lines())
            .find(|l| l.starts_with("--fit-memory: "))
            .unwrap_or_else(|| panic!("no --fit-memory line in:\n{stdout}"))
            .to_string();
        (chosen, steps(&log))
    };
    let (chosen, full) = run("full", &[]);
    let (chosen_again, continued) = run("continued", &["--continue"]);
    assert_eq!(chosen_again, chosen);
    assert_eq!(full.len(), 4);
    let bits = |v: &[(u64, f64, String)]| -> Vec<(u64, u64)> {
        v.iter()
            .filter(|x| x.0 > 2)
            .map(|x| (x.0, x.1.to_bits()))
            .collect()
    };
    assert_eq!(bits(&continued), bits(&full));
    assert_eq!(continued.len(), 2);
}

/// Streamed, a block set (weights, or gradients) keeps what is outside the blocks and two
/// block slots on the device, and every block in host memory: of the tiny model's 2 blocks,
/// nothing is saved on the device, and of a 5-layer one's, 3 blocks.
#[test]
fn streaming_keeps_two_blocks_of_weights_and_gradients_on_the_device() {
    let setup = setup();
    let config = hf::read_config(&setup.model).unwrap();
    let deep = ModelConfig {
        num_layers: 5,
        ..config
    };
    let block = deep.block_parameters() as u64 * 2; // bf16
    let streamed = |weights, gradients| {
        let mut choice = recomputing(Recompute::default());
        choice.memory.offload_weights = weights;
        choice.memory.offload_gradients = gradients;
        let plan = planned(&deep, 1, false, choice);
        (by_name(&plan.device), by_name(&plan.host))
    };
    let (device, host) = streamed(false, false);
    for (weights, gradients) in [(true, false), (false, true), (true, true)] {
        let (d, h) = streamed(weights, gradients);
        for (category, streams) in [("weights", weights), ("gradients", gradients)] {
            let (on_device, in_host) = (d[category], h.get(category).copied());
            match streams {
                true => {
                    assert_eq!(device[category] - on_device, 3 * block, "{category}");
                    assert_eq!(in_host, Some(5 * block), "{category}");
                }
                false => {
                    assert_eq!(on_device, device[category], "{category}");
                    assert_eq!(in_host, host.get(category).copied(), "{category}");
                }
            }
        }
    }
}

/// The update's traffic with streamed weights and gradients, against what an H200 measured
/// (`scripts/gpu/streaming.sh`: Llama-3-8B, batch 1 × 8192, bf16 moments offloaded, no master
/// copy): an optimizer phase of 765 ms with the moments offloaded, and 1,518 ms with the
/// blocks' weights and gradients streamed too. The estimate charges the bytes at 45 GB/s
/// each way; the kernel's reads of host memory ran a little slower.
#[test]
fn the_estimated_update_over_the_bus_is_near_what_an_h200_measured() {
    let config = smelt::model::presets::preset("llama-3-8b").unwrap();
    let request = Request {
        config,
        batch: 1,
        seq: 8192,
        micro_steps: 1,
        model_dtype: DType::BF16,
        matmul: MatmulPrecision::Native,
        optimizer: bf16_adamw_options(),
        gpus: 1,
        lmhead_chunks: Some(8),
        ffn_chunks: Some(1),
        allow_zero_2: true,
        documents: None,
        layer_major: 0,
        cuda_graphs: false,
    };
    let all = candidates(&request, datasheet("H200").unwrap()).unwrap();
    let bus = |streamed: bool| {
        let mut choice = recomputing(Recompute {
            block: true,
            ..Recompute::default()
        });
        choice.memory.lmhead_chunks = 8;
        choice.memory.offload_weights = streamed;
        choice.memory.offload_gradients = streamed;
        choice.offload.opt_m = true;
        choice.offload.opt_v = true;
        let c = all.iter().find(|c| c.choice == choice).unwrap();
        c.cost.bus * 1e3
    };
    for (streamed, measured) in [(false, 765.0), (true, 1518.0)] {
        let estimate = bus(streamed);
        assert!(
            (estimate / measured - 1.0).abs() < 0.15,
            "streamed {streamed}: {estimate} ms estimated, {measured} measured"
        );
    }
}

/// A run that replays its passes as CUDA graphs is planned without the offloads a
/// recording cannot replay: the activations', the weights' and the gradients'.
#[test]
fn cuda_graphs_are_planned_without_the_offloads_they_refuse() {
    let offloads = |extra: &[&str]| -> Vec<String> {
        let args = [
            &[
                "--model",
                "qwen2.5-1.5b",
                "--batch-size",
                "8",
                "--device-memory",
                "16",
            ][..],
            extra,
        ]
        .concat();
        let v = plan_json(&args);
        let rows = v["plans"][0]["rows"].as_array().unwrap().clone();
        let flags = rows
            .iter()
            .flat_map(|r| r["flags"].as_array().unwrap().clone());
        let names = flags.map(|f| f.as_str().unwrap().to_string());
        let refused = ["residual", "activations", "weights", "gradients"];
        let mut seen: Vec<String> = names
            .filter(|f| refused.iter().any(|r| *f == format!("--offload-{r}")))
            .collect();
        seen.sort();
        seen.dedup();
        seen
    };
    assert_eq!(
        offloads(&[]),
        [
            "--offload-activations",
            "--offload-gradients",
            "--offload-residual",
            "--offload-weights"
        ]
    );
    assert!(offloads(&["--use-cuda-graphs"]).is_empty());
}
