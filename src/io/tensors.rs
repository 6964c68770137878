//! Safetensors files of backend tensors: the dtype conversions shared by model import and
//! export, and exact save/load of named tensors for checkpoints.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo, TensorView};
use safetensors::{Dtype, SafeTensors};

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

/// Decodes a stored tensor's values to f32 (f32, bf16 and f16 are read). A value that is
/// not finite, which no weight or optimizer state should hold, is refused: the file is
/// corrupt, or was saved from a run that diverged.
pub fn decode(view: &TensorView, file: &Path, name: &str) -> Result<Vec<f32>> {
    let values = decode_values(view, file, name)?;
    if let Err(found) = check_finite(name, &values) {
        bail!(
            "{}: {found}: the file is corrupt, or was saved from a run that diverged; write or download it again",
            file.display()
        );
    }
    Ok(values)
}

fn decode_values(view: &TensorView, file: &Path, name: &str) -> Result<Vec<f32>> {
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
        // Codes are whole numbers in 0..=255; `as` saturates anything else.
        DType::Q8 => (
            Dtype::U8,
            values.iter().map(|&v| v.round_ties_even() as u8).collect(),
        ),
        other => {
            bail!("cannot store tensors as {other} in safetensors files; choose f32, bf16 or f16")
        }
    })
}

/// Writes `(name, dtype, shape, bytes)` entries atomically, with the metadata transformers
/// expects, in `safetensors::serialize`'s layout (tensors by descending alignment, then by
/// name, after a JSON header padded with spaces to 8 bytes), streamed into a file made as
/// every other output is (`write_atomically`).
pub fn write_file(path: &Path, entries: &[(String, Dtype, Vec<usize>, Vec<u8>)]) -> Result<()> {
    let mut order: Vec<&(String, Dtype, Vec<usize>, Vec<u8>)> = entries.iter().collect();
    order.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut offset = 0;
    let infos = order
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let info = TensorInfo {
                dtype: *dtype,
                shape: shape.clone(),
                data_offsets: (offset, offset + bytes.len()),
            };
            offset += bytes.len();
            (name.clone(), info)
        })
        .collect();
    let format = HashMap::from([("format".to_string(), "pt".to_string())]);
    // Checks that each tensor's bytes are its shape's.
    let metadata = Metadata::new(Some(format), infos)
        .with_context(|| format!("{}: inconsistent tensors to write", path.display()))?;
    let mut header = serde_json::to_vec(&metadata)?;
    header.resize(header.len().next_multiple_of(8), b' ');
    write_atomically(path, |tmp| {
        let mut out = BufWriter::with_capacity(1 << 20, File::create(tmp)?);
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        for (_, _, _, bytes) in order {
            out.write_all(bytes)?;
        }
        out.into_inner().map_err(|e| e.into_error())?;
        Ok(())
    })
}

/// Tensors with the names they are saved under.
pub type Named<'a, B> = Vec<(String, &'a Tensor<B>)>;

/// A value that is not finite, found in tensor `tensor` (saving or loading it).
#[derive(Debug, thiserror::Error)]
#[error("tensor `{tensor}` holds {value} (element {index})")]
pub struct NonFinite {
    pub tensor: String,
    pub index: usize,
    pub value: f32,
}

/// `Err(NonFinite)` at the first value of `values` that is NaN or infinite.
pub fn check_finite(name: &str, values: &[f32]) -> Result<(), NonFinite> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(index) => Err(NonFinite {
            tensor: name.to_string(),
            index,
            value: values[index],
        }),
    }
}

/// Saves tensors exactly, each at its own dtype. Refuses (`NonFinite`) a tensor holding NaN
/// or infinity, which no training state should, before anything is written.
pub fn save<B: Backend>(b: &B, path: &Path, tensors: &[(String, &Tensor<B>)]) -> Result<()> {
    let entries = tensors
        .iter()
        .map(|(name, t)| {
            let values = b.download(t)?;
            check_finite(name, &values)?;
            let (dtype, bytes) = encode(&values, t.dtype)?;
            Ok((name.clone(), dtype, t.shape.clone(), bytes))
        })
        .collect::<Result<Vec<_>>>()?;
    write_file(path, &entries)
}

/// The stored tensor `name` of `st`, checked to have `t`'s shape and dtype.
fn stored<'a, B: Backend>(
    st: &SafeTensors<'a>, path: &Path, name: &str, t: &Tensor<B>,
) -> Result<TensorView<'a>> {
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
        Dtype::U8 => DType::Q8,
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
    Ok(view)
}

