//! INT8 linear layers with row-wise scales (SwitchBack): every token's activations and output
//! gradients, and every output and input channel of a weight, get their own scale, so that
//! quantization needs no statistics from other kernels and an outlier costs precision in its
//! own row only.
//!
//! - forward: `y = x · wᵀ`, x quantized per token and w per output channel;
//! - input gradient: `dx = dy · w`, dy per token and w per input channel (its transposed
//!   copy, made with the other once per optimizer step);
//! - weight gradient: `dw = dyᵀ · x` in bf16 from the activations the forward kept, or with
//!   `weight_grad` in INT8, dy and x each per channel along the tokens.
//!
//! The forward rounds to nearest; with `stochastic` the backward's operands round
//! stochastically, from seeds derived from the one `set_seed` gives (each micro-batch's) and
//! the operand's layer, linear and role, so that a run and its resumption round alike.
//!
//! The activations are those of a bf16 model: INT8 changes the matmuls only.

use std::cell::Cell;

use anyhow::Result;

use super::linear::{Input, Int8Options, Linear, QuantizedShape, copies_per_block, copy_holders};
use super::params::{LayerParams, ParamSpec, Params};
use crate::backend::{Backend, Int8Layout, Int8Rounding, Matmul, Operand};
use crate::rng::Rng;
use crate::tensor::{DType, Tensor, TensorSpec};

/// A weight's INT8 codes: `[out, in]` per output channel, for the forward, and `[in, out]`
/// per input channel, for the input gradient.
struct WeightCodes<B: Backend> {
    rows: Tensor<B>,
    row_descale: Tensor<B>,
    cols: Tensor<B>,
    col_descale: Tensor<B>,
}

// By hand: a derive would ask for `B: Clone`.
impl<B: Backend> Clone for WeightCodes<B> {
    fn clone(&self) -> Self {
        WeightCodes {
            rows: self.rows.clone(),
            row_descale: self.row_descale.clone(),
            cols: self.cols.clone(),
            col_descale: self.col_descale.clone(),
        }
    }
}

/// Scratch codes of one operand and their descales, as flat buffers viewed per call.
struct Scratch<B: Backend> {
    codes: Tensor<B>,
    descale: Tensor<B>,
}

impl<B: Backend> Scratch<B> {
    /// The first `rows · cols` codes as `[rows, cols]` and their `rows` descales.
    fn view(&self, rows: usize, cols: usize) -> (Tensor<B>, Tensor<B>) {
        let codes = self
            .codes
            .narrow_rows(0, rows * cols)
            .reshape(&[rows, cols]);
        (codes, self.descale.narrow_rows(0, rows))
    }

    /// `x` quantized in `layout` into the scratch.
    fn quantize(
        &self, b: &B, x: &Tensor<B>, layout: Int8Layout, rounding: Int8Rounding,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        let [rows, cols] = layout.codes_shape(x.matrix_rows(), x.cols());
        let (codes, descale) = self.view(rows, cols);
        b.quantize_i8(&codes, &descale, x, layout, rounding)?;
        Ok((codes, descale))
    }
}

/// What a backward quantization rounds: its seed's index among a layer's linear's operands.
#[derive(Clone, Copy)]
enum Role {
    /// The output gradient, per token (the input gradient's operand).
    Grad = 0,
    /// The output gradient and the input, each per channel: an INT8 weight gradient's.
    GradCols = 1,
    InputCols = 2,
}

/// Everything INT8 adds to a transformer: the weights' codes and scratch for quantized
/// activations and gradients.
pub(crate) struct Int8State<B: Backend> {
    /// Per block, its four linears' codes, in `Linear::ALL` order.
    weights: Vec<[WeightCodes<B>; 4]>,
    /// Per block, whether its weights pass through a shared slot (streamed, or under ZeRO-3
    /// kept by another rank), its codes then being the slot's (`weights_arrived`).
    in_slot: Vec<bool>,
    /// Whether the codes match the weights; the optimizer and loads make them stale.
    current: Cell<bool>,
    options: Int8Options,
    /// The seed stochastic rounding derives its seeds from (`set_seed`).
    seed: Cell<u64>,
    /// A linear's input (rows in the forward; columns for an INT8 weight gradient).
    input: Scratch<B>,
    /// An output gradient (columns for an INT8 weight gradient, then rows).
    grad: Scratch<B>,
}

/// The INT8 buffers' specs.
pub(crate) struct Int8Plan {
    pub specs: Vec<TensorSpec>,
    /// Each block's slot of codes where its weights pass through a shared slot, `None` where
    /// it has codes of its own (`QuantizedShape::weight_slots`).
    code_slots: Vec<Option<usize>>,
    options: Int8Options,
}

