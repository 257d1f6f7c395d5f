//! AVX2 integer kernels for [`super::qmatmul`] (x86-64; also the path on AVX-512 without VNNI).
//!
//! Per 32-block: `vpmaddubsw` (unsigned x signed bytes into i16 pairs), `vpmaddwd` with ones into
//! eight i32 lanes of four columns each, converted to f32 and accumulated with one FMA by
//! `weight scale * activation scale`. Int8 weights use the sign trick (`|w|` as the unsigned
//! operand, the activation's sign flipped where `w < 0`: pairs stay within 2*128*127, no
//! saturation), so no zero-point correction. Int4 nibbles `0..=15` are the unsigned operand
//! directly (2*15*127 fits i16); `8 *` the activations' 4-column sums are subtracted from the
//! eight i32 lanes (exact).
//! Every function is `unsafe` and needs AVX2 and FMA.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use spark_core::quant::QFormat;

use super::qmatmul::{ScaleMode, SideEl, TileArgs, QBLOCK};

/// How a weight format turns a 32-block into `vpmaddubsw` operands.
trait Fmt {
    /// Whether the unsigned operand carries a zero point of 8 (subtracted via the 4-column sums).
    const Z8: bool;
    /// Block `b` of the packed row at `w`: (unsigned operand, sign source).
    unsafe fn block(w: *const u8, b: usize) -> (__m256i, __m256i);
    /// The 16 i16 pair sums of `w . q` for activation bytes `q`.
    unsafe fn dot16(wu: __m256i, ws: __m256i, q: __m256i) -> __m256i;
}

struct I8;
struct I4;

impl Fmt for I8 {
    const Z8: bool = false;
    #[inline(always)]
    unsafe fn block(w: *const u8, b: usize) -> (__m256i, __m256i) {
        let v = _mm256_loadu_si256(w.add(b * QBLOCK) as *const __m256i);
        (_mm256_abs_epi8(v), v)
    }
    #[inline(always)]
    unsafe fn dot16(wu: __m256i, ws: __m256i, q: __m256i) -> __m256i {
        _mm256_maddubs_epi16(wu, _mm256_sign_epi8(q, ws))
    }
}

impl Fmt for I4 {
    const Z8: bool = true;
    #[inline(always)]
    unsafe fn block(w: *const u8, b: usize) -> (__m256i, __m256i) {
        let v = _mm256_loadu_si256(w.add((b / 2) * 32) as *const __m256i);
        let v = if b.is_multiple_of(2) { v } else { _mm256_srli_epi16(v, 4) };
        (_mm256_and_si256(v, _mm256_set1_epi8(0x0F)), v)
    }
    #[inline(always)]
    unsafe fn dot16(wu: __m256i, _ws: __m256i, q: __m256i) -> __m256i {
        _mm256_maddubs_epi16(wu, q)
    }
}

