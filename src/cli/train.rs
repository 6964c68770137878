//! `smelt train`: the command line of a training run. With no data arguments it runs the
//! built-in demo (see `train::demo`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;

use super::flags::{
    DocumentFlags, FitMemoryFlag, LayerMajorFlag, OffloadFlags, Precision, PrecisionFlags,
    RecomputeFlags, SmallerBatch, check_floats, parse_flags,
};
use crate::backend::Backend;
use crate::backend::select::{Device, DeviceChoice, select};
use crate::backend::telemetry::Telemetry;
use crate::comm::Comm;
use crate::comm::ranks::{RankMain, Ranks, on_ranks};
use crate::generate::{Generator, SampleOptions, Sampling};
use crate::io::hf;
use crate::model::{Documents, Recompute};
use crate::plan::Request;
use crate::tensor::DType;
use crate::tokenize::encoder::Encoder;
use crate::train::guard::{GuardOptions, OnSpike};
use crate::train::inject::Injection;
use crate::train::options::{Defaults, MemoryOptions, Offload, OptimizerOptions, Resolved};
use crate::train::schedule::Decay;
use crate::train::{ModelSource, Options, Summary, demo};

/// Defaults of an ordinary run (the demo has its own, in `train::demo::DEFAULTS`).
const DEFAULTS: Defaults = Defaults {
    batch_size: 4,
    seq_len: 1024,
    steps: None,
    lr: 3e-4,
    warmup: 0,
    final_lr_fraction: 0.1,
    model_dtype: DType::BF16,
    eval_every_n_steps: 100,
    eval_num_steps: 20,
};

