//! The blocks' linear layers, run forward and backward: in the model's dtype by plain
//! matmuls, in FP8 through the copies and scales `fp8.rs` keeps, or in INT8 through
//! `int8.rs`'s. Everything FP8 and INT8 change about a block stays behind these calls and the
//! norm outputs they ask for.

use anyhow::Result;

use super::fp8::Fp8State;
use super::int8::Int8State;
use super::linear::{Input, Linear};
use super::params::{LayerParams, Params};
use crate::backend::{Backend, Matmul};
use crate::tensor::Tensor;

/// What the linear layers multiply in, with the state each quantized form keeps.
pub(crate) enum LinearLayers<B: Backend> {
    Native,
    Fp8(Fp8State<B>),
    Int8(Int8State<B>),
}

impl<B: Backend> LinearLayers<B> {
    fn fp8(&self) -> Option<&Fp8State<B>> {
        match self {
            LinearLayers::Fp8(f) => Some(f),
            _ => None,
        }
    }

    /// Whether the backward reads the norms' and SwiGLU's outputs again, as stored in the
    /// model's dtype: with plain and INT8 matmuls (FP8's reads the quantized copies its
    /// forward made).
    pub fn native(&self) -> bool {
        self.fp8().is_none()
    }

    /// Where a norm before a linear stores its output: nowhere with FP8 (`Input`).
    pub fn norm_output<'a>(&self, stored: &'a Tensor<B>) -> Option<&'a Tensor<B>> {
        self.native().then_some(stored)
    }

    /// Where the op that produces layer `l`'s input to `lin` reports its abs-max, with FP8.
    pub fn input_amax(&self, l: usize, lin: Linear) -> Option<Tensor<B>> {
        self.fp8().map(|f| f.input_amax(l, lin))
    }

    /// Where the op that produces layer `l`'s output gradient of `lin` reports its abs-max,
    /// with FP8.
    pub fn grad_amax(&self, l: usize, lin: Linear) -> Option<Tensor<B>> {
        self.fp8().map(|f| f.grad_amax(l, lin))
    }

    /// Whether `lin`'s bias gradient comes with RoPE's backward (in the one pass over the
    /// gradient): QKV's in the model's dtype. FP8 sums it in the gradient's quantization
    /// instead.
    pub fn bias_with_rope(&self, lin: Linear) -> bool {
        lin == Linear::Qkv && self.native()
    }

    /// At the start of every forward: FP8 and INT8 make their weight copies current.
    pub fn begin_forward(&self, b: &B, params: &Params<Tensor<B>>) -> Result<()> {
        match self {
            LinearLayers::Native => Ok(()),
            LinearLayers::Fp8(fp8) => fp8.begin_forward(b, params),
            LinearLayers::Int8(int8) => int8.begin_forward(b, params),
        }
    }

    /// Which micro-batch of a pass the ops enqueued until the next call are for (the first
    /// after `begin_forward`): FP8 keeps each one's abs-maxes apart.
    pub fn set_micro_batch(&self, m: usize) {
        if let Some(fp8) = self.fp8() {
            fp8.set_micro_batch(m);
        }
    }

    /// Block `l`'s weights `w` are in their slot, where they pass through one (streamed, or
    /// from another rank): FP8 and INT8 make their copies of them there.
    pub fn weights_arrived(&self, b: &B, l: usize, w: &LayerParams<Tensor<B>>) -> Result<()> {
        match self {
            LinearLayers::Native => Ok(()),
            LinearLayers::Fp8(fp8) => fp8.weights_arrived(b, l, w),
            LinearLayers::Int8(int8) => int8.weights_arrived(b, l, w),
        }
    }

    /// Whether the recompute pass makes FP8's copy of the down projection's input again from
    /// SwiGLU's output (`stash_down_input`), which it then recomputes.
    pub fn remakes_down_input(&self) -> bool {
        self.fp8().is_some_and(|fp8| fp8.remakes_down_input())
    }

    /// In the recompute pass, FP8's copy of layer `l`'s down projection input `swiglu`, for
    /// its weight gradient.
    pub fn stash_down_input(&self, b: &B, l: usize, swiglu: &Tensor<B>) -> Result<()> {
        match self.fp8() {
            Some(fp8) => fp8.stash_input(b, (l, Linear::Down), swiglu),
            None => Ok(()),
        }
    }

    /// At the start of every backward: FP8 zeroes its gradient abs-maxes.
    pub fn begin_backward(&self, b: &B) -> Result<()> {
        match self.fp8() {
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
        match self {
            LinearLayers::Native => b.matmul(out, x.stored(), lin.weight(w), bias, Matmul::FORWARD),
            LinearLayers::Fp8(fp8) => fp8.forward(b, (l, lin), out, x, bias),
            LinearLayers::Int8(int8) => int8.forward(b, (l, lin), out, x, bias),
        }
    }

    /// The gate/up projection of `x` and SwiGLU of it into `swiglu`, reporting its abs-max
    /// where FP8 quantizes it next; the backend may do both in one kernel.
    pub fn gate_up_swiglu(
        &self, b: &B, (l, w): (usize, &LayerParams<Tensor<B>>),
        (gate_up, swiglu): (&Tensor<B>, &Tensor<B>), x: Input<'_, B>,
    ) -> Result<()> {
        match self {
            LinearLayers::Native => b.gate_up_swiglu(gate_up, swiglu, x.stored(), &w.gate_up, None),
            LinearLayers::Fp8(fp8) => fp8.gate_up_swiglu(b, l, gate_up, swiglu, x),
            LinearLayers::Int8(int8) => int8.gate_up_swiglu(b, l, gate_up, swiglu, x),
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
        if let LinearLayers::Fp8(fp8) = self {
            return fp8.backward(b, (l, lin), dx, (dw, db), dy, accumulate);
        }
        if let Some(db) = db.filter(|_| !self.bias_with_rope(lin)) {
            b.bias_backward(db, dy, accumulate)?;
        }
        match self {
            LinearLayers::Int8(int8) => {
                int8.weight_gradient(b, (l, lin), dw, dy, x, accumulate)?;
                int8.with_gradient(b, (l, lin), dy, |dy8, w8| {
                    b.matmul(dx, dy8, w8, None, Matmul::FORWARD)
                })
            }
            _ => {
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
        match self {
            LinearLayers::Native => {
                let spec = Matmul::backward_weight(accumulate);
                b.matmul(&g.down, dy, swiglu, None, spec)?;
                b.swiglu_backward_through_down(gate_up, dh, dy, &w.down, None)
            }
            LinearLayers::Fp8(fp8) => {
                fp8.down_swiglu_backward(b, l, (gate_up, dh), &g.down, dy, accumulate)
            }
            LinearLayers::Int8(int8) => {
                int8.weight_gradient(b, (l, Linear::Down), &g.down, dy, swiglu, accumulate)?;
                int8.with_gradient(b, (l, Linear::Down), dy, |dy8, w8| {
                    b.swiglu_backward_through_down(gate_up, dh, dy8, w8, None)
                })
            }
        }
    }

    /// The weights were written other than by the optimizer (initialised, loaded): FP8 and
    /// INT8 remake their copies from scratch at the next forward.
    pub fn weights_changed(&self) {
        match self {
            LinearLayers::Native => {}
            LinearLayers::Fp8(fp8) => fp8.weights_changed(),
            LinearLayers::Int8(int8) => int8.weights_changed(),
        }
    }

    /// Which state the quantized weight copies are in, 0 to 2, for a recorded forward
    /// (`recorded::PassRecordings`): it decides which ops `begin_forward` enqueues.
    pub fn copies_state(&self) -> usize {
        match self {
            LinearLayers::Native => 0,
            LinearLayers::Fp8(fp8) => fp8.copies_state(),
            LinearLayers::Int8(int8) => int8.copies_state(),
        }
    }

    /// After a replayed forward, which made the copies current on the device: the state that
    /// `begin_forward` leaves.
    pub fn copies_made(&self) {
        match self {
            LinearLayers::Native => {}
            LinearLayers::Fp8(fp8) => fp8.copies_made(),
            LinearLayers::Int8(int8) => int8.copies_made(),
        }
    }

    /// The seed of INT8's stochastic roundings until the next call (each micro-batch's).
    pub fn set_rounding_seed(&self, seed: u64) {
        if let LinearLayers::Int8(int8) = self {
            int8.set_seed(seed);
        }
    }

    /// Before an optimizer step: where its update of each parameter (in `Params` order)
    /// reports the abs-max that scales the weight's FP8 copy. `None` without FP8. INT8's
    /// codes, scaled per row, are remade from the updated weights at the next forward.
    pub fn weight_amax_slots(&self, b: &B) -> Result<Option<Vec<Tensor<B>>>> {
        if let LinearLayers::Int8(int8) = self {
            int8.weights_changed();
        }
        self.fp8().map(|fp8| fp8.weight_amax_slots(b)).transpose()
    }

    /// Every FP8 abs-max statistic by name (`None` without FP8). Waits for the device.
    pub fn abs_max_report(&self, b: &B) -> Result<Option<Vec<(String, f32)>>> {
        self.fp8().map(|fp8| fp8.abs_max_report(b)).transpose()
    }
}
