//! Training throughput, as `smelt bench` measures it: a model of any config from random
//! weights, trained on random tokens in bf16 with bf16 Adam states (the rows of the
//! performance table), then timed.
//!
//! A step is what the trainer does for one optimizer step of `accumulation` micro-batches:
//! forward (with the token upload), backward (the target upload, LM head, loss and blocks),
//! the AdamW update, and "other": reading the loss back, which waits for the device, so each
//! step ends with exactly one synchronisation. Run layer-major (`--layer-major`), the forward
//! phase includes each micro-batch's LM head, loss and their backward. After `warmup` steps
//! (kernel compilation, cuBLASLt plans, scratch growth) the median of `steps` steps gives the
//! throughput. The
//! per-phase split comes from a few further steps that also synchronise between phases:
//! those extra waits make them slightly slower, so each phase is reported against the median
//! of the unsynchronised steps. With `op_times`, a last few unsynchronised steps time every
//! backend op on the device (where the backend can: `Backend::time_ops`).

use std::time::Instant;

use anyhow::{Result, bail};

use super::console::memory_total;
use super::metrics;
use super::optimizer::AdamWState;
use super::options::{MemoryOptions, Offload, OptimizerOptions};
use super::trainer;
use crate::backend::Backend;
use crate::backend::op_times::OpTime;
use crate::comm::Solo;
use crate::model::{
    BlockEvent, Documents, Gradients, LossOptions, MatmulPrecision, ModelConfig, Transformer,
};
use crate::rng::Rng;
use crate::tensor::DType;

/// Steps that synchronise between phases, for the split (the median of each phase is taken).
pub const SPLIT_STEPS: usize = 3;
/// Seeds the weights, the tokens and stochastic rounding.
const SEED: u64 = 1;
/// The token that ends the benchmark's documents.
pub const EOS: i32 = 0;
/// A constant learning rate: the schedule costs nothing on the device, and a small rate
/// keeps the random model from diverging over the few steps.
const LR: f32 = 1e-4;

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub batch: usize,
    pub seq: usize,
    /// Micro-batches per step (`--grad-accumulation`).
    pub accumulation: usize,
    /// Steps timed for the median.
    pub steps: usize,
    /// Untimed steps before them.
    pub warmup: usize,
    pub matmul: MatmulPrecision,
    pub memory: MemoryOptions,
    /// The optimizer state in host memory.
    pub offload: Offload,
    /// The dtypes of Adam's first and second moments.
    pub moments: [DType; 2],
    /// Random documents packed into the sequences.
    pub documents: Option<BenchDocuments>,
    /// Also time each op (`BenchReport::ops`).
    pub op_times: bool,
    /// Each block updated in the backward (`block_updates`), without clipping.
    pub in_backward: bool,
    /// Each micro-batch's forward and backward recorded and replayed
    /// (`ModelOptions::record_passes`).
    pub cuda_graphs: bool,
}

/// The benchmark's random documents.
#[derive(Clone, Copy, Debug)]
pub struct BenchDocuments {
    /// What keeps them apart; each ends with `EOS`.
    pub apart: Documents,
    /// Their mean length in tokens.
    pub length: usize,
}

/// The phases of a step, in order.
pub const PHASES: [&str; 4] = ["forward", "backward", "optimizer", "other"];

#[derive(Clone, Debug)]
pub struct BenchReport {
    pub tokens_per_step: usize,
    /// Micro-batches a layer-major pass held (0: one at a time), as `--fit-memory` left it.
    pub layer_major: usize,
    /// Median seconds per step.
    pub step_s: f64,
    pub tokens_per_second: f64,
    /// `None` where the device has no peak figure (the CPU).
    pub mfu: Option<f64>,
    /// Median seconds of each of `PHASES` over the separately synchronised steps.
    pub phases_s: [f64; 4],
    /// Median seconds of those steps as a whole: what the split adds up to, slightly above
    /// `step_s` for the extra waits.
    pub split_step_s: f64,
    /// What `device_bytes` reported after the last step, or else the bytes of every
    /// planned tensor (model and optimizer).
    pub memory_bytes: u64,
    /// Whether `memory_bytes` was measured on the device (else it is the plan).
    pub memory_measured: bool,
    /// All the device's memory in use after the last step, as the driver counts it (with the
    /// CUDA context and the libraries' own), where the backend can tell.
    pub device_in_use: Option<u64>,
    /// The optimizer state and residual stream offloaded to host memory, in bytes (not in
    /// `memory_bytes`).
    pub offloaded_bytes: u64,
    /// The mean per-token loss of the last step.
    pub loss: f64,
    /// With `op_times`, each op's calls and device seconds per step (the mean over
    /// `SPLIT_STEPS` steps), in order of first appearance; empty otherwise, and on backends
    /// that do not time ops.
    pub ops: Vec<OpTime>,
}

