//! Device memory: one allocation per category (weights, gradients, activations, ...), carved
//! into 256-byte-aligned views, plus a scratch buffer for kernels' transient partial results.
//! Every byte is counted by category, so the startup memory table shows real numbers, and
//! running out of memory says what to change instead of printing a CUDA error code.
//!
//! A category may instead live in pinned host memory mapped into the device's address space
//! (offloaded optimizer state): kernels reach it over the bus through the same kind of
//! pointer, so no op needs to know where its tensors are.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::sync::{Arc, Weak};

use anyhow::{Result, anyhow};
use cudarc::driver::result::{self, DriverError};
use cudarc::driver::{CudaContext, sys};

use crate::tensor::TensorSpec;

/// Views start at multiples of this many bytes (what cuBLASLt and vector loads like best).
pub const ALIGN: usize = 256;

/// Where an arena's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Device,
    /// Page-locked host memory that the device reads and writes over the bus.
    PinnedHost,
}

/// One allocation, freed on drop.
pub struct Arena {
    ctx: Arc<CudaContext>,
    /// The address kernels use (for pinned host memory, its device mapping).
    ptr: sys::CUdeviceptr,
    /// The host address that pinned host memory is freed by (an integer, like `ptr`).
    host: Option<usize>,
    bytes: usize,
}

impl Arena {
    /// Allocates `bytes` (at least one) for `ctx`'s device, in `place`.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize, place: Place) -> Result<Arena, DriverError> {
        ctx.bind_to_thread()?;
        let (ptr, host) = match place {
            // SAFETY: the context is current; the pointer is owned by the returned Arena.
            Place::Device => (unsafe { result::malloc_sync(bytes.max(1)) }?, None),
            Place::PinnedHost => {
                let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP;
                // SAFETY: as above; the memory is written before it is read (the optimizer
                // fills or uploads its state), like device memory.
                let host = unsafe { result::malloc_host(bytes.max(1), flags) }?;
                let mut ptr = 0;
                // SAFETY: `host` was allocated with DEVICEMAP in the current context.
                let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut ptr, host, 0) };
                if let Err(e) = mapped.result() {
                    // SAFETY: `host` came from malloc_host and nothing else holds it.
                    let _ = unsafe { result::free_host(host) };
                    return Err(e);
                }
                (ptr, Some(host as usize))
            }
        };
        Ok(Arena {
            ctx: ctx.clone(),
            ptr,
            host,
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
        // SAFETY: the pointer came from malloc_host or malloc_sync, no queued work uses it
        // any more, and it is freed once.
        let _ = unsafe {
            match self.host {
                Some(host) => result::free_host(host as *mut c_void),
                None => result::free_sync(self.ptr),
            }
        };
    }
}

/// What a CUDA tensor points into: an arena and the byte offset of its view.
#[derive(Clone)]
pub struct CudaStorage {
    pub(super) arena: Arc<Arena>,
    pub(super) base: usize,
}

impl CudaStorage {
    /// Whether the bytes are in pinned host memory.
    pub fn in_host(&self) -> bool {
        self.arena.host.is_some()
    }

    /// The device address of element `offset` of a view whose elements are `size` bytes.
    pub fn address(&self, offset: usize, size: usize) -> u64 {
        self.arena.ptr() + (self.base + offset * size) as u64
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
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

/// The allocations of one category in one place, in allocation order (weak, so that the
/// report counts only live memory).
struct Category {
    name: String,
    place: Place,
    arenas: Vec<Weak<Arena>>,
}

/// Every category's allocations, and the growable scratch buffer.
pub struct Memory {
    ctx: Arc<CudaContext>,
    categories: RefCell<Vec<Category>>,
    scratch: RefCell<Option<Arena>>,
    /// Whether a recording (`Backend::record`) writes to the current scratch buffer.
    scratch_held: Cell<bool>,
    /// Earlier scratch buffers that recordings write to: kept when the scratch grows past
    /// them, since each replay still does.
    held_scratch: RefCell<Vec<Arena>>,
}

/// The memory table: bytes per category on the device and in pinned host memory, and the
/// device's free and total bytes.
#[derive(Clone, Debug)]
pub struct MemoryReport {
    pub categories: Vec<(String, usize)>,
    pub pinned_host: Vec<(String, usize)>,
    pub free: usize,
    pub total: usize,
}

impl std::fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (name, bytes) in &self.categories {
            writeln!(f, "  {name:<14} {:>10.1} MiB", mib(*bytes))?;
        }
        for (name, bytes) in &self.pinned_host {
            writeln!(
                f,
                "  {name:<14} {:>10.1} MiB (pinned host memory)",
                mib(*bytes)
            )?;
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
            scratch_held: Cell::new(false),
            held_scratch: RefCell::new(vec![]),
        }
    }

