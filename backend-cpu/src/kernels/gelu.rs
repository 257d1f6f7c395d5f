//! GELU with erf (`torch.nn.functional.gelu(x)`, approximate='none') and the GEGLU row op,
//! vectorized.
//!
//! [`erf`] is branch-free so that the compiler vectorizes it: on `|x| <= 1.5`, `x * A(u)` with
//! `u` the rescaled `x^2` (erf(x)/x is smooth and even); on `1.5 < |x| <= 4`, `1 - B(u)` with `u`
//! the rescaled `|x|` (erfc is small and smooth there); beyond 4, erf is 1 to within f32
//! rounding. `A` (degree 8) and `B` (degree 13) are Chebyshev interpolants of the exact
//! functions, evaluated by Horner's rule with fused multiply-adds. Maximum absolute error
//! against the exact erf: 9.6e-8 (libm's `erff`: 5.3e-8), about one f32 ulp near +-1; the
//! unit test checks 1.2e-7 on a dense grid. Every SIMD level computes the same operations, so
//! the results are identical across levels (also tested).

use spark_core::DType;

use super::Simd;

/// `erf(x) / x` on `|x| <= 1.5` in `u = (x^2 - 1.125) / 1.125`.
const A: [f32; 9] = [
    0.8168362,
    -0.22525254,
    0.06590879,
    -0.016287595,
    0.0033850723,
    -0.000601298,
    9.299963e-5,
    -1.3099386e-5,
    1.5922934e-6,
];
/// `erfc(x)` on `1.5 <= x <= 4` in `u = (x - 2.75) / 1.25`.
const B: [f32; 14] = [
    0.00010062298,
    -0.0007328461,
    0.0025190564,
    -0.005391427,
    0.007956071,
    -0.008409382,
    0.0063116658,
    -0.0030845406,
    0.0005626199,
    0.0005415312,
    -0.0005645446,
    0.00016987554,
    6.194279e-5,
    -4.063098e-5,
];
const SPLIT: f32 = 1.5;

#[inline(always)]
fn horner<const N: usize>(c: &[f32; N], u: f32) -> f32 {
    let mut r = c[N - 1];
    for &k in c[..N - 1].iter().rev() {
        r = r.mul_add(u, k);
    }
    r
}

/// The error function in f32 (see the module documentation for its accuracy).
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    // (A NaN fails the comparison and stays NaN.)
    let a = if x.abs() > 4.0 { 4.0 } else { x.abs() };
    let t = a * a;
    let small = a * horner(&A, (t - 1.125) * (1.0 / 1.125));
    let large = 1.0 - horner(&B, (a - 2.75) * (1.0 / 1.25));
    let y = if a <= SPLIT { small } else { large };
    y.copysign(x)
}

/// Exact-erf GELU: `0.5 x (1 + erf(x / sqrt 2))`.
#[inline(always)]
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// `o = round(round(gelu_erf(g)) * u)`, element-wise.
pub fn geglu(simd: Simd, g: &[f32], u: &[f32], o: &mut [f32], round: DType) {
    assert!(g.len() == u.len() && o.len() == u.len(), "geglu: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        if simd >= Simd::Avx512 {
            // SAFETY: Simd::Avx512 is only detected with AVX-512F present.
            return unsafe { geglu_avx512(g, u, o, round) };
        }
        if simd >= Simd::Avx2 {
            // SAFETY: Simd::Avx2 is only detected with AVX2 and FMA present.
            return unsafe { geglu_avx2(g, u, o, round) };
        }
    }
    let _ = simd;
    geglu_body(g, u, o, round);
}

/// The loop, with the rounding chosen outside it (so it vectorizes).
#[inline(always)]
fn geglu_body(g: &[f32], u: &[f32], o: &mut [f32], round: DType) {
    match round {
        DType::BF16 => {
            let r = spark_core::dtype::round_bf16;
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = r(r(gelu_erf(g)) * u);
            }
        }
        _ => {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = round.round(round.round(gelu_erf(g)) * u);
            }
        }
    }
}

/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn geglu_avx512(g: &[f32], u: &[f32], o: &mut [f32], round: DType) {
    geglu_body(g, u, o, round)
}

/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn geglu_avx2(g: &[f32], u: &[f32], o: &mut [f32], round: DType) {
    geglu_body(g, u, o, round)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_is_within_1_2e_7_of_the_exact_function() {
        let mut worst = (0.0f64, 0.0f32);
        let mut x = -6.0f32;
        while x <= 6.0 {
            let e = (erf(x) as f64 - libm::erf(x as f64)).abs();
            if e > worst.0 {
                worst = (e, x);
            }
            x += 1.0 / 65536.0;
        }
        assert!(worst.0 <= 1.2e-7, "max |erf error| {:e} at {}", worst.0, worst.1);
        assert_eq!(erf(0.0), 0.0);
        assert_eq!(erf(f32::INFINITY), 1.0);
        assert_eq!(erf(f32::NEG_INFINITY), -1.0);
        assert!(erf(f32::NAN).is_nan());
    }

    #[test]
    fn geglu_is_identical_at_every_level_and_close_to_libm() {
        let n = 4099;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 - 2049.0) * 0.0037).collect();
        let u: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        for round in [DType::F32, DType::BF16] {
            let mut want = vec![0.0f32; n];
            geglu(Simd::Portable, &g, &u, &mut want, round);
            for (i, (&w, (&g, &u))) in want.iter().zip(g.iter().zip(&u)).enumerate() {
                let libm_gelu = 0.5 * g as f64 * (1.0 + libm::erf(g as f64 / std::f64::consts::SQRT_2));
                let exact = libm_gelu * u as f64;
                // The formula's own cancellation (1 + erf near -1) allows an absolute error of
                // 0.5 |g u| times erf's; rounding adds one bf16 or a few f32 ulps.
                let cancel = 0.5 * (g * u).abs() as f64 * 1.2e-7;
                let tol = cancel + if round == DType::BF16 { exact.abs() / 128.0 } else { 1e-6 * exact.abs() };
                assert!((w as f64 - exact).abs() <= tol, "{round:?} [{i}] g={g}: {w} vs {exact}");
            }
            for simd in [Simd::Avx2, Simd::Avx512] {
                if simd > Simd::detect() {
                    eprintln!("skipped: this CPU has no {simd:?}");
                    continue;
                }
                let mut got = vec![0.0f32; n];
                geglu(simd, &g, &u, &mut got, round);
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{simd:?} {round:?} differs from the portable path"
                );
            }
        }
    }
}
