//! AVX-512 f32 FMA matmul for a few tokens (x86-64): `out = x W^T` for 2 to 15 tokens (batched
//! decode, short chunks) on bf16 weights, on cores whose `vdpbf16ps` is slow.
//!
//! Where it runs ([`super::matmul::fma512_batch_takes`]): the `Avx512` level on Intel cores
//! ([`super::matmul::vdpbf16ps_is_slow`]), 2-15 tokens, where the `vdpbf16ps` tiles
//! ([`super::avx512bf16::matmul`]) issue at a quarter of the FMA's rate. Whole-model bf16
//! decode on an Emerald Rapids guest, two threads, four rounds alternated (docs/BENCHMARKS.md,
//! session 49): `--batch 4` median 23.2 -> 25.9 tok/s (+11 %), `--batch 8` 30.0 -> 30.5 (level).
//! Both stay far from the weights' stream (batch 8 reads 12-13 GB/s of about 24): the tile
//! waits on its weight loads, and neither form tried here fixed that.
//!
//! A tile of [`ROWS`] (2) weight rows x up to [`TOKENS`] (8) tokens: per 16 columns, each row's
//! 16 bf16 weights widened to f32 in registers (a zero extension and a shift), each token's 16
//! activations loaded once for both rows, and 16 FMAs into 16 accumulators. The weights stream
//! once per 8 tokens, and each tile prefetches the next tile's rows at its own column (a
//! prefetch 4 KiB ahead in the row, the one-token GEMV's, fetched the tile's other row half
//! the time: batch 4 ran 8-12 % slower with it). One row per tile instead (8 accumulators, one
//! weight stream) ran a third slower: each FMA then loads its activations. Columns past the
//! last multiple of 16 are summed in scalar code.
//!
//! Precision: f32 products and f32 sums in column order per lane, as the f32 panels; with
//! bf16-valued activations every product is exact, as in `vdpbf16ps`; only the order of the
//! sums differs.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use rayon::prelude::*;
use spark_core::DType;

use super::SharedOut;

/// Weight rows per tile.
pub const ROWS: usize = 2;
/// Most tokens per tile (one pass over the weights).
pub const TOKENS: usize = 8;

/// `out[t*m + r] = round(sum_j x[t*k + j] * W[r, j])` for bf16 `w` `[m, k]` and `n` tokens of
/// `x` `[n, k]`, rows split across the rayon pool.
///
/// # Safety
/// AVX-512F is present.
pub unsafe fn matmul(x: &[f32], n: usize, k: usize, w: &[u16], m: usize, out: &mut [f32], round: DType) {
    assert_eq!(x.len(), n * k, "batch fma512: x has the wrong size");
    assert_eq!(w.len(), m * k, "batch fma512: w has the wrong size");
    assert_eq!(out.len(), n * m, "batch fma512: out has the wrong size");
    if n == 0 || m == 0 {
        return;
    }
    let chunk = super::row_chunk(m, ROWS);
    let outp = SharedOut(out.as_mut_ptr());
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let (r0, r1) = (c * chunk, (c * chunk + chunk).min(m));
        // SAFETY: AVX-512F (this function's contract); rows r0..r1 lie in w; x holds n rows of
        // k; this task alone writes rows r0..r1 of every token.
        unsafe { rows(x, n, k, w, m, r0, r1, outp, round) };
    });
}

/// Rows `r0..r1` for all `n` tokens into `out[t*m + r]`.
///
/// # Safety
/// AVX-512F; `w` holds rows `r0..r1` of `k`; `x` holds `n` rows of `k`; the `out` cells
/// `t*m + r` of these rows are this caller's alone.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows(
    x: &[f32],
    n: usize,
    k: usize,
    w: &[u16],
    m: usize,
    r0: usize,
    r1: usize,
    outp: SharedOut,
    round: DType,
) {
    let mut r = r0;
    while r < r1 {
        let nr = ROWS.min(r1 - r);
        let wp = w.as_ptr().add(r * k);
        for t0 in (0..n).step_by(TOKENS) {
            let nt = TOKENS.min(n - t0);
            let xp = x.as_ptr().add(t0 * k);
            let mut sums = [[0.0f32; TOKENS]; ROWS];
            macro_rules! go {
                ($r:literal, $t:literal) => {{
                    let s = tile::<$r, $t>(xp, k, wp);
                    for (dst, src) in sums.iter_mut().zip(&s) {
                        dst[..$t].copy_from_slice(src);
                    }
                }};
            }
            match (nr, nt) {
                (2, 8) => go!(2, 8),
                (2, 7) => go!(2, 7),
                (2, 6) => go!(2, 6),
                (2, 5) => go!(2, 5),
                (2, 4) => go!(2, 4),
                (2, 3) => go!(2, 3),
                (2, 2) => go!(2, 2),
                (2, _) => go!(2, 1),
                (_, 8) => go!(1, 8),
                (_, 7) => go!(1, 7),
                (_, 6) => go!(1, 6),
                (_, 5) => go!(1, 5),
                (_, 4) => go!(1, 4),
                (_, 3) => go!(1, 3),
                (_, 2) => go!(1, 2),
                (_, _) => go!(1, 1),
            }
            for (i, row) in sums.iter().enumerate().take(nr) {
                for (t, &v) in row.iter().enumerate().take(nt) {
                    // SAFETY: t0 + t < n and r + i < r1 <= m; rows r0..r1 are this task's.
                    outp.put((t0 + t) * m + r + i, round.round(v));
                }
            }
        }
        r += nr;
    }
}

/// `R` rows x `T` tokens over all `k` columns: `out[i][t] = sum_j x[t*k + j] * w[i*k + j]`.
///
/// # Safety
/// AVX-512F; `w` holds `R` rows of `k` bf16, `x` `T` rows of `k` f32.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<const R: usize, const T: usize>(x: *const f32, k: usize, w: *const u16) -> [[f32; T]; R] {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let full = k / 16 * 16;
    let mut j = 0;
    while j < full {
        let mut wv = [_mm512_setzero_ps(); R];
        for i in 0..R {
            let row = w.add(i * k + j);
            if j % 32 == 0 {
                // The next tile's row at the same column. A prefetch is a hint: it does not
                // fault, whatever the address.
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(R * k) as *const i8);
            }
            let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(row as *const __m256i));
            wv[i] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits));
        }
        for t in 0..T {
            let xv = _mm512_loadu_ps(x.add(t * k + j));
            for i in 0..R {
                acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
            }
        }
        j += 16;
    }
    let mut out = [[0.0f32; T]; R];
    for i in 0..R {
        for t in 0..T {
            let mut s = _mm512_reduce_add_ps(acc[i][t]);
            for c in full..k {
                s += *x.add(t * k + c) * f32::from_bits((*w.add(i * k + c) as u32) << 16);
            }
            out[i][t] = s;
        }
    }
    out
}
