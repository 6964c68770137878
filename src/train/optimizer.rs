//! AdamW state and its step.
//!
//! The first and second moments (and, when the weights are narrower than the master dtype,
//! a master copy of the weights) are one allocation per category, laid out like the
//! parameters, on the device or, offloaded, in host memory that the update reaches over the
//! bus. Q8 moments (`--opt-m-dtype q8 --opt-v-dtype q8`, `backend::ops::adam8bit`) have
//! their blocks' abs-maxes beside them, two more categories that offload with their moments;
//! tensors too small for 8 bits keep f32 moments. A step sums the squared gradients into a
//! device scalar and hands it to every update, which clips on the device: nothing is read
//! back unless the caller asks for the norm to log it. Weight decay applies only where `ParamKind::decays()` says so.
//!
//! With `--zero-level 1` a rank keeps the state of only its share of the tensors (`zero`),
//! updates those, and broadcasts them; the gradients stay whole on every rank. With
//! `--zero-level 2` a rank holds the summed gradients of only its own blocks (and every
//! rank the others'), so the ranks add their shares of the gradient norm. With
//! `--zero-level 3` a block's weights are updated by their rank and stay there.

use anyhow::Result;

use super::block_updates::{BlockState, Streamed};
use super::options::OptimizerOptions;
use super::zero;
use crate::backend::ops::adam8bit::{absmax_len, moment_dtype};
use crate::backend::{AdamW, AdamWTensor, Backend, MomentScales, Range};
use crate::comm::Comm;
use crate::io::tensors::Named;
use crate::model::params::ParamSpec;
use crate::model::shared_slots;
use crate::model::{Params, Transformer};
use crate::rng::Rng;
use crate::tensor::{DType, Tensor, TensorSpec};

/// The categories of the Q8 moments' abs-maxes, m's and v's.
const SCALE_CATEGORIES: [&str; 2] = ["adam_m_absmax", "adam_v_absmax"];

/// The categories that the updates in the backward stream through device slots where they
/// are offloaded (`block_updates`), with their slots' category.
const STREAMED: [(&str, &str); 3] = [
    ("adam_m", "adam_m slots"),
    ("adam_v", "adam_v slots"),
    ("master", "master slots"),
];