#[derive(Args, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Train or fine-tune a model; with no data arguments, run the built-in demo",
    after_help = "With no --train-file, smelt trains a small byte-level Llama on the text built \
into the binary (its README and sources), writes a log and a model under --demo-dir, and ends \
with a sample. Options given on the command line override the demo's settings.\n\nFlags marked \"not \
implemented yet\" are accepted only at their default value, and refused otherwise."
)]
pub struct TrainArgs {
    // ----- model and data -----
    /// HF model directory to fine-tune (config.json + model.safetensors); with
    /// --from-scratch, only its config.json is read. Its tokenizer files are copied to
    /// --out-dir. With --from-scratch it may instead name a built-in architecture:
    /// qwen2.5-0.5b, -1.5b, -3b, qwen2-100m, qwen3-0.6b, -1.7b, -4b, -8b, llama-3.2-1b or
    /// llama-3-8b.
    #[arg(long, value_name = "DIR|NAME", help_heading = "Model and data")]
    model: Option<PathBuf>,
    /// Start from random weights (seeded by --seed) instead of --model's weights.
    #[arg(long, help_heading = "Model and data")]
    from_scratch: bool,
    /// Training token files (llm.q BIN.TOK, as `smelt tokenize` writes): a path or a glob
    /// such as 'data/train-*.bin' (quote it).
    #[arg(long, value_name = "GLOB", help_heading = "Model and data")]
    train_file: Option<String>,
    /// Eval token files, read in order: a path or a glob.
    #[arg(long, value_name = "GLOB", help_heading = "Model and data")]
    eval_file: Option<String>,
    /// Where the demo writes its token files, and by default its log and model.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "smelt-demo",
        help_heading = "Model and data"
    )]
    demo_dir: PathBuf,
    #[command(flatten)]
    documents: DocumentFlags,
    /// The token that ends each document in --train-file and --eval-file, for --doc-mask and
    /// --doc-positions [default: the EOS that --model's tokenizer files name, which `smelt
    /// tokenize` appended].
    #[arg(long, value_name = "ID", help_heading = "Model and data")]
    eos_id: Option<u32>,

    // ----- batch and schedule -----
    /// Sequences per micro-batch [default: 4; demo 16].
    #[arg(long, help_heading = "Batch and schedule")]
    batch_size: Option<usize>,
    /// Tokens per sequence [default: 1024; demo 128].
    #[arg(long, help_heading = "Batch and schedule")]
    seq_len: Option<usize>,
    /// Micro-batches per optimizer step; the gradient is the mean over all their trained
    /// tokens.
    #[arg(long, default_value_t = 1, help_heading = "Batch and schedule")]
    grad_accumulation: usize,
    /// Optimizer steps [default: one epoch of --train-file; demo 250].
    #[arg(long, help_heading = "Batch and schedule")]
    steps: Option<u64>,
    /// Peak learning rate [default: 3e-4; demo 3e-3].
    #[arg(long, help_heading = "Batch and schedule")]
    lr: Option<f64>,
    /// Steps of linear warmup from 0 to --lr; one longer than the run is shortened to it,
    /// with a warning [default: 0; demo 20].
    #[arg(long, help_heading = "Batch and schedule")]
    warmup: Option<u64>,
    /// Shape of the decay after warmup.
    #[arg(long, value_enum, default_value_t = Decay::Cosine, help_heading = "Batch and schedule")]
    lr_schedule: Decay,
    /// The decay ends at this fraction of --lr [default: 0.1].
    #[arg(long, help_heading = "Batch and schedule")]
    final_lr_fraction: Option<f64>,
    /// Steps at the end that ramp the rate linearly down towards 0 (after the decay).
    #[arg(long, default_value_t = 0, help_heading = "Batch and schedule")]
    cooldown: u64,
    /// Seeds initialisation, data order and stochastic rounding.
    #[arg(long, default_value_t = 42, help_heading = "Batch and schedule")]
    seed: u64,

    // ----- optimizer -----
    /// AdamW decoupled weight decay, applied to matrices and embeddings only.
    #[arg(long, default_value_t = 0.1, help_heading = "Optimizer")]
    weight_decay: f64,
    /// Clip the global gradient norm to this; 0 disables clipping.
    #[arg(long, default_value_t = 1.0, help_heading = "Optimizer")]
    grad_clip: f64,
    /// AdamW β1.
    #[arg(long = "beta-1", default_value_t = 0.9, help_heading = "Optimizer")]
    beta_1: f64,
    /// AdamW β2.
    #[arg(long = "beta-2", default_value_t = 0.95, help_heading = "Optimizer")]
    beta_2: f64,
    /// AdamW ε.
    #[arg(long, default_value_t = 1e-8, help_heading = "Optimizer")]
    adam_eps: f64,
    /// Update each block in the step's last backward, as soon as its gradients are final,
    /// beside the backward of the blocks below, instead of after the whole backward; with
    /// --offload-gradients the gradients then never leave the GPU, and offloaded optimizer
    /// state streams through it. The same results, but it cannot wait for the step's norm
    /// or loss: needs one GPU, --grad-clip 0 and --on-spike warn, and a step that is not
    /// finite stops the run instead of being skipped.
    #[arg(long, help_heading = "Optimizer")]
    optimizer_in_backward: bool,
    /// Adds z · logsumexp² to each token's loss, keeping logits from drifting.
    #[arg(long, default_value_t = 0.0, help_heading = "Optimizer")]
    z_loss: f64,

    #[command(flatten)]
    precision: PrecisionFlags,

    // ----- memory -----
    #[command(flatten)]
    recompute: RecomputeFlags,
    /// Run the LM head and loss over the tokens in this many chunks, so that the full
    /// batch × vocabulary logits never exist at once.
    #[arg(long, default_value_t = 1, help_heading = "Memory")]
    lmhead_chunks: usize,
    /// Run each block's MLP over the tokens in this many chunks, so that its intermediates
    /// (the widest activations) exist one chunk at a time. Needs --recompute-ffn or
    /// --recompute-block, and bf16 or f32 matmuls.
    #[arg(long, default_value_t = 1, help_heading = "Memory")]
    ffn_chunks: usize,
    /// Keep the f32 master weights in pinned host memory; the optimizer updates them over
    /// the bus.
    #[arg(long, help_heading = "Memory")]
    offload_master: bool,
    #[command(flatten)]
    layer_major: LayerMajorFlag,
    #[command(flatten)]
    offload: OffloadFlags,

    // ----- devices -----
    /// Where to run: the GPU when the driver reports one, else the CPU.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto, help_heading = "Devices")]
    device: DeviceChoice,
    /// GPUs to train on, data parallel, a thread each: each takes --batch-size sequences of
    /// every step, and NCCL sums the gradients. With --device cpu, this many CPU ranks in one
    /// process, exchanging through host memory (how the multi-GPU logic is tested without
    /// GPUs). Leave it out under a launcher (torchrun, srun, mpirun), which starts one
    /// process per GPU; each reads its rank from the launcher's variables.
    #[arg(long, default_value_t = 1, help_heading = "Devices")]
    gpus: usize,
    /// ZeRO sharding over the ranks: 1 shares the optimizer state (Adam's moments and the
    /// master weights) out between them, each GPU updating its share of the weights and
    /// sending them to the others; 2 also shares out the blocks' gradients, each GPU
    /// keeping memory for those of the blocks it updates; 3 also the blocks' weights, each
    /// block's sent from its GPU to the others before each pass reads it; 0 keeps all of it
    /// on every GPU. The same results (levels 2 and 3 with --grad-accumulation: sums in
    /// another order).
    #[arg(long, default_value_t = 0, help_heading = "Devices")]
    zero_level: u8,
    /// With several ranks, how long a rank waits for the others to meet it (and for rank 0's
    /// store, at the start), and how long the GPUs may all wait on their devices, before the
    /// run stops as stuck (a rank, kernel or collective that does not end) with an error
    /// naming what it waited for.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 600,
        help_heading = "Devices"
    )]
    comm_timeout: u64,
    /// Sum the gradients over the --gpus after the whole backward, instead of each block's
    /// as soon as the backward has finished it, beside the rest. The same results; faster
    /// only where the sums are short, as over NVLink for small models.
    #[arg(long, help_heading = "Devices")]
    grad_sum_after_backward: bool,
    #[command(flatten, next_help_heading = "Memory")]
    fit_memory: FitMemoryFlag,
    /// Record each micro-batch's forward and backward as CUDA graphs in the second step and
    /// replay them from then on: the same results, without the gaps between launching their
    /// many kernels, which show at small batches. One GPU; not with the offloads of
    /// activations, weights or gradients, --layer-major, --optimizer-in-backward or
    /// --int8-stochastic-rounding.
    #[arg(long, help_heading = "Devices")]
    use_cuda_graphs: bool,

    // ----- output -----
    /// Write a checkpoint every N steps (and at the end); 0 for none.
    #[arg(long, default_value_t = 0, help_heading = "Output")]
    ckpt_interval: u64,
    /// Directory of the checkpoints, one step-N directory each plus a `latest` pointer
    /// [default: checkpoints; demo: --demo-dir/checkpoints].
    #[arg(long, value_name = "DIR", help_heading = "Output")]
    checkpoint_dir: Option<PathBuf>,
    /// Continue exactly from the latest checkpoint in --checkpoint-dir, with the same
    /// model, data, batch shape, dtypes and seed.
    #[arg(long = "continue", help_heading = "Output")]
    resume: bool,
    /// Write the trained model here as a HF directory (config.json + model.safetensors +
    /// the tokenizer files of --model): a new or empty directory, checked before training,
    /// unless the run continues one (--continue), whose model it replaces [demo:
    /// --demo-dir/model, whose earlier model the demo replaces].
    #[arg(long, value_name = "DIR", help_heading = "Output")]
    out_dir: Option<PathBuf>,
    /// Append the run's events (options, steps, evals, checkpoints) to this JSON Lines
    /// file, for `smelt plot` [demo: --demo-dir/log.jsonl].
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    log_file: Option<PathBuf>,
    /// Write the scalars of the run's events (loss, gradient norm, learning rate, tok/s,
    /// MFU, eval losses, memory) to a new TensorBoard event file in this directory, as they
    /// happen: watch it with `tensorboard --logdir DIR`.
    #[arg(long, value_name = "DIR", help_heading = "Output")]
    tensorboard_dir: Option<PathBuf>,
    /// Evaluate every N steps on the first --eval-num-steps batches of --eval-file (0: not
    /// during the run); a full eval over all of it always ends the run [default: 100; demo 50].
    #[arg(long, help_heading = "Output")]
    eval_every_n_steps: Option<u64>,
    /// Batches in each periodic eval [default: 20; demo 8].
    #[arg(long, help_heading = "Output")]
    eval_num_steps: Option<usize>,
    /// Every N steps, log the FP8 abs-max of each linear layer's input, weight and output
    /// gradient (JSONL `abs_max` events), for diagnosing divergence; 0 for never.
    #[arg(long, default_value_t = 0, help_heading = "Precision")]
    debug_log_abs_max: u64,
    /// Every N steps, log each GPU's utilisation, SM clock, power, temperature and memory
    /// (a `[G]` line, JSONL `gpu_util` events), read through NVML: every GPU of this process
    /// (under a launcher, rank 0's own); 0 for never. GPUs only.
    #[arg(long, value_name = "N", default_value_t = 0, help_heading = "Output")]
    log_gpu_util: u64,

    // ----- health and guards -----
    /// Every N steps, log the training health (JSONL `health` events): the gradient norm
    /// before and after clipping, and the gradient norm, weight norm and ‖update‖/‖weights‖
    /// overall, per block and per tensor family; 0 for never. Such a step reads every
    /// weight into host memory twice, one tensor at a time.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        help_heading = "Health and guards"
    )]
    health_every: u64,
    /// Stop the run once this many steps in a row have been skipped (a loss or gradient norm
    /// that is not finite is never applied to the weights; nor, with --on-spike skip, a loss
    /// spike): the last checkpoint keeps the last good step.
    #[arg(
        long,
        value_name = "K",
        default_value_t = 10,
        help_heading = "Health and guards"
    )]
    max_skipped_steps: u64,
    /// Losses the spike detector remembers: a loss is a spike when it stands more than
    /// --spike-zscore standard deviations above their mean (judged once it holds them all).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 128,
        help_heading = "Health and guards"
    )]
    spike_window: usize,
    /// Standard deviations above the window's mean that make a loss a spike; 0 turns the
    /// detector off.
    #[arg(
        long,
        value_name = "Z",
        default_value_t = 5.0,
        help_heading = "Health and guards"
    )]
    spike_zscore: f64,
    /// What a loss spike does: `warn` logs it (a `spike` event) and applies the update;
    /// `skip` logs it and skips the step's update.
    #[arg(long, value_enum, default_value_t = OnSpike::Warn, help_heading = "Health and guards")]
    on_spike: OnSpike,
    /// Inject faults, for testing the guards: FAULT@STEP, comma-separated; FAULT is
    /// nan-grad (a gradient becomes NaN on the device), nan-loss or spike (the loss reads
    /// NaN, or 10× itself).
    #[arg(
        long,
        value_name = "FAULT@STEP,...",
        value_delimiter = ',',
        help_heading = "Health and guards"
    )]
    debug_inject: Vec<Injection>,
}

