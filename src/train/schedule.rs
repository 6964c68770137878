//! The learning-rate schedule: linear warmup, then a cosine or linear decay to
//! `final_fraction · lr` (or a constant rate), then an optional linear cooldown towards zero
//! over the last `cooldown` steps (warmup-stable-decay when the decay is constant).

use serde::{Deserialize, Serialize};

use super::Options;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    /// Half a cosine from --lr down to the final rate.
    Cosine,
    /// A straight line from --lr down to the final rate.
    Linear,
    /// Hold --lr (ignores --final-lr-fraction); with --cooldown, warmup-stable-decay.
    Constant,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub lr: f64,
    pub warmup: u64,
    pub steps: u64,
    pub final_fraction: f64,
    pub decay: Decay,
    pub cooldown: u64,
}

impl Schedule {
    /// The schedule of a run of `steps` steps with options `o`.
    pub fn of_run(o: &Options, steps: u64) -> Schedule {
        Schedule {
            lr: o.lr,
            // As torchtitan does, a warmup longer than the run is shortened to it (the
            // trainer warns of it), so that the rate reaches --lr at the last step.
            warmup: o.warmup.min(steps),
            steps,
            final_fraction: o.final_lr_fraction,
            decay: o.lr_schedule,
            // Likewise a cooldown longer than what follows the warmup starts where it ends.
            cooldown: o.cooldown.min(steps - o.warmup.min(steps)),
        }
    }

    /// The learning rate of step `step`, counted from 0.
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let decay_end = self.steps.saturating_sub(self.cooldown).max(self.warmup);
        let final_lr = match self.decay {
            Decay::Constant => self.lr,
            _ => self.lr * self.final_fraction,
        };
        if step < decay_end {
            // t runs from 0 at the first decay step to 1 at the last, so that the last
            // step before any cooldown runs at exactly the final rate.
            let span = (decay_end - self.warmup).saturating_sub(1).max(1);
            let t = (step - self.warmup) as f64 / span as f64;
            let f = match self.decay {
                Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * t).cos()),
                Decay::Linear => 1.0 - t,
                Decay::Constant => 1.0,
            };
            return final_lr + (self.lr - final_lr) * f;
        }
        // Cooldown: a linear ramp that would reach zero one step after the last.
        let left = self.steps.saturating_sub(step);
        final_lr * left as f64 / (self.cooldown + 1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(decay: Decay, cooldown: u64) -> Schedule {
        Schedule {
            lr: 1.0,
            warmup: 4,
            steps: 20,
            final_fraction: 0.1,
            decay,
            cooldown,
        }
    }

    #[test]
    fn warmup_then_decay_to_the_final_fraction() {
        for decay in [Decay::Cosine, Decay::Linear] {
            let s = schedule(decay, 0);
            let lrs: Vec<f64> = (0..20).map(|i| s.lr(i)).collect();
            assert_eq!(&lrs[..5], &[0.25, 0.5, 0.75, 1.0, 1.0]);
            // Exact: 0.1 + 0.9·f(1) with f(1) = 0 up to cos(π) rounding (1e-16).
            assert!((lrs[19] - 0.1).abs() < 1e-12, "{decay:?}: {}", lrs[19]);
            assert!(lrs[4..].windows(2).all(|w| w[1] < w[0]), "{decay:?}");
        }
        // Linear decay falls by the same amount each step: 0.9 over the 15 decay steps.
        let s = schedule(Decay::Linear, 0);
        assert!((s.lr(11) - (0.1 + 0.9 * (1.0 - 7.0 / 15.0))).abs() < 1e-12);
    }

    #[test]
    fn cooldown_ramps_down_from_the_decayed_rate() {
        let s = schedule(Decay::Constant, 4);
        assert_eq!(s.lr(15), 1.0);
        let tail: Vec<f64> = (16..20).map(|i| s.lr(i)).collect();
        assert_eq!(tail, [0.8, 0.6, 0.4, 0.2]);
        let s = schedule(Decay::Linear, 4);
        assert!((s.lr(15) - 0.1).abs() < 1e-12);
        assert!((s.lr(19) - 0.02).abs() < 1e-12);
    }
}
