//! One full training step (forward and backward) of small Qwen2 and Llama models on the GPU
//! in bf16 against the CPU in f32, on the same weights and batch.

mod common;

use common::gpu::*;
use common::{batch, gradients, options, trained_tokens};
use smelt::backend::cpu::Cpu;
use smelt::model::{LossOptions, Recompute, Transformer};
use smelt::tensor::DType;

#[test]
#[ignore = "needs a CUDA GPU"]
fn training_step_matches_the_cpu() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let (batch_size, seq) = (2, 256);
    for (name, config) in small_configs() {
        let opts = |dtype| options(batch_size, seq, dtype, Recompute::default(), 2);
        let mut on_gpu = Transformer::new(&gpu, config.clone(), opts(DType::BF16)).unwrap();
        let mut on_cpu = Transformer::new(&cpu, config.clone(), opts(DType::F32)).unwrap();
        let weights = host_weights(&on_cpu, 7, 0.05);
        upload_weights(&gpu, &on_gpu, &weights);
        upload_weights(&cpu, &on_cpu, &weights);
        let (tokens, targets) = batch(batch_size * seq, config.vocab_size, 8);
        let trained = trained_tokens(&targets);
        let loss = LossOptions {
            grad_scale: 1.0 / trained as f32,
            z_loss: 1e-4,
            accumulate: false,
        };
        on_gpu
            .forward_backward(&gpu, &tokens, &targets, loss)
            .unwrap();
        on_cpu
            .forward_backward(&cpu, &tokens, &targets, loss)
            .unwrap();
        let gpu_loss = on_gpu.loss_sum(&gpu).unwrap() / trained as f64;
        let cpu_loss = on_cpu.loss_sum(&cpu).unwrap() / trained as f64;
        let test = format!("training step {name}");
        figure(&test, format!("loss gpu {gpu_loss:.5} cpu {cpu_loss:.5}"));
        // bf16 weights and activations against f32 move a ~7 loss by a few 1e-3.
        assert!(
            (gpu_loss - cpu_loss).abs() <= 1e-2,
            "{test}: loss {gpu_loss} on the GPU, {cpu_loss} on the CPU"
        );
        let mut worst = (f64::INFINITY, String::new());
        for ((pname, g), (_, c)) in gradients(&gpu, &on_gpu)
            .iter()
            .zip(&gradients(&cpu, &on_cpu))
        {
            let cos = cosine(g, c);
            if cos < worst.0 {
                worst = (cos, pname.clone());
            }
            // bf16 storage of every activation and gradient costs well under 1% of direction.
            assert!(cos >= 0.99, "{test}: gradient {pname} cosine {cos}");
        }
        figure(
            &test,
            format!("min gradient cosine {:.5} ({})", worst.0, worst.1),
        );
    }
}
