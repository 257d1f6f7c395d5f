//! AVX-512 VNNI integer kernels for [`super::qmatmul`] (x86-64).
//!
//! Per 64-column chunk (two 32-blocks): one `vpdpbusd` of the unsigned weight bytes (int8 as
//! `q + 128`, the stored signed bytes with the top bit flipped; int4 as the chunk's 32 bytes
//! broadcast to both halves of the register and masked, the low nibbles in bytes 0-31 and the
//! high nibbles, left in place, i.e. times 16, in bytes 32-63) with the signed activation bytes
//! gives 16 i32 lanes (lanes 0-7 the first block, 8-15 the second), converted to f32 and
//! accumulated with one FMA by a 16-lane `weight scale * activation scale` vector (for int4 the
//! activation scales of lanes 8-15 carry the factor 1/16: a power of two, so the products are
//! bit-identical to unpacking the nibbles). The zero point (128 for int8, 8 for int4, 128 for
//! the int4 high nibbles in place, 32 for int6) is removed exactly: each `vpdpbusd` starts from
//! `-zero *` the activations' 4-column sums instead of 0; except on int4 with grid sides
//! (`spark-run quantize`'s int4, the decode path), where it comes off in f32 with the bias
//! term, once per super-block and row (`sum_g (bias_g - 8 scale_g) A_g`), and the scale
//! products are formed once per super-block too: a third fewer operations per chunk. Int4 and
//! int6 with f16 or f32 scales per 32-block on whole super-blocks form their scale products
//! once per super-block as well (`PairSuper`; the zero point stays in `vpdpbusd`'s start).
//! Int4 on whole super-blocks (grids or `PairSuper`) reads a row two chunks per plain 64-byte
//! load (the low nibbles of both chunks, then their high nibbles, against activations and
//! 4-column sums regrouped to match), which spares the broadcast per chunk. Int6 chunks are
//! unpacked to `0..=63` in column order: in [`I6Layout::Groups`] (`I6G`, with AVX-512 VBMI) by
//! one plain load, a byte permute that puts each group's three bytes in a qword little-endian,
//! a multishift that takes each value's six bits to its byte, and a mask (+30 % for the int6
//! GEMV in L2 on a Zen 4); in [`I6Layout::Split`] (`I6`, without VBMI) by two broadcast loads, a
//! shift, a rotate, a mask and a ternary op. Every function is `unsafe` and needs AVX-512F,
//! AVX-512BW and AVX-512 VNNI (and F16C, for f16 scales; `I6G` AVX-512 VBMI too).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use spark_core::quant::QFormat;

use super::qmatmul::{I6Layout, ScaleMode, SideEl, TileArgs, TileKind, I6_CHUNK_BYTES, QBLOCK, QCHUNK, SUPER_BLOCKS};

/// How a weight format yields the 64 unsigned bytes of a chunk.
trait Fmt {
    /// Whether the weight bytes are unpacked from nibbles (extra registers).
    const UNPACK: bool = false;
    /// Int4: whole super-blocks read two chunks per plain load (see [`tile`]).
    const PAIRED: bool = false;
    /// The zero point of the stored values, in the units of the scales (what [`Fmt::start`]
    /// takes off; the grid tiles take it off with the bias term instead).
    const ZERO: i32;
    /// `-zero * s` for the 4-column activation sums `s`.
    unsafe fn start(s: __m512i) -> __m512i;
    unsafe fn chunk(w: *const u8, c: usize) -> __m512i;
    /// The activation scales `dv` of a chunk's 16 lanes, adjusted for how [`Fmt::chunk`] scales
    /// the weight bytes.
    #[inline(always)]
    unsafe fn act_scales(dv: __m512) -> __m512 {
        dv
    }
    /// The same for eight consecutive blocks' scales from an even block: what
    /// [`Fmt::act_scales`] gives the lanes of each block.
    #[inline(always)]
    unsafe fn block_act_scales(d8: __m256) -> __m256 {
        d8
    }
}

struct I8;
struct I4;
/// Int6 in [`I6Layout::Split`].
struct I6;
/// Int6 in [`I6Layout::Groups`] (AVX-512 VBMI: [`vbmi`]).
struct I6G;

impl Fmt for I8 {
    const ZERO: i32 = 128;
    #[inline(always)]
    unsafe fn start(s: __m512i) -> __m512i {
        _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<7>(s))
    }
    #[inline(always)]
    unsafe fn chunk(w: *const u8, c: usize) -> __m512i {
        // Signed bytes to `q + 128` (the zero point the caller corrects).
        _mm512_xor_si512(_mm512_loadu_si512(w.add(c * QCHUNK) as *const _), _mm512_set1_epi8(-128))
    }
}

