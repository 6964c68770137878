//! NCCL between two GPUs (`--gpus 2`): the gradient sum and the broadcast of weights give
//! what the host computes from the same values, bit for bit. (The trainer's use of them is
//! tested on CPU ranks in `train_data_parallel.rs`, and end to end on two GPUs by
//! `scripts/gpu/multi_gpu.sh`.)

mod common;

use common::gpu::*;
use half::bf16;
use smelt::backend::Backend;
use smelt::backend::cuda::nccl::{Nccl, UniqueId};
use smelt::backend::cuda::{Cuda, device};
use smelt::comm::{Comm, ranks};
use smelt::tensor::DType;

const N: usize = 100_003;

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
    let id = UniqueId::new().unwrap();
    let dtypes = [DType::BF16, DType::F32];
    let result = ranks::run(2, |member| {
        let rank = member.rank;
        let b = Cuda::new(rank)?;
        let comm = Nccl::new(&b, id, member)?;
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
