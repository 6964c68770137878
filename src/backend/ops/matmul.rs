//! Matrix products, in the model's dtype or on FP8 operands with their scales, and the bias
//! gradient.

use anyhow::Result;

use super::memory::MemoryOps;
use crate::tensor::Tensor;

/// How an FP8 matmul sums along K; ignored by matmuls in other dtypes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Fp8Sum {
    /// In the tensor cores' own accumulator, without promotion to f32 along the way: faster,
    /// and what Transformer Engine does in the forward. smelt sums so wherever K is a model
    /// width: the forward and the input gradients.
    #[default]
    Fast,
    /// Promoted to f32 at intervals along K: for the weight gradients, which sum over every
    /// token of the batch.
    Promoted,
}

/// `out (+)= op(a) · op(b) (+ bias)`, where `op` transposes when asked. Every operand is
/// read as a row-major matrix whose columns are its last dimension.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Matmul {
    pub trans_a: bool,
    pub trans_b: bool,
    pub accumulate: bool,
    pub sum: Fp8Sum,
}

impl Matmul {
    /// `y = x · wᵀ`: the forward of a linear layer with `w` stored `[out, in]`.
    pub const FORWARD: Matmul = Matmul {
        trans_a: false,
        trans_b: true,
        accumulate: false,
        sum: Fp8Sum::Fast,
    };
    /// `dx = dy · w`: a linear layer's input gradient.
    pub const BACKWARD_INPUT: Matmul = Matmul {
        trans_a: false,
        trans_b: false,
        accumulate: false,
        sum: Fp8Sum::Fast,
    };
    /// `dw (+)= dyᵀ · x`: a linear layer's weight gradient.
    pub fn backward_weight(accumulate: bool) -> Matmul {
        Matmul {
            trans_a: true,
            trans_b: false,
            accumulate,
            sum: Fp8Sum::Promoted,
        }
    }
}

/// One operand of a matmul: a tensor in the model's dtype, or FP8 values quantized by
/// `quantize` with `descale` (`[1]` f32, on the device), the factor that turns them back into
/// real values. A matmul takes two plain operands or two scaled ones; scaled ones are e4m3 or
/// e5m2 (not both e5m2) in the one form FP8 matmuls take on Hopper, K contiguous in both
/// (`Matmul::FORWARD`'s layouts), into a bf16 output.
#[derive(Debug)]
pub struct Operand<'a, B: MemoryOps> {
    pub data: &'a Tensor<B>,
    pub descale: Option<&'a Tensor<B>>,
}

impl<'a, B: MemoryOps> Operand<'a, B> {
    pub fn scaled(data: &'a Tensor<B>, descale: &'a Tensor<B>) -> Self {
        Operand {
            data,
            descale: Some(descale),
        }
    }
}

impl<'a, B: MemoryOps> From<&'a Tensor<B>> for Operand<'a, B> {
    fn from(data: &'a Tensor<B>) -> Self {
        Operand {
            data,
            descale: None,
        }
    }
}

// By hand: a derive would ask for `B: Copy`, but only references are copied.
impl<B: MemoryOps> Clone for Operand<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: MemoryOps> Copy for Operand<'_, B> {}

pub trait MatmulOps: MemoryOps {
    /// `out[M, N] (+)= op(a)[M, K] · op(b)[K, N] (+ bias[N])`, the operands' descales applied
    /// where they are scaled.
    fn matmul<'a>(
        &self, out: &Tensor<Self>, a: impl Into<Operand<'a, Self>>,
        b: impl Into<Operand<'a, Self>>, bias: Option<&Tensor<Self>>, spec: Matmul,
    ) -> Result<()>
    where
        Self: 'a;
    /// `dbias[N] (+)= Σ_m dout[m, N]`.
    fn bias_backward(
        &self, dbias: &Tensor<Self>, dout: &Tensor<Self>, accumulate: bool,
    ) -> Result<()>;
}
