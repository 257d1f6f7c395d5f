//! The wgpu backend as one [`BackendFactory`]: linked statically by `spark-run` (feature `wgpu`)
//! and exported through the C ABI as `spark_backend_v1_wgpu` of
//! `libspark_backend_wgpu.so`.
//!
//! Probe: one device per Vulkan/Metal/DX12 adapter. Scores for `--backend auto`: a discrete GPU
//! 150, an integrated one 120, a virtual one 100, anything else 60; a software rasteriser
//! (lavapipe, WARP, SwiftShader: device type `Cpu`) 5, below every CPU backend variant (10-50),
//! so `auto` never prefers it. With no adapter (no Vulkan loader or driver) the probe reports a
//! single unusable device whose note says why; nothing panics.

use std::path::Path;

use spark_core::plugin::{BackendFactory, DeviceInfo, OpenOptions};
use spark_core::{Error, Executor, Model, ModelOptions, Result};

use crate::gpu::{adapters, Found};
use crate::{WgpuBackend, WgpuOptions};

/// The wgpu backend's factory.
pub const FACTORY: BackendFactory = BackendFactory { name: c"wgpu", probe, open };

// Only with the `plugin` feature: see backend-wgpu/Cargo.toml.
// Named entry point: cpu, cuda and wgpu are linked into one spark-run, so each needs its own symbol.
spark_core::export_backend!(FACTORY, spark_backend_v1_wgpu);

/// The score of an adapter type.
pub fn score(t: wgpu::DeviceType) -> i32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 150,
        wgpu::DeviceType::IntegratedGpu => 120,
        wgpu::DeviceType::VirtualGpu => 100,
        wgpu::DeviceType::Other => 60,
        wgpu::DeviceType::Cpu => 5,
    }
}

fn describe(f: &Found) -> (String, String) {
    let feats = f.adapter.features();
    let mut caps = vec![format!("{:?}", f.info.backend).to_lowercase(), "f32/bf16/f16".to_string()];
    if feats.contains(wgpu::Features::SUBGROUP) {
        caps.push("subgroups".into());
    }
    if feats.contains(wgpu::Features::SHADER_F16) {
        caps.push("shader-f16".into());
    }
    let mut note = format!("{:?}, driver {} {}", f.info.device_type, f.info.driver, f.info.driver_info);
    if f.info.device_type == wgpu::DeviceType::Cpu {
        note.push_str("; a software rasteriser: slower than the cpu backend, never chosen by --backend auto");
    }
    (caps.join(" "), note.trim().to_string())
}

/// The adapters wgpu finds, or one unusable entry saying why there are none.
pub fn probe() -> Vec<DeviceInfo> {
    let found = match std::panic::catch_unwind(adapters) {
        Ok(f) => f,
        Err(_) => {
            return vec![unusable("wgpu panicked while looking for adapters (broken Vulkan installation?)".into())]
        }
    };
    if found.is_empty() {
        return vec![unusable(
            "no Vulkan/Metal/DX12 adapter found (on Linux install a Vulkan driver, e.g. `apt-get install mesa-vulkan-drivers` for lavapipe)"
                .into(),
        )];
    }
    found
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let (capabilities, note) = describe(f);
            DeviceInfo {
                index: i as u32,
                name: f.info.name.clone(),
                capabilities,
                memory_total: 0,
                memory_free: 0,
                score: score(f.info.device_type),
                usable: true,
                note,
            }
        })
        .collect()
}

fn unusable(note: String) -> DeviceInfo {
    DeviceInfo {
        index: 0,
        name: "no adapter".into(),
        capabilities: String::new(),
        memory_total: 0,
        memory_free: 0,
        score: 0,
        usable: false,
        note,
    }
}

/// Load the checkpoint directory `dir` on adapter `o.device` (`o.threads` does not apply).
pub fn open(dir: &Path, o: &OpenOptions) -> Result<Box<dyn Executor>> {
    let backend = WgpuBackend::new(WgpuOptions { device: o.device as usize, subgroups: true })
        .map_err(|e| Error::new(e.kind, e.message))?;
    Ok(Box::new(Model::load(backend, dir, &ModelOptions { ctx: o.ctx, dtype: o.dtype, quant: o.quant })?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics_and_explains_itself() {
        let d = probe();
        assert!(!d.is_empty());
        for dev in &d {
            eprintln!(
                "wgpu probe: {} [{}] score {} usable {} ({})",
                dev.name, dev.capabilities, dev.score, dev.usable, dev.note
            );
            if !dev.usable {
                assert!(!dev.note.is_empty());
            }
        }
    }

    #[test]
    fn software_adapters_score_below_the_cpu_backend() {
        assert!(score(wgpu::DeviceType::Cpu) < 10);
        assert!(score(wgpu::DeviceType::DiscreteGpu) >= 100);
    }

    #[test]
    fn open_refuses_a_missing_device_and_a_missing_checkpoint() {
        let e = open(Path::new("/nonexistent"), &OpenOptions { device: 99, ..Default::default() }).err().unwrap();
        assert!(e.message.contains("99") || e.message.contains("no Vulkan"), "{e}");
        if !probe()[0].usable {
            return;
        }
        let e = open(Path::new("/nonexistent/ckpt"), &OpenOptions::default()).err().unwrap();
        assert!(e.message.contains("/nonexistent/ckpt"), "{e}");
    }
}
