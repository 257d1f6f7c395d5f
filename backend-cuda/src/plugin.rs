//! The CUDA backend as one [`BackendFactory`]: linked statically by `spark-run` (feature `cuda`)
//! and exported through the C ABI as `spark_backend_v1_cuda` of
//! `libspark_backend_cuda.so`.
//!
//! Probe: one entry per GPU, scored 100 + 10 x major compute capability (above any CPU), usable
//! from compute capability 8.0. With no driver library or no device it returns a single
//! unusable entry whose note says why; nothing panics (cudarc's panics are caught).

use std::path::Path;

use spark_core::plugin::{BackendFactory, DeviceInfo, OpenOptions};
use spark_core::{DType, Error, Executor, Model, ModelOptions, Result};

use crate::device::{self, guard, Libs};
use crate::CudaBackend;

/// The CUDA backend's factory.
pub const FACTORY: BackendFactory = BackendFactory { name: c"cuda", probe, open };

// Only with the `plugin` feature: see backend-cuda/Cargo.toml.
// Named entry point: cpu, cuda and wgpu are linked into one spark-run, so each needs its own symbol.
spark_core::export_backend!(FACTORY, spark_backend_v1_cuda);

fn unusable(note: String) -> DeviceInfo {
    DeviceInfo { index: 0, name: "cuda".into(), usable: false, note, ..Default::default() }
}

/// Every CUDA device, or one unusable entry saying why there is none.
pub fn probe() -> Vec<DeviceInfo> {
    let libs = Libs::detect();
    match guard("probe", || probe_with(&libs)) {
        Ok(v) => v,
        Err(e) => vec![unusable(e.message)],
    }
}

fn probe_with(libs: &Libs) -> Result<Vec<DeviceInfo>> {
    let n = match device::device_count(libs) {
        Ok(n) => n,
        Err(e) => return Ok(vec![unusable(e.message)]),
    };
    if n == 0 {
        return Ok(vec![unusable("no CUDA device (the driver reports 0 devices)".into())]);
    }
    let gemm = if libs.cublas { "cuBLAS" } else { "fallback GEMM (libcublas not found, slow)" };
    let kernels = if libs.nvrtc { "NVRTC" } else { "bundled PTX (libnvrtc not found)" };
    Ok((0..n)
        .map(|i| match device::open_context(i) {
            Ok((_ctx, f)) => {
                let usable = f.cc >= (8, 0);
                DeviceInfo {
                    index: i as u32,
                    name: f.name.clone(),
                    capabilities: format!("sm_{}{}, {} SMs, {gemm}, {kernels}", f.cc.0, f.cc.1, f.sms),
                    memory_total: f.mem_total,
                    memory_free: f.mem_free,
                    score: 100 + 10 * f.cc.0,
                    usable,
                    note: if usable {
                        "f32 and bf16".into()
                    } else {
                        format!("compute capability {}.{} < 8.0 (bf16 is needed)", f.cc.0, f.cc.1)
                    },
                }
            }
            Err(e) => DeviceInfo {
                index: i as u32,
                name: format!("cuda device {i}"),
                note: e.message,
                ..unusable(String::new())
            },
        })
        .collect())
}

/// Load the checkpoint directory `dir` on GPU `o.device`.
pub fn open(dir: &Path, o: &OpenOptions) -> Result<Box<dyn Executor>> {
    if o.dtype == Some(DType::F16) {
        return Err(Error::unsupported("cuda backend: f16 compute is not implemented (use --dtype bf16 or f32)"));
    }
    guard("open", || {
        let backend = CudaBackend::new(o.device as usize)?;
        let model: Box<dyn Executor> =
            Box::new(Model::load(backend, dir, &ModelOptions { ctx: o.ctx, dtype: o.dtype, quant: o.quant })?);
        Ok(model)
    })
}
