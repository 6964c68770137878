//! The memory planner behind `smelt plan` and `--fit-memory`: which recompute, offload,
//! ZeRO and LM-head choices fit a run into a memory budget, and which of those is fastest.
//!
//! Memory is counted from the same plans that `Transformer::new` and `AdamWState::new`
//! allocate (`ModelPlan`, `StatePlan`), so it is exact for what smelt allocates up front;
//! what it does not plan (the CUDA context, library workspaces, the kernels' scratch and
//! NCCL's buffers) is a fixed reserve. Speed is the estimate of `cost`. When nothing fits
//! at the asked batch size, smaller micro-batches with more of them per step (the same
//! tokens per optimizer step) are tried.

pub mod cost;

use anyhow::{Context, Result};

use self::cost::{StepCost, Workload};
use crate::backend::datasheet::Datasheet;
use crate::model::{
    Documents, Gradients, MatmulPrecision, ModelConfig, ModelPlan, Params, Recompute, shared_slots,
};
use crate::tensor::DType;
use crate::train::bench::{self, BenchOptions};
use crate::train::console::{Categories, category_bytes};
use crate::train::optimizer::StatePlan;
use crate::train::options::{MemoryOptions, Offload, OptimizerOptions};
use crate::train::step_losses::rows_spec;
use crate::train::{Options, zero};

/// Device memory a run needs beyond its planned tensors: the CUDA context, cuBLASLt's
/// workspace, the kernels' scratch and, with several GPUs, NCCL's buffers.
pub const DEVICE_RESERVE: u64 = 3 << 29; // 1.5 GiB

/// The run being planned, less what the plan chooses.
#[derive(Clone, Debug)]
pub struct Request {
    pub config: ModelConfig,
    pub batch: usize,
    pub seq: usize,
    pub micro_steps: usize,
    pub model_dtype: DType,
    pub matmul: MatmulPrecision,
    /// The optimizer; its `offload` and `zero_level` are the plan's to choose.
    pub optimizer: OptimizerOptions,
    pub gpus: usize,
    /// Fixed by the caller, or `None` for the plan to choose.
    pub lmhead_chunks: Option<usize>,
    /// The same for the MLP's chunks.
    pub ffn_chunks: Option<usize>,
    /// Whether ZeRO-2 may be chosen (not with `--grad-sum-after-backward`, which it cannot
    /// honour).
    pub allow_zero_2: bool,
    /// Documents packed into the sequences (`--doc-mask`, `--doc-positions`), whose spans
    /// the activations hold.
    pub documents: Option<Documents>,
    /// The most micro-steps a layer-major pass holds (`--layer-major`; 0: one at a time), the
    /// caller's choice. The plan may choose fewer, halving, to fit their activations.
    pub layer_major: usize,
    /// The passes replayed as CUDA graphs (`--use-cuda-graphs`), which nothing copying
    /// beside them can join: no activation, weight or gradient offload is chosen.
    pub cuda_graphs: bool,
}

impl Request {
    /// What `--fit-memory` asks for a training run: `options` on `gpus` GPUs, its memory
    /// flags to choose.
    pub fn for_training(options: &Options, gpus: usize) -> Result<Request> {
        Ok(Request {
            config: options.model.config()?.0,
            batch: options.batch_size,
            seq: options.seq_len,
            micro_steps: options.grad_accumulation,
            model_dtype: options.model_dtype,
            matmul: options.matmul,
            optimizer: options.optimizer.clone(),
            gpus,
            lmhead_chunks: None,
            ffn_chunks: None,
            allow_zero_2: !options.grad_sum_after_backward,
            documents: options.documents,
            layer_major: options.memory.layer_major,
            cuda_graphs: options.use_cuda_graphs,
        })
    }

