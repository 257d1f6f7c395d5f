//! AVX2 integer kernels for [`super::qmatmul`] (x86-64; also the path on AVX-512 without VNNI).
//!
//! Per 32-block: `vpmaddubsw` (unsigned x signed bytes into i16 pairs), `vpmaddwd` with ones into
//! eight i32 lanes of four columns each, converted to f32 and accumulated with one FMA by
//! `weight scale * activation scale`. Int8 weights use the sign trick (`|w|` as the unsigned
//! operand, the activation's sign flipped where `w < 0`: pairs stay within 2*128*127, no
//! saturation), so no zero-point correction. Int4 nibbles `0..=15` are the unsigned operand
//! directly (2*15*127 fits i16); their zero point of 8 is taken off after the sum, with the bias
//! term (`TileArgs::bias_term`: `- 8 scale` per group times the activations' group sums), not
//! per block in the loop. Int6 likewise, zero point 32: in [`I6Layout::Split`], its nibble and
//! its top two bits (moved to bits 4-5 by one per-lane shift) or-ed into `0..=63`; in
//! [`I6Layout::Groups`] unpacked from its groups of three bytes (`i6_block`).
//!
//! `tile` scales each block in f32; `sub_tile` (2 to 31 tokens, int4 with integer
//! sub-scales or int8 with per-row scales, activations with one scale per 256 columns) sums a
//! whole super-block in integers and converts once per super-block.
//! Every function is `unsafe` and needs AVX2 and FMA.

#![cfg(target_arch = "x86_64")]

use std::arch::asm;
use std::arch::x86_64::*;

use spark_core::quant::QFormat;

use std::marker::PhantomData;

use super::qmatmul::{I6Layout, ScaleMode, SideEl, TileArgs, TileKind, H16, I6_CHUNK_BYTES, QBLOCK, SUPER_BLOCKS};

/// How a weight format turns a 32-block into `vpmaddubsw` operands.
trait Fmt {
    /// The zero point the unsigned operand carries (8 for int4, 32 for int6; taken off with the
    /// bias term), 0 for none.
    const ZERO: i32;
    /// Block `h` (0 or 1) of 64-column chunk `c` of the packed row at `w`: (unsigned operand,
    /// sign source).
    unsafe fn block(w: *const u8, c: usize, h: usize) -> (__m256i, __m256i);
    /// The 16 i16 pair sums of `w . q` for activation bytes `q`.
    unsafe fn dot16(wu: __m256i, ws: __m256i, q: __m256i) -> __m256i;
}

struct I8;
struct I4;
/// Int6 in [`I6Layout::Split`].
struct I6;
/// Int6 in [`I6Layout::Groups`].
struct I6G;

impl Fmt for I8 {
    const ZERO: i32 = 0;
    #[inline(always)]
    unsafe fn block(w: *const u8, c: usize, h: usize) -> (__m256i, __m256i) {
        let v = _mm256_loadu_si256(w.add((2 * c + h) * QBLOCK) as *const __m256i);
        (_mm256_abs_epi8(v), v)
    }
    #[inline(always)]
    unsafe fn dot16(wu: __m256i, ws: __m256i, q: __m256i) -> __m256i {
        _mm256_maddubs_epi16(wu, _mm256_sign_epi8(q, ws))
    }
}

impl Fmt for I4 {
    const ZERO: i32 = 8;
    #[inline(always)]
    unsafe fn block(w: *const u8, c: usize, h: usize) -> (__m256i, __m256i) {
        let v = _mm256_loadu_si256(w.add(c * 32) as *const __m256i);
        let v = if h == 0 { v } else { _mm256_srli_epi16(v, 4) };
        (_mm256_and_si256(v, _mm256_set1_epi8(0x0F)), v)
    }
    #[inline(always)]
    unsafe fn dot16(wu: __m256i, _ws: __m256i, q: __m256i) -> __m256i {
        _mm256_maddubs_epi16(wu, q)
    }
}

