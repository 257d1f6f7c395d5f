//! Backend plugins: a stable C ABI over the step-level [`Executor`], the macro a backend crate
//! uses to export it, and the loader the host uses to find, check and call plugins.
//!
//! - [`abi`]: the `#[repr(C)]` table and records (mirrored by `include/spark.h`).
//! - [`export`]: [`export_backend!`](crate::export_backend) and the `extern "C"` functions it
//!   wires into the table; every one catches panics.
//! - [`loader`]: the search path, loading and ABI checks, [`loader::PluginExecutor`] (an
//!   [`Executor`] over a plugin), and the choice of a backend among static ones and plugins.
//!
//! A backend describes itself once, as a [`BackendFactory`] (name, probe, open). The same value
//! is registered with the host when the backend is linked statically and exported through the C
//! ABI when it is built as a `cdylib`, so the two paths run the same code.

pub mod abi;
pub mod export;
pub mod loader;

use std::ffi::CStr;
use std::path::Path;

use crate::backend::Executor;
use crate::dtype::DType;
use crate::error::Result;

/// One device a backend can run on (the Rust side of [`abi::SparkDeviceInfo`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Index to pass as [`OpenOptions::device`].
    pub index: u32,
    /// Human-readable name (CPU model, GPU name).
    pub name: String,
    /// What the backend uses on it (`avx2+fma`, ...).
    pub capabilities: String,
    /// Bytes (0: unknown).
    pub memory_total: u64,
    /// Bytes (0: unknown).
    pub memory_free: u64,
    /// Preference for `--backend auto`, higher is better: CPU variants 10..=50 by SIMD level,
    /// accelerators 100 and up.
    pub score: i32,
    /// Whether the backend can run on it now.
    pub usable: bool,
    /// Why it is unusable, or another remark.
    pub note: String,
}

/// How to open a model (the Rust side of [`abi::SparkOpenOptions`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// Worker threads (`None`: the backend's default).
    pub threads: Option<usize>,
    /// Largest context to serve (`None`: `min(max_position_embeddings, 4096)`).
    pub ctx: Option<usize>,
    /// Compute dtype (`None`: the checkpoint's).
    pub dtype: Option<DType>,
    /// Device index from the probe.
    pub device: u32,
    /// Quantize the checkpoint's float matrices at load (static backends only: the v1 C ABI
    /// has no field for it, so a plugin refuses it; quantize the checkpoint on disk instead).
    pub quant: Option<crate::quant::QuantSpec>,
}

/// Lists the devices a backend can see.
pub type ProbeFn = fn() -> Vec<DeviceInfo>;
/// Opens a checkpoint directory on a backend.
pub type OpenFn = fn(&Path, &OpenOptions) -> Result<Box<dyn Executor>>;

/// A backend as one value: what the host needs to list and open it, statically or as a plugin.
#[derive(Clone, Copy)]
pub struct BackendFactory {
    /// `cpu`, `cuda`, ...: also names the plugin file `libspark_backend_<name>.so`.
    pub name: &'static CStr,
    pub probe: ProbeFn,
    pub open: OpenFn,
}

impl BackendFactory {
    /// The name as a `&str`.
    pub fn name(&self) -> &'static str {
        self.name.to_str().unwrap_or("(non-UTF-8 name)")
    }
}

impl std::fmt::Debug for BackendFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendFactory").field("name", &self.name()).finish_non_exhaustive()
    }
}

/// `SPARK_DTYPE_*` code of a dtype choice.
pub fn dtype_code(d: Option<DType>) -> u32 {
    match d {
        None => abi::SPARK_DTYPE_DEFAULT,
        Some(DType::F32) => abi::SPARK_DTYPE_F32,
        Some(DType::BF16) => abi::SPARK_DTYPE_BF16,
        Some(DType::F16) => abi::SPARK_DTYPE_F16,
    }
}

/// The dtype choice of a `SPARK_DTYPE_*` code (`Err(code)` for an unknown one).
pub fn dtype_from_code(code: u32) -> std::result::Result<Option<DType>, u32> {
    match code {
        abi::SPARK_DTYPE_DEFAULT => Ok(None),
        abi::SPARK_DTYPE_F32 => Ok(Some(DType::F32)),
        abi::SPARK_DTYPE_BF16 => Ok(Some(DType::BF16)),
        abi::SPARK_DTYPE_F16 => Ok(Some(DType::F16)),
        other => Err(other),
    }
}

impl DeviceInfo {
    /// As a C record (strings cut to fit).
    pub fn to_c(&self) -> abi::SparkDeviceInfo {
        let mut d = abi::SparkDeviceInfo::zeroed();
        d.index = self.index;
        d.usable = self.usable as u32;
        d.score = self.score;
        d.memory_total = self.memory_total;
        d.memory_free = self.memory_free;
        abi::write_c_chars(&mut d.name, &self.name);
        abi::write_c_chars(&mut d.capabilities, &self.capabilities);
        abi::write_c_chars(&mut d.note, &self.note);
        d
    }

    /// From a C record.
    pub fn from_c(d: &abi::SparkDeviceInfo) -> Self {
        DeviceInfo {
            index: d.index,
            name: abi::read_c_chars(&d.name),
            capabilities: abi::read_c_chars(&d.capabilities),
            memory_total: d.memory_total,
            memory_free: d.memory_free,
            score: d.score,
            usable: d.usable != 0,
            note: abi::read_c_chars(&d.note),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_info_round_trips_and_cuts_long_strings() {
        let d = DeviceInfo {
            index: 3,
            name: "é".repeat(100),
            capabilities: "avx2+fma".into(),
            memory_total: 1 << 40,
            memory_free: 5,
            score: -2,
            usable: true,
            note: "a\0b".into(),
        };
        let back = DeviceInfo::from_c(&d.to_c());
        // 127 bytes of room: 63 two-byte characters, never half of one.
        assert_eq!(back.name, "é".repeat(63));
        assert_eq!(back.note, "a b");
        assert_eq!(DeviceInfo { name: d.name.clone(), note: d.note.clone(), ..back }, d);
    }

    #[test]
    fn dtype_codes_round_trip() {
        for d in [None, Some(DType::F32), Some(DType::BF16), Some(DType::F16)] {
            assert_eq!(dtype_from_code(dtype_code(d)), Ok(d));
        }
        assert_eq!(dtype_from_code(9), Err(9));
    }
}
