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
///
/// Blocked: a task takes a block of queries and the query heads that share one KV head, and
/// reads each key and value row once for all of them (the row stays in L1 for up to 32 dot
/// products or axpys) instead of once per (query, head). Per (query, head) the arithmetic is the
/// exact two-pass softmax of the reference, in the same order as a one-row loop: scores rounded
/// to the activation type, max, `exp`, sum, probabilities rounded, then `sum_j p_j v_j` rounded.
/// Sliding layers read at most `window` keys per query, so their cost does not grow with the
/// context.
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
    let group = shape.n_heads / shape.n_kv_heads;
    let ocols = out.cols;
    assert!(out.rows >= chunk.row + chunk.len && ocols == qd, "attend: output has the wrong shape");
    let threads = rayon::current_num_threads().max(1);
    // Blocks as large as keep the pool busy: up to 8 queries x all heads of a KV group.
    let mut qb = QUERY_BLOCK.min(chunk.len);
    while qb > 1 && chunk.len.div_ceil(qb) * shape.n_kv_heads < 2 * threads {
        qb /= 2;
    }
    let hb = if chunk.len.div_ceil(qb) * shape.n_kv_heads >= 2 * threads { group } else { 1 };
    let qblocks = chunk.len.div_ceil(qb);
    let hblocks = shape.n_heads / hb;
    let outp = SharedOut(out.data.as_mut_ptr());
    (0..qblocks * hblocks).into_par_iter().for_each_init(Scratch::default, |scratch, task| {
        let (qi, hi) = (task / hblocks, task % hblocks);
        let i0 = qi * qb;
        let i1 = (i0 + qb).min(chunk.len);
        let h0 = hi * hb;
        let rows = Block { i0, i1, h0, h1: h0 + hb, kvh: h0 / group };
        attend_block(simd, qkv, chunk, shape, kv, rows, round, scratch, outp, ocols);
    });
}

/// Queries per attention task at most.
const QUERY_BLOCK: usize = 8;

/// One attention task: queries `i0..i1` of the chunk and heads `h0..h1`, which all read KV
/// head `kvh`.
#[derive(Clone, Copy)]
struct Block {
    i0: usize,
    i1: usize,
    h0: usize,
    h1: usize,
    kvh: usize,
}

impl Block {
    /// Calls `f(query, head, row)` for every (query, head) of the block, `row` numbering them
    /// query-major from 0.
    #[inline]
    fn each_row(&self, mut f: impl FnMut(usize, usize, usize)) {
        let nh = self.h1 - self.h0;
        for i in self.i0..self.i1 {
            for h in self.h0..self.h1 {
                f(i, h, (i - self.i0) * nh + (h - self.h0));
            }
        }
    }
}

/// A task's buffers, reused across tasks on one thread.
#[derive(Default)]
struct Scratch {
    /// `[row][key]` scores, then probabilities.
    scores: Vec<f32>,
    /// `[row][head_dim]` accumulators.
    acc: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn attend_block(
    simd: Simd,
    qkv: &CpuTensor,
    chunk: AttnChunk,
    shape: AttnShape,
    kv: &CpuKv,
    b: Block,
    round: DType,
    scratch: &mut Scratch,
    outp: SharedOut,
    ocols: usize,
) {
    let d = shape.head_dim;
    let qd = shape.n_heads * d;
    let kvd = shape.n_kv_heads * d;
    let kvh = b.kvh;
    let nh = b.h1 - b.h0;
    let nrows = (b.i1 - b.i0) * nh;
    // Query i sees positions lo(i)..=p(i); the block reads the union.
    let pos_of = |i: usize| chunk.start_pos + i;
    let lo_of = |i: usize| shape.window.map_or(0, |w| (pos_of(i) + 1).saturating_sub(w));
    let (lo, hi) = (lo_of(b.i0), pos_of(b.i1 - 1));
    let span = hi + 1 - lo;
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
    let query = |i: usize, h: usize| &qkv.data[(chunk.row + i) * qkv.cols + h * d..][..d];
    scratch.scores.clear();
    scratch.scores.resize(nrows * span, 0.0);
    // Pass 1: scores, each key row read once for the whole block.
    let sees = |i: usize, pos: usize| (lo_of(i)..=pos_of(i)).contains(&pos);
    for pos in lo..=hi {
        let k = key(pos);
        b.each_row(|i, h, r| {
            if sees(i, pos) {
                scratch.scores[r * span + pos - lo] = round.round(round.round(dot(simd, query(i, h), k)) * shape.scale);
            }
        });
    }
    // Pass 2: softmax per row over its own keys, probabilities rounded to the activation type.
    for i in b.i0..b.i1 {
        let (a, z) = (lo_of(i) - lo, pos_of(i) - lo + 1);
        for h in b.h0..b.h1 {
            let r = (i - b.i0) * nh + (h - b.h0);
            let s = &mut scratch.scores[r * span + a..r * span + z];
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for v in s.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            let inv = 1.0 / sum;
            for v in s.iter_mut() {
                *v = round.round(*v * inv);
            }
        }
    }
    // Pass 3: `sum_j p_j v_j`, each value row read once for the whole block.
    scratch.acc.clear();
    scratch.acc.resize(nrows * d, 0.0);
    for pos in lo..=hi {
        let v = value(pos);
        b.each_row(|i, _, r| {
            if sees(i, pos) {
                axpy(simd, scratch.scores[r * span + pos - lo], v, &mut scratch.acc[r * d..(r + 1) * d]);
            }
        });
    }
    for i in b.i0..b.i1 {
        for h in b.h0..b.h1 {
            let r = (i - b.i0) * nh + (h - b.h0);
            // SAFETY: this task alone owns out[chunk.row + i][h*d..(h+1)*d] (tasks split queries
            // and heads disjointly), and the row is inside `out` (asserted by `attend`).
            let o = unsafe { std::slice::from_raw_parts_mut(outp.get().add((chunk.row + i) * ocols + h * d), d) };
            for (o, &a) in o.iter_mut().zip(&scratch.acc[r * d..(r + 1) * d]) {
                *o = round.round(a);
            }
        }
    }
}
