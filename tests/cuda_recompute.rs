//! On the GPU, every recompute option, and offloading activations, gives bitwise the losses
//! (and weights) of keeping all activations on the device, over 5 optimizer steps.
//! The kernels and cuBLASLt plans are deterministic, the recompute reruns the same ops on the
//! same inputs, and the offload only moves bytes, so nothing less than equal bits is right.
//! Running the MLP in token chunks changes the order of its weight gradients' sums, so it is
//! compared within bf16 rounding.

mod common;

use common::gpu::*;
use common::{batch, gradients, max_abs, max_abs_diff, options};
use smelt::backend::prelude::*;
use smelt::model::{
    LossOptions, MatmulPrecision, ModelConfig, ModelOptions, Recompute, Transformer,
};
use smelt::tensor::DType;

const STEPS: u64 = 5;

/// Per-token losses of every step, and the final weights, at `batch` × `seq`.
fn train_shape<B: Backend>(
    gpu: &B, config: &ModelConfig, (batch, seq): (usize, usize), o: impl FnOnce(&mut ModelOptions),
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
    gpu: &B, config: &ModelConfig, recompute: Recompute, matmul: MatmulPrecision,
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

/// Six layers, so that the backward fetches the activations of the blocks below the last two
/// back into slots that other layers used. The copies are small beside a block's work here
/// (a `wait_for_copies_of` that waited for nothing still passed), so this checks the
/// bookkeeping on the GPU; `cuda_offload` checks the waits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn offloading_activations_is_bitwise_identical_on_the_gpu() {
    let gpu = cuda();
    let (name, config) = small_configs().swap_remove(0);
    let config = ModelConfig {
        num_layers: 6,
        ..config
    };
    let shape = (8, 1024);
    let r = Recompute::default();
    let (block, ffn) = (Recompute { block: true, ..r }, Recompute { ffn: true, ..r });
    let (base_losses, base_weights) = train_shape(&gpu, &config, shape, |_| ());
    for (variant, recompute, residual, kept) in [
        ("residual, nothing recomputed", r, true, false),
        ("residual, block", block, true, false),
        ("the other activations, nothing recomputed", r, false, true),
        ("both, ffn", ffn, true, true),
    ] {
        let (losses, weights) = train_shape(&gpu, &config, shape, |o| {
            o.recompute = recompute;
            o.offload_residual = residual;
            o.offload_activations = kept;
        });
        let test = format!("offloaded {variant}, {name}, 6 layers");
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

/// The MLP over 512 tokens in 3 chunks (171, 171 and 170 rows, so cuBLASLt gets row views at
/// offsets that are not multiples of 256 bytes) against the whole MLP, for one micro-batch.
/// cuBLASLt may pick other algorithms for the chunks' shapes, and the chunks' weight
/// gradients are summed into bf16 one by one, so both differ within bf16 rounding.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_mlp_in_token_chunks_matches_the_whole_mlp_on_the_gpu() {
    let gpu = cuda();
    let r = Recompute::default();
    let (batch_size, seq) = (2, 256);
    let run = |config: &ModelConfig, recompute: Recompute, ffn_chunks: usize| {
        let mut o = options(batch_size, seq, DType::BF16, recompute, 1);
        o.ffn_chunks = ffn_chunks;
        let mut model = Transformer::new(&gpu, config.clone(), o).unwrap();
        upload_weights(&gpu, &model, &host_weights(&model, 3, 0.05));
        let (tokens, targets) = batch(batch_size * seq, config.vocab_size, 7);
        let loss = LossOptions {
            grad_scale: 1.0 / (batch_size * seq) as f32,
            z_loss: 0.0,
            accumulate: false,
        };
        model
            .forward_backward(&gpu, &tokens, &targets, loss)
            .unwrap();
        let losses = gpu.download_f64(model.losses()).unwrap();
        (losses, gradients(&gpu, &model))
    };
    for (config_name, config) in small_configs().into_iter().take(2) {
        for (variant, recompute) in [
            ("ffn", Recompute { ffn: true, ..r }),
            ("block", Recompute { block: true, ..r }),
        ] {
            let test = format!("ffn chunks {config_name}, recompute {variant}");
            let (base_losses, base_grads) = run(&config, recompute, 1);
            let (losses, grads) = run(&config, recompute, 3);
            let loss_diff = max_abs_diff(&losses, &base_losses);
            assert!(loss_diff <= 1e-2, "{test}: losses differ by {loss_diff:e}");
            let mut worst = (1.0f64, String::new());
            for ((name, g), (_, base)) in grads.iter().zip(&base_grads) {
                let (scale, err) = (max_abs(base), max_abs_diff(g, base));
                assert!(
                    err <= 2e-2 * scale,
                    "{test}: {name} differs by {err:e} of {scale:e}"
                );
                let c = cosine(g, base);
                if c < worst.0 {
                    worst = (c, name.clone());
                }
            }
            assert!(worst.0 >= 0.999, "{test}: {} cosine {}", worst.1, worst.0);
            figure(
                &test,
                format!(
                    "losses within {loss_diff:.1e}, min gradient cosine {:.6} ({})",
                    worst.0, worst.1
                ),
            );
        }
    }
}
