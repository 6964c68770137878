//! Checkpoints: one directory per step holding the tensors (safetensors, at each tensor's
//! dtype, so they round-trip exactly) and `state.json` with everything else needed to
//! continue bit for bit: step, schedule, data-loader position, RNG, and what must not change
//! (model config hash, dtypes, sequence length, data files, and the global batch, with the
//! world size and the per-rank batch that made it up).
//!
//! A checkpoint is written under a temporary name, synced, verified and renamed into place;
//! only then is the `latest` pointer replaced, itself by a synced rename. A process killed at
//! any point leaves `latest` naming a complete checkpoint. Verified means: every tensor was
//! finite when it was written (the writer reads each one to the host anyway, so the check
//! costs a pass over memory already read), every file reads back whole with the tensors it
//! should hold, and `state.json` reads back as the state written. A checkpoint that fails
//! (a non-finite update, a full disk) leaves no temporary folder, and `latest` where it was.
//!
//! With several ranks, rank 0 writes what every rank holds alike (the weights, and the
//! optimizer state unless it is sharded), each rank writes its own share of a sharded
//! optimizer state (`adam_m.rank1.safetensors`, ...), whole tensors under their names, and
//! rank 0 completes the checkpoint once every rank has written.
//!
//! A checkpoint continues on any number of ranks, sharded or not, as long as the global
//! batch (ranks × batch × accumulation) is the same: the data position counts the sequences
//! of all ranks together (`loader`), and each rank finds each optimizer tensor it now keeps
//! in whichever file of its category holds it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::guard::GuardState;
use super::loader::LoaderState;
use super::optimizer::AdamWState;
use super::schedule::Schedule;
use super::zero;
use crate::backend::Backend;
use crate::comm::Comm;
use crate::hash::fnv1a;
use crate::io::atomic::{sync_dir, temporary_name, write_bytes_atomically};
use crate::io::tensors::{self, Named, NonFinite, TensorFiles};
use crate::model::{ModelConfig, Transformer, Weights};
use crate::rng::Rng;
use crate::tensor::DType;

/// Version 1 counted each rank's own sequences in the data position, and held the batch size,
/// the accumulation, the world size and the ZeRO level fixed; version 2 counts all ranks'
/// sequences and holds their global batch fixed. On one rank the two agree, so version 1's
/// checkpoints of one rank continue as they are, and those of several are converted
/// (`LoaderState::from_per_rank`).
pub const VERSION: u32 = 2;
/// What version 1 held fixed that version 2 does not (see `VERSION`).
const FIXED_IN_VERSION_1: [&str; 3] = ["--batch-size", "--grad-accumulation", "--zero-level"];
/// The pointer file naming the newest complete checkpoint.
pub const LATEST: &str = "latest";
const STATE: &str = "state.json";
const WEIGHTS: &str = "model";

/// A test hook: with this set to N, the writer pauses N ms after each tensor file, so that a
/// test can kill the process in the middle of a checkpoint.
pub const DELAY_ENV: &str = "SMELT_TEST_CHECKPOINT_DELAY_MS";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct State {
    pub version: u32,
    /// Optimizer steps completed.
    pub step: u64,
    /// The ranks of the run that wrote it: with the options' batch size and accumulation, its
    /// global batch; with the options' ZeRO level, which files hold the optimizer state.
    pub world_size: usize,
    /// A hash of `model_config` and `fixed`.
    pub config_hash: String,
    /// The model's HF `config.json`.
    pub model_config: Value,
    /// Settings that must be equal to continue, by flag name.
    pub fixed: BTreeMap<String, Value>,
    /// Every option of the run, for warnings about those changed on continuing.
    pub options: Value,
    pub schedule: Schedule,
    pub loader: LoaderState,
    pub rng: Rng,
    pub tokens_seen: u64,
    /// The model directory the run started from, whose tokenizer files belong to it.
    pub model_dir: Option<PathBuf>,
    /// What the guard remembers (absent from the checkpoints of an earlier smelt: empty).
    #[serde(default)]
    pub guard: GuardState,
}

