//! The meeting place of ranks in one process: a mutex and a condition variable. It serves
//! the threads of `--gpus N`, and inside rank 0's `Store` the processes of a launched run.
//!
//! A rank that is stuck rather than failed (in a kernel or a device wait that does not end,
//! or in host code) is caught by the timeout: a rank that waits here longer than that for the
//! others fails, naming them, and when no rank waits here and none has met for that long, the
//! group counts as stalled (`fails_within`, which NCCL's watchers poll).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use super::{Failure, Group, PEER_FAILED};

pub struct Local {
    world: usize,
    /// How long a rank waits at a meeting for the others, and how long the ranks may go
    /// without meeting while none waits at one, before the run counts as stuck.
    timeout: Duration,
    state: Mutex<Round>,
    changed: Condvar,
}

/// The exchange in progress, and the last one completed.
struct Round {
    /// Counts completed exchanges, so that a waiter knows when its own has completed.
    generation: u64,
    handed_in: Vec<Option<Vec<f64>>>,
    /// Every rank's values from the last completed exchange. A rank reads it before it can
    /// hand in again, and an exchange completes only once every rank has handed in, so no
    /// reader ever finds the next exchange's values here.
    completed: Arc<Vec<Vec<f64>>>,
    /// When the last exchange completed, or the group was made.
    last_met: Instant,
    /// Whether a rank has ended: the others then meet no more, and may work alone for as
    /// long as they need (rank 0 exporting the model, say).
    one_ended: bool,
    /// How the group failed, once it has.
    failed: Option<Failure>,
}