/// The optimizer of the benchmark rows: AdamW with bf16 moments updated in place (no master
/// copy, so the bf16 weights are the only copy), β = (0.9, 0.95), clip 1, decay 0.1.
pub fn bf16_adamw_options() -> OptimizerOptions {
    OptimizerOptions {
        beta_1: 0.9,
        beta_2: 0.95,
        adam_eps: 1e-8,
        weight_decay: 0.1,
        grad_clip: 1.0,
        opt_m_dtype: DType::BF16,
        opt_v_dtype: DType::BF16,
        master_dtype: None,
        offload: Offload::default(),
        zero_level: 0,
        in_backward: false,
    }
}

/// The benchmark's optimizer with `o`'s moments, its state on the device; updating in the
/// backward where `o` asks, which cannot clip.
pub fn adamw_options(o: &BenchOptions) -> OptimizerOptions {
    let [opt_m_dtype, opt_v_dtype] = o.moments;
    let defaults = bf16_adamw_options();
    OptimizerOptions {
        opt_m_dtype,
        opt_v_dtype,
        in_backward: o.in_backward,
        grad_clip: if o.in_backward {
            0.0
        } else {
            defaults.grad_clip
        },
        ..defaults
    }
}

/// Benchmarks `config` on `b`. `device_bytes` reads the device's own count of what is
/// allocated, where it keeps one (it is called while everything is still allocated).
pub fn run<B: Backend>(
    b: &B, config: ModelConfig, o: &BenchOptions, device_bytes: impl Fn(&B) -> Result<Option<u64>>,
) -> Result<BenchReport> {
    if o.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if o.accumulation == 0 {
        bail!("--grad-accumulation must be at least 1");
    }
    o.memory.check_layer_major(o.accumulation)?;
    if o.cuda_graphs {
        trainer::check_cuda_graphs(1, o.in_backward)?;
    }
    let flops_per_token = config.training_flops_per_token(o.seq);
    let documents = o.documents.map(|d| d.apart);
    let mut options = (o.memory).model_options(
        o.batch,
        o.seq,
        DType::BF16,
        o.matmul,
        Gradients::All,
        documents,
    );
    options.record_passes = o.cuda_graphs;
    let model = Transformer::new(b, config, options)?;
    model.init_weights(b, SEED)?;
    let optimizer = OptimizerOptions {
        offload: o.offload,
        ..adamw_options(o)
    };
    let opt = AdamWState::new(b, &Solo, &model, optimizer)?;
    let mut bench = Bench {
        b,
        batches: (0..2 * o.accumulation as u64)
            .map(|i| random_batch(&model, i, o.documents.map(|d| d.length)))
            .collect(),
        model,
        opt,
        step: 0,
    };

    for _ in 0..o.warmup {
        bench.step(false)?;
    }
    let mut totals = Vec::with_capacity(o.steps);
    for _ in 0..o.steps {
        totals.push(bench.step(false)?.iter().sum());
    }
    let mut split = vec![vec![]; PHASES.len()];
    let mut split_totals = Vec::with_capacity(SPLIT_STEPS);
    for _ in 0..SPLIT_STEPS {
        let phases = bench.step(true)?;
        split_totals.push(phases.iter().sum());
        for (phase, s) in split.iter_mut().zip(phases) {
            phase.push(s);
        }
    }
    let mut ops = Vec::new();
    if o.op_times {
        b.time_ops(true);
        for _ in 0..SPLIT_STEPS {
            bench.step(false)?;
        }
        b.time_ops(false);
        ops = b.take_op_times()?;
        for op in &mut ops {
            op.calls /= SPLIT_STEPS;
            op.seconds /= SPLIT_STEPS as f64;
        }
    }
    let loss = bench.last_loss()?;
    if !loss.is_finite() {
        bail!("the loss became {loss}: the benchmark diverged and its timings mean nothing");
    }

    let planned = memory_total(&[&bench.model.memory, &bench.opt.memory]);
    let measured = device_bytes(b)?;
    let device_in_use = b.free_memory().map(|(free, total)| (total - free) as u64);
    let offloaded_bytes = memory_total(&[&bench.opt.offloaded, &bench.model.offloaded]);

    let tokens_per_step = bench.model.tokens_per_step() * o.accumulation;
    let step_s = median(&mut totals);
    let tokens_per_second = tokens_per_step as f64 / step_s;
    Ok(BenchReport {
        tokens_per_step,
        layer_major: o.memory.layer_major,
        step_s,
        tokens_per_second,
        mfu: metrics::mfu(
            flops_per_token,
            tokens_per_second,
            b.peak_flops(DType::BF16),
        ),
        phases_s: std::array::from_fn(|i| median(&mut split[i])),
        split_step_s: median(&mut split_totals),
        memory_bytes: measured.unwrap_or(planned),
        memory_measured: measured.is_some(),
        device_in_use,
        offloaded_bytes,
        loss,
        ops,
    })
}

