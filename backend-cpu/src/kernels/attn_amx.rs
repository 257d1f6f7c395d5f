//! AMX BF16 tiles for prefill attention (x86-64 with AMX), used by [`crate::attention`]: the
//! scores `Q K^T` and the weighted values `P V` of a block of (query, head) rows ([`ROWS`], or
//! up to [`ROWS_PACKING`] for a block that packs its own keys and values).
//!
//! Precision: taken only when the graph rounds activations to bf16, so queries, keys, values
//! and the (rounded) probabilities are bf16 values and every product is exact; the sums are f32
//! in the tiles' order (`tdpbf16ps`), which differs from the f32-FMA loops only in the order of
//! additions (and in reading bf16 denormals as zero).
//!
//! Layout: a call's keys and values are packed once ([`PackedKv`]), shared by every block (or,
//! past a memory budget, by each block, a run of positions at a time: [`PackedKv::repack`]):
//! - keys in groups of 16 positions, one B tile per 32 head-dim columns: row `r`, column `t` the
//!   pair `(k[t][32 s + 2r], k[t][32 s + 2r + 1])`; a score tile is 16 rows x 16 keys;
//! - values in blocks of 32 positions, one B tile per 16 head-dim columns: row `r`, column `c`
//!   the pair `(v[2r][16 g + c], v[2r + 1][16 g + c])`; the probabilities are the A tiles
//!   (16 rows x 32 positions), so `P V` accumulates 16 rows x 16 columns per product.
//!
//! CPUs without AMX run the same tile products on the same layouts: with `vdpbf16ps` where it
//! is fast (AVX512_BF16 on Zen 4/5: [`scores_dp`], [`weighted_dp`]), per B-tile row one
//! instruction per A row with that row's bf16 pair broadcast; on other AVX-512 cores (Intel's,
//! whose `vdpbf16ps` issues at a quarter of the FMA's rate, or which lack it) in f32 FMAs on A
//! tiles widened to f32 ([`scores_fma`], [`weighted_fma`]), per B-tile row two FMAs per A row.
//! Which one runs: `crate::attention::Products::for_cpu`.
//!
//! A block's queries are packed into A tiles per 32 columns ([`pack_queries`]); its row tiles
//! live in tmm0-3 (four at a time), the streamed B tile in tmm4, the A tile in tmm5. The accumulators of `P V`
//! are loaded from and stored to the caller's f32 rows (tiles take a row stride).

#![cfg(target_arch = "x86_64")]

use std::arch::asm;
use std::arch::x86_64::*;

use rayon::prelude::*;

use super::amx::{round_bf16_high, round_pairs, transpose16};
use super::Row;

/// (query, head) rows per block whose keys and values are packed once per call: four row
/// tiles, held in tmm0-3 together.
pub const ROWS: usize = 64;
/// (query, head) rows per block that packs its own keys and values: sixteen row tiles, in
/// groups of four, so that each packed segment serves 256 rows.
pub const ROWS_PACKING: usize = 256;
/// Positions per key group (one score tile's columns).
pub const KEY_GROUP: usize = 16;
/// Positions per value block (one probability tile's columns).
pub const VALUE_BLOCK: usize = 32;
/// u16 elements of one tile (16 rows x 64 bytes).
const TILE_U16: usize = 512;

/// Keys and values of positions `base..base + n` of a range of KV heads, packed into B tiles
/// (see the module doc).
#[derive(Default)]
pub struct PackedKv {
    base: usize,
    n: usize,
    d: usize,
    /// `[kv head][key group][32-column step]` tiles.
    k: Vec<u16>,
    /// `[kv head][value block][16-column group]` tiles.
    v: Vec<u16>,
}

impl PackedKv {
    /// Bytes [`PackedKv::pack`] allocates for these sizes.
    pub fn bytes(kv_heads: usize, d: usize, n: usize) -> usize {
        let k = n.div_ceil(KEY_GROUP) * KEY_GROUP * d;
        let v = n.div_ceil(VALUE_BLOCK) * VALUE_BLOCK * d;
        (k + v) * kv_heads * 2
    }

    /// Pack positions `base..base + n` of every one of `kv_heads` heads on the rayon pool
    /// ([`PackedKv::repack`]).
    ///
    /// # Safety
    /// AVX-512F and AVX-512BW are present.
    pub unsafe fn pack<'a>(
        kv_heads: usize,
        d: usize,
        base: usize,
        n: usize,
        row: &(dyn Fn(bool, usize, usize) -> Row<'a> + Sync),
    ) -> PackedKv {
        let mut p = PackedKv::default();
        p.repack(0..kv_heads, d, base, n, row, (true, true), true);
        p
    }

