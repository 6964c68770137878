//! Watching the GPU: `smelt bench --op-times` times every op of the step, as often as the
//! model calls it, and the op times account for the step they were taken from; NVML's
//! readings (`--log-gpu-util`) are of the GPU the backend opened.

mod common;

use common::gpu::*;
use smelt::backend::telemetry::Telemetry;
use smelt::model::presets::preset;
use smelt::model::{MatmulPrecision, Recompute};
use smelt::tensor::DType;
use smelt::train::bench::{self, BenchOptions};
use smelt::train::options::{MemoryOptions, Offload};

#[test]
#[ignore = "needs a CUDA GPU"]
fn op_times_account_for_the_step() {
    let gpu = cuda();
    let config = preset("qwen2.5-0.5b").unwrap();
    let layers = config.num_layers;
    let chunks = 8;
    let options = BenchOptions {
        batch: 8,
        seq: 1024,
        accumulation: 1,
        steps: 5,
        warmup: 2,
        matmul: MatmulPrecision::Native,
        memory: MemoryOptions {
            recompute: Recompute::default(),
            offload_residual: false,
            offload_activations: false,
            lmhead_chunks: chunks,
            ffn_chunks: 1,
            offload_weights: false,
            offload_gradients: false,
            layer_major: 0,
        },
        offload: Offload::default(),
        moments: [DType::BF16; 2],
        documents: None,
        op_times: true,
        in_backward: false,
        cuda_graphs: false,
    };
    let report = bench::run(&gpu, config, &options, |_| Ok(None)).unwrap();
    // The calls of whichever of `ops` the step ran: SwiGLU runs on its own, or inside the
    // matmul next to it where the backend fuses them (the own GEMM on Hopper), and RoPE's
    // backward with or without QKV's bias gradient.
    let calls_of_any = |ops: &[&str]| {
        let timed: Vec<_> = report
            .ops
            .iter()
            .filter(|o| ops.contains(&o.op.as_str()))
            .collect();
        assert!(
            !timed.is_empty(),
            "none of {ops:?} was timed: {:?}",
            report.ops
        );
        timed.iter().map(|o| o.calls).sum::<usize>()
    };
    let calls = |op: &str| calls_of_any(&[op]);
    // Once per layer and step, and the loss once per LM-head chunk (the model's structure,
    // not a count the timer could get right by construction).
    for op in ["attention_forward", "attention_backward", "rope_forward"] {
        assert_eq!(calls(op), layers, "{op} calls per step");
    }
    for ops in [
        ["swiglu_forward", "gate_up_swiglu"],
        ["swiglu_backward", "swiglu_backward_through_down"],
        // QKV's bias gradient comes with RoPE's backward in bf16.
        ["rope_backward", "rope_backward_and_bias"],
    ] {
        assert_eq!(calls_of_any(&ops), layers, "{ops:?} calls per step");
    }
    assert_eq!(
        calls("cross_entropy"),
        chunks,
        "cross_entropy calls per step"
    );
    // The LM head's forward over one chunk of rows: [B·T / chunks, vocab] from [.., hidden].
    let head = format!("matmul {}×151936×896", 8 * 1024 / chunks);
    assert_eq!(calls(&head), chunks, "{head} calls per step");

    // The step is device-bound at this size, so the ops' device times add up to nearly the
    // median step's wall time: not more (they run one after another on one stream; 5%
    // for the spread between the timed steps), and not much less (launch gaps and the loss
    // readback are all that is left out).
    let sum: f64 = report.ops.iter().map(|o| o.seconds).sum();
    let share = sum / report.step_s;
    figure(
        "op times",
        format!(
            "{} ops, {:.2} ms of {:.2} ms per step ({:.1}%)",
            report.ops.len(),
            sum * 1e3,
            report.step_s * 1e3,
            100.0 * share
        ),
    );
    assert!(
        (0.8..=1.05).contains(&share),
        "op times sum to {:.1}% of the step",
        100.0 * share
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn telemetry_reads_the_gpu_cuda_opened() {
    let gpu = cuda();
    let telemetry = Telemetry::open(&[gpu.ordinal()]).unwrap();
    let g = telemetry.sample().remove(0);
    let total = gpu.memory_report().unwrap().total;
    figure("telemetry", format!("{g:?}"));
    assert_eq!(g.gpu, gpu.ordinal());
    // The same device: NVML's total is CUDA's, to within what the driver reserves.
    let nvml_total = g.memory_total.expect("NVML reports the memory") as f64;
    assert!(
        (nvml_total - total as f64).abs() < 0.05 * total as f64,
        "{nvml_total} vs {total}"
    );
    assert!(g.memory_used.is_some_and(|used| used > 0), "{g:?}");
    assert!(g.utilization.is_some_and(|u| u <= 100), "{g:?}");
    assert!(g.temperature_c.is_some_and(|t| t > 0 && t < 120), "{g:?}");
}
