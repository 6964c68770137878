//! Helpers for the GPU tests: tensors with the same values on both backends, comparisons
//! that print their figures (the GPU script collects `[figure]` lines), and model weights
//! drawn once on the host.

use smelt::backend::Fused;
use smelt::backend::cuda::Cuda;
use smelt::backend::prelude::*;
use smelt::comm::Solo;
use smelt::model::{LossOptions, ParamKind, Transformer};
use smelt::rng::{Rng, fill_normal};
use smelt::tensor::{DType, Tensor, TensorSpec};
use smelt::train::bench;
use smelt::train::optimizer::AdamWState;

use super::{batch, trained_tokens};

pub fn cuda() -> Cuda {
    Cuda::new(0).expect("these tests need a CUDA GPU")
}

/// A line the GPU script puts in its summary table.
pub fn figure(test: &str, text: impl std::fmt::Display) {
    println!("[figure] {test}: {text}");
}

/// `n` draws of N(0, std²), filled in parallel: the model-sized inputs of `cuda_gemm` are
/// hundreds of millions of values.
pub fn normal(n: usize, std: f64, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; n];
    fill_normal(&mut v, std, seed, 0);
    v
}

/// A fresh tensor holding `values` (rounded to `dtype` by the upload).
pub fn tensor<B: Backend>(b: &B, shape: &[usize], dtype: DType, values: &[f32]) -> Tensor<B> {
    let t = b
        .allocate("test", &[TensorSpec::new("t", shape, dtype)])
        .unwrap()
        .remove(0);
    b.upload(&t, values).unwrap();
    t
}

pub fn tensor_i32<B: Backend>(b: &B, values: &[i32]) -> Tensor<B> {
    let t = b
        .allocate("test", &[TensorSpec::new("t", &[values.len()], DType::I32)])
        .unwrap()
        .remove(0);
    b.upload_i32(&t, values).unwrap();
    t
}

/// `‖a − b‖ / ‖b‖` in f64 (0 when both are 0).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared outputs differ in length");
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        diff += (x as f64 - y as f64).powi(2);
        norm += (y as f64).powi(2);
    }
    if diff == 0.0 {
        0.0
    } else {
        (diff / norm).sqrt()
    }
}

pub fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (na * nb)
}

pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Milliseconds per call of `op`, the median of 20 calls after 3 warm-up calls, each timed
/// by CUDA events (the op timer, summed over the ops one call makes).
pub fn time_ms(gpu: &Cuda, op: impl Fn()) -> f64 {
    for _ in 0..3 {
        op();
    }
    let mut each: Vec<f64> = (0..20)
        .map(|_| {
            gpu.time_ops(true);
            op();
            let times = gpu.take_op_times().unwrap();
            gpu.time_ops(false);
            times.iter().map(|t| t.seconds).sum::<f64>() * 1e3
        })
        .collect();
    each.sort_by(f64::total_cmp);
    each[each.len() / 2]
}

/// Named outputs of one run of an op.
pub type Outputs = Vec<(&'static str, Vec<f32>)>;

/// Runs the op on the GPU twice (demanding bitwise-equal outputs: the kernels are
/// deterministic) and once on the CPU, and checks each output's relative error against
/// its tolerance. `tolerance` maps an output name to the bound, chosen by the caller.
/// Returns the GPU's outputs for further checks.
pub fn check_op(
    test: &str, gpu: impl Fn() -> Outputs, cpu: impl Fn() -> Outputs,
    tolerance: impl Fn(&str) -> f64,
) -> Outputs {
    let (first, second, reference) = (gpu(), gpu(), cpu());
    for (((name, g1), (_, g2)), (_, c)) in first.iter().zip(&second).zip(&reference) {
        assert!(
            g1.iter().all(|x| x.is_finite()),
            "{test} {name}: non-finite GPU output"
        );
        assert!(same_bits(g1, g2), "{test} {name}: two GPU runs differ");
        let err = rel_err(g1, c);
        let tol = tolerance(name);
        figure(
            test,
            format!("{name} rel err {err:.2e} (tol {tol:.0e}), deterministic"),
        );
        assert!(
            err <= tol,
            "{test} {name}: relative error {err:e} > {tol:e}"
        );
    }
    first
}

/// The output called `name`.
pub fn output<'a>(outputs: &'a Outputs, name: &str) -> &'a [f32] {
    &outputs
        .iter()
        .find(|(n, _)| *n == name)
        .expect("no such output")
        .1
}

/// Host values for every parameter of `model`: norms near 1, biases small, matrices
/// N(0, std). Large enough that attention is far from uniform.
pub fn host_weights<B: Backend>(model: &Transformer<B>, seed: u64, std: f64) -> Vec<Vec<f32>> {
    model
        .layout
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let n = spec.tensor.numel();
            let mut rng = Rng::derived(seed, i as u64);
            (0..n)
                .map(|_| {
                    let r = rng.normal();
                    (match spec.kind {
                        ParamKind::Norm => 1.0 + 0.1 * r,
                        ParamKind::Bias => 0.1 * r,
                        _ => std * r,
                    }) as f32
                })
                .collect()
        })
        .collect()
}

pub fn upload_weights<B: Backend>(b: &B, model: &Transformer<B>, weights: &[Vec<f32>]) {
    for (t, w) in model.params.iter().zip(weights) {
        b.upload(t, w).unwrap();
    }
}

