//! AdamW state and its step.
//!
//! The first and second moments (and, when the weights are narrower than the master dtype,
//! a master copy of the weights) are one allocation per category, laid out like the
//! parameters, on the device or, offloaded, in host memory that the update reaches over the
//! bus. A step sums the squared gradients into a device scalar and hands it to every
//! update, which clips on the device: nothing is read back unless the caller asks for the
//! norm to log it. Weight decay applies only where `ParamKind::decays()` says so.

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::backend::{AdamW, AdamWTensor, Backend};
use crate::model::Transformer;
use crate::model::params::{ParamSpec, Params, from_list};
use crate::rng::Rng;
use crate::tensor::{DType, Tensor, TensorSpec};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerOptions {
    pub beta_1: f64,
    pub beta_2: f64,
    pub adam_eps: f64,
    pub weight_decay: f64,
    /// Global gradient-norm clip; 0 disables it.
    pub grad_clip: f64,
    pub opt_m_dtype: DType,
    pub opt_v_dtype: DType,
    /// The dtype of a master copy of the weights; `None` updates the weights in place.
    pub master_dtype: Option<DType>,
    /// Which of the state lives in host memory.
    pub offload: Offload,
}

/// Which optimizer state lives in host memory (llm.q's `--offload-*`). The update reads and
/// writes it over the bus once per step, which costs that traffic at PCIe speed and saves
/// its size in device memory. Where the state lives changes no result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offload {
    pub master: bool,
    pub opt_m: bool,
    pub opt_v: bool,
}

pub struct AdamWState<B: Backend> {
    pub options: OptimizerOptions,
    pub m: Params<Tensor<B>>,
    pub v: Params<Tensor<B>>,
    pub master: Option<Params<Tensor<B>>>,
    /// `[1]` f32: Σ g² over every gradient, summed on the device each step.
    norm_sq: Tensor<B>,
    /// What each device allocation holds, for the memory table.
    pub memory: Vec<(&'static str, Vec<TensorSpec>)>,
    /// The same for the offloaded categories.
    pub offloaded: Vec<(&'static str, Vec<TensorSpec>)>,
}

/// One allocation laid out like the parameters, each tensor named `prefix.name`, in host
/// memory if `offload`.
fn allocate_like<B: Backend>(
    b: &B,
    layout: &Params<ParamSpec>,
    category: &'static str,
    dtype: DType,
    offload: bool,
) -> Result<(Params<Tensor<B>>, Vec<TensorSpec>)> {
    let specs: Vec<TensorSpec> = layout
        .try_map(|p| {
            Ok(TensorSpec::new(
                format!("{category}.{}", p.tensor.name),
                &p.tensor.shape,
                dtype,
            ))
        })?
        .iter()
        .cloned()
        .collect();
    let tensors = match offload {
        true => b.allocate_offloaded(category, &specs)?,
        false => b.allocate(category, &specs)?,
    };
    Ok((from_list(layout, tensors), specs))
}

impl<B: Backend> AdamWState<B> {
    /// Allocates the state for `model` and initialises it: zero moments, and the master copy
    /// (if any) equal to the current weights.
    pub fn new(b: &B, model: &Transformer<B>, options: OptimizerOptions) -> Result<Self> {
        let layout = &model.layout;
        let offload = options.offload;
        let (mut memory, mut offloaded) = (vec![], vec![]);
        let mut allocate = |category, dtype, in_host| {
            let (tensors, specs) = allocate_like(b, layout, category, dtype, in_host)?;
            match in_host {
                true => offloaded.push((category, specs)),
                false => memory.push((category, specs)),
            }
            anyhow::Ok(tensors)
        };
        let m = allocate("adam_m", options.opt_m_dtype, offload.opt_m)?;
        let v = allocate("adam_v", options.opt_v_dtype, offload.opt_v)?;
        let master = match options.master_dtype {
            Some(dtype) => Some(allocate("master", dtype, offload.master)?),
            None => None,
        };
        let norm_spec = TensorSpec::new("grad_norm_sq", &[1], DType::F32);
        let norm_sq = b.allocate("optimizer", std::slice::from_ref(&norm_spec))?;
        memory.push(("optimizer", vec![norm_spec]));
        for t in m.iter().chain(v.iter()) {
            b.fill(t, 0.0)?;
        }
        let state = AdamWState {
            options,
            m,
            v,
            master,
            norm_sq: norm_sq.into_iter().next().expect("one tensor"),
            memory,
            offloaded,
        };
        state.sync_master(b, model)?;
        Ok(state)
    }

    /// Starts the master copy from the model's weights (a checkpoint then overwrites it
    /// with its own, when the run continues).
    fn sync_master(&self, b: &B, model: &Transformer<B>) -> Result<()> {
        if let Some(master) = &self.master {
            for (dst, src) in master.zip(&model.params) {
                b.copy(dst, src)?;
            }
        }
        Ok(())
    }

    /// Each state category with its tensors, for checkpoints.
    pub fn categories(&self) -> Vec<(&'static str, &Params<Tensor<B>>)> {
        let mut out = vec![("adam_m", &self.m), ("adam_v", &self.v)];
        out.extend(self.master.as_ref().map(|m| ("master", m)));
        out
    }

    /// One update of every parameter of `model` from its gradients. `step` counts from 1
    /// (bias correction); `seed` drives stochastic rounding and must be the same on a resumed
    /// run for the result to be bitwise the same.
    pub fn step(&self, b: &B, model: &Transformer<B>, lr: f32, step: u64, seed: u64) -> Result<()> {
        let grads: Vec<&Tensor<B>> = model.grads.iter().collect();
        b.sum_squares(&self.norm_sq, &grads)?;
        let o = &self.options;
        let hp = AdamW {
            lr,
            beta1: o.beta_1 as f32,
            beta2: o.beta_2 as f32,
            eps: o.adam_eps as f32,
            weight_decay: o.weight_decay as f32,
            step,
            grad_clip: o.grad_clip as f32,
        };
        let amax_slots = model.weight_amax_slots(b)?;
        let masters: Vec<Option<&Tensor<B>>> = match &self.master {
            Some(m) => m.iter().map(Some).collect(),
            None => vec![None; model.layout.iter().count()],
        };
        let tensors = model
            .layout
            .iter()
            .zip(model.params.iter())
            .zip(model.grads.iter())
            .zip(self.m.iter().zip(self.v.iter()))
            .zip(masters)
            .enumerate()
            .map(
                |(i, ((((spec, param), grad), (m, v)), master))| AdamWTensor {
                    param,
                    master,
                    grad,
                    m,
                    v,
                    decays: spec.kind.decays(),
                    seed: Rng::derived(seed, i as u64).next_u64(),
                    amax: amax_slots.as_ref().map(|slots| &slots[i]),
                },
            )
            .collect::<Vec<_>>();
        b.adamw(&tensors, &self.norm_sq, &hp)
    }

    /// The global gradient norm of the last step, before clipping. Waits for the device.
    pub fn grad_norm(&self, b: &B) -> Result<f64> {
        Ok(b.download_f64(&self.norm_sq)?[0].sqrt())
    }
}
