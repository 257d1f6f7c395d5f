//! Integer matmul for quantized weights: `out = x W^T` with `W` an int8, int6 or int4 [`QTensor`]
//! repacked at upload ([`QMat`]) and the activations `x` quantized on the fly ([`QAct`]).
//!
//! Precision (W8A8 / W4A8): each token's row of `x` is cut into blocks of 32 values, each
//! quantized symmetrically to int8 with its own f32 scale `d = max|x| / 127` (`q = x / d`
//! rounded half to even), once per call and shared by every weight row (llama.cpp's Q8_1 idea).
//! The weights are exactly the [`QTensor`]'s values, so relative to the float matmul of the
//! dequantized weights the only extra error is that of the activations: at most `d / 2 =
//! max|x_block| / 254` per element, i.e. `|err| <= sum_c |w_c| * max|x_block(c)| / 254` per
//! output, and about `sqrt(sum_c w_c^2 d_c^2 / 12)` RMS (rounding errors are uniform). The
//! integer dot of each 32-block is exact; it is scaled in f32 by `d * weight scale` and summed in
//! f32 (paths differ only in float summation order; all paths quantize `x` identically).
//!
//! The result for weight row `r` and token `t` is
//!
//! ```text
//! sum_b d[t,b] * dot_b(wq[r], qa[t]) * s[r, g(b)]  +  sum_g bias[r,g] * A[t,g]
//! ```
//!
//! where `A[t,g] = sum_{c in g} d[t,b(c)] * qa[t,c]` (the float sum of the quantized activations
//! of group `g`, kept per call) carries the `bias` term. Kernels that multiply unsigned weight
//! bytes (`vpdpbusd` on int8 as `q + 128`; int4 nibbles `0..=15` with zero point 8) remove the
//! zero point in integers, from the activations' sums over each 4 columns (kept per call too):
//! `dot(q + z, qa) - z * sum(qa)` is exact.
//!
//! Layout ([`QMat`]): rows padded to a multiple of 64 columns (zero weights; padded activations
//! are zero too), 64-byte aligned. Int8 is stored as the signed bytes themselves (the AVX2 sign
//! trick wants them; VNNI flips the top bit on load); int4 per 64-column chunk as 32 bytes with
//! element `j` in the low nibble of byte `j` and element `j + 32` in the high nibble, so one
//! 256-bit load, a mask and a shift give the two 32-blocks in order; int6 per chunk in 48 bytes
//! ([`I6_CHUNK_BYTES`]) in one of two layouts ([`I6Layout`], chosen for the CPU's kernels):
//! [`I6Layout::Split`], those 32 bytes of low nibbles then 16 bytes of top bits (element
//! `16 i + j` at bits `2i` of byte `32 + j`), or [`I6Layout::Groups`], 16 groups of 3 bytes each
//! holding four elements as a big-endian 24-bit number ([`i6_group`]). The int6 kernels may read
//! up to 16 bytes past a chunk: the buffer has 64 readable bytes after the last row
//! ([`QMat::packed_ptr`]). Scales and biases are the tensor's values (`[rows, cols / group]`),
//! held as f16 when they fit one ([`QTensor::sides_fit_f16`]: exact, or within 2^-11 for GGUF
//! K-quant products) and this CPU's kernels gain from it ([`Side`], [`QMat::f16_sides_pay`]),
//! else as the tensor's own f32 array; a table maps each 16-column half-block to its group,
//! and per-row scales (`group == cols`) are applied once after the row's sum. Group sizes must
//! be multiples of 16 ([`QMat::supports`]); the backend dequantizes others at upload.
//!
//! Scheduling mirrors the float path: rayon over row chunks; within a chunk, tokens in blocks
//! (4 for decode-sized batches, so the weights stream once per 4 tokens; 32 for prefill, whose
//! int8 rows then stay in cache while every row tile of the chunk runs over them) and register
//! tiles of `R` rows x `T` tokens (each weight load reused for `T` tokens, each activation load
//! for `R` rows). Paths: [`super::qavx512`] (VNNI), [`super::qavx2`] (`vpmaddubsw`), and the
//! portable scalar kernel here, which is the reference. From 12 tokens at the VNNI level,
//! [`quant_matmul`] runs the same product on weights repacked into 16-row panels
//! ([`super::qprefill_vnni`]). One exception to the int8 activations:
//! at the AVX2 and VNNI levels, int8 weights with a scale per row in steps of at most four
//! tokens go to [`super::qdecode16`] (16-bit activations, one scale per 256 columns).

use std::sync::Arc;

use rayon::prelude::*;
use spark_core::quant::{QFormat, QTensor};
use spark_core::DType;

use super::{Prefetcher, QSimd, SharedOut};
use crate::huge_pages::HugeBytes;

/// Activation block (values sharing one int8 scale).
pub const QBLOCK: usize = 32;
/// Column padding of the packed rows (one int4 chunk, one AVX-512 register of int8).
pub const QCHUNK: usize = 64;
/// Fewest tokens for the AVX2 super-block kernel (int4 with [`SubScales`], int8 per row:
/// [`QMat::sums_super_blocks`]). One token's GEMV streams the weights at the memory's pace
/// either way (kernel bench, 1.7B shapes, one core: 11.7-20.6 GMAC/s both, run to run), so
/// decode keeps per-block activation scales, the finer ones; from two tokens on the integer
/// sums pay (int4, 4 tokens: 33-36 against 22-23 GMAC/s; whole-model batched decode +16-34 %
/// for int4, +22 % for int8, at about 2 dB of int8's logit SNR on the demo). From 32 tokens
/// [`quant_matmul`] takes integer panels instead ([`super::qprefill_avx2::MIN_TOKENS`]): int4
/// with sub-scales those of [`super::qprefill_avx2`], int8 those of [`super::qpanels16_avx2`],
/// the rest those of [`super::qpanels_avx2`].
pub const SUB_SCALE_MIN_TOKENS: usize = 2;

/// 32-blocks per int4 super-block ([`spark_core::quant::SUPER_COLS`] columns).
pub const SUPER_BLOCKS: usize = spark_core::quant::SUPER_COLS / QBLOCK;

/// The integer sub-scales of an int4 matrix in groups of 32 whose steps are `k * u` per row and
/// super-block, `u` a power of two and `k` in 0..=255 (what `spark-run quantize` writes:
/// `spark_core::quant::SUPER_COLS`). The AVX2 kernel then sums a super-block's eight blocks
/// in integers, `k` the second operand of `vpmaddwd`, and converts once per super-block.
pub struct SubScales {
    /// `[rows, ng]`: `k`.
    pub k: Vec<u8>,
    /// `[rows, ng / 8]` (rounded up): `u`.
    pub unit: Vec<f32>,
}

/// One row's sub-scales from its scales (groups of 32): `k` into `ks`, one unit per super-block
/// into `us` ([`common_unit`]), or false where a super-block has no such form.
fn row_sub_scales(row: &[f32], ks: &mut [u8], us: &mut [f32]) -> bool {
    row.chunks(SUPER_BLOCKS)
        .zip(ks.chunks_mut(SUPER_BLOCKS))
        .zip(us.iter_mut())
        .all(|((sb, ks), u)| common_unit(sb, ks).map(|v| *u = v).is_some())
}

/// How a 32-block finds its weight scales (all groups are multiples of 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleMode {
    /// One scale per row (`group == cols`): applied once, after the row's sum.
    Row,
    /// `group % 64 == 0`: one scale per 64-column chunk.
    Chunk,
    /// `group % 32 == 0`: one scale per 32-block.
    Block,
    /// `group == 32` and no column padding: [`ScaleMode::Block`] whose two scales per chunk are
    /// adjacent in the row's scales (one 8-byte load instead of the table lookups).
    Pair,
    /// `group % 16 == 0`: one scale per 16-column half-block.
    Half,
    /// `group == 16` and no column padding: [`ScaleMode::Half`] whose four scales per chunk are
    /// adjacent in the row's scales (GGUF Q6_K: one 16- or 8-byte load instead of four table
    /// lookups and scalar conversions).
    Quad,
}

/// A unit `u` of which every value of `vals` is an integer multiple `k <= 255` (written to
/// `ks`), or `None` (a negative or non-finite value, or no such unit). First the power of two
/// that `spark-run quantize` uses ([`spark_core::quant::super_unit`] of the largest: `k` by an
/// exact multiply, cheap at load); else the largest unit, exactly: each value is an odd integer
/// times a power of two; aligned to the smallest power, their integer gcd `G` gives `u = G 2^e`
/// (odd and below 2^24, so an f32; GGUF Q4_K's `d` times 6-bit sub-scales), and `k * u` is the
/// value itself. All zeros: `u = 1`. One super-block at a time: more than [`SUPER_BLOCKS`]
/// values, or fewer `ks` than values, give `None`.
pub fn common_unit(vals: &[f32], ks: &mut [u8]) -> Option<f32> {
    if vals.len() > SUPER_BLOCKS || ks.len() < vals.len() {
        return None;
    }
    let mut dmax = 0.0f32;
    for &v in vals {
        if !(v >= 0.0 && v.is_finite()) {
            return None;
        }
        dmax = dmax.max(v);
    }
    if dmax == 0.0 {
        ks.fill(0);
        return Some(1.0);
    }
    let u = spark_core::quant::super_unit(dmax);
    // A power of two of at least 2^-24: its inverse is exact, and so is each product.
    let inv = 1.0 / u;
    if vals.iter().all(|&v| (v * inv).fract() == 0.0) {
        for (k, &v) in ks.iter_mut().zip(vals) {
            *k = (v * inv) as u8;
        }
        return Some(u);
    }
    // (odd mantissa, exponent) of each nonzero value.
    let mut parts = [(0u64, 0i32); SUPER_BLOCKS];
    let parts = &mut parts[..vals.len()];
    let mut emin = i32::MAX;
    for (p, &v) in parts.iter_mut().zip(vals) {
        if v == 0.0 {
            continue;
        }
        let bits = v.to_bits();
        let (field, frac) = ((bits >> 23) & 0xFF, (bits & 0x7F_FFFF) as u64);
        let (m, e) = if field == 0 { (frac, -149) } else { (frac | 0x80_0000, field as i32 - 150) };
        let tz = m.trailing_zeros();
        *p = (m >> tz, e + tz as i32);
        emin = emin.min(p.1);
    }
    let mut g = 0u64;
    for p in parts.iter_mut().filter(|p| p.0 != 0) {
        // The unit's odd part divides this odd mantissa, so k is a multiple of 2^shift: more
        // than 7 means k > 255.
        let shift = p.1 - emin;
        if shift > 7 {
            return None;
        }
        p.0 <<= shift;
        g = gcd(g, p.0);
    }
    for (k, p) in ks.iter_mut().zip(parts.iter()) {
        // `g` divides `p.0` (< 2^31): the f64 quotient is that integer exactly.
        let q = p.0 as f64 / g as f64;
        if q > 255.0 {
            return None;
        }
        *k = q as u8;
    }
    // In f64 (2^-149 is a normal f64; f32 powi would underflow), then exactly to f32.
    Some((g as f64 * 2f64.powi(emin)) as f32)
}

