//! The residual stream: each block's input, which the backward reads again, and the last
//! block's output. Kept on the device for every layer, or, offloaded (`--offload-residual`),
//! copied to pinned host memory as the forward writes it and back just ahead of the
//! backward, so that the device holds two blocks' inputs, taken in turn, and the output,
//! whatever the depth. The copies run beside the blocks' work (`Backend::start_copy`).

use anyhow::Result;

use crate::backend::Backend;
use crate::tensor::Tensor;

pub struct Residuals<B: Backend> {
    /// Every block's input and then the output; offloaded, two slots and then the output.
    device: Vec<Tensor<B>>,
    /// Offloaded: every block's input, in host memory; otherwise empty.
    host: Vec<Tensor<B>>,
}

impl<B: Backend> Residuals<B> {
    pub fn new(device: Vec<Tensor<B>>, host: Vec<Tensor<B>>) -> Self {
        assert!(
            host.is_empty() || device.len() == 3,
            "offloaded, the device holds two slots and the output"
        );
        Residuals { device, host }
    }

    fn offloaded(&self) -> bool {
        !self.host.is_empty()
    }

    /// Block `l`'s input (at `l` = the number of layers, the output), where the pass that is
    /// running reads and writes it.
    pub fn layer(&self, l: usize) -> &Tensor<B> {
        match self.offloaded() {
            false => &self.device[l],
            true if l == self.host.len() => &self.device[2],
            true => &self.device[l % 2],
        }
    }

    /// Before the forward writes block `l`'s input: the layer that had its slot before
    /// (two blocks up, or a pass ago) must have been copied out.
    pub fn before_write(&self, b: &B, l: usize) -> Result<()> {
        match self.offloaded() && l < self.host.len() {
            true => b.join_copies(),
            false => Ok(()),
        }
    }

    /// After the forward has written block `l`'s input: its copy out starts, and runs while
    /// the block goes on.
    pub fn written(&self, b: &B, l: usize) -> Result<()> {
        match self.offloaded() && l < self.host.len() {
            true => b.start_copy(&self.host[l], self.layer(l)),
            false => Ok(()),
        }
    }

    /// Before block `l`'s backward (the forward having run just before the backward): its
    /// input must be back, and the input of block `l − 1` starts coming back into the slot
    /// that block `l + 1`'s backward has finished with. The two last blocks' inputs never
    /// left their slots.
    pub fn before_backward(&self, b: &B, l: usize) -> Result<()> {
        if !self.offloaded() {
            return Ok(());
        }
        b.join_copies()?;
        if l >= 1 && l + 2 <= self.host.len() {
            b.start_copy(self.layer(l - 1), &self.host[l - 1])?;
        }
        Ok(())
    }
}
