//! The plugin side of the C ABI: [`export_backend!`](crate::export_backend) builds a
//! [`SparkBackendV1`] table from a [`BackendFactory`] and exports it as `spark_backend_v1`;
//! the functions here are what the table points to.
//!
//! Every function catches panics (`catch_unwind`) and turns them, like ordinary errors, into a
//! status code plus a thread-local message. An executor that panicked is marked poisoned: every
//! later call on its handle but `close` fails with [`SPARK_ERR_PANIC`], since its state (KV
//! caches half written) can no longer be trusted.
//!
//! The last-error message lives in a thread-local `CString` of the exporting library; the
//! pointer `last_error` returns stays valid until the next call into that library from the same
//! thread.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use super::abi::*;
use super::{dtype_code, dtype_from_code, BackendFactory, OpenOptions};
use crate::backend::{Executor, LogitsMode, SeqStep};
use crate::error::{Error, ErrorKind, Result};

/// Export `$factory` (a `const` [`BackendFactory`] expression) as this library's entry point:
/// `spark_backend_v1`, or the named symbol `spark_backend_v1_<name>` given as a second argument.
/// Invoke once, in a crate built as a `cdylib`:
///
/// ```ignore
/// pub const FACTORY: spark_core::plugin::BackendFactory =
///     spark_core::plugin::BackendFactory { name: c"cuda", probe, open };
/// spark_core::export_backend!(FACTORY, spark_backend_v1_cuda);
/// ```
///
/// Backends that may be linked statically into one program together must use the named form
/// (unmangled symbols must be unique in a program); the loader looks for
/// `spark_backend_v1_<name>` (from the file name `libspark_backend_<name>.so`) first, then for
/// `spark_backend_v1`.
#[macro_export]
macro_rules! export_backend {
    ($factory:expr) => {
        $crate::export_backend!($factory, spark_backend_v1);
    };
    ($factory:expr, $symbol:ident) => {
        const _: () = {
            use $crate::plugin::abi as __abi;
            use $crate::plugin::export as __export;

            const __FACTORY: $crate::plugin::BackendFactory = $factory;

            unsafe extern "C" fn __probe(devices: *mut __abi::SparkDeviceInfo, capacity: u32, count: *mut u32) -> i32 {
                // SAFETY: our caller upholds `probe`'s contract (abi::ProbeFn), which is the
                // contract of `export::probe`.
                unsafe { __export::probe(devices, capacity, count, __FACTORY.probe) }
            }

            unsafe extern "C" fn __open(
                model_path: *const ::std::ffi::c_char,
                options: *const __abi::SparkOpenOptions,
                out: *mut *mut __abi::SparkExecutor,
            ) -> i32 {
                // SAFETY: our caller upholds `open`'s contract (abi::OpenFn), which is the
                // contract of `export::open`.
                unsafe { __export::open(model_path, options, out, &__FACTORY) }
            }

            static __TABLE: __abi::SparkBackendV1 = __abi::SparkBackendV1 {
                abi_version: __abi::ABI_VERSION,
                table_size: ::core::mem::size_of::<__abi::SparkBackendV1>() as u32,
                name: __FACTORY.name.as_ptr(),
                probe: __probe,
                open: __open,
                info: __export::info,
                forward: __export::forward,
                release: __export::release,
                fork: __export::fork,
                seq_len: __export::seq_len,
                kv_bytes: __export::kv_bytes,
                close: __export::close,
                last_error: __export::last_error,
            };

            /// The plugin entry point: the backend's function table, valid for the life of
            /// the library.
            #[no_mangle]
            pub extern "C" fn $symbol() -> *const __abi::SparkBackendV1 {
                &__TABLE
            }
        };
    };
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Record `msg` as the calling thread's last error (interior NULs become spaces).
pub fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // `try_with` fails only while the thread is being torn down; there is nobody to tell then.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

/// The status code of an error kind.
pub fn error_code(kind: ErrorKind) -> i32 {
    match kind {
        ErrorKind::InvalidInput => SPARK_ERR_INVALID_INPUT,
        ErrorKind::BadModel => SPARK_ERR_BAD_MODEL,
        ErrorKind::OutOfMemory => SPARK_ERR_OUT_OF_MEMORY,
        ErrorKind::Unsupported => SPARK_ERR_UNSUPPORTED,
        ErrorKind::Io => SPARK_ERR_IO,
        ErrorKind::Backend => SPARK_ERR_BACKEND,
        ErrorKind::Internal => SPARK_ERR_INTERNAL,
    }
}

/// The text of a panic payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic with a non-string payload)".to_string()
    }
}

