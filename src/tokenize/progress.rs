//! The progress bar: input bytes tokenized, documents, tokens and tokens per second. Drawn on
//! stderr only when it is a terminal (indicatif hides it otherwise). The encoding threads
//! report each document as they finish it; the bar redraws a few times a second.

use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use indicatif::{HumanCount, ProgressBar, ProgressState, ProgressStyle};

pub struct Progress {
    bar: ProgressBar,
    counts: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    documents: AtomicU64,
    tokens: AtomicU64,
}

impl Progress {
    pub fn new(total_bytes: u64) -> Progress {
        let counts = Arc::new(Counts::default());
        let shown = counts.clone();
        let style = ProgressStyle::with_template(
            "{bar:30} {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} | {counts} | {elapsed} (eta {eta})",
        )
        .expect("a valid template")
        .with_key("counts", move |state: &ProgressState, out: &mut dyn Write| {
            let tokens = shown.tokens.load(Relaxed);
            let rate = tokens as f64 / state.elapsed().as_secs_f64().max(1e-3);
            let documents = HumanCount(shown.documents.load(Relaxed));
            let _ = write!(out, "{documents} docs | {} tok | {} tok/s", HumanCount(tokens), HumanCount(rate as u64));
        });
        let bar = ProgressBar::new(total_bytes).with_style(style);
        if !bar.is_hidden() {
            bar.enable_steady_tick(Duration::from_millis(250));
        }
        Progress { bar, counts }
    }

    /// Called by any thread: `bytes` more of the input are done, in `documents` documents of
    /// `tokens` tokens.
    pub fn advance(&self, bytes: u64, documents: usize, tokens: usize) {
        self.counts.documents.fetch_add(documents as u64, Relaxed);
        self.counts.tokens.fetch_add(tokens as u64, Relaxed);
        self.bar.inc(bytes);
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
