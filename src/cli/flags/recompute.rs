//! The recompute flags, shared by `smelt train` and `smelt bench` so that both, and the
//! out-of-memory message that names them, speak the same language.

use clap::Args;

use crate::model::Recompute;

#[derive(Args, Debug)]
pub struct RecomputeFlags {
    /// Recompute the SwiGLU output in the backward instead of keeping it.
    #[arg(long, help_heading = "Memory")]
    recompute_swiglu: bool,
    /// Recompute both RMSNorm outputs of each block.
    #[arg(long, help_heading = "Memory")]
    recompute_norm: bool,
    /// Recompute the QKV projection and RoPE.
    #[arg(long, help_heading = "Memory")]
    recompute_qkv: bool,
    /// Recompute attention and its log-sum-exp.
    #[arg(long, help_heading = "Memory")]
    recompute_att: bool,
    /// Recompute the gate/up projection and SwiGLU.
    #[arg(long, help_heading = "Memory")]
    recompute_ffn: bool,
    /// Recompute everything but each block's input (implies all the others).
    #[arg(long, help_heading = "Memory")]
    recompute_block: bool,
}

impl RecomputeFlags {
    pub fn recompute(&self) -> Recompute {
        Recompute {
            swiglu: self.recompute_swiglu,
            norm: self.recompute_norm,
            qkv: self.recompute_qkv,
            att: self.recompute_att,
            ffn: self.recompute_ffn,
            block: self.recompute_block,
        }
    }
}
