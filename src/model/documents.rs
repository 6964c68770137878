//! Packed documents: token files put documents end to end, each closed by an EOS token, and a
//! training sequence is a window over them. With `--doc-mask` a token attends only within its
//! own document, and with `--doc-positions` its RoPE position counts from its document's
//! start; `spans` finds the documents of a batch for the attention and RoPE ops.

use serde::Serialize;

/// How the documents packed into a sequence are told apart, and what keeps them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Documents {
    /// The token that ends each document: the token after it starts the next.
    pub eos: i32,
    /// Attention stays within a document (`--doc-mask`).
    pub mask: bool,
    /// RoPE positions restart at each document (`--doc-positions`).
    pub positions: bool,
}

/// The spans `AttentionOps` takes as `docs`, for `tokens` in sequences of `seq`: `[2, B, T]`,
/// each token's document start in its sequence, then that document's end (exclusive). A
/// document runs up to and including its EOS; a sequence's first token starts one, and its
/// last ends one, wherever the window cut them.
pub fn spans(tokens: &[i32], seq: usize, eos: i32) -> Vec<i32> {
    let mut spans = vec![0; 2 * tokens.len()];
    let (starts, ends) = spans.split_at_mut(tokens.len());
    for ((tokens, starts), ends) in tokens
        .chunks(seq)
        .zip(starts.chunks_mut(seq))
        .zip(ends.chunks_mut(seq))
    {
        let mut start = 0;
        for (t, &token) in tokens.iter().enumerate() {
            starts[t] = start as i32;
            if token == eos || t + 1 == seq {
                ends[start..=t].fill(t as i32 + 1);
                start = t + 1;
            }
        }
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_document_runs_through_its_eos_and_each_sequence_starts_afresh() {
        // Two sequences of 6 with EOS = 0: [5 6 0 | 7 0 | 8] and [9 | 0 0 | 1 2 3] cut mid-way.
        let tokens = [5, 6, 0, 7, 0, 8, 9, 0, 0, 1, 2, 3];
        let spans = spans(&tokens, 6, 0);
        let (starts, ends) = spans.split_at(12);
        assert_eq!(starts, [0, 0, 0, 3, 3, 5, 0, 0, 2, 3, 3, 3]);
        assert_eq!(ends, [3, 3, 3, 5, 5, 6, 2, 2, 3, 6, 6, 6]);
    }
}
