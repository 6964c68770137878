//! FP8 on the GPU: abs-max and current-scaling quantization (plain, or transposed for the
//! backward's operands), and the host codec that uploads and downloads e4m3/e5m2 tensors (one
//! byte per element) so that tests can compare bits. Scaled matmuls are matmul.rs'.

use anyhow::{Result, bail, ensure};

use super::kernels::{Arg, Kernel, QUANTIZE_TILE, QUANTIZE_TILE_THREADS};
use super::{
    BLOCK, Cuda, amax_ptr, blocks, ensure_dtype, ensure_dtype_in, ensure_same_dtype, float, ptr,
    vec16, width,
};
use crate::backend::cpu::rounding::round_fp8;
use crate::backend::{Fused, Operand, QuantizeOps};
use crate::tensor::{DType, Tensor};

/// Blocks of the grid-stride abs-max: enough to fill any GPU, and one atomic each.
const ABS_MAX_BLOCKS: u32 = 1024;

/// The device address of a scaled operand's descale (`[1]` f32).
pub(super) fn descale_ptr(op: &'static str, operand: &Operand<'_, Cuda>) -> Result<u64> {
    let Some(descale) = operand.descale else {
        bail!("{op}: operand {:?} has no descale", operand.data.shape);
    };
    ensure_dtype(descale, DType::F32, op)?;
    ensure!(
        descale.numel() == 1,
        "{op}: a descale must be one f32, got {:?}",
        descale.shape
    );
    Ok(ptr(descale))
}

/// The name a quantization's time is filed under: by shape and layouts, as matmuls are, since
/// the transposed passes differ by shape; `extra` marks what else the pass does.
pub(super) fn quantize_name(
    rows: Option<&Tensor<Cuda>>, cols: Option<&Tensor<Cuda>>, x: &Tensor<Cuda>, extra: &str,
) -> String {
    let layouts = match (rows.is_some(), cols.is_some()) {
        (true, true) => "rows+cols",
        (false, true) => "cols",
        _ => "rows",
    };
    format!("quantize {}×{} {layouts}{extra}", x.matrix_rows(), x.cols())
}

/// (mantissa bits, exponent bias) of an FP8 format.
fn bit_layout(dtype: DType) -> (u32, i32) {
    match dtype {
        DType::E4M3 => (3, 7),
        DType::E5M2 => (2, 15),
        other => panic!("{other} is not an fp8 dtype"),
    }
}

/// The code of `x` rounded as the CPU rounds it (`round_fp8`: nearest even, saturating).
pub(super) fn encode(x: f32, dtype: DType) -> u8 {
    let (mantissa, bias) = bit_layout(dtype);
    let r = round_fp8(x, dtype);
    let sign = if r.is_sign_negative() { 0x80 } else { 0 };
    if r.is_nan() {
        return sign | 0x7F; // e4m3's only NaN, and a NaN of e5m2
    }
    let a = r.abs() as f64;
    let exp = (((a.to_bits() >> 52) & 0x7FF) as i32 - 1023).max(1 - bias);
    // The significand in units of the last place at that exponent: exact, since r is an fp8
    // value. Below the smallest normal the exponent field is 0 and the unit that of the
    // subnormals; above it the implicit leading one carries into the exponent field.
    let units = (a / 2f64.powi(exp - mantissa as i32)) as u32;
    let code = if units < 1 << mantissa {
        units
    } else {
        (((exp + bias) as u32) << mantissa) + units - (1 << mantissa)
    };
    sign | code as u8
}

/// The value of an FP8 code.
pub(super) fn decode(code: u8, dtype: DType) -> f32 {
    let (mantissa, bias) = bit_layout(dtype);
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((code & 0x7F) >> mantissa) as i32;
    let m = (code & ((1 << mantissa) - 1)) as f64;
    let max_exp = (1 << (7 - mantissa)) - 1;
    let value = match dtype {
        // e4m3 ("fn") has no infinities; S.1111.111 is its NaN.
        DType::E4M3 if code & 0x7F == 0x7F => f64::NAN,
        // e5m2 keeps IEEE's all-ones exponent for infinities and NaN.
        DType::E5M2 if e == max_exp => {
            if m == 0.0 {
                f64::INFINITY
            } else {
                f64::NAN
            }
        }
        _ if e == 0 => m * 2f64.powi(1 - bias - mantissa as i32),
        _ => (1.0 + m / (1 << mantissa) as f64) * 2f64.powi(e - bias),
    };
    (sign * value) as f32
}

