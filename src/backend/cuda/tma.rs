//! TMA descriptors (Hopper's tensor memory accelerator): how a kernel's bulk copies see a
//! tensor in global memory. A kernel takes them by value (`__grid_constant__`), and one thread
//! then copies a whole box into shared memory with one instruction, where `cp.async` takes one
//! per 16 bytes from every thread.

use std::ffi::c_void;

use anyhow::{Context, Result, bail};
use cudarc::driver::DeviceRepr;
use cudarc::driver::sys::{
    self, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};

use crate::tensor::DType;

/// One CUtensorMap.
#[derive(Clone, Copy, Debug)]
pub struct TensorMap(sys::CUtensorMap);

impl TensorMap {
    /// The map of a tensor of `dtype` (bf16, or FP8 or INT8 as bytes) at `address` of `dims` elements
    /// (innermost first) with `strides` bytes between consecutive indices of each outer
    /// dimension, copied in boxes of `boxes` elements into shared memory swizzled across a box's
    /// rows: a box row is 128 bytes (the 128-byte swizzle) or 64 (the 64-byte one). Boxes
    /// reaching past the tensor's edges read zeros there, and stores drop what lies past them.
    pub fn swizzled<const RANK: usize>(
        address: u64, dtype: DType, dims: [u64; RANK], strides: &[u64], boxes: [u32; RANK],
    ) -> Result<Self> {
        assert_eq!(strides.len() + 1, RANK, "one stride per outer dimension");
        let element = match dtype {
            DType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            d if d.is_fp8() || d == DType::I8 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            d => bail!("a TMA map of {d}: bf16, FP8 or INT8 only"),
        };
        let swizzle = match boxes[0] as usize * dtype.size_bytes() {
            128 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            64 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
            other => bail!("a TMA box row of {other} bytes: 128 or 64 are swizzled"),
        };
        let steps = [1u32; RANK];
        let mut map = Self::unused();
        // SAFETY: dims, boxes and steps hold RANK values and strides RANK − 1, all outliving
        // the call, which only writes `map`; the driver checks the address's and strides'
        // alignment and the box sizes, and fails the call otherwise.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map.0,
                element,
                RANK as u32,
                address as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                steps.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()
        }
        .with_context(|| {
            format!("encoding a TMA map of a {dtype} tensor of {dims:?} in boxes of {boxes:?}")
        })?;
        Ok(map)
    }

    /// All zeros: the argument of a kernel that takes maps but never reads them (the
    /// mma.sync attention kernels, whose tiles come by cp.async).
    pub fn unused() -> Self {
        TensorMap(sys::CUtensorMap { opaque: [0; 16] })
    }
}

/// Two maps as one kernel parameter, a struct of two CUtensorMaps on the device's side.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TensorMaps2(pub [TensorMap; 2]);

// SAFETY: plain bytes, laid out as the kernels' struct of two 128-byte maps.
unsafe impl DeviceRepr for TensorMaps2 {}

/// Four maps as one kernel parameter (gemm_tn.cu: a, b, out and SwiGLU's output).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TensorMaps4(pub [TensorMap; 4]);

// SAFETY: plain bytes, laid out as the kernel's struct of four 128-byte maps.
unsafe impl DeviceRepr for TensorMaps4 {}