impl Fmt for I4 {
    const UNPACK: bool = true;
    const PAIRED: bool = true;
    const ZERO: i32 = 8;
    #[inline(always)]
    unsafe fn start(s: __m512i) -> __m512i {
        // Lanes 0-7: low nibbles, zero point 8; lanes 8-15: high nibbles in place, 16 * 8.
        _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_sllv_epi32(s, I4_SHIFT.v))
    }
    #[inline(always)]
    unsafe fn chunk(w: *const u8, c: usize) -> __m512i {
        // One broadcast load (no shuffle uop) and one mask: `16 * high nibble` in bytes 32-63.
        let v = _mm512_broadcast_i64x4(_mm256_loadu_si256(w.add(c * 32) as *const __m256i));
        _mm512_and_si512(v, I4_MASK.v)
    }
    #[inline(always)]
    unsafe fn act_scales(dv: __m512) -> __m512 {
        _mm512_mul_ps(dv, I4_LANE_SCALE.v)
    }
    #[inline(always)]
    unsafe fn block_act_scales(d8: __m256) -> __m256 {
        // Block `2j + 1` is chunk `j`'s high nibbles.
        _mm256_mul_ps(d8, _mm256_setr_ps(1.0, 0.0625, 1.0, 0.0625, 1.0, 0.0625, 1.0, 0.0625))
    }
}

impl Fmt for I6 {
    const UNPACK: bool = true;
    const ZERO: i32 = 32;
    #[inline(always)]
    unsafe fn start(s: __m512i) -> __m512i {
        // Zero point 32 in every lane.
        _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<5>(s))
    }
    #[inline(always)]
    unsafe fn chunk(w: *const u8, c: usize) -> __m512i {
        // The nibbles broadcast to both halves, the high half's shifted down (`0..=15` in every
        // byte, in column order); the 16 bytes of top bits broadcast to all four 128-bit lanes
        // and rotated per lane so that lane `i`'s field (bits `2i..2i+2`) lands at bits 4-5; one
        // ternary-logic op masks it and ors it in.
        let p = w.add(c * I6_CHUNK_BYTES);
        let v = _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i));
        let lo = _mm512_and_si512(_mm512_srlv_epi16(v, I6_NIBBLE_SHIFT.v), _mm512_set1_epi8(0x0F));
        let h = _mm512_rolv_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128(p.add(32) as *const __m128i)), I6_ROTATE.v);
        // A | (B & C): 0xF0 | (0xCC & 0xAA).
        _mm512_ternarylogic_epi32::<0xF8>(lo, h, _mm512_set1_epi8(0x30))
    }
}

#[repr(C)]
union Words {
    a: [u16; 32],
    v: __m512i,
}
/// Shift of each 16-bit word of the broadcast nibbles: 0 in the low half, 4 in the high.
const I6_NIBBLE_SHIFT: Words = {
    let mut a = [0u16; 32];
    let mut i = 16;
    while i < 32 {
        a[i] = 4;
        i += 1;
    }
    Words { a }
};
/// Left rotation of each 32-bit lane of the broadcast top bits: field `i` (bits `2i`) of each
/// byte to bits 4-5 in 128-bit lane `i` (by 4, 2, 0, and 30 = right by 2; bits moved into a
/// neighbouring byte fall outside the mask).
const I6_ROTATE: Idx = Idx { a: [4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0, 30, 30, 30, 30] };

impl Fmt for I6G {
    const UNPACK: bool = true;
    const ZERO: i32 = I6::ZERO;
    #[inline(always)]
    unsafe fn start(s: __m512i) -> __m512i {
        I6::start(s)
    }
    #[inline(always)]
    unsafe fn chunk(w: *const u8, c: usize) -> __m512i {
        // 64 bytes from the chunk's 48 (the rest is the next chunk's, or the buffer's slack);
        // each qword gets two groups' bytes in little-endian order (the groups' 24-bit numbers
        // at bits 0 and 24), each byte its value's six bits from there, masked.
        let v = _mm512_loadu_si512(w.add(c * I6_CHUNK_BYTES) as *const _);
        let e = _mm512_permutexvar_epi8(I6_SPREAD.v, v);
        _mm512_and_si512(_mm512_multishift_epi64_epi8(I6_SHIFTS.v, e), _mm512_set1_epi8(0x3F))
    }
}

/// Chunk `c` (64 columns) of a packed row `w` as 64 bytes `q + zero` in column order: int8 `q +
/// 128`, int4 its nibbles (`q + 8`), int6 `q + 32`; what [`super::qprefill_vnni`] repacks.
///
/// # Safety
/// AVX-512F/BW/VNNI, and AVX-512 VBMI for int6 in [`I6Layout::Groups`]; `w` holds the row's
/// chunks up to `c` in the format's layout (int6: and 16 readable bytes past chunk `c`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn column_chunk(format: QFormat, i6: I6Layout, w: *const u8, c: usize) -> __m512i {
    match format {
        QFormat::I8 => I8::chunk(w, c),
        QFormat::I4 => {
            // The 32 bytes in both halves, the high half's shifted down: the low nibbles are
            // columns 0-31, the high ones 32-63.
            let v = _mm512_broadcast_i64x4(_mm256_loadu_si256(w.add(c * 32) as *const __m256i));
            _mm512_and_si512(_mm512_srlv_epi16(v, I6_NIBBLE_SHIFT.v), _mm512_set1_epi8(0x0F))
        }
        QFormat::I6 if i6 == I6Layout::Split => I6::chunk(w, c),
        QFormat::I6 => column_chunk_vbmi(w, c),
    }
}

