//! AVX2 + FMA + F16C kernels (x86-64). Every function here is `unsafe` and must only be called
//! after `Simd::detect` has returned `Simd::Avx2`.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::{Prefetcher, Row};

/// Load 8 weights at `i` as f32.
#[inline(always)]
unsafe fn load8(w: Row<'_>, i: usize) -> __m256 {
    match w {
        Row::F32(r) => _mm256_loadu_ps(r.as_ptr().add(i)),
        Row::BF16(r) => {
            let h = _mm_loadu_si128(r.as_ptr().add(i) as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
        Row::F16(r) => _mm256_cvtph_ps(_mm_loadu_si128(r.as_ptr().add(i) as *const __m128i)),
    }
}

/// The sum of the 8 lanes of `v` (the order every AVX2 dot product here uses).
///
/// # Safety
/// AVX (the caller's target features).
#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// `sum_i x[i] * w[i]`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x.len() == w.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot(x: &[f32], w: Row<'_>) -> f32 {
    let n = x.len();
    let xp = x.as_ptr();
    let mut a0 = _mm256_setzero_ps();
    let mut a1 = _mm256_setzero_ps();
    let mut a2 = _mm256_setzero_ps();
    let mut a3 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(i)), load8(w, i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(i + 8)), load8(w, i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(i + 16)), load8(w, i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(i + 24)), load8(w, i + 24), a3);
        i += 32;
    }
    while i + 8 <= n {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(i)), load8(w, i), a0);
        i += 8;
    }
    let mut s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    while i < n {
        s += x[i] * w.get(i);
        i += 1;
    }
    s
}

/// `out[i] += a * w[i]`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `out.len() == w.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy(a: f32, w: Row<'_>, out: &mut [f32]) {
    let n = out.len();
    let av = _mm256_set1_ps(a);
    let op = out.as_mut_ptr();
    let mut i = 0;
    while i + 8 <= n {
        let o = _mm256_loadu_ps(op.add(i));
        _mm256_storeu_ps(op.add(i), _mm256_fmadd_ps(av, load8(w, i), o));
        i += 8;
    }
    while i < n {
        out[i] += a * w.get(i);
        i += 1;
    }
}

/// A tile of `R` weight rows x `T` tokens: `out[r][t] = x[t] . w[r]`. Each weight element is
/// loaded (and converted) once for all tokens of the tile.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every row and token has the same length.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile<const R: usize, const T: usize>(x: &[&[f32]; T], w: &[Row<'_>; R], out: &mut [[f32; T]; R]) {
    let n = x[0].len();
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut i = 0;
    while i + 8 <= n {
        let mut xv = [_mm256_setzero_ps(); T];
        for t in 0..T {
            xv[t] = _mm256_loadu_ps(x[t].as_ptr().add(i));
        }
        for r in 0..R {
            let wv = load8(w[r], i);
            for t in 0..T {
                acc[r][t] = _mm256_fmadd_ps(xv[t], wv, acc[r][t]);
            }
        }
        i += 8;
    }
    for r in 0..R {
        for t in 0..T {
            let mut s = hsum(acc[r][t]);
            for (j, &xv) in x[t].iter().enumerate().skip(i) {
                s += xv * w[r].get(j);
            }
            out[r][t] = s;
        }
    }
}

/// Weight element types the monomorphic kernels below read.
pub trait Elem: Copy + Send + Sync {
    /// Load 8 elements at `p` as f32.
    ///
    /// # Safety
    /// `p..p+8` must be readable; the CPU must support AVX2 and F16C.
    unsafe fn load8(p: *const Self) -> __m256;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

/// bf16 bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Bf16(pub u16);
/// f16 bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct F16(pub u16);

impl Elem for Bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const Bf16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::from_bits(self.0).to_f32()
    }
}

impl Elem for F16 {
    #[inline(always)]
    unsafe fn load8(p: *const F16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }
}