/// Greatest common divisor (`gcd(0, b) = b`), binary (no divisions: this runs per
/// super-block at load).
fn gcd(mut a: u64, mut b: u64) -> u64 {
    if a == 0 || b == 0 {
        return a | b;
    }
    let shift = (a | b).trailing_zeros();
    a >>= a.trailing_zeros();
    loop {
        b >>= b.trailing_zeros();
        if a > b {
            std::mem::swap(&mut a, &mut b);
        }
        b -= a;
        if b == 0 {
            return a << shift;
        }
    }
}

/// One int4 row from the tensor's order (element `2j` in the low nibble of byte `j`, `2j + 1`
/// in the high) into [`QMat`]'s (per 64-column chunk, element `j` low and `j + 32` high in byte
/// `j`); columns past `cols` are nibble 8 (q = 0). `dst` is the padded row.
fn repack_int4_row(src: &[u8], cols: usize, dst: &mut [u8]) {
    for (ci, chunk) in dst.chunks_exact_mut(QCHUNK / 2).enumerate() {
        let c0 = ci * QCHUNK;
        if c0 + QCHUNK <= cols {
            let s = &src[c0 / 2..c0 / 2 + QCHUNK / 2];
            let mut e = [0u8; QCHUNK];
            for j in 0..QCHUNK / 2 {
                e[2 * j] = s[j] & 0xF;
                e[2 * j + 1] = s[j] >> 4;
            }
            for (j, d) in chunk.iter_mut().enumerate() {
                *d = e[j] | (e[j + 32] << 4);
            }
        } else {
            let nib = |c: usize| if c < cols { (src[c / 2] >> (4 * (c % 2))) & 0xF } else { 8 };
            for (j, d) in chunk.iter_mut().enumerate() {
                *d = nib(c0 + j) | (nib(c0 + j + 32) << 4);
            }
        }
    }
}

/// How [`QMat`] holds an int6 chunk's 64 values `0..=63` (zero point 32) in its 48 bytes: the
/// layout each level unpacks cheapest ([`QMat::i6_layout_at`]). Every kernel reads both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum I6Layout {
    /// 32 bytes of low nibbles as int4's chunk (element `j` low and `j + 32` high in byte `j`),
    /// then 16 bytes of top bits (element `16 i + j` at bits `2i..2i+2` of byte `32 + j`). The
    /// AVX2 kernels take the nibbles as int4's and move the top bits with a shift per lane:
    /// no multiplies, which share a port with `vpmaddubsw`.
    Split,
    /// 16 groups of 3 bytes, group `g` elements `4g..4g + 4` as the big-endian 24-bit number
    /// `e0 << 18 | e1 << 12 | e2 << 6 | e3` ([`i6_group`]; base64's order). AVX-512 VBMI
    /// unpacks a chunk with one load, a byte permute, a multishift and a mask (the int6 GEMV
    /// +30 % over [`I6Layout::Split`] in L2 on a Zen 4); AVX2 with two 16-bit multiplies per
    /// 32 values (-20 % against [`I6Layout::Split`] on the same machine).
    Groups,
}

/// One int6 row from the tensor's order ([`spark_core::quant::i6_stored`]) into [`QMat`]'s
/// `layout`, 48 bytes per 64-column chunk; columns past `cols` are 32 (q = 0). `dst` is the
/// padded row.
fn repack_int6_row(src: &[u8], cols: usize, dst: &mut [u8], layout: I6Layout) {
    let v = |c: usize| if c < cols { spark_core::quant::i6_stored(src, cols, c) } else { 32 };
    match layout {
        I6Layout::Split => {
            for (ci, chunk) in dst.chunks_exact_mut(I6_CHUNK_BYTES).enumerate() {
                let e: [u8; QCHUNK] = std::array::from_fn(|j| v(ci * QCHUNK + j));
                for j in 0..32 {
                    chunk[j] = (e[j] & 0xF) | ((e[j + 32] & 0xF) << 4);
                }
                for j in 0..16 {
                    chunk[32 + j] = (0..4).fold(0u8, |b, i| b | ((e[16 * i + j] >> 4) << (2 * i)));
                }
            }
        }
        I6Layout::Groups => {
            for (gi, group) in dst.chunks_exact_mut(3).enumerate() {
                let e = |i: usize| u32::from(v(4 * gi + i) & 0x3F);
                let n = e(0) << 18 | e(1) << 12 | e(2) << 6 | e(3);
                group.copy_from_slice(&n.to_be_bytes()[1..]);
            }
        }
    }
}

/// What the SIMD tiles dispatch on: a [`QMat`]'s format, scale layout, side type (f16 when
/// `half`, else f32) and int6 layout.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Debug, Clone, Copy)]
pub(crate) struct TileKind {
    pub(crate) format: QFormat,
    pub(crate) mode: ScaleMode,
    pub(crate) half: bool,
    pub(crate) i6: I6Layout,
}

/// Bytes of one 64-column int6 chunk in [`QMat`] (either [`I6Layout`]).
pub const I6_CHUNK_BYTES: usize = 48;

/// For [`QMat::dequant_avx512`]'s int6 groups: `I6_LANE_BYTE[k]` gives lane `j` byte
/// `3 (j / 4) + k` (byte `k` of its group), and lane `j` shifts the group's 24-bit number right
/// by `I6_LANE_SHIFT[j]`.
#[cfg(target_arch = "x86_64")]
const I6_LANE_BYTE: [Lanes; 3] = [i6_lane_bytes(0), i6_lane_bytes(1), i6_lane_bytes(2)];
#[cfg(target_arch = "x86_64")]
const I6_LANE_SHIFT: Lanes = Lanes { a: [18, 12, 6, 0, 18, 12, 6, 0, 18, 12, 6, 0, 18, 12, 6, 0] };

#[cfg(target_arch = "x86_64")]
#[repr(C)]
union Lanes {
    a: [i32; 16],
    v: std::arch::x86_64::__m512i,
}

#[cfg(target_arch = "x86_64")]
const fn i6_lane_bytes(k: i32) -> Lanes {
    let mut a = [0i32; 16];
    let mut j = 0;
    while j < 16 {
        a[j] = 3 * (j as i32 / 4) + k;
        j += 1;
    }
    Lanes { a }
}

/// Element `i` (0..4) of an [`I6Layout::Groups`] group's three bytes `b` (`0..=63`, zero point
/// 32): the big-endian 24-bit number `b0 << 16 | b1 << 8 | b2` holds element `i` at bits
/// `18 - 6 i`.
#[inline]
pub fn i6_group(b: &[u8], i: usize) -> u8 {
    let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
    ((n >> (18 - 6 * i)) & 0x3F) as u8
}

/// A matrix's scales or biases (`[rows, ng]`) as the kernels read them.
pub enum Side {
    /// The [`QTensor`]'s own f32 values (shared, no copy).
    F32(Arc<Vec<f32>>),
    /// The same values as f16 bits, when every one fits ([`QTensor::sides_fit_f16`]): half the
    /// bytes per decode step, converted back to the identical f32 values where they were f16
    /// values (our own files, GGUF Q8_0 / Q4_0), else to within 2^-11 of them (GGUF K-quant
    /// products `d * sc`).
    F16(Vec<u16>),
    /// A byte per value and a power of two per row and super-block ([`Grid`]): what the VNNI
    /// level holds of `spark-run quantize`'s int4 ([`QMat::for_level`]).
    Grid(Box<Grid>),
}

/// Values `k * 2^e` with one exponent `e` per row and super-block ([`SUPER_BLOCKS`] groups) and
/// integers `k` in a byte: `0..=255` (scales) or `-127..=127` (biases, `signed`). `spark-run
/// quantize` writes its int4 scales and biases on such grids ([`spark_core::quant::super_unit`],
/// [`spark_core::quant::bias_unit`]): 1 byte per group instead of f16's 2, and each value comes
/// back exactly (a small integer times a power of two).
pub struct Grid {
    /// `[rows, ng]`: `k` (the bits of an `i8` when `signed`).
    pub k: Vec<u8>,
    /// `[rows, ng / 8]`: `e`.
    pub exp: Vec<i8>,
    pub ng: usize,
    pub signed: bool,
}

impl Grid {
    /// `vals` (`[rows, ng]`, `ng` a multiple of [`SUPER_BLOCKS`]) on such a grid, or `None` where
    /// a super-block's values are not integer multiples, within the byte's range, of the power
    /// of two its largest magnitude needs (or a scale is negative, or a value not finite).
    pub fn new(vals: &[f32], ng: usize, signed: bool) -> Option<Grid> {
        if ng == 0 || !ng.is_multiple_of(SUPER_BLOCKS) || !vals.len().is_multiple_of(ng) {
            return None;
        }
        let kmax = if signed { 127.0 } else { 255.0 };
        let mut k = vec![0u8; vals.len()];
        let mut exp = vec![0i8; vals.len() / SUPER_BLOCKS];
        let ok = k.par_chunks_mut(SUPER_BLOCKS).zip(exp.par_iter_mut()).zip(vals.par_chunks(SUPER_BLOCKS)).all(
            |((ks, e), sb)| {
                let mut vmax = 0.0f32;
                for &v in sb {
                    if !v.is_finite() || (!signed && v < 0.0) {
                        return false;
                    }
                    vmax = vmax.max(v.abs());
                }
                if vmax == 0.0 {
                    return true;
                }
                // The unit the quantizer used: the smallest power of two `u >= 2^-24` with
                // `vmax / u <= kmax`.
                let u = if signed { spark_core::quant::bias_unit(vmax) } else { spark_core::quant::super_unit(vmax) };
                let ex = u.log2() as i32;
                if !(-24..=127).contains(&ex) {
                    return false;
                }
                *e = ex as i8;
                let u = Grid::unit(*e);
                sb.iter().zip(ks.iter_mut()).all(|(&v, kv)| {
                    let q = v / u;
                    let ok = q == q.round() && q.abs() <= kmax;
                    *kv = if signed { q as i8 as u8 } else { q as u8 };
                    ok
                })
            },
        );
        ok.then_some(Grid { k, exp, ng, signed })
    }

    /// `2^e` (a normal f32: `-24 <= e <= 127`).
    #[inline(always)]
    pub fn unit(e: i8) -> f32 {
        f32::from_bits(((e as i32 + 127) as u32) << 23)
    }

