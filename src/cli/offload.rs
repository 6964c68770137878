//! The flags that offload Adam's moments, shared by `smelt train` and `smelt bench` (only
//! train keeps a master copy of the weights, so `--offload-master` is train's own).

use clap::Args;

use crate::train::optimizer::Offload;

#[derive(Args, Debug)]
pub struct OffloadFlags {
    /// Keep Adam's first moment in pinned host memory; the optimizer updates it over the
    /// bus.
    #[arg(long, help_heading = "Memory")]
    offload_opt_m: bool,
    /// Keep Adam's second moment in pinned host memory.
    #[arg(long, help_heading = "Memory")]
    offload_opt_v: bool,
}

impl OffloadFlags {
    pub fn offload(&self, master: bool) -> Offload {
        Offload {
            master,
            opt_m: self.offload_opt_m,
            opt_v: self.offload_opt_v,
        }
    }
}
