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
    /// The first end event that failed to record, reported by `take`.
    failed: RefCell<Option<anyhow::Error>>,
}

/// One op's timing, from its start to its drop, which records the end: an op begins with
/// `let _timing = self.time_op(..)?;` and its launches follow.
pub struct OpTiming<'a> {
    timer: &'a OpTimer,
    stream: &'a Arc<CudaStream>,
    /// The op's name and start event, while timing is on.
    started: Option<(String, CudaEvent)>,
}

impl OpTimer {
    pub fn set(&self, on: bool) {
        self.on.set(on);
    }

    pub fn is_on(&self) -> bool {
        self.on.get()
    }

    /// Starts timing an op whose work is enqueued on `stream` until the returned value is
    /// dropped; `name` is built only while timing is on.
    pub fn begin<'a>(
        &'a self, stream: &'a Arc<CudaStream>, name: impl FnOnce() -> String,
    ) -> Result<OpTiming<'a>> {
        let started = match self.on.get() {
            true => Some((name(), record(stream)?)),
            false => None,
        };
        Ok(OpTiming {
            timer: self,
            stream,
            started,
        })
    }

    /// Waits for the device and returns the totals of the ops timed since the last call.
    pub fn take(&self, stream: &CudaStream) -> Result<Vec<OpTime>> {
        stream.synchronize().context("waiting for the GPU")?;
        if let Some(err) = self.failed.borrow_mut().take() {
            return Err(err);
        }
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

impl Drop for OpTiming<'_> {
    fn drop(&mut self) {
        let Some((name, start)) = self.started.take() else {
            return;
        };
        match record(self.stream) {
            Ok(end) => self.timer.pending.borrow_mut().push((name, start, end)),
            Err(err) => {
                self.timer.failed.borrow_mut().get_or_insert(err);
            }
        }
    }
}

fn record(stream: &Arc<CudaStream>) -> Result<CudaEvent> {
    stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .context("recording an op-timing event")
}
