//! NVRTC: CUDA C sources to CUBIN for one exact architecture, cached on disk.
//!
//! NVRTC 13 ships no built-in headers, so the CUDA include directory is looked up here
//! (`CUDA_HOME`, `CUDA_PATH`, `/usr/local/cuda`, or the pip wheel's `nvidia/cu13`). Every
//! program gets `common.cuh` as an in-memory header. Kernels are C++ templates; each program
//! asks for the instantiations it needs as NVRTC name expressions, so a misspelt kernel name
//! fails the compile rather than a later lookup. The cache key covers the sources, the name
//! expressions, the architecture, the options and the NVRTC version.

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use cudarc::nvrtc::sys;

use super::disk_cache;

/// The header every kernel file includes as `"common.cuh"`.
const COMMON: &str = include_str!("kernels/common.cuh");

/// One kernel file and the NVRTC options it needs beyond the defaults.
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
    pub options: &'static [&'static str],
    /// Constants that both the kernels and their launchers depend on (tile sizes, threads
    /// per block), passed as `-DNAME=value`: the host's value is the only one, so the grid
    /// a launcher computes cannot drift from what the kernel assumes.
    pub defines: &'static [(&'static str, usize)],
}

/// A compiled program: the CUBIN and, for each requested name expression, its mangled name.
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub lowered: Vec<String>,
}

/// Fails with what to install when libnvrtc cannot be loaded.
pub fn ensure_available() -> Result<()> {
    // SAFETY: only tries to dlopen the library under its usual names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        bail!(
            "cannot load libnvrtc.so.13 or libnvrtc.so.12 (NVRTC, the CUDA runtime compiler): \
             install the CUDA 13 or 12 toolkit, or `pip install nvidia-cuda-nvrtc==13.0.88` (or \
             `nvidia-cuda-nvrtc-cu12`), and put its lib directory (e.g. /usr/local/cuda/lib64, \
             site-packages/nvidia/cu13/lib or site-packages/nvidia/cuda_nvrtc/lib) on \
             LD_LIBRARY_PATH"
        )
    }
}

/// `(major, minor)` of the loaded NVRTC.
pub fn version() -> Result<(i32, i32)> {
    ensure_available()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| anyhow::anyhow!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// The headers the kernels include, all in the CUDA include directory.
const HEADERS: [&str; 2] = ["cuda_bf16.h", "cuda_fp8.h"];

/// The CUDA major version of the headers in `dir`, from `cuda_runtime_api.h`'s
/// `CUDART_VERSION` (12090 for 12.9).
fn headers_major(dir: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(dir.join("cuda_runtime_api.h")).ok()?;
    let line = text
        .lines()
        .find(|l| l.starts_with("#define CUDART_VERSION"))?;
    let version: i32 = line.split_whitespace().nth(2)?.parse().ok()?;
    Some(version / 1000)
}

/// The directories holding `cuda_bf16.h` and `cuda_fp8.h` and CCCL's headers, which they
/// include, of the CUDA version of the loaded NVRTC (headers of another major version are
/// passed over: NVRTC 12 cannot compile CUDA 13's). Looked for in `CUDA_HOME`, `CUDA_PATH`
/// and /usr/local/cuda, then in the pip wheels: CUDA 13's `nvidia/cu13/include` (CCCL under
/// `cccl/`), CUDA 12's `nvidia/cuda_runtime/include` beside `nvidia/cuda_cccl/include`.
pub fn include_dirs() -> Result<Vec<PathBuf>> {
    let major = version()?.0;
    let mut candidates: Vec<(PathBuf, Option<PathBuf>)> = vec![];
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(dir) = std::env::var_os(var) {
            candidates.push((PathBuf::from(dir).join("include"), None));
        }
    }
    candidates.push((PathBuf::from("/usr/local/cuda/include"), None));
    let found = |candidates: &[(PathBuf, Option<PathBuf>)]| {
        candidates
            .iter()
            .find(|(d, _)| {
                HEADERS.iter().all(|h| d.join(h).is_file()) && headers_major(d) == Some(major)
            })
            .map(|(dir, cccl)| {
                let mut dirs = vec![dir.clone()];
                // CUDA 13 moved CCCL (`nv/target`, `cuda/std`) under include/cccl.
                if dir.join("cccl").is_dir() {
                    dirs.push(dir.join("cccl"));
                }
                dirs.extend(cccl.clone());
                dirs
            })
    };
    if let Some(dirs) = found(&candidates) {
        return Ok(dirs);
    }
    // Only then ask python where pip put the wheels.
    for site in python_site_dirs() {
        let nvidia = site.join("nvidia");
        candidates.push((nvidia.join("cu13/include"), None));
        candidates.push((
            nvidia.join("cuda_runtime/include"),
            Some(nvidia.join("cuda_cccl/include")),
        ));
    }
    if let Some(dirs) = found(&candidates) {
        return Ok(dirs);
    }
    let wheels = match major {
        12 => "`pip install nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12`",
        _ => "`pip install nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85`",
    };
    bail!(
        "no CUDA {major} include directory with {} found (NVRTC {major} needs its own \
         version's headers); looked in: {}. Set CUDA_HOME to a CUDA {major} toolkit, or {wheels}",
        HEADERS.join(" and "),
        candidates
            .iter()
            .map(|(p, _)| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// `PYTHONPATH` entries and the site-packages of `python3`, where pip puts the CUDA wheels.
fn python_site_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PYTHONPATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let script = "import site,sys;print('\\n'.join(site.getsitepackages()+[site.getusersitepackages()]+sys.path))";
    if let Ok(out) = Command::new("python3").args(["-c", script]).output() {
        dirs.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| !l.is_empty())
                .map(PathBuf::from),
        );
    }
    dirs
}

