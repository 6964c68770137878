//! FP8 linear layers: current per-tensor scaling, as llm.q does it.

use std::cell::Cell;

use anyhow::Result;

use super::linear::{
    Input, Linear, MatmulPrecision, QuantizedShape, copies_per_block, copy_holders,
};
use super::params::{LayerParams, ParamSpec, Params};
use super::recompute::Recompute;
use crate::backend::{Backend, Fp8Sum, Fused, Matmul, Operand};
use crate::tensor::{DType, Tensor, TensorSpec};

/// Whether the backward's recompute pass (`block_recompute`) makes `lin`'s input copy again,
/// so that one copy serves every layer and micro-batch. The down projection's input, SwiGLU's
/// output, is made again only in a pass of several micro-batches (`layer_major`): one kept
/// per layer would be overwritten by the next micro-batch's forward before the backward read
/// it.
fn rerun_by(lin: Linear, recompute: Recompute, micro_batches: usize) -> bool {
    match lin {
        Linear::Qkv => recompute.qkv(),
        Linear::Out => recompute.residual_mid(),
        Linear::GateUp => recompute.gate_up(),
        Linear::Down => recompute.gate_up() && micro_batches > 1,
    }
}

/// Whether a pass of several micro-batches can run in FP8 under `recompute`: only if the
/// recompute pass makes every linear's input copy again (`rerun_by`), since a pass keeps one
/// copy per layer, not per micro-batch.
pub(crate) fn remakes_every_input(recompute: Recompute) -> bool {
    Linear::ALL
        .into_iter()
        .all(|lin| rerun_by(lin, recompute, 2))
}

/// Whether the FP8 copies of the weights match the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WeightCopies {
    /// The weights were written by something other than the optimizer: their abs-maxes are
    /// unknown too.
    Stale,
    /// The optimizer has written the weights and reported their abs-maxes.
    Updated,
    /// The copies are current: later micro-steps reuse them.
    Current,
}

/// One weight's FP8 copies, sharing one scale: `[out, in]` as stored, for the forward, and
/// `[in, out]`, for the input gradient (FP8 matmuls take K-contiguous operands only).
struct WeightCopy<B: Backend> {
    rows: Tensor<B>,
    cols: Tensor<B>,
    descale: Tensor<B>,
}

// By hand, as for `InputStash`: a derive would ask for `B: Clone`.
impl<B: Backend> Clone for WeightCopy<B> {
    fn clone(&self) -> Self {
        WeightCopy {
            rows: self.rows.clone(),
            cols: self.cols.clone(),
            descale: self.descale.clone(),
        }
    }
}

/// One linear's input as its weight gradient needs it, `[in, tokens]` in FP8, written by the
/// forward's quantization in the same pass as the forward's own `[tokens, in]` copy, and its
/// descale: the backward reads it instead of quantizing the input again. One per layer, or
/// one for all layers when the recompute pass reruns the linear's forward.
struct InputStash<B: Backend> {
    cols: Tensor<B>,
    descale: Tensor<B>,
}

impl<B: Backend> Clone for InputStash<B> {
    fn clone(&self) -> Self {
        InputStash {
            cols: self.cols.clone(),
            descale: self.descale.clone(),
        }
    }
}

/// What one linear layer keeps in FP8.
struct LinearCopies<B: Backend> {
    weight: WeightCopy<B>,
    input: InputStash<B>,
}

