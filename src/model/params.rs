//! The parameter layout, as one generic structure shared by weights, gradients and
//! optimizer states, so that a name can never drift from its tensor.
//!
//! Internally q, k and v are one fused matrix and gate and up another, as in llm.q; the
//! `hf` parts of each `ParamSpec` say which HF tensors are stacked into it, in row order.

use anyhow::Result;

use super::config::ModelConfig;
use crate::tensor::{DType, TensorSpec};

/// One transformer block's parameters. Shapes use C = hidden, F = intermediate,
/// D = head_dim, Q = heads·D, W = (heads + 2·kv_heads)·D.
#[derive(Clone, Debug)]
pub struct LayerParams<T> {
    pub ln1: T,              // [C]
    pub qkv: T,              // [W, C]
    pub qkv_bias: Option<T>, // [W] (Qwen2)
    pub q_norm: Option<T>,   // [D] (Qwen3)
    pub k_norm: Option<T>,   // [D] (Qwen3)
    pub o: T,                // [C, Q]
    pub ln2: T,              // [C]
    pub gate_up: T,          // [2F, C]: gate rows, then up rows
    pub down: T,             // [C, F]
}

#[derive(Clone, Debug)]
pub struct Params<T> {
    pub embed: T, // [V, C]
    pub layers: Vec<LayerParams<T>>,
    pub final_norm: T,      // [C]
    pub lm_head: Option<T>, // [V, C]; None when tied to `embed`
}

/// How a parameter is treated by initialisation and the optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    Embedding,
    /// A matrix feeding the residual stream (o, down): initialised smaller, by 1/sqrt(2L).
    ResidualMatrix,
    Matrix,
    Norm,
    Bias,
}

impl ParamKind {
    /// Weight decay applies to matrices and embeddings only.
    pub fn decays(self) -> bool {
        matches!(
            self,
            ParamKind::Embedding | ParamKind::ResidualMatrix | ParamKind::Matrix
        )
    }
}

#[derive(Clone, Debug)]
pub struct ParamSpec {
    pub tensor: TensorSpec,
    pub kind: ParamKind,
    /// The HF tensors stacked (along rows) into this one: (name, rows).
    pub hf: Vec<(String, usize)>,
}

/// One HF tensor inside a (possibly fused) parameter.
pub struct HfSlice<'a> {
    pub name: &'a str,
    /// Elements of the parameter, in row-major order, that this tensor holds.
    pub range: std::ops::Range<usize>,
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// The HF tensors stacked into this parameter, with where each one sits.
    pub fn hf_slices(&self) -> impl Iterator<Item = HfSlice<'_>> {
        let cols = self.tensor.shape.get(1).copied();
        let mut start = 0;
        self.hf.iter().map(move |(name, rows)| {
            let len = rows * cols.unwrap_or(1);
            start += len;
            HfSlice {
                name,
                range: start - len..start,
                shape: cols.map_or(vec![*rows], |c| vec![*rows, c]),
            }
        })
    }
}

impl<T> LayerParams<T> {
    pub fn try_map<U>(&self, f: &mut impl FnMut(&T) -> Result<U>) -> Result<LayerParams<U>> {
        Ok(LayerParams {
            ln1: f(&self.ln1)?,
            qkv: f(&self.qkv)?,
            qkv_bias: self.qkv_bias.as_ref().map(&mut *f).transpose()?,
            q_norm: self.q_norm.as_ref().map(&mut *f).transpose()?,
            k_norm: self.k_norm.as_ref().map(&mut *f).transpose()?,
            o: f(&self.o)?,
            ln2: f(&self.ln2)?,
            gate_up: f(&self.gate_up)?,
            down: f(&self.down)?,
        })
    }

    /// The QK-norm's weights, (queries, keys), where the block has them.
    pub fn qk_norm(&self) -> Option<(&T, &T)> {
        self.q_norm.as_ref().zip(self.k_norm.as_ref())
    }

    /// Every element, in a fixed order.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        [
            Some(&self.ln1),
            Some(&self.qkv),
            self.qkv_bias.as_ref(),
            self.q_norm.as_ref(),
            self.k_norm.as_ref(),
            Some(&self.o),
            Some(&self.ln2),
            Some(&self.gate_up),
            Some(&self.down),
        ]
        .into_iter()
        .flatten()
    }
}

impl<T> Params<T> {
    /// The same structure with each element replaced by `f(element)`.
    pub fn try_map<U>(&self, mut f: impl FnMut(&T) -> Result<U>) -> Result<Params<U>> {
        Ok(Params {
            embed: f(&self.embed)?,
            layers: self
                .layers
                .iter()
                .map(|l| l.try_map(&mut f))
                .collect::<Result<_>>()?,
            final_norm: f(&self.final_norm)?,
            lm_head: self.lm_head.as_ref().map(&mut f).transpose()?,
        })
    }

