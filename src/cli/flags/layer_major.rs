//! `--layer-major[=N]`, shared by `smelt train`, `bench` and `plan`.

use clap::Args;

#[derive(Args, Debug)]
pub struct LayerMajorFlag {
    /// Run the --grad-accumulation micro-batches of a step layer-major, N a pass (all of them
    /// without N): each block runs on every micro-batch of the pass before the next block
    /// runs, so that streamed weights (--offload-weights, ZeRO-3) cross the bus once a pass
    /// and a block's gradients are summed over the pass's micro-batches before they go out.
    /// Each micro-batch keeps its own residual stream (--offload-residual puts them in host
    /// memory); --fit-memory may halve N to fit. The same results (tied embeddings: within
    /// rounding); bf16 or f32 matmuls.
    #[arg(
        long,
        value_name = "N",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "0",
        help_heading = "Memory"
    )]
    layer_major: Option<usize>,
}

impl LayerMajorFlag {
    /// Micro-batches a pass for steps of `accumulation` of them (`MemoryOptions::layer_major`):
    /// all of them for the flag alone, 0 without it.
    pub fn per_pass(&self, accumulation: usize) -> usize {
        match self.layer_major {
            None => 0,
            Some(0) => accumulation,
            Some(n) => n,
        }
    }
}
