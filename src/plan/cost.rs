//! The step-time estimate behind `smelt plan`'s ranking: what the step costs without
//! recompute or offload, plus what each adds. Each rate is a share of the GPU's datasheet
//! figure, as smelt measured it on an H100 (docs/performance.md); the estimate is for
//! comparing choices, not a promise of throughput.

use super::Choice;
use crate::backend::datasheet::Datasheet;
use crate::model::{ModelConfig, Recompute};

/// The step but for attention's products (its matmuls, memory-bound kernels and update), as a
/// share of the bf16 peak: 0.51–0.57 on the bench rows, with attention taken out at the rate
/// below.
const STEP_SHARE: f64 = 0.54;
/// The recomputed matmuls: cuBLASLt's bf16 forward products ran at 630–756 of 989 TFLOP/s.
const MATMUL_SHARE: f64 = 0.7;
/// Attention's products, forward and backward: 286–363 of 989 TFLOP/s at 1k tokens. Under 5%
/// of the work there, most of it at 32k, where the step ran at 0.38–0.39 of the peak.
const ATTENTION_SHARE: f64 = 0.32;
/// The recomputed memory-bound kernels (norms, RoPE, SwiGLU): 2.5–3.0 of 3.35 TB/s.
const BANDWIDTH_SHARE: f64 = 0.85;
/// Offloaded optimizer state crosses the bus once each way per optimizer step, both
/// directions at once: 44–45 GB/s each way was measured over PCIe Gen5 ×16.
pub const BUS_BYTES_PER_S: f64 = 45e9;
/// ZeRO-3 sends each block's weights from their GPU to the others before each pass, on the
/// compute stream (nothing overlaps them yet), so a step pays their time in full. NCCL's
/// broadcast rate between the GPUs is taken as 100 GB/s, a stand-in for NVLink (it has not
/// been measured); over PCIe it is lower, and the estimate optimistic.
const BROADCAST_BYTES_PER_S: f64 = 100e9;
/// A block's copies beside its work (offloaded activations, streamed weights and gradients)
/// run on the copy engines, each direction at this rate: 312 MB a block of activations went
/// out in about 5.5 ms, 57 GB/s, at 0.5B batch 32 × 1024; Llama-3-8B's 436 MB of block
/// weights came in a block ahead of a 6.4 ms block forward at a cost of 1.7 ms a block
/// (H200), 54 GB/s.
const COPY_BYTES_PER_S: f64 = 55e9;

/// The seconds of one optimizer step's parts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepCost {
    /// Forward, backward and update, with nothing recomputed.
    pub base: f64,
    /// The forward work that recompute repeats in the backward.
    pub recompute: f64,
    /// Each LM-head or MLP chunk after the first re-reads and rewrites the head's or the
    /// MLP's weight gradients.
    pub chunks: f64,
    /// The offloaded state's round trip over the bus.
    pub bus: f64,
    /// What the blocks' copies (offloaded activations, streamed weights and gradients) do
    /// not hide behind the blocks' work.
    pub copies: f64,
    /// ZeRO-3's broadcasts of the blocks' weights.
    pub broadcasts: f64,
}

impl StepCost {
    pub fn total(&self) -> f64 {
        self.base + self.recompute + self.chunks + self.bus + self.copies + self.broadcasts
    }
}

/// What one optimizer step of a run costs on `gpu`.
pub struct Workload<'a> {
    pub config: &'a ModelConfig,
    pub seq: usize,
    /// Tokens of one micro-batch.
    pub tokens: usize,
    pub micro_steps: usize,
    /// Bytes of an activation element (the model dtype).
    pub element_bytes: usize,
    /// Whether the blocks' matmuls are FP8, whose recompute pass skips the outputs the
    /// backward does not read again (`ActivationPlan::new`).
    pub fp8: bool,
}

