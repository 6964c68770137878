//! On the GPU, the blocks' weights and gradients streamed from pinned host memory give
//! bitwise the losses and weights of keeping them on the device, over 5 optimizer steps of
//! two accumulated micro-batches: the blocks run the same ops on the same bytes, which the
//! copies only move. So does updating each block in the last backward
//! (`--optimizer-in-backward`), its offloaded moments streaming through device slots beside
//! the weights going out and the gradients' sums coming in. At 16 tokens a micro-batch a
//! block's work is far shorter than the copy of its weights, so a wait that is missing (a
//! block reading its slot before its weights are in, a copy overwriting a slot still in
//! use or on its way out, the optimizer reading a gradient still on its way out) shows in
//! the bits; at 4 × 1024 tokens the copies hide behind the work. The same holds run
//! layer-major (`--layer-major`), each micro-batch's residual stream in host memory, and in
//! FP8 and INT8 matmuls, whose copies of streamed weights are made in their slots.

mod common;

use common::gpu::*;
use common::{batch, options, trained_tokens};
use smelt::backend::prelude::*;
use smelt::comm::Solo;
use smelt::model::{
    BlockEvent, Int8Options, LossOptions, MatmulPrecision, ModelConfig, ModelOptions, Recompute,
    Transformer,
};
use smelt::tensor::DType;
use smelt::train::bench;
use smelt::train::optimizer::AdamWState;
use smelt::train::options::{Offload, OptimizerOptions};

const STEPS: u64 = 5;
const MICRO_STEPS: u64 = 2;

