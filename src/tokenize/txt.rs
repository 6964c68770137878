//! Plain-text inputs: a whole file is one document, or, with a separator, each piece between
//! separators is one, read in blocks so that a file far larger than memory streams through.

use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result, bail};

use super::compressed;
use super::document::{Document, Sink};

/// The largest document accepted. Tokenizing holds ~30 bytes per input byte for a moment
/// (ids, token strings, offsets), so this bounds one document's memory at about 1 GB.
pub const MAX_DOCUMENT_BYTES: usize = 32 << 20;
const BLOCK_BYTES: usize = 1 << 20;

pub fn read(path: &Path, separator: Option<&str>, sink: &mut Sink) -> Result<()> {
    let name = path.display();
    let (file, position) = compressed::open(path)?;
    let Some(separator) = separator else {
        // One byte more than a document may hold says that the file holds more.
        let mut bytes = Vec::new();
        (file
            .take(MAX_DOCUMENT_BYTES as u64 + 1)
            .read_to_end(&mut bytes))
        .with_context(|| format!("{name}: cannot read"))?;
        if bytes.len() > MAX_DOCUMENT_BYTES {
            bail!(
                "{name}: more than {} MiB of text is too large for one document; split the file into documents with --separator",
                MAX_DOCUMENT_BYTES >> 20
            );
        }
        let end = bytes.len() as u64;
        let text = String::from_utf8(bytes)
            .with_context(|| format!("{name}: cannot read as UTF-8 text"))?;
        return sink(Document::text(text), position.on_disk(end));
    };
    split(
        file,
        separator.as_bytes(),
        BLOCK_BYTES,
        |piece, offset, end| {
            let text = String::from_utf8(piece).map_err(|e| {
                anyhow::anyhow!(
                    "{name}: not UTF-8 text at byte {}",
                    offset + e.utf8_error().valid_up_to() as u64
                )
            })?;
            sink(Document::text(text), position.on_disk(end))
        },
    )
    .with_context(|| format!("{name}: reading documents separated by {separator:?}"))
}

/// Calls `emit(piece, start, end)` for each piece of `reader` between occurrences of `sep`,
/// with the piece's start and end (separator included) as byte offsets; reads `block` bytes at
/// a time and holds at most one piece plus one block.
fn split(
    mut reader: impl Read, sep: &[u8], block: usize,
    mut emit: impl FnMut(Vec<u8>, u64, u64) -> Result<()>,
) -> Result<()> {
    assert!(!sep.is_empty(), "the separator is checked to be non-empty");
    // `buf` holds the file from offset `base`; the current piece starts at `start`, and no
    // separator begins before `scan`.
    let (mut buf, mut base, mut start, mut scan) = (Vec::new(), 0u64, 0usize, 0usize);
    loop {
        if let Some(k) = buf[scan..].windows(sep.len()).position(|w| w == sep) {
            let end = scan + k;
            let piece = buf[start..end].to_vec();
            emit(piece, base + start as u64, base + (end + sep.len()) as u64)?;
            start = end + sep.len();
            scan = start;
            continue;
        }
        // A separator may straddle the end of what was read: rescan its possible start.
        scan = buf.len().saturating_sub(sep.len() - 1).max(start);
        buf.drain(..start);
        base += start as u64;
        scan -= start;
        start = 0;
        if buf.len() > MAX_DOCUMENT_BYTES {
            bail!(
                "no separator in the {} MiB from byte {base}; is the separator right?",
                MAX_DOCUMENT_BYTES >> 20
            );
        }
        let read = (&mut reader).take(block as u64).read_to_end(&mut buf)?;
        if read == 0 {
            if !buf.is_empty() {
                let end = base + buf.len() as u64;
                emit(std::mem::take(&mut buf), base, end)?;
            }
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces as `str::split` finds them, read in blocks of every size from 1 byte up, so that
    /// separators straddle block ends in every position.
    #[test]
    fn split_matches_str_split_for_every_block_size() {
        let text = "one\n\n\ntwo\n\nthree\n\n\n\n\nfour and more\n\n";
        let sep = "\n\n";
        let expected: Vec<&str> = text.split(sep).filter(|p| !p.is_empty()).collect();
        for block in 1..=text.len() + 1 {
            let mut pieces = Vec::new();
            let mut last_end = 0;
            split(text.as_bytes(), sep.as_bytes(), block, |p, start, end| {
                assert!(start >= last_end && end > start);
                last_end = end;
                pieces.push(String::from_utf8(p).unwrap());
                Ok(())
            })
            .unwrap();
            pieces.retain(|p| !p.is_empty());
            assert_eq!(pieces, expected, "block {block}");
            assert_eq!(last_end, text.len() as u64, "block {block}");
        }
    }
}
