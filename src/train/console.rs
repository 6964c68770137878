//! What a person watching a run sees: llm.q-style `[T]` step, `[V]` eval and `[G]` GPU
//! lines, startup tables, and, only when stdout is a terminal, a progress bar with an ETA
//! under the lines (indicatif's, which prints each line above itself).

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

use crate::backend::telemetry::GpuSample;
use crate::tensor::TensorSpec;

/// One training step's figures, as the console and the log show them.
#[derive(Clone, Debug)]
pub struct StepReport {
    pub step: u64,
    pub steps: u64,
    pub seconds: f64,
    pub norm: f64,
    pub loss: f64,
    pub lr: f64,
    /// Of the whole run, every rank's tokens.
    pub tokens_per_second: f64,
    pub mfu: Option<f64>,
    pub sol: Option<f64>,
}

pub struct Console {
    /// Prints nothing: the console of a rank other than 0, which speaks for the run.
    silent: bool,
    terminal: bool,
    /// Drawn from the first step on, on a terminal.
    bar: Option<ProgressBar>,
}

impl Default for Console {
    fn default() -> Self {
        Console::new()
    }
}

impl Console {
    pub fn new() -> Console {
        Console {
            silent: false,
            terminal: std::io::stdout().is_terminal(),
            bar: None,
        }
    }

    /// A console that prints nothing.
    pub fn silent() -> Console {
        Console {
            silent: true,
            terminal: false,
            bar: None,
        }
    }

    /// Prints one line, above the progress bar where there is one.
    pub fn line(&mut self, text: &str) {
        match (&self.bar, self.silent) {
            (_, true) => {}
            (Some(bar), false) => bar.println(text),
            (None, false) => println!("{text}"),
        }
    }

    pub fn step(&mut self, r: &StepReport) {
        let width = r.steps.to_string().len();
        self.line(&format!(
            "[T] step {:>width$}/{} | {:>8} | norm {:>7.4} | loss {:>7.4} | lr {:.2e} | {:>7} tok/s | mfu {} | sol {} | 1B in {}",
            r.step,
            r.steps,
            duration(r.seconds),
            r.norm,
            r.loss,
            r.lr,
            si(r.tokens_per_second),
            percent(r.mfu),
            percent(r.sol),
            duration(1e9 / r.tokens_per_second),
        ));
        self.progress(r.step, r.steps);
    }

    pub fn eval(&mut self, step: u64, loss: f64, tokens: u64, full: bool) {
        let what = if full { "full eval" } else { "eval" };
        self.line(&format!(
            "[V] step {step} | {what} loss {loss:.4} | {} target tokens",
            si(tokens as f64)
        ));
    }

    /// One GPU's readings after step `step`; `-` for what NVML does not give.
    pub fn gpu(&mut self, step: u64, g: &GpuSample) {
        fn or_dash<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
            v.map_or_else(|| "-".into(), f)
        }
        let memory = match (g.memory_used, g.memory_total) {
            (Some(used), Some(total)) => format!("{:.1}/{:.1} GiB", gib(used), gib(total)),
            _ => "- GiB".into(),
        };
        self.line(&format!(
            "[G] step {step} | GPU {} | util {:>4} | SM {:>4} MHz | {:>5} W | {:>3} °C | {memory}",
            g.gpu,
            or_dash(g.utilization, |u| format!("{u}%")),
            or_dash(g.sm_clock_mhz, |c| c.to_string()),
            or_dash(g.power_watts, |w| format!("{w:.0}")),
            or_dash(g.temperature_c, |t| t.to_string()),
        ));
    }

    /// Moves the progress bar to `done` of `total` steps, on a terminal only. It is made at
    /// the first step this run takes, and its ETA is the mean time of the steps since then
    /// (`?` until there is one) times the steps left.
    fn progress(&mut self, done: u64, total: u64) {
        if self.silent || !self.terminal || total == 0 {
            return;
        }
        let bar = self.bar.get_or_insert_with(|| {
            let first = done;
            let eta = move |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let (taken, left) = (s.pos() - first, s.len().unwrap_or(0) - s.pos());
                let _ = match taken {
                    0 => w.write_str("?"),
                    n => w.write_str(&duration(
                        s.elapsed().as_secs_f64() / n as f64 * left as f64,
                    )),
                };
            };
            let style =
                ProgressStyle::with_template("[{bar:30}] {pos}/{len} ({percent}%) ETA {smelt_eta}")
                    .expect("a valid template")
                    .progress_chars("#>.")
                    .with_key("smelt_eta", eta);
            ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stdout())
                .with_style(style)
                .with_position(done)
        });
        bar.set_position(done);
    }

    /// Leaves the bar drawn as it is, and the cursor on the line below it, so that later
    /// output starts on a line of its own.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.abandon();
            println!();
        }
    }
}