pub struct AdamWState<B: Backend> {
    pub options: OptimizerOptions,
    /// The rank that updates each parameter tensor, in `Params` order.
    owners: Vec<usize>,
    /// Which rank this is, when it keeps only its share of the state.
    pub shard: Option<usize>,
    /// ZeRO-2: the rank that updates each block, and alone holds its summed gradients.
    pub block_owners: Option<Vec<usize>>,
    /// The parameters (as `Params` indices) whose state this rank keeps, in order; the
    /// state tensors below follow it.
    kept: Vec<usize>,
    pub m: Vec<Tensor<B>>,
    pub v: Vec<Tensor<B>>,
    /// Each kept tensor's abs-maxes of its moments, m's and v's, where they are Q8
    /// (`adam8bit`).
    scales: Vec<Option<[Tensor<B>; 2]>>,
    pub master: Option<Vec<Tensor<B>>>,
    /// `[parameters]` f32: each gradient's Σ g², summed on the device each step.
    sums_sq: Tensor<B>,
    /// `[1]` f32: their sum.
    norm_sq: Tensor<B>,
    /// Whether each parameter's weight decays, in `Params` order.
    decays: Vec<bool>,
    /// With `OptimizerOptions::in_backward`, where the blocks' updates find their state.
    blocks: Option<BlockState<B>>,
    /// What each device allocation holds, for the memory table.
    pub memory: Vec<(&'static str, Vec<TensorSpec>)>,
    /// The same for the offloaded categories.
    pub offloaded: Vec<(&'static str, Vec<TensorSpec>)>,
}

/// This rank's share of the optimizer state, planned before anything is allocated: what
/// `AdamWState::new` allocates, and what `smelt plan` counts.
pub struct StatePlan {
    owners: Vec<usize>,
    /// Which rank this is, when it keeps only its share of the state.
    shard: Option<usize>,
    /// ZeRO-2: the rank that updates each block, and alone holds its summed gradients.
    block_owners: Option<Vec<usize>>,
    kept: Vec<usize>,
    /// Each category of state: its name, its tensors (shaped like the parameters kept,
    /// named `category.parameter`), and whether it lives in host memory.
    categories: Vec<(&'static str, Vec<TensorSpec>, bool)>,
    /// Each gradient's `Σ g²`, then their sum, on the device.
    norm: Vec<TensorSpec>,
    /// With `OptimizerOptions::in_backward`, the device slots that each offloaded category
    /// of m, v and the master copy streams its blocks through (`block_updates`).
    slots: [Option<(&'static str, Vec<TensorSpec>)>; 3],
}

impl StatePlan {
    pub fn new(
        layout: &Params<ParamSpec>, rank: usize, world: usize, options: &OptimizerOptions,
    ) -> Self {
        let specs: Vec<&ParamSpec> = layout.iter().collect();
        let sharded = zero::owners_of(layout, world, options);
        let shard = sharded.as_ref().map(|_| rank);
        let (owners, block_owners) = match sharded {
            Some(o) => (o.tensors, o.blocks),
            None => (vec![rank; specs.len()], None),
        };
        let kept: Vec<usize> = (0..specs.len()).filter(|&i| owners[i] == rank).collect();
        let like_kept = |category: &str, dtype| -> Vec<TensorSpec> {
            kept.iter()
                .map(|&i| {
                    let t = &specs[i].tensor;
                    let dtype = moment_dtype(dtype, t.numel());
                    TensorSpec::new(format!("{category}.{}", t.name), &t.shape, dtype)
                })
                .collect()
        };
        // The abs-maxes of the Q8 moments among them (none unless q8 was asked for).
        let scales_of = |category: &str, moments: &[TensorSpec]| -> Vec<TensorSpec> {
            (kept.iter().zip(moments))
                .filter(|(_, m)| m.dtype == DType::Q8)
                .map(|(&i, _)| {
                    let t = &specs[i].tensor;
                    let shape = [absmax_len(t.numel())];
                    TensorSpec::new(format!("{category}.{}", t.name), &shape, DType::F32)
                })
                .collect()
        };
        let offload = options.offload;
        let (m, v) = (
            like_kept("adam_m", options.opt_m_dtype),
            like_kept("adam_v", options.opt_v_dtype),
        );
        let [m_category, v_category] = SCALE_CATEGORIES;
        let (m_scales, v_scales) = (scales_of(m_category, &m), scales_of(v_category, &v));
        let mut categories = vec![("adam_m", m, offload.opt_m), ("adam_v", v, offload.opt_v)];
        if !m_scales.is_empty() {
            categories.push((m_category, m_scales, offload.opt_m));
            categories.push((v_category, v_scales, offload.opt_v));
        }
        if let Some(dtype) = options.master_dtype {
            categories.push(("master", like_kept("master", dtype), offload.master));
        }
        let slots = STREAMED.map(|(category, slots)| {
            let (_, specs, offloaded) = categories.iter().find(|c| c.0 == category)?;
            let template = &specs[layout.block_indices(0)];
            (options.in_backward && *offloaded).then(|| {
                (
                    slots,
                    shared_slots::slot_specs(layout, &format!("{category}."), 2, template),
                )
            })
        });
        StatePlan {
            owners,
            shard,
            block_owners,
            kept,
            categories,
            norm: vec![
                TensorSpec::new("grad_sums_sq", &[specs.len()], DType::F32),
                TensorSpec::new("grad_norm_sq", &[1], DType::F32),
            ],
            slots,
        }
    }

    /// The device allocations, by category.
    pub fn memory(&self) -> Vec<(&'static str, Vec<TensorSpec>)> {
        let mut memory = self.placed(false);
        memory.extend(self.slots.iter().flatten().cloned());
        memory.push(("optimizer", self.norm.clone()));
        memory
    }

    /// The allocations in host memory, by category.
    pub fn offloaded(&self) -> Vec<(&'static str, Vec<TensorSpec>)> {
        self.placed(true)
    }

    fn placed(&self, in_host: bool) -> Vec<(&'static str, Vec<TensorSpec>)> {
        (self.categories.iter())
            .filter(|c| c.2 == in_host)
            .map(|(name, specs, _)| (*name, specs.clone()))
            .collect()
    }
}

impl<B: Backend> AdamWState<B> {
    /// Allocates this rank's state for `model` and initialises it: zero moments, and the
    /// master copy (if any) equal to the current weights.
    pub fn new(
        b: &B, comm: &dyn Comm<B>, model: &Transformer<B>, options: OptimizerOptions,
    ) -> Result<Self> {
        let (rank, world) = (comm.rank(), comm.world());
        let plan = StatePlan::new(&model.layout, rank, world, &options);
        let mut allocations =
            (plan.categories.iter()).map(|(category, specs, in_host)| match in_host {
                true => b.allocate_offloaded(category, specs),
                false => b.allocate(category, specs),
            });
        let mut next = || {
            allocations
                .next()
                .expect("one allocation per planned category")
        };
        let m = next()?;
        let v = next()?;
        // The scale categories, when planned, hold the Q8 moments' abs-maxes in order.
        let mut scales: Vec<Option<[Tensor<B>; 2]>> = vec![None; m.len()];
        if m.iter().any(|t| t.dtype == DType::Q8) {
            let (m_scales, v_scales) = (next()?, next()?);
            let q8 = (scales.iter_mut().zip(&m)).filter(|(_, t)| t.dtype == DType::Q8);
            for ((slot, _), pair) in q8.zip(m_scales.into_iter().zip(v_scales)) {
                *slot = Some([pair.0, pair.1]);
            }
        }
        let master = match options.master_dtype {
            Some(_) => Some(next()?),
            None => None,
        };
        let slots = (plan.slots.iter())
            .map(|s| {
                s.as_ref()
                    .map(|(name, specs)| b.allocate(name, specs))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let blocks = options.in_backward.then(|| {
            let mut slots = slots.into_iter();
            let states = [Some(&m[..]), Some(&v[..]), master.as_deref()];
            let streamed = states.map(|state| {
                let slots = slots.next().expect("slots planned per category")?;
                Some(Streamed {
                    state: state?,
                    slots,
                })
            });
            BlockState::new(&model.layout, streamed)
        });
        let mut norm = b.allocate("optimizer", &plan.norm)?.into_iter();
        let mut next_norm = || norm.next().expect("two norm tensors were planned");
        let (sums_sq, norm_sq) = (next_norm(), next_norm());
        for t in m.iter().chain(&v).chain(scales.iter().flatten().flatten()) {
            b.fill(t, 0.0)?;
        }
        let state = AdamWState {
            shard: plan.shard,
            options,
            memory: plan.memory(),
            offloaded: plan.offloaded(),
            block_owners: plan.block_owners,
            owners: plan.owners,
            kept: plan.kept,
            m,
            v,
            scales,
            master,
            sums_sq,
            norm_sq,
            decays: model.layout.iter().map(|p| p.kind.decays()).collect(),
            blocks,
        };
        state.sync_master(b, model)?;
        Ok(state)
    }

    /// Starts the master copy from the model's weights (a checkpoint then overwrites it
    /// with its own, when the run continues).
    fn sync_master(&self, b: &B, model: &Transformer<B>) -> Result<()> {
        if let Some(master) = &self.master {
            let params: Vec<&Tensor<B>> = model.params.iter().collect();
            for (dst, &i) in master.iter().zip(&self.kept) {
                b.copy(dst, params[i])?;
            }
        }
        Ok(())
    }

    /// Each state category with its tensors, named like the parameters they belong to,
    /// for checkpoints.
    pub fn categories<'a>(&'a self, model: &Transformer<B>) -> Vec<(&'static str, Named<'a, B>)> {
        let names: Vec<&String> = model.layout.iter().map(|p| &p.tensor.name).collect();
        let named = |set: &'a Vec<Tensor<B>>| {
            (self.kept.iter().zip(set))
                .map(|(&i, t)| (names[i].clone(), t))
                .collect()
        };
        let mut out = vec![("adam_m", named(&self.m)), ("adam_v", named(&self.v))];
        for (k, category) in SCALE_CATEGORIES.into_iter().enumerate() {
            let named: Named<'a, B> = (self.kept.iter().zip(&self.scales))
                .filter_map(|(&i, s)| s.as_ref().map(|s| (names[i].clone(), &s[k])))
                .collect();
            if !named.is_empty() {
                out.push((category, named));
            }
        }
        out.extend(self.master.as_ref().map(|m| ("master", named(m))));
        out
    }

    /// The names of the tensors of `model` that have a state of `category` on some rank:
    /// all of them, but for the abs-maxes of Q8 moments, which only the tensors large enough
    /// for them have.
    pub fn held_by<'m>(&self, category: &str, model: &'m Transformer<B>) -> Vec<&'m str> {
        let scales = SCALE_CATEGORIES.contains(&category);
        (model.layout.iter())
            .filter(|p| {
                !scales || moment_dtype(self.options.opt_m_dtype, p.tensor.numel()) == DType::Q8
            })
            .map(|p| p.tensor.name.as_str())
            .collect()
    }

    /// One update of every parameter of `model` from its gradients: `measure_gradients`,
    /// then `update`.
    pub fn step(
        &self, b: &B, comm: &dyn Comm<B>, model: &Transformer<B>, lr: f32, step: u64, seed: u64,
    ) -> Result<()> {
        self.measure_gradients(b, comm, model)?;
        self.update(b, comm, model, lr, step, seed, false)
            .map(|_| ())
    }

    /// Sums the squared gradients into the global norm on the device, for clipping (and
    /// `grad_norm`). Nothing waits for the device.
    pub fn measure_gradients(
        &self, b: &B, comm: &dyn Comm<B>, model: &Transformer<B>,
    ) -> Result<()> {
        let grads: Vec<&Tensor<B>> = model.grads().iter().collect();
        if let Some(blocks) = &self.blocks {
            // The blocks' sums were taken in the backward (`update_block`); each sum depends
            // only on its tensor, so the rest, summed now, give the bits of summing all.
            let first = blocks.block(0).start;
            let after = blocks.block(model.config.num_layers - 1).end;
            b.sum_squares(&self.sums_sq.narrow_rows(0, first), &[Some(grads[0])])?;
            let tail: Vec<Option<&Tensor<B>>> = grads[after..].iter().copied().map(Some).collect();
            b.sum_squares(&self.sums_sq.narrow_rows(after, grads.len()), &tail)?;
            return b.sum(&self.norm_sq, &self.sums_sq);
        }
        // Under ZeRO-2 each gradient's sum of squares comes from the rank that holds its sum
        // over the ranks (zeros from the others), so adding the ranks' vectors gives every
        // rank the bits of an unsharded run.
        let sharded_grads = self.block_owners.is_some();
        let summed: Vec<Option<&Tensor<B>>> = (grads.iter().zip(&self.owners))
            .map(|(&g, &owner)| (!sharded_grads || Some(owner) == self.shard).then_some(g))
            .collect();
        b.sum_squares(&self.sums_sq, &summed)?;
        if sharded_grads {
            comm.start_all_reduce_sum(b, &[&self.sums_sq])?;
            comm.join_all_reduce_sums(b)?;
        }
        b.sum(&self.norm_sq, &self.sums_sq)
    }

    /// One AdamW update of every parameter of `model` from its gradients, clipped by the
    /// norm `measure_gradients` summed. `step` counts from 1 (bias correction); `seed`
    /// drives stochastic rounding and must be the same on a resumed run for the result to
    /// be bitwise the same. Sharded, this rank updates its share and `comm` brings every
    /// rank the others'.
    ///
    /// With `measure`, every rank also gets each parameter's `Σ w²` before the update and
    /// `Σ Δw²` of it (of the master copy where there is one), in `Params` order: each kept
    /// tensor is then updated on its own between two reads of it into host memory, which
    /// gives the bits of the update of all at once (every element's update depends only on
    /// its tensor) and waits for the device.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &self, b: &B, comm: &dyn Comm<B>, model: &Transformer<B>, lr: f32, step: u64, seed: u64,
        measure: bool,
    ) -> Result<Option<Vec<WeightNorms>>> {
        let _range = Range::begin(b, format_args!("optimizer"));
        let grads: Vec<&Tensor<B>> = model.grads().iter().collect();
        let hp = self.hyper(lr, step);
        let amax_slots = model.weight_amax_slots(b)?;
        let params: Vec<&Tensor<B>> = model.params.iter().collect();
        // With the blocks updated in the backward, only the tensors outside them are left,
        // and what follows reads the blocks' state where it went back to.
        let in_blocks: Vec<bool> = model.layout.in_blocks().collect();
        if let Some(blocks) = &self.blocks {
            blocks.end(b)?;
            // Their updates reported no abs-max: the blocks' FP8 and INT8 copies are made
            // from the weights alone at the next forward.
            model.weights_changed();
        }
        let tensors = (self.kept.iter().enumerate())
            .filter(|&(_, &i)| self.blocks.is_none() || !in_blocks[i])
            .map(|(j, &i)| {
                let own = self.own_state(j);
                let amax = amax_slots.as_ref().map(|slots| &slots[i]);
                self.tensor(i, j, (params[i], grads[i]), own, seed, amax)
            })
            .collect::<Vec<_>>();
        // Unsharded, every rank updates every tensor alike and rank 0 alone measures them.
        let measures = measure && (self.shard.is_some() || comm.rank() == 0);
        let mut norms = vec![WeightNorms::default(); params.len()];
        if measures {
            for (t, &i) in tensors.iter().zip(&self.kept) {
                let weight = t.master.unwrap_or(t.param);
                let before = b.download(weight)?;
                b.adamw(std::slice::from_ref(t), &self.norm_sq, &hp)?;
                norms[i] = WeightNorms::between(&before, &b.download(weight)?);
            }
        } else {
            b.adamw(&tensors, &self.norm_sq, &hp)?;
        }
        let norms = match measure {
            true => Some(WeightNorms::sum_over_ranks(comm, &norms)?),
            false => None,
        };
        if self.shard.is_none() {
            return Ok(norms);
        }
        // Each weight from the rank that updated it, with the abs-max its FP8 copy scales by;
        // under ZeRO-3 only those outside the blocks, whose weights stay with their rank.
        let blocks_stay = self.options.zero_level >= 3;
        let mut updated: Vec<(&Tensor<B>, usize)> = (params.into_iter())
            .zip(self.owners.iter().copied())
            .zip(model.layout.in_blocks())
            .filter(|&(_, in_block)| !(blocks_stay && in_block))
            .map(|(updated, _)| updated)
            .collect();
        if let Some(slots) = &amax_slots {
            updated.extend(slots.iter().zip(self.owners.iter().copied()));
        }
        comm.broadcast(b, &updated)?;
        Ok(norms)
    }

    /// In the step's last backward (`OptimizerOptions::in_backward`), before its first
    /// `update_block`: the top blocks' offloaded state starts coming in.
    pub fn begin_block_updates(&self, b: &B) -> Result<()> {
        match &self.blocks {
            Some(blocks) => blocks.begin(b),
            None => Ok(()),
        }
    }

    /// Block `l`'s part of update `step` at rate `lr` (`update`'s arguments), from its
    /// gradients `grads` as the backward left them, into its `weights` where the block's ops
    /// read them; also its gradients' `Σ g²` for `measure_gradients`. Needs
    /// `OptimizerOptions::in_backward`, which leaves the blocks to these calls.
    #[allow(clippy::too_many_arguments)]
    pub fn update_block(
        &self, b: &B, l: usize, weights: &[&Tensor<B>], grads: &[&Tensor<B>], lr: f32, step: u64,
        seed: u64,
    ) -> Result<()> {
        let Some(blocks) = &self.blocks else {
            anyhow::bail!("update_block needs an optimizer made with in_backward");
        };
        let _range = Range::begin(b, format_args!("layer {l} optimizer"));
        let range = blocks.block(l);
        let sums: Vec<Option<&Tensor<B>>> = grads.iter().copied().map(Some).collect();
        b.sum_squares(&self.sums_sq.narrow_rows(range.start, range.end), &sums)?;
        blocks.before_update(b, l)?;
        // One rank keeps all the state, so a parameter's index is its state's.
        let tensors: Vec<AdamWTensor<B>> = (range.zip(weights.iter().zip(grads)).enumerate())
            .map(|(f, (i, (&param, &grad)))| {
                let state = blocks.place(l, f, self.own_state(i));
                self.tensor(i, i, (param, grad), state, seed, None)
            })
            .collect();
        // No clipping (`block_updates::check`): the norm the update would read is not there
        // yet.
        b.adamw(&tensors, &self.norm_sq, &self.hyper(lr, step))?;
        blocks.after_update(b, l)
    }

    /// The `j`th kept tensor's m, v and master copy, where they are kept.
    fn own_state(&self, j: usize) -> [Option<&Tensor<B>>; 3] {
        [
            Some(&self.m[j]),
            Some(&self.v[j]),
            self.master.as_ref().map(|m| &m[j]),
        ]
    }

    /// The update of parameter `i`, the `j`th this rank keeps: its weight and gradient where
    /// the pass reads them, its m, v and master copy at `state` (`own_state`, or slots), its
    /// rounding seed derived from the step's, and where its abs-max goes, if anywhere.
    fn tensor<'a>(
        &'a self, i: usize, j: usize, (param, grad): (&'a Tensor<B>, &'a Tensor<B>),
        state: [Option<&'a Tensor<B>>; 3], seed: u64, amax: Option<&'a Tensor<B>>,
    ) -> AdamWTensor<'a, B> {
        let [m, v, master] = state;
        AdamWTensor {
            param,
            master,
            grad,
            m: m.expect("m is always kept"),
            v: v.expect("v is always kept"),
            scales: self.scales[j].as_ref().map(|[m, v]| MomentScales { m, v }),
            decays: self.decays[i],
            seed: Rng::derived(seed, i as u64).next_u64(),
            amax,
        }
    }

    /// The hyper-parameters of update `step` at rate `lr`.
    fn hyper(&self, lr: f32, step: u64) -> AdamW {
        let o = &self.options;
        AdamW {
            lr,
            beta1: o.beta_1 as f32,
            beta2: o.beta_2 as f32,
            eps: o.adam_eps as f32,
            weight_decay: o.weight_decay as f32,
            step,
            grad_clip: o.grad_clip as f32,
        }
    }

    /// The factor by which the update scales gradients of global norm `norm`.
    pub fn clip_scale(&self, norm: f64) -> f64 {
        self.hyper(0.0, 1).clip_scale(norm * norm)
    }

    /// Each gradient's `Σ g²` of the last step, in `Params` order (summed over the ranks).
    /// Waits for the device.
    pub fn grad_sums_sq(&self, b: &B) -> Result<Vec<f64>> {
        b.download_f64(&self.sums_sq)
    }

    /// The global gradient norm of the last step, before clipping. Waits for the device.
    pub fn grad_norm(&self, b: &B) -> Result<f64> {
        Ok(b.download_f64(&self.norm_sq)?[0].sqrt())
    }
}

/// A weight tensor's squared norm before an update, and the update's.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WeightNorms {
    /// `Σ w²`.
    pub param_sq: f64,
    /// `Σ (w' − w)²`.
    pub update_sq: f64,
}

impl WeightNorms {
    /// Of a tensor that held `before` and holds `after`, summed in f64.
    fn between(before: &[f32], after: &[f32]) -> WeightNorms {
        let (mut param_sq, mut update_sq) = (0.0, 0.0);
        for (&w, &w_new) in before.iter().zip(after) {
            param_sq += (w as f64).powi(2);
            update_sq += (w_new as f64 - w as f64).powi(2);
        }
        WeightNorms {
            param_sq,
            update_sq,
        }
    }

    /// Every rank's measures of the tensors it updated (zeros elsewhere), added up.
    fn sum_over_ranks<B: Backend>(comm: &dyn Comm<B>, norms: &[WeightNorms]) -> Result<Vec<Self>> {
        let flat: Vec<f64> = norms
            .iter()
            .flat_map(|n| [n.param_sq, n.update_sq])
            .collect();
        let summed = comm.sum(&flat)?;
        Ok(summed
            .chunks_exact(2)
            .map(|p| WeightNorms {
                param_sq: p[0],
                update_sq: p[1],
            })
            .collect())
    }
}