/// [`column_chunk`] of int6 in [`I6Layout::Groups`].
///
/// # Safety
/// As [`column_chunk`], with AVX-512 VBMI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
unsafe fn column_chunk_vbmi(w: *const u8, c: usize) -> __m512i {
    I6G::chunk(w, c)
}

/// Whether this CPU has AVX-512 VBMI (cached): the int6 tiles then unpack with [`I6`].
pub(crate) fn vbmi() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| is_x86_feature_detected!("avx512vbmi"))
}

/// [`I6`]'s byte permute: qword `q` gets group `2q`'s bytes at 0-2 and group `2q + 1`'s at
/// 3-5, each reversed (little-endian: the group's 24-bit number); bytes 6-7 are unused.
const I6_SPREAD: Bytes = {
    let mut a = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let (q, k) = (i / 8, i % 8);
        if k < 6 {
            a[i] = (3 * (2 * q + k / 3) + 2 - k % 3) as u8;
        }
        i += 1;
    }
    Bytes { a }
};
/// [`I6`]'s multishift: byte `k` of each qword from bit `18 - 6 (k % 4)` of the group's number at
/// bit `24 (k / 4)`.
const I6_SHIFTS: Bytes = {
    let mut a = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let k = i % 8;
        a[i] = (24 * (k / 4) + 18 - 6 * (k % 4)) as u8;
        i += 1;
    }
    Bytes { a }
};
#[repr(C)]
pub(super) union Bytes {
    a: [u8; 64],
    pub(super) v: __m512i,
}
#[repr(C)]
union Floats {
    a: [f32; 16],
    v: __m512,
}
/// Low nibbles in bytes 0-31, high nibbles (in place) in bytes 32-63.
pub(super) const I4_MASK: Bytes = {
    let mut a = [0x0Fu8; 64];
    let mut i = 32;
    while i < 64 {
        a[i] = 0xF0;
        i += 1;
    }
    Bytes { a }
};
/// The zero point's shift per lane: `8 = 1 << 3` for the low nibbles, `128 = 1 << 7` in place.
const I4_SHIFT: Idx = Idx { a: [3, 3, 3, 3, 3, 3, 3, 3, 7, 7, 7, 7, 7, 7, 7, 7] };
/// Undoes the high nibbles' factor 16 (exact: a power of two).
const I4_LANE_SCALE: Floats = Floats {
    a: [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0625, 0.0625, 0.0625, 0.0625, 0.0625, 0.0625, 0.0625, 0.0625],
};

/// How the weight scales of a chunk fill 16 lanes (four columns each), from scales of type `E`.
trait Scale {
    /// One scale for the whole row, applied after the sum (`sv` is then unused).
    const ROW: bool = false;
    /// Scales and biases on [`Grid`]s ([`GridPair`]: the tile reads them itself, and takes the
    /// zero point off with the bias term in f32). Implies [`Scale::SUPER`].
    const GRID: bool = false;
    /// One scale per 32-block on whole super-blocks ([`PairSuper`], [`GridPair`]): the tile
    /// forms a super-block's eight `weight scale * activation scale` products once per row and
    /// spreads a chunk's two with one permute (`sv` unused).
    const SUPER: bool = false;
    /// Whether `sv` gathers several scales per chunk (extra registers).
    const WIDE_SCALES: bool = false;
    /// A chunk's 16 lanes of weight scales; unused (zero) with [`Scale::ROW`] or [`Scale::SUPER`].
    #[inline(always)]
    unsafe fn sv<E: SideEl>(_s: *const E, _sidx: *const u32, _c: usize) -> __m512 {
        _mm512_setzero_ps()
    }
}

/// One scale per row.
struct PerRow;

impl Scale for PerRow {
    const ROW: bool = true;
}

/// One scale per chunk (`group % 64 == 0`).
struct Chunk;
/// One scale per 32-block.
struct Block;
/// One scale per 16-column half-block.
struct Half;

impl Scale for Chunk {
    #[inline(always)]
    unsafe fn sv<E: SideEl>(s: *const E, sidx: *const u32, c: usize) -> __m512 {
        _mm512_set1_ps(E::get(s, *sidx.add(4 * c) as usize))
    }
}

impl Scale for Block {
    const WIDE_SCALES: bool = true;
    #[inline(always)]
    unsafe fn sv<E: SideEl>(s: *const E, sidx: *const u32, c: usize) -> __m512 {
        let two = _mm_unpacklo_ps(
            _mm_set_ss(E::get(s, *sidx.add(4 * c) as usize)),
            _mm_set_ss(E::get(s, *sidx.add(4 * c + 2) as usize)),
        );
        _mm512_permutexvar_ps(IDX2.v, _mm512_castps128_ps512(two))
    }
}

