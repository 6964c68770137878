//! FP8 linear layers on the CPU's emulation: a step tracks the bf16 step it approximates,
//! and the weights' FP8 copies follow the optimizer. (`recompute.rs` checks that recompute
//! stays bitwise under FP8; `cuda_model.rs` checks the GPU against this emulation.)

mod common;

use common::gpu::{
    bf16_adamw, cosine, norm_quantizations, norm_quantizations_agree, normal, output,
};
use common::*;
use smelt::backend::cpu::Cpu;
use smelt::backend::prelude::*;
use smelt::comm::Solo;
use smelt::model::{LossOptions, MatmulPrecision, ModelConfig, Recompute, Transformer};
use smelt::tensor::DType;

const BATCH: usize = 2;
const SEQ: usize = 16;

fn fp8(gradient: DType) -> MatmulPrecision {
    MatmulPrecision::Fp8 {
        forward: DType::E4M3,
        gradient,
    }
}

fn model(cpu: &Cpu, config: &ModelConfig, matmul: MatmulPrecision) -> Transformer<Cpu> {
    let mut o = options(BATCH, SEQ, DType::BF16, Recompute::default(), 2);
    o.matmul = matmul;
    Transformer::new(cpu, config.clone(), o).unwrap()
}

fn loss_options() -> LossOptions {
    LossOptions {
        grad_scale: 1.0 / (BATCH * SEQ) as f32,
        z_loss: 0.0,
        accumulate: false,
    }
}

/// Mean loss and gradients of one step from the weights `randomize` draws with `seed`.
fn step(config: &ModelConfig, matmul: MatmulPrecision) -> (f64, Vec<(String, Vec<f64>)>) {
    let cpu = Cpu::new();
    let mut m = model(&cpu, config, matmul);
    // Initial weights, not the large ones of `randomize`: in these 16-wide layers those make
    // attention so sharp that FP8's rounding alone turns gradients by 30°, while at init
    // it is the few-degree error FP8 training lives with.
    m.init_weights(&cpu, 5).unwrap();
    let (tokens, targets) = batch(BATCH * SEQ, config.vocab_size, 9);
    m.forward_backward(&cpu, &tokens, &targets, loss_options())
        .unwrap();
    let loss = m.loss_sum(&cpu).unwrap() / trained_tokens(&targets) as f64;
    (loss, gradients(&cpu, &m))
}

#[test]
fn fp8_step_tracks_the_bf16_step() {
    for (name, config) in tiny_configs() {
        let (loss, grads) = step(&config, MatmulPrecision::Native);
        for gradient in [DType::E4M3, DType::E5M2] {
            let (fp8_loss, fp8_grads) = step(&config, fp8(gradient));
            let test = format!("{name} e4m3/{gradient}");
            // FP8 moves every matmul operand by up to 2⁻⁴ (e4m3) or 2⁻³ (e5m2) relative:
            // measured here, losses move by ~1e-4 and the lowest gradient cosine is 0.988.
            // A misplaced transpose or scale breaks both bounds by far.
            assert!(
                (fp8_loss - loss).abs() < 1e-3,
                "{test}: loss {fp8_loss} vs bf16 {loss}"
            );
            let mut lowest = 1.0f64;
            for ((param, g), (_, g8)) in grads.iter().zip(&fp8_grads) {
                let c = cosine(g8, g);
                assert!(c >= 0.98, "{test}: {param} gradient cosine {c}");
                lowest = lowest.min(c);
            }
            println!("{test}: loss {fp8_loss:.5} vs {loss:.5}, lowest cosine {lowest:.4}");
        }
    }
}

/// After an optimizer step the FP8 copies are remade from the abs-maxes the optimizer
/// reported, and they equal copies made from scratch by a model loading the same weights.
#[test]
fn fp8_weight_copies_follow_the_optimizer() {
    let config = tiny_config("Qwen2ForCausalLM", false);
    let cpu = Cpu::new();
    let mut trained = model(&cpu, &config, fp8(DType::E5M2));
    trained.init_weights(&cpu, 3).unwrap();
    let optimizer = bf16_adamw(&cpu, &trained);
    let (tokens, targets) = batch(BATCH * SEQ, config.vocab_size, 2);
    let loss = |m: &mut Transformer<Cpu>| {
        m.forward_loss(&cpu, &tokens, &targets, 0.0).unwrap();
        cpu.download_f64(m.losses()).unwrap()
    };
    let before = loss(&mut trained);
    trained
        .forward_backward(&cpu, &tokens, &targets, loss_options())
        .unwrap();
    optimizer.step(&cpu, &Solo, &trained, 1e-2, 1, 7).unwrap();
    let after = loss(&mut trained);
    assert_ne!(before, after, "the step changed nothing");

    let mut fresh = model(&cpu, &config, fp8(DType::E5M2));
    for (dst, src) in fresh.params.zip(&trained.params) {
        cpu.copy(dst, src).unwrap();
    }
    fresh.weights_changed();
    assert_eq!(loss(&mut fresh), after, "cached FP8 weights are stale");

    // The reported weight abs-maxes are those of the weights.
    let report = trained.fp8_abs_max(&cpu).unwrap().unwrap();
    let down = cpu.download(&trained.params.layers[1].down).unwrap();
    let expected = down.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let reported = report
        .iter()
        .find(|(name, _)| name == "layers.1.down.weight")
        .unwrap()
        .1;
    assert_eq!(reported, expected);
    assert!(report.iter().all(|(_, v)| *v > 0.0 && v.is_finite()));
}

/// An FP8 projection's input quantized from the norm's input, as the norm's output is never
/// stored, gives the codes of the stored output's quantization, and the norm without an
/// output gives the same rstd and abs-max as with one.
#[test]
fn a_norm_quantized_as_it_is_normalized_matches_its_stored_output() {
    let (r, c) = (24, 40);
    let w: Vec<f32> = normal(c, 0.2, 2).iter().map(|v| 1.0 + v).collect();
    let x = normal(r * c, 3.0, 1);
    let outputs = norm_quantizations(&Cpu::<f32>::new(), DType::BF16, (r, c), &x, &w);
    assert!(norm_quantizations_agree(&outputs));
    assert!(output(&outputs, "stored rows").iter().any(|v| *v != 0.0));
}