/// Everything FP8 adds to a transformer: the weights' FP8 copies, the abs-max statistics,
/// and scratch for quantized activations and gradients.
pub(crate) struct Fp8State<B: Backend> {
    /// Per block, its four linears' FP8 copies, in `Linear::ALL` order.
    linears: Vec<[LinearCopies<B>; 4]>,
    state: Cell<WeightCopies>,
    /// Per block, whether its weights pass through a shared slot (streamed, or under ZeRO-3
    /// kept by another rank), its copies then being the slot's (`weights_arrived`).
    in_slot: Vec<bool>,
    /// Whether the recompute pass makes the down projection's input copy again
    /// (`rerun_by`).
    remakes_down_input: bool,
    /// The micro-batch of the pass whose ops are being enqueued (`set_micro_batch`).
    micro_batch: Cell<usize>,
    /// `[P, 1]` f32: each parameter's abs-max, reported by the optimizer, in `Params` order.
    weight_amax: Tensor<B>,
    /// Per block, the rows of its four linear weights in `weight_amax`.
    weight_slot: Vec<[usize; 4]>,
    /// `[M·L·4, 1]` f32: each linear's input abs-max for each micro-batch of a pass, reported
    /// by the op that produces it.
    input_amax: Tensor<B>,
    /// `[M·L·4, 1]` f32: each linear's output-gradient abs-max for each micro-batch, reported
    /// by the op producing it or from a pass over it.
    grad_amax: Tensor<B>,
    /// Flat scratch for the forward's quantized input and one quantized gradient in both
    /// layouts.
    input_q: Tensor<B>,
    grad_q: Tensor<B>,
    grad_qt: Tensor<B>,
    /// `[1]` f32: the descale of `grad_q`. Each descale is its own allocation, as cuBLASLt
    /// wants its scale pointers aligned.
    grad_descale: Tensor<B>,
}

/// The FP8 buffers' specs, and which abs-max slot each layer's weights report into.
pub(crate) struct Fp8Plan {
    pub specs: Vec<TensorSpec>,
    weight_slot: Vec<[usize; 4]>,
    /// Which linears' input copies are shared by every layer.
    shared_input: [bool; 4],
    /// Each block's slot of weight copies where its weights pass through a shared slot,
    /// `None` where it has copies of its own (`QuantizedShape::weight_slots`).
    copy_slots: Vec<Option<usize>>,
}

impl Fp8Plan {
    /// The specs of every buffer for `precision`; `None` when the matmuls are not FP8.
    pub fn new(
        precision: MatmulPrecision, shape: &QuantizedShape, layout: &Params<ParamSpec>,
    ) -> Option<Self> {
        let MatmulPrecision::Fp8 { forward, gradient } = precision else {
            return None;
        };
        let mut next = 0;
        let index = layout
            .try_map(|_| {
                next += 1;
                Ok(next - 1)
            })
            .expect("counting cannot fail");
        let weight_slot: Vec<[usize; 4]> = index
            .layers
            .iter()
            .map(|l| Linear::ALL.map(|lin| *lin.weight(l)))
            .collect();
        let stat = |name: &str, rows: usize| TensorSpec::new(name, &[rows, 1], DType::F32);
        let stats = 4 * shape.layers * shape.micro_batches;
        let mut specs = vec![
            stat("fp8.weight_amax", next),
            stat("fp8.input_amax", stats),
            stat("fp8.grad_amax", stats),
            TensorSpec::new("fp8.input_q", &[shape.tokens * shape.max_in], forward),
            TensorSpec::new("fp8.grad_q", &[shape.tokens * shape.max_out], gradient),
            TensorSpec::new("fp8.grad_qt", &[shape.tokens * shape.max_out], gradient),
            stat("fp8.grad_descale", 1),
        ];
        let shared_input =
            Linear::ALL.map(|lin| rerun_by(lin, shape.recompute, shape.micro_batches));
        let input_stash = |specs: &mut Vec<TensorSpec>, name: &str, inp: usize| {
            let input = format!("{name}.input");
            specs.push(TensorSpec::new(
                format!("{input}.t"),
                &[inp, shape.tokens],
                forward,
            ));
            specs.push(stat(&format!("{input}.descale"), 1));
        };
        // A shared copy is as wide as any layer's input to that linear: the first layer's.
        let Some(first) = layout.layers.first() else {
            return Some(Fp8Plan {
                specs,
                weight_slot,
                shared_input,
                copy_slots: vec![],
            });
        };
        for lin in Linear::ALL
            .into_iter()
            .filter(|&l| shared_input[l as usize])
        {
            let name = format!("fp8.layers.{}", lin.name());
            input_stash(&mut specs, &name, lin.weight(first).tensor.shape[1]);
        }
        let weight_copy = |specs: &mut Vec<TensorSpec>, name: &str, lin: Linear| {
            let [out, inp] = lin.weight(first).tensor.shape[..] else {
                unreachable!("a linear's weight is a matrix")
            };
            specs.push(TensorSpec::new(name, &[out, inp], forward));
            specs.push(TensorSpec::new(format!("{name}.t"), &[inp, out], forward));
            specs.push(stat(&format!("{name}.descale"), 1));
        };
        for holder in copy_holders(&shape.weight_slots) {
            for lin in Linear::ALL {
                weight_copy(&mut specs, &format!("fp8.{holder}.{}", lin.name()), lin);
            }
        }
        for l in 0..layout.layers.len() {
            for lin in Linear::ALL
                .into_iter()
                .filter(|&lin| !shared_input[lin as usize])
            {
                let name = format!("fp8.layers.{l}.{}", lin.name());
                input_stash(&mut specs, &name, lin.weight(first).tensor.shape[1]);
            }
        }
        Some(Fp8Plan {
            specs,
            weight_slot,
            shared_input,
            copy_slots: shape.weight_slots.clone(),
        })
    }

