//! `smelt bench`: training throughput of a model on random weights and tokens (see
//! `train::bench`), as a table or, with `--json`, one JSON line for scripts.

use anyhow::{Result, bail};
use clap::Args;
use serde_json::json;

use super::flags::{
    DocumentFlags, FitMemoryFlag, LayerMajorFlag, MatmulFlags, MomentFlags, OffloadFlags,
    RecomputeFlags, SmallerBatch,
};
use crate::backend::op_times::{OpTime, by_family};
use crate::backend::select::{Device, DeviceChoice, select};
use crate::comm::ranks::Ranks;
use crate::model::Recompute;
use crate::plan::Request;
use crate::tensor::DType;
use crate::train::ModelSource;
use crate::train::bench::{self, BenchDocuments, BenchOptions, BenchReport, PHASES, SPLIT_STEPS};
use crate::train::console::gib;
use crate::train::options::{MemoryOptions, Offload};

/// The LM head's default chunk: the whole batch, as `smelt train` runs it, up to 10 GB of
/// logits for a 152k vocabulary. Smaller chunks cost time: each re-reads and rewrites the
/// head's weight gradient, 10% of a batch-1 step in 8 chunks, and makes smaller matmuls, 2.5
/// ms of a 0.5B batch-32 step in chunks of 4096 tokens (about 0.5%; H100).
const LMHEAD_CHUNK_TOKENS: usize = 32_768;

#[derive(Args, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Measure training throughput: tok/s, MFU, peak memory and the time of each phase",
    after_help = "Trains --model from random weights on random tokens, in bf16 with bf16 Adam \
states (--opt-m-dtype and --opt-v-dtype choose others). After --warmup steps, the median of \
--steps steps (each ending with one wait for the device) gives tok/s and MFU. Then a few more steps wait for the device after every phase \
(forward, backward, optimizer, other) to split the step's time. With --op-times, a few more \
steps time every op on the GPU with CUDA events, by name (a matmul by its M×N×K), and two tables \
list them by device time: each op, then each family (a name's first word)."
)]
pub struct BenchArgs {
    /// A built-in architecture (qwen2.5-0.5b, -1.5b, -3b, qwen2-100m, qwen3-0.6b, -1.7b, -4b,
    /// -8b, llama-3.2-1b, llama-3-8b) or a HF model directory, of which only config.json is
    /// read.
    #[arg(long, value_name = "NAME|DIR")]
    model: String,
    /// Sequences per step.
    #[arg(long)]
    batch_size: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// Micro-batches of --batch-size sequences per step, their gradients summed before the
    /// update.
    #[arg(long, default_value_t = 1)]
    grad_accumulation: usize,
    #[command(flatten)]
    layer_major: LayerMajorFlag,
    /// Steps timed (their median is reported).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Steps before the timed ones: kernel compilation, matmul plans.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[command(flatten)]
    matmul: MatmulFlags,
    #[command(flatten)]
    moments: MomentFlags,
    #[command(flatten)]
    recompute: RecomputeFlags,
    #[command(flatten)]
    offload: OffloadFlags,
    /// Chunks of the LM head and loss (the logits buffer shrinks with it) [default: one per
    /// 32,768 tokens of the batch, 1 at 32 × 1024].
    #[arg(long)]
    lmhead_chunks: Option<usize>,
    /// Chunks of each block's MLP (with --recompute-ffn or --recompute-block; the MLP's
    /// intermediates shrink with it).
    #[arg(long, default_value_t = 1)]
    ffn_chunks: usize,
    #[command(flatten)]
    fit_memory: FitMemoryFlag,
    #[command(flatten)]
    documents: DocumentFlags,
    /// With --doc-mask or --doc-positions, the random tokens form documents of about this
    /// many tokens, each closed by an EOS: their lengths are drawn uniformly between half
    /// and one and a half times it.
    #[arg(
        long,
        value_name = "TOKENS",
        default_value_t = 512,
        help_heading = "Model and data"
    )]
    doc_length: usize,
    /// Where to run: the GPU when the driver reports one, else the CPU.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Also time each op on the device (GPU only) and list them by time.
    #[arg(long)]
    op_times: bool,
    /// Update each block in the backward, as soon as its gradients are final (as `smelt
    /// train --optimizer-in-backward`); the benchmark's optimizer then does not clip.
    #[arg(long)]
    optimizer_in_backward: bool,
    /// Record each micro-batch's forward and backward as CUDA graphs and replay them (as
    /// `smelt train --use-cuda-graphs`).
    #[arg(long)]
    use_cuda_graphs: bool,
    /// Print one JSON line instead of the table.
    #[arg(long)]
    json: bool,
}

