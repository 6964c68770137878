//! Faults injected on purpose (`--debug-inject nan-grad@3,spike@7`), so that the guards
//! (`train::guard`) are tested on the paths a real fault takes: a NaN gradient is written
//! into the device's gradients before their norm is taken, a NaN loss or a spike replaces
//! the loss the step read back.

use std::fmt;
use std::str::FromStr;

use serde::{Serialize, Serializer};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The final norm's gradient becomes NaN, and so the global gradient norm.
    NanGrad,
    /// The loss reads NaN.
    NanLoss,
    /// The loss reads `SPIKE_FACTOR` times what it is.
    Spike,
}

/// How far an injected spike lifts the loss.
pub const SPIKE_FACTOR: f64 = 10.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Injection {
    pub fault: Fault,
    /// The step (from 1) it strikes.
    pub step: u64,
}

const NAMES: [(&str, Fault); 3] = [
    ("nan-grad", Fault::NanGrad),
    ("nan-loss", Fault::NanLoss),
    ("spike", Fault::Spike),
];

impl FromStr for Injection {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let usage = || {
            let names: Vec<&str> = NAMES.iter().map(|n| n.0).collect();
            format!("`{s}`: give FAULT@STEP, FAULT one of {}", names.join(", "))
        };
        let (name, step) = s.split_once('@').ok_or_else(usage)?;
        let fault = (NAMES.iter().find(|n| n.0 == name).map(|n| n.1)).ok_or_else(usage)?;
        let step = step.parse().ok().filter(|&s| s >= 1).ok_or_else(usage)?;
        Ok(Injection { fault, step })
    }
}

impl fmt::Display for Injection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = NAMES.iter().find(|n| n.1 == self.fault).map(|n| n.0);
        write!(f, "{}@{}", name.unwrap_or("?"), self.step)
    }
}

impl Serialize for Injection {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Whether `fault` strikes `step`.
pub fn strikes(injections: &[Injection], fault: Fault, step: u64) -> bool {
    injections.contains(&Injection { fault, step })
}

/// The loss of `step` as the injections make it read.
pub fn loss(injections: &[Injection], step: u64, loss: f64) -> f64 {
    if strikes(injections, Fault::NanLoss, step) {
        f64::NAN
    } else if strikes(injections, Fault::Spike, step) {
        loss * SPIKE_FACTOR
    } else {
        loss
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let i: Injection = "nan-grad@3".parse().unwrap();
        assert_eq!(
            i,
            Injection {
                fault: Fault::NanGrad,
                step: 3
            }
        );
        assert_eq!(i.to_string(), "nan-grad@3");
        for bad in ["nan-grad", "nan@3", "spike@0", "spike@x"] {
            let err = bad.parse::<Injection>().unwrap_err();
            assert!(err.contains("FAULT@STEP"), "{err}");
        }
        let list = ["spike@2".parse().unwrap()];
        assert_eq!(loss(&list, 2, 1.5), 15.0);
        assert_eq!(loss(&list, 3, 1.5), 1.5);
    }
}
