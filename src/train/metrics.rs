//! Throughput figures.

/// Model FLOPs utilisation: achieved model FLOP/s (`ModelConfig::training_flops_per_token`
/// times tokens per second) over the device's peak, where it has one.
pub fn mfu(flops_per_token: f64, tokens_per_second: f64, peak_flops: Option<f64>) -> Option<f64> {
    peak_flops.map(|peak| flops_per_token * tokens_per_second / peak)
}