/// Where compiled kernels are kept: `$SMELT_KERNEL_CACHE`, else `$XDG_CACHE_HOME/smelt/kernels`,
/// else `~/.cache/smelt/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    disk_cache::dir("SMELT_KERNEL_CACHE", "kernels")
}

fn options(source: &Source, arch: &str, include: &[PathBuf]) -> Vec<String> {
    let mut opts = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    opts.extend(include.iter().map(|d| format!("-I{}", d.display())));
    opts.extend(source.options.iter().map(|o| o.to_string()));
    opts.extend(
        source
            .defines
            .iter()
            .map(|(name, v)| format!("-D{name}={v}")),
    );
    opts
}

/// Compiles `names` (template instantiations such as `fill<bf16>`) from `source` for `arch`,
/// reusing the disk cache when it holds this exact program.
pub fn compile_cached(
    source: &Source, names: &[String], arch: &str, include: &[PathBuf],
) -> Result<Compiled> {
    let (major, minor) = version()?;
    let opts = options(source, arch, include).join(" ");
    let version = format!("{major}.{minor}");
    let mut parts = vec![source.name, source.text, COMMON, arch, &opts, &version];
    parts.extend(names.iter().map(String::as_str));
    let key = disk_cache::key(&parts);
    let dir = cache_dir();
    if let Some(dir) = &dir
        && let Some(hit) = read_cache(dir, &key, names.len())
    {
        return Ok(hit);
    }
    let compiled = compile(source, names, arch, include)?;
    if let Some(dir) = &dir {
        // A cache that cannot be written only costs a recompile next time.
        let _ = write_cache(dir, &key, &compiled);
    }
    Ok(compiled)
}

fn read_cache(dir: &Path, key: &str, count: usize) -> Option<Compiled> {
    let names = std::fs::read_to_string(dir.join(format!("{key}.names"))).ok()?;
    let lowered: Vec<String> = names.lines().map(str::to_string).collect();
    let cubin = std::fs::read(dir.join(format!("{key}.cubin"))).ok()?;
    (lowered.len() == count && !cubin.is_empty()).then_some(Compiled { cubin, lowered })
}

/// Writes the CUBIN, then the names file: `read_cache` takes an entry only when its names
/// file exists, and the names file appears only after the CUBIN is complete (each is written
/// whole by a rename), so a half-written entry is never taken.
fn write_cache(dir: &Path, key: &str, compiled: &Compiled) -> Result<()> {
    disk_cache::write(dir, &format!("{key}.cubin"), &compiled.cubin)?;
    disk_cache::write(
        dir,
        &format!("{key}.names"),
        compiled.lowered.join("\n").as_bytes(),
    )
}