    /// Values `i..i + out.len()` (`[rows, ng]` order): a unit per super-block, then `k * u`.
    pub fn get_into(&self, i: usize, out: &mut [f32]) {
        // Value `i`'s exponent is `exp[i / 8]` (`ng` is a multiple of `SUPER_BLOCKS`), and the
        // next super-block's the next one, across rows too: no division per super-block.
        let mut e = i / SUPER_BLOCKS;
        let mut j = 0;
        while j < out.len() {
            let n = (SUPER_BLOCKS - (i + j) % SUPER_BLOCKS).min(out.len() - j);
            let u = Grid::unit(self.exp[e]);
            e += 1;
            let (ks, os) = (&self.k[i + j..i + j + n], &mut out[j..j + n]);
            if self.signed {
                os.iter_mut().zip(ks).for_each(|(o, &k)| *o = k as i8 as f32 * u);
            } else {
                os.iter_mut().zip(ks).for_each(|(o, &k)| *o = k as f32 * u);
            }
            j += n;
        }
    }

    /// Value `i` (`[rows, ng]` order).
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        let (r, g) = (i / self.ng, i % self.ng);
        let k = if self.signed { self.k[i] as i8 as f32 } else { self.k[i] as f32 };
        k * Grid::unit(self.exp[r * (self.ng / SUPER_BLOCKS) + g / SUPER_BLOCKS])
    }
}

impl Side {
    fn new(v: &Arc<Vec<f32>>, half: bool) -> Side {
        if half {
            Side::F16(v.par_iter().with_min_len(1 << 14).map(|&x| half::f16::from_f32(x).to_bits()).collect())
        } else {
            Side::F32(v.clone())
        }
    }

    /// `v` as f16 bits when every value is exactly an f16 value (`QTensor::half_sides`'s test),
    /// else `None`.
    fn exact_f16(v: &[f32]) -> Option<Side> {
        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
        const CHUNK: usize = 4096;
        let mut bits = vec![0u16; v.len()];
        let exact = bits.par_chunks_mut(CHUNK).zip(v.par_chunks(CHUNK)).all(|(o, x)| {
            let h = o.reinterpret_cast_mut::<half::f16>();
            h.convert_from_f32_slice(x);
            let mut back = [0.0f32; CHUNK];
            let back = &mut back[..x.len()];
            h.convert_to_f32_slice(back);
            back.iter().zip(x).all(|(b, x)| x.is_finite() && b == x)
        });
        exact.then_some(Side::F16(bits))
    }

    /// Value `i`.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Side::F32(v) => v[i],
            Side::F16(v) => half::f16::from_bits(v[i]).to_f32(),
            Side::Grid(g) => g.get(i),
        }
    }

    /// The grid, when held so.
    pub fn grid(&self) -> Option<&Grid> {
        match self {
            Side::Grid(g) => Some(g),
            _ => None,
        }
    }

    /// Values `i..i + out.len()` as f32 (f16 ones converted a slice at a time).
    pub fn get_into(&self, i: usize, out: &mut [f32]) {
        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
        match self {
            Side::F32(v) => out.copy_from_slice(&v[i..i + out.len()]),
            Side::F16(v) => v[i..i + out.len()].reinterpret_cast::<half::f16>().convert_to_f32_slice(out),
            Side::Grid(g) => g.get_into(i, out),
        }
    }

    /// The first value's address and the bytes per value (for prefetching).
    pub fn raw(&self) -> (*const u8, usize) {
        match self {
            Side::F32(v) => (v.as_ptr().cast(), 4),
            Side::F16(v) => (v.as_ptr().cast(), 2),
            Side::Grid(g) => (g.k.as_ptr(), 1),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Side::F32(v) => v.len(),
            Side::F16(v) => v.len(),
            Side::Grid(g) => g.k.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        match self {
            Side::F32(v) => 4 * v.len(),
            Side::F16(v) => 2 * v.len(),
            Side::Grid(g) => g.k.len() + g.exp.len(),
        }
    }
}

/// A quantized matrix in the kernels' layout (see the module documentation).
pub struct QMat {
    pub format: QFormat,
    pub rows: usize,
    /// Logical columns.
    pub cols: usize,
    /// Columns padded to a multiple of [`QCHUNK`].
    pub kp: usize,
    pub group: usize,
    /// Groups per row (`cols / group`).
    pub ng: usize,
    pub mode: ScaleMode,
    /// On transparent huge pages where the kernel gives them ([`HugeBytes`]).
    data: HugeBytes,
    /// Offset of the first row in `data` (64-byte aligned).
    off: usize,
    /// `[rows, ng]`: f16 when [`QTensor::sides_fit_f16`], else shared with the [`QTensor`].
    scales: Side,
    bias: Option<Side>,
    /// Group of each 16-column half-block, `kp / 16` entries (padding: the last group).
    sidx: Vec<u32>,
    /// Integer sub-scales, where built ([`QMat::with_sub_scales`]).
    sub: Option<SubScales>,
    /// How int6 chunks are laid out (unused for the other formats).
    i6: I6Layout,
}

impl std::fmt::Debug for QMat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QMat([{}, {}] {} group {} {:?})", self.rows, self.cols, self.format, self.group, self.mode)
    }
}

impl QMat {
    /// Whether the integer kernels take this tensor (groups must be multiples of 16).
    pub fn supports(q: &QTensor) -> bool {
        q.group > 0 && q.group.is_multiple_of(16) && q.cols > 0 && q.cols.is_multiple_of(q.group) && q.rows > 0
    }

    /// Bytes of one packed row.
    pub fn row_bytes(&self) -> usize {
        match self.format {
            QFormat::I8 => self.kp,
            QFormat::I4 => self.kp / 2,
            QFormat::I6 => self.kp / QCHUNK * I6_CHUNK_BYTES,
        }
    }

    /// Whether this CPU's integer kernels hold f16 scales and biases as f16
    /// ([`QMat::from_qtensor`]): from the VNNI level up, whose decode GEMVs stream at the memory's
    /// pace, so half the side bytes is time saved. The AVX2 and portable kernels keep f32 scales
    /// (shared with the [`QTensor`], no copy): converting f16 scales in the AVX2 block loop cost
    /// ~5 % and saved nothing. Except at the AVX2 level int4 with sub-scales, whose kernels do
    /// not read the scale array ([`QMat::for_level`]).
    pub fn f16_sides_pay() -> bool {
        QSimd::detect() >= QSimd::Avx512Vnni
    }

    /// Repack `q` (checked with [`QMat::supports`] and `validate`) for this CPU
    /// ([`QMat::for_level`] of the detected level).
    pub fn from_qtensor(q: &QTensor) -> QMat {
        Self::for_level(q, QSimd::detect())
    }

    /// Repack `q` as the integer kernels of level `qs` hold it: scales and biases as f16 where
    /// they fit from the VNNI level up ([`QMat::f16_sides_pay`]); at the AVX2 level, int4 whose
    /// scales have the sub-scale form gets sub-scales ([`QMat::with_sub_scales`]), which the
    /// AVX2 kernels read (a byte per group and a unit per super-block) with the biases, never
    /// the scale array (a scale is `k * u` exactly: the same arithmetic). Its scales and biases
    /// are then held as f16 when that is exact (every value an f16 value, as
    /// [`QTensor::half_sides`] tests: our own files, whose sides are f16): a decode step reads
    /// 4.875 bits per weight instead of 6, with results bit for bit those of f32 sides.
    /// Otherwise (GGUF Q4_K's products `d * sc`) they stay f32: 5.375 bits. From the VNNI level
    /// up ([`QMat::grid_sides_at`]) int4 whose scales and biases lie on power-of-two grids holds
    /// them as [`Grid`]s ([`QMat::with_grid_sides`]).
    pub fn for_level(q: &QTensor, qs: QSimd) -> QMat {
        let m = Self::with_layout(q, qs >= QSimd::Avx512Vnni, Self::i6_layout_at(qs));
        if Self::grid_sides_at(qs) {
            return m.with_grid_sides(q);
        }
        if !Self::sub_scales_at(qs) {
            return m;
        }
        let mut m = m.with_sub_scales();
        if m.sub.is_some() && !m.half_sides() {
            // One pass per array: the f16 bits, or `None` at the first value that is not one.
            if let Some(scales) = Side::exact_f16(&q.scales) {
                let bias = match &q.bias {
                    None => Some(None),
                    Some(b) => Side::exact_f16(b).map(Some),
                };
                if let Some(bias) = bias {
                    (m.scales, m.bias) = (scales, bias);
                }
            }
        }
        m
    }

    /// Repack `q` (checked with [`QMat::supports`] and `validate`), one row at a time into the
    /// final buffer (no intermediate copy of the whole matrix); its scales and biases as f16
    /// when `half_ok` and they fit ([`QTensor::sides_fit_f16`]). Every kernel level takes
    /// either.
    pub fn with_sides(q: &QTensor, half_ok: bool) -> QMat {
        Self::with_layout(q, half_ok, Self::i6_layout_at(QSimd::detect()))
    }

    /// [`QMat::with_sides`] with int6 chunks in `i6` (whichever this CPU's kernels prefer:
    /// every level reads both; tests build both).
    pub fn with_layout(q: &QTensor, half_ok: bool, i6: I6Layout) -> QMat {
        assert!(QMat::supports(q), "QMat::from_qtensor: unsupported group {} for {} columns", q.group, q.cols);
        let (rows, cols, group) = (q.rows, q.cols, q.group);
        let kp = cols.div_ceil(QCHUNK) * QCHUNK;
        let ng = cols / group;
        let mode = if ng == 1 {
            ScaleMode::Row
        } else if group.is_multiple_of(64) {
            ScaleMode::Chunk
        } else if group == 32 && cols == kp {
            ScaleMode::Pair
        } else if group.is_multiple_of(32) {
            ScaleMode::Block
        } else if group == 16 && cols == kp {
            ScaleMode::Quad
        } else {
            ScaleMode::Half
        };
        let rb = match q.format {
            QFormat::I8 => kp,
            QFormat::I4 => kp / 2,
            QFormat::I6 => kp / QCHUNK * I6_CHUNK_BYTES,
        };
        // Zeroed (the allocator's fresh pages): int8 padding is q = 0; int4 and int6 rows are
        // written whole below, their padding as 8 or 32 (q = 0). The first row is 64-byte
        // aligned and at least 64 bytes follow the last: the int6 kernels read up to 16 bytes
        // past a chunk (the module's doc).
        let mut data = HugeBytes::zeroed(rows * rb + 128);
        let off = data.as_ptr().align_offset(64).min(64);
        // Rows in parallel (the pages are first touched here, by the worker that fills them),
        // 64 rows per task.
        data[off..off + rows * rb].par_chunks_mut(64 * rb).enumerate().for_each(|(ci, block)| {
            for (k, dst) in block.chunks_exact_mut(rb).enumerate() {
                let src = q.q_row(ci * 64 + k);
                match q.format {
                    QFormat::I8 => dst[..cols].copy_from_slice(src),
                    QFormat::I4 => repack_int4_row(src, cols, dst),
                    QFormat::I6 => repack_int6_row(src, cols, dst, i6),
                }
            }
        });
        let sidx = (0..kp / 16).map(|h| ((h * 16 / group).min(ng - 1)) as u32).collect();
        let half = half_ok && q.sides_fit_f16();
        QMat {
            format: q.format,
            rows,
            cols,
            kp,
            group,
            ng,
            mode,
            data,
            off,
            scales: Side::new(&q.scales, half),
            bias: q.bias.as_ref().map(|b| Side::new(b, half)),
            sidx,
            sub: None,
            i6,
        }
    }

