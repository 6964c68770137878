//! The blocks' linear layers, run forward and backward: in the model's dtype by plain
//! matmuls, or in FP8 through the copies and scales `fp8.rs` keeps. Everything FP8 changes
//! about a block stays behind these calls and the norm outputs they ask for.

use anyhow::Result;

use super::fp8::Fp8State;
use super::linear::{Input, Linear};
use super::params::{LayerParams, Params};
use crate::backend::{Backend, Matmul};
use crate::tensor::Tensor;

pub(crate) struct LinearLayers<B: Backend> {
    /// The FP8 copies, statistics and scratch, when the linear layers run in FP8.
    fp8: Option<Fp8State<B>>,
}

impl<B: Backend> LinearLayers<B> {
    pub fn new(fp8: Option<Fp8State<B>>) -> Self {
        LinearLayers { fp8 }
    }

    /// Whether they multiply in the model's dtype: then the backward reads the norms' and
    /// SwiGLU's outputs again (FP8's reads the quantized copies its forward made).
    pub fn native(&self) -> bool {
        self.fp8.is_none()
    }

    /// Where a norm before a linear stores its output: nowhere with FP8 (`Input`).
    pub fn norm_output<'a>(&self, stored: &'a Tensor<B>) -> Option<&'a Tensor<B>> {
        self.native().then_some(stored)
    }

    /// Where the op that produces layer `l`'s input to `lin` reports its abs-max, with FP8.
    pub fn input_amax(&self, l: usize, lin: Linear) -> Option<Tensor<B>> {
        self.fp8.as_ref().map(|f| f.input_amax(l, lin))
    }

    /// Where the op that produces layer `l`'s output gradient of `lin` reports its abs-max,
    /// with FP8.
    pub fn grad_amax(&self, l: usize, lin: Linear) -> Option<Tensor<B>> {
        self.fp8.as_ref().map(|f| f.grad_amax(l, lin))
    }

    /// Whether `lin`'s bias gradient comes with RoPE's backward (in the one pass over the
    /// gradient): QKV's in the model's dtype. FP8 sums it in the gradient's quantization
    /// instead.
    pub fn bias_with_rope(&self, lin: Linear) -> bool {
        lin == Linear::Qkv && self.native()
    }

    /// At the start of every forward: FP8 makes its weight copies current.
    pub fn begin_forward(&self, b: &B, params: &Params<Tensor<B>>) -> Result<()> {
        match &self.fp8 {
            Some(fp8) => fp8.begin_forward(b, params),
            None => Ok(()),
        }
    }

    /// At the start of every backward: FP8 zeroes its gradient abs-maxes.
    pub fn begin_backward(&self, b: &B) -> Result<()> {
        match &self.fp8 {
            Some(fp8) => fp8.begin_backward(b),
            None => Ok(()),
        }
    }

    /// `out = x · wᵀ (+ bias)` for layer `l`'s `lin`, of weights `w`.
    pub fn forward(
        &self, b: &B, (l, lin, w): (usize, Linear, &LayerParams<Tensor<B>>), out: &Tensor<B>,
        x: Input<'_, B>,
    ) -> Result<()> {
        let bias = lin.bias(w);
        match &self.fp8 {
            Some(fp8) => fp8.forward(b, (l, lin), out, x, bias),
            None => b.matmul(out, x.stored(), lin.weight(w), bias, Matmul::FORWARD),
        }
    }

    /// The gate/up projection of `x` and SwiGLU of it into `swiglu`, reporting its abs-max
    /// where FP8 quantizes it next; the backend may do both in one kernel.
    pub fn gate_up_swiglu(
        &self, b: &B, (l, w): (usize, &LayerParams<Tensor<B>>),
        (gate_up, swiglu): (&Tensor<B>, &Tensor<B>), x: Input<'_, B>,
    ) -> Result<()> {
        match &self.fp8 {
            Some(fp8) => fp8.gate_up_swiglu(b, l, gate_up, swiglu, x),
            None => b.gate_up_swiglu(gate_up, swiglu, x.stored(), &w.gate_up, None),
        }
    }

    /// `dw (+)= dyᵀ · x` (and `db (+)= Σ dy` if it has a bias, unless it came with RoPE's
    /// backward), then `dx = dy · w`, for layer `l`'s `lin`, `w` and `g` being its weights and
    /// gradients; `dx` may be `x`, which is read first. With FP8, x is read from the
    /// forward's copy and the `x` given here is unused.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self, b: &B,
        (l, lin, w, g): (
            usize,
            Linear,
            &LayerParams<Tensor<B>>,
            &LayerParams<Tensor<B>>,
        ),
        dx: &Tensor<B>, dy: &Tensor<B>, x: &Tensor<B>, accumulate: bool,
    ) -> Result<()> {
        let (dw, db) = (lin.weight(g), lin.bias(g));
        match &self.fp8 {
            Some(fp8) => fp8.backward(b, (l, lin), dx, (dw, db), dy, accumulate),
            None => {
                if let Some(db) = db.filter(|_| !self.bias_with_rope(lin)) {
                    b.bias_backward(db, dy, accumulate)?;
                }
                b.matmul(dw, dy, x, None, Matmul::backward_weight(accumulate))?;
                b.matmul(dx, dy, lin.weight(w), None, Matmul::BACKWARD_INPUT)
            }
        }
    }

    /// The down projection's backward and SwiGLU's: `dw (+)= dyᵀ · h` (h the SwiGLU output
    /// `swiglu`), and gate/up's gradient over `gate_up` from `dh = dy · w`, its abs-max
    /// reported where FP8 quantizes it next; the backend may do the second in one kernel,
    /// leaving `dh` (where it would put `dy · w`) untouched. `dh` may be `swiglu`, which the
    /// weight gradient reads first.
    #[allow(clippy::too_many_arguments)]
    pub fn down_swiglu_backward(
        &self, b: &B, (l, w, g): (usize, &LayerParams<Tensor<B>>, &LayerParams<Tensor<B>>),
        (gate_up, swiglu, dh): (&Tensor<B>, &Tensor<B>, &Tensor<B>), dy: &Tensor<B>,
        accumulate: bool,
    ) -> Result<()> {
        match &self.fp8 {
            Some(fp8) => fp8.down_swiglu_backward(b, l, (gate_up, dh), &g.down, dy, accumulate),
            None => {
                let spec = Matmul::backward_weight(accumulate);
                b.matmul(&g.down, dy, swiglu, None, spec)?;
                b.swiglu_backward_through_down(gate_up, dh, dy, &w.down, None)
            }
        }
    }

    /// The weights were written other than by the optimizer (initialised, loaded): FP8
    /// remakes its copies from scratch at the next forward.
    pub fn weights_changed(&self) {
        if let Some(fp8) = &self.fp8 {
            fp8.weights_changed();
        }
    }

    /// Before an optimizer step: where its update of each parameter (in `Params` order)
    /// reports the abs-max that scales the weight's FP8 copy. `None` without FP8.
    pub fn weight_amax_slots(&self, b: &B) -> Result<Option<Vec<Tensor<B>>>> {
        self.fp8
            .as_ref()
            .map(|fp8| fp8.weight_amax_slots(b))
            .transpose()
    }

    /// Every FP8 abs-max statistic by name (`None` without FP8). Waits for the device.
    pub fn abs_max_report(&self, b: &B) -> Result<Option<Vec<(String, f32)>>> {
        self.fp8
            .as_ref()
            .map(|fp8| fp8.abs_max_report(b))
            .transpose()
    }
}