/// Compiles without the cache. Errors carry NVRTC's log and the options used.
pub fn compile(
    source: &Source, names: &[String], arch: &str, include: &[PathBuf],
) -> Result<Compiled> {
    ensure_available()?;
    let opts = options(source, arch, include);
    let program = Program::new(source)?;
    let c_names: Vec<CString> = names
        .iter()
        .map(|n| CString::new(n.as_str()))
        .collect::<Result<_, _>>()?;
    for name in &c_names {
        // SAFETY: a live program and a NUL-terminated string.
        check(
            unsafe { sys::nvrtcAddNameExpression(program.0, name.as_ptr()) },
            "nvrtcAddNameExpression",
        )?;
    }
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<Result<_, _>>()?;
    let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: a live program and `opt_ptrs.len()` valid C strings.
    let status =
        unsafe { sys::nvrtcCompileProgram(program.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    if status != sys::nvrtcResult::NVRTC_SUCCESS {
        bail!(
            "NVRTC failed to compile {} for {arch} ({status:?})\noptions: {}\nkernels: {}\nlog:\n{}",
            source.name,
            opts.join(" "),
            names.join(", "),
            program.log()
        );
    }
    let mut size = 0usize;
    // SAFETY: a compiled program and a valid out-pointer.
    check(
        unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) },
        "nvrtcGetCUBINSize",
    )?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the size NVRTC asked for.
    check(
        unsafe { sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr() as *mut c_char) },
        "nvrtcGetCUBIN",
    )?;
    let mut lowered = Vec::with_capacity(names.len());
    for (name, c_name) in names.iter().zip(&c_names) {
        let mut ptr: *const c_char = std::ptr::null();
        // SAFETY: the name was added before compiling; NVRTC owns the returned string until
        // the program is destroyed, and it is copied out before that.
        check(
            unsafe { sys::nvrtcGetLoweredName(program.0, c_name.as_ptr(), &mut ptr) },
            "nvrtcGetLoweredName",
        )
        .with_context(|| format!("kernel {name} in {}", source.name))?;
        // SAFETY: NVRTC returned a NUL-terminated string.
        lowered.push(
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned(),
        );
    }
    Ok(Compiled { cubin, lowered })
}

fn check(status: sys::nvrtcResult, call: &str) -> Result<()> {
    if status == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        bail!("{call} failed: {status:?}")
    }
}

/// An NVRTC program that destroys itself on drop. It keeps the C strings it was made from,
/// which NVRTC may reference until then.
struct Program(sys::nvrtcProgram, #[allow(dead_code)] [CString; 4]);

impl Program {
    fn new(source: &Source) -> Result<Self> {
        let strings = [
            CString::new(source.text)?,
            CString::new(source.name)?,
            CString::new(COMMON)?,
            CString::new("common.cuh")?,
        ];
        let headers = [strings[2].as_ptr()];
        let include_names = [strings[3].as_ptr()];
        let mut prog = std::mem::MaybeUninit::uninit();
        // SAFETY: every pointer is a live C string kept in `strings`, which the program owns.
        check(
            unsafe {
                sys::nvrtcCreateProgram(
                    prog.as_mut_ptr(),
                    strings[0].as_ptr(),
                    strings[1].as_ptr(),
                    1,
                    headers.as_ptr(),
                    include_names.as_ptr(),
                )
            },
            "nvrtcCreateProgram",
        )?;
        // SAFETY: nvrtcCreateProgram succeeded and wrote the handle.
        Ok(Program(unsafe { prog.assume_init() }, strings))
    }

    fn log(&self) -> String {
        let mut size = 0usize;
        // SAFETY: a live program and valid out-pointers sized by NVRTC.
        unsafe {
            if sys::nvrtcGetProgramLogSize(self.0, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS {
                return "(no log)".into();
            }
            let mut log = vec![0u8; size];
            if sys::nvrtcGetProgramLog(self.0, log.as_mut_ptr() as *mut c_char)
                != sys::nvrtcResult::NVRTC_SUCCESS
            {
                return "(no log)".into();
            }
            String::from_utf8_lossy(&log)
                .trim_end_matches('\0')
                .to_string()
        }
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed once.
        unsafe {
            sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}
