//! The SIMD matmul paths (GEMV for decode, packed panels for prefill) against a scalar f64
//! reference, on odd shapes and every weight dtype, for every SIMD level this CPU has.

use spark_backend_cpu::kernels::matmul::{matmul, Mat};
use spark_backend_cpu::Simd;
use spark_core::DType;

/// A weight-matrix case: name, the matrix, and element `i` as f64 for the reference.
type Case<'a> = (&'a str, Mat<'a>, Box<dyn Fn(usize) -> f64 + 'a>);

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// One random weight matrix in the three float dtypes (bf16 and f16 rounded from the f32).
struct Weights {
    w32: Vec<f32>,
    bf: Vec<u16>,
    hf: Vec<u16>,
}

impl Weights {
    fn random(len: usize, seed: &mut u64) -> Self {
        let w32: Vec<f32> = (0..len).map(|_| lcg(seed)).collect();
        let bf = w32.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        let hf = w32.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
        Weights { w32, bf, hf }
    }

    fn cases(&self) -> [Case<'_>; 3] {
        let (w32, bf, hf) = (&self.w32, &self.bf, &self.hf);
        [
            ("f32", Mat::F32(w32), Box::new(|i| w32[i] as f64)),
            ("bf16", Mat::BF16(bf), Box::new(|i| half::bf16::from_bits(bf[i]).to_f64())),
            ("f16", Mat::F16(hf), Box::new(|i| half::f16::from_bits(hf[i]).to_f64())),
        ]
    }
}

/// `x W^T` in f64 for `x` `[n, k]` and weights `[m, k]` read through `wv`.
fn reference(x: &[f32], n: usize, k: usize, m: usize, wv: &dyn Fn(usize) -> f64) -> Vec<f64> {
    (0..n * m).map(|i| (0..k).map(|j| x[(i / m) * k + j] as f64 * wv((i % m) * k + j)).sum()).collect()
}

#[test]
fn matmul_matches_scalar_reference() {
    let mut seed = 7u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for &(n, k, m) in
        &[(1, 37, 5), (2, 130, 17), (3, 64, 33), (4, 8, 16), (5, 129, 31), (13, 77, 48), (97, 256, 19), (200, 40, 70)]
    {
        let x: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
        let ws = Weights::random(m * k, &mut seed);
        for (name, w, wv) in &ws.cases() {
            let want = reference(&x, n, k, m, wv);
            for simd in [Simd::Portable, Simd::Avx2, Simd::Avx512] {
                if simd > Simd::detect() {
                    eprintln!("skipped: this CPU has no {simd:?}");
                    continue;
                }
                let mut out = vec![0.0f32; n * m];
                pool.install(|| matmul(simd, &x, n, k, *w, m, &mut out, DType::F32));
                let err = out.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
                assert!(err < 1e-4, "{name} {simd:?} n={n} k={k} m={m}: max error {err:e}");
            }
        }
    }
}

