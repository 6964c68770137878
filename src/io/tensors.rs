//! Safetensors files of backend tensors: the dtype conversions shared by model import and
//! export, and exact save/load of named tensors for checkpoints.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use super::atomic::write_atomically;
use crate::backend::Backend;
use crate::tensor::{DType, Tensor};

/// A safetensors file mapped into memory.
pub struct MappedFile {
    map: Mmap,
}

impl MappedFile {
    pub fn open(path: &Path) -> Result<MappedFile> {
        let file = std::fs::File::open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?;
        // SAFETY: read-only map of a file we do not modify while it is open.
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("{}: cannot map", path.display()))?;
        Ok(MappedFile { map })
    }

    /// Parses the header; a truncated or corrupt file is reported with its name.
    pub fn tensors(&self, path: &Path) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.map).map_err(|e| {
            anyhow::anyhow!("{}: not a valid safetensors file, truncated or corrupt ({e}); write or download it again", path.display())
        })
    }
}

/// Decodes a stored tensor's values to f32 (f32, bf16 and f16 are read).
pub fn decode(view: &TensorView, file: &Path, name: &str) -> Result<Vec<f32>> {
    let data = view.data();
    let words = |n: usize| data.chunks_exact(n);
    Ok(match view.dtype() {
        Dtype::F32 => words(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect(),
        Dtype::BF16 => words(2)
            .map(|b| bf16::from_le_bytes(b.try_into().expect("2 bytes")).to_f32())
            .collect(),
        Dtype::F16 => words(2)
            .map(|b| f16::from_le_bytes(b.try_into().expect("2 bytes")).to_f32())
            .collect(),
        other => bail!(
            "{}: tensor `{name}` has dtype {other:?}; smelt reads F32, BF16 and F16",
            file.display()
        ),
    })
}

/// Encodes values as `dtype` bytes (round-to-nearest-even for narrower types).
pub fn encode(values: &[f32], dtype: DType) -> Result<(Dtype, Vec<u8>)> {
    Ok(match dtype {
        DType::F32 => (
            Dtype::F32,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        DType::BF16 => (
            Dtype::BF16,
            values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        ),
        DType::F16 => (
            Dtype::F16,
            values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
        ),
        other => {
            bail!("cannot store tensors as {other} in safetensors files; choose f32, bf16 or f16")
        }
    })
}

/// Writes `(name, dtype, shape, bytes)` entries atomically, with the metadata transformers expects.
pub fn write_file(path: &Path, entries: &[(String, Dtype, Vec<usize>, Vec<u8>)]) -> Result<()> {
    let views = entries
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            Ok((
                name.as_str(),
                TensorView::new(*dtype, shape.clone(), bytes)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_atomically(path, |tmp| {
        Ok(safetensors::serialize_to_file(views, Some(metadata), tmp)?)
    })
}

/// Tensors with the names they are saved under.
pub type Named<'a, B> = Vec<(String, &'a Tensor<B>)>;

/// Saves tensors exactly, each at its own dtype.
pub fn save<B: Backend>(b: &B, path: &Path, tensors: &[(String, &Tensor<B>)]) -> Result<()> {
    let entries = tensors
        .iter()
        .map(|(name, t)| {
            let (dtype, bytes) = encode(&b.download(t)?, t.dtype)?;
            Ok((name.clone(), dtype, t.shape.clone(), bytes))
        })
        .collect::<Result<Vec<_>>>()?;
    write_file(path, &entries)
}

/// Loads tensors saved by `save` into tensors of the same names, shapes and dtypes.
pub fn load<B: Backend>(b: &B, path: &Path, tensors: &[(String, &Tensor<B>)]) -> Result<()> {
    let file = MappedFile::open(path)?;
    let st = file.tensors(path)?;
    for (name, t) in tensors {
        let view = st
            .tensor(name)
            .map_err(|_| anyhow::anyhow!("{}: tensor `{name}` is missing", path.display()))?;
        if view.shape() != t.shape.as_slice() {
            bail!(
                "{}: tensor `{name}` has shape {:?}, expected {:?}",
                path.display(),
                view.shape(),
                t.shape
            );
        }
        let stored = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::BF16 => DType::BF16,
            Dtype::F16 => DType::F16,
            other => bail!(
                "{}: tensor `{name}` has unsupported dtype {other:?}",
                path.display()
            ),
        };
        if stored != t.dtype {
            bail!(
                "{}: tensor `{name}` is {stored}, expected {}",
                path.display(),
                t.dtype
            );
        }
        b.upload(t, &decode(&view, path, name)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryOps;
    use crate::backend::cpu::Cpu;
    use crate::tensor::TensorSpec;

    #[test]
    fn save_load_is_exact_and_checks_shapes() {
        let cpu = Cpu::<f32>::new();
        let specs = [
            TensorSpec::new("a", &[3, 2], DType::BF16),
            TensorSpec::new("b", &[5], DType::F32),
        ];
        let saved = cpu.allocate("test", &specs).unwrap();
        cpu.upload(&saved[0], &[0.1, -2.5, 3.3, 1e-3, 7.0, -0.0])
            .unwrap();
        cpu.upload(&saved[1], &[1.0 / 3.0, 2.0, f32::MIN_POSITIVE, -1e30, 5.5])
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        fn named(t: &[Tensor<Cpu>]) -> Vec<(String, &Tensor<Cpu>)> {
            vec![("a".to_string(), &t[0]), ("b".to_string(), &t[1])]
        }
        save(&cpu, &path, &named(&saved)).unwrap();

        let loaded = cpu.allocate("test", &specs).unwrap();
        load(&cpu, &path, &named(&loaded)).unwrap();
        for (a, b) in saved.iter().zip(&loaded) {
            let bits = |t| {
                cpu.download(t)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(a), bits(b));
        }
        let wrong = cpu
            .allocate("test", &[TensorSpec::new("a", &[2, 3], DType::BF16)])
            .unwrap();
        let err = load(&cpu, &path, &[("a".to_string(), &wrong[0])])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("t.safetensors: tensor `a` has shape [3, 2], expected [2, 3]"),
            "{err}"
        );
    }
}
