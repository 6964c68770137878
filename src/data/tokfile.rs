//! llm.q's BIN.TOK token files, read through a memory map and written atomically.
//!
//! Layout: a 1024-byte header of 256 little-endian int32 — bytes 0..8 the magic
//! `BIN.TOK\n`, then [2] version (1 or 2), [3] bytes per token (4), [4] token count,
//! [5] vocabulary size (version 2; 0 if unknown), [6] 1 if a loss mask follows — then the
//! tokens as int32, then, if present, the mask: one bit per token, least significant bit
//! first. A set bit means the token at that position is trained *as a target*.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use memmap2::Mmap;

use crate::io::atomic::{is_disk_full_io, sync_dir, temporary_name};

pub const MAGIC: &[u8; 8] = b"BIN.TOK\n";
pub const HEADER_BYTES: usize = 1024;
const BYTES_PER_TOKEN: i32 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: i32,
    pub tokens: usize,
    /// The vocabulary the tokens were drawn from (version 2 files).
    pub vocab_size: Option<usize>,
    pub has_mask: bool,
}

impl Header {
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES] {
        let mut bytes = [0u8; HEADER_BYTES];
        bytes[..8].copy_from_slice(MAGIC);
        let fields = [
            self.version,
            BYTES_PER_TOKEN,
            self.tokens as i32,
            self.vocab_size.unwrap_or(0) as i32,
            self.has_mask as i32,
        ];
        for (i, v) in fields.iter().enumerate() {
            bytes[8 + 4 * i..12 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        bytes
    }

    /// Parses and checks a header; `path` names the file in errors.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Header> {
        let name = path.display();
        if bytes.len() < HEADER_BYTES {
            bail!(
                "{name}: {} bytes is too short for a BIN.TOK file (the header alone is 1024 bytes); recreate it with `smelt tokenize`",
                bytes.len()
            );
        }
        if &bytes[..8] != MAGIC {
            bail!(
                "{name}: not a BIN.TOK token file (wrong magic); create token files with `smelt tokenize`"
            );
        }
        let int =
            |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        let (version, width, tokens, vocab, masks) = (int(2), int(3), int(4), int(5), int(6));
        if version != 1 && version != 2 {
            bail!(
                "{name}: BIN.TOK version {version} is not supported (1 or 2); recreate it with `smelt tokenize`"
            );
        }
        if width != BYTES_PER_TOKEN {
            bail!(
                "{name}: {width} bytes per token; smelt reads 4-byte tokens only: recreate it with `smelt tokenize`"
            );
        }
        if tokens < 0 || vocab < 0 {
            bail!(
                "{name}: the header is corrupt (token count {tokens}, vocabulary {vocab}); recreate it with `smelt tokenize`"
            );
        }
        Ok(Header {
            version,
            tokens: tokens as usize,
            vocab_size: (version == 2 && vocab > 0).then_some(vocab as usize),
            has_mask: version == 2 && masks != 0,
        })
    }

    /// The file's size implied by the header.
    pub fn file_bytes(&self) -> usize {
        HEADER_BYTES
            + 4 * self.tokens
            + if self.has_mask {
                self.tokens.div_ceil(8)
            } else {
                0
            }
    }
}

/// A token file mapped into memory.
pub struct TokenFile {
    pub path: PathBuf,
    pub header: Header,
    map: Mmap,
}