    /// The state, from tensors allocated for `specs` in their order.
    pub fn build<B: Backend>(&self, t: Vec<Tensor<B>>) -> Fp8State<B> {
        let mut t = t.into_iter();
        let mut take = || t.next().expect("one tensor per planned spec");
        let (weight_amax, input_amax, grad_amax) = (take(), take(), take());
        let (input_q, grad_q, grad_qt) = (take(), take(), take());
        let grad_descale = take();
        let layers = self.weight_slot.len();
        let shared: [Option<InputStash<B>>; 4] = self.shared_input.map(|shared| {
            (shared && layers > 0).then(|| InputStash {
                cols: take(),
                descale: take(),
            })
        });
        let weights = copies_per_block(&self.copy_slots, || {
            Linear::ALL.map(|_| WeightCopy {
                rows: take(),
                cols: take(),
                descale: take(),
            })
        });
        let linears = (weights.into_iter())
            .map(|weight| {
                Linear::ALL.map(|lin| LinearCopies {
                    weight: weight[lin as usize].clone(),
                    input: shared[lin as usize].clone().unwrap_or_else(|| InputStash {
                        cols: take(),
                        descale: take(),
                    }),
                })
            })
            .collect();
        Fp8State {
            linears,
            state: Cell::new(WeightCopies::Stale),
            in_slot: self.copy_slots.iter().map(Option::is_some).collect(),
            remakes_down_input: self.shared_input[Linear::Down as usize],
            micro_batch: Cell::new(0),
            weight_amax,
            weight_slot: self.weight_slot.clone(),
            input_amax,
            grad_amax,
            input_q,
            grad_q,
            grad_qt,
            grad_descale,
        }
    }
}

/// `[rows, cols]` at the start of a flat scratch buffer.
fn view<B: Backend>(scratch: &Tensor<B>, rows: usize, cols: usize) -> Tensor<B> {
    scratch.narrow_rows(0, rows * cols).reshape(&[rows, cols])
}

impl<B: Backend> Fp8State<B> {
    /// The weights were written other than by the optimizer (initialised, loaded).
    pub fn weights_changed(&self) {
        self.state.set(WeightCopies::Stale);
    }

    /// `WeightCopies` as a number (`LinearLayers::copies_state`).
    pub fn copies_state(&self) -> usize {
        self.state.get() as usize
    }

    /// What `begin_forward` leaves (`LinearLayers::copies_made`).
    pub fn copies_made(&self) {
        self.state.set(WeightCopies::Current);
    }

    /// Zeroes the weight abs-maxes for the optimizer to report into, and returns each
    /// parameter's slot in `Params` order.
    pub fn weight_amax_slots(&self, b: &B) -> Result<Vec<Tensor<B>>> {
        b.fill(&self.weight_amax, 0.0)?;
        self.state.set(WeightCopies::Updated);
        Ok((0..self.weight_amax.rows())
            .map(|i| self.weight_amax.narrow_rows(i, i + 1))
            .collect())
    }

