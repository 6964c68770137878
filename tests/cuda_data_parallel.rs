//! NCCL between two GPUs (`--gpus 2`): the gradient sum and the broadcast of weights give
//! what the host computes from the same values, bit for bit, and a rank that fails does not
//! leave the other waiting inside a collective. (The trainer's use of them is
//! tested on CPU ranks in `train_data_parallel.rs`, and end to end on two GPUs by
//! `scripts/gpu/multi_gpu.sh`.)

mod common;

use common::gpu::*;
use half::bf16;
use smelt::backend::cuda::{Cuda, device};
use smelt::backend::prelude::*;
use smelt::comm::nccl::Nccl;
use smelt::comm::{Comm, ranks};
use smelt::tensor::{DType, TensorSpec};
use std::time::{Duration, Instant};

const N: usize = 100_003;
/// The ranks' timeout where it is not what a test tests (`--comm-timeout`'s default).
const LONG: Duration = Duration::from_secs(600);

/// Rank `rank`'s values of tensor `which`, as its upload rounds them to `dtype`.
fn values(rank: usize, which: u64, dtype: DType) -> Vec<f32> {
    let raw = normal(N, 1.0 + rank as f64, 1000 * which + rank as u64);
    match dtype {
        DType::BF16 => raw.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
        _ => raw,
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn nccl_sums_and_broadcasts_like_the_host() {
    let gpus = device::gpu_count().unwrap();
    assert!(
        gpus >= 2,
        "this test needs two GPUs, the driver reports {gpus}"
    );
    let dtypes = [DType::BF16, DType::F32];
    let result = ranks::run(2, LONG, move |member| {
        let rank = member.rank;
        let b = Cuda::new(rank)?;
        let comm = Nccl::new(&b, member)?;
        assert_eq!((comm.rank(), comm.world()), (rank, 2));
        let summed: Vec<_> = (0..2)
            .map(|i| tensor(&b, &[N], dtypes[i], &values(rank, i as u64, dtypes[i])))
            .collect();
        // Two sums in flight at once, as the trainer starts one per block.
        for t in &summed {
            comm.start_all_reduce_sum(&b, &[t])?;
        }
        comm.join_all_reduce_sums(&b)?;
        // Tensor i comes from rank i.
        let sent: Vec<_> = (0..2)
            .map(|i| tensor(&b, &[N], dtypes[i], &values(rank, 10 + i as u64, dtypes[i])))
            .collect();
        comm.broadcast(&b, &[(&sent[0], 0), (&sent[1], 1)])?;
        for (i, dtype) in dtypes.into_iter().enumerate() {
            let (x, y) = (values(0, i as u64, dtype), values(1, i as u64, dtype));
            let want: Vec<f32> = x
                .iter()
                .zip(&y)
                .map(|(x, y)| match dtype {
                    DType::BF16 => bf16::from_f32(x + y).to_f32(),
                    _ => x + y,
                })
                .collect();
            let got = b.download(&summed[i])?;
            let exact = same_bits(&got, &want);
            if rank == 0 {
                figure(
                    "nccl",
                    format!("{dtype} all-reduce of {N} values: bitwise the host's sum: {exact}"),
                );
            }
            assert!(
                exact,
                "rank {rank} {dtype}: rel err {:e}",
                rel_err(&got, &want)
            );
            let from = values(i, 10 + i as u64, dtype);
            let got = b.download(&sent[i])?;
            assert!(
                same_bits(&got, &from),
                "rank {rank}: {dtype} broadcast from rank {i}"
            );
        }
        Ok(())
    });
    result.unwrap();
}

/// ZeRO-2's reduce: only the root receives the sum, and `wait_for_sums_of` holds back the
/// ops that would overwrite a tensor still being sent (on the other rank) or read one still
/// being received (on the root). 256 MiB per rank, so that the reduce outlasts the fill and
/// the download that follow it: with a wait that waits for nothing, rank 0 overwrites its
/// values mid-send, or rank 1 reads its own.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn nccl_reduces_to_one_rank_and_waits_before_reuse() {
    const M: usize = 64 << 20;
    let result = ranks::run(2, LONG, move |member| {
        let rank = member.rank;
        let b = Cuda::new(rank)?;
        let comm = Nccl::new(&b, member)?;
        let t = b.allocate("reduced", &[TensorSpec::new("t", &[M], DType::F32)])?;
        let t = &t[0];
        b.fill(t, 1.0 + rank as f32)?;
        comm.start_reduce_sum(&b, &[t], 1)?;
        comm.wait_for_sums_of(&b, &[t])?;
        if rank == 0 {
            b.fill(t, 100.0)?;
            b.download(t)?;
        } else {
            let got = b.download(t)?;
            let wrong = got.iter().filter(|&&x| x != 3.0).count();
            figure(
                "nccl",
                format!("reduce of {M} f32 to rank 1, then overwritten on rank 0: {wrong} wrong"),
            );
            assert_eq!(wrong, 0, "rank 1 received values other than 1 + 2");
        }
        comm.join_all_reduce_sums(&b)?;
        Ok(())
    });
    result.unwrap();
}

/// With `connected`, two ranks join a first sum (in which NCCL connects them, blocking while
/// it holds the communicator, out of the watcher's reach). Then rank 1 meets rank 0 for
/// the next sum and, instead of enqueueing its part, does `rank_1_then`, while rank 0 waits
/// for that sum and then meets again. Runs detached, so that a hang fails the test instead
/// of blocking it. The run's error, and how long it took.
fn rank_1_leaves_a_sum_unjoined(
    timeout: Duration, connected: bool, rank_1_then: fn() -> anyhow::Result<()>,
) -> (String, Duration) {
    let (report, reported) = std::sync::mpsc::channel();
    let start = Instant::now();
    std::thread::spawn(move || {
        let result = ranks::run(2, timeout, move |member| {
            let rank = member.rank;
            let b = Cuda::new(rank)?;
            let t = tensor(&b, &[N], DType::F32, &values(rank, 0, DType::F32));
            let comm = Nccl::new(&b, member)?;
            if connected {
                comm.start_all_reduce_sum(&b, &[&t])?;
                comm.join_all_reduce_sums(&b)?;
                b.download(&t)?;
            }
            if rank == 1 {
                comm.sum(&[])?; // the meeting that rank 0's sum starts with
                return rank_1_then();
            }
            comm.start_all_reduce_sum(&b, &[&t])?;
            comm.join_all_reduce_sums(&b)?;
            b.download(&t)?; // waits for the sum that rank 1 never joins
            comm.sum(&[])?;
            Ok(())
        });
        let _ = report.send(result.map_err(|e| format!("{e:#}")));
    });
    let result = reported
        .recv_timeout(Duration::from_secs(120))
        .expect("rank 0 still waits for rank 1's part of the sum after 120 s");
    (result.expect_err("the run should fail"), start.elapsed())
}

/// A rank that fails after the host meeting of a collective, without enqueueing its part,
/// leaves its peer's sum waiting for it on the device, where no meeting reaches. The peer's
/// watcher aborts the communicator once the group has failed, which ends that wait, and the
/// run reports the failure instead of hanging. (Without the watcher this test times out.)
#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_rank_failing_after_the_meeting_does_not_leave_its_peer_waiting() {
    let (err, _) = rank_1_leaves_a_sum_unjoined(LONG, true, || {
        anyhow::bail!("rank 1 gave up after the meeting")
    });
    figure("nccl", format!("a rank failing after the meeting: {err}"));
    assert!(err.contains("gave up after the meeting"), "{err}");
}

