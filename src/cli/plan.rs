//! `smelt plan`: which memory flags a training run needs to fit, and the fastest of them
//! (see `plan`), as a table or, with `--json`, one JSON object.

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;

use super::flags::{LayerMajorFlag, PrecisionFlags, gib_bytes};
use crate::backend::datasheet::{self, Datasheet};
use crate::backend::select::{Device, DeviceChoice, select};
use crate::plan::{
    self, Budget, ByCategory, Candidate, DEVICE_RESERVE, Plan, Request, available_host_memory,
};
use crate::tensor::DType;
use crate::train::ModelSource;
use crate::train::bench::bf16_adamw_options;
use crate::train::console::gib;
use crate::train::options::OptimizerOptions;

#[derive(Args, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Plan a training run's memory: the recompute, offload and LM-head flags that fit it, fastest first",
    after_help = "Takes the model, batch and precision flags of `smelt train` and lists the \
choices of --recompute-*, --offload-*, --lmhead-chunks (and, with --gpus, --zero-level) worth \
considering: fastest first, each needing less GPU memory than every faster one. Memory is \
counted from the tensors smelt allocates, plus 1.5 GiB per GPU for the CUDA context, library \
workspaces and the kernels' scratch. The step time is an estimate from the GPU's datasheet \
(docs/memory.md says how). When nothing fits, smaller micro-batches with more \
--grad-accumulation (the same sequences per step) are tried."
)]
pub struct PlanArgs {
    /// A HF model directory (only config.json is read) or a built-in architecture
    /// (qwen2.5-0.5b, -1.5b, -3b, qwen2-100m, qwen3-0.6b, -1.7b, -4b, -8b, llama-3.2-1b,
    /// llama-3-8b).
    #[arg(long, value_name = "DIR|NAME")]
    model: String,
    /// Sequences per micro-batch, on each GPU.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accumulation: usize,
    #[command(flatten)]
    layer_major: LayerMajorFlag,
    /// The run replays its passes as CUDA graphs (`smelt train --use-cuda-graphs`): no
    /// offload of the activations, weights or gradients is chosen.
    #[arg(long)]
    use_cuda_graphs: bool,
    #[command(flatten)]
    precision: PrecisionFlags,
    /// Keep this many LM-head chunks instead of choosing.
    #[arg(long)]
    lmhead_chunks: Option<usize>,
    /// GPUs the run trains on (data parallel; each holds its own micro-batch).
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Memory of each GPU, in GiB [default: what GPU 0 has free].
    #[arg(long, value_name = "GIB")]
    device_memory: Option<f64>,
    /// Host memory the offloaded state may take, in GiB [default: nine tenths of
    /// MemAvailable in /proc/meminfo].
    #[arg(long, value_name = "GIB")]
    host_memory: Option<f64>,
    /// The GPU whose datasheet the step time is estimated for [default: GPU 0, or an H100
    /// where there is none].
    #[arg(long, value_name = "NAME")]
    gpu: Option<String>,
    /// Where to look for the GPU.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

impl PlanArgs {
    pub fn run(self) -> Result<()> {
        let positive = [
            ("--batch-size", self.batch_size),
            ("--seq-len", self.seq_len),
            ("--grad-accumulation", self.grad_accumulation),
            ("--gpus", self.gpus),
        ];
        if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
            bail!("{flag} must be at least 1");
        }
        let precision = self.precision.resolve(DType::BF16)?;
        let request = Request {
            config: ModelSource::architecture(&self.model)?,
            batch: self.batch_size,
            seq: self.seq_len,
            micro_steps: self.grad_accumulation,
            model_dtype: precision.model_dtype,
            matmul: precision.matmul,
            optimizer: OptimizerOptions {
                opt_m_dtype: precision.opt_m_dtype,
                opt_v_dtype: precision.opt_v_dtype,
                master_dtype: precision.master_dtype,
                ..bf16_adamw_options()
            },
            gpus: self.gpus,
            lmhead_chunks: self.lmhead_chunks,
            ffn_chunks: None,
            allow_zero_2: true,
            documents: None,
            layer_major: self.layer_major.per_pass(self.grad_accumulation),
            cuda_graphs: self.use_cuda_graphs,
        };
        let (gpu, free) = self.gpu()?;
        let device = match (self.device_memory, free) {
            (Some(gib), _) => gib_bytes(gib, "--device-memory")?,
            (None, Some(free)) => free,
            (None, None) => bail!(
                "--device-memory: there is no GPU here to ask; give each GPU's memory in GiB \
                 (80 for an H100)"
            ),
        };
        let budget = Budget {
            device: device.saturating_sub(DEVICE_RESERVE),
            host: match self.host_memory {
                Some(gib) => gib_bytes(gib, "--host-memory")?,
                None => available_host_memory().context("pass --host-memory")?,
            },
        };
        let plans = plan::plan(&request, gpu, &budget)?;
        if self.json {
            println!("{}", self.json(gpu, &budget, &plans));
        } else {
            self.print(gpu, device, &budget, &plans);
        }
        if plans.last().is_none_or(|p| p.pick.is_none()) {
            bail!(
                "nothing fits in {:.1} GiB per GPU, even one sequence per micro-batch with \
                 everything recomputed and offloaded: use more GPUs (--gpus with --zero-level 1), \
                 shorter sequences or a smaller model",
                gib(budget.device)
            );
        }
        Ok(())
    }