/// One scale per 32-block, the chunk's two adjacent in the row ([`ScaleMode::Pair`]).
struct Pair;

impl Scale for Pair {
    const WIDE_SCALES: bool = true;
    #[inline(always)]
    unsafe fn sv<E: SideEl>(s: *const E, _sidx: *const u32, c: usize) -> __m512 {
        _mm512_permutexvar_ps(IDX2.v, _mm512_castps128_ps512(E::pair(s, 2 * c)))
    }
}

impl Scale for Half {
    const WIDE_SCALES: bool = true;
    #[inline(always)]
    unsafe fn sv<E: SideEl>(s: *const E, sidx: *const u32, c: usize) -> __m512 {
        let g = |h: usize| E::get(s, *sidx.add(4 * c + h) as usize);
        let four = _mm_setr_ps(g(0), g(1), g(2), g(3));
        _mm512_permutexvar_ps(IDX4.v, _mm512_castps128_ps512(four))
    }
}

/// One scale per 16-column half-block, the chunk's four adjacent in the row
/// ([`ScaleMode::Quad`]).
struct Quad;

impl Scale for Quad {
    const WIDE_SCALES: bool = true;
    #[inline(always)]
    unsafe fn sv<E: SideEl>(s: *const E, _sidx: *const u32, c: usize) -> __m512 {
        _mm512_permutexvar_ps(IDX4.v, _mm512_castps128_ps512(E::quad(s, 4 * c)))
    }
}

/// [`Pair`] on whole super-blocks (`ng` a multiple of 8, `kp = 32 ng`): the products of a
/// super-block's eight scales with the activation scales are formed once per row and spread
/// to a chunk's lanes with one permute, instead of loading, converting and multiplying two
/// scales per row and chunk.
struct PairSuper;

impl Scale for PairSuper {
    const SUPER: bool = true;
    const WIDE_SCALES: bool = true;
}

/// One scale per 32-block from a [`Grid`] (`spark-run quantize`'s int4 at the VNNI level):
/// the tile converts a super-block's eight `k` once per row (`k * 2^e`, exactly the f16 scales'
/// values), multiplies them by the activation scales and spreads a chunk's two products with
/// one permute; it adds the super-block's bias and zero-point term at the same time.
struct GridPair;

impl Scale for GridPair {
    const GRID: bool = true;
    const SUPER: bool = true;
    const WIDE_SCALES: bool = true;
}

/// A super-block's eight scales or biases `k * unit` (from the row's `k` at `k`: unsigned
/// bytes for scales, signed for biases).
///
/// # Safety
/// Eight readable bytes at `k`; AVX2 (inlined into the tile).
#[inline(always)]
unsafe fn grid_sides<const SIGNED: bool>(k: *const u8, unit: f32) -> __m256 {
    let b = _mm_loadl_epi64(k as *const __m128i);
    let kv = if SIGNED { _mm256_cvtepi8_epi32(b) } else { _mm256_cvtepu8_epi32(b) };
    _mm256_mul_ps(_mm256_cvtepi32_ps(kv), _mm256_set1_ps(unit))
}

/// Super-blocks whose grid units the tile forms at once ([`grid_units`]).
const UNITS: usize = 16;

/// The units `2^e` ([`super::qmatmul::Grid::unit`]) of the `n <= 16` exponents at `e` (lanes past `n`: 1).
///
/// # Safety
/// `n` readable bytes at `e`; AVX-512F/BW (inlined into the tile).
#[inline(always)]
unsafe fn grid_units(e: *const i8, n: usize) -> [f32; UNITS] {
    let mask = if n >= UNITS { 0xFFFF } else { (1u64 << n) - 1 };
    let e = _mm512_cvtepi8_epi32(_mm512_castsi512_si128(_mm512_maskz_loadu_epi8(mask, e)));
    // The bits of `2^e`, a normal f32 (`-24 <= e <= 127`, as `Grid::unit`).
    let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(e, _mm512_set1_epi32(127)));
    let mut out = [0.0f32; UNITS];
    _mm512_storeu_ps(out.as_mut_ptr(), _mm512_castsi512_ps(bits));
    out
}

#[repr(C)]
union Idx {
    a: [i32; 16],
    v: __m512i,
}
/// Lanes 0-7 from element 0, 8-15 from element 1.
const IDX2: Idx = Idx { a: [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1] };
/// Lanes 0-7 from element 0, 8-15 from element 2 (a chunk pair's low-nibble blocks).
const IDX_PAIR: Idx = Idx { a: [0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2] };
/// Four lanes from each of elements 0..4.
const IDX4: Idx = Idx { a: [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3] };