    /// Every element, in a fixed order (embedding, layers, final norm, head).
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        std::iter::once(&self.embed)
            .chain(self.layers.iter().flat_map(LayerParams::iter))
            .chain(std::iter::once(&self.final_norm))
            .chain(self.lm_head.as_ref())
    }

    /// Pairs two structures built from the same layout element by element.
    pub fn zip<'a, U>(&'a self, other: &'a Params<U>) -> impl Iterator<Item = (&'a T, &'a U)> {
        assert_eq!(
            self.iter().count(),
            other.iter().count(),
            "zipping parameter sets of different layouts"
        );
        self.iter().zip(other.iter())
    }

    /// For each element, in `iter` order, whether it is a block's.
    pub fn in_blocks(&self) -> impl Iterator<Item = bool> + '_ {
        std::iter::once(false)
            .chain(self.layers.iter().flat_map(|l| l.iter().map(|_| true)))
            .chain(std::iter::once(false))
            .chain(self.lm_head.iter().map(|_| false))
    }

    /// Where block `l`'s tensors are in `iter` order (after the embedding, block by block).
    pub fn block_indices(&self, l: usize) -> std::ops::Range<usize> {
        let per_block = self.layers[0].iter().count();
        1 + l * per_block..1 + (l + 1) * per_block
    }

    /// The parameters outside the blocks, in `iter` order: the embedding, the final norm and
    /// an untied head.
    pub fn outside_blocks(&self) -> impl Iterator<Item = &T> {
        std::iter::once(&self.embed)
            .chain(std::iter::once(&self.final_norm))
            .chain(self.lm_head.as_ref())
    }

    /// The LM head's weight: its own, or the embedding when tied.
    pub fn head(&self) -> &T {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

impl Params<ParamSpec> {
    /// The layout of `config`'s parameters, every tensor of `dtype`.
    pub fn layout(config: &ModelConfig, dtype: DType) -> Params<ParamSpec> {
        let (c, f, v) = (
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
        );
        let (q, kv, d) = (config.q_dim(), config.kv_dim(), config.head_dim);
        let spec = |name: String, shape: &[usize], kind, hf: Vec<(String, usize)>| ParamSpec {
            tensor: TensorSpec::new(name, shape, dtype),
            kind,
            hf,
        };
        let layers = (0..config.num_layers)
            .map(|i| {
                let n = |s: &str| format!("layers.{i}.{s}");
                let hf = |s: &str| format!("model.layers.{i}.{s}");
                LayerParams {
                    ln1: spec(
                        n("ln1"),
                        &[c],
                        ParamKind::Norm,
                        vec![(hf("input_layernorm.weight"), c)],
                    ),
                    qkv: spec(
                        n("qkv"),
                        &[q + 2 * kv, c],
                        ParamKind::Matrix,
                        vec![
                            (hf("self_attn.q_proj.weight"), q),
                            (hf("self_attn.k_proj.weight"), kv),
                            (hf("self_attn.v_proj.weight"), kv),
                        ],
                    ),
                    qkv_bias: config.qkv_bias.then(|| {
                        spec(
                            n("qkv_bias"),
                            &[q + 2 * kv],
                            ParamKind::Bias,
                            vec![
                                (hf("self_attn.q_proj.bias"), q),
                                (hf("self_attn.k_proj.bias"), kv),
                                (hf("self_attn.v_proj.bias"), kv),
                            ],
                        )
                    }),
                    q_norm: config.qk_norm.then(|| {
                        let hf_name = hf("self_attn.q_norm.weight");
                        spec(n("q_norm"), &[d], ParamKind::Norm, vec![(hf_name, d)])
                    }),
                    k_norm: config.qk_norm.then(|| {
                        let hf_name = hf("self_attn.k_norm.weight");
                        spec(n("k_norm"), &[d], ParamKind::Norm, vec![(hf_name, d)])
                    }),
                    o: spec(
                        n("o"),
                        &[c, q],
                        ParamKind::ResidualMatrix,
                        vec![(hf("self_attn.o_proj.weight"), c)],
                    ),
                    ln2: spec(
                        n("ln2"),
                        &[c],
                        ParamKind::Norm,
                        vec![(hf("post_attention_layernorm.weight"), c)],
                    ),
                    gate_up: spec(
                        n("gate_up"),
                        &[2 * f, c],
                        ParamKind::Matrix,
                        vec![
                            (hf("mlp.gate_proj.weight"), f),
                            (hf("mlp.up_proj.weight"), f),
                        ],
                    ),
                    down: spec(
                        n("down"),
                        &[c, f],
                        ParamKind::ResidualMatrix,
                        vec![(hf("mlp.down_proj.weight"), c)],
                    ),
                }
            })
            .collect();
        Params {
            embed: spec(
                "embed".into(),
                &[v, c],
                ParamKind::Embedding,
                vec![("model.embed_tokens.weight".into(), v)],
            ),
            layers,
            final_norm: spec(
                "final_norm".into(),
                &[c],
                ParamKind::Norm,
                vec![("model.norm.weight".into(), c)],
            ),
            lm_head: (!config.tie_word_embeddings).then(|| {
                spec(
                    "lm_head".into(),
                    &[v, c],
                    ParamKind::Matrix,
                    vec![("lm_head.weight".into(), v)],
                )
            }),
        }
    }

    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        self.iter().map(|p| p.tensor.clone()).collect()
    }
}

/// Builds a structure of tensors from a list in `Params::iter` order, such as the result of
/// one `Backend::allocate` call over `tensor_specs()`.
pub fn from_list<T: Clone>(layout: &Params<ParamSpec>, list: Vec<T>) -> Params<T> {
    let mut items = list.into_iter();
    layout
        .try_map(|_| Ok(items.next().expect("one tensor per parameter")))
        .expect("infallible")
}
