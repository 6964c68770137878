//! How the next token is drawn from the logits: greedy (temperature 0) or sampling with a
//! temperature, optionally from the top k tokens and from the smallest set holding
//! probability p (nucleus), applied in that order, as transformers does.

use rayon::prelude::*;

use crate::rng::Rng;

/// How the next token is drawn from the logits.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    /// 0 picks the most likely token.
    pub temperature: f32,
    /// Draw only from the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Then only from the most likely tokens whose probabilities, renormalised over those
    /// left, first sum to at least this; 1 keeps all.
    pub top_p: f64,
}

impl Sampling {
    /// Plain temperature sampling.
    pub fn temperature(temperature: f32) -> Self {
        Sampling {
            temperature,
            top_k: 0,
            top_p: 1.0,
        }
    }
}

/// The most likely token at temperature 0, else a draw from softmax(logits / temperature)
/// restricted to `s.top_k` and `s.top_p`.
pub(super) fn pick(logits: &[f32], s: &Sampling, rng: &mut Rng) -> i32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if s.temperature <= 0.0 {
        return logits.iter().position(|&l| l == max).unwrap_or(0) as i32;
    }
    // A vocabulary's worth of exponentials, in parallel: computed serially they cost a GPU's
    // whole token.
    let weights: Vec<f64> = logits
        .par_iter()
        .map(|&l| (((l - max) / s.temperature) as f64).exp())
        .collect();
    let (top_k, top_p) = (s.top_k > 0 && s.top_k < weights.len(), s.top_p < 1.0);
    if !top_k && !top_p {
        // Every token a candidate, in order, without a list of them: a vocabulary's worth
        // of indices is memory to fault in, at every token.
        return draw((0..weights.len()).map(|c| (c, weights[c])), rng);
    }
    let mut candidates: Vec<usize> = (0..weights.len()).collect();
    if top_k {
        candidates.select_nth_unstable_by(s.top_k - 1, |a, b| more_likely(&weights, *a, *b));
        candidates.truncate(s.top_k);
        candidates.sort_unstable();
    }
    if top_p {
        candidates = nucleus(candidates, &weights, s.top_p);
    }
    draw(candidates.iter().map(|&c| (c, weights[c])), rng)
}

/// Most likely first, ties in token order.
fn more_likely(weights: &[f64], a: usize, b: usize) -> std::cmp::Ordering {
    weights[b].total_cmp(&weights[a]).then(a.cmp(&b))
}

/// How many of the most likely candidates `nucleus` sorts first.
const NUCLEUS_HEAD: usize = 1024;

/// The fewest most likely of `candidates` (in token order) whose weights add up to at least
/// `p` of theirs, most likely first. A nucleus is most often a few tokens of a vocabulary of
/// 150k, whose sorting would cost more than the GPU's token: only the `NUCLEUS_HEAD` most
/// likely are sorted, and the rest only if those fall short (as for a barely trained model),
/// on every core.
fn nucleus(mut candidates: Vec<usize>, weights: &[f64], p: f64) -> Vec<usize> {
    let total: f64 = candidates.iter().map(|&c| weights[c]).sum();
    let order = |a: &usize, b: &usize| more_likely(weights, *a, *b);
    // How long a prefix of the `head` most likely, sorted, reaches p · total, if one does.
    let reach = |candidates: &mut [usize], head: usize| {
        if head < candidates.len() {
            candidates.select_nth_unstable_by(head - 1, order);
        }
        candidates[..head].par_sort_unstable_by(order);
        let mut sum = 0.0;
        candidates[..head]
            .iter()
            .position(|&c| {
                sum += weights[c];
                sum >= p * total
            })
            .map(|i| i + 1)
    };
    let n = candidates.len();
    let keep = reach(&mut candidates, NUCLEUS_HEAD.min(n))
        .or_else(|| reach(&mut candidates, n))
        // Rounding left the sum short of p · total: every candidate stays.
        .unwrap_or(n);
    candidates.truncate(keep);
    candidates
}

