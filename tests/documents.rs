//! Packed documents on the CPU: with `--doc-mask --doc-positions` each document of a packed
//! batch gets the logits, losses and gradients it gets alone, as a batch of its own; with
//! `--doc-mask` alone the same logits (RoPE's scores depend only on the distance between
//! positions); recomputing gives the same bits; and unmasked, the documents do see each other.

mod common;

use common::*;
use smelt::backend::AttnShape;
use smelt::backend::cpu::Cpu;
use smelt::backend::prelude::*;
use smelt::model::documents::spans;
use smelt::model::{Documents, LossOptions, ModelConfig, ModelOptions, Recompute, Transformer};
use smelt::rng::Rng;
use smelt::tensor::{DType, TensorSpec};

const BATCH: usize = 2;
const SEQ: usize = 40;
/// The documents' mean length: several a sequence, some shorter than a tile of anything.
const MEAN: usize = 6;

/// `--doc-mask --doc-positions`, and `--doc-mask` alone.
const BOTH: Documents = Documents {
    eos: EOS,
    mask: true,
    positions: true,
};
const MASK_ONLY: Documents = Documents {
    positions: false,
    ..BOTH
};

type B = Cpu<f64>;

/// What a pass gives each position and parameter.
struct Pass {
    /// Each position's logits.
    logits: Vec<Vec<f32>>,
    losses: Vec<f64>,
    grads: Vec<(String, Vec<f64>)>,
}

/// Forward, each position's logits, then the backward with every loss scaled by `scale`.
fn pass(cpu: &B, model: &mut Transformer<B>, tokens: &[i32], targets: &[i32], scale: f64) -> Pass {
    model.forward_hidden(cpu, tokens).unwrap();
    let logits = (0..tokens.len())
        .map(|t| model.logits_at(cpu, t).unwrap())
        .collect();
    let loss = LossOptions {
        grad_scale: scale as f32,
        z_loss: 1e-4,
        accumulate: false,
    };
    model.backward(cpu, targets, loss, &mut |_| Ok(())).unwrap();
    Pass {
        logits,
        losses: cpu.download_f64(model.losses()).unwrap(),
        grads: gradients(cpu, model),
    }
}

fn packed_options(documents: Option<Documents>, recompute: Recompute) -> ModelOptions {
    ModelOptions {
        documents,
        ..options(BATCH, SEQ, DType::F64, recompute, 1)
    }
}

/// The packed model on random weights, and a pass of `tokens` through it.
fn packed(
    cpu: &B, config: &ModelConfig, documents: Option<Documents>, recompute: Recompute,
    (tokens, targets): (&[i32], &[i32]),
) -> (Transformer<B>, Pass) {
    let mut model =
        Transformer::new(cpu, config.clone(), packed_options(documents, recompute)).unwrap();
    randomize(cpu, &model, 5);
    let scale = 1.0 / trained_tokens(targets) as f64;
    let pass = pass(cpu, &mut model, tokens, targets, scale);
    (model, pass)
}

/// Each document of the batch: its sequence and its span in it.
fn documents(tokens: &[i32]) -> Vec<(usize, usize, usize)> {
    let spans = spans(tokens, SEQ, EOS);
    let mut docs = vec![];
    for b in 0..BATCH {
        let mut t = 0;
        while t < SEQ {
            let end = spans[(BATCH + b) * SEQ + t] as usize;
            docs.push((b, t, end));
            t = end;
        }
    }
    docs
}

fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-300f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

fn logits_of(logits: &[Vec<f32>]) -> Vec<f64> {
    logits.iter().flatten().map(|&x| x as f64).collect()
}

#[test]
fn each_packed_document_trains_as_it_would_alone() {
    let cpu = B::new();
    for (name, config) in tiny_configs() {
        let (tokens, targets) = packed_batch(BATCH * SEQ, SEQ, MEAN, config.vocab_size, 11);
        let (model, packed) = packed(
            &cpu,
            &config,
            Some(BOTH),
            Recompute::default(),
            (&tokens, &targets),
        );
        let scale = 1.0 / trained_tokens(&targets) as f64;
        let docs = documents(&tokens);
        assert!(docs.len() >= 2 * BATCH * SEQ / MEAN / 3, "{name}: {docs:?}");
        let mut summed: Vec<Vec<f64>> = packed
            .grads
            .iter()
            .map(|(_, g)| vec![0.0; g.len()])
            .collect();
        for &(b, start, end) in &docs {
            let range = b * SEQ + start..b * SEQ + end;
            let options = options(1, end - start, DType::F64, Recompute::default(), 1);
            let mut alone = Transformer::sharing_weights(&cpu, &model, options).unwrap();
            let own = pass(
                &cpu,
                &mut alone,
                &tokens[range.clone()],
                &targets[range.clone()],
                scale,
            );
            let what = format!("{name}: document [{start}, {end}) of sequence {b}");
            let logits = max_rel_diff(
                &logits_of(&packed.logits[range.clone()]),
                &logits_of(&own.logits),
            );
            assert!(logits < 1e-6, "{what}: logits differ by {logits:e}");
            let losses = max_rel_diff(&packed.losses[range], &own.losses);
            assert!(losses < 1e-12, "{what}: losses differ by {losses:e}");
            for (sum, (_, g)) in summed.iter_mut().zip(&own.grads) {
                sum.iter_mut().zip(g).for_each(|(s, x)| *s += x);
            }
        }
        for ((param, g), sum) in packed.grads.iter().zip(&summed) {
            let diff = max_rel_diff(g, sum);
            assert!(
                diff < 1e-11,
                "{name}: {param}'s gradient differs from its documents' sum by {diff:e}"
            );
        }
    }
}

