//! The blocks' linear layers, in the model's dtype or in FP8 (see `fp8.rs`), behind one call
//! each for the forward and the backward.

use anyhow::Result;

use super::fp8::Linear;
use super::transformer::Transformer;
use crate::backend::{Backend, Matmul};
use crate::tensor::Tensor;

impl<B: Backend> Transformer<B> {
    /// Where the op that produces layer `l`'s input to `lin` reports its abs-max, with FP8.
    pub(crate) fn input_amax(&self, l: usize, lin: Linear) -> Option<Tensor<B>> {
        self.fp8.as_ref().map(|f| f.input_amax(l, lin))
    }

    /// Where the op that produces layer `l`'s output gradient of `lin` reports its abs-max,
    /// with FP8.
    pub(crate) fn grad_amax(&self, l: usize, lin: Linear) -> Option<Tensor<B>> {
        self.fp8.as_ref().map(|f| f.grad_amax(l, lin))
    }

    /// `out = x · wᵀ (+ bias)` for layer `l`'s `lin`.
    pub(crate) fn linear_forward(
        &self,
        b: &B,
        (l, lin): (usize, Linear),
        out: &Tensor<B>,
        x: &Tensor<B>,
        bias: Option<&Tensor<B>>,
    ) -> Result<()> {
        match &self.fp8 {
            Some(fp8) => fp8.forward(b, (l, lin), out, x, bias),
            None => {
                let w = lin.weight(&self.params.layers[l]);
                b.matmul(out, x, w, bias, Matmul::FORWARD)
            }
        }
    }

    /// `dw (+)= dyᵀ · x` (and `db (+)= Σ dy` if it has a bias), then `dx = dy · w`, for layer
    /// `l`'s `lin`, `dw` and `db` being its gradients; `dx` may be `x`, which is read first.
    /// With FP8, x is read from the forward's stash and the `x` given here is unused.
    pub(crate) fn linear_backward(
        &self,
        b: &B,
        (l, lin): (usize, Linear),
        dx: &Tensor<B>,
        dy: &Tensor<B>,
        x: &Tensor<B>,
        accumulate: bool,
    ) -> Result<()> {
        let g = &self.grads.layers[l];
        let (dw, db) = (lin.weight(g), lin.bias(g));
        match &self.fp8 {
            Some(fp8) => fp8.backward(b, (l, lin), dx, (dw, db), dy, accumulate),
            None => {
                if let Some(db) = db {
                    b.bias_backward(db, dy, accumulate)?;
                }
                let w = lin.weight(&self.params.layers[l]);
                b.matmul(dw, dy, x, None, Matmul::backward_weight(accumulate))?;
                b.matmul(dx, dy, w, None, Matmul::BACKWARD_INPUT)
            }
        }
    }
}