/// `R` rows x `T` tokens over all columns. Inlined into [`run`] or [`run_vbmi`], whose target
/// features it is compiled with.
///
/// # Safety
/// AVX-512F/BW/VNNI (and VBMI for [`I6G`]); `a` describes `R` packed rows and `T` token rows of
/// `a.kp` columns.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<F: Fmt, S: Scale, E: SideEl, const R: usize, const T: usize>(a: &TileArgs<'_>) -> [[f32; T]; R] {
    let nc = a.kp / QCHUNK;
    let nb = a.kp / QBLOCK;
    let sidx = a.sidx.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut pf = a.prefetcher(R, nc).cursor();
    // The sides' prefetches go once per four chunks (a super-block: at most 16 bytes of f16
    // scales per row, a line's worth over the four rows; stepped per chunk they cost about as
    // much as the arithmetic in an L2-resident GEMV).
    const SIDE_STEP: usize = SUPER_BLOCKS / 2;
    let per = if S::SUPER { SIDE_STEP } else { 1 };
    let [ps, pb] = a.side_prefetchers(R, nc.div_ceil(SIDE_STEP));
    let (mut ps, mut pb) = (ps.cursor(), pb.cursor());
    // The grids' exponents are a byte per row and super-block (32 bytes for four rows of 2048
    // columns): fetched at the start, one step.
    if S::GRID {
        let [pe, pbe] = a.grid_prefetchers(R, 1);
        pe.cursor().advance();
        pbe.cursor().advance();
    }
    // With grids, the units `2^e` of [`UNITS`] super-blocks per row, for the scales and the
    // biases, formed [`UNITS`] at a time (a masked load and three operations per row, where
    // forming one per super-block and row took a sign extension, two integer operations, a
    // move and a broadcast each: about 8 % of an L2-resident GEMV).
    let mut su = [[0.0f32; UNITS]; R];
    let mut bu = [[0.0f32; UNITS]; R];
    // With grids, once per super-block: per row and token, its eight `weight scale *
    // activation scale` products (lanes 0-7; formed per chunk they cost a multiply per row
    // and chunk, one of seven vector operations there), and its share of the bias and
    // zero-point term, `sum_g (bias_g - zero scale_g) A_g`, added to the accumulator's lanes
    // 0-7 (instead of a pass after the row that converted the scales again). Together: 18.5 ->
    // 22.3 GB/s for a 2048 x 2048 GEMV in L3 on a Zen 4. The chunks go a super-block at a time
    // (a constant count, unrolled, so each chunk's permute index is a constant).
    let mut sd = [[_mm512_setzero_ps(); T]; R];
    let nsb = a.ng / SUPER_BLOCKS;
    let biased = !a.b.is_null();
    for c0 in (0..nc).step_by(per) {
        if S::GRID {
            let sb = c0 / per;
            ps.advance();
            pb.advance();
            if sb % UNITS == 0 {
                let n = (nsb - sb).min(UNITS);
                for r in 0..R {
                    su[r] = grid_units(a.sexp.add(r * nsb + sb), n);
                    if biased {
                        bu[r] = grid_units(a.bexp.add(r * nsb + sb), n);
                    }
                }
            }
            let g0 = sb * SUPER_BLOCKS;
            let mut d8 = [_mm256_setzero_ps(); T];
            let mut a8 = [_mm512_setzero_ps(); T];
            for t in 0..T {
                d8[t] = F::block_act_scales(_mm256_loadu_ps(a.d.add(t * nb + g0)));
                a8[t] = _mm512_zextps256_ps512(_mm256_loadu_ps(a.ga.add(t * a.ng + g0)));
            }
            for r in 0..R {
                let s8 = grid_sides::<false>(a.s.add(r * a.ng + g0), su[r][sb % UNITS]);
                for t in 0..T {
                    sd[r][t] = _mm512_castps256_ps512(_mm256_mul_ps(s8, d8[t]));
                }
                let z = _mm256_set1_ps(-(F::ZERO as f32));
                let w8 = if biased {
                    let b8 = grid_sides::<true>(a.b.add(r * a.ng + g0), bu[r][sb % UNITS]);
                    _mm256_fmadd_ps(s8, z, b8)
                } else {
                    _mm256_mul_ps(s8, z)
                };
                let w8 = _mm512_zextps256_ps512(w8);
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(w8, a8[t], acc[r][t]);
                }
            }
        } else if S::SUPER {
            let g0 = c0 / per * SUPER_BLOCKS;
            let mut d8 = [_mm256_setzero_ps(); T];
            for t in 0..T {
                d8[t] = F::block_act_scales(_mm256_loadu_ps(a.d.add(t * nb + g0)));
            }
            for r in 0..R {
                let s8 = E::load8(a.s.cast::<E>().add(r * a.ng + g0));
                for t in 0..T {
                    sd[r][t] = _mm512_castps256_ps512(_mm256_mul_ps(s8, d8[t]));
                }
            }
        }
        if S::SUPER && F::PAIRED {
            // Int4 on whole super-blocks: two chunks of a row per plain 64-byte load, no broadcast (a
            // shuffle per row and chunk, which with the permute bound this tile on a Zen 4).
            // Masked twice, the load gives the low nibbles of chunks `c` and `c + 1` (blocks
            // `2j` and `2j + 2`) and their high nibbles in place (blocks `2j + 1` and `2j + 3`,
            // times 16); the activations are regrouped to match, two shuffles per token shared
            // by the tile's rows. The same four-column sums, each block's product scaled by the
            // same f32 value; only the order of the f32 additions differs.
            for j in (0..per).step_by(2) {
                let c = c0 + j;
                pf.advance();
                pf.advance();
                if !S::GRID && c % SIDE_STEP == 0 {
                    // The sides' prefetch, once per super-block (the grid tiles step it above).
                    ps.advance();
                    pb.advance();
                }
                let (m_lo, m_hi) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0xF0u8 as i8));
                let mut lo = [_mm512_setzero_si512(); R];
                let mut hi = [_mm512_setzero_si512(); R];
                for r in 0..R {
                    let v = _mm512_loadu_si512(a.w.add(r * a.row_bytes + c * 32) as *const _);
                    lo[r] = _mm512_and_si512(v, m_lo);
                    hi[r] = _mm512_and_si512(v, m_hi);
                }
                let idx_lo = _mm512_add_epi32(IDX_PAIR.v, _mm512_set1_epi32(2 * j as i32));
                let idx_hi = _mm512_add_epi32(idx_lo, _mm512_set1_epi32(1));
                for t in 0..T {
                    let q0 = _mm512_loadu_si512(a.q.add(t * a.kp + c * QCHUNK) as *const _);
                    let q1 = _mm512_loadu_si512(a.q.add(t * a.kp + (c + 1) * QCHUNK) as *const _);
                    // [q0 columns 0-31, q1 columns 0-31] and [q0 32-63, q1 32-63].
                    let q_lo = _mm512_shuffle_i64x2::<0x44>(q0, q1);
                    let q_hi = _mm512_shuffle_i64x2::<0xEE>(q0, q1);
                    // The zero point: with grids it comes off with the bias term, in f32;
                    // otherwise each `vpdpbusd` starts from `-8 *` (low nibbles) or `-128 *`
                    // (high nibbles in place) the 4-column sums, regrouped like the activations.
                    let (z_lo, z_hi) = if S::GRID {
                        (_mm512_setzero_si512(), _mm512_setzero_si512())
                    } else {
                        let s0 = _mm512_loadu_si512(a.s4.add(t * (a.kp / 4) + c * 16) as *const _);
                        let s1 = _mm512_loadu_si512(a.s4.add(t * (a.kp / 4) + (c + 1) * 16) as *const _);
                        let zero = _mm512_setzero_si512();
                        (
                            _mm512_sub_epi32(zero, _mm512_slli_epi32::<3>(_mm512_shuffle_i64x2::<0x44>(s0, s1))),
                            _mm512_sub_epi32(zero, _mm512_slli_epi32::<7>(_mm512_shuffle_i64x2::<0xEE>(s0, s1))),
                        )
                    };
                    for r in 0..R {
                        let pl = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z_lo, lo[r], q_lo));
                        let ph = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z_hi, hi[r], q_hi));
                        acc[r][t] = _mm512_fmadd_ps(pl, _mm512_permutexvar_ps(idx_lo, sd[r][t]), acc[r][t]);
                        acc[r][t] = _mm512_fmadd_ps(ph, _mm512_permutexvar_ps(idx_hi, sd[r][t]), acc[r][t]);
                    }
                }
            }
            continue;
        }
        // Past here no grids: they are int4 on whole super-blocks and took the paired path.
        const { assert!(!S::GRID || (S::SUPER && F::PAIRED), "grid tiles take the paired path") };
        for j in 0..per {
            let c = c0 + j;
            pf.advance();
            if c % SIDE_STEP == 0 {
                ps.advance();
                pb.advance();
            }
            let mut wv = [_mm512_setzero_si512(); R];
            let mut sv = [_mm512_setzero_ps(); R];
            // On whole super-blocks, this chunk's two blocks: lanes 0-7 from product `2j`, 8-15
            // from `2j + 1`.
            let idx = _mm512_add_epi32(IDX2.v, _mm512_set1_epi32(2 * j as i32));
            for r in 0..R {
                wv[r] = F::chunk(a.w.add(r * a.row_bytes), c);
                if !S::ROW && !S::SUPER {
                    sv[r] = S::sv(a.s.cast::<E>().add(r * a.ng), sidx, c);
                }
            }
            for t in 0..T {
                let q = _mm512_loadu_si512(a.q.add(t * a.kp + c * QCHUNK) as *const _);
                let dv = if S::SUPER {
                    _mm512_setzero_ps()
                } else {
                    let d2 = _mm_castsi128_ps(_mm_loadl_epi64(a.d.add(t * nb + 2 * c) as *const __m128i));
                    F::act_scales(_mm512_permutexvar_ps(IDX2.v, _mm512_castps128_ps512(d2)))
                };
                let z = F::start(_mm512_loadu_si512(a.s4.add(t * (a.kp / 4) + c * 16) as *const _));
                for r in 0..R {
                    let p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, wv[r], q));
                    let scale = if S::SUPER {
                        _mm512_permutexvar_ps(idx, sd[r][t])
                    } else if S::ROW {
                        dv
                    } else {
                        _mm512_mul_ps(sv[r], dv)
                    };
                    acc[r][t] = _mm512_fmadd_ps(p, scale, acc[r][t]);
                }
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
            if S::ROW {
                out[r][t] *= E::get(a.s.cast::<E>(), r * a.ng);
            }
            if !S::GRID {
                out[r][t] += a.bias_term::<E>(r, t, 0);
            }
        }
    }
    out
}