    /// The same matrix with integer sub-scales ([`SubScales`]) when its scales have that form
    /// (int4 in groups of 32 without column padding, each row's super-blocks integer multiples
    /// `k <= 255` of one unit: [`common_unit`]), else unchanged. That covers `spark-run
    /// quantize`'s int4 (a power of two per super-block) and GGUF Q4_K (`d` times 6-bit
    /// sub-scales). The AVX2 level builds them ([`QMat::from_qtensor`]); one byte per 32 weights
    /// and one f32 per 256 more.
    pub fn with_sub_scales(mut self) -> QMat {
        if self.format != QFormat::I4 || self.mode != ScaleMode::Pair {
            return self;
        }
        let (ng, nsb) = (self.ng, self.ng.div_ceil(SUPER_BLOCKS));
        let mut k = vec![0u8; self.rows * ng];
        let mut unit = vec![0.0f32; self.rows * nsb];
        let scales = &self.scales;
        let ok = k.par_chunks_mut(ng).zip(unit.par_chunks_mut(nsb)).enumerate().all(|(r, (kr, ur))| {
            let mut row = vec![0.0f32; ng];
            scales.get_into(r * ng, &mut row);
            row_sub_scales(&row, kr, ur)
        });
        if ok {
            self.sub = Some(SubScales { k, unit });
        }
        self
    }

    /// The same matrix with its scales and biases on [`Grid`]s when both have that form (int4 in
    /// groups of 32 without column padding, whole super-blocks: what `spark-run quantize`
    /// writes), else unchanged. The VNNI kernels read a byte per group for each and a byte per
    /// super-block (4.56 bits per weight instead of 5 with f16 sides) and get the same f32
    /// values, so the same results bit for bit. The VNNI level builds them
    /// ([`QMat::for_level`]); the AMX INT8 tiles and the AVX2 kernels do not read them.
    pub fn with_grid_sides(mut self, q: &QTensor) -> QMat {
        if self.format != QFormat::I4 || self.mode != ScaleMode::Pair || !self.ng.is_multiple_of(SUPER_BLOCKS) {
            return self;
        }
        let Some(scales) = Grid::new(&q.scales, self.ng, false) else {
            return self;
        };
        let bias = match &q.bias {
            None => None,
            Some(b) => match Grid::new(b, self.ng, true) {
                Some(g) => Some(Side::Grid(Box::new(g))),
                None => return self,
            },
        };
        (self.scales, self.bias) = (Side::Grid(Box::new(scales)), bias);
        self
    }

    /// Whether level `qs` holds int4 sides on grids where they have that form: the VNNI level
    /// and AMX INT8, whose int4 decode (1-2 tokens) is the VNNI grid tile and whose AMX INT8
    /// tiles read the grids 16 values at a time (`amx_int8::grid_lanes`).
    pub fn grid_sides_at(qs: QSimd) -> bool {
        qs >= QSimd::Avx512Vnni
    }

    /// The int6 layout level `qs` unpacks cheapest on this CPU: [`I6Layout::Groups`] from the
    /// VNNI level up where AVX-512 VBMI is there, else [`I6Layout::Split`].
    pub fn i6_layout_at(qs: QSimd) -> I6Layout {
        #[cfg(target_arch = "x86_64")]
        if qs >= QSimd::Avx512Vnni && super::qavx512::vbmi() {
            return I6Layout::Groups;
        }
        let _ = qs;
        I6Layout::Split
    }

    /// How this matrix's int6 chunks are laid out (meaningless for other formats).
    pub fn i6_layout(&self) -> I6Layout {
        self.i6
    }

    /// Whether level `qs` holds int4 with integer sub-scales where it has that form
    /// ([`QMat::with_sub_scales`]): the AVX2 level, whose super-block kernels read them.
    pub fn sub_scales_at(qs: QSimd) -> bool {
        qs == QSimd::Avx2
    }

    /// Whether [`QMat::with_grid_sides`] would hold `q`'s sides on grids, without repacking it.
    pub fn has_grid_form(q: &QTensor) -> bool {
        let ng = q.cols / QBLOCK;
        QMat::supports(q)
            && q.format == QFormat::I4
            && q.group == QBLOCK
            && q.cols.is_multiple_of(SUPER_BLOCKS * QBLOCK)
            && q.scales.len() == q.rows * ng
            && Grid::new(&q.scales, ng, false).is_some()
            && q.bias.as_ref().is_none_or(|b| Grid::new(b, ng, true).is_some())
    }

    /// Whether [`QMat::with_sub_scales`] would build sub-scales for `q` (int4 in groups of 32, no
    /// column padding, every super-block's steps integer multiples of one unit), without
    /// repacking it: what the AVX2 level will read of it ([`QMat::for_level`]).
    pub fn has_sub_scale_form(q: &QTensor) -> bool {
        let ng = q.cols / QBLOCK;
        QMat::supports(q)
            && q.format == QFormat::I4
            && q.group == QBLOCK
            && q.cols.is_multiple_of(QCHUNK)
            && q.scales.len() == q.rows * ng
            && q.scales.par_chunks(ng).all(|row| {
                let (mut ks, mut us) = (vec![0u8; ng], vec![0.0f32; ng.div_ceil(SUPER_BLOCKS)]);
                row_sub_scales(row, &mut ks, &mut us)
            })
    }

    /// The integer sub-scales, if built and the scales have that form.
    pub fn sub_scales(&self) -> Option<&SubScales> {
        self.sub.as_ref()
    }

    /// Whether the AVX2 level sums this matrix's super-blocks in integers: int4 with
    /// sub-scales, or int8 with one scale per row (no per-block weight scale at all).
    pub fn sums_super_blocks(&self) -> bool {
        self.sub.is_some() || (self.format == QFormat::I8 && self.mode == ScaleMode::Row)
    }

    /// All packed rows.
    pub fn packed(&self) -> &[u8] {
        &self.data[self.off..self.off + self.rows * self.row_bytes()]
    }
    /// The first packed row, as a pointer into the whole buffer: kernels may read the 64 bytes
    /// after the last row (the module's doc).
    pub fn packed_ptr(&self) -> *const u8 {
        self.data.as_ptr().wrapping_add(self.off)
    }
    /// Scales, `[rows, ng]`.
    pub fn scales(&self) -> &Side {
        &self.scales
    }
    /// Biases, `[rows, ng]`, if any.
    pub fn bias(&self) -> Option<&Side> {
        self.bias.as_ref()
    }
    /// Whether the scales (and biases) are held as f16.
    pub fn half_sides(&self) -> bool {
        matches!(self.scales, Side::F16(_))
    }
    /// Group of each 16-column half-block (`kp / 16` entries).
    pub fn half_groups(&self) -> &[u32] {
        &self.sidx
    }

    /// The packed bytes of row `r` that hold columns `c0..c0 + n` (`c0` a multiple of
    /// [`QCHUNK`], the range inside the padded row).
    pub fn row_columns(&self, r: usize, c0: usize, n: usize) -> &[u8] {
        assert!(c0.is_multiple_of(QCHUNK) && c0 + n <= self.kp, "row_columns: range");
        let row = &self.packed()[r * self.row_bytes()..(r + 1) * self.row_bytes()];
        match self.format {
            QFormat::I8 => &row[c0..c0 + n],
            QFormat::I4 => &row[c0 / 2..(c0 + n).div_ceil(2)],
            QFormat::I6 => &row[c0 / QCHUNK * I6_CHUNK_BYTES..(c0 + n).div_ceil(QCHUNK) * I6_CHUNK_BYTES],
        }
    }

    /// Bytes held (values, scales, biases, table).
    pub fn nbytes(&self) -> usize {
        self.data.len()
            + self.scales.nbytes()
            + self.bias.as_ref().map_or(0, |b| b.nbytes())
            + 4 * self.sidx.len()
            + self.sub.as_ref().map_or(0, |s| s.k.len() + 4 * s.unit.len())
    }

    /// Bytes one pass over every row reads at the level this matrix was built for (a decode
    /// step): the packed values (column padding included), the sub-scales and units where built
    /// (the AVX2 kernels then never read the scales), else the scales, and the biases.
    pub fn decode_bytes(&self) -> usize {
        let sides = match &self.sub {
            Some(s) => s.k.len() + 4 * s.unit.len(),
            None => self.scales.nbytes(),
        };
        self.rows * self.row_bytes() + sides + self.bias.as_ref().map_or(0, |b| b.nbytes())
    }

    /// The integer value of element `c` of row `r` minus the zero point.
    #[inline]
    pub fn qval(&self, r: usize, c: usize) -> i32 {
        let row = &self.packed()[r * self.row_bytes()..(r + 1) * self.row_bytes()];
        match self.format {
            QFormat::I8 => row[c] as i8 as i32,
            QFormat::I4 => {
                let b = row[(c / QCHUNK) * 32 + c % 32];
                (if c % QCHUNK < 32 { b & 0xF } else { b >> 4 }) as i32 - 8
            }
            QFormat::I6 => i6_qval(row, c, self.i6),
        }
    }

    /// Columns `c0..c0 + out.len()` of row `r` dequantized as [`QMat::dequant_row`] does, then
    /// rounded to bf16 (bits). `c0` and the length are multiples of 16 within `cols`. The same
    /// operations at every SIMD level (a multiply, then an add, then the rounding), so the
    /// results are identical: the AVX-512 level runs them on 16 columns per instruction
    /// (`dequant_avx512`: about 10 % of int4 pp512 on AMX, where the compiler's vectorization
    /// of the generic loop took 15 %), the AVX2 level lets the compiler vectorize the loop.
    pub fn dequant_bf16(&self, r: usize, c0: usize, out: &mut [u16]) {
        self.dequant_range(r, c0, out)
    }

    /// Columns `c0..c0 + out.len()` of row `r` dequantized as [`QMat::dequant_row`] does (the
    /// same f32 values), on the same terms as [`QMat::dequant_bf16`].
    pub fn dequant_f32(&self, r: usize, c0: usize, out: &mut [f32]) {
        self.dequant_range(r, c0, out)
    }

    fn dequant_range<O: DequantOut>(&self, r: usize, c0: usize, out: &mut [O]) {
        assert!(c0.is_multiple_of(16) && out.len().is_multiple_of(16) && c0 + out.len() <= self.cols, "dequant: range");
        #[cfg(target_arch = "x86_64")]
        {
            let simd = super::Simd::detect();
            if simd >= super::Simd::Avx512 {
                // SAFETY: Simd::Avx512 is only detected with AVX-512F present.
                return unsafe { self.dequant_avx512(r, c0, out) };
            }
            if simd >= super::Simd::Avx2 {
                // SAFETY: Simd::Avx2 is only detected with AVX2 present.
                return unsafe { self.dequant_avx2(r, c0, out) };
            }
        }
        self.dequant_body(r, c0, out)
    }