impl Fmt for I6 {
    const ZERO: i32 = 32;
    #[inline(always)]
    unsafe fn block(w: *const u8, c: usize, h: usize) -> (__m256i, __m256i) {
        // The chunk's nibbles as int4's; its top bits, element `16 i + j` at bits `2i` of byte
        // `j`, broadcast to both halves and shifted per half so that block `h`'s two fields
        // (`2h` in bytes 0-15, `2h + 1` in 16-31) land at bits 4-5 (32-bit shifts: what crosses
        // into a neighbouring byte is masked off).
        let p = w.add(c * I6_CHUNK_BYTES);
        let v = _mm256_loadu_si256(p as *const __m256i);
        let v = if h == 0 { v } else { _mm256_srli_epi16(v, 4) };
        let lo = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
        let hb = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(32) as *const __m128i));
        let hs = if h == 0 {
            _mm256_sllv_epi32(hb, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2))
        } else {
            _mm256_srlv_epi32(hb, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2))
        };
        (_mm256_or_si256(lo, _mm256_and_si256(hs, _mm256_set1_epi8(0x30))), v)
    }
    #[inline(always)]
    unsafe fn dot16(wu: __m256i, _ws: __m256i, q: __m256i) -> __m256i {
        // `0..=63` times `-127..=127`, in pairs: at most 16002, no saturation.
        _mm256_maddubs_epi16(wu, q)
    }
}

impl Fmt for I6G {
    const ZERO: i32 = 32;
    #[inline(always)]
    unsafe fn block(w: *const u8, c: usize, h: usize) -> (__m256i, __m256i) {
        let v = i6_block(w.add(c * I6_CHUNK_BYTES), h);
        (v, v)
    }
    #[inline(always)]
    unsafe fn dot16(wu: __m256i, _ws: __m256i, q: __m256i) -> __m256i {
        // `0..=63` times `-127..=127`, in pairs: at most 16002, no saturation.
        _mm256_maddubs_epi16(wu, q)
    }
}

/// Block `h` (0 or 1) of the int6 chunk at `p` in [`I6Layout::Groups`]: its 32
/// values `0..=63` in column order. Lane 0 takes the block's groups 0-3 (its bytes 0..12), lane
/// 1 groups 4-7 (bytes 12..24, loaded from 8 so that nothing past the block is read); a byte
/// shuffle gives each dword its group's bytes as `[b1, b0, b2, b1]`, i.e. the 16-bit words
/// `b0 b1` and `b1 b2` of the group's 24-bit number, and two 16-bit multiplies move the four
/// fields to the dword's bytes (base64's unpacking): `e0` and `e2` down by 10 and 6 bits
/// (`vpmulhuw` by 2^6 and 2^10), `e1` and `e3` up by 4 and 8 (`vpmullw` by 2^4 and 2^8).
///
/// # Safety
/// AVX2; 48 readable bytes at `p`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn i6_block(p: *const u8, h: usize) -> __m256i {
    let b = p.add(24 * h);
    let v = _mm256_loadu2_m128i(b.add(8) as *const __m128i, b as *const __m128i);
    let x = _mm256_shuffle_epi8(v, I6_GROUP_BYTES.v);
    let t0 = _mm256_and_si256(x, _mm256_set1_epi32(0x0FC0_FC00));
    let t2 = _mm256_and_si256(x, _mm256_set1_epi32(0x003F_03F0));
    // The multiplies in inline assembly: LLVM rewrites `vpmulhuw` / `vpmullw` by powers of two
    // as word shifts, which AVX2 has only with one count per register, and emulates them with
    // widening, dword shifts and packs (the int6 GEMV in L2 at 12 GB/s against 17 this way).
    let (t1, t3): (__m256i, __m256i);
    // SAFETY: AVX2 (this function's precondition); register operands only, no memory, no flags.
    asm!(
        "vpmulhuw {t1}, {t0}, {m1}",
        "vpmullw {t3}, {t2}, {m3}",
        t0 = in(ymm_reg) t0,
        t2 = in(ymm_reg) t2,
        m1 = in(ymm_reg) _mm256_set1_epi32(0x0400_0040),
        m3 = in(ymm_reg) _mm256_set1_epi32(0x0100_0010),
        t1 = out(ymm_reg) t1,
        t3 = lateout(ymm_reg) t3,
        options(pure, nomem, nostack, preserves_flags),
    );
    _mm256_or_si256(t1, t3)
}