    /// Pack positions `base..base + n` of KV heads `heads` (held from index 0), reusing this
    /// value's memory: `row(value, kvh, pos)` gives the key (`value` false) or value row of KV
    /// head `kvh` at `pos`, `d` long (a multiple of 32). `which`: whether to pack the keys, the
    /// values (the other keeps its old contents, stale). Rows are rounded to bf16
    /// ([`spark_core::dtype::round_bf16`]); positions past `n` in the last group or block are
    /// zero. `parallel`: on the rayon pool, else on this thread.
    ///
    /// # Safety
    /// AVX-512F and AVX-512BW are present.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn repack<'a>(
        &mut self,
        heads: std::ops::Range<usize>,
        d: usize,
        base: usize,
        n: usize,
        row: &(dyn Fn(bool, usize, usize) -> Row<'a> + Sync),
        which: (bool, bool),
        parallel: bool,
    ) {
        assert!(d.is_multiple_of(32) && d > 0, "attn_amx: head dim {d} is not a multiple of 32");
        (self.base, self.n, self.d) = (base, n, d);
        let nh = heads.len();
        let (groups, blocks) = (n.div_ceil(KEY_GROUP), n.div_ceil(VALUE_BLOCK));
        let (ksteps, vgroups) = (d / 32, d / 16);
        // One unit (a key group or a value block) of KV head `i / units`: its rows, then its
        // tiles, each written whole (so reused memory needs no clearing).
        let fill = |value: bool, per: usize, units: usize| {
            move |(i, tiles): (usize, &mut [u16])| {
                let (kvh, p0) = (heads.start + i / units, (i % units) * per);
                let mut rows = [Row::F32(&[]); VALUE_BLOCK];
                let cnt = per.min(n - p0);
                for (t, r) in rows.iter_mut().enumerate().take(cnt) {
                    *r = row(value, kvh, base + p0 + t);
                }
                for (j, tile) in tiles.chunks_exact_mut(TILE_U16).enumerate() {
                    // SAFETY: AVX-512F/BW (this function's contract); every row holds d values,
                    // d >= 32 (j + 1) for a key tile's columns, >= 16 (j + 1) for a value
                    // tile's; at most 16 key rows or 32 value rows; `tile` is one tile.
                    unsafe {
                        if value {
                            value_tile(&rows[..cnt], j * 16, tile)
                        } else {
                            key_tile(&rows[..cnt], j * 32, tile)
                        }
                    };
                }
            }
        };
        let (fill_k, fill_v) = (fill(false, KEY_GROUP, groups), fill(true, VALUE_BLOCK, blocks));
        if which.0 {
            fill_units(&mut self.k, nh * groups, ksteps * TILE_U16, parallel, fill_k);
        }
        if which.1 {
            fill_units(&mut self.v, nh * blocks, vgroups * TILE_U16, parallel, fill_v);
        }
    }

    /// The first position held.
    pub fn base(&self) -> usize {
        self.base
    }

    /// One past the last position held.
    pub fn end(&self) -> usize {
        self.base + self.n
    }

    /// The first of key group `g`'s `d / 32` tiles for KV head `kvh`.
    fn key_group(&self, kvh: usize, g: usize) -> *const u16 {
        let ksteps = self.d / 32;
        self.k[((kvh * self.n.div_ceil(KEY_GROUP) + g) * ksteps) * TILE_U16..].as_ptr()
    }

    /// The first of value block `b`'s `d / 16` tiles for KV head `kvh`.
    fn value_block(&self, kvh: usize, b: usize) -> *const u16 {
        let vgroups = self.d / 16;
        self.v[((kvh * self.n.div_ceil(VALUE_BLOCK) + b) * vgroups) * TILE_U16..].as_ptr()
    }
}

/// Resize `buf` to `units` units of `unit` elements and call `fill((i, unit i))` for each, on
/// the rayon pool when `parallel`.
fn fill_units(
    buf: &mut Vec<u16>,
    units: usize,
    unit: usize,
    parallel: bool,
    fill: impl Fn((usize, &mut [u16])) + Sync + Send,
) {
    buf.resize(units * unit, 0);
    if parallel {
        buf.par_chunks_mut(unit).enumerate().for_each(fill);
    } else {
        buf.chunks_mut(unit).enumerate().for_each(fill);
    }
}

/// 32 values of `row` from column `c0` as 16 bf16 pairs (element `i` in word `i`).
///
/// # Safety
/// AVX-512F and AVX-512BW are present; `c0 + 32 <= row.len()`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pairs32(row: &Row<'_>, c0: usize) -> __m512i {
    match row {
        Row::BF16(r) => _mm512_loadu_si512(r[c0..c0 + 32].as_ptr().cast()),
        Row::F32(r) => {
            let seg = r[c0..c0 + 32].as_ptr();
            round_pairs(_mm512_loadu_ps(seg), _mm512_loadu_ps(seg.add(16)))
        }
        Row::F16(_) => {
            let mut f = [0.0f32; 32];
            row.slice(c0, 32).to_f32(&mut f);
            round_pairs(_mm512_loadu_ps(f.as_ptr()), _mm512_loadu_ps(f.as_ptr().add(16)))
        }
    }
}

/// 16 values of `row` from column `c0` rounded to bf16, in the low words of 16 lanes.
///
/// # Safety
/// AVX-512F and AVX-512BW are present; `c0 + 16 <= row.len()`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn words16(row: &Row<'_>, c0: usize) -> __m512i {
    match row {
        Row::BF16(r) => _mm512_cvtepu16_epi32(_mm256_loadu_si256(r[c0..c0 + 16].as_ptr().cast())),
        Row::F32(r) => _mm512_srli_epi32::<16>(round_bf16_high(_mm512_loadu_ps(r[c0..c0 + 16].as_ptr()))),
        Row::F16(_) => {
            let mut f = [0.0f32; 16];
            row.slice(c0, 16).to_f32(&mut f);
            _mm512_srli_epi32::<16>(round_bf16_high(_mm512_loadu_ps(f.as_ptr())))
        }
    }
}

