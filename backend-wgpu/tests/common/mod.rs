//! Helpers shared by the wgpu tests: opening the adapter (or skipping visibly without one),
//! repository paths, golden tensors, and comparisons.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use spark_backend_wgpu::{plugin, WgpuBackend, WgpuOptions};

/// The wgpu backend on the first adapter, or `None` (after saying so on stderr) when this
/// machine has none.
pub fn backend(subgroups: bool) -> Option<WgpuBackend> {
    let devices = plugin::probe();
    if !devices.iter().any(|d| d.usable) {
        eprintln!("skipped: no wgpu adapter ({})", devices.first().map_or("", |d| d.note.as_str()));
        return None;
    }
    let b = WgpuBackend::new(WgpuOptions { device: 0, subgroups }).expect("an adapter was probed but does not open");
    eprintln!("wgpu adapter: {} (subgroups: {})", b.adapter(), b.uses_subgroups());
    Some(b)
}

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A golden tensor: f32 data (ids converted).
pub struct Gold {
    pub data: Vec<f32>,
    pub ids: Vec<u32>,
}

/// Every tensor of a golden.safetensors file.
pub fn load_golden(path: &Path) -> HashMap<String, Gold> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out = HashMap::new();
    for (name, t) in st.tensors() {
        let (data, ids) = match t.dtype() {
            safetensors::Dtype::F32 => {
                (t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(), vec![])
            }
            safetensors::Dtype::I64 => {
                (vec![], t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect())
            }
            other => panic!("unexpected golden dtype {other:?} for {name}"),
        };
        out.insert(name, Gold { data, ids });
    }
    out
}

/// Largest |a - b|.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Mean |a - b|.
pub fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