/// Run `f`, turning an error or a panic into a status code and the last-error message.
fn guard(what: &str, f: impl FnOnce() -> Result<()>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SPARK_OK,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            error_code(e.kind)
        }
        Err(payload) => {
            set_last_error(&format!("{what} panicked: {}", panic_message(&*payload)));
            SPARK_ERR_PANIC
        }
    }
}

/// What an executor handle points to.
struct Handle {
    exec: Box<dyn Executor>,
    backend: &'static str,
    /// Set when a call panicked: the message, and the handle refuses further work.
    poisoned: Option<String>,
}

/// Run `f` on the executor behind `h`, as [`guard`] does, poisoning the handle on a panic.
///
/// # Safety
/// `h` is null or a handle returned by `open` and not yet closed, not in use by another thread.
unsafe fn with_handle(h: *mut SparkExecutor, what: &str, f: impl FnOnce(&mut dyn Executor) -> Result<()>) -> i32 {
    if h.is_null() {
        set_last_error(&format!("{what}: the executor handle is null"));
        return SPARK_ERR_INVALID_INPUT;
    }
    // SAFETY: a non-null handle is a `Box<Handle>` leaked by `open` and not yet freed by `close`,
    // and no other thread uses it now (the caller's contract), so a unique reference is sound.
    let handle = unsafe { &mut *h.cast::<Handle>() };
    if let Some(p) = &handle.poisoned {
        set_last_error(&format!(
            "{what}: this {} executor is unusable after an earlier panic ({p}); close it",
            handle.backend
        ));
        return SPARK_ERR_PANIC;
    }
    let exec = &mut *handle.exec;
    match catch_unwind(AssertUnwindSafe(|| f(exec))) {
        Ok(Ok(())) => SPARK_OK,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            error_code(e.kind)
        }
        Err(payload) => {
            let msg = format!("{} backend: {what} panicked: {}", handle.backend, panic_message(&*payload));
            set_last_error(&msg);
            handle.poisoned = Some(msg);
            SPARK_ERR_PANIC
        }
    }
}

/// `probe` over a Rust probe function.
///
/// # Safety
/// `devices` is null or valid for writing `capacity` records; `count` is null or valid for
/// writing one `u32`.
pub unsafe fn probe(devices: *mut SparkDeviceInfo, capacity: u32, count: *mut u32, f: super::ProbeFn) -> i32 {
    guard("probe", || {
        if count.is_null() {
            return Err(Error::invalid("probe: the count pointer is null"));
        }
        if devices.is_null() && capacity > 0 {
            return Err(Error::invalid(format!("probe: the device array is null but its capacity is {capacity}")));
        }
        let found = f();
        let n = u32::try_from(found.len()).map_err(|_| Error::internal("probe: more than 2^32 devices"))?;
        for (i, d) in found.iter().take(capacity as usize).enumerate() {
            // SAFETY: `i < capacity` and `devices` is valid for `capacity` records (checked
            // non-null above; validity is the caller's contract). `write` does not read the
            // possibly uninitialised old value.
            unsafe { devices.add(i).write(d.to_c()) };
        }
        // SAFETY: `count` is non-null (checked) and valid for one write (caller's contract).
        unsafe { count.write(n) };
        Ok(())
    })
}