    /// Which micro-batch of a pass the ops enqueued until the next call are for: each keeps
    /// its own abs-maxes, since a pass runs the others' forwards between one micro-batch's
    /// forward and its backward (`layer_major`).
    pub fn set_micro_batch(&self, m: usize) {
        self.micro_batch.set(m);
    }

    /// Row of micro-batch `m`'s layer `l` statistics of `lin` in the `[M·L·4, 1]` abs-max
    /// tensors.
    fn slot(&self, m: usize, l: usize, lin: Linear) -> usize {
        (m * self.linears.len() + l) * 4 + lin as usize
    }

    /// Row `i` of an abs-max tensor.
    fn stat(t: &Tensor<B>, i: usize) -> Tensor<B> {
        t.narrow_rows(i, i + 1)
    }

    /// Where layer `l`'s output gradient of `lin` has its abs-max.
    pub fn grad_amax(&self, l: usize, lin: Linear) -> Tensor<B> {
        Self::stat(&self.grad_amax, self.slot(self.micro_batch.get(), l, lin))
    }

    fn weight_amax(&self, l: usize, lin: Linear) -> Tensor<B> {
        Self::stat(&self.weight_amax, self.weight_slot[l][lin as usize])
    }

    /// Where the op producing layer `l`'s input to `lin` reports its abs-max.
    pub fn input_amax(&self, l: usize, lin: Linear) -> Tensor<B> {
        Self::stat(&self.input_amax, self.slot(self.micro_batch.get(), l, lin))
    }

    /// At the start of every forward: makes the copies of the weights that have their own
    /// current (once per optimizer step: later micro-steps reuse them; those in a slot are
    /// made as they arrive, `weights_arrived`), zeroes the input abs-maxes and starts at the
    /// first micro-batch.
    pub fn begin_forward(&self, b: &B, params: &Params<Tensor<B>>) -> Result<()> {
        b.fill(&self.input_amax, 0.0)?;
        self.micro_batch.set(0);
        let state = self.state.get();
        if state == WeightCopies::Current {
            return Ok(());
        }
        if state == WeightCopies::Stale {
            b.fill(&self.weight_amax, 0.0)?;
        }
        let own = params
            .layers
            .iter()
            .enumerate()
            .filter(|&(l, _)| !self.in_slot[l]);
        for (l, layer) in own {
            for lin in Linear::ALL {
                let (w, amax) = (lin.weight(layer), self.weight_amax(l, lin));
                if state == WeightCopies::Stale {
                    b.abs_max(&amax, w)?;
                }
                self.copy_weight(b, (l, lin), w, &amax)?;
            }
        }
        self.state.set(WeightCopies::Current);
        Ok(())
    }

    /// Where block `l`'s weights pass through a slot (streamed, or from another rank): its
    /// copies, made in the slot from its weights `w` once they are there, before each pass
    /// reads them. They are scaled by the weights' abs-max, measured here, which is the one
    /// the optimizer reports: the copies have the bits of those of weights with their own.
    pub fn weights_arrived(&self, b: &B, l: usize, w: &LayerParams<Tensor<B>>) -> Result<()> {
        if !self.in_slot[l] {
            return Ok(());
        }
        for lin in Linear::ALL {
            let (w, amax) = (lin.weight(w), self.weight_amax(l, lin));
            b.fill(&amax, 0.0)?;
            b.abs_max(&amax, w)?;
            self.copy_weight(b, (l, lin), w, &amax)?;
        }
        Ok(())
    }

    /// Layer `l`'s copies of `lin`'s weight `w`, in both layouts, scaled by `amax`.
    fn copy_weight(
        &self, b: &B, (l, lin): (usize, Linear), w: &Tensor<B>, amax: &Tensor<B>,
    ) -> Result<()> {
        let copy = &self.linears[l][lin as usize].weight;
        let (rows, cols) = (Some(&copy.rows), Some(&copy.cols));
        b.quantize(rows, cols, &copy.descale, w, amax, Fused::Nothing)
    }