/// GEMV rows `r0..r1`: `out[r - r0] = x . w[r]`, four rows at a time with two accumulators
/// each, every weight element read once (decode is bound by this stream).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` holds at least `r1 * k` elements,
/// `x.len() == k`, `out.len() >= r1 - r0`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gemv<E: Elem>(x: &[f32], w: &[E], k: usize, r0: usize, r1: usize, out: &mut [f32]) {
    let xp = x.as_ptr();
    let wp = w.as_ptr();
    let body = k - k % 16;
    let mut r = r0;
    while r + 4 <= r1 {
        let rows = [wp.add(r * k), wp.add((r + 1) * k), wp.add((r + 2) * k), wp.add((r + 3) * k)];
        // The next four rows (if inside the range) stream into L2 meanwhile.
        let mut pf =
            Prefetcher::rows(wp as *const u8, k * size_of::<E>(), r + 4, (r1 - r - 4).min(4), body / 16).cursor();
        let mut a = [_mm256_setzero_ps(); 8];
        let mut i = 0;
        while i < body {
            pf.advance();
            let x0 = _mm256_loadu_ps(xp.add(i));
            let x1 = _mm256_loadu_ps(xp.add(i + 8));
            for (j, rp) in rows.iter().enumerate() {
                a[2 * j] = _mm256_fmadd_ps(x0, E::load8(rp.add(i)), a[2 * j]);
                a[2 * j + 1] = _mm256_fmadd_ps(x1, E::load8(rp.add(i + 8)), a[2 * j + 1]);
            }
            i += 16;
        }
        for j in 0..4 {
            let mut s = hsum(_mm256_add_ps(a[2 * j], a[2 * j + 1]));
            for (t, &xv) in x.iter().enumerate().skip(body) {
                s += xv * (*rows[j].add(t)).to_f32();
            }
            out[r - r0 + j] = s;
        }
        r += 4;
    }
    while r < r1 {
        let rp = wp.add(r * k);
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        let mut i = 0;
        while i < body {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(i)), E::load8(rp.add(i)), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(i + 8)), E::load8(rp.add(i + 8)), a1);
            i += 16;
        }
        let mut s = hsum(_mm256_add_ps(a0, a1));
        for (t, &xv) in x.iter().enumerate().skip(body) {
            s += xv * (*rp.add(t)).to_f32();
        }
        out[r - r0] = s;
        r += 1;
    }
}

/// Rows of a packed panel: 16 weight rows interleaved as `[k][16]` f32.
pub const PANEL: usize = 16;

/// Transpose an 8x8 block of f32 held in 8 registers (shuffles only, so any 32-bit lanes: the
/// integer prefill panels transpose bytes in fours and 16-bit values in pairs with it,
/// [`super::qpanels_avx2`], [`super::qpanels16_avx2`]).
///
/// # Safety
/// AVX.
#[inline(always)]
pub(super) unsafe fn transpose8(r: &mut [__m256; 8]) {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    r[0] = _mm256_permute2f128_ps::<0x20>(s0, s4);
    r[1] = _mm256_permute2f128_ps::<0x20>(s1, s5);
    r[2] = _mm256_permute2f128_ps::<0x20>(s2, s6);
    r[3] = _mm256_permute2f128_ps::<0x20>(s3, s7);
    r[4] = _mm256_permute2f128_ps::<0x31>(s0, s4);
    r[5] = _mm256_permute2f128_ps::<0x31>(s1, s5);
    r[6] = _mm256_permute2f128_ps::<0x31>(s2, s6);
    r[7] = _mm256_permute2f128_ps::<0x31>(s3, s7);
}

