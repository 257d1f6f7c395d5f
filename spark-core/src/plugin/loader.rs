//! The host side of the C ABI: find plugin libraries, load them (checking the ABI version before
//! anything else), run them as ordinary [`Executor`]s, and choose a backend among the statically
//! linked ones and the plugins on the search path.
//!
//! Search path, in order: the `--plugin-dir`s given, `SPARK_PLUGIN_PATH` (colon-separated), the
//! executable's directory, and `../lib` beside it. A backend named `NAME` lives in
//! `libspark_backend_NAME.so` (`.dylib` on macOS, `spark_backend_NAME.dll` on Windows).
//!
//! Libraries are loaded lazily (only when a backend is asked for by name or path, or when `auto`
//! and the listing need to probe them) and never unloaded: each loaded [`Plugin`] stays in a
//! process-wide registry, and every [`PluginExecutor`] holds an `Arc` to its plugin, so code is
//! never unmapped while an executor from it exists.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::abi::*;
use super::{dtype_code, dtype_from_code, BackendFactory, DeviceInfo, OpenOptions};
use crate::backend::{logits_rows, Executor, ExecutorInfo, SeqStep};
use crate::error::{Error, ErrorKind, Result};

/// Backend names spark knows of, listed by `spark-run backends` even when absent.
pub const KNOWN_BACKENDS: [&str; 4] = ["cpu", "cuda", "wgpu", "qnn"];

/// Environment variable with extra plugin directories (colon-separated).
pub const PLUGIN_PATH_ENV: &str = "SPARK_PLUGIN_PATH";

/// The file name of backend `name`'s plugin on this platform (`libspark_backend_cpu.so`).
pub fn plugin_file_name(name: &str) -> String {
    format!("{}spark_backend_{name}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX)
}

/// The backend name in a plugin file name, if it follows the `libspark_backend_NAME.so` pattern.
pub fn backend_name_of_file(file: &str) -> Option<&str> {
    let prefix = format!("{}spark_backend_", std::env::consts::DLL_PREFIX);
    let name = file.strip_prefix(&prefix)?.strip_suffix(std::env::consts::DLL_SUFFIX)?;
    (!name.is_empty()).then_some(name)
}

/// A loaded plugin library whose ABI version matched.
pub struct Plugin {
    path: PathBuf,
    name: String,
    abi_version: u32,
    table: *const SparkBackendV1,
    /// Kept (and never dropped while reachable) so that `table` and its code stay mapped.
    _lib: libloading::Library,
}

// SAFETY: the table is immutable and stays valid while `_lib` is loaded, which is as long as the
// `Plugin` lives. The ABI requires every entry point to be callable from any thread, with only
// calls on one executor handle serialized — which `PluginExecutor` (`&mut self`) guarantees.
unsafe impl Send for Plugin {}
// SAFETY: as for `Send`: shared access only reads the immutable table.
unsafe impl Sync for Plugin {}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin").field("name", &self.name).field("path", &self.path).finish()
    }
}

/// Every plugin loaded so far, never emptied: libraries stay loaded for the life of the process.
static LOADED: Mutex<Vec<Arc<Plugin>>> = Mutex::new(Vec::new());

/// Load the plugin at `path` (once per canonical path), checking its ABI version before calling
/// anything else in it.
pub fn load_plugin(path: &Path) -> Result<Arc<Plugin>> {
    let meta = std::fs::metadata(path)
        .map_err(|e| Error::new(ErrorKind::Io, format!("backend plugin {}: {e}", path.display())))?;
    if !meta.is_file() {
        return Err(Error::invalid(format!("backend plugin {} is not a file", path.display())));
    }
    let canon = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = loaded.iter().find(|p| p.path == canon) {
        return Ok(p.clone());
    }
    let plugin = Arc::new(open_library(path, canon)?);
    loaded.push(plugin.clone());
    Ok(plugin)
}

