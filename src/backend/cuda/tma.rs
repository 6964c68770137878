//! TMA descriptors (Hopper's tensor memory accelerator): how a kernel's bulk copies see a
//! tensor in global memory. A kernel takes them by value (`__grid_constant__`), and one thread
//! then copies a whole box into shared memory with one instruction, where `cp.async` takes one
//! per 16 bytes from every thread.

use std::ffi::c_void;

use anyhow::{Context, Result};
use cudarc::driver::DeviceRepr;
use cudarc::driver::sys::{
    self, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};

/// One CUtensorMap.
#[derive(Clone, Copy, Debug)]
pub struct TensorMap(sys::CUtensorMap);

impl TensorMap {
    /// The map of a bf16 tensor at `address` of `dims` elements (innermost first) with
    /// `strides` bytes between consecutive indices of each outer dimension, copied in boxes of
    /// `boxes` elements into shared memory swizzled across a box's rows: `boxes[0]` is 64 (one
    /// 128-byte line, the 128-byte swizzle) or 32 (the 64-byte one). Boxes reaching past the
    /// tensor's edges read zeros there, and stores drop what lies past them.
    pub fn bf16_swizzled<const RANK: usize>(
        address: u64,
        dims: [u64; RANK],
        strides: &[u64],
        boxes: [u32; RANK],
    ) -> Result<Self> {
        assert_eq!(strides.len() + 1, RANK, "one stride per outer dimension");
        let swizzle = match boxes[0] {
            64 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            32 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
            other => anyhow::bail!("a TMA box row of {other} bf16: 64 or 32 are swizzled"),
        };
        let steps = [1u32; RANK];
        let mut map = Self::unused();
        // SAFETY: dims, boxes and steps hold RANK values and strides RANK − 1, all outliving
        // the call, which only writes `map`; the driver checks the address's and strides'
        // alignment and the box sizes, and fails the call otherwise.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map.0,
                CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
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
            format!("encoding a TMA map of a bf16 tensor of {dims:?} in boxes of {boxes:?}")
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

/// Four maps as one kernel parameter (gemm.cu: a, b, out and SwiGLU's output).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TensorMaps4(pub [TensorMap; 4]);

// SAFETY: plain bytes, laid out as the kernel's struct of four 128-byte maps.
unsafe impl DeviceRepr for TensorMaps4 {}