#[repr(C)]
union Bytes32 {
    a: [u8; 32],
    v: __m256i,
}
/// [`i6_block`]'s shuffle: dword `j` of lane 0 takes group `j` from byte `3j`, of lane 1 group
/// `4 + j` from byte `4 + 3j` (the lane was loaded from byte 8).
const I6_GROUP_BYTES: Bytes32 = {
    let mut a = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        let (lane, j, k) = (i / 16, i % 16 / 4, i % 4);
        let order = [1, 0, 2, 1];
        a[i] = (4 * lane + 3 * j + order[k]) as u8;
        i += 1;
    }
    Bytes32 { a }
};

/// How the weight scales of a 32-block fill eight lanes (four columns each), from scales of
/// type `E`.
trait Scale {
    /// One scale for the whole row, applied after the sum (`sv` is then unused).
    const ROW: bool = false;
    /// One scale per 32-block, block `b`'s at index `b` of the row ([`ScaleMode::Pair`]): [`tile`]
    /// multiplies them by the activation scales up front ([`PROD_CAP`]).
    const PAIR: bool = false;
    /// [`Scale::PAIR`] whose scales are `k * u` from the sub-scales ([`TileArgs::k`],
    /// [`TileArgs::unit`]): the same f32 values, from a byte per block instead of the scales.
    const SUB: bool = false;
    unsafe fn sv<E: SideEl>(s: *const E, sidx: *const u32, b: usize) -> __m256;
}

/// One scale per row.
struct PerRow;
/// One scale per block (`group % 32 == 0`).
struct Uni;
/// One scale per 16-column half (`group % 16 == 0`).
struct Half;
/// One scale per 32-block, in block order ([`ScaleMode::Pair`]).
struct Pair;
/// [`Pair`] from the integer sub-scales.
struct SubPair;

impl Scale for PerRow {
    const ROW: bool = true;
    #[inline(always)]
    unsafe fn sv<E: SideEl>(_s: *const E, _sidx: *const u32, _b: usize) -> __m256 {
        _mm256_setzero_ps()
    }
}

impl Scale for Uni {
    #[inline(always)]
    unsafe fn sv<E: SideEl>(s: *const E, sidx: *const u32, b: usize) -> __m256 {
        _mm256_set1_ps(E::get(s, *sidx.add(2 * b) as usize))
    }
}

impl Scale for Pair {
    const PAIR: bool = true;
    #[inline(always)]
    unsafe fn sv<E: SideEl>(s: *const E, _sidx: *const u32, b: usize) -> __m256 {
        _mm256_set1_ps(E::get(s, b))
    }
}

impl Scale for SubPair {
    const PAIR: bool = true;
    const SUB: bool = true;
    #[inline(always)]
    unsafe fn sv<E: SideEl>(_s: *const E, _sidx: *const u32, _b: usize) -> __m256 {
        unreachable!("tile takes SubPair scales from sub_scale")
    }
}

/// Scale `k * u` of block `b` of row `r` of the tile (groups of 32, [`SubPair`]).
///
/// # Safety
/// `a` has sub-scales for its rows; `b` is a block of the row.
#[inline(always)]
unsafe fn sub_scale(a: &TileArgs<'_>, r: usize, b: usize) -> f32 {
    *a.k.add(r * a.ng + b) as f32 * *a.unit.add(r * a.ng.div_ceil(SUPER_BLOCKS) + b / SUPER_BLOCKS)
}