fn open_library(shown: &Path, canon: PathBuf) -> Result<Plugin> {
    let fail = |msg: String| Error::new(ErrorKind::Backend, msg);
    // SAFETY: loading a library runs its initialisers; choosing to load a file from the plugin
    // path (or named by the user) is choosing to trust it, as with any dynamic library.
    let lib = unsafe { libloading::Library::new(&canon) }.map_err(|e| {
        fail(format!(
            "cannot load backend plugin {}: {e} (is it a shared library built for this platform?)",
            shown.display()
        ))
    })?;
    let generic = String::from_utf8_lossy(&ENTRY_SYMBOL[..ENTRY_SYMBOL.len() - 1]).into_owned();
    // `libspark_backend_<name>.so` may export the named entry `spark_backend_v1_<name>` (so that
    // several backends can also be linked into one program), else the generic one.
    let named = shown
        .file_name()
        .and_then(|f| f.to_str())
        .and_then(backend_name_of_file)
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .map(|n| format!("{generic}_{n}"));
    let mut sym = generic.clone();
    // SAFETY: both entry symbols are documented to have type `EntryFn`; a library that exports
    // one with another type breaks the plugin contract, which we cannot check further.
    let entry = match named.as_deref().and_then(|n| unsafe { lib.get::<EntryFn>(format!("{n}\0").as_bytes()) }.ok()) {
        Some(e) => {
            sym = named.clone().unwrap_or_default();
            e
        }
        // SAFETY: as above.
        None => unsafe { lib.get::<EntryFn>(ENTRY_SYMBOL) }.map_err(|e| {
            let also = named.as_deref().map(|n| format!(" nor {n}")).unwrap_or_default();
            fail(format!("{} is not a spark backend plugin: no symbol {generic}{also} ({e})", shown.display()))
        })?,
    };
    // SAFETY: calling the entry point as documented: no arguments, returns a pointer to a
    // static table (or null).
    let table = unsafe { entry() };
    if table.is_null() {
        return Err(fail(format!("{}: {sym}() returned a null table", shown.display())));
    }
    // SAFETY: every ABI version starts the table with the `u32` version, so reading it is valid
    // whatever version the plugin speaks; nothing else is read before it matches.
    let abi_version = unsafe { table.cast::<u32>().read() };
    if abi_version != ABI_VERSION {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "backend plugin {} speaks ABI version {abi_version}, but this spark speaks ABI version {ABI_VERSION}: rebuild the plugin against this spark",
                shown.display()
            ),
        ));
    }
    // SAFETY: the version matched, so `table` points to a `SparkBackendV1` that lives as long as
    // the library (the ABI's contract).
    let t = unsafe { &*table };
    let want = std::mem::size_of::<SparkBackendV1>();
    if (t.table_size as usize) < want {
        return Err(fail(format!(
            "backend plugin {}: its ABI {ABI_VERSION} table is {} bytes, expected {want}",
            shown.display(),
            t.table_size
        )));
    }
    let name = if t.name.is_null() {
        return Err(fail(format!("backend plugin {}: its table has no name", shown.display())));
    } else {
        // SAFETY: non-null and, per the ABI, a static NUL-terminated string.
        unsafe { CStr::from_ptr(t.name) }.to_string_lossy().into_owned()
    };
    Ok(Plugin { path: canon, name, abi_version, table, _lib: lib })
}

/// What a status code means on the Rust side.
fn kind_of(code: i32) -> ErrorKind {
    match code {
        SPARK_ERR_INVALID_INPUT => ErrorKind::InvalidInput,
        SPARK_ERR_BAD_MODEL => ErrorKind::BadModel,
        SPARK_ERR_OUT_OF_MEMORY => ErrorKind::OutOfMemory,
        SPARK_ERR_UNSUPPORTED => ErrorKind::Unsupported,
        SPARK_ERR_IO => ErrorKind::Io,
        SPARK_ERR_BACKEND => ErrorKind::Backend,
        _ => ErrorKind::Internal,
    }
}

impl Plugin {
    /// The backend name the plugin reports.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The library file (canonical path).
    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn abi_version(&self) -> u32 {
        self.abi_version
    }

    fn table(&self) -> &SparkBackendV1 {
        // SAFETY: checked non-null and of the right version and size at load; valid while the
        // library (`self._lib`) is loaded, i.e. at least as long as `self`.
        unsafe { &*self.table }
    }