/// One key tile: row `r`, column `t` = the bf16 pair of `rows[t]` at columns `c0 + 2r, +1`;
/// columns past `rows.len() <= 16` zero.
///
/// # Safety
/// AVX-512F and AVX-512BW are present; every row holds at least `c0 + 32` values.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn key_tile(rows: &[Row<'_>], c0: usize, tile: &mut [u16]) {
    debug_assert!(rows.len() <= 16 && tile.len() == TILE_U16);
    let mut v = [_mm512_setzero_si512(); 16];
    for (t, row) in rows.iter().enumerate() {
        v[t] = pairs32(row, c0);
    }
    for (r, row) in transpose16(v).iter().enumerate() {
        _mm512_storeu_si512(tile.as_mut_ptr().add(r * 32).cast(), *row);
    }
}

/// One value tile: row `r`, column `c` = `(rows[2r][c0 + c], rows[2r + 1][c0 + c])` as bf16;
/// rows past `rows.len() <= 32` zero.
///
/// # Safety
/// AVX-512F and AVX-512BW are present; every row holds at least `c0 + 16` values.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn value_tile(rows: &[Row<'_>], c0: usize, tile: &mut [u16]) {
    debug_assert!(rows.len() <= 32 && tile.len() == TILE_U16);
    for r in 0..16 {
        let even = rows.get(2 * r).map_or(_mm512_setzero_si512(), |row| words16(row, c0));
        let odd = rows.get(2 * r + 1).map_or(_mm512_setzero_si512(), |row| words16(row, c0));
        let pair = _mm512_or_si512(even, _mm512_slli_epi32::<16>(odd));
        _mm512_storeu_si512(tile.as_mut_ptr().add(r * 32).cast(), pair);
    }
}

/// Pack query rows into A tiles: tile `(rt, s)` row `i` = the 32 bf16 of `rows[16 rt + i]` from
/// column `32 s`; rows past `rows.len()` up to a multiple of 16 are zero. `out` is resized.
///
/// # Safety
/// AVX-512F and AVX-512BW are present; every row is `d` long, `d` a multiple of 32.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn pack_queries(rows: &[&[f32]], d: usize, out: &mut Vec<u16>) {
    let ksteps = d / 32;
    let nrt = rows.len().div_ceil(16);
    out.clear();
    out.resize(nrt * ksteps * TILE_U16, 0);
    for (r, row) in rows.iter().enumerate() {
        let (rt, i) = (r / 16, r % 16);
        for s in 0..ksteps {
            let p = pairs32(&Row::F32(row), s * 32);
            _mm512_storeu_si512(out.as_mut_ptr().add((rt * ksteps + s) * TILE_U16 + i * 32).cast(), p);
        }
    }
}

/// `dst[j] = bf16(bf16(src[j]) * scale)` for `j < src.len()`: the scores' two roundings as
/// [`spark_core::DType::round`] makes them for bf16, bit for bit, 16 at a time.
///
/// # Safety
/// AVX-512F is present; `dst` holds `src.len()` values.
#[target_feature(enable = "avx512f")]
pub unsafe fn scale_scores(src: &[f32], scale: f32, dst: &mut [f32]) {
    debug_assert!(dst.len() >= src.len());
    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let bf16 = |x: __m512| _mm512_castsi512_ps(_mm512_and_si512(round_bf16_high(x), high));
    for j in (0..src.len()).step_by(16) {
        let m: __mmask16 = (((1u32 << (src.len() - j).min(16)) - 1) & 0xffff) as u16;
        let x = _mm512_maskz_loadu_ps(m, src.as_ptr().add(j));
        let y = bf16(_mm512_mul_ps(bf16(x), _mm512_set1_ps(scale)));
        _mm512_mask_storeu_ps(dst.as_mut_ptr().add(j), m, y);
    }
}

/// `dst[j] = src[j]`'s bf16 bits (its high half) for `j < src.len()`: probabilities already
/// rounded to bf16 into an A tile row, 16 at a time.
///
/// # Safety
/// AVX-512F is present; `dst` holds `src.len()` values.
#[target_feature(enable = "avx512f")]
pub unsafe fn bf16_bits(src: &[f32], dst: &mut [u16]) {
    debug_assert!(dst.len() >= src.len());
    for j in (0..src.len()).step_by(16) {
        let m: __mmask16 = (((1u32 << (src.len() - j).min(16)) - 1) & 0xffff) as u16;
        let x = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, src.as_ptr().add(j)));
        _mm512_mask_cvtepi32_storeu_epi16(dst.as_mut_ptr().add(j).cast(), m, _mm512_srli_epi32::<16>(x));
    }
}

