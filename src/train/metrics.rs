//! Throughput figures of one device, against its datasheet peaks (`backend::datasheet`).

use crate::model::MatmulFlops;

/// Model FLOPs utilisation: the model FLOP/s one device achieves
/// (`ModelConfig::training_flops_per_token` times its tokens per second) over its dense
/// bf16 peak, where it has one.
pub fn mfu(flops_per_token: f64, tokens_per_second: f64, peak_flops: Option<f64>) -> Option<f64> {
    peak_flops.map(|peak| flops_per_token * tokens_per_second / peak)
}

/// Speed of light (llm.q's SOL): the share of the step's time that its matmuls alone would
/// take at the device's dense peaks, the blocks' linear layers at `blocks_peak` (that of
/// `--matmul-dtype`) and the LM head at `head_peak` (that of the model's dtype):
/// `tokens_per_second · (blocks / blocks_peak + head / head_peak)`, from
/// `ModelConfig::training_matmul_flops_per_token`. The rest of the step (attention, the
/// element-wise ops, the optimizer, waiting) is what keeps it below 1.
pub fn sol(
    matmuls: MatmulFlops, tokens_per_second: f64, blocks_peak: Option<f64>, head_peak: Option<f64>,
) -> Option<f64> {
    Some(tokens_per_second * (matmuls.blocks / blocks_peak? + matmuls.head / head_peak?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sol_is_the_matmuls_time_at_peak_over_the_step_time() {
        let matmuls = MatmulFlops {
            blocks: 6e9,
            head: 1e9,
        };
        // 1000 tokens a second: 6e12 FLOP/s in FP8 at 2e14 (3%), 1e12 in bf16 at 1e14 (1%).
        let sol = sol(matmuls, 1000.0, Some(2e14), Some(1e14)).unwrap();
        assert!((sol - 0.04).abs() < 1e-12, "{sol}");
        assert_eq!(super::sol(matmuls, 1000.0, None, Some(1e14)), None);
        let mfu = mfu(7e9, 1000.0, Some(1e14)).unwrap();
        assert!((mfu - 0.07).abs() < 1e-12, "{mfu}");
    }
}
