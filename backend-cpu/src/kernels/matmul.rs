//! `out = x W^T` for activations `x` `[n, k]` (f32) and a weight `W` `[m, k]` stored as f32,
//! bf16 or f16, accumulating in f32.
//!
//! Work is split over weight-row chunks across the thread pool; inside a chunk, tokens are taken
//! in blocks that stay in cache, and the AVX2 path computes 4-row x 3-token tiles so each weight
//! element is loaded and converted once per three tokens. Decode (n = 1) is a GEMV that streams
//! the weights once.

use rayon::prelude::*;
use spark_core::DType;

use super::{dot, Row, Simd};

/// A weight matrix viewed as rows.
#[derive(Clone, Copy)]
pub enum Mat<'a> {
    F32(&'a [f32]),
    BF16(&'a [u16]),
    F16(&'a [u16]),
}

impl<'a> Mat<'a> {
    #[inline]
    pub fn row(&self, r: usize, k: usize) -> Row<'a> {
        match *self {
            Mat::F32(d) => Row::F32(&d[r * k..(r + 1) * k]),
            Mat::BF16(d) => Row::BF16(&d[r * k..(r + 1) * k]),
            Mat::F16(d) => Row::F16(&d[r * k..(r + 1) * k]),
        }
    }
}

/// A pointer that may be shared across threads that write disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: used only to write disjoint (row, column) cells from different threads.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn get(self) -> *mut f32 {
        self.0
    }
}

const TOKEN_BLOCK: usize = 48;

/// `out[t*m + r] = round(sum_j x[t*k + j] * W[r, j])`.
#[allow(clippy::too_many_arguments)]
pub fn matmul(simd: Simd, x: &[f32], n: usize, k: usize, w: Mat<'_>, m: usize, out: &mut [f32], round: DType) {
    assert_eq!(x.len(), n * k, "matmul: x has the wrong size");
    assert_eq!(out.len(), n * m, "matmul: out has the wrong size");
    let threads = rayon::current_num_threads().max(1);
    // Enough chunks to balance the threads, each a multiple of 4 rows.
    let chunk = (m.div_ceil(threads * 4)).div_ceil(4).max(1) * 4;
    let outp = SharedOut(out.as_mut_ptr());
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let r0 = c * chunk;
        let r1 = (r0 + chunk).min(m);
        let put = |t: usize, r: usize, v: f32| {
            // SAFETY: t < n and r < m, so the cell is inside `out`; each (t, r) is written by
            // exactly one thread because weight-row ranges [r0, r1) are disjoint per chunk.
            unsafe { *outp.get().add(t * m + r) = round.round(v) };
        };
        for t0 in (0..n).step_by(TOKEN_BLOCK) {
            let t1 = (t0 + TOKEN_BLOCK).min(n);
            chunk_rows(simd, x, k, w, r0, r1, t0, t1, &put);
        }
    });
}

#[allow(clippy::too_many_arguments)]
fn chunk_rows(
    simd: Simd,
    x: &[f32],
    k: usize,
    w: Mat<'_>,
    r0: usize,
    r1: usize,
    t0: usize,
    t1: usize,
    put: &dyn Fn(usize, usize, f32),
) {
    let xrow = |t: usize| &x[t * k..(t + 1) * k];
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx2 {
        let mut r = r0;
        while r + 4 <= r1 {
            let rows = [w.row(r, k), w.row(r + 1, k), w.row(r + 2, k), w.row(r + 3, k)];
            let mut t = t0;
            while t + 3 <= t1 {
                let mut acc = [[0.0f32; 3]; 4];
                // SAFETY: Simd::Avx2 was detected; all rows and tokens have length k.
                unsafe { super::avx2::tile::<4, 3>(&[xrow(t), xrow(t + 1), xrow(t + 2)], &rows, &mut acc) };
                for (ri, a) in acc.iter().enumerate() {
                    for (ti, &v) in a.iter().enumerate() {
                        put(t + ti, r + ri, v);
                    }
                }
                t += 3;
            }
            while t < t1 {
                let mut acc = [[0.0f32; 1]; 4];
                // SAFETY: as above.
                unsafe { super::avx2::tile::<4, 1>(&[xrow(t)], &rows, &mut acc) };
                for (ri, a) in acc.iter().enumerate() {
                    put(t, r + ri, a[0]);
                }
                t += 1;
            }
            r += 4;
        }
        for r in r..r1 {
            let wr = w.row(r, k);
            for t in t0..t1 {
                put(t, r, dot(simd, xrow(t), wr));
            }
        }
        return;
    }
    for r in r0..r1 {
        let wr = w.row(r, k);
        for t in t0..t1 {
            put(t, r, dot(simd, xrow(t), wr));
        }
    }
}
