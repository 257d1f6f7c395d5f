//! The C ABI of a spark backend plugin, version 1: the `#[repr(C)]` types and constants that
//! cross a shared-library boundary. `include/spark.h` declares the same types for C; a test
//! compiles it and compares every size and field offset with these.
//!
//! A plugin exports one symbol, [`ENTRY_SYMBOL`] (`spark_backend_v1`), an
//! `extern "C" fn() -> *const SparkBackendV1` returning a table that lives as long as the
//! library. The host reads [`SparkBackendV1::abi_version`] before anything else and refuses any
//! version other than [`ABI_VERSION`].
//!
//! Rules every entry point follows:
//! - only plain C data crosses: integers, floats, pointers to them, NUL-terminated UTF-8 strings,
//!   fixed-size `char` arrays, and the opaque [`SparkExecutor`] handle;
//! - functions returning `i32` return [`SPARK_OK`] (0) or an error code (`SPARK_ERR_*`), and on
//!   error set the calling thread's last-error message, read with `last_error`;
//! - no panic escapes: a panic inside the backend is caught and returned as
//!   [`SPARK_ERR_PANIC`]; after one, the executor handle is refused by every call but `close`;
//! - one handle must not be used by two threads at the same time (calls on different handles
//!   may run concurrently).

use std::ffi::c_char;

/// The ABI version this build of spark speaks.
pub const ABI_VERSION: u32 = 1;

/// The symbol every plugin exports (NUL-terminated, for `dlsym`).
pub const ENTRY_SYMBOL: &[u8] = b"spark_backend_v1\0";

/// Success.
pub const SPARK_OK: i32 = 0;
/// Bad input: an argument, a token id, a sequence position, a buffer length.
pub const SPARK_ERR_INVALID_INPUT: i32 = 1;
/// A model file is missing, truncated or malformed.
pub const SPARK_ERR_BAD_MODEL: i32 = 2;
/// Not enough memory for the request (KV cache, context).
pub const SPARK_ERR_OUT_OF_MEMORY: i32 = 3;
/// Not implemented by this backend.
pub const SPARK_ERR_UNSUPPORTED: i32 = 4;
/// I/O failure.
pub const SPARK_ERR_IO: i32 = 5;
/// A device failure.
pub const SPARK_ERR_BACKEND: i32 = 6;
/// A bug: an internal invariant did not hold.
pub const SPARK_ERR_INTERNAL: i32 = 7;
/// The backend panicked; the message says where. The handle is unusable afterwards.
pub const SPARK_ERR_PANIC: i32 = 8;

/// `SparkOpenOptions::dtype`: the checkpoint's stored type.
pub const SPARK_DTYPE_DEFAULT: u32 = 0;
pub const SPARK_DTYPE_F32: u32 = 1;
pub const SPARK_DTYPE_BF16: u32 = 2;
pub const SPARK_DTYPE_F16: u32 = 3;

/// `SparkSeqStep::logits`: no logits for this sequence.
pub const SPARK_LOGITS_NONE: u32 = 0;
/// The row of the last token only.
pub const SPARK_LOGITS_LAST: u32 = 1;
/// One row per token.
pub const SPARK_LOGITS_ALL: u32 = 2;

/// Bytes of [`SparkDeviceInfo::name`], NUL included.
pub const DEVICE_NAME_LEN: usize = 128;
/// Bytes of [`SparkDeviceInfo::capabilities`], NUL included.
pub const DEVICE_CAPS_LEN: usize = 128;
/// Bytes of [`SparkDeviceInfo::note`], NUL included.
pub const DEVICE_NOTE_LEN: usize = 256;

/// One device a backend can run on, as reported by `probe`. Strings are NUL-terminated UTF-8,
/// cut to fit.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SparkDeviceInfo {
    /// Index to pass as [`SparkOpenOptions::device`].
    pub index: u32,
    /// 1: the backend can run on this device now; 0: it cannot (`note` says why).
    pub usable: u32,
    /// Preference for automatic choice, higher is better. CPU variants score 10..=50 by SIMD
    /// level; accelerators are expected to score 100 and up.
    pub score: i32,
    /// Zero.
    pub reserved: u32,
    /// Device memory in bytes (0: unknown).
    pub memory_total: u64,
    /// Free device memory in bytes (0: unknown).
    pub memory_free: u64,
    /// Human-readable device name (e.g. the CPU model or GPU name).
    pub name: [c_char; DEVICE_NAME_LEN],
    /// What the backend uses on it (e.g. `avx2+fma`, `sm_90 bf16`).
    pub capabilities: [c_char; DEVICE_CAPS_LEN],
    /// Why the device is unusable, or any other remark; empty if none.
    pub note: [c_char; DEVICE_NOTE_LEN],
}

impl SparkDeviceInfo {
    /// An all-zero record (empty strings).
    pub const fn zeroed() -> Self {
        SparkDeviceInfo {
            index: 0,
            usable: 0,
            score: 0,
            reserved: 0,
            memory_total: 0,
            memory_free: 0,
            name: [0; DEVICE_NAME_LEN],
            capabilities: [0; DEVICE_CAPS_LEN],
            note: [0; DEVICE_NOTE_LEN],
        }
    }
}

/// How to open a model. All-zero means "defaults" (and a null pointer does too).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SparkOpenOptions {
    /// Worker threads (0: the backend's default, e.g. one per core).
    pub threads: u32,
    /// Largest context to serve (0: `min(max_position_embeddings, 4096)`).
    pub ctx_size: u32,
    /// Compute dtype: `SPARK_DTYPE_*` (0: the checkpoint's stored type).
    pub dtype: u32,
    /// Device index from `probe`.
    pub device: u32,
}

