//! A thin cuBLASLt wrapper over cudarc's `result`/`sys` layer (its safe API has no FP8):
//! row-major `out (+)= op(a) · op(b) (+ bias)` in bf16 or f32 with f32 accumulation
//! (CUBLAS_COMPUTE_32F: no TF32, so f32 results are tight enough for tests), and the FP8 form
//! `out (+)= (a · da) · (b · db)ᵀ (+ bias)` with e4m3/e5m2 operands, bf16 out and bias, and
//! per-tensor descales read from device pointers.
//! Descriptors, layouts and the heuristic's algorithm are made once per shape and kept.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::CudaStream;

use super::memory::Arena;
use crate::tensor::DType;

/// The workspace cuBLASLt may use; 32 MiB is what NVIDIA recommends for Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// FP8 matmuls' fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM): faster, but the tensor
/// cores' partial sums are then never promoted to f32 along K, which loses precision over
/// long reductions (the weight gradients sum over every token). Off: precise accumulation.
pub const FP8_FAST_ACCUM: bool = false;

/// Everything that decides the descriptors and the algorithm of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmKey {
    /// Row-major `op(a)` is `[m, k]`, `op(b)` is `[k, n]`, out is `[m, n]`.
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    /// Storage types of a, b and out: all bf16 or all f32, or for FP8 e4m3/e5m2 operands
    /// (not both e5m2, and only as `a · bᵀ`) into bf16.
    pub dtypes: [DType; 3],
    pub bias: bool,
    /// The largest power of two (≤ 256) dividing each of the a, b and out addresses: the
    /// heuristic must only pick kernels that accept them.
    pub align: [u32; 3],
}

/// Pointers of one call.
pub struct GemmPtrs {
    pub out: u64,
    pub a: u64,
    pub b: u64,
    pub bias: Option<u64>,
    /// FP8 only: the device addresses of a's and b's descales (one f32 each).
    pub descales: Option<(u64, u64)>,
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3], // cuBLAS A, B, and C = D
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once by this plan and is destroyed once.
        unsafe {
            let _ = result::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = result::destroy_matrix_layout(l);
            }
        }
    }
}

pub struct Blas {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: Arc<Arena>,
    plans: RefCell<HashMap<GemmKey, Plan>>,
}

fn err(call: &str) -> impl FnOnce(result::CublasError) -> anyhow::Error + '_ {
    move |e| anyhow!("cuBLASLt {call}: {e}")
}

/// Largest power of two up to 256 that divides `addr`.
pub fn alignment(addr: u64) -> u32 {
    (1u64 << addr.trailing_zeros().min(8)) as u32
}

fn data_type(dtype: DType) -> Result<sys::cudaDataType> {
    Ok(match dtype {
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
        DType::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
        other => bail!("cuda matmul: unsupported dtype {other}"),
    })
}

fn is_fp8(dtype: DType) -> bool {
    matches!(dtype, DType::E4M3 | DType::E5M2)
}

/// # Safety
/// `value` must be the attribute's C type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    // SAFETY: forwarded contract; the pointer and size describe `value`.
    unsafe {
        result::set_matmul_desc_attribute(
            desc,
            attr,
            value as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    }
    .map_err(err("set matmul attribute"))
}

