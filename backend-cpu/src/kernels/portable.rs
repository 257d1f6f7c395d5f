//! Portable kernels: plain Rust that any target compiles; the reference the SIMD paths are
//! tested against.

use super::Row;

/// `sum_i x[i] * w[i]` with four interleaved partial sums.
pub fn dot(x: &[f32], w: Row<'_>) -> f32 {
    let mut acc = [0.0f32; 4];
    let n = x.len();
    let body = n - n % 4;
    match w {
        Row::F32(w) => {
            for i in (0..body).step_by(4) {
                for j in 0..4 {
                    acc[j] += x[i + j] * w[i + j];
                }
            }
        }
        _ => {
            for i in (0..body).step_by(4) {
                for j in 0..4 {
                    acc[j] += x[i + j] * w.get(i + j);
                }
            }
        }
    }
    let mut s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (i, &xv) in x.iter().enumerate().skip(body) {
        s += xv * w.get(i);
    }
    s
}

/// `out[i] += a * w[i]`.
pub fn axpy(a: f32, w: Row<'_>, out: &mut [f32]) {
    match w {
        Row::F32(w) => out.iter_mut().zip(w).for_each(|(o, &v)| *o += a * v),
        _ => out.iter_mut().enumerate().for_each(|(i, o)| *o += a * w.get(i)),
    }
}
