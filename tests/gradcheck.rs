//! The CPU backend's gradients against central finite differences, in f64.

mod common;

use common::*;
use smelt::backend::cpu::Cpu;
use smelt::model::{LossOptions, Recompute, Transformer};
use smelt::tensor::DType;

const Z_LOSS: f32 = 1e-2;

fn mean_loss(
    cpu: &Cpu<f64>, model: &mut Transformer<Cpu<f64>>, tokens: &[i32], targets: &[i32],
) -> f64 {
    model.forward_loss(cpu, tokens, targets, Z_LOSS).unwrap();
    model.loss_sum(cpu).unwrap() / trained_tokens(targets) as f64
}

#[test]
fn every_gradient_matches_finite_differences() {
    // Central differences in f64 with h = 1e-5 carry a truncation error ~h² and a rounding
    // error ~1e-16/h, both far below the 1e-4 bound; a wrong formula misses it by orders.
    const H: f64 = 1e-5;
    const TOLERANCE: f64 = 1e-4;
    let cpu = Cpu::<f64>::new();
    for (name, config) in tiny_configs() {
        let (batch_size, seq) = (2, 5);
        let mut model = Transformer::new(
            &cpu,
            config.clone(),
            options(batch_size, seq, DType::F64, Recompute::default(), 3),
        )
        .unwrap();
        randomize(&cpu, &model, 11);
        let (tokens, targets) = batch(batch_size * seq, config.vocab_size, 5);
        let loss = LossOptions {
            grad_scale: 1.0 / trained_tokens(&targets) as f32,
            z_loss: Z_LOSS,
            accumulate: false,
        };
        model
            .forward_backward(&cpu, &tokens, &targets, loss)
            .unwrap();
        let analytic = gradients(&cpu, &model);

        let params: Vec<_> = model.params.iter().cloned().collect();
        for ((param_name, grad), param) in analytic.iter().zip(&params) {
            let mut numeric = vec![0.0; grad.len()];
            for (i, slot) in numeric.iter_mut().enumerate() {
                let nudge = |delta: f64| cpu.update(param, |v| v[i] += delta).unwrap();
                nudge(H);
                let up = mean_loss(&cpu, &mut model, &tokens, &targets);
                nudge(-2.0 * H);
                let down = mean_loss(&cpu, &mut model, &tokens, &targets);
                nudge(H);
                *slot = (up - down) / (2.0 * H);
            }
            let diff = grad
                .iter()
                .zip(&numeric)
                .map(|(a, n)| (a - n).powi(2))
                .sum::<f64>()
                .sqrt();
            let scale = numeric.iter().map(|n| n * n).sum::<f64>().sqrt();
            assert!(
                scale > 1e-6,
                "{name} {param_name}: the gradient is ~0, so the check would prove nothing"
            );
            let rel = diff / scale;
            assert!(
                rel <= TOLERANCE,
                "{name} {param_name}: relative error {rel:e} against finite differences"
            );
        }
    }
}