/// `e^x` in every lane where `x <= 0` (a softmax's `score - max`), within 2 units in the last
/// place of `f32::exp` (`exp_matches_f32_exp_within_two_ulps`, which measured at most 1 over
/// `[-103.5, 0]`): Cody-Waite reduction by ln 2
/// and Cephes' `expf` polynomial, scaled by `vscalefps`. Below -103.5 (where `f32::exp`'s
/// value rounds to 0): 0; NaN stays NaN.
///
/// # Safety
/// AVX-512F is present.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn exp_nonpositive(x: __m512) -> __m512 {
    let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-103.5));
    // `max(floor, x)` keeps a NaN `x` (the second operand is returned when either is NaN).
    let x = _mm512_max_ps(_mm512_set1_ps(-103.5), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
    _mm512_maskz_mov_ps(!tiny, _mm512_scalef_ps(y, n))
}

/// The softmax of one row's scores, probabilities rounded to bf16, in place: the maximum, the
/// exponentials (`exp_nonpositive`, within 2 ulps of the f32 loops' `f32::exp`), their sum and
/// the rounding 16 at a time, so a probability can differ from the f32 loops' by a bf16 unit
/// where the two land on either side of a rounding boundary. Scalar `exp` had cost a fifth of a
/// tile attention call deep in a context: 8192 cached positions and 512 queries of the 1.7B
/// shape's full layer, two threads of an Emerald Rapids guest, 319-339 -> 276-280 ms with
/// `vdpbf16ps` products, 257-275 -> 194-220 ms with FMA products (docs/BENCHMARKS.md, session
/// 49). A NaN score makes the whole row NaN, as there.
///
/// # Safety
/// AVX-512F is present.
#[target_feature(enable = "avx512f")]
pub unsafe fn softmax_bf16(s: &mut [f32]) {
    let n = s.len();
    let mask = |j: usize| -> __mmask16 { (((1u32 << (n - j).min(16)) - 1) & 0xffff) as u16 };
    let mut vmax = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut nan = false;
    for j in (0..n).step_by(16) {
        let x = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), mask(j), s.as_ptr().add(j));
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x) != 0;
        vmax = _mm512_max_ps(vmax, x);
    }
    let max = _mm512_set1_ps(if nan { f32::NAN } else { _mm512_reduce_max_ps(vmax) });
    let mut vsum = _mm512_setzero_ps();
    for j in (0..n).step_by(16) {
        let x = _mm512_maskz_loadu_ps(mask(j), s.as_ptr().add(j));
        let e = _mm512_maskz_mov_ps(mask(j), exp_nonpositive(_mm512_sub_ps(x, max)));
        vsum = _mm512_add_ps(vsum, e);
        _mm512_mask_storeu_ps(s.as_mut_ptr().add(j), mask(j), e);
    }
    let inv = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(vsum));
    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
    for j in (0..n).step_by(16) {
        let x = _mm512_maskz_loadu_ps(mask(j), s.as_ptr().add(j));
        let p = _mm512_and_si512(round_bf16_high(_mm512_mul_ps(x, inv)), high);
        _mm512_mask_storeu_ps(s.as_mut_ptr().add(j), mask(j), _mm512_castsi512_ps(p));
    }
}

/// `tileloadd tmm{T}` from `p`, rows `stride` bytes apart.
#[inline(always)]
unsafe fn load<const T: u8>(p: *const u8, stride: usize) {
    asm!("tileloadd tmm{t}, [{p} + {s}*1]", t = const T, p = in(reg) p, s = in(reg) stride, options(nostack, readonly));
}

/// `tilestored` tmm{T} to `p`, rows `stride` bytes apart.
#[inline(always)]
unsafe fn store<const T: u8>(p: *mut u8, stride: usize) {
    asm!("tilestored [{p} + {s}*1], tmm{t}", t = const T, p = in(reg) p, s = in(reg) stride, options(nostack));
}

/// Row tile `rt` (tmm0-3): zero it, load it, store it, or add tmm5 x tmm4 to it.
#[derive(Clone, Copy)]
enum Op {
    Zero,
    Load(*const u8, usize),
    Store(*mut u8, usize),
    Dot,
}

/// Apply `op` to row tile `rt` (tile numbers are immediates, hence the dispatch).
///
/// # Safety
/// AMX is available and this thread has loaded the tile configuration; `rt < 4`; pointers
/// address 16 rows of 64 bytes `stride` apart.
#[inline(always)]
unsafe fn on_row_tile(rt: usize, op: Op) {
    macro_rules! each {
        ($t:literal) => {
            match op {
                Op::Zero => asm!("tilezero tmm{t}", t = const $t, options(nostack, nomem)),
                Op::Load(p, s) => load::<$t>(p, s),
                Op::Store(p, s) => store::<$t>(p, s),
                Op::Dot => asm!("tdpbf16ps tmm{t}, tmm5, tmm4", t = const $t, options(nostack, nomem)),
            }
        };
    }
    match rt {
        0 => each!(0),
        1 => each!(1),
        2 => each!(2),
        3 => each!(3),
        _ => unreachable!("attn_amx: row tile {rt}"),
    }
}

/// Row tiles held in tmm0-3 at once; blocks of more rows run in groups of these.
const TILE_GROUP: usize = 4;

