//! The CPU backend as one [`BackendFactory`]: linked statically by `spark-run` (feature `cpu`)
//! and exported through the C ABI as `spark_backend_v1` of `libspark_backend_cpu.so`, so both
//! paths run the same probe and open.
//!
//! Probe: one device, the processor, scored by SIMD level for `--backend auto` in the spirit of
//! ggml's scored CPU variants (portable 10, AVX2+FMA 20, AVX-512F 30, AMX 40,
//! below any accelerator's 100+).

use std::path::Path;

use spark_core::plugin::{BackendFactory, DeviceInfo, OpenOptions};
use spark_core::{Error, Executor, Model, ModelOptions, Result};

use crate::kernels::qmatmul::{I6Layout, QMat};
use crate::kernels::QSimd;
use crate::{CpuBackend, Simd};

/// The CPU backend's factory.
pub const FACTORY: BackendFactory = BackendFactory { name: c"cpu", probe, open };

spark_core::export_backend!(FACTORY);

/// The score of a SIMD level.
pub fn score(simd: Simd) -> i32 {
    match simd {
        Simd::Portable => 10,
        Simd::Avx2 => 20,
        Simd::Avx512 => 30,
        Simd::Amx => 40,
    }
}

/// The float and the integer kernel levels (e.g. `avx512f+amx-bf16, int8 avx512-vnni+amx-int8,
/// int6 vbmi`: the last where int6 is held in the layout AVX-512 VBMI unpacks).
fn capabilities() -> String {
    let (simd, qs) = (Simd::detect(), QSimd::detect());
    let i6 = if QMat::i6_layout_at(qs) == I6Layout::Groups { ", int6 vbmi" } else { "" };
    format!("{}, int8 {}{i6}", simd.name(), qs.name())
}

/// The processor as the one device.
pub fn probe() -> Vec<DeviceInfo> {
    let simd = Simd::detect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (memory_total, memory_free) = meminfo();
    vec![DeviceInfo {
        index: 0,
        name: cpu_model().unwrap_or_else(|| std::env::consts::ARCH.to_string()),
        capabilities: capabilities(),
        memory_total,
        memory_free,
        score: score(simd),
        usable: true,
        note: format!("{threads} threads by default"),
    }]
}

/// Load the checkpoint directory `dir` on the CPU.
pub fn open(dir: &Path, o: &OpenOptions) -> Result<Box<dyn Executor>> {
    if o.device != 0 {
        return Err(Error::invalid(format!("cpu backend: device {} does not exist (the only device is 0)", o.device)));
    }
    let backend = CpuBackend::new(o.threads)?;
    Ok(Box::new(Model::load(backend, dir, &ModelOptions { ctx: o.ctx, dtype: o.dtype, quant: o.quant })?))
}

/// The processor's model name, from `/proc/cpuinfo` where there is one.
fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}

/// (total, available) bytes of memory, from `/proc/meminfo` where there is one (else zeros).
fn meminfo() -> (u64, u64) {
    let Ok(info) = std::fs::read_to_string("/proc/meminfo") else { return (0, 0) };
    let kib = |key: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |k| k * 1024)
    };
    (kib("MemTotal:"), kib("MemAvailable:"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_reports_one_usable_device_scored_by_simd() {
        let d = probe();
        assert_eq!(d.len(), 1);
        assert!(d[0].usable);
        assert_eq!(d[0].score, score(Simd::detect()));
        assert!(d[0].capabilities.starts_with(Simd::detect().name()), "{}", d[0].capabilities);
        let int8 = format!("int8 {}", QSimd::detect().name());
        assert!(d[0].capabilities.contains(&int8), "{}", d[0].capabilities);
        let vbmi = QMat::i6_layout_at(QSimd::detect()) == I6Layout::Groups;
        assert_eq!(d[0].capabilities.ends_with(", int6 vbmi"), vbmi, "{}", d[0].capabilities);
    }

    #[test]
    fn open_refuses_a_missing_device_and_a_missing_checkpoint() {
        let e = open(Path::new("/nonexistent"), &OpenOptions { device: 3, ..Default::default() }).err().unwrap();
        assert!(e.message.contains("device 3"), "{e}");
        let e = open(Path::new("/nonexistent/ckpt"), &OpenOptions::default()).err().unwrap();
        assert!(e.message.contains("/nonexistent/ckpt"), "{e}");
    }
}