impl TokenFile {
    /// Maps `path` and checks its header and size. With `vocab_size` given, also checks that
    /// every token is below it, so that a bad id fails here and not in the middle of training.
    pub fn open(path: &Path, vocab_size: Option<usize>) -> Result<TokenFile> {
        let name = path.display();
        let file = File::open(path).with_context(|| format!("{name}: cannot open token file"))?;
        // SAFETY: the map is read-only; a file truncated underneath us by another process
        // would be a misuse we cannot guard against, as with any mapped input.
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("{name}: cannot map token file"))?;
        let header = Header::parse(&map, path)?;
        if map.len() != header.file_bytes() {
            let what = match map.len() < header.file_bytes() {
                true => "truncated",
                false => "longer than its header says (corrupt, or appended to)",
            };
            bail!(
                "{name}: {what}: the header promises {} tokens ({} bytes) but the file has {} bytes; recreate it with `smelt tokenize`",
                header.tokens,
                header.file_bytes(),
                map.len()
            );
        }
        if header.tokens == 0 {
            bail!("{name}: the file holds no tokens; tokenize some text into it, or leave it out");
        }
        let tf = TokenFile {
            path: path.to_path_buf(),
            header,
            map,
        };
        if let Some(limit) = vocab_size {
            if let Some(vocab) = header.vocab_size
                && vocab > limit
            {
                bail!(
                    "{name}: tokenized for a vocabulary of {vocab}, but the model has {limit}; tokenize with the model's tokenizer"
                );
            }
            if let Some((i, t)) = (0..header.tokens)
                .map(|i| (i, tf.token(i)))
                .find(|&(_, t)| t < 0 || t as usize >= limit)
            {
                bail!(
                    "{name}: token {t} at position {i} is outside the model's vocabulary of {limit}; tokenize with the model's own tokenizer"
                );
            }
        }
        Ok(tf)
    }

    pub fn len(&self) -> usize {
        self.header.tokens
    }

    pub fn is_empty(&self) -> bool {
        self.header.tokens == 0
    }

    pub fn token(&self, i: usize) -> i32 {
        let at = HEADER_BYTES + 4 * i;
        i32::from_le_bytes(self.map[at..at + 4].try_into().expect("4 bytes"))
    }

    /// Copies tokens `start..start + out.len()` into `out`.
    pub fn read(&self, start: usize, out: &mut [i32]) {
        for (k, o) in out.iter_mut().enumerate() {
            *o = self.token(start + k);
        }
    }

    /// Whether the token at `i` is trained as a target (always, without a mask).
    pub fn trained(&self, i: usize) -> bool {
        if !self.header.has_mask {
            return true;
        }
        let byte = self.map[HEADER_BYTES + 4 * self.header.tokens + i / 8];
        byte >> (i % 8) & 1 == 1
    }
}

/// Writes a token file under a temporary name and renames it into place on `finish`, so
/// that a crash never leaves a partial file under the final name. Dropped unfinished (an
/// error on the way), it deletes its temporary file.
pub struct TokenWriter {
    pending: PendingFile,
    out: BufWriter<File>,
    tokens: usize,
    vocab_size: Option<usize>,
    /// Mask bits, kept in memory until the tokens are all written (1 bit per token).
    mask: Option<Vec<u8>>,
}

