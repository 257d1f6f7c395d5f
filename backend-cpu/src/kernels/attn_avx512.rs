//! AVX-512 attention inner loops over a tile of key / value rows (x86-64), used by
//! [`crate::attention`] for head dims that are multiples of 32.
//!
//! Both give bit for bit what the one-row AVX2 loops give ([`super::avx2::dot`] per score,
//! repeated [`super::avx2::axpy`] per value), only with fewer loads and no per-call overhead:
//! - [`dots`]: a query row against up to four keys at once (each query load serves four keys),
//!   each score summed in `dot`'s order: four 8-lane partial sums over 32-column steps, here
//!   held as the two halves of two 16-lane registers, then the same horizontal reduction.
//! - [`weighted_sum`]: `acc += sum_j p_j v_j` with the accumulator in registers across the
//!   tile's positions (128 columns at a time), one FMA per position and column in increasing
//!   position order, as the repeated axpy does in memory.
//!
//! The rows are given one pointer each ([`KvEl`]: f32, or the bf16 bits of a bf16 cache, widened
//! exactly in registers as they are loaded), so a tile is read where it lies: the cache's ring
//! slots or the chunk's own activations, with no f32 copy.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::avx2::hsum;
use super::KvEl;

/// `out[j] = q . k_j` for the keys `keys[j]` (`d` values each, `d % 32 == 0`).
///
/// # Safety
/// AVX-512F, AVX2 and FMA; `q` holds `d` values, each `keys[j]` `d`, `out` `keys.len()`.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn dots<E: KvEl>(q: *const f32, keys: &[*const E], d: usize, out: *mut f32) {
    debug_assert!(d.is_multiple_of(32));
    let nk = keys.len();
    let mut j = 0;
    while j + 4 <= nk {
        let k = [0, 1, 2, 3].map(|u| keys[j + u]);
        // acc[u][0] = [a0 | a1], acc[u][1] = [a2 | a3] of `dot`'s four 8-lane sums.
        let mut acc = [[_mm512_setzero_ps(); 2]; 4];
        let mut i = 0;
        while i < d {
            let q0 = _mm512_loadu_ps(q.add(i));
            let q1 = _mm512_loadu_ps(q.add(i + 16));
            for u in 0..4 {
                acc[u][0] = _mm512_fmadd_ps(q0, E::load16(k[u].add(i)), acc[u][0]);
                acc[u][1] = _mm512_fmadd_ps(q1, E::load16(k[u].add(i + 16)), acc[u][1]);
            }
            i += 32;
        }
        for (u, a) in acc.iter().enumerate() {
            *out.add(j + u) = reduce(a[0], a[1]);
        }
        j += 4;
    }
    while j < nk {
        let k = keys[j];
        let mut a = [_mm512_setzero_ps(); 2];
        let mut i = 0;
        while i < d {
            a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(i)), E::load16(k.add(i)), a[0]);
            a[1] = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(i + 16)), E::load16(k.add(i + 16)), a[1]);
            i += 32;
        }
        *out.add(j) = reduce(a[0], a[1]);
        j += 1;
    }
}

/// `dot`'s final sum: `hsum((a0 + a1) + (a2 + a3))` from `x = [a0 | a1]`, `y = [a2 | a3]`.
#[inline(always)]
unsafe fn reduce(x: __m512, y: __m512) -> f32 {
    let lo = |v: __m512| _mm512_castps512_ps256(v);
    let hi = |v: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    hsum(_mm256_add_ps(_mm256_add_ps(lo(x), hi(x)), _mm256_add_ps(lo(y), hi(y))))
}

/// `acc[c] += p[j] * v_j[c]` for the value rows `vals[j]` (`d` values each), in increasing `j`,
/// for every column `c < d` (`d % 16 == 0`).
///
/// # Safety
/// AVX-512F; `p` holds `vals.len()` values, each `vals[j]` `d`, `acc` `d`.
#[target_feature(enable = "avx512f")]
pub unsafe fn weighted_sum<E: KvEl>(p: *const f32, vals: &[*const E], d: usize, acc: *mut f32) {
    debug_assert!(d.is_multiple_of(16));
    let mut c0 = 0;
    while c0 + 128 <= d {
        columns::<E, 8>(p, vals, acc, c0);
        c0 += 128;
    }
    while c0 < d {
        columns::<E, 1>(p, vals, acc, c0);
        c0 += 16;
    }
}

/// [`weighted_sum`] on columns `c0..c0 + 16 W`, the `W` accumulators in registers.
#[inline(always)]
unsafe fn columns<E: KvEl, const W: usize>(p: *const f32, vals: &[*const E], acc: *mut f32, c0: usize) {
    let mut a = [_mm512_setzero_ps(); W];
    for (l, a) in a.iter_mut().enumerate() {
        *a = _mm512_loadu_ps(acc.add(c0 + 16 * l));
    }
    for (j, &v) in vals.iter().enumerate() {
        let pj = _mm512_set1_ps(*p.add(j));
        let v = v.add(c0);
        for (l, a) in a.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(pj, E::load16(v.add(16 * l)), *a);
        }
    }
    for (l, a) in a.iter().enumerate() {
        _mm512_storeu_ps(acc.add(c0 + 16 * l), *a);
    }
}
