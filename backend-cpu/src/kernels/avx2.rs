//! AVX2 + FMA + F16C kernels (x86-64). Every function here is `unsafe` and must only be called
//! after `Simd::detect` has returned `Simd::Avx2`.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::Row;

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

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
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
