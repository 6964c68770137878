//! The precision flags, shared by `smelt train` and `smelt plan` (and the matmul pair by
//! `smelt bench`) so that a plan is made for exactly the run the same flags would start, and
//! the dtype values they take, which `--help` lists. Each value also takes the other
//! spellings `DType::parse` reads (`bfloat16`, `fp32`, `fp8-e4m3`), in any case.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};

use crate::model::{Int8Options, MatmulPrecision};
use crate::tensor::DType;

/// The dtype of weights, activations, master weights or Adam's moments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FloatDtype {
    #[value(alias = "fp32", alias = "float32")]
    F32,
    #[value(alias = "bfloat16")]
    Bf16,
}

/// The dtype of one of Adam's moments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MomentDtype {
    #[value(alias = "fp32", alias = "float32")]
    F32,
    #[value(alias = "bfloat16")]
    Bf16,
    /// 8 bits with a scale per block of 256, as bitsandbytes' AdamW8bit (both moments).
    Q8,
}

/// The dtype a block's linear layers multiply in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MatmulDtype {
    #[value(alias = "bfloat16")]
    Bf16,
    #[value(alias = "fp8-e4m3")]
    E4m3,
    #[value(alias = "i8")]
    Int8,
}

/// The dtype of the output gradients FP8 matmuls take in the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GradientDtype {
    #[value(alias = "fp8-e4m3")]
    E4m3,
    #[value(alias = "fp8-e5m2")]
    E5m2,
}

/// The dtype tensors are stored in, in a safetensors file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StorageDtype {
    #[value(alias = "fp32", alias = "float32")]
    F32,
    #[value(alias = "bfloat16")]
    Bf16,
    #[value(alias = "fp16", alias = "float16")]
    F16,
}

impl From<FloatDtype> for DType {
    fn from(d: FloatDtype) -> DType {
        match d {
            FloatDtype::F32 => DType::F32,
            FloatDtype::Bf16 => DType::BF16,
        }
    }
}

impl From<MomentDtype> for DType {
    fn from(d: MomentDtype) -> DType {
        match d {
            MomentDtype::F32 => DType::F32,
            MomentDtype::Bf16 => DType::BF16,
            MomentDtype::Q8 => DType::Q8,
        }
    }
}

impl From<MatmulDtype> for DType {
    fn from(d: MatmulDtype) -> DType {
        match d {
            MatmulDtype::Bf16 => DType::BF16,
            MatmulDtype::E4m3 => DType::E4M3,
            MatmulDtype::Int8 => DType::I8,
        }
    }
}

impl From<GradientDtype> for DType {
    fn from(d: GradientDtype) -> DType {
        match d {
            GradientDtype::E4m3 => DType::E4M3,
            GradientDtype::E5m2 => DType::E5M2,
        }
    }
}

impl From<StorageDtype> for DType {
    fn from(d: StorageDtype) -> DType {
        match d {
            StorageDtype::F32 => DType::F32,
            StorageDtype::Bf16 => DType::BF16,
            StorageDtype::F16 => DType::F16,
        }
    }
}

/// `--matmul-dtype`, `--gradient-dtype` and `--int8-weight-grad`.
#[derive(Args, Debug)]
pub struct MatmulFlags {
    /// Dtype the blocks' linear layers multiply in: bf16, e4m3 (FP8 with per-tensor
    /// scaling) or int8 (a scale per token and per channel; the weight gradients stay bf16
    /// unless --int8-weight-grad). Both need --model-dtype bf16. The embeddings and the LM
    /// head stay bf16.
    #[arg(long, value_enum, ignore_case = true, value_name = "DTYPE", default_value_t = MatmulDtype::Bf16, help_heading = "Precision")]
    matmul_dtype: MatmulDtype,
    /// Dtype of the output gradients those matmuls take in the backward, with
    /// --matmul-dtype e4m3 [default: e5m2].
    #[arg(
        long,
        value_enum,
        ignore_case = true,
        value_name = "DTYPE",
        help_heading = "Precision"
    )]
    gradient_dtype: Option<GradientDtype>,
    /// With --matmul-dtype int8: the weight gradients in INT8 too, activations and output
    /// gradients each scaled per channel over the tokens.
    #[arg(long, help_heading = "Precision")]
    int8_weight_grad: bool,
    /// With --matmul-dtype int8: the backward's operands rounded stochastically (unbiased)
    /// rather than to nearest. Costs no memory: the random bits are a hash of each element's
    /// index.
    #[arg(long, help_heading = "Precision")]
    int8_stochastic_rounding: bool,
}