impl Scale for Half {
    #[inline(always)]
    unsafe fn sv<E: SideEl>(s: *const E, sidx: *const u32, b: usize) -> __m256 {
        let lo = _mm_set1_ps(E::get(s, *sidx.add(2 * b) as usize));
        let hi = _mm_set1_ps(E::get(s, *sidx.add(2 * b + 1) as usize));
        _mm256_set_m128(hi, lo)
    }
}

/// Most groups per row whose f16 scales [`tile`] converts to f32 up front (4 rows: 8 KiB of
/// stack); rows with more groups read the f16 values in the block loop.
const CONV_GROUPS: usize = 512;
/// Most `weight scale * activation scale` products (rows x tokens x blocks) that [`tile`] forms
/// up front for [`ScaleMode::Pair`] (16 KiB of stack): eight per multiply into an L1 buffer,
/// from which the block loop's FMA broadcasts its factor with a load alone. Formed in the loop,
/// each product cost a scalar multiply and a register broadcast per row and block, a fifth of
/// the int4 GEMV's arithmetic. The products are the same f32 multiplications either way.
const PROD_CAP: usize = 4096;

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// `R` rows x `T` tokens over all columns: `out[r][t] = sum_b d[t,b] * s[r,b] * dot_b`.
///
/// # Safety
/// AVX2 and FMA; `a` describes `R` packed rows and `T` token rows of `a.kp` columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<F: Fmt, S: Scale, E: SideEl, const R: usize, const T: usize>(a: &TileArgs<'_>) -> [[f32; T]; R] {
    let nb = a.kp / QBLOCK;
    let ones = _mm256_set1_epi16(1);
    let sidx = a.sidx.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut pf = a.prefetcher(R, nb / 2).cursor();
    let [ps, pb] = a.side_prefetchers(R, nb / 2);
    let (mut ps, mut pb) = (ps.cursor(), pb.cursor());
    let table = S::PAIR && R * T * nb <= PROD_CAP;
    let mut prod = [std::mem::MaybeUninit::<f32>::uninit(); PROD_CAP];
    let pp = prod.as_mut_ptr() as *mut f32;
    if table {
        // `ng == nb` (groups of 32, no padding): products of rows (r, t) at `(r T + t) nb`.
        let n8 = nb / 8 * 8;
        let nsb = nb.div_ceil(SUPER_BLOCKS);
        for r in 0..R {
            let s = a.s.cast::<E>().add(r * a.ng);
            let (k, u) = (a.k.wrapping_add(r * a.ng), a.unit.wrapping_add(r * nsb));
            // Eight scales from `i` (a super-block's with sub-scales: `SUPER_BLOCKS == 8`).
            let s8 = |i: usize| {
                if S::SUB {
                    let kv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(k.add(i) as *const __m128i));
                    _mm256_mul_ps(_mm256_cvtepi32_ps(kv), _mm256_set1_ps(*u.add(i / SUPER_BLOCKS)))
                } else {
                    E::load8(s.add(i))
                }
            };
            for t in 0..T {
                let (d, o) = (a.d.add(t * nb), pp.add((r * T + t) * nb));
                for i in (0..n8).step_by(8) {
                    _mm256_storeu_ps(o.add(i), _mm256_mul_ps(s8(i), _mm256_loadu_ps(d.add(i))));
                }
                for i in n8..nb {
                    let si = if S::SUB { sub_scale(a, r, i) } else { E::get(s, i) };
                    *o.add(i) = si * *d.add(i);
                }
            }
        }
    }
    // f16 scales: the tile's rows' scales converted to f32 once, into an L1 buffer, so that the
    // block loop broadcasts f32 values (a scalar f16 conversion per block and row made the
    // decode GEMV ~20 % slower than with f32 scales).
    let mut conv = [std::mem::MaybeUninit::<f32>::uninit(); 4 * CONV_GROUPS];
    let convert = E::HALF && !S::ROW && !S::SUB && !table && R <= 4 && a.ng <= CONV_GROUPS;
    let cp = conv.as_mut_ptr() as *mut f32;
    if convert {
        let n8 = a.ng / 8 * 8;
        for r in 0..R {
            let src = a.s.cast::<E>().add(r * a.ng);
            for i in (0..n8).step_by(8) {
                _mm256_storeu_ps(cp.add(r * a.ng + i), E::load8(src.add(i)));
            }
            for i in n8..a.ng {
                *cp.add(r * a.ng + i) = E::get(src, i);
            }
        }
    }
    // By 64-column chunks (two blocks; `kp` is a multiple of 64): an int4 chunk is one 32-byte
    // load, whose two blocks are its low and high nibbles (no per-block parity test), and the
    // prefetches step once per chunk.
    for c in 0..nb / 2 {
        pf.advance();
        ps.advance();
        pb.advance();
        for h in 0..2 {
            let b = 2 * c + h;
            let mut wu = [_mm256_setzero_si256(); R];
            let mut ws = [_mm256_setzero_si256(); R];
            let mut sv = [_mm256_setzero_ps(); R];
            for r in 0..R {
                (wu[r], ws[r]) = F::block(a.w.add(r * a.row_bytes), c, h);
                if !S::ROW && !table {
                    sv[r] = if S::SUB {
                        _mm256_set1_ps(sub_scale(a, r, b))
                    } else if convert {
                        S::sv::<f32>(cp.add(r * a.ng), sidx, b)
                    } else {
                        S::sv(a.s.cast::<E>().add(r * a.ng), sidx, b)
                    };
                }
            }
            for t in 0..T {
                let q = _mm256_loadu_si256(a.q.add(t * a.kp + b * QBLOCK) as *const __m256i);
                let dv = _mm256_broadcast_ss(&*a.d.add(t * nb + b));
                for r in 0..R {
                    let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(F::dot16(wu[r], ws[r], q), ones));
                    let scale = if table {
                        _mm256_broadcast_ss(&*pp.add((r * T + t) * nb + b))
                    } else if S::ROW {
                        dv
                    } else {
                        _mm256_mul_ps(sv[r], dv)
                    };
                    acc[r][t] = _mm256_fmadd_ps(p, scale, acc[r][t]);
                }
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(acc[r][t]);
            if S::ROW {
                out[r][t] *= E::get(a.s.cast::<E>(), r * a.ng);
            }
            out[r][t] += a.bias_term::<E>(r, t, F::ZERO);
        }
    }
    out
}

