//! The datasheet figures of the GPUs smelt knows by name: the dense (not sparse) bf16 and FP8
//! tensor-core peaks, for MFU and SOL, and the memory bandwidth, for `smelt plan`'s estimates.
//!
//! Every peak is the vendor's dense figure with FP32 accumulation, which is what training
//! runs at: NVIDIA lists sparse figures first, twice the dense ones, and for GeForce cards
//! (RTX 3090, 4090, 5090) also an FP16-accumulate figure that is twice the FP32-accumulate
//! one; the professional and data-centre cards accumulate in FP32 at full rate. Ampere has
//! no FP8 tensor cores.

use crate::tensor::DType;

pub struct Datasheet {
    /// The words that name the GPU in what the driver calls it (see `datasheet`).
    pub key: &'static str,
    /// Dense bf16 tensor-core FLOP/s.
    pub bf16_flops: f64,
    /// Dense FP8 (e4m3, e5m2) tensor-core FLOP/s; `None` where the GPU has no FP8.
    pub fp8_flops: Option<f64>,
    /// Bytes/s.
    pub memory_bandwidth: f64,
    /// Where the figures come from.
    pub source: &'static str,
}

impl Datasheet {
    /// The dense tensor-core peak for matmuls whose inputs are `dtype`: FP8 for e4m3 and
    /// e5m2; for int8 the FP8 figure where there is one (Ada, Hopper and Blackwell run INT8 at
    /// FP8's rate), else twice bf16's (Ampere); bf16 for every other dtype (f32 matmuls have
    /// no tensor-core peak of their own, and MFU is measured against bf16's as PyTorch's
    /// figures are).
    pub fn peak_flops(&self, dtype: DType) -> Option<f64> {
        match dtype {
            d if d.is_fp8() => self.fp8_flops,
            DType::I8 => Some(self.fp8_flops.unwrap_or(2.0 * self.bf16_flops)),
            _ => Some(self.bf16_flops),
        }
    }
}

const HOPPER: &str = "NVIDIA H100 and H200 datasheets";
const HGX_BLACKWELL: &str = "NVIDIA HGX B200/B100 datasheet, per GPU";
const ADA: &str = "NVIDIA Ada GPU architecture whitepaper, appendix";
const AMPERE: &str = "NVIDIA Ampere GA102 GPU architecture whitepaper, appendix";
const RTX_BLACKWELL: &str = "NVIDIA RTX Blackwell GPU architecture whitepaper, appendix";

const GPUS: [Datasheet; 25] = [
    gpu(
        "GB200",
        2500e12,
        Some(5000e12),
        8.0e12,
        "NVIDIA GB200 NVL72 datasheet, per GPU",
    ),
    gpu("B200", 2250e12, Some(4500e12), 8.0e12, HGX_BLACKWELL),
    gpu("B100", 1750e12, Some(3500e12), 8.0e12, HGX_BLACKWELL),
    // "NVIDIA GH200 480GB" has 96 GB of HBM3; the HBM3e part has 144 GB, and more bandwidth.
    gpu(
        "GH200",
        989.4e12,
        Some(1978.9e12),
        4.0e12,
        "NVIDIA GH200 datasheet",
    ),
    gpu(
        "GH200 144G",
        989.4e12,
        Some(1978.9e12),
        4.9e12,
        "NVIDIA GH200 datasheet",
    ),
    gpu("H200 NVL", 835.5e12, Some(1670.5e12), 4.8e12, HOPPER),
    gpu("H200", 989.4e12, Some(1978.9e12), 4.8e12, HOPPER),
    gpu("H100 PCIe", 756.5e12, Some(1513e12), 2.0e12, HOPPER),
    gpu("H100 NVL", 835.5e12, Some(1670.5e12), 3.9e12, HOPPER),
    // SXM: "NVIDIA H100 80GB HBM3".
    gpu("H100", 989.4e12, Some(1978.9e12), 3.35e12, HOPPER),
    // "NVIDIA A100-SXM4-80GB" and "NVIDIA A100 80GB PCIe"; the 40 GB parts, SXM4 and PCIe,
    // have 1.555 TB/s.
    gpu("A100 80GB", 312e12, None, 2.039e12, "NVIDIA A100 datasheet"),
    gpu(
        "A100 80GB PCIe",
        312e12,
        None,
        1.935e12,
        "NVIDIA A100 datasheet",
    ),
    gpu("A100", 312e12, None, 1.555e12, "NVIDIA A100 datasheet"),
    gpu("A10", 125e12, None, 0.6e12, "NVIDIA A10 datasheet"),
    gpu("RTX A6000", 154.8e12, None, 0.768e12, AMPERE),
    gpu("RTX 3090", 71e12, None, 0.936e12, AMPERE),
    gpu("RTX 3090 Ti", 80e12, None, 1.008e12, ADA),
    gpu("RTX 4090", 165.2e12, Some(330.3e12), 1.008e12, ADA),
    gpu("RTX 6000 Ada", 364.2e12, Some(728.5e12), 0.96e12, ADA),
    gpu(
        "L40S",
        362.05e12,
        Some(733e12),
        0.864e12,
        "NVIDIA L40S datasheet",
    ),
    gpu(
        "L40",
        181.05e12,
        Some(362.1e12),
        0.864e12,
        "NVIDIA L40 datasheet",
    ),
    gpu("L4", 121e12, Some(242.5e12), 0.3e12, "NVIDIA L4 datasheet"),
    gpu("RTX 5090", 209.5e12, Some(419e12), 1.792e12, RTX_BLACKWELL),
    // The Workstation and Server Editions; the 300 W Max-Q clocks lower.
    gpu(
        "RTX PRO 6000",
        503.8e12,
        Some(1007.6e12),
        1.792e12,
        RTX_BLACKWELL,
    ),
    gpu(
        "RTX PRO 6000 Max-Q",
        438.9e12,
        Some(877.8e12),
        1.792e12,
        RTX_BLACKWELL,
    ),
];