struct Bench<'a, B: Backend> {
    b: &'a B,
    model: Transformer<B>,
    opt: AdamWState<B>,
    /// (tokens, targets) of two steps' micro-batches, the steps taking them in turn.
    batches: Vec<(Vec<i32>, Vec<i32>)>,
    /// Steps taken, which is also the last step's number (AdamW counts from 1).
    step: u64,
}

impl<B: Backend> Bench<'_, B> {
    /// One training step; returns the seconds spent in each of `PHASES`. With `split`, the
    /// device is synchronised after every phase; otherwise only the loss readback waits,
    /// and only the sum of the phases means anything.
    fn step(&mut self, split: bool) -> Result<[f64; 4]> {
        let b = self.b;
        let n = self.batches.len() / 2;
        let first = (self.step as usize % 2) * n;
        let batches = &self.batches[first..first + n];
        self.step += 1;
        let loss = LossOptions {
            grad_scale: 1.0 / (n * batches[0].1.len()) as f32,
            z_loss: 0.0,
            accumulate: false,
        };
        // The device is idle at the start, so the step's time is its own.
        b.synchronize()?;
        let mut phases = [0.0; 4];
        let mut since = Instant::now();
        let mut lap = |phase: usize| -> Result<()> {
            if split {
                b.synchronize()?;
            }
            phases[phase] += since.elapsed().as_secs_f64();
            since = Instant::now();
            Ok(())
        };
        let (opt, step) = (&self.opt, self.step);
        let updates = opt.options.in_backward;
        let mut events = |event: BlockEvent<B>| match event {
            BlockEvent::Update {
                layer,
                weights,
                grads,
            } => opt.update_block(b, layer, weights, grads, LR, step, SEED),
            _ => Ok(()),
        };
        let per_pass = self.model.options.micro_batches;
        if per_pass > 1 {
            for (i, pass) in batches.chunks(per_pass).enumerate() {
                let tokens: Vec<&[i32]> = pass.iter().map(|(t, _)| &t[..]).collect();
                let targets: Vec<&[i32]> = pass.iter().map(|(_, t)| &t[..]).collect();
                let loss = LossOptions {
                    accumulate: i > 0,
                    ..loss
                };
                (self.model).forward_layer_major(b, &tokens, &targets, loss, &mut |_| Ok(()))?;
                lap(0)?;
                let updates = updates && (i + 1) * per_pass >= n;
                if updates {
                    opt.begin_block_updates(b)?;
                }
                (self.model).backward_layer_major(b, i > 0, &mut events, updates)?;
                lap(1)?;
            }
        } else {
            for (k, (tokens, targets)) in batches.iter().enumerate() {
                let loss = LossOptions {
                    accumulate: k > 0,
                    ..loss
                };
                self.model.forward_hidden(b, tokens)?;
                lap(0)?;
                match updates && k == n - 1 {
                    true => {
                        opt.begin_block_updates(b)?;
                        (self.model).backward_updating(b, targets, loss, &mut events)?
                    }
                    false => self.model.backward(b, targets, loss, &mut |_| Ok(()))?,
                }
                lap(1)?;
            }
        }
        self.opt.step(b, &Solo, &self.model, LR, self.step, SEED)?;
        lap(2)?;
        self.model.loss_sum(b)?;
        lap(3)?;
        Ok(phases)
    }

    fn last_loss(&self) -> Result<f64> {
        Ok(self.model.loss_sum(self.b)? / self.model.tokens_per_step() as f64)
    }
}

/// Uniformly random tokens, each target the next token, from the `index`th stream. With
/// `doc_length`, an `EOS` ends each document, of a length drawn uniformly from [L/2, 3L/2],
/// and the other tokens are never it.
fn random_batch<B: Backend>(
    model: &Transformer<B>, index: u64, doc_length: Option<usize>,
) -> (Vec<i32>, Vec<i32>) {
    let mut rng = Rng::derived(SEED, index);
    let vocab = model.config.vocab_size;
    let document = |rng: &mut Rng| doc_length.map(|l| l / 2 + rng.below(l + 1));
    let mut left = document(&mut rng);
    let stream: Vec<i32> = (0..=model.tokens_per_step())
        .map(|_| match &mut left {
            None => rng.below(vocab) as i32,
            Some(0 | 1) => {
                left = document(&mut rng);
                EOS
            }
            Some(n) => {
                *n -= 1;
                1 + rng.below(vocab - 1) as i32
            }
        })
        .collect();
    let n = stream.len() - 1;
    (stream[..n].to_vec(), stream[1..].to_vec())
}

/// The median (the upper one of an even count).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