/// `R` rows x `T` tokens summed in integers across each super-block, on activations with one
/// scale per super-block: int4 with integer sub-scales (`K`: `a.k`, `a.unit`), or int8 with one
/// scale per row (`!K`). Per 32-block `vpmaddubsw` ([`Fmt::dot16`]), then `vpmaddwd` by the
/// block's `k` (int4) or by ones (int8), summed into i32 lanes across the super-block's eight
/// blocks, converted and scaled once per super-block by `u * d` (int4) or `d` (int8, the row
/// scale after the sum). Exact integers throughout: a lane's pair sums reach 2 * 15 * 127
/// (int4), times `k <= 255` and over eight blocks 15.5e6, or 2 * 128 * 127 (int8) times 2 and 8:
/// 520e3 (both < 2^24: the f32 conversion is exact too). The int4 zero point of 8 comes off
/// with the bias term. Per block and token: two multiply-adds and an integer add (int8: and the
/// sign), where [`tile`] has two multiply-adds, a conversion and an FMA.
///
/// # Safety
/// AVX2 and FMA; `a` describes `R` packed rows (int4 [`ScaleMode::Pair`] with sub-scales, or
/// int8 [`ScaleMode::Row`]) and `T` token rows of `a.kp` columns whose scales repeat over each
/// super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)]
unsafe fn sub_tile<F: Fmt, E: SideEl, const K: bool, const R: usize, const T: usize>(
    a: &TileArgs<'_>,
) -> [[f32; T]; R] {
    let nb = a.kp / QBLOCK;
    let nsb = nb.div_ceil(SUPER_BLOCKS);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut pf = a.prefetcher(R, nb / 2).cursor();
    // The scales and biases are read after the loop only.
    let [ps, pb] = a.side_prefetchers(R, nb / 2);
    let (mut ps, mut pb) = (ps.cursor(), pb.cursor());
    for sb in 0..nsb {
        let (c0, c1) = (sb * SUPER_BLOCKS / 2, ((sb + 1) * SUPER_BLOCKS / 2).min(nb / 2));
        let mut iacc = [[_mm256_setzero_si256(); T]; R];
        for c in c0..c1 {
            pf.advance();
            ps.advance();
            pb.advance();
            for h in 0..2 {
                let b = 2 * c + h;
                let mut wu = [_mm256_setzero_si256(); R];
                let mut ws = [_mm256_setzero_si256(); R];
                let mut kv = [ones; R];
                for r in 0..R {
                    (wu[r], ws[r]) = F::block(a.w.add(r * a.row_bytes), c, h);
                    if K {
                        kv[r] = _mm256_set1_epi16(*a.k.add(r * a.ng + b) as i16);
                    }
                }
                for t in 0..T {
                    let q = _mm256_loadu_si256(a.q.add(t * a.kp + b * QBLOCK) as *const __m256i);
                    for r in 0..R {
                        let p = _mm256_madd_epi16(F::dot16(wu[r], ws[r], q), kv[r]);
                        iacc[r][t] = _mm256_add_epi32(iacc[r][t], p);
                    }
                }
            }
        }
        for r in 0..R {
            let u = if K { *a.unit.add(r * nsb + sb) } else { 1.0 };
            for t in 0..T {
                let f = _mm256_set1_ps(u * *a.d.add(t * nb + 2 * c0));
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][t]), f, acc[r][t]);
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(acc[r][t]);
            if !K {
                out[r][t] *= E::get(a.s.cast::<E>(), r * a.ng);
            }
            out[r][t] += a.bias_term::<E>(r, t, F::ZERO);
        }
    }
    out
}

