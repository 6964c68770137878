//! `smelt plot`: training logs as a PNG of four panels (see `plot`), several logs overlaid.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;

use crate::io::same_path;
use crate::plot::{label, read_series, render, write_png};

#[derive(Args, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Plot training logs as a PNG: loss and eval loss, lr, grad norm, tok/s; several logs are overlaid"
)]
pub struct PlotArgs {
    /// The JSON Lines logs runs wrote (`smelt train --log-file`); each is labelled by its
    /// file name.
    #[arg(required = true, value_name = "LOG")]
    logs: Vec<PathBuf>,
    /// The PNG to write.
    #[arg(short, long, value_name = "PNG", default_value = "train.png")]
    out: PathBuf,
    /// Image width in pixels.
    #[arg(long, default_value_t = 1400)]
    width: u32,
    /// Image height in pixels.
    #[arg(long, default_value_t = 900)]
    height: u32,
}

impl PlotArgs {
    pub fn run(self) -> Result<()> {
        if !(MIN_SIDE..=MAX_SIDE).contains(&self.width)
            || !(MIN_SIDE..=MAX_SIDE).contains(&self.height)
        {
            bail!("--width and --height must be between {MIN_SIDE} and {MAX_SIDE} pixels");
        }
        if let Some(log) = self.logs.iter().find(|l| same_path(l, &self.out)) {
            bail!(
                "-o {}: is one of the logs to plot ({}); write the PNG to another file",
                self.out.display(),
                log.display()
            );
        }
        let runs = self
            .logs
            .iter()
            .map(|path| Ok((label(path), read_series(path)?)))
            .collect::<Result<Vec<_>>>()?;
        let rgb = render(&runs, self.width, self.height)?;
        write_png(&self.out, &rgb, self.width, self.height)?;
        println!("wrote {}", self.out.display());
        Ok(())
    }
}

/// Image sides, in pixels: a panel needs room for its axes, and the RGB buffer of the
/// largest image (1.2 GB) stays addressable.
const MIN_SIDE: u32 = 200;
const MAX_SIDE: u32 = 20_000;