    /// The calling thread's last error message in this library.
    fn last_error(&self) -> String {
        // SAFETY: `last_error` takes nothing and returns null or a NUL-terminated string valid
        // until the next call into the library from this thread; it is copied at once.
        unsafe {
            let p = (self.table().last_error)();
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }

    /// `Ok` for [`SPARK_OK`], else the error with the plugin's message.
    fn check(&self, what: &str, code: i32) -> Result<()> {
        if code == SPARK_OK {
            return Ok(());
        }
        let mut msg = self.last_error();
        if msg.is_empty() {
            msg = format!("{what} failed with status {code} and no message");
        }
        if code == SPARK_ERR_PANIC {
            msg = format!("backend plugin {}: {msg}", self.path.display());
        }
        Err(Error::new(kind_of(code), msg))
    }

    /// The devices the backend sees.
    pub fn probe(&self) -> Result<Vec<DeviceInfo>> {
        let mut cap = 8u32;
        loop {
            let mut buf = vec![SparkDeviceInfo::zeroed(); cap as usize];
            let mut count = 0u32;
            // SAFETY: `buf` holds `cap` records and `count` one `u32`, both writable.
            let code = unsafe { (self.table().probe)(buf.as_mut_ptr(), cap, &mut count) };
            self.check("probe", code)?;
            if count <= cap {
                return Ok(buf[..count as usize].iter().map(DeviceInfo::from_c).collect());
            }
            cap = count;
        }
    }

    /// Open the checkpoint directory `model` on this backend.
    pub fn open(self: &Arc<Self>, model: &Path, opts: &OpenOptions) -> Result<PluginExecutor> {
        let path = path_to_cstring(model)?;
        if let Some(q) = opts.quant {
            return Err(Error::unsupported(format!(
                "quantizing at load ({}) is not available through a plugin (ABI v1 has no field for it); \
                 write a quantized checkpoint with `spark-run quantize` and load that",
                q.format
            )));
        }
        let to_u32 = |v: Option<usize>, what: &str| {
            u32::try_from(v.unwrap_or(0)).map_err(|_| Error::invalid(format!("{what} {} is too large", v.unwrap_or(0))))
        };
        let o = SparkOpenOptions {
            threads: to_u32(opts.threads, "thread count")?,
            ctx_size: to_u32(opts.ctx, "context size")?,
            dtype: dtype_code(opts.dtype),
            device: opts.device,
        };
        let mut h: *mut SparkExecutor = std::ptr::null_mut();
        // SAFETY: `path` is NUL-terminated, `o` a valid options record and `h` writable; all
        // outlive the call.
        let code = unsafe { (self.table().open)(path.as_ptr(), &o, &mut h) };
        self.check("open", code)?;
        if h.is_null() {
            return Err(Error::internal(format!(
                "backend plugin {}: open succeeded but returned no handle",
                self.path.display()
            )));
        }
        let mut exec = PluginExecutor {
            plugin: self.clone(),
            handle: h,
            info: ExecutorInfo { backend: self.name.clone(), vocab: 0, ctx: 0, dtype: crate::DType::F32 },
            steps: Vec::new(),
        };
        let mut ci = SparkExecInfo::default();
        // SAFETY: `h` is the open handle we own; `ci` is writable.
        let code = unsafe { (self.table().info)(h, &mut ci) };
        self.check("info", code)?; // on error, dropping `exec` closes the handle
        let dtype = match dtype_from_code(ci.dtype) {
            Ok(Some(d)) => d,
            _ => {
                return Err(Error::internal(format!(
                    "backend plugin {}: info reported an unknown dtype code {}",
                    self.path.display(),
                    ci.dtype
                )))
            }
        };
        exec.info.vocab = usize::try_from(ci.vocab).map_err(|_| Error::internal("vocab does not fit usize"))?;
        exec.info.ctx = usize::try_from(ci.ctx).map_err(|_| Error::internal("ctx does not fit usize"))?;
        exec.info.dtype = dtype;
        Ok(exec)
    }
}

#[cfg(unix)]
fn path_to_cstring(p: &Path) -> Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| Error::invalid(format!("model path {} contains a NUL byte", p.display())))
}

#[cfg(not(unix))]
fn path_to_cstring(p: &Path) -> Result<CString> {
    let s = p.to_str().ok_or_else(|| Error::invalid(format!("model path {} is not UTF-8", p.display())))?;
    CString::new(s).map_err(|_| Error::invalid(format!("model path {} contains a NUL byte", p.display())))
}

/// An [`Executor`] running in a plugin: each call is one call through the C table.
pub struct PluginExecutor {
    /// Keeps the library loaded while the handle exists.
    plugin: Arc<Plugin>,
    handle: *mut SparkExecutor,
    info: ExecutorInfo,
    /// Scratch for the C form of a batch.
    steps: Vec<SparkSeqStep>,
}

