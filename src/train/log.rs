//! The training log: JSON Lines, one event per line, appended and flushed as it happens, so
//! that a crash loses at most the line being written and reading it back is linear (llm.q
//! rewrites a whole JSON array on every event). A run that fails ends its log with the error.
//! With `--tensorboard-dir`, the scalars of every event (`scalars.rs`) also go to a
//! TensorBoard event file, as they are logged.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use super::health::Health;
use super::scalars::scalars;
use super::tensorboard::EventWriter;
use crate::backend::telemetry::GpuSample;
use crate::io::atomic::is_disk_full_io;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// One command-line option of the run, as resolved.
    Option {
        name: String,
        value: serde_json::Value,
    },
    Device {
        name: String,
    },
    /// One allocation category's size.
    Memory {
        category: String,
        bytes: u64,
    },
    Step {
        step: u64,
        loss: f64,
        /// Global gradient norm before clipping.
        norm: f64,
        lr: f64,
        /// Tokens processed in this step (trained or not).
        tokens: u64,
        seconds: f64,
        tokens_per_second: f64,
        /// Model FLOPs utilisation of one device, where its peak is known.
        mfu: Option<f64>,
        /// The share of the step the matmuls would take at the device's peaks
        /// (`metrics::sol`), where they are known.
        sol: Option<f64>,
        /// A hash of the step's input sequences, every rank's, in the order of the training
        /// stream: two runs that read the same data log the same, whatever their world size.
        data: String,
    },
    /// A step whose update was skipped (`train::guard`): its batch is spent and no weight
    /// changed. `None` for a figure that is not finite.
    Skipped {
        step: u64,
        reason: String,
        loss: Option<f64>,
        norm: Option<f64>,
        /// As `Step`'s.
        data: String,
    },
    /// A loss spike (`train::guard`): the loss, and the mean and standard deviation of the
    /// window it stands out of by `zscore`.
    Spike {
        step: u64,
        loss: f64,
        zscore: f64,
        mean: f64,
        std: f64,
        /// Whether the step's update was skipped for it (`--on-spike skip`).
        skipped: bool,
    },
    /// The training health of a step (`--health-every`), measured on its update.
    Health {
        step: u64,
        #[serde(flatten)]
        health: Health,
    },
    /// The readings of the GPUs this process trains on after a step (`--log-gpu-util`).
    GpuUtil {
        step: u64,
        gpus: Vec<GpuSample>,
    },
    Eval {
        step: u64,
        loss: f64,
        /// Trained target tokens the loss averages over.
        tokens: u64,
        /// A pass over all eval data (at the end) rather than the first `--eval-num-steps` batches.
        full: bool,
    },
    /// The FP8 abs-max statistics of a step (`--debug-log-abs-max`), by
    /// `layers.L.LINEAR.{input,weight,grad}`: inputs and gradients of the last micro-step,
    /// weights as quantized for the step.
    AbsMax {
        step: u64,
        values: std::collections::BTreeMap<String, f32>,
    },
    Checkpoint {
        step: u64,
        path: String,
        /// `true` when the run continued from this checkpoint, `false` when it wrote it.
        loaded: bool,
    },
    Warning {
        message: String,
    },
    /// The error that ended the run: the last event of a run that failed.
    Error {
        message: String,
    },
}

/// A line of the log: the event and when it happened (seconds since the Unix epoch).
#[derive(Serialize, Deserialize)]
struct Line {
    time: f64,
    #[serde(flatten)]
    event: Event,
}

pub struct Log {
    file: Option<(PathBuf, File)>,
    tensorboard: Option<EventWriter>,
}

/// Refuses a `--log-file` that holds something other than a log, which appending to would
/// damage (a token file or a model given by mistake): an existing file must be empty or
/// start with a log event.
pub fn check_appendable(path: &Path) -> Result<()> {
    use std::io::{BufRead, BufReader};
    let Ok(file) = File::open(path) else {
        return Ok(()); // not there yet (or unreadable, which opening for appending reports)
    };
    let mut first = Vec::new();
    BufReader::new(file)
        .take(MAX_LINE)
        .read_until(b'\n', &mut first)
        .with_context(|| format!("--log-file {}: cannot read it", path.display()))?;
    if !first.is_empty() && serde_json::from_slice::<Line>(&first).is_err() {
        bail!(
            "--log-file {}: exists and is not a smelt log (its first line is no log event); choose another file",
            path.display()
        );
    }
    Ok(())
}

