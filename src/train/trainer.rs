//! The training loop: per step, gradient accumulation over micro-batches (the gradient of
//! each token's loss scaled by 1 / trained targets over all micro-steps, so the update does
//! not depend on how a batch is split), one AdamW update, a `[T]` line and a log event; eval
//! every `--eval-every-n-steps` and in full at the end; checkpoints; the model exported.
//!
//! With several ranks (data parallel, `--gpus N`) every rank runs this same loop on its own
//! replica and its own share of each batch: the ranks meet to count the step's trained
//! targets (which scale every gradient), sum the gradients before the optimizer (whose
//! update is then the same on every rank) and sum the losses. Rank 0 speaks for the run: it
//! alone prints, logs, writes checkpoints and exports.
//!
//! Every check of the user's input that needs no tensor read (options, model config, data
//! files, checkpoint settings, output folder) runs before anything is written, so a run
//! refused for those changes nothing. Weights that do not fit the config are found as they
//! load, after the log has recorded the run's start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};

use super::block_updates;
use super::checkpoint::{self, State, VERSION};
use super::console::{self, Console, StepReport};
use super::guard::{Guard, Spike, Verdict};
use super::health::{self, Health};
use super::inject::{self, Fault};
use super::loader::{Batch, DataSet, EvalSet, Loader, LoaderState, place_in_step};
use super::log::{self, Event, Log};
use super::metrics;
use super::optimizer::AdamWState;
use super::options::{ModelSource, Options};
use super::schedule::Schedule;
use super::step_losses::StepLosses;
use super::zero;
use crate::backend::telemetry::Telemetry;
use crate::backend::{Backend, Range};
use crate::comm::Comm;
use crate::hash::fnv1a;
use crate::io::{self, hf, tensors};
use crate::model::{BlockEvent, Gradients, LossOptions, MatmulFlops, Params, Transformer, Weights};
use crate::rng::Rng;
use crate::tensor::{DType, Tensor};

/// Mixed into the run's seed for the stream of per-micro-batch rounding seeds
/// (`Transformer::set_rounding_seed`), apart from the other streams drawn from it.
const ROUNDING_SEEDS: u64 = 0x1A78_5EED_0F1A_2B3C;

/// What a finished run reports to its caller.
#[derive(Clone, Debug)]
pub struct Summary {
    /// The losses of the steps this process ran, in order.
    pub losses: Vec<f64>,
    /// The full eval at the end, when there is eval data.
    pub final_eval: Option<f64>,
}

/// Trains as `o` says, on backend `b`, as rank `comm.rank()` of `comm.world()`. Rank 0 logs
/// `telemetry`'s readings every `o.log_gpu_util` steps.
pub fn train<B: Backend>(
    b: &B, comm: &dyn Comm<B>, o: &Options, telemetry: Option<&Telemetry>,
) -> Result<Summary> {
    // The model's config is checked before the data, whose checks need its vocabulary.
    let (config, _) = o.model.config()?;
    let data = DataSet::open(&o.train_file, "--train-file", config.vocab_size, o.seq_len)?;
    let (mut run, resume) = Run::open(b, comm, o, Some(data), telemetry)?;
    run.logging_failure(|run| {
        run.start(resume)?;
        run.train_loop()?;
        run.finish()
    })?;
    Ok(run.summary)
}

/// A checkpoint to continue from, with the warnings about options changed since.
pub type Resume = (PathBuf, State, Vec<String>);

/// A step between its gradients and its update.
struct Pending {
    start: Instant,
    /// Trained targets over all ranks and micro-batches.
    trained: usize,
    /// The hash of its sequences (`meet_for_step`).
    data: u64,
    /// Tokens over all ranks and micro-batches.
    tokens: u64,
    /// With `--optimizer-in-backward`, the rate and seed the blocks' updates used.
    applied: Option<Applied>,
}

/// The rate and rounding seed of a step's update, drawn before its last backward where the
/// blocks are updated in it.
#[derive(Clone, Copy)]
struct Applied {
    lr: f32,
    seed: u64,
}

/// What a step's update did.
#[derive(Clone, Debug)]
pub struct StepResult {
    pub step: u64,
    pub loss: f64,
    /// The global gradient norm, before clipping.
    pub norm: f64,
    /// Why the guard skipped the update, if it did.
    pub skipped: Option<String>,
}