#[test]
fn documents_recompute_to_the_same_bits() {
    let cpu = B::new();
    let config = tiny_config("Qwen2ForCausalLM", false);
    let (tokens, targets) = packed_batch(BATCH * SEQ, SEQ, MEAN, config.vocab_size, 12);
    let batch = (tokens.as_slice(), targets.as_slice());
    let (_, kept) = packed(&cpu, &config, Some(BOTH), Recompute::default(), batch);
    let (_, recomputed) = packed(&cpu, &config, Some(BOTH), Recompute::all(), batch);
    assert_eq!(kept.losses, recomputed.losses);
    for ((param, a), (_, b)) in kept.grads.iter().zip(&recomputed.grads) {
        assert!(
            a == b,
            "{param}: the recomputed backward's gradient differs"
        );
    }
}

#[test]
fn masked_documents_see_only_themselves_whatever_their_positions() {
    let cpu = B::new();
    let config = tiny_config("LlamaForCausalLM", false);
    let (tokens, targets) = packed_batch(BATCH * SEQ, SEQ, MEAN, config.vocab_size, 13);
    let batch = (tokens.as_slice(), targets.as_slice());
    let (model, mask_only) = packed(&cpu, &config, Some(MASK_ONLY), Recompute::default(), batch);
    let (_, unmasked) = packed(&cpu, &config, None, Recompute::default(), batch);
    let mut later_documents_differ = 0;
    for &(b, start, end) in &documents(&tokens) {
        let range = b * SEQ + start..b * SEQ + end;
        let options = options(1, end - start, DType::F64, Recompute::default(), 1);
        let mut alone = Transformer::sharing_weights(&cpu, &model, options).unwrap();
        alone.forward_hidden(&cpu, &tokens[range.clone()]).unwrap();
        let own: Vec<Vec<f32>> = (0..end - start)
            .map(|t| alone.logits_at(&cpu, t).unwrap())
            .collect();
        let own = logits_of(&own);
        // The same scores at other absolute positions: RoPE rotates queries and keys alike.
        let diff = max_rel_diff(&logits_of(&mask_only.logits[range.clone()]), &own);
        assert!(
            diff < 1e-6,
            "document [{start}, {end}) of sequence {b}: {diff:e}"
        );
        // Unmasked, a document after the first sees those before it.
        if start > 0 && max_rel_diff(&logits_of(&unmasked.logits[range]), &own) > 1e-3 {
            later_documents_differ += 1;
        }
    }
    assert!(
        later_documents_differ > 0,
        "unmasked documents should see each other"
    );
}

/// RoPE with `--doc-positions` rotates each document's rows as it rotates that document
/// alone, forward and backward, bit for bit (the positions are what differ, and with them the
/// table's rows; the model's tests above cannot tell, RoPE's scores being relative).
#[test]
fn rope_positions_restart_at_each_document() {
    let cpu = B::new();
    let s = AttnShape {
        batch: BATCH,
        seq: SEQ,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let (tokens, _) = packed_batch(BATCH * SEQ, SEQ, MEAN, 50, 14);
    let docs = spans(&tokens, SEQ, EOS);
    let mut rng = Rng::new(15);
    let mut draw = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32).collect() };
    let (qkv, table) = (draw(BATCH * SEQ * s.qkv_width()), draw(SEQ * s.head_dim));
    let tensor = |shape: &[usize], values: &[f32]| {
        let t = cpu
            .allocate("test", &[TensorSpec::new("t", shape, DType::F64)])
            .unwrap()
            .remove(0);
        cpu.upload(&t, values).unwrap();
        t
    };
    let freqs = tensor(&[SEQ, s.head_dim / 2, 2], &table);
    let spans_t = cpu
        .allocate(
            "test",
            &[TensorSpec::new("docs", &[2, BATCH * SEQ], DType::I32)],
        )
        .unwrap()
        .remove(0);
    cpu.upload_i32(&spans_t, &docs).unwrap();
    let w = s.qkv_width();
    for inverse in [false, true] {
        let packed = tensor(&[BATCH * SEQ, w], &qkv);
        match inverse {
            false => cpu
                .rope_forward(&packed, &freqs, s, Some(&spans_t))
                .unwrap(),
            true => cpu
                .rope_backward(&packed, &freqs, s, Some(&spans_t), None, None)
                .unwrap(),
        }
        let packed = cpu.download_f64(&packed).unwrap();
        for &(b, start, end) in &documents(&tokens) {
            let rows = (b * SEQ + start) * w..(b * SEQ + end) * w;
            let alone = tensor(&[end - start, w], &qkv[rows.clone()]);
            let one = AttnShape {
                batch: 1,
                seq: end - start,
                ..s
            };
            match inverse {
                false => cpu.rope_forward(&alone, &freqs, one, None).unwrap(),
                true => cpu
                    .rope_backward(&alone, &freqs, one, None, None, None)
                    .unwrap(),
            }
            assert!(
                packed[rows] == cpu.download_f64(&alone).unwrap()[..],
                "document [{start}, {end}) of sequence {b} (inverse: {inverse})"
            );
        }
    }
}