impl Int8Plan {
    /// The specs of every buffer; `None` when the matmuls are not INT8.
    pub fn new(
        precision: super::MatmulPrecision, shape: &QuantizedShape, layout: &Params<ParamSpec>,
    ) -> Option<Self> {
        let super::MatmulPrecision::Int8(options) = precision else {
            return None;
        };
        let weight_grad = options.weight_grad;
        let descales = |name: &str, n: usize| TensorSpec::new(name, &[n], DType::F32);
        // With an INT8 weight gradient the scratch also holds x and dy transposed, with a
        // descale per channel.
        let (n, in_rows, out_rows) = (
            shape.tokens,
            shape.tokens.max(if weight_grad { shape.max_in } else { 0 }),
            shape
                .tokens
                .max(if weight_grad { shape.max_out } else { 0 }),
        );
        let mut specs = vec![
            TensorSpec::new("int8.input", &[n * shape.max_in], DType::I8),
            descales("int8.input.descale", in_rows),
            TensorSpec::new("int8.grad", &[n * shape.max_out], DType::I8),
            descales("int8.grad.descale", out_rows),
        ];
        let codes = |specs: &mut Vec<TensorSpec>, name: &str, w: &TensorSpec| {
            let (out, inp) = (w.shape[0], w.shape[1]);
            specs.push(TensorSpec::new(name, &[out, inp], DType::I8));
            specs.push(descales(&format!("{name}.descale"), out));
            specs.push(TensorSpec::new(format!("{name}.t"), &[inp, out], DType::I8));
            specs.push(descales(&format!("{name}.t.descale"), inp));
        };
        // Every block has the first's shapes.
        if let Some(first) = layout.layers.first() {
            for holder in copy_holders(&shape.weight_slots) {
                for lin in Linear::ALL {
                    let name = format!("int8.{holder}.{}", lin.name());
                    codes(&mut specs, &name, &lin.weight(first).tensor);
                }
            }
        }
        Some(Int8Plan {
            specs,
            code_slots: shape.weight_slots.clone(),
            options,
        })
    }

    /// The state, from tensors allocated for `specs` in their order.
    pub fn build<B: Backend>(&self, t: Vec<Tensor<B>>) -> Int8State<B> {
        let mut t = t.into_iter();
        let mut take = || t.next().expect("one tensor per planned spec");
        let input = Scratch {
            codes: take(),
            descale: take(),
        };
        let grad = Scratch {
            codes: take(),
            descale: take(),
        };
        let weights = copies_per_block(&self.code_slots, || {
            Linear::ALL.map(|_| WeightCodes {
                rows: take(),
                row_descale: take(),
                cols: take(),
                col_descale: take(),
            })
        });
        Int8State {
            weights,
            in_slot: self.code_slots.iter().map(Option::is_some).collect(),
            current: Cell::new(false),
            options: self.options,
            seed: Cell::new(0),
            input,
            grad,
        }
    }
}

impl<B: Backend> Int8State<B> {
    /// The weights were written (by the optimizer, or initialised or loaded): the codes are
    /// remade at the next forward.
    pub fn weights_changed(&self) {
        self.current.set(false);
    }

    /// At the start of every forward: makes the codes of the weights that have their own
    /// current (once per optimizer step: later micro-steps reuse them; those in a slot are
    /// made as they arrive, `weights_arrived`).
    pub fn begin_forward(&self, b: &B, params: &Params<Tensor<B>>) -> Result<()> {
        if self.current.get() {
            return Ok(());
        }
        let own = (params.layers.iter().enumerate()).filter(|&(l, _)| !self.in_slot[l]);
        for (l, layer) in own {
            self.make_codes(b, l, layer)?;
        }
        self.current.set(true);
        Ok(())
    }

    /// Where block `l`'s weights pass through a slot (streamed, or from another rank): its
    /// codes, made in the slot from its weights `w` once they are there, before each pass
    /// reads them.
    pub fn weights_arrived(&self, b: &B, l: usize, w: &LayerParams<Tensor<B>>) -> Result<()> {
        match self.in_slot[l] {
            true => self.make_codes(b, l, w),
            false => Ok(()),
        }
    }

    /// Block `l`'s codes of its weights `w`, per output and per input channel.
    fn make_codes(&self, b: &B, l: usize, w: &LayerParams<Tensor<B>>) -> Result<()> {
        for lin in Linear::ALL {
            let (w, c) = (lin.weight(w), self.weight(l, lin));
            let nearest = Int8Rounding::Nearest;
            b.quantize_i8(&c.rows, &c.row_descale, w, Int8Layout::Rows, nearest)?;
            b.quantize_i8(&c.cols, &c.col_descale, w, Int8Layout::Cols, nearest)?;
        }
        Ok(())
    }