    /// [`QMat::dequant_body`] on 16 columns per instruction.
    ///
    /// # Safety
    /// AVX-512F (what `Simd::Avx512` detects).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2")]
    unsafe fn dequant_avx512<O: DequantOut>(&self, r: usize, c0: usize, out: &mut [O]) {
        use std::arch::x86_64::*;
        let row = &self.packed()[r * self.row_bytes()..(r + 1) * self.row_bytes()];
        let mut sides = RowSides::new(self, r);
        let p = row.as_ptr();
        for (hi, o16) in out.chunks_exact_mut(16).enumerate() {
            let c = c0 + hi * 16;
            let (sg, bg) = sides.at(self.sidx[c / 16] as usize);
            // The 16 values minus the zero point, as `dequant_body` forms them, in i32 lanes.
            // SAFETY: `c + 16 <= cols <= kp` and the row holds `kp` values in this format's
            // layout (int4: 16 bytes from `base`; int6 split: 16 bytes from `j0` and the
            // chunk's 16 bytes of top bits at 32; int6 groups: the 12 bytes of four groups
            // from `base`, three dwords of a masked load), as `i6_qval` reads them.
            let q = match self.format {
                QFormat::I8 => _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(c).cast())),
                QFormat::I4 => {
                    let base = (c / QCHUNK) * 32 + c % 32;
                    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(base).cast()));
                    let v = if c % QCHUNK >= 32 { _mm512_srli_epi32::<4>(v) } else { v };
                    _mm512_sub_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0xF)), _mm512_set1_epi32(8))
                }
                QFormat::I6 if self.i6 == I6Layout::Split => {
                    let ch = p.add(c / QCHUNK * I6_CHUNK_BYTES);
                    let l = _mm512_cvtepu8_epi32(_mm_loadu_si128(ch.add(c % 32).cast()));
                    let l = if c % QCHUNK >= 32 { _mm512_srli_epi32::<4>(l) } else { l };
                    let h = _mm512_cvtepu8_epi32(_mm_loadu_si128(ch.add(32).cast()));
                    let h = _mm512_srlv_epi32(h, _mm512_set1_epi32(2 * (c % QCHUNK / 16) as i32));
                    let h = _mm512_slli_epi32::<4>(_mm512_and_si512(h, _mm512_set1_epi32(3)));
                    let lo = _mm512_and_si512(l, _mm512_set1_epi32(0xF));
                    _mm512_sub_epi32(_mm512_or_si512(lo, h), _mm512_set1_epi32(32))
                }
                QFormat::I6 => {
                    // Lane `j` from group `j / 4`'s three bytes (`b0 << 16 | b1 << 8 | b2`),
                    // shifted right by `18 - 6 (j % 4)` and masked.
                    let base = c / QCHUNK * I6_CHUNK_BYTES + c % QCHUNK / 4 * 3;
                    let b = _mm512_castsi512_si128(_mm512_maskz_loadu_epi32(0b111, p.add(base).cast()));
                    let b = _mm512_cvtepu8_epi32(b);
                    let n = _mm512_or_si512(
                        _mm512_slli_epi32::<16>(_mm512_permutexvar_epi32(I6_LANE_BYTE[0].v, b)),
                        _mm512_or_si512(
                            _mm512_slli_epi32::<8>(_mm512_permutexvar_epi32(I6_LANE_BYTE[1].v, b)),
                            _mm512_permutexvar_epi32(I6_LANE_BYTE[2].v, b),
                        ),
                    );
                    let v = _mm512_and_si512(_mm512_srlv_epi32(n, I6_LANE_SHIFT.v), _mm512_set1_epi32(0x3F));
                    _mm512_sub_epi32(v, _mm512_set1_epi32(32))
                }
            };
            // `sg * q + bg`: a multiply, then an add (no FMA), as `dequant_body`.
            let v = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(sg), _mm512_cvtepi32_ps(q)), _mm512_set1_ps(bg));
            // With finite `sg` and `bg` no value is NaN (`|q| <= 128`).
            let finite = sg.is_finite() && bg.is_finite();
            // SAFETY: `o16` is 16 values.
            O::put16(v, finite, o16.as_mut_ptr());
        }
    }

    /// # Safety
    /// AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn dequant_avx2<O: DequantOut>(&self, r: usize, c0: usize, out: &mut [O]) {
        self.dequant_body(r, c0, out)
    }

    #[inline(always)]
    fn dequant_body<O: DequantOut>(&self, r: usize, c0: usize, out: &mut [O]) {
        let row = &self.packed()[r * self.row_bytes()..(r + 1) * self.row_bytes()];
        let mut sides = RowSides::new(self, r);
        for (hi, o16) in out.chunks_exact_mut(16).enumerate() {
            let c = c0 + hi * 16;
            let (sg, bg) = sides.at(self.sidx[c / 16] as usize);
            let mut q = [0.0f32; 16];
            match self.format {
                QFormat::I8 => {
                    for (q, &v) in q.iter_mut().zip(&row[c..c + 16]) {
                        *q = v as i8 as f32;
                    }
                }
                QFormat::I4 => {
                    let (base, shift) = ((c / QCHUNK) * 32 + c % 32, if c % QCHUNK >= 32 { 4 } else { 0 });
                    for (q, &v) in q.iter_mut().zip(&row[base..base + 16]) {
                        *q = (((v >> shift) & 0xF) as i32 - 8) as f32;
                    }
                }
                QFormat::I6 => {
                    for (j, q) in q.iter_mut().enumerate() {
                        *q = i6_qval(row, c + j, self.i6) as f32;
                    }
                }
            }
            for (o, &q) in o16.iter_mut().zip(&q) {
                *o = O::from_f32(sg * q + bg);
            }
        }
    }

    /// Row `r` dequantized into `out` (`cols` long), with the same float operations as
    /// [`QTensor::dequant_row`] (so the results are identical).
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols, "dequant_row: output length");
        let (s, b) = (&self.scales, self.bias.as_ref());
        for (c, o) in out.iter_mut().enumerate() {
            let g = r * self.ng + c / self.group;
            *o = s.get(g) * self.qval(r, c) as f32 + b.map_or(0.0, |b| b.get(g));
        }
    }
}

/// One row's scales and biases as f32 for the dequantizing loops, [`RowSides::SEG`] groups at a
/// time (a per-value f16 conversion per 16 columns cost more than the rest of the
/// dequantization).
struct RowSides<'a> {
    w: &'a QMat,
    /// The row's first group (`[rows, ng]` index).
    at: usize,
    s: [f32; RowSides::SEG],
    b: [f32; RowSides::SEG],
    /// The first group held (`usize::MAX`: none yet).
    seg0: usize,
}

impl<'a> RowSides<'a> {
    const SEG: usize = 64;

    fn new(w: &'a QMat, r: usize) -> RowSides<'a> {
        RowSides { w, at: r * w.ng, s: [0.0; Self::SEG], b: [0.0; Self::SEG], seg0: usize::MAX }
    }

    /// Group `g`'s scale and bias (0 without biases).
    #[inline(always)]
    fn at(&mut self, g: usize) -> (f32, f32) {
        if !(self.seg0..self.seg0.saturating_add(Self::SEG)).contains(&g) {
            self.seg0 = g;
            let len = Self::SEG.min(self.w.ng - g);
            self.w.scales.get_into(self.at + g, &mut self.s[..len]);
            if let Some(b) = &self.w.bias {
                b.get_into(self.at + g, &mut self.b[..len]);
            }
        }
        (self.s[g - self.seg0], self.b[g - self.seg0])
    }
}

/// What [`QMat::dequant_bf16`] / [`QMat::dequant_f32`] write: a dequantized value as bf16 bits
/// (rounded to nearest even) or as the f32 itself.
trait DequantOut: Copy {
    fn from_f32(v: f32) -> Self;
    /// Sixteen values at once, as [`DequantOut::from_f32`] converts each (`no_nan`: none of
    /// them is NaN).
    ///
    /// # Safety
    /// AVX-512F (inlined into a function that enables it); 16 values writable at `dst`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn put16(v: std::arch::x86_64::__m512, no_nan: bool, dst: *mut Self);
}

impl DequantOut for u16 {
    #[inline(always)]
    fn from_f32(v: f32) -> u16 {
        (spark_core::dtype::round_bf16(v).to_bits() >> 16) as u16
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn put16(v: std::arch::x86_64::__m512, no_nan: bool, dst: *mut u16) {
        use std::arch::x86_64::*;
        // `round_bf16`'s integer rounding (to nearest even), and its quiet NaN.
        let b = _mm512_castps_si512(v);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let mut bits = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd);
        if !no_nan {
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            bits = _mm512_mask_blend_epi32(nan, bits, _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000)));
        }
        _mm256_storeu_si256(dst.cast(), _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(bits)));
    }
}

impl DequantOut for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> f32 {
        v
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn put16(v: std::arch::x86_64::__m512, _no_nan: bool, dst: *mut f32) {
        std::arch::x86_64::_mm512_storeu_ps(dst, v);
    }
}

/// Activations quantized for one matmul call: per token, `kp` int8 values (zero padded), one
/// f32 scale per 32-block, and per weight group the float sum `A` of its quantized values.
pub struct QAct {
    pub n: usize,
    pub kp: usize,
    /// `[n, kp]` int8 values.
    pub q: Vec<i8>,
    /// `[n, kp / 32]` block scales.
    pub d: Vec<f32>,
    /// `[n, ng]`: `A[t, g] = sum_{c in g} d[t, c / 32] * q[t, c]`.
    pub a: Vec<f32>,
    pub ng: usize,
    /// `[n, kp / 4]`: the sum of each 4 consecutive values of `q` (zero-point corrections).
    pub s4: Vec<i32>,
    /// Consecutive blocks that share one scale (1 or [`SUPER_BLOCKS`]; `d` holds it per block
    /// either way, so every kernel reads these activations alike).
    pub span: usize,
}

impl QAct {
    /// Quantize `x` (`[n, k]`) for the weight `w` (its padding and groups), with the best
    /// activation path this CPU has (every path gives identical values).
    pub fn quantize(x: &[f32], n: usize, k: usize, w: &QMat) -> QAct {
        Self::quantize_with(QSimd::detect(), x, n, k, w)
    }

    /// As [`QAct::quantize`] with a given path (capped at what the CPU has). Tokens are
    /// quantized in parallel on the current rayon pool when there are many.
    pub fn quantize_with(qs: QSimd, x: &[f32], n: usize, k: usize, w: &QMat) -> QAct {
        Self::quantize_spans(qs, x, n, k, w, 1)
    }