/// A tile kernel that [`run`] drives over rows and tokens.
trait Kernel {
    /// Most tokens per two-row tile (registers).
    const MAX_T: usize;
    /// # Safety
    /// As the kernel's own function.
    unsafe fn tile<const R: usize, const T: usize>(a: &TileArgs<'_>) -> [[f32; T]; R];
}

/// [`tile`]: per-block float scaling.
struct Blocks<F, S, E>(PhantomData<(F, S, E)>);
/// [`sub_tile`]: integer sums per super-block (`K`: with int4 sub-scales).
struct Sub<F, E, const K: bool>(PhantomData<(F, E)>);

impl<F: Fmt, S: Scale, E: SideEl> Kernel for Blocks<F, S, E> {
    // Per-block scales run out of registers at 2 x 4: use 2 x 3.
    const MAX_T: usize = if S::ROW { 4 } else { 3 };
    #[inline(always)]
    unsafe fn tile<const R: usize, const T: usize>(a: &TileArgs<'_>) -> [[f32; T]; R] {
        tile::<F, S, E, R, T>(a)
    }
}

impl<F: Fmt, E: SideEl, const K: bool> Kernel for Sub<F, E, K> {
    const MAX_T: usize = 4;
    #[inline(always)]
    unsafe fn tile<const R: usize, const T: usize>(a: &TileArgs<'_>) -> [[f32; T]; R] {
        sub_tile::<F, E, K, R, T>(a)
    }
}

/// Rows `r0..r1` x tokens `t0..t0+nt` into `tmp[i * ld + r - r0]`, in tiles of 4 x 1 (decode)
/// or 2 x up to 4 tokens (3 when per-block scales need registers).
///
/// For weights of `kind`: scales and biases f16 when `kind.half`, else f32. With `sums`,
/// [`sub_tile`] (int4 with sub-scales or int8 per row, activations with one scale per
/// super-block). With `sub` (int4 [`ScaleMode::Pair`] with sub-scales), the per-block scales
/// come from the sub-scales ([`SubPair`]), never from the scale array. Int6 chunks are in
/// layout `kind.i6`.
///
/// # Safety
/// AVX2, FMA and F16C; `args(r, t)` describes packed row `r` and token `t` of matching buffers
/// for every `r0 <= r < r1`, `t0 <= t < t0 + nt`, with scales and biases of the type
/// `kind.half` says (and with `sums` or `sub`, the sub-scales [`sub_tile`] and [`SubPair`] need);
/// `tmp.len() >= nt * ld`, `ld >= r1 - r0`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows_tokens<'a>(
    kind: TileKind,
    sums: bool,
    sub: bool,
    args: &impl Fn(usize, usize) -> TileArgs<'a>,
    r0: usize,
    r1: usize,
    t0: usize,
    nt: usize,
    tmp: &mut [f32],
    ld: usize,
) {
    let TileKind { format: fmt, mode, half, i6 } = kind;
    // The kernel with f32 or f16 scales and biases.
    macro_rules! sides {
        ($k:ty, $kh:ty) => {
            if half {
                run::<$kh>(args, r0, r1, t0, nt, tmp, ld)
            } else {
                run::<$k>(args, r0, r1, t0, nt, tmp, ld)
            }
        };
    }
    macro_rules! go {
        ($f:ty, $s:ty) => {
            sides!(Blocks<$f, $s, f32>, Blocks<$f, $s, H16>)
        };
    }
    if sums {
        return match fmt {
            QFormat::I4 => sides!(Sub<I4, f32, true>, Sub<I4, H16, true>),
            QFormat::I8 => sides!(Sub<I8, f32, false>, Sub<I8, H16, false>),
            QFormat::I6 => unreachable!("int6 never sums super-blocks (QMat::sums_super_blocks)"),
        };
    }
    match (fmt, mode) {
        (QFormat::I8, ScaleMode::Row) => go!(I8, PerRow),
        (QFormat::I8, ScaleMode::Half | ScaleMode::Quad) => go!(I8, Half),
        (QFormat::I8, ScaleMode::Pair) => go!(I8, Pair),
        (QFormat::I8, _) => go!(I8, Uni),
        (QFormat::I4, ScaleMode::Row) => go!(I4, PerRow),
        (QFormat::I4, ScaleMode::Half | ScaleMode::Quad) => go!(I4, Half),
        (QFormat::I4, ScaleMode::Pair) if sub => go!(I4, SubPair),
        (QFormat::I4, ScaleMode::Pair) => go!(I4, Pair),
        (QFormat::I4, _) => go!(I4, Uni),
        (QFormat::I6, _) if i6 == I6Layout::Groups => match mode {
            ScaleMode::Row => go!(I6G, PerRow),
            ScaleMode::Half | ScaleMode::Quad => go!(I6G, Half),
            ScaleMode::Pair => go!(I6G, Pair),
            _ => go!(I6G, Uni),
        },
        (QFormat::I6, ScaleMode::Row) => go!(I6, PerRow),
        (QFormat::I6, ScaleMode::Half | ScaleMode::Quad) => go!(I6, Half),
        (QFormat::I6, ScaleMode::Pair) => go!(I6, Pair),
        (QFormat::I6, _) => go!(I6, Uni),
    }
}

