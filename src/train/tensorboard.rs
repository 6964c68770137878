//! TensorBoard event files (`--tensorboard-dir`), written as TensorFlow's summary writer
//! writes them, so that TensorBoard reads them as they grow.
//!
//! A file is a sequence of TFRecords: the data's length (u64 LE), the masked CRC-32C of
//! those 8 bytes (u32 LE), the data, and the data's masked CRC-32C. Each record's data is a
//! `tensorflow.Event` protobuf; the first holds only `file_version`, each later one a
//! summary of one scalar:
//!
//! ```text
//! Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//! Summary { repeated Value value = 1; }
//! Value   { string tag = 1; float simple_value = 2; }
//! ```

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, anyhow};

use super::scalars::Scalar;
use crate::io::atomic::is_disk_full_io;

/// An event file, open for appending.
pub struct EventWriter {
    path: PathBuf,
    file: File,
}

/// Event files this process has created, numbered into their names.
static CREATED: AtomicU64 = AtomicU64::new(0);

impl EventWriter {
    /// Creates a new event file in `dir`, named as TensorFlow names its own
    /// (`events.out.tfevents.<unix seconds>.<hostname>`) plus the process id and a count,
    /// so that runs into one folder never share a file. The caller has checked that `dir`
    /// can be written (`io::create_writable_dir`).
    pub fn create(dir: &Path, wall_time: f64) -> Result<EventWriter> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map_or_else(|_| "localhost".to_string(), |h| h.trim().to_string());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.{}",
            wall_time as u64,
            std::process::id(),
            CREATED.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .with_context(|| {
                format!(
                    "--tensorboard-dir: cannot create {}; choose a directory this user can write to",
                    path.display()
                )
            })?;
        let mut writer = EventWriter { path, file };
        let mut version = vec![];
        field_bytes(&mut version, 3, b"brain.Event:2");
        writer.append(&record(&event(wall_time, 0, &version)))?;
        Ok(writer)
    }

    /// Appends an event per scalar, in one write, which reaches the file before it returns
    /// (it is not buffered), so a live TensorBoard sees every step.
    pub fn write(&mut self, wall_time: f64, scalars: &[Scalar]) -> Result<()> {
        let mut bytes = vec![];
        for s in scalars {
            let mut value = vec![];
            field_bytes(&mut value, 1, s.tag.as_bytes());
            key(&mut value, 2, FIXED32);
            value.extend((s.value as f32).to_le_bytes());
            let (mut values, mut summary) = (vec![], vec![]);
            field_bytes(&mut values, 1, &value);
            field_bytes(&mut summary, 5, &values);
            bytes.extend(record(&event(wall_time, s.step, &summary)));
        }
        self.append(&bytes)
    }

    fn append(&mut self, bytes: &[u8]) -> Result<()> {
        let path = self.path.display();
        self.file.write_all(bytes).map_err(|e| match is_disk_full_io(&e) {
            true => anyhow!(
                "writing {path}: {e}; free space on its disk, or choose another --tensorboard-dir"
            ),
            false => anyhow!("writing {path}: {e}"),
        })
    }
}

/// An `Event`: `wall_time`, `step` (left out at 0, as protobuf leaves defaults out) and
/// `rest`, its other fields already encoded.
fn event(wall_time: f64, step: u64, rest: &[u8]) -> Vec<u8> {
    let mut e = vec![];
    key(&mut e, 1, FIXED64);
    e.extend(wall_time.to_le_bytes());
    if step > 0 {
        key(&mut e, 2, VARINT);
        varint(&mut e, step);
    }
    e.extend(rest);
    e
}

// Protobuf wire types.
const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const BYTES: u64 = 2;
const FIXED32: u64 = 5;

fn key(out: &mut Vec<u8>, field: u64, wire_type: u64) {
    varint(out, field << 3 | wire_type);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    key(out, field, BYTES);
    varint(out, bytes.len() as u64);
    out.extend(bytes);
}

/// `data` framed as a TFRecord.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(data.len() + 16);
    r.extend(len);
    r.extend(masked_crc(&len).to_le_bytes());
    r.extend(data);
    r.extend(masked_crc(data).to_le_bytes());
    r
}

/// TFRecord's masking of a CRC (a CRC of data that holds CRCs is weak, the format says).
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// CRC-32C (Castagnoli), one table lookup per byte: event files are small, so this needs no
/// hardware CRC (nor a crate for one).
fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |crc, &b| {
        CRC32C_TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8)
    })
}

/// The CRC of each byte value, for the reflected Castagnoli polynomial.
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn crc32c_matches_the_standard_check_values() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        // RFC 3720 (iSCSI), B.4.
        assert_eq!(crc32c(&[0; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xff; 32]), 0x62a8_ab43);
        // tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c(b"123456789").
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
    }

    /// The bytes protobuf and TensorBoard's own writer give (event_pb2.Event(...)
    /// .SerializeToString(), framed by tensorboard's `masked_crc32c`).
    #[test]
    fn events_and_records_match_tensorboards_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path(), 1.5).unwrap();
        let scalar = Scalar {
            tag: "train/loss".into(),
            step: 3,
            value: 2.25,
        };
        w.write(1.5, &[scalar]).unwrap();
        let bytes = std::fs::read(&w.path).unwrap();
        let version = "09000000000000f83f1a0d627261696e2e4576656e743a32";
        let first = 8 + 4 + version.len() / 2 + 4;
        assert_eq!(hex(&bytes[12..first - 4]), version);
        assert_eq!(
            hex(&bytes[first..]),
            "200000000000000029eda950\
             09000000000000f83f10032a130a110a0a747261696e2f6c6f73731500001040\
             7e61bfd1"
        );
        let name = w.path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents.1."), "{name}");
        let other = EventWriter::create(dir.path(), 1.5).unwrap();
        assert_ne!(other.path, w.path);
    }

    #[test]
    fn varints_take_seven_bits_a_byte() {
        let mut out = vec![];
        varint(&mut out, 300);
        varint(&mut out, u64::MAX);
        assert_eq!(hex(&out), "ac02ffffffffffffffffff01");
    }
}