/// `smelt train`'s flags without the data, parsed and checked as `smelt train` does: for a
/// caller that brings each batch itself (the Python package). `args` are the flags alone.
pub fn resolve_without_data(args: &[String]) -> Result<Resolved> {
    let mut flags: TrainArgs = parse_flags("smelt.Trainer", args)?;
    if flags.train_file.is_some() {
        bail!("train_file: the caller brings each batch; give the tokens to step() instead");
    }
    flags.train_file = Some(String::new());
    flags.resolve()
}

impl TrainArgs {
    pub fn run(self) -> Result<()> {
        let demo_data = self
            .train_file
            .is_none()
            .then(|| self.demo_dir.join("data"));
        let Resolved {
            options,
            device,
            ranks,
            timeout,
            telemetry,
        } = self.resolve()?;
        let rank = TrainRank {
            options,
            demo_data,
            telemetry,
        };
        on_ranks(device, ranks, timeout, rank)
    }

    /// The options, ranks and device that the flags ask for, checked.
    fn resolve(self) -> Result<Resolved> {
        self.refuse_unimplemented()?;
        if self.comm_timeout == 0 {
            bail!("--comm-timeout 0: give the seconds a rank may wait for the others, 1 or more");
        }
        let ranks = Ranks::new(self.gpus)?;
        let device = select(self.device, ranks.device_index())?;
        // Rank 0 reads the GPUs; the processes of other ranks need no NVML.
        let telemetry = match (&device, self.log_gpu_util) {
            (_, 0) => None,
            (Device::Cpu(_), _) => bail!(
                "--log-gpu-util reads GPUs through NVML, and this run is on the CPU (--device \
                 cpu, or no GPU found); leave it out, or train on a GPU"
            ),
            (Device::Cuda(_), _) if !ranks.has_rank_0() => None,
            (Device::Cuda(gpu), _) => Some(Telemetry::open(&ranks.process_gpus(gpu.ordinal()))?),
        };
        let chosen_by_hand = [
            self.recompute.recompute() != Recompute::default(),
            self.offload.offload(self.offload_master) != Offload::default(),
            self.offload.residual(),
            self.offload.activations(),
            self.offload.weights(),
            self.offload.gradients(),
            self.lmhead_chunks != 1,
            self.ffn_chunks != 1,
            self.zero_level != 0,
        ];
        self.fit_memory
            .check(&device, chosen_by_hand.contains(&true))?;
        let mut options = self.options(matches!(device, Device::Cuda(_)))?;
        if let Some(choice) =
            self.fit_memory
                .choose(&device, SmallerBatch::WithAccumulation, || {
                    Request::for_training(&options, ranks.world())
                })?
        {
            options.memory = choice.memory;
            options.optimizer.offload = choice.offload;
            options.optimizer.zero_level = choice.zero_level;
        }
        if options.optimizer.zero_level >= 2 && options.grad_sum_after_backward {
            bail!(
                "--grad-sum-after-backward cannot be used with --zero-level 2 or 3, which send each \
                 block's gradients to its GPU during the backward to free their memory; leave \
                 one of them out"
            );
        }
        Ok(Resolved {
            options,
            device,
            ranks,
            timeout: Duration::from_secs(self.comm_timeout),
            telemetry,
        })
    }