impl<'a, B: Backend> Run<'a, B> {
    /// Checks what `o` asks for, and allocates the model and opens the log: the run up to
    /// its start. `data` is the training data, or `None` where the caller brings each batch
    /// (`accumulate`). Rank 0 logs `telemetry`'s readings every `o.log_gpu_util` steps. The
    /// checkpoint to continue from comes back for `start`.
    pub fn open(
        b: &'a B, comm: &'a dyn Comm<B>, o: &'a Options, data: Option<DataSet>,
        telemetry: Option<&'a Telemetry>,
    ) -> Result<(Run<'a, B>, Option<Resume>)> {
        let root = comm.rank() == 0;
        // 1) Everything that reads the user's input, before anything is written.
        let (config, model_dir) = o.model.config()?;
        let eval = (o.eval_file.as_deref())
            .map(|pattern| DataSet::open(pattern, "--eval-file", config.vocab_size, o.seq_len))
            .transpose()?;
        let fixed = fixed_settings(o, data.as_ref());
        let loader =
            (data.map(|d| Loader::new(d, o.seed, comm.rank(), comm.world()))).transpose()?;
        let global_batch = comm.world() * o.batch_size * o.grad_accumulation;
        let per_epoch = loader.as_ref().map_or(0, Loader::per_epoch);
        let steps = o
            .steps
            .unwrap_or_else(|| (per_epoch / global_batch).max(1) as u64);
        let model_json = config.to_hf_json();
        let state = State {
            version: VERSION,
            step: 0,
            world_size: comm.world(),
            config_hash: State::hash(&model_json, &fixed),
            model_config: model_json,
            fixed,
            options: serde_json::to_value(o)?,
            schedule: Schedule::of_run(o, steps),
            loader: LoaderState::default(),
            rng: Rng::derived(o.seed, 1),
            tokens_seen: 0,
            model_dir: model_dir.clone(),
            guard: Default::default(),
        };
        let resume = check_checkpoint_dir(o, &state)?;
        if o.out_dir.is_some() {
            check_tokenizer(model_dir.as_deref(), config.vocab_size)?;
        }
        let log_file = o.log_file.as_deref().filter(|_| root);
        if let Some(path) = log_file {
            log::check_appendable(path)?;
        }

        // 2) Startup: options, device, model, memory.
        if o.optimizer.in_backward {
            block_updates::check(o, comm.world())?;
        }
        o.memory.check_layer_major(o.grad_accumulation)?;
        if o.use_cuda_graphs {
            check_cuda_graphs(comm.world(), o.optimizer.in_backward)?;
        }
        if comm.world() > 1 && (o.memory.offload_weights || o.memory.offload_gradients) {
            bail!(
                "--offload-weights and --offload-gradients stream one GPU's blocks from its host \
                 memory, and are not implemented with several ranks yet; train on one GPU, or \
                 share the state out with --zero-level 1, 2 or 3 instead"
            );
        }
        let layout = Params::layout(&config, o.model_dtype);
        let owners = zero::owners_of(&layout, comm.world(), &o.optimizer);
        let kept = owners.and_then(|w| w.kept_blocks(comm.rank()));
        let gradients = kept.clone().map_or(Gradients::All, Gradients::Kept);
        let mut options = (o.memory).model_options(
            o.batch_size,
            o.seq_len,
            o.model_dtype,
            o.matmul,
            gradients,
            o.documents,
        );
        if let Some(kept) = kept.filter(|_| o.optimizer.zero_level >= 3) {
            options.weights = Weights::Kept(kept);
        }
        options.record_passes = o.use_cuda_graphs;
        let model = Transformer::new(b, config.clone(), options)?;
        // These create folders, so they come after the model's own checks (--lmhead-chunks).
        let tensorboard_dir = o.tensorboard_dir.as_deref().filter(|_| root);
        if let Some(dir) = tensorboard_dir {
            io::create_writable_dir(dir, "--tensorboard-dir")?;
        }
        if root {
            check_out_dir(o)?;
        }
        let step_losses = StepLosses::new(b, &model, o.grad_accumulation)?;
        let run = Run {
            b,
            comm,
            o,
            log: Log::open(log_file, tensorboard_dir)?,
            console: if root {
                Console::new()
            } else {
                Console::silent()
            },
            step_losses,
            model,
            opt: None,
            guard: Guard::new(o.guard.clone()),
            loader,
            eval: eval.map(|d| EvalSet::new(d, o.batch_size, comm.rank(), comm.world())),
            flops_per_token: config.training_flops_per_token(o.seq_len),
            matmul_flops: config.training_matmul_flops_per_token(),
            telemetry: telemetry.filter(|_| root && o.log_gpu_util > 0),
            state,
            saved_step: None,
            pending: None,
            summary: Summary {
                losses: vec![],
                final_eval: None,
            },
            model_dir,
        };
        Ok((run, resume))
    }

    /// Runs `f`, and ends the log with the error it fails with (unless writing the log is
    /// what failed).
    pub fn logging_failure(&mut self, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        let result = f(self);
        if let Err(e) = &result {
            let _ = self.log.write(Event::Error {
                message: format!("{e:#}"),
            });
        }
        result
    }
}

