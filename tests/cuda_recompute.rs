//! On the GPU, every recompute option, and offloading the residual stream, gives bitwise the
//! losses (and weights) of keeping all activations on the device, over 5 optimizer steps.
//! The kernels and cuBLASLt plans are deterministic, the recompute reruns the same ops on the
//! same inputs, and the offload only moves bytes, so nothing less than equal bits is right.

mod common;

use common::gpu::*;
use common::options;
use smelt::backend::Backend;
use smelt::model::{MatmulPrecision, ModelConfig, ModelOptions, Recompute, Transformer};
use smelt::tensor::DType;

const STEPS: u64 = 5;

/// Per-token losses of every step, and the final weights, at `batch` × `seq`.
fn train_shape<B: Backend>(
    gpu: &B,
    config: &ModelConfig,
    (batch, seq): (usize, usize),
    o: impl FnOnce(&mut ModelOptions),
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut options = options(batch, seq, DType::BF16, Recompute::default(), 2);
    o(&mut options);
    let mut model = Transformer::new(gpu, config.clone(), options).unwrap();
    upload_weights(gpu, &model, &host_weights(&model, 3, 0.05));
    let optimizer = bf16_adamw(gpu, &model);
    let losses = train_steps(gpu, &mut model, &optimizer, STEPS);
    let weights = model
        .params
        .iter()
        .map(|p| gpu.download(p).unwrap())
        .collect();
    (losses, weights)
}

/// `train_shape` at 2 × 256 with `recompute` and `matmul`.
fn train<B: Backend>(
    gpu: &B,
    config: &ModelConfig,
    recompute: Recompute,
    matmul: MatmulPrecision,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    train_shape(gpu, config, (2, 256), |o| {
        o.recompute = recompute;
        o.matmul = matmul;
    })
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn recompute_is_bitwise_identical_on_the_gpu() {
    let gpu = cuda();
    let variants = Recompute::variants();
    let fp8 = MatmulPrecision::Fp8 {
        forward: DType::E4M3,
        gradient: DType::E5M2,
    };
    let configs = small_configs().into_iter().take(2);
    // FP8 on the first config: its producers' abs-max reports and quantizations rerun too.
    let runs = configs
        .map(|(name, c)| (name.to_string(), c, MatmulPrecision::Native))
        .chain(std::iter::once((
            format!("{} fp8", small_configs()[0].0),
            small_configs()[0].1.clone(),
            fp8,
        )));
    for (config_name, config, matmul) in runs {
        let (base_losses, base_weights) = train(&gpu, &config, Recompute::default(), matmul);
        assert!(base_losses.iter().all(|l| l.is_finite()) && base_losses.iter().any(|&l| l > 0.0));
        let per_step = base_losses.len() / STEPS as usize;
        let mean = |s: usize| {
            base_losses[s * per_step..(s + 1) * per_step]
                .iter()
                .sum::<f32>()
                / per_step as f32
        };
        let test = format!("recompute {config_name}");
        figure(
            &test,
            format!(
                "mean token loss step 1 {:.4}, step 5 {:.4}",
                mean(0),
                mean(4)
            ),
        );
        for (name, recompute) in &variants {
            let (losses, weights) = train(&gpu, &config, *recompute, matmul);
            assert!(
                same_bits(&losses, &base_losses),
                "{test}: recompute {name} changes the losses"
            );
            for (w, base) in weights.iter().zip(&base_weights) {
                assert!(
                    same_bits(w, base),
                    "{test}: recompute {name} changes the weights"
                );
            }
        }
        figure(
            &test,
            format!(
                "{} variants bitwise equal over {STEPS} steps",
                variants.len()
            ),
        );
    }
}

/// Six layers, so that the backward fetches the inputs of the blocks below the last two
/// back into slots that other layers used. The copies are small beside a block's work here
/// (a `join_copies` that waited for nothing still passed), so this checks the bookkeeping on
/// the GPU; `cuda_offload` checks the waits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn offloading_the_residual_stream_is_bitwise_identical_on_the_gpu() {
    let gpu = cuda();
    let (name, config) = small_configs().swap_remove(0);
    let config = ModelConfig {
        num_layers: 6,
        ..config
    };
    let shape = (8, 1024);
    let block = Recompute {
        block: true,
        ..Recompute::default()
    };
    let (base_losses, base_weights) = train_shape(&gpu, &config, shape, |_| ());
    for (variant, recompute) in [
        ("nothing recomputed", Recompute::default()),
        ("block", block),
    ] {
        let (losses, weights) = train_shape(&gpu, &config, shape, |o| {
            o.recompute = recompute;
            o.offload_residual = true;
        });
        let test = format!("offloaded residual, {name}, 6 layers, {variant}");
        assert!(
            same_bits(&losses, &base_losses),
            "{test}: the losses differ"
        );
        for (w, base) in weights.iter().zip(&base_weights) {
            assert!(same_bits(w, base), "{test}: the weights differ");
        }
        figure(&test, format!("bitwise equal over {STEPS} steps"));
    }
}
