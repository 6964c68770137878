//! A rank's membership of a group whose store is served by rank 0 in another process
//! (`Store`): each call goes to the store over TCP, and a reader thread takes in the
//! answers and the news of a failure, which can come at any time.

use std::io::{BufReader, BufWriter};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use super::wire::{FromStore, ToStore};
use super::{Failure, Group, PEER_FAILED};
use crate::comm::tcp::connect_within;

pub struct Remote {
    rank: usize,
    world: usize,
    timeout: Duration,
    writer: Mutex<BufWriter<TcpStream>>,
    seen: Arc<(Mutex<Seen>, Condvar)>,
}

/// What the reader thread has taken in.
#[derive(Default)]
struct Seen {
    /// The answer to the exchange in progress.
    answer: Option<Result<Arc<Vec<Vec<f64>>>, String>>,
    failure: Option<Failure>,
    /// Whether this rank has ended: the store closing the connection is then no failure.
    ended: bool,
}

impl Remote {
    /// Joins the group served at `store` as rank `rank` of `world`, trying for at most
    /// `timeout` (rank 0 may start later than this rank).
    pub fn join(store: SocketAddr, rank: usize, world: usize, timeout: Duration) -> Result<Remote> {
        let stream = connect_within(store, timeout).with_context(|| {
            format!(
                "rank {rank}: cannot reach rank 0's store at {store} within --comm-timeout {} s; \
                 is rank 0 running, and do MASTER_ADDR and MASTER_PORT name its machine and a \
                 port it can open?",
                timeout.as_secs_f64()
            )
        })?;
        let _ = stream.set_nodelay(true);
        let mut writer = BufWriter::new(stream.try_clone()?);
        let mut reader = BufReader::new(stream);
        let context = || format!("rank {rank}: joining rank 0's store at {store}");
        ToStore::Hello { rank, world }
            .send(&mut writer)
            .with_context(context)?;
        reader.get_ref().set_read_timeout(Some(timeout))?;
        match FromStore::receive(&mut reader).with_context(context)? {
            FromStore::Welcome => {}
            FromStore::Refused(why) => bail!("rank {rank}: rank 0's store refused it: {why}"),
            other => bail!("{}: unexpected first answer {other:?}", context()),
        }
        reader.get_ref().set_read_timeout(None)?;
        let seen: Arc<(Mutex<Seen>, Condvar)> = Arc::default();
        let reading = seen.clone();
        std::thread::Builder::new()
            .name("smelt-store-reader".into())
            .spawn(move || read(reader, &reading))
            .context("starting the thread that reads from rank 0's store")?;
        Ok(Remote {
            rank,
            world,
            timeout,
            writer: Mutex::new(writer),
            seen,
        })
    }

    fn seen(&self) -> MutexGuard<'_, Seen> {
        lock(&self.seen.0)
    }

    fn send(&self, message: ToStore) -> std::io::Result<()> {
        message.send(&mut *lock(&self.writer))
    }
}