/// # Safety
/// As [`rows_tokens`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<'a, K: Kernel>(
    args: &impl Fn(usize, usize) -> TileArgs<'a>,
    r0: usize,
    r1: usize,
    t0: usize,
    nt: usize,
    tmp: &mut [f32],
    ld: usize,
) {
    let rt = if nt == 1 { 4 } else { 2 };
    let mut r = r0;
    while r < r1 {
        let nr = if r + rt <= r1 { rt } else { 1 };
        let mut t = 0;
        while t < nt {
            let tt = (nt - t).min(K::MAX_T);
            let mut a = args(r, t0 + t);
            if t + tt >= nt {
                // The last token tile over these rows: fetch the rows ahead meanwhile.
                a.plan_prefetch(r == r0, nr, r1 - r - nr);
            }
            let base = t * ld + r - r0;
            macro_rules! go {
                ($r:literal, $t:literal) => {{
                    let o = K::tile::<$r, $t>(&a);
                    for (j, row) in o.iter().enumerate() {
                        for (i, &v) in row.iter().enumerate() {
                            tmp[base + i * ld + j] = v;
                        }
                    }
                }};
            }
            match (nr, tt) {
                // Four-row tiles only when nt == 1.
                (4, _) => go!(4, 1),
                (2, 1) => go!(2, 1),
                (2, 2) => go!(2, 2),
                (2, 3) => go!(2, 3),
                (2, _) => go!(2, 4),
                (_, 1) => go!(1, 1),
                (_, 2) => go!(1, 2),
                (_, 3) => go!(1, 3),
                (_, _) => go!(1, 4),
            }
            t += tt;
        }
        r += nr;
    }
}

