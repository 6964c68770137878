//! On the GPU, training passes replayed from CUDA graphs (`ModelOptions::record_passes`,
//! `--use-cuda-graphs`) give bitwise the losses and final weights of the same passes
//! launched op by op, over 4 optimizer steps of two accumulated micro-batches with an eval
//! pass after each update: in bf16, FP8 and INT8 (whose first forward after an update
//! remakes the weights' quantized copies and whose others reuse them, so each is its own
//! recording), with documents kept apart, and with each step's loss scale different (its
//! trained targets differ), which the replayed backward must read from the device.

mod common;

use common::gpu::*;
use common::{options, packed_batch, trained_tokens};
use smelt::backend::cpu::IGNORE_INDEX;
use smelt::backend::prelude::*;
use smelt::comm::Solo;
use smelt::model::{
    Documents, Int8Options, LossOptions, MatmulPrecision, ModelConfig, ModelOptions, Recompute,
    Transformer,
};
use smelt::tensor::DType;
use smelt::train::bench;
use smelt::train::optimizer::AdamWState;

const STEPS: u64 = 4;
const MICRO_STEPS: u64 = 2;

/// What a run leaves: every step's per-token training losses and eval losses, in order, the
/// final weights, and how many of its passes were replayed from recordings.
struct Run {
    losses: Vec<f32>,
    weights: Vec<Vec<f32>>,
    recorded: usize,
}

fn train<B: Backend>(gpu: &B, config: &ModelConfig, options: ModelOptions) -> Run {
    let mut model = Transformer::new(gpu, config.clone(), options).unwrap();
    upload_weights(gpu, &model, &host_weights(&model, 3, 0.05));
    let optimizer = AdamWState::new(gpu, &Solo, &model, bench::bf16_adamw_options()).unwrap();
    let n = model.tokens_per_step();
    let seq = model.options.seq;
    let mut losses = vec![];
    for step in 1..=STEPS {
        let batches: Vec<(Vec<i32>, Vec<i32>)> = (0..MICRO_STEPS)
            .map(|micro| {
                let seed = 100 + step * MICRO_STEPS + micro;
                let (tokens, mut targets) = packed_batch(n, seq, 8, config.vocab_size, seed);
                // A different count of trained targets each step: another loss scale.
                targets[..step as usize].fill(IGNORE_INDEX);
                (tokens, targets)
            })
            .collect();
        let trained: usize = batches.iter().map(|(_, t)| trained_tokens(t)).sum();
        for (micro, (tokens, targets)) in (0..).zip(&batches) {
            let loss = LossOptions {
                grad_scale: 1.0 / trained as f32,
                z_loss: 1e-4,
                accumulate: micro > 0,
            };
            model.forward_hidden(gpu, tokens).unwrap();
            model.backward(gpu, targets, loss, &mut |_| Ok(())).unwrap();
            losses.extend(gpu.download(model.losses()).unwrap());
        }
        optimizer.step(gpu, &Solo, &model, 1e-3, step, 7).unwrap();
        let (tokens, targets) = &batches[0];
        model.forward_loss(gpu, tokens, targets, 1e-4).unwrap();
        losses.extend(gpu.download(model.losses()).unwrap());
    }
    Run {
        losses,
        weights: (model.params.iter())
            .map(|p| gpu.download(p).unwrap())
            .collect(),
        recorded: model.recorded_passes(),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replayed_passes_are_bitwise_the_passes_run_op_by_op() {
    let gpu = cuda();
    let int8 = MatmulPrecision::Int8(Int8Options {
        weight_grad: true,
        stochastic: false,
    });
    let fp8 = MatmulPrecision::Fp8 {
        forward: DType::E4M3,
        gradient: DType::E5M2,
    };
    let ffn = Recompute {
        ffn: true,
        ..Recompute::default()
    };
    let documents = Documents {
        eos: common::EOS,
        mask: true,
        positions: true,
    };
    for (name, config) in small_configs() {
        let runs = [
            ("bf16", MatmulPrecision::Native, Recompute::default()),
            ("bf16, FFN recomputed", MatmulPrecision::Native, ffn),
            ("fp8", fp8, Recompute::default()),
            ("int8", int8, Recompute::default()),
        ];
        for (run, matmul, recompute) in runs {
            let test = format!("{name} {run}");
            let shape = |record_passes| ModelOptions {
                matmul,
                documents: Some(documents),
                record_passes,
                ..options(2, 64, DType::BF16, recompute, 2)
            };
            let op_by_op = train(&gpu, &config, shape(false));
            let replayed = train(&gpu, &config, shape(true));
            assert_eq!(op_by_op.recorded, 0, "{test}: nothing is recorded unasked");
            // The bf16 forward and the two backwards; with quantized copies, the forward
            // remaking them and the forward reusing them.
            let expected = if matmul == MatmulPrecision::Native {
                3
            } else {
                4
            };
            assert_eq!(replayed.recorded, expected, "{test}: passes replayed");
            assert!(
                replayed.losses == op_by_op.losses,
                "{test}: the replayed passes' losses differ"
            );
            assert!(
                replayed.weights == op_by_op.weights,
                "{test}: the replayed passes' weights differ"
            );
            figure(
                "cuda graphs",
                format!("{test}: bitwise equal over {STEPS} steps, {expected} passes replayed"),
            );
        }
    }
}
