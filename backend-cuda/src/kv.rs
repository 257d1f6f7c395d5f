//! One layer's K/V cache for one sequence, in device memory, in the layout kernels.cu reads
//! (`kv_row`).
//!
//! K and V rows are `kv_heads * head_dim` elements of the cache dtype (f32, or bf16 stored as
//! u16). A sliding layer keeps a ring of `window` rows (position `p` in row `p % window`),
//! allocated whole at the start. A full layer's cache is paged: pages of [`KV_PAGE`] rows are
//! allocated as the sequence grows (capped at the served context) and never move, and a device
//! table of page addresses (one for K, one for V, sized for the context) is what the kernels get.
//! So growing copies nothing, and the bytes held stay within one page of what is used. A fork
//! shares its source's pages; a page shared by several sequences is copied before one of them
//! writes into it (copy on write), so forks of a long context cost a table, not its pages.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use spark_core::kv::{KvKind, KvSpec};
use spark_core::{DType, Error, ErrorKind, Result};

use crate::device::err;

/// Positions per page of a full layer's cache (`KV_PAGE` in kernels.cu).
pub const KV_PAGE: usize = 64;

/// A ring's K and V buffers.
pub struct KvBufs {
    pub k: CudaSlice<u8>,
    pub v: CudaSlice<u8>,
}

/// A full layer's pages and their address tables.
pub struct KvPages {
    /// K and V pages, in position order (shared with forks until written).
    pub k: Vec<Arc<CudaSlice<u8>>>,
    pub v: Vec<Arc<CudaSlice<u8>>>,
    /// Device tables of the pages' addresses (entries past the last page are 0).
    pub k_table: CudaSlice<u64>,
    pub v_table: CudaSlice<u64>,
}

/// One layer's K/V for one sequence.
pub struct CudaKv {
    pub spec: KvSpec,
    /// Positions seen so far (not all of them held, for a ring).
    pub len: usize,
    /// Positions the allocated rows hold (a ring's window; a paged cache's pages x KV_PAGE).
    pub slots: usize,
    /// A ring's buffers.
    pub bufs: Option<KvBufs>,
    /// A paged cache's pages (allocated on first use).
    pub pages: Option<KvPages>,
}

fn alloc(stream: &Arc<CudaStream>, bytes: usize) -> Result<CudaSlice<u8>> {
    stream
        .alloc_zeros::<u8>(bytes.max(1))
        .map_err(|e| Error::new(ErrorKind::OutOfMemory, format!("cuda: allocating {bytes} bytes of KV cache: {e:?}")))
}

impl CudaKv {
    /// An empty cache (a ring is allocated whole, a paged cache's pages on use).
    pub fn new(stream: &Arc<CudaStream>, spec: KvSpec) -> Result<CudaKv> {
        if !matches!(spec.dtype, DType::F32 | DType::BF16) {
            return Err(Error::unsupported(format!(
                "cuda backend: a {} KV cache is not implemented (use --dtype bf16 or f32)",
                spec.dtype
            )));
        }
        let mut kv = CudaKv { spec, len: 0, slots: 0, bufs: None, pages: None };
        if let KvKind::Ring { window } = spec.kind {
            let bytes = window * kv.row_bytes();
            kv.bufs = Some(KvBufs { k: alloc(stream, bytes)?, v: alloc(stream, bytes)? });
            kv.slots = window;
        }
        Ok(kv)
    }

    /// Bytes of one position's K (or V).
    pub fn row_bytes(&self) -> usize {
        self.spec.kv_heads * self.spec.head_dim * self.spec.dtype.size()
    }

    pub fn is_bf16(&self) -> bool {
        self.spec.dtype == DType::BF16
    }

    /// Rows of the ring, or 0 for a paged cache (the kernels' `ring` argument).
    pub fn ring(&self) -> usize {
        match self.spec.kind {
            KvKind::Ring { window } => window,
            KvKind::Grow { .. } => 0,
        }
    }

