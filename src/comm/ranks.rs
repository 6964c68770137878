//! The ranks of a run (`--gpus N`): `on_ranks` runs a command's body once per rank, each on
//! its own device and thread, joined by the collectives that fit the device (NCCL between
//! GPUs, host memory between CPU ranks), or once on the device already open when N is 1.
//! `run` starts one thread per rank and reports how the run ended: rank 0's result, or the
//! error of the rank that failed first (not what its failure caused in the others, such as
//! the "another rank failed" of those it released), or that the ranks stalled.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail, ensure};

use super::group::{Failure, Group};
use super::nccl::{Nccl, UniqueId};
use super::{Comm, InProcess, Member, Solo};
use crate::backend::Backend;
use crate::backend::cpu::Cpu;
use crate::backend::cuda::{Cuda, device};
use crate::backend::select::Device;

/// What each rank runs: the same code on every backend.
pub trait RankMain: Sync {
    type Output: Send;
    fn run<B: Backend>(&self, b: &B, comm: &dyn Comm<B>) -> Result<Self::Output>;
}

/// Runs `main` on `gpus` ranks of `device`'s kind, whose meetings give up on a stuck rank
/// after `timeout`; rank 0's output, or the error of the rank that failed first.
pub fn on_ranks<M: RankMain + Send + 'static>(
    device: Device, gpus: usize, timeout: Duration, main: M,
) -> Result<M::Output>
where
    M::Output: 'static,
{
    if gpus == 0 {
        bail!("--gpus 0: give the number of devices to train on, 1 or more");
    }
    let main = Arc::new(main);
    match device {
        Device::Cpu(b) if gpus == 1 => main.run(&b, &Solo),
        Device::Cuda(b) if gpus == 1 => main.run(&b, &Solo),
        Device::Cpu(_) => run(gpus, timeout, move |member| {
            main.run(&Cpu::<f32>::new(), &InProcess { member })
        }),
        Device::Cuda(first) => {
            let count = device::gpu_count()?;
            ensure!(
                gpus <= count,
                "--gpus {gpus}: the driver reports {count} GPU(s); check nvidia-smi and \
                 CUDA_VISIBLE_DEVICES, or ask for fewer"
            );
            // Each rank opens its own GPU on its own thread.
            drop(first);
            let id = UniqueId::new()?;
            run(gpus, timeout, move |member| {
                let b = Cuda::new(member.rank)?;
                let comm = Nccl::new(&b, id, member)?;
                main.run(&b, &comm)
            })
        }
    }
}

/// How often the caller looks whether the ranks have ended.
const POLL: Duration = Duration::from_millis(20);

/// Runs `rank_main` for ranks `0..world` on threads of their own, each given its `Member` of
/// one shared `Group` (whose meetings give up on a rank after `timeout`), and returns once
/// every rank has ended: rank 0's result, or the first failure. A rank still running
/// `timeout` after the group failed is stuck where nothing reaches it (a kernel that does
/// not end, say); it is left behind, to end with the process, rather than hang the caller.
pub fn run<T: Send + 'static>(
    world: usize, timeout: Duration,
    rank_main: impl Fn(Member) -> Result<T> + Send + Sync + 'static,
) -> Result<T> {
    let group = Group::new(world, timeout);
    let rank_main = Arc::new(rank_main);
    let threads: Vec<JoinHandle<Result<T>>> = (0..world)
        .map(|rank| {
            let (group, rank_main) = (group.clone(), rank_main.clone());
            std::thread::spawn(move || {
                let member = Member {
                    rank,
                    group: group.clone(),
                };
                let result =
                    catch_unwind(AssertUnwindSafe(|| rank_main(member))).unwrap_or_else(|panic| {
                        Err(anyhow!(
                            "rank {rank} panicked: {}",
                            crate::panic::message(&*panic)
                        ))
                    });
                if result.is_err() {
                    group.fail(rank);
                }
                group.end();
                result
            })
        })
        .collect();
    let mut failed_at = None;
    while !threads.iter().all(JoinHandle::is_finished) {
        if group.failure().is_some() {
            let since = *failed_at.get_or_insert_with(Instant::now);
            if since.elapsed() > timeout {
                break;
            }
        }
        std::thread::sleep(POLL);
    }
    let mut results: Vec<Option<Result<T>>> = threads
        .into_iter()
        .map(|t| {
            t.is_finished()
                .then(|| t.join().expect("panics are caught in the thread"))
        })
        .collect();
    let mut take = |rank: usize| {
        results[rank]
            .take()
            .unwrap_or_else(|| Err(anyhow!("rank {rank} of {world} did not end")))
    };
    match group.failure() {
        Some(Failure::Rank(rank)) if rank > 0 => {
            let err = take(rank)
                .err()
                .expect("a failed rank's result is an error");
            Err(err.context(format!("rank {rank} (of {world}) failed")))
        }
        Some(Failure::Stalled) => Err(anyhow!(
            "the {world} ranks neither met nor waited to meet for {} s: each was held on its \
             device (by a collective or a kernel that does not end); raise --comm-timeout if a \
             step takes that long",
            timeout.as_secs_f64()
        )),
        _ => take(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::{Context, bail};

    /// Longer than any of these tests waits, where the timeout is not what they test.
    const LONG: Duration = Duration::from_secs(600);

    #[test]
    fn returns_rank_0s_result_after_every_rank_has_met() {
        let got = run(3, LONG, |member| {
            let sum = member.sum(&[member.rank as f64])?;
            Ok(sum[0] + member.rank as f64)
        });
        assert_eq!(got.unwrap(), 3.0);
    }

    #[test]
    fn reports_the_first_failed_ranks_error_not_what_it_caused() {
        let err = run(2, LONG, |member| {
            if member.rank == 1 {
                bail!("out of memory on GPU 1");
            }
            // What rank 0 then reports is a consequence, in words of its own.
            member.sum(&[]).context("rank 0 could not sum its loss")?;
            Ok(())
        })
        .unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("rank 1 (of 2) failed") && text.contains("out of memory on GPU 1"),
            "{text}"
        );
    }

    #[test]
    fn a_panic_is_an_error_that_releases_the_others() {
        let err = run(2, LONG, |member| {
            if member.rank == 0 {
                panic!("bug");
            }
            member.sum(&[])?;
            Ok(())
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("rank 0 panicked: bug"));
    }

    #[test]
    fn a_rank_stuck_between_meetings_is_left_behind_with_the_error_of_its_waiting_peer() {
        let start = Instant::now();
        let err = run(2, Duration::from_millis(200), |member| {
            if member.rank == 1 {
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            member.sum(&[])?;
            Ok(())
        })
        .unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("rank 0 waited 0.2 s for rank(s) 1"), "{text}");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
    }
}
