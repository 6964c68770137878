//! Generation over a KV cache on the GPU: every position's logits against the full forward
//! pass on the same device, at the four small shapes in bf16 and f32; and how fast
//! `Generator` samples at Qwen2.5-0.5B's shape, and where a token's time goes.

mod common;

use std::time::Instant;

use common::gpu::*;
use common::{batch, cached_logits, full_logits, logits_rel_err};
use smelt::backend::ResidualAdd;
use smelt::backend::prelude::*;
use smelt::generate::{Generator, SampleOptions, Sampling};
use smelt::model::{ModelOptions, Transformer, presets};
use smelt::tensor::DType;

#[test]
#[ignore = "needs a CUDA GPU"]
fn cached_logits_are_the_full_forwards() {
    let gpu = cuda();
    for (name, config) in small_configs() {
        let tokens = batch(300, config.vocab_size, 7).0;
        // bf16: the full pass's matmuls have other shapes than one token's, so cuBLASLt
        // rounds some activations the other way; a wrong position, rotation or cache row
        // would be off by the logits' own size.
        for (dtype, tol) in [(DType::BF16, 5e-2), (DType::F32, 1e-4)] {
            let options = ModelOptions::forward_only(1, dtype);
            let mut model = Transformer::new(&gpu, config.clone(), options).unwrap();
            upload_weights(&gpu, &model, &host_weights(&model, 11, 0.05));
            let full = full_logits(&gpu, &model, &tokens);
            for prompt in [1, 100] {
                let cached = cached_logits(&gpu, &mut model, &tokens, prompt);
                let err = logits_rel_err(&cached, &full);
                let test = format!("generate {name} {dtype}");
                figure(
                    &test,
                    format!(
                        "300 positions' logits after a {prompt}-token prompt, cached against \
                         full: rel err {err:.2e} (tol {tol:.0e})"
                    ),
                );
                assert!(err <= tol, "{test}: relative error {err:e} > {tol:e}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sampling_speed_at_qwen2_5_0_5b() {
    let gpu = cuda();
    let config = presets::preset("qwen2.5-0.5b").unwrap();
    let (prompt_len, new_tokens) = (128, 512);
    let prompt = batch(prompt_len, config.vocab_size, 1).0;
    let mut generator = Generator::new(&gpu, config.clone(), DType::BF16, |m| {
        m.init_weights(&gpu, 5)
    })
    .unwrap();
    let options = |max_new_tokens| SampleOptions {
        max_new_tokens,
        sampling: Sampling::temperature(1.0),
        seed: 1,
        stop: vec![],
    };
    // Each token's pass enqueued op by op, then recorded once and replayed.
    let mut sample = |graphs: bool| {
        gpu.set_graphs(graphs);
        // Compiles the kernels and picks cuBLASLt's algorithms.
        generator
            .generate(&gpu, &prompt, &options(4), |_| Ok(()))
            .unwrap();
        let start = Instant::now();
        let new = generator
            .generate(&gpu, &prompt, &options(new_tokens), |_| Ok(()))
            .unwrap();
        (new, start.elapsed().as_secs_f64())
    };
    let (eager, eager_seconds) = sample(false);
    let (new, seconds) = sample(true);
    assert_eq!(new.len(), new_tokens);
    // The same tokens: every logit of the replayed passes has the bits of the enqueued ones.
    assert!(eager == new, "a replayed pass sampled other tokens");
    decode_step_costs(&gpu, &config, &prompt);
    decode_step_costs(&gpu, &config, &batch(2048, config.vocab_size, 3).0);
    enqueue_costs(&gpu, &config);

    // What each new token cost before the cache: a full forward pass over the context (here
    // its final length).
    let context = prompt_len + new_tokens;
    let options = ModelOptions::forward_only(context, DType::BF16);
    let mut full = Transformer::new(&gpu, config.clone(), options).unwrap();
    full.init_weights(&gpu, 5).unwrap();
    let tokens = batch(context, config.vocab_size, 2).0;
    let mut pass = || {
        full.forward_hidden(&gpu, &tokens).unwrap();
        full.logits_at(&gpu, context - 1).unwrap();
        gpu.synchronize().unwrap();
    };
    pass();
    let start = Instant::now();
    pass();
    let full_ms = start.elapsed().as_secs_f64() * 1e3;
    figure(
        "sampling qwen2.5-0.5b bf16",
        format!(
            "each token's pass enqueued op by op: {new_tokens} tokens in {eager_seconds:.2} s \
             ({:.0} tok/s); recorded once and replayed, the same tokens",
            new_tokens as f64 / eager_seconds,
        ),
    );
    figure(
        "sampling qwen2.5-0.5b bf16",
        format!(
            "{new_tokens} tokens after a {prompt_len}-token prompt in {seconds:.2} s \
             ({:.0} tok/s, {:.2} ms a token); one full pass over {context} positions {full_ms:.2} ms",
            new_tokens as f64 / seconds,
            seconds * 1e3 / new_tokens as f64
        ),
    );
}

/// Where a generated token's time goes at Qwen2.5-0.5B's shape, at contexts of 1 to 3 times
/// the prompt's length: the prompt's one pass, each token's pass alone (the host enqueues,
/// the device runs), the logits read back, and the ops' device time.
fn decode_step_costs(
    gpu: &smelt::backend::cuda::Cuda, config: &smelt::model::ModelConfig, prompt: &[i32],
) {
    let n = prompt.len();
    let mut model = Transformer::new(
        gpu,
        config.clone(),
        ModelOptions::forward_only(1, DType::BF16),
    )
    .unwrap();
    model.init_weights(gpu, 5).unwrap();
    let options = ModelOptions::forward_only(n, DType::BF16);
    let mut prompt_pass = Transformer::sharing_weights(gpu, &model, options).unwrap();
    let mut fill = || {
        let mut cache = prompt_pass.kv_cache(gpu, 3 * n).unwrap();
        prompt_pass.forward_cached(gpu, prompt, &mut cache).unwrap();
        prompt_pass.logits_at(gpu, n - 1).unwrap();
        cache
    };
    fill();
    let start = Instant::now();
    let mut cache = fill();
    let prompt_ms = start.elapsed().as_secs_f64() * 1e3;
    for &t in prompt {
        model.forward_token(gpu, t, &mut cache).unwrap();
    }
    gpu.synchronize().unwrap();
    let start = Instant::now();
    for &t in prompt {
        model.forward_token(gpu, t, &mut cache).unwrap();
    }
    let enqueued = start.elapsed().as_secs_f64() * 1e3 / n as f64;
    gpu.synchronize().unwrap();
    let passes = start.elapsed().as_secs_f64() * 1e3 / n as f64;
    let start = Instant::now();
    for _ in 0..n {
        model.logits_at(gpu, 0).unwrap();
    }
    let logits = start.elapsed().as_secs_f64() * 1e3 / n as f64;
    // A new cache filled to two thirds, so that the ops are timed at the contexts above, op by
    // op (a replayed pass times none of its ops).
    gpu.set_graphs(false);
    let mut cache = fill();
    for &t in prompt {
        model.forward_token(gpu, t, &mut cache).unwrap();
    }
    gpu.time_ops(true);
    for &t in prompt {
        model.forward_token(gpu, t, &mut cache).unwrap();
    }
    let ops = gpu.take_op_times().unwrap();
    gpu.time_ops(false);
    gpu.set_graphs(true);
    let device: f64 = ops.iter().map(|o| o.seconds).sum::<f64>() * 1e3 / n as f64;
    let mut top: Vec<_> = ops.iter().collect();
    top.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let top: Vec<String> = top
        .iter()
        .take(6)
        .map(|o| {
            format!(
                "{} {:.1} us ({} calls)",
                o.op,
                o.seconds * 1e6 / n as f64,
                o.calls / n
            )
        })
        .collect();
    figure(
        "sampling qwen2.5-0.5b bf16",
        format!(
            "a {n}-token prompt's pass {prompt_ms:.2} ms (with its cache's allocation and \
             last logits); contexts {}..{}: a token's pass {passes:.2} ms (enqueued in \
             {enqueued:.2}), logits read back {logits:.2} ms, ops' device time {device:.2} ms: {}",
            n,
            3 * n,
            top.join(", ")
        ),
    );
}

/// What the host spends enqueuing each kind of op of a generated token at `config`'s
/// shape: a token's pass is as long as its enqueuing (`decode_step_costs`), so this is where
/// its time goes. Each op is enqueued 200 times with nothing in between, fewer than fill the
/// launch queue, and the device is drained between ops.
fn enqueue_costs(gpu: &smelt::backend::cuda::Cuda, config: &smelt::model::ModelConfig) {
    use smelt::backend::{AttnShape, Matmul};
    use smelt::tensor::TensorSpec;
    let (d, f, w) = (
        config.hidden_size,
        config.intermediate_size,
        config.qkv_dim(),
    );
    let seq = 300;
    let spec = |name: &str, shape: &[usize], dtype| TensorSpec::new(name, shape, dtype);
    let bf = DType::BF16;
    let t = gpu
        .allocate(
            "enqueue costs",
            &[
                spec("x", &[1, d], bf),
                spec("y", &[1, d], bf),
                spec("rstd", &[1], DType::F32),
                spec("norm", &[d], bf),
                spec("w_o", &[d, d], bf),
                spec("w_gate_up", &[2 * f, d], bf),
                spec("gate_up", &[1, 2 * f], bf),
                spec("swiglu", &[1, f], bf),
                spec("qkv", &[seq, w], bf),
                spec("rope", &[1, config.head_dim / 2, 2], DType::F32),
                spec("att", &[1, config.q_dim()], bf),
                spec("at", &[1], DType::I32),
            ],
        )
        .unwrap();
    let [
        x,
        y,
        rstd,
        norm,
        w_o,
        w_gate_up,
        gate_up,
        swiglu,
        qkv,
        rope,
        att,
        at,
    ] = &t[..]
    else {
        unreachable!()
    };
    for t in &t[..t.len() - 1] {
        gpu.fill(t, 0.01).unwrap();
    }
    gpu.upload_i32(at, &[seq as i32 - 1]).unwrap();
    let shape = |seq| AttnShape {
        batch: 1,
        seq,
        q_heads: config.num_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
    };
    let last = qkv.narrow_rows(seq - 1, seq);
    const CALLS: usize = 200;
    let mut lines = vec![];
    let mut time = |name: &str, op: &dyn Fn() -> anyhow::Result<()>| {
        op().unwrap();
        gpu.synchronize().unwrap();
        let start = Instant::now();
        for _ in 0..CALLS {
            op().unwrap();
        }
        let host = start.elapsed().as_secs_f64() * 1e6 / CALLS as f64;
        gpu.synchronize().unwrap();
        let all = start.elapsed().as_secs_f64() * 1e6 / CALLS as f64;
        lines.push(format!("{name} {host:.1} us ({all:.1} with the device)"));
    };
    time("fill", &|| gpu.fill(y, 0.0));
    time("rmsnorm_forward", &|| {
        gpu.rmsnorm_forward(Some(y), rstd, x, None, norm, 1e-6, None)
    });
    time("residual_rmsnorm_forward", &|| {
        let add = ResidualAdd { out: y, branch: y };
        gpu.rmsnorm_forward(Some(x), rstd, x, Some(add), norm, 1e-6, None)
    });
    time("matmul", &|| gpu.matmul(y, x, w_o, None, Matmul::FORWARD));
    time("gate_up_swiglu", &|| {
        gpu.gate_up_swiglu(gate_up, swiglu, x, w_gate_up, None)
    });
    time("rope_forward", &|| {
        gpu.rope_forward(&last, rope, shape(1), None)
    });
    time("attention_decode", &|| {
        gpu.attention_decode(att, qkv, at, shape(seq))
    });
    figure(
        "sampling qwen2.5-0.5b bf16",
        format!("enqueuing one op: {}", lines.join(", ")),
    );
}
