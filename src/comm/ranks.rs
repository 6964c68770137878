//! The ranks of a run, and running a command's body once per rank. The ranks are threads of
//! this process, each on its own device (`--gpus N`), or this process is one rank of a run
//! that a launcher started as processes (`launch`), on the GPU its `LOCAL_RANK` names. Either
//! way each rank runs the same body with the same collectives (NCCL between GPUs, host
//! memory between CPU ranks), meeting in the ranks' `Group`; with one rank, on the device
//! already open.
//!
//! How a run ends is reported alike: rank 0's result, or the error of the rank that failed
//! first (not what its failure caused in the others, such as the "another rank failed" of
//! those it released), or that the ranks stalled.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail, ensure};

use super::group::{Failure, Group, Local};
use super::launch::Launch;
use super::nccl::Nccl;
use super::{Comm, Host, Member, Solo};
use crate::backend::Backend;
use crate::backend::cpu::Cpu;
use crate::backend::cuda::{Cuda, device};
use crate::backend::select::Device;

/// What each rank runs: the same code on every backend.
pub trait RankMain: Sync {
    type Output: Send;
    fn run<B: Backend>(&self, b: &B, comm: &dyn Comm<B>) -> Result<Self::Output>;
}

/// Where this run's ranks come from.
pub enum Ranks {
    /// `--gpus N`: N threads of this process, one per device.
    Threads(usize),
    /// This process is one rank of a run that a launcher started.
    Process(Launch),
}

impl Ranks {
    /// The ranks from the launcher's environment, if a launcher started this process, else
    /// from `--gpus`.
    pub fn new(gpus: usize) -> Result<Ranks> {
        if gpus == 0 {
            bail!("--gpus 0: give the number of devices to train on, 1 or more");
        }
        match Launch::from_env()? {
            None => Ok(Ranks::Threads(gpus)),
            Some(launch) if gpus > 1 => bail!(
                "--gpus {gpus}: this process is rank {} of the {} that {} started, each driving \
                 one GPU; leave --gpus out, and start one process per GPU",
                launch.rank,
                launch.world,
                launch.launcher
            ),
            Some(launch) => Ok(Ranks::Process(launch)),
        }
    }

    pub fn world(&self) -> usize {
        match self {
            Ranks::Threads(n) => *n,
            Ranks::Process(launch) => launch.world,
        }
    }

    /// The device this process opens: its own GPU under a launcher, else the first.
    pub fn device_index(&self) -> usize {
        match self {
            Ranks::Threads(_) => 0,
            Ranks::Process(launch) => launch.local_rank,
        }
    }

    /// Whether rank 0, which speaks for the run, is in this process.
    pub fn has_rank_0(&self) -> bool {
        match self {
            Ranks::Threads(_) => true,
            Ranks::Process(launch) => launch.rank == 0,
        }
    }

    /// The CUDA devices this process's ranks train on, where `opened` is the one opened for
    /// it: under `--gpus N`, every thread's (rank r on device r, as `on_ranks` opens them);
    /// else `opened` alone.
    pub fn process_gpus(&self, opened: usize) -> Vec<usize> {
        match self {
            Ranks::Threads(n) if *n > 1 => (0..*n).collect(),
            _ => vec![opened],
        }
    }
}

/// Runs `main` on `ranks`, on `device`'s kind (and on `device` itself where this process
/// is one rank), whose meetings give up on a stuck rank after `timeout`; rank 0's output,
/// or the error of the rank that failed first.
pub fn on_ranks<M: RankMain + Send + 'static>(
    device: Device, ranks: Ranks, timeout: Duration, main: M,
) -> Result<M::Output>
where
    M::Output: 'static,
{
    let main = Arc::new(main);
    match ranks {
        Ranks::Threads(1) => on_device(&*main, &device, None),
        Ranks::Process(launch) if launch.world == 1 => on_device(&*main, &device, None),
        Ranks::Process(launch) => as_process(&launch, &device, timeout, &*main),
        Ranks::Threads(gpus) => {
            if let Device::Cuda(_) = device {
                let count = device::gpu_count()?;
                ensure!(
                    gpus <= count,
                    "--gpus {gpus}: the driver reports {count} GPU(s); check nvidia-smi and \
                     CUDA_VISIBLE_DEVICES, or ask for fewer"
                );
            }
            let on_gpus = matches!(device, Device::Cuda(_));
            // Each rank opens its own device on its own thread.
            drop(device);
            run(gpus, timeout, move |member| {
                let device = match on_gpus {
                    true => Device::Cuda(Cuda::new(member.rank)?),
                    false => Device::Cpu(Cpu::new()),
                };
                on_device(&*main, &device, Some(member))
            })
        }
    }
}