impl TokenWriter {
    pub fn create(path: &Path, vocab_size: Option<usize>, with_mask: bool) -> Result<TokenWriter> {
        if let Some(vocab) = vocab_size.filter(|&v| v > i32::MAX as usize) {
            bail!(
                "{}: a vocabulary of {vocab} does not fit BIN.TOK's int32 tokens (at most 2^31 - 1)",
                path.display()
            );
        }
        let pending = PendingFile {
            tmp: temporary_name(path),
            path: path.to_path_buf(),
        };
        let file = File::create(&pending.tmp)
            .with_context(|| format!("{}: cannot create token file", pending.tmp.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&[0u8; HEADER_BYTES])?;
        Ok(TokenWriter {
            pending,
            out,
            tokens: 0,
            vocab_size,
            mask: with_mask.then(Vec::new),
        })
    }

    /// Appends tokens; `mask` (one flag per token) is required exactly when the file has one.
    pub fn write(&mut self, tokens: &[i32], mask: Option<&[bool]>) -> Result<()> {
        if self.tokens + tokens.len() > i32::MAX as usize {
            bail!(
                "{}: a BIN.TOK file holds at most 2^31 - 1 tokens; use a smaller --shard-tokens",
                self.pending.path.display()
            );
        }
        let out = &mut self.out;
        let written: std::io::Result<()> = tokens
            .iter()
            .try_for_each(|t| out.write_all(&t.to_le_bytes()));
        written.map_err(|e| write_error(&self.pending.path, e))?;
        match (&mut self.mask, mask) {
            (Some(bits), Some(flags)) => {
                assert_eq!(flags.len(), tokens.len(), "one mask flag per token");
                for (k, &f) in flags.iter().enumerate() {
                    let i = self.tokens + k;
                    if i.is_multiple_of(8) {
                        bits.push(0);
                    }
                    if f {
                        *bits.last_mut().expect("pushed above") |= 1 << (i % 8);
                    }
                }
            }
            (None, None) => {}
            _ => panic!("mask given to a file without one, or missing for a file with one"),
        }
        self.tokens += tokens.len();
        Ok(())
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Writes the mask and header, syncs, and renames the file into place.
    pub fn finish(self) -> Result<PathBuf> {
        self.seal()?.commit()
    }

    /// Writes the mask and header and syncs, still under the temporary name. Several files
    /// sealed first and committed together appear only once all of them are complete.
    pub fn seal(mut self) -> Result<SealedTokenFile> {
        let name = self.pending.tmp.display().to_string();
        let fail = |e| write_error(&self.pending.path, e);
        if let Some(bits) = &self.mask {
            self.out.write_all(bits).map_err(fail)?;
        }
        let header = Header {
            version: 2,
            tokens: self.tokens,
            vocab_size: self.vocab_size,
            has_mask: self.mask.is_some(),
        };
        let mut file =
            (self.out.into_inner()).map_err(|e| write_error(&self.pending.path, e.into_error()))?;
        use std::io::{Seek, SeekFrom};
        (file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(&header.to_bytes()))
            .map_err(|e| write_error(&self.pending.path, e))?;
        file.sync_all()
            .with_context(|| format!("{name}: cannot sync to disk"))?;
        Ok(SealedTokenFile {
            pending: self.pending,
            tokens: self.tokens,
        })
    }
}

/// A write to the token file `path` failed: what happened, and for a full disk, what to do.
fn write_error(path: &Path, e: std::io::Error) -> anyhow::Error {
    let fix = match is_disk_full_io(&e) {
        true => "; free space on its disk, or choose another --out-dir",
        false => "",
    };
    anyhow::anyhow!("{}: cannot write the token file: {e}{fix}", path.display())
}

/// A complete token file under its temporary name, waiting for `commit`; dropped, it is
/// deleted.
pub struct SealedTokenFile {
    pending: PendingFile,
    pub tokens: usize,
}

impl SealedTokenFile {
    /// Renames the file into place.
    pub fn commit(self) -> Result<PathBuf> {
        let p = &self.pending;
        std::fs::rename(&p.tmp, &p.path)
            .with_context(|| format!("renaming {} into place", p.path.display()))?;
        sync_dir(&p.path)?;
        Ok(p.path.clone())
    }
}

/// A temporary file that is removed when dropped, unless it was renamed away first (the
/// removal then finds nothing, which is fine).
struct PendingFile {
    tmp: PathBuf,
    path: PathBuf,
}

impl Drop for PendingFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_and_reads_back_with_mask() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        let mut w = TokenWriter::create(&path, Some(100), true).unwrap();
        let tokens: Vec<i32> = (0..21).collect();
        let mask: Vec<bool> = (0..21).map(|i| i % 3 == 0).collect();
        w.write(&tokens[..10], Some(&mask[..10])).unwrap();
        w.write(&tokens[10..], Some(&mask[10..])).unwrap();
        w.finish().unwrap();
        let f = TokenFile::open(&path, Some(100)).unwrap();
        assert_eq!(
            f.header,
            Header {
                version: 2,
                tokens: 21,
                vocab_size: Some(100),
                has_mask: true
            }
        );
        assert!((0..21).all(|i| f.token(i) == i as i32 && f.trained(i) == (i % 3 == 0)));
        assert!(!temporary_name(&path).exists());
    }

    #[test]
    fn dropped_writers_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.bin"), dir.path().join("b.bin"));
        let mut w = TokenWriter::create(&a, None, false).unwrap();
        w.write(&[1, 2, 3], None).unwrap();
        drop(w);
        let mut w = TokenWriter::create(&b, None, false).unwrap();
        w.write(&[1, 2, 3], None).unwrap();
        let sealed = w.seal().unwrap();
        assert_eq!(sealed.tokens, 3);
        assert!(
            !b.exists(),
            "sealed but not committed: not under the final name"
        );
        drop(sealed);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn refuses_a_vocabulary_beyond_int32() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        let big = i32::MAX as usize + 1;
        let err = TokenWriter::create(&path, Some(big), false).err().unwrap();
        assert!(format!("{err:#}").contains("does not fit"), "{err:#}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