impl Workload<'_> {
    /// The cost of `choice`, with `offloaded_bytes` crossing the bus each way in the update
    /// (the busiest rank's offloaded optimizer state, and streamed weights and gradients),
    /// and `block_bytes` of each block's offloaded activations.
    pub fn cost(
        &self, gpu: &Datasheet, choice: &Choice, offloaded_bytes: u64, block_bytes: u64,
    ) -> StepCost {
        let c = self.config;
        let passes = (self.tokens * self.micro_steps) as f64;
        let attention = c.training_attention_flops_per_token(self.seq);
        let rest = c.training_flops_per_token(self.seq) - attention;
        let base = passes
            * (rest / (STEP_SHARE * gpu.bf16_flops)
                + attention / (ATTENTION_SHARE * gpu.bf16_flops));
        let per_token = self.recompute_seconds_per_token(gpu, choice.memory.recompute);
        let head_grad_bytes = (2 * c.vocab_size * c.hidden_size * self.element_bytes) as f64;
        let mlp_grad_bytes =
            (2 * 3 * c.intermediate_size * c.hidden_size * self.element_bytes * c.num_layers)
                as f64;
        let chunks = self.micro_steps as f64
            * ((choice.memory.lmhead_chunks - 1) as f64 * head_grad_bytes
                + (choice.memory.ffn_chunks - 1) as f64 * mlp_grad_bytes)
            / (BANDWIDTH_SHARE * gpu.memory_bandwidth);
        StepCost {
            base,
            recompute: passes * per_token,
            chunks,
            bus: offloaded_bytes as f64 / BUS_BYTES_PER_S,
            copies: self.block_copies(base, choice, block_bytes),
            broadcasts: match choice.zero_level {
                3.. => self.weight_broadcasts(self.passes(choice).0),
                _ => 0.0,
            },
        }
    }

    /// Each block's copies run beside the blocks' work, per pass: in the forward its
    /// streamed weights come in while its offloaded activations go out; in the backward its
    /// weights and activations come in (with its gradient sum so far, when streamed and
    /// accumulating) while its streamed gradients go out. A pass is a micro-step, or
    /// layer-major all of them, whose weights and gradients then cross once beside every
    /// micro-step's work and activations. Only what a copy takes beyond that work is paid,
    /// each direction on its own engine; a block's share of the step is taken as a third
    /// forward and two thirds backward.
    fn block_copies(&self, base: f64, choice: &Choice, activation_bytes: u64) -> f64 {
        let c = self.config;
        let m = &choice.memory;
        let params = self.element_bytes * c.block_parameters();
        let weights = if m.offload_weights { params } else { 0 } as f64;
        let grads = if m.offload_gradients { params } else { 0 } as f64;
        let (passes, per_pass) = self.passes(choice);
        let activations = (activation_bytes * per_pass) as f64;
        let blocks = (passes * c.num_layers) as f64;
        let block = base / blocks;
        let paid = |bytes_in: f64, bytes_out: f64, work: f64| {
            (bytes_in.max(bytes_out) / COPY_BYTES_PER_S - work).max(0.0)
        };
        // With accumulation, every pass after the first brings the sums back in.
        let sums_in = grads * (passes - 1) as f64 / passes as f64;
        blocks
            * (paid(weights, activations, block / 3.0)
                + paid(weights + activations + sums_in, grads, 2.0 * block / 3.0))
    }

    /// The passes of a step and the micro-steps each holds: one each, or layer-major as
    /// many as a pass takes.
    fn passes(&self, choice: &Choice) -> (usize, u64) {
        let per_pass = choice.memory.layer_major.max(1);
        (self.micro_steps.div_ceil(per_pass), per_pass as u64)
    }

    /// Every block's weights, sent twice per pass (for the forward and the backward).
    fn weight_broadcasts(&self, passes: usize) -> f64 {
        let c = self.config;
        let bytes = self.element_bytes * c.block_parameters() * c.num_layers;
        (2 * passes * bytes) as f64 / BROADCAST_BYTES_PER_S
    }

    /// The recompute pass of one token through every block: the steps of `block_forward`
    /// that `recompute` runs again.
    fn recompute_seconds_per_token(&self, gpu: &Datasheet, r: Recompute) -> f64 {
        let c = self.config;
        let (hidden, q, kv, f) = (
            c.hidden_size as f64,
            c.q_dim() as f64,
            c.kv_dim() as f64,
            c.intermediate_size as f64,
        );
        // FP8's backward reads no norm or SwiGLU output again (`ActivationPlan::new`).
        let again = !self.fp8;
        let mut matmul_flops = 0.0;
        let mut attention_flops = 0.0;
        // Elements read and written by the memory-bound kernels.
        let mut elements = 0.0;
        if r.norms() && again {
            elements += 2.0 * hidden; // the input norm
        }
        if r.qkv() {
            matmul_flops += 2.0 * hidden * c.qkv_dim() as f64;
            elements += 2.0 * (q + kv); // RoPE on q and k, in place
        }
        if r.attention() {
            // Causal: on average half the sequence's keys per query, QKᵀ and PV.
            attention_flops += 2.0 * self.seq as f64 * q;
        }
        if r.residual_mid() {
            matmul_flops += 2.0 * q * hidden;
            elements += 4.0 * hidden; // residual add and norm: two in, two out
        } else if r.norms() && again {
            elements += 2.0 * hidden;
        }
        if r.gate_up() {
            matmul_flops += 2.0 * hidden * 2.0 * f;
        }
        if r.swiglu_out() && again {
            elements += 3.0 * f;
        }
        c.num_layers as f64
            * (matmul_flops / (MATMUL_SHARE * gpu.bf16_flops)
                + attention_flops / (ATTENTION_SHARE * gpu.bf16_flops)
                + elements * self.element_bytes as f64 / (BANDWIDTH_SHARE * gpu.memory_bandwidth))
    }
}

