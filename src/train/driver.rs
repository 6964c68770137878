//! A run driven step by step by its caller (the Python package): each rank of this process
//! runs a `Run` on a thread of its own, with its own device, and does what the caller sends
//! it, so that the caller owns the loop, the schedule and the data while every step runs as
//! in `smelt train`. A command goes to every local rank and returns once each has done it;
//! nothing else waits for the device.
//!
//! The batch of a step holds the sequences of every local rank, in the order of the
//! training stream: rank r of L takes sequences r, r + L, r + 2L, ... (as `Loader` deals
//! them), so that a caller that reads the stream in order feeds the ranks what `smelt train`
//! would.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::{Context, Result, anyhow, bail, ensure};

use super::Options;
use super::loader::Batch;
use super::options::Resolved;
use super::trainer::{Run, StepResult};
use crate::backend::Backend;
use crate::backend::cpu::IGNORE_INDEX;
use crate::backend::telemetry::Telemetry;
use crate::comm::Comm;
use crate::comm::ranks::{RankMain, Ranks, on_ranks};

/// Token ids of `rows` sequences, with their targets (`IGNORE_INDEX` where not trained).
#[derive(Clone, Debug)]
pub struct Rows {
    pub tokens: Vec<i32>,
    pub targets: Vec<i32>,
}

pub enum Command {
    /// The forward and backward of one step: `grad_accumulation` micro-batches of every
    /// local rank's `batch_size` sequences.
    Step(Arc<Rows>),
    /// The step's update at this rate.
    Update(f64),
    /// The loss over one batch of every local rank's `batch_size` sequences.
    Eval(Arc<Rows>),
    Checkpoint,
    Export(PathBuf),
    Memory,
    /// The run ends.
    Close,
}

pub enum Reply {
    /// The run has started, at this step.
    Started(u64),
    Done,
    Step(StepResult),
    /// Loss summed over the trained targets, and their count.
    Eval(f64, u64),
    Checkpoint(PathBuf),
    Memory(Vec<(String, u64)>),
}

pub struct Driver {
    pub options: Options,
    /// Ranks in this process, each fed by one sender.
    local: usize,
    /// Ranks in the whole run.
    pub world: usize,
    /// Steps the run has done (more than 0 for one continued from a checkpoint).
    pub steps_done: u64,
    inboxes: Vec<Sender<Command>>,
    replies: Receiver<Result<Reply>>,
    ranks: Option<JoinHandle<Result<()>>>,
}

impl Driver {
    /// Starts the run that `resolve` gives (the command line's `resolve_without_data`): its
    /// weights made or read, its checkpoint continued from. Returns once every local rank
    /// is ready, or with the first error. `resolve` runs on the thread that then runs the
    /// ranks, since it opens a device, which stays on its thread.
    pub fn start(resolve: impl FnOnce() -> Result<Resolved> + Send + 'static) -> Result<Driver> {
        let (setup, ready) = channel();
        let (reply, replies) = channel();
        let ranks = std::thread::spawn(move || {
            let resolved = match resolve() {
                Ok(r) => r,
                Err(e) => {
                    let message = format!("{e:#}");
                    let _ = setup.send(Err(e));
                    bail!("{message}");
                }
            };
            let Resolved {
                options,
                device,
                ranks,
                timeout,
                telemetry,
            } = resolved;
            let (local, world) = match &ranks {
                Ranks::Threads(n) => (*n, *n),
                Ranks::Process(launch) => (1, launch.world),
            };
            let (senders, receivers): (Vec<_>, Vec<_>) = (0..local).map(|_| channel()).unzip();
            let _ = setup.send(Ok((options.clone(), world, senders)));
            let driven = Driven {
                options,
                telemetry,
                local,
                inboxes: Mutex::new(receivers.into_iter().map(Some).collect()),
                reply,
            };
            on_ranks(device, ranks, timeout, driven)
        });
        let (options, world, inboxes) =
            (ready.recv()).map_err(|_| anyhow!("the run's thread ended before it started"))??;
        let mut driver = Driver {
            options,
            local: inboxes.len(),
            world,
            inboxes,
            replies,
            ranks: Some(ranks),
            steps_done: 0,
        };
        if let Reply::Started(step) = driver.collect()? {
            driver.steps_done = step;
        }
        Ok(driver)
    }

    /// Has every local rank do `command`; rank 0's reply, or the first error.
    pub fn call(&mut self, command: impl Fn() -> Command) -> Result<Reply> {
        for inbox in &self.inboxes {
            if inbox.send(command()).is_err() {
                return Err(self.ended());
            }
        }
        let reply = self.collect()?;
        if let Reply::Step(r) = &reply {
            self.steps_done = r.step;
        }
        Ok(reply)
    }