/// What must not change for a run to continue from a checkpoint, by flag. The global batch
/// must not either, but the batch size, the accumulation and the world size that make it up
/// may (`State::check_continues`); so may the ZeRO level, whose shards are read whole.
fn fixed_settings(o: &Options, data: Option<&DataSet>) -> BTreeMap<String, Value> {
    let files: Vec<Value> = (data.map_or(&[][..], DataSet::files).iter())
        .map(|f| {
            let name = f.path.file_name().map(|n| n.to_string_lossy().into_owned());
            json!([name, f.len()])
        })
        .collect();
    let opt = &o.optimizer;
    [
        ("--model-dtype", json!(o.model_dtype)),
        ("--master-dtype", json!(opt.master_dtype)),
        ("--opt-m-dtype", json!(opt.opt_m_dtype)),
        ("--opt-v-dtype", json!(opt.opt_v_dtype)),
        ("--seq-len", json!(o.seq_len)),
        ("--seed", json!(o.seed)),
        ("--train-file (name, tokens)", Value::Array(files)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// What `--use-cuda-graphs` needs of a run on `world` ranks beyond the model
/// (`ModelOptions::record_passes`): one rank, whose recorded passes no gradient sums run
/// beside, and the update after the backward, not in it (`in_backward`), whose rate and
/// seed a recording could not take. `smelt bench` checks its run with it too.
pub(crate) fn check_cuda_graphs(world: usize, in_backward: bool) -> Result<()> {
    if world > 1 {
        bail!(
            "--use-cuda-graphs records one GPU's passes, and this run has {world} ranks, whose \
             gradient sums run beside them: train on one GPU, or leave it out"
        );
    }
    if in_backward {
        bail!(
            "--use-cuda-graphs cannot be used with --optimizer-in-backward yet, whose updates in \
             the backward take each step's rate and seed; leave one of them out"
        );
    }
    Ok(())
}

/// With `--continue`, the checkpoint to continue from (checked against this run), and the
/// warnings about options that changed. Without it, a run that writes checkpoints refuses a
/// directory that already holds some, which it would mix its own with.
fn check_checkpoint_dir(o: &Options, now: &State) -> Result<Option<(PathBuf, State, Vec<String>)>> {
    let dir = &o.checkpoint_dir;
    let latest = checkpoint::read_latest(dir)?;
    match (o.resume, latest) {
        (true, None) => bail!(
            "--continue: no checkpoint in {} (it has no `{}` file); run without --continue to start afresh, or pass the --checkpoint-dir of the run to continue",
            dir.display(),
            checkpoint::LATEST
        ),
        (true, Some(path)) => {
            let saved = checkpoint::read_state(&path)?;
            let warnings = now.check_continues(&saved, &path, &Options::FREE_ON_CONTINUE)?;
            Ok(Some((path, saved, warnings)))
        }
        (false, Some(path)) if o.ckpt_interval > 0 => bail!(
            "--checkpoint-dir {} already holds checkpoints (latest: {}); pass --continue to continue that run, or choose another --checkpoint-dir",
            dir.display(),
            path.display()
        ),
        (false, _) => Ok(None),
    }
}

/// The tokenizer.json that `--out-dir` gets a copy of must serve the trained model: one that
/// does not load, or whose vocabulary is larger than the model's, is refused before anything
/// is written, rather than copied beside the weights for sampling to fail on.
fn check_tokenizer(model_dir: Option<&Path>, vocab_size: usize) -> Result<()> {
    let Some(path) = model_dir
        .map(|d| d.join("tokenizer.json"))
        .filter(|p| p.exists())
    else {
        return Ok(());
    };
    let tokenizer = tokenizers::Tokenizer::from_file(&path).map_err(|e| {
        anyhow!(
            "{}: not a usable tokenizer.json ({e}); --out-dir would get a copy of it: restore the model's own",
            path.display()
        )
    })?;
    let tokens = tokenizer.get_vocab_size(true);
    if tokens > vocab_size {
        bail!(
            "{}: has {tokens} tokens, more than the model's vocab_size {vocab_size}, so it belongs to another model; --out-dir would get a copy of it: restore the model's own",
            path.display()
        );
    }
    Ok(())
}

/// Creates `--out-dir` and checks that the trained model can be written there, so that a
/// run does not find out only at its end.
fn check_out_dir(o: &Options) -> Result<()> {
    let Some(dir) = o.out_dir.as_deref() else {
        return Ok(());
    };
    let model_dir = match &o.model {
        ModelSource::Dir { path, .. } => Some(path.as_path()),
        ModelSource::Config { .. } => None,
    };
    hf::check_export_dir(dir, model_dir)?;
    io::create_writable_dir(dir, "--out-dir")
}

pub struct Run<'a, B: Backend> {
    b: &'a B,
    comm: &'a dyn Comm<B>,
    o: &'a Options,
    log: Log,
    console: Console,
    model: Transformer<B>,
    /// Set once the weights are in place (the master copy is taken from them).
    opt: Option<AdamWState<B>>,
    step_losses: StepLosses<B>,
    guard: Guard,
    /// The training data, unless the caller brings each batch.
    loader: Option<Loader>,
    eval: Option<EvalSet>,
    flops_per_token: f64,
    matmul_flops: MatmulFlops,
    /// The GPUs to sample, on rank 0 with `--log-gpu-util`.
    telemetry: Option<&'a Telemetry>,
    /// The state a checkpoint now would save.
    state: State,
    /// The step of the newest checkpoint on disk, written or continued from.
    saved_step: Option<u64>,
    /// The step `accumulate` computed, until `update` applies it.
    pending: Option<Pending>,
    pub summary: Summary,
    /// The model directory the run started from, whose tokenizer files go with the export.
    model_dir: Option<PathBuf>,
}

impl<B: Backend> Run<'_, B> {
    /// The start of a run whose log is open: the options, device and memory announced, the
    /// weights made or read, the optimizer's state made, and the checkpoint to continue from
    /// loaded.
    pub fn start(&mut self, resume: Option<Resume>) -> Result<()> {
        let (b, comm, o) = (self.b, self.comm, self.o);
        self.announce()?;
        let steps = self.state.schedule.steps;
        if o.warmup > steps {
            self.warn(format!(
                "--warmup {} is longer than the run's {steps} steps: the rate warms up over those \
                 {steps} instead and reaches --lr at the last one",
                o.warmup
            ))?;
        }
        let cooldown = self.state.schedule.cooldown;
        if o.cooldown > cooldown {
            self.warn(format!(
                "--cooldown {} is longer than the {cooldown} steps after the warmup: the rate \
                 cools down over those {cooldown} instead",
                o.cooldown
            ))?;
        }
        if o.out_dir.is_none() && o.ckpt_interval == 0 {
            self.warn(
                "neither --out-dir nor --ckpt-interval is set, so the trained weights will not be saved"
                    .into(),
            )?;
        }
        if resume.is_none() {
            match &o.model {
                ModelSource::Dir {
                    path,
                    from_scratch: false,
                } => hf::import(b, &self.model, path)?,
                _ => self.model.init_weights(b, o.seed)?,
            }
            // Every rank made the same weights; taking rank 0's makes that a certainty. (With
            // sharded weights, a block's are those of the rank that keeps it, made alike.)
            let params: Vec<_> = match self.model.options.weights {
                Weights::All => self.model.params.iter().map(|t| (t, 0)).collect(),
                Weights::Kept(_) => self.model.params.outside_blocks().map(|t| (t, 0)).collect(),
            };
            comm.broadcast(b, &params)?;
            self.model.weights_changed();
        }
        self.opt = Some(AdamWState::new(b, comm, &self.model, o.optimizer.clone())?);
        self.announce_memory()?;
        if let Some((path, saved, warnings)) = resume {
            self.resume(&path, saved, warnings)?;
        }
        Ok(())
    }

    fn opt(&self) -> &AdamWState<B> {
        self.opt
            .as_ref()
            .expect("the optimizer is set before training")
    }

    fn warn(&mut self, message: String) -> Result<()> {
        self.console.line(&format!("warning: {message}"));
        self.log.write(Event::Warning { message })
    }

    /// Prints and logs the options and the device.
    fn announce(&mut self) -> Result<()> {
        let c = &self.model.config;
        let o = self.o;
        self.console.line(&format!(
            "smelt train: {} model, {} parameters; {} steps of {} × {} × {} tokens",
            c.architecture.hf_class(),
            console::si(c.num_parameters() as f64),
            self.state.schedule.steps,
            o.batch_size,
            o.seq_len,
            o.grad_accumulation
        ));
        let source = match &o.model {
            ModelSource::Config { name, .. } => {
                format!("the built-in config of {name} (random weights)")
            }
            ModelSource::Dir { path, from_scratch } => format!(
                "{}{}",
                path.display(),
                if *from_scratch {
                    " (config only, random weights)"
                } else {
                    ""
                }
            ),
        };
        self.console.line(&format!(
            "model: {source}: {} layers, hidden {}, {} heads ({} kv) of {}, MLP {}, vocabulary {}{}",
            c.num_layers,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
            if c.tie_word_embeddings { ", tied embeddings" } else { "" },
        ));
        let mut line = String::from("options:");
        for (name, value) in o.listing() {
            // The model's source and shape have their own line above.
            let item = (name != "model").then(|| format!(" {name}={value}"));
            self.log.write(Event::Option { name, value })?;
            let Some(item) = item else { continue };
            if line.len() + item.len() > 100 {
                self.console.line(&line);
                line = " ".repeat(8);
            }
            line.push_str(&item);
        }
        self.console.line(&line);
        let device = match self.comm.world() {
            1 => self.b.describe(),
            world => format!("{} (rank 0 of {world})", self.b.describe()),
        };
        self.console.line(&format!("device: {device}"));
        self.log.write(Event::Device { name: device })?;
        if o.seq_len > c.max_position_embeddings {
            self.warn(format!(
                "--seq-len {} is longer than the model's max_position_embeddings {}",
                o.seq_len, c.max_position_embeddings
            ))?;
        }
        Ok(())
    }

    /// Prints and logs the memory table: the model's allocations and the optimizer's, and
    /// what either offloaded to host memory.
    fn announce_memory(&mut self) -> Result<()> {
        let table = console::memory_table(&[
            &self.model.memory,
            &self.opt().memory,
            &self.step_losses.memory,
        ]);
        let mut cells: Vec<String> = table
            .iter()
            .map(|(name, bytes)| format!("{name} {}", console::mib(*bytes)))
            .collect();
        for (category, bytes) in table {
            self.log.write(Event::Memory { category, bytes })?;
        }
        let in_host = [self.model.offloaded.as_slice(), &self.opt().offloaded];
        if in_host.iter().any(|c| !c.is_empty()) {
            let offloaded = console::memory_table(&in_host);
            let listed: Vec<String> = offloaded
                .iter()
                .map(|(name, bytes)| format!("{name} {}", console::mib(*bytes)))
                .collect();
            cells.push(format!("in host memory: {}", listed.join(", ")));
            for (name, bytes) in offloaded {
                let category = format!("host {name}");
                self.log.write(Event::Memory { category, bytes })?;
            }
        }
        if let Some((free, total)) = self.b.free_memory() {
            let (free, total) = (free as u64, total as u64);
            cells.push(format!(
                "device free {} of {}",
                console::mib(free),
                console::mib(total)
            ));
            self.log.write(Event::Memory {
                category: "free".into(),
                bytes: free,
            })?;
        }
        self.console.line(&format!("memory: {}", cells.join(" | ")));
        Ok(())
    }

    fn resume(&mut self, path: &Path, saved: State, warnings: Vec<String>) -> Result<()> {
        checkpoint::load(self.b, path, &saved, &self.model, self.opt())?;
        let sequences = self.loader.as_ref().map_or(0, Loader::per_epoch);
        let position = match saved.version {
            1 => saved.loader.from_per_rank(saved.world_size, sequences),
            _ => saved.loader,
        };
        if let Some(loader) = &mut self.loader {
            (loader.restore(position))
                .with_context(|| format!("--continue from {}", path.display()))?;
        }
        if saved.version == 1 && !LoaderState::is_exact_from_per_rank(saved.world_size, sequences) {
            self.warn(format!(
                "{} was written by an earlier smelt on {} ranks, which left out the last {} of \
                 the {sequences} sequences of each epoch: this run trains what that one would \
                 have until the end of the epoch it is in, and from then on every sequence",
                path.display(),
                saved.world_size,
                sequences % saved.world_size,
            ))?;
        }
        self.state.step = saved.step;
        self.state.loader = position;
        self.state.rng = saved.rng;
        self.guard.state = saved.guard.clone();
        self.state.guard = saved.guard;
        self.state.tokens_seen = saved.tokens_seen;
        self.saved_step = Some(saved.step);
        for w in warnings {
            self.warn(w)?;
        }
        self.console.line(&format!(
            "continuing from {} (step {})",
            path.display(),
            saved.step
        ));
        self.log.write(Event::Checkpoint {
            step: saved.step,
            path: path.display().to_string(),
            loaded: true,
        })
    }

    fn train_loop(&mut self) -> Result<()> {
        let o = self.o;
        let steps = self.state.schedule.steps;
        let mut batches = vec![Batch::new(o.batch_size * o.seq_len); o.grad_accumulation];
        while self.state.step < steps {
            let lr = self.state.schedule.lr(self.state.step);
            let loader = (self.loader.as_mut()).expect("a run that loops reads its data");
            for batch in batches.iter_mut() {
                loader.next_batch(batch);
            }
            self.accumulate(&batches)?;
            self.update(lr)?;
            let step = self.state.step;
            if o.eval_every_n_steps > 0 && step.is_multiple_of(o.eval_every_n_steps) && step < steps
            {
                self.evaluate(Some(o.eval_num_steps))?;
            }
            if o.ckpt_interval > 0 && step.is_multiple_of(o.ckpt_interval) {
                self.checkpoint()?;
            }
        }
        Ok(())
    }

    /// The forward and backward of the next step's micro-batches (this rank's share of
    /// each), with their gradients summed over the ranks, for `update` to apply.
    pub fn accumulate(&mut self, batches: &[Batch]) -> Result<()> {
        let (b, o) = (self.b, self.o);
        let _range = Range::begin(b, format_args!("step {}", self.state.step + 1));
        let start = Instant::now();
        let (trained, data) = self.meet_for_step(batches)?;
        let comm = self.comm;
        // The last micro-batch's backward hands each block's gradients to be summed over the
        // ranks as soon as it has finished them, and goes on with the blocks below. Not in
        // the first step this process runs, where cuBLASLt's algorithms for each new shape
        // are chosen by timing them (and the choice is kept on disk): sums running beside
        // them would skew the timings. Under ZeRO-2 every micro-batch's backward sends each
        // block's gradients to the block's rank, since the memory they were written to is
        // shared with other blocks; in the first step the backward waits for each send.
        let overlap = !o.grad_sum_after_backward && !self.summary.losses.is_empty();
        let block_owners = self.opt().block_owners.clone();
        let last = batches.len() - 1;
        // The rate and seed `update` would use, drawn as it draws them.
        let step = self.state.step + 1;
        let applied = (o.optimizer.in_backward).then(|| Applied {
            lr: self.state.schedule.lr(self.state.step) as f32,
            seed: self.state.rng.next_u64(),
        });
        let opt = (self.opt.as_ref()).context("the optimizer is set before training")?;
        let owners = &block_owners;
        // What a backward does with the events of the blocks' weights and gradients; with
        // `sum_now`, the last micro-batch's (or a layer-major pass's) that sums the
        // gradients over the ranks as it finishes them.
        let events_of = |sum_now: bool| {
            move |event: BlockEvent<B>| match (event, owners) {
                (event @ BlockEvent::Weights { .. }, owners) => {
                    bring_weights(b, comm, owners, event)
                }
                (BlockEvent::Writing { grads, .. }, Some(_)) => comm.wait_for_sums_of(b, grads),
                (
                    BlockEvent::Done {
                        layer: Some(l),
                        grads,
                    },
                    Some(owners),
                ) => {
                    comm.start_reduce_sum(b, grads, owners[l])?;
                    match overlap {
                        true => Ok(()),
                        false => comm.join_all_reduce_sums(b),
                    }
                }
                (BlockEvent::Done { grads, .. }, _) if sum_now => {
                    comm.start_all_reduce_sum(b, grads)
                }
                (
                    BlockEvent::Update {
                        layer,
                        weights,
                        grads,
                    },
                    _,
                ) => {
                    let a = applied.expect("only a backward that updates tells of updates");
                    opt.update_block(b, layer, weights, grads, a.lr, step, a.seed)
                }
                _ => Ok(()),
            }
        };
        let loss = LossOptions {
            grad_scale: 1.0 / trained.max(1) as f32,
            z_loss: o.z_loss as f32,
            accumulate: false,
        };
        let mut weights = |event: BlockEvent<B>| bring_weights(b, comm, owners, event);
        let per_pass = self.model.options.micro_batches;
        if per_pass > 1 {
            // Layer-major passes of `per_pass` micro-batches, the last one's summing the
            // gradients over the ranks, or updating the blocks, as it finishes them.
            let passes = batches.len().div_ceil(per_pass);
            for (i, pass) in batches.chunks(per_pass).enumerate() {
                let last = i + 1 == passes;
                let tokens: Vec<&[i32]> = pass.iter().map(|batch| &batch.tokens[..]).collect();
                let targets: Vec<&[i32]> = pass.iter().map(|batch| &batch.targets[..]).collect();
                let loss = LossOptions {
                    accumulate: i > 0,
                    ..loss
                };
                (self.model).forward_layer_major(b, &tokens, &targets, loss, &mut weights)?;
                let updates = applied.is_some() && last;
                if updates {
                    opt.begin_block_updates(b)?;
                }
                let mut events = events_of(overlap && last);
                (self.model).backward_layer_major(b, i > 0, &mut events, updates)?;
                for m in 0..pass.len() {
                    let losses = self.model.micro_batch_losses(m);
                    self.step_losses.keep(b, losses, i * per_pass + m)?;
                }
            }
        } else {
            for (k, batch) in batches.iter().enumerate() {
                let loss = LossOptions {
                    accumulate: k > 0,
                    ..loss
                };
                let micro_batch = self.state.step * batches.len() as u64 + k as u64;
                let rounding = Rng::derived(o.seed ^ ROUNDING_SEEDS, micro_batch).next_u64();
                self.model.set_rounding_seed(rounding);
                self.model
                    .forward_hidden_with(b, &batch.tokens, &mut weights)?;
                let mut events = events_of(overlap && k == last);
                match applied {
                    Some(_) if k == last => {
                        opt.begin_block_updates(b)?;
                        (self.model).backward_updating(b, &batch.targets, loss, &mut events)?;
                    }
                    _ => self.model.backward(b, &batch.targets, loss, &mut events)?,
                }
                self.step_losses.keep(b, self.model.losses(), k)?;
            }
        }
        if !overlap {
            let grads = self.model.grads();
            let whole: Vec<&Tensor<B>> = match block_owners {
                None => grads.iter().collect(),
                // The blocks' were sent during the backward.
                Some(_) => grads.outside_blocks().collect(),
            };
            comm.start_all_reduce_sum(b, &whole)?;
        }
        comm.join_all_reduce_sums(b)?;
        let tokens = (comm.world() * batches.len() * o.batch_size * o.seq_len) as u64;
        self.pending = Some(Pending {
            start,
            trained,
            data,
            tokens,
            applied,
        });
        Ok(())
    }

    /// The update of the step `accumulate` computed, at rate `lr`, unless the guard skips it;
    /// then the step's log event and console line.
    pub fn update(&mut self, lr: f64) -> Result<StepResult> {
        let (b, o, comm) = (self.b, self.o, self.comm);
        let Pending {
            start,
            trained,
            data,
            tokens,
            applied,
        } = (self.pending.take()).context("an update needs a step's gradients first")?;
        let step = self.state.step + 1;
        if let Some(a) = applied.filter(|a| a.lr != lr as f32) {
            bail!(
                "step {step} was given the rate {lr}, but --optimizer-in-backward updated its \
                 blocks in the backward at the schedule's {}: leave the rate to the schedule",
                a.lr
            );
        }
        if o.debug_log_abs_max > 0 && step.is_multiple_of(o.debug_log_abs_max) {
            self.log_abs_max(step)?;
        }
        if inject::strikes(&o.debug_inject, Fault::NanGrad, step) {
            b.fill(&self.model.grads().final_norm, f32::NAN)?;
        }
        self.opt().measure_gradients(b, comm, &self.model)?;
        // The step's one wait for the device: the update waits for the guard's verdict.
        let loss_sum = comm.sum(&[self.step_losses.sum(b)?])?[0];
        let norm = self.opt().grad_norm(b)?;
        let loss = inject::loss(&o.debug_inject, step, loss_sum / trained.max(1) as f64);
        let verdict = self.guard.judge(loss, norm);
        let seed = match applied {
            Some(a) => a.seed,
            None => self.state.rng.next_u64(),
        };
        if let (Some(_), Verdict::Skip { reason, .. }) = (applied, &verdict) {
            return Err(block_updates::refuse_after_update(step, reason));
        }
        let health = match &verdict {
            Verdict::Update { .. } => self.apply_update(lr, step, seed, norm)?,
            Verdict::Skip { .. } => None,
        };
        let seconds = start.elapsed().as_secs_f64();

        self.state.step = step;
        if let Some(loader) = &self.loader {
            self.state.loader = loader.state();
        }
        self.state.guard = self.guard.state.clone();
        self.state.tokens_seen += tokens;
        if trained == 0 {
            self.warn(format!(
                "step {step}: every target of the batch is masked out; the loss is 0 and only weight decay applies"
            ))?;
        }
        let data = format!("{data:016x}");
        let (spike, skipped) = match verdict {
            Verdict::Update { spike } => (spike, None),
            Verdict::Skip { reason, spike } => (spike, Some(reason)),
        };
        if let Some(s) = spike {
            self.log_spike(step, loss, s, skipped.is_some())?;
        }
        let result = StepResult {
            step,
            loss,
            norm,
            skipped: skipped.clone(),
        };
        if let Some(reason) = skipped {
            self.skipped(step, reason, loss, norm, data)?;
            return Ok(result);
        }
        let tokens_per_second = tokens as f64 / seconds;
        // Each rank's device ran its share of the tokens.
        let per_device = tokens_per_second / self.comm.world() as f64;
        let report = StepReport {
            step,
            steps: self.state.schedule.steps,
            seconds,
            norm,
            loss,
            lr,
            tokens_per_second,
            mfu: metrics::mfu(self.flops_per_token, per_device, b.peak_flops(DType::BF16)),
            sol: metrics::sol(
                self.matmul_flops,
                per_device,
                b.peak_flops(o.matmul.input_dtype(o.model_dtype)),
                b.peak_flops(o.model_dtype),
            ),
        };
        self.log.write(Event::Step {
            step,
            loss,
            norm,
            lr,
            tokens,
            seconds,
            tokens_per_second,
            mfu: report.mfu,
            sol: report.sol,
            data,
        })?;
        self.console.step(&report);
        if let Some(health) = health {
            self.log_health(step, health)?;
        }
        self.summary.losses.push(loss);
        // Each pass is recorded on its second run: by now, those of every micro-batch.
        if o.use_cuda_graphs && self.summary.losses.len() == 2 {
            self.console.line(&match self.model.recorded_passes() {
                0 => "cuda graphs: this device records none; the passes run op by op".into(),
                n => format!("cuda graphs: {n} passes recorded, replayed from here on"),
            });
        }
        if let Some(t) = self
            .telemetry
            .filter(|_| step.is_multiple_of(o.log_gpu_util))
        {
            self.log_gpus(t, step)?;
        }
        Ok(result)
    }

    /// Logs and prints the readings of the GPUs this process trains on.
    fn log_gpus(&mut self, telemetry: &Telemetry, step: u64) -> Result<()> {
        let gpus = telemetry.sample();
        for g in &gpus {
            self.console.gpu(step, g);
        }
        self.log.write(Event::GpuUtil { step, gpus })
    }

    /// Step `step`'s update, and its health when it is a `--health-every` step; `norm` is
    /// the gradients' global norm, as read for the guard.
    fn apply_update(&mut self, lr: f64, step: u64, seed: u64, norm: f64) -> Result<Option<Health>> {
        let (b, o, opt) = (self.b, self.o, self.opt());
        let measure = o.health_every > 0 && step.is_multiple_of(o.health_every);
        let weights = (opt.update(b, self.comm, &self.model, lr as f32, step, seed, measure))?;
        let Some(weights) = weights else {
            return Ok(None);
        };
        let grad_sq = opt.grad_sums_sq(b)?;
        let clip = opt.clip_scale(norm);
        Ok(Some(health::measure(
            &self.model.layout,
            &grad_sq,
            &weights,
            clip,
        )))
    }

    fn log_health(&mut self, step: u64, health: Health) -> Result<()> {
        let families = health.families.iter();
        let top = families.max_by(|a, b| a.1.update_ratio.total_cmp(&b.1.update_ratio));
        let (name, worst) = top.map_or(("-", 0.0), |(n, f)| (n.as_str(), f.update_ratio));
        self.console.line(&format!(
            "[H] step {step} | norm {:.4} → {:.4} clipped | ‖w‖ {:.2} | ‖Δw‖/‖w‖ {:.2e} (largest: {name} {worst:.2e})",
            health.all.grad_norm, health.clipped_grad_norm, health.all.param_norm, health.all.update_ratio,
        ));
        self.log.write(Event::Health { step, health })
    }

    /// Logs a loss spike; the console shows it here only when the update goes ahead (a
    /// skipped step's line says why it was skipped).
    fn log_spike(&mut self, step: u64, loss: f64, s: Spike, skipped: bool) -> Result<()> {
        if !skipped {
            self.console.line(&format!(
                "[S] step {step} | loss spike {loss:.4}, {:.1} standard deviations above the mean \
                 of the last {} ({:.4}); updated (--on-spike warn)",
                s.zscore, self.o.guard.spike_window, s.mean
            ));
        }
        self.log.write(Event::Spike {
            step,
            loss,
            zscore: s.zscore,
            mean: s.mean,
            std: s.std,
            skipped,
        })
    }

    /// Logs step `step` as skipped for `reason`, and stops the run when too many in a row
    /// have been.
    fn skipped(
        &mut self, step: u64, reason: String, loss: f64, norm: f64, data: String,
    ) -> Result<()> {
        let in_a_row = self.guard.state.skipped_in_a_row;
        self.console.line(&format!(
            "[S] step {step}/{} skipped: {reason} ({in_a_row} in a row); no weight changed",
            self.state.schedule.steps
        ));
        let finite = |x: f64| x.is_finite().then_some(x);
        self.log.write(Event::Skipped {
            step,
            reason: reason.clone(),
            loss: finite(loss),
            norm: finite(norm),
            data,
        })?;
        let kept = match self.saved_step {
            Some(saved) => format!("its last checkpoint is of step {saved}"),
            None => "it wrote no checkpoint".into(),
        };
        self.guard.check_skipped(step, &reason, &kept)
    }

    /// The ranks meet once before the step's micro-batches, for the trained targets over all
    /// of them (which scale every gradient) and a hash of the step's sequences in stream
    /// order, the same whatever the world size. Each rank fills the slots of its own
    /// sequences' hashes and leaves the others' at 0, so that the sum over the ranks gathers
    /// them, exactly: each half of a hash is an integer below 2^32.
    fn meet_for_step(&self, batches: &[Batch]) -> Result<(usize, u64)> {
        let seq = self.o.seq_len;
        let sequences: Vec<&[i32]> = batches.iter().flat_map(|b| b.tokens.chunks(seq)).collect();
        let mut values = vec![0.0; 1 + 2 * self.comm.world() * sequences.len()];
        values[0] = batches.iter().map(Batch::trained).sum::<usize>() as f64;
        for (j, tokens) in sequences.iter().enumerate() {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            let hash = fnv1a(&bytes);
            let at = 1 + 2 * place_in_step(j, self.comm.rank(), self.comm.world());
            values[at] = (hash >> 32) as f64;
            values[at + 1] = (hash & 0xffff_ffff) as f64;
        }
        let summed = self.comm.sum(&values)?;
        let hashes: Vec<u8> = (summed[1..].chunks_exact(2))
            .flat_map(|h| (((h[0] as u64) << 32) | h[1] as u64).to_le_bytes())
            .collect();
        Ok((summed[0] as usize, fnv1a(&hashes)))
    }

    /// Logs the FP8 statistics of this step, before the optimizer replaces the weights'.
    fn log_abs_max(&mut self, step: u64) -> Result<()> {
        let Some(values) = self.model.fp8_abs_max(self.b)? else {
            return Ok(());
        };
        if let Some((name, largest)) = values.iter().max_by(|a, b| a.1.total_cmp(&b.1)) {
            let line = format!("[A] step {step} | largest abs-max {largest:.4e} at {name}");
            self.console.line(&line);
        }
        self.log.write(Event::AbsMax {
            step,
            values: values.iter().cloned().collect(),
        })
    }

    /// The mean loss over the first `batches` eval batches (all of them with `None`).
    fn evaluate(&mut self, batches: Option<usize>) -> Result<Option<f64>> {
        let Some(eval) = &self.eval else {
            return Ok(None);
        };
        let (b, comm) = (self.b, self.comm);
        let count = batches.map_or(eval.num_batches(), |n| n.min(eval.num_batches()));
        let mut batch = Batch::new(self.o.batch_size * self.o.seq_len);
        let (mut sum, mut trained) = (0.0, 0);
        let owners = self.opt().block_owners.clone();
        // With sharded weights every rank takes part in every block's pass, so none skips
        // a batch that holds none of its targets.
        let sharded = self.model.options.weights != Weights::All;
        for i in 0..count {
            eval.fill(i, &mut batch);
            if batch.trained() == 0 && !sharded {
                continue;
            }
            sum += forward_loss_sum(b, comm, &mut self.model, &batch, &owners)?;
            trained += batch.trained() as u64;
        }
        let totals = comm.sum(&[sum, trained as f64])?;
        let (sum, trained) = (totals[0], totals[1] as u64);
        let loss = sum / trained.max(1) as f64;
        let (step, full) = (self.state.step, batches.is_none());
        self.console.eval(step, loss, trained, full);
        self.log.write(Event::Eval {
            step,
            loss,
            tokens: trained,
            full,
        })?;
        Ok(Some(loss))
    }

    /// The loss summed over the trained targets of each rank's `batch`, and their count,
    /// over all ranks.
    pub fn eval_batch(&mut self, batch: &Batch) -> Result<(f64, u64)> {
        let owners = self.opt().block_owners.clone();
        let sum = forward_loss_sum(self.b, self.comm, &mut self.model, batch, &owners)?;
        let totals = self.comm.sum(&[sum, batch.trained() as f64])?;
        Ok((totals[0], totals[1] as u64))
    }

    /// The memory table: bytes per device allocation category, then in host memory.
    pub fn memory(&self) -> Vec<(String, u64)> {
        let mut rows = console::memory_table(&[
            &self.model.memory,
            &self.opt().memory,
            &self.step_losses.memory,
        ]);
        let in_host = [self.model.offloaded.as_slice(), &self.opt().offloaded];
        let host = console::memory_table(&in_host);
        rows.extend(
            host.into_iter()
                .map(|(name, bytes)| (format!("host {name}"), bytes)),
        );
        rows
    }

    /// Steps done: those of the run it continues, and its own.
    pub fn steps_done(&self) -> u64 {
        self.state.step
    }

    /// Writes a checkpoint of the step the run is at into `--checkpoint-dir`.
    pub fn checkpoint(&mut self) -> Result<PathBuf> {
        let (b, comm, dir) = (self.b, self.comm, &self.o.checkpoint_dir);
        let path = checkpoint::save(b, comm, dir, &self.state, &self.model, self.opt())?;
        self.saved_step = Some(self.state.step);
        self.console
            .line(&format!("checkpoint: {}", path.display()));
        self.log.write(Event::Checkpoint {
            step: self.state.step,
            path: path.display().to_string(),
            loaded: false,
        })?;
        Ok(path)
    }

    /// Every weight's values, in `Params` order, on rank 0 (`None` on the others, which take
    /// part in bringing each sharded block to it).
    fn gather_weights(&self) -> Result<Option<Vec<Vec<f32>>>> {
        let (b, comm, model) = (self.b, self.comm, &self.model);
        let owners = self.opt().block_owners.clone();
        let root = comm.rank() == 0;
        let download = |t: &Tensor<B>| b.download(t);
        let mut values = vec![download(&model.params.embed)?];
        for l in 0..model.config.num_layers {
            let mut weights = |event: BlockEvent<B>| bring_weights(b, comm, &owners, event);
            model.fetch_sharded_weights(l, &mut weights)?;
            if root {
                let layer = model.held_weights(l);
                values.extend(
                    layer
                        .into_iter()
                        .map(download)
                        .collect::<Result<Vec<_>>>()?,
                );
            }
        }
        values.push(download(&model.params.final_norm)?);
        if let Some(head) = &model.params.lm_head {
            values.push(download(head)?);
        }
        Ok(root.then_some(values))
    }

    /// Checks the weights before they are exported: an update that made them non-finite is
    /// found by the next step's loss or by a checkpoint, but the last step may have neither.
    fn check_weights_finite(&self, values: &[Vec<f32>]) -> Result<()> {
        for (spec, values) in self.model.layout.iter().zip(values) {
            if let Err(found) = tensors::check_finite(&spec.tensor.name, values) {
                let (step, found) = (self.state.step, found.to_string());
                return Err(checkpoint::diverged(
                    step,
                    &found,
                    "the model is not exported",
                ));
            }
        }
        Ok(())
    }

    /// After the last step: a checkpoint if the interval did not just write one, the full
    /// eval, and the exported model.
    pub fn finish(&mut self) -> Result<()> {
        let (o, step) = (self.o, self.state.step);
        if o.ckpt_interval > 0 && self.saved_step != Some(step) {
            self.checkpoint()?;
        }
        self.summary.final_eval = self.evaluate(None)?;
        if let Some(out) = &o.out_dir {
            self.export(out)?;
        }
        self.console.finish();
        Ok(())
    }

    /// Writes the model as it is now into `out` as a HF directory (with the tokenizer files
    /// of the model it started from). Every rank takes part in gathering the weights; rank 0
    /// writes them. A directory other than `--out-dir` (checked at the start) is checked
    /// here.
    pub fn export(&mut self, out: &Path) -> Result<()> {
        let (o, step) = (self.o, self.state.step);
        if self.comm.rank() == 0 && o.out_dir.as_deref() != Some(out) {
            hf::check_new_export_dir(out, self.model_dir.as_deref())?;
            io::create_writable_dir(out, "export")?;
        }
        let Some(values) = self.gather_weights()? else {
            return Ok(());
        };
        // A checkpoint of this step has checked the weights already.
        if self.saved_step != Some(step) {
            self.check_weights_finite(&values)?;
        }
        hf::export_values(&self.model, &values, out, o.model_dtype)?;
        if let Some(dir) = &self.model_dir {
            hf::copy_tokenizer_files(dir, out)?;
        }
        self.console.line(&format!("model: {}", out.display()));
        Ok(())
    }
}

/// The loss summed over the trained targets of `batch`, on this rank's weights.
fn forward_loss_sum<B: Backend>(
    b: &B, comm: &dyn Comm<B>, model: &mut Transformer<B>, batch: &Batch,
    owners: &Option<Vec<usize>>,
) -> Result<f64> {
    let mut weights = |event: BlockEvent<B>| bring_weights(b, comm, owners, event);
    model.forward_loss_with(b, &batch.tokens, &batch.targets, 0.0, &mut weights)?;
    model.loss_sum(b)
}

/// ZeRO-3: block `layer`'s weights (`BlockEvent::Weights`) from the rank that keeps them
/// (`owners`) to every rank's copy. Other events, and runs whose weights are not sharded,
/// need nothing.
fn bring_weights<B: Backend>(
    b: &B, comm: &dyn Comm<B>, owners: &Option<Vec<usize>>, event: BlockEvent<'_, B>,
) -> Result<()> {
    match (event, owners) {
        (BlockEvent::Weights { layer, weights }, Some(owners)) => {
            let from: Vec<(&Tensor<B>, usize)> =
                weights.iter().map(|&t| (t, owners[layer])).collect();
            comm.broadcast(b, &from)
        }
        _ => Ok(()),
    }
}
