//! Token files. Files are built here byte by byte from the format description
//! (docs/data.md), independently of `TokenWriter`, then read through
//! the loader: v1 and v2 headers, masks applied at the target's position, and a shuffle
//! that is reproducible from its seed.

use std::collections::BTreeSet;
use std::path::Path;

use smelt::backend::cpu::IGNORE_INDEX;
use smelt::data::tokfile::{Header, TokenFile, TokenWriter};
use smelt::train::loader::{Batch, DataSet, EvalSet, Loader, LoaderState};

/// A BIN.TOK file as the format describes it: 256 little-endian int32 of header (magic
/// `BIN.TOK\n`, version, bytes per token, count, vocabulary, has-mask), the tokens as int32,
/// then the mask bits, least significant bit first.
fn by_hand(version: i32, tokens: &[i32], vocab: i32, mask: Option<&[bool]>) -> Vec<u8> {
    let mut header = [0i32; 256];
    header[0] = i32::from_le_bytes(*b"BIN.");
    header[1] = i32::from_le_bytes(*b"TOK\n");
    header[2] = version;
    header[3] = 4;
    header[4] = tokens.len() as i32;
    if version == 2 {
        header[5] = vocab;
        header[6] = mask.is_some() as i32;
    }
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    if let Some(mask) = mask {
        for byte in mask.chunks(8) {
            bytes.push(byte.iter().enumerate().map(|(i, &b)| (b as u8) << i).sum());
        }
    }
    bytes
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn reads_v1_and_v2_files_written_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<i32> = (0..40).map(|i| (i * 7) % 50).collect();
    let v1 = dir.path().join("v1.bin");
    write(&v1, &by_hand(1, &tokens, 0, None));
    let f = TokenFile::open(&v1, Some(50)).unwrap();
    assert_eq!(
        f.header,
        Header {
            version: 1,
            tokens: 40,
            vocab_size: None,
            has_mask: false
        }
    );
    assert!((0..40).all(|i| f.token(i) == tokens[i] && f.trained(i)));

    let v2 = dir.path().join("v2.bin");
    let mask: Vec<bool> = (0..40).map(|i| i % 3 != 0).collect();
    write(&v2, &by_hand(2, &tokens, 50, Some(&mask)));
    let f = TokenFile::open(&v2, Some(50)).unwrap();
    assert_eq!((f.header.version, f.header.vocab_size), (2, Some(50)));
    assert!((0..40).all(|i| f.token(i) == tokens[i] && f.trained(i) == mask[i]));
}

#[test]
fn written_files_match_the_format_description() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<i32> = (0..21).collect();
    let mask: Vec<bool> = (0..21).map(|i| i % 4 == 1).collect();
    let path = dir.path().join("w.bin");
    let mut w = TokenWriter::create(&path, Some(30), true).unwrap();
    w.write(&tokens, Some(&mask)).unwrap();
    w.finish().unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        by_hand(2, &tokens, 30, Some(&mask))
    );
    // A version-1 header, as older llm.q files carry.
    let v1 = Header {
        version: 1,
        tokens: 21,
        vocab_size: None,
        has_mask: false,
    };
    assert_eq!(v1.to_bytes().to_vec(), by_hand(1, &tokens, 0, None)[..1024]);
}

#[test]
fn the_mask_bit_of_the_target_position_decides() {
    let dir = tempfile::tempdir().unwrap();
    let n = 41;
    let tokens: Vec<i32> = (0..n).map(|i| 100 + i).collect();
    // Position p is trained as a target unless p is a multiple of 5.
    let mask: Vec<bool> = (0..n).map(|p| p % 5 != 0).collect();
    write(
        &dir.path().join("m.bin"),
        &by_hand(2, &tokens, 200, Some(&mask)),
    );
    let seq = 8;
    let data = DataSet::open(
        dir.path().join("m.bin").to_str().unwrap(),
        "--eval-file",
        200,
        seq,
    )
    .unwrap();
    // (41 - 1) / 8 = 5 sequences, read in order by the eval set: one batch of 5.
    let eval = EvalSet::new(data, 5, 0, 1);
    assert_eq!(eval.num_batches(), 1);
    let mut batch = Batch::new(5 * seq);
    eval.fill(0, &mut batch);
    for k in 0..5 {
        for i in 0..seq {
            let (input, target) = (k * seq + i, k * seq + i + 1);
            assert_eq!(batch.tokens[input], 100 + input as i32);
            let expected = if target % 5 != 0 {
                100 + target as i32
            } else {
                IGNORE_INDEX
            };
            assert_eq!(batch.targets[input], expected, "input position {input}");
        }
    }
    // Position 5 is masked: its own target (position 6) is trained, the target at 5 is not.
    assert_eq!((batch.targets[4], batch.targets[5]), (IGNORE_INDEX, 106));
}

