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
/// context. Memory does not grow with it either: a task holds the scores of at most
/// `SCORE_BUDGET` (16 MiB); a longer span (full layers deep into a long context) runs the same
/// passes segment by segment, recomputing the scores (bit-identical, about twice the
/// attention arithmetic) instead of an online softmax, which could not round the normalized
/// probabilities to the activation type as the reference does.
///
/// With AMX and bf16 activations, chunks of at least 16 queries (prefill) run the products on
/// AMX tiles instead ([`crate::kernels::attn_amx`]): the call's keys and values are packed once
/// (blocks of up to 64 rows), or past 64 MiB of them (`AMX_PACK_BUDGET`) by each block (of up
/// to 256 rows) a run of positions at a time; the scores and weighted values are sums of the
/// same exact bf16 products in another order (the softmax and every rounding as above, except
/// that a span held in one segment takes its `exp` 16 at a time, within 2 ulps: the
/// probabilities can then differ from the one-row loops' by a bf16 unit). CPUs
/// without AMX run the same tile products on the same layouts in other instructions
/// (`Products`): `vdpbf16ps` where it is fast (AMD's Zen 4/5), f32 FMAs on the other AVX-512
/// cores (Intel's, with or without AVX512_BF16).
pub fn attend(
    simd: Simd,
    qkv: &CpuTensor,
    chunk: AttnChunk,
    shape: AttnShape,
    kv: &CpuKv,
    out: &mut CpuTensor,
    round: DType,
) {
    attend_with_budget(simd, qkv, chunk, shape, kv, out, round, SCORE_BUDGET, Loops::Bf16Tiles, AMX_PACK_BUDGET)
}

/// The loops a call may take (tests compare them): the one-row loops, the f32 tile loops where
/// the head dim allows ([`crate::kernels::attn_avx2`], [`crate::kernels::attn_avx512`]), or also
/// the bf16 tiles for prefill with bf16 activations, their products as [`Products::for_cpu`]
/// picks them or (tests) as given.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Loops {
    OneRow,
    /// Only tests ask for the f32 tiles without the bf16 ones (they compare the two).
    #[cfg_attr(not(test), allow(dead_code))]
    F32Tiles,
    Bf16Tiles,
    /// The bf16 tiles with these products, whatever the CPU would pick (tests run each one
    /// this CPU can).
    #[cfg_attr(not(test), allow(dead_code))]
    Bf16TilesAs(Products),
}

/// What computes the bf16 tiles' products (the layouts of [`crate::kernels::attn_amx`]): AMX
/// tiles, `vdpbf16ps`, or f32 FMAs. The same exact products of bf16 values, summed in f32 in
/// three orders.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum Products {
    /// AMX BF16 tiles (`tdpbf16ps`).
    Amx,
    /// AVX512_BF16 `vdpbf16ps` ([`crate::kernels::attn_amx::scores_dp`], `weighted_dp`).
    Dp,
    /// AVX-512F FMAs on the bf16 values widened to f32 ([`crate::kernels::attn_amx::scores_fma`],
    /// `weighted_fma`).
    Fma,
}

impl Products {
    /// The products at level `simd` on this CPU, if any: AMX at the `Amx` level (granted); at
    /// the `Avx512` level, `vdpbf16ps` where present and fast, else (Intel cores,
    /// [`crate::kernels::matmul::vdpbf16ps_is_slow`], and AVX-512 cores without AVX512_BF16)
    /// FMAs, given AVX-512BW for the packing. On one thread pair of an Emerald Rapids guest
    /// (2048 and 8192 cached positions, 512 queries, the 1.7B shape's full layer) the FMA tiles
    /// took 0.76-0.81 of the `vdpbf16ps` tiles' time with a scalar `exp` in the softmax and
    /// 0.70-0.78 with it vectorized, and the `vdpbf16ps` tiles 0.54-0.57 of the f32 loops'
    /// (docs/BENCHMARKS.md, session 49).
    pub(crate) fn for_cpu(simd: Simd) -> Option<Products> {
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::{amx, avx512bf16, matmul::vdpbf16ps_is_slow};
            match simd {
                Simd::Amx if amx::available() => Some(Products::Amx),
                Simd::Avx512 if avx512bf16::available() && !vdpbf16ps_is_slow() => Some(Products::Dp),
                Simd::Avx512 if Products::Fma.available() => Some(Products::Fma),
                _ => None,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = simd;
            None
        }
    }

