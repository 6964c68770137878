//! On the GPU, the blocks' weights and gradients streamed from pinned host memory give
//! bitwise the losses and weights of keeping them on the device, over 5 optimizer steps of
//! two accumulated micro-batches: the blocks run the same ops on the same bytes, which the
//! copies only move. At 16 tokens a micro-batch a block's work is far shorter than the copy
//! of its weights, so a wait that is missing (a block reading its slot before its weights
//! are in, a copy overwriting a slot still in use, the optimizer reading a gradient still on
//! its way out) shows in the bits; at 4 × 1024 tokens the copies hide behind the work.

mod common;

use common::gpu::*;
use common::{batch, options, trained_tokens};
use smelt::backend::prelude::*;
use smelt::comm::Solo;
use smelt::model::{LossOptions, ModelConfig, ModelOptions, Recompute, Transformer};
use smelt::tensor::DType;

const STEPS: u64 = 5;
const MICRO_STEPS: u64 = 2;

/// Every step's per-token losses, then the final weights, at `shape` with `o`'s options.
fn train<B: Backend>(
    gpu: &B, config: &ModelConfig, shape: (usize, usize), o: impl FnOnce(&mut ModelOptions),
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut options = options(shape.0, shape.1, DType::BF16, Recompute::default(), 2);
    o(&mut options);
    let mut model = Transformer::new(gpu, config.clone(), options).unwrap();
    upload_weights(gpu, &model, &host_weights(&model, 3, 0.05));
    let optimizer = bf16_adamw(gpu, &model);
    let mut losses = vec![];
    for step in 1..=STEPS {
        for micro in 0..MICRO_STEPS {
            let seed = 100 + step * MICRO_STEPS + micro;
            let (tokens, targets) = batch(model.tokens_per_step(), config.vocab_size, seed);
            let loss = LossOptions {
                grad_scale: 1.0 / trained_tokens(&targets) as f32,
                z_loss: 1e-4,
                accumulate: micro > 0,
            };
            model
                .forward_backward(gpu, &tokens, &targets, loss)
                .unwrap();
            losses.extend(gpu.download(model.losses()).unwrap());
        }
        optimizer.step(gpu, &Solo, &model, 1e-3, step, 7).unwrap();
    }
    let weights = model
        .params
        .iter()
        .map(|p| gpu.download(p).unwrap())
        .collect();
    (losses, weights)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn streaming_weights_and_gradients_is_bitwise_identical_on_the_gpu() {
    let gpu = cuda();
    let (name, config) = small_configs().swap_remove(1);
    let config = ModelConfig {
        num_layers: 6,
        ..config
    };
    let block = Recompute {
        block: true,
        ..Recompute::default()
    };
    for shape in [(1, 16), (4, 1024)] {
        let (base_losses, base_weights) = train(&gpu, &config, shape, |_| ());
        assert!(base_losses.iter().all(|l| l.is_finite()));
        for (variant, weights, gradients, recompute) in [
            ("weights", true, false, Recompute::default()),
            ("gradients", false, true, Recompute::default()),
            ("both", true, true, Recompute::default()),
            ("both, block recomputed", true, true, block),
        ] {
            let (losses, w) = train(&gpu, &config, shape, |o| {
                o.offload_weights = weights;
                o.offload_gradients = gradients;
                o.recompute = recompute;
            });
            let test = format!(
                "streamed {variant}, {name}, 6 layers, {} × {}",
                shape.0, shape.1
            );
            assert!(
                same_bits(&losses, &base_losses),
                "{test}: the losses differ"
            );
            for (w, base) in w.iter().zip(&base_weights) {
                assert!(same_bits(w, base), "{test}: the weights differ");
            }
            figure(
                &test,
                format!("bitwise equal over {STEPS} steps of {MICRO_STEPS} micro-batches"),
            );
        }
    }
}