    /// Quantize `x` for the integer kernels of level `qs` on `w`: one scale per
    /// [`SUPER_BLOCKS`] blocks where the AVX2 super-block kernel takes `w` and the `n` tokens
    /// ([`QMat::sums_super_blocks`], [`SUB_SCALE_MIN_TOKENS`]), else per block (what
    /// [`QAct::quantize`] gives).
    pub fn quantize_for(qs: QSimd, x: &[f32], n: usize, k: usize, w: &QMat) -> QAct {
        let sub = qs.min(QSimd::detect()) == QSimd::Avx2 && w.sums_super_blocks() && n >= SUB_SCALE_MIN_TOKENS;
        let span = if sub { SUPER_BLOCKS } else { 1 };
        Self::quantize_spans(QSimd::detect(), x, n, k, w, span)
    }

    /// The activations with one scale per `span` consecutive blocks (1 or [`SUPER_BLOCKS`]).
    pub fn quantize_spans(qs: QSimd, x: &[f32], n: usize, k: usize, w: &QMat, span: usize) -> QAct {
        assert!(span == 1 || span == SUPER_BLOCKS, "QAct::quantize: span {span}");
        assert_eq!(k, w.cols, "QAct::quantize: columns");
        assert_eq!(x.len(), n * k, "QAct::quantize: x has the wrong size");
        let simd = qs.min(QSimd::detect()) >= QSimd::Avx2;
        let (kp, ng) = (w.kp, w.ng);
        let nb = kp / QBLOCK;
        let mut qa = QAct {
            n,
            kp,
            q: vec![0; n * kp],
            d: vec![0.0; n * nb],
            a: vec![0.0; n * ng],
            ng,
            s4: vec![0; n * kp / 4],
            span,
        };
        type Token<'a> = (((&'a [f32], &'a mut [i8]), &'a mut [i32]), (&'a mut [f32], &'a mut [f32]));
        let one = |(((xr, q), s4), (d, a)): Token<'_>| {
            quantize_row(xr, q, s4, d, a, &w.sidx, simd, span);
        };
        if n >= 8 {
            x.par_chunks(k.max(1))
                .zip(qa.q.par_chunks_mut(kp))
                .zip(qa.s4.par_chunks_mut(kp / 4))
                .zip(qa.d.par_chunks_mut(nb).zip(qa.a.par_chunks_mut(ng)))
                .for_each(one);
        } else {
            x.chunks(k.max(1))
                .zip(qa.q.chunks_mut(kp))
                .zip(qa.s4.chunks_mut(kp / 4))
                .zip(qa.d.chunks_mut(nb).zip(qa.a.chunks_mut(ng)))
                .for_each(one);
        }
        qa
    }

    /// Token `t`'s values.
    pub fn q_row(&self, t: usize) -> &[i8] {
        &self.q[t * self.kp..(t + 1) * self.kp]
    }
    /// Token `t`'s block scales.
    pub fn d_row(&self, t: usize) -> &[f32] {
        let nb = self.kp / QBLOCK;
        &self.d[t * nb..(t + 1) * nb]
    }
    /// Token `t`'s group sums.
    pub fn a_row(&self, t: usize) -> &[f32] {
        &self.a[t * self.ng..(t + 1) * self.ng]
    }
    /// The dequantized value of token `t`, column `c` (`d * q`).
    pub fn value(&self, t: usize, c: usize) -> f32 {
        self.d_row(t)[c / QBLOCK] * self.q_row(t)[c] as f32
    }
}

/// One token: `q`/`d` from `x`, and the group sums `a` (via the half-block sums). `simd`: full
/// spans through [`super::qavx2::quantize_blocks`] (identical results).
#[allow(clippy::too_many_arguments)]
fn quantize_row(
    x: &[f32],
    q: &mut [i8],
    s4: &mut [i32],
    d: &mut [f32],
    a: &mut [f32],
    sidx: &[u32],
    simd: bool,
    span: usize,
) {
    a.fill(0.0);
    quantize_values(x, q, d, a, sidx, simd, span);
    for (o, quad) in s4.iter_mut().zip(q.chunks_exact(4)) {
        *o = quad.iter().map(|&v| v as i32).sum();
    }
}

/// `q`, `d` and `a` of one token, `span` consecutive 32-blocks sharing one scale (1, or
/// [`SUPER_BLOCKS`] for the AVX2 super-block kernel; the last span of a row may be shorter).
fn quantize_values(x: &[f32], q: &mut [i8], d: &mut [f32], a: &mut [f32], sidx: &[u32], simd: bool, span: usize) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd;
    let nb = d.len();
    let mut sums = [[0i32; 2]; SUPER_BLOCKS];
    'spans: for b0 in (0..nb).step_by(span) {
        let b1 = (b0 + span).min(nb);
        let c0 = b0 * QBLOCK;
        if c0 >= x.len() {
            d[b0..b1].fill(0.0);
            continue;
        }
        let xs = &x[c0..(b1 * QBLOCK).min(x.len())];
        let qs = &mut q[c0..c0 + xs.len()];
        let sums = &mut sums[..b1 - b0];
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_labels))]
        let scale = 'scale: {
            #[cfg(target_arch = "x86_64")]
            if simd && xs.len() == QBLOCK * sums.len() {
                // SAFETY: `simd` is only set when AVX2 was detected; `xs` and `qs` hold the
                // blocks' values.
                if let Some(s) = unsafe { super::qavx2::quantize_blocks(xs.as_ptr(), qs.as_mut_ptr(), sums) } {
                    break 'scale s;
                }
            }
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if amax == 0.0 || !xs.iter().all(|v| v.is_finite()) {
                // Zeros; or a non-finite input, which the NaN scale carries into every output.
                qs.fill(0);
                d[b0..b1].fill(if xs.iter().all(|v| v.is_finite()) { 0.0 } else { f32::NAN });
                continue 'spans;
            }
            let s = amax / 127.0;
            let inv = 1.0 / s;
            sums.fill([0, 0]);
            for (j, (o, &v)) in qs.iter_mut().zip(xs).enumerate() {
                let qi = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
                *o = qi;
                sums[j / QBLOCK][j % QBLOCK / 16] += qi as i32;
            }
            s
        };
        for (i, sum) in sums.iter().enumerate() {
            let b = b0 + i;
            // A block wholly in the padding keeps scale 0 (its values are 0 either way).
            d[b] = if b * QBLOCK < x.len() { scale } else { 0.0 };
            for (h, &v) in sum.iter().enumerate() {
                a[sidx[2 * b + h] as usize] += scale * v as f32;
            }
        }
    }
}

/// Below this many tokens, tokens go 4 at a time over the whole row chunk (decode: the weights
/// stream once per 4 tokens); from it on, in blocks of [`PREFILL_TOKENS`].
const SMALL_BATCH: usize = 16;
/// Bytes of int8 activations per prefill token block (they stay in L2 while a row chunk runs
/// over them; each block streams the chunk's weights once).
const PREFILL_BYTES: usize = 256 * 1024;

/// What a tile kernel needs: the row tile, the token tile, the scale table.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct TileArgs<'a> {
    /// Packed rows, `row_bytes` apart, starting at the tile's first row.
    pub w: *const u8,
    pub row_bytes: usize,
    /// Scales of the tile's first row, `ng` apart: f32, or f16 ([`H16`]) when `side_bytes` is 2.
    pub s: *const u8,
    /// Bytes per scale or bias (4 or 2).
    pub side_bytes: usize,
    pub ng: usize,
    pub sidx: &'a [u32],
    /// The token tile's int8 rows (`kp` apart) and block scales (`kp / 32` apart).
    pub q: *const i8,
    pub d: *const f32,
    /// The token tile's 4-column sums (`kp / 4` apart).
    pub s4: *const i32,
    /// Biases of the tile's first row (`ng` apart, the scales' type), or null: the kernels add
    /// the bias term `sum_g bias[r, g] * A[t, g]` themselves.
    pub b: *const u8,
    /// The token tile's group sums `A` (`ng` apart), for the bias term.
    pub ga: *const f32,
    pub kp: usize,
    /// The tile's first row's integer sub-scales `k` (`ng` apart) and super-block units (`ng /
    /// 8` rounded up apart), or null: [`SubScales`], for the AVX2 super-block kernel.
    pub k: *const u8,
    pub unit: *const f32,
    /// With [`Grid`] sides (`s` and `b` then point at the tile's first row's `k` bytes): that
    /// row's exponents of the scales' and the biases' grids (`ng / 8` apart; the biases' null
    /// without biases), else null.
    pub sexp: *const i8,
    pub bexp: *const i8,
    /// How many packed rows to prefetch while the tile runs (0: none), `skip_rows` rows after
    /// the tile's own (they exist in `w`); see [`super::Prefetcher`] and
    /// [`TileArgs::plan_prefetch`].
    pub next_rows: usize,
    pub skip_rows: usize,
}