/// bf16 weights times bf16-valued activations with bf16 output rounding: the case AMX tiles take
/// (two or more tokens, k a multiple of 32; 64-row runs against one token block up to 16 tokens,
/// weights read in place up to 64 tokens, packed and k-blocked by 512 beyond, short row blocks
/// padded), plus shapes that fall back (one token, odd k); without AMX, the AVX512_BF16 GEMV (2-15
/// tokens) and prefill (16 and more).
/// Every level must land within one bf16 ulp of the f64 result rounded to bf16.
#[test]
fn bf16_matmul_with_bf16_activations_matches_reference_at_every_level() {
    let mut seed = 11u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let shapes = [
        (2, 32, 1),
        (2, 64, 17),
        (3, 96, 33),
        (16, 32, 16),
        (17, 128, 31),
        (33, 64, 48),
        (64, 256, 70),
        (5, 2048, 100),
        (40, 160, 65),
        (97, 96, 40),
        (150, 544, 66),
        (12, 96, 130),
        (2, 2048, 64),
        (3, 64, 600),
        (16, 96, 530),
        (1, 64, 33),
        // One token (a row at a time on AVX512_BF16): a whole 32-column step after the 64-column
        // body, masked tails, k under one step.
        (1, 96, 7),
        (1, 71, 9),
        (1, 130, 21),
        (1, 3, 4),
        (7, 70, 19),
        // The AVX512_BF16 prefill: odd k (a lone last column), token tails of 1-16 and 17-31,
        // row tails of its 12-row tiles, several 32-token blocks.
        (20, 71, 45),
        (31, 3, 25),
        (47, 130, 27),
        (16, 1, 13),
        (100, 257, 37),
    ];
    for &(n, k, m) in &shapes {
        let bfv = |v: f32| half::bf16::from_f32(v).to_f32();
        let x: Vec<f32> = (0..n * k).map(|_| bfv(lcg(&mut seed))).collect();
        let w: Vec<u16> = (0..m * k).map(|_| half::bf16::from_f32(lcg(&mut seed)).to_bits()).collect();
        let want: Vec<f64> = (0..n * m)
            .map(|i| {
                let (t, r) = (i / m, i % m);
                (0..k).map(|j| x[t * k + j] as f64 * half::bf16::from_bits(w[r * k + j]).to_f64()).sum()
            })
            .collect();
        for simd in [Simd::Portable, Simd::Avx2, Simd::Avx512, Simd::Amx] {
            if simd > Simd::detect() {
                eprintln!("skipped: this CPU has no {simd:?}");
                continue;
            }
            let mut out = vec![f32::NAN; n * m];
            pool.install(|| matmul(simd, &x, n, k, Mat::BF16(&w), m, &mut out, DType::BF16));
            for (i, (&got, &exact)) in out.iter().zip(&want).enumerate() {
                let rounded = bfv(exact as f32);
                // One bf16 ulp at the exact value's magnitude (8 bits of mantissa), and a floor for
                // sums that cancel to near zero.
                let ulp = (exact.abs() / 128.0).max(1e-3);
                assert!(
                    (got as f64 - rounded as f64).abs() <= ulp,
                    "{simd:?} n={n} k={k} m={m}: out[{i}] = {got}, reference {exact} (bf16 {rounded})"
                );
            }
        }
    }
}

/// Every `out[i]` against the f64 reference `want[i]`: within 1e-4 for f32 output, within one
/// bf16 ulp of the reference rounded to bf16 (a floor of 1e-3 for sums near zero) for bf16.
#[cfg(target_arch = "x86_64")]
fn check_rounded(out: &[f32], want: &[f64], round: DType, what: impl Fn() -> String) {
    for (i, (&got, &exact)) in out.iter().zip(want).enumerate() {
        let (reference, tol) = match round {
            DType::BF16 => (half::bf16::from_f32(exact as f32).to_f64(), (exact.abs() / 128.0).max(1e-3)),
            _ => (exact, 1e-4),
        };
        assert!((got as f64 - reference).abs() <= tol, "{}: out[{i}] = {got}, reference {exact}", what());
    }
}

