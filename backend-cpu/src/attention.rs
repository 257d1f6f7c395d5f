//! Attention on the CPU over one sequence's KV cache.
//!
//! The cache ([`CpuKv`]) holds K and V as `[slot][kv_heads * head_dim]`: a ring of `window`
//! slots for sliding layers (position `p` in slot `p % window`), a growing array for full
//! layers. A chunk's queries read cached positions below `start_pos` from the cache and the
//! chunk's own keys straight from the fused QKV activations, so a prefill longer than the window
//! never needs keys the ring has already overwritten; the new K/V are appended afterwards.

use rayon::prelude::*;
use spark_core::backend::{AttnChunk, AttnShape};
use spark_core::kv::{KvKind, KvSpec};
use spark_core::{DType, Error, Result};

use crate::kernels::{axpy, dot, Row, SharedOut, Simd};
use crate::CpuTensor;

#[derive(Clone)]
enum Store {
    F32(Vec<f32>),
    BF16(Vec<u16>),
}

impl Store {
    fn row(&self, slot: usize, off: usize, d: usize) -> Row<'_> {
        match self {
            Store::F32(v) => Row::F32(&v[slot * off..][..d]),
            Store::BF16(v) => Row::BF16(&v[slot * off..][..d]),
        }
    }
}

/// One layer's K/V for one sequence.
#[derive(Clone)]
pub struct CpuKv {
    spec: KvSpec,
    len: usize,
    k: Store,
    v: Store,
}

impl CpuKv {
    pub fn new(spec: KvSpec) -> CpuKv {
        let slots = match spec.kind {
            KvKind::Ring { window } => window,
            KvKind::Grow { .. } => 0,
        };
        let n = slots * spec.kv_heads * spec.head_dim;
        let store = || match spec.dtype {
            DType::BF16 => Store::BF16(vec![0; n]),
            _ => Store::F32(vec![0.0; n]),
        };
        CpuKv { spec, len: 0, k: store(), v: store() }
    }

    /// Positions seen so far (not all of them held, for a ring).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn truncate(&mut self, new_len: usize) {
        if let KvKind::Grow { .. } = self.spec.kind {
            let n = new_len * self.spec.kv_heads * self.spec.head_dim;
            match (&mut self.k, &mut self.v) {
                (Store::F32(k), Store::F32(v)) => {
                    k.truncate(n);
                    v.truncate(n);
                }
                (Store::BF16(k), Store::BF16(v)) => {
                    k.truncate(n);
                    v.truncate(n);
                }
                _ => {}
            }
        }
        self.len = self.len.min(new_len);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let n = |s: &Store| match s {
            Store::F32(v) => v.capacity() * 4,
            Store::BF16(v) => v.capacity() * 2,
        };
        n(&self.k) + n(&self.v)
    }

    fn slot(&self, pos: usize) -> usize {
        match self.spec.kind {
            KvKind::Ring { window } => pos % window,
            KvKind::Grow { .. } => pos,
        }
    }

    /// Append the chunk's K and V rows (the last `window` of them, for a ring).
    pub fn append(&mut self, qkv: &CpuTensor, chunk: AttnChunk, shape: AttnShape) -> Result<()> {
        let kvd = shape.n_kv_heads * shape.head_dim;
        let qd = shape.n_heads * shape.head_dim;
        let end = chunk.start_pos + chunk.len;
        if let KvKind::Grow { max } = self.spec.kind {
            if end > max {
                return Err(Error::new(
                    spark_core::ErrorKind::OutOfMemory,
                    format!("KV cache full: {end} positions > {max}"),
                ));
            }
        }
        if let KvKind::Grow { max } = self.spec.kind {
            // Grow in blocks of 256 positions (capped at the context), not by doubling, so the
            // bytes held stay within one block of what is used.
            let want = end.div_ceil(256).saturating_mul(256).min(max) * kvd;
            for store in [&mut self.k, &mut self.v] {
                match store {
                    Store::F32(s) if s.capacity() < want => s.reserve_exact(want - s.len()),
                    Store::BF16(s) if s.capacity() < want => s.reserve_exact(want - s.len()),
                    _ => {}
                }
            }
        }
        let first = match self.spec.kind {
            KvKind::Ring { window } => end.saturating_sub(window).max(chunk.start_pos),
            KvKind::Grow { .. } => chunk.start_pos,
        };
        for pos in first..end {
            let row = &qkv.data[(chunk.row + pos - chunk.start_pos) * qkv.cols..][..qkv.cols];
            let (kr, vr) = (&row[qd..qd + kvd], &row[qd + kvd..qd + 2 * kvd]);
            let slot = self.slot(pos);
            for (store, src) in [(&mut self.k, kr), (&mut self.v, vr)] {
                match (store, self.spec.kind) {
                    (Store::F32(s), KvKind::Grow { .. }) => s.extend_from_slice(src),
                    (Store::BF16(s), KvKind::Grow { .. }) => {
                        s.extend(src.iter().map(|&x| half::bf16::from_f32(x).to_bits()))
                    }
                    (Store::F32(s), KvKind::Ring { .. }) => s[slot * kvd..(slot + 1) * kvd].copy_from_slice(src),
                    (Store::BF16(s), KvKind::Ring { .. }) => {
                        for (d, &x) in s[slot * kvd..(slot + 1) * kvd].iter_mut().zip(src) {
                            *d = half::bf16::from_f32(x).to_bits();
                        }
                    }
                }
            }
        }
        self.len = end;
        Ok(())
    }
}