impl Local {
    pub fn new(world: usize, timeout: Duration) -> Arc<Local> {
        Arc::new(Local {
            world,
            timeout,
            state: Mutex::new(Round {
                generation: 0,
                handed_in: vec![None; world],
                completed: Arc::new(vec![]),
                last_met: Instant::now(),
                one_ended: false,
                failed: None,
            }),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock left the state consistent: every
        // update above is a single assignment.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Group for Local {
    fn world(&self) -> usize {
        self.world
    }

    fn exchange(&self, rank: usize, values: Vec<f64>) -> Result<Arc<Vec<Vec<f64>>>> {
        let mut round = self.lock();
        if round.failed.is_some() {
            bail!(PEER_FAILED);
        }
        assert!(
            round.handed_in[rank].is_none(),
            "rank {rank} handed in twice"
        );
        round.handed_in[rank] = Some(values);
        let generation = round.generation;
        if round.handed_in.iter().all(Option::is_some) {
            let all = round.handed_in.iter_mut().map(|v| v.take().unwrap());
            round.completed = Arc::new(all.collect());
            round.generation += 1;
            round.last_met = Instant::now();
            self.changed.notify_all();
        }
        let (round, waited) = self
            .changed
            .wait_timeout_while(round, self.timeout, |round| {
                round.generation == generation && round.failed.is_none()
            })
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if round.generation != generation {
            return Ok(round.completed.clone());
        }
        if round.failed.is_some() {
            bail!(PEER_FAILED);
        }
        debug_assert!(waited.timed_out());
        let missing: Vec<String> = (round.handed_in.iter().enumerate())
            .filter(|(_, v)| v.is_none())
            .map(|(r, _)| r.to_string())
            .collect();
        bail!(
            "rank {rank} waited {} s for rank(s) {} to meet it; they are stuck, or slower \
             than --comm-timeout allows (raise it if a step or a checkpoint takes that long)",
            self.timeout.as_secs_f64(),
            missing.join(", ")
        )
    }

    /// Past the wait, a group that has stalled (see `Failure::Stalled`) is marked so here.
    fn fails_within(&self, wait: Duration) -> bool {
        let round = self.lock();
        let (mut round, _) = self
            .changed
            .wait_timeout_while(round, wait, |round| round.failed.is_none())
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // A rank waiting at a meeting times out there, naming whom it waits for.
        let none_waits = round.handed_in.iter().all(Option::is_none);
        let meeting_due = !round.one_ended && round.last_met.elapsed() > self.timeout;
        if round.failed.is_none() && none_waits && meeting_due {
            round.failed = Some(Failure::Stalled);
            self.changed.notify_all();
        }
        round.failed.is_some()
    }

    fn end(&self, _rank: usize) {
        self.lock().one_ended = true;
    }

    fn fail(&self, rank: usize, message: String) {
        self.lock()
            .failed
            .get_or_insert(Failure::Rank { rank, message });
        self.changed.notify_all();
    }

    fn failure(&self) -> Option<Failure> {
        self.lock().failed.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Longer than any of these tests waits, where the timeout is not what they test.
    const LONG: Duration = Duration::from_secs(600);

    #[test]
    fn every_rank_gets_every_list_in_rank_order_round_after_round() {
        let group = Local::new(3, LONG);
        std::thread::scope(|s| {
            for rank in 0..3 {
                let group = &group;
                s.spawn(move || {
                    for round in 0..50 {
                        let got = group
                            .exchange(rank, vec![(round * 10 + rank) as f64])
                            .unwrap();
                        let want: Vec<Vec<f64>> =
                            (0..3).map(|r| vec![(round * 10 + r) as f64]).collect();
                        assert_eq!(*got, want);
                    }
                });
            }
        });
    }

    #[test]
    fn a_failed_rank_releases_the_waiting_ones() {
        let group = Local::new(2, LONG);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| group.exchange(0, vec![1.0]));
            std::thread::sleep(Duration::from_millis(20));
            group.fail(1, "out of memory".into());
            let err = waiting.join().unwrap().unwrap_err();
            assert_eq!(err.to_string(), PEER_FAILED);
        });
        assert!(group.exchange(1, vec![]).is_err());
        group.fail(0, "later".into());
        assert_eq!(
            group.failure(),
            Some(Failure::Rank {
                rank: 1,
                message: "out of memory".into()
            })
        );
    }

    #[test]
    fn a_watcher_learns_of_a_failure_as_it_happens() {
        let group = Local::new(2, LONG);
        assert!(!group.fails_within(Duration::from_millis(1)));
        std::thread::scope(|s| {
            let watching = s.spawn(|| group.fails_within(Duration::from_secs(60)));
            std::thread::sleep(Duration::from_millis(20));
            let start = Instant::now();
            group.fail(0, "later".into());
            assert!(watching.join().unwrap());
            assert!(start.elapsed() < Duration::from_secs(10));
        });
    }

    #[test]
    fn a_rank_waiting_past_the_timeout_names_the_ranks_that_did_not_come() {
        let timeout = Duration::from_millis(200);
        let group = Local::new(3, timeout);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| group.exchange(1, vec![]));
            let start = Instant::now();
            let err = waiting.join().unwrap().unwrap_err().to_string();
            assert!(start.elapsed() >= timeout, "{:?}", start.elapsed());
            assert!(
                err.contains("rank 1 waited 0.2 s for rank(s) 0, 2"),
                "{err}"
            );
            assert!(err.contains("--comm-timeout"), "{err}");
        });
        // Waiting there was no stall: the waiter reports what it waited for.
        assert!(!group.fails_within(Duration::ZERO));
    }

    #[test]
    fn ranks_that_neither_meet_nor_wait_for_the_timeout_have_stalled() {
        let group = Local::new(2, Duration::from_millis(100));
        assert!(!group.fails_within(Duration::ZERO));
        std::thread::sleep(Duration::from_millis(150));
        assert!(group.fails_within(Duration::ZERO));
        assert_eq!(group.failure(), Some(Failure::Stalled));
        // A rank that fails afterwards is not taken for the cause.
        group.fail(1, "out of memory".into());
        assert_eq!(group.failure(), Some(Failure::Stalled));

        // Once a rank has ended, the others meet no more, and working alone is no stall.
        let group = Local::new(2, Duration::from_millis(100));
        group.end(0);
        std::thread::sleep(Duration::from_millis(150));
        assert!(!group.fails_within(Duration::ZERO));
    }
}
