//! Where the ranks of one process meet on the host: each hands in a list of values and gets
//! back every rank's list, in rank order. The ranks are threads of one process, so this needs
//! no network and serves every device kind, NCCL's included (for losses, token counts and
//! the in-process collectives' tensors).
//!
//! A rank that fails marks the group failed; every rank waiting here, or arriving later,
//! then gets an error instead of waiting for ever on a rank that will not come.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Result, bail};

/// The error the other ranks get once one has failed. `ranks::run` reports the failed
/// rank's own error instead, so this text is seen only if that one is lost.
pub const PEER_FAILED: &str = "another rank of this run failed";

pub struct Group {
    world: usize,
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
    /// The rank that failed first, once one has.
    failed: Option<usize>,
}

impl Group {
    pub fn new(world: usize) -> Arc<Group> {
        Arc::new(Group {
            world,
            state: Mutex::new(Round {
                generation: 0,
                handed_in: vec![None; world],
                completed: Arc::new(vec![]),
                failed: None,
            }),
            changed: Condvar::new(),
        })
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Hands in `values` as rank `rank` and waits for every rank's, which it returns in rank
    /// order.
    pub fn exchange(&self, rank: usize, values: Vec<f64>) -> Result<Arc<Vec<Vec<f64>>>> {
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
            self.changed.notify_all();
        }
        while round.generation == generation && round.failed.is_none() {
            round = self
                .changed
                .wait(round)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        if round.generation == generation {
            bail!(PEER_FAILED);
        }
        Ok(round.completed.clone())
    }

    /// Whether a rank has failed, or fails within `wait` (returning as soon as one does).
    pub fn fails_within(&self, wait: Duration) -> bool {
        let round = self.lock();
        let (round, _) = self
            .changed
            .wait_timeout_while(round, wait, |round| round.failed.is_none())
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        round.failed.is_some()
    }

    /// Marks the group failed by `rank` (unless another rank failed first) and wakes every
    /// waiting rank.
    pub fn fail(&self, rank: usize) {
        self.lock().failed.get_or_insert(rank);
        self.changed.notify_all();
    }

    /// The rank that failed first: the cause, where the others' errors are consequences.
    pub fn first_failed(&self) -> Option<usize> {
        self.lock().failed
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock left the state consistent: every
        // update above is a single assignment.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_every_list_in_rank_order_round_after_round() {
        let group = Group::new(3);
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
        let group = Group::new(2);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| group.exchange(0, vec![1.0]));
            std::thread::sleep(std::time::Duration::from_millis(20));
            group.fail(1);
            let err = waiting.join().unwrap().unwrap_err();
            assert_eq!(err.to_string(), PEER_FAILED);
        });
        assert!(group.exchange(1, vec![]).is_err());
        group.fail(0);
        assert_eq!(group.first_failed(), Some(1));
    }

    #[test]
    fn a_watcher_learns_of_a_failure_as_it_happens() {
        let group = Group::new(2);
        assert!(!group.fails_within(Duration::from_millis(1)));
        std::thread::scope(|s| {
            let watching = s.spawn(|| group.fails_within(Duration::from_secs(60)));
            std::thread::sleep(Duration::from_millis(20));
            let start = std::time::Instant::now();
            group.fail(0);
            assert!(watching.join().unwrap());
            assert!(start.elapsed() < Duration::from_secs(10));
        });
    }
}
