//! `smelt._smelt`: the extension module under the `smelt` Python package (python/smelt/),
//! which converts arrays to the little-endian int32 bytes taken here and keyword arguments
//! to `smelt train`'s flags. Everything here hands work to smelt's engine and waits for it
//! with the GIL released; smelt's errors become `smelt.SmeltError` with smelt's message.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use smelt::backend::cpu::IGNORE_INDEX;
use smelt::train::driver::{Command, Driver, Reply, Rows, next_token_targets};
use smelt::train::loader::{Batch, DataSet, Loader};
use smelt::train::schedule::Schedule;

create_exception!(
    smelt,
    SmeltError,
    PyException,
    "An error smelt reports, with its message."
);

fn error(e: anyhow::Error) -> PyErr {
    SmeltError::new_err(format!("{e:#}"))
}

/// Int32 values from their little-endian bytes.
fn int32s(bytes: &[u8], what: &str) -> PyResult<Vec<i32>> {
    if !bytes.len().is_multiple_of(4) {
        return Err(SmeltError::new_err(format!("{what}: not int32 values")));
    }
    Ok((bytes.chunks_exact(4))
        .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect())
}

fn bytes_of(values: &[i32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A training run driven from Python (see `smelt.Trainer`). Unsendable: its driver's
/// channels stay with the Python thread that made it.
#[pyclass(module = "smelt._smelt", unsendable)]
struct Trainer {
    driver: Option<Driver>,
    schedule: Schedule,
    vocab_size: usize,
}

impl Trainer {
    fn driver(&mut self) -> PyResult<&mut Driver> {
        (self.driver.as_mut()).ok_or_else(|| SmeltError::new_err("the trainer is closed"))
    }

    /// `tokens` and `targets` (or the next tokens, with `mask`) as the rows of `micro`
    /// micro-batches, checked against the model's vocabulary.
    fn rows(
        &mut self, tokens: &[u8], targets: Option<&[u8]>, mask: Option<&[u8]>, micro: usize,
    ) -> PyResult<Arc<Rows>> {
        let vocab = self.vocab_size;
        let driver = self.driver()?;
        let (seq, rows) = (driver.options.seq_len, driver.rows(micro));
        let tokens = int32s(tokens, "tokens")?;
        if tokens.len() != rows * seq {
            return Err(SmeltError::new_err(format!(
                "tokens: {} values; give {rows} sequences of {} ({} × batch_size {} × {micro} \
                 micro-batches), shaped [{rows}, {seq}]",
                tokens.len(),
                seq,
                rows / (driver.options.batch_size * micro),
                driver.options.batch_size,
            )));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t < 0 || t as usize >= vocab) {
            return Err(SmeltError::new_err(format!(
                "tokens: {bad} is not a token id of the model's vocabulary of {vocab}"
            )));
        }
        let targets = match targets {
            Some(t) => int32s(t, "targets")?,
            None => next_token_targets(&tokens, seq, mask),
        };
        if targets.len() != tokens.len() {
            return Err(SmeltError::new_err(format!(
                "targets: {} values for {} tokens; give them the tokens' shape",
                targets.len(),
                tokens.len()
            )));
        }
        let trained = |t: i32| t == IGNORE_INDEX || (t >= 0 && (t as usize) < vocab);
        if let Some(bad) = targets.iter().find(|&&t| !trained(t)) {
            return Err(SmeltError::new_err(format!(
                "targets: {bad} is neither a token id of the model's vocabulary of {vocab} nor                  {IGNORE_INDEX} (not trained)"
            )));
        }
        Ok(Arc::new(Rows { tokens, targets }))
    }

    fn call(&mut self, py: Python<'_>, command: impl Fn() -> Command + Send) -> PyResult<Reply> {
        let driver = self.driver()?;
        py.detach(|| driver.call(command)).map_err(error)
    }
}

#[pymethods]
impl Trainer {
    /// `args`: `smelt train`'s flags, without the data.
    #[new]
    fn new(py: Python<'_>, args: Vec<String>) -> PyResult<Self> {
        let resolve = move || smelt::cli::train::resolve_without_data(&args);
        let driver = py.detach(|| Driver::start(resolve)).map_err(error)?;
        let o = &driver.options;
        let (config, _) = o.model.config().map_err(error)?;
        let schedule = Schedule::of_run(o, o.steps.unwrap_or(1));
        Ok(Trainer {
            vocab_size: config.vocab_size,
            schedule,
            driver: Some(driver),
        })
    }

    #[pyo3(signature = (tokens, targets=None, mask=None))]
    fn step(
        &mut self, py: Python<'_>, tokens: &[u8], targets: Option<&[u8]>, mask: Option<&[u8]>,
    ) -> PyResult<()> {
        let micro = self.driver()?.options.grad_accumulation;
        let rows = self.rows(tokens, targets, mask, micro)?;
        self.call(py, || Command::Step(rows.clone())).map(|_| ())
    }

    /// The update of the last step at rate `lr` (the run's schedule's where `None`).
    #[pyo3(signature = (lr=None))]
    fn update<'py>(&mut self, py: Python<'py>, lr: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let lr = lr.unwrap_or_else(|| self.schedule.lr(self.steps_done()));
        let Reply::Step(r) = self.call(py, || Command::Update(lr))? else {
            unreachable!("an update replies with its step")
        };
        let out = PyDict::new(py);
        out.set_item("step", r.step)?;
        out.set_item("loss", r.loss)?;
        out.set_item("grad_norm", r.norm)?;
        out.set_item("lr", lr)?;
        out.set_item("skipped", r.skipped)?;
        Ok(out)
    }

    #[pyo3(signature = (tokens, targets=None, mask=None))]
    fn eval(
        &mut self, py: Python<'_>, tokens: &[u8], targets: Option<&[u8]>, mask: Option<&[u8]>,
    ) -> PyResult<(f64, u64)> {
        let rows = self.rows(tokens, targets, mask, 1)?;
        let Reply::Eval(sum, trained) = self.call(py, || Command::Eval(rows.clone()))? else {
            unreachable!("an eval replies with its loss")
        };
        Ok((sum, trained))
    }

    fn save_checkpoint(&mut self, py: Python<'_>) -> PyResult<String> {
        let Reply::Checkpoint(path) = self.call(py, || Command::Checkpoint)? else {
            unreachable!("a checkpoint replies with its path")
        };
        Ok(path.display().to_string())
    }

    fn export(&mut self, py: Python<'_>, dir: PathBuf) -> PyResult<()> {
        self.call(py, || Command::Export(dir.clone())).map(|_| ())
    }

    fn memory(&mut self, py: Python<'_>) -> PyResult<Vec<(String, u64)>> {
        let Reply::Memory(rows) = self.call(py, || Command::Memory)? else {
            unreachable!("memory replies with its table")
        };
        Ok(rows)
    }

    /// Steps done: those of the run it continues, and its own.
    fn steps_done(&self) -> u64 {
        self.driver.as_ref().map_or(0, |d| d.steps_done)
    }

    /// The rate of step `step` (from 0) under the run's schedule flags.
    fn scheduled_lr(&self, step: u64) -> f64 {
        self.schedule.lr(step)
    }

    /// (batch_size, seq_len, grad_accumulation, sequences per step from Python, world).
    fn shape(&mut self) -> PyResult<(usize, usize, usize, usize, usize)> {
        let d = self.driver()?;
        let o = &d.options;
        let rows = d.rows(o.grad_accumulation);
        Ok((o.batch_size, o.seq_len, o.grad_accumulation, rows, d.world))
    }

    fn close(&mut self, py: Python<'_>) {
        if let Some(driver) = self.driver.take() {
            py.detach(|| drop(driver));
        }
    }
}

/// The training stream of token files, as `smelt train` reads it (see `smelt.DataLoader`).
#[pyclass(module = "smelt._smelt")]
struct DataLoader {
    loader: Loader,
    seq_len: usize,
}

#[pymethods]
impl DataLoader {
    #[new]
    fn new(pattern: &str, seq_len: usize, seed: u64, vocab_size: usize) -> PyResult<Self> {
        let data = DataSet::open(pattern, "train_file", vocab_size, seq_len).map_err(error)?;
        let loader = Loader::new(data, seed, 0, 1).map_err(error)?;
        Ok(DataLoader { loader, seq_len })
    }

    /// The next `sequences` of the stream: (tokens, targets) as int32 bytes.
    fn next<'py>(
        &mut self, py: Python<'py>, sequences: usize,
    ) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
        let mut batch = Batch::new(sequences * self.seq_len);
        self.loader.next_batch(&mut batch);
        (
            PyBytes::new(py, &bytes_of(&batch.tokens)),
            PyBytes::new(py, &bytes_of(&batch.targets)),
        )
    }

    /// Sequences in one epoch.
    fn per_epoch(&self) -> usize {
        self.loader.per_epoch()
    }
}

/// Runs a `smelt` subcommand in this process, as the command line would (`args` without
/// `smelt`), printing what it prints.
#[pyfunction]
fn run(py: Python<'_>, args: Vec<String>) -> PyResult<()> {
    use clap::Parser;
    let all = std::iter::once("smelt".to_string()).chain(args);
    let cli =
        smelt::cli::Cli::try_parse_from(all).map_err(|e| SmeltError::new_err(e.to_string()))?;
    py.detach(|| cli.run()).map_err(error)
}

/// The text `smelt sample` would print for `args` (its flags), returned.
#[pyfunction]
fn generate(py: Python<'_>, args: Vec<String>) -> PyResult<String> {
    py.detach(|| smelt::cli::sample::generate_text(&args))
        .map_err(error)
}

#[pymodule]
fn _smelt(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Trainer>()?;
    m.add_class::<DataLoader>()?;
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add_function(wrap_pyfunction!(generate, m)?)?;
    m.add("SmeltError", m.py().get_type::<SmeltError>())?;
    Ok(())
}