impl State {
    pub fn hash(model_config: &Value, fixed: &BTreeMap<String, Value>) -> String {
        // serde_json's maps are sorted, so this text is canonical.
        let text = serde_json::to_string(&(model_config, fixed)).expect("JSON values serialize");
        format!("{:016x}", fnv1a(text.as_bytes()))
    }

    /// The global batch of the run this state is of.
    pub fn global_batch(&self) -> Result<GlobalBatch> {
        let option = |key: &str| {
            (self.options[key].as_u64())
                .filter(|&v| v > 0)
                .map(|v| v as usize)
                .with_context(|| {
                    format!(
                        "`options.{key}` is not a positive integer (edited by hand?); point `{LATEST}` at an earlier step-N directory"
                    )
                })
        };
        Ok(GlobalBatch {
            ranks: self.world_size,
            batch_size: option("batch_size")?,
            grad_accumulation: option("grad_accumulation")?,
        })
    }

    /// Refuses to continue from `saved` unless the model, the fixed settings and the global
    /// batch match. Returns what else changed, to warn about: the world size, and the
    /// options other than those in `free`.
    pub fn check_continues(
        &self, saved: &State, path: &Path, free: &[&str],
    ) -> Result<Vec<String>> {
        let mut diffs = vec![];
        if !(1..=VERSION).contains(&saved.version) {
            diffs.push(format!(
                "checkpoint format version {} (this build reads 1 to {VERSION})",
                saved.version
            ));
        }
        let config = differences(&saved.model_config, &self.model_config);
        diffs.extend(
            config
                .into_iter()
                .map(|(k, d)| format!("model config `{k}`: {d}")),
        );
        let mut saved_fixed = saved.fixed.clone();
        if saved.version == 1 {
            saved_fixed.retain(|k, _| !FIXED_IN_VERSION_1.contains(&k.as_str()));
        }
        let fixed = differences(&to_object(&saved_fixed), &to_object(&self.fixed));
        diffs.extend(fixed.into_iter().map(|(k, d)| format!("{k}: {d}")));
        let state = || path.join(STATE).display().to_string();
        let (was, now) = (
            saved.global_batch().with_context(state)?,
            self.global_batch()?,
        );
        if was.sequences() != now.sequences() {
            diffs.push(format!(
                "global batch: checkpoint {was}, this run {}; keep ranks × --batch-size × \
                 --grad-accumulation at {}{}",
                now.short(),
                was.sequences(),
                now.suggestion(was.sequences())
            ));
        }
        if !diffs.is_empty() {
            bail!(
                "--continue: checkpoint {} was written by an incompatible run:\n  {}\nrerun with the checkpoint's settings, or start afresh with another --checkpoint-dir",
                path.display(),
                diffs.join("\n  ")
            );
        }
        let mut warnings = vec![];
        if was.ranks != now.ranks {
            warnings.push(format!(
                "the world size changed on continuing: checkpoint {}, this run {}; each step \
                 trains the same {} sequences, but the sums over the ranks round in another \
                 order, so the losses are close to those on {}, not the same bits",
                ranks(was.ranks),
                ranks(now.ranks),
                now.sequences(),
                ranks(was.ranks)
            ));
        }
        warnings.extend(
            differences(&saved.options, &self.options)
                .into_iter()
                .filter(|(k, _)| !free.contains(&k.as_str()))
                .map(|(k, d)| format!("--{} changed on continuing: {d}", k.replace('_', "-"))),
        );
        Ok(warnings)
    }

    /// The files holding category `category` of the optimizer state in `checkpoint`: one per
    /// rank where the run that wrote it sharded the state, else one.
    fn state_files(&self, checkpoint: &Path, category: &str) -> Vec<PathBuf> {
        self.files_of(
            checkpoint,
            category,
            zero::shards(self.world_size, self.zero_level()),
        )
    }