/// Tokens per sequence in the shuffle tests, and the sequences of `four_files`: 8 + 16 + 4 + 12.
const SEQ: usize = 10;
const TOTAL: usize = 40;

/// Four files whose tokens are `1000·file + position`, so that a sequence names its
/// origin; returns their glob.
fn four_files(dir: &Path) -> String {
    for (f, len) in [81, 161, 41, 121].into_iter().enumerate() {
        let tokens: Vec<i32> = (0..len).map(|p| (1000 * f + p) as i32).collect();
        write(
            &dir.join(format!("part-{f}.bin")),
            &by_hand(2, &tokens, 10_000, None),
        );
    }
    dir.join("part-*.bin").to_str().unwrap().to_string()
}

fn loader(pattern: &str, seed: u64, rank: usize, world: usize) -> Loader {
    let data = DataSet::open(pattern, "--train-file", 10_000, SEQ).unwrap();
    Loader::new(data, seed, rank, world).unwrap()
}

/// The (file, position) at which each of the next `n` sequences starts.
fn take(loader: &mut Loader, n: usize) -> Vec<(i32, i32)> {
    let mut batch = Batch::new(SEQ);
    (0..n)
        .map(|_| {
            loader.next_batch(&mut batch);
            (batch.tokens[0] / 1000, batch.tokens[0] % 1000)
        })
        .collect()
}

#[test]
fn shuffle_is_two_level_and_reproducible_from_the_seed() {
    let dir = tempfile::tempdir().unwrap();
    let pattern = four_files(dir.path());
    let mut a = loader(&pattern, 7, 0, 1);
    assert_eq!(a.per_epoch(), TOTAL);
    let epoch1 = take(&mut a, TOTAL);
    let epoch2 = take(&mut a, TOTAL);
    assert_eq!(
        take(&mut loader(&pattern, 7, 0, 1), TOTAL),
        epoch1,
        "same seed"
    );
    assert_ne!(
        take(&mut loader(&pattern, 8, 0, 1), TOTAL),
        epoch1,
        "another seed"
    );
    assert_ne!(epoch1, epoch2, "each epoch reshuffles");
    for epoch in [&epoch1, &epoch2] {
        // Every sequence exactly once per epoch ...
        let all: BTreeSet<(i32, i32)> = epoch.iter().copied().collect();
        assert_eq!(all.len(), TOTAL);
        assert!(all.iter().all(|&(_, p)| p % SEQ as i32 == 0));
        // ... one file after another (the first level), in shuffled order within each.
        let mut runs: Vec<i32> = epoch.iter().map(|x| x.0).collect();
        runs.dedup();
        assert_eq!(runs.len(), 4, "files interleave: {runs:?}");
    }
    let in_file_order = |e: &[(i32, i32)]| e.windows(2).all(|w| w[0].0 != w[1].0 || w[0] < w[1]);
    assert!(
        !in_file_order(&epoch1),
        "sequences within files are not shuffled"
    );

    // The position restores exactly: mid-epoch, reading on across the epoch boundary, and
    // saved right at the boundary (every sequence of the epoch taken).
    for saved_at in [33, TOTAL] {
        let mut b = loader(&pattern, 7, 0, 1);
        take(&mut b, saved_at);
        let state = b.state();
        let expected = take(&mut b, 20);
        let mut c = loader(&pattern, 7, 0, 1);
        c.restore(state).unwrap();
        assert_eq!(take(&mut c, 20), expected, "saved after {saved_at}");
    }
    // A position past the end of the epoch cannot come from these files.
    let mut d = loader(&pattern, 7, 0, 1);
    let mut past = d.state();
    past.taken = TOTAL as u64 + 1;
    let err = d.restore(past).unwrap_err().to_string();
    assert!(err.contains("differ from the checkpoint's"), "{err}");
}