    /// Whether the recompute pass makes the down projection's input copy again
    /// (`stash_input`).
    pub fn remakes_down_input(&self) -> bool {
        self.remakes_down_input
    }

    /// In the recompute pass, layer `l`'s copy of `lin`'s input `x` for the weight gradient,
    /// made again by the abs-max its forward reported: the bits of the forward's.
    pub fn stash_input(&self, b: &B, (l, lin): (usize, Linear), x: &Tensor<B>) -> Result<()> {
        let input = &self.linears[l][lin as usize].input;
        let xt = input.cols.reshape(&[x.cols(), x.matrix_rows()]);
        let amax = self.input_amax(l, lin);
        b.quantize(None, Some(&xt), &input.descale, x, &amax, Fused::Nothing)
    }

    /// At the start of every backward: zeroes the gradient abs-maxes.
    pub fn begin_backward(&self, b: &B) -> Result<()> {
        b.fill(&self.grad_amax, 0.0)
    }

    /// `out = x · wᵀ (+ bias)` with x and w in FP8; x is also stashed transposed for the
    /// backward.
    pub fn forward(
        &self, b: &B, (l, lin): (usize, Linear), out: &Tensor<B>, x: Input<'_, B>,
        bias: Option<&Tensor<B>>,
    ) -> Result<()> {
        self.with_operands(b, (l, lin), x, |x8, w8| {
            b.matmul(out, x8, w8, bias, Matmul::FORWARD)
        })
    }

    /// The gate/up projection of `x` (as `forward`) and SwiGLU of it into `swiglu`, reporting
    /// its abs-max where the down projection's input quantization reads it; the backend may do
    /// both in one kernel.
    pub fn gate_up_swiglu(
        &self, b: &B, l: usize, gate_up: &Tensor<B>, swiglu: &Tensor<B>, x: Input<'_, B>,
    ) -> Result<()> {
        let amax = self.input_amax(l, Linear::Down);
        self.with_operands(b, (l, Linear::GateUp), x, |x8, w8| {
            b.gate_up_swiglu(gate_up, swiglu, x8, w8, Some(&amax))
        })
    }

    /// Quantizes `x` (normalizing it first, if it is a norm's output), stashing it transposed
    /// for the backward, and runs `matmul` on it and the weight's FP8 copy.
    fn with_operands(
        &self, b: &B, (l, lin): (usize, Linear), x: Input<'_, B>,
        matmul: impl FnOnce(Operand<'_, B>, Operand<'_, B>) -> Result<()>,
    ) -> Result<()> {
        let LinearCopies { weight: w, input } = &self.linears[l][lin as usize];
        let (rows, cols) = x.dims();
        let xq = view(&self.input_q, rows, cols);
        let xt = input.cols.reshape(&[cols, rows]);
        let (xd, amax) = (&input.descale, &self.input_amax(l, lin));
        match x {
            Input::Tensor(x) => b.quantize(Some(&xq), Some(&xt), xd, x, amax, Fused::Nothing)?,
            Input::Norm(n) => {
                let norm = Fused::Norm {
                    rstd: &n.rstd,
                    weight: n.weight,
                };
                b.quantize(Some(&xq), Some(&xt), xd, &n.x, amax, norm)?
            }
        }
        matmul(
            Operand::scaled(&xq, xd),
            Operand::scaled(&w.rows, &w.descale),
        )
    }

    /// `dx = dy · w`, `dw (+)= dyᵀ · x` and `db (+)= Σ dy`, as `with_gradient` runs them.
    pub fn backward(
        &self, b: &B, (l, lin): (usize, Linear), dx: &Tensor<B>,
        grads: (&Tensor<B>, Option<&Tensor<B>>), dy: &Tensor<B>, accumulate: bool,
    ) -> Result<()> {
        self.with_gradient(b, (l, lin), grads, dy, accumulate, |dy8, w8| {
            b.matmul(dx, dy8, w8, None, Matmul::FORWARD)
        })
    }

