//! Where the last work started on a side stream over each tensor ends, by the tensor's
//! address: the copies beside the compute stream and NCCL's sums note their ends here, so
//! that the compute stream waits for the work on the tensors it is about to touch, and not
//! for what was started after it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::Result;
use cudarc::driver::{CudaEvent, CudaStream};

#[derive(Default)]
pub struct Pending {
    ends: Mutex<HashMap<u64, Arc<CudaEvent>>>,
}

impl Pending {
    /// Records the end of the work enqueued on `side` so far as the end of the work on each
    /// of `addresses`.
    pub fn record(&self, side: &CudaStream, addresses: &[u64]) -> Result<()> {
        let end = Arc::new(side.record_event(None)?);
        let mut ends = self.lock();
        for &address in addresses {
            ends.insert(address, end.clone());
        }
        Ok(())
    }

    /// Makes `stream` wait for the work on each of `addresses`.
    pub fn wait(&self, stream: &CudaStream, addresses: &[u64]) -> Result<()> {
        let ends = self.lock();
        let mut waits: Vec<&Arc<CudaEvent>> =
            addresses.iter().filter_map(|a| ends.get(a)).collect();
        waits.dedup_by(|a, b| Arc::ptr_eq(a, b));
        for end in waits {
            stream.wait(end)?;
        }
        Ok(())
    }

    /// Forgets every end, once the stream that waits has joined the side stream whole.
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<CudaEvent>>> {
        // Every update is a single insertion or a clear, so a panic while holding the lock
        // left no half state.
        self.ends.lock().unwrap_or_else(|p| p.into_inner())
    }
}