/// A token drawn with probability proportional to its weight, scanning in the given order.
fn draw(weighted: impl Iterator<Item = (usize, f64)> + Clone, rng: &mut Rng) -> i32 {
    let mut u = rng.uniform() * weighted.clone().map(|c| c.1).sum::<f64>();
    let mut last = 0;
    for (token, w) in weighted {
        if u < w {
            return token as i32;
        }
        u -= w;
        last = token;
    }
    last as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How often each token is drawn in `n` picks.
    fn frequencies(logits: &[f32], s: Sampling, n: usize) -> Vec<f64> {
        let mut rng = Rng::new(1);
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..n {
            counts[pick(logits, &s, &mut rng) as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    /// Each frequency within 5 standard errors of `expected` (an excluded token: never).
    fn assert_follows(freq: &[f64], expected: &[f64], n: usize) {
        for (f, p) in freq.iter().zip(expected) {
            let sigma = (p * (1.0 - p) / n as f64).sqrt();
            assert!(
                (f - p).abs() <= 5.0 * sigma,
                "{freq:?} against {expected:?}"
            );
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_sampling_follows_the_softmax() {
        let mut rng = Rng::new(1);
        let greedy = Sampling::temperature(0.0);
        assert_eq!(pick(&[0.0, 3.0, 3.0, 1.0], &greedy, &mut rng), 1);
        // Probabilities ∝ exp([0, ln 3]) = [1/4, 3/4].
        let n = 20_000;
        let freq = frequencies(&[0.0, 3f32.ln()], Sampling::temperature(1.0), n);
        assert_follows(&freq, &[0.25, 0.75], n);
        // At temperature 1/2 the weights square: ∝ [1, 9].
        let freq = frequencies(&[0.0, 3f32.ln()], Sampling::temperature(0.5), n);
        assert_follows(&freq, &[0.1, 0.9], n);
    }

    #[test]
    fn the_nucleus_is_the_shortest_most_likely_prefix_whether_or_not_the_head_holds_it() {
        // Reference: every candidate sorted (a stable sort keeps ties in token order).
        let reference = |weights: &[f64], p: f64| {
            let mut all: Vec<usize> = (0..weights.len()).collect();
            all.sort_by(|a, b| weights[*b].total_cmp(&weights[*a]));
            let total: f64 = weights.iter().sum();
            let mut sum = 0.0;
            let keep = all.iter().position(|&c| {
                sum += weights[c];
                sum >= p * total
            });
            all.truncate(keep.map_or(all.len(), |i| i + 1));
            all
        };
        let n = 4 * NUCLEUS_HEAD;
        let mut rng = Rng::new(3);
        // Peaked (a few tokens hold most of the mass: the head suffices) and flat (the
        // nucleus runs past the head), with repeated values for ties.
        let peaked: Vec<f64> = (0..n)
            .map(|_| (-8.0 * rng.uniform()).exp().powi(3))
            .collect();
        let flat: Vec<f64> = (0..n)
            .map(|_| 1.0 + (rng.uniform() * 8.0).floor())
            .collect();
        for (weights, p) in [(&peaked, 0.5), (&peaked, 0.9), (&flat, 0.9), (&flat, 0.1)] {
            let kept = nucleus((0..n).collect(), weights, p);
            assert_eq!(kept, reference(weights, p), "p {p}");
        }
        assert!(nucleus((0..n).collect(), &peaked, 0.9).len() < NUCLEUS_HEAD);
        assert!(nucleus((0..n).collect(), &flat, 0.9).len() > NUCLEUS_HEAD);
    }

    #[test]
    fn top_k_and_top_p_draw_from_the_most_likely_tokens_renormalised() {
        // Probabilities 0.1, 0.4, 0.2, 0.3 (token 1 most likely, then 3, 2, 0).
        let logits = [1f32, 4.0, 2.0, 3.0].map(f32::ln);
        let n = 20_000;
        let sampling = |top_k, top_p| Sampling {
            temperature: 1.0,
            top_k,
            top_p,
        };
        // The two most likely: 0.4 and 0.3, renormalised.
        let two = [0.0, 4.0 / 7.0, 0.0, 3.0 / 7.0];
        assert_follows(&frequencies(&logits, sampling(2, 1.0), n), &two, n);
        // Nucleus 0.5: 0.4 falls short, 0.4 + 0.3 reaches it.
        assert_follows(&frequencies(&logits, sampling(0, 0.5), n), &two, n);
        // Nucleus 0.35: the first token alone reaches it.
        let one = [0.0, 1.0, 0.0, 0.0];
        assert_follows(&frequencies(&logits, sampling(0, 0.35), n), &one, n);
        // Top 2 first (4/7 and 3/7), then nucleus 0.55 of those: 4/7 alone reaches it (over
        // all four tokens, 0.4 would not).
        assert_follows(&frequencies(&logits, sampling(2, 0.55), n), &one, n);
        // k past the vocabulary and p = 1 keep the whole softmax.
        let all = [0.1, 0.4, 0.2, 0.3];
        assert_follows(&frequencies(&logits, sampling(10, 1.0), n), &all, n);
    }
}
