//! Causal grouped-query attention, written as the textbook softmax(q·kᵀ/√d)·v per query.
//!
//! Each (batch, head) task computes into buffers of its own, which are then scattered into
//! the interleaved `[B·T, heads·d]` layout; that keeps the parallel loop free of shared
//! writes and the result independent of scheduling.

use rayon::prelude::*;

use anyhow::{Result, ensure};

use super::{Cpu, Scalar, rounding, sum_f64};
use crate::backend::{AttentionOps, AttnShape};
use crate::tensor::Tensor;

fn dot<T: Scalar>(a: &[T], b: &[T]) -> T {
    sum_f64(a.iter().zip(b).map(|(&x, &y)| x * y))
}

/// Where one head's vectors live in `qkv`.
struct Heads<'a, T> {
    qkv: &'a [T],
    s: AttnShape,
    batch: usize,
}

impl<'a, T: Scalar> Heads<'a, T> {
    fn at(&self, t: usize, head: usize) -> &'a [T] {
        let d = self.s.head_dim;
        let row = (self.batch * self.s.seq + t) * self.s.qkv_width();
        &self.qkv[row + head * d..row + (head + 1) * d]
    }
    fn q(&self, t: usize, h: usize) -> &'a [T] {
        self.at(t, h)
    }
    fn k(&self, t: usize, kvh: usize) -> &'a [T] {
        self.at(t, self.s.q_heads + kvh)
    }
    fn v(&self, t: usize, kvh: usize) -> &'a [T] {
        self.at(t, self.s.q_heads + self.s.kv_heads + kvh)
    }
}

fn scale<T: Scalar>(s: AttnShape) -> T {
    T::of(1.0 / (s.head_dim as f64).sqrt())
}

/// Where each token's document starts and ends in its sequence (`AttentionOps`'s `docs`), or
/// without them the whole sequence.
#[derive(Clone, Copy)]
pub(super) struct Spans<'a> {
    docs: Option<&'a [i32]>,
    s: AttnShape,
}

impl<'a> Spans<'a> {
    pub(super) fn new(docs: Option<&'a [i32]>, s: AttnShape) -> Self {
        Spans { docs, s }
    }
    /// The first token of the document of token `t` of sequence `b`.
    pub(super) fn start(&self, b: usize, t: usize) -> usize {
        self.docs.map_or(0, |d| d[b * self.s.seq + t] as usize)
    }
    /// One past the last token of that document.
    fn end(&self, b: usize, t: usize) -> usize {
        self.docs.map_or(self.s.seq, |d| {
            d[(self.s.batch + b) * self.s.seq + t] as usize
        })
    }
}

/// Query `t` of head `h` against keys and values `first..=t`: writes its output into `o_t`
/// and returns its log-sum-exp. `scores` holds at least `t + 1 - first` values.
fn attend_row<T: Scalar>(
    heads: &Heads<T>, h: usize, t: usize, first: usize, scores: &mut [T], o_t: &mut [T],
) -> T {
    let kvh = h / (heads.s.q_heads / heads.s.kv_heads);
    let q = heads.q(t, h);
    let scores = &mut scores[..=t - first];
    for (j, score) in (first..).zip(scores.iter_mut()) {
        *score = dot(q, heads.k(j, kvh)) * scale(heads.s);
    }
    let max = scores.iter().fold(T::neg_infinity(), |m, &x| m.max(x));
    let lse = max + sum_f64(scores.iter().map(|&x| (x - max).exp())).ln();
    for (j, &score) in (first..).zip(scores.iter()) {
        let p = (score - lse).exp();
        for (o, &v) in o_t.iter_mut().zip(heads.v(j, kvh)) {
            *o += p * v;
        }
    }
    lse
}

