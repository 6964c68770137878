//! What several subcommands share: the flag groups they flatten into their arguments, so that
//! each flag reads and means the same everywhere, and the parsers of their values.
//!
//! `precision` (train, plan), `recompute` and `offload` (train, bench), `fit_memory` (train,
//! bench).

mod fit_memory;
mod offload;
mod precision;
mod recompute;

use anyhow::{Result, bail};

use crate::tensor::DType;

pub use self::fit_memory::{FitMemoryFlag, SmallerBatch};
pub use self::offload::OffloadFlags;
pub use self::precision::{Precision, PrecisionFlags};
pub use self::recompute::RecomputeFlags;

const GIB: f64 = (1u64 << 30) as f64;

/// A dtype flag's value.
pub fn dtype(name: &str) -> Result<DType, String> {
    DType::parse(name).ok_or_else(|| format!("unknown dtype `{name}`; use f32 or bf16"))
}

/// A flag's figure in GiB, as bytes.
pub fn gib_bytes(gib: f64, flag: &str) -> Result<u64> {
    if !(gib > 0.0 && gib.is_finite()) {
        bail!("{flag} {gib}: give a positive number of GiB");
    }
    Ok((gib * GIB) as u64)
}