/// `open` over a factory's Rust open function.
///
/// # Safety
/// `model_path` is null or a NUL-terminated string; `options` is null or points to a
/// [`SparkOpenOptions`]; `out` is null or valid for writing one pointer.
pub unsafe fn open(
    model_path: *const c_char,
    options: *const SparkOpenOptions,
    out: *mut *mut SparkExecutor,
    factory: &BackendFactory,
) -> i32 {
    let backend = factory.name();
    guard("open", || {
        if out.is_null() {
            return Err(Error::invalid("open: the output handle pointer is null"));
        }
        // SAFETY: `out` is non-null and valid for one write (caller's contract); clearing it
        // first means a failed open never leaves a stale handle behind.
        unsafe { out.write(std::ptr::null_mut()) };
        if model_path.is_null() {
            return Err(Error::invalid("open: the model path is null"));
        }
        // SAFETY: non-null and NUL-terminated (caller's contract); only read during this call.
        let bytes = unsafe { CStr::from_ptr(model_path) }.to_bytes();
        let path = path_from_bytes(bytes)?;
        let o = if options.is_null() {
            SparkOpenOptions::default()
        } else {
            // SAFETY: non-null and pointing to a `SparkOpenOptions` (caller's contract); it is
            // plain old data, copied out.
            unsafe { options.read() }
        };
        let dtype = dtype_from_code(o.dtype).map_err(|c| {
            Error::invalid(format!("open: unknown dtype code {c} (expected 0 = default, 1 = f32, 2 = bf16, 3 = f16)"))
        })?;
        let opts = OpenOptions {
            threads: (o.threads > 0).then_some(o.threads as usize),
            ctx: (o.ctx_size > 0).then_some(o.ctx_size as usize),
            dtype,
            device: o.device,
            quant: None,
        };
        let exec = (factory.open)(&path, &opts)?;
        let h = Box::into_raw(Box::new(Handle { exec, backend, poisoned: None }));
        // SAFETY: as above; the host now owns the handle until `close`.
        unsafe { out.write(h.cast::<SparkExecutor>()) };
        Ok(())
    })
}

#[cfg(unix)]
fn path_from_bytes(b: &[u8]) -> Result<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(b)))
}

#[cfg(not(unix))]
fn path_from_bytes(b: &[u8]) -> Result<PathBuf> {
    std::str::from_utf8(b)
        .map(PathBuf::from)
        .map_err(|_| Error::invalid(format!("open: the model path {} is not UTF-8", String::from_utf8_lossy(b))))
}

/// `info`.
///
/// # Safety
/// `h` as for every handle call (null, or open and not in use elsewhere); `out` is null or
/// valid for writing one [`SparkExecInfo`].
pub unsafe extern "C" fn info(h: *mut SparkExecutor, out: *mut SparkExecInfo) -> i32 {
    let f = |e: &mut dyn Executor| {
        if out.is_null() {
            return Err(Error::invalid("info: the output pointer is null"));
        }
        let i = e.info();
        let r =
            SparkExecInfo { vocab: i.vocab as u64, ctx: i.ctx as u64, dtype: dtype_code(Some(i.dtype)), reserved: 0 };
        // SAFETY: non-null and valid for one write (caller's contract).
        unsafe { out.write(r) };
        Ok(())
    };
    // SAFETY: forwarded caller contract on `h`.
    unsafe { with_handle(h, "info", f) }
}

/// `forward`.
///
/// # Safety
/// `h` as for every handle call; `steps` is null (with `n_steps` 0) or valid for reading
/// `n_steps` records, each with `tokens` valid for reading `n_tokens` ids; `logits` is null (with
/// `logits_len` 0) or valid for writing `logits_len` floats; none of these overlap.
pub unsafe extern "C" fn forward(
    h: *mut SparkExecutor,
    steps: *const SparkSeqStep,
    n_steps: usize,
    logits: *mut f32,
    logits_len: usize,
) -> i32 {
    let f = |e: &mut dyn Executor| {
        let steps: &[SparkSeqStep] = if n_steps == 0 {
            &[]
        } else if steps.is_null() || !steps.is_aligned() {
            return Err(Error::invalid(format!("forward: the step array is null or misaligned (n_steps {n_steps})")));
        } else {
            // SAFETY: non-null, aligned, and valid for `n_steps` reads (caller's contract).
            unsafe { std::slice::from_raw_parts(steps, n_steps) }
        };
        let mut batch = Vec::with_capacity(steps.len());
        for (i, s) in steps.iter().enumerate() {
            let tokens: &[u32] = if s.n_tokens == 0 {
                &[]
            } else if s.tokens.is_null() || !s.tokens.is_aligned() {
                return Err(Error::invalid(format!(
                    "forward: step {i} (sequence {}): the token pointer is null or misaligned ({} tokens)",
                    s.seq_id, s.n_tokens
                )));
            } else {
                // SAFETY: non-null, aligned, valid for `n_tokens` reads (caller's contract).
                unsafe { std::slice::from_raw_parts(s.tokens, s.n_tokens) }
            };
            let mode = match s.logits {
                SPARK_LOGITS_NONE => LogitsMode::None,
                SPARK_LOGITS_LAST => LogitsMode::Last,
                SPARK_LOGITS_ALL => LogitsMode::All,
                other => {
                    return Err(Error::invalid(format!(
                        "forward: step {i} (sequence {}): logits mode {other} is not 0 (none), 1 (last) or 2 (all)",
                        s.seq_id
                    )))
                }
            };
            batch.push(SeqStep { seq_id: s.seq_id, tokens, start_pos: s.start_pos, logits: mode });
        }
        let out: &mut [f32] = if logits_len == 0 {
            &mut []
        } else if logits.is_null() || !logits.is_aligned() {
            return Err(Error::invalid(format!(
                "forward: the logits buffer is null or misaligned (length {logits_len})"
            )));
        } else {
            // SAFETY: non-null, aligned, valid for `logits_len` writes and not aliased by the
            // inputs (caller's contract).
            unsafe { std::slice::from_raw_parts_mut(logits, logits_len) }
        };
        e.forward(&batch, out)
    };
    // SAFETY: forwarded caller contract on `h`.
    unsafe { with_handle(h, "forward", f) }
}