/// Quantize `sums.len()` consecutive full 32-blocks of activations at `x` into `q`, sharing
/// one scale (the largest magnitude of them all; one block, or a super-block): returns the
/// scale and writes each block's two 16-value half sums into `sums`, or `None` when a value is
/// not finite (the caller's scalar path handles it). The same arithmetic as the scalar path
/// (`amax / 127`, `1 / scale`, round half to even, clamp to +-127), so the results are
/// identical.
///
/// # Safety
/// AVX2; `x` has `32 * sums.len()` readable values, `q` as many writable bytes.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_blocks(x: *const f32, q: *mut i8, sums: &mut [[i32; 2]]) -> Option<f32> {
    let nblk = sums.len();
    // x * 0 is NaN exactly for infinities and NaNs.
    let z = _mm256_setzero_ps();
    let mut bad = _mm256_setzero_ps();
    let absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let mut m = _mm256_setzero_ps();
    for i in 0..4 * nblk {
        let vi = _mm256_loadu_ps(x.add(8 * i));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_UNORD_Q>(_mm256_mul_ps(vi, z), z));
        m = _mm256_max_ps(m, _mm256_and_ps(vi, absmask));
    }
    if _mm256_movemask_ps(bad) != 0 {
        return None;
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
    if amax == 0.0 {
        std::ptr::write_bytes(q, 0, QBLOCK * nblk);
        sums.fill([0, 0]);
        return Some(0.0);
    }
    let s = amax / 127.0;
    let inv = _mm256_set1_ps(1.0 / s);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let hsum_i = |a: __m256i| {
        let s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)))
    };
    for (b, sum) in sums.iter_mut().enumerate() {
        let mut iv = [_mm256_setzero_si256(); 4];
        for (j, o) in iv.iter_mut().enumerate() {
            let vi = _mm256_loadu_ps(x.add(b * QBLOCK + 8 * j));
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(vi, inv));
            *o = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        let p8 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        let p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.add(b * QBLOCK) as *mut __m256i, p8);
        *sum = [hsum_i(_mm256_add_epi32(iv[0], iv[1])), hsum_i(_mm256_add_epi32(iv[2], iv[3]))];
    }
    Some(s)
}
