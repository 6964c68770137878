//! The nouns of a block's linear layers: which ones there are (`Linear`), what they multiply
//! in (`MatmulPrecision`) and what they read (`Input`). `linear_layers.rs` runs them.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::params::LayerParams;
use super::recompute::Recompute;
use crate::backend::Backend;
use crate::tensor::{DType, Tensor};

/// The linear layers of a block, each with the activation it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Linear {
    /// QKV, reading the input norm's output.
    Qkv,
    /// The attention output projection, reading the attention output.
    Out,
    /// Gate/up, reading the post-attention norm's output.
    GateUp,
    /// Down, reading the SwiGLU output.
    Down,
}

impl Linear {
    pub const ALL: [Linear; 4] = [Linear::Qkv, Linear::Out, Linear::GateUp, Linear::Down];

    pub fn name(self) -> &'static str {
        match self {
            Linear::Qkv => "qkv",
            Linear::Out => "o",
            Linear::GateUp => "gate_up",
            Linear::Down => "down",
        }
    }

    pub fn weight<T>(self, layer: &LayerParams<T>) -> &T {
        match self {
            Linear::Qkv => &layer.qkv,
            Linear::Out => &layer.o,
            Linear::GateUp => &layer.gate_up,
            Linear::Down => &layer.down,
        }
    }

    /// The bias of this linear, if it has one.
    pub fn bias<T>(self, layer: &LayerParams<T>) -> Option<&T> {
        match self {
            Linear::Qkv => layer.qkv_bias.as_ref(),
            _ => None,
        }
    }
}

/// The dtypes the four linear layers of each block (QKV, output, gate/up, down) multiply
/// in. The embeddings and the LM head always use the model's dtype.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum MatmulPrecision {
    /// The model's dtype.
    #[default]
    Native,
    /// FP8: inputs and weights in `forward` (e4m3), output gradients in `gradient` (e4m3 or
    /// e5m2), each tensor scaled by its own current abs-max.
    Fp8 { forward: DType, gradient: DType },
    /// INT8 with a scale per row (`int8.rs`).
    Int8(Int8Options),
}

/// What INT8 matmuls quantize, and how.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Int8Options {
    /// The weight gradients in INT8 too (else bf16); the forward and the input gradients
    /// always are.
    pub weight_grad: bool,
    /// The backward's operands (output gradients, and with `weight_grad` the activations
    /// for it) rounded stochastically rather than to nearest.
    pub stochastic: bool,
}

impl MatmulPrecision {
    pub fn is_fp8(self) -> bool {
        matches!(self, MatmulPrecision::Fp8 { .. })
    }

    /// Whether a pass of several micro-batches (`--layer-major`) can multiply in this
    /// precision under `recompute`: FP8 keeps one copy of each layer's inputs, which the
    /// recompute pass must make again for each micro-batch, and INT8's stochastic rounding
    /// follows one micro-batch's seed at a time.
    pub fn runs_layer_major(self, recompute: Recompute) -> bool {
        match self {
            MatmulPrecision::Native => true,
            MatmulPrecision::Fp8 { .. } => super::fp8::remakes_every_input(recompute),
            MatmulPrecision::Int8(o) => !o.stochastic,
        }
    }

    /// The name the step line and `smelt bench` give it.
    pub fn name(self) -> String {
        match self {
            MatmulPrecision::Native => "bf16".into(),
            MatmulPrecision::Fp8 { forward, gradient } => format!("{forward}/{gradient}"),
            MatmulPrecision::Int8(o) => {
                let weights = if o.weight_grad { "int8" } else { "bf16" };
                let rounding = if o.stochastic {
                    ", stochastic rounding"
                } else {
                    ""
                };
                format!("int8 ({weights} weight gradients{rounding})")
            }
        }
    }

