//! Multi-tensor launches: one kernel launch covers a run of tensors, each with an entry in a
//! table in the scratch memory and a run of the launch's blocks, in table order
//! (`entry_of_block` in common.cuh finds a block's entry). The gradients' sum of squares and
//! AdamW update a model's hundreds of tensors this way, in a launch or two.

use anyhow::Result;
use cudarc::driver::result;

use super::Cuda;

/// Consecutive entries of the table that need the same kernel instantiation (`variant`),
/// which one launch covers.
pub(super) struct Run<V> {
    pub variant: V,
    /// Its first entry, and how many it has.
    pub first: usize,
    pub entries: usize,
    /// Its entries' blocks, which make its launch's grid.
    pub blocks: u32,
}

impl<V> Run<V> {
    /// The device address of its first entry, in a table at `list` of `words` 8-byte words
    /// per entry.
    pub fn entries_at(&self, list: u64, words: usize) -> u64 {
        list + (8 * words * self.first) as u64
    }
}

/// Groups a table's entries, in order, into runs.
pub(super) struct Runs<V>(pub Vec<Run<V>>);

impl<V: PartialEq> Runs<V> {
    pub fn new() -> Self {
        Runs(Vec::new())
    }

    /// Adds the next entry, of `variant` and `blocks` blocks. Returns its first block within
    /// its run's launch, which its table entry records.
    pub fn push(&mut self, variant: V, blocks: u32) -> u32 {
        let next = self.0.last().map_or(0, |r| r.first + r.entries);
        if self.0.last().is_none_or(|r| r.variant != variant) {
            self.0.push(Run {
                variant,
                first: next,
                entries: 0,
                blocks: 0,
            });
        }
        let run = self.0.last_mut().expect("pushed above");
        let first_block = run.blocks;
        run.entries += 1;
        run.blocks += blocks;
        first_block
    }

    /// Every run's blocks.
    pub fn blocks(&self) -> u32 {
        self.0.iter().map(|r| r.blocks).sum()
    }
}

impl Cuda {
    /// Scratch room for `floats` f32s, followed by `table` (a multi-tensor launch's entries,
    /// 8-byte aligned) copied in: (the floats' address, the table's).
    pub(super) fn scratch_with_table(&self, floats: usize, table: &[u64]) -> Result<(u64, u64)> {
        let table_at = floats.next_multiple_of(2); // 8-byte aligned, in floats
        let scratch = self.scratch_f32(table_at + 2 * table.len())?;
        let list = scratch + 4 * table_at as u64;
        if !table.is_empty() {
            self.ctx.bind_to_thread()?;
            // SAFETY: the scratch holds `table_at` floats and then the table's words. Pageable
            // memory is staged before the call returns.
            unsafe { result::memcpy_htod_async(list, table, self.stream.cu_stream()) }?;
        }
        Ok((scratch, list))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_group_consecutive_entries_of_one_variant() {
        let mut runs = Runs::new();
        // Each entry's first block within its run.
        let firsts: Vec<u32> = [('a', 3), ('a', 0), ('a', 2), ('b', 4), ('a', 1)]
            .into_iter()
            .map(|(variant, blocks)| runs.push(variant, blocks))
            .collect();
        assert_eq!(firsts, [0, 3, 3, 0, 0]);
        let summary: Vec<_> = runs
            .0
            .iter()
            .map(|r| (r.variant, r.first, r.entries, r.blocks))
            .collect();
        assert_eq!(summary, [('a', 0, 3, 5), ('b', 3, 1, 4), ('a', 4, 1, 1)]);
        assert_eq!(runs.blocks(), 10);
        // The second run starts at entry 3: three 11-word entries into the table.
        assert_eq!(runs.0[1].entries_at(0x1000, 11), 0x1000 + 3 * 88);
    }
}
