//! A thin cuBLASLt wrapper over cudarc's `result`/`sys` layer (its safe API has no FP8):
//! row-major `out (+)= op(a) · op(b) (+ bias)` in bf16 or f32 with f32 accumulation
//! (CUBLAS_COMPUTE_32F: no TF32, so f32 results are tight enough for tests), and the FP8 form
//! `out (+)= (a · da) · (b · db)ᵀ (+ bias)` with e4m3/e5m2 operands, bf16 out and bias, and
//! per-tensor descales read from device pointers; and INT8 operands summed into int32 (IMMA).
//! Descriptors, layouts and the algorithm (`matmul_algos`) are chosen once per shape and kept.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::CudaStream;
use cudarc::driver::sys::CUevent_flags;

use super::arena::{Arena, Place};
use super::matmul_algos::{AlgoChooser, GemmKey};
use crate::tensor::DType;

/// The workspace cuBLASLt may use; 32 MiB is what NVIDIA recommends for Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Pointers of one call.
pub struct GemmPtrs {
    pub out: u64,
    pub a: u64,
    pub b: u64,
    pub bias: Option<u64>,
    /// FP8 only: the device addresses of a's and b's descales (one f32 each).
    pub descales: Option<(u64, u64)>,
}

impl GemmPtrs {
    /// `GemmKey::align` of a call through these pointers.
    pub fn alignments(&self) -> [u32; 3] {
        [self.a, self.b, self.out].map(alignment)
    }
}

/// How many of the heuristic's algorithms a plan considers (see `matmul_algos`).
const MAX_CANDIDATES: usize = 8;

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3], // cuBLAS A, B, and C = D
    /// The heuristic's algorithms, best guess first.
    candidates: Vec<sys::cublasLtMatmulAlgo_t>,
    /// Which candidate the calls use.
    chosen: usize,
    /// Whether alpha and beta are int32 (INT8's sums) rather than f32.
    int_scale: bool,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once by this plan and is destroyed once; a layout
        // still null was never created (`Blas::plan` failed before it).
        unsafe {
            let _ = result::destroy_matmul_desc(self.desc);
            for l in self.layouts.into_iter().filter(|l| !l.is_null()) {
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
    chooser: AlgoChooser,
}

fn err(call: &str) -> impl FnOnce(result::CublasError) -> anyhow::Error + '_ {
    move |e| anyhow!("cuBLASLt {call}: {e}")
}

/// Largest power of two up to 256 that divides `addr`.
fn alignment(addr: u64) -> u32 {
    (1u64 << addr.trailing_zeros().min(8)) as u32
}

fn data_type(dtype: DType) -> Result<sys::cudaDataType> {
    Ok(match dtype {
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
        DType::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
        DType::I8 => sys::cudaDataType::CUDA_R_8I,
        DType::I32 => sys::cudaDataType::CUDA_R_32I,
        other => bail!("cuda matmul: unsupported dtype {other}"),
    })
}

