//! The parallel part. A reader thread walks the inputs in order and hands batches of whole
//! documents through a bounded channel; each batch is encoded on all cores and written in
//! input order. The output therefore does not depend on the number of threads, and memory
//! holds a few batches whatever the size of the input.

use std::sync::mpsc::{SyncSender, sync_channel};

use anyhow::{Result, anyhow};
use rayon::prelude::*;

use super::document::{Document, Sink};
use super::encoder::{Encoded, Encoder};
use super::inputs::{Format, Input};
use super::jsonl::{self, Fields};
use super::outputs::Outputs;
use super::progress::Progress;
use super::{parquet, txt};

/// Text per batch and per thread: large enough that every thread gets many documents, small
/// enough that the batches in flight (this, one being read, two queued) stay small.
const BATCH_BYTES_PER_THREAD: usize = 4 << 20;
const BATCHES_QUEUED: usize = 2;

/// How each kind of input is read.
pub struct Readers {
    pub separator: Option<String>,
    pub fields: Fields,
    pub column: String,
}

#[derive(Default)]
pub struct Counts {
    pub documents: usize,
    pub empty: usize,
    pub tokens: usize,
    /// Tokens the loss mask trains (all of them where there is no mask).
    pub trained: usize,
}

#[derive(Default)]
struct Batch {
    /// Each document with the bytes of its file it accounts for (for the progress bar).
    docs: Vec<(Document, u64)>,
    /// Input bytes read without a document (blank lines, Parquet metadata).
    other_bytes: u64,
    /// The text the batch holds.
    text_bytes: usize,
}

pub fn run(
    inputs: &[Input], readers: &Readers, encoder: &Encoder, outputs: &mut Outputs,
    progress: &Progress,
) -> Result<Counts> {
    let batch_bytes = BATCH_BYTES_PER_THREAD * rayon::current_num_threads().max(4);
    std::thread::scope(|scope| {
        let (tx, rx) = sync_channel(BATCHES_QUEUED);
        let reader = scope.spawn(move || read_all(inputs, readers, batch_bytes, tx));
        // `rx` moves into the closure, so an error here drops it and a reader blocked on a
        // full channel wakes up with an error instead of waiting forever.
        let written = (move || -> Result<Counts> {
            let mut counts = Counts::default();
            for batch in rx {
                let encoded: Vec<Option<Encoded>> = batch
                    .docs
                    .par_iter()
                    .map(|(doc, bytes)| {
                        if doc.is_empty() {
                            progress.advance(*bytes, 0, 0);
                            return Ok(None);
                        }
                        let encoded = encoder.encode(doc)?;
                        progress.advance(*bytes, 1, encoded.ids.len());
                        Ok(Some(encoded))
                    })
                    .collect::<Result<_>>()?;
                for doc in encoded.iter().flatten() {
                    outputs.add(doc)?;
                    counts.documents += 1;
                    counts.tokens += doc.ids.len();
                    counts.trained += doc.trained.iter().filter(|&&t| t).count();
                }
                counts.empty += encoded.iter().filter(|e| e.is_none()).count();
                progress.advance(batch.other_bytes, 0, 0);
            }
            Ok(counts)
        })();
        let read = reader.join().expect("the reader thread does not panic");
        // A write error stops the reader too; report the first cause, not the echo.
        let counts = written?;
        read.map(|()| counts)
    })
}

/// Reads every input in order, sending a batch whenever it holds `batch_bytes` of text.
fn read_all(
    inputs: &[Input], readers: &Readers, batch_bytes: usize, tx: SyncSender<Batch>,
) -> Result<()> {
    let mut batch = Batch::default();
    let stopped = || anyhow!("stopped: writing the token files failed");
    for input in inputs {
        let mut seen = 0u64;
        let sink: &mut Sink = &mut |doc: Document, offset: u64| {
            batch.text_bytes += doc.bytes();
            batch.docs.push((doc, offset.saturating_sub(seen)));
            seen = seen.max(offset);
            if batch.text_bytes >= batch_bytes {
                tx.send(std::mem::take(&mut batch)).map_err(|_| stopped())?;
            }
            Ok(())
        };
        let path = &input.path;
        match input.format {
            Format::Text => txt::read(path, readers.separator.as_deref(), sink)?,
            Format::Jsonl => jsonl::read(path, &readers.fields, sink)?,
            Format::Parquet => parquet::read(path, &readers.column, sink)?,
        }
        // Bytes no document accounts for: blank lines, Parquet metadata.
        batch.other_bytes += input.bytes.saturating_sub(seen);
    }
    tx.send(batch).map_err(|_| stopped())
}