    /// The files holding the weights in `checkpoint`: one per rank where the run that wrote
    /// it sharded them (ZeRO-3), else one.
    pub fn weight_files(&self, checkpoint: &Path) -> Vec<PathBuf> {
        let sharded = zero::shards_weights(self.world_size, self.zero_level());
        self.files_of(checkpoint, WEIGHTS, sharded)
    }

    fn zero_level(&self) -> u8 {
        // Runs from before `--zero-level` existed have none, and never sharded.
        self.options["zero_level"].as_u64().unwrap_or(0) as u8
    }

    fn files_of(&self, checkpoint: &Path, stem: &str, sharded: bool) -> Vec<PathBuf> {
        let shards: Vec<Option<usize>> = match sharded {
            true => (0..self.world_size).map(Some).collect(),
            false => vec![None],
        };
        (shards.into_iter())
            .map(|shard| checkpoint.join(file_name(&state_stem(stem, shard))))
            .collect()
    }
}

/// The sequences of a step over all ranks, and the settings they come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalBatch {
    pub ranks: usize,
    pub batch_size: usize,
    pub grad_accumulation: usize,
}

impl GlobalBatch {
    pub fn sequences(&self) -> usize {
        self.ranks * self.batch_size * self.grad_accumulation
    }

    /// The product without the flag names: `1 × 2 × 2 = 4`.
    fn short(&self) -> String {
        let (r, b, a) = (self.ranks, self.batch_size, self.grad_accumulation);
        format!("{r} × {b} × {a} = {}", self.sequences())
    }

    /// A hint for making `want` sequences per step on these ranks, changing one flag where
    /// one can.
    fn suggestion(&self, want: usize) -> String {
        let (r, b, a) = (self.ranks, self.batch_size, self.grad_accumulation);
        if want.is_multiple_of(r * b) {
            format!(", e.g. --grad-accumulation {}", want / (r * b))
        } else if want.is_multiple_of(r * a) {
            format!(", e.g. --batch-size {}", want / (r * a))
        } else if want.is_multiple_of(r) {
            format!(", e.g. --batch-size {} --grad-accumulation 1", want / r)
        } else {
            format!(", on a number of ranks that divides {want}")
        }
    }
}

/// `1 rank`, `2 ranks`.
fn ranks(n: usize) -> String {
    match n {
        1 => "1 rank".into(),
        n => format!("{n} ranks"),
    }
}

impl std::fmt::Display for GlobalBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} × --batch-size {} × --grad-accumulation {} = {} sequences",
            ranks(self.ranks),
            self.batch_size,
            self.grad_accumulation,
            self.sequences()
        )
    }
}

fn to_object(map: &BTreeMap<String, Value>) -> Value {
    Value::Object(map.clone().into_iter().collect())
}

/// The keys of two JSON objects whose values differ, each with "checkpoint A, this run B".
fn differences(saved: &Value, now: &Value) -> Vec<(String, String)> {
    let empty = serde_json::Map::new();
    let (a, b) = (
        saved.as_object().unwrap_or(&empty),
        now.as_object().unwrap_or(&empty),
    );
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    let show = |v: Option<&Value>| v.map_or("(none)".to_string(), Value::to_string);
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            let text = format!("checkpoint {}, this run {}", show(a.get(k)), show(b.get(k)));
            (k.clone(), text)
        })
        .collect()
}

/// A tensor file of a checkpoint: its stem, its tensors, and whether every rank holds the
/// same values (so that rank 0 alone writes it).
struct File<'a, B: Backend> {
    stem: String,
    tensors: Named<'a, B>,
    shared: bool,
}