    pub fn report(&self) -> Result<MemoryReport> {
        self.ctx.bind_to_thread()?;
        let (free, total) = result::mem_get_info()?;
        let categories = self.categories.borrow();
        let in_place = |place: Place| -> Vec<(String, usize)> {
            categories
                .iter()
                .filter(|c| c.place == place)
                .filter_map(|c| {
                    let live: Vec<_> = c.arenas.iter().filter_map(Weak::upgrade).collect();
                    let bytes = live.iter().map(|a| a.bytes()).sum();
                    (!live.is_empty()).then(|| (c.name.clone(), bytes))
                })
                .collect()
        };
        let mut on_device = in_place(Place::Device);
        let held = self.held_scratch.borrow();
        let scratch = self.scratch.borrow();
        let bytes: usize = held.iter().chain(scratch.as_ref()).map(Arena::bytes).sum();
        if bytes > 0 {
            on_device.push(("scratch".into(), bytes));
        }
        Ok(MemoryReport {
            categories: on_device,
            pinned_host: in_place(Place::PinnedHost),
            free,
            total,
        })
    }

    /// One allocation for `category` in `place`, counted in the report, or an out-of-memory
    /// error that shows the table and what to change.
    pub fn allocate(&self, category: &str, bytes: usize, place: Place) -> Result<Arc<Arena>> {
        let arena = match Arena::new(&self.ctx, bytes, place) {
            Ok(arena) => Arc::new(arena),
            Err(e) if place == Place::PinnedHost => {
                return Err(anyhow!(
                    "pinning {:.1} MiB of host memory for {category}: {e}. The host lacks that \
                     much free memory, or its locked-memory limit (ulimit -l) is lower: keep \
                     {category} on the device (leave out its --offload-* flag)",
                    mib(bytes)
                ));
            }
            Err(e) => return Err(self.out_of_memory(category, bytes, e)),
        };
        let mut categories = self.categories.borrow_mut();
        let weak = Arc::downgrade(&arena);
        match categories
            .iter_mut()
            .find(|c| c.name == category && c.place == place)
        {
            Some(c) => {
                c.arenas.retain(|a| a.strong_count() > 0);
                c.arenas.push(weak);
            }
            None => categories.push(Category {
                name: category.to_string(),
                place,
                arenas: vec![weak],
            }),
        }
        Ok(arena)
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
             (--recompute-block, or -ffn/-att/-qkv/-norm/-swiglu), raise --lmhead-chunks \
             (the logits buffer shrinks with it), or keep the optimizer state in host memory \
             (the --offload-* flags).",
            mib(bytes)
        )
    }

    /// A scratch buffer of at least `bytes`, valid until the next call. It only grows, which
    /// happens in the first step; growing waits for the device (freeing synchronizes), and
    /// keeps the buffer it replaces where a recording writes to it (`hold_scratch`).
    pub fn scratch(&self, bytes: usize) -> Result<u64> {
        if let Some(s) = self.scratch.borrow().as_ref()
            && s.bytes() >= bytes
        {
            return Ok(s.ptr());
        }
        let replaced = self.scratch.borrow_mut().take();
        if let Some(old) = replaced.filter(|_| self.scratch_held.replace(false)) {
            self.held_scratch.borrow_mut().push(old);
        }
        let size = bytes.next_power_of_two().max(1 << 20);
        let arena = Arena::new(&self.ctx, size, Place::Device)
            .map_err(|e| self.out_of_memory("scratch", size, e))?;
        let ptr = arena.ptr();
        *self.scratch.borrow_mut() = Some(arena);
        Ok(ptr)
    }

    /// A recording has been made whose ops may write to the current scratch buffer.
    pub fn hold_scratch(&self) {
        self.scratch_held.set(true);
    }
}
