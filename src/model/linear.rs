//! The blocks' linear layers, in the model's dtype or in FP8 (see `fp8.rs`), behind one call
//! each for the forward and the backward.

use anyhow::Result;

use super::fp8::Linear;
use super::transformer::Transformer;
use crate::backend::{Backend, Matmul};
use crate::tensor::Tensor;

/// The output of `rmsnorm_forward` described by its input rows `x` `[N, C]`, their `rstd`
/// `[N]` (f32) and the norm's `weight` `[C]`, for an op that normalizes as it reads instead
/// of reading the stored output.
pub(crate) struct Normalized<'a, B: Backend> {
    pub x: &'a Tensor<B>,
    pub rstd: &'a Tensor<B>,
    pub weight: &'a Tensor<B>,
}

/// What a linear layer reads: a tensor, or a norm's output. A norm stores its output in
/// `stored` for bf16 matmuls only: with FP8, the projection's quantization normalizes the
/// norm's input as it reads it (`Backend::quantize_normalized`), which saves writing the
/// output and reading it back.
pub(crate) enum Input<'a, B: Backend> {
    Tensor(&'a Tensor<B>),
    Norm {
        stored: &'a Tensor<B>,
        normalized: Normalized<'a, B>,
    },
}

impl<B: Backend> Input<'_, B> {
    /// The tensor bf16 matmuls read.
    pub fn stored(&self) -> &Tensor<B> {
        match self {
            Input::Tensor(t) | Input::Norm { stored: t, .. } => t,
        }
    }

    /// The input's rows and columns.
    pub fn dims(&self) -> (usize, usize) {
        (self.stored().matrix_rows(), self.stored().cols())
    }
}

/// Views of a norm's output over some rows, `Input::Norm`'s parts.
pub(crate) struct NormRows<'a, B: Backend> {
    pub stored: Tensor<B>,
    pub x: Tensor<B>,
    pub rstd: Tensor<B>,
    pub weight: &'a Tensor<B>,
}

impl<B: Backend> NormRows<'_, B> {
    pub fn input(&self) -> Input<'_, B> {
        Input::Norm {
            stored: &self.stored,
            normalized: Normalized {
                x: &self.x,
                rstd: &self.rstd,
                weight: self.weight,
            },
        }
    }
}

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

    /// Where a norm stores its output: nowhere with FP8 (`Input`).
    pub(crate) fn norm_out<'a>(&self, stored: &'a Tensor<B>) -> Option<&'a Tensor<B>> {
        self.fp8.is_none().then_some(stored)
    }

    /// `out = x · wᵀ (+ bias)` for layer `l`'s `lin`.
    pub(crate) fn linear_forward(
        &self,
        b: &B,
        (l, lin): (usize, Linear),
        out: &Tensor<B>,
        x: Input<'_, B>,
        bias: Option<&Tensor<B>>,
    ) -> Result<()> {
        match &self.fp8 {
            Some(fp8) => fp8.forward(b, (l, lin), out, x, bias),
            None => {
                let w = lin.weight(&self.params.layers[l]);
                b.matmul(out, x.stored(), w, bias, Matmul::FORWARD)
            }
        }
    }

    /// Whether `lin`'s bias gradient comes with RoPE's backward (`rope_backward_and_bias`, in
    /// the one pass over the gradient): QKV's in bf16. FP8 sums it in the gradient's
    /// quantization instead.
    pub(crate) fn bias_with_rope(&self, lin: Linear) -> bool {
        lin == Linear::Qkv && self.fp8.is_none()
    }

    /// `dw (+)= dyᵀ · x` (and `db (+)= Σ dy` if it has a bias, unless it came with RoPE's
    /// backward), then `dx = dy · w`, for layer `l`'s `lin`, `dw` and `db` being its gradients;
    /// `dx` may be `x`, which is read first. With FP8, x is read from the forward's stash and
    /// the `x` given here is unused.
    pub(crate) fn linear_backward(
        &self,
        b: &B,
        (l, lin): (usize, Linear),
        dx: &Tensor<B>,
        dy: &Tensor<B>,
        x: &Tensor<B>,
        accumulate: bool,
    ) -> Result<()> {
        let g = &self.grads().layers[l];
        let (dw, db) = (lin.weight(g), lin.bias(g));
        match &self.fp8 {
            Some(fp8) => fp8.backward(b, (l, lin), dx, (dw, db), dy, accumulate),
            None => {
                if let Some(db) = db.filter(|_| !self.bias_with_rope(lin)) {
                    b.bias_backward(db, dy, accumulate)?;
                }
                let w = lin.weight(&self.params.layers[l]);
                b.matmul(dw, dy, x, None, Matmul::backward_weight(accumulate))?;
                b.matmul(dx, dy, w, None, Matmul::BACKWARD_INPUT)
            }
        }
    }
}