impl QuantizeOps for Cuda {
    fn abs_max(&self, amax: &Tensor<Cuda>, x: &Tensor<Cuda>) -> Result<()> {
        let _timing = self.time_op("abs_max")?;
        let amax = amax_ptr("abs_max", Some(amax))?;
        let n = x.numel();
        let vec = ptr(x).is_multiple_of(16);
        let units = n / width(x, vec);
        // SAFETY: abs_max<T, VEC>(amax, x, n) reads n elements of x (16-byte units from a
        // 16-byte aligned start with VEC, the tail one by one) and updates amax[0].
        unsafe {
            self.launch(
                Kernel::AbsMax,
                &[float(x), Arg::Flag(vec)],
                (blocks(units, BLOCK as usize).min(ABS_MAX_BLOCKS), 1, 1),
                BLOCK,
                &[amax.into(), ptr(x).into(), (n as i64).into()],
            )
        }
    }

    /// What `fused` asks is done from the transposing pass's read of x, which a norm's output
    /// needs.
    fn quantize(
        &self, rows: Option<&Tensor<Cuda>>, cols: Option<&Tensor<Cuda>>, descale: &Tensor<Cuda>,
        x: &Tensor<Cuda>, amax: &Tensor<Cuda>, fused: Fused<'_, Cuda>,
    ) -> Result<()> {
        let extra = match fused {
            Fused::Nothing => "",
            Fused::Norm { .. } => "+norm",
            Fused::ColumnSums { .. } => "+sums",
        };
        let _timing = self.time_op_named(|| quantize_name(rows, cols, x, extra))?;
        self.quantize_pass(rows, cols, descale, x, amax, fused)
    }
}

