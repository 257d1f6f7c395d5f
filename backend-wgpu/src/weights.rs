//! Weights and RoPE tables on the device.
//!
//! A weight is kept in the compute type (f32, or bf16/f16 packed two to a `u32`; RMSNorm
//! vectors always f32) and split by rows into parts that each fit one storage binding, so the
//! 131072-row embedding/head of the real models works on adapters whose bindings are limited
//! (lavapipe: 128 MiB). Conversion happens in chunks straight into the mapped upload buffer.

use spark_core::backend::WeightRole;
use spark_core::rope::RopeTable;
use spark_core::weights::Tensor as HostTensor;
use spark_core::{DType, Error, ErrorKind, Result};

use crate::gpu::{Gpu, GpuBuf};
use crate::shaders::Elem;

/// Elements converted per chunk at load.
const CONVERT_CHUNK: usize = 1 << 20;

/// The element type a compute dtype is stored as.
pub fn elem_of(d: DType) -> Elem {
    match d {
        DType::F32 => Elem::F32,
        DType::BF16 => Elem::BF16,
        DType::F16 => Elem::F16,
    }
}

/// Rows `r0..r0+rows` of a weight in one buffer.
pub struct Part {
    pub r0: usize,
    pub rows: usize,
    pub buf: GpuBuf,
}

/// An uploaded weight: a vector (`rows == 1`) or an `[rows, cols]` matrix.
pub struct WgpuWeight {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    pub parts: Vec<Part>,
}

impl WgpuWeight {
    pub fn elem(&self) -> Elem {
        elem_of(self.dtype)
    }

    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.buf.size).sum()
    }

    pub fn upload(gpu: &Gpu, t: &HostTensor, role: WeightRole, dtype: DType) -> Result<WgpuWeight> {
        let (rows, cols) = match t.shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            s => return Err(Error::model(format!("tensor '{}' has shape {s:?}; expected 1 or 2 dims", t.name))),
        };
        // RMSNorm weights are read as f32 by the kernel.
        let dtype = if role == WeightRole::Norm { DType::F32 } else { dtype };
        let bytes = t.bytes();
        if bytes.len() != rows * cols * t.dtype.size() {
            return Err(Error::model(format!(
                "tensor '{}' holds {} bytes, its shape {:?} in {} needs {}",
                t.name,
                bytes.len(),
                t.shape,
                t.dtype,
                rows * cols * t.dtype.size()
            )));
        }
        let esize = dtype.size();
        let row_bytes = (cols * esize) as u64;
        let mut per_part = (gpu.max_binding() / row_bytes.max(1)) as usize;
        if esize == 2 && cols % 2 == 1 {
            per_part &= !1; // keep every part's first element on a u32 boundary
        }
        if per_part == 0 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "wgpu: one row of '{}' ({row_bytes} bytes) is larger than a storage binding may be on {} ({} bytes)",
                    t.name,
                    gpu.info.name,
                    gpu.max_binding()
                ),
            ));
        }
        let mut parts = Vec::new();
        let mut r0 = 0;
        while r0 < rows {
            let n = per_part.min(rows - r0);
            let src = &bytes[r0 * cols * t.dtype.size()..(r0 + n) * cols * t.dtype.size()];
            let buf = gpu.buffer_init(&t.name, (n * cols * esize) as u64, |dst| convert(src, t.dtype, dst, dtype))?;
            parts.push(Part { r0, rows: n, buf });
            r0 += n;
        }
        Ok(WgpuWeight { rows, cols, dtype, parts })
    }
}

/// Convert little-endian `src` of `from` into `to`, a chunk at a time, through `write`.
fn convert(src: &[u8], from: DType, write: &mut dyn FnMut(usize, &[u8]), to: DType) {
    if from == to {
        write(0, src);
        return;
    }
    let mut tmp = Vec::with_capacity(CONVERT_CHUNK);
    let mut out = 0;
    for chunk in src.chunks(CONVERT_CHUNK * from.size()) {
        tmp.clear();
        spark_core::dtype::decode_into(from, chunk, &mut tmp);
        let enc = spark_core::dtype::encode(to, &tmp);
        write(out, &enc);
        out += enc.len();
    }
}

/// A RoPE table on the device.
pub struct WgpuRope {
    pub rot_dims: usize,
    pub positions: usize,
    pub cos: GpuBuf,
    pub sin: GpuBuf,
}

impl WgpuRope {
    pub fn upload(gpu: &Gpu, t: &RopeTable) -> Result<WgpuRope> {
        let up = |name: &str, v: &[f32]| {
            gpu.buffer_init(name, (v.len() * 4) as u64, |write| write(0, bytemuck::cast_slice(v)))
        };
        Ok(WgpuRope {
            rot_dims: t.rot_dims,
            positions: t.positions,
            cos: up("rope cos", &t.cos)?,
            sin: up("rope sin", &t.sin)?,
        })
    }
}