    /// What `--fit-memory` asks for the run `bench::run` makes: bf16 weights and the
    /// benchmark's optimizer with its moments, on one GPU.
    pub fn for_bench(config: ModelConfig, options: &BenchOptions) -> Request {
        Request {
            config,
            batch: options.batch,
            seq: options.seq,
            micro_steps: options.accumulation,
            model_dtype: DType::BF16,
            matmul: options.matmul,
            optimizer: bench::adamw_options(options),
            gpus: 1,
            lmhead_chunks: None,
            ffn_chunks: None,
            allow_zero_2: true,
            documents: options.documents.map(|d| d.apart),
            layer_major: options.memory.layer_major,
            cuda_graphs: options.cuda_graphs,
        }
    }
}

/// Bytes available on each GPU (after `DEVICE_RESERVE`) and in host memory (for all ranks).
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub device: u64,
    pub host: u64,
}

/// What the plan chooses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub memory: MemoryOptions,
    /// The optimizer state in host memory.
    pub offload: Offload,
    pub zero_level: u8,
}

impl Choice {
    /// The `smelt train` flags that make this choice.
    pub fn flags(&self) -> Vec<String> {
        let a = self.memory;
        let r = a.recompute;
        let o = self.offload;
        let mut flags: Vec<String> = [
            (r.block, "--recompute-block"),
            (!r.block && r.ffn, "--recompute-ffn"),
            (!r.block && r.swiglu, "--recompute-swiglu"),
            (!r.block && r.norm, "--recompute-norm"),
            (!r.block && r.qkv, "--recompute-qkv"),
            (!r.block && r.att, "--recompute-att"),
            (a.offload_residual, "--offload-residual"),
            (a.offload_activations, "--offload-activations"),
            (a.offload_weights, "--offload-weights"),
            (a.offload_gradients, "--offload-gradients"),
            (o.opt_m, "--offload-opt-m"),
            (o.opt_v, "--offload-opt-v"),
            (o.master, "--offload-master"),
        ]
        .into_iter()
        .filter(|f| f.0)
        .map(|f| f.1.to_string())
        .collect();
        flags.push(format!("--lmhead-chunks {}", a.lmhead_chunks));
        if a.ffn_chunks > 1 {
            flags.push(format!("--ffn-chunks {}", a.ffn_chunks));
        }
        if a.layer_major > 0 {
            flags.push(format!("--layer-major={}", a.layer_major));
        }
        if self.zero_level > 0 {
            flags.push(format!("--zero-level {}", self.zero_level));
        }
        flags
    }
}

/// Bytes per allocation category, in allocation order.
pub type ByCategory = Vec<(&'static str, u64)>;

#[derive(Clone, Debug)]
pub struct Candidate {
    pub choice: Choice,
    /// Planned bytes on the GPU that needs the most (ZeRO shares differ by up to a tensor).
    pub device: ByCategory,
    /// Planned bytes of host memory, all ranks together.
    pub host: ByCategory,
    /// One optimizer step.
    pub cost: StepCost,
}

impl Candidate {
    pub fn device_bytes(&self) -> u64 {
        total(&self.device)
    }

    pub fn host_bytes(&self) -> u64 {
        total(&self.host)
    }

    pub fn fits(&self, budget: &Budget) -> bool {
        self.device_bytes() <= budget.device && self.host_bytes() <= budget.host
    }
}

/// The plan for one micro-batch size.
#[derive(Debug)]
pub struct Plan {
    pub batch: usize,
    pub micro_steps: usize,
    /// The micro-steps a layer-major pass holds (0: one at a time).
    pub layer_major: usize,
    /// The choices worth considering, fastest first, each needing less device memory than
    /// every faster one (only those that fit the host budget).
    pub rows: Vec<Candidate>,
    /// The fastest row that fits, if any.
    pub pick: Option<usize>,
}

/// The plan at `request`'s micro-batch, then, while nothing fits, at each smaller divisor
/// of it with more micro-steps (and, layer-major, at each before it with fewer micro-steps a
/// pass): every plan made, the last one's pick being the answer.
pub fn plan(request: &Request, gpu: &Datasheet, budget: &Budget) -> Result<Vec<Plan>> {
    let sequences = request.batch * request.micro_steps;
    let mut plans = vec![];
    for batch in (1..=request.batch)
        .rev()
        .filter(|b| request.batch.is_multiple_of(*b))
    {
        // Layer-major passes of the micro-steps the caller allows, or where nothing fits, of
        // half as many, a quarter, ... down to two: fewer micro-steps a pass keep fewer
        // residual streams, for more crossings of the streamed weights.
        let pass_sizes =
            std::iter::successors(Some(request.layer_major), |&n| (n >= 4).then_some(n / 2));
        for layer_major in pass_sizes {
            let request = Request {
                batch,
                micro_steps: sequences / batch,
                layer_major,
                ..request.clone()
            };
            let plan = plan_at(&request, gpu, budget)?;
            let found = plan.pick.is_some();
            plans.push(plan);
            if found {
                return Ok(plans);
            }
        }
    }
    Ok(plans)
}

/// What `fit` found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fit {
    /// The fastest choice that fits at the asked micro-batch.
    Chosen(Choice),
    /// Nothing fits at the asked micro-batch; this smaller one, with this many micro-steps
    /// (the same sequences per step), is the largest where something does.
    Smaller { batch: usize, micro_steps: usize },
    /// Nothing fits even one sequence per micro-batch.
    Nothing,
}