/// Facts about an open executor.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SparkExecInfo {
    /// Logits row width.
    pub vocab: u64,
    /// Largest position + 1 that can be served.
    pub ctx: u64,
    /// Compute dtype: `SPARK_DTYPE_F32`, `_BF16` or `_F16`.
    pub dtype: u32,
    /// Zero.
    pub reserved: u32,
}

/// One sequence's part of a `forward` call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SparkSeqStep {
    pub seq_id: u64,
    /// `n_tokens` token ids (may be null only when `n_tokens` is 0, which is refused anyway).
    pub tokens: *const u32,
    pub n_tokens: usize,
    /// Position of `tokens[0]`: the sequence's cached length, or less to rewind.
    pub start_pos: u32,
    /// `SPARK_LOGITS_*`.
    pub logits: u32,
}

/// An open executor: opaque to the host, owned by the plugin until `close`.
#[repr(C)]
pub struct SparkExecutor {
    _opaque: [u8; 0],
}

/// `probe(devices, capacity, count)`: write up to `capacity` device records to `devices` (may be
/// null when `capacity` is 0) and the total number of devices to `*count`.
pub type ProbeFn = unsafe extern "C" fn(devices: *mut SparkDeviceInfo, capacity: u32, count: *mut u32) -> i32;
/// `open(model_path, options, out)`: load the checkpoint directory `model_path` (NUL-terminated
/// UTF-8) with `options` (null: defaults) and store a new handle in `*out`.
pub type OpenFn = unsafe extern "C" fn(
    model_path: *const c_char,
    options: *const SparkOpenOptions,
    out: *mut *mut SparkExecutor,
) -> i32;
/// `info(handle, out)`.
pub type InfoFn = unsafe extern "C" fn(handle: *mut SparkExecutor, out: *mut SparkExecInfo) -> i32;
/// `forward(handle, steps, n_steps, logits, logits_len)`: run one step over `n_steps` sequences
/// and write the requested logits rows, in step order, each `vocab` floats wide, to `logits`,
/// whose length `logits_len` (in floats) must equal the number of rows asked for times `vocab`.
pub type ForwardFn = unsafe extern "C" fn(
    handle: *mut SparkExecutor,
    steps: *const SparkSeqStep,
    n_steps: usize,
    logits: *mut f32,
    logits_len: usize,
) -> i32;
/// `release(handle, seq_id)`: drop a sequence's KV cache (no-op if unknown).
pub type ReleaseFn = unsafe extern "C" fn(handle: *mut SparkExecutor, seq_id: u64) -> i32;
/// `fork(handle, src, dst)`: copy `src`'s KV cache to `dst` (replacing it if it exists).
pub type ForkFn = unsafe extern "C" fn(handle: *mut SparkExecutor, src: u64, dst: u64) -> i32;
/// `seq_len(handle, seq_id, out)`: the cached length of a sequence, or -1 if unknown.
pub type SeqLenFn = unsafe extern "C" fn(handle: *mut SparkExecutor, seq_id: u64, out: *mut i64) -> i32;
/// `kv_bytes(handle, out)`: KV-cache bytes in use over all sequences.
pub type KvBytesFn = unsafe extern "C" fn(handle: *mut SparkExecutor, out: *mut u64) -> i32;
/// `close(handle)`: free the executor (null is a no-op). The handle is invalid afterwards.
pub type CloseFn = unsafe extern "C" fn(handle: *mut SparkExecutor);
/// `last_error()`: the message of the calling thread's last failed call into this library
/// (never null; empty if none). Valid until the next call into the library from this thread.
pub type LastErrorFn = unsafe extern "C" fn() -> *const c_char;

/// The function table a plugin's `spark_backend_v1` returns. `abi_version` comes first and stays
/// first in every future version, so that a host can always read it.
#[repr(C)]
pub struct SparkBackendV1 {
    /// [`ABI_VERSION`] of the spark the plugin was built with.
    pub abi_version: u32,
    /// `sizeof(SparkBackendV1)` as the plugin sees it.
    pub table_size: u32,
    /// The backend's name (`cpu`, `cuda`, ...): static, NUL-terminated.
    pub name: *const c_char,
    pub probe: ProbeFn,
    pub open: OpenFn,
    pub info: InfoFn,
    pub forward: ForwardFn,
    pub release: ReleaseFn,
    pub fork: ForkFn,
    pub seq_len: SeqLenFn,
    pub kv_bytes: KvBytesFn,
    pub close: CloseFn,
    pub last_error: LastErrorFn,
}

// SAFETY: the table is immutable after construction; `name` points to a static string that is
// only ever read, and function pointers are plain code addresses. Sharing it between threads
// (as a `static` in the exporting library) is therefore sound.
unsafe impl Sync for SparkBackendV1 {}

/// The type of the entry symbol.
pub type EntryFn = unsafe extern "C" fn() -> *const SparkBackendV1;

/// Write `s` into a fixed `char` array, cut at a UTF-8 boundary to leave room for the NUL.
pub fn write_c_chars(dst: &mut [c_char], s: &str) {
    let Some(room) = dst.len().checked_sub(1) else { return };
    let mut n = s.len().min(room);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    for (d, &b) in dst.iter_mut().zip(&s.as_bytes()[..n]) {
        // Interior NULs would end the string early; a space keeps the rest readable.
        *d = if b == 0 { b' ' } else { b } as c_char;
    }
    dst[n] = 0;
}

/// Read a fixed `char` array up to its first NUL (or its end), replacing invalid UTF-8.
pub fn read_c_chars(src: &[c_char]) -> String {
    let bytes: Vec<u8> = src.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