/// How the weight scales of a 32-block fill eight lanes (four columns each), from scales of
/// type `E`.
trait Scale {
    /// One scale for the whole row, applied after the sum (`sv` is then unused).
    const ROW: bool = false;
    /// One scale per 32-block, block `b`'s at index `b` of the row ([`ScaleMode::Pair`]): [`tile`]
    /// multiplies them by the activation scales up front ([`PROD_CAP`]).
    const PAIR: bool = false;
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
    let pf = a.prefetcher(R, nb);
    let [ps, pb] = a.side_prefetchers(R, nb);
    let table = S::PAIR && R * T * nb <= PROD_CAP;
    let mut prod = [std::mem::MaybeUninit::<f32>::uninit(); PROD_CAP];
    let pp = prod.as_mut_ptr() as *mut f32;
    if table {
        // `ng == nb` (groups of 32, no padding): products of rows (r, t) at `(r T + t) nb`.
        let n8 = nb / 8 * 8;
        for r in 0..R {
            let s = a.s.cast::<E>().add(r * a.ng);
            for t in 0..T {
                let (d, o) = (a.d.add(t * nb), pp.add((r * T + t) * nb));
                for i in (0..n8).step_by(8) {
                    _mm256_storeu_ps(o.add(i), _mm256_mul_ps(E::load8(s.add(i)), _mm256_loadu_ps(d.add(i))));
                }
                for i in n8..nb {
                    *o.add(i) = E::get(s, i) * *d.add(i);
                }
            }
        }
    }
    // f16 scales: the tile's rows' scales converted to f32 once, into an L1 buffer, so that the
    // block loop broadcasts f32 values (a scalar f16 conversion per block and row made the
    // decode GEMV ~20 % slower than with f32 scales).
    let mut conv = [std::mem::MaybeUninit::<f32>::uninit(); 4 * CONV_GROUPS];
    let convert = E::HALF && !S::ROW && !table && R <= 4 && a.ng <= CONV_GROUPS;
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
    for b in 0..nb {
        pf.step(b);
        ps.step(b);
        pb.step(b);
        let mut wu = [_mm256_setzero_si256(); R];
        let mut ws = [_mm256_setzero_si256(); R];
        let mut sv = [_mm256_setzero_ps(); R];
        for r in 0..R {
            (wu[r], ws[r]) = F::block(a.w.add(r * a.row_bytes), b);
            if !S::ROW && !table {
                sv[r] = if convert {
                    S::sv::<f32>(cp.add(r * a.ng), sidx, b)
                } else {
                    S::sv(a.s.cast::<E>().add(r * a.ng), sidx, b)
                };
            }
        }
        for t in 0..T {
            let q = _mm256_loadu_si256(a.q.add(t * a.kp + b * QBLOCK) as *const __m256i);
            let dv = _mm256_broadcast_ss(&*a.d.add(t * nb + b));
            let z = if F::Z8 {
                _mm256_slli_epi32::<3>(_mm256_loadu_si256(a.s4.add(t * (a.kp / 4) + b * 8) as *const __m256i))
            } else {
                _mm256_setzero_si256()
            };
            for r in 0..R {
                let mut p = _mm256_madd_epi16(F::dot16(wu[r], ws[r], q), ones);
                if F::Z8 {
                    p = _mm256_sub_epi32(p, z);
                }
                let p = _mm256_cvtepi32_ps(p);
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
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(acc[r][t]);
            if S::ROW {
                out[r][t] *= E::get(a.s.cast::<E>(), r * a.ng);
            }
            out[r][t] += a.bias_term::<E>(r, t);
        }
    }
    out
}

/// Rows `r0..r1` x tokens `t0..t0+nt` into `tmp[i * ld + r - r0]`, in tiles of 4 x 1 (decode)
/// or 2 x up to 4 tokens (3 when per-block scales or the int4 correction need registers).
///
/// Scales and biases are f16 when `half`, else f32.
///
/// # Safety
/// AVX2, FMA and F16C; `args(r, t)` describes packed row `r` and token `t` of matching buffers
/// for every `r0 <= r < r1`, `t0 <= t < t0 + nt`, with scales and biases of the type `half`
/// says; `tmp.len() >= nt * ld`, `ld >= r1 - r0`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows_tokens<'a>(
    fmt: QFormat,
    mode: ScaleMode,
    half: bool,
    args: &impl Fn(usize, usize) -> TileArgs<'a>,
    r0: usize,
    r1: usize,
    t0: usize,
    nt: usize,
    tmp: &mut [f32],
    ld: usize,
) {
    macro_rules! go {
        ($f:ty, $s:ty) => {
            super::by_side!(half, run::<$f, $s>(args, r0, r1, t0, nt, tmp, ld))
        };
    }
    match (fmt, mode) {
        (QFormat::I8, ScaleMode::Row) => go!(I8, PerRow),
        (QFormat::I8, ScaleMode::Half | ScaleMode::Quad) => go!(I8, Half),
        (QFormat::I8, ScaleMode::Pair) => go!(I8, Pair),
        (QFormat::I8, _) => go!(I8, Uni),
        (QFormat::I4, ScaleMode::Row) => go!(I4, PerRow),
        (QFormat::I4, ScaleMode::Half | ScaleMode::Quad) => go!(I4, Half),
        (QFormat::I4, ScaleMode::Pair) => go!(I4, Pair),
        (QFormat::I4, _) => go!(I4, Uni),
    }
}

/// # Safety
/// As [`rows_tokens`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<'a, F: Fmt, S: Scale, E: SideEl>(
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
            // Per-block scales or the int4 correction run out of registers at 2 x 4: use 2 x 3.
            let tt = (nt - t).min(if S::ROW && !F::Z8 { 4 } else { 3 });
            let mut a = args(r, t0 + t);
            if t + tt >= nt {
                // The last token tile over these rows: fetch the next rows meanwhile.
                a.next_rows = (r1 - r - nr).min(nr);
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

/// Quantize one full 32-block of activations at `x` into `q`: returns the scale and the sums
/// of the two 16-value halves, or `None` when a value is not finite (the caller's scalar path
/// handles it). The same arithmetic as the scalar path (`amax / 127`, `1 / scale`, round half
/// to even, clamp to +-127), so the results are identical.
///
/// # Safety
/// AVX2; `x` has 32 readable values, `q` 32 writable bytes.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_block(x: *const f32, q: *mut i8) -> Option<(f32, [i32; 2])> {
    let v = [_mm256_loadu_ps(x), _mm256_loadu_ps(x.add(8)), _mm256_loadu_ps(x.add(16)), _mm256_loadu_ps(x.add(24))];
    // x * 0 is NaN exactly for infinities and NaNs.
    let z = _mm256_setzero_ps();
    let mut bad = _mm256_setzero_ps();
    let absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let mut m = _mm256_setzero_ps();
    for vi in v {
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
        std::ptr::write_bytes(q, 0, QBLOCK);
        return Some((0.0, [0, 0]));
    }
    let s = amax / 127.0;
    let inv = _mm256_set1_ps(1.0 / s);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let mut iv = [_mm256_setzero_si256(); 4];
    for (o, vi) in iv.iter_mut().zip(v) {
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(vi, inv));
        *o = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    let p8 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
    let p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q as *mut __m256i, p8);
    let hsum_i = |a: __m256i| {
        let s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)))
    };
    Some((s, [hsum_i(_mm256_add_epi32(iv[0], iv[1])), hsum_i(_mm256_add_epi32(iv[2], iv[3]))]))
}
