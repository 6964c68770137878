//! Where the ranks of a run meet on the host: each hands in a list of values and gets back
//! every rank's list, in rank order. The losses, the token counts, the CPU ranks' tensors
//! and the NCCL id meet here, and so does news of a rank that failed.
//!
//! `Group` is what a rank asks of the meeting place, wherever the ranks are:
//! - `Local`: the ranks are threads of one process (`--gpus N`), meeting in shared memory.
//! - `Store` and `Remote`: the ranks are processes (launched by torchrun, Slurm or mpirun),
//!   possibly on several machines. Rank 0 serves a `Store`, which is a `Local` group whose
//!   other members are stand-ins for the remote ranks, each served over TCP; every other rank
//!   is a `Remote` member that forwards each call to it. So the meetings, the timeouts and the
//!   failure rules are those of `Local` in both cases, written once.
//!
//! A rank that fails marks the group failed; every rank waiting at a meeting, or arriving
//! later, then gets an error instead of waiting for ever on a rank that will not come. A rank
//! that is stuck rather than failed is caught by the timeout (`Local`'s header says how).

mod local;
mod remote;
mod store;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;

pub use self::local::Local;
pub use self::remote::Remote;
pub use self::store::Store;

/// The error the other ranks get at a meeting once one has failed. The run reports the
/// failed rank's own error instead (`Failure::describe`), so this text is seen only if that
/// one is lost.
pub const PEER_FAILED: &str = "another rank of this run failed";

pub trait Group: Send + Sync {
    fn world(&self) -> usize;

    /// Hands in `values` as rank `rank` and waits for every rank's, which it returns in rank
    /// order. Fails if a rank has failed, or if the others have not all come within the
    /// timeout.
    fn exchange(&self, rank: usize, values: Vec<f64>) -> Result<Arc<Vec<Vec<f64>>>>;

    /// Whether the group has failed, or fails within `wait` (returning as soon as it does).
    /// Polled by the watchers that abort a rank's device collectives when the group fails.
    fn fails_within(&self, wait: Duration) -> bool;

    /// Records that rank `rank` has ended (its work done, or failed): the others then meet no
    /// more, and may work alone for as long as they need (rank 0 exporting the model, say).
    fn end(&self, rank: usize);

    /// Marks the group failed by `rank`, with its error, unless it failed before; wakes every
    /// waiting rank.
    fn fail(&self, rank: usize, message: String);

    /// How the group failed, if it has: the cause, where the ranks' errors are consequences.
    fn failure(&self) -> Option<Failure>;
}

/// How a group failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// This rank failed first, with this error.
    Rank { rank: usize, message: String },
    /// No rank failed, but none met or waited at a meeting for the timeout: each was held
    /// where no meeting reaches, on its device.
    Stalled,
}

impl Failure {
    /// The error that ends a run of `world` ranks, meeting with `timeout`, that failed so.
    pub fn describe(&self, world: usize, timeout: Duration) -> String {
        match self {
            Failure::Rank { rank, message } => {
                format!("rank {rank} (of {world}) failed: {message}")
            }
            Failure::Stalled => format!(
                "the {world} ranks neither met nor waited to meet for {} s: each was held on its \
                 device (by a collective or a kernel that does not end); raise --comm-timeout if \
                 a step takes that long",
                timeout.as_secs_f64()
            ),
        }
    }
}
