//! What keeps a bad step from the weights. Each step's loss and global gradient norm are
//! read before its update (the step's one wait for the device), and the update is skipped
//! when either is not finite, or, with `--on-spike skip`, when the loss is a spike: more
//! than `--spike-zscore` standard deviations above the mean of the last `--spike-window`
//! losses (llm.c's outlier detector, upward only; a spike that is skipped does not enter
//! the window). A skipped step consumes its batch and
//! its place in the schedule, and changes no weight or optimizer state. After
//! `--max-skipped-steps` skipped steps in a row the run stops, its last checkpoint as the
//! last good step left it.
//!
//! The window and the count are part of the checkpoint, so a continued run judges its
//! steps as the uninterrupted one does.

use std::collections::VecDeque;

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// What `--on-spike` does with a loss spike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OnSpike {
    /// Skip the step's update.
    Skip,
    /// Log it and update as usual.
    Warn,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GuardOptions {
    /// Skipped steps in a row that stop the run (at least 1).
    pub max_skipped_steps: u64,
    /// Losses the spike detector compares against; it judges nothing until it holds them.
    pub spike_window: usize,
    /// Standard deviations above the window's mean that make a loss a spike; 0 turns the
    /// detector off.
    pub spike_zscore: f64,
    pub on_spike: OnSpike,
}

/// The guard's memory, as a checkpoint keeps it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GuardState {
    /// The last finite losses, oldest first, at most a window of them.
    pub recent_losses: VecDeque<f64>,
    /// Steps skipped since the last update.
    pub skipped_in_a_row: u64,
}

/// A loss that stands out of its window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spike {
    pub zscore: f64,
    /// The window's mean and standard deviation.
    pub mean: f64,
    pub std: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Update {
        spike: Option<Spike>,
    },
    Skip {
        reason: String,
        spike: Option<Spike>,
    },
}

pub struct Guard {
    pub options: GuardOptions,
    pub state: GuardState,
}

impl Guard {
    pub fn new(options: GuardOptions) -> Guard {
        Guard {
            options,
            state: GuardState::default(),
        }
    }

    /// Judges a step by its loss and gradient norm, and remembers the loss.
    pub fn judge(&mut self, loss: f64, norm: f64) -> Verdict {
        let reason = match (loss.is_finite(), norm.is_finite()) {
            (false, _) => Some(format!("the loss is {loss}")),
            (true, false) => Some(format!("the gradient norm is {norm}")),
            (true, true) => None,
        };
        if let Some(reason) = reason {
            self.state.skipped_in_a_row += 1;
            return Verdict::Skip {
                reason,
                spike: None,
            };
        }
        let spike = self.spike(loss);
        let skip = spike.is_some() && self.options.on_spike == OnSpike::Skip;
        // A skipped spike stays out of the window, so that the next step is judged against
        // the losses of steps that were applied, and a run of bad batches is skipped whole.
        if !skip {
            let window = &mut self.state.recent_losses;
            window.push_back(loss);
            while window.len() > self.options.spike_window {
                window.pop_front();
            }
        }
        match spike {
            Some(s) if skip => {
                self.state.skipped_in_a_row += 1;
                Verdict::Skip {
                    reason: format!(
                        "the loss {loss:.4} is a spike, {:.1} standard deviations above the mean \
                         of the last {} ({:.4})",
                        s.zscore, self.options.spike_window, s.mean
                    ),
                    spike,
                }
            }
            _ => {
                self.state.skipped_in_a_row = 0;
                Verdict::Update { spike }
            }
        }
    }

    /// `loss` as a spike of the window, once the window is full.
    fn spike(&self, loss: f64) -> Option<Spike> {
        let window = &self.state.recent_losses;
        let n = self.options.spike_window;
        if self.options.spike_zscore <= 0.0 || n < 2 || window.len() < n {
            return None;
        }
        let mean = window.iter().sum::<f64>() / n as f64;
        let var = window.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        let std = var.sqrt();
        // A window of equal losses has no spread to measure against.
        let zscore = (loss - mean) / std;
        (std > 0.0 && zscore > self.options.spike_zscore).then_some(Spike { zscore, mean, std })
    }