/// Runs `main` on `device` as `member` (alone where there is none), with the collectives
/// that fit the device.
fn on_device<M: RankMain>(main: &M, device: &Device, member: Option<Member>) -> Result<M::Output> {
    match (device, member) {
        (Device::Cpu(b), None) => main.run(b, &Solo),
        (Device::Cuda(b), None) => main.run(b, &Solo),
        (Device::Cpu(b), Some(member)) => main.run(b, &Host { member }),
        (Device::Cuda(b), Some(member)) => {
            let comm = Nccl::new(b, member)?;
            main.run(b, &comm)
        }
    }
}

/// `f`'s result, a panic in it becoming rank `rank`'s error; the group is told of a
/// failure, and that the rank has ended.
fn guarded<T>(rank: usize, group: &dyn Group, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let result = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        Err(anyhow!(
            "rank {rank} panicked: {}",
            crate::panic::message(&*panic)
        ))
    });
    if let Err(e) = &result {
        group.fail(rank, format!("{e:#}"));
    }
    group.end(rank);
    result
}

/// Runs `main` as this process's rank of `launch`. Its error is its own, or, where another
/// rank's failure caused it, that rank's. Rank 0 keeps its store up until the others are
/// done with it. A process whose rank is stuck where nothing reaches it once the group has
/// failed (a kernel that does not end) exits the timeout after the failure, with its error.
fn as_process<M: RankMain>(
    launch: &Launch, device: &Device, timeout: Duration, main: &M,
) -> Result<M::Output> {
    let joined = launch.join(timeout)?;
    let group = joined.member.group.clone();
    let (rank, world) = (launch.rank, launch.world);
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (group, done) = (group.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                if group.fails_within(Duration::from_millis(200)) {
                    let since = Instant::now();
                    while since.elapsed() < timeout {
                        if done.load(Ordering::Relaxed) {
                            return;
                        }
                        std::thread::sleep(POLL);
                    }
                    let failure = group.failure().expect("the group has failed");
                    eprintln!("error: {}", failure.describe(world, timeout));
                    std::process::exit(1);
                }
            }
        })
    };
    let result = guarded(rank, &*group, || {
        on_device(main, device, Some(joined.member))
    });
    if let Some(store) = &joined.store {
        store.wait_for_the_others();
    }
    done.store(true, Ordering::Relaxed);
    let _ = watchdog.join();
    match (result, group.failure()) {
        (Err(_), Some(failure @ Failure::Rank { rank: r, .. })) if r != rank => {
            Err(anyhow!(failure.describe(world, timeout)))
        }
        (Err(_), Some(Failure::Stalled)) => Err(anyhow!(Failure::Stalled.describe(world, timeout))),
        (result, _) => result,
    }
}

/// How often the caller looks whether the ranks have ended.
const POLL: Duration = Duration::from_millis(20);

/// Runs `rank_main` for ranks `0..world` on threads of their own, each given its `Member` of
/// one shared `Local` group (whose meetings give up on a rank after `timeout`), and returns
/// once every rank has ended: rank 0's result, or the first failure. A rank still running
/// `timeout` after the group failed is stuck where nothing reaches it (a kernel that does
/// not end, say); it is left behind, to end with the process, rather than hang the caller.
pub fn run<T: Send + 'static>(
    world: usize, timeout: Duration,
    rank_main: impl Fn(Member) -> Result<T> + Send + Sync + 'static,
) -> Result<T> {
    let group = Local::new(world, timeout);
    let rank_main = Arc::new(rank_main);
    let threads: Vec<JoinHandle<Result<T>>> = (0..world)
        .map(|rank| {
            let (group, rank_main) = (group.clone(), rank_main.clone());
            std::thread::spawn(move || {
                let member = Member {
                    rank,
                    group: group.clone(),
                };
                guarded(rank, &*group, || rank_main(member))
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
        Some(Failure::Rank { rank, .. }) if rank > 0 => {
            let err = take(rank)
                .err()
                .expect("a failed rank's result is an error");
            Err(err.context(format!("rank {rank} (of {world}) failed")))
        }
        Some(Failure::Stalled) => Err(anyhow!(Failure::Stalled.describe(world, timeout))),
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
