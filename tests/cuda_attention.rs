//! Attention at the shapes of the benchmark's models: the tensor-core kernels against the
//! CUDA-core ones (the simple reference, itself tested against the CPU in cuda_ops), wgmma's
//! (tiles by TMA) bit for bit against mma.sync's (tiles by cp.async), and the tensor-core
//! kernels' speed, timed by CUDA events around each op. The speed is a figure, not
//! an assertion; `scripts/gpu/torch_attention.py` times PyTorch's fused attention on the same
//! shapes for comparison.

mod common;

use common::gpu::*;
use common::{EOS, packed_batch};
use smelt::backend::AttnShape;
use smelt::backend::cuda::Cuda;
use smelt::backend::cuda::kernel_choice::AttentionKernels;
use smelt::backend::prelude::*;
use smelt::model::documents;
use smelt::tensor::{DType, Tensor};

struct Buffers {
    qkv: Tensor<Cuda>,
    out: Tensor<Cuda>,
    lse: Tensor<Cuda>,
    dout: Tensor<Cuda>,
    dqkv: Tensor<Cuda>,
    /// Packed documents' spans, where the sequences hold several.
    docs: Option<Tensor<Cuda>>,
}

impl Buffers {
    fn new(gpu: &Cuda, s: AttnShape, seed: u64) -> Self {
        let rows = s.batch * s.seq;
        let q = s.q_heads * s.head_dim;
        let zeros =
            |shape: &[usize], dtype| tensor(gpu, shape, dtype, &vec![0.0; shape.iter().product()]);
        Buffers {
            // Entries of std 1.5 give scores of std ~2: attention far from uniform.
            qkv: tensor(
                gpu,
                &[rows, s.qkv_width()],
                DType::BF16,
                &normal(rows * s.qkv_width(), 1.5, seed),
            ),
            out: zeros(&[rows, q], DType::BF16),
            lse: zeros(&[s.batch, s.q_heads, s.seq], DType::F32),
            dout: tensor(
                gpu,
                &[rows, q],
                DType::BF16,
                &normal(rows * q, 1.0, seed + 1),
            ),
            dqkv: zeros(&[rows, s.qkv_width()], DType::BF16),
            docs: None,
        }
    }

    /// The buffers with documents of about `mean` tokens packed into each sequence.
    fn with_documents(self, gpu: &Cuda, s: AttnShape, mean: usize, seed: u64) -> Self {
        let (tokens, _) = packed_batch(s.batch * s.seq, s.seq, mean, 1000, seed);
        let spans = documents::spans(&tokens, s.seq, EOS);
        Buffers {
            docs: Some(tensor_i32(gpu, &spans)),
            ..self
        }
    }

    fn forward_backward(&self, gpu: &Cuda, s: AttnShape) {
        let docs = self.docs.as_ref();
        gpu.attention_forward(&self.out, &self.lse, &self.qkv, s, docs, None)
            .unwrap();
        gpu.attention_backward(
            &self.dqkv, &self.dout, &self.qkv, &self.out, &self.lse, s, docs,
        )
        .unwrap();
    }

    fn outputs(&self, gpu: &Cuda) -> Outputs {
        vec![
            ("out", gpu.download(&self.out).unwrap()),
            ("lse", gpu.download(&self.lse).unwrap()),
            ("dqkv", gpu.download(&self.dqkv).unwrap()),
        ]
    }
}