#[cfg(test)]
mod tests {
    use super::Workload;
    use crate::backend::datasheet::datasheet;
    use crate::model::{ModelConfig, Recompute, presets};
    use crate::plan::Choice;
    use crate::train::options::MemoryOptions;

    fn choice(recompute: Recompute, lmhead_chunks: usize) -> Choice {
        Choice {
            memory: MemoryOptions {
                recompute,
                offload_residual: false,
                offload_activations: false,
                lmhead_chunks,
                ffn_chunks: 1,
                offload_weights: false,
                offload_gradients: false,
                layer_major: 0,
            },
            offload: Default::default(),
            zero_level: 0,
        }
    }

    /// `smelt bench` on an H100 SXM, bf16 with bf16 moments: (model, batch, seq, median step
    /// in ms = tokens / tok/s), the reference the estimate is held to. At seq 1k attention is
    /// under 5% of the work; the 32k row (`smelt bench --batch-size 1 --seq-len 32768`) is two
    /// thirds attention.
    const MEASURED_STEPS: [(&str, usize, usize, f64); 4] = [
        ("qwen2.5-0.5b", 32, 1024, 207.3),
        ("qwen2.5-1.5b", 16, 1024, 288.4),
        ("qwen2.5-3b", 8, 1024, 289.3),
        ("qwen2.5-0.5b", 1, 32768, 616.1),
    ];