    /// Resolves the command line into the run's options.
    fn options(&self, on_gpu: bool) -> Result<Options> {
        let demo = self.train_file.is_none();
        let mut d = if demo { demo::DEFAULTS } else { DEFAULTS };
        if on_gpu {
            // The demo runs in f32 on the CPU, where that is fastest; on a GPU, in bf16.
            d.model_dtype = DType::BF16;
        }
        if demo && (self.model.is_some() || self.eval_file.is_some() || self.from_scratch) {
            bail!(
                "--model, --from-scratch and --eval-file need --train-file (without data arguments, smelt train runs its built-in demo)"
            );
        }
        let Precision {
            model_dtype,
            matmul,
            master_dtype,
            opt_m_dtype,
            opt_v_dtype,
        } = self.precision.resolve(d.model_dtype)?;
        if self.debug_log_abs_max > 0 && !matmul.is_fp8() {
            bail!("--debug-log-abs-max logs FP8 statistics; it needs --matmul-dtype e4m3");
        }
        if self.offload_master && master_dtype.is_none() {
            bail!(
                "--offload-master: this run keeps no master copy of the weights (--model-dtype \
                 {model_dtype} is updated in place); leave it out"
            );
        }
        let batch_size = self.batch_size.unwrap_or(d.batch_size);
        let seq_len = self.seq_len.unwrap_or(d.seq_len);
        let eval_num_steps = self.eval_num_steps.unwrap_or(d.eval_num_steps);
        let positive = [
            ("--batch-size", batch_size),
            ("--seq-len", seq_len),
            ("--grad-accumulation", self.grad_accumulation),
            ("--lmhead-chunks", self.lmhead_chunks),
            ("--ffn-chunks", self.ffn_chunks),
            ("--eval-num-steps", eval_num_steps),
            ("--max-skipped-steps", self.max_skipped_steps as usize),
        ];
        if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
            bail!("{flag} must be at least 1");
        }
        if self.spike_window < 2 {
            bail!(
                "--spike-window {}: must be at least 2 (a spread needs two losses)",
                self.spike_window
            );
        }
        let final_lr_fraction = self.final_lr_fraction.unwrap_or(d.final_lr_fraction);
        let lr = self.lr.unwrap_or(d.lr);
        let decay_rule = format!(
            "must be at least 0, and with --lr {lr} below {:.3e} (each step scales the weights by 1 - lr · decay)",
            1.0 / lr
        );
        check_floats(&[
            ("--lr", lr, lr > 0.0, "must be positive"),
            (
                "--final-lr-fraction",
                final_lr_fraction,
                (0.0..=1.0).contains(&final_lr_fraction),
                "must be between 0 and 1",
            ),
            (
                "--beta-1",
                self.beta_1,
                self.beta_1 >= 0.0 && (self.beta_1 as f32) < 1.0,
                "must be at least 0 and below 1 in f32 (the bias correction divides by 1 - beta^t)",
            ),
            (
                "--beta-2",
                self.beta_2,
                self.beta_2 >= 0.0 && (self.beta_2 as f32) < 1.0,
                "must be at least 0 and below 1 in f32 (the bias correction divides by 1 - beta^t)",
            ),
            (
                "--adam-eps",
                self.adam_eps,
                self.adam_eps > 0.0,
                "must be positive (with 0, a weight whose gradient has always been 0 divides 0 by 0)",
            ),
            (
                "--weight-decay",
                self.weight_decay,
                self.weight_decay >= 0.0 && lr * self.weight_decay < 1.0,
                &decay_rule,
            ),
            (
                "--grad-clip",
                self.grad_clip,
                self.grad_clip >= 0.0,
                "must not be negative (0 turns clipping off)",
            ),
            (
                "--spike-zscore",
                self.spike_zscore,
                self.spike_zscore >= 0.0,
                "must not be negative (0 turns the spike detector off)",
            ),
            (
                "--z-loss",
                self.z_loss,
                (0.0..1.0).contains(&self.z_loss),
                "must be at least 0 and below 1 (a coefficient on log(Z)²; 1e-4 is usual)",
            ),
        ])?;
        // Now, not at the end of the run: a model already there is not this run's to
        // replace. A continued run's is (the run it continues may have written it), and so
        // is the demo's, under --demo-dir.
        if let Some(out) = self.out_dir.as_ref().filter(|_| !self.resume) {
            hf::check_new_export_dir(out, self.model.as_deref())?;
        }
        let (model, train_file, eval_file) = match (&self.train_file, &self.model) {
            (None, _) => {
                let (train, eval) = demo::data_paths(&self.demo_dir.join("data"));
                let path = |p: PathBuf| p.to_string_lossy().into_owned();
                (
                    ModelSource::Config {
                        name: "the demo".into(),
                        config: demo::config(),
                    },
                    path(train),
                    Some(path(eval)),
                )
            }
            (Some(_), None) => bail!(
                "--train-file needs --model DIR, a HF model directory (add --from-scratch to train its config from random weights)"
            ),
            (Some(train), Some(model)) => (
                ModelSource::new(model, self.from_scratch)?,
                train.clone(),
                self.eval_file.clone(),
            ),
        };
        let documents = self.documents(&model)?;
        let demo_path = |name: &str| demo.then(|| self.demo_dir.join(name));
        Ok(Options {
            model,
            train_file,
            eval_file,
            batch_size,
            seq_len,
            grad_accumulation: self.grad_accumulation,
            steps: self.steps.or(d.steps),
            lr,
            warmup: self.warmup.unwrap_or(d.warmup),
            final_lr_fraction,
            lr_schedule: self.lr_schedule,
            cooldown: self.cooldown,
            optimizer: OptimizerOptions {
                beta_1: self.beta_1,
                beta_2: self.beta_2,
                adam_eps: self.adam_eps,
                weight_decay: self.weight_decay,
                grad_clip: self.grad_clip,
                opt_m_dtype,
                opt_v_dtype,
                master_dtype,
                offload: self.offload.offload(self.offload_master),
                zero_level: self.zero_level,
                in_backward: self.optimizer_in_backward,
            },
            z_loss: self.z_loss,
            model_dtype,
            matmul,
            memory: MemoryOptions {
                recompute: self.recompute.recompute(),
                offload_residual: self.offload.residual(),
                offload_activations: self.offload.activations(),
                offload_weights: self.offload.weights(),
                offload_gradients: self.offload.gradients(),
                lmhead_chunks: self.lmhead_chunks,
                ffn_chunks: self.ffn_chunks,
                layer_major: self.layer_major.per_pass(self.grad_accumulation),
            },
            documents,
            seed: self.seed,
            ckpt_interval: self.ckpt_interval,
            checkpoint_dir: self
                .checkpoint_dir
                .clone()
                .or_else(|| demo_path("checkpoints"))
                .unwrap_or_else(|| "checkpoints".into()),
            resume: self.resume,
            out_dir: self.out_dir.clone().or_else(|| demo_path("model")),
            log_file: self.log_file.clone().or_else(|| demo_path("log.jsonl")),
            tensorboard_dir: self.tensorboard_dir.clone(),
            eval_every_n_steps: self.eval_every_n_steps.unwrap_or(d.eval_every_n_steps),
            eval_num_steps,
            debug_log_abs_max: self.debug_log_abs_max,
            log_gpu_util: self.log_gpu_util,
            grad_sum_after_backward: self.grad_sum_after_backward,
            use_cuda_graphs: self.use_cuda_graphs,
            health_every: self.health_every,
            guard: GuardOptions {
                max_skipped_steps: self.max_skipped_steps,
                spike_window: self.spike_window,
                spike_zscore: self.spike_zscore,
                on_spike: self.on_spike,
            },
            debug_inject: self.debug_inject.clone(),
        })
    }

    /// `--doc-mask` and `--doc-positions`, their documents ended by `--eos-id` or else by the
    /// EOS that the model directory's tokenizer files name (as `smelt tokenize` found it).
    fn documents(&self, model: &ModelSource) -> Result<Option<Documents>> {
        if !self.documents.any() {
            if self.eos_id.is_some() {
                bail!(
                    "--eos-id tells the documents apart for --doc-mask and --doc-positions: \
                     give one of them, or leave it out"
                );
            }
            return Ok(None);
        }
        let no_eos = |what: String| {
            anyhow!(
                "--doc-mask/--doc-positions: {what} to name the EOS that ends each document; \
                 pass --eos-id (the id `smelt tokenize` printed)"
            )
        };
        let (eos, source) = match (self.eos_id, model) {
            (Some(id), _) => (id, "--eos-id".to_string()),
            (None, ModelSource::Dir { path, .. }) => {
                let file = path.join("tokenizer.json");
                if !file.is_file() {
                    return Err(no_eos(format!("{} has no tokenizer.json", path.display())));
                }
                let found = (Encoder::load(&file, None))
                    .with_context(|| {
                        format!(
                            "--doc-mask/--doc-positions: the EOS that ends each document, from \
                             {} (or pass --eos-id)",
                            file.display()
                        )
                    })?
                    .eos;
                (found.id, found.source)
            }
            (None, ModelSource::Config { name, .. }) => {
                return Err(no_eos(format!("{name} has no tokenizer files")));
            }
        };
        let vocab = model.config()?.0.vocab_size;
        if eos as usize >= vocab {
            bail!("{source} {eos} is outside the model's vocabulary of {vocab}");
        }
        Ok(self.documents.documents(eos as i32))
    }

    fn refuse_unimplemented(&self) -> Result<()> {
        if self.zero_level > 3 {
            bail!(
                "--zero-level {} is not implemented yet (levels 1 to 3 shard the optimizer \
                 state, the gradients and the weights: use one of those)",
                self.zero_level
            );
        }
        Ok(())
    }
}

