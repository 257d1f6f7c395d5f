//! AVX2 attention inner loops over a tile of key / value rows (x86-64), used by
//! [`crate::attention`] for head dims that are multiples of 32 on CPUs without AVX-512.
//!
//! Both give bit for bit what the one-row loops give ([`super::avx2::dot`] per score, repeated
//! [`super::avx2::axpy`] per value), with fewer loads and no per-call dispatch:
//! - [`dots`]: a query row against two keys at once (each query load serves both), each score
//!   summed in `dot`'s order: four 8-lane partial sums over 32-column steps, then
//!   `hsum((a0 + a1) + (a2 + a3))`.
//! - [`weighted_sum`]: `acc += sum_j p_j v_j` with the accumulator in registers across the
//!   tile's positions (64 columns at a time), one FMA per position and column in increasing
//!   position order, as the repeated axpy does in memory.
//!
//! Rows come one pointer each, f32 or bf16 bits ([`KvEl`], widened exactly as loaded).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::avx2::hsum;
use super::KvEl;

/// `out[j] = q . k_j` for the keys `keys[j]` (`d` values each, `d % 32 == 0`).
///
/// # Safety
/// AVX2 and FMA; `q` holds `d` values, each `keys[j]` `d`, `out` `keys.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dots<E: KvEl>(q: *const f32, keys: &[*const E], d: usize, out: *mut f32) {
    debug_assert!(d.is_multiple_of(32));
    let nk = keys.len();
    let mut j = 0;
    while j < nk {
        let two = j + 2 <= nk;
        let k = [keys[j], keys[if two { j + 1 } else { j }]];
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        let mut i = 0;
        while i < d {
            let qv = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(q.add(i + o)));
            for (a, kr) in acc.iter_mut().zip(k) {
                for (l, (a, &qv)) in a.iter_mut().zip(&qv).enumerate() {
                    *a = _mm256_fmadd_ps(qv, E::load8(kr.add(i + 8 * l)), *a);
                }
            }
            i += 32;
        }
        for (u, a) in acc.iter().enumerate().take(if two { 2 } else { 1 }) {
            *out.add(j + u) = hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
        }
        j += if two { 2 } else { 1 };
    }
}

/// `acc[c] += p[j] * v_j[c]` for the value rows `vals[j]` (`d` values each), in increasing `j`,
/// for every column `c < d` (`d % 32 == 0`).
///
/// # Safety
/// AVX2 and FMA; `p` holds `vals.len()` values, each `vals[j]` `d`, `acc` `d`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn weighted_sum<E: KvEl>(p: *const f32, vals: &[*const E], d: usize, acc: *mut f32) {
    debug_assert!(d.is_multiple_of(32));
    let mut c0 = 0;
    while c0 + 64 <= d {
        columns::<E, 8>(p, vals, acc, c0);
        c0 += 64;
    }
    while c0 < d {
        columns::<E, 4>(p, vals, acc, c0);
        c0 += 32;
    }
}

/// [`weighted_sum`] on columns `c0..c0 + 8 W`, the `W` accumulators in registers.
#[inline(always)]
unsafe fn columns<E: KvEl, const W: usize>(p: *const f32, vals: &[*const E], acc: *mut f32, c0: usize) {
    let mut a = [_mm256_setzero_ps(); W];
    for (l, a) in a.iter_mut().enumerate() {
        *a = _mm256_loadu_ps(acc.add(c0 + 8 * l));
    }
    for (j, &v) in vals.iter().enumerate() {
        let pj = _mm256_set1_ps(*p.add(j));
        let v = v.add(c0);
        for (l, a) in a.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(pj, E::load8(v.add(8 * l)), *a);
        }
    }
    for (l, a) in a.iter().enumerate() {
        _mm256_storeu_ps(acc.add(c0 + 8 * l), *a);
    }
}