/// Longer than any event's line (the abs-max statistics of a large model are the longest).
const MAX_LINE: u64 = 1 << 24;

impl Log {
    /// Opens `path` for appending (creating it and its folder), and a new event file in
    /// `tensorboard_dir`; either may be `None`. The caller has checked `path` with
    /// `check_appendable`, and `tensorboard_dir` with `io::create_writable_dir`.
    pub fn open(path: Option<&Path>, tensorboard_dir: Option<&Path>) -> Result<Log> {
        let tensorboard =
            (tensorboard_dir.map(|dir| EventWriter::create(dir, now()))).transpose()?;
        let Some(path) = path else {
            return Ok(Log {
                file: None,
                tensorboard,
            });
        };
        let fix = "choose a writable --log-file";
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| {
                format!(
                    "--log-file {}: cannot create its folder; {fix}",
                    path.display()
                )
            })?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| {
                format!(
                    "--log-file {}: cannot open for appending; {fix}",
                    path.display()
                )
            })?;
        // A run killed mid-write leaves a partial last line; end it so ours start clean.
        let len = file.metadata().map_or(0, |m| m.len());
        if len > 0 && !ends_with_newline(path)? {
            (&file).write_all(b"\n")?;
        }
        Ok(Log {
            file: Some((path.to_path_buf(), file)),
            tensorboard,
        })
    }

    /// Appends one event, and its scalars to the event file. Each line goes out in one
    /// write, so lines never interleave.
    pub fn write(&mut self, event: Event) -> Result<()> {
        let time = now();
        if let Some(writer) = &mut self.tensorboard {
            writer.write(time, &scalars(&event))?;
        }
        let Some((path, file)) = &mut self.file else {
            return Ok(());
        };
        let mut line = serde_json::to_string(&Line { time, event })?;
        line.push('\n');
        let written = file.write_all(line.as_bytes()).and_then(|()| file.flush());
        written.map_err(|e| match is_disk_full_io(&e) {
            true => anyhow!(
                "writing the log {}: {e}; free space on its disk, or choose another --log-file",
                path.display()
            ),
            false => anyhow!("writing the log {}: {e}", path.display()),
        })
    }
}

/// Seconds since the Unix epoch.
fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn ends_with_newline(path: &Path) -> Result<bool> {
    use std::io::{Seek, SeekFrom};
    let mut f = File::open(path)?;
    f.seek(SeekFrom::End(-1))?;
    let mut last = [0u8];
    f.read_exact(&mut last)?;
    Ok(last[0] == b'\n')
}

/// What a log file holds.
pub struct Contents {
    pub events: Vec<Event>,
    /// Line numbers (from 1) that are not events: a line cut short by a crash, say.
    pub skipped: Vec<usize>,
}

/// Reads every event of a log file, in order. A file with no event at all is an error.
pub fn read(path: &Path) -> Result<Contents> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read the log", path.display()))?;
    let mut contents = Contents {
        events: vec![],
        skipped: vec![],
    };
    for (i, l) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        match serde_json::from_str::<Line>(l) {
            Ok(line) => contents.events.push(line.event),
            Err(_) => contents.skipped.push(i + 1),
        }
    }
    if contents.events.is_empty() {
        bail!(
            "{}: no training events; pass a log written by `smelt train --log-file`",
            path.display()
        );
    }
    Ok(contents)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_and_survives_a_line_cut_short() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("logs/run.jsonl");
        let warning = |m: &str| Event::Warning { message: m.into() };
        Log::open(Some(&path), None)
            .unwrap()
            .write(warning("one"))
            .unwrap();
        // A crash in the middle of a line.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"time\": 1, \"event\": \"st").unwrap();
        Log::open(Some(&path), None)
            .unwrap()
            .write(warning("two"))
            .unwrap();
        let contents = read(&path).unwrap();
        assert_eq!(contents.events, [warning("one"), warning("two")]);
        assert_eq!(contents.skipped, [2]);
    }
}