    /// From `--matmul-dtype` (bf16, e4m3 or int8), `--gradient-dtype` (e4m3 or e5m2, for
    /// e4m3 matmuls only) and `--int8-weight-grad` and `--int8-stochastic-rounding` (for
    /// int8 only).
    pub fn new(matmul: DType, gradient: Option<DType>, int8: Int8Options) -> Result<Self> {
        let check = |flag: &str, d: DType, allowed: &[DType]| match allowed.contains(&d) {
            true => Ok(d),
            false => bail!(
                "{flag} {d}: choose from {}",
                allowed
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let matmul = check(
            "--matmul-dtype",
            matmul,
            &[DType::BF16, DType::E4M3, DType::I8],
        )?;
        for (flag, on) in [
            ("--int8-weight-grad", int8.weight_grad),
            ("--int8-stochastic-rounding", int8.stochastic),
        ] {
            if on && matmul != DType::I8 {
                bail!("{flag} needs --matmul-dtype int8, not {matmul}");
            }
        }
        if let Some(g) = gradient.filter(|_| matmul != DType::E4M3) {
            bail!(
                "--gradient-dtype {g} needs --matmul-dtype e4m3; {matmul} matmuls take bf16 \
                 gradients"
            );
        }
        match matmul {
            DType::E4M3 => Ok(MatmulPrecision::Fp8 {
                forward: DType::E4M3,
                gradient: check(
                    "--gradient-dtype",
                    gradient.unwrap_or(DType::E5M2),
                    &[DType::E4M3, DType::E5M2],
                )?,
            }),
            DType::I8 => Ok(MatmulPrecision::Int8(int8)),
            _ => Ok(MatmulPrecision::Native),
        }
    }

    /// The dtype the blocks' linear layers read their inputs in, in a model of
    /// `model_dtype`.
    pub fn input_dtype(self, model_dtype: DType) -> DType {
        match self {
            MatmulPrecision::Native => model_dtype,
            MatmulPrecision::Fp8 { forward, .. } => forward,
            MatmulPrecision::Int8(_) => DType::I8,
        }
    }
}

/// The shapes the quantized linear layers' buffers (`Fp8Plan`, `Int8Plan`) are planned for.
pub(crate) struct QuantizedShape {
    pub tokens: usize,
    pub layers: usize,
    /// Largest input width (K) and output width (N) of the four linears.
    pub max_in: usize,
    pub max_out: usize,
    /// What the backward recomputes (FP8's `rerun_by`).
    pub recompute: Recompute,
    /// The micro-batches a pass holds (`ModelOptions::micro_batches`): FP8 keeps each one's
    /// abs-maxes apart.
    pub micro_batches: usize,
    /// Each block's slot where its weights pass through one of two shared device slots
    /// (streamed from host memory, or under ZeRO-3 kept by another rank; `shared_slots`),
    /// `None` where it has its own: FP8 and INT8 keep their copies of the weights alike.
    pub weight_slots: Vec<Option<usize>>,
}

/// How many shared slots the blocks of `QuantizedShape::weight_slots` pass through.
fn slot_count(slots: &[Option<usize>]) -> usize {
    slots.iter().flatten().max().map_or(0, |s| s + 1)
}

/// Who holds a quantized form's copies of the blocks' weights, given each block's slot
/// (`QuantizedShape::weight_slots`), in allocation order: each shared slot (`slot{s}`), then
/// each block with copies of its own (`layers.{l}`).
pub(crate) fn copy_holders(slots: &[Option<usize>]) -> Vec<String> {
    let shared = (0..slot_count(slots)).map(|s| format!("slot{s}"));
    let own = (slots.iter().enumerate())
        .filter(|(_, slot)| slot.is_none())
        .map(|(l, _)| format!("layers.{l}"));
    shared.chain(own).collect()
}

/// Each block's copies, `make` giving one holder's in `copy_holders`' order: a block in a
/// slot shares that slot's.
pub(crate) fn copies_per_block<T: Clone>(
    slots: &[Option<usize>], mut make: impl FnMut() -> T,
) -> Vec<T> {
    let shared: Vec<T> = (0..slot_count(slots)).map(|_| make()).collect();
    (slots.iter())
        .map(|slot| match slot {
            Some(s) => shared[*s].clone(),
            None => make(),
        })
        .collect()
}

/// What a linear layer reads: a tensor, or a norm's output. A norm stores its output in
/// `stored` for matmuls in the model's dtype only: in FP8 the projection's quantization
/// normalizes the norm's input `x` (with its `rstd` and `weight`) as it reads it, which saves
/// writing the output and reading it back.
pub(crate) enum Input<'a, B: Backend> {
    Tensor(&'a Tensor<B>),
    Norm(NormOutput<'a, B>),
}

/// A norm's output over some rows: where it is stored, and what it is made of.
pub(crate) struct NormOutput<'a, B: Backend> {
    pub stored: Tensor<B>,
    /// `[N, C]`: the norm's input rows.
    pub x: Tensor<B>,
    /// `[N]` f32.
    pub rstd: Tensor<B>,
    /// `[C]`.
    pub weight: &'a Tensor<B>,
}

impl<B: Backend> Input<'_, B> {
    /// The tensor matmuls in the model's dtype read.
    pub fn stored(&self) -> &Tensor<B> {
        match self {
            Input::Tensor(t) => t,
            Input::Norm(n) => &n.stored,
        }
    }

    /// The input's rows and columns.
    pub fn dims(&self) -> (usize, usize) {
        (self.stored().matrix_rows(), self.stored().cols())
    }
}
