//! Which of smelt's own kernels run, as the environment asks: `SMELT_ATTENTION` picks the
//! attention kernels, `SMELT_GEMM` whether smelt's own matmul runs where the GPU has it. Both
//! exist to measure one choice against another and to rule one out when a result looks wrong.

use anyhow::{Result, bail};

/// Which attention kernels run. `SMELT_ATTENTION=mma` picks the mma.sync ones where wgmma
/// would run, `SMELT_ATTENTION=simple` the CUDA-core ones; unset (or `wgmma`), the default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernels {
    /// wgmma kernels for bf16 on Hopper at head sizes that are multiples of 64; else as
    /// `MmaSync`.
    Wgmma,
    /// mma.sync tensor-core kernels for 16-byte aligned bf16 on sm_80 and later; the simple
    /// ones otherwise.
    MmaSync,
    /// The CUDA-core kernels, for every storage type.
    Simple,
}

impl AttentionKernels {
    /// The choice `SMELT_ATTENTION` names (`Wgmma` when it is unset).
    pub fn from_env() -> Result<Self> {
        Self::named(std::env::var("SMELT_ATTENTION").ok().as_deref())
    }

    /// `SMELT_ATTENTION`'s value, if set.
    fn named(value: Option<&str>) -> Result<Self> {
        match value {
            None | Some("wgmma") => Ok(AttentionKernels::Wgmma),
            Some("mma") => Ok(AttentionKernels::MmaSync),
            Some("simple") => Ok(AttentionKernels::Simple),
            Some(other) => bail!("SMELT_ATTENTION={other}: set it to wgmma, mma or simple"),
        }
    }
}

/// Whether `SMELT_GEMM` leaves smelt's own matmul on: unset or `own`, yes; `cublaslt`, no.
pub(super) fn own_gemm_from_env() -> Result<bool> {
    match std::env::var("SMELT_GEMM").ok().as_deref() {
        None | Some("own") => Ok(true),
        Some("cublaslt") => Ok(false),
        Some(other) => bail!("SMELT_GEMM={other}: set it to own or cublaslt"),
    }
}

/// Whether `Backend::record` makes CUDA graphs: `SMELT_CUDA_GRAPHS=off` runs every op as it
/// is called instead, for comparison.
pub(super) fn graphs_from_env() -> Result<bool> {
    match std::env::var("SMELT_CUDA_GRAPHS").ok().as_deref() {
        None | Some("on") => Ok(true),
        Some("off") => Ok(false),
        Some(other) => bail!("SMELT_CUDA_GRAPHS={other}: set it to on or off"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_choice_takes_the_documented_values_and_names_itself_otherwise() {
        let named = |v| AttentionKernels::named(v).unwrap();
        assert_eq!(named(None), AttentionKernels::Wgmma);
        assert_eq!(named(Some("wgmma")), AttentionKernels::Wgmma);
        assert_eq!(named(Some("mma")), AttentionKernels::MmaSync);
        assert_eq!(named(Some("simple")), AttentionKernels::Simple);
        let err = AttentionKernels::named(Some("tc")).unwrap_err().to_string();
        assert!(
            err.contains("SMELT_ATTENTION=tc") && err.contains("wgmma, mma or simple"),
            "{err}"
        );
    }
}
