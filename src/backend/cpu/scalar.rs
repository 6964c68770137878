//! The float type the CPU backend computes in: f32 for training, f64 for gradient checks.

use std::fmt::Debug;
use std::iter::Sum;
use std::ops::AddAssign;

use num_traits::{Float, FromPrimitive, ToPrimitive};

use crate::tensor::DType;

pub trait Scalar:
    Float + FromPrimitive + ToPrimitive + AddAssign + Sum + Default + Debug + Send + Sync + 'static
{
    /// The dtype whose values this type holds exactly.
    const DTYPE: DType;

    /// `c = alpha · a · b + beta · c` over strided matrices (see `matrixmultiply::sgemm`).
    ///
    /// # Safety
    /// Each pointer must be valid for every element its dimensions and strides address, and
    /// `c` must not overlap `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        beta: Self,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );

    fn of(x: f64) -> Self {
        Self::from_f64(x).expect("f64 converts to every float")
    }

    fn f64(self) -> f64 {
        self.to_f64().expect("every float converts to f64")
    }
}

impl Scalar for f32 {
    const DTYPE: DType = DType::F32;

    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: f32,
        a: *const f32,
        rsa: isize,
        csa: isize,
        b: *const f32,
        rsb: isize,
        csb: isize,
        beta: f32,
        c: *mut f32,
        rsc: isize,
        csc: isize,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            matrixmultiply::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc)
        }
    }
}

impl Scalar for f64 {
    const DTYPE: DType = DType::F64;

    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: f64,
        a: *const f64,
        rsa: isize,
        csa: isize,
        b: *const f64,
        rsb: isize,
        csb: isize,
        beta: f64,
        c: *mut f64,
        rsc: isize,
        csc: isize,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            matrixmultiply::dgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc)
        }
    }
}