/// # Safety
/// `value` must be the attribute's C type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, value: &T,
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
    pref: sys::cublasLtMatmulPreference_t, attr: sys::cublasLtMatmulPreferenceAttributes_t,
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
        // SAFETY: a plain query with no arguments.
        let version = unsafe { sys::cublasLtGetVersion() };
        let chooser = AlgoChooser::new(&stream.context().name()?, version)?;
        Ok(Blas {
            handle,
            stream,
            workspace,
            plans: RefCell::new(HashMap::new()),
            chooser,
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
        let fp8 = key.dtypes[..2].iter().any(|d| d.is_fp8());
        // INT8 sums in int32 (IMMA), with int32 alpha and beta.
        let int_scale = key.dtypes[0] == DType::I8;
        let (compute, scale) = match int_scale {
            true => (
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32I,
                sys::cudaDataType::CUDA_R_32I,
            ),
            false => (
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            ),
        };
        // The plan owns each handle from its creation, so that an error below frees the
        // ones created before it.
        let mut plan = Plan {
            desc: result::create_matmul_desc(compute, scale).map_err(err("create matmul desc"))?,
            int_scale,
            layouts: [std::ptr::null_mut(); 3],
            candidates: Vec::new(),
            chosen: 0,
        };
        // Our b is stored [k, n] (or [n, k] when transposed); as column-major it is [n, k]
        // (or [k, n]).
        let (b_rows, b_cols) = if key.trans_b {
            (key.k, key.n)
        } else {
            (key.n, key.k)
        };
        // Our a is stored [m, k] (or [k, m]); column-major [k, m] (or [m, k]).
        let (a_rows, a_cols) = if key.trans_a {
            (key.m, key.k)
        } else {
            (key.k, key.m)
        };
        // cuBLAS's A is our b, its B our a, and its C = D our out.
        let shapes = [
            (b_type, b_rows, b_cols),
            (a_type, a_rows, a_cols),
            (out_type, key.n, key.m),
        ];
        for (layout, (ty, rows, cols)) in plan.layouts.iter_mut().zip(shapes) {
            *layout = result::create_matrix_layout(ty, rows as u64, cols as u64, rows as i64)
                .map_err(err("create layout"))?;
        }
        let (desc, layouts) = (plan.desc, plan.layouts);
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
                    &(key.fast_accum as i8),
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
            // SAFETY: a plain C struct of integers and floats, for which zero bits are valid.
            let mut found: [sys::cublasLtMatmulHeuristicResult_t; MAX_CANDIDATES] =
                unsafe { std::mem::zeroed() };
            let mut count = 0i32;
            // SAFETY: all descriptors are live; `found` holds MAX_CANDIDATES results.
            unsafe {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    desc,
                    layouts[0],
                    layouts[1],
                    layouts[2],
                    layouts[2],
                    pref,
                    MAX_CANDIDATES as i32,
                    found.as_mut_ptr(),
                    &mut count,
                )
                .result()
            }
            .map_err(|e| anyhow!("cuBLASLt has no algorithm for {key:?}: {e}"))?;
            if count == 0 {
                bail!("cuBLASLt has no algorithm for {key:?}");
            }
            Ok(found[..count as usize]
                .iter()
                .map(|r| r.algo)
                .collect::<Vec<_>>())
        })();
        // SAFETY: created above, destroyed once.
        unsafe {
            let _ = result::destroy_matmul_pref(pref);
        }
        plan.candidates = picked?;
        Ok(plan)
    }

    /// Enqueues `out = op(a)·op(b) + beta·out (+ bias)` on the stream.
    pub fn gemm(&self, key: GemmKey, ptrs: &GemmPtrs, accumulate: bool) -> Result<()> {
        self.stream.context().bind_to_thread()?;
        if !self.plans.borrow().contains_key(&key) {
            let mut plan = self.plan(&key)?;
            self.set_pointers(&plan, ptrs)?;
            plan.chosen = self.chooser.choose(&key, &plan.candidates, || {
                self.time_candidates(&key, &plan, ptrs)
            });
            self.plans.borrow_mut().insert(key, plan);
        }
        let plans = self.plans.borrow();
        let plan = &plans[&key];
        self.set_pointers(plan, ptrs)?;
        self.launch(plan, plan.chosen, ptrs, ptrs.out, accumulate)
            .map_err(|e| anyhow!("cuBLASLt matmul {key:?}: {e}"))
    }

    /// Each candidate's time in milliseconds (infinite if it fails), on this call's inputs
    /// and a scratch output: the best of three rounds, each timing three calls of every
    /// candidate in turn, after one untimed call of each (so that clocks and caches are warm
    /// for the first as for the last). `None` when the scratch output does not fit. The
    /// scratch output is allocated here, outside `Memory`, and the timings wait for the
    /// device: the one exception, once per shape, to matmuls that only enqueue.
    fn time_candidates(&self, key: &GemmKey, plan: &Plan, ptrs: &GemmPtrs) -> Option<Vec<f32>> {
        const ROUNDS: usize = 3;
        const CALLS: usize = 3;
        let scratch = Arena::new(
            self.stream.context(),
            key.m * key.n * key.dtypes[2].size_bytes(),
            Place::Device,
        )
        .ok()?;
        let count = plan.candidates.len();
        let ok: Vec<bool> = (0..count)
            .map(|i| self.launch(plan, i, ptrs, scratch.ptr(), false).is_ok())
            .collect();
        let event = || {
            self.stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .ok()
        };
        let mut best = vec![f32::INFINITY; count];
        for _ in 0..ROUNDS {
            for i in (0..count).filter(|&i| ok[i]) {
                let start = event()?;
                for _ in 0..CALLS {
                    self.launch(plan, i, ptrs, scratch.ptr(), false).ok()?;
                }
                let end = event()?;
                end.synchronize().ok()?;
                best[i] = best[i].min(start.elapsed_ms(&end).ok()? / CALLS as f32);
            }
        }
        Some(best)
    }

    /// Points the plan's descriptor at this call's bias and descales.
    fn set_pointers(&self, plan: &Plan, ptrs: &GemmPtrs) -> Result<()> {
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
        Ok(())
    }

    /// Enqueues candidate `algo` of `plan` writing into `out`.
    fn launch(
        &self, plan: &Plan, algo: usize, ptrs: &GemmPtrs, out: u64, accumulate: bool,
    ) -> Result<(), result::CublasError> {
        let (alpha_f, beta_f) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let (alpha_i, beta_i) = (1i32, accumulate as i32);
        let (alpha, beta) = match plan.int_scale {
            true => (
                &alpha_i as *const i32 as *const c_void,
                &beta_i as *const i32 as *const c_void,
            ),
            false => (
                &alpha_f as *const f32 as *const c_void,
                &beta_f as *const f32 as *const c_void,
            ),
        };
        // SAFETY: the plan's descriptors match the key it was made for, which the caller
        // derived from the tensors behind `ptrs`; `out` has the output's size; the workspace
        // is WORKSPACE_BYTES of device memory.
        unsafe {
            result::matmul(
                self.handle,
                plan.desc,
                alpha,
                beta,
                ptrs.b as *const c_void,
                plan.layouts[0],
                ptrs.a as *const c_void,
                plan.layouts[1],
                out as *const c_void,
                plan.layouts[2],
                out as *mut c_void,
                plan.layouts[2],
                &plan.candidates[algo],
                self.workspace.ptr() as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as _,
            )
        }
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