// SAFETY: the handle is owned exclusively by this value and only used through `&mut self` (or
// `&self` for read-only queries, never concurrently with `&mut` uses), so moving it to another
// thread is sound; the ABI allows calls on a handle from any thread as long as they are not
// concurrent. `steps` holds pointers only during a `forward` call.
unsafe impl Send for PluginExecutor {}

impl PluginExecutor {
    /// The plugin this executor runs in.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }
}

impl Executor for PluginExecutor {
    fn info(&self) -> ExecutorInfo {
        self.info.clone()
    }

    fn forward(&mut self, batch: &[SeqStep<'_>], out: &mut [f32]) -> Result<()> {
        let want = logits_rows(batch) * self.info.vocab;
        if out.len() != want {
            return Err(Error::invalid(format!(
                "forward: the logits buffer holds {} floats, the batch needs {want}",
                out.len()
            )));
        }
        self.steps.clear();
        self.steps.extend(batch.iter().map(|s| SparkSeqStep {
            seq_id: s.seq_id,
            tokens: s.tokens.as_ptr(),
            n_tokens: s.tokens.len(),
            start_pos: s.start_pos,
            logits: s.logits as u32,
        }));
        // SAFETY: `handle` is open and used only here (`&mut self`); `steps` and each step's
        // tokens are valid for reading and `out` for writing `out.len()` floats for the whole
        // call; they do not overlap.
        let code = unsafe {
            (self.plugin.table().forward)(
                self.handle,
                self.steps.as_ptr(),
                self.steps.len(),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        self.steps.clear();
        self.plugin.check("forward", code)
    }

    fn release(&mut self, seq_id: u64) {
        // SAFETY: `handle` is open and used only here.
        let code = unsafe { (self.plugin.table().release)(self.handle, seq_id) };
        // `release` has no way to report: a failure (a poisoned handle) shows on the next call.
        let _ = self.plugin.check("release", code);
    }

    fn fork(&mut self, src: u64, dst: u64) -> Result<()> {
        // SAFETY: `handle` is open and used only here.
        let code = unsafe { (self.plugin.table().fork)(self.handle, src, dst) };
        self.plugin.check("fork", code)
    }

    fn seq_len(&self, seq_id: u64) -> Option<usize> {
        let mut n = -1i64;
        // SAFETY: `handle` is open; `n` is writable; no `&mut` use runs concurrently (`&self`).
        let code = unsafe { (self.plugin.table().seq_len)(self.handle, seq_id, &mut n) };
        self.plugin.check("seq_len", code).ok()?;
        usize::try_from(n).ok()
    }

    fn kv_bytes(&self) -> usize {
        let mut n = 0u64;
        // SAFETY: `handle` is open; `n` is writable; no `&mut` use runs concurrently (`&self`).
        let code = unsafe { (self.plugin.table().kv_bytes)(self.handle, &mut n) };
        self.plugin.check("kv_bytes", code).map_or(0, |()| n as usize)
    }
}

impl Drop for PluginExecutor {
    fn drop(&mut self) {
        // SAFETY: `handle` came from `open`, is closed exactly once, here, and not used after.
        unsafe { (self.plugin.table().close)(self.handle) };
    }
}

/// Where plugins are looked for.
#[derive(Debug, Clone, Default)]
pub struct SearchPath {
    pub dirs: Vec<PathBuf>,
}

impl SearchPath {
    /// `extra` (e.g. `--plugin-dir`s), then `SPARK_PLUGIN_PATH`, the executable's directory and
    /// `../lib` beside it, without duplicates.
    pub fn new(extra: &[PathBuf]) -> Self {
        let mut dirs: Vec<PathBuf> = extra.to_vec();
        if let Some(v) = std::env::var_os(PLUGIN_PATH_ENV) {
            dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
        }
        if let Some(exe_dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
            let lib = exe_dir.join("../lib");
            dirs.push(exe_dir);
            dirs.push(lib);
        }
        let mut seen = Vec::new();
        dirs.retain(|d| {
            let key = d.canonicalize().unwrap_or_else(|_| d.clone());
            let new = !seen.contains(&key);
            seen.push(key);
            new
        });
        SearchPath { dirs }
    }

    /// The first `libspark_backend_<name>.so` on the path.
    pub fn find(&self, name: &str) -> Option<PathBuf> {
        let file = plugin_file_name(name);
        self.dirs.iter().map(|d| d.join(&file)).find(|p| p.is_file())
    }

    /// Every `libspark_backend_*.so` on the path, first one of each name, in path order.
    pub fn discover(&self) -> Vec<(String, PathBuf)> {
        let mut found: Vec<(String, PathBuf)> = Vec::new();
        for d in &self.dirs {
            let Ok(rd) = std::fs::read_dir(d) else { continue };
            let mut here: Vec<(String, PathBuf)> = rd
                .flatten()
                .filter_map(|e| {
                    let f = e.file_name().into_string().ok()?;
                    let name = backend_name_of_file(&f)?.to_string();
                    e.path().is_file().then(|| (name, e.path()))
                })
                .collect();
            here.sort();
            for (n, p) in here {
                if !found.iter().any(|(m, _)| *m == n) {
                    found.push((n, p));
                }
            }
        }
        found
    }

    /// The directories, for messages: `[a, b, c]`.
    pub fn describe(&self) -> String {
        let v: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
        format!("[{}]", v.join(", "))
    }
}

/// What `--backend` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendSpec {
    /// The best score among usable devices of every backend found.
    Auto,
    /// A backend by name: linked statically, else `libspark_backend_<name>.so` on the path.
    Name(String),
    /// A plugin file.
    Path(PathBuf),
}

impl BackendSpec {
    /// `auto`, a name (`[a-z0-9_]+`), or a path (anything with a `/` or ending in the
    /// platform's library suffix).
    pub fn parse(s: &str) -> Result<Self> {
        if s == "auto" {
            return Ok(BackendSpec::Auto);
        }
        if s.contains('/') || s.contains(std::path::MAIN_SEPARATOR) || s.ends_with(std::env::consts::DLL_SUFFIX) {
            return Ok(BackendSpec::Path(PathBuf::from(s)));
        }
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            return Ok(BackendSpec::Name(s.to_string()));
        }
        Err(Error::invalid(format!(
            "--backend '{s}': expected auto, a backend name ({}) or the path of a plugin library",
            KNOWN_BACKENDS.join(", ")
        )))
    }
}

/// Where a backend's code is.
#[derive(Debug, Clone)]
pub enum Source {
    /// Linked into this program.
    Static(BackendFactory),
    /// A loaded plugin.
    Plugin(Arc<Plugin>),
}

impl Source {
    pub fn name(&self) -> &str {
        match self {
            Source::Static(f) => f.name(),
            Source::Plugin(p) => p.name(),
        }
    }