/// # Safety
/// `value` must be the preference's C type.
unsafe fn set_pref<T>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    value: &T,
) -> Result<()> {
    // SAFETY: forwarded contract; the pointer and size describe `value`.
    unsafe {
        result::set_matmul_pref_attribute(
            pref,
            attr,
            value as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    }
    .map_err(err("set preference"))
}

impl Blas {
    pub fn new(stream: Arc<CudaStream>, workspace: Arc<Arena>) -> Result<Self> {
        stream.context().bind_to_thread()?;
        let handle = result::create_handle().map_err(err("create"))?;
        Ok(Blas {
            handle,
            stream,
            workspace,
            plans: RefCell::new(HashMap::new()),
        })
    }

    /// Row-major to column-major, in one place: a row-major `[r, c]` matrix is the
    /// column-major `[c, r]` matrix with leading dimension `c`, i.e. its transpose. So we ask
    /// cuBLAS for `outᵀ = op(b)ᵀ · op(a)ᵀ`: cuBLAS's A is our `b`, its B is our `a`, each
    /// with the same transpose flag, and its `[n, m]` column-major D is our row-major out.
    ///
    /// For FP8 this is what cuBLASLt requires on Hopper: out = a · bᵀ becomes cuBLAS's TN
    /// form, A := b (op T, lda = k), B := a (op N, ldb = k), m = n, n = m.
    fn plan(&self, key: &GemmKey) -> Result<Plan> {
        let [a_type, b_type, out_type] = key.dtypes.map(data_type);
        let (a_type, b_type, out_type) = (a_type?, b_type?, out_type?);
        let fp8 = key.dtypes[..2].iter().any(|&d| is_fp8(d));
        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(err("create matmul desc"))?;
        // Our b is stored [k, n] (or [n, k] when transposed); as column-major it is [n, k]
        // (or [k, n]).
        let (a_rows, a_cols) = if key.trans_b {
            (key.k, key.n)
        } else {
            (key.n, key.k)
        };
        // Our a is stored [m, k] (or [k, m]); column-major [k, m] (or [m, k]).
        let (b_rows, b_cols) = if key.trans_a {
            (key.m, key.k)
        } else {
            (key.k, key.m)
        };
        let layout = |ty: sys::cudaDataType, rows: usize, cols: usize| {
            result::create_matrix_layout(ty, rows as u64, cols as u64, rows as i64)
                .map_err(err("create layout"))
        };
        let layouts = [
            layout(b_type, a_rows, a_cols)?,
            layout(a_type, b_rows, b_cols)?,
            layout(out_type, key.n, key.m)?,
        ];
        let mut plan = Plan {
            desc,
            layouts,
            algo: unsafe { std::mem::zeroed() },
        };
        let op = |t: bool| if t { 1i32 } else { 0i32 }; // CUBLAS_OP_T / CUBLAS_OP_N
        let epilogue = if key.bias {
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
        } else {
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        // SAFETY: TRANSA/TRANSB are int32 (cublasOperation_t), EPILOGUE is uint32.
        unsafe {
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(key.trans_b))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(key.trans_a))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))?;
        }
        if fp8 {
            // SAFETY: FAST_ACCUM is an int8, BIAS_DATA_TYPE an int32 (cudaDataType). The bias
            // is bf16 like out, which is also cuBLASLt's default; set so that it is explicit.
            unsafe {
                set_desc(
                    desc,
                    D::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                    &(FP8_FAST_ACCUM as i8),
                )?;
                set_desc(
                    desc,
                    D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &(out_type as i32),
                )?;
            }
        }
        let pref = result::create_matmul_pref().map_err(err("create preference"))?;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let picked = (|| {
            // SAFETY: the workspace limit is a uint64, the alignments are uint32.
            unsafe {
                set_pref(
                    pref,
                    P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &(WORKSPACE_BYTES as u64),
                )?;
                // cuBLAS's A is our b, its B our a.
                set_pref(
                    pref,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    &key.align[1],
                )?;
                set_pref(
                    pref,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    &key.align[0],
                )?;
                set_pref(
                    pref,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    &key.align[2],
                )?;
                set_pref(
                    pref,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                    &key.align[2],
                )?;
            }
            // SAFETY: all descriptors are live.
            unsafe {
                result::get_matmul_algo_heuristic(
                    self.handle,
                    desc,
                    layouts[0],
                    layouts[1],
                    layouts[2],
                    layouts[2],
                    pref,
                )
            }
            .map_err(|e| anyhow!("cuBLASLt has no algorithm for {key:?}: {e}"))
        })();
        // SAFETY: created above, destroyed once.
        unsafe {
            let _ = result::destroy_matmul_pref(pref);
        }
        plan.algo = picked?.algo;
        Ok(plan)
    }

    /// Enqueues `out = op(a)·op(b) + beta·out (+ bias)` on the stream.
    pub fn gemm(&self, key: GemmKey, ptrs: &GemmPtrs, accumulate: bool) -> Result<()> {
        self.stream.context().bind_to_thread()?;
        if !self.plans.borrow().contains_key(&key) {
            let plan = self.plan(&key)?;
            self.plans.borrow_mut().insert(key, plan);
        }
        let plans = self.plans.borrow();
        let plan = &plans[&key];
        use sys::cublasLtMatmulDescAttributes_t as D;
        if let Some(bias) = ptrs.bias {
            // SAFETY: BIAS_POINTER is a device pointer (void*).
            unsafe {
                set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
            }
        }
        if let Some((a_descale, b_descale)) = ptrs.descales {
            // SAFETY: the scale pointers are device pointers (const void*) to one f32 each.
            // cuBLAS's A is our b, so b's descale is its A scale.
            unsafe {
                set_desc(
                    plan.desc,
                    D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                    &b_descale,
                )?;
                set_desc(
                    plan.desc,
                    D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                    &a_descale,
                )?;
            }
        }
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: the plan's descriptors match `key`, which the caller derived from the
        // tensors behind `ptrs`; the workspace is WORKSPACE_BYTES of device memory.
        unsafe {
            result::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                ptrs.b as *const c_void,
                plan.layouts[0],
                ptrs.a as *const c_void,
                plan.layouts[1],
                ptrs.out as *const c_void,
                plan.layouts[2],
                ptrs.out as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                self.workspace.ptr() as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as _,
            )
        }
        .map_err(|e| anyhow!("cuBLASLt matmul {key:?}: {e}"))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.borrow_mut().clear();
        // SAFETY: the handle was created in `new` and is destroyed once.
        unsafe {
            let _ = result::destroy_handle(self.handle);
        }
    }
}