/// The fastest choice that fits at `request`'s own micro-batch (what `--fit-memory`
/// applies), or what the plan found instead. The caller names the flags, which differ by
/// command.
pub fn fit(request: &Request, gpu: &Datasheet, budget: &Budget) -> Result<Fit> {
    let plans = plan(request, gpu, budget)?;
    let last = plans
        .last()
        .expect("at least the asked micro-batch is planned");
    Ok(match last.pick {
        Some(i) if last.batch == request.batch => Fit::Chosen(last.rows[i].choice),
        Some(_) => Fit::Smaller {
            batch: last.batch,
            micro_steps: last.micro_steps,
        },
        None => Fit::Nothing,
    })
}

fn plan_at(request: &Request, gpu: &Datasheet, budget: &Budget) -> Result<Plan> {
    let mut all = candidates(request, gpu)?;
    all.retain(|c| c.host_bytes() <= budget.host);
    // At equal cost, the choice that takes less host memory first: it is kept, and one
    // that offloads more for no speed is listed only for needing less device memory.
    all.sort_by(|a, b| {
        (a.cost.total().total_cmp(&b.cost.total()))
            .then(a.host_bytes().cmp(&b.host_bytes()))
            .then(a.device_bytes().cmp(&b.device_bytes()))
    });
    let mut rows: Vec<Candidate> = vec![];
    for c in all {
        if rows
            .last()
            .is_none_or(|r| c.device_bytes() < r.device_bytes())
        {
            rows.push(c);
        }
    }
    let pick = rows.iter().position(|c| c.fits(budget));
    Ok(Plan {
        batch: request.batch,
        micro_steps: request.micro_steps,
        layer_major: request.layer_major,
        rows,
        pick,
    })
}