/// out: `[B·T, Hq·d]`; lse: `[B, Hq, T]`.
fn attention_forward<T: Scalar>(
    out: &mut [T], lse: &mut [T], qkv: &[T], s: AttnShape, spans: Spans,
) {
    let d = s.head_dim;
    let per_head: Vec<(Vec<T>, Vec<T>)> = (0..s.batch * s.q_heads)
        .into_par_iter()
        .map(|bh| {
            let heads = Heads {
                qkv,
                s,
                batch: bh / s.q_heads,
            };
            let (mut o, mut l, mut scores) = (
                vec![T::zero(); s.seq * d],
                vec![T::zero(); s.seq],
                vec![T::zero(); s.seq],
            );
            for t in 0..s.seq {
                l[t] = attend_row(
                    &heads,
                    bh % s.q_heads,
                    t,
                    spans.start(heads.batch, t),
                    &mut scores,
                    &mut o[t * d..(t + 1) * d],
                );
            }
            (o, l)
        })
        .collect();
    for (bh, (o, l)) in per_head.into_iter().enumerate() {
        let (b, h) = (bh / s.q_heads, bh % s.q_heads);
        for t in 0..s.seq {
            let row = (b * s.seq + t) * s.q_heads * d + h * d;
            out[row..row + d].copy_from_slice(&o[t * d..(t + 1) * d]);
        }
        lse[bh * s.seq..(bh + 1) * s.seq].copy_from_slice(&l);
    }
}

/// Row `at` of `attention_forward` over one sequence alone: out `[1, Hq·d]`.
fn attention_decode<T: Scalar>(out: &mut [T], qkv: &[T], at: usize, s: AttnShape) {
    let heads = Heads { qkv, s, batch: 0 };
    let d = s.head_dim;
    out.par_chunks_mut(d).enumerate().for_each(|(h, o)| {
        o.fill(T::zero());
        attend_row(&heads, h, at, 0, &mut vec![T::zero(); at + 1], o);
    });
}

/// Writes `dqkv` from `dout`, using the saved `out` and `lse`:
/// `dS = P ⊙ (dout·vᵀ − rowsum(dout ⊙ out))`, `dq = dS·k/√d`, `dk = dSᵀ·q/√d`, `dv = Pᵀ·dout`.
fn attention_backward<T: Scalar>(
    dqkv: &mut [T], dout: &[T], qkv: &[T], out: &[T], lse: &[T], s: AttnShape, spans: Spans,
) {
    let (d, group) = (s.head_dim, s.q_heads / s.kv_heads);
    let row_of = |b: usize, t: usize, h: usize| (b * s.seq + t) * s.q_heads * d + h * d;
    // Per (batch, kv head): dq for the group's query heads `[group, T, d]`, then dk and dv `[T, d]`.
    let per_group: Vec<(Vec<T>, Vec<T>, Vec<T>)> = (0..s.batch * s.kv_heads)
        .into_par_iter()
        .map(|bk| {
            let (b, kvh) = (bk / s.kv_heads, bk % s.kv_heads);
            let heads = Heads { qkv, s, batch: b };
            let mut dq = vec![T::zero(); group * s.seq * d];
            let (mut dk, mut dv) = (vec![T::zero(); s.seq * d], vec![T::zero(); s.seq * d]);
            for g in 0..group {
                let h = kvh * group + g;
                for t in 0..s.seq {
                    let (q, do_t) = (heads.q(t, h), &dout[row_of(b, t, h)..row_of(b, t, h) + d]);
                    let delta = dot(do_t, &out[row_of(b, t, h)..row_of(b, t, h) + d]);
                    let l = lse[(b * s.q_heads + h) * s.seq + t];
                    let dq_t = &mut dq[(g * s.seq + t) * d..(g * s.seq + t + 1) * d];
                    for j in spans.start(b, t)..=t {
                        let (k, v) = (heads.k(j, kvh), heads.v(j, kvh));
                        let p = (dot(q, k) * scale(s) - l).exp();
                        let ds = p * (dot(do_t, v) - delta) * scale(s);
                        for i in 0..d {
                            dq_t[i] += ds * k[i];
                            dk[j * d + i] += ds * q[i];
                            dv[j * d + i] += p * do_t[i];
                        }
                    }
                }
            }
            (dq, dk, dv)
        })
        .collect();
    let w = s.qkv_width();
    for (bk, (dq, dk, dv)) in per_group.into_iter().enumerate() {
        let (b, kvh) = (bk / s.kv_heads, bk % s.kv_heads);
        for t in 0..s.seq {
            let row = &mut dqkv[(b * s.seq + t) * w..(b * s.seq + t + 1) * w];
            for g in 0..group {
                let h = kvh * group + g;
                row[h * d..(h + 1) * d]
                    .copy_from_slice(&dq[(g * s.seq + t) * d..(g * s.seq + t + 1) * d]);
            }
            let k_at = (s.q_heads + kvh) * d;
            let v_at = (s.q_heads + s.kv_heads + kvh) * d;
            row[k_at..k_at + d].copy_from_slice(&dk[t * d..(t + 1) * d]);
            row[v_at..v_at + d].copy_from_slice(&dv[t * d..(t + 1) * d]);
        }
    }
}