impl Drop for Remote {
    /// Closes the connection for both threads: the store then learns that this rank is gone
    /// (a failure unless it has ended), and the reader thread ends.
    fn drop(&mut self) {
        let _ = lock(&self.writer)
            .get_ref()
            .shutdown(std::net::Shutdown::Both);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update is a single assignment, so a panic while holding the lock left no half
    // state.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Takes in what the store sends until the connection closes; a close before this rank has
/// ended means rank 0 is gone, which fails the group.
fn read(mut reader: BufReader<TcpStream>, seen: &(Mutex<Seen>, Condvar)) {
    loop {
        let message = FromStore::receive(&mut reader);
        let mut s = lock(&seen.0);
        match message {
            Ok(FromStore::Exchanged(all)) => s.answer = Some(Ok(Arc::new(all))),
            Ok(FromStore::ExchangeFailed(why)) => s.answer = Some(Err(why)),
            Ok(FromStore::Failed(failure)) => {
                s.failure.get_or_insert(failure);
            }
            Ok(other) => {
                s.failure.get_or_insert(Failure::Rank {
                    rank: 0,
                    message: format!("its store sent an unexpected {other:?}"),
                });
            }
            Err(_) => {
                if !s.ended {
                    s.failure.get_or_insert(Failure::Rank {
                        rank: 0,
                        message: "the connection to its store broke: rank 0 ended, was killed or \
                                  crashed, or the network between the machines failed"
                            .into(),
                    });
                }
                seen.1.notify_all();
                return;
            }
        }
        seen.1.notify_all();
    }
}

impl Group for Remote {
    fn world(&self) -> usize {
        self.world
    }

    fn exchange(&self, rank: usize, values: Vec<f64>) -> Result<Arc<Vec<Vec<f64>>>> {
        debug_assert_eq!(rank, self.rank);
        if self.seen().failure.is_some() {
            bail!(PEER_FAILED);
        }
        if self.send(ToStore::Exchange(values)).is_err() {
            // The reader learns why, or already has.
            bail!(PEER_FAILED);
        }
        // The store answers within its own timeout; waiting longer than twice that means it
        // can no longer answer at all.
        let (s, waited) = self
            .seen
            .1
            .wait_timeout_while(self.seen(), self.timeout.saturating_mul(2), |s| {
                s.answer.is_none() && s.failure.is_none()
            })
            .unwrap_or_else(|p| p.into_inner());
        let mut s = s;
        match s.answer.take() {
            Some(Ok(all)) => Ok(all),
            Some(Err(why)) => Err(anyhow!(why)),
            None if s.failure.is_some() => bail!(PEER_FAILED),
            None => {
                debug_assert!(waited.timed_out());
                bail!(
                    "rank {rank}: rank 0's store did not answer within {} s",
                    self.timeout.saturating_mul(2).as_secs_f64()
                )
            }
        }
    }

    fn fails_within(&self, wait: Duration) -> bool {
        let (s, _) = self
            .seen
            .1
            .wait_timeout_while(self.seen(), wait, |s| s.failure.is_none())
            .unwrap_or_else(|p| p.into_inner());
        s.failure.is_some()
    }

    fn end(&self, _rank: usize) {
        self.seen().ended = true;
        let _ = self.send(ToStore::End);
    }

    fn fail(&self, rank: usize, message: String) {
        self.seen().failure.get_or_insert(Failure::Rank {
            rank,
            message: message.clone(),
        });
        self.seen.1.notify_all();
        let _ = self.send(ToStore::Fail(message));
    }

    fn failure(&self) -> Option<Failure> {
        self.seen().failure.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::super::Store;
    use super::*;

    /// Longer than any of these tests waits, where the timeout is not what they test.
    const LONG: Duration = Duration::from_secs(600);

    fn serve(world: usize, timeout: Duration) -> (Store, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        (Store::serve(listener, world, timeout).unwrap(), address)
    }

    #[test]
    fn ranks_in_other_threads_meet_rank_0_through_the_store_in_rank_order() {
        let (store, address) = serve(3, LONG);
        std::thread::scope(|s| {
            for rank in 1..3 {
                s.spawn(move || {
                    let remote = Remote::join(address, rank, 3, LONG).unwrap();
                    for round in 0..20 {
                        let got = remote
                            .exchange(rank, vec![(round * 10 + rank) as f64])
                            .unwrap();
                        let want: Vec<Vec<f64>> =
                            (0..3).map(|r| vec![(round * 10 + r) as f64]).collect();
                        assert_eq!(*got, want);
                    }
                    remote.end(rank);
                });
            }
            let group = store.group();
            for round in 0..20 {
                let got = group.exchange(0, vec![(round * 10) as f64]).unwrap();
                assert_eq!(got[2], vec![(round * 10 + 2) as f64]);
            }
        });
        store.wait_for_the_others();
        assert_eq!(store.group().failure(), None);
    }

    #[test]
    fn a_remote_rank_that_fails_or_vanishes_releases_the_others_with_its_error() {
        let (store, address) = serve(3, LONG);
        let group = store.group();
        let r1 = Remote::join(address, 1, 3, LONG).unwrap();
        let r2 = Remote::join(address, 2, 3, LONG).unwrap();
        std::thread::scope(|s| {
            let waiting = s.spawn(|| r1.exchange(1, vec![]));
            std::thread::sleep(Duration::from_millis(50));
            r2.fail(2, "out of memory on GPU 2".into());
            assert_eq!(
                waiting.join().unwrap().unwrap_err().to_string(),
                PEER_FAILED
            );
        });
        let failure = Failure::Rank {
            rank: 2,
            message: "out of memory on GPU 2".into(),
        };
        assert!(group.fails_within(LONG));
        assert_eq!(group.failure(), Some(failure.clone()));
        assert!(r1.fails_within(LONG));
        assert_eq!(r1.failure(), Some(failure));

        // A rank whose connection closes without a word (its process was killed) fails.
        let (store, address) = serve(2, LONG);
        drop(Remote::join(address, 1, 2, LONG).unwrap());
        assert!(store.group().fails_within(LONG));
        let Some(Failure::Rank { rank: 1, message }) = store.group().failure() else {
            panic!("{:?}", store.group().failure());
        };
        assert!(message.contains("ended without a word"), "{message}");
    }

    #[test]
    fn a_rank_that_waits_past_the_timeout_is_told_whom_it_waits_for() {
        let (_store, address) = serve(3, Duration::from_millis(300));
        let r1 = Remote::join(address, 1, 3, LONG).unwrap();
        let err = r1.exchange(1, vec![]).unwrap_err().to_string();
        assert!(
            err.contains("rank 1 waited 0.3 s for rank(s) 0, 2"),
            "{err}"
        );
    }

    #[test]
    fn a_wrong_rank_or_world_is_refused_with_the_reason() {
        let (store, address) = serve(2, LONG);
        let err = |rank, world| {
            format!(
                "{:#}",
                Remote::join(address, rank, world, LONG).err().unwrap()
            )
        };
        assert!(err(1, 3).contains("rank 1 counts 3 ranks, rank 0 counts 2"));
        assert!(err(2, 2).contains("the others are 1 to 1"));
        let first = Remote::join(address, 1, 2, LONG).unwrap();
        assert!(err(1, 2).contains("two processes were given RANK 1"));
        first.end(1);
        drop(first);
        store.wait_for_the_others();
        assert_eq!(store.group().failure(), None);
    }

    #[test]
    fn rank_0_gone_fails_the_others() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let accepted = std::thread::spawn(move || {
            // A store that welcomes one rank, then its process dies.
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            ToStore::receive_hello(&mut reader).unwrap();
            FromStore::Welcome
                .send(&mut BufWriter::new(stream))
                .unwrap();
        });
        let r1 = Remote::join(address, 1, 2, LONG).unwrap();
        accepted.join().unwrap();
        assert!(r1.fails_within(LONG));
        let Some(Failure::Rank { rank: 0, message }) = r1.failure() else {
            panic!("{:?}", r1.failure());
        };
        assert!(
            message.contains("connection to its store broke"),
            "{message}"
        );
        assert!(r1.exchange(1, vec![]).is_err());
    }
}