/// Attention of a chunk's queries; writes rows `chunk.row..chunk.row+chunk.len` of `out`.
pub fn attend(
    simd: Simd,
    qkv: &CpuTensor,
    chunk: AttnChunk,
    shape: AttnShape,
    kv: &CpuKv,
    out: &mut CpuTensor,
    round: DType,
) {
    let d = shape.head_dim;
    let qd = shape.n_heads * d;
    let kvd = shape.n_kv_heads * d;
    let group = shape.n_heads / shape.n_kv_heads;
    let ocols = out.cols;
    assert!(out.rows >= chunk.row + chunk.len && ocols == qd, "attend: output has the wrong shape");
    let outp = SharedOut(out.data.as_mut_ptr());
    (0..chunk.len * shape.n_heads).into_par_iter().for_each_init(Vec::new, |scores: &mut Vec<f32>, task| {
        let (i, h) = (task / shape.n_heads, task % shape.n_heads);
        let kvh = h / group;
        let p = chunk.start_pos + i;
        let lo = shape.window.map_or(0, |w| (p + 1).saturating_sub(w));
        let qrow = &qkv.data[(chunk.row + i) * qkv.cols..][..qkv.cols];
        let q = &qrow[h * d..(h + 1) * d];
        let key = |pos: usize| -> Row<'_> {
            if pos >= chunk.start_pos {
                let r = &qkv.data[(chunk.row + pos - chunk.start_pos) * qkv.cols..][..qkv.cols];
                Row::F32(&r[qd + kvh * d..qd + (kvh + 1) * d])
            } else {
                kv.k.row(kv.slot(pos), kvd, kvd).slice(kvh * d, d)
            }
        };
        let value = |pos: usize| -> Row<'_> {
            if pos >= chunk.start_pos {
                let r = &qkv.data[(chunk.row + pos - chunk.start_pos) * qkv.cols..][..qkv.cols];
                Row::F32(&r[qd + kvd + kvh * d..qd + kvd + (kvh + 1) * d])
            } else {
                kv.v.row(kv.slot(pos), kvd, kvd).slice(kvh * d, d)
            }
        };
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for pos in lo..=p {
            let s = round.round(round.round(dot(simd, q, key(pos))) * shape.scale);
            max = max.max(s);
            scores.push(s);
        }
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        // SAFETY: task (i, h) owns out[chunk.row + i][h*d..(h+1)*d]; no other task writes there,
        // and the row is inside `out` (asserted above).
        let o = unsafe { std::slice::from_raw_parts_mut(outp.get().add((chunk.row + i) * ocols + h * d), d) };
        o.fill(0.0);
        for (j, pos) in (lo..=p).enumerate() {
            let pj = round.round(scores[j] * inv);
            axpy(simd, pj, value(pos), o);
        }
        for v in o.iter_mut() {
            *v = round.round(*v);
        }
    });
}
