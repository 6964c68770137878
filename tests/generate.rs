//! Generation over a KV cache against the full forward pass: every position's logits, the
//! prompt's from its own pass and the rest one token a pass, and greedy text long enough to
//! outgrow the model's context.

mod common;

use common::*;
use smelt::backend::cpu::Cpu;
use smelt::generate::{Generator, SampleOptions, Sampling};
use smelt::model::{ModelOptions, Transformer};
use smelt::tensor::DType;

#[test]
fn cached_logits_are_the_full_forwards() {
    let cpu = Cpu::<f32>::new();
    let tokens = batch(13, 23, 5).0;
    for (name, config) in tiny_configs() {
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
            let mut model =
                Transformer::new(&cpu, config.clone(), ModelOptions::forward_only(1, dtype))
                    .unwrap();
            randomize(&cpu, &model, 3);
            let full = full_logits(&cpu, &model, &tokens);
            // A prompt of one token, and one of several that the rest attend over.
            for prompt in [1, 6] {
                let cached = cached_logits(&cpu, &mut model, &tokens, prompt);
                let err = logits_rel_err(&cached, &full);
                assert!(
                    err <= tol,
                    "{name} {dtype}, prompt {prompt}: relative error {err:e} > {tol:e}"
                );
            }
        }
    }
}

/// The first largest logit, as greedy sampling takes it.
fn argmax(logits: &[f32]) -> i32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    logits.iter().position(|&l| l == max).unwrap() as i32
}

#[test]
fn greedy_text_past_the_context_restarts_from_its_newest_half() {
    let cpu = Cpu::<f32>::new();
    let mut config = tiny_config("Qwen2ForCausalLM", true);
    config.max_position_embeddings = 8;
    let mut generator = Generator::new(&cpu, config.clone(), DType::F32, |m| {
        randomize(&cpu, m, 9);
        Ok(())
    })
    .unwrap();
    let new_tokens = 20;
    let options = SampleOptions {
        max_new_tokens: new_tokens,
        sampling: Sampling::temperature(0.0),
        seed: 1,
        stop: vec![],
    };
    // A prompt that fits the context, and one that is already longer.
    for prompt in [vec![3, 5, 7], (0..11).collect()] {
        let generated = generator
            .generate(&cpu, &prompt, &options, |_| Ok(()))
            .unwrap();

        // The same rule, each token from a full forward pass over the context: once it
        // holds more than 8 tokens, it restarts from its newest 4.
        let mut tokens = prompt.clone();
        let (mut start, mut restarts) = (0, 0);
        for _ in 0..new_tokens {
            if tokens.len() - start > 8 {
                start = tokens.len() - 4;
                restarts += 1;
            }
            let context = &tokens[start..];
            let model = Transformer::new(
                &cpu,
                config.clone(),
                ModelOptions::forward_only(context.len(), DType::F32),
            )
            .unwrap();
            randomize(&cpu, &model, 9);
            let logits = full_logits(&cpu, &model, context);
            tokens.push(argmax(logits.last().unwrap()));
        }
        assert_eq!(generated, tokens[prompt.len()..], "prompt {prompt:?}");
        // The text restarted several times and is not stuck on one token.
        assert!(restarts >= 3, "{restarts} restarts");
        assert!(
            generated.iter().any(|&t| t != generated[0]),
            "{generated:?}"
        );
    }
}