    /// Whether this CPU can run these products.
    pub(crate) fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Products::Amx => crate::kernels::amx::available(),
                Products::Dp => crate::kernels::avx512bf16::available(),
                Products::Fma => is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

/// Bytes of scores one attention task holds at most (16 MiB: a decode block of 8 heads keeps
/// up to 512k positions in one pass, a prefill block of 64 rows 64k).
const SCORE_BUDGET: usize = 16 << 20;

/// [`attend`] with the task's score memory capped at `score_budget` bytes (tests force the
/// segmented passes with a small one); `tiles`: the tile loops where the head dim allows
/// ([`crate::kernels::attn_avx2`], [`crate::kernels::attn_avx512`], AMX), else the one-row
/// loops (tests compare the two); `amx_budget`: the most bytes of keys and values packed once
/// per call for AMX (tests force per-block packing with 0).
#[allow(clippy::too_many_arguments)]
fn attend_with_budget(
    simd: Simd,
    qkv: &CpuTensor,
    chunk: AttnChunk,
    shape: AttnShape,
    kv: &CpuKv,
    out: &mut CpuTensor,
    round: DType,
    score_budget: usize,
    loops: Loops,
    amx_budget: usize,
) {
    let d = shape.head_dim;
    let qd = shape.n_heads * d;
    let group = shape.n_heads / shape.n_kv_heads;
    let ocols = out.cols;
    assert!(out.rows >= chunk.row + chunk.len && ocols == qd, "attend: output has the wrong shape");
    let threads = rayon::current_num_threads().max(1);
    let products = match loops {
        Loops::Bf16Tiles => Products::for_cpu(simd),
        Loops::Bf16TilesAs(p) => {
            assert!(p.available(), "attend: {p:?} tile products on a CPU without them");
            Some(p)
        }
        Loops::OneRow | Loops::F32Tiles => None,
    };
    let packed = amx_pack(qkv, chunk, shape, kv, round, products, amx_budget);
    let tiles = loops != Loops::OneRow;
    // Blocks as large as keep the pool busy: up to 8 queries x all heads of a KV group (with AMX
    // tiles, up to 64 rows, every packed key and value then serving four row tiles; 256 where
    // each block packs its own).
    let amx_rows = match &packed {
        // Blocks that pack their own keys and values: as many rows as keep the call's whole
        // span of scores within the score budget (one pass, not three), within 64..=256.
        Some(Amx::PerBlock) => (score_budget / (4 * call_span(chunk, shape).1)).clamp(AMX_ROWS, AMX_ROWS_PACKING),
        _ => AMX_ROWS,
    };
    let (query_block, hb_max) = match &packed {
        Some(_) if group <= amx_rows => (amx_rows / group, group),
        Some(_) => (amx_rows, 1),
        None => (QUERY_BLOCK, group),
    };
    let mut qb = query_block.min(chunk.len);
    while qb > 1 && chunk.len.div_ceil(qb) * shape.n_kv_heads < 2 * threads {
        qb /= 2;
    }
    let qblocks = chunk.len.div_ceil(qb);
    let hb = if qblocks * shape.n_kv_heads >= 2 * threads {
        hb_max
    } else if qblocks == 1 {
        // One query block (decode): the blocks are equal, so one per thread balances; each
        // takes as many of a KV head's query heads as leaves a block for every thread, since
        // the blocks of one KV head each read all its keys and values.
        (1..=hb_max).rev().find(|&h| hb_max % h == 0 && shape.n_heads / h >= threads).unwrap_or(1)
    } else {
        1
    };
    let hblocks = shape.n_heads / hb;
    let outp = SharedOut(out.data.as_mut_ptr());
    (0..qblocks * hblocks).into_par_iter().for_each_init(Scratch::default, |scratch, task| {
        let (qi, hi) = (task / hblocks, task % hblocks);
        let i0 = qi * qb;
        let i1 = (i0 + qb).min(chunk.len);
        let h0 = hi * hb;
        let rows = Block { i0, i1, h0, h1: h0 + hb, kvh: h0 / group };
        let args = BlockArgs {
            qkv,
            chunk,
            shape,
            kv,
            round,
            outp,
            ocols,
            score_budget,
            tiles,
            amx: packed.as_ref(),
            products: products.unwrap_or(Products::Amx),
        };
        attend_block(simd, &args, rows, scratch);
    });
}

/// Rows of an AMX attention block at most: on keys and values packed once per call, and for a
/// block that packs its own.
#[cfg(target_arch = "x86_64")]
const AMX_ROWS: usize = crate::kernels::attn_amx::ROWS;
#[cfg(target_arch = "x86_64")]
const AMX_ROWS_PACKING: usize = crate::kernels::attn_amx::ROWS_PACKING;
#[cfg(not(target_arch = "x86_64"))]
const AMX_ROWS: usize = 64;
#[cfg(not(target_arch = "x86_64"))]
const AMX_ROWS_PACKING: usize = 256;

/// Keys and values packed into AMX tiles (x86-64 only; elsewhere no value exists).
#[cfg(target_arch = "x86_64")]
type Packed = crate::kernels::attn_amx::PackedKv;
#[cfg(not(target_arch = "x86_64"))]
enum Packed {}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
/// How a call's blocks reach AMX tiles.
enum Amx {
    /// The call's keys and values, packed once for every block.
    Shared(Packed),
    /// The span is past [`AMX_PACK_BUDGET`] (full layers deep into a long context): each block
    /// packs the keys and values it reads, [`AMX_BLOCK_SEGMENT`] positions at a time (the keys
    /// once per pass), in memory that does not grow with the context.
    PerBlock,
}

/// Positions a block that packs its own keys and values packs at a time (1 MiB of packed keys
/// and values at head dim 256).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const AMX_BLOCK_SEGMENT: usize = 1024;

/// Calls `f(packed, kvh, q0, q1)` for the runs `q0..=q1` of positions `s0..=s1` an AMX block
/// reads at a time, `packed` holding their keys (`values` false) or values with KV head `kvh`
/// as its head `kvh`: on the call's shared packing, the whole range at once; else
/// [`AMX_BLOCK_SEGMENT`] positions at a time, packed into `own` here (as head 0).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn amx_runs<'a>(
    mode: &Amx,
    own: &mut Option<Packed>,
    kvh: usize,
    d: usize,
    (s0, s1): (usize, usize),
    values: bool,
    row: &(dyn Fn(bool, usize, usize) -> Row<'a> + Sync),
    mut f: impl FnMut(&Packed, usize, usize, usize),
) {
    match mode {
        Amx::Shared(p) => f(p, kvh, s0, s1),
        Amx::PerBlock => {
            let own = own.get_or_insert_with(Packed::default);
            for q0 in (s0..=s1).step_by(AMX_BLOCK_SEGMENT) {
                let q1 = (q0 + AMX_BLOCK_SEGMENT - 1).min(s1);
                // SAFETY: AVX-512F/BW (a bf16-tile block exists only with AMX or AVX512_BF16).
                unsafe { own.repack(kvh..kvh + 1, d, q0, q1 + 1 - q0, row, (!values, values), false) };
                f(own, 0, q0, q1);
            }
        }
    }
}

/// Queries per call from which attention runs on AMX tiles (fewer: decode, whose blocks have
/// too few rows to fill a tile, stays on the f32 loops).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const AMX_MIN_QUERIES: usize = 16;

/// The most bytes of packed keys and values one call holds (64 MiB: 32k positions of the 1.7B
/// shape's two KV heads of 256); a longer span (full layers deep into a long context) is
/// packed by each block, segment by segment ([`Amx::PerBlock`]).
const AMX_PACK_BUDGET: usize = 64 << 20;

/// The positions a chunk's queries read, all of them together: `(first, count)`.
fn call_span(chunk: AttnChunk, shape: AttnShape) -> (usize, usize) {
    let lo = shape.window.map_or(0, |w| (chunk.start_pos + 1).saturating_sub(w));
    (lo, chunk.start_pos + chunk.len - lo)
}

/// Key (`value` false) or value row of KV head `kvh` at `pos`: from the chunk's own fused QKV
/// activations at `pos >= chunk.start_pos`, else from the cache.
fn kv_row<'a>(
    qkv: &'a CpuTensor,
    chunk: AttnChunk,
    shape: AttnShape,
    kv: &'a CpuKv,
    value: bool,
    kvh: usize,
    pos: usize,
) -> Row<'a> {
    let d = shape.head_dim;
    let qd = shape.n_heads * d;
    let kvd = shape.n_kv_heads * d;
    if pos >= chunk.start_pos {
        let r = &qkv.data[(chunk.row + pos - chunk.start_pos) * qkv.cols..][..qkv.cols];
        let off = qd + if value { kvd } else { 0 } + kvh * d;
        Row::F32(&r[off..off + d])
    } else {
        let store = if value { &kv.v } else { &kv.k };
        store.row(kv.slot(pos), kvd, kvd).slice(kvh * d, d)
    }
}