/// Every step's per-token losses, then the final weights, at `shape` with `o`'s options and
/// the optimizer `adamw`.
fn train<B: Backend>(
    gpu: &B, config: &ModelConfig, shape: (usize, usize), o: impl FnOnce(&mut ModelOptions),
    adamw: OptimizerOptions,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut options = options(shape.0, shape.1, DType::BF16, Recompute::default(), 2);
    o(&mut options);
    let mut model = Transformer::new(gpu, config.clone(), options).unwrap();
    upload_weights(gpu, &model, &host_weights(&model, 3, 0.05));
    let optimizer = AdamWState::new(gpu, &Solo, &model, adamw).unwrap();
    let (lr, seed) = (1e-3, 7);
    let mut losses = vec![];
    for step in 1..=STEPS {
        let batches: Vec<(Vec<i32>, Vec<i32>)> = (0..MICRO_STEPS)
            .map(|micro| {
                let seed = 100 + step * MICRO_STEPS + micro;
                batch(model.tokens_per_step(), config.vocab_size, seed)
            })
            .collect();
        let trained: usize = batches.iter().map(|(_, t)| trained_tokens(t)).sum();
        let loss = LossOptions {
            grad_scale: 1.0 / trained as f32,
            z_loss: 1e-4,
            accumulate: false,
        };
        let in_backward = optimizer.options.in_backward;
        let mut update = |event: BlockEvent<B>| match event {
            BlockEvent::Update {
                layer,
                weights,
                grads,
            } => optimizer.update_block(gpu, layer, weights, grads, lr, step, seed),
            _ => Ok(()),
        };
        if model.options.micro_batches > 1 {
            let tokens: Vec<&[i32]> = batches.iter().map(|(t, _)| &t[..]).collect();
            let targets: Vec<&[i32]> = batches.iter().map(|(_, t)| &t[..]).collect();
            (model.forward_layer_major(gpu, &tokens, &targets, loss, &mut |_| Ok(()))).unwrap();
            if in_backward {
                optimizer.begin_block_updates(gpu).unwrap();
            }
            (model.backward_layer_major(gpu, false, &mut update, in_backward)).unwrap();
            for micro in 0..MICRO_STEPS as usize {
                losses.extend(gpu.download(model.micro_batch_losses(micro)).unwrap());
            }
            optimizer.step(gpu, &Solo, &model, lr, step, seed).unwrap();
            continue;
        }
        for (micro, (tokens, targets)) in (0..).zip(&batches) {
            let loss = LossOptions {
                accumulate: micro > 0,
                ..loss
            };
            model.forward_hidden(gpu, tokens).unwrap();
            if in_backward && micro + 1 == MICRO_STEPS {
                optimizer.begin_block_updates(gpu).unwrap();
                (model.backward_updating(gpu, targets, loss, &mut update)).unwrap();
            } else {
                model.backward(gpu, targets, loss, &mut |_| Ok(())).unwrap();
            }
            losses.extend(gpu.download(model.losses()).unwrap());
        }
        optimizer.step(gpu, &Solo, &model, lr, step, seed).unwrap();
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
    // Layer-major, a tied embedding's gradient sums its parts in another order, so those
    // variants run on an untied model.
    let configs = small_configs();
    let six_layers = |(name, config): &(&'static str, ModelConfig)| {
        let config = ModelConfig {
            num_layers: 6,
            ..config.clone()
        };
        (*name, config)
    };
    let (tied, untied) = (six_layers(&configs[1]), six_layers(&configs[2]));
    assert!(!untied.1.tie_word_embeddings && tied.1.tie_word_embeddings);
    let block = Recompute {
        block: true,
        ..Recompute::default()
    };
    let adamw = bench::bf16_adamw_options();
    // Updating in the backward does not clip; its baseline does not either.
    let no_clip = OptimizerOptions {
        grad_clip: 0.0,
        ..adamw.clone()
    };
    let in_backward = |offload| OptimizerOptions {
        in_backward: true,
        offload,
        ..no_clip.clone()
    };
    let moments = Offload {
        opt_m: true,
        opt_v: true,
        ..Offload::default()
    };
    // The variants of one micro-batch at a time on the tied model, the layer-major ones on
    // the untied.
    let runs = [(&tied, false), (&untied, true)];
    let fp8 = MatmulPrecision::Fp8 {
        forward: DType::E4M3,
        gradient: DType::E5M2,
    };
    let int8 = MatmulPrecision::Int8(Int8Options {
        weight_grad: true,
        stochastic: false,
    });
    for ((((name, config), layer_major_runs), shape), matmul) in runs
        .into_iter()
        .flat_map(|run| [(run, (1, 16)), (run, (4, 1024))])
        .flat_map(|run| [(run, MatmulPrecision::Native), (run, fp8), (run, int8)])
    {
        let base = |adamw| train(&gpu, config, shape, |o| o.matmul = matmul, adamw);
        let bases = [base(adamw.clone()), base(no_clip.clone())];
        assert!(bases.iter().flat_map(|b| &b.0).all(|l| l.is_finite()));
        // (variant, weights and gradients streamed, recompute, optimizer, layer-major with
        // the residual stream in host memory)
        let variants = [
            (
                "weights",
                (true, false),
                Recompute::default(),
                &adamw,
                false,
            ),
            (
                "gradients",
                (false, true),
                Recompute::default(),
                &adamw,
                false,
            ),
            ("both", (true, true), Recompute::default(), &adamw, false),
            ("both, block recomputed", (true, true), block, &adamw, false),
            (
                "nothing, updated in the backward",
                (false, false),
                block,
                &in_backward(Offload::default()),
                false,
            ),
            (
                "both and the moments, updated in the backward",
                (true, true),
                block,
                &in_backward(moments),
                false,
            ),
            ("both, layer-major", (true, true), block, &adamw, true),
            (
                "both and the moments, layer-major, updated in the backward",
                (true, true),
                block,
                &in_backward(moments),
                true,
            ),
        ];
        for (variant, (weights, gradients), recompute, optimizer, layer_major) in variants {
            if layer_major != layer_major_runs {
                continue;
            }
            let (losses, w) = train(
                &gpu,
                config,
                shape,
                |o| {
                    o.matmul = matmul;
                    o.offload_weights = weights;
                    o.offload_gradients = gradients;
                    o.recompute = recompute;
                    if layer_major {
                        o.micro_batches = MICRO_STEPS as usize;
                        o.offload_residual = true;
                    }
                },
                optimizer.clone(),
            );
            let (base_losses, base_weights) = &bases[optimizer.grad_clip.eq(&0.0) as usize];
            let test = format!(
                "streamed {variant}, {name}, 6 layers, {} × {}, {} matmuls",
                shape.0,
                shape.1,
                matmul.name()
            );
            assert!(same_bits(&losses, base_losses), "{test}: the losses differ");
            for (w, base) in w.iter().zip(base_weights) {
                assert!(same_bits(w, base), "{test}: the weights differ");
            }
            figure(
                &test,
                format!("bitwise equal over {STEPS} steps of {MICRO_STEPS} micro-batches"),
            );
        }
    }
}