/// Scores of key group `g` of KV head `kvh`: `c[rt]` (16 rows x 16 keys, f32) = the `nrt`
/// row tiles of `qa` ([`pack_queries`]) times the group's keys, four row tiles at a time.
///
/// # Safety
/// AMX is available and this thread has loaded the tile configuration (every tile 16 x 64
/// bytes); `qa` holds `nrt` row tiles of `kv.d / 32` steps, `c` at least `nrt` tiles; `g` is a
/// group of `kv`.
pub unsafe fn scores(kv: &PackedKv, kvh: usize, g: usize, qa: &[u16], nrt: usize, c: &mut [[f32; 256]]) {
    let ksteps = kv.d / 32;
    debug_assert!(qa.len() >= nrt * ksteps * TILE_U16 && c.len() >= nrt);
    let kt = kv.key_group(kvh, g);
    for r0 in (0..nrt).step_by(TILE_GROUP) {
        let nt = TILE_GROUP.min(nrt - r0);
        for t in 0..nt {
            on_row_tile(t, Op::Zero);
        }
        for s in 0..ksteps {
            load::<4>(kt.add(s * TILE_U16).cast(), 64);
            for t in 0..nt {
                load::<5>(qa.as_ptr().add(((r0 + t) * ksteps + s) * TILE_U16).cast(), 64);
                on_row_tile(t, Op::Dot);
            }
        }
        for t in 0..nt {
            on_row_tile(t, Op::Store(c[r0 + t].as_mut_ptr().cast(), 64));
        }
    }
}

/// `acc[r][..d] += sum_j p[r][j] v[j]` over value blocks `b0..b0 + nb` of KV head `kvh`: `pa`
/// holds `[block][row tile]` A tiles of probabilities (16 rows x 32 positions, bf16), `acc` the
/// `16 nrt` rows of `d` f32 (row stride `d`); four row tiles at a time.
///
/// # Safety
/// AMX is available and this thread has loaded the tile configuration; `pa` holds `nb * nrt`
/// tiles; `acc` holds `16 nrt` rows of `kv.d`; the blocks are blocks of `kv`.
pub unsafe fn weighted(kv: &PackedKv, kvh: usize, b0: usize, nb: usize, pa: &[u16], nrt: usize, acc: &mut [f32]) {
    let d = kv.d;
    let vgroups = d / 16;
    debug_assert!(pa.len() >= nb * nrt * TILE_U16 && acc.len() >= 16 * nrt * d);
    let vt = kv.value_block(kvh, b0);
    for r0 in (0..nrt).step_by(TILE_GROUP) {
        let nt = TILE_GROUP.min(nrt - r0);
        for g in 0..vgroups {
            let at = |t: usize| 16 * (r0 + t) * d + 16 * g;
            for t in 0..nt {
                on_row_tile(t, Op::Load(acc.as_ptr().add(at(t)).cast(), 4 * d));
            }
            for b in 0..nb {
                load::<4>(vt.add((b * vgroups + g) * TILE_U16).cast(), 64);
                for t in 0..nt {
                    load::<5>(pa.as_ptr().add((b * nrt + r0 + t) * TILE_U16).cast(), 64);
                    on_row_tile(t, Op::Dot);
                }
            }
            for t in 0..nt {
                on_row_tile(t, Op::Store(acc.as_mut_ptr().add(at(t)).cast(), 4 * d));
            }
        }
    }
}

/// The tile product `c += A B` with AVX512_BF16 instead of AMX, on the same layouts: `a` an A
/// tile (16 rows x 16 bf16 pairs, rows 32 u16 apart), `b` a B tile (16 rows of 16 pairs), `c`
/// the 16 rows of 16 f32 accumulators. Per B row, one `vdpbf16ps` per A row with that row's
/// pair broadcast: the same exact bf16 products, summed in f32 in another order.
///
/// # Safety
/// AVX512F/BW/BF16; `a` and `b` address 512 u16 each.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dp_tile(c: &mut [__m512; 16], a: *const u16, b: *const u16) {
    for r in 0..16 {
        let bv: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(32 * r).cast()));
        for (m, cm) in c.iter_mut().enumerate() {
            let pair = (a.add(32 * m + 2 * r) as *const u32).read_unaligned();
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair as i32));
            *cm = _mm512_dpbf16_ps(*cm, av, bv);
        }
    }
}

/// `c += A B` for one tile pair in f32 FMAs, on CPUs whose `vdpbf16ps` is slow (Intel cores,
/// [`super::matmul::vdpbf16ps_is_slow`]) or missing: `a` an A tile widened to f32 (16 rows x
/// 32 values, rows 32 apart: [`widen_bf16`]), `b` a B tile (16 rows of 16 bf16 pairs), `c` the
/// 16 rows of 16 f32 accumulators. Per B row, its pairs split into the even and the odd f32
/// values (a shift and a mask), then two FMAs per A row with that row's two values broadcast
/// from memory: the same exact bf16 products as [`dp_tile`] and the tiles, summed in f32 in
/// another order. On one Emerald Rapids core `vdpbf16ps zmm` issues at a quarter of the FMA's
/// rate, half its multiply-adds per cycle (docs/BENCHMARKS.md, session 47).
///
/// # Safety
/// AVX512F; `a` addresses 512 f32, `b` 512 u16.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn fma_tile(c: &mut [__m512; 16], a: *const f32, b: *const u16) {
    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
    for r in 0..16 {
        let bv = _mm512_loadu_si512(b.add(32 * r).cast());
        let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bv));
        let odd = _mm512_castsi512_ps(_mm512_and_si512(bv, high));
        for (m, cm) in c.iter_mut().enumerate() {
            *cm = _mm512_fmadd_ps(_mm512_set1_ps(*a.add(32 * m + 2 * r)), even, *cm);
            *cm = _mm512_fmadd_ps(_mm512_set1_ps(*a.add(32 * m + 2 * r + 1)), odd, *cm);
        }
    }
}