    /// `static` or the library path.
    pub fn origin(&self) -> String {
        match self {
            Source::Static(_) => "static".to_string(),
            Source::Plugin(p) => p.path().display().to_string(),
        }
    }

    pub fn probe(&self) -> Result<Vec<DeviceInfo>> {
        match self {
            Source::Static(f) => Ok((f.probe)()),
            Source::Plugin(p) => p.probe(),
        }
    }

    /// Open `model` on this backend.
    pub fn open(&self, model: &Path, opts: &OpenOptions) -> Result<Box<dyn Executor>> {
        match self {
            Source::Static(f) => (f.open)(model, opts),
            Source::Plugin(p) => Ok(Box::new(p.open(model, opts)?)),
        }
    }
}

/// The outcome of choosing a backend.
#[derive(Debug, Clone)]
pub struct Chosen {
    pub source: Source,
    pub device: DeviceInfo,
    /// Plugins skipped on the way (failed to load or probe), for a warning.
    pub skipped: Vec<String>,
}

impl Chosen {
    /// Open `model` on the chosen backend and device.
    pub fn open(&self, model: &Path, opts: &OpenOptions) -> Result<Box<dyn Executor>> {
        let opts = OpenOptions { device: self.device.index, ..opts.clone() };
        self.source.open(model, &opts)
    }
}

/// One line of `spark-run backends`.
#[derive(Debug, Clone)]
pub struct BackendReport {
    pub name: String,
    /// `static`, the library path, or empty when nothing was found.
    pub origin: String,
    pub abi_version: Option<u32>,
    pub devices: Vec<DeviceInfo>,
    /// Why it cannot be used (not found, ABI mismatch, no usable device).
    pub problem: Option<String>,
    /// Any other remark (e.g. shadowed by a static backend).
    pub note: Option<String>,
}

/// The backends a program can use: those linked into it and the plugins on a search path.
#[derive(Debug, Clone)]
pub struct Registry {
    pub statics: Vec<BackendFactory>,
    pub search: SearchPath,
}

/// The best usable device of `devices` (ties: the first).
fn best_device(devices: &[DeviceInfo]) -> Option<&DeviceInfo> {
    devices.iter().filter(|d| d.usable).fold(None, |best: Option<&DeviceInfo>, d| match best {
        Some(b) if b.score >= d.score => Some(b),
        _ => Some(d),
    })
}

/// Why none of `devices` is usable.
fn unusable(devices: &[DeviceInfo]) -> String {
    let notes: Vec<String> = devices
        .iter()
        .map(|d| format!("{}: {}", d.name, if d.note.is_empty() { "unusable" } else { &d.note }))
        .collect();
    if notes.is_empty() {
        "no device found".to_string()
    } else {
        format!("no usable device ({})", notes.join("; "))
    }
}

impl Registry {
    pub fn new(statics: Vec<BackendFactory>, search: SearchPath) -> Self {
        Registry { statics, search }
    }

