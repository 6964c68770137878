//! The offload flags, shared by `smelt train` and `smelt bench`.

use anyhow::{Result, bail};
use clap::Args;

use crate::tensor::DType;
use crate::train::optimizer::Offload;

#[derive(Args, Debug)]
pub struct OffloadFlags {
    /// Keep the f32 master weights in pinned host memory; the optimizer updates them over
    /// the bus.
    #[arg(long, help_heading = "Memory")]
    offload_master: bool,
    /// Keep Adam's first moment in pinned host memory.
    #[arg(long, help_heading = "Memory")]
    offload_opt_m: bool,
    /// Keep Adam's second moment in pinned host memory.
    #[arg(long, help_heading = "Memory")]
    offload_opt_v: bool,
}

impl OffloadFlags {
    /// The choice, refusing to offload a master copy that the run does not keep.
    pub fn offload(&self, master_dtype: Option<DType>) -> Result<Offload> {
        if self.offload_master && master_dtype.is_none() {
            bail!(
                "--offload-master: this run keeps no master copy of the weights (it updates \
                 them in place); leave it out"
            );
        }
        Ok(Offload {
            master: self.offload_master,
            opt_m: self.offload_opt_m,
            opt_v: self.offload_opt_v,
        })
    }
}
