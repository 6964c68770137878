//! Training health, every `--health-every` steps: the global gradient norm before and after
//! clipping, the weights' norm and the update's relative size ‖Δw‖/‖w‖, overall, per block
//! and per tensor family (`qkv`, `down`, `embed`, ...). A ratio that drifts far from ~1e-3,
//! or a family whose gradients grow while the others' shrink, is the early sign of a run
//! about to diverge, which the loss shows only once it has.
//!
//! The update is measured on the master copy where there is one (the weights as the
//! optimizer keeps them), else on the weights.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::optimizer::WeightNorms;
use crate::model::Params;
use crate::model::params::ParamSpec;

/// The norms of a set of tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Norms {
    /// Of the gradients, before clipping.
    pub grad_norm: f64,
    /// Of the weights, before the update.
    pub param_norm: f64,
    /// ‖Δw‖ / ‖w‖.
    pub update_ratio: f64,
}

/// One step's health, as the log records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Health {
    #[serde(flatten)]
    pub all: Norms,
    /// The gradients' norm as the update saw it: scaled down to `--grad-clip`.
    pub clipped_grad_norm: f64,
    /// Per block, in order.
    pub layers: Vec<Norms>,
    /// Per tensor family: the parameter's name without its block.
    pub families: BTreeMap<String, Norms>,
}

/// Squared sums of a set of tensors, added up before the square roots are taken.
#[derive(Clone, Copy, Default)]
struct Sums {
    grad_sq: f64,
    param_sq: f64,
    update_sq: f64,
}

impl Sums {
    fn add(&mut self, grad_sq: f64, w: &WeightNorms) {
        self.grad_sq += grad_sq;
        self.param_sq += w.param_sq;
        self.update_sq += w.update_sq;
    }

    fn norms(&self) -> Norms {
        let param_norm = self.param_sq.sqrt();
        Norms {
            grad_norm: self.grad_sq.sqrt(),
            param_norm,
            update_ratio: match param_norm > 0.0 {
                true => self.update_sq.sqrt() / param_norm,
                false => 0.0,
            },
        }
    }
}

/// The health of a step from each parameter's `Σ g²` (`grad_sq`) and weight norms, both in
/// `Params` order; `clip_scale` is what the update scaled the gradients by.
pub fn measure(
    layout: &Params<ParamSpec>, grad_sq: &[f64], weights: &[WeightNorms], clip_scale: f64,
) -> Health {
    let mut all = Sums::default();
    let mut layers = vec![Sums::default(); layout.layers.len()];
    let mut families: BTreeMap<String, Sums> = BTreeMap::new();
    for ((spec, &g), w) in layout.iter().zip(grad_sq).zip(weights) {
        all.add(g, w);
        let (layer, family) = split_name(&spec.tensor.name);
        if let Some(l) = layer {
            layers[l].add(g, w);
        }
        families.entry(family.to_string()).or_default().add(g, w);
    }
    let all_norms = all.norms();
    Health {
        clipped_grad_norm: all_norms.grad_norm * clip_scale,
        all: all_norms,
        layers: layers.iter().map(Sums::norms).collect(),
        families: families
            .iter()
            .map(|(k, s)| (k.clone(), s.norms()))
            .collect(),
    }
}

/// `layers.3.qkv` as (Some(3), "qkv"); `embed` as (None, "embed").
fn split_name(name: &str) -> (Option<usize>, &str) {
    let in_block = name.strip_prefix("layers.").and_then(|rest| {
        let (layer, family) = rest.split_once('.')?;
        Some((layer.parse().ok()?, family))
    });
    match in_block {
        Some((layer, family)) => (Some(layer), family),
        None => (None, name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets;
    use crate::tensor::DType;

    #[test]
    fn groups_add_squares_before_the_root() {
        let config = presets::preset("qwen2-100m").unwrap();
        let layout = Params::layout(&config, DType::F32);
        let n = layout.iter().count();
        let grad_sq = vec![4.0; n];
        let weights = vec![
            WeightNorms {
                param_sq: 100.0,
                update_sq: 1e-4,
            };
            n
        ];
        let scale = 1.0 / (4.0 * n as f64).sqrt();
        let h = measure(&layout, &grad_sq, &weights, scale);
        let nf = n as f64;
        assert!((h.all.grad_norm - (4.0 * nf).sqrt()).abs() < 1e-9);
        assert!((h.all.update_ratio - (1e-4f64 / 100.0).sqrt()).abs() < 1e-12);
        assert!((h.clipped_grad_norm - 1.0).abs() < 1e-9);
        assert_eq!(h.layers.len(), config.num_layers);
        let per_block = layout.layers[0].iter().count() as f64;
        assert!((h.layers[0].grad_norm - (4.0 * per_block).sqrt()).abs() < 1e-9);
        let qkv = h.families["qkv"];
        assert!((qkv.param_norm - (100.0 * config.num_layers as f64).sqrt()).abs() < 1e-9);
        assert!(h.families.contains_key("embed"));
        assert!(!h.families.keys().any(|k| k.starts_with("layers")));
    }
}
