//! FP8 linear layers: current per-tensor scaling, as llm.q does it.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use crate::tensor::DType;

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
}

impl MatmulPrecision {
    /// From `--matmul-dtype` and `--gradient-dtype`.
    pub fn parse(matmul: &str, gradient: Option<&str>) -> Result<Self> {
        let dtype = |flag: &str, name: &str, allowed: &[DType]| match DType::parse(name) {
            Some(d) if allowed.contains(&d) => Ok(d),
            _ => bail!(
                "{flag} {name}: choose from {}",
                allowed
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        match dtype("--matmul-dtype", matmul, &[DType::BF16, DType::E4M3])? {
            DType::E4M3 => Ok(MatmulPrecision::Fp8 {
                forward: DType::E4M3,
                gradient: dtype(
                    "--gradient-dtype",
                    gradient.unwrap_or("e5m2"),
                    &[DType::E4M3, DType::E5M2],
                )?,
            }),
            _ => match gradient {
                Some(g) => bail!(
                    "--gradient-dtype {g} needs --matmul-dtype e4m3; bf16 matmuls take bf16 gradients"
                ),
                None => Ok(MatmulPrecision::Native),
            },
        }
    }
}