/// Bytes of packed weights the integer tiles prefetch ahead of the rows they run (rounded up
/// to whole tiles). A tile prefetching just the next tile's rows left the int4 decode GEMV
/// waiting on memory: on a Zen 4 with one thread, int4 tiles of 2048 columns (4.6 KB) streamed
/// 14.2 GB/s fetching one tile ahead and 18 GB/s two ahead (int8's 8 KB tiles: best one ahead).
const PREFETCH_AHEAD: usize = 8 * 1024;
/// Most tiles ahead (short rows).
const PREFETCH_TILES: usize = 4;

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl TileArgs<'_> {
    /// Plan the prefetch of a row tile of `nr` rows with `after` rows after it in its task:
    /// the rows [`PREFETCH_AHEAD`] bytes ahead, a tile's worth; the task's first tile fetches
    /// every tile up to there.
    pub fn plan_prefetch(&mut self, first: bool, nr: usize, after: usize) {
        let tiles = PREFETCH_AHEAD.div_ceil((nr * self.row_bytes).max(1)).clamp(1, PREFETCH_TILES);
        let (skip, rows) = if first { (0, tiles * nr) } else { ((tiles - 1) * nr, nr) };
        self.skip_rows = skip.min(after);
        self.next_rows = (after - self.skip_rows).min(rows);
    }

    /// The first row (counted from the tile's) to prefetch: `skip_rows` after its `tile_rows`.
    fn fetch_from(&self, tile_rows: usize) -> usize {
        tile_rows + self.skip_rows
    }

    /// The prefetch of the `next_rows` rows `skip_rows` after this tile's `tile_rows`, over
    /// its `n` steps.
    pub fn prefetcher(&self, tile_rows: usize, n: usize) -> Prefetcher {
        Prefetcher::rows(self.w, self.row_bytes, self.fetch_from(tile_rows), self.next_rows, n)
    }

    /// The same for the next rows' scales (or sub-scales `k`) and biases (separate arrays; with
    /// int4 groups of 32 and f32 sides they are half as many bytes as the packed weights, and
    /// unprefetched they stalled the decode GEMV: 19 % of int4 decode time went to the bias
    /// term before it moved in here).
    pub fn side_prefetchers(&self, tile_rows: usize, n: usize) -> [Prefetcher; 2] {
        let (rb, nr) = (self.ng * self.side_bytes, self.next_rows);
        let bias = if self.b.is_null() {
            Prefetcher::none()
        } else {
            Prefetcher::rows(self.b, rb, self.fetch_from(tile_rows), nr, n)
        };
        // With sub-scales the kernels read `k` (a byte per group) instead of the scales.
        let scales = if !self.k.is_null() {
            Prefetcher::rows(self.k, self.ng, self.fetch_from(tile_rows), nr, n)
        } else if self.ng > 1 {
            Prefetcher::rows(self.s, rb, self.fetch_from(tile_rows), nr, n)
        } else {
            Prefetcher::none()
        };
        [scales, bias]
    }

    /// The prefetch of the next rows' grid exponents (scales', biases'), as
    /// [`TileArgs::side_prefetchers`] does for their bytes.
    pub fn grid_prefetchers(&self, tile_rows: usize, n: usize) -> [Prefetcher; 2] {
        let (nsb, nr) = (self.ng / SUPER_BLOCKS, self.next_rows);
        let at = |p: *const i8| {
            if p.is_null() {
                Prefetcher::none()
            } else {
                Prefetcher::rows(p.cast(), nsb, self.fetch_from(tile_rows), nr, n)
            }
        };
        [at(self.sexp), at(self.bexp)]
    }

    /// Row `r`'s (of the tile) bias term for token `t`: `sum_g bias[r, g] * A[t, g]`, 0 without
    /// biases (eight partial sums). With a `zero` point (8 for int4, 32 for int6; 0: none), also
    /// its term: the kernel then summed the stored values as they are, and `sum_g (bias[r, g] -
    /// zero scale[r, g]) A[t, g]` adds what `- zero` would have (a row scale, `ng == 1`, is the
    /// same formula).
    ///
    /// # Safety
    /// `r` and `t` are inside the tile the arguments describe; the scales and biases are `E`s;
    /// AVX2, FMA and F16C (inlined into the kernels, which enable them).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub unsafe fn bias_term<E: SideEl>(&self, r: usize, t: usize, zero: i32) -> f32 {
        use std::arch::x86_64::*;
        let nob = self.b.is_null();
        let zero8 = zero != 0;
        if nob && !zero8 {
            return 0.0;
        }
        // SAFETY: the caller's rows and tokens have `ng` scales, biases (when not null) and group
        // sums each; with sub-scales (`k` not null; groups of 32, one unit per eight groups),
        // `ng` values of `k` and `ng / 8` (rounded up) units per row.
        unsafe {
            let (s, a) = (self.s.cast::<E>().add(r * self.ng), self.ga.add(t * self.ng));
            let b = self.b.cast::<E>().wrapping_add(r * self.ng);
            // With sub-scales, each scale is `k * u`: the same f32 value exactly
            // ([`common_unit`]), without reading the scales.
            let sub = !self.k.is_null();
            let (k, u) = (self.k.wrapping_add(r * self.ng), self.unit.wrapping_add(r * self.ng.div_ceil(SUPER_BLOCKS)));
            let s8 = |i: usize| {
                if sub {
                    let kv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(k.add(i) as *const __m128i));
                    _mm256_mul_ps(_mm256_cvtepi32_ps(kv), _mm256_set1_ps(*u.add(i / SUPER_BLOCKS)))
                } else {
                    E::load8(s.add(i))
                }
            };
            let s1 = |i: usize| if sub { *k.add(i) as f32 * *u.add(i / SUPER_BLOCKS) } else { E::get(s, i) };
            let z = if zero8 { -(zero as f32) } else { 0.0 };
            let n8 = self.ng / 8 * 8;
            let mut acc = _mm256_setzero_ps();
            for i in (0..n8).step_by(8) {
                let w = match (nob, zero8) {
                    (true, _) => _mm256_mul_ps(s8(i), _mm256_set1_ps(z)),
                    (false, true) => _mm256_fmadd_ps(s8(i), _mm256_set1_ps(z), E::load8(b.add(i))),
                    (false, false) => E::load8(b.add(i)),
                };
                acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(a.add(i)), acc);
            }
            let mut sum = hsum8(acc);
            for i in n8..self.ng {
                let bias = if nob { 0.0 } else { E::get(b, i) };
                sum += (z * s1(i) + bias) * *a.add(i);
            }
            sum
        }
    }
}

/// The sum of the eight lanes (the bias terms' order: halves, then pairs, then the last two).
///
/// # Safety
/// AVX (inlined into the kernels, which enable it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hsum8(acc: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: register operations only; AVX (caller).
    unsafe {
        let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)))
    }
}

/// An f16 scale or bias as the kernels read it (its bits).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct H16(u16);