impl MatmulFlags {
    /// The matmul precision; a --gradient-dtype without FP8 matmuls, or an --int8-* flag
    /// without INT8 ones, is refused.
    pub fn resolve(&self) -> Result<MatmulPrecision> {
        MatmulPrecision::new(
            self.matmul_dtype.into(),
            self.gradient_dtype.map(DType::from),
            Int8Options {
                weight_grad: self.int8_weight_grad,
                stochastic: self.int8_stochastic_rounding,
            },
        )
    }
}

#[derive(Args, Debug)]
pub struct PrecisionFlags {
    /// Dtype of weights and activations [default: bf16; the demo on the CPU: f32].
    #[arg(
        long,
        value_enum,
        ignore_case = true,
        value_name = "DTYPE",
        help_heading = "Precision"
    )]
    model_dtype: Option<FloatDtype>,
    #[command(flatten)]
    matmul: MatmulFlags,
    /// Dtype of the optimizer's master weights; a master copy is kept when it is wider than
    /// --model-dtype [default: f32].
    #[arg(
        long,
        value_enum,
        ignore_case = true,
        value_name = "DTYPE",
        help_heading = "Precision"
    )]
    master_dtype: Option<FloatDtype>,
    #[command(flatten)]
    moments: MomentFlags,
}

/// The dtypes of Adam's moments (train, plan and bench, each with its own default).
#[derive(Args, Debug)]
pub struct MomentFlags {
    /// Dtype of Adam's first moment [default: f32; smelt bench: bf16]. bf16 is updated with
    /// stochastic rounding; q8, with --opt-v-dtype q8, is bitsandbytes' blockwise 8-bit state.
    #[arg(
        long,
        value_enum,
        ignore_case = true,
        value_name = "DTYPE",
        help_heading = "Precision"
    )]
    opt_m_dtype: Option<MomentDtype>,
    /// Dtype of Adam's second moment [default: f32; smelt bench: bf16]; as --opt-m-dtype.
    #[arg(
        long,
        value_enum,
        ignore_case = true,
        value_name = "DTYPE",
        help_heading = "Precision"
    )]
    opt_v_dtype: Option<MomentDtype>,
}

impl MomentFlags {
    /// The first and second moments' dtypes, `default` where not given; q8 for one and not
    /// the other is refused.
    pub fn resolve(&self, default: DType) -> Result<[DType; 2]> {
        let [m, v] = [self.opt_m_dtype, self.opt_v_dtype].map(|d| d.map_or(default, DType::from));
        if (m == DType::Q8) != (v == DType::Q8) {
            bail!(
                "--opt-m-dtype {m} with --opt-v-dtype {v}: 8-bit moments quantize both, each \
                 block of both by its own scale; give q8 to both flags, or to neither"
            );
        }
        Ok([m, v])
    }
}

/// The dtypes of a run, checked against each other.
#[derive(Clone, Copy, Debug)]
pub struct Precision {
    pub model_dtype: DType,
    pub matmul: MatmulPrecision,
    /// `None` when the weights are updated in place (no wider master copy).
    pub master_dtype: Option<DType>,
    pub opt_m_dtype: DType,
    pub opt_v_dtype: DType,
}

impl PrecisionFlags {
    /// The dtypes, with `default_model_dtype` where --model-dtype is not given.
    pub fn resolve(&self, default_model_dtype: DType) -> Result<Precision> {
        let model_dtype = self.model_dtype.map_or(default_model_dtype, DType::from);
        let matmul = self.matmul.resolve()?;
        if matmul != MatmulPrecision::Native && model_dtype != DType::BF16 {
            bail!(
                "--matmul-dtype {}: FP8 and INT8 matmuls write bf16, so they need --model-dtype bf16 (not {model_dtype})",
                matmul.input_dtype(model_dtype)
            );
        }
        let master_dtype = match self.master_dtype.map_or(DType::F32, DType::from) {
            m if m == model_dtype => None,
            DType::F32 => Some(DType::F32),
            m => bail!(
                "--master-dtype {m}: the master weights must be f32, or the same as --model-dtype ({model_dtype})"
            ),
        };
        let [opt_m_dtype, opt_v_dtype] = self.moments.resolve(DType::F32)?;
        Ok(Precision {
            model_dtype,
            matmul,
            master_dtype,
            opt_m_dtype,
            opt_v_dtype,
        })
    }
}