    fn static_named(&self, name: &str) -> Option<BackendFactory> {
        self.statics.iter().copied().find(|f| f.name() == name)
    }

    /// Choose the backend and device `spec` asks for.
    pub fn choose(&self, spec: &BackendSpec) -> Result<Chosen> {
        let pick = |source: Source, skipped: Vec<String>| -> Result<Chosen> {
            let devices = source.probe()?;
            match best_device(&devices) {
                Some(d) => Ok(Chosen { device: d.clone(), source, skipped }),
                None => {
                    Err(Error::unsupported(format!("{} ({}): {}", source.name(), source.origin(), unusable(&devices))))
                }
            }
        };
        match spec {
            BackendSpec::Path(p) => pick(Source::Plugin(load_plugin(p)?), vec![]),
            BackendSpec::Name(n) => {
                if let Some(f) = self.static_named(n) {
                    return pick(Source::Static(f), vec![]);
                }
                match self.search.find(n) {
                    Some(p) => pick(Source::Plugin(load_plugin(&p)?), vec![]),
                    None => Err(Error::unsupported(self.not_found(n))),
                }
            }
            BackendSpec::Auto => {
                let mut skipped = Vec::new();
                let mut best: Option<(Source, DeviceInfo)> = None;
                let mut sources: Vec<Source> = self.statics.iter().copied().map(Source::Static).collect();
                for (n, p) in self.search.discover() {
                    if self.static_named(&n).is_some() {
                        continue; // the static one wins; its plugin twin is not even loaded
                    }
                    match load_plugin(&p) {
                        Ok(pl) => sources.push(Source::Plugin(pl)),
                        Err(e) => skipped.push(e.message),
                    }
                }
                for s in sources {
                    match s.probe() {
                        Ok(devs) => match best_device(&devs) {
                            Some(d) if best.as_ref().is_none_or(|(_, b)| d.score > b.score) => {
                                best = Some((s, d.clone()))
                            }
                            Some(_) => {}
                            None => skipped.push(format!("{} ({}): {}", s.name(), s.origin(), unusable(&devs))),
                        },
                        Err(e) => skipped.push(format!("{} ({}): probe failed: {}", s.name(), s.origin(), e.message)),
                    }
                }
                match best {
                    Some((source, device)) => Ok(Chosen { source, device, skipped }),
                    None => Err(Error::unsupported(format!(
                        "no usable backend: none is linked into this program and no plugin on {} has a usable device{}",
                        self.search.describe(),
                        if skipped.is_empty() { String::new() } else { format!(" ({})", skipped.join("; ")) }
                    ))),
                }
            }
        }
    }

    fn not_found(&self, name: &str) -> String {
        let statics: Vec<&str> = self.statics.iter().map(|f| f.name()).collect();
        format!(
            "{name}: no plugin {} found in {}{}",
            plugin_file_name(name),
            self.search.describe(),
            if statics.is_empty() {
                " (no backend is linked into this program)".to_string()
            } else {
                format!(" (linked into this program: {})", statics.join(", "))
            }
        )
    }