    fn workload(config: &ModelConfig, batch: usize, seq: usize) -> Workload<'_> {
        Workload {
            config,
            seq,
            tokens: batch * seq,
            micro_steps: 1,
            element_bytes: 2,
            fp8: false,
        }
    }

    fn within(estimate: f64, measured: f64, tolerance: f64) -> bool {
        (estimate / measured - 1.0).abs() <= tolerance
    }

    #[test]
    fn the_estimate_is_near_what_an_h100_measured() {
        let h100 = datasheet("H100").unwrap();
        for (name, batch, seq, ms) in MEASURED_STEPS {
            let config = presets::preset(name).unwrap();
            let cost =
                workload(&config, batch, seq).cost(h100, &choice(Recompute::default(), 1), 0, 0);
            assert!(
                within(cost.total() * 1e3, ms, 0.1),
                "{name} at {batch} × {seq}: {cost:?} against {ms} ms"
            );
        }
        let half_b = presets::preset("qwen2.5-0.5b").unwrap();
        let w = workload(&half_b, 32, 1024);
        let block = Recompute {
            block: true,
            ..Recompute::default()
        };
        // --recompute-block adds 45.5 ms a step (smelt bench, 143.0k tok/s without it and
        // 119.3k with it).
        let extra = w.cost(h100, &choice(block, 1), 0, 0).recompute * 1e3;
        assert!(within(extra, 45.5, 0.2), "block recompute: {extra} ms");
        // The same at one sequence of 128k tokens, with 32 LM-head chunks: 14,058 tok/s.
        let long = workload(&half_b, 1, 131_072).cost(h100, &choice(block, 32), 0, 0);
        assert!(within(long.total(), 9.32, 0.15), "128k: {long:?}");
        // bf16 m and v offloaded (1.98 GB): the optimizer phase takes 47.7 ms, 3.5 ms on the
        // device.
        let moments = 2 * 2 * half_b.num_parameters() as u64;
        let extra = w
            .cost(h100, &choice(Recompute::default(), 1), moments, 0)
            .bus
            * 1e3;
        assert!(within(extra, 44.2, 0.15), "offloaded moments: {extra} ms");
        // --offload-residual costs nothing measurable: the copies hide behind the blocks
        // (without and with it, 212.0 and 211.3 ms a step; with --recompute-block 257.3 and
        // 257.6; at 128k 11,877 and 11,808 ms).
        let offloaded = |r: Recompute, chunks| {
            let mut offloaded = choice(r, chunks);
            offloaded.memory.offload_residual = true;
            offloaded
        };
        for (w, r, chunks) in [
            (&w, Recompute::default(), 1),
            (&w, block, 1),
            (&workload(&half_b, 1, 131_072), block, 32),
        ] {
            let inputs = (w.tokens * half_b.hidden_size * 2) as u64;
            let cost = w.cost(h100, &offloaded(r, chunks), 0, inputs);
            assert!(cost.copies < 0.01 * cost.total(), "{cost:?}");
        }
        // --offload-activations too (the same losses either way). Where a block's work
        // outlasts its copies it costs nothing measurable: at 128k with --recompute-ffn
        // --recompute-norm (1.23 GB a block), 14,007 and 14,028 tok/s without and with it; 3B
        // at batch 8 × 1024 with the same recompute (102 MB a block), 14,940 and 14,860. Where
        // it does not, 0.5B at batch 32 × 1024 with --recompute-ffn (312 MB a block against a
        // 2.2 ms block forward): 138,661 and 101,729 tok/s, 86 ms a step, 78 ms of it the
        // copies out.
        let norms_ffn = Recompute {
            ffn: true,
            norm: true,
            ..Recompute::default()
        };
        let ffn = Recompute {
            ffn: true,
            ..Recompute::default()
        };
        let three_b = presets::preset("qwen2.5-3b").unwrap();
        let per_token = |c: &ModelConfig, kept_vectors: usize| {
            // bf16 [N, ·] activations, f32 norm statistics, f32 log-sum-exp per head.
            (kept_vectors * 2 + 2 * 4 + c.num_heads * 4) as u64
        };
        let kept = |c: &ModelConfig, norms: bool| {
            let vectors = 2 * c.hidden_size + c.qkv_dim() + c.q_dim();
            match norms {
                true => per_token(c, vectors - c.hidden_size),
                false => per_token(c, vectors + c.hidden_size),
            }
        };
        for (w, r, chunks, block_bytes, step_ms) in [
            (
                workload(&half_b, 1, 131_072),
                norms_ffn,
                8,
                131_072 * kept(&half_b, true),
                None,
            ),
            (
                workload(&three_b, 8, 1024),
                norms_ffn,
                1,
                8192 * kept(&three_b, true),
                None,
            ),
            (w, ffn, 1, 32_768 * kept(&half_b, false), Some(86.0)),
        ] {
            let mut choice = offloaded(r, chunks);
            choice.memory.offload_activations = true;
            let cost = w.cost(h100, &choice, 0, block_bytes);
            match step_ms {
                None => assert!(cost.copies < 0.01 * cost.total(), "{cost:?}"),
                Some(ms) => {
                    let estimate = cost.copies * 1e3;
                    assert!(within(estimate, ms, 0.2), "{estimate} ms: {cost:?}")
                }
            }
        }
    }
}
