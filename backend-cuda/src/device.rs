//! Finding the CUDA libraries and devices without panicking, and turning cudarc's errors into
//! spark's.
//!
//! cudarc loads libcuda, libcublas and libnvrtc at run time and panics when one is missing, so
//! every entry point first checks that the library can be opened ([`Libs::detect`]) and runs
//! cudarc calls under [`guard`], which turns a panic into an [`Error`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use spark_core::{Error, ErrorKind, Result};

/// Which of the run-time libraries can be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Libs {
    /// libcuda.so (the driver): required.
    pub driver: bool,
    /// libcublas.so: GEMMs (else the fallback GEMM kernels, slow).
    pub cublas: bool,
    /// libnvrtc.so: compile the kernels for the device (else the bundled PTX).
    pub nvrtc: bool,
}

impl Libs {
    /// Try to open each library (nothing is kept open by this check beyond what the dynamic
    /// loader caches).
    pub fn detect() -> Libs {
        // SAFETY: each `is_culib_present` only tries `libloading::Library::new` on candidate file
        // names and drops the handle; opening the NVIDIA libraries runs their initialisers, which
        // have no preconditions.
        let (driver, cublas, nvrtc) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::cublas::sys::is_culib_present(),
                cudarc::nvrtc::sys::is_culib_present(),
            )
        };
        Libs { driver, cublas, nvrtc }
    }
}

/// A backend error naming what failed.
pub fn err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::new(ErrorKind::Backend, format!("cuda: {what}: {e:?}"))
}

/// Run `f` (cudarc calls), turning a panic (a missing library or symbol) into an error.
pub fn guard<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::new(ErrorKind::Backend, format!("cuda: {what}: {msg}")))
        }
    }
}

/// Facts about one device.
#[derive(Debug, Clone)]
pub struct DeviceFacts {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    pub sms: i32,
    /// Bytes of dynamic shared memory a block may take once a kernel opts in.
    pub shared_optin: i32,
    pub mem_total: u64,
    pub mem_free: u64,
}

/// The number of CUDA devices, or why there are none. Checks the driver library first.
pub fn device_count(libs: &Libs) -> Result<usize> {
    if !libs.driver {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "libcuda.so not found: no NVIDIA driver is installed (or it is not on the library path)",
        ));
    }
    guard("counting devices", || {
        match cudarc::driver::result::init() {
            Ok(()) => {}
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => {
                return Err(Error::new(ErrorKind::Unsupported, "no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)"))
            }
            Err(e) => return Err(err("cuInit failed (driver and GPU do not work together?)", e)),
        }
        let n = CudaContext::device_count().map_err(|e| err("cuDeviceGetCount", e))?;
        Ok(n.max(0) as usize)
    })
}

/// Open a context on device `ordinal` (the primary context) and read its facts.
pub fn open_context(ordinal: usize) -> Result<(Arc<CudaContext>, DeviceFacts)> {
    guard("opening the device", || {
        let ctx = CudaContext::new(ordinal).map_err(|e| err(&format!("creating a context on device {ordinal}"), e))?;
        let name = ctx.name().map_err(|e| err("device name", e))?;
        let cc = ctx.compute_capability().map_err(|e| err("compute capability", e))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| err("multiprocessor count", e))?;
        let shared_optin = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| err("shared memory per block", e))?;
        let (free, total) = ctx.mem_get_info().map_err(|e| err("memory info", e))?;
        Ok((ctx, DeviceFacts { ordinal, name, cc, sms, shared_optin, mem_total: total as u64, mem_free: free as u64 }))
    })
}
