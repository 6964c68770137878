//! The transformer's state for one (batch, seq) shape: parameters, gradients, activations
//! and the RoPE table, each category allocated once.

use std::cell::RefCell;

use anyhow::{Result, bail, ensure};

use super::activations::{ActivationOffload, ActivationPlan, ActivationShape, Activations};
use super::config::ModelConfig;
use super::documents::Documents;
use super::fp8::Fp8Plan;
use super::int8::Int8Plan;
use super::linear::{MatmulPrecision, QuantizedShape};
use super::linear_layers::LinearLayers;
use super::params::{ParamSpec, Params};
use super::recompute::{Recompute, RecomputePlan};
use super::recorded::PassRecordings;
use super::shared_slots;
use super::streaming::{SplitSpecs, Streams, assemble, split_specs};
use crate::backend::{AttnShape, Backend};
use crate::tensor::{DType, Tensor, TensorSpec};

/// How the model is laid out in memory and run.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelOptions {
    pub batch: usize,
    pub seq: usize,
    /// Dtype of weights, gradients and activations.
    pub dtype: DType,
    pub recompute: Recompute,
    /// Keep the residual stream (each block's input) in pinned host memory, copied out in
    /// the forward and back in the backward beside the blocks' work.
    pub offload_residual: bool,
    /// The same for every other activation a layer keeps for its backward
    /// (`stash::Stash`).
    pub offload_activations: bool,
    /// The LM head and loss run over the tokens in this many chunks, so the full
    /// `[B·T, V]` logits never exist at once.
    pub lmhead_chunks: usize,
    /// Each block's MLP runs over the tokens in this many chunks, so its recomputed
    /// intermediates exist one chunk at a time (`mlp`).
    pub ffn_chunks: usize,
    /// What the blocks' linear layers multiply in.
    pub matmul: MatmulPrecision,
    pub gradients: Gradients,
    pub weights: Weights,
    /// The blocks' weights in pinned host memory, streamed through two device slots
    /// (`streaming`).
    pub offload_weights: bool,
    /// The same for the blocks' gradients.
    pub offload_gradients: bool,
    /// Documents packed into each sequence, kept apart in attention or in RoPE's positions;
    /// `None` trains each sequence as one.
    pub documents: Option<Documents>,
    /// The micro-batches one pass holds and runs layer-major (`layer_major`): each block
    /// runs on all of them before the next block does. 1 runs a micro-batch a pass.
    pub micro_batches: usize,
    /// Record the training forward and backward on their second run and replay them from
    /// then on (`recorded`: CUDA graphs, `--use-cuda-graphs`).
    pub record_passes: bool,
}

/// Which parameter gradients have memory.
#[derive(Clone, Debug, PartialEq)]
pub enum Gradients {
    /// Every parameter's has its own.
    All,
    /// ZeRO-2: only block l's with `kept[l]` have their own; the other blocks share two
    /// slots (`grads`).
    Kept(Vec<bool>),
    /// None: the model only runs forward (generation) or only holds weights (export).
    Absent,
}

impl Gradients {
    fn kept(&self) -> Option<&[bool]> {
        match self {
            Gradients::Kept(kept) => Some(kept),
            Gradients::All | Gradients::Absent => None,
        }
    }
}

/// Which blocks' weights have memory of their own.
#[derive(Clone, Debug, PartialEq)]
pub enum Weights {
    /// Every block's.
    All,
    /// ZeRO-3: only block l's with `kept[l]`; the other blocks share two slots, which each
    /// pass fills before it reads them (`BlockEvent::Weights`).
    Kept(Vec<bool>),
}

impl Weights {
    pub fn kept(&self) -> Option<&[bool]> {
        match self {
            Weights::Kept(kept) => Some(kept),
            Weights::All => None,
        }
    }
}