/// `dst` = the bf16 values whose bits are `src`, as f32, in the same order (resized): A tiles
/// for [`scores_fma`] and [`weighted_fma`].
///
/// # Safety
/// AVX-512F is present.
#[target_feature(enable = "avx512f")]
pub unsafe fn widen_bf16(src: &[u16], dst: &mut Vec<f32>) {
    dst.clear();
    dst.resize(src.len(), 0.0);
    let full = src.len() / 16 * 16;
    for j in (0..full).step_by(16) {
        let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(src.as_ptr().add(j).cast()));
        _mm512_storeu_ps(dst.as_mut_ptr().add(j), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)));
    }
    for j in full..src.len() {
        dst[j] = f32::from_bits((src[j] as u32) << 16);
    }
}

/// One tile product without AMX: `c += A B` for an A tile of `Self::A` and a B tile of bf16
/// pairs (`dp_tile`, `fma_tile`).
trait TileProduct {
    /// The A tiles' element: bf16 bits, or f32.
    type A;
    /// # Safety
    /// As the product's own function; inlined into a caller compiled with its features.
    unsafe fn tile(c: &mut [__m512; 16], a: *const Self::A, b: *const u16);
}

/// `vdpbf16ps` products (`dp_tile`).
struct Dp;
/// f32 FMA products (`fma_tile`).
struct Fma;

impl TileProduct for Dp {
    type A = u16;
    #[inline(always)]
    unsafe fn tile(c: &mut [__m512; 16], a: *const u16, b: *const u16) {
        dp_tile(c, a, b)
    }
}

impl TileProduct for Fma {
    type A = f32;
    #[inline(always)]
    unsafe fn tile(c: &mut [__m512; 16], a: *const f32, b: *const u16) {
        fma_tile(c, a, b)
    }
}

/// [`scores`] with the products `P` on CPUs without AMX: the same layouts and results up to
/// the order of f32 additions.
///
/// # Safety
/// The products' features (inlined into [`scores_dp`] or [`scores_fma`]); the rest as
/// [`scores`].
#[inline(always)]
unsafe fn scores_with<P: TileProduct>(
    kv: &PackedKv,
    kvh: usize,
    g: usize,
    qa: &[P::A],
    nrt: usize,
    c: &mut [[f32; 256]],
) {
    let ksteps = kv.d / 32;
    debug_assert!(qa.len() >= nrt * ksteps * TILE_U16 && c.len() >= nrt);
    let kt = kv.key_group(kvh, g);
    for (rt, ct) in c.iter_mut().enumerate().take(nrt) {
        let mut acc = [_mm512_setzero_ps(); 16];
        for s in 0..ksteps {
            P::tile(&mut acc, qa.as_ptr().add((rt * ksteps + s) * TILE_U16), kt.add(s * TILE_U16));
        }
        for (m, v) in acc.iter().enumerate() {
            _mm512_storeu_ps(ct.as_mut_ptr().add(16 * m), *v);
        }
    }
}

/// [`weighted`] with the products `P` on CPUs without AMX.
///
/// # Safety
/// The products' features (inlined into [`weighted_dp`] or [`weighted_fma`]); the rest as
/// [`weighted`].
#[inline(always)]
unsafe fn weighted_with<P: TileProduct>(
    kv: &PackedKv,
    kvh: usize,
    b0: usize,
    nb: usize,
    pa: &[P::A],
    nrt: usize,
    acc: &mut [f32],
) {
    let d = kv.d;
    let vgroups = d / 16;
    debug_assert!(pa.len() >= nb * nrt * TILE_U16 && acc.len() >= 16 * nrt * d);
    let vt = kv.value_block(kvh, b0);
    for rt in 0..nrt {
        for g in 0..vgroups {
            let at = |m: usize| (16 * rt + m) * d + 16 * g;
            let mut c = [_mm512_setzero_ps(); 16];
            for (m, cm) in c.iter_mut().enumerate() {
                *cm = _mm512_loadu_ps(acc.as_ptr().add(at(m)));
            }
            for b in 0..nb {
                P::tile(&mut c, pa.as_ptr().add((b * nrt + rt) * TILE_U16), vt.add((b * vgroups + g) * TILE_U16));
            }
            for (m, cm) in c.iter().enumerate() {
                _mm512_storeu_ps(acc.as_mut_ptr().add(at(m)), *cm);
            }
        }
    }
}

/// [`scores`] with AVX512_BF16 (`vdpbf16ps`, `dp_tile`) on CPUs without AMX.
///
/// # Safety
/// AVX512F/BW/BF16 (no tile state needed); the rest as [`scores`].
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub unsafe fn scores_dp(kv: &PackedKv, kvh: usize, g: usize, qa: &[u16], nrt: usize, c: &mut [[f32; 256]]) {
    scores_with::<Dp>(kv, kvh, g, qa, nrt, c)
}

