//! Training and eval batches from token files.
//!
//! A data set is a list of token files, each cut into chunks of `seq + 1` tokens that overlap
//! by one (chunk k starts at position k·seq): the first `seq` are the inputs, the last `seq`
//! the targets. A target is trained only if the mask bit of *its own* position is set (llm.q
//! reads the input's bit, one position early); otherwise it becomes `IGNORE_INDEX`.
//!
//! Training order is one stream: epoch after epoch, each a two-level shuffle drawn from
//! (seed, epoch), first the order of the files, then the order of each file's chunks, so that
//! reading stays local to one file at a time. Rank r of W takes stream positions r, r+W,
//! r+2W, ..., running from one epoch into the next without dropping any chunk. A step of
//! global batch G (ranks × batch × accumulation) therefore trains stream positions
//! [sG, (s+1)G) at step s, whatever W is, and one rank reads the stream in order. The
//! position saved in checkpoints is global: how far into the stream all ranks together
//! have read. Eval data is read in order.

use std::path::PathBuf;

use anyhow::{Context, Result, bail, ensure};
use serde::{Deserialize, Serialize};

use crate::backend::cpu::IGNORE_INDEX;
use crate::data::tokfile::TokenFile;
use crate::rng::Rng;

/// A chunk: (file index, chunk index within the file).
type Chunk = (u32, u32);

/// Token files cut into training sequences.
pub struct DataSet {
    files: Vec<TokenFile>,
    seq: usize,
    /// First global chunk index of each file, then the total.
    starts: Vec<usize>,
}

impl DataSet {
    /// Opens every file that `pattern` (a glob) matches, checking each token against `vocab`
    /// now rather than mid-run. `flag` names the option in errors.
    pub fn open(pattern: &str, flag: &str, vocab: usize, seq: usize) -> Result<DataSet> {
        let paths = expand(pattern, flag)?;
        let mut files = vec![];
        let mut starts = vec![0];
        for path in paths {
            let file = TokenFile::open(&path, Some(vocab))?;
            let chunks = (file.len() - 1) / seq;
            if chunks == 0 {
                bail!(
                    "{}: {} tokens is too short for one sequence of --seq-len {seq} (that needs {}); use a smaller --seq-len or leave the file out of {flag}",
                    path.display(),
                    file.len(),
                    seq + 1
                );
            }
            starts.push(starts.last().expect("starts at 0") + chunks);
            files.push(file);
        }
        Ok(DataSet { files, seq, starts })
    }

    pub fn files(&self) -> &[TokenFile] {
        &self.files
    }

    pub fn num_chunks(&self) -> usize {
        *self.starts.last().expect("starts at 0")
    }

    fn chunks_in(&self, file: usize) -> usize {
        self.starts[file + 1] - self.starts[file]
    }

    /// The chunk with global index `g`, files in order.
    fn locate(&self, g: usize) -> Chunk {
        let file = self.starts.partition_point(|&s| s <= g) - 1;
        (file as u32, (g - self.starts[file]) as u32)
    }

    /// Writes one chunk's inputs and targets (`seq` each).
    fn fill(&self, (file, chunk): Chunk, tokens: &mut [i32], targets: &mut [i32]) {
        let f = &self.files[file as usize];
        let start = chunk as usize * self.seq;
        f.read(start, tokens);
        for (i, t) in targets.iter_mut().enumerate() {
            let p = start + i + 1;
            *t = if f.trained(p) {
                f.token(p)
            } else {
                IGNORE_INDEX
            };
        }
    }
}

/// The files a glob names, sorted, with an error naming the flag when there are none.
fn expand(pattern: &str, flag: &str) -> Result<Vec<PathBuf>> {
    let entries =
        glob::glob(pattern).with_context(|| format!("{flag} {pattern}: not a valid glob"))?;
    let mut paths: Vec<PathBuf> = entries
        .collect::<Result<_, _>>()
        .with_context(|| format!("{flag} {pattern}: cannot list the matching files"))?;
    paths.retain(|p| !p.is_dir());
    paths.sort();
    if paths.is_empty() {
        if pattern.contains(['*', '?', '[']) {
            bail!(
                "{flag} {pattern}: no file matches; check the pattern, or create token files with `smelt tokenize`"
            );
        }
        bail!(
            "{pattern}: no such token file ({flag}); check the path, or create it with `smelt tokenize`"
        );
    }
    Ok(paths)
}

/// One batch: `[B·T]` inputs and targets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<i32>,
    pub targets: Vec<i32>,
}

impl Batch {
    pub fn new(tokens: usize) -> Batch {
        Batch {
            tokens: vec![0; tokens],
            targets: vec![IGNORE_INDEX; tokens],
        }
    }

    /// Targets that are trained (not ignored).
    pub fn trained(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}

/// Where the ranks together stand in the training stream: in which epoch, and how many of
/// its sequences all ranks together have taken. The end of an epoch is saved as every one of
/// its sequences taken (not as none of the next epoch's), as one rank always saved it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub epoch: u64,
    pub taken: u64,
}

impl LoaderState {
    /// The position of a checkpoint of format version 1, written on `world` ranks from a data
    /// set of `sequences`, in the terms of this one. Version 1 counted each rank's own
    /// sequences: rank r took the epoch's sequences r, r+W, ... and left out the
    /// `sequences mod W` at its end. So `taken` of each rank's is `taken·W` of the stream, and
    /// an epoch taken to the end of its whole rounds goes on with the next epoch. From there
    /// the ranks take what that run would have until the epoch ends; `is_exact_from_per_rank`
    /// says whether also after.
    pub fn from_per_rank(self, world: usize, sequences: usize) -> LoaderState {
        let rounds = (sequences / world) as u64;
        if world > 1 && self.taken == rounds {
            LoaderState {
                epoch: self.epoch + 1,
                taken: 0,
            }
        } else {
            LoaderState {
                epoch: self.epoch,
                taken: self.taken * world as u64,
            }
        }
    }