impl BenchArgs {
    pub fn run(self) -> Result<()> {
        let config = ModelSource::architecture(&self.model)?;
        if self.batch_size == 0 || self.seq_len == 0 {
            bail!("--batch-size and --seq-len must be at least 1");
        }
        if self.doc_length < 2 {
            bail!("--doc-length must be at least 2 (a document's tokens and its EOS)");
        }
        let matmul = self.matmul.resolve()?;
        let moments = self.moments.resolve(DType::BF16)?;
        // Under a launcher, the GPU its LOCAL_RANK names.
        let ranks = Ranks::new(1)?;
        if ranks.world() > 1 {
            bail!(
                "smelt bench times one GPU, and this process is one of {} ranks: launch it alone \
                 (torchrun --nproc-per-node 1), or time several GPUs with `smelt train --gpus N`",
                ranks.world()
            );
        }
        let device = select(self.device, ranks.device_index())?;
        let recompute = self.recompute.recompute();
        let offload = self.offload.offload(false);
        let chosen_by_hand = recompute != Recompute::default()
            || offload != Offload::default()
            || self.offload.residual()
            || self.offload.activations()
            || self.offload.weights()
            || self.offload.gradients()
            || self.lmhead_chunks.is_some()
            || self.ffn_chunks != 1;
        self.fit_memory.check(&device, chosen_by_hand)?;
        let mut options = BenchOptions {
            batch: self.batch_size,
            seq: self.seq_len,
            accumulation: self.grad_accumulation,
            steps: self.steps,
            warmup: self.warmup,
            matmul,
            memory: MemoryOptions {
                recompute,
                offload_residual: self.offload.residual(),
                offload_activations: self.offload.activations(),
                offload_weights: self.offload.weights(),
                offload_gradients: self.offload.gradients(),
                lmhead_chunks: self
                    .lmhead_chunks
                    .unwrap_or((self.batch_size * self.seq_len).div_ceil(LMHEAD_CHUNK_TOKENS)),
                ffn_chunks: self.ffn_chunks,
                layer_major: self.layer_major.per_pass(self.grad_accumulation),
            },
            offload,
            moments,
            documents: (self.documents.documents(bench::EOS)).map(|apart| BenchDocuments {
                apart,
                length: self.doc_length,
            }),
            op_times: self.op_times,
            in_backward: self.optimizer_in_backward,
            cuda_graphs: self.use_cuda_graphs,
        };
        let request = || Ok(Request::for_bench(config.clone(), &options));
        if let Some(choice) = self
            .fit_memory
            .choose(&device, SmallerBatch::Alone, request)?
        {
            options.memory = choice.memory;
            options.offload = choice.offload;
        }
        let report = match &device {
            Device::Cpu(b) => bench::run(b, config, &options, |_| Ok(None)),
            // What smelt holds on the device (every category and the kernels' scratch): the
            // peak, since nothing is allocated or freed in the step loop.
            Device::Cuda(b) => bench::run(b, config, &options, |b| {
                let report = b.memory_report()?;
                Ok(Some(report.categories.iter().map(|c| c.1 as u64).sum()))
            }),
        }?;
        let dtypes = Dtypes {
            matmul: matmul.name(),
            moments: moments_name(moments),
        };
        if self.json {
            println!("{}", self.json_line(&report, &dtypes, &device.describe()));
        } else {
            self.print_table(&report, &dtypes, &device.describe());
        }
        Ok(())
    }

    fn json_line(&self, r: &BenchReport, dtypes: &Dtypes, device: &str) -> String {
        let ms = |s: f64| s * 1e3;
        let phases: serde_json::Map<String, serde_json::Value> = PHASES
            .iter()
            .zip(r.phases_s)
            .map(|(name, s)| (name.to_string(), json!(ms(s))))
            .collect();
        json!({
            "model": self.model,
            "device": device,
            "dtype": dtypes.matmul,
            "moments": dtypes.moments,
            "batch": self.batch_size,
            "seq": self.seq_len,
            "grad_accumulation": self.grad_accumulation,
            "layer_major": r.layer_major,
            "cuda_graphs": self.use_cuda_graphs,
            "documents": self.documents.documents(bench::EOS).map(|d| json!({
                "mask": d.mask,
                "positions": d.positions,
                "length": self.doc_length,
            })),
            "steps": self.steps,
            "warmup": self.warmup,
            "tok_s": r.tokens_per_second,
            "mfu": r.mfu,
            "step_ms": ms(r.step_s),
            "peak_mem_gib": gib(r.memory_bytes),
            "memory": if r.memory_measured { "allocated" } else { "planned" },
            "offloaded_gib": gib(r.offloaded_bytes),
            "device_in_use_gib": r.device_in_use.map(gib),
            "phases_ms": phases,
            "split_step_ms": ms(r.split_step_s),
            "split_steps": SPLIT_STEPS,
            "loss": r.loss,
            "ops": r.ops.iter().map(|o| json!({
                "op": o.op,
                "calls": o.calls,
                "ms": ms(o.seconds),
            })).collect::<Vec<_>>(),
            "op_families": by_family(&r.ops).iter().map(|o| json!({
                "family": o.op,
                "calls": o.calls,
                "ms": ms(o.seconds),
            })).collect::<Vec<_>>(),
        })
        .to_string()
    }