/// [`weighted`] with AVX512_BF16 (`vdpbf16ps`, `dp_tile`) on CPUs without AMX.
///
/// # Safety
/// AVX512F/BW/BF16 (no tile state needed); the rest as [`weighted`].
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub unsafe fn weighted_dp(kv: &PackedKv, kvh: usize, b0: usize, nb: usize, pa: &[u16], nrt: usize, acc: &mut [f32]) {
    weighted_with::<Dp>(kv, kvh, b0, nb, pa, nrt, acc)
}

/// [`scores`] in f32 FMAs (`fma_tile`): `qa` the query tiles widened to f32 ([`widen_bf16`] of
/// [`pack_queries`]' tiles).
///
/// # Safety
/// AVX512F (no tile state needed); the rest as [`scores`].
#[target_feature(enable = "avx512f")]
pub unsafe fn scores_fma(kv: &PackedKv, kvh: usize, g: usize, qa: &[f32], nrt: usize, c: &mut [[f32; 256]]) {
    scores_with::<Fma>(kv, kvh, g, qa, nrt, c)
}

/// [`weighted`] in f32 FMAs (`fma_tile`): `pa` the probability tiles as f32 (16 rows x 32
/// positions each, the values already rounded to bf16).
///
/// # Safety
/// AVX512F (no tile state needed); the rest as [`weighted`].
#[target_feature(enable = "avx512f")]
pub unsafe fn weighted_fma(kv: &PackedKv, kvh: usize, b0: usize, nb: usize, pa: &[f32], nrt: usize, acc: &mut [f32]) {
    weighted_with::<Fma>(kv, kvh, b0, nb, pa, nrt, acc)
}

/// Load the eight-tile configuration on this thread ([`super::amx`]'s).
///
/// # Safety
/// AMX is available; the thread calls [`release`] when done.
pub unsafe fn begin() {
    super::amx::load_config();
}

/// Release this thread's tile state.
///
/// # Safety
/// AMX is available.
pub unsafe fn release() {
    super::amx::release();
}

#[cfg(test)]
mod tests {
    use super::*;
    use spark_core::dtype::round_bf16;

    fn avx512() -> bool {
        let ok = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
        if !ok {
            eprintln!("skipped: this CPU has no AVX-512F/BW");
        }
        ok
    }

