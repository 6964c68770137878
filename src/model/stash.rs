//! An activation the backward reads again, kept for every layer or shared by all, and when
//! offloaded, copied to host memory beside the blocks' work.

use anyhow::Result;

use crate::backend::Backend;
use crate::tensor::Tensor;

/// One activation for every layer, or one buffer shared by all layers when recomputed.
/// Offloaded (`--offload-activations`, and the residual stream's inputs with
/// `--offload-residual`), every layer's copy is in pinned host memory and the device holds
/// two slots, which the layers take in turn: the forward copies each layer's out while the
/// next block runs, and the backward brings each back while the block above runs its
/// backward. The two last layers' never leave their slots. Copies run beside the blocks'
/// work (`Backend::start_copy`), and each wait is for one slot's last copy only.
pub struct Stash<B: Backend> {
    device: Vec<Tensor<B>>,
    host: Vec<Tensor<B>>,
}

impl<B: Backend> Stash<B> {
    /// `device`: every layer's tensor, or the one shared, or (with `host` not empty) the two
    /// slots; `host`: every layer's copy, when offloaded.
    pub fn new(device: Vec<Tensor<B>>, host: Vec<Tensor<B>>) -> Self {
        Stash { device, host }
    }

    pub fn layer(&self, l: usize) -> &Tensor<B> {
        match self.host.is_empty() {
            true => &self.device[l.min(self.device.len() - 1)],
            false => &self.device[l % 2],
        }
    }

    /// Before the forward writes layer `l`: the layer that had the slot before (two blocks
    /// up, or a pass ago) must have been copied out, or (its backward) back in.
    pub fn before_write(&self, b: &B, l: usize) -> Result<()> {
        match self.host.is_empty() {
            true => Ok(()),
            false => b.wait_for_copies_of(&[self.layer(l)]),
        }
    }

    /// After the forward has written layer `l`: its copy out starts.
    pub fn written(&self, b: &B, l: usize) -> Result<()> {
        match self.host.get(l) {
            Some(host) => b.start_copy(host, self.layer(l)),
            None => Ok(()),
        }
    }

    /// Before block `l`'s backward reads layer `l` (and writes over it: the MLP's gradients
    /// take their activations' memory), it must be back, and no longer on its way out; and
    /// layer `l − 1` starts coming back into the slot that block `l + 1`'s backward is done
    /// with.
    pub fn before_backward(&self, b: &B, l: usize) -> Result<()> {
        if self.host.is_empty() {
            return Ok(());
        }
        b.wait_for_copies_of(&[self.layer(l)])?;
        if l >= 1 && l + 2 <= self.host.len() {
            b.start_copy(self.layer(l - 1), &self.host[l - 1])?;
        }
        Ok(())
    }
}
