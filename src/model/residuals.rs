//! The residual stream: each block's input, which the backward reads again, and the last
//! block's output. The inputs are a stash kept per layer, which `--offload-residual`
//! offloads (`Stash`); the output is read by the final norm right away and stays on the
//! device.

use anyhow::Result;

use super::stash::Stash;
use crate::backend::Backend;
use crate::tensor::Tensor;

pub struct Residuals<B: Backend> {
    inputs: Stash<B>,
    output: Tensor<B>,
    layers: usize,
}

impl<B: Backend> Residuals<B> {
    pub fn new(inputs: Stash<B>, output: Tensor<B>, layers: usize) -> Self {
        Residuals {
            inputs,
            output,
            layers,
        }
    }

    /// Block `l`'s input (at `l` = the number of layers, the output), where the pass that is
    /// running reads and writes it.
    pub fn layer(&self, l: usize) -> &Tensor<B> {
        match l == self.layers {
            true => &self.output,
            false => self.inputs.layer(l),
        }
    }

    /// Before the forward writes block `l`'s input (`Stash::before_write`).
    pub fn before_write(&self, b: &B, l: usize) -> Result<()> {
        self.inputs.before_write(b, l)
    }

    /// After the forward has written block `l`'s input: its copy out, if offloaded, starts
    /// and runs while the block goes on.
    pub fn written(&self, b: &B, l: usize) -> Result<()> {
        self.inputs.written(b, l)
    }

    /// Before block `l`'s backward (`Stash::before_backward`).
    pub fn before_backward(&self, b: &B, l: usize) -> Result<()> {
        self.inputs.before_backward(b, l)
    }
}