/// Whether this call runs on the bf16 tiles, and how: `products` for them (AMX granted, or
/// [`Products::Dp`] / [`Products::Fma`] available), activations rounded to bf16 (so q, k, v and
/// the probabilities are bf16 values), head dims a multiple of 32, at least [`AMX_MIN_QUERIES`]
/// queries; the keys and values packed once here when they take at most `pack_budget` bytes,
/// else by each block.
fn amx_pack(
    qkv: &CpuTensor,
    chunk: AttnChunk,
    shape: AttnShape,
    kv: &CpuKv,
    round: DType,
    products: Option<Products>,
    pack_budget: usize,
) -> Option<Amx> {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::attn_amx::PackedKv;
        let d = shape.head_dim;
        if !(products.is_some() && round == DType::BF16 && d.is_multiple_of(32) && chunk.len >= AMX_MIN_QUERIES) {
            return None;
        }
        let (lo, n) = call_span(chunk, shape);
        if PackedKv::bytes(shape.n_kv_heads, d, n) > pack_budget {
            return Some(Amx::PerBlock);
        }
        let row = |value: bool, kvh: usize, pos: usize| kv_row(qkv, chunk, shape, kv, value, kvh, pos);
        // SAFETY: every kind of products is available only with AVX-512F and AVX-512BW (AMX
        // and AVX512_BF16 imply both; `Products::available` checks them for FMAs).
        Some(Amx::Shared(unsafe { PackedKv::pack(shape.n_kv_heads, d, lo, n, &row) }))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (qkv, chunk, shape, kv, round, products, pack_budget);
        None
    }
}

/// What every block of one call shares.
struct BlockArgs<'a> {
    qkv: &'a CpuTensor,
    chunk: AttnChunk,
    shape: AttnShape,
    kv: &'a CpuKv,
    round: DType,
    outp: SharedOut,
    ocols: usize,
    score_budget: usize,
    tiles: bool,
    amx: Option<&'a Amx>,
    /// With `amx`: what computes the tile products (not read without).
    products: Products,
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
    /// `[KV_TILE][head_dim]` keys or values widened to f32, for a tile of mixed rows (the
    /// tile loops; none today: see `for_tiles`).
    tile: Vec<f32>,
    /// `[KV_TILE]` one row's scores in a tile.
    dots: Vec<f32>,
    /// AMX: the block's queries as A tiles.
    qa: Vec<u16>,
    /// [`Products::Fma`]: the block's queries as A tiles of f32.
    qa32: Vec<f32>,
    /// AMX: a segment's probabilities as A tiles.
    pa: Vec<u16>,
    /// [`Products::Fma`]: a segment's probabilities as A tiles of f32.
    pa32: Vec<f32>,
    /// AMX: one key group's score tiles.
    ctiles: Vec<[f32; 256]>,
    /// AMX: a segment's keys and values, for a block that packs its own ([`Amx::PerBlock`]).
    own: Option<Packed>,
}