/// This rank's tensor files of a checkpoint: the weights, and the optimizer state or this
/// rank's share of it.
fn files<'a, B: Backend>(model: &'a Transformer<B>, opt: &'a AdamWState<B>) -> Vec<File<'a, B>> {
    // ZeRO-3: each rank writes the blocks it keeps, and rank 0 also what every rank keeps.
    let sharded = model.options.weights != Weights::All;
    let weights = match opt.shard.filter(|_| sharded) {
        Some(rank) => File {
            stem: state_stem(WEIGHTS, Some(rank)),
            tensors: {
                let (layout, params) = (&model.layout, &model.params);
                let outside =
                    (layout.outside_blocks().zip(params.outside_blocks())).filter(|_| rank == 0);
                let blocks = (0..model.config.num_layers)
                    .filter(|&l| model.keeps_weights(l))
                    .flat_map(|l| layout.layers[l].iter().zip(params.layers[l].iter()));
                (outside.chain(blocks))
                    .map(|(spec, t)| (spec.tensor.name.clone(), t))
                    .collect()
            },
            shared: false,
        },
        None => File {
            stem: WEIGHTS.to_string(),
            tensors: weights(model),
            shared: true,
        },
    };
    let state = opt
        .categories(model)
        .into_iter()
        .map(|(category, tensors)| File {
            stem: state_stem(category, opt.shard),
            tensors,
            shared: opt.shard.is_none(),
        });
    std::iter::once(weights).chain(state).collect()
}

/// The stem of the file holding `category` (the weights, or an optimizer state), or rank
/// `shard`'s share of it.
fn state_stem(category: &str, shard: Option<usize>) -> String {
    match shard {
        Some(rank) => format!("{category}.rank{rank}"),
        None => category.to_string(),
    }
}

fn file_name(stem: &str) -> String {
    format!("{stem}.safetensors")
}

/// The directory of the checkpoint after `step` steps.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:08}"))
}

/// The weights this rank of `model` keeps (all of them, unless ZeRO-3 shards them), under
/// their parameter names.
pub fn weights<B: Backend>(model: &Transformer<B>) -> Named<'_, B> {
    (model.kept_params())
        .map(|(spec, t)| (spec.tensor.name.clone(), t))
        .collect()
}

