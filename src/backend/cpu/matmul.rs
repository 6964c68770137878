//! Matrix products through a real GEMM, plus the bias gradient.

use super::Scalar;
use crate::backend::Matmul;

/// Row-major strides of `op(x)` for an `[rows, cols]` matrix: `(rows_of_op, cols_of_op, rs, cs)`.
fn op_view(rows: usize, cols: usize, transpose: bool) -> (usize, usize, isize, isize) {
    if transpose {
        (cols, rows, 1, cols as isize)
    } else {
        (rows, cols, cols as isize, 1)
    }
}

/// `out[M, N] (+)= op(a) · op(b) (+ bias)`, with `a` stored `[a_rows, a_cols]` and `b`
/// stored `[b_rows, b_cols]`.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Scalar>(
    out: &mut [T],
    a: &[T],
    a_cols: usize,
    b: &[T],
    b_cols: usize,
    bias: Option<&[T]>,
    spec: Matmul,
) {
    let (m, k, rsa, csa) = op_view(a.len() / a_cols, a_cols, spec.trans_a);
    let (kb, n, rsb, csb) = op_view(b.len() / b_cols, b_cols, spec.trans_b);
    assert_eq!(k, kb, "matmul inner dimensions");
    assert_eq!(out.len(), m * n, "matmul output size");
    let beta = if spec.accumulate { T::one() } else { T::zero() };
    // SAFETY: the strides above address exactly `a`, `b` and `out`, whose lengths were
    // checked, and `out` is a distinct mutable borrow.
    unsafe {
        T::gemm(
            m,
            k,
            n,
            T::one(),
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            beta,
            out.as_mut_ptr(),
            n as isize,
            1,
        );
    }
    if let Some(bias) = bias {
        for row in out.chunks_mut(n) {
            for (o, &b) in row.iter_mut().zip(bias) {
                *o += b;
            }
        }
    }
}

/// `dbias[N] (+)= Σ_m dout[m, N]`.
pub fn bias_backward<T: Scalar>(dbias: &mut [T], dout: &[T], accumulate: bool) {
    if !accumulate {
        dbias.fill(T::zero());
    }
    for row in dout.chunks(dbias.len()) {
        for (d, &g) in dbias.iter_mut().zip(row) {
            *d += g;
        }
    }
}
