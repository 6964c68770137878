//! Device memory: one allocation per category (weights, gradients, activations, ...), carved
//! into 256-byte-aligned views, plus a scratch buffer for kernels' transient partial results.
//! Every byte is counted by category, so the startup memory table shows real numbers, and
//! running out of memory says what to change instead of printing a CUDA error code.

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use anyhow::{Result, anyhow};
use cudarc::driver::result::{self, DriverError};
use cudarc::driver::{CudaContext, sys};

use crate::tensor::TensorSpec;

/// Views start at multiples of this many bytes (what cuBLASLt and vector loads like best).
pub const ALIGN: usize = 256;

/// One device allocation, freed on drop.
pub struct Arena {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl Arena {
    /// Allocates `bytes` (at least one) on `ctx`'s device.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Arena, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: the context is current; the pointer is owned by the returned Arena.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }?;
        Ok(Arena {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // Wait for work that may still use the memory before freeing it. Errors here (a
        // context already torn down) cannot be reported from a destructor.
        let _ = self.ctx.synchronize();
        // SAFETY: `ptr` came from malloc_sync, no queued work uses it any more, and it is
        // freed once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// What a CUDA tensor points into: an arena and the byte offset of its view.
#[derive(Clone)]
pub struct CudaStorage {
    pub(super) arena: Arc<Arena>,
    pub(super) base: usize,
}

impl CudaStorage {
    /// The device address of element `offset` of a view whose elements are `size` bytes.
    pub fn address(&self, offset: usize, size: usize) -> u64 {
        self.arena.ptr() + (self.base + offset * size) as u64
    }
}

/// The byte offset of each spec's view in one allocation, and the total size.
pub fn carve(specs: &[TensorSpec]) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(specs.len());
    let mut end = 0usize;
    for spec in specs {
        offsets.push(end);
        end += spec.bytes().div_ceil(ALIGN) * ALIGN;
    }
    (offsets, end)
}

/// The allocations of each category, in allocation order (weak, so that the report counts
/// only live memory), and the growable scratch buffer.
pub struct Memory {
    ctx: Arc<CudaContext>,
    categories: RefCell<Vec<(String, Vec<Weak<Arena>>)>>,
    scratch: RefCell<Option<Arena>>,
}

/// The memory table: bytes per category, and the device's free and total bytes.
#[derive(Clone, Debug)]
pub struct MemoryReport {
    pub categories: Vec<(String, usize)>,
    pub free: usize,
    pub total: usize,
}

impl std::fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        for (name, bytes) in &self.categories {
            writeln!(f, "  {name:<14} {:>10.1} MiB", mib(*bytes))?;
        }
        write!(
            f,
            "  {:<14} {:>10.1} MiB of {:.1} MiB",
            "free",
            mib(self.free),
            mib(self.total)
        )
    }
}

impl Memory {
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        Memory {
            ctx,
            categories: RefCell::new(vec![]),
            scratch: RefCell::new(None),
        }
    }

    pub fn report(&self) -> Result<MemoryReport> {
        self.ctx.bind_to_thread()?;
        let (free, total) = result::mem_get_info()?;
        let mut categories: Vec<(String, usize)> = self
            .categories
            .borrow()
            .iter()
            .map(|(name, arenas)| {
                let live = arenas.iter().filter_map(Weak::upgrade).map(|a| a.bytes());
                (name.clone(), live.sum())
            })
            .collect();
        if let Some(s) = self.scratch.borrow().as_ref() {
            categories.push(("scratch".into(), s.bytes()));
        }
        Ok(MemoryReport {
            categories,
            free,
            total,
        })
    }

    /// One allocation for `category`, counted in the report, or an out-of-memory error that
    /// shows the table and what to change.
    pub fn allocate(&self, category: &str, bytes: usize) -> Result<Arc<Arena>> {
        match Arena::new(&self.ctx, bytes) {
            Ok(arena) => {
                let arena = Arc::new(arena);
                let mut categories = self.categories.borrow_mut();
                let weak = Arc::downgrade(&arena);
                match categories.iter_mut().find(|(n, _)| n == category) {
                    Some((_, arenas)) => {
                        arenas.retain(|a| a.strong_count() > 0);
                        arenas.push(weak);
                    }
                    None => categories.push((category.to_string(), vec![weak])),
                }
                Ok(arena)
            }
            Err(e) => Err(self.out_of_memory(category, bytes, e)),
        }
    }

    fn out_of_memory(&self, category: &str, bytes: usize, e: DriverError) -> anyhow::Error {
        if e.0 != sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            return anyhow!("allocating {bytes} bytes for {category}: {e}");
        }
        let table = self
            .report()
            .map(|r| r.to_string())
            .unwrap_or_else(|e| format!("  (no table: {e})"));
        anyhow!(
            "out of GPU memory allocating {:.1} MiB for {category}.\nAlready allocated:\n{table}\n\
             To fit, lower --batch-size (activations scale with it), turn on recompute \
             (--recompute-block, or -ffn/-att/-qkv/-norm/-swiglu), or raise --lmhead-chunks \
             (the logits buffer shrinks with it).",
            bytes as f64 / (1024.0 * 1024.0)
        )
    }

    /// A scratch buffer of at least `bytes`, valid until the next call. It only grows, which
    /// happens in the first step; growing waits for the device (freeing synchronizes).
    pub fn scratch(&self, bytes: usize) -> Result<u64> {
        if let Some(s) = self.scratch.borrow().as_ref()
            && s.bytes() >= bytes
        {
            return Ok(s.ptr());
        }
        *self.scratch.borrow_mut() = None;
        let size = bytes.next_power_of_two().max(1 << 20);
        let arena =
            Arena::new(&self.ctx, size).map_err(|e| self.out_of_memory("scratch", size, e))?;
        let ptr = arena.ptr();
        *self.scratch.borrow_mut() = Some(arena);
        Ok(ptr)
    }
}