impl ModelOptions {
    /// One sequence of `seq` tokens, for a model that only runs forward (generation) or only
    /// holds weights (export): no gradients, every activation recomputed, so each has one
    /// shared buffer, and one row of logits at a time (`logits_at`).
    pub fn forward_only(seq: usize, dtype: DType) -> Self {
        Self {
            batch: 1,
            seq,
            dtype,
            recompute: Recompute::all(),
            offload_residual: false,
            offload_activations: false,
            lmhead_chunks: seq,
            ffn_chunks: 1,
            matmul: MatmulPrecision::Native,
            gradients: Gradients::Absent,
            weights: Weights::All,
            offload_weights: false,
            offload_gradients: false,
            documents: None,
            micro_batches: 1,
            record_passes: false,
        }
    }
}

pub struct Transformer<B: Backend> {
    pub config: ModelConfig,
    pub options: ModelOptions,
    pub layout: Params<ParamSpec>,
    pub params: Params<Tensor<B>>,
    /// `None` with `Gradients::Absent` (`grads()`).
    grads: Option<Params<Tensor<B>>>,
    /// The activations of each micro-batch a pass holds (`ModelOptions::micro_batches`).
    pub(crate) micro_batches: Vec<Activations<B>>,
    /// How many of them the last layer-major forward ran, for its backward (`layer_major`).
    pub(crate) in_pass: usize,
    /// `[T, head_dim/2, 2]`: (cos, sin) per position and rotated pair.
    pub(crate) rope: Tensor<B>,
    /// The blocks' linear layers, in the model's dtype or FP8.
    pub(crate) linears: LinearLayers<B>,
    /// What the backward's recompute pass reruns of each block.
    pub(crate) recompute: RecomputePlan,
    /// The blocks' weights and gradients where they are streamed from host memory.
    pub(crate) streams: Streams<B>,
    /// What each allocation holds, for the memory table.
    pub memory: Vec<(&'static str, Vec<TensorSpec>)>,
    /// The same for the allocations in host memory.
    pub offloaded: Vec<(&'static str, Vec<TensorSpec>)>,
    /// Unique among the process's models: what a KV cache's recorded pass names the model
    /// whose buffers it runs on by (`decode`).
    pub(crate) id: u64,
    /// The training passes' recordings, with `ModelOptions::record_passes`.
    pub(crate) recordings: RefCell<PassRecordings<B>>,
}

/// The next model's `id`.
static NEXT_MODEL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Every tensor a model of one config and shape holds, by allocation category, before
/// anything is allocated: what `Transformer::new` allocates, and what `smelt plan` counts.
pub struct ModelPlan {
    layout: Params<ParamSpec>,
    weights: SplitSpecs,
    grads: Option<SplitSpecs>,
    activations: ActivationPlan,
    rope: TensorSpec,
    fp8: Option<Fp8Plan>,
    int8: Option<Int8Plan>,
}

/// That the passes `options` asks for can be recorded (`ModelOptions::record_passes`): a
/// recording replays the ops of the compute stream with the arguments they were recorded
/// with, so nothing may copy beside them on other streams, wait for another rank, or take a
/// seed that changes with each micro-batch.
fn check_recordable(options: &ModelOptions) -> Result<()> {
    let stochastic = matches!(options.matmul, MatmulPrecision::Int8(o) if o.stochastic);
    let sharded = options.gradients.kept().is_some() || options.weights.kept().is_some();
    let refused = [
        ("--offload-residual", options.offload_residual),
        ("--offload-activations", options.offload_activations),
        ("--offload-weights", options.offload_weights),
        ("--offload-gradients", options.offload_gradients),
        ("--layer-major", options.micro_batches > 1),
        ("--zero-level 2 or 3", sharded),
        ("--int8-stochastic-rounding", stochastic),
    ];
    match refused.into_iter().find(|(_, on)| *on) {
        Some((flag, _)) => bail!(
            "--use-cuda-graphs cannot be used with {flag} yet: a recorded pass replays the \
             compute stream's ops alone, with the arguments they were recorded with; leave one \
             of them out"
        ),
        None => Ok(()),
    }
}

impl ModelPlan {
    pub fn new(config: &ModelConfig, options: &ModelOptions) -> Result<Self> {
        ensure!(
            options.batch > 0 && options.seq > 0,
            "batch size and sequence length must be positive"
        );
        ensure!(
            config.num_layers > 0,
            "the model has no layers (`num_hidden_layers` must be at least 1)"
        );
        ensure!(
            options.lmhead_chunks > 0 && options.lmhead_chunks <= options.batch * options.seq,
            "--lmhead-chunks must be between 1 and batch·seq = {}",
            options.batch * options.seq
        );
        ensure!(
            options.ffn_chunks > 0 && options.ffn_chunks <= options.batch * options.seq,
            "--ffn-chunks must be between 1 and batch·seq = {}",
            options.batch * options.seq
        );
        if options.ffn_chunks > 1 {
            ensure!(
                options.recompute.gate_up(),
                "--ffn-chunks {} needs --recompute-ffn or --recompute-block: otherwise every \
                 layer keeps its MLP activations whole, and chunks would save nothing",
                options.ffn_chunks
            );
            ensure!(
                !options.matmul.is_fp8(),
                "--ffn-chunks {} cannot be used with FP8 matmuls, which scale by the abs-max of \
                 the whole MLP input; leave one of them out",
                options.ffn_chunks
            );
        }
        ensure!(
            options.micro_batches > 0,
            "a pass holds at least one micro-batch"
        );
        ensure!(
            options.micro_batches == 1 || options.matmul.runs_layer_major(options.recompute),
            "--layer-major cannot be used with --int8-stochastic-rounding, which rounds by one \
             micro-batch's seed at a time, nor with FP8 matmuls without --recompute-block: FP8 \
             keeps one copy of each layer's inputs for the backward, which the recompute pass \
             makes again for each micro-batch"
        );
        if options.record_passes {
            check_recordable(options)?;
        }
        if options.matmul != MatmulPrecision::Native {
            ensure!(
                options.dtype == DType::BF16,
                "FP8 and INT8 matmuls write bf16 outputs; the model dtype must be bf16, not {}",
                options.dtype
            );
        }
        let stat_dtype = if options.dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let layout = Params::layout(config, options.dtype);
        for kept in [options.gradients.kept(), options.weights.kept()]
            .into_iter()
            .flatten()
        {
            ensure!(
                kept.len() == config.num_layers,
                "kept blocks given for {} blocks of {}",
                kept.len(),
                config.num_layers
            );
        }
        ensure!(
            !(options.weights.kept().is_some() && options.offload_weights),
            "--zero-level 3 and --offload-weights cannot be used together; choose one"
        );
        ensure!(
            !(options.offload_gradients && options.gradients.kept().is_some()),
            "--offload-gradients cannot be used with --zero-level 2, which keeps each block's \
             gradients on its own GPU; leave one of them out"
        );
        let weights = match options.weights.kept() {
            Some(kept) => SplitSpecs {
                device: shared_slots::specs(&layout, "", Some(kept)),
                host: vec![],
            },
            None => split_specs(&layout, "", options.offload_weights),
        };
        let grads = match &options.gradients {
            Gradients::Absent => None,
            Gradients::All => Some(split_specs(&layout, "grad.", options.offload_gradients)),
            Gradients::Kept(kept) => Some(SplitSpecs {
                device: shared_slots::specs(&layout, "grad.", Some(kept)),
                host: vec![],
            }),
        };
        let n = options.batch * options.seq;
        let shape = ActivationShape {
            tokens: n,
            batch: options.batch,
            seq: options.seq,
            layers: config.num_layers,
            hidden: config.hidden_size,
            q_dim: config.q_dim(),
            qkv_dim: config.qkv_dim(),
            intermediate: config.intermediate_size,
            heads: config.num_heads,
            vocab: config.vocab_size,
            head_rows: n.div_ceil(options.lmhead_chunks),
            ffn_rows: n.div_ceil(options.ffn_chunks),
            qk_norm_heads: config
                .qk_norm
                .then_some(config.num_heads + config.num_kv_heads),
            documents: options.documents.is_some(),
            micro_batches: options.micro_batches,
        };
        let activations = ActivationPlan::new(
            &shape,
            options.recompute,
            options.matmul.is_fp8(),
            ActivationOffload {
                residual: options.offload_residual,
                kept: options.offload_activations,
            },
            options.dtype,
            stat_dtype,
        );
        let rope = TensorSpec::new("rope", &[options.seq, config.head_dim / 2, 2], stat_dtype);
        let quantized = QuantizedShape {
            tokens: n,
            layers: config.num_layers,
            max_in: config
                .hidden_size
                .max(config.q_dim())
                .max(config.intermediate_size),
            max_out: config
                .qkv_dim()
                .max(config.hidden_size)
                .max(2 * config.intermediate_size),
            recompute: options.recompute,
            micro_batches: options.micro_batches,
            weight_slots: match (options.weights.kept(), options.offload_weights) {
                (Some(kept), _) => shared_slots::slots_of(kept),
                (None, true) => shared_slots::slots_of(&vec![false; config.num_layers]),
                (None, false) => vec![None; config.num_layers],
            },
        };
        let fp8 = Fp8Plan::new(options.matmul, &quantized, &layout);
        let int8 = Int8Plan::new(options.matmul, &quantized, &layout);
        Ok(ModelPlan {
            layout,
            weights,
            grads,
            activations,
            rope,
            fp8,
            int8,
        })
    }

    /// The per-token losses of a pass (`Transformer::losses`).
    pub fn losses(&self) -> &TensorSpec {
        self.activations.losses()
    }

    /// The allocations, in the order `Transformer::new` makes them: each category's name
    /// and tensors (the RoPE table is carved from the activations' allocation).
    pub fn memory(&self) -> Vec<(&'static str, Vec<TensorSpec>)> {
        let mut activations = self.activations.specs.clone();
        activations.push(self.rope.clone());
        let mut memory = vec![("weights", self.weights.device.clone())];
        memory.extend(self.grads.as_ref().map(|g| ("gradients", g.device.clone())));
        memory.push(("activations", activations));
        memory.extend(self.fp8.as_ref().map(|f| ("fp8", f.specs.clone())));
        memory.extend(self.int8.as_ref().map(|i| ("int8", i.specs.clone())));
        memory
    }

    /// The allocations in host memory: the streamed blocks' weights and gradients and the
    /// offloaded activations, those that are.
    pub fn offloaded(&self) -> Vec<(&'static str, Vec<TensorSpec>)> {
        let grads = self.grads.as_ref().map_or(&[][..], |g| &g.host[..]);
        [
            ("weights", &self.weights.host[..]),
            ("gradients", grads),
            ("activations", &self.activations.offloaded[..]),
        ]
        .into_iter()
        .filter(|(_, specs)| !specs.is_empty())
        .map(|(category, specs)| (category, specs.to_vec()))
        .collect()
    }
}

impl<B: Backend> Transformer<B> {
    pub fn new(backend: &B, config: ModelConfig, options: ModelOptions) -> Result<Self> {
        Self::build(backend, config, options, None)
    }

    /// A model of another shape over `other`'s weights, which it shares rather than copies
    /// (as generation runs a prompt in one pass and then a token a pass).
    pub fn sharing_weights(backend: &B, other: &Self, options: ModelOptions) -> Result<Self> {
        ensure!(
            options.dtype == other.options.dtype,
            "a model of {} cannot share the weights of one of {}",
            options.dtype,
            other.options.dtype
        );
        let weights = other.params.clone();
        Self::build(backend, other.config.clone(), options, Some(weights))
    }

    fn build(
        backend: &B, config: ModelConfig, options: ModelOptions, weights: Option<Params<Tensor<B>>>,
    ) -> Result<Self> {
        let plan = ModelPlan::new(&config, &options)?;
        let mut memory = plan.memory();
        if weights.is_some() {
            memory.retain(|(category, _)| *category != "weights");
        }
        let offloaded = plan.offloaded();
        let mut host = offloaded
            .iter()
            .map(|(category, specs)| Ok((*category, backend.allocate_offloaded(category, specs)?)))
            .collect::<Result<Vec<_>>>()?;
        let mut in_host = |category: &str| match host.iter().position(|h| h.0 == category) {
            Some(i) => host.remove(i).1,
            None => vec![],
        };
        let mut take = memory
            .iter()
            .map(|(category, specs)| backend.allocate(category, specs));
        let mut next = || take.next().expect("one allocation per planned category");
        let (params, weight_ring) = match (weights, options.weights.kept()) {
            (Some(weights), _) => (weights, None),
            (None, Some(kept)) => (shared_slots::build(&plan.layout, Some(kept), next()?), None),
            (None, None) => assemble(&plan.layout, next()?, in_host("weights")),
        };
        let (grads, grad_ring) = match &options.gradients {
            Gradients::Absent => (None, None),
            Gradients::All => {
                let (grads, ring) = assemble(&plan.layout, next()?, in_host("gradients"));
                (Some(grads), ring)
            }
            Gradients::Kept(kept) => (
                Some(shared_slots::build(&plan.layout, Some(kept), next()?)),
                None,
            ),
        };
        let mut act_tensors = next()?;
        let rope = act_tensors.pop().expect("the rope table was planned last");
        backend.upload(&rope, &rope_table(&config, options.seq))?;
        let linears = match (&plan.fp8, &plan.int8) {
            (Some(f), _) => LinearLayers::Fp8(f.build(next()?)),
            (_, Some(i)) => LinearLayers::Int8(i.build(next()?)),
            _ => LinearLayers::Native,
        };
        let recompute =
            RecomputePlan::new(options.recompute, linears.native(), options.ffn_chunks > 1);
        Ok(Transformer {
            micro_batches: plan.activations.build(act_tensors, in_host("activations")),
            in_pass: 0,
            memory,
            offloaded,
            linears,
            recompute,
            streams: Streams {
                weights: weight_ring,
                grads: grad_ring,
            },
            config,
            options,
            layout: plan.layout,
            params,
            grads,
            rope,
            id: NEXT_MODEL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            recordings: RefCell::default(),
        })
    }

    /// The parameter gradients. A model of `Gradients::Absent` has none, and nothing that
    /// trains takes one.
    pub fn grads(&self) -> &Params<Tensor<B>> {
        self.grads
            .as_ref()
            .expect("a forward-only model (Gradients::Absent) has no gradients")
    }

    /// Whether block `l`'s parameter gradients have memory of their own (not a shared slot,
    /// which each micro-batch's backward overwrites instead of adding into).
    pub fn keeps_grads(&self, l: usize) -> bool {
        self.options.gradients.kept().is_none_or(|kept| kept[l])
    }

    /// Whether block `l`'s weights have memory of their own on this rank (not a shared slot
    /// that holds another rank's copy while a pass reads it).
    pub fn keeps_weights(&self, l: usize) -> bool {
        self.options.weights.kept().is_none_or(|kept| kept[l])
    }

    /// The weights this rank keeps, in `Params` order: every parameter but the blocks' that
    /// another rank keeps (`Weights::Kept`).
    pub fn kept_params(&self) -> impl Iterator<Item = (&ParamSpec, &Tensor<B>)> {
        let (layout, params) = (&self.layout, &self.params);
        let blocks = (0..self.config.num_layers)
            .filter(|&l| self.keeps_weights(l))
            .flat_map(move |l| layout.layers[l].iter().zip(params.layers[l].iter()));
        std::iter::once((&layout.embed, &params.embed))
            .chain(blocks)
            .chain(std::iter::once((&layout.final_norm, &params.final_norm)))
            .chain(layout.lm_head.iter().zip(params.lm_head.iter()))
    }

    pub(crate) fn attn_shape(&self) -> AttnShape {
        AttnShape {
            batch: self.options.batch,
            seq: self.options.seq,
            q_heads: self.config.num_heads,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// Tells the model its weights were written other than by the optimizer (initialised,
    /// loaded), so that FP8 copies are remade from scratch at the next forward.
    pub fn weights_changed(&self) {
        self.linears.weights_changed();
    }

    /// The seed of the stochastic roundings of the micro-batch that follows (INT8's, with
    /// `--int8-stochastic-rounding`); the trainer derives one per micro-batch of each step.
    pub fn set_rounding_seed(&self, seed: u64) {
        self.linears.set_rounding_seed(seed);
    }

    /// Before an optimizer step: where its update of each parameter (in `Params` order) reports
    /// the abs-max that scales the weight's FP8 copy. `None` without FP8.
    pub fn weight_amax_slots(&self, b: &B) -> Result<Option<Vec<Tensor<B>>>> {
        self.linears.weight_amax_slots(b)
    }

    /// Every FP8 abs-max statistic by name (`None` without FP8), for diagnosing divergence.
    /// Waits for the device.
    pub fn fp8_abs_max(&self, b: &B) -> Result<Option<Vec<(String, f32)>>> {
        self.linears.abs_max_report(b)
    }

    /// The activations of a pass of one micro-batch (the first of those a pass holds).
    pub(crate) fn acts(&self) -> &Activations<B> {
        &self.micro_batches[0]
    }

    pub fn tokens_per_step(&self) -> usize {
        self.options.batch * self.options.seq
    }
}

/// (cos, sin) of `position · inv_freq` for every position and rotated pair, in f64.
pub(super) fn rope_table(config: &ModelConfig, seq: usize) -> Vec<f32> {
    let inv_freq = config.rope_inv_freq();
    let mut table = Vec::with_capacity(seq * inv_freq.len() * 2);
    for t in 0..seq {
        for f in &inv_freq {
            let angle = t as f64 * f;
            table.push(angle.cos() as f32);
            table.push(angle.sin() as f32);
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryOps;
    use crate::backend::cpu::Cpu;
    use crate::model::LossOptions;

    fn config() -> ModelConfig {
        let json = serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 32, "tie_word_embeddings": true,
        });
        ModelConfig::from_json(&json, "test").unwrap()
    }

    fn categories<B: Backend>(model: &Transformer<B>) -> Vec<&'static str> {
        model.memory.iter().map(|(category, _)| *category).collect()
    }

    #[test]
    fn a_forward_only_model_has_no_gradients_and_shares_its_weights() {
        let b = Cpu::<f32>::new();
        let options = ModelOptions::forward_only(1, DType::F32);
        let mut model = Transformer::new(&b, config(), options).unwrap();
        assert_eq!(categories(&model), ["weights", "activations"]);
        let loss = LossOptions {
            grad_scale: 1.0,
            z_loss: 0.0,
            accumulate: false,
        };
        let err = model.forward_backward(&b, &[1], &[2], loss).unwrap_err();
        assert!(err.to_string().contains("forward-only"), "{err}");

        let options = ModelOptions::forward_only(5, DType::F32);
        let wide = Transformer::sharing_weights(&b, &model, options).unwrap();
        assert_eq!(categories(&wide), ["activations"]);
        b.fill(&model.params.final_norm, 3.0).unwrap();
        assert_eq!(b.download(&wide.params.final_norm).unwrap(), [3.0; 8]);

        let options = ModelOptions::forward_only(5, DType::BF16);
        assert!(Transformer::sharing_weights(&b, &model, options).is_err());
    }
}