/// Pack rows `r0..r0+16` of `w` (`[m, k]`) into `panel` as `[k][16]` f32, zero rows past `m`.
/// Converts 8 elements of 8 rows at a time and transposes them in registers, so the panel is
/// written with full-vector stores.
///
/// # Safety
/// The CPU must support AVX2 and F16C; `panel.len() >= k * 16`; `w.len() >= m * k`.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn pack_panel<E: Elem>(w: &[E], k: usize, m: usize, r0: usize, panel: &mut [f32]) {
    let wp = w.as_ptr();
    let pp = panel.as_mut_ptr();
    let body = k - k % 8;
    for g in 0..2 {
        let base = r0 + 8 * g;
        let mut kk = 0;
        while kk < body {
            let mut v = [_mm256_setzero_ps(); 8];
            for (j, vj) in v.iter_mut().enumerate() {
                if base + j < m {
                    *vj = E::load8(wp.add((base + j) * k + kk));
                }
            }
            transpose8(&mut v);
            for (i, vi) in v.iter().enumerate() {
                _mm256_storeu_ps(pp.add((kk + i) * PANEL + 8 * g), *vi);
            }
            kk += 8;
        }
        for kk in body..k {
            for j in 0..8 {
                let r = base + j;
                *pp.add(kk * PANEL + 8 * g + j) = if r < m { (*wp.add(r * k + kk)).to_f32() } else { 0.0 };
            }
        }
    }
}

/// The prefill micro-kernel: `T` tokens x 16 packed rows, broadcasting each activation and
/// accumulating outer products (2 FMAs per broadcast, 12 accumulators at T = 6).
///
/// # Safety
/// The CPU must support AVX2 and FMA; each `x[t]` has `k` readable elements;
/// `panel.len() >= k * 16`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn panel_kernel<const T: usize>(x: &[*const f32; T], panel: &[f32], k: usize, out: &mut [[f32; PANEL]; T]) {
    let mut a0 = [_mm256_setzero_ps(); T];
    let mut a1 = [_mm256_setzero_ps(); T];
    let pp = panel.as_ptr();
    for kk in 0..k {
        let w0 = _mm256_loadu_ps(pp.add(kk * PANEL));
        let w1 = _mm256_loadu_ps(pp.add(kk * PANEL + 8));
        for t in 0..T {
            let xb = _mm256_broadcast_ss(&*x[t].add(kk));
            a0[t] = _mm256_fmadd_ps(xb, w0, a0[t]);
            a1[t] = _mm256_fmadd_ps(xb, w1, a1[t]);
        }
    }
    for t in 0..T {
        _mm256_storeu_ps(out[t].as_mut_ptr(), a0[t]);
        _mm256_storeu_ps(out[t].as_mut_ptr().add(8), a1[t]);
    }
}

/// Multi-token GEMV for small batches: rows `r0..r1` for `T` tokens at once, two rows per
/// iteration, so each weight element is loaded and converted once per `T` tokens.
/// `out[t][r - r0] = x[t] . w[r]`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` holds at least `r1 * k` elements; every
/// `x[t]` has `k` elements; every `out[t]` has at least `r1 - r0`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gemv_multi<E: Elem, const T: usize>(
    x: [&[f32]; T],
    w: &[E],
    k: usize,
    r0: usize,
    r1: usize,
    out: &mut [&mut [f32]; T],
) {
    let wp = w.as_ptr();
    let body = k - k % 8;
    let mut r = r0;
    while r < r1 {
        let nr = if r + 2 <= r1 { 2 } else { 1 };
        let rows = [wp.add(r * k), wp.add((r + nr - 1) * k)];
        // The next two rows stream into L2 meanwhile, as in [`gemv`].
        let mut pf =
            Prefetcher::rows(wp as *const u8, k * size_of::<E>(), r + nr, (r1 - r - nr).min(2), body / 8).cursor();
        let mut a = [[_mm256_setzero_ps(); T]; 2];
        let mut i = 0;
        while i < body {
            pf.advance();
            let w0 = E::load8(rows[0].add(i));
            let w1 = E::load8(rows[1].add(i));
            for t in 0..T {
                let xv = _mm256_loadu_ps(x[t].as_ptr().add(i));
                a[0][t] = _mm256_fmadd_ps(xv, w0, a[0][t]);
                a[1][t] = _mm256_fmadd_ps(xv, w1, a[1][t]);
            }
            i += 8;
        }
        for (j, row) in rows.iter().enumerate().take(nr) {
            for t in 0..T {
                let mut s = hsum(a[j][t]);
                for (kk, &xv) in x[t].iter().enumerate().skip(body) {
                    s += xv * (*row.add(kk)).to_f32();
                }
                out[t][r - r0 + j] = s;
            }
        }
        r += nr;
    }
}
