//! The precision flags, shared by `smelt train` and `smelt plan` so that a plan is made for
//! exactly the run the same flags would start.

use anyhow::{Result, bail};
use clap::Args;

use super::dtype;
use crate::model::MatmulPrecision;
use crate::tensor::DType;

#[derive(Args, Debug)]
pub struct PrecisionFlags {
    /// Dtype of weights and activations: f32 or bf16 [default: bf16; the demo on the CPU: f32].
    #[arg(long, value_parser = dtype, help_heading = "Precision")]
    model_dtype: Option<DType>,
    /// Dtype the blocks' linear layers multiply in: bf16, or e4m3 (FP8 with per-tensor
    /// scaling; needs --model-dtype bf16). The embeddings and the LM head stay bf16.
    #[arg(long, default_value = "bf16", help_heading = "Precision")]
    matmul_dtype: String,
    /// Dtype of the output gradients those matmuls take in the backward, with
    /// --matmul-dtype e4m3: e4m3 or e5m2 [default: e5m2].
    #[arg(long, help_heading = "Precision")]
    gradient_dtype: Option<String>,
    /// Dtype of the optimizer's master weights; a master copy is kept when it is wider than
    /// --model-dtype [default: f32].
    #[arg(long, value_parser = dtype, help_heading = "Precision")]
    master_dtype: Option<DType>,
    /// Dtype of Adam's first moment: f32, or bf16 (updated with stochastic rounding).
    #[arg(long, value_parser = dtype, default_value = "f32", help_heading = "Precision")]
    opt_m_dtype: DType,
    /// Dtype of Adam's second moment: f32, or bf16 (updated with stochastic rounding).
    #[arg(long, value_parser = dtype, default_value = "f32", help_heading = "Precision")]
    opt_v_dtype: DType,
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
        let model_dtype = self.model_dtype.unwrap_or(default_model_dtype);
        if !matches!(model_dtype, DType::F32 | DType::BF16) {
            bail!("--model-dtype {model_dtype}: choose f32 or bf16");
        }
        let matmul = MatmulPrecision::parse(&self.matmul_dtype, self.gradient_dtype.as_deref())?;
        if matmul != MatmulPrecision::Native && model_dtype != DType::BF16 {
            bail!(
                "--matmul-dtype {}: FP8 matmuls write bf16, so they need --model-dtype bf16 (not {model_dtype})",
                self.matmul_dtype
            );
        }
        for (flag, v) in [
            ("--opt-m-dtype", self.opt_m_dtype),
            ("--opt-v-dtype", self.opt_v_dtype),
        ] {
            if !matches!(v, DType::F32 | DType::BF16) {
                bail!("{flag} {v}: choose f32 or bf16");
            }
        }
        let master_dtype = match self.master_dtype.unwrap_or(DType::F32) {
            m if m == model_dtype => None,
            DType::F32 => Some(DType::F32),
            m => bail!(
                "--master-dtype {m}: the master weights must be f32, or the same as --model-dtype ({model_dtype})"
            ),
        };
        Ok(Precision {
            model_dtype,
            matmul,
            master_dtype,
            opt_m_dtype: self.opt_m_dtype,
            opt_v_dtype: self.opt_v_dtype,
        })
    }
}