/// Rows `r0..r1` x tokens `t0..t0+nt` into `tmp[i * ld + r - r0]`, in tiles of 4 rows x up to
/// 4 tokens (3 for int4 with per-block scales), for weights of `kind`; scales and biases on
/// [`Grid`]s when `grid` (int4, [`ScaleMode::Pair`]), else f16 when `kind.half`, else f32. Int4 and int6 with
/// [`ScaleMode::Pair`] on whole super-blocks take [`PairSuper`], and so does int8 (GGUF Q8_0,
/// `--to int8 --group 32`) at 1-3 tokens.
///
/// # Safety
/// AVX-512F/BW/VNNI and F16C; `args(r, t)` describes packed row `r` and token `t` of matching
/// buffers for every `r0 <= r < r1`, `t0 <= t < t0 + nt`, with scales and biases of the type
/// `grid` and `kind.half` say (with `grid`, `ng` a multiple of 8 and the exponents set);
/// `tmp.len() >= nt * ld`, `ld >= r1 - r0`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows_tokens<'a>(
    kind: TileKind,
    grid: bool,
    args: &impl Fn(usize, usize) -> TileArgs<'a>,
    r0: usize,
    r1: usize,
    t0: usize,
    nt: usize,
    tmp: &mut [f32],
    ld: usize,
) {
    let TileKind { format: fmt, mode, half, i6 } = kind;
    assert!(fmt != QFormat::I6 || i6 == I6Layout::Split || vbmi(), "int6 groups need AVX-512 VBMI");
    macro_rules! go {
        (I6G, $s:ty) => {
            // `I6G` is only chosen in the layout that needs VBMI, asserted above.
            super::by_side!(half, run_vbmi::<I6G, $s>(args, r0, r1, t0, nt, tmp, ld))
        };
        ($f:ty, $s:ty) => {
            super::by_side!(half, run::<$f, $s>(args, r0, r1, t0, nt, tmp, ld))
        };
    }
    if grid {
        assert!(fmt == QFormat::I4 && mode == ScaleMode::Pair, "grid sides are int4 in pairs of blocks");
        // The element type is unused: the grid tiles read their own sides.
        return run::<I4, GridPair, f32>(args, r0, r1, t0, nt, tmp, ld);
    }
    // Pair on whole super-blocks: `ng` a multiple of 8 and a scale for each 32 columns of `kp`
    // (so that a super-block's eight scales and activation scales are there to read).
    let whole_super = mode == ScaleMode::Pair && r0 < r1 && nt > 0 && {
        let a = args(r0, t0);
        a.ng.is_multiple_of(SUPER_BLOCKS) && a.kp == a.ng * QBLOCK
    };
    match (fmt, mode) {
        // Int8 from 4 tokens keeps its 4 x 4 tiles (`PairSuper` runs 4 x 3 there).
        (QFormat::I8, ScaleMode::Pair) if whole_super && nt < 4 => go!(I8, PairSuper),
        (QFormat::I4, ScaleMode::Pair) if whole_super => go!(I4, PairSuper),
        (QFormat::I6, _) if i6 == I6Layout::Groups => match mode {
            ScaleMode::Pair if whole_super => go!(I6G, PairSuper),
            ScaleMode::Row => go!(I6G, PerRow),
            ScaleMode::Chunk => go!(I6G, Chunk),
            ScaleMode::Block => go!(I6G, Block),
            ScaleMode::Pair => go!(I6G, Pair),
            ScaleMode::Half => go!(I6G, Half),
            ScaleMode::Quad => go!(I6G, Quad),
        },
        (QFormat::I6, ScaleMode::Pair) if whole_super => go!(I6, PairSuper),
        (QFormat::I8, ScaleMode::Row) => go!(I8, PerRow),
        (QFormat::I4, ScaleMode::Row) => go!(I4, PerRow),
        (QFormat::I8, ScaleMode::Chunk) => go!(I8, Chunk),
        (QFormat::I8, ScaleMode::Block) => go!(I8, Block),
        (QFormat::I8, ScaleMode::Pair) => go!(I8, Pair),
        (QFormat::I8, ScaleMode::Half) => go!(I8, Half),
        (QFormat::I8, ScaleMode::Quad) => go!(I8, Quad),
        (QFormat::I4, ScaleMode::Chunk) => go!(I4, Chunk),
        (QFormat::I4, ScaleMode::Block) => go!(I4, Block),
        (QFormat::I4, ScaleMode::Pair) => go!(I4, Pair),
        (QFormat::I4, ScaleMode::Half) => go!(I4, Half),
        (QFormat::I4, ScaleMode::Quad) => go!(I4, Quad),
        (QFormat::I6, ScaleMode::Row) => go!(I6, PerRow),
        (QFormat::I6, ScaleMode::Chunk) => go!(I6, Chunk),
        (QFormat::I6, ScaleMode::Block) => go!(I6, Block),
        (QFormat::I6, ScaleMode::Pair) => go!(I6, Pair),
        (QFormat::I6, ScaleMode::Half) => go!(I6, Half),
        (QFormat::I6, ScaleMode::Quad) => go!(I6, Quad),
    }
}