/// A small model config of `arch` (GQA when `kv_heads < heads`), for the GPU model tests.
pub fn small_config(
    arch: &str, tied: bool, hidden: usize, heads: usize, kv_heads: usize, head_dim: usize,
) -> smelt::model::ModelConfig {
    let v = serde_json::json!({
        "architectures": [arch], "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "vocab_size": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": tied, "eos_token_id": 1,
    });
    smelt::model::ModelConfig::from_json(&v, "small GPU test config").unwrap()
}

/// The shapes of the model-level GPU tests: every family, tied and untied, GQA, and every
/// supported head size.
pub fn small_configs() -> Vec<(&'static str, smelt::model::ModelConfig)> {
    vec![
        (
            "qwen2 untied D64",
            small_config("Qwen2ForCausalLM", false, 256, 4, 2, 64),
        ),
        (
            "qwen2 tied D128",
            small_config("Qwen2ForCausalLM", true, 256, 4, 1, 128),
        ),
        (
            "llama untied D80",
            small_config("LlamaForCausalLM", false, 320, 4, 2, 80),
        ),
        (
            "llama tied D96",
            small_config("LlamaForCausalLM", true, 384, 6, 2, 96),
        ),
        (
            "qwen3 untied D128",
            small_config("Qwen3ForCausalLM", false, 256, 4, 2, 128),
        ),
    ]
}

/// `steps` optimizer steps of `model` on random batches seeded by the step (z-loss 1e-4,
/// lr 1e-3, rounding seed 7): every step's per-token losses, in order.
pub fn train_steps<B: Backend>(
    b: &B, model: &mut Transformer<B>, optimizer: &AdamWState<B>, steps: u64,
) -> Vec<f32> {
    let mut losses = vec![];
    for step in 1..=steps {
        let (tokens, targets) = batch(model.tokens_per_step(), model.config.vocab_size, 100 + step);
        let loss = LossOptions {
            grad_scale: 1.0 / trained_tokens(&targets) as f32,
            z_loss: 1e-4,
            accumulate: false,
        };
        model.forward_backward(b, &tokens, &targets, loss).unwrap();
        losses.extend(b.download(model.losses()).unwrap());
        optimizer.step(b, &Solo, model, 1e-3, step, 7).unwrap();
    }
    losses
}

/// The trainer's AdamW as the benchmark rows define it: bf16 weights and bf16 Adam states.
pub fn bf16_adamw<B: Backend>(b: &B, model: &Transformer<B>) -> AdamWState<B> {
    AdamWState::new(b, &Solo, model, bench::bf16_adamw_options()).unwrap()
}

/// A norm's output quantized to e4m3 two ways: stored by `rmsnorm_forward` and quantized,
/// and (`Fused::Norm`) from the norm's input by a norm that stores nothing; with both
/// norms' rstd and abs-max. The two ways must give the same bits.
pub fn norm_quantizations<B: Backend>(
    b: &B, x_dtype: DType, (r, c): (usize, usize), x: &[f32], w: &[f32],
) -> Outputs {
    let (x, w) = (tensor(b, &[r, c], x_dtype, x), tensor(b, &[c], x_dtype, w));
    let zeros =
        |shape: &[usize], dtype| tensor(b, shape, dtype, &vec![0.0; shape.iter().product()]);
    let norm = |out: Option<&Tensor<B>>| {
        let (rstd, amax) = (zeros(&[r], DType::F32), zeros(&[1], DType::F32));
        b.rmsnorm_forward(out, &rstd, &x, None, &w, 1e-6, Some(&amax))
            .unwrap();
        (rstd, amax)
    };
    let y = zeros(&[r, c], x_dtype);
    let ((rstd, amax), (unstored_rstd, unstored_amax)) = (norm(Some(&y)), norm(None));
    let codes = || {
        let descale = zeros(&[1], DType::F32);
        (
            zeros(&[r, c], DType::E4M3),
            zeros(&[c, r], DType::E4M3),
            descale,
        )
    };
    let (rows, cols, descale) = codes();
    b.quantize(
        Some(&rows),
        Some(&cols),
        &descale,
        &y,
        &amax,
        Fused::Nothing,
    )
    .unwrap();
    let (n_rows, n_cols, n_descale) = codes();
    let norm = Fused::Norm {
        rstd: &unstored_rstd,
        weight: &w,
    };
    b.quantize(
        Some(&n_rows),
        Some(&n_cols),
        &n_descale,
        &x,
        &unstored_amax,
        norm,
    )
    .unwrap();
    let values = |t: &Tensor<B>| b.download(t).unwrap();
    vec![
        ("stored rstd", values(&rstd)),
        ("stored amax", values(&amax)),
        ("stored rows", values(&rows)),
        ("stored cols", values(&cols)),
        ("stored descale", values(&descale)),
        ("normalized rstd", values(&unstored_rstd)),
        ("normalized amax", values(&unstored_amax)),
        ("normalized rows", values(&n_rows)),
        ("normalized cols", values(&n_cols)),
        ("normalized descale", values(&n_descale)),
    ]
}

/// Whether `norm_quantizations` gave the same bits both ways.
pub fn norm_quantizations_agree(outputs: &Outputs) -> bool {
    ["rstd", "amax", "rows", "cols", "descale"]
        .iter()
        .all(|part| {
            same_bits(
                output(outputs, &format!("stored {part}")),
                output(outputs, &format!("normalized {part}")),
            )
        })
}