    /// Stops the run once `--max-skipped-steps` steps in a row have been skipped, the last
    /// of them `step` for `reason`; `kept` says what the last checkpoint holds.
    pub fn check_skipped(&self, step: u64, reason: &str, kept: &str) -> Result<()> {
        let (count, max) = (self.state.skipped_in_a_row, self.options.max_skipped_steps);
        if count >= max {
            bail!(
                "step {step}: {count} steps in a row were skipped, the last because {reason}, and \
                 --max-skipped-steps is {max}: the run stops ({kept}); lower --lr (or lengthen \
                 --warmup), set --grad-clip, or look at the data of steps {}–{step}",
                step + 1 - count
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(window: usize, on_spike: OnSpike) -> Guard {
        Guard::new(GuardOptions {
            max_skipped_steps: 2,
            spike_window: window,
            spike_zscore: 3.0,
            on_spike,
        })
    }

    #[test]
    fn non_finite_steps_are_skipped_and_counted_in_a_row() {
        let mut g = guard(4, OnSpike::Warn);
        assert!(matches!(g.judge(f64::NAN, 1.0), Verdict::Skip { .. }));
        assert!(g.check_skipped(1, "x", "k").is_ok());
        assert!(matches!(g.judge(1.0, f64::INFINITY), Verdict::Skip { .. }));
        let err = g.check_skipped(2, "the loss is NaN", "k").unwrap_err();
        assert!(
            err.to_string().contains("step 2: 2 steps in a row"),
            "{err}"
        );
        assert!(err.to_string().contains("steps 1–2"), "{err}");
        assert_eq!(g.judge(1.0, 1.0), Verdict::Update { spike: None });
        assert_eq!(g.state.skipped_in_a_row, 0);
        // Non-finite losses never enter the window.
        assert_eq!(g.state.recent_losses, [1.0]);
    }

    #[test]
    fn a_spike_is_judged_against_a_full_window() {
        let mut g = guard(4, OnSpike::Skip);
        for loss in [2.0, 2.1, 1.9, 2.0] {
            assert_eq!(g.judge(loss, 1.0), Verdict::Update { spike: None });
        }
        // Mean 2.0, sample standard deviation √(0.02/3) ≈ 0.0816.
        let Verdict::Skip { spike: Some(s), .. } = g.judge(2.5, 1.0) else {
            panic!("2.5 is a spike of that window");
        };
        assert!((s.mean - 2.0).abs() < 1e-12);
        assert!((s.zscore - 0.5 / (0.02f64 / 3.0).sqrt()).abs() < 1e-9);
        assert_eq!(g.state.recent_losses, [2.0, 2.1, 1.9, 2.0]);
        assert!(matches!(g.judge(2.5, 1.0), Verdict::Skip { .. }));
        // A loss that falls is no spike.
        assert!(matches!(g.judge(0.5, 1.0), Verdict::Update { spike: None }));
    }

    #[test]
    fn warn_updates_through_a_spike() {
        let mut g = guard(3, OnSpike::Warn);
        for loss in [1.0, 1.1, 0.9] {
            g.judge(loss, 1.0);
        }
        assert!(matches!(
            g.judge(9.0, 1.0),
            Verdict::Update { spike: Some(_) }
        ));
        // Not before the window is full, nor with no spread in it.
        let mut g = guard(3, OnSpike::Skip);
        for loss in [1.0, 1.0] {
            g.judge(loss, 1.0);
        }
        assert!(matches!(g.judge(9.0, 1.0), Verdict::Update { spike: None }));
        let mut g = guard(2, OnSpike::Skip);
        for loss in [1.0, 1.0] {
            g.judge(loss, 1.0);
        }
        assert!(matches!(g.judge(9.0, 1.0), Verdict::Update { spike: None }));
    }
}