    fn values(seed: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                ((*seed >> 40) as f32 / (1u32 << 24) as f32 - 0.5) * 8.0
            })
            .collect()
    }

    /// Key tiles hold each key's bf16 pairs by column, value tiles each position pair's bf16
    /// values by column; positions past the span are zero. F32 and BF16 rows.
    #[test]
    fn packed_tiles_hold_the_rows() {
        if !avx512() {
            return;
        }
        let (kv_heads, d, base, n) = (2, 64, 5, 37);
        let mut seed = 3;
        let f: Vec<f32> = values(&mut seed, 2 * kv_heads * (base + n) * d);
        let b: Vec<u16> = f.iter().map(|&x| (round_bf16(x).to_bits() >> 16) as u16).collect();
        let at = |value: bool, kvh: usize, pos: usize| ((value as usize * kv_heads + kvh) * (base + n) + pos) * d;
        let expect = |value: bool, kvh: usize, pos: usize, c: usize| -> u16 {
            if pos < base + n {
                b[at(value, kvh, pos) + c]
            } else {
                0
            }
        };
        for bf in [false, true] {
            let row = |value: bool, kvh: usize, pos: usize| {
                let o = at(value, kvh, pos);
                if bf {
                    Row::BF16(&b[o..o + d])
                } else {
                    Row::F32(&f[o..o + d])
                }
            };
            // SAFETY: AVX-512F/BW checked above.
            let p = unsafe { PackedKv::pack(kv_heads, d, base, n, &row) };
            for kvh in 0..kv_heads {
                for g in 0..n.div_ceil(KEY_GROUP) {
                    for s in 0..d / 32 {
                        let tile = &p.k[((kvh * n.div_ceil(KEY_GROUP) + g) * (d / 32) + s) * TILE_U16..][..TILE_U16];
                        for r in 0..16 {
                            for t in 0..16 {
                                for e in 0..2 {
                                    let want = expect(false, kvh, base + g * 16 + t, 32 * s + 2 * r + e);
                                    assert_eq!(tile[r * 32 + 2 * t + e], want, "key tile {kvh} {g} {s} [{r}][{t}].{e}");
                                }
                            }
                        }
                    }
                }
                for blk in 0..n.div_ceil(VALUE_BLOCK) {
                    for c in 0..d / 16 {
                        let tile =
                            &p.v[((kvh * n.div_ceil(VALUE_BLOCK) + blk) * (d / 16) + c) * TILE_U16..][..TILE_U16];
                        for r in 0..16 {
                            for col in 0..16 {
                                for e in 0..2 {
                                    let want = expect(true, kvh, base + blk * 32 + 2 * r + e, 16 * c + col);
                                    assert_eq!(tile[r * 32 + 2 * col + e], want, "value tile {kvh} {blk} {c}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The vector helpers give the scalar roundings' bits: lengths around the 16-lane steps,
    /// ties, NaN, infinities, denormals.
    /// `exp_nonpositive` against `f32::exp` on a sweep of `[-110, 0]` (every 2^-12 near 0,
    /// coarser below) and the special values: within 2 ulps where the value is normal, 0 where
    /// `f32::exp` rounds to 0, NaN for NaN.
    #[test]
    fn exp_matches_f32_exp_within_two_ulps() {
        if !avx512() {
            return;
        }
        let mut xs: Vec<f32> = (0..=4096).map(|i| -(i as f32) / 4096.0).collect();
        xs.extend((0..=110_000).map(|i| -(i as f32) / 1000.0));
        xs.extend([-0.0, -f32::MIN_POSITIVE, -1e-30, -87.33, -87.34, -103.97, -104.0, -200.0, f32::NEG_INFINITY]);
        let mut worst = 0u32;
        for chunk in xs.chunks(16) {
            let mut x = [0.0f32; 16];
            x[..chunk.len()].copy_from_slice(chunk);
            let mut y = [0.0f32; 16];
            // SAFETY: AVX-512F checked above.
            unsafe { _mm512_storeu_ps(y.as_mut_ptr(), exp_nonpositive(_mm512_loadu_ps(x.as_ptr()))) };
            for (&xi, &yi) in x.iter().zip(&y).take(chunk.len()) {
                let want = xi.exp();
                if want < f32::MIN_POSITIVE {
                    // Subnormal or zero: within one subnormal step of it, or 0 below -103.5.
                    assert!(
                        (yi - want).abs() <= f32::from_bits(1) * 2.0 || (xi < -103.5 && yi == 0.0),
                        "exp({xi}) = {yi}, want {want}"
                    );
                    continue;
                }
                let ulps = (yi.to_bits() as i64 - want.to_bits() as i64).unsigned_abs() as u32;
                worst = worst.max(ulps);
                assert!(ulps <= 2, "exp({xi}) = {yi}, want {want}: {ulps} ulps");
            }
        }
        eprintln!("exp_nonpositive: at most {worst} ulps from f32::exp");
        let mut y = [0.0f32; 16];
        // SAFETY: AVX-512F checked above.
        unsafe { _mm512_storeu_ps(y.as_mut_ptr(), exp_nonpositive(_mm512_set1_ps(f32::NAN))) };
        assert!(y.iter().all(|v| v.is_nan()), "exp(NaN) must be NaN");
    }

    #[test]
    fn score_and_probability_helpers_match_scalar() {
        if !avx512() {
            return;
        }
        let special = [
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x7f7f_ffff),
            f32::INFINITY,
            f32::from_bits(0x0000_8000),
            -0.0,
        ];
        let mut seed = 9;
        for n in [1, 15, 16, 17, 32, 33, 100] {
            let mut src = values(&mut seed, n);
            for (i, &v) in special.iter().enumerate().take(n / 3) {
                src[3 * i] = v;
            }
            let bf = |x: f32| round_bf16(x);
            let mut got = vec![7.0f32; n + 1];
            // SAFETY: AVX-512F checked above; got holds n values.
            unsafe { scale_scores(&src, 0.125, &mut got) };
            for j in 0..n {
                assert_eq!(got[j].to_bits(), bf(bf(src[j]) * 0.125).to_bits(), "scale_scores n {n} [{j}]");
            }
            assert_eq!(got[n], 7.0, "scale_scores wrote past n");
            let probs: Vec<f32> = src.iter().map(|&x| bf(x)).collect();
            let mut bits = vec![0xabcdu16; n + 1];
            // SAFETY: as above.
            unsafe { bf16_bits(&probs, &mut bits) };
            for j in 0..n {
                assert_eq!(bits[j] as u32, probs[j].to_bits() >> 16, "bf16_bits n {n} [{j}]");
            }
            assert_eq!(bits[n], 0xabcd, "bf16_bits wrote past n");
            // The softmax against the f32 loops' scalar form, on finite scores.
            let scores: Vec<f32> = values(&mut seed, n).iter().map(|&x| bf(x)).collect();
            let mut want = scores.clone();
            let max = want.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for v in want.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            let inv = 1.0 / sum;
            want.iter_mut().for_each(|v| *v = bf(*v * inv));
            let mut got = scores.clone();
            // SAFETY: as above.
            unsafe { softmax_bf16(&mut got) };
            // Within a bf16 unit of the scalar form (the exponentials within 2 f32 ulps, summed
            // in another order).
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= b.abs() / 128.0, "softmax_bf16 n {n}: {got:?} vs {want:?}");
            }
            let total: f32 = got.iter().sum();
            assert!((total - 1.0).abs() <= n as f32 / 256.0, "softmax_bf16 n {n}: sums to {total}");
            let mut nan = scores.clone();
            nan[n / 2] = f32::NAN;
            // SAFETY: as above.
            unsafe { softmax_bf16(&mut nan) };
            assert!(nan.iter().all(|v| v.is_nan()), "softmax_bf16 n {n}: a NaN score must make the row NaN");
        }
    }
}