    /// One reply from each local rank.
    fn collect(&mut self) -> Result<Reply> {
        let mut first = None;
        let mut error = None;
        for _ in 0..self.local {
            match self.replies.recv() {
                Ok(Ok(reply)) => first = first.or(Some(reply)),
                Ok(Err(e)) => error = error.or(Some(e)),
                Err(_) => return Err(self.ended()),
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(first.expect("one reply per local rank, at least one rank")),
        }
    }

    /// Why the ranks stopped answering: the error their run ended with.
    fn ended(&mut self) -> anyhow::Error {
        match self.ranks.take().map(JoinHandle::join) {
            Some(Ok(Err(e))) => e,
            Some(Err(_)) => anyhow!("a rank's thread panicked"),
            _ => anyhow!("the run has ended"),
        }
    }

    /// The rows a command's batch must hold: `micro_batches` of every local rank's
    /// `--batch-size` sequences.
    pub fn rows(&self, micro_batches: usize) -> usize {
        self.local * self.options.batch_size * micro_batches
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        for inbox in &self.inboxes {
            let _ = inbox.send(Command::Close);
        }
        if let Some(ranks) = self.ranks.take() {
            let _ = ranks.join();
        }
    }
}

/// What each rank runs: its `Run`, commanded through its inbox.
struct Driven {
    options: Options,
    telemetry: Option<Telemetry>,
    local: usize,
    inboxes: Mutex<Vec<Option<Receiver<Command>>>>,
    reply: Sender<Result<Reply>>,
}

impl RankMain for Driven {
    type Output = ();

    fn run<B: Backend>(&self, b: &B, comm: &dyn Comm<B>) -> Result<()> {
        let index = comm.rank() % self.local;
        let inbox = (self.inboxes.lock()).map_err(|_| anyhow!("a rank panicked while starting"))?
            [index]
            .take()
            .context("each local rank takes its own inbox")?;
        let o = &self.options;
        let started =
            Run::open(b, comm, o, None, self.telemetry.as_ref()).and_then(|(mut run, resume)| {
                run.logging_failure(|run| run.start(resume))?;
                Ok(run)
            });
        let mut run = match started {
            Ok(run) => run,
            Err(e) => {
                let message = format!("{e:#}");
                let _ = self.reply.send(Err(e));
                bail!("{message}");
            }
        };
        let _ = self.reply.send(Ok(Reply::Started(run.steps_done())));
        for command in inbox {
            let reply = match command {
                Command::Close => return Ok(()),
                Command::Step(rows) => {
                    let batches = batches(&rows, o, index, self.local, o.grad_accumulation);
                    batches
                        .and_then(|b| run.accumulate(&b))
                        .map(|()| Reply::Done)
                }
                Command::Update(lr) => run.update(lr).map(Reply::Step),
                Command::Eval(rows) => batches(&rows, o, index, self.local, 1)
                    .and_then(|b| run.eval_batch(&b[0]))
                    .map(|(sum, trained)| Reply::Eval(sum, trained)),
                Command::Checkpoint => run.checkpoint().map(Reply::Checkpoint),
                Command::Export(dir) => run.export(&dir).map(|()| Reply::Done),
                Command::Memory => Ok(Reply::Memory(run.memory())),
            };
            if self.reply.send(reply).is_err() {
                break;
            }
        }
        Ok(())
    }
}

/// Rank `rank`'s (of `local`) share of `rows`, as `micro_batches` batches of `--batch-size`
/// sequences.
fn batches(
    rows: &Rows, o: &Options, rank: usize, local: usize, micro_batches: usize,
) -> Result<Vec<Batch>> {
    let (seq, batch) = (o.seq_len, o.batch_size);
    let sequences = local * batch * micro_batches;
    ensure!(
        rows.tokens.len() == sequences * seq && rows.targets.len() == rows.tokens.len(),
        "a batch of {} tokens and {} targets: give {sequences} sequences of {seq} (batch_size \
         {batch} × {micro_batches} micro-batches × {local} local ranks)",
        rows.tokens.len(),
        rows.targets.len(),
    );
    let mut out = vec![Batch::new(batch * seq); micro_batches];
    for (m, micro) in out.iter_mut().enumerate() {
        for i in 0..batch {
            let row = (m * batch + i) * local + rank;
            let from = row * seq..(row + 1) * seq;
            micro.tokens[i * seq..(i + 1) * seq].copy_from_slice(&rows.tokens[from.clone()]);
            micro.targets[i * seq..(i + 1) * seq].copy_from_slice(&rows.targets[from]);
        }
    }
    Ok(out)
}

/// The targets of `tokens` (`[sequences, seq]`) when none are given: each token's next
/// within its sequence, the last one's not trained; with `mask` (1 trains), the others
/// masked out too.
pub fn next_token_targets(tokens: &[i32], seq: usize, mask: Option<&[u8]>) -> Vec<i32> {
    let mut targets = vec![IGNORE_INDEX; tokens.len()];
    for (t, row) in targets.chunks_mut(seq).zip(tokens.chunks(seq)) {
        t[..seq - 1].copy_from_slice(&row[1..]);
    }
    if let Some(mask) = mask {
        for (t, &m) in targets.iter_mut().zip(mask) {
            if m == 0 {
                *t = IGNORE_INDEX;
            }
        }
    }
    targets
}
