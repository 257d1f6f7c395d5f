//! AVX-512F kernels (x86-64): the prefill micro-kernel on 16-float vectors, and the bf16 -> f32
//! row conversion (attention's key / value tiles). Callers must have checked `Simd::Avx512`
//! (which implies AVX2, FMA and F16C too) or AVX-512F itself.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::avx2::PANEL;

/// Tokens per AVX-512 micro-kernel call.
pub const MR: usize = 12;

/// `T` tokens x one 16-row packed panel: per k, one panel vector and `T` broadcast FMAs into
/// `T` accumulators.
///
/// # Safety
/// The CPU must support AVX-512F; each `x[t]` has `k` readable elements;
/// `panel.len() >= k * 16`.
#[target_feature(enable = "avx512f")]
pub unsafe fn panel_kernel<const T: usize>(x: &[*const f32; T], panel: &[f32], k: usize, out: &mut [[f32; PANEL]; T]) {
    let mut a = [_mm512_setzero_ps(); T];
    let pp = panel.as_ptr();
    for kk in 0..k {
        let w = _mm512_loadu_ps(pp.add(kk * PANEL));
        for t in 0..T {
            a[t] = _mm512_fmadd_ps(_mm512_set1_ps(*x[t].add(kk)), w, a[t]);
        }
    }
    for t in 0..T {
        _mm512_storeu_ps(out[t].as_mut_ptr(), a[t]);
    }
}

/// `out[i] = f32(src[i])` for bf16 bits `src` (exact: the bits shifted into the high half).
///
/// # Safety
/// The CPU must support AVX-512F; `out.len() == src.len()`.
#[target_feature(enable = "avx512f")]
pub unsafe fn bf16_to_f32(src: &[u16], out: &mut [f32]) {
    let n = src.len();
    let (sp, op) = (src.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(sp.add(i) as *const __m256i));
        _mm512_storeu_si512(op.add(i) as *mut _, _mm512_slli_epi32::<16>(v));
        i += 16;
    }
    while i < n {
        *op.add(i) = f32::from_bits((*sp.add(i) as u32) << 16);
        i += 1;
    }
}

/// `out[i] = f32(src[i])` for f16 bits `src` (exact: `vcvtph2ps`, 16 at a time).
///
/// # Safety
/// The CPU must support AVX-512F; `out.len() == src.len()`.
#[target_feature(enable = "avx512f")]
pub unsafe fn f16_to_f32(src: &[u16], out: &mut [f32]) {
    let n = src.len();
    let (sp, op) = (src.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        let h = _mm256_loadu_si256(sp.add(i) as *const __m256i);
        _mm512_storeu_ps(op.add(i), _mm512_cvtph_ps(h));
        i += 16;
    }
    while i < n {
        *op.add(i) = half::f16::from_bits(*sp.add(i)).to_f32();
        i += 1;
    }
}