/// Every choice, with its memory and cost. The model's memory depends only on recompute,
/// the activations' offload and the LM-head and MLP chunks; the gradients' and the
/// optimizer's only on offload and ZeRO. Each is planned once per value and the two are
/// combined.
pub fn candidates(request: &Request, gpu: &Datasheet) -> Result<Vec<Candidate>> {
    let r = request;
    let tokens = r.batch * r.seq;
    // Powers of two down to chunks of 1024 tokens: fewer rows than that leave the matmuls
    // small, for little memory.
    let powers = || {
        std::iter::successors(Some(1), |c| Some(c * 2))
            .take_while(|&c| c == 1 || tokens / c >= 1024)
            .collect::<Vec<usize>>()
    };
    let chunks = match r.lmhead_chunks {
        Some(n) => vec![n],
        None => powers(),
    };
    // (the blocks' weights, their gradients) streamed from host memory: one GPU only.
    let streaming: Vec<(bool, bool)> = match (r.gpus, r.cuda_graphs) {
        (1, false) => vec![(false, false), (false, true), (true, false), (true, true)],
        _ => vec![(false, false)],
    };
    let mut models = vec![];
    for recompute in recompute_choices() {
        // FP8 in a pass of several micro-batches remakes its input copies in the recompute:
        // only the choices that rerun every linear are offered.
        if r.layer_major > 1 && r.matmul.is_fp8() && !r.matmul.runs_layer_major(recompute) {
            continue;
        }
        // MLP chunks shrink only recomputed intermediates, and FP8 scales by whole tensors.
        let chunkable = recompute.gate_up() && !r.matmul.is_fp8();
        let ffn_chunks = match (r.ffn_chunks, chunkable) {
            (Some(n), true) => vec![n],
            (Some(1) | None, false) => vec![1],
            (Some(_), false) => continue,
            (None, true) => powers(),
        };
        // (the residual stream, the other activations kept per layer)
        let activation_offloads = match r.cuda_graphs {
            false => &[(false, false), (true, false), (false, true), (true, true)][..],
            true => &[(false, false)],
        };
        for &(offload_residual, offload_activations) in activation_offloads {
            for &(offload_weights, offload_gradients) in &streaming {
                for &lmhead_chunks in &chunks {
                    for &ffn_chunks in &ffn_chunks {
                        let memory = MemoryOptions {
                            recompute,
                            offload_residual,
                            offload_activations,
                            lmhead_chunks,
                            ffn_chunks,
                            offload_weights,
                            offload_gradients,
                            layer_major: r.layer_major,
                        };
                        models.push(model_memory(r, memory)?);
                    }
                }
            }
        }
    }
    let layout = Params::layout(&r.config, r.model_dtype);
    let mut states = vec![];
    // ZeRO-2 and -3 with micro-steps one at a time send every micro-batch's block gradients,
    // a cost `cost` does not know; they are offered only without, or layer-major (which sends
    // each block's sum once).
    let sends_once = r.micro_steps == 1 || r.layer_major == r.micro_steps;
    let zero_levels = match r.gpus {
        1 => vec![0],
        _ if r.allow_zero_2 && sends_once => vec![0, 1, 2, 3],
        _ => vec![0, 1],
    };
    for offload in offload_choices(r.optimizer.master_dtype.is_some()) {
        for &zero_level in &zero_levels {
            let options = OptimizerOptions {
                offload,
                zero_level,
                ..r.optimizer.clone()
            };
            let owners = zero::owners_of(&layout, r.gpus, &options);
            let ranks: Vec<StatePlan> = (0..r.gpus)
                .map(|rank| StatePlan::new(&layout, rank, r.gpus, &options))
                .collect();
            // The weights and gradients are counted with the optimizer state, whose sharding
            // they follow (except where they stream, when the model counts them).
            let device = (ranks.iter().enumerate())
                .map(|(rank, s)| {
                    let kept = owners.as_ref().and_then(|o| o.kept_blocks(rank));
                    let kept_weights = kept.as_deref().filter(|_| zero_level >= 3);
                    let weights = ("weights", shared_slots::specs(&layout, "", kept_weights));
                    let grads = (
                        "gradients",
                        shared_slots::specs(&layout, "grad.", kept.as_deref()),
                    );
                    (bytes(&[weights]), bytes(&[grads]), bytes(&s.memory()))
                })
                .max_by_key(|(weights, grads, state)| total(weights) + total(grads) + total(state))
                .expect("at least one rank");
            let per_rank: Vec<ByCategory> = ranks.iter().map(|s| bytes(&s.offloaded())).collect();
            let busiest_bus = per_rank.iter().map(total).max().unwrap_or(0);
            let mut host = per_rank[0].clone();
            for rank in &per_rank[1..] {
                for (all, one) in host.iter_mut().zip(rank) {
                    all.1 += one.1;
                }
            }
            states.push((offload, zero_level, device, host, busiest_bus));
        }
    }
    let workload = Workload {
        config: &r.config,
        seq: r.seq,
        tokens,
        micro_steps: r.micro_steps,
        element_bytes: r.model_dtype.size_bytes(),
        fp8: r.matmul.is_fp8(),
    };
    let mut out = Vec::with_capacity(models.len() * states.len());
    for m in &models {
        for (offload, zero_level, (weights, grads, state), host, bus) in &states {
            let choice = Choice {
                memory: m.memory,
                offload: *offload,
                zero_level: *zero_level,
            };
            let weights = weights.iter().filter(|_| !m.memory.offload_weights);
            let grads = grads.iter().filter(|_| !m.memory.offload_gradients);
            out.push(Candidate {
                choice,
                device: (m.device.iter().chain(weights).chain(grads).chain(state))
                    .cloned()
                    .collect(),
                // Every rank offloads its own activations.
                host: (m.host.iter())
                    .map(|&(name, bytes)| (name, bytes * r.gpus as u64))
                    .chain(host.iter().copied())
                    .collect(),
                cost: workload.cost(gpu, &choice, bus + m.bus, m.activation_block_bytes),
            });
        }
    }
    Ok(out)
}

