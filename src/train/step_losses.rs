//! Every micro-step's per-token losses, gathered on the device so that a step reads them back
//! once, after its update is enqueued, rather than waiting for the device after each
//! micro-step.

use anyhow::Result;

use crate::backend::Backend;
use crate::model::Transformer;
use crate::tensor::{DType, Tensor, TensorSpec};

/// The rows of `micro_steps` passes of `tokens` losses each.
pub fn rows_spec(micro_steps: usize, tokens: usize, dtype: DType) -> TensorSpec {
    TensorSpec::new("step_losses", &[micro_steps, tokens], dtype)
}

pub struct StepLosses<B: Backend> {
    /// `[micro-steps, tokens]`, in the dtype of the model's losses.
    rows: Tensor<B>,
    /// What the allocation holds, for the memory table.
    pub memory: Vec<(&'static str, Vec<TensorSpec>)>,
}

impl<B: Backend> StepLosses<B> {
    pub fn new(b: &B, model: &Transformer<B>, micro_steps: usize) -> Result<Self> {
        let losses = model.losses();
        let spec = rows_spec(micro_steps, losses.numel(), losses.dtype);
        let rows = b.allocate("losses", std::slice::from_ref(&spec))?;
        Ok(StepLosses {
            rows: rows.into_iter().next().expect("one tensor"),
            memory: vec![("losses", vec![spec])],
        })
    }

    /// Keeps a pass's per-token `losses` as those of micro-step `k`.
    pub fn keep(&self, b: &B, losses: &Tensor<B>, k: usize) -> Result<()> {
        b.copy(&self.rows.narrow_rows(k, k + 1), losses)
    }

    /// The sum of every micro-step's losses (ignored targets count 0), each micro-step's in
    /// f64, then added in order. Waits for the device.
    pub fn sum(&self, b: &B) -> Result<f64> {
        let values = b.download_f64(&self.rows)?;
        Ok(values
            .chunks(self.rows.cols())
            .map(|row| row.iter().sum::<f64>())
            .sum())
    }
}
