//! Passes recorded once and replayed (`Backend::record`: CUDA graphs): a generated token's
//! pass (`decode`), and with `ModelOptions::record_passes` (`--use-cuda-graphs`) the training
//! forward and backward, where a small batch's hundreds of short kernels leave the device
//! waiting between one launch and the next.
//!
//! A recording replays its ops on the same memory with the same arguments, so what differs
//! between steps is uploaded to the device before the replay (tokens, targets, the loss
//! gradient's scale) and what differs in which ops run picks the recording (see
//! `PassRecordings`).

use anyhow::Result;

use super::transformer::Transformer;
use crate::backend::Backend;

/// One pass's recording. The pass runs op by op the first time, which loads its kernels,
/// chooses its matmul algorithms and sizes its scratch (none of which a recording can hold),
/// is recorded the second time, and is replayed from then on. Where the backend records
/// nothing (the CPU, `SMELT_CUDA_GRAPHS=off`, ops being timed) it runs op by op.
pub(crate) struct Recorded<B: Backend> {
    ran: bool,
    recording: Option<B::Recording>,
}

impl<B: Backend> Default for Recorded<B> {
    fn default() -> Self {
        Recorded {
            ran: false,
            recording: None,
        }
    }
}

impl<B: Backend> Recorded<B> {
    /// Enqueues `pass`'s ops: replayed, recorded and replayed, or run.
    pub fn run(&mut self, b: &B, pass: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if let Some(recording) = &self.recording {
            return b.replay(recording);
        }
        if self.ran
            && let Some(recording) = b.record(pass)?
        {
            b.replay(&recording)?;
            self.recording = Some(recording);
            return Ok(());
        }
        self.ran = true;
        pass()
    }

    fn held(&self) -> bool {
        self.recording.is_some()
    }
}

/// A model's training passes, recorded by what decides which ops they enqueue: the forward's
/// by the state of the quantized weight copies it starts from (`LinearLayers::copies_state`:
/// whether it remakes them), the backward's by whether it adds into the gradients.
pub(crate) struct PassRecordings<B: Backend> {
    pub forward: [Recorded<B>; 3],
    pub backward: [Recorded<B>; 2],
}

impl<B: Backend> PassRecordings<B> {
    /// How many passes are replayed from a recording.
    pub fn held(&self) -> usize {
        let all = self.forward.iter().chain(&self.backward);
        all.filter(|r| r.held()).count()
    }
}

impl<B: Backend> Default for PassRecordings<B> {
    fn default() -> Self {
        PassRecordings {
            forward: Default::default(),
            backward: Default::default(),
        }
    }
}

impl<B: Backend> Transformer<B> {
    /// How many of the training passes are replayed from recordings
    /// (`ModelOptions::record_passes`): none where the backend records nothing.
    pub fn recorded_passes(&self) -> usize {
        self.recordings.borrow().held()
    }
}