    /// Whether the codes are current, as a number (`LinearLayers::copies_state`).
    pub fn copies_state(&self) -> usize {
        self.current.get() as usize
    }

    /// What `begin_forward` leaves (`LinearLayers::copies_made`).
    pub fn copies_made(&self) {
        self.current.set(true);
    }

    /// The seed of the stochastic roundings that follow, until the next call.
    pub fn set_seed(&self, seed: u64) {
        self.seed.set(seed);
    }

    fn weight(&self, l: usize, lin: Linear) -> &WeightCodes<B> {
        &self.weights[l][lin as usize]
    }

    /// How the backward rounds layer `l`'s `lin` operand `role`.
    fn rounding(&self, (l, lin): (usize, Linear), role: Role) -> Int8Rounding {
        if !self.options.stochastic {
            return Int8Rounding::Nearest;
        }
        let index = (4 * l + lin as usize) * 3 + role as usize;
        Int8Rounding::Stochastic {
            seed: Rng::derived(self.seed.get(), index as u64).next_u64(),
        }
    }

    /// `out = x · wᵀ (+ bias)`, x quantized per token.
    pub fn forward(
        &self, b: &B, (l, lin): (usize, Linear), out: &Tensor<B>, x: Input<'_, B>,
        bias: Option<&Tensor<B>>,
    ) -> Result<()> {
        let (xq, xd) =
            self.input
                .quantize(b, x.stored(), Int8Layout::Rows, Int8Rounding::Nearest)?;
        let w = self.weight(l, lin);
        b.matmul(
            out,
            Operand::scaled(&xq, &xd),
            Operand::scaled(&w.rows, &w.row_descale),
            bias,
            Matmul::FORWARD,
        )
    }

    /// The gate/up projection of `x` (as `forward`) and SwiGLU of it into `swiglu`; the
    /// backend may do both in one kernel.
    pub fn gate_up_swiglu(
        &self, b: &B, l: usize, gate_up: &Tensor<B>, swiglu: &Tensor<B>, x: Input<'_, B>,
    ) -> Result<()> {
        let (xq, xd) =
            self.input
                .quantize(b, x.stored(), Int8Layout::Rows, Int8Rounding::Nearest)?;
        let w = self.weight(l, Linear::GateUp);
        b.gate_up_swiglu(
            gate_up,
            swiglu,
            Operand::scaled(&xq, &xd),
            Operand::scaled(&w.rows, &w.row_descale),
            None,
        )
    }

    /// `dw (+)= dyᵀ · x`: in bf16, or in INT8 with dy and x quantized per channel along the
    /// tokens.
    pub fn weight_gradient(
        &self, b: &B, linear: (usize, Linear), dw: &Tensor<B>, dy: &Tensor<B>, x: &Tensor<B>,
        accumulate: bool,
    ) -> Result<()> {
        if !self.options.weight_grad {
            return b.matmul(dw, dy, x, None, Matmul::backward_weight(accumulate));
        }
        let dy_rounding = self.rounding(linear, Role::GradCols);
        let (dyt, dyd) = self.grad.quantize(b, dy, Int8Layout::Cols, dy_rounding)?;
        let x_rounding = self.rounding(linear, Role::InputCols);
        let (xt, xd) = self.input.quantize(b, x, Int8Layout::Cols, x_rounding)?;
        let spec = Matmul {
            accumulate,
            ..Matmul::FORWARD
        };
        b.matmul(
            dw,
            Operand::scaled(&dyt, &dyd),
            Operand::scaled(&xt, &xd),
            None,
            spec,
        )
    }

    /// dy quantized per token, and layer `l`'s `lin` weight per input channel: the operands
    /// of `dx = dy · w`, which `input_gradient` runs.
    pub fn with_gradient(
        &self, b: &B, (l, lin): (usize, Linear), dy: &Tensor<B>,
        input_gradient: impl FnOnce(Operand<'_, B>, Operand<'_, B>) -> Result<()>,
    ) -> Result<()> {
        let rounding = self.rounding((l, lin), Role::Grad);
        let (dyq, dyd) = self.grad.quantize(b, dy, Int8Layout::Rows, rounding)?;
        let w = self.weight(l, lin);
        input_gradient(
            Operand::scaled(&dyq, &dyd),
            Operand::scaled(&w.cols, &w.col_descale),
        )
    }
}