/// `run` and `run_vbmi`: [`run_body`] compiled with each set of target features.
macro_rules! runners {
    ($($(#[$doc:meta])* $name:ident: $features:literal;)*) => {$(
        $(#[$doc])*
        #[target_feature(enable = $features)]
        unsafe fn $name<'a, F: Fmt, S: Scale, E: SideEl>(
            args: &impl Fn(usize, usize) -> TileArgs<'a>,
            r0: usize,
            r1: usize,
            t0: usize,
            nt: usize,
            tmp: &mut [f32],
            ld: usize,
        ) {
            run_body::<F, S, E>(args, r0, r1, t0, nt, tmp, ld)
        }
    )*};
}

runners! {
    /// # Safety
    /// As [`rows_tokens`].
    run: "avx512f,avx512bw,avx512vnni,avx2,fma,f16c";
    /// [`run`] compiled with AVX-512 VBMI too (for [`I6G`]; kept apart so that no other tile
    /// may use VBMI instructions).
    ///
    /// # Safety
    /// As [`rows_tokens`], and AVX-512 VBMI.
    run_vbmi: "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c";
}

/// The loop over [`tile`]s that [`run`] and [`run_vbmi`] compile.
///
/// # Safety
/// As [`run_vbmi`] for [`I6G`], else as [`run`].
#[inline(always)]
unsafe fn run_body<'a, F: Fmt, S: Scale, E: SideEl>(
    args: &impl Fn(usize, usize) -> TileArgs<'a>,
    r0: usize,
    r1: usize,
    t0: usize,
    nt: usize,
    tmp: &mut [f32],
    ld: usize,
) {
    let mut r = r0;
    while r < r1 {
        let nr = if r + 4 <= r1 { 4 } else { 1 };
        let mut t = 0;
        while t < nt {
            // Per-block scales with unpacked int4 run out of registers at 4 x 4: use 4 x 3.
            // So do int8's with scale products per super-block (`PairSuper`).
            let tt = (nt - t).min(if S::WIDE_SCALES && (F::UNPACK || S::SUPER) { 3 } else { 4 });
            let mut a = args(r, t0 + t);
            if t + tt >= nt {
                // The last token tile over these rows: fetch the rows ahead meanwhile.
                a.plan_prefetch(r == r0, nr, r1 - r - nr);
            }
            let base = t * ld + r - r0;
            macro_rules! go {
                ($r:literal, $t:literal) => {{
                    let o = tile::<F, S, E, $r, $t>(&a);
                    for (j, row) in o.iter().enumerate() {
                        for (i, &v) in row.iter().enumerate() {
                            tmp[base + i * ld + j] = v;
                        }
                    }
                }};
            }
            super::tile_shape!(nr, tt, go);
            t += tt;
        }
        r += nr;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::qmatmul::i6_group;

    /// The VBMI unpacker gives every chunk's 64 values in column order, as the layout's scalar
    /// reader does, whatever bytes follow the chunk.
    #[test]
    fn int6_groups_unpack_in_column_order() {
        if !(is_x86_feature_detected!("avx512bw") && vbmi()) {
            eprintln!("skipped: this CPU has no AVX-512 VBMI");
            return;
        }
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        // Three chunks and the 16 bytes a chunk's load reads past it.
        let mut buf = vec![0u8; 3 * I6_CHUNK_BYTES + 16];
        for _ in 0..200 {
            for b in &mut buf {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                *b = seed as u8;
            }
            for c in 0..3 {
                let want: Vec<u8> =
                    (0..QCHUNK).map(|j| i6_group(&buf[c * I6_CHUNK_BYTES + j / 4 * 3..], j % 4)).collect();
                let mut got = [0u8; 64];
                // SAFETY: AVX-512 BW and VBMI (checked); the chunk and 16 bytes after it are in
                // `buf`.
                unsafe { _mm512_storeu_si512(got.as_mut_ptr().cast(), unpack(buf.as_ptr(), c)) };
                assert_eq!(got[..], want[..], "chunk {c}");
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn unpack(w: *const u8, c: usize) -> __m512i {
        I6G::chunk(w, c)
    }
}
