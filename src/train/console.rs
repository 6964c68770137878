//! What a person watching a run sees: llm.q-style `[T]` step and `[V]` eval lines, startup
//! tables, and, only when stdout is a terminal, a progress bar with an ETA that redraws
//! itself under the lines.

use std::io::{IsTerminal, Write};
use std::time::Instant;

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
    pub tokens_per_second: f64,
    pub mfu: Option<f64>,
}

pub struct Console {
    /// Prints nothing: the console of a rank other than 0, which speaks for the run.
    silent: bool,
    terminal: bool,
    /// When the bar started and at which step, for the ETA.
    start: Option<(Instant, u64)>,
    bar_drawn: bool,
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
            start: None,
            bar_drawn: false,
        }
    }

    /// A console that prints nothing.
    pub fn silent() -> Console {
        Console {
            silent: true,
            ..Console::new()
        }
    }

    /// Prints one line above the progress bar.
    pub fn line(&mut self, text: &str) {
        if self.silent {
            return;
        }
        let mut out = std::io::stdout().lock();
        if self.bar_drawn {
            // Carriage return, then clear the line the bar was on.
            let _ = write!(out, "\r\x1b[2K");
            self.bar_drawn = false;
        }
        let _ = writeln!(out, "{text}");
        let _ = out.flush();
    }

    pub fn step(&mut self, r: &StepReport) {
        let width = r.steps.to_string().len();
        self.line(&format!(
            "[T] step {:>width$}/{} | {:>8} | norm {:>7.4} | loss {:>7.4} | lr {:.2e} | {:>7} tok/s | mfu {}",
            r.step,
            r.steps,
            duration(r.seconds),
            r.norm,
            r.loss,
            r.lr,
            si(r.tokens_per_second),
            r.mfu
                .map_or_else(|| "-".to_string(), |m| format!("{:.1}%", 100.0 * m)),
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

    /// Redraws the progress bar after `done` of `total` steps, on a terminal only.
    fn progress(&mut self, done: u64, total: u64) {
        if self.silent || !self.terminal || total == 0 {
            return;
        }
        let (start, first) = *self.start.get_or_insert((Instant::now(), done));
        let elapsed = start.elapsed().as_secs_f64();
        let eta = if done > first {
            duration(elapsed / (done - first) as f64 * (total - done) as f64)
        } else {
            "?".into()
        };
        const WIDTH: usize = 30;
        let filled = (WIDTH as u64 * done / total) as usize;
        let mut out = std::io::stdout().lock();
        let _ = write!(
            out,
            "\r[{}{}] {done}/{total} ({:.0}%) ETA {eta}",
            "#".repeat(filled),
            ".".repeat(WIDTH - filled),
            100.0 * done as f64 / total as f64
        );
        let _ = out.flush();
        self.bar_drawn = true;
    }

    /// Leaves the bar's line, so that later output starts on a fresh one.
    pub fn finish(&mut self) {
        if self.bar_drawn {
            self.line("");
        }
    }
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

/// Seconds as `850 ms`, `12.3 s` or `4m05s`.
pub fn duration(seconds: f64) -> String {
    if seconds < 1.0 {
        format!("{:.0} ms", seconds * 1e3)
    } else if seconds < 60.0 {
        format!("{seconds:.1} s")
    } else {
        let s = seconds.round() as u64;
        if s < 3600 {
            format!("{}m{:02}s", s / 60, s % 60)
        } else {
            format!("{}h{:02}m", s / 3600, s % 3600 / 60)
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
        let specs = vec![TensorSpec::new("w", &[4, 8], DType::BF16)];
        let model = [("weights", specs.clone())];
        let opt = [("m", specs.clone()), ("v", specs)];
        let table = memory_table(&[&model, &opt]);
        let names: Vec<&str> = table.iter().map(|r| r.0.as_str()).collect();
        assert_eq!(names, ["weights", "m", "v", "total"]);
        assert_eq!(table.last().unwrap().1, 3 * 64);
    }
}
