//! Compressed text and JSONL inputs (`.gz`, `.zst`), as datasets are shipped: decompressed
//! as they stream through the readers, never unpacked to disk. A reader sees the text; the
//! progress bar sees how far into the file on disk it is.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    /// gzip, one member or several one after another (as `cat a.gz b.gz` and pigz make).
    Gzip,
    /// Zstandard, one frame or several.
    Zstd,
}

impl Compression {
    /// The compression of `path` by its last extension, and the file name without it.
    pub fn of(path: &Path) -> (Compression, &str) {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let lower = name.to_ascii_lowercase();
        for (ext, compression) in [(".gz", Compression::Gzip), (".zst", Compression::Zstd)] {
            if lower.ends_with(ext) {
                return (compression, &name[..name.len() - ext.len()]);
            }
        }
        (Compression::None, name)
    }
}

/// How many bytes of the file on disk have been read.
#[derive(Clone)]
pub struct Position(Arc<AtomicU64>);

impl Position {
    /// Where the reader is, for the progress bar: `text_offset` (bytes of text read) for a
    /// file that is not compressed, else the bytes read from the compressed file.
    pub fn on_disk(&self, text_offset: u64) -> u64 {
        match self.0.load(Ordering::Relaxed) {
            u64::MAX => text_offset,
            read => read,
        }
    }
}

/// A file, counting the bytes read from it.
struct Counted {
    file: File,
    read: Arc<AtomicU64>,
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// `path`'s text, decompressed if its name says it is compressed, with where in the file
/// the reading is.
pub fn open(path: &Path) -> Result<(Box<dyn Read>, Position)> {
    let name = path.display();
    let file = File::open(path).with_context(|| format!("{name}: cannot open"))?;
    let (compression, _) = Compression::of(path);
    if compression == Compression::None {
        return Ok((Box::new(file), Position(Arc::new(AtomicU64::new(u64::MAX)))));
    }
    let read = Arc::new(AtomicU64::new(0));
    let counted = io::BufReader::with_capacity(
        1 << 20,
        Counted {
            file,
            read: read.clone(),
        },
    );
    let text: Box<dyn Read> = match compression {
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(counted)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::with_buffer(counted)
                .with_context(|| format!("{name}: cannot start decompressing it"))?,
        ),
        Compression::None => unreachable!("returned above"),
    };
    Ok((
        Box::new(Named {
            text,
            path: path.display().to_string(),
        }),
        Position(read),
    ))
}

/// A decompressing reader whose errors name the file (a damaged or truncated archive).
struct Named {
    text: Box<dyn Read>,
    path: String,
}

impl Read for Named {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.text.read(buf).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("{}: cannot decompress it: {e}", self.path),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn names_and_streams() {
        assert_eq!(
            Compression::of(Path::new("a/b.jsonl.GZ")),
            (Compression::Gzip, "b.jsonl")
        );
        assert_eq!(
            Compression::of(Path::new("b.txt.zst")),
            (Compression::Zstd, "b.txt")
        );
        assert_eq!(
            Compression::of(Path::new("b.md")),
            (Compression::None, "b.md")
        );
        let dir = tempfile::tempdir().unwrap();
        let text = "one line\nand another\n".repeat(1000);
        // Two gzip members, as `cat a.gz b.gz` makes: both are read.
        let gz = dir.path().join("t.txt.gz");
        let mut out = Vec::new();
        for half in [&text[..100], &text[100..]] {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(half.as_bytes()).unwrap();
            out.extend(e.finish().unwrap());
        }
        std::fs::write(&gz, &out).unwrap();
        let zst = dir.path().join("t.txt.zst");
        std::fs::write(&zst, zstd::encode_all(text.as_bytes(), 3).unwrap()).unwrap();
        for path in [&gz, &zst] {
            let (mut reader, position) = open(path).unwrap();
            let mut got = String::new();
            reader.read_to_string(&mut got).unwrap();
            assert_eq!(got, text, "{}", path.display());
            let on_disk = std::fs::metadata(path).unwrap().len();
            assert_eq!(position.on_disk(0), on_disk);
        }
        // A truncated archive is an error that names the file.
        std::fs::write(&gz, &out[..out.len() / 2]).unwrap();
        let (mut reader, _) = open(&gz).unwrap();
        let err = reader.read_to_end(&mut Vec::new()).unwrap_err();
        assert!(
            err.to_string().contains("t.txt.gz: cannot decompress it"),
            "{err}"
        );
    }
}
