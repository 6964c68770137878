//! Tensor handles: a shape and a dtype over storage that a backend owns.
//!
//! A tensor never owns its memory. Memory is planned up front (see `memory.rs`): each
//! category is allocated once and handed out as named tensors. A `Tensor` is a cheap
//! clone of a handle, and `rows` narrows it to a range of its leading dimension, which
//! is how the chunked LM head walks over the tokens without copying.

use std::fmt;

use crate::backend::MemoryOps;

/// Element types. The CPU backend stores every float in its own precision and rounds
/// each written value to the tensor's dtype, so it predicts the GPU's numerics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F64,
    F32,
    BF16,
    F16,
    E4M3,
    E5M2,
    /// Signed 8-bit integers: INT8 matmuls' codes.
    I8,
    I32,
    /// Unsigned 8-bit indices into a 256-entry dynamic map, each block of elements scaled by
    /// an f32 abs-max kept beside it: the 8-bit Adam moments (`backend::ops::adam8bit`).
    Q8,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::E4M3 | DType::E5M2 | DType::I8 | DType::Q8 => 1,
        }
    }

    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32 | DType::I8 | DType::Q8)
    }

    /// Whether this is one of the one-byte FP8 formats (e4m3, e5m2).
    pub fn is_fp8(self) -> bool {
        matches!(self, DType::E4M3 | DType::E5M2)
    }

    pub fn parse(name: &str) -> Option<DType> {
        Some(match name.to_ascii_lowercase().as_str() {
            "f64" | "fp64" | "float64" => DType::F64,
            "f32" | "fp32" | "float32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "fp16" | "float16" => DType::F16,
            "e4m3" | "fp8-e4m3" => DType::E4M3,
            "e5m2" | "fp8-e5m2" => DType::E5M2,
            "i8" | "int8" => DType::I8,
            "i32" | "int32" => DType::I32,
            "q8" => DType::Q8,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::E4M3 => "e4m3",
            DType::E5M2 => "e5m2",
            DType::I8 => "int8",
            DType::I32 => "i32",
            DType::Q8 => "q8",
        };
        f.write_str(name)
    }
}

/// What a planned tensor will be: its name (for the memory table and error messages),
/// its shape and its dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, shape: &[usize], dtype: DType) -> Self {
        TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
        }
    }

    /// Elements, or `None` where the shape's product overflows `usize` (an absurd shape,
    /// which an allocation refuses rather than wrapping round to a small size).
    pub fn checked_numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    pub fn checked_bytes(&self) -> Option<usize> {
        self.checked_numel()?.checked_mul(self.dtype.size_bytes())
    }

    /// Elements; panics where the shape's product overflows (a backend's `allocate` refuses
    /// such a spec first, through `checked_numel`).
    pub fn numel(&self) -> usize {
        self.checked_numel().unwrap_or_else(|| self.overflow())
    }

    pub fn bytes(&self) -> usize {
        self.checked_bytes().unwrap_or_else(|| self.overflow())
    }

    fn overflow(&self) -> ! {
        panic!(
            "tensor `{}` of shape {:?}: its size overflows 64 bits",
            self.name, self.shape
        )
    }
}

/// A view of backend storage: `numel()` elements starting at element `offset`.
pub struct Tensor<B: MemoryOps> {
    pub(crate) storage: B::Storage,
    pub(crate) offset: usize,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl<B: MemoryOps> Clone for Tensor<B> {
    fn clone(&self) -> Self {
        Tensor {
            storage: self.storage.clone(),
            offset: self.offset,
            shape: self.shape.clone(),
            dtype: self.dtype,
        }
    }
}

impl<B: MemoryOps> fmt::Debug for Tensor<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({:?}, {})", self.shape, self.dtype)
    }
}

impl<B: MemoryOps> Tensor<B> {
    pub fn new(storage: B::Storage, shape: Vec<usize>, dtype: DType) -> Self {
        Tensor {
            storage,
            offset: 0,
            shape,
            dtype,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }

    /// The size of the leading dimension.
    pub fn rows(&self) -> usize {
        self.shape[0]
    }

    /// Elements per leading-dimension row.
    pub fn row_len(&self) -> usize {
        self.shape[1..].iter().product()
    }

    /// Size of the last dimension.
    pub fn cols(&self) -> usize {
        *self.shape.last().expect("tensor has no dimensions")
    }

    /// Rows of the `[N, cols]` matrix the ops read the tensor as (every dimension but the
    /// last one, flattened).
    pub fn matrix_rows(&self) -> usize {
        self.numel() / self.cols()
    }

    /// Rows `start..end` of the leading dimension, sharing storage.
    pub fn narrow_rows(&self, start: usize, end: usize) -> Self {
        assert!(
            start <= end && end <= self.rows(),
            "rows {start}..{end} of {:?}",
            self.shape
        );
        let mut shape = self.shape.clone();
        shape[0] = end - start;
        Tensor {
            storage: self.storage.clone(),
            offset: self.offset + start * self.row_len(),
            shape,
            dtype: self.dtype,
        }
    }

    /// The same elements seen with another shape of equal size.
    pub fn reshape(&self, shape: &[usize]) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            self.numel(),
            "reshape {:?} to {shape:?}",
            self.shape
        );
        Tensor {
            storage: self.storage.clone(),
            offset: self.offset,
            shape: shape.to_vec(),
            dtype: self.dtype,
        }
    }

    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn storage(&self) -> &B::Storage {
        &self.storage
    }
}