    /// Make positions `start..end` writable: a paged cache adds pages (and their table entries)
    /// up to `end`, and copies the pages in that range that it shares with a fork.
    pub fn reserve(&mut self, stream: &Arc<CudaStream>, start: usize, end: usize) -> Result<()> {
        let KvKind::Grow { max } = self.spec.kind else { return Ok(()) };
        if end > max {
            return Err(Error::new(ErrorKind::OutOfMemory, format!("KV cache full: {end} positions > {max}")));
        }
        if end <= start {
            return Ok(());
        }
        let page_bytes = KV_PAGE * self.row_bytes();
        if self.pages.is_none() {
            let n = max.div_ceil(KV_PAGE);
            let table = || stream.alloc_zeros::<u64>(n).map_err(|e| err("allocating a KV page table", e));
            self.pages = Some(KvPages { k: vec![], v: vec![], k_table: table()?, v_table: table()? });
        }
        let pages = self.pages.as_mut().expect("allocated above");
        // Shared pages the range writes into: a private copy each.
        let held = pages.k.len();
        for j in start / KV_PAGE..held.min(end.div_ceil(KV_PAGE)) {
            for (list, table) in [(&mut pages.k, &mut pages.k_table), (&mut pages.v, &mut pages.v_table)] {
                if Arc::strong_count(&list[j]) > 1 {
                    let mut own = alloc(stream, page_bytes)?;
                    stream.memcpy_dtod(list[j].as_ref(), &mut own).map_err(|e| err("KV page copy", e))?;
                    let addr = own.device_ptr(stream).0;
                    list[j] = Arc::new(own);
                    stream
                        .memcpy_htod(&[addr], &mut table.slice_mut(j..j + 1))
                        .map_err(|e| err("writing the KV page table", e))?;
                }
            }
        }
        // New pages up to `end`, and their addresses into both tables (in stream order: before
        // any kernel launched after this reads them; kernels launched before read older entries
        // only).
        while pages.k.len() * KV_PAGE < end {
            pages.k.push(Arc::new(alloc(stream, page_bytes)?));
            pages.v.push(Arc::new(alloc(stream, page_bytes)?));
        }
        let last = pages.k.len();
        if last > held {
            let addrs =
                |v: &[Arc<CudaSlice<u8>>]| -> Vec<u64> { v[held..].iter().map(|p| p.device_ptr(stream).0).collect() };
            let (ka, va) = (addrs(&pages.k), addrs(&pages.v));
            stream
                .memcpy_htod(&ka, &mut pages.k_table.slice_mut(held..last))
                .map_err(|e| err("writing the KV page table", e))?;
            stream
                .memcpy_htod(&va, &mut pages.v_table.slice_mut(held..last))
                .map_err(|e| err("writing the KV page table", e))?;
        }
        self.slots = last * KV_PAGE;
        Ok(())
    }

    /// The kernels' K and V cache arguments: a ring's buffers, or a paged cache's page tables
    /// (0 while nothing is allocated: no cached position is read then).
    pub fn ptrs(&self, stream: &Arc<CudaStream>) -> (u64, u64) {
        if let Some(b) = &self.bufs {
            return (b.k.device_ptr(stream).0, b.v.device_ptr(stream).0);
        }
        match &self.pages {
            Some(p) => (p.k_table.device_ptr(stream).0, p.v_table.device_ptr(stream).0),
            None => (0, 0),
        }
    }

    pub fn truncate(&mut self, new_len: usize) {
        self.len = self.len.min(new_len);
    }

    /// Device bytes held: ring buffers, or pages and their tables, a page shared by n sequences
    /// counting 1/n here (so that the sum over sequences is what the device holds).
    pub fn bytes(&self) -> usize {
        let ring = self.bufs.as_ref().map_or(0, |b| b.k.len() + b.v.len());
        let pages = self.pages.as_ref().map_or(0, |p| {
            let page = |s: &Arc<CudaSlice<u8>>| s.len() / Arc::strong_count(s);
            p.k.iter().chain(&p.v).map(page).sum::<usize>() + 8 * (p.k_table.len() + p.v_table.len())
        });
        ring + pages
    }

    /// A fork: a ring is copied; a paged cache shares the pages (copied when either side writes
    /// into one, see [`CudaKv::reserve`]) under new tables.
    pub fn try_clone(&self, stream: &Arc<CudaStream>) -> Result<CudaKv> {
        let bufs = match &self.bufs {
            Some(b) => Some(KvBufs {
                k: stream.clone_dtod(&b.k).map_err(|e| err("KV clone", e))?,
                v: stream.clone_dtod(&b.v).map_err(|e| err("KV clone", e))?,
            }),
            None => None,
        };
        let pages = match &self.pages {
            Some(p) => {
                let k_table = stream.clone_dtod(&p.k_table).map_err(|e| err("KV page table clone", e))?;
                let v_table = stream.clone_dtod(&p.v_table).map_err(|e| err("KV page table clone", e))?;
                Some(KvPages { k: p.k.clone(), v: p.v.clone(), k_table, v_table })
            }
            None => None,
        };
        Ok(CudaKv { spec: self.spec, len: self.len, slots: self.slots, bufs, pages })
    }
}