/// Writes a checkpoint of `state.step` into `dir` and points `latest` at it. Every rank
/// calls it. On failure nothing of the checkpoint is left, and the error says what failed:
/// a tensor that is not finite (the step's update diverged) or a write (a full disk).
pub fn save<B: Backend>(
    b: &B, comm: &dyn Comm<B>, dir: &Path, state: &State, model: &Transformer<B>,
    opt: &AdamWState<B>,
) -> Result<PathBuf> {
    let last = step_dir(dir, state.step);
    let tmp = temporary_name(&last);
    let Err(e) = write(b, comm, dir, state, model, opt, &tmp, &last) else {
        return Ok(last);
    };
    if comm.rank() == 0 {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let latest = match std::fs::read_to_string(dir.join(LATEST)) {
        Ok(name) => format!("`{LATEST}` still names {}", name.trim()),
        Err(_) => "there is no earlier checkpoint".into(),
    };
    Err(
        match e.chain().find_map(|c| c.downcast_ref::<NonFinite>()) {
            Some(_) => diverged(state.step, &format!("{e:#}"), &latest),
            None => e.context(format!(
                "checkpoint {} not written ({latest})",
                last.display()
            )),
        },
    )
}

/// The error for a run whose update of `step` left the training state not finite (`found`
/// says where), which stops without saving it (`kept` says what is on disk instead).
pub fn diverged(step: u64, found: &str, kept: &str) -> anyhow::Error {
    anyhow!(
        "step {step}: after its update the training state is not finite ({found}), so it is \
         not saved ({kept}); lower --lr (or lengthen --warmup) and run again"
    )
}

#[allow(clippy::too_many_arguments)]
fn write<B: Backend>(
    b: &B, comm: &dyn Comm<B>, dir: &Path, state: &State, model: &Transformer<B>,
    opt: &AdamWState<B>, tmp: &Path, last: &Path,
) -> Result<()> {
    let io = |what: &str, p: &Path| format!("writing checkpoint: {what} {}", p.display());
    let root = comm.rank() == 0;
    if root {
        if tmp.exists() {
            // Left by a run killed while writing; it was never complete.
            std::fs::remove_dir_all(tmp).with_context(|| io("removing", tmp))?;
        }
        std::fs::create_dir_all(tmp).with_context(|| io("creating", tmp))?;
    }
    // The ranks meet once the folder exists, and again once each has written its files.
    comm.sum(&[])?;
    let delay = std::env::var(DELAY_ENV).ok().and_then(|v| v.parse().ok());
    let mine: Vec<File<B>> = files(model, opt)
        .into_iter()
        .filter(|f| root || !f.shared)
        .collect();
    for file in &mine {
        let name = file_name(&file.stem);
        let path = tmp.join(&name);
        tensors::save(b, &path, &file.tensors).map_err(|e| match e.is::<NonFinite>() {
            true => e.context(name.clone()),
            false => e,
        })?;
        if let Some(ms) = delay {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    }
    for file in &mine {
        tensors::verify(&tmp.join(file_name(&file.stem)), &file.tensors)?;
    }
    comm.sum(&[])?;
    if !root {
        return Ok(());
    }
    let state_path = tmp.join(STATE);
    write_bytes_atomically(&state_path, &serde_json::to_vec_pretty(state)?)?;
    let read_back = serde_json::to_value(read_state(tmp)?)?;
    ensure!(
        read_back == serde_json::to_value(state)?,
        "{}: reads back other than it was written",
        state_path.display()
    );
    if last.exists() {
        // A checkpoint past `latest` from a run that died before it could point at it.
        if read_latest(dir)?.as_deref() == Some(last) {
            bail!(
                "{}: refusing to replace the latest checkpoint",
                last.display()
            );
        }
        std::fs::remove_dir_all(last).with_context(|| io("removing", last))?;
    }
    std::fs::rename(tmp, last).with_context(|| io("renaming into place", last))?;
    sync_dir(last)?;
    let name = last.file_name().expect("step dirs have names");
    write_bytes_atomically(&dir.join(LATEST), name.as_encoded_bytes())
}

/// Whether `dir` is a complete checkpoint: its state is written last.
pub fn is_complete(dir: &Path) -> bool {
    dir.join(STATE).is_file()
}

/// The checkpoint `latest` points at in `dir`, if there is one.
pub fn read_latest(dir: &Path) -> Result<Option<PathBuf>> {
    let pointer = dir.join(LATEST);
    if !pointer.exists() {
        return Ok(None);
    }
    let name = std::fs::read_to_string(&pointer)
        .with_context(|| format!("reading {}", pointer.display()))?;
    let path = dir.join(name.trim());
    if !is_complete(&path) {
        bail!(
            "{}: names {}, which is not a complete checkpoint; point it at an existing step-N directory",
            pointer.display(),
            path.display()
        );
    }
    Ok(Some(path))
}

/// A checkpoint read for its model alone (`smelt sample`, `smelt export`).
pub struct SavedModel {
    /// The step-N directory.
    pub path: PathBuf,
    pub state: State,
    pub config: ModelConfig,
    /// The dtype the run kept its weights in, and `model.safetensors` stores them in.
    pub dtype: DType,
}

impl SavedModel {
    /// The checkpoint that `--checkpoint DIR` names: `DIR` itself, a step-N directory, or the
    /// one that `latest` names in a --checkpoint-dir.
    pub fn open(dir: &Path) -> Result<SavedModel> {
        let path = read_latest(dir)?.unwrap_or_else(|| dir.to_path_buf());
        if !is_complete(&path) {
            bail!(
                "--checkpoint {}: neither a step-N checkpoint directory (with {STATE}) nor a --checkpoint-dir with a `{LATEST}` file; pass one of those",
                path.display()
            );
        }
        let state = read_state(&path)?;
        let source = path.join(STATE).display().to_string();
        let config = ModelConfig::from_json(&state.model_config, &source)?;
        let dtype = serde_json::from_value(state.options["model_dtype"].clone())
            .with_context(|| format!("{source}: no valid `options.model_dtype`"))?;
        Ok(SavedModel {
            path,
            state,
            config,
            dtype,
        })
    }
}

/// Reads a checkpoint's `state.json`, and checks that it is consistent: its hash is that of
/// its model config and fixed settings, and a `step-N` folder's state is of step N.
pub fn read_state(checkpoint: &Path) -> Result<State> {
    let path = checkpoint.join(STATE);
    let text = std::fs::read(&path).with_context(|| format!("{}: cannot read", path.display()))?;
    let state: State = serde_json::from_slice(&text).with_context(|| {
        format!(
            "{}: not a smelt checkpoint state (truncated, corrupt, or written by another version); point `{LATEST}` at an earlier step-N directory",
            path.display()
        )
    })?;
    let folder = checkpoint
        .file_name()
        .map(|n| n.to_string_lossy().into_owned());
    let step = folder
        .as_deref()
        .and_then(|n| n.strip_prefix("step-"))
        .and_then(|n| n.parse::<u64>().ok());
    if State::hash(&state.model_config, &state.fixed) != state.config_hash {
        bail!(
            "{}: its config_hash does not match its model_config and fixed settings (edited by hand?); point `{LATEST}` at an earlier step-N directory",
            path.display()
        );
    }
    if let Some(step) = step.filter(|&s| s != state.step) {
        bail!(
            "{}: is the state of step {}, not of step {step}, whose folder it is in (copied from another checkpoint?); point `{LATEST}` at an earlier step-N directory",
            path.display(),
            state.step
        );
    }
    Ok(state)
}

/// Loads a checkpoint's weights and optimizer state, which the run that wrote `saved` may
/// have sharded otherwise than this one, into allocated tensors: each state tensor that this
/// rank keeps comes from whichever file of its category holds it, and every tensor of the
/// model must be in exactly one of them.
pub fn load<B: Backend>(
    b: &B, checkpoint: &Path, saved: &State, model: &Transformer<B>, opt: &AdamWState<B>,
) -> Result<()> {
    let names: Vec<&str> = (model.layout.iter())
        .map(|p| p.tensor.name.as_str())
        .collect();
    let read = |paths: &[PathBuf], names: &[&str], tensors: &Named<B>| -> Result<()> {
        let files = TensorFiles::open(paths)?;
        files.check_names(names)?;
        files.load(b, tensors)
    };
    let weights = (saved.weight_files(checkpoint), names, weights(model));
    let state = (opt.categories(model).into_iter()).map(|(category, tensors)| {
        let held = opt.held_by(category, model);
        (saved.state_files(checkpoint, category), held, tensors)
    });
    for (paths, names, tensors) in std::iter::once(weights).chain(state) {
        read(&paths, &names, &tensors).with_context(|| {
            format!(
                "--continue: checkpoint {} is damaged; to continue from an earlier one, write its step-N name into {}",
                checkpoint.display(),
                checkpoint.with_file_name(LATEST).display()
            )
        })?;
    }
    model.weights_changed();
    Ok(())
}

/// Loads only the weights, for sampling and export: every weight, from whichever of the
/// checkpoint's files holds it.
pub fn load_weights<B: Backend>(
    b: &B, checkpoint: &Path, saved: &State, model: &Transformer<B>,
) -> Result<()> {
    let names: Vec<&str> = (model.layout.iter())
        .map(|p| p.tensor.name.as_str())
        .collect();
    let files = TensorFiles::open(&saved.weight_files(checkpoint));
    (files.and_then(|f| {
        f.check_names(&names)
            .and_then(|()| f.load(b, &weights(model)))
    }))
    .with_context(|| {
        format!(
            "checkpoint {} is damaged; use another step-N directory",
            checkpoint.display()
        )
    })?;
    model.weights_changed();
    Ok(())
}
