//! One layer's K/V cache for one sequence, in device buffers, laid out as backend-cpu's:
//! `[slot][kv_heads * head_dim]` for K and for V; a ring of `window` slots for sliding layers
//! (position `p` in slot `p % window`), a growing array for full layers (grown in blocks of 256
//! positions up to the served context, the old contents copied on the device). bf16 and f16
//! caches are stored packed (two values to a `u32`); the values written are already rounded to
//! that type, so nothing is lost.

use spark_core::kv::{KvKind, KvSpec};
use spark_core::{DType, Error, ErrorKind, Result};

use crate::gpu::{Gpu, GpuBuf};
use crate::shaders::Elem;

/// Positions a growing cache adds at a time.
const GROW_BLOCK: usize = 256;

/// One layer's K/V for one sequence.
pub struct WgpuKv {
    pub spec: KvSpec,
    pub elem: Elem,
    /// Positions seen so far (not all of them held, for a ring).
    pub len: usize,
    /// Slots allocated.
    pub cap: usize,
    pub k: Option<GpuBuf>,
    pub v: Option<GpuBuf>,
}

impl WgpuKv {
    pub fn new(gpu: &Gpu, spec: KvSpec) -> Result<WgpuKv> {
        let kvd = spec.kv_heads * spec.head_dim;
        let elem = match spec.dtype {
            DType::BF16 if kvd.is_multiple_of(2) => Elem::BF16,
            DType::F16 if kvd.is_multiple_of(2) => Elem::F16,
            _ => Elem::F32,
        };
        let mut kv = WgpuKv { spec, elem, len: 0, cap: 0, k: None, v: None };
        if let KvKind::Ring { window } = spec.kind {
            kv.k = Some(gpu.buffer_zeroed("kv ring K", kv.slot_bytes() * window as u64)?);
            kv.v = Some(gpu.buffer_zeroed("kv ring V", kv.slot_bytes() * window as u64)?);
            kv.cap = window;
        }
        Ok(kv)
    }

    /// Bytes of one slot of K (or of V).
    pub fn slot_bytes(&self) -> u64 {
        let kvd = (self.spec.kv_heads * self.spec.head_dim) as u64;
        match self.elem {
            Elem::F32 => kvd * 4,
            _ => kvd * 2,
        }
    }

    /// Ring size, or 0 for a growing cache (the kernels' `slots`).
    pub fn ring_slots(&self) -> usize {
        match self.spec.kind {
            KvKind::Ring { window } => window,
            KvKind::Grow { .. } => 0,
        }
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        [&self.k, &self.v].iter().map(|b| b.as_ref().map_or(0, |b| b.size as usize)).sum()
    }

    /// Make room for positions `..end` (a growing cache; a ring always has room).
    pub fn reserve(&mut self, gpu: &Gpu, end: usize) -> Result<()> {
        let KvKind::Grow { max } = self.spec.kind else { return Ok(()) };
        if end > max {
            return Err(Error::new(ErrorKind::OutOfMemory, format!("KV cache full: {end} positions > {max}")));
        }
        if end <= self.cap {
            return Ok(());
        }
        let cap = end.div_ceil(GROW_BLOCK).saturating_mul(GROW_BLOCK).min(max);
        let bytes = self.slot_bytes() * cap as u64;
        let keep = self.slot_bytes() * self.len.min(self.cap) as u64;
        let k = gpu.buffer_zeroed("kv K", bytes)?;
        let v = gpu.buffer_zeroed("kv V", bytes)?;
        if let (Some(ok), Some(ov)) = (&self.k, &self.v) {
            gpu.copy(ok, 0, &k, 0, keep)?;
            gpu.copy(ov, 0, &v, 0, keep)?;
        }
        self.k = Some(k);
        self.v = Some(v);
        self.cap = cap;
        Ok(())
    }

    pub fn truncate(&mut self, new_len: usize) {
        self.len = self.len.min(new_len);
    }

    /// A copy with its own buffers (the copy is recorded on the device).
    pub fn duplicate(&self, gpu: &Gpu) -> Result<WgpuKv> {
        let dup = |b: &Option<GpuBuf>| -> Result<Option<GpuBuf>> {
            match b {
                None => Ok(None),
                Some(b) => {
                    let n = gpu.buffer_zeroed("kv copy", b.size)?;
                    gpu.copy(b, 0, &n, 0, b.size)?;
                    Ok(Some(n))
                }
            }
        };
        Ok(WgpuKv {
            spec: self.spec,
            elem: self.elem,
            len: self.len,
            cap: self.cap,
            k: dup(&self.k)?,
            v: dup(&self.v)?,
        })
    }
}
