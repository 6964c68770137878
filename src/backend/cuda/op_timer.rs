//! Times each backend op with a pair of CUDA events around its launches. Events are resolved
//! only when the times are taken, after one wait, so timing adds no synchronisation to the
//! step; while it is off an op pays one `Cell` read.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use anyhow::{Context, Result};
use cudarc::driver::{CudaEvent, CudaStream, sys};

use crate::backend::op_times::{OpTime, OpTotals};

#[derive(Default)]
pub struct OpTimer {
    on: Cell<bool>,
    /// Ops enqueued since the last `take`: name, start and end events.
    pending: RefCell<Vec<(String, CudaEvent, CudaEvent)>>,
}

impl OpTimer {
    pub fn set(&self, on: bool) {
        self.on.set(on);
    }

    /// Runs `op` (which enqueues work on `stream`) between two events when timing is on.
    pub fn time<R>(
        &self,
        stream: &Arc<CudaStream>,
        name: impl FnOnce() -> String,
        op: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        if !self.on.get() {
            return op();
        }
        let event = || stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT));
        let start = event().context("recording an op-timing event")?;
        let out = op()?;
        let end = event().context("recording an op-timing event")?;
        self.pending.borrow_mut().push((name(), start, end));
        Ok(out)
    }

    /// Waits for the device and returns the totals of the ops timed since the last call.
    pub fn take(&self, stream: &CudaStream) -> Result<Vec<OpTime>> {
        stream.synchronize().context("waiting for the GPU")?;
        let mut totals = OpTotals::default();
        for (name, start, end) in self.pending.borrow_mut().drain(..) {
            let ms = start
                .elapsed_ms(&end)
                .context("reading an op-timing event")?;
            totals.add(&name, ms as f64 / 1e3);
        }
        Ok(totals.take())
    }
}
