//! Token embedding lookup, and its gradient through a sort of (token, position) pairs.

use anyhow::{Result, ensure};

use super::kernels::{EMBEDDING_SORT_TILE, Kernel};
use super::{BLOCK, Cuda, blocks, ensure_dtype, ensure_same_dtype, float, ptr};
use crate::backend::EmbeddingOps;
use crate::tensor::{DType, Tensor};

impl EmbeddingOps for Cuda {
    fn embedding_forward(
        &self, out: &Tensor<Cuda>, tokens: &Tensor<Cuda>, wte: &Tensor<Cuda>,
    ) -> Result<()> {
        let _timing = self.time_op("embedding_forward")?;
        ensure_dtype(tokens, DType::I32, "embedding_forward")?;
        ensure_same_dtype("embedding_forward", &[out, wte])?;
        let (n, c, v) = (tokens.numel(), wte.cols(), wte.rows());
        ensure!(
            out.numel() == n * c,
            "embedding_forward: out {:?}",
            out.shape
        );
        // SAFETY: block i reads tokens[i] and a row of wte (checked in the kernel against V)
        // and writes row i of out, [n, c].
        unsafe {
            self.launch(
                Kernel::EmbeddingForward,
                &[float(out)],
                (n as u32, 1, 1),
                BLOCK,
                &[
                    ptr(out).into(),
                    ptr(tokens).into(),
                    ptr(wte).into(),
                    (c as i32).into(),
                    (v as i32).into(),
                ],
            )
        }
    }

    /// Sorts (token, position) keys, then one block per run of equal tokens adds that
    /// token's rows of `dout` in position order: the CPU's order, without float atomics.
    fn embedding_backward(
        &self, dwte: &Tensor<Cuda>, tokens: &Tensor<Cuda>, dout: &Tensor<Cuda>, accumulate: bool,
    ) -> Result<()> {
        let _timing = self.time_op("embedding_backward")?;
        ensure_dtype(tokens, DType::I32, "embedding_backward")?;
        ensure_same_dtype("embedding_backward", &[dwte, dout])?;
        let (n, c, v) = (tokens.numel(), dwte.cols(), dwte.rows());
        ensure!(
            dout.numel() == n * c,
            "embedding_backward: dout {:?}",
            dout.shape
        );
        if !accumulate {
            self.fill_untimed(dwte, 0.0)?;
        }
        if n == 0 {
            return Ok(());
        }
        let padded = n.next_power_of_two().max(EMBEDDING_SORT_TILE);
        let keys = self.memory.scratch(padded * 8)?;
        // SAFETY: `keys` holds `padded` u64; the sort kernels touch exactly those, the key
        // kernel reads n tokens, and the backward reads the first n keys, rows of dout [n, c]
        // and writes rows of dwte [v, c] (tokens checked against v).
        unsafe {
            self.launch(
                Kernel::EmbeddingSortKeys,
                &[],
                (blocks(padded, BLOCK as usize), 1, 1),
                BLOCK,
                &[
                    keys.into(),
                    ptr(tokens).into(),
                    (n as i32).into(),
                    (padded as i32).into(),
                ],
            )?;
            let tiles = (padded / EMBEDDING_SORT_TILE) as u32;
            let local = |k: usize| {
                self.launch(
                    Kernel::BitonicLocal,
                    &[],
                    (tiles, 1, 1),
                    (EMBEDDING_SORT_TILE / 2) as u32,
                    &[keys.into(), (k as i32).into()],
                )
            };
            local(0)?;
            let mut k = 2 * EMBEDDING_SORT_TILE;
            while k <= padded {
                let mut j = k / 2;
                while j >= EMBEDDING_SORT_TILE {
                    self.launch(
                        Kernel::BitonicGlobal,
                        &[],
                        (blocks(padded, BLOCK as usize), 1, 1),
                        BLOCK,
                        &[keys.into(), (k as i32).into(), (j as i32).into()],
                    )?;
                    j /= 2;
                }
                local(k)?;
                k *= 2;
            }
            self.launch(
                Kernel::EmbeddingBackward,
                &[float(dwte)],
                (n as u32, 1, 1),
                BLOCK,
                &[
                    ptr(dwte).into(),
                    keys.into(),
                    ptr(dout).into(),
                    (n as i32).into(),
                    (c as i32).into(),
                    (v as i32).into(),
                ],
            )
        }
    }
}
