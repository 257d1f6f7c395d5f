//! One layer's K/V cache for one sequence, in device memory.
//!
//! K and V are each `[slots, kv_heads * head_dim]` of the cache dtype (f32, or bf16 stored as
//! u16): a ring of `window` slots for sliding layers (position `p` in slot `p % window`),
//! allocated whole at the start; for full layers a buffer that grows in blocks of 256 positions
//! (capped at the served context), so the bytes held stay within one block of what is used.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use spark_core::kv::{KvKind, KvSpec};
use spark_core::{DType, Error, ErrorKind, Result};

use crate::device::err;

/// Positions a growing cache adds at a time.
pub const GROW_BLOCK: usize = 256;

/// A device buffer of K and V.
pub struct KvBufs {
    pub k: CudaSlice<u8>,
    pub v: CudaSlice<u8>,
}

/// One layer's K/V for one sequence.
pub struct CudaKv {
    pub spec: KvSpec,
    /// Positions seen so far (not all of them held, for a ring).
    pub len: usize,
    /// Slots allocated.
    pub slots: usize,
    pub bufs: Option<KvBufs>,
}

/// Bytes of one element of the cache dtype (f32 or bf16; f16 is refused at allocation).
fn elem(dtype: DType) -> usize {
    dtype.size()
}

fn alloc(stream: &Arc<CudaStream>, bytes: usize) -> Result<CudaSlice<u8>> {
    stream
        .alloc_zeros::<u8>(bytes.max(1))
        .map_err(|e| Error::new(ErrorKind::OutOfMemory, format!("cuda: allocating {bytes} bytes of KV cache: {e:?}")))
}

impl CudaKv {
    /// An empty cache (a ring is allocated whole, a growing cache on first use).
    pub fn new(stream: &Arc<CudaStream>, spec: KvSpec) -> Result<CudaKv> {
        if !matches!(spec.dtype, DType::F32 | DType::BF16) {
            return Err(Error::unsupported(format!(
                "cuda backend: a {} KV cache is not implemented (use --dtype bf16 or f32)",
                spec.dtype
            )));
        }
        let mut kv = CudaKv { spec, len: 0, slots: 0, bufs: None };
        if let KvKind::Ring { window } = spec.kind {
            let bytes = window * kv.row_bytes();
            kv.bufs = Some(KvBufs { k: alloc(stream, bytes)?, v: alloc(stream, bytes)? });
            kv.slots = window;
        }
        Ok(kv)
    }

    /// Bytes of one position's K (or V).
    pub fn row_bytes(&self) -> usize {
        self.spec.kv_heads * self.spec.head_dim * elem(self.spec.dtype)
    }

    pub fn is_bf16(&self) -> bool {
        self.spec.dtype == DType::BF16
    }

    /// Slots of the ring (0 for a growing cache, where the slot is the position).
    pub fn ring(&self) -> usize {
        match self.spec.kind {
            KvKind::Ring { window } => window,
            KvKind::Grow { .. } => 0,
        }
    }

    /// Make room for positions up to `end` (a growing cache reallocates and copies).
    pub fn reserve(&mut self, stream: &Arc<CudaStream>, end: usize) -> Result<()> {
        let KvKind::Grow { max } = self.spec.kind else { return Ok(()) };
        if end > max {
            return Err(Error::new(ErrorKind::OutOfMemory, format!("KV cache full: {end} positions > {max}")));
        }
        if end <= self.slots {
            return Ok(());
        }
        let want = end.div_ceil(GROW_BLOCK).saturating_mul(GROW_BLOCK).min(max);
        let bytes = want * self.row_bytes();
        let mut k = alloc(stream, bytes)?;
        let mut v = alloc(stream, bytes)?;
        if let Some(old) = &self.bufs {
            let used = self.slots * self.row_bytes();
            if used > 0 {
                stream.memcpy_dtod(&old.k.slice(0..used), &mut k.slice_mut(0..used)).map_err(|e| err("KV copy", e))?;
                stream.memcpy_dtod(&old.v.slice(0..used), &mut v.slice_mut(0..used)).map_err(|e| err("KV copy", e))?;
            }
        }
        self.bufs = Some(KvBufs { k, v });
        self.slots = want;
        Ok(())
    }

    /// Device pointers of K and V (0 while nothing is allocated: no cached position is read then).
    pub fn ptrs(&self, stream: &Arc<CudaStream>) -> (u64, u64) {
        match &self.bufs {
            Some(b) => (b.k.device_ptr(stream).0, b.v.device_ptr(stream).0),
            None => (0, 0),
        }
    }

    pub fn truncate(&mut self, new_len: usize) {
        self.len = self.len.min(new_len);
    }

    pub fn bytes(&self) -> usize {
        self.bufs.as_ref().map_or(0, |b| b.k.len() + b.v.len())
    }

    pub fn try_clone(&self, stream: &Arc<CudaStream>) -> Result<CudaKv> {
        let bufs = match &self.bufs {
            Some(b) => Some(KvBufs {
                k: stream.clone_dtod(&b.k).map_err(|e| err("KV clone", e))?,
                v: stream.clone_dtod(&b.v).map_err(|e| err("KV clone", e))?,
            }),
            None => None,
        };
        Ok(CudaKv { spec: self.spec, len: self.len, slots: self.slots, bufs })
    }
}