/// FLOPs of the causal forward: QKᵀ and PV each take 2·D per (query, key at or before it,
/// q head). The backward is counted as 2.5 times this, as FlashAttention reports it.
fn forward_flops(s: AttnShape) -> f64 {
    let pairs = (s.seq * (s.seq + 1) / 2) as f64;
    4.0 * pairs * (s.batch * s.q_heads * s.head_dim) as f64
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tensor_cores_at_model_shapes() {
    let gpu = cuda();
    let shape = |batch, q_heads, kv_heads, head_dim| AttnShape {
        batch,
        seq: 1024,
        q_heads,
        kv_heads,
        head_dim,
    };
    // Qwen2.5-0.5B at batch 32, 1.5B at 16, 3B at 8: the benchmark's rows.
    let cases = [
        ("qwen2.5-0.5b", shape(32, 14, 2, 64)),
        ("qwen2.5-1.5b", shape(16, 12, 2, 128)),
        ("qwen2.5-3b", shape(8, 16, 2, 128)),
    ];
    for (i, (model, s)) in cases.into_iter().enumerate() {
        let bufs = Buffers::new(&gpu, s, 50 + 2 * i as u64);
        let test = format!(
            "attention {model} B{} H{}/{} D{}",
            s.batch, s.q_heads, s.kv_heads, s.head_dim
        );
        let run = |kernels| {
            gpu.set_attention_kernels(kernels);
            bufs.forward_backward(&gpu, s);
            bufs.outputs(&gpu)
        };
        let reference = run(AttentionKernels::Simple);
        // wgmma where the GPU has it (else the same mma.sync kernels twice), then mma.sync.
        let mut results = Vec::new();
        for (name, kernels) in [
            ("wgmma", AttentionKernels::Wgmma),
            ("mma.sync", AttentionKernels::MmaSync),
        ] {
            let test = format!("{test} {name}");
            // bf16 outputs and P, dS rounded to bf16 for the MMAs: the bound of cuda_ops.
            results.push(check_op(
                &test,
                || run(kernels),
                || reference.clone(),
                |name| {
                    if name == "lse" { 1e-5 } else { 1e-2 }
                },
            ));
            let (fwd, bwd) = time(&gpu, &bufs, s, kernels);
            let flops = forward_flops(s);
            figure(
                &test,
                format!(
                    "forward {fwd:.3} ms ({:.0} TFLOP/s), backward {bwd:.3} ms ({:.0} TFLOP/s)",
                    flops / fwd * 1e-9,
                    2.5 * flops / bwd * 1e-9
                ),
            );
        }
        // On an H100 the two kernels give the same bits, and wgmma's tiles arrive by TMA where
        // mma.sync's come by cp.async: any tile TMA landed differently would show here.
        for ((name, wgmma), (_, mma)) in results[0].iter().zip(&results[1]) {
            assert!(
                same_bits(wgmma, mma),
                "{test}: {name} differs between wgmma and mma.sync"
            );
        }
        figure(&test, "wgmma and mma.sync outputs bitwise equal");
    }
}

/// Documents of ~300 tokens packed into the 0.5B benchmark's sequences: the tensor-core
/// kernels against the CUDA-core ones, and their time against the same shape unmasked. The
/// masked kernels skip the key tiles before a query tile's first document and the query tiles
/// after a key tile's last, so with documents of ~300 tokens they see about a fifth of the
/// causal tile pairs of 1024-token sequences.
#[test]
#[ignore = "needs a CUDA GPU"]
fn documents_skip_the_tiles_between_them() {
    let gpu = cuda();
    let s = AttnShape {
        batch: 32,
        seq: 1024,
        q_heads: 14,
        kv_heads: 2,
        head_dim: 64,
    };
    let test = "attention qwen2.5-0.5b B32 documents of ~300";
    let unmasked = Buffers::new(&gpu, s, 60);
    let masked = Buffers::new(&gpu, s, 60).with_documents(&gpu, s, 300, 61);
    let run = |bufs: &Buffers, kernels| {
        gpu.set_attention_kernels(kernels);
        bufs.forward_backward(&gpu, s);
        bufs.outputs(&gpu)
    };
    let reference = run(&masked, AttentionKernels::Simple);
    for (name, kernels) in [
        ("wgmma", AttentionKernels::Wgmma),
        ("mma.sync", AttentionKernels::MmaSync),
    ] {
        let test = format!("{test} {name}");
        check_op(
            &test,
            || run(&masked, kernels),
            || reference.clone(),
            |name| {
                if name == "lse" { 1e-5 } else { 1e-2 }
            },
        );
        let (fwd, bwd) = time(&gpu, &masked, s, kernels);
        let (full_fwd, full_bwd) = time(&gpu, &unmasked, s, kernels);
        figure(
            &test,
            format!(
                "forward {fwd:.3} ms against {full_fwd:.3} unmasked ({:.2}x), backward {bwd:.3} \
                 ms against {full_bwd:.3} ({:.2}x)",
                full_fwd / fwd,
                full_bwd / bwd
            ),
        );
        assert!(
            fwd < full_fwd && bwd < full_bwd,
            "{test}: masked attention should be faster than unmasked"
        );
    }
}

/// Milliseconds per forward and per backward, over 10 rounds timed by CUDA events.
fn time(gpu: &Cuda, bufs: &Buffers, s: AttnShape, kernels: AttentionKernels) -> (f64, f64) {
    let reps = 10;
    gpu.set_attention_kernels(kernels);
    gpu.time_ops(true);
    for _ in 0..reps {
        bufs.forward_backward(gpu, s);
    }
    gpu.synchronize().unwrap();
    let times = gpu.take_op_times().unwrap();
    gpu.time_ops(false);
    let ms = |op: &str| {
        let t = times
            .iter()
            .find(|t| t.op == op)
            .unwrap_or_else(|| panic!("{op} not timed: {times:?}"));
        assert_eq!(t.calls, reps, "{op} calls");
        t.seconds * 1e3 / reps as f64
    };
    (ms("attention_forward"), ms("attention_backward"))
}