/// The AVX-512 f32 FMA prefill (Intel cores' prefill) and the `vdpbf16ps` prefill (AMD's, bf16
/// weights, where AVX512_BF16 is present) called directly, so that both are checked on every
/// AVX-512 CPU whichever of them `matmul` picks there: f32, bf16 and f16 weights, f32 output
/// within 1e-4 of the f64 reference and bf16 output within one bf16 ulp;
/// token tails of its 32-token blocks (1-16 and 17-31 left), row tails of its 12-row tiles,
/// columns that are not a multiple of 16 (the transpose's scalar tail) and more than its
/// 256-column chunks.
#[test]
#[cfg(target_arch = "x86_64")]
fn avx512_prefills_match_reference_for_every_weight_dtype() {
    use spark_backend_cpu::kernels::{avx512bf16, prefill_fma512};
    if !is_x86_feature_detected!("avx512f") {
        eprintln!("skipped: this CPU has no AVX-512F");
        return;
    }
    let mut seed = 23u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for &(n, k, m) in
        &[(16, 32, 12), (17, 71, 13), (31, 3, 25), (33, 257, 37), (47, 530, 30), (100, 300, 130), (64, 1, 5)]
    {
        let bfv = |v: f32| half::bf16::from_f32(v).to_f32();
        let x: Vec<f32> = (0..n * k).map(|_| bfv(lcg(&mut seed))).collect();
        let ws = Weights::random(m * k, &mut seed);
        for (name, w, wv) in &ws.cases() {
            let want = reference(&x, n, k, m, wv);
            for (path, round) in [("fma", DType::F32), ("fma", DType::BF16), ("vdpbf16ps", DType::BF16)] {
                let bf16_weights = matches!(w, Mat::BF16(_));
                if path == "vdpbf16ps" && !(bf16_weights && avx512bf16::available()) {
                    continue;
                }
                let mut out = vec![f32::NAN; n * m];
                // SAFETY: AVX-512F is present (checked above), AVX512_BF16 for the vdpbf16ps path.
                pool.install(|| unsafe {
                    match path {
                        "fma" => prefill_fma512::prefill(&x, n, k, *w, m, &mut out, round),
                        _ => {
                            avx512bf16::prefill(&x, n, k, avx512bf16::PrefillWeights::Bf16(&ws.bf), m, &mut out, round)
                        }
                    }
                });
                check_rounded(&out, &want, round, || format!("{path} {name} {round:?} n={n} k={k} m={m}"));
            }
        }
    }
}

/// The AVX-512 kernels for 2-15 tokens on bf16 weights called directly, so that both are
/// checked on every AVX-512 CPU whichever `matmul` picks there: the f32 FMA one (Intel cores')
/// with f32 output within 1e-4 of the f64 reference and bf16 output within one bf16 ulp, and the
/// `vdpbf16ps` one (AMD's, where AVX512_BF16 is present) with bf16 output; token counts across
/// its 8-token passes, row tails of its 2-row tiles, column tails under and past 16.
#[test]
#[cfg(target_arch = "x86_64")]
fn avx512_small_batch_kernels_match_reference() {
    use spark_backend_cpu::kernels::{avx512bf16, batch_fma512};
    if !is_x86_feature_detected!("avx512f") {
        eprintln!("skipped: this CPU has no AVX-512F");
        return;
    }
    let mut seed = 29u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for &(n, k, m) in &[
        (2, 32, 3),
        (3, 71, 5),
        (4, 2048, 6),
        (7, 130, 9),
        (8, 16, 2),
        (9, 300, 7),
        (15, 47, 11),
        (5, 15, 1),
        (12, 1, 4),
    ] {
        let bfv = |v: f32| half::bf16::from_f32(v).to_f32();
        let x: Vec<f32> = (0..n * k).map(|_| bfv(lcg(&mut seed))).collect();
        let w: Vec<u16> = (0..m * k).map(|_| half::bf16::from_f32(lcg(&mut seed)).to_bits()).collect();
        let want: Vec<f64> = (0..n * m)
            .map(|i| {
                let (t, r) = (i / m, i % m);
                (0..k).map(|j| x[t * k + j] as f64 * half::bf16::from_bits(w[r * k + j]).to_f64()).sum()
            })
            .collect();
        for (path, round) in [("fma", DType::F32), ("fma", DType::BF16), ("vdpbf16ps", DType::BF16)] {
            if path == "vdpbf16ps" && !avx512bf16::available() {
                continue;
            }
            let mut out = vec![f32::NAN; n * m];
            // SAFETY: AVX-512F is present (checked above), AVX512_BF16 for the vdpbf16ps path.
            pool.install(|| unsafe {
                match path {
                    "fma" => batch_fma512::matmul(&x, n, k, &w, m, &mut out, round),
                    _ => avx512bf16::matmul(&x, n, k, &w, m, &mut out, round),
                }
            });
            check_rounded(&out, &want, round, || format!("{path} {round:?} n={n} k={k} m={m}"));
        }
    }
}

