//! The flags that offload Adam's moments and the residual stream, shared by `smelt train`
//! and `smelt bench` (only train keeps a master copy of the weights, so `--offload-master`
//! is train's own).

use clap::Args;

use crate::train::options::Offload;

#[derive(Args, Debug)]
pub struct OffloadFlags {
    /// Keep Adam's first moment in pinned host memory; the optimizer updates it over the
    /// bus.
    #[arg(long, help_heading = "Memory")]
    offload_opt_m: bool,
    /// Keep Adam's second moment in pinned host memory.
    #[arg(long, help_heading = "Memory")]
    offload_opt_v: bool,
    /// Keep the residual stream (each block's input, which the backward reads again) in
    /// pinned host memory: copied out during the forward and back during the backward,
    /// beside the blocks' work, so the GPU holds two blocks' worth whatever the depth.
    #[arg(long, help_heading = "Memory")]
    offload_residual: bool,
    /// Keep every other activation a layer keeps for its backward (those not recomputed) in
    /// pinned host memory, the same way: the GPU holds two layers' worth. Pays where a
    /// block's work outlasts its copies over the bus: long sequences (at 0.5B, a 128k
    /// sequence with --recompute-ffn moves 1.2 GB per block, against a 100 ms forward).
    #[arg(long, help_heading = "Memory")]
    offload_activations: bool,
}

impl OffloadFlags {
    pub fn offload(&self, master: bool) -> Offload {
        Offload {
            master,
            opt_m: self.offload_opt_m,
            opt_v: self.offload_opt_v,
        }
    }

    pub fn residual(&self) -> bool {
        self.offload_residual
    }

    pub fn activations(&self) -> bool {
        self.offload_activations
    }
}