/// What one choice of `MemoryOptions` holds of the model, on the device and in host memory.
struct ModelMemory {
    memory: MemoryOptions,
    device: ByCategory,
    host: ByCategory,
    /// What each block's offloaded activations move over the bus each way.
    activation_block_bytes: u64,
    /// What the update moves over the bus each way: the streamed weights (read and written)
    /// and gradients (read).
    bus: u64,
}

fn model_memory(r: &Request, memory: MemoryOptions) -> Result<ModelMemory> {
    let options = memory.model_options(
        r.batch,
        r.seq,
        r.model_dtype,
        r.matmul,
        Gradients::All,
        r.documents,
    );
    let model = ModelPlan::new(&r.config, &options)?;
    let losses = model.losses();
    let losses = rows_spec(r.micro_steps, losses.numel(), losses.dtype);
    let mut device = model.memory();
    // Weights and gradients on the device are counted with the optimizer state
    // (`candidates`), but for the streamed ones.
    device.retain(|c| match c.0 {
        "weights" => memory.offload_weights,
        "gradients" => memory.offload_gradients,
        _ => true,
    });
    device.push(("losses", vec![losses]));
    let host = bytes(&model.offloaded());
    let in_host = |category: &str| {
        host.iter()
            .filter(|c| c.0 == category)
            .map(|c| c.1)
            .sum::<u64>()
    };
    Ok(ModelMemory {
        memory,
        device: bytes(&device),
        activation_block_bytes: in_host("activations") / r.config.num_layers as u64,
        bus: in_host("weights") + in_host("gradients"),
        host,
    })
}

/// The bytes of each category of planned tensors.
fn bytes(memory: &Categories) -> ByCategory {
    (memory.iter())
        .map(|(name, specs)| (*name, category_bytes(specs)))
        .collect()
}

fn total(categories: &ByCategory) -> u64 {
    categories.iter().map(|c| c.1).sum()
}

fn recompute_choices() -> Vec<Recompute> {
    let mut out: Vec<Recompute> = (0..32u32)
        .map(|bits| Recompute {
            swiglu: bits & 1 != 0,
            norm: bits & 2 != 0,
            qkv: bits & 4 != 0,
            att: bits & 8 != 0,
            ffn: bits & 16 != 0,
            block: false,
        })
        .filter(|r| !(r.ffn && r.swiglu))
        .collect();
    out.push(Recompute {
        block: true,
        ..Recompute::default()
    });
    out
}

/// Every combination of the offload flags (`--offload-master` only with a master copy).
fn offload_choices(master: bool) -> Vec<Offload> {
    (0..8u32)
        .map(|bits| Offload {
            opt_m: bits & 1 != 0,
            opt_v: bits & 2 != 0,
            master: bits & 4 != 0,
        })
        .filter(|o| master || !o.master)
        .collect()
}

/// Host memory a plan may pin: the kernel's estimate of what new allocations can take
/// without swapping, less a tenth for what is not planned (the data loader, the page cache
/// the data files are read through, the process's own allocations), since pinned memory
/// cannot be swapped out when those grow.
pub fn available_host_memory() -> Result<u64> {
    let path = "/proc/meminfo";
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading {path} for the host memory"))?;
    let kib = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .with_context(|| format!("{path} has no MemAvailable line"))?;
    Ok(kib * 1024 / 10 * 9)
}
