//! Helpers shared by the cross-crate tests: repository paths and golden tensors.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A golden tensor: f32 data (ids converted) and its shape.
pub struct Gold {
    pub shape: Vec<usize>,
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
        out.insert(name, Gold { shape: t.shape().to_vec(), data, ids });
    }
    out
}

/// Largest |a - b|.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
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
