//! What several subcommands share: the flag groups they flatten into their arguments, so that
//! each flag reads and means the same everywhere, and the parsers of their values.
//!
//! `precision` (train, plan; its matmul pair also bench, its dtypes sample and export),
//! `recompute`, `offload`, `documents` and `fit_memory` (train, bench), `layer_major` (train,
//! bench, plan).

mod documents;
mod fit_memory;
mod layer_major;
mod offload;
mod precision;
mod recompute;

use anyhow::{Result, anyhow, bail};

pub use self::documents::DocumentFlags;
pub use self::fit_memory::{FitMemoryFlag, SmallerBatch};
pub use self::layer_major::LayerMajorFlag;
pub use self::offload::OffloadFlags;
pub use self::precision::{
    FloatDtype, MatmulFlags, MomentFlags, Precision, PrecisionFlags, StorageDtype,
};
pub use self::recompute::RecomputeFlags;

const GIB: f64 = (1u64 << 30) as f64;

/// A subcommand's flags parsed from `args` (the flags alone), for a caller outside the
/// command line (the Python package), with the checks and messages the command line gives;
/// `name` names the caller in clap's messages.
pub fn parse_flags<A: clap::Args + clap::FromArgMatches>(
    name: &'static str, args: &[String],
) -> Result<A> {
    let command = clap::Command::new(name)
        .no_binary_name(true)
        .allow_negative_numbers(true);
    let matches = A::augment_args(command)
        .try_get_matches_from(args)
        .map_err(|e| anyhow!("{e}"))?;
    A::from_arg_matches(&matches).map_err(|e| anyhow!("{e}"))
}

/// A float flag: its name, its value, whether the value meets the flag's rule, and the rule.
pub type FloatFlag<'a> = (&'a str, f64, bool, &'a str);

/// Refuses the first flag whose value is not a finite number in f32 (what the device
/// computes in: an infinite rate or a NaN ε would make every weight NaN), or breaks its rule,
/// naming the flag and what it must be.
pub fn check_floats(flags: &[FloatFlag]) -> Result<()> {
    for &(flag, value, meets_rule, rule) in flags {
        if !value.is_finite() {
            bail!("{flag} {value}: must be a finite number");
        }
        if !(value as f32).is_finite() {
            bail!("{flag} {value:e}: beyond f32's range (±3.4e38), in which it is used");
        }
        if !meets_rule {
            bail!("{flag} {value}: {rule}");
        }
    }
    Ok(())
}

/// A flag's figure in GiB, as bytes.
pub fn gib_bytes(gib: f64, flag: &str) -> Result<u64> {
    if !(gib > 0.0 && gib.is_finite()) {
        bail!("{flag} {gib}: give a positive number of GiB");
    }
    Ok((gib * GIB) as u64)
}