const fn gpu(
    key: &'static str, bf16_flops: f64, fp8_flops: Option<f64>, memory_bandwidth: f64,
    source: &'static str,
) -> Datasheet {
    Datasheet {
        key,
        bf16_flops,
        fp8_flops,
        memory_bandwidth,
        source,
    }
}

/// The words of a GPU's name, upper case: "NVIDIA A100-SXM4-80GB" is NVIDIA, A100, SXM4,
/// 80GB.
fn words(name: &str) -> Vec<String> {
    name.split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_uppercase)
        .collect()
}

/// The figures of the GPU the driver calls `name` (or a user calls it: case is ignored);
/// `None` for GPUs not listed here. A key matches when each of its words is a word of the
/// name, so that "L4" does not match "NVIDIA L40S", nor "H200" "NVIDIA GH200 480GB"; of the
/// keys that match, the one of the most words is the most specific ("H100 PCIe" over
/// "H100", "RTX 3090 Ti" over "RTX 3090").
pub fn datasheet(name: &str) -> Option<&'static Datasheet> {
    let name = words(name);
    GPUS.iter()
        .map(|g| (g, words(g.key)))
        .filter(|(_, key)| key.iter().all(|w| name.contains(w)))
        .max_by_key(|(_, key)| key.len())
        .map(|(g, _)| g)
}

/// The names `datasheet` knows, for error messages.
pub fn known() -> Vec<&'static str> {
    GPUS.iter().map(|g| g.key).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> Option<&'static str> {
        datasheet(name).map(|g| g.key)
    }

    /// The names drivers report (nvidia-smi's), each to the entry it must find.
    #[test]
    fn driver_names_find_the_most_specific_entry() {
        let names = [
            ("NVIDIA H100 80GB HBM3", "H100"),
            ("NVIDIA H100 PCIe", "H100 PCIe"),
            ("NVIDIA H100 NVL", "H100 NVL"),
            ("NVIDIA H200", "H200"),
            ("NVIDIA H200 NVL", "H200 NVL"),
            ("NVIDIA GH200 480GB", "GH200"),
            ("NVIDIA GH200 144G HBM3e", "GH200 144G"),
            ("NVIDIA B200", "B200"),
            ("NVIDIA GB200", "GB200"),
            ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
            ("NVIDIA A100-SXM4-40GB", "A100"),
            ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
            ("NVIDIA A100-PCIE-40GB", "A100"),
            ("NVIDIA A10", "A10"),
            ("NVIDIA L4", "L4"),
            ("NVIDIA L40", "L40"),
            ("NVIDIA L40S", "L40S"),
            ("NVIDIA GeForce RTX 3090", "RTX 3090"),
            ("NVIDIA GeForce RTX 3090 Ti", "RTX 3090 Ti"),
            ("NVIDIA GeForce RTX 4090", "RTX 4090"),
            ("NVIDIA GeForce RTX 5090", "RTX 5090"),
            ("NVIDIA RTX A6000", "RTX A6000"),
            ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
            (
                "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                "RTX PRO 6000",
            ),
            (
                "NVIDIA RTX PRO 6000 Blackwell Server Edition",
                "RTX PRO 6000",
            ),
            (
                "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
                "RTX PRO 6000 Max-Q",
            ),
            // What a user passes to `smelt plan --gpu`.
            ("h100 pcie", "H100 PCIe"),
        ];
        for (name, expected) in names {
            assert_eq!(key(name), Some(expected), "{name}");
        }
        for unknown in [
            "NVIDIA GeForce GTX 1080",
            "NVIDIA GeForce RTX 2080 Ti",
            "Tesla T4",
        ] {
            assert_eq!(key(unknown), None, "{unknown}");
        }
    }

    #[test]
    fn peaks_follow_the_matmul_dtype() {
        let h100 = datasheet("NVIDIA H100 PCIe").unwrap();
        assert_eq!(h100.peak_flops(DType::BF16), Some(756.5e12));
        assert_eq!(h100.peak_flops(DType::F32), Some(756.5e12));
        assert_eq!(h100.peak_flops(DType::E4M3), Some(1513e12));
        let a100 = datasheet("NVIDIA A100-SXM4-80GB").unwrap();
        assert_eq!(a100.peak_flops(DType::E4M3), None, "Ampere has no FP8");
    }

    #[test]
    fn every_key_finds_itself_and_fp8_doubles_bf16() {
        for g in &GPUS {
            assert_eq!(key(g.key), Some(g.key), "{} is shadowed", g.key);
            if let Some(fp8) = g.fp8_flops {
                // The L40S datasheet's bf16 figure is 1.2% below half its FP8 one.
                let ratio = fp8 / g.bf16_flops;
                assert!((ratio - 2.0).abs() < 0.03, "{}: {ratio}", g.key);
            }
        }
    }
}