/// The element type of a matrix's scales and biases in the tile kernels: `f32` or [`H16`].
/// Every function needs AVX (and F16C for [`H16`]) and is inlined into the kernels.
#[cfg(target_arch = "x86_64")]
pub(crate) trait SideEl: Copy {
    /// Whether the values are f16.
    const HALF: bool;
    /// Value `i` after `p`.
    unsafe fn get(p: *const Self, i: usize) -> f32;
    /// Values `i` and `i + 1` in lanes 0 and 1.
    unsafe fn pair(p: *const Self, i: usize) -> std::arch::x86_64::__m128;
    /// Values `i..i + 4` in lanes 0-3.
    unsafe fn quad(p: *const Self, i: usize) -> std::arch::x86_64::__m128;
    /// Eight values.
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

#[cfg(target_arch = "x86_64")]
impl SideEl for f32 {
    const HALF: bool = false;
    #[inline(always)]
    unsafe fn get(p: *const f32, i: usize) -> f32 {
        // SAFETY: the caller's pointer is readable at `i`.
        unsafe { *p.add(i) }
    }
    #[inline(always)]
    unsafe fn pair(p: *const f32, i: usize) -> std::arch::x86_64::__m128 {
        use std::arch::x86_64::*;
        // SAFETY: two readable values (an unaligned 8-byte load).
        unsafe { _mm_castsi128_ps(_mm_loadl_epi64(p.add(i) as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn quad(p: *const f32, i: usize) -> std::arch::x86_64::__m128 {
        // SAFETY: four readable values (an unaligned 16-byte load).
        unsafe { std::arch::x86_64::_mm_loadu_ps(p.add(i)) }
    }
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: eight readable values.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

#[cfg(target_arch = "x86_64")]
impl SideEl for H16 {
    const HALF: bool = true;
    #[inline(always)]
    unsafe fn get(p: *const H16, i: usize) -> f32 {
        // SAFETY: readable at `i`; F16C (caller).
        unsafe {
            use std::arch::x86_64::*;
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((*p.add(i)).0 as i32)))
        }
    }
    #[inline(always)]
    unsafe fn pair(p: *const H16, i: usize) -> std::arch::x86_64::__m128 {
        use std::arch::x86_64::*;
        // SAFETY: two readable values (an unaligned 4-byte load); F16C (caller).
        unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p.add(i) as *const i32))) }
    }
    #[inline(always)]
    unsafe fn quad(p: *const H16, i: usize) -> std::arch::x86_64::__m128 {
        use std::arch::x86_64::*;
        // SAFETY: four readable values (an unaligned 8-byte load); F16C (caller).
        unsafe { _mm_cvtph_ps(_mm_loadl_epi64(p.add(i) as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn load8(p: *const H16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: eight readable values; F16C (caller).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

/// The one place a quantized matmul at float level `simd` picks its kernel: AMX INT8 tiles
/// where they take the shape ([`super::amx_int8::takes`]); else, from
/// [`super::matmul::AMX_QUANT_MIN_TOKENS`] tokens with bf16 activations, AMX BF16 on
/// dequantized tiles ([`super::amx`]); at the VNNI level (no AMX) from
/// [`super::qprefill_vnni::MIN_TOKENS`] tokens, the VNNI prefill on 16-row panels (scales per
/// row or per multiple of 32 columns), and for the other layouts with bf16 activations the
/// `vdpbf16ps` prefill on dequantized weights ([`super::matmul::avx512_quant_prefill_takes`]);
/// at the AVX2 integer level (no VNNI) from 32 tokens,
/// integer panels ([`super::qprefill_avx2::takes`]: int4 with sub-scales in
/// [`super::qprefill_avx2`], int8 in [`super::qpanels16_avx2`], int6 and int4 without
/// sub-scales in [`super::qpanels_avx2`]); else the integer
/// kernels of `simd`'s level ([`qmatmul`]).
pub fn quant_matmul(simd: super::Simd, x: &[f32], n: usize, k: usize, w: &QMat, out: &mut [f32], round: DType) {
    let qs = simd.qsimd().min(QSimd::detect());
    #[cfg(target_arch = "x86_64")]
    if super::qprefill_vnni::takes(qs, w, n) {
        super::qprefill_vnni::matmul(x, n, k, w, out, round);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::matmul::avx512_quant_prefill_takes(simd, w.format, n)
        && round == DType::BF16
        && super::avx512bf16::available()
        && super::avx512bf16::prefill_supports(w)
    {
        let (m, w) = (w.rows, super::avx512bf16::PrefillWeights::Quant(w));
        // SAFETY: available() checked AVX512F/BW/BF16; prefill_supports() the shape.
        unsafe { super::avx512bf16::prefill(x, n, k, w, m, out, round) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::qprefill_avx2::takes(qs, w, n) {
        super::qprefill_avx2::matmul(x, n, k, w, out, round);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if !(qs == QSimd::AmxInt8 && super::amx_int8::takes(w, n))
        && n >= super::matmul::AMX_QUANT_MIN_TOKENS
        && super::amx::eligible(simd, round, k)
    {
        // SAFETY: eligible() checked amx::available() and supports(k).
        unsafe { super::amx::matmul(x, n, k, super::amx::Weights::Quant(w), w.rows, out, round) };
        return;
    }
    qmatmul(qs, x, n, k, w, out, round);
}

/// `out[t*m + r] = round(sum_j x[t*k + j] * W[r, j])` with `x` quantized per 32-block.
#[allow(clippy::too_many_arguments)]
pub fn qmatmul(qs: QSimd, x: &[f32], n: usize, k: usize, w: &QMat, out: &mut [f32], round: DType) {
    let m = w.rows;
    assert_eq!(out.len(), n * m, "qmatmul: out has the wrong size");
    let qs = qs.min(QSimd::detect());
    #[cfg(target_arch = "x86_64")]
    if super::qdecode16::takes(qs, w, n) {
        super::qdecode16::matmul(qs, x, n, k, w, out, round);
        return;
    }
    let act = QAct::quantize_for(qs, x, n, k, w);
    qmatmul_quantized(qs, &act, w, out, round);
}

/// [`qmatmul`] on activations already quantized (tests compare against the same ones).
pub fn qmatmul_quantized(qs: QSimd, act: &QAct, w: &QMat, out: &mut [f32], round: DType) {
    let (n, m) = (act.n, w.rows);
    assert_eq!(out.len(), n * m, "qmatmul: out has the wrong size");
    assert_eq!(act.kp, w.kp, "qmatmul: activations quantized for another weight");
    let qs = qs.min(QSimd::detect());
    #[cfg(target_arch = "x86_64")]
    if qs == QSimd::AmxInt8 && super::amx_int8::takes(w, n) {
        // SAFETY: QSimd::AmxInt8 (clamped to the detected level) implies amx_int8::available();
        // takes() checked the weight and token count.
        unsafe { super::amx_int8::matmul(act, w, out, round) };
        return;
    }
    let chunk = super::row_chunk(m, 16);
    let outp = SharedOut(out.as_mut_ptr());
    // Prefill: as many tokens as fit in about 256 KiB of int8 rows (a multiple of 4, 16..=128).
    let tb = if n < SMALL_BATCH { 4 } else { (PREFILL_BYTES / w.kp).clamp(16, 128) / 4 * 4 };
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let r0 = c * chunk;
        let r1 = (r0 + chunk).min(m);
        let mut tmp = vec![0.0f32; tb * (r1 - r0)];
        let mut t0 = 0;
        while t0 < n {
            let nt = tb.min(n - t0);
            // tmp[i * (r1 - r0) + (r - r0)] for token t0 + i.
            rows_tokens(qs, act, w, r0, r1, t0, nt, &mut tmp);
            let ld = r1 - r0;
            for i in 0..nt {
                // SAFETY: t0 + i < n and r1 <= m, so the cells are inside `out`; rows [r0, r1)
                // belong to this task only.
                unsafe { outp.put_rounded((t0 + i) * m + r0, &tmp[i * ld..(i + 1) * ld], round) };
            }
            t0 += nt;
        }
    });
}

/// Rows `r0..r1` x tokens `t0..t0+nt` (the integer part and the bias term) into `tmp`
/// (`[nt][r1 - r0]`).
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub(super) fn rows_tokens(
    qs: QSimd,
    act: &QAct,
    w: &QMat,
    r0: usize,
    r1: usize,
    t0: usize,
    nt: usize,
    tmp: &mut [f32],
) {
    let rb = w.row_bytes();
    let nb = w.kp / QBLOCK;
    let ng = w.ng;
    let (sp, side_bytes) = w.scales.raw();
    let bp = w.bias.as_ref().map_or(std::ptr::null(), |b| b.raw().0);
    // Int6 groups need VBMI at the VNNI level; without it (a matrix built for another CPU
    // level, as tests do) the AVX2 kernels read them.
    #[cfg(target_arch = "x86_64")]
    let qs =
        if qs >= QSimd::Avx512Vnni && w.format == QFormat::I6 && w.i6 == I6Layout::Groups && !super::qavx512::vbmi() {
            QSimd::Avx2
        } else {
            qs
        };
    // The super-block kernel needs activations with one scale per super-block.
    let sums = act.span == SUPER_BLOCKS && qs == QSimd::Avx2 && w.sums_super_blocks();
    let sub = w.sub.as_ref();
    let (sgrid, bgrid) = (w.scales.grid(), w.bias.as_ref().and_then(|b| b.grid()));
    let args = |r: usize, t: usize| TileArgs {
        w: w.packed_ptr().wrapping_add(r * rb),
        row_bytes: rb,
        s: sp.wrapping_add(r * ng * side_bytes),
        side_bytes,
        ng,
        sidx: &w.sidx,
        q: act.q[t * w.kp..].as_ptr(),
        d: act.d[t * nb..].as_ptr(),
        s4: act.s4[t * w.kp / 4..].as_ptr(),
        b: if bp.is_null() { bp } else { bp.wrapping_add(r * ng * side_bytes) },
        ga: act.a[t * ng..].as_ptr(),
        kp: w.kp,
        k: sub.map_or(std::ptr::null(), |s| s.k[r * ng..].as_ptr()),
        unit: sub.map_or(std::ptr::null(), |s| s.unit[r * ng.div_ceil(SUPER_BLOCKS)..].as_ptr()),
        sexp: sgrid.map_or(std::ptr::null(), |g| g.exp[r * (ng / SUPER_BLOCKS)..].as_ptr()),
        bexp: bgrid.map_or(std::ptr::null(), |g| g.exp[r * (ng / SUPER_BLOCKS)..].as_ptr()),
        next_rows: 0,
        skip_rows: 0,
    };
    let ld = r1 - r0;
    #[cfg(target_arch = "x86_64")]
    let kind = TileKind { format: w.format, mode: w.mode, half: w.half_sides(), i6: w.i6 };
    match qs {
        #[cfg(target_arch = "x86_64")]
        QSimd::Avx2 if sgrid.is_none() => {
            // SAFETY: QSimd::Avx2 (clamped to the detected level) implies AVX2, FMA and F16C;
            // every tile's rows and tokens are inside `w` and `act`, its scales and biases `ng`
            // per row of `side_bytes` each (f16 exactly when `half`); with `sums`, the
            // activations share one scale per super-block and an int4 `w` has sub-scales, which
            // the tiles' `k` and `unit` point into (as with `sub`); `tmp` holds nt * ld.
            unsafe { super::qavx2::rows_tokens(kind, sums, sub.is_some(), &args, r0, r1, t0, nt, tmp, ld) }
        }
        #[cfg(target_arch = "x86_64")]
        QSimd::Avx512Vnni | QSimd::AmxInt8 => {
            // SAFETY: QSimd::Avx512Vnni or above (clamped to the detected level) implies AVX-512F/BW/VNNI
            // and AVX2/FMA/F16C; tiles as above; with `sgrid`, scales and biases are `Grid`s
            // (int4, `ScaleMode::Pair`, whole super-blocks: `QMat::with_grid_sides`) and the
            // tiles' `s`, `b`, `sexp` and `bexp` point into them.
            unsafe { super::qavx512::rows_tokens(kind, sgrid.is_some(), &args, r0, r1, t0, nt, tmp, ld) }
        }
        _ => {
            for i in 0..nt {
                for r in r0..r1 {
                    let a = act.a_row(t0 + i);
                    let bias = w.bias.as_ref().map_or(0.0, |b| (0..ng).map(|g| b.get(r * ng + g) * a[g]).sum());
                    tmp[i * ld + r - r0] = portable_dot(act, w, r, t0 + i) + bias;
                }
            }
        }
    }
}

/// Element `c` of a packed int6 row in `layout` minus the zero point 32.
#[inline]
fn i6_qval(row: &[u8], c: usize, layout: I6Layout) -> i32 {
    let ch = &row[c / QCHUNK * I6_CHUNK_BYTES..][..I6_CHUNK_BYTES];
    let j = c % QCHUNK;
    let v = match layout {
        I6Layout::Split => ((ch[j % 32] >> (4 * (j / 32))) & 0xF) | ((ch[32 + j % 16] >> (2 * (j / 16))) & 3) << 4,
        I6Layout::Groups => i6_group(&ch[j / 4 * 3..], j % 4),
    };
    v as i32 - 32
}

/// The reference kernel: per 32-block, the exact integer dot of each 16-column half, scaled by
/// `d * s` in f32 (signed weights, so no zero-point correction).
pub fn portable_dot(act: &QAct, w: &QMat, r: usize, t: usize) -> f32 {
    let rb = w.row_bytes();
    let row = &w.packed()[r * rb..(r + 1) * rb];
    let s = |g: usize| w.scales.get(r * w.ng + g);
    let qa = act.q_row(t);
    let d = act.d_row(t);
    let mut acc = 0.0f32;
    for (b, &db) in d.iter().enumerate() {
        let mut sums = [0i32; 2];
        for (j, &a) in qa[b * QBLOCK..(b + 1) * QBLOCK].iter().enumerate() {
            let c = b * QBLOCK + j;
            let wq = match w.format {
                QFormat::I8 => row[c] as i8 as i32,
                QFormat::I4 => {
                    let byte = row[(c / QCHUNK) * 32 + c % 32];
                    (if c % QCHUNK < 32 { byte & 0xF } else { byte >> 4 }) as i32 - 8
                }
                QFormat::I6 => i6_qval(row, c, w.i6),
            };
            sums[j / 16] += wq * a as i32;
        }
        let (s0, s1) = (s(w.sidx[2 * b] as usize), s(w.sidx[2 * b + 1] as usize));
        if s0 == s1 {
            acc += (sums[0] + sums[1]) as f32 * (db * s0);
        } else {
            acc += sums[0] as f32 * (db * s0) + sums[1] as f32 * (db * s1);
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tile's prefetch stays inside its task's rows (`after` rows follow the tile), reaches
    /// about [`PREFETCH_AHEAD`] bytes ahead, and a task's first tile fetches every row up to
    /// there, so that each later tile's rows were fetched by an earlier one.
    #[test]
    fn prefetch_plan_stays_inside_the_task_and_covers_each_row_once() {
        for row_bytes in [64usize, 1152, 2048, 3456, 8192, 20000] {
            for nr in [1usize, 2, 4, 8] {
                for rows in [nr, 3 * nr, 17 * nr + 1, 64 * nr] {
                    let mut fetched = vec![0u32; rows];
                    let mut r = 0;
                    while r < rows {
                        let n = nr.min(rows - r);
                        let mut a = TileArgs {
                            w: std::ptr::null(),
                            row_bytes,
                            s: std::ptr::null(),
                            side_bytes: 2,
                            ng: 1,
                            sidx: &[],
                            q: std::ptr::null(),
                            d: std::ptr::null(),
                            s4: std::ptr::null(),
                            b: std::ptr::null(),
                            ga: std::ptr::null(),
                            kp: 64,
                            k: std::ptr::null(),
                            unit: std::ptr::null(),
                            sexp: std::ptr::null(),
                            bexp: std::ptr::null(),
                            next_rows: 0,
                            skip_rows: 0,
                        };
                        let after = rows - r - n;
                        a.plan_prefetch(r == 0, n, after);
                        assert!(a.skip_rows + a.next_rows <= after, "{row_bytes} {nr} {rows} at {r}");
                        let first = r + n + a.skip_rows;
                        for f in &mut fetched[first..first + a.next_rows] {
                            *f += 1;
                        }
                        if a.next_rows > 0 {
                            let ahead = (a.skip_rows + a.next_rows) * row_bytes;
                            assert!(ahead < PREFETCH_AHEAD + (PREFETCH_TILES + 1) * n * row_bytes, "{ahead}");
                        }
                        r += n;
                    }
                    // Every row past the first tile is fetched once when the tiles are whole.
                    if rows % nr == 0 {
                        assert!(fetched[nr..].iter().all(|&c| c == 1), "{row_bytes} {nr} {rows}: {fetched:?}");
                    }
                }
            }
        }
    }
}
