//! The datasheet figures of the GPUs smelt knows by name: the dense (not sparse) bf16
//! tensor-core peak, for MFU, and the memory bandwidth, for `smelt plan`'s estimates.

pub struct Datasheet {
    /// Matched against the name the driver gives the GPU; the most specific key comes first.
    pub key: &'static str,
    /// FLOP/s.
    pub bf16_flops: f64,
    /// Bytes/s.
    pub memory_bandwidth: f64,
}

const GPUS: [Datasheet; 8] = [
    gpu("B200", 2250e12, 8.0e12),
    gpu("GH200", 989.4e12, 4.0e12),
    gpu("H200 NVL", 835e12, 4.8e12),
    gpu("H200", 989.4e12, 4.8e12),
    gpu("H100 PCIe", 756e12, 2.0e12),
    gpu("H100 NVL", 835e12, 3.9e12),
    gpu("H100", 989.4e12, 3.35e12), // SXM: "NVIDIA H100 80GB HBM3"
    gpu("A100", 312e12, 2.0e12),    // the 80 GB SXM part; the 40 GB one has 1.6 TB/s
];

const fn gpu(key: &'static str, bf16_flops: f64, memory_bandwidth: f64) -> Datasheet {
    Datasheet {
        key,
        bf16_flops,
        memory_bandwidth,
    }
}

/// The figures of the GPU the driver calls `name` (or a user calls it: case is ignored);
/// `None` for GPUs not listed here.
pub fn datasheet(name: &str) -> Option<&'static Datasheet> {
    let name = name.to_uppercase();
    GPUS.iter().find(|g| name.contains(&g.key.to_uppercase()))
}

/// The names `datasheet` knows, for error messages.
pub fn known() -> Vec<&'static str> {
    GPUS.iter().map(|g| g.key).collect()
}

#[cfg(test)]
mod tests {
    use super::datasheet;

    fn peak(name: &str) -> Option<f64> {
        datasheet(name).map(|g| g.bf16_flops)
    }

    #[test]
    fn peaks_match_the_most_specific_name() {
        assert_eq!(peak("NVIDIA H100 80GB HBM3"), Some(989.4e12));
        assert_eq!(peak("NVIDIA H100 PCIe"), Some(756e12));
        assert_eq!(peak("NVIDIA H200 NVL"), Some(835e12));
        assert_eq!(peak("NVIDIA A100-SXM4-80GB"), Some(312e12));
        assert_eq!(peak("NVIDIA GeForce GTX 1080"), None);
        assert_eq!(peak("h100 pcie"), Some(756e12));
    }
}
