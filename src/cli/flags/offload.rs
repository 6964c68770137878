//! The flags that offload Adam's moments, the activations and the blocks' weights and
//! gradients, shared by `smelt train` and `smelt bench` (only train keeps a master copy of
//! the weights, so `--offload-master` is train's own).

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
    /// Keep the blocks' weights in pinned host memory, each block copied into one of two
    /// device slots a block ahead of its forward and again of its backward: the GPU holds
    /// two blocks' weights whatever the depth. Each micro-batch moves the weights over the
    /// bus twice; it pays where a block's work outlasts its copy (long micro-batches).
    #[arg(long, help_heading = "Memory")]
    offload_weights: bool,
    /// Keep the blocks' gradients in pinned host memory: each block's goes out of one of two
    /// device slots as its backward finishes it (and, with --grad-accumulation, its sum so
    /// far comes back in a block ahead, to be added to). One GPU only.
    #[arg(long, help_heading = "Memory")]
    offload_gradients: bool,
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

    pub fn weights(&self) -> bool {
        self.offload_weights
    }

    pub fn gradients(&self) -> bool {
        self.offload_gradients
    }
}