/// Loads tensors saved by `save` into tensors of the same names, shapes and dtypes; a value
/// that is not finite is refused (`decode`).
pub fn load<B: Backend>(b: &B, path: &Path, tensors: &[(String, &Tensor<B>)]) -> Result<()> {
    TensorFiles::open(&[path.to_path_buf()])?.load(b, tensors)
}

/// Named tensors saved by `save` across several files, each tensor in one of them: a
/// checkpoint's optimizer state, of which each rank of a sharded run wrote its own share.
pub struct TensorFiles {
    files: Vec<(PathBuf, MappedFile)>,
    /// The index in `files` of the file holding each tensor.
    holder: BTreeMap<String, usize>,
}

impl TensorFiles {
    /// Opens `paths` and reads which tensors each holds; a tensor held by two of them is
    /// refused, naming both.
    pub fn open(paths: &[PathBuf]) -> Result<TensorFiles> {
        let mut files = Vec::with_capacity(paths.len());
        let mut holder = BTreeMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = MappedFile::open(path)?;
            for name in file.tensors(path)?.names() {
                if let Some(j) = holder.insert(name.to_string(), i) {
                    bail!(
                        "tensor `{name}` is in both {} and {}",
                        paths[j].display(),
                        path.display()
                    );
                }
            }
            files.push((path.clone(), file));
        }
        Ok(TensorFiles { files, holder })
    }

    /// Refuses unless the files hold exactly the tensors `names`: each of them (once, as
    /// `open` checked), and no other.
    pub fn check_names(&self, names: &[&str]) -> Result<()> {
        if let Some(name) = names.iter().find(|n| !self.holder.contains_key(**n)) {
            return Err(self.missing(name));
        }
        let wanted: BTreeSet<&str> = names.iter().copied().collect();
        match (self.holder.iter()).find(|(name, _)| !wanted.contains(name.as_str())) {
            Some((name, &i)) => bail!(
                "{}: holds tensor `{name}`, which is not expected there",
                self.files[i].0.display()
            ),
            None => Ok(()),
        }
    }

    fn missing(&self, name: &str) -> anyhow::Error {
        match self.files.as_slice() {
            [(path, _)] => anyhow!("{}: tensor `{name}` is missing", path.display()),
            files => {
                let paths: Vec<String> = files.iter().map(|f| f.0.display().to_string()).collect();
                anyhow!("tensor `{name}` is in none of {}", paths.join(", "))
            }
        }
    }

    /// Loads each of `tensors` from the file holding it, which must give it the same shape
    /// and dtype; a value that is not finite is refused (`decode`).
    pub fn load<B: Backend>(&self, b: &B, tensors: &[(String, &Tensor<B>)]) -> Result<()> {
        let parsed = (self.files.iter())
            .map(|(path, file)| file.tensors(path))
            .collect::<Result<Vec<_>>>()?;
        for (name, t) in tensors {
            let &i = self.holder.get(name).ok_or_else(|| self.missing(name))?;
            let path = &self.files[i].0;
            let view = stored(&parsed[i], path, name, t)?;
            let values = match view.dtype() {
                // The codes of 8-bit Adam moments, which `stored` found a Q8 tensor for.
                Dtype::U8 => view.data().iter().map(|&c| f32::from(c)).collect(),
                _ => decode(&view, path, name)?,
            };
            b.upload(t, &values)?;
        }
        Ok(())
    }
}