/// `Row::to_f32` of bf16 rows (AVX-512 where present, with a scalar tail) is the exact bit shift
/// for every length and bit pattern: NaN payloads, infinities, denormals, signed zeros.
#[test]
fn bf16_rows_convert_exactly() {
    use spark_backend_cpu::kernels::Row;
    let special = [0x0000u16, 0x8000, 0x7f80, 0xff80, 0x7fc1, 0xffff, 0x0001, 0x807f, 0x3f80, 0xc2f7];
    for n in 0..70usize {
        let src: Vec<u16> =
            (0..n).map(|i| special[i % special.len()].wrapping_add((i / special.len()) as u16 * 0x111)).collect();
        let mut out = vec![0.0f32; n];
        Row::BF16(&src).to_f32(&mut out);
        for (i, (&b, &o)) in src.iter().zip(&out).enumerate() {
            assert_eq!(o.to_bits(), (b as u32) << 16, "n={n} element {i}: bits {b:#06x}");
        }
    }
}

/// `Row::to_f32` of f16 rows (`vcvtph2ps` 16 at a time where AVX-512 is present, with a scalar
/// tail) gives the exact value of every f16 bit pattern (NaNs stay NaN), at lengths around 16.
#[test]
fn f16_rows_convert_exactly() {
    use spark_backend_cpu::kernels::Row;
    let all: Vec<u16> = (0..=u16::MAX).collect();
    for n in [1usize, 15, 16, 17, 33, all.len()] {
        let src = &all[all.len() - n..];
        let mut out = vec![0.0f32; n];
        Row::F16(src).to_f32(&mut out);
        for (&b, &o) in src.iter().zip(&out) {
            let want = half::f16::from_bits(b).to_f32();
            if want.is_nan() {
                assert!(o.is_nan(), "n={n} bits {b:#06x}: {o}");
            } else {
                assert_eq!(o.to_bits(), want.to_bits(), "n={n} bits {b:#06x}");
            }
        }
    }
}

/// AMX and the AVX512_BF16 prefill write their f32 sums rounded to bf16 to nearest, ties to
/// even, NaN kept: sums exact in f32 in any order (two bf16 terms), placed above, at and below
/// half a bf16 ulp of 1, in every row of a 16-row block and in a row tail, at 1 and 17 tokens
/// (AMX) and 17 and 40 tokens (the prefill's two- and one-vector token blocks).
#[test]
#[cfg(target_arch = "x86_64")]
fn tiles_round_outputs_to_nearest_even_bf16() {
    use spark_backend_cpu::kernels::{amx, avx512bf16, prefill_fma512};
    let bf = |v: f32| half::bf16::from_f32(v).to_bits();
    let k = 32;
    // 1 + a: a = 0.75, 0.5 and 0.25 ulp (ulp of 1 in bf16: 2^-7), and 1.5 ulp + 0.5 ulp (a tie
    // that rounds up to the even 1 + 2 ulp); a NaN row.
    let ulp = 2f32.powi(-7);
    let cases = [(0.75 * ulp, 1.0 + ulp), (0.5 * ulp, 1.0), (0.25 * ulp, 1.0), (1.5 * ulp, 1.0 + 2.0 * ulp)];
    let m = 19;
    let mut w = vec![0u16; m * k];
    let mut want = vec![0.0f32; m];
    for r in 0..m {
        let (a, v) = cases[r % cases.len()];
        w[r * k] = bf(1.0);
        w[r * k + 1] = bf(a);
        want[r] = v;
    }
    w[7 * k + 1] = bf(f32::NAN);
    want[7] = f32::NAN;
    let mut ran = false;
    for (path, tokens) in [("amx", [1usize, 17]), ("avx512bf16 prefill", [17, 40]), ("fma512 prefill", [17, 40])] {
        let present = match path {
            "amx" => amx::available(),
            "avx512bf16 prefill" => avx512bf16::available(),
            _ => is_x86_feature_detected!("avx512f"),
        };
        if !present {
            eprintln!("skipped {path}: this CPU lacks it");
            continue;
        }
        ran = true;
        for n in tokens {
            let mut x = vec![0.0f32; n * k];
            for t in 0..n {
                x[t * k] = 1.0;
                x[t * k + 1] = 1.0;
            }
            let mut out = vec![0.0f32; n * m];
            // SAFETY: the path's available() returned true; k is a multiple of 32.
            unsafe {
                match path {
                    "amx" => amx::matmul(&x, n, k, amx::Weights::Bf16(&w), m, &mut out, DType::BF16),
                    "avx512bf16 prefill" => {
                        avx512bf16::prefill(&x, n, k, avx512bf16::PrefillWeights::Bf16(&w), m, &mut out, DType::BF16)
                    }
                    _ => prefill_fma512::prefill(&x, n, k, Mat::BF16(&w), m, &mut out, DType::BF16),
                }
            };
            for t in 0..n {
                for r in 0..m {
                    let got = out[t * m + r];
                    if want[r].is_nan() {
                        assert!(got.is_nan(), "{path} n={n} [{t},{r}]: {got}");
                    } else {
                        assert_eq!(got, want[r], "{path} n={n} [{t},{r}]");
                    }
                }
            }
        }
    }
    if !ran {
        eprintln!("skipped: this CPU has neither AMX nor AVX512_BF16");
    }
}