impl Drop for Console {
    /// A run that fails leaves the bar where it stopped, above the error.
    fn drop(&mut self) {
        self.finish();
    }
}

/// A fraction as `50.1%`, or `-` where there is none.
fn percent(fraction: Option<f64>) -> String {
    fraction.map_or_else(|| "-".to_string(), |f| format!("{:.1}%", 100.0 * f))
}

/// A list of named allocation categories, as the model and the optimizer keep theirs.
pub type Categories = [(&'static str, Vec<TensorSpec>)];

/// The memory table: bytes per allocation category of every list, then the total.
pub fn memory_table(lists: &[&Categories]) -> Vec<(String, u64)> {
    let mut rows: Vec<(String, u64)> = lists
        .iter()
        .flat_map(|list| list.iter())
        .map(|(name, specs)| (name.to_string(), category_bytes(specs)))
        .collect();
    rows.push(("total".into(), memory_total(lists)));
    rows
}

/// The bytes of every category of every list: the memory table's last row.
pub fn memory_total(lists: &[&Categories]) -> u64 {
    lists
        .iter()
        .flat_map(|list| list.iter())
        .map(|(_, specs)| category_bytes(specs))
        .sum()
}

pub fn category_bytes(specs: &[TensorSpec]) -> u64 {
    specs.iter().map(|s| s.bytes() as u64).sum()
}

/// `1234567` as `1.23M`.
pub fn si(x: f64) -> String {
    let (value, unit) = match x.abs() {
        a if a >= 1e9 => (x / 1e9, "G"),
        a if a >= 1e6 => (x / 1e6, "M"),
        a if a >= 1e3 => (x / 1e3, "k"),
        _ => (x, ""),
    };
    format!("{value:.2}{unit}")
}

/// Bytes in GiB, for tables and JSON figures.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Bytes as MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// Seconds as `850 ms`, `12.3 s`, `4m05s`, `2h05m` or `3d07h`.
pub fn duration(seconds: f64) -> String {
    if seconds < 1.0 {
        format!("{:.0} ms", seconds * 1e3)
    } else if seconds < 60.0 {
        format!("{seconds:.1} s")
    } else {
        let s = seconds.round() as u64;
        match s {
            ..3600 => format!("{}m{:02}s", s / 60, s % 60),
            3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
            _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn formats() {
        assert_eq!(si(1234567.0), "1.23M");
        assert_eq!(si(950.0), "950.00");
        assert_eq!(duration(0.25), "250 ms");
        assert_eq!(duration(125.0), "2m05s");
        assert_eq!(duration(7500.0), "2h05m");
        assert_eq!(duration(1e9 / 5050.0), "2d07h");
        let specs = vec![TensorSpec::new("w", &[4, 8], DType::BF16)];
        let model = [("weights", specs.clone())];
        let opt = [("m", specs.clone()), ("v", specs)];
        let table = memory_table(&[&model, &opt]);
        let names: Vec<&str> = table.iter().map(|r| r.0.as_str()).collect();
        assert_eq!(names, ["weights", "m", "v", "total"]);
        assert_eq!(table.last().unwrap().1, 3 * 64);
    }
}