    /// The down projection's backward and SwiGLU's: `dw (+)= dyᵀ · h`, and gate/up's gradient
    /// over `gate_up` from `dy · w`, its abs-max reported where the gate/up projection's
    /// backward quantizes it; the backend may do the second in one kernel, leaving `dh`
    /// (where it would put `dy · w`) untouched.
    pub fn down_swiglu_backward(
        &self, b: &B, l: usize, (gate_up, dh): (&Tensor<B>, &Tensor<B>), dw: &Tensor<B>,
        dy: &Tensor<B>, accumulate: bool,
    ) -> Result<()> {
        let amax = self.grad_amax(l, Linear::GateUp);
        self.with_gradient(
            b,
            (l, Linear::Down),
            (dw, None),
            dy,
            accumulate,
            |dy8, w8| b.swiglu_backward_through_down(gate_up, dh, dy8, w8, Some(&amax)),
        )
    }

    /// Quantizes dy into the gradient dtype in both layouts in one pass, by the abs-max its
    /// producer reported (and sums it over rows into the bias's gradient `db` in the same
    /// pass, if the linear has a bias), runs `input_gradient` on it and the weight's
    /// transposed copy, then `dw (+)= dyᵀ · x` from the forward's transposed stash of x. The
    /// input gradient sums fast, as the forward does: its K is a model width. The weight
    /// gradient's K is every token of the batch, so it is promoted.
    fn with_gradient(
        &self, b: &B, (l, lin): (usize, Linear), (dw, db): (&Tensor<B>, Option<&Tensor<B>>),
        dy: &Tensor<B>, accumulate: bool,
        input_gradient: impl FnOnce(Operand<'_, B>, Operand<'_, B>) -> Result<()>,
    ) -> Result<()> {
        let (n, outs) = (dy.matrix_rows(), dy.cols());
        let amax = self.grad_amax(l, lin);
        let dd = &self.grad_descale;
        let (dyq, dyt) = (view(&self.grad_q, n, outs), view(&self.grad_qt, outs, n));
        let fused = match db {
            Some(dbias) => Fused::ColumnSums { dbias, accumulate },
            None => Fused::Nothing,
        };
        b.quantize(Some(&dyq), Some(&dyt), dd, dy, &amax, fused)?;
        let LinearCopies { weight: w, input } = &self.linears[l][lin as usize];
        input_gradient(
            Operand::scaled(&dyq, dd),
            Operand::scaled(&w.cols, &w.descale),
        )?;
        let xt = input.cols.reshape(&[w.cols.matrix_rows(), n]);
        let spec = Matmul {
            accumulate,
            sum: Fp8Sum::Promoted,
            ..Matmul::FORWARD
        };
        b.matmul(
            dw,
            Operand::scaled(&dyt, dd),
            Operand::scaled(&xt, &input.descale),
            None,
            spec,
        )
    }

    /// Every abs-max, named `layers.L.LINEAR.{input,weight,grad}`: what `--debug-log-abs-max`
    /// logs. The weights' are those of the last quantization, the others the first
    /// micro-batch's of the last pass. Waits for the device.
    pub fn abs_max_report(&self, b: &B) -> Result<Vec<(String, f32)>> {
        let (input, weight, grad) = (
            b.download(&self.input_amax)?,
            b.download(&self.weight_amax)?,
            b.download(&self.grad_amax)?,
        );
        let mut out = vec![];
        for (l, slots) in self.weight_slot.iter().enumerate() {
            for lin in Linear::ALL {
                let name = format!("layers.{l}.{}", lin.name());
                let i = self.slot(0, l, lin);
                out.push((format!("{name}.input"), input[i]));
                out.push((format!("{name}.weight"), weight[slots[lin as usize]]));
                out.push((format!("{name}.grad"), grad[i]));
            }
        }
        Ok(out)
    }
}