    /// Whether a version-1 position of `world` ranks continues exactly: when no epoch has a
    /// remainder to leave out, version 1's stream is this one.
    pub fn is_exact_from_per_rank(world: usize, sequences: usize) -> bool {
        sequences.is_multiple_of(world)
    }
}

/// Shuffled training batches for one rank.
pub struct Loader {
    data: DataSet,
    seed: u64,
    rank: usize,
    world: usize,
    /// Stream positions all ranks together have taken; this rank's next is `consumed + rank`.
    consumed: u64,
    /// The epoch whose order `order` holds.
    order_epoch: u64,
    /// That epoch's chunks, in order.
    order: Vec<Chunk>,
}

impl Loader {
    pub fn new(data: DataSet, seed: u64, rank: usize, world: usize) -> Result<Loader> {
        ensure!(rank < world, "rank {rank} of {world}");
        let mut loader = Loader {
            data,
            seed,
            rank,
            world,
            consumed: 0,
            order_epoch: 0,
            order: vec![],
        };
        loader.order = loader.epoch_order(0);
        Ok(loader)
    }

    pub fn state(&self) -> LoaderState {
        let n = self.per_epoch() as u64;
        match self.consumed {
            0 => LoaderState::default(),
            c => LoaderState {
                epoch: (c - 1) / n,
                taken: (c - 1) % n + 1,
            },
        }
    }

    /// Continues from a saved position, on any number of ranks. A position at the end of an
    /// epoch (every sequence taken) is valid: the next batch starts the next epoch.
    pub fn restore(&mut self, state: LoaderState) -> Result<()> {
        let n = self.per_epoch() as u64;
        ensure!(
            state.taken <= n,
            "the saved data position ({} sequences into epoch {}) is past the end of an epoch of {n}; the training files differ from the checkpoint's",
            state.taken,
            state.epoch,
        );
        self.consumed = (state.epoch.checked_mul(n))
            .and_then(|start| start.checked_add(state.taken))
            .with_context(|| {
                format!(
                    "the saved data position (epoch {}) is past any this data set can reach; the checkpoint is damaged",
                    state.epoch
                )
            })?;
        Ok(())
    }

    /// Sequences per epoch, over all ranks.
    pub fn per_epoch(&self) -> usize {
        self.data.num_chunks()
    }

    /// Where this rank's `j`-th sequence of a step falls among the step's sequences in
    /// stream order.
    pub fn place_in_step(&self, j: usize) -> usize {
        place_in_step(j, self.rank, self.world)
    }

    /// Every chunk of `epoch`, in order.
    fn epoch_order(&self, epoch: u64) -> Vec<Chunk> {
        let mut rng = Rng::derived(self.seed, epoch);
        let mut files: Vec<usize> = (0..self.data.files.len()).collect();
        rng.shuffle(&mut files);
        let mut all: Vec<Chunk> = Vec::with_capacity(self.data.num_chunks());
        for f in files {
            let mut chunks: Vec<u32> = (0..self.data.chunks_in(f) as u32).collect();
            rng.shuffle(&mut chunks);
            all.extend(chunks.into_iter().map(|c| (f as u32, c)));
        }
        all
    }

    /// Fills `out` with this rank's next `out.tokens.len() / seq` sequences, running into the
    /// next epoch when this one ends.
    pub fn next_batch(&mut self, out: &mut Batch) {
        let (seq, n) = (self.data.seq, self.per_epoch() as u64);
        for (tokens, targets) in out.tokens.chunks_mut(seq).zip(out.targets.chunks_mut(seq)) {
            let at = self.consumed + self.rank as u64;
            if at / n != self.order_epoch {
                self.order_epoch = at / n;
                self.order = self.epoch_order(self.order_epoch);
            }
            let chunk = self.order[(at % n) as usize];
            self.data.fill(chunk, tokens, targets);
            self.consumed += self.world as u64;
        }
    }
}

/// Eval batches, read in order. Rank r takes chunks r, r+W, ...; the last batch is padded
/// with ignored targets.
pub struct EvalSet {
    data: DataSet,
    batch: usize,
    rank: usize,
    world: usize,
}

impl EvalSet {
    pub fn new(data: DataSet, batch: usize, rank: usize, world: usize) -> EvalSet {
        EvalSet {
            data,
            batch,
            rank,
            world,
        }
    }

    /// Batches in one full pass; every rank gets the same count.
    pub fn num_batches(&self) -> usize {
        self.data
            .num_chunks()
            .div_ceil(self.world)
            .div_ceil(self.batch)
    }

    /// Writes eval batch `i`.
    pub fn fill(&self, i: usize, out: &mut Batch) {
        let seq = self.data.seq;
        for (j, (tokens, targets)) in out
            .tokens
            .chunks_mut(seq)
            .zip(out.targets.chunks_mut(seq))
            .enumerate()
        {
            let g = (i * self.batch + j) * self.world + self.rank;
            if g < self.data.num_chunks() {
                self.data.fill(self.data.locate(g), tokens, targets);
            } else {
                tokens.fill(0);
                targets.fill(IGNORE_INDEX);
            }
        }
    }
}

/// Where the `j`-th sequence of a step on rank `rank` of `world` falls among the step's
/// sequences in stream order: the ranks take them in turn.
pub fn place_in_step(j: usize, rank: usize, world: usize) -> usize {
    j * world + rank
}