/// A rank held up after a meeting, neither failing nor coming back (as in a kernel that does
/// not end), leaves its peer waiting on the device for a sum it never joins, where no
/// meeting times out. Once neither has met nor waited at a meeting for the timeout, the
/// peer's watcher counts the group stalled and aborts its communicator; the run then ends
/// with that error, leaving the held rank behind.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn ranks_held_on_their_devices_past_the_timeout_end_the_run() {
    let (err, took) = rank_1_leaves_a_sum_unjoined(Duration::from_secs(5), true, || {
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    figure(
        "nccl",
        format!("ranks held on their devices: {err} (after {took:?})"),
    );
    assert!(
        err.contains("neither met nor waited") && err.contains("--comm-timeout"),
        "{err}"
    );
}

/// A rank failing before the first sum, while NCCL would connect the ranks in it: its peer
/// blocks inside NCCL holding the communicator, where the watcher cannot abort it. The run
/// still ends, the timeout after the failure, with the failed rank's error, and leaves the
/// blocked rank behind. (Before `--comm-timeout` it hung; `NCCL_RUNTIME_CONNECT=0`, which
/// connects the ranks when the communicator is made, also ends it, at once.)
#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_rank_failing_before_the_ranks_connect_ends_the_run_after_the_timeout() {
    let (err, took) = rank_1_leaves_a_sum_unjoined(Duration::from_secs(5), false, || {
        anyhow::bail!("rank 1 gave up before the first sum")
    });
    figure(
        "nccl",
        format!("a rank failing before the first sum: {err} (after {took:?})"),
    );
    assert!(err.contains("gave up before the first sum"), "{err}");
}
