//! Rank 0's store: the `Local` group of a run whose ranks are processes, served over TCP to
//! the other ranks (`Remote`). Each connection is one rank, served by two threads: one
//! answers the rank's calls by making them on the `Local` group in its name, the other tells
//! the rank as soon as the group fails. A connection that closes before its rank has ended
//! is that rank's failure: its process died (SIGKILL, a crash) or its machine went away.

use std::collections::BTreeSet;
use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, Result};

use super::wire::{FromStore, ToStore, send_exchanged};
use super::{Group, Local};

/// How often a connection's watcher looks whether the group has failed.
const WATCH_PERIOD: Duration = Duration::from_millis(100);

pub struct Store {
    group: Arc<Local>,
    timeout: Duration,
    /// The ranks connected now.
    connected: Arc<(Mutex<BTreeSet<usize>>, Condvar)>,
}

impl Store {
    /// Serves `listener` to ranks `1..world` (rank 0 is this process) for the life of the
    /// process; their meetings give up after `timeout`.
    pub fn serve(listener: TcpListener, world: usize, timeout: Duration) -> Result<Store> {
        let store = Store {
            group: Local::new(world, timeout),
            timeout,
            connected: Arc::default(),
        };
        let (group, connected) = (store.group.clone(), store.connected.clone());
        std::thread::Builder::new()
            .name("smelt-store".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let (group, connected) = (group.clone(), connected.clone());
                    // A connection that fails before it is a rank affects no rank.
                    let _ = std::thread::Builder::new()
                        .name("smelt-store-rank".into())
                        .spawn(move || serve_rank(stream, &group, &connected, timeout));
                }
            })
            .context("starting the thread of rank 0's store")?;
        Ok(store)
    }

    /// The group, as rank 0 meets in it.
    pub fn group(&self) -> Arc<Local> {
        self.group.clone()
    }

    /// Waits, for at most the timeout, until no other rank is connected: the ranks that are
    /// still ending their work (or telling of their failure) keep the store they need.
    pub fn wait_for_the_others(&self) {
        let (set, changed) = &*self.connected;
        let set = lock(set);
        let _ = changed
            .wait_timeout_while(set, self.timeout, |set| !set.is_empty())
            .unwrap_or_else(|p| p.into_inner());
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update is a single insertion or removal, so a panic while holding the lock left
    // no half state.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Serves one connection: its `Hello`, then its calls until it closes.
fn serve_rank(
    stream: TcpStream, group: &Arc<Local>, connected: &(Mutex<BTreeSet<usize>>, Condvar),
    timeout: Duration,
) {
    let _ = stream.set_nodelay(true);
    // A peer that connects and says nothing is not a rank; it must not hold a thread for ever.
    let _ = stream.set_read_timeout(Some(timeout));
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let writer = Arc::new(Mutex::new(BufWriter::new(write_half)));
    let mut reader = BufReader::new(stream);
    let refuse = |message: String| {
        let _ = FromStore::Refused(message).send(&mut *lock(&writer));
    };
    let world = group.world();
    let rank = match ToStore::receive_hello(&mut reader) {
        Ok(ToStore::Hello { rank, world: w }) if w != world => {
            return refuse(format!(
                "rank {rank} counts {w} ranks, rank 0 counts {world}: every process must be \
                 given the same WORLD_SIZE"
            ));
        }
        Ok(ToStore::Hello { rank, .. }) if rank == 0 || rank >= world => {
            return refuse(format!(
                "rank {rank}: rank 0 serves this store, and the others are 1 to {}",
                world - 1
            ));
        }
        Ok(ToStore::Hello { rank, .. }) => rank,
        _ => return,
    };
    if !lock(&connected.0).insert(rank) {
        return refuse(format!(
            "a rank {rank} is connected already: two processes were given RANK {rank}"
        ));
    }
    let _ = reader.get_ref().set_read_timeout(None);
    let welcomed = FromStore::Welcome.send(&mut *lock(&writer));
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (group, writer, done) = (group.clone(), writer.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                if group.fails_within(WATCH_PERIOD) {
                    if let Some(failure) = group.failure() {
                        let _ = FromStore::Failed(failure).send(&mut *lock(&writer));
                    }
                    return;
                }
            }
        })
    };
    let mut ended = false;
    while welcomed.is_ok() {
        let Ok(message) = ToStore::receive(&mut reader) else {
            break;
        };
        match message {
            ToStore::Exchange(values) => {
                let sent = match group.exchange(rank, values) {
                    Ok(all) => send_exchanged(&mut *lock(&writer), &all),
                    Err(e) => FromStore::ExchangeFailed(format!("{e:#}")).send(&mut *lock(&writer)),
                };
                if sent.is_err() {
                    break;
                }
            }
            ToStore::Fail(message) => group.fail(rank, message),
            ToStore::End => {
                ended = true;
                group.end(rank);
            }
            ToStore::Hello { .. } => break,
        }
    }
    if !ended {
        let why = "its process ended without a word (killed, crashed, or its machine or network \
                   went down), or its connection to rank 0 broke";
        group.fail(rank, why.into());
    }
    done.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    let (set, changed) = connected;
    lock(set).remove(&rank);
    changed.notify_all();
}
