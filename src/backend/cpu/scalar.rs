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
        m: usize, k: usize, n: usize, alpha: Self, a: *const Self, rsa: isize, csa: isize,
        b: *const Self, rsb: isize, csb: isize, beta: Self, c: *mut Self, rsc: isize, csc: isize,
    );

    fn of(x: f64) -> Self {
        Self::from_f64(x).expect("f64 converts to every float")
    }

    fn f64(self) -> f64 {
        self.to_f64().expect("every float converts to f64")
    }
}

/// `Scalar` for a float type whose strided GEMM is `$gemm` in matrixmultiply.
macro_rules! scalar_with_gemm {
    ($t:ty, $dtype:expr, $gemm:path) => {
        impl Scalar for $t {
            const DTYPE: DType = $dtype;

            unsafe fn gemm(
                m: usize, k: usize, n: usize, alpha: $t, a: *const $t, rsa: isize, csa: isize,
                b: *const $t, rsb: isize, csb: isize, beta: $t, c: *mut $t, rsc: isize, csc: isize,
            ) {
                // SAFETY: forwarded contract.
                unsafe { $gemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
            }
        }
    };
}

/// The sum of `xs`, accumulated in f64 and rounded once to `T`. The reference sums every long
/// axis so (a vocabulary, a tensor's elements, the tokens of a batch): a sequential f32 sum
/// loses the small terms once the total has grown, and would leave the CPU further from the
/// exact result than the GPU it checks.
pub fn sum_f64<T: Scalar>(xs: impl Iterator<Item = T>) -> T {
    T::of(xs.map(T::f64).sum())
}

/// Adds each column's sum over `rows` (each yielding `out.len()` values) into `out`, each sum
/// accumulated in f64 and rounded once: `sum_f64` for the columns of a matrix.
pub fn add_column_sums<T: Scalar, R: IntoIterator<Item = T>>(
    out: &mut [T], rows: impl Iterator<Item = R>,
) {
    let mut sums = vec![0f64; out.len()];
    for row in rows {
        for (s, x) in sums.iter_mut().zip(row) {
            *s += x.f64();
        }
    }
    for (o, s) in out.iter_mut().zip(sums) {
        *o = T::of(o.f64() + s);
    }
}

scalar_with_gemm!(f32, DType::F32, matrixmultiply::sgemm);
scalar_with_gemm!(f64, DType::F64, matrixmultiply::dgemm);