impl<T: Scalar> AttentionOps for Cpu<T> {
    fn attention_forward(
        &self, out: &Tensor<Self>, lse: &Tensor<Self>, qkv: &Tensor<Self>, shape: AttnShape,
        docs: Option<&Tensor<Self>>, amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        {
            let qkv = self.floats(qkv)?;
            let docs = self.documents(docs, shape)?;
            let spans = Spans::new(docs.as_deref(), shape);
            let mut lse_v = self.floats_mut(lse)?;
            self.update(out, |o| {
                attention_forward(o, &mut lse_v, &qkv, shape, spans)
            })?;
            rounding::round_slice(lse.dtype, &mut lse_v);
        }
        self.report_abs_max(amax, out)
    }

    fn attention_decode(
        &self, out: &Tensor<Self>, qkv: &Tensor<Self>, at: &Tensor<Self>, shape: AttnShape,
    ) -> Result<()> {
        ensure!(
            shape.batch == 1 && qkv.numel() == shape.seq * shape.qkv_width(),
            "attention_decode: qkv {:?} for {shape:?} (one sequence)",
            qkv.shape
        );
        let at = (self.ints(at)?[0].max(0) as usize).min(shape.seq - 1);
        let qkv = self.floats(qkv)?;
        self.update(out, |o| attention_decode(o, &qkv, at, shape))
    }

    fn attention_backward(
        &self, dqkv: &Tensor<Self>, dout: &Tensor<Self>, qkv: &Tensor<Self>, out: &Tensor<Self>,
        lse: &Tensor<Self>, shape: AttnShape, docs: Option<&Tensor<Self>>,
    ) -> Result<()> {
        let (dout, qkv, out, lse) = (
            self.floats(dout)?,
            self.floats(qkv)?,
            self.floats(out)?,
            self.floats(lse)?,
        );
        let docs = self.documents(docs, shape)?;
        let spans = Spans::new(docs.as_deref(), shape);
        self.update(dqkv, |d| {
            attention_backward(d, &dout, &qkv, &out, &lse, shape, spans)
        })
    }
}

impl<T: Scalar> Cpu<T> {
    /// `docs`' values, checked to be `[2, B, T]` i32 of runs within each sequence.
    pub(super) fn documents<'a>(
        &self, docs: Option<&'a Tensor<Self>>, s: AttnShape,
    ) -> Result<Option<std::cell::Ref<'a, [i32]>>> {
        let Some(docs) = docs else { return Ok(None) };
        let bounds = self.ints(docs)?;
        ensure!(
            bounds.len() == 2 * s.batch * s.seq,
            "attention: docs {:?} for {s:?} (want [2, B, T])",
            docs.shape
        );
        let spans = Spans::new(Some(&bounds), s);
        for b in 0..s.batch {
            for t in 0..s.seq {
                let (start, end) = (spans.start(b, t), spans.end(b, t));
                ensure!(
                    start <= t && t < end && end <= s.seq,
                    "attention: token {t} of sequence {b} lies outside its document [{start}, {end})"
                );
            }
        }
        Ok(Some(bounds))
    }
}