/// bf16 decode GEMV throughput across many matrices, as a decode step streams them (not a test:
/// `cargo test --release -p backend-cpu --test kernels bench_bf16_decode_stream -- --ignored
/// --nocapture`): one token, bf16-valued activations rounded to bf16 (the bf16 compute dtype),
/// `QBENCH_THREADS` threads (default 2), enough 2048 x 2048 bf16 matrices (`QBENCH_MB`, default
/// 600) on transparent huge pages that they stream from memory; the best of `QBENCH_PASSES` (7).
#[test]
#[ignore]
fn bench_bf16_decode_stream() {
    let threads = std::env::var("QBENCH_THREADS").map_or(2, |v| v.parse().expect("QBENCH_THREADS"));
    let mb: usize = std::env::var("QBENCH_MB").map_or(600, |v| v.parse().expect("QBENCH_MB"));
    let passes: usize = std::env::var("QBENCH_PASSES").map_or(7, |v| v.parse().expect("QBENCH_PASSES"));
    let (m, k) = (2048usize, 2048usize);
    let bytes = m * k * 2;
    // At least one matrix (QBENCH_MB=0 would time nothing).
    let copies = (mb << 20).div_ceil(bytes).max(1);
    let mut seed = 3u64;
    let mats: Vec<spark_backend_cpu::huge_pages::HugeBytes> = (0..copies)
        .map(|_| {
            let mut b = spark_backend_cpu::huge_pages::HugeBytes::zeroed(bytes);
            for v in b.chunks_exact_mut(2) {
                v.copy_from_slice(&half::bf16::from_f32(lcg(&mut seed) * 0.05).to_bits().to_le_bytes());
            }
            b
        })
        .collect();
    let x: Vec<f32> = (0..k).map(|_| half::bf16::from_f32(lcg(&mut seed)).to_f32()).collect();
    let simd = Simd::detect();
    // QBENCH_ROUND=f32 runs the f32-output path (the float GEMV) instead of the bf16 one.
    let round = if std::env::var("QBENCH_ROUND").is_ok_and(|v| v == "f32") { DType::F32 } else { DType::BF16 };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let mut out = vec![0.0f32; m];
    let mut best = f64::INFINITY;
    pool.install(|| {
        for _ in 0..passes {
            let t = std::time::Instant::now();
            for w in &mats {
                let w: &[u16] = bytemuck::cast_slice(&w[..]);
                matmul(simd, &x, 1, k, Mat::BF16(w), m, &mut out, round);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
    });
    eprintln!(
        "{simd:?}, {round:?} output, {threads} threads, {copies} x {m}x{k} bf16: {:.1} GB/s, {:.1} us per matrix",
        (bytes * copies) as f64 / best * 1e-9,
        best / copies as f64 * 1e6
    );
}