    /// Every backend found, static or plugin, plus each of `KNOWN_BACKENDS` that is nowhere,
    /// with its devices or what is wrong with it. Loads (but does not open) every plugin found.
    pub fn report(&self) -> Vec<BackendReport> {
        let mut out = Vec::new();
        for f in &self.statics {
            let devices = (f.probe)();
            let problem = best_device(&devices).is_none().then(|| unusable(&devices));
            out.push(BackendReport {
                name: f.name().to_string(),
                origin: "static".into(),
                abi_version: Some(ABI_VERSION),
                devices,
                problem,
                note: None,
            });
        }
        for (n, p) in self.search.discover() {
            let note = self
                .static_named(&n)
                .map(|_| format!("shadowed by the static {n} backend; pick this file with --backend {}", p.display()));
            let r = match load_plugin(&p) {
                Ok(pl) => match pl.probe() {
                    Ok(devices) => BackendReport {
                        name: n.clone(),
                        origin: pl.path().display().to_string(),
                        abi_version: Some(pl.abi_version()),
                        problem: best_device(&devices).is_none().then(|| unusable(&devices)),
                        devices,
                        note,
                    },
                    Err(e) => BackendReport {
                        name: n.clone(),
                        origin: p.display().to_string(),
                        abi_version: Some(pl.abi_version()),
                        devices: vec![],
                        problem: Some(format!("probe failed: {}", e.message)),
                        note,
                    },
                },
                Err(e) => BackendReport {
                    name: n.clone(),
                    origin: p.display().to_string(),
                    abi_version: None,
                    devices: vec![],
                    problem: Some(e.message),
                    note,
                },
            };
            out.push(r);
        }
        for k in KNOWN_BACKENDS {
            if !out.iter().any(|r| r.name == k) {
                out.push(BackendReport {
                    name: k.to_string(),
                    origin: String::new(),
                    abi_version: None,
                    devices: vec![],
                    problem: Some(self.not_found(k)),
                    note: None,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_parsing() {
        assert_eq!(BackendSpec::parse("auto").unwrap(), BackendSpec::Auto);
        assert_eq!(BackendSpec::parse("cuda").unwrap(), BackendSpec::Name("cuda".into()));
        assert_eq!(BackendSpec::parse("./x.so").unwrap(), BackendSpec::Path("./x.so".into()));
        assert_eq!(BackendSpec::parse("libfoo.so").unwrap(), BackendSpec::Path("libfoo.so".into()));
        let e = BackendSpec::parse("Cu Da").unwrap_err();
        assert!(e.message.contains("'Cu Da'"), "{e}");
    }

    #[test]
    fn file_names() {
        let f = plugin_file_name("cpu");
        assert_eq!(backend_name_of_file(&f), Some("cpu"));
        assert_eq!(backend_name_of_file(&plugin_file_name("")), None);
        assert_eq!(backend_name_of_file("libspark_testplugin_x.so"), None);
    }

    #[test]
    fn missing_and_corrupt_files_give_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("libspark_backend_nope.so");
        let e = load_plugin(&missing).unwrap_err();
        assert!(e.message.contains(&missing.display().to_string()), "{e}");
        let text = dir.path().join("libspark_backend_text.so");
        std::fs::write(&text, "this is not a shared library\n").unwrap();
        let e = load_plugin(&text).unwrap_err();
        assert!(
            e.message.contains("cannot load backend plugin") && e.message.contains(&text.display().to_string()),
            "{e}"
        );
        let e = load_plugin(dir.path()).unwrap_err();
        assert!(e.message.contains("is not a file"), "{e}");
    }

    #[test]
    fn a_name_not_found_lists_the_search_path() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::new(vec![], SearchPath { dirs: vec![dir.path().to_path_buf()] });
        let e = reg.choose(&BackendSpec::Name("cuda".into())).unwrap_err();
        let want = format!("cuda: no plugin {} found in [{}]", plugin_file_name("cuda"), dir.path().display());
        assert!(e.message.starts_with(&want), "{e}");
        let e = reg.choose(&BackendSpec::Auto).unwrap_err();
        assert!(e.message.contains("no usable backend"), "{e}");
        let r = reg.report();
        assert_eq!(r.len(), KNOWN_BACKENDS.len());
        assert!(r.iter().all(|b| b.problem.as_deref().is_some_and(|p| p.contains("no plugin"))));
    }

    #[test]
    fn best_device_takes_the_highest_usable_score() {
        let d = |i, score, usable| DeviceInfo { index: i, score, usable, ..Default::default() };
        let devs = [d(0, 50, false), d(1, 10, true), d(2, 20, true), d(3, 20, true)];
        assert_eq!(best_device(&devs).map(|d| d.index), Some(2));
        assert_eq!(best_device(&devs[..1]), None);
    }
}