    /// The datasheet to estimate with, and GPU 0's free memory where there is a GPU.
    fn gpu(&self) -> Result<(&'static Datasheet, Option<u64>)> {
        let named = |name: &str, flag: &str| {
            datasheet::datasheet(name).with_context(|| {
                format!(
                    "{flag}{name}: no datasheet figures for this GPU; pass --gpu with one of {}",
                    datasheet::known().join(", ")
                )
            })
        };
        let present = match select(self.device, 0)? {
            Device::Cuda(b) => Some((b.name().to_string(), b.memory_report()?.free as u64)),
            Device::Cpu(_) => None,
        };
        let free = present.as_ref().map(|p| p.1);
        let sheet = match (&self.gpu, &present) {
            (Some(name), _) => named(name, "--gpu ")?,
            (None, Some((name, _))) => named(name, "GPU 0 is ")?,
            (None, None) => named("H100", "")?,
        };
        Ok((sheet, free))
    }

    fn print(&self, gpu: &Datasheet, device: u64, budget: &Budget, plans: &[Plan]) {
        println!(
            "smelt plan: {}, {} × {} tokens per micro-batch on {} GPU(s), {} micro-batch(es) per step",
            self.model, self.batch_size, self.seq_len, self.gpus, self.grad_accumulation
        );
        println!(
            "budget: {:.1} GiB per GPU ({:.1} GiB less {:.1} for the CUDA context, workspaces \
             and scratch), {:.1} GiB of host memory",
            gib(budget.device),
            gib(device),
            gib(DEVICE_RESERVE),
            gib(budget.host)
        );
        println!(
            "step time: estimated for an {} ({:.0} TFLOP/s bf16, {:.2} TB/s), offload at {:.0} GB/s",
            gpu.key,
            gpu.bf16_flops / 1e12,
            gpu.memory_bandwidth / 1e12,
            plan::cost::BUS_BYTES_PER_S / 1e9
        );
        for p in plans {
            let passes = match p.layer_major {
                0 => String::new(),
                n => format!(" --layer-major={n}"),
            };
            println!(
                "\n--batch-size {} --grad-accumulation {}{passes}:",
                p.batch, p.micro_steps
            );
            println!(
                "  {:>10} {:>9} {:>10} {:>11}  flags",
                "GPU GiB", "host GiB", "est. step", "est. tok/s"
            );
            let mut shown: Option<u64> = None;
            for (i, c) in p.rows.iter().enumerate() {
                // Rows a few percent apart in memory add little: each shown row needs at
                // least a tenth less than the one above it.
                let picked = Some(i) == p.pick;
                if !picked && shown.is_some_and(|s| c.device_bytes() * 10 > s * 9) {
                    continue;
                }
                shown = Some(c.device_bytes());
                let note = match (picked, c.fits(budget)) {
                    (true, _) => "  <- fastest that fits",
                    (false, false) => "  (does not fit)",
                    (false, true) => "",
                };
                println!(
                    "  {:>10.2} {:>9.2} {:>7.1} ms {:>11.0}  {}{note}",
                    gib(c.device_bytes()),
                    gib(c.host_bytes()),
                    c.cost.total() * 1e3,
                    self.tokens_per_second(p, c),
                    c.choice.flags().join(" ")
                );
            }
        }
        if let Some(p) = plans.last()
            && let Some(i) = p.pick
        {
            let pick = &p.rows[i];
            // Categories under a MiB (the losses, the norm's scalar) would show as 0.00.
            let listed = |categories: &ByCategory| -> Vec<String> {
                (categories.iter())
                    .filter(|c| c.1 >= 1 << 20)
                    .map(|(name, bytes)| format!("{name} {:.2}", gib(*bytes)))
                    .collect()
            };
            println!("\nits GiB per GPU: {}", listed(&pick.device).join(", "));
            if pick.host_bytes() > 0 {
                println!("in host memory: {}", listed(&pick.host).join(", "));
            }
            let gpus = match self.gpus {
                1 => String::new(),
                n => format!(" --gpus {n}"),
            };
            println!(
                "smelt train flags:{gpus} --batch-size {} --grad-accumulation {} {}",
                p.batch,
                p.micro_steps,
                pick.choice.flags().join(" ")
            );
        }
    }

    fn tokens_per_second(&self, p: &Plan, c: &Candidate) -> f64 {
        (self.gpus * p.batch * p.micro_steps * self.seq_len) as f64 / c.cost.total()
    }

    fn json(&self, gpu: &Datasheet, budget: &Budget, plans: &[Plan]) -> serde_json::Value {
        let plans: Vec<_> = plans
            .iter()
            .map(|p| {
                let rows: Vec<_> = p
                    .rows
                    .iter()
                    .map(|c| {
                        json!({
                            "flags": c.choice.flags(),
                            "device": by_name(&c.device),
                            "host": by_name(&c.host),
                            "step_ms": c.cost.total() * 1e3,
                            "tok_s": self.tokens_per_second(p, c),
                            "fits": c.fits(budget),
                        })
                    })
                    .collect();
                json!({
                    "batch_size": p.batch,
                    "grad_accumulation": p.micro_steps,
                    "layer_major": p.layer_major,
                    "rows": rows,
                    "pick": p.pick,
                })
            })
            .collect();
        json!({
            "model": self.model,
            "gpu": gpu.key,
            "device_budget_bytes": budget.device,
            "host_budget_bytes": budget.host,
            "plans": plans,
        })
    }
}

fn by_name(categories: &ByCategory) -> serde_json::Value {
    (categories.iter())
        .map(|(name, bytes)| (name.to_string(), json!(bytes)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}
