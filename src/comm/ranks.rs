//! Runs one thread per rank and reports how the run ended: rank 0's result, or the error of
//! the rank that failed first (not what its failure caused in the others, such as the
//! "another rank failed" of those it released).

use std::panic::{AssertUnwindSafe, catch_unwind};

use anyhow::{Result, anyhow};

use super::Member;
use super::group::Group;

/// Runs `rank_main` for ranks `0..world` on threads of their own, each given its `Member` of
/// one shared `Group`, and returns rank 0's result once every rank has ended.
pub fn run<T: Send>(world: usize, rank_main: impl Fn(Member) -> Result<T> + Sync) -> Result<T> {
    let group = Group::new(world);
    let mut results: Vec<Result<T>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..world)
            .map(|rank| {
                let (group, rank_main) = (&group, &rank_main);
                s.spawn(move || {
                    let member = Member {
                        rank,
                        group: group.clone(),
                    };
                    let result = catch_unwind(AssertUnwindSafe(|| rank_main(member)))
                        .unwrap_or_else(|panic| {
                            Err(anyhow!(
                                "rank {rank} panicked: {}",
                                crate::panic::message(&*panic)
                            ))
                        });
                    if result.is_err() {
                        group.fail(rank);
                    }
                    result
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("panics are caught in the thread"))
            .collect()
    });
    match group.first_failed() {
        Some(rank) if rank > 0 => {
            let err = results.swap_remove(rank).err().expect("an error");
            Err(err.context(format!("rank {rank} (of {world}) failed")))
        }
        _ => results.swap_remove(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::{Context, bail};

    #[test]
    fn returns_rank_0s_result_after_every_rank_has_met() {
        let got = run(3, |member| {
            let sum = member.sum(&[member.rank as f64])?;
            Ok(sum[0] + member.rank as f64)
        });
        assert_eq!(got.unwrap(), 3.0);
    }

    #[test]
    fn reports_the_first_failed_ranks_error_not_what_it_caused() {
        let err = run(2, |member| {
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
        let err = run(2, |member| {
            if member.rank == 0 {
                panic!("bug");
            }
            member.sum(&[])?;
            Ok(())
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("rank 0 panicked: bug"));
    }
}