/// `release`.
///
/// # Safety
/// `h` as for every handle call.
pub unsafe extern "C" fn release(h: *mut SparkExecutor, seq_id: u64) -> i32 {
    let f = |e: &mut dyn Executor| {
        e.release(seq_id);
        Ok(())
    };
    // SAFETY: forwarded caller contract on `h`.
    unsafe { with_handle(h, "release", f) }
}

/// `fork`.
///
/// # Safety
/// `h` as for every handle call.
pub unsafe extern "C" fn fork(h: *mut SparkExecutor, src: u64, dst: u64) -> i32 {
    // SAFETY: forwarded caller contract on `h`.
    unsafe { with_handle(h, "fork", |e| e.fork(src, dst)) }
}

/// `seq_len`.
///
/// # Safety
/// `h` as for every handle call; `out` is null or valid for writing one `i64`.
pub unsafe extern "C" fn seq_len(h: *mut SparkExecutor, seq_id: u64, out: *mut i64) -> i32 {
    let f = |e: &mut dyn Executor| {
        if out.is_null() {
            return Err(Error::invalid("seq_len: the output pointer is null"));
        }
        let n = e.seq_len(seq_id).map_or(-1, |n| i64::try_from(n).unwrap_or(i64::MAX));
        // SAFETY: non-null and valid for one write (caller's contract).
        unsafe { out.write(n) };
        Ok(())
    };
    // SAFETY: forwarded caller contract on `h`.
    unsafe { with_handle(h, "seq_len", f) }
}

/// `kv_bytes`.
///
/// # Safety
/// `h` as for every handle call; `out` is null or valid for writing one `u64`.
pub unsafe extern "C" fn kv_bytes(h: *mut SparkExecutor, out: *mut u64) -> i32 {
    let f = |e: &mut dyn Executor| {
        if out.is_null() {
            return Err(Error::invalid("kv_bytes: the output pointer is null"));
        }
        // SAFETY: non-null and valid for one write (caller's contract).
        unsafe { out.write(e.kv_bytes() as u64) };
        Ok(())
    };
    // SAFETY: forwarded caller contract on `h`.
    unsafe { with_handle(h, "kv_bytes", f) }
}

/// `close`: free the executor, even a poisoned one. A panic while dropping it is swallowed (and
/// recorded as the last error): there is no status to return it in.
///
/// # Safety
/// `h` is null or a handle returned by `open`, not yet closed and not in use elsewhere; it is
/// invalid afterwards.
pub unsafe extern "C" fn close(h: *mut SparkExecutor) {
    if h.is_null() {
        return;
    }
    // SAFETY: `h` is a `Box<Handle>` leaked by `open` and not yet freed (caller's contract);
    // taking it back frees it exactly once.
    let handle = unsafe { Box::from_raw(h.cast::<Handle>()) };
    guard("close", move || {
        drop(handle);
        Ok(())
    });
}

/// `last_error`: the calling thread's last error message (empty if none; never null).
///
/// # Safety
/// None beyond the documented lifetime of the returned pointer: valid until the next call into
/// this library from the same thread.
pub unsafe extern "C" fn last_error() -> *const c_char {
    catch_unwind(|| LAST_ERROR.try_with(|e| e.borrow().as_ptr()).ok()).ok().flatten().unwrap_or(c"".as_ptr())
}