/// Trains on one rank; after the demo, rank 0 reports its loss and shows a sample.
struct TrainRank {
    options: Options,
    /// The demo's data folder, when this is the demo.
    demo_data: Option<PathBuf>,
    /// This process's GPUs, which rank 0 reads with --log-gpu-util.
    telemetry: Option<Telemetry>,
}

impl RankMain for TrainRank {
    type Output = ();

    fn run<B: Backend>(&self, b: &B, comm: &dyn Comm<B>) -> Result<()> {
        if let Some(dir) = &self.demo_data {
            // The flags are checked; only now does the demo write its data, once, for every
            // rank to read after it.
            if comm.rank() == 0 {
                demo::write_data(dir)?;
            }
            comm.sum(&[])?;
        }
        let telemetry = self.telemetry.as_ref();
        let summary = crate::train::train(b, comm, &self.options, telemetry)?;
        if self.demo_data.is_some() && comm.rank() == 0 {
            demo_report(b, &summary, &self.options)?;
        }
        Ok(())
    }
}

/// The demo's closing lines: how far the loss fell, and a sample from the exported model.
fn demo_report<B: Backend>(b: &B, summary: &Summary, options: &Options) -> Result<()> {
    if let (Some(first), Some(eval)) = (summary.losses.first(), summary.final_eval) {
        println!(
            "demo: loss {first:.3} at the first step, eval loss {eval:.3} at the end ({:+.0}%)",
            100.0 * (eval - first) / first
        );
    }
    let out = options
        .out_dir
        .as_ref()
        .expect("the demo always writes a model");
    demo_sample(b, out, options.seed)
}

/// The demo's closing sample, from the model it just exported.
fn demo_sample<B: Backend>(b: &B, model_dir: &std::path::Path, seed: u64) -> Result<()> {
    let config = hf::read_config(model_dir)?;
    let mut generator = Generator::new(b, config, DType::F32, |m| hf::import(b, m, model_dir))?;
    let prompt: Vec<i32> = demo::SAMPLE_PROMPT.bytes().map(i32::from).collect();
    let options = SampleOptions {
        max_new_tokens: demo::SAMPLE_TOKENS,
        sampling: Sampling::temperature(demo::SAMPLE_TEMPERATURE),
        seed,
        stop: vec![],
    };
    let new = generator.generate(b, &prompt, &options, |_| Ok(()))?;
    println!(
        "sample (temperature {}):\n{}{}",
        options.sampling.temperature,
        demo::SAMPLE_PROMPT,
        demo::decode(&new)
    );
    Ok(())
}