impl Cuda {
    /// `quantize`, untimed.
    fn quantize_pass(
        &self, rows: Option<&Tensor<Cuda>>, cols: Option<&Tensor<Cuda>>, descale: &Tensor<Cuda>,
        x: &Tensor<Cuda>, amax: &Tensor<Cuda>, fused: Fused<'_, Cuda>,
    ) -> Result<()> {
        match (cols, fused) {
            (None, Fused::ColumnSums { dbias, accumulate }) => {
                self.quantize_pass(rows, None, descale, x, amax, Fused::Nothing)?;
                return self.column_sum(dbias, x, accumulate);
            }
            (None, Fused::Norm { .. }) => {
                bail!("quantize: a norm's output is quantized in both layouts")
            }
            _ => {}
        }
        let amax = amax_ptr("quantize (amax)", Some(amax))?;
        ensure_dtype(descale, DType::F32, "quantize (descale)")?;
        let (r, c) = (x.matrix_rows(), x.cols());
        let Some(first) = rows.or(cols) else {
            bail!("quantize: neither layout of x {:?} asked for", x.shape);
        };
        for (out, shape) in [(rows, [r, c]), (cols, [c, r])] {
            let Some(out) = out else { continue };
            ensure_dtype_in(out, &[DType::E4M3, DType::E5M2], "quantize (out)")?;
            ensure!(
                descale.numel() == 1
                    && out.numel() == x.numel()
                    && (out.shape.len() != 2 || out.shape == shape)
                    && out.dtype == first.dtype,
                "quantize: x {:?} into {:?} {} (rows {r}, cols {c}), descale {:?}",
                x.shape,
                out.shape,
                out.dtype,
                descale.shape
            );
        }
        // With the 16-byte path a thread stores the codes of one 16-byte load of x as one
        // word, so `rows` must be aligned to that many bytes.
        let codes = width(x, true) as u64;
        let (x_ptr, rows_ptr) = (ptr(x), rows.map_or(0, ptr));
        let Some(cols) = cols else {
            let n = x.numel();
            let vec = x_ptr.is_multiple_of(16) && rows_ptr.is_multiple_of(codes);
            let units = n / width(x, vec);
            let args = [
                rows_ptr.into(),
                ptr(descale).into(),
                x_ptr.into(),
                amax.into(),
            ];
            // SAFETY: quantize<T, F, VEC>(out, descale, x, amax, n): thread u converts
            // elements [u·W, u·W + W) of x into out (n elements each; 16-byte loads and
            // W-byte stores only when aligned so), and the tail; descale and amax are one
            // f32 each.
            return unsafe {
                self.launch(
                    Kernel::Quantize,
                    &[float(x), Arg::Fp8(first.dtype), Arg::Flag(vec)],
                    (blocks(units, BLOCK as usize), 1, 1),
                    BLOCK,
                    &[args.as_slice(), &[(n as i64).into()]].concat(),
                )
            };
        };
        ensure!(
            r.div_ceil(QUANTIZE_TILE) <= 65535,
            "quantize: x {:?} has too many rows to transpose in one launch",
            x.shape
        );
        let norm = match fused {
            Fused::Norm { rstd, weight } => {
                ensure_dtype(rstd, DType::F32, "quantize (rstd)")?;
                ensure_same_dtype("quantize (norm weight)", &[weight, x])?;
                ensure!(
                    rstd.numel() == r && weight.numel() == c,
                    "quantize: the norm of x {:?} with rstd {:?} and weight {:?}",
                    x.shape,
                    rstd.shape,
                    weight.shape
                );
                Some((rstd, weight))
            }
            _ => None,
        };
        let vec = vec16(
            &[x].into_iter().chain(norm.map(|n| n.1)).collect::<Vec<_>>(),
            c,
        ) && r.is_multiple_of(4)
            && ptr(cols).is_multiple_of(4)
            && rows_ptr.is_multiple_of(codes);
        let row_tiles = r.div_ceil(QUANTIZE_TILE);
        let sums = match fused {
            Fused::ColumnSums { dbias, .. } => {
                ensure_same_dtype("quantize (column sums)", &[dbias, x])?;
                ensure!(
                    dbias.numel() == c,
                    "quantize: column sums of x {:?} into {:?}",
                    x.shape,
                    dbias.shape
                );
                self.scratch_f32(row_tiles * c)?
            }
            _ => 0,
        };
        let args = [
            ptr(cols).into(),
            rows_ptr.into(),
            sums.into(),
            ptr(descale).into(),
            x_ptr.into(),
            amax.into(),
            norm.map_or(0, |n| ptr(n.0)).into(),
            norm.map_or(0, |n| ptr(n.1)).into(),
        ];
        // SAFETY: quantize_transposed<T, F, VEC, SUMS, NORM>(out, rows_out, col_sums,
        // descale, x, amax, rstd, norm_weight, R, C): the block of tile (i, j) reads rows
        // [Tj, Tj + T) × columns [Ti, Ti + T) of x [R, C] (T = QUANTIZE_TILE) and, with NORM, the same
        // rows of rstd [R] and columns of norm_weight [C], writes them to rows_out [R, C] when
        // it is not null, the transposed tile to out [C, R] and, with SUMS (col_sums not
        // null), the tile's column sums to row j of col_sums [ceil(R / T), C] (the scratch,
        // sized so), bounds-checked, with vector accesses only when the shapes and addresses
        // allow them (as checked above); under 13 KB of static shared memory.
        unsafe {
            self.launch(
                Kernel::QuantizeTransposed,
                &[
                    float(x),
                    Arg::Fp8(first.dtype),
                    Arg::Flag(vec),
                    Arg::Flag(sums != 0),
                    Arg::Flag(norm.is_some()),
                ],
                (blocks(c, QUANTIZE_TILE), row_tiles as u32, 1),
                QUANTIZE_TILE_THREADS,
                &[args.as_slice(), &[(r as i32).into(), (c as i32).into()]].concat(),
            )?;
        }
        match fused {
            Fused::ColumnSums { dbias, accumulate } => {
                self.colsum_finish(dbias, sums, row_tiles, accumulate)
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_decodes_and_encodes_back() {
        for dtype in [DType::E4M3, DType::E5M2] {
            let max = crate::backend::fp8_max(dtype).unwrap();
            let mut finite = 0;
            for code in 0..=255u8 {
                let v = decode(code, dtype);
                if !v.is_finite() {
                    continue;
                }
                finite += 1;
                assert!(v.abs() <= max, "{dtype} {code:#x} = {v}");
                // Every finite value is its own rounding, so it must come back to its code.
                assert_eq!(round_fp8(v, dtype), v, "{dtype} {code:#x} = {v}");
                assert_eq!(encode(v, dtype), code, "{dtype} {code:#x} = {v}");
            }
            // e4m3: all 256 codes but the two NaNs; e5m2: all but ±inf and six NaNs.
            let expected = if dtype == DType::E4M3 { 254 } else { 248 };
            assert_eq!(finite, expected, "{dtype}");
            assert_eq!(decode(encode(max, dtype), dtype), max);
            assert_eq!(decode(encode(-1e9, dtype), dtype), -max, "saturates");
            assert!(decode(encode(f32::NAN, dtype), dtype).is_nan());
        }
    }

    #[test]
    fn upload_rounding_is_the_cpus() {
        let mut rng = crate::rng::Rng::new(7);
        for dtype in [DType::E4M3, DType::E5M2] {
            for i in 0..100_000 {
                // Magnitudes from far below the subnormals to past saturation.
                let x = (rng.normal() * 2f64.powi(i % 40 - 24)) as f32;
                let expected = round_fp8(x, dtype);
                assert_eq!(
                    decode(encode(x, dtype), dtype).to_bits(),
                    expected.to_bits(),
                    "{dtype} {x:e}"
                );
            }
        }
    }
}