/// One tile's key or value rows for the tile loops: a pointer to each row's `d` values, all of
/// one element type.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy)]
enum TileRows<'t> {
    F32(&'t [*const f32]),
    /// The bf16 bits of a bf16 cache's rows.
    BF16(&'t [*const u16]),
}

/// Calls `f(t0, t1, rows)` for each tile `t0..=t1` of at most [`KV_TILE`] positions in
/// `lo..=hi`, `rows` pointing at `row(pos)` for the tile's positions where they lie (a bf16
/// cache read as bf16). A tile never straddles `split` (the chunk's first position: the cache
/// below, the chunk's f32 activations from it), so its rows share one type; rows of any other
/// mix (none today) are widened to f32 into `tile` first.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn for_tiles<'a>(
    lo: usize,
    hi: usize,
    split: usize,
    d: usize,
    tile: &mut Vec<f32>,
    row: impl Fn(usize) -> Row<'a>,
    mut f: impl FnMut(usize, usize, TileRows<'_>),
) {
    let mut pf = [std::ptr::null::<f32>(); KV_TILE];
    let mut pb = [std::ptr::null::<u16>(); KV_TILE];
    let mut t0 = lo;
    while t0 <= hi {
        let mut t1 = (t0 + KV_TILE - 1).min(hi);
        if t0 < split {
            t1 = t1.min(split - 1);
        }
        let n = t1 + 1 - t0;
        let (mut nf, mut nb) = (0, 0);
        for pos in t0..=t1 {
            match row(pos) {
                Row::F32(r) => {
                    pf[nf] = r.as_ptr();
                    nf += 1;
                }
                Row::BF16(r) => {
                    pb[nb] = r.as_ptr();
                    nb += 1;
                }
                Row::F16(_) => {}
            }
        }
        if nf == n {
            f(t0, t1, TileRows::F32(&pf[..n]));
        } else if nb == n {
            f(t0, t1, TileRows::BF16(&pb[..n]));
        } else {
            tile.resize(KV_TILE * d, 0.0);
            for (j, pos) in (t0..=t1).enumerate() {
                row(pos).to_f32(&mut tile[j * d..(j + 1) * d]);
                pf[j] = tile[j * d..].as_ptr();
            }
            f(t0, t1, TileRows::F32(&pf[..n]));
        }
        t0 = t1 + 1;
    }
}

/// Key / value rows per tile of the tile loops (32 KiB of f32 at head_dim 128).
const KV_TILE: usize = 64;

#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
#[inline(never)]
fn attend_block(simd: Simd, args: &BlockArgs<'_>, b: Block, scratch: &mut Scratch) {
    let &BlockArgs { qkv, chunk, shape, kv, round, outp, ocols, score_budget, tiles, amx, products } = args;
    let d = shape.head_dim;
    let kvh = b.kvh;
    let nh = b.h1 - b.h0;
    let nrows = (b.i1 - b.i0) * nh;
    // Query i sees positions lo(i)..=p(i); the block reads the union.
    let pos_of = |i: usize| chunk.start_pos + i;
    let lo_of = |i: usize| shape.window.map_or(0, |w| (pos_of(i) + 1).saturating_sub(w));
    let (lo, hi) = (lo_of(b.i0), pos_of(b.i1 - 1));
    let span = hi + 1 - lo;
    let key = |pos: usize| kv_row(qkv, chunk, shape, kv, false, kvh, pos);
    let row = |value: bool, kvh: usize, pos: usize| kv_row(qkv, chunk, shape, kv, value, kvh, pos);
    let value = |pos: usize| kv_row(qkv, chunk, shape, kv, true, kvh, pos);
    let query = |i: usize, h: usize| &qkv.data[(chunk.row + i) * qkv.cols + h * d..][..d];
    let Scratch { scores, acc, tile, dots, qa, qa32, pa, pa32, ctiles, own } = scratch;
    // AVX2 or AVX-512 with head dims a multiple of 32: the same sums, over tiles of f32 rows.
    let wide = amx.is_none() && tiles && cfg!(target_arch = "x86_64") && simd >= Simd::Avx2 && d.is_multiple_of(32);
    let avx512 = simd >= Simd::Avx512;
    if wide {
        dots.resize(KV_TILE, 0.0);
    }
    // AMX: the block's rows in row tiles of 16 (the last one padded with zero queries).
    let nrt = nrows.div_ceil(16);
    #[cfg(target_arch = "x86_64")]
    if amx.is_some() {
        debug_assert!(nrows <= AMX_ROWS_PACKING);
        let mut rows = Vec::with_capacity(nrows);
        b.each_row(|i, h, _| rows.push(query(i, h)));
        ctiles.resize(nrt, [0.0; 256]);
        // SAFETY: an AMX block exists only when its products are available (`amx_pack`), each
        // kind with AVX-512F/BW; the rows are d long, d a multiple of 32. With AMX the tile
        // state is released at the end of this function.
        unsafe {
            crate::kernels::attn_amx::pack_queries(&rows, d, qa);
            match products {
                Products::Amx => crate::kernels::attn_amx::begin(),
                Products::Fma => crate::kernels::attn_amx::widen_bf16(qa, qa32),
                Products::Dp => {}
            }
        }
    }
    // The positions of row `i` inside `t0..=t1`, if any.
    let range = |i: usize, t0: usize, t1: usize| {
        let (a, z) = (lo_of(i).max(t0), pos_of(i).min(t1));
        (a <= z).then_some((a, z))
    };
    let sees = |i: usize, pos: usize| (lo_of(i)..=pos_of(i)).contains(&pos);
    acc.clear();
    acc.resize(if amx.is_some() { nrt * 16 } else { nrows } * d, 0.0);
    // Positions per segment of scores held at once (a multiple of the KV tile). A span that
    // fits is one segment and one pass: scores, softmax per row over its own keys (probabilities
    // rounded to the activation type), weighted values. A longer one (full layers deep into a
    // long context) takes three passes over its segments, the scores recomputed in each (the
    // same operations in the same order, so the same bits): row maxima, row sums, then the
    // probabilities and the weighted values, in memory that does not grow with the context.
    let seg = (score_budget / (4 * nrows)).max(KV_TILE) / KV_TILE * KV_TILE;
    let long = span > seg;
    let seg = seg.min(span);
    scores.clear();
    scores.resize(nrows * seg + 2 * nrows, 0.0);
    let (sc, stats) = scores.split_at_mut(nrows * seg);
    let (maxes, sums) = stats.split_at_mut(nrows);
    maxes.fill(f32::NEG_INFINITY);
    for pass in 0..if long { 3 } else { 1 } {
        for s0 in (lo..=hi).step_by(seg) {
            let s1 = (s0 + seg - 1).min(hi);
            let len = s1 + 1 - s0;
            // Scores of positions s0..=s1 (`[row][len]`), each key row read once for the block.
            if let Some(mode) = amx {
                #[cfg(target_arch = "x86_64")]
                {
                    use crate::kernels::attn_amx::{
                        scale_scores, scores as amx_scores, scores_dp, scores_fma, KEY_GROUP,
                    };
                    let ct = &mut ctiles[..nrt];
                    amx_runs(mode, own, kvh, d, (s0, s1), false, &row, |p, kvh, q0, q1| {
                        for g in (q0 - p.base()) / KEY_GROUP..=(q1 - p.base()) / KEY_GROUP {
                            let gp = p.base() + g * KEY_GROUP;
                            // SAFETY: with AMX the tile configuration is loaded on this thread
                            // (above), else the products' instructions are available
                            // (`amx_pack`); qa (qa32 for FMAs) holds nrt row tiles of d / 32
                            // steps, ct nrt tiles; positions q0..=q1 lie in the packed span, so
                            // group g is one of its groups.
                            unsafe {
                                match products {
                                    Products::Dp => scores_dp(p, kvh, g, qa, nrt, ct),
                                    Products::Fma => scores_fma(p, kvh, g, qa32, nrt, ct),
                                    Products::Amx => amx_scores(p, kvh, g, qa, nrt, ct),
                                }
                            };
                            let (t0, t1) = (gp.max(q0), (gp + KEY_GROUP - 1).min(q1));
                            b.each_row(|i, _, r| {
                                if let Some((a, z)) = range(i, t0, t1) {
                                    let c = &ct[r / 16][(r % 16) * 16..][..16];
                                    // SAFETY: AVX-512F (AMX or AVX512_BF16); the destination holds the
                                    // z - a + 1 scores of row r from position a.
                                    unsafe {
                                        scale_scores(&c[a - gp..=z - gp], shape.scale, &mut sc[r * len + a - s0..])
                                    };
                                }
                            });
                        }
                    });
                }
                #[cfg(not(target_arch = "x86_64"))]
                {
                    let _ = mode;
                    unreachable!("AMX attention exists on x86-64 only");
                }
            } else if wide {
                #[cfg(target_arch = "x86_64")]
                for_tiles(s0, s1, chunk.start_pos, d, tile, key, |t0, t1, rows| {
                    b.each_row(|i, h, r| {
                        if let Some((a, z)) = range(i, t0, t1) {
                            let (q, op) = (query(i, h).as_ptr(), dots.as_mut_ptr());
                            use crate::kernels::{attn_avx2 as a2, attn_avx512 as a5};
                            // SAFETY: Simd::Avx512 implies AVX-512F, AVX2 and FMA, Simd::Avx2
                            // AVX2 and FMA; d % 32 == 0; each row pointer holds d values (see
                            // for_tiles); dots holds KV_TILE >= z - a + 1.
                            unsafe {
                                match (rows, avx512) {
                                    (TileRows::F32(k), true) => a5::dots(q, &k[a - t0..=z - t0], d, op),
                                    (TileRows::BF16(k), true) => a5::dots(q, &k[a - t0..=z - t0], d, op),
                                    (TileRows::F32(k), false) => a2::dots(q, &k[a - t0..=z - t0], d, op),
                                    (TileRows::BF16(k), false) => a2::dots(q, &k[a - t0..=z - t0], d, op),
                                }
                            };
                            for (j, &v) in dots[..z - a + 1].iter().enumerate() {
                                sc[r * len + a - s0 + j] = round.round(round.round(v) * shape.scale);
                            }
                        }
                    });
                });
            } else {
                for pos in s0..=s1 {
                    let k = key(pos);
                    b.each_row(|i, h, r| {
                        if sees(i, pos) {
                            sc[r * len + pos - s0] = round.round(round.round(dot(simd, query(i, h), k)) * shape.scale);
                        }
                    });
                }
            }
            for i in b.i0..b.i1 {
                let Some((a, z)) = range(i, s0, s1) else { continue };
                for h in b.h0..b.h1 {
                    let r = (i - b.i0) * nh + (h - b.h0);
                    let s = &mut sc[r * len + a - s0..r * len + z - s0 + 1];
                    match (long, pass) {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: AVX-512F (AMX or AVX512_BF16); this path rounds to bf16.
                        (false, _) if amx.is_some() => unsafe { crate::kernels::attn_amx::softmax_bf16(s) },
                        (false, _) => {
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
                        (true, 0) => maxes[r] = s.iter().copied().fold(maxes[r], f32::max),
                        (true, 1) => {
                            for &v in s.iter() {
                                sums[r] += (v - maxes[r]).exp();
                            }
                        }
                        (true, _) => {
                            let inv = 1.0 / sums[r];
                            for v in s.iter_mut() {
                                *v = round.round((*v - maxes[r]).exp() * inv);
                            }
                        }
                    }
                }
            }
            if long && pass < 2 {
                continue;
            }
            // `acc[r] += sum_j p_j v_j` over s0..=s1, each value row read once for the block.
            if let Some(mode) = amx {
                #[cfg(target_arch = "x86_64")]
                {
                    use crate::kernels::attn_amx::{bf16_bits, weighted, weighted_dp, weighted_fma, VALUE_BLOCK};
                    amx_runs(mode, own, kvh, d, (s0, s1), true, &row, |p, kvh, q0, q1| {
                        // The probabilities as A tiles `[block][row tile]` (16 rows x 32 positions,
                        // bf16: rounded to bf16 above, so the high halves exactly; for FMAs the
                        // f32 values themselves), zero where a row does not see a position.
                        let b0 = (q0 - p.base()) / VALUE_BLOCK;
                        let nb = (q1 - p.base()) / VALUE_BLOCK + 1 - b0;
                        let fma = products == Products::Fma;
                        if fma {
                            pa32.clear();
                            pa32.resize(nb * nrt * 512, 0.0);
                        } else {
                            pa.clear();
                            pa.resize(nb * nrt * 512, 0);
                        }
                        b.each_row(|i, _, r| {
                            if let Some((a, z)) = range(i, q0, q1) {
                                let (rt, ri) = (r / 16, r % 16);
                                // Runs of positions inside one value block, a tile row each.
                                let mut pos = a;
                                while pos <= z {
                                    let (bi, j) = ((pos - p.base()) / VALUE_BLOCK - b0, (pos - p.base()) % VALUE_BLOCK);
                                    let run = (VALUE_BLOCK - j).min(z + 1 - pos);
                                    let (at, src) =
                                        ((bi * nrt + rt) * 512 + ri * 32 + j, &sc[r * len + pos - s0..][..run]);
                                    if fma {
                                        pa32[at..][..run].copy_from_slice(src);
                                    } else {
                                        // SAFETY: AVX-512F (every kind of products); both hold `run` values.
                                        unsafe { bf16_bits(src, &mut pa[at..][..run]) };
                                    }
                                    pos += run;
                                }
                            }
                        });
                        // SAFETY: with AMX the tile configuration is loaded on this thread, else
                        // the products' instructions are available; pa (pa32 for FMAs) holds nb *
                        // nrt tiles; acc holds 16 nrt rows of d; blocks b0..b0 + nb cover q0..=q1,
                        // inside the packed span.
                        unsafe {
                            match products {
                                Products::Dp => weighted_dp(p, kvh, b0, nb, pa, nrt, acc),
                                Products::Fma => weighted_fma(p, kvh, b0, nb, pa32, nrt, acc),
                                Products::Amx => weighted(p, kvh, b0, nb, pa, nrt, acc),
                            }
                        };
                    });
                }
                #[cfg(not(target_arch = "x86_64"))]
                {
                    let _ = mode;
                    unreachable!("AMX attention exists on x86-64 only");
                }
            } else if wide {
                #[cfg(target_arch = "x86_64")]
                for_tiles(s0, s1, chunk.start_pos, d, tile, value, |t0, t1, rows| {
                    b.each_row(|i, _, r| {
                        if let Some((a, z)) = range(i, t0, t1) {
                            let pp = sc[r * len + a - s0..].as_ptr();
                            let ap = acc[r * d..(r + 1) * d].as_mut_ptr();
                            use crate::kernels::{attn_avx2 as a2, attn_avx512 as a5};
                            // SAFETY: Simd::Avx512 implies AVX-512F, Simd::Avx2 AVX2 and FMA;
                            // d % 32 == 0; sc holds row r's probabilities for positions a..=z,
                            // each row pointer d values (see for_tiles), acc row r d values.
                            unsafe {
                                match (rows, avx512) {
                                    (TileRows::F32(v), true) => a5::weighted_sum(pp, &v[a - t0..=z - t0], d, ap),
                                    (TileRows::BF16(v), true) => a5::weighted_sum(pp, &v[a - t0..=z - t0], d, ap),
                                    (TileRows::F32(v), false) => a2::weighted_sum(pp, &v[a - t0..=z - t0], d, ap),
                                    (TileRows::BF16(v), false) => a2::weighted_sum(pp, &v[a - t0..=z - t0], d, ap),
                                }
                            };
                        }
                    });
                });
            } else {
                for pos in s0..=s1 {
                    let v = value(pos);
                    b.each_row(|i, _, r| {
                        if sees(i, pos) {
                            axpy(simd, sc[r * len + pos - s0], v, &mut acc[r * d..(r + 1) * d]);
                        }
                    });
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if amx.is_some() && products == Products::Amx {
        // SAFETY: AMX is available (a block on AMX products exists); loaded above.
        unsafe { crate::kernels::attn_amx::release() };
    }
    for i in b.i0..b.i1 {
        for h in b.h0..b.h1 {
            let r = (i - b.i0) * nh + (h - b.h0);
            // SAFETY: this task alone owns out[chunk.row + i][h*d..(h+1)*d] (tasks split queries
            // and heads disjointly), and the row is inside `out` (asserted by `attend`).
            let o = unsafe { std::slice::from_raw_parts_mut(outp.get().add((chunk.row + i) * ocols + h * d), d) };
            for (o, &a) in o.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
                *o = round.round(a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Calls `check(shape, dtype, kv, qkv, chunk)` for each chunk of `lens` (in turn, each
    /// appended to the cache afterwards) of every `(head_dim, window, dtype)` case: 4 query heads
    /// over 2 KV heads, random activations (rounded to bf16 for a bf16 cache).
    fn each_chunk(
        seed: u32,
        cases: &[(usize, Option<usize>, DType)],
        lens: &[usize],
        scale: f32,
        mut check: impl FnMut(AttnShape, DType, &CpuKv, &CpuTensor, AttnChunk),
    ) {
        let mut seed = seed;
        let mut rnd = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        for &(d, window, dtype) in cases {
            let shape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: d, window, scale: scale / (d as f32).sqrt() };
            let kind = match window {
                Some(w) => KvKind::Ring { window: w },
                None => KvKind::Grow { max: 4096 },
            };
            let mut kv = CpuKv::new(KvSpec { kind, kv_heads: 2, head_dim: d, dtype });
            let cols = (4 + 2 * 2) * d;
            let mut start = 0;
            for &len in lens {
                let mut qkv = CpuTensor { rows: len, cols, data: (0..len * cols).map(|_| rnd()).collect() };
                if dtype == DType::BF16 {
                    qkv.data.iter_mut().for_each(|v| *v = spark_core::dtype::round_bf16(*v));
                }
                let chunk = AttnChunk { row: 0, len, start_pos: start };
                check(shape, dtype, &kv, &qkv, chunk);
                kv.append(&qkv, chunk, shape).unwrap();
                start += len;
            }
        }
    }

    /// The output of `attend_with_budget` on a 2-thread pool; AMX keys and values packed per
    /// call up to `amx_budget` bytes (0: every block packs its own).
    #[allow(clippy::too_many_arguments)]
    fn run(
        pool: &rayon::ThreadPool,
        simd: Simd,
        shape: AttnShape,
        dtype: DType,
        kv: &CpuKv,
        qkv: &CpuTensor,
        chunk: AttnChunk,
        budget: usize,
        loops: Loops,
        amx_budget: usize,
    ) -> Vec<f32> {
        let cols = shape.n_heads * shape.head_dim;
        let mut out = CpuTensor { rows: chunk.len, cols, data: vec![0.0; chunk.len * cols] };
        pool.install(|| attend_with_budget(simd, qkv, chunk, shape, kv, &mut out, dtype, budget, loops, amx_budget));
        assert!(out.data.iter().all(|v| v.is_finite()) && out.data.iter().any(|&v| v != 0.0));
        out.data
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// The AVX2 and AVX-512 tile loops give the AVX2 one-row loops' bits exactly: f32 and bf16
    /// caches, sliding and full layers, chunks that start inside the cache and span several
    /// tiles.
    #[test]
    fn tiles_match_the_one_row_loops_bit_for_bit() {
        if Simd::detect() < Simd::Avx2 {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        if Simd::detect() < Simd::Avx512 {
            eprintln!("skipped: this CPU has no AVX-512 (the AVX-512 tiles)");
        }
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let cases = [
            (64, None, DType::F32),
            (64, Some(37), DType::BF16),
            (256, None, DType::BF16),
            (96, Some(100), DType::F32),
        ];
        // Three chunks: a long prefill, a second chunk over the cache, one decode token.
        each_chunk(7, &cases, &[150, 70, 1], 1.0, |shape, dtype, kv, qkv, chunk| {
            let rows =
                run(&pool, Simd::Avx2, shape, dtype, kv, qkv, chunk, SCORE_BUDGET, Loops::OneRow, AMX_PACK_BUDGET);
            for simd in [Simd::Avx2, Simd::Avx512].into_iter().filter(|&s| Simd::detect() >= s) {
                let tiles =
                    run(&pool, simd, shape, dtype, kv, qkv, chunk, SCORE_BUDGET, Loops::F32Tiles, AMX_PACK_BUDGET);
                assert!(same_bits(&rows, &tiles), "{shape:?} {dtype:?} {simd:?} chunk {chunk:?}: the paths differ");
            }
        });
    }

    /// The bf16 tiles (bf16 activations, chunks of at least 16 queries) against the AVX-512 f32
    /// loops, with each kind of tile products this CPU has (AMX; `vdpbf16ps` with AVX512_BF16;
    /// f32 FMAs on any AVX-512 core), whichever [`Products::for_cpu`] would pick: the same
    /// products summed in another order, so outputs agree to a few bf16 units in the last
    /// place; and segmented spans and per-block packing give the path's own results again.
    #[test]
    fn bf16_tiles_match_the_f32_loops() {
        let levels: Vec<(Simd, Products)> =
            [(Simd::Amx, Products::Amx), (Simd::Avx512, Products::Dp), (Simd::Avx512, Products::Fma)]
                .into_iter()
                .filter(|&(s, p)| Simd::detect() >= s && p.available())
                .collect();
        if levels.is_empty() {
            eprintln!("skipped: this CPU has no AVX-512 (nor AMX)");
            return;
        }
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let cases = [
            (64, Some(37), DType::BF16),
            (256, None, DType::BF16),
            (96, Some(100), DType::BF16),
            (32, None, DType::BF16),
        ];
        let mut worst = vec![0.0f32; levels.len()];
        let mut differ = vec![0usize; levels.len()];
        // A long prefill, a chunk over the cache (ring wrapped for the sliding cases), a chunk
        // of exactly 16 and one of 17 queries, a decode token (f32 loops on both sides), and a
        // chunk whose full-layer span passes AMX_BLOCK_SEGMENT (several runs of packing).
        each_chunk(5, &cases, &[150, 70, 16, 17, 1, 1000], 2.0, |shape, dtype, kv, qkv, chunk| {
            let f32_loops =
                run(&pool, Simd::Avx512, shape, dtype, kv, qkv, chunk, SCORE_BUDGET, Loops::F32Tiles, AMX_PACK_BUDGET);
            let scale = f32_loops.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (li, &(simd, products)) in levels.iter().enumerate() {
                let loops = Loops::Bf16TilesAs(products);
                let tiles = run(&pool, simd, shape, dtype, kv, qkv, chunk, SCORE_BUDGET, loops, AMX_PACK_BUDGET);
                let err = f32_loops.iter().zip(&tiles).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                worst[li] = worst[li].max(err);
                assert!(
                    err <= AMX_TOLERANCE,
                    "{products:?} {shape:?} chunk {chunk:?}: bf16 tiles differ by {err} of the largest output"
                );
                if chunk.len == 1 {
                    assert!(same_bits(&f32_loops, &tiles), "{products:?}: decode must stay on the f32 loops");
                } else {
                    // Outputs rounded to bf16 mostly hide the order of the f32 sums; over the
                    // whole test some must differ, or the tiles did not run.
                    differ[li] += f32_loops.iter().zip(&tiles).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                }
                // Scores held in segments (several passes), and keys and values packed by each
                // block rather than once per call, segment by segment.
                for (budget, amx_budget) in
                    [(1, AMX_PACK_BUDGET), (4 * 64 * 2 * KV_TILE, AMX_PACK_BUDGET), (SCORE_BUDGET, 0), (1, 0)]
                {
                    let seg = run(&pool, simd, shape, dtype, kv, qkv, chunk, budget, loops, amx_budget);
                    let err = tiles.iter().zip(&seg).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                    assert!(
                        err <= AMX_TOLERANCE,
                        "{products:?} {shape:?} chunk {chunk:?} budget {budget}, packing {amx_budget}: differs by {err}"
                    );
                }
            }
        });
        for ((products, w), n) in levels.iter().map(|l| l.1).zip(&worst).zip(&differ) {
            eprintln!("{products:?} bf16 attention tiles vs the f32 loops: largest difference {w} of the largest output, {n} outputs differ");
            assert!(*n > 0, "{products:?}: no output differs from the f32 loops: the bf16 tiles did not run");
        }
    }

    /// Times one full-attention prefill chunk deep into a context on the 1.7B shape (8 query
    /// heads, 2 KV heads of 256, bf16), two threads: the f32 loops (AVX-512), then the bf16 tiles
    /// with each kind of products this CPU has (AMX, `vdpbf16ps`, f32 FMAs), the call's keys and
    /// values packed once and each block packing its own. Not a test of
    /// speed (it asserts nothing about it): `cargo test --release -p backend-cpu --lib
    /// bench_long_span -- --ignored --nocapture`, `ATTN_BENCH_POS` (default 8192) positions in
    /// the cache, `ATTN_BENCH_CHUNK` (default 512) queries.
    #[test]
    #[ignore]
    fn bench_long_span() {
        if Simd::detect() < Simd::Avx512 {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
        let (pos, len) = (env("ATTN_BENCH_POS", 8192), env("ATTN_BENCH_CHUNK", 512));
        let d = 256;
        let shape = AttnShape { n_heads: 8, n_kv_heads: 2, head_dim: d, window: None, scale: 1.0 / 16.0 };
        let mut kv =
            CpuKv::new(KvSpec { kind: KvKind::Grow { max: pos + len }, kv_heads: 2, head_dim: d, dtype: DType::BF16 });
        let cols = (8 + 2 * 2) * d;
        let mut seed = 1u32;
        let mut fill = |rows: usize| {
            let data = (0..rows * cols)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    spark_core::dtype::round_bf16((seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
                })
                .collect();
            CpuTensor { rows, cols, data }
        };
        for p0 in (0..pos).step_by(4096) {
            let n = 4096.min(pos - p0);
            let qkv = fill(n);
            kv.append(&qkv, AttnChunk { row: 0, len: n, start_pos: p0 }, shape).unwrap();
        }
        let qkv = fill(len);
        let chunk = AttnChunk { row: 0, len, start_pos: pos };
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let (amx, dp, fma) =
            (Loops::Bf16TilesAs(Products::Amx), Loops::Bf16TilesAs(Products::Dp), Loops::Bf16TilesAs(Products::Fma));
        for (name, simd, loops, amx_budget) in [
            ("f32 loops (AVX-512)", Simd::Avx512, Loops::F32Tiles, 0),
            ("AMX, packed per call", Simd::Amx, amx, usize::MAX),
            ("AMX, packed per block", Simd::Amx, amx, 0),
            ("vdpbf16ps, packed per call", Simd::Avx512, dp, usize::MAX),
            ("vdpbf16ps, packed per block", Simd::Avx512, dp, 0),
            ("f32 FMA tiles, packed per call", Simd::Avx512, fma, usize::MAX),
            ("f32 FMA tiles, packed per block", Simd::Avx512, fma, 0),
        ]
        .into_iter()
        .filter(|&(_, simd, loops, _)| match loops {
            Loops::Bf16TilesAs(p) => Simd::detect() >= simd && p.available(),
            _ => true,
        }) {
            let mut ms: Vec<f64> = (0..3)
                .map(|_| {
                    let t = std::time::Instant::now();
                    run(&pool, simd, shape, DType::BF16, &kv, &qkv, chunk, SCORE_BUDGET, loops, amx_budget);
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            ms.sort_by(f64::total_cmp);
            eprintln!("{pos} cached + {len} queries, {name}: median {:.1} ms (runs {ms:.1?})", ms[1]);
        }
    }

    /// How far the AMX tiles may drift from the f32 loops, relative to the largest output.
    const AMX_TOLERANCE: f32 = 1.0 / 128.0;

    /// Spans longer than the score budget run segment by segment with the scores recomputed:
    /// the outputs are bit-identical to holding all scores, for every SIMD path, f32 and bf16
    /// caches, sliding and full layers, chunks reading the cache and their own keys across
    /// segment borders.
    #[test]
    fn segmented_scores_match_holding_all_scores_bit_for_bit() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let simds: Vec<Simd> =
            [Simd::Portable, Simd::Avx2, Simd::Avx512].into_iter().filter(|&s| Simd::detect() >= s).collect();
        let cases =
            [(64, None, DType::F32), (64, Some(150), DType::BF16), (256, None, DType::BF16), (96, None, DType::F32)];
        each_chunk(11, &cases, &[300, 90, 1, 1], 3.0, |shape, dtype, kv, qkv, chunk| {
            for &simd in &simds {
                let whole =
                    run(&pool, simd, shape, dtype, kv, qkv, chunk, SCORE_BUDGET, Loops::F32Tiles, AMX_PACK_BUDGET);
                // Budget 1: segments of one KV tile (64 positions); the other: one or a few
                // tiles, depending on the block's rows.
                for budget in [1, 4 * 16 * 2 * KV_TILE] {
                    let seg = run(&pool, simd, shape, dtype, kv, qkv, chunk, budget, Loops::F32Tiles, AMX_PACK_BUDGET);
                    assert!(
                        same_bits(&whole, &seg),
                        "{shape:?} {dtype:?} {simd:?} chunk {chunk:?}, budget {budget}: differs"
                    );
                }
            }
        });
    }
}