/// The one-rank order of `epochs` epochs: the training stream.
fn stream(pattern: &str, seed: u64, epochs: usize) -> Vec<(i32, i32)> {
    take(&mut loader(pattern, seed, 0, 1), epochs * TOTAL)
}

/// Rank r of W takes stream positions r, r+W, ..., epoch after epoch, leaving none out: 40
/// sequences do not divide over 3 ranks, so a round runs from one epoch into the next.
#[test]
fn ranks_take_every_wth_position_of_one_stream() {
    let dir = tempfile::tempdir().unwrap();
    let pattern = four_files(dir.path());
    let order = stream(&pattern, 3, 3);
    for world in [2, 3] {
        for rank in 0..world {
            let mut r = loader(&pattern, 3, rank, world);
            assert_eq!(r.per_epoch(), TOTAL);
            let expected: Vec<_> = order.iter().copied().skip(rank).step_by(world).collect();
            let n = expected.len().min(100 / world);
            assert_eq!(take(&mut r, n), expected[..n], "rank {rank} of {world}");
        }
    }
}

/// The position is global, so it continues on another number of ranks: after 13 rounds of 3
/// ranks (39 sequences), 2 ranks take on from position 39, into the second epoch.
#[test]
fn a_position_continues_on_another_number_of_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let pattern = four_files(dir.path());
    let order = stream(&pattern, 3, 2);
    let mut three: Vec<Loader> = (0..3).map(|r| loader(&pattern, 3, r, 3)).collect();
    for r in &mut three {
        take(r, 13);
    }
    let saved = three[0].state();
    assert_eq!(
        saved,
        LoaderState {
            epoch: 0,
            taken: 39
        }
    );
    assert!(three.iter().all(|r| r.state() == saved));
    for rank in 0..2 {
        let mut r = loader(&pattern, 3, rank, 2);
        r.restore(saved).unwrap();
        let expected: Vec<_> = order[39..].iter().copied().skip(rank).step_by(2).collect();
        assert_eq!(take(&mut r, 10), expected[..10], "rank {rank}");
    }
}

/// Checkpoints of format version 1 saved each rank's own count, and their ranks took the
/// epoch's positions r, r+W, ... up to its last whole round (39 of 40 on 3 ranks). Converted,
/// the position continues as those ranks would have: mid-epoch, and from the end of an epoch
/// (13 rounds), where they went on with the next epoch.
#[test]
fn a_per_rank_position_of_version_1_continues_where_its_ranks_would_have() {
    let dir = tempfile::tempdir().unwrap();
    let pattern = four_files(dir.path());
    let order = stream(&pattern, 3, 2);
    let old_rank = |rank: usize| -> Vec<(i32, i32)> {
        let epoch = |e: usize| {
            order[e * TOTAL..][..39]
                .iter()
                .copied()
                .skip(rank)
                .step_by(3)
        };
        epoch(0).chain(epoch(1)).collect()
    };
    for taken in [5, 13] {
        let saved = LoaderState { epoch: 0, taken }.from_per_rank(3, TOTAL);
        for rank in 0..3 {
            let mut r = loader(&pattern, 3, rank, 3);
            r.restore(saved).unwrap();
            let expected = &old_rank(rank)[taken as usize..][..5];
            assert_eq!(take(&mut r, 5), expected, "rank {rank} after {taken}");
        }
    }
    assert!(!LoaderState::is_exact_from_per_rank(3, TOTAL));
    assert!(LoaderState::is_exact_from_per_rank(2, TOTAL));
    // One rank counted the stream: nothing changes.
    let one = LoaderState {
        epoch: 1,
        taken: 40,
    };
    assert_eq!(one.from_per_rank(1, TOTAL), one);
}