    fn print_table(&self, r: &BenchReport, dtypes: &Dtypes, device: &str) {
        let documents = match self.documents.documents(bench::EOS) {
            Some(d) => format!(
                ", documents of ~{} tokens{}{}",
                self.doc_length,
                if d.mask { " masked" } else { "" },
                if d.positions {
                    " with their own positions"
                } else {
                    ""
                }
            ),
            None => String::new(),
        };
        let graphs = match self.use_cuda_graphs {
            true => ", passes replayed as CUDA graphs",
            false => "",
        };
        println!(
            "smelt bench: {}, batch {} × {}{documents}, matmul {}, Adam moments {}{graphs}, on {device}",
            self.model, self.batch_size, self.seq_len, dtypes.matmul, dtypes.moments
        );
        let mfu = r
            .mfu
            .map_or("n/a (no peak figure for this device)".into(), |m| {
                format!("{:.1}%", 100.0 * m)
            });
        let mut memory = if r.memory_measured {
            "allocated on the device".to_string()
        } else {
            "planned tensors".to_string()
        };
        if let Some(used) = r.device_in_use {
            memory += &format!("; {:.2} GiB in use on the device in all", gib(used));
        }
        if r.offloaded_bytes > 0 {
            memory += &format!(", + {:.2} GiB in host memory", gib(r.offloaded_bytes));
        }
        println!(
            "step {:.1} ms (median of {} after {} warmup) | {:.0} tok/s | MFU {mfu} | peak memory {:.2} GiB ({memory}) | loss {:.3}",
            r.step_s * 1e3,
            self.steps,
            self.warmup,
            r.tokens_per_second,
            gib(r.memory_bytes),
            r.loss
        );
        println!(
            "phases (median of {SPLIT_STEPS} steps synchronised after each phase; % of the median step above):"
        );
        for (name, s) in PHASES.iter().zip(r.phases_s) {
            println!(
                "  {name:<10} {:>9.2} ms {:>6.1}%",
                s * 1e3,
                100.0 * s / r.step_s
            );
        }
        let sum: f64 = r.phases_s.iter().sum();
        println!(
            "  {:<10} {:>9.2} ms {:>6.1}%",
            "sum",
            sum * 1e3,
            100.0 * sum / r.step_s
        );
        println!(
            "  (forward includes the token upload, backward the target upload, LM head and loss; other is the loss readback)"
        );
        if self.op_times {
            print_op_times(r);
        }
    }
}

/// What a report names the run's dtypes by.
struct Dtypes {
    matmul: String,
    moments: String,
}

/// `q8`, or `f32/bf16` where the two moments differ.
fn moments_name([m, v]: [DType; 2]) -> String {
    if m == v {
        m.to_string()
    } else {
        format!("{m}/{v}")
    }
}

/// The ops by device time per step, largest first, against the median step; then the same
/// by family.
fn print_op_times(r: &BenchReport) {
    if r.ops.is_empty() {
        println!("op times: not measured (only the CUDA backend times ops)");
        return;
    }
    let mut ops = r.ops.clone();
    ops.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    println!("op times (device time per step, mean of {SPLIT_STEPS} steps; % of the median step):");
    print_ops(&ops, r.step_s);
    println!("by family (an op name's first word; every matmul shape together):");
    print_ops(&by_family(&r.ops), r.step_s);
}

fn print_ops(ops: &[OpTime], step_s: f64) {
    for o in ops {
        println!(
            "  {:<44} {:>5} calls {:>9.2} ms {:>6.1}%",
            o.op,
            o.calls,
            o.seconds * 1e3,
            100.0 * o.seconds / step_s
        );
    }
    let sum: f64 = ops.iter().map(|o| o.seconds).sum();
    println!(
        "  {:<44} {:>5}       {:>9.2} ms {:>6.1}%",
        "sum",
        "",
        sum * 1e3,
        100.0 * sum / step_s
    );
}
