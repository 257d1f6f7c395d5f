//! The machine's ceilings, measured: memory read bandwidth (what bounds a decode step) and the
//! f32 FMA peak (what bounds a float prefill), both on a given number of threads. `spark-run
//! bench` reports decode speed as a share of the first; `spark-run bench --roofline` prints both.

use std::time::Instant;

use rayon::prelude::*;

use crate::huge_pages::HugeBytes;
use crate::kernels::Simd;

/// Bytes per second of a streaming read of a buffer much larger than the caches, on `threads`
/// threads (best of `reps` passes over `bytes`). Each thread reads its own contiguous part with
/// the widest loads this CPU has and software prefetch 1 KiB ahead, as the decode kernels do
/// (a plain scalar loop left about a third of the bandwidth unused on Sapphire Rapids, below
/// what the GEMVs themselves reach), from a buffer on transparent huge pages where the kernel
/// gives them.
pub fn read_bandwidth(threads: usize, bytes: usize, reps: usize) -> f64 {
    let pool = match rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build() {
        Ok(p) => p,
        Err(_) => return 0.0,
    };
    let n = bytes / 8;
    // On huge pages, as the quantized weights are ([`HugeBytes`]): the ceiling is what the
    // memory gives, not what 4 KiB pages' TLB misses leave of it.
    let mut raw = HugeBytes::zeroed(n * 8);
    let mut unaligned_fallback = Vec::new();
    let buf: &mut [u64] = match bytemuck::try_cast_slice_mut(&mut raw[..]) {
        Ok(b) => b,
        // A plain vector's bytes need not be 8-aligned.
        Err(_) => {
            unaligned_fallback.resize(n, 0u64);
            &mut unaligned_fallback
        }
    };
    pool.install(|| buf.par_iter_mut().enumerate().for_each(|(i, v)| *v = i as u64));
    let buf: &[u64] = buf;
    let per = n.div_ceil(threads.max(1));
    let simd = Simd::detect();
    let mut best = 0.0f64;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let s: u64 = pool.install(|| buf.par_chunks(per).map(|c| sum_chunk(simd, c)).sum());
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((n * 8) as f64 / dt);
    }
    best
}

/// The wrapping sum of `c` (the loads, not the adds, set the pace).
fn sum_chunk(simd: Simd, c: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if simd >= Simd::Avx2 {
        let body = c.len() / 32 * 32;
        // SAFETY: Simd::Avx2 (or better) is only detected with AVX2 present; `body` values lie
        // inside `c`.
        let s = unsafe { sum_avx2(c.as_ptr(), body) };
        return c[body..].iter().fold(s, |s, &v| s.wrapping_add(v));
    }
    let _ = simd;
    let mut acc = [0u64; 8];
    let mut it = c.chunks_exact(8);
    for b in &mut it {
        for (a, &v) in acc.iter_mut().zip(b) {
            *a = a.wrapping_add(v);
        }
    }
    acc.iter().fold(it.remainder().iter().fold(0u64, |s, &v| s.wrapping_add(v)), |s, &v| s.wrapping_add(v))
}

/// Sum `n` (a multiple of 32) u64 from `p`: four 256-bit loads per 256-byte step, prefetching
/// 1 KiB ahead.
///
/// # Safety
/// AVX2; `p` holds `n` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(p: *const u64, n: usize) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut i = 0;
    while i < n {
        for l in 0..4 {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + 128 + 8 * l) as *const i8);
        }
        for (l, a) in acc.iter_mut().enumerate() {
            *a = _mm256_add_epi64(*a, _mm256_loadu_si256(p.add(i + 4 * l) as *const __m256i));
            *a = _mm256_add_epi64(*a, _mm256_loadu_si256(p.add(i + 16 + 4 * l) as *const __m256i));
        }
        i += 32;
    }
    let mut lanes = [0u64; 4];
    let s = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
    _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, s);
    lanes.iter().fold(0u64, |s, &v| s.wrapping_add(v))
}

/// f32 FLOP/s of fused multiply-adds at the widest SIMD level this CPU runs, on `threads`
/// threads.
pub fn fma_peak(threads: usize) -> f64 {
    let pool = match rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build() {
        Ok(p) => p,
        Err(_) => return 0.0,
    };
    let simd = Simd::detect();
    let iters = 20_000_000usize;
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let flops: f64 = pool.install(|| {
            (0..threads.max(1)).into_par_iter().map(|i| fma_loop(simd, iters, i as f32 * 1e-9)).sum::<f64>()
        });
        best = best.max(flops / t.elapsed().as_secs_f64());
    }
    best
}

/// Run `iters` rounds of 10 independent FMA chains; returns the FLOPs done.
fn fma_loop(simd: Simd, iters: usize, seed: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if simd >= Simd::Avx512 {
            // SAFETY: Simd::Avx512 is only detected with AVX-512F present.
            let r = unsafe { fma512(iters, seed) };
            std::hint::black_box(r);
            return (iters * 10 * 16 * 2) as f64;
        }
        if simd >= Simd::Avx2 {
            // SAFETY: Simd::Avx2 is only detected with AVX2 and FMA present.
            let r = unsafe { fma256(iters, seed) };
            std::hint::black_box(r);
            return (iters * 10 * 8 * 2) as f64;
        }
    }
    let _ = simd;
    let mut a = [seed; 10];
    for _ in 0..iters / 8 {
        for x in a.iter_mut() {
            *x = x.mul_add(0.999_999, 1e-7);
        }
    }
    std::hint::black_box(a);
    ((iters / 8) * 10 * 2) as f64
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma256(iters: usize, seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm256_set1_ps(0.999_999);
    let c = _mm256_set1_ps(1e-7);
    let mut a = [_mm256_set1_ps(seed); 10];
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm256_fmadd_ps(*x, m, c);
        }
    }
    let mut s = _mm256_setzero_ps();
    for x in a {
        s = _mm256_add_ps(s, x);
    }
    _mm256_cvtss_f32(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma512(iters: usize, seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm512_set1_ps(0.999_999);
    let c = _mm512_set1_ps(1e-7);
    let mut a = [_mm512_set1_ps(seed); 10];
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm512_fmadd_ps(*x, m, c);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in a {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measurements_are_positive_and_finite() {
        let bw = read_bandwidth(1, 8 << 20, 1);
        assert!(bw.is_finite() && bw > 1e8, "{bw}");
        let v: Vec<u64> = (1..=75).collect();
        for simd in [Simd::Portable, Simd::detect()] {
            assert_eq!(sum_chunk(simd, &v[..11]), 66);
            assert_eq!(sum_chunk(simd, &v), 75 * 76 / 2);
        }
    }
}