/// Checks, without reading the values, that the file `save` wrote at `path` is whole (as long
/// as its header says) and holds exactly `tensors`, each with its shape and dtype.
pub fn verify<B: Backend>(path: &Path, tensors: &[(String, &Tensor<B>)]) -> Result<()> {
    let file = MappedFile::open(path)?;
    let st = file.tensors(path)?;
    if st.len() != tensors.len() {
        bail!(
            "{}: holds {} tensors, not the {} written",
            path.display(),
            st.len(),
            tensors.len()
        );
    }
    for (name, t) in tensors {
        stored(&st, path, name, t)?;
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

    /// A set split over files loads from whichever holds each tensor, and a tensor in two
    /// files, in none, or not asked for is refused with the file named.
    #[test]
    fn tensor_files_find_each_tensor_in_the_file_holding_it() {
        let cpu = Cpu::<f32>::new();
        let specs = [
            TensorSpec::new("a", &[2], DType::F32),
            TensorSpec::new("b", &[3], DType::BF16),
        ];
        let saved = cpu.allocate("test", &specs).unwrap();
        cpu.upload(&saved[0], &[1.5, -2.0]).unwrap();
        cpu.upload(&saved[1], &[0.25, 4.0, -8.0]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| dir.path().join(name);
        let one = |i: usize| vec![(specs[i].name.clone(), &saved[i])];
        save(&cpu, &path("0.safetensors"), &one(0)).unwrap();
        save(&cpu, &path("1.safetensors"), &one(1)).unwrap();
        save(&cpu, &path("again.safetensors"), &one(1)).unwrap();

        let files = TensorFiles::open(&[path("1.safetensors"), path("0.safetensors")]).unwrap();
        files.check_names(&["a", "b"]).unwrap();
        let loaded = cpu.allocate("test", &specs).unwrap();
        let named: Vec<(String, &Tensor<Cpu>)> = (specs.iter().zip(&loaded))
            .map(|(s, t)| (s.name.clone(), t))
            .collect();
        files.load(&cpu, &named).unwrap();
        for (a, b) in saved.iter().zip(&loaded) {
            assert_eq!(cpu.download(a).unwrap(), cpu.download(b).unwrap());
        }

        let err = |r: Result<()>| format!("{:#}", r.unwrap_err());
        let twice = [
            path("0.safetensors"),
            path("1.safetensors"),
            path("again.safetensors"),
        ];
        let e = err(TensorFiles::open(&twice).map(drop));
        assert!(
            e.contains("tensor `b` is in both") && e.contains("again.safetensors"),
            "{e}"
        );
        let e = err(files.check_names(&["a", "b", "c"]));
        assert!(
            e.contains("tensor `c` is in none of") && e.contains("0.safetensors"),
            "{e}"
        );
        let e = err(files.check_names(&["a"]));
        assert!(
            e.contains("1.safetensors: holds tensor `b`, which is not expected there"),
            "{e}"
        );
        let single = TensorFiles::open(&[path("0.safetensors")]).unwrap();
        let e = err(single.check_names(&["a", "b"]));
        assert!(e.contains("0.safetensors: tensor `b` is missing"), "{e}");
    }

    #[test]
    fn write_file_writes_what_safetensors_serializes() {
        let entries = vec![
            (
                "b".to_string(),
                Dtype::BF16,
                vec![3],
                vec![1, 2, 3, 4, 5, 6],
            ),
            ("a".to_string(), Dtype::BF16, vec![1], vec![7, 8]),
            ("c".to_string(), Dtype::F32, vec![2], (0..8).collect()),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        write_file(&path, &entries).unwrap();
        let views = entries
            .iter()
            .map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()));
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        let expected = safetensors::serialize(views, Some(metadata)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), expected);
        // Bytes that are not the shape's are refused, and nothing is written.
        let wrong = [("x".to_string(), Dtype::F32, vec![2], vec![0; 4])];
        let other = dir.path().join("wrong.safetensors");
        assert!(write_file(&other, &wrong).is_err());
        assert!(!other.exists());
    }

    #[test]
    fn non_finite_values_are_neither_saved_nor_loaded() {
        let cpu = Cpu::<f32>::new();
        let spec = [TensorSpec::new("w", &[4], DType::F32)];
        let t = cpu.allocate("test", &spec).unwrap();
        cpu.upload(&t[0], &[1.0, 2.0, f32::INFINITY, 0.0]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let named = [("w".to_string(), &t[0])];
        let err = save(&cpu, &path, &named).unwrap_err();
        assert_eq!(err.to_string(), "tensor `w` holds inf (element 2)");
        assert!(err.downcast_ref::<NonFinite>().is_some());
        assert!(!path.exists());
        // A file holding NaN, written by other means, is refused on loading.
        let nan: Vec<u8> = [1.0f32, f32::NAN, 0.0, 0.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        write_file(&path, &[("w".to_string(), Dtype::F32, vec![4], nan)]).unwrap();
        let err = format!("{:#}", load(&cpu, &path, &named).unwrap_err());
        assert!(
            err.contains("t.safetensors: tensor `w` holds NaN (element 1): the file is corrupt"),
            "{err}"
        );
    }
}
