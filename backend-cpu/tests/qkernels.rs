//! The integer matmul kernels (W8A8 / W4A8) on odd shapes, every format/group/bias combination
//! the loaders produce, every integer SIMD level this CPU has, 1 and 2 threads:
//!
//! - against an f64 reference from `QTensor::dequantize()` and the same quantized activations
//!   (only the float summation order differs: within 1e-5 of the sum of |terms|);
//! - against the float matmul of the dequantized weights with the unquantized activations,
//!   within the bound 8-bit activation quantization implies: each activation is off by at most
//!   half a step, `max|x_block| / 254`, so `|err| <= sum_c |w_c| * max|x_block(c)| / 254`;
//! - the backend: `upload_quant` repacks (the weight reports its format), `matmul` and `embed`
//!   on a quantized table, and the dequantized-float fallback for groups the kernels refuse.

use std::sync::Arc;

use spark_backend_cpu::kernels::matmul::{matmul, quant_panels, Mat, AVX2_QUANT_PANEL_MIN_TOKENS};
use spark_backend_cpu::kernels::qmatmul::{qmatmul, qmatmul_quantized, quant_matmul, I6Layout, QAct, QMat};
use spark_backend_cpu::kernels::QSimd;
use spark_backend_cpu::{CpuBackend, CpuTensor, Simd};
use spark_core::backend::{Backend, WeightRole};
use spark_core::quant::{QFormat, QTensor};
use spark_core::weights::TensorBytes;
use spark_core::DType;

fn lcg(seed: &mut u64) -> u32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (*seed >> 33) as u32
}

fn unit(seed: &mut u64) -> f32 {
    (lcg(seed) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

/// A random quantized matrix: every byte value (int8 -128..=127, both nibbles, every int6
/// value), scales of both
/// signs (GGUF K-quants have signed sub-scales) and some zero, optional biases; with `half`,
/// scales and biases rounded to f16 values (which the kernels then hold as f16: what
/// `spark-run quantize` and GGUF Q8_0 / Q4_0 give), else f32 values that are not f16 ones.
#[allow(clippy::too_many_arguments)]
fn random_q(
    rows: usize,
    cols: usize,
    format: QFormat,
    group: usize,
    bias: bool,
    half: bool,
    seed: &mut u64,
) -> QTensor {
    let q: Vec<u8> = (0..rows * format.row_bytes(cols)).map(|_| lcg(seed) as u8).collect();
    let ng = rows * cols / group;
    let side = |v: f32| if half { half::f16::from_f32(v).to_f32() } else { v };
    let scales: Vec<f32> =
        (0..ng).map(|i| if i % 11 == 5 { 0.0 } else { side(unit(seed) * 0.02 * (1.0 + (i % 3) as f32)) }).collect();
    let bias = bias.then(|| Arc::new((0..ng).map(|_| side(unit(seed) * 0.05)).collect::<Vec<f32>>()));
    let t = QTensor {
        name: "w".into(),
        format,
        rows,
        cols,
        group,
        q: TensorBytes::Owned(Arc::new(q)),
        scales: Arc::new(scales),
        bias,
    };
    t.validate().unwrap();
    t
}

/// `qt` with its scales and biases as a CPU holding f16 sides (`half`) keeps them: rounded to
/// the nearest f16 when they fit one ([`QTensor::sides_fit_f16`]), else as they are.
fn as_held(qt: &QTensor, half: bool) -> QTensor {
    if !(half && qt.sides_fit_f16()) {
        return qt.clone();
    }
    let round = |v: &Arc<Vec<f32>>| Arc::new(v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect::<Vec<_>>());
    QTensor { scales: round(&qt.scales), bias: qt.bias.as_ref().map(round), ..qt.clone() }
}

/// Activations with a few large columns (outliers) and an all-zero block in token 1.
fn random_x(n: usize, k: usize, seed: &mut u64) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n * k).map(|i| unit(seed) * if (i % k) % 29 == 3 { 8.0 } else { 1.0 }).collect();
    if n > 1 && k >= 64 {
        x[k + 32..k + 64].fill(0.0);
    }
    x
}

/// Every (format, group, bias, f16 sides) the loaders produce, plus half-block groups (48,
/// int4 16).
fn combos(cols: usize) -> Vec<(QFormat, usize, bool, bool, &'static str)> {
    let all = [
        (QFormat::I8, cols, false, false, "int8 per-row"),
        (QFormat::I8, 32, false, false, "int8 g32 f32"),
        (QFormat::I8, 32, false, true, "int8 g32 f16 (Q8_0)"),
        (QFormat::I8, 16, false, false, "int8 g16 f32"),
        (QFormat::I8, 16, false, true, "int8 g16 f16 (Q6_K)"),
        (QFormat::I8, 32, true, false, "int8 g32+bias (Q5_K)"),
        (QFormat::I8, 48, false, true, "int8 g48 f16"),
        (QFormat::I4, 32, false, true, "int4 g32 f16 (Q4_0)"),
        (QFormat::I4, 64, false, false, "int4 g64"),
        (QFormat::I4, 64, true, true, "int4 g64+bias f16"),
        (QFormat::I4, 128, false, false, "int4 g128"),
        (QFormat::I4, 32, true, false, "int4 g32+bias f32 (Q4_K)"),
        (QFormat::I4, 32, true, true, "int4 g32+bias f16 (ours)"),
        (QFormat::I4, 16, false, false, "int4 g16"),
        (QFormat::I4, 16, true, true, "int4 g16+bias f16"),
        (QFormat::I6, 32, false, true, "int6 g32 f16 (ours)"),
        (QFormat::I6, 32, false, false, "int6 g32 f32"),
        (QFormat::I6, 16, false, false, "int6 g16 f32"),
        (QFormat::I6, 16, false, true, "int6 g16 f16"),
        (QFormat::I6, 64, false, true, "int6 g64 f16"),
        (QFormat::I6, 48, false, false, "int6 g48"),
        (QFormat::I6, cols, false, false, "int6 per-row"),
    ];
    all.into_iter().filter(|&(f, g, _, _, _)| cols.is_multiple_of(g) && cols.is_multiple_of(f.col_multiple())).collect()
}

/// The int6 layouts for `format` (every level reads both, whichever this CPU would build); one
/// for the other formats, which ignore it.
fn layouts(format: QFormat) -> &'static [I6Layout] {
    if format == QFormat::I6 {
        &[I6Layout::Split, I6Layout::Groups]
    } else {
        &[I6Layout::Split]
    }
}

/// The integer levels this CPU has (the others are skipped, said once per test binary).
fn levels() -> Vec<QSimd> {
    static SAID: std::sync::Once = std::sync::Once::new();
    let all = [QSimd::Portable, QSimd::Avx2, QSimd::Avx512Vnni, QSimd::AmxInt8];
    SAID.call_once(|| {
        for q in all.iter().filter(|&&q| q > QSimd::detect()) {
            eprintln!("skipped: this CPU has no {q:?} (or SPARK_CPU_SIMD caps it)");
        }
    });
    all.into_iter().filter(|&q| q <= QSimd::detect()).collect()
}

/// The f64 reference of `[rows, cols]` dequantized weights times the dequantized int8
/// activations, `[n][rows]`, with the sum of |terms| of each output (the error scale).
fn f64_reference(deq: &[f32], act: &QAct, rows: usize, cols: usize) -> (Vec<f64>, Vec<f64>) {
    f64_reference_by(deq, act.n, rows, cols, |t, c| act.value(t, c) as f64)
}

/// [`f64_reference`] on activations `value(t, c)`.
fn f64_reference_by(
    deq: &[f32],
    n: usize,
    rows: usize,
    cols: usize,
    value: impl Fn(usize, usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut want = vec![0.0f64; n * rows];
    let mut mag = vec![0.0f64; n * rows];
    for t in 0..n {
        for r in 0..rows {
            for c in 0..cols {
                let term = deq[r * cols + c] as f64 * value(t, c);
                want[t * rows + r] += term;
                mag[t * rows + r] += term.abs();
            }
        }
    }
    (want, mag)
}

/// Every output within 1e-5 of its sum of |terms| of the f64 reference (only the float
/// summation order differs); `what` names the case in the failure.
fn assert_matches_reference(out: &[f32], want: &[f64], mag: &[f64], what: impl Fn() -> String) {
    for i in 0..out.len() {
        let err = (out[i] as f64 - want[i]).abs();
        assert!(
            err <= 1e-5 * mag[i] + 1e-30,
            "{}: out[{i}] = {} want {} (sum|terms| {})",
            what(),
            out[i],
            want[i],
            mag[i]
        );
    }
}

#[test]
fn integer_kernels_match_f64_reference_on_the_same_quantized_activations() {
    let mut seed = 11u64;
    let pools: Vec<_> =
        [1, 2].iter().map(|&t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap()).collect();
    let mut modes = std::collections::BTreeSet::new();
    for &(cols, rows) in &[(32, 37), (96, 37), (128, 21), (160, 37), (256, 301), (2080, 19), (2176, 7), (8448, 5)] {
        for (format, group, bias, half, what) in combos(cols) {
            let qt = random_q(rows, cols, format, group, bias, half, &mut seed);
            let deq = qt.dequantize();
            // f32 or f16 sides as the combo says, at every level (whichever this CPU would
            // choose by itself).
            for &layout in layouts(format) {
                let w = QMat::with_layout(&qt, half, layout);
                assert_eq!(w.half_sides(), half && group < cols, "{what}: f16 sides");
                modes.insert(format!("{:?}{}", w.mode, if w.half_sides() { " f16" } else { "" }));
                for &n in &[1usize, 2, 3, 5, 17, 26, 33] {
                    let x = random_x(n, cols, &mut seed);
                    let act = QAct::quantize(&x, n, cols, &w);
                    let (want, mag) = f64_reference(&deq, &act, rows, cols);
                    for qs in levels() {
                        for pool in &pools {
                            let mut out = vec![f32::NAN; n * rows];
                            pool.install(|| qmatmul_quantized(qs, &act, &w, &mut out, DType::F32));
                            let threads = pool.current_num_threads();
                            assert_matches_reference(&out, &want, &mag, || {
                                format!("{what} {qs:?} {threads} threads n={n} cols={cols} rows={rows}")
                            });
                        }
                    }
                }
            }
        }
    }
    // Every scale layout the kernels specialize on ran (group 32 comes as Pair and as Block,
    // group 16 as Quad and as Half),
    // with f32 and (but per-row) f16 scales.
    for mode in
        ["Row", "Chunk", "Block", "Pair", "Half", "Quad", "Chunk f16", "Block f16", "Pair f16", "Half f16", "Quad f16"]
    {
        assert!(modes.contains(mode), "no shape exercised ScaleMode::{mode} (saw {modes:?})");
    }
}

/// The VNNI prefill (weights in 16-row panels, tokens broadcast) against the f64 reference on
/// the same quantized activations: int8, int6 (both layouts) and int4, scales per row or per
/// 32 / 64 / 128 columns (f32 and f16), with and without biases, odd row counts (partial
/// panels and bands), token counts that leave partial tiles, columns with padding, one and two
/// threads; bf16 output as the f32 output rounded; a non-finite activation gives NaN in its
/// token's outputs only.
#[test]
#[cfg(target_arch = "x86_64")]
fn vnni_prefill_matches_f64_reference_on_the_same_quantized_activations() {
    use spark_backend_cpu::kernels::qprefill_vnni;
    if QSimd::detect() < QSimd::Avx512Vnni {
        eprintln!("skipped: this CPU has no AVX-512 VNNI");
        return;
    }
    let mut seed = 43u64;
    let pools: Vec<_> =
        [1, 2].iter().map(|&t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap()).collect();
    let mut ran = 0;
    for &(cols, rows) in &[(32, 37), (160, 70), (2080, 19), (256, 301), (1088, 160)] {
        for (format, group, bias, half, what) in combos(cols) {
            let qt = random_q(rows, cols, format, group, bias, half, &mut seed);
            let deq = qt.dequantize();
            for &layout in layouts(format) {
                let w = QMat::with_layout(&qt, half, layout);
                if !qprefill_vnni::takes(QSimd::Avx512Vnni, &w, qprefill_vnni::MIN_TOKENS) {
                    let vbmi = std::arch::is_x86_feature_detected!("avx512vbmi");
                    assert!(group % 32 != 0 || (layout == I6Layout::Groups && !vbmi), "{what}: not taken");
                    continue;
                }
                for &n in &[12usize, 32, 33, 47, 70] {
                    let x = random_x(n, cols, &mut seed);
                    let act = QAct::quantize(&x, n, cols, &w);
                    let (want, mag) = f64_reference(&deq, &act, rows, cols);
                    for pool in &pools {
                        let threads = pool.current_num_threads();
                        let mut out = vec![f32::NAN; n * rows];
                        pool.install(|| qprefill_vnni::matmul(&x, n, cols, &w, &mut out, DType::F32));
                        assert_matches_reference(&out, &want, &mag, || {
                            format!("{what} {threads} threads n={n} cols={cols} rows={rows}")
                        });
                        let mut bf = vec![f32::NAN; n * rows];
                        pool.install(|| qprefill_vnni::matmul(&x, n, cols, &w, &mut bf, DType::BF16));
                        for (i, (&b, &o)) in bf.iter().zip(&out).enumerate() {
                            assert_eq!(b.to_bits(), spark_core::dtype::round_bf16(o).to_bits(), "{what} bf16 out[{i}]");
                        }
                        ran += 1;
                    }
                }
            }
        }
    }
    assert!(ran >= 5 * 10 * 5 * 2, "too few cases ran: {ran}");
    // A non-finite activation makes its token's outputs NaN (the block's scale carries it), and
    // only that token's.
    for (format, group, bias) in [(QFormat::I8, 160, false), (QFormat::I4, 32, true)] {
        let qt = random_q(70, 160, format, group, bias, true, &mut seed);
        let w = QMat::with_sides(&qt, true);
        let mut x = random_x(20, 160, &mut seed);
        x[5 * 160 + 40] = f32::NAN;
        x[9 * 160 + 100] = f32::INFINITY;
        let mut out = vec![0.0f32; 20 * 70];
        qprefill_vnni::matmul(&x, 20, 160, &w, &mut out, DType::BF16);
        for (t, row) in out.chunks(70).enumerate() {
            if t == 5 || t == 9 {
                assert!(row.iter().all(|v| v.is_nan()), "{format}: token {t} must be NaN: {row:?}");
            } else {
                assert!(row.iter().all(|v| v.is_finite()), "{format}: token {t} must be finite");
            }
        }
    }
}

/// Int4 in groups of 32 as `spark-run quantize` writes it (steps `k * u` per super-block) gets
/// integer sub-scales, and at the AVX2 level its activations share one scale per super-block
/// and the super-block kernel sums each super-block in integers, as for int8 with per-row
/// scales: against the f64 reference on the same activations at every level, odd shapes (a
/// partial last super-block), f32 and f16 sides. Scales without that form get no sub-scales.
#[test]
fn avx2_sub_scale_kernel_matches_f64_reference() {
    use spark_core::quant::{quantize, QuantSpec};
    let mut seed = 31u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for &(cols, rows) in &[(64usize, 3usize), (256, 37), (768, 5), (2112, 7)] {
        // Rows of different spreads, groups of different ranges.
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| unit(&mut seed) * 0.02 * (1.0 + (i / 32 % 5) as f32) * (1.0 + (i / cols) as f32))
            .collect();
        let int4 = quantize("w", rows, cols, &vals, QuantSpec::new(QFormat::I4, Some(32))).unwrap();
        // Int8 per row (every byte value, -128 included) sums super-blocks without sub-scales.
        let int8 = random_q(rows, cols, QFormat::I8, cols, false, false, &mut seed);
        for (qt, half) in [(&int4, false), (&int4, true), (&int8, false)] {
            let deq = qt.dequantize();
            let w = QMat::with_sides(qt, half).with_sub_scales();
            assert!(w.sums_super_blocks());
            if qt.format == QFormat::I4 {
                let sub = w.sub_scales().expect("quantize's int4 g32 has super-block steps");
                for r in 0..rows {
                    for g in 0..cols / 32 {
                        let (k, u) = (sub.k[r * (cols / 32) + g] as f32, sub.unit[r * (cols / 32).div_ceil(8) + g / 8]);
                        assert_eq!(k * u, qt.scales[r * (cols / 32) + g], "row {r} group {g}");
                    }
                }
            }
            for &n in &[1usize, 2, 3, 4, 7, 17] {
                let x = random_x(n, cols, &mut seed);
                let act = QAct::quantize_for(QSimd::Avx2, &x, n, cols, &w);
                if QSimd::detect() >= QSimd::Avx2 {
                    // One token keeps per-block scales (SUB_SCALE_MIN_TOKENS).
                    assert_eq!(act.span, if n >= 2 { 8 } else { 1 }, "super-block activation scales at the AVX2 level");
                    for t in 0..n {
                        let d = act.d_row(t);
                        assert!(
                            n == 1 || d.chunks(8).all(|sb| sb.iter().all(|&v| v == sb[0])),
                            "one scale per super-block"
                        );
                    }
                }
                let (want, mag) = f64_reference(&deq, &act, rows, cols);
                for qs in levels() {
                    let mut out = vec![f32::NAN; n * rows];
                    pool.install(|| qmatmul_quantized(qs, &act, &w, &mut out, DType::F32));
                    assert_matches_reference(&out, &want, &mag, || {
                        format!("{} {qs:?} half {half} n={n} cols={cols} rows={rows}", qt.format)
                    });
                }
                // One token: the per-block kernel takes its scales from the sub-scales (`k * u`,
                // the same f32 values), so the outputs are those of the scales, bit for bit.
                if n == 1 && QSimd::detect() >= QSimd::Avx2 && qt.format == QFormat::I4 {
                    let plain = QMat::with_sides(qt, half);
                    assert!(plain.sub_scales().is_none());
                    let (mut a, mut b) = (vec![0.0f32; rows], vec![0.0f32; rows]);
                    pool.install(|| qmatmul_quantized(QSimd::Avx2, &act, &w, &mut a, DType::F32));
                    pool.install(|| qmatmul_quantized(QSimd::Avx2, &act, &plain, &mut b, DType::F32));
                    assert_eq!(a, b, "sub-scales vs scales, half {half} cols={cols} rows={rows}");
                }
                // The public entry quantizes the same way at the AVX2 level (except for what
                // it sends to the 16-bit-activation decode GEMV: int8 per row up to 4 tokens,
                // `int8_decode_on_16_bit_activations_matches_f64_reference`).
                #[cfg(target_arch = "x86_64")]
                let w16 = spark_backend_cpu::kernels::qdecode16::takes(QSimd::Avx2, &w, n);
                #[cfg(not(target_arch = "x86_64"))]
                let w16 = false;
                if QSimd::detect() >= QSimd::Avx2 && !w16 {
                    let (mut a, mut b) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
                    pool.install(|| qmatmul(QSimd::Avx2, &x, n, cols, &w, &mut a, DType::F32));
                    pool.install(|| qmatmul_quantized(QSimd::Avx2, &act, &w, &mut b, DType::F32));
                    assert_eq!(a, b, "qmatmul at AVX2 uses super-block activations");
                }
            }
        }
    }
    // Free-form scales (random, some negative) have no such form.
    let qt = random_q(9, 256, QFormat::I4, 32, true, true, &mut seed);
    assert!(QMat::with_sides(&qt, true).with_sub_scales().sub_scales().is_none());
}

/// The AVX2 level's holding of int4 ([`QMat::for_level`]): `spark-run quantize`'s int4 gets
/// sub-scales and f16 scales and biases (the kernels read `k`, units and biases only), with
/// outputs bit for bit those of f32 sides on every path (1 token, the super-block kernel, the
/// integer panels); free-form scales keep f32 sides and no sub-scales.
#[test]
fn avx2_level_holds_sub_scaled_int4_with_f16_sides() {
    use spark_core::quant::{quantize, QuantSpec};
    let mut seed = 77u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let (rows, cols) = (37usize, 2112usize);
    let vals: Vec<f32> = (0..rows * cols).map(|i| unit(&mut seed) * 0.03 * (1.0 + (i / 64 % 3) as f32)).collect();
    let qt = quantize("w", rows, cols, &vals, QuantSpec::new(QFormat::I4, Some(32))).unwrap();
    assert!(QMat::has_sub_scale_form(&qt));
    let held = QMat::for_level(&qt, QSimd::Avx2);
    assert!(held.sub_scales().is_some() && held.half_sides(), "sub-scales and f16 sides");
    // Scales k * u, f32 biases: the reference holding.
    let f32_sides = QMat::with_sides(&qt, false).with_sub_scales();
    assert!(f32_sides.sub_scales().is_some() && !f32_sides.half_sides());
    // Values, k, a unit per (partial) super-block, f16 biases; 6 bits per weight with f32 sides.
    let ng = cols / 32;
    assert_eq!(held.decode_bytes(), rows * (cols / 2 + ng + 4 * ng.div_ceil(8) + 2 * ng));
    assert_eq!(QMat::with_sides(&qt, false).decode_bytes(), rows * cols * 6 / 8);
    if QSimd::detect() >= QSimd::Avx2 {
        for n in [1usize, 2, 5, 33] {
            let x = random_x(n, cols, &mut seed);
            let (mut a, mut b) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
            pool.install(|| quant_matmul(Simd::Avx2, &x, n, cols, &held, &mut a, DType::F32));
            pool.install(|| quant_matmul(Simd::Avx2, &x, n, cols, &f32_sides, &mut b, DType::F32));
            assert_eq!(a, b, "f16 vs f32 sides, n={n}");
            assert!(a.iter().all(|v| v.is_finite()));
        }
    }
    // Biases that are not f16 values (as GGUF Q4_K's `-dmin * m`): sub-scales, f32 sides kept
    // (5.375 bits read per weight).
    let bias = qt.bias.as_ref().expect("int4 g32 has biases");
    let q4k =
        QTensor { bias: Some(Arc::new(bias.iter().map(|&b| b * (1.0 + 2f32.powi(-22))).collect())), ..qt.clone() };
    let m = QMat::for_level(&q4k, QSimd::Avx2);
    assert!(m.sub_scales().is_some() && !m.half_sides(), "inexact sides stay f32");
    assert_eq!(m.decode_bytes(), rows * (cols / 2 + ng + 4 * ng.div_ceil(8) + 4 * ng));
    // Free-form scales (random, some negative): no sub-scales, f32 sides at the AVX2 level.
    let free = random_q(9, 256, QFormat::I4, 32, true, true, &mut seed);
    assert!(!QMat::has_sub_scale_form(&free));
    let m = QMat::for_level(&free, QSimd::Avx2);
    assert!(m.sub_scales().is_none() && !m.half_sides());
    // int8 never gets sub-scales.
    let int8 = random_q(5, 128, QFormat::I8, 32, false, true, &mut seed);
    assert!(!QMat::has_sub_scale_form(&int8) && QMat::for_level(&int8, QSimd::Avx2).sub_scales().is_none());
}

/// The VNNI and AMX INT8 levels hold `spark-run quantize`'s int4 sides on grids (a byte per
/// group for the scale and for the bias, a byte per super-block for each unit): every token
/// count matches the f64 reference at every level, as the same matrix with f16 sides does, and
/// 4.5625 bits are read per weight instead of 5. The AMX INT8 tiles read the same values as
/// from f16 sides, so their outputs are those bits exactly. Sides off the grid (old
/// checkpoints' biases, GGUF Q4_K) and partial super-blocks keep f16 / f32.
#[test]
fn vnni_level_holds_int4_sides_on_grids() {
    use spark_core::quant::{quantize, QuantSpec};
    let mut seed = 91u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    // 39 rows: tiles of 4 rows and single-row tails; 768 columns: three super-blocks.
    let (rows, cols) = (39usize, 768usize);
    let vals: Vec<f32> =
        (0..rows * cols).map(|i| unit(&mut seed) * 0.03 * (1.0 + (i / 96 % 5) as f32) + 0.01).collect();
    let qt = quantize("w", rows, cols, &vals, QuantSpec::new(QFormat::I4, Some(32))).unwrap();
    assert!(QMat::has_grid_form(&qt));
    let grid = QMat::for_level(&qt, QSimd::Avx512Vnni);
    let (sg, bg) = (grid.scales().grid().expect("scale grid"), grid.bias().and_then(|b| b.grid()).expect("bias grid"));
    assert!(!sg.signed && bg.signed);
    assert!(bg.k.iter().any(|&k| (k as i8) < 0) && bg.k.iter().any(|&k| (k as i8) > 0), "biases of both signs");
    let ng = cols / 32;
    assert_eq!(grid.decode_bytes(), rows * (cols / 2 + 2 * ng + 2 * ng / 8));
    let half = QMat::with_sides(&qt, true);
    assert!(half.half_sides() && half.scales().grid().is_none());
    assert_eq!(half.decode_bytes(), rows * (cols / 2 + 4 * ng));
    // The same values: every scale and bias (a bias of -0 comes back as +0).
    for i in 0..rows * ng {
        assert_eq!(grid.scales().get(i), qt.scales[i], "scale {i}");
        assert_eq!(grid.bias().unwrap().get(i), qt.bias.as_ref().unwrap()[i], "bias {i}");
    }
    // In runs that start and end inside super-blocks and rows, and the rows dequantized.
    for (side, want) in [(grid.scales(), &qt.scales), (grid.bias().unwrap(), qt.bias.as_ref().unwrap())] {
        let mut at = 0;
        for len in [5usize, 13, 1, 40, 7].iter().cycle() {
            let len = (*len).min(rows * ng - at);
            let mut got = vec![0.0f32; len];
            side.get_into(at, &mut got);
            assert_eq!(got, want[at..at + len], "get_into({at}, {len})");
            at += len;
            if at == rows * ng {
                break;
            }
        }
    }
    let (mut dg, mut dh) = (vec![0.0f32; cols], vec![0.0f32; cols]);
    for r in 0..rows {
        grid.dequant_f32(r, 0, &mut dg);
        half.dequant_f32(r, 0, &mut dh);
        assert_eq!(dg, dh, "row {r} dequantized");
    }
    for n in [1usize, 2, 3, 4, 5, 7, 16, 33] {
        let x = random_x(n, cols, &mut seed);
        let act = QAct::quantize(&x, n, cols, &half);
        let deq = qt.dequantize();
        let (want, mag) = f64_reference(&deq, &act, rows, cols);
        for qs in levels() {
            let (mut a, mut b) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
            pool.install(|| qmatmul(qs, &x, n, cols, &grid, &mut a, DType::F32));
            assert_matches_reference(&a, &want, &mag, || format!("grid sides at {qs:?}, n={n}"));
            if qs == QSimd::Avx512Vnni {
                // The grid tiles add the bias and zero-point term per super-block, in f32, where
                // the f16-side tiles take the zero point off in integers: not the same bits,
                // both within the reference's tolerance.
                pool.install(|| qmatmul(qs, &x, n, cols, &half, &mut b, DType::F32));
                assert_matches_reference(&b, &want, &mag, || format!("f16 sides at {qs:?}, n={n}"));
            }
            if qs == QSimd::AmxInt8 && n >= 3 {
                // AMX INT8 tiles (3+ tokens, whole 16-row blocks; the 7 tail rows take the VNNI
                // tiles): the grid values read 16 lanes at a time, in the f16 sides' arithmetic.
                pool.install(|| qmatmul(qs, &x, n, cols, &half, &mut b, DType::F32));
                for (t, (ra, rb)) in a.chunks(rows).zip(b.chunks(rows)).enumerate() {
                    for r in 0..rows / 16 * 16 {
                        assert_eq!(ra[r].to_bits(), rb[r].to_bits(), "AMX INT8 grid vs f16 sides, n={n} t={t} r={r}");
                    }
                }
            }
        }
    }
    if QSimd::detect() < QSimd::Avx512Vnni {
        eprintln!("skipped: the VNNI grid kernel (this CPU has no AVX-512 VNNI); grids checked on the other levels");
    }
    // Biases off the grid (a checkpoint quantized before the bias grid): f16 sides.
    let mut old = qt.clone();
    let mut b = old.bias.as_ref().unwrap().to_vec();
    b[5] += b[5].abs().max(1e-3) * 2f32.powi(-6);
    b[5] = half::f16::from_f32(b[5]).to_f32();
    old.bias = Some(Arc::new(b));
    let m = QMat::for_level(&old, QSimd::Avx512Vnni);
    assert!(m.scales().grid().is_none() && m.half_sides(), "an off-grid bias keeps f16 sides");
    assert!(!QMat::has_grid_form(&old));
    // A partial last super-block (cols not a multiple of 256): f16 sides.
    let qp = quantize("w", 5, 320, &vals[..5 * 320], QuantSpec::new(QFormat::I4, Some(32))).unwrap();
    assert!(QMat::for_level(&qp, QSimd::Avx512Vnni).scales().grid().is_none());
    // The portable and AVX2 levels never build grids; AMX INT8 does, as VNNI.
    for qs in [QSimd::Portable, QSimd::Avx2] {
        assert!(QMat::for_level(&qt, qs).scales().grid().is_none(), "{qs:?}");
    }
    assert!(QMat::for_level(&qt, QSimd::AmxInt8).scales().grid().is_some());
}

/// The AVX2 int4 prefill on panels ([`qprefill_avx2`]): int4 in groups of 32 with super-block
/// steps (what `spark-run quantize` writes), with and without biases, f32 and f16 sides; row
/// counts that leave a partial panel, partial last super-blocks, token counts that
/// leave a partial micro-kernel tile: against the f64 reference on the same activations (one
/// scale per super-block), and `quant_matmul` takes this path at the AVX2 level.
#[test]
#[cfg(target_arch = "x86_64")]
fn avx2_quantized_prefill_panels_match_f64_reference() {
    use spark_backend_cpu::kernels::qprefill_avx2;
    use spark_core::quant::{quantize, QuantSpec};
    if QSimd::detect() < QSimd::Avx2 {
        eprintln!("skipped: this CPU has no AVX2 (or SPARK_CPU_SIMD caps it)");
        return;
    }
    let mut seed = 41u64;
    let pools: Vec<_> =
        [1, 2].iter().map(|&t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap()).collect();
    for &(cols, rows) in &[(64usize, 5usize), (256, 37), (768, 16), (2112, 21)] {
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| unit(&mut seed) * 0.02 * (1.0 + (i / 32 % 5) as f32) * (1.0 + (i / cols) as f32))
            .collect();
        let biased = quantize("w", rows, cols, &vals, QuantSpec::new(QFormat::I4, Some(32))).unwrap();
        let plain = QTensor { bias: None, ..biased.clone() };
        // GGUF Q4_K's form: per super-block an f16 `d` times 6-bit sub-scales (some zero).
        let ng = cols / 32;
        let q4k_scales: Vec<f32> = (0..rows * ng)
            .map(|g| {
                let sb = (g / ng * ng.div_ceil(8) + g % ng / 8) as u64;
                let d = half::f16::from_f32(0.001 + 0.01 * unit(&mut (99 + sb)).abs()).to_f32();
                d * (lcg(&mut seed) % 64) as f32
            })
            .collect();
        let q4k = QTensor { scales: Arc::new(q4k_scales), ..biased.clone() };
        for (qt, half) in [(&biased, false), (&biased, true), (&plain, true), (&q4k, false)] {
            let deq = qt.dequantize();
            let w = QMat::with_sides(qt, half).with_sub_scales();
            assert!(w.sub_scales().is_some(), "sub-scales found (half {half}, bias {})", qt.bias.is_some());
            for &n in &[32usize, 33, 38, 67] {
                assert!(qprefill_avx2::takes(QSimd::Avx2, &w, n));
                let x = random_x(n, cols, &mut seed);
                let act = QAct::quantize_for(QSimd::Avx2, &x, n, cols, &w);
                assert_eq!(act.span, 8, "one activation scale per super-block");
                let (want, mag) = f64_reference(&deq, &act, rows, cols);
                for pool in &pools {
                    let mut out = vec![f32::NAN; n * rows];
                    pool.install(|| qprefill_avx2::matmul(&x, n, cols, &w, &mut out, DType::F32));
                    let threads = pool.current_num_threads();
                    let bias = qt.bias.is_some();
                    assert_matches_reference(&out, &want, &mag, || {
                        format!("{} bias {bias} half {half} {threads} threads n={n} cols={cols} rows={rows}", qt.format)
                    });
                    let mut via = vec![f32::NAN; n * rows];
                    pool.install(|| quant_matmul(Simd::Avx2, &x, n, cols, &w, &mut via, DType::F32));
                    assert_eq!(out, via, "quant_matmul at the AVX2 level takes the int4 prefill");
                }
            }
        }
    }
}

/// The AVX2 integer prefill panels for float scales (`qpanels16_avx2` for int8, `qpanels_avx2`
/// for the rest, which `qprefill_avx2::matmul` takes for every matrix without int4 sub-scales):
/// every format and group the loaders produce (int8 per row and in groups, int6 in 16s, 32s,
/// 48s, 64s and per row, int4 free-form with and without biases), f32 and f16 sides, every byte
/// value, rows that leave a partial panel, columns that leave a partial activation span, token
/// counts that leave a partial micro-kernel tile: against the f64 reference on the same
/// activations (int8 weights: 16-bit with one scale per 256 columns, [`act16`]; the others: int8
/// with one scale per 32-block), on one and two threads, and `quant_matmul` takes this path at
/// the AVX2 level.
#[test]
#[cfg(target_arch = "x86_64")]
fn avx2_float_scale_prefill_panels_match_f64_reference() {
    use spark_backend_cpu::kernels::qprefill_avx2;
    if QSimd::detect() < QSimd::Avx2 {
        eprintln!("skipped: this CPU has no AVX2 (or SPARK_CPU_SIMD caps it)");
        return;
    }
    let mut seed = 43u64;
    let pools: Vec<_> =
        [1, 2].iter().map(|&t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap()).collect();
    for &(cols, rows) in &[(192usize, 13usize), (2112, 9), (576, 21)] {
        for (format, group, bias, half, what) in combos(cols) {
            let qt = as_held(&random_q(rows, cols, format, group, bias, half, &mut seed), half);
            for &layout in layouts(format) {
                let w = QMat::with_layout(&qt, half, layout).with_sub_scales();
                if w.sub_scales().is_some() {
                    continue;
                }
                let deq = qt.dequantize();
                for &n in &[32usize, 39] {
                    assert!(qprefill_avx2::takes(QSimd::Avx2, &w, n));
                    let x = random_x(n, cols, &mut seed);
                    let (want, mag) = if format == QFormat::I8 {
                        let v = act16(&x, n, cols);
                        f64_reference_by(&deq, n, rows, cols, |t, c| v[t * cols + c])
                    } else {
                        f64_reference(&deq, &QAct::quantize(&x, n, cols, &w), rows, cols)
                    };
                    for pool in &pools {
                        let mut out = vec![f32::NAN; n * rows];
                        pool.install(|| qprefill_avx2::matmul(&x, n, cols, &w, &mut out, DType::F32));
                        let threads = pool.current_num_threads();
                        assert_matches_reference(&out, &want, &mag, || {
                            format!("{what} bias {bias} half {half} {threads} threads n={n} cols={cols} rows={rows}")
                        });
                        let mut via = vec![f32::NAN; n * rows];
                        pool.install(|| quant_matmul(Simd::Avx2, &x, n, cols, &w, &mut via, DType::F32));
                        assert_eq!(out, via, "{what}: quant_matmul at the AVX2 level takes the prefill panels");
                    }
                }
            }
        }
    }
}

/// The int8 prefill panels' activations, as `qpanels16_avx2` documents them: per token and
/// span of 256 columns, `q = round_half_even(x * (32767 / max |x|))` in f32, worth `q * (max |x|
/// / 32767)`.
#[cfg(target_arch = "x86_64")]
fn act16(x: &[f32], n: usize, k: usize) -> Vec<f64> {
    use spark_backend_cpu::kernels::qpanels16_avx2::SPAN;
    let mut v = vec![0.0f64; n * k];
    for t in 0..n {
        for c0 in (0..k).step_by(SPAN) {
            let span = &x[t * k + c0..t * k + (c0 + SPAN).min(k)];
            let amax = span.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if amax == 0.0 {
                continue;
            }
            let (inv, d) = (32767.0 / amax, amax / 32767.0);
            for (i, &xv) in span.iter().enumerate() {
                v[t * k + c0 + i] = (xv * inv).round_ties_even() as f64 * d as f64;
            }
        }
    }
    v
}

/// The decode GEMV on 16-bit activations (`qdecode16`: int8 per row, 1-4 tokens) at the AVX2,
/// VNNI and AMX INT8 levels this CPU has: against the f64 reference on the same 16-bit activations
/// ([`act16`]) on odd shapes (a partial activation span, partial row tiles, column padding), f32
/// and f16 row scales, 1 and 2 threads; `qmatmul` takes it at those levels for those steps and
/// not for 5 tokens (which stay on int8 activations: their reference is the W8A8 one).
#[test]
#[cfg(target_arch = "x86_64")]
fn int8_decode_on_16_bit_activations_matches_f64_reference() {
    use spark_backend_cpu::kernels::qdecode16::{self, MAX_TOKENS};
    let mut seed = 53u64;
    let pools: Vec<_> =
        [1, 2].iter().map(|&t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap()).collect();
    let levels: Vec<QSimd> =
        levels().into_iter().filter(|&q| matches!(q, QSimd::Avx2 | QSimd::Avx512Vnni | QSimd::AmxInt8)).collect();
    for &qs in &levels {
        for &(rows, cols) in &[(5usize, 64usize), (37, 320), (21, 2112), (64, 2048), (6, 112), (3, 256)] {
            for half in [false, true] {
                let qt = as_held(&random_q(rows, cols, QFormat::I8, cols, false, half, &mut seed), half);
                let w = QMat::for_level(&qt, qs);
                let deq = qt.dequantize();
                for n in 1..=MAX_TOKENS + 1 {
                    let x = random_x(n, cols, &mut seed);
                    let takes = qdecode16::takes(qs, &w, n);
                    assert_eq!(takes, n <= MAX_TOKENS, "{qs:?} n = {n}");
                    let a = act16(&x, n, cols);
                    let (want, mag) = f64_reference_by(&deq, n, rows, cols, |t, c| a[t * cols + c]);
                    for pool in &pools {
                        let mut out = vec![f32::NAN; n * rows];
                        pool.install(|| qmatmul(qs, &x, n, cols, &w, &mut out, DType::F32));
                        let threads = pool.current_num_threads();
                        let what = || format!("{qs:?} half {half} {threads} threads n={n} rows={rows} cols={cols}");
                        if !takes {
                            let act = QAct::quantize_for(qs, &x, n, cols, &w);
                            let (want8, mag8) = f64_reference(&deq, &act, rows, cols);
                            assert_matches_reference(&out, &want8, &mag8, what);
                            continue;
                        }
                        assert_matches_reference(&out, &want, &mag, what);
                        let mut direct = vec![f32::NAN; n * rows];
                        pool.install(|| qdecode16::matmul(qs, &x, n, cols, &w, &mut direct, DType::F32));
                        assert_eq!(out, direct, "{}: qmatmul takes the W8A16 GEMV", what());
                    }
                }
            }
        }
        // Groups, biases and other formats stay on the W8A8 kernels.
        let grouped = QMat::for_level(&random_q(8, 256, QFormat::I8, 32, false, true, &mut seed), qs);
        assert!(!qdecode16::takes(qs, &grouped, 1));
        let biased = QMat::for_level(&random_q(8, 256, QFormat::I8, 256, true, true, &mut seed), qs);
        assert!(!qdecode16::takes(qs, &biased, 1));
        let int4 = QMat::for_level(&random_q(8, 256, QFormat::I4, 256, false, true, &mut seed), qs);
        assert!(!qdecode16::takes(qs, &int4, 1));
    }
    assert!(!levels.is_empty() || QSimd::detect() < QSimd::Avx2, "AVX2, VNNI or AMX INT8 present but not tested");
}

/// The int8 prefill panels (`qpanels16_avx2`) carry a non-finite activation into NaN outputs
/// for its token only (whose span would otherwise quantize by an infinite or NaN scale), keep
/// an all-zero span at zero, and are closer to the product on unquantized activations than the
/// int8 activations of decode are.
#[test]
#[cfg(target_arch = "x86_64")]
fn avx2_int8_prefill_panels_handle_non_finite_and_zero_activations() {
    use spark_backend_cpu::kernels::qprefill_avx2;
    if QSimd::detect() < QSimd::Avx2 {
        eprintln!("skipped: this CPU has no AVX2 (or SPARK_CPU_SIMD caps it)");
        return;
    }
    let mut seed = 47u64;
    let (rows, cols, n) = (11usize, 576usize, 33usize);
    let qt = random_q(rows, cols, QFormat::I8, cols, false, false, &mut seed);
    let w = QMat::from_qtensor(&qt);
    let deq = qt.dequantize();
    let mut x = random_x(n, cols, &mut seed);
    x[3 * cols + 300] = f32::NAN;
    x[5 * cols + 7] = f32::INFINITY;
    x[6 * cols + 500] = f32::NEG_INFINITY;
    // Token 7: one span all zeros, the others a NaN next to zeros (max |x| is 0 there).
    x[7 * cols..8 * cols].fill(0.0);
    x[8 * cols..9 * cols].fill(0.0);
    x[8 * cols + 520] = f32::NAN;
    let mut out = vec![0.0f32; n * rows];
    qprefill_avx2::matmul(&x, n, cols, &w, &mut out, DType::F32);
    for t in 0..n {
        let o = &out[t * rows..(t + 1) * rows];
        match t {
            3 | 5 | 6 | 8 => assert!(o.iter().all(|v| v.is_nan()), "token {t}: {o:?}"),
            7 => assert!(o.iter().all(|&v| v == 0.0), "token {t}: {o:?}"),
            _ => assert!(o.iter().all(|v| v.is_finite()), "token {t}: {o:?}"),
        }
    }
    // Against the exact product on the finite tokens: the 16-bit activations' error is below
    // the int8 ones' (decode's quantization) in total.
    let act8 = QAct::quantize(&x, n, cols, &w);
    let (mut e16, mut e8) = (0.0f64, 0.0f64);
    for t in (0..n).filter(|t| ![3, 5, 6, 7, 8].contains(t)) {
        for r in 0..rows {
            let (mut exact, mut via8) = (0.0f64, 0.0f64);
            for c in 0..cols {
                exact += deq[r * cols + c] as f64 * x[t * cols + c] as f64;
                via8 += deq[r * cols + c] as f64 * act8.value(t, c) as f64;
            }
            e16 += (out[t * rows + r] as f64 - exact).powi(2);
            e8 += (via8 - exact).powi(2);
        }
    }
    assert!(e16 * 100.0 < e8, "16-bit activations' squared error {e16} vs int8's {e8}");
}

/// `common_unit` finds a unit for `spark-run quantize`'s super-blocks (powers of two) and for
/// GGUF Q4_K's (`d` times 6-bit sub-scales), down to subnormal units, with `k * u` the value
/// exactly; and refuses negative, non-finite and free-form values.
#[test]
fn common_unit_finds_the_units_of_integer_sub_scales() {
    use spark_backend_cpu::kernels::qmatmul::common_unit;
    let mut seed = 5u64;
    let mut ks = [0u8; 8];
    for case in 0..2000 {
        let u = match case % 4 {
            0 => 2f32.powi(-((lcg(&mut seed) % 30) as i32)),
            1 => half::f16::from_f32(unit(&mut seed).abs() * 0.05 + 1e-6).to_f32(),
            2 => f32::from_bits(1 + lcg(&mut seed) % 1000),
            // Up to 16 significant bits: the products with k <= 255 stay exact in f32.
            _ => (1 + lcg(&mut seed) % 65535) as f32 * 2f32.powi(-30),
        };
        let vals: Vec<f32> = (0..8).map(|_| u * (lcg(&mut seed) % 256) as f32).collect();
        let got = common_unit(&vals, &mut ks).expect("integer multiples of one unit");
        for (&v, &k) in vals.iter().zip(&ks) {
            assert_eq!(k as f32 * got, v, "case {case}: u {u} found {got}");
        }
    }
    assert_eq!(common_unit(&[0.0; 8], &mut ks), Some(1.0));
    assert_eq!(ks, [0; 8]);
    assert_eq!(common_unit(&[1.0, -2.0], &mut ks[..2]), None);
    assert_eq!(common_unit(&[1.0, f32::NAN], &mut ks[..2]), None);
    assert_eq!(common_unit(&[1.0, 256.0], &mut ks[..2]), None);
    assert_eq!(common_unit(&[0.1, 0.3], &mut ks[..2]), None, "0.1 and 0.3 in f32 share no unit with k <= 255");
    assert_eq!(common_unit(&[1.0; 9], &mut [0u8; 9]), None, "one super-block at a time");
    assert_eq!(common_unit(&[1.0; 4], &mut ks[..2]), None, "room for every k");
}

/// Sides that are not f16 values but fit one (GGUF K-quant products `d * sc`): held as f16, the
/// kernels compute with the rounded values exactly (against an f64 reference on a tensor with
/// the rounded sides), and stay within f16's precision of the unrounded tensor.
#[test]
fn k_quant_sides_held_as_f16_compute_with_the_rounded_values() {
    let mut seed = 23u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for &(cols, rows) in &[(256usize, 37usize), (160, 21), (2048, 9)] {
        for (format, group, bias, what) in [
            (QFormat::I8, 16, false, "Q6_K-like int8 g16"),
            (QFormat::I4, 32, true, "Q4_K-like int4 g32+bias"),
            (QFormat::I8, 32, true, "Q5_K-like int8 g32+bias"),
        ] {
            let mut qt = random_q(rows, cols, format, group, bias, false, &mut seed);
            // K-quant scales are normal f16 values in practice (a zero or subnormal one, say
            // beside a bias near zero, keeps the tensor in f32).
            qt.scales = Arc::new(qt.scales.iter().map(|&v| if v.abs() < 1e-3 { 0.0137 } else { v }).collect());
            assert!(!qt.half_sides() && qt.sides_fit_f16(), "{what}: the test wants inexact sides");
            let w = QMat::with_sides(&qt, true);
            assert!(w.half_sides(), "{what}: held as f16");
            let (deq, exact) = (as_held(&qt, true).dequantize(), qt.dequantize());
            for &n in &[1usize, 4, 17] {
                let x = random_x(n, cols, &mut seed);
                let act = QAct::quantize(&x, n, cols, &w);
                for qs in levels() {
                    let mut out = vec![f32::NAN; n * rows];
                    pool.install(|| qmatmul_quantized(qs, &act, &w, &mut out, DType::F32));
                    for t in 0..n {
                        for r in 0..rows {
                            let (mut want, mut unrounded, mut mag, mut moved) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
                            for c in 0..cols {
                                let a = act.value(t, c) as f64;
                                let e = exact[r * cols + c] as f64;
                                want += deq[r * cols + c] as f64 * a;
                                unrounded += e * a;
                                mag += (e * a).abs();
                                // A weight `s q + b` moves by at most 2^-11 (|s q| + max(|b|,
                                // 8 |s|)) <= 2^-11 (|w| + |b| + max(|b|, 8 |s|)).
                                let g = r * (cols / group) + c / group;
                                let b = qt.bias.as_ref().map_or(0.0, |v| v[g].abs() as f64);
                                let s8 = 8.0 * qt.scales[g].abs() as f64;
                                moved += 2f64.powi(-11) * (e.abs() + b + b.max(s8)) * a.abs();
                            }
                            let got = out[t * rows + r] as f64;
                            let i = format!("{what} {qs:?} n={n} cols={cols} [{t},{r}]");
                            assert!((got - want).abs() <= 1e-5 * mag + 1e-30, "{i}: {got} vs {want}");
                            let bound = moved * 1.001 + 1e-5 * mag + 1e-30;
                            assert!((got - unrounded).abs() <= bound, "{i}: {got} vs {unrounded} (bound {bound})");
                        }
                    }
                }
            }
        }
    }
}

/// The AVX2 prefill of quantized weights on dequantized f32 panels (what CPUs without VNNI run
/// from [`AVX2_QUANT_PANEL_MIN_TOKENS`] tokens, but for int4 with sub-scales, which these
/// random scales do not have: `avx2_quantized_prefill_panels_match_f64_reference`): against an f64 product of the dequantized
/// weights and the unquantized activations, only f32 summation differs (within 1e-5 of the sum
/// of |terms|), for every combo, at the AVX2 and (where present) AVX-512 micro-kernels, on rows
/// that do not fill a panel; and `quant_matmul` at the AVX2 level takes this path from the
/// threshold on.
#[test]
fn avx2_quantized_prefill_on_float_panels_matches_f64() {
    if Simd::detect() < Simd::Avx2 {
        eprintln!("skipped: this CPU has no AVX2 (or SPARK_CPU_SIMD caps it)");
        return;
    }
    let mut seed = 31u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for &(cols, rows) in &[(96usize, 37usize), (160, 21), (2080, 19)] {
        for (format, group, bias, half, what) in combos(cols) {
            let qt = random_q(rows, cols, format, group, bias, half, &mut seed);
            for &layout in layouts(format) {
                let w = QMat::with_layout(&qt, half, layout);
                let deq = as_held(&qt, half).dequantize();
                for &n in &[AVX2_QUANT_PANEL_MIN_TOKENS, 45] {
                    let x = random_x(n, cols, &mut seed);
                    for simd in [Simd::Avx2, Simd::detect()] {
                        let mut out = vec![f32::NAN; n * rows];
                        pool.install(|| quant_panels(simd, &x, n, cols, &w, &mut out, DType::F32));
                        for t in 0..n {
                            for r in 0..rows {
                                let (mut want, mut mag) = (0.0f64, 0.0f64);
                                for c in 0..cols {
                                    let term = deq[r * cols + c] as f64 * x[t * cols + c] as f64;
                                    want += term;
                                    mag += term.abs();
                                }
                                let got = out[t * rows + r] as f64;
                                assert!(
                                    (got - want).abs() <= 1e-5 * mag + 1e-30,
                                    "{what} {simd:?} n={n} cols={cols} [{t},{r}]: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn integer_kernels_are_within_the_activation_quantization_bound_of_float() {
    let mut seed = 5u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let (mut worst_ratio, mut worst_rel, mut worst_stat) = (0.0f64, 0.0f64, 0.0f64);
    for &(cols, rows) in &[(96, 37), (160, 37), (2080, 19)] {
        for (format, group, bias, half, what) in combos(cols) {
            let qt = random_q(rows, cols, format, group, bias, half, &mut seed);
            let deq = qt.dequantize();
            for &layout in layouts(format) {
                let w = QMat::with_layout(&qt, half, layout);
                for &n in &[1usize, 5, 17] {
                    let x = random_x(n, cols, &mut seed);
                    let mut fl = vec![0.0f32; n * rows];
                    pool.install(|| matmul(Simd::detect(), &x, n, cols, Mat::F32(&deq), rows, &mut fl, DType::F32));
                    // The bound: half a quantization step per activation, times |w|; and the
                    // expected RMS error for uniform rounding errors (step^2 / 12 per activation).
                    let mut bound = vec![0.0f64; n * rows];
                    let mut mag = vec![0.0f64; n * rows];
                    let mut var = 0.0f64;
                    for t in 0..n {
                        let xr = &x[t * cols..(t + 1) * cols];
                        let amax: Vec<f32> =
                            xr.chunks(32).map(|b| b.iter().fold(0.0f32, |m, v| m.max(v.abs()))).collect();
                        for r in 0..rows {
                            for c in 0..cols {
                                let wv = deq[r * cols + c].abs() as f64;
                                bound[t * rows + r] += wv * amax[c / 32] as f64 / 254.0;
                                var += (wv * amax[c / 32] as f64 / 127.0).powi(2) / 12.0;
                                mag[t * rows + r] += wv * xr[c].abs() as f64;
                            }
                        }
                    }
                    for qs in levels() {
                        let mut out = vec![0.0f32; n * rows];
                        pool.install(|| qmatmul(qs, &x, n, cols, &w, &mut out, DType::F32));
                        let (mut num, mut den) = (0.0f64, 0.0f64);
                        let (mut se, mut sv) = (0.0f64, 0.0f64);
                        for i in 0..n * rows {
                            let err = (out[i] as f64 - fl[i] as f64).abs();
                            let b = bound[i] * 1.0001 + 1e-5 * mag[i];
                            assert!(
                                err <= b,
                                "{what} {qs:?} n={n} cols={cols}: |{} - {}| = {err} > bound {b}",
                                out[i],
                                fl[i]
                            );
                            worst_ratio = worst_ratio.max(err / b.max(1e-30));
                            num += err * err;
                            den += (fl[i] as f64).powi(2);
                            se += err * err;
                        }
                        sv += var;
                        worst_rel = worst_rel.max((num / den.max(1e-30)).sqrt());
                        // Statistically: the RMS error is that of uniform rounding (allow 2x).
                        let (rms, expect) = ((se / (n * rows) as f64).sqrt(), (sv / (n * rows) as f64).sqrt());
                        assert!(
                            rms <= 2.0 * expect + 1e-6,
                            "{what} {qs:?} n={n}: RMS error {rms:e}, expected {expect:e}"
                        );
                        worst_stat = worst_stat.max(rms / expect.max(1e-30));
                    }
                }
            }
        }
    }
    // These activations have outliers (8x every 29th column), which coarsen their blocks'
    // steps, and random weights cancel: a relative RMS error of a few percent is expected here
    // (a real model's logits: see tests/tests/quant_e2e.rs).
    eprintln!(
        "W8A8/W4A8 vs float: worst |err| / hard bound {worst_ratio:.3}, worst RMS error / expected {worst_stat:.2}, \
         worst relative RMS error {worst_rel:.2e}"
    );
    assert!(worst_rel < 5e-2, "relative RMS error {worst_rel}");
}

#[test]
fn backend_repacks_quantized_weights_and_embeds_them() {
    let mut seed = 3u64;
    let (rows, cols) = (45, 160);
    for simd in [Simd::Portable, Simd::Avx2, Simd::Avx512] {
        if simd > Simd::detect() {
            continue;
        }
        let b = CpuBackend::with_simd(Some(2), simd).unwrap();
        for (format, group, bias, half, what) in combos(cols) {
            let qt = random_q(rows, cols, format, group, bias, half, &mut seed);
            let w = b.upload_quant(&qt, WeightRole::Embedding, DType::F32).unwrap();
            assert_eq!(w.quant_format(), Some((format, group)), "{what}: not repacked for the integer kernels");
            // Embedding rows are the exact dequantized rows (of the scales as held).
            let ids = [0u32, 44, 7, 7];
            let mut e = b.alloc(ids.len(), cols).unwrap();
            b.embed(&w, &ids, &mut e).unwrap();
            let deq = as_held(&qt, QMat::f16_sides_pay()).dequantize();
            for (i, &id) in ids.iter().enumerate() {
                let want = &deq[id as usize * cols..(id as usize + 1) * cols];
                assert_eq!(&e.data[i * cols..(i + 1) * cols], want, "{what}: embedding row {id}");
            }
            // matmul through the backend = the kernel entry point at the backend's level.
            let n = 3;
            let x = CpuTensor { rows: n, cols, data: random_x(n, cols, &mut seed) };
            let mut out = b.alloc(n, rows).unwrap();
            b.matmul(&x, &w, &mut out, DType::BF16).unwrap();
            let mut direct = vec![0.0; n * rows];
            let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
            pool.install(|| qmatmul(simd.qsimd(), &x.data, n, cols, w.quant().unwrap(), &mut direct, DType::BF16));
            for (a, d) in out.data.iter().zip(&direct) {
                assert!((a - d).abs() <= 1e-2 * d.abs().max(1e-3), "{what} {simd:?}: {a} vs {d}");
                assert_eq!(*a, half::bf16::from_f32(*a).to_f32(), "output not rounded to bf16");
            }
        }
    }
    // Groups that are not multiples of 16 are dequantized to a float weight.
    let b = CpuBackend::new(Some(1)).unwrap();
    let qt = random_q(5, 100, QFormat::I8, 10, false, false, &mut seed);
    let w = b.upload_quant(&qt, WeightRole::Matrix, DType::F32).unwrap();
    assert_eq!(w.quant_format(), None);
    let x = CpuTensor { rows: 1, cols: 100, data: random_x(1, 100, &mut seed) };
    let mut out = b.alloc(1, 5).unwrap();
    b.matmul(&x, &w, &mut out, DType::F32).unwrap();
    let deq = qt.dequantize();
    for r in 0..5 {
        let want: f32 = (0..100).map(|c| deq[r * 100 + c] * x.data[c]).sum();
        assert!((out.data[r] - want).abs() < 1e-4, "fallback row {r}");
    }
}

#[test]
fn non_finite_activations_give_nan_outputs() {
    let mut seed = 9u64;
    let (rows, cols, n) = (29, 2080, 4);
    let qt = random_q(rows, cols, QFormat::I8, cols, false, false, &mut seed);
    let w = QMat::from_qtensor(&qt);
    let mut x = random_x(n, cols, &mut seed);
    x[cols + 5] = f32::NAN;
    x[2 * cols + 100] = f32::INFINITY;
    for qs in levels() {
        let mut out = vec![0.0; n * rows];
        qmatmul(qs, &x, n, cols, &w, &mut out, DType::F32);
        assert!(out[..rows].iter().all(|v| v.is_finite()), "{qs:?}: token 0 has no NaN input");
        assert!(out[rows..3 * rows].iter().all(|v| v.is_nan()), "{qs:?}: NaN/inf input must give NaN outputs");
        assert!(out[3 * rows..].iter().all(|v| v.is_finite()), "{qs:?}: token 3 has no NaN input");
    }
}

/// On-CPU nanoseconds of the calling thread (robust to a shared, busy machine).
fn thread_cpu_ns() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    s.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// Kernel speed on one thread, in on-CPU time (not a test: `cargo test --release -p backend-cpu
/// --test qkernels -- --ignored --nocapture`).
#[test]
#[ignore]
fn bench_kernels() {
    let mut seed = 1u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    // QBENCH_SHAPES=MxK,MxK... replaces the 1.7B shapes (e.g. an L2-resident one to see the
    // kernels' arithmetic alone); QBENCH_ONLY=text keeps the weight kinds whose label has it.
    let shapes: Vec<(usize, usize)> = std::env::var("QBENCH_SHAPES").map_or_else(
        |_| vec![(512, 2048), (6656, 2048), (2048, 6656)],
        |v| {
            v.split(',')
                .map(|s| {
                    let (m, k) = s.split_once('x').expect("QBENCH_SHAPES: MxK,...");
                    (m.parse().expect("QBENCH_SHAPES: M"), k.parse().expect("QBENCH_SHAPES: K"))
                })
                .collect()
        },
    );
    let only = std::env::var("QBENCH_ONLY").unwrap_or_default();
    for &(m, k) in &shapes {
        let w32: Vec<f32> = (0..m * k).map(|_| unit(&mut seed) * 0.05).collect();
        let bf: Vec<u16> = w32.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        for &n in &[1usize, 4, 16, 32, 64, 128, 256, 512] {
            if std::env::var("QBENCH_N").is_ok_and(|v| v != n.to_string()) {
                continue;
            }
            let x = random_x(n, k, &mut seed);
            let mut out = vec![0.0f32; n * m];
            // The best of 5 windows of at least 0.1 s of CPU time each (the counter moves in
            // scheduler ticks; the best window is the least disturbed by other processes).
            let time = |f: &mut (dyn FnMut() + Send)| {
                pool.install(|| {
                    // Calls per clock read: the read is a file read (microseconds), which would
                    // swamp a small shape's call; batches of at least ~1 ms of CPU time.
                    let t = thread_cpu_ns();
                    f();
                    let batch = (1_000_000 / (thread_cpu_ns() - t).max(1)).clamp(1, 10_000);
                    let mut best = f64::INFINITY;
                    for _ in 0..5 {
                        let t = thread_cpu_ns();
                        let mut reps = 0;
                        while thread_cpu_ns() - t < 100_000_000 {
                            for _ in 0..batch {
                                f();
                            }
                            reps += batch;
                        }
                        best = best.min((thread_cpu_ns() - t) as f64 / reps as f64 * 1e-9);
                    }
                    best
                })
            };
            let s = time(&mut || matmul(Simd::detect(), &x, n, k, Mat::BF16(&bf), m, &mut out, DType::F32));
            eprintln!("m={m} k={k} n={n}: bf16 float {:.2} ms ({:.1} GB/s)", s * 1e3, (m * k * 2) as f64 / s * 1e-9);
            // The bf16-rounded path (AMX tiles where present: the activations are read as bf16).
            let s = time(&mut || matmul(Simd::detect(), &x, n, k, Mat::BF16(&bf), m, &mut out, DType::BF16));
            eprintln!(
                "m={m} k={k} n={n}: bf16 rounded {:.2} ms ({:.1} GB/s, {:.1} GMAC/s)",
                s * 1e3,
                (m * k * 2) as f64 / s * 1e-9,
                (m * k * n) as f64 / s * 1e-9
            );
            for (format, group, bias, half) in [
                (QFormat::I8, k, false, false),
                (QFormat::I8, 32, false, true),
                (QFormat::I4, 32, true, false),
                (QFormat::I4, 32, true, true),
                (QFormat::I4, 64, false, false),
                (QFormat::I8, 16, false, false),
                (QFormat::I8, 16, false, true),
                (QFormat::I6, 32, false, true),
            ] {
                let label =
                    format!("{format} g{group}{}{}", if bias { "+bias" } else { "" }, if half { " f16" } else { "" });
                if !label.contains(&only) {
                    continue;
                }
                let qt = random_q(m, k, format, group, bias, half, &mut seed);
                for &layout in layouts(format) {
                    let w = QMat::with_layout(&qt, half, layout);
                    // One line per path: time, weight bytes per second, multiply-adds per second.
                    let report = |path: &str, s: f64, bytes: usize| {
                        eprintln!(
                            "  {label} {path}: {:.2} ms ({:.1} GB/s, {:.1} GMAC/s)",
                            s * 1e3,
                            bytes as f64 / s * 1e-9,
                            (m * k * n) as f64 / s * 1e-9
                        )
                    };
                    for qs in levels() {
                        if qs == QSimd::Portable {
                            continue;
                        }
                        let s = time(&mut || qmatmul(qs, &x, n, k, &w, &mut out, DType::F32));
                        report(&format!("{qs:?}"), s, qt.nbytes());
                    }
                    // int4 as `spark-run quantize` writes it (super-block steps, sub-scales).
                    let sub =
                        (format == QFormat::I4 && group == 32 && bias && QSimd::detect() >= QSimd::Avx2).then(|| {
                            let spec = spark_core::quant::QuantSpec::new(QFormat::I4, Some(32));
                            let qk = spark_core::quant::quantize("w", m, k, &w32, spec).unwrap();
                            let wk = QMat::with_sides(&qk, half).with_sub_scales();
                            assert!(wk.sub_scales().is_some());
                            (qk.nbytes(), wk)
                        });
                    if let Some((bytes, wk)) = &sub {
                        let s = time(&mut || qmatmul(QSimd::Avx2, &x, n, k, wk, &mut out, DType::F32));
                        report("AVX2 sub-scales", s, *bytes);
                    }
                    // The same with its sides on grids, at the VNNI level.
                    if sub.is_some() && half && QSimd::detect() >= QSimd::Avx512Vnni {
                        let spec = spark_core::quant::QuantSpec::new(QFormat::I4, Some(32));
                        let qk = spark_core::quant::quantize("w", m, k, &w32, spec).unwrap();
                        let (wh, wg) = (QMat::with_sides(&qk, true), QMat::for_level(&qk, QSimd::Avx512Vnni));
                        if wg.scales().grid().is_some() {
                            let s = time(&mut || qmatmul(QSimd::Avx512Vnni, &x, n, k, &wh, &mut out, DType::F32));
                            report("VNNI, quantize's f16 sides", s, wh.decode_bytes());
                            let s = time(&mut || qmatmul(QSimd::Avx512Vnni, &x, n, k, &wg, &mut out, DType::F32));
                            report("VNNI, quantize's grid sides", s, wg.decode_bytes());
                        }
                    }
                    #[cfg(target_arch = "x86_64")]
                    let (pbytes, wp) = sub.as_ref().map_or((qt.nbytes(), &w), |(b, wk)| (*b, wk));
                    #[cfg(target_arch = "x86_64")]
                    if spark_backend_cpu::kernels::qprefill_avx2::takes(QSimd::Avx2, wp, n) {
                        use spark_backend_cpu::kernels::qprefill_avx2;
                        let s = time(&mut || qprefill_avx2::matmul(&x, n, k, wp, &mut out, DType::F32));
                        report("AVX2 prefill panels", s, pbytes);
                    }
                    #[cfg(target_arch = "x86_64")]
                    if spark_backend_cpu::kernels::qprefill_vnni::takes(QSimd::Avx512Vnni, &w, n) {
                        use spark_backend_cpu::kernels::qprefill_vnni;
                        let s = time(&mut || qprefill_vnni::matmul(&x, n, k, &w, &mut out, DType::BF16));
                        report("VNNI prefill", s, qt.nbytes());
                    }
                    #[cfg(target_arch = "x86_64")]
                    if n >= 16 && spark_backend_cpu::kernels::avx512bf16::available() {
                        use spark_backend_cpu::kernels::avx512bf16;
                        let xb: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
                        let wq = avx512bf16::PrefillWeights::Quant(&w);
                        // SAFETY: available() checked AVX512F/BW/BF16.
                        let s = time(&mut || unsafe { avx512bf16::prefill(&xb, n, k, wq, m, &mut out, DType::BF16) });
                        report("bf16 prefill, dequantized", s, qt.nbytes());
                    }
                    if n >= 16 && Simd::detect() >= Simd::Avx2 {
                        let s = time(&mut || quant_panels(Simd::Avx2, &x, n, k, &w, &mut out, DType::F32));
                        report("AVX2 f32 panels", s, qt.nbytes());
                    }
                    #[cfg(target_arch = "x86_64")]
                    if Simd::detect() == Simd::Amx {
                        use spark_backend_cpu::kernels::amx;
                        let xb: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
                        // SAFETY: Simd::Amx implies amx::available(); k is a multiple of 32.
                        let s = time(&mut || unsafe {
                            amx::matmul(&xb, n, k, amx::Weights::Quant(&w), m, &mut out, DType::BF16)
                        });
                        report("AMX bf16 dequantized", s, qt.nbytes());
                    }
                }
            }
        }
    }
}

#[test]
fn activation_quantization_is_identical_on_every_path() {
    let mut seed = 21u64;
    let qt = random_q(3, 2080, QFormat::I8, 16, false, false, &mut seed);
    let w = QMat::from_qtensor(&qt);
    let mut x = random_x(9, 2080, &mut seed);
    // Exact ties after scaling, tiny values, a zero block, a non-finite block.
    for (i, v) in x[..32].iter_mut().enumerate() {
        *v = (i as f32 - 16.0) * 0.5;
    }
    x[40] = 1e-30;
    x[3 * 2080 + 70] = f32::INFINITY;
    let r = QAct::quantize_with(QSimd::Portable, &x, 9, 2080, &w);
    for qs in levels() {
        let o = QAct::quantize_with(qs, &x, 9, 2080, &w);
        assert_eq!(o.q, r.q, "{qs:?} values");
        assert_eq!(
            o.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            r.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(
            o.a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            r.a.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
    // Symmetric, round half to even: max|x| maps to 127.
    assert_eq!(r.q[0], -127);
    assert!(r.d[0] > 0.0);
}

/// With AMX, int8/int4 matmuls of 32+ tokens whose activations are bf16 run on bf16 tiles; at the
/// AVX-512 level with AVX512_BF16 (no AMX), on the `vdpbf16ps` prefill: either way the weights
/// dequantized exactly (`QTensor` values) and rounded to bf16. Checked against an f64 reference
/// on those bf16 weights (one bf16 ulp of the output), and `QMat::dequant_bf16` against
/// `QTensor::dequantize` directly, for every format/group/bias, odd row counts, k across several
/// 512-wide cache blocks, token counts with tails of both token-block widths.
#[test]
fn dequantized_bf16_prefill_matches_reference() {
    #[cfg(target_arch = "x86_64")]
    let bf16_dot = spark_backend_cpu::kernels::avx512bf16::available();
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_dot = false;
    let level = if Simd::detect() >= Simd::Amx {
        Simd::Amx
    } else if Simd::detect() >= Simd::Avx512 && bf16_dot {
        Simd::Avx512
    } else {
        eprintln!("skipped: this CPU has neither AMX nor AVX512_BF16 (Simd {:?})", Simd::detect());
        return;
    };
    eprintln!("level {level:?}");
    let mut seed = 99u64;
    let bfv = |v: f32| half::bf16::from_f32(v).to_f32();
    let be = CpuBackend::with_simd(Some(2), level).unwrap();
    #[cfg(target_arch = "x86_64")]
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for &(format, group, bias, half) in &[
        (QFormat::I8, 0usize, false, false),
        (QFormat::I8, 32, false, true),
        (QFormat::I4, 32, true, false),
        (QFormat::I4, 32, true, true),
        (QFormat::I4, 64, false, false),
        (QFormat::I4, 128, true, true),
        (QFormat::I4, 16, true, false),
        (QFormat::I6, 32, false, true),
        (QFormat::I6, 16, false, false),
    ] {
        for &(n, k, m) in &[(66usize, 128usize, 33usize), (80, 640, 70), (97, 1152, 17), (64, 256, 12)] {
            let g = if group == 0 { k } else { group };
            let q = random_q(m, k, format, g, bias, half, &mut seed);
            let deq = q.dequantize();
            for &layout in layouts(format) {
                let qm = QMat::with_layout(&q, half, layout);
                // The backend holds the sides as this CPU does (rounded to f16 where they fit).
                let held = as_held(&q, QMat::f16_sides_pay()).dequantize();
                for r in [0, m / 2, m - 1] {
                    let mut bits = vec![0u16; k];
                    qm.dequant_bf16(r, 0, &mut bits);
                    for c in 0..k {
                        let want = half::bf16::from_f32(deq[r * k + c]).to_bits();
                        assert_eq!(bits[c], want, "{format} g{g} row {r} col {c}");
                    }
                }
                let check = |x: &[f32], held: &[f32], out: &[f32]| {
                    for t in 0..n {
                        for r in 0..m {
                            let exact: f64 = (0..k).map(|c| x[t * k + c] as f64 * bfv(held[r * k + c]) as f64).sum();
                            let got = out[t * m + r] as f64;
                            let tol = (exact.abs() / 128.0).max(1e-3);
                            assert!(
                                (got - bfv(exact as f32) as f64).abs() <= tol,
                                "{format} g{g} bias {bias} n={n} k={k} m={m} [{t},{r}]: {got} vs {exact}"
                            );
                        }
                    }
                };
                let x: Vec<f32> = random_x(n, k, &mut seed).into_iter().map(bfv).collect();
                let mut out = CpuTensor { rows: n, cols: m, data: vec![f32::NAN; n * m] };
                #[cfg(target_arch = "x86_64")]
                if level == Simd::Avx512 {
                    // The VNNI prefill takes most of these weights in the backend at this level
                    // (`vnni_prefill_matches_f64_reference_on_the_same_quantized_activations`),
                    // so the dequantized bf16 prefill runs directly, on this QMat.
                    use spark_backend_cpu::kernels::avx512bf16;
                    let held = as_held(&q, half).dequantize();
                    let wq = avx512bf16::PrefillWeights::Quant(&qm);
                    // SAFETY: available() checked AVX512F/BW/BF16.
                    pool.install(|| unsafe { avx512bf16::prefill(&x, n, k, wq, m, &mut out.data, DType::BF16) });
                    check(&x, &held, &out.data);
                    continue;
                }
                let w = be.upload_quant(&q, WeightRole::Matrix, DType::BF16).unwrap();
                let xt = CpuTensor { rows: n, cols: k, data: x.clone() };
                be.matmul(&xt, &w, &mut out, DType::BF16).unwrap();
                check(&x, &held, &out.data);
            }
        }
    }
}

/// Decode GEMV throughput across many matrices, as a decode step streams them (not a test:
/// `cargo test --release -p backend-cpu --test qkernels bench_decode_stream -- --ignored
/// --nocapture`). Weights as `spark-run quantize` writes them (`QBENCH_FORMAT`: `int4`, the
/// default, group 32 with super-block steps, or `int8` per channel), held for the detected level
/// (`SPARK_CPU_SIMD` caps it); one token; `QBENCH_THREADS` threads (default 2); enough copies of
/// a 2048 x 2048 matrix (`QBENCH_MB` megabytes, default 600) that they stream from memory, not
/// from the last-level cache. With `QBENCH_SPLIT` set, each thread runs its own share of the
/// matrices on a one-thread pool (no fork-join per matrix), to tell the threads' sync apart
/// from the kernel. Reports the bytes one decode step reads of them, per second.
#[test]
#[ignore]
fn bench_decode_stream() {
    let mut seed = 5u64;
    let threads = std::env::var("QBENCH_THREADS").map_or(2, |v| v.parse().expect("QBENCH_THREADS"));
    let mb: usize = std::env::var("QBENCH_MB").map_or(600, |v| v.parse().expect("QBENCH_MB"));
    let format = std::env::var("QBENCH_FORMAT").unwrap_or_else(|_| "int4".into());
    let spec = match format.as_str() {
        "int4" => spark_core::quant::QuantSpec::new(QFormat::I4, Some(32)),
        "int8" => spark_core::quant::QuantSpec::new(QFormat::I8, None),
        "int6" => spark_core::quant::QuantSpec::new(QFormat::I6, Some(32)),
        "int8g32" => spark_core::quant::QuantSpec::new(QFormat::I8, Some(32)),
        other => panic!("QBENCH_FORMAT: int4, int6, int8 or int8g32, not {other}"),
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let (m, k) = std::env::var("QBENCH_MK").map_or((2048, 2048), |v| {
        let (m, k) = v.split_once('x').expect("QBENCH_MK: MxK");
        (m.parse().expect("QBENCH_MK: M"), k.parse().expect("QBENCH_MK: K"))
    });
    let w32: Vec<f32> = (0..m * k).map(|_| unit(&mut seed) * 0.05).collect();
    let q = spark_core::quant::quantize("w", m, k, &w32, spec).unwrap();
    let qs = QSimd::detect();
    // QBENCH_SIDES=f16: the sides as f16 whatever the level would hold (grids at VNNI, AMX INT8).
    let f16_sides = std::env::var("QBENCH_SIDES").is_ok_and(|v| v == "f16");
    let hold = || if f16_sides { QMat::with_sides(&q, true) } else { QMat::for_level(&q, qs) };
    let one = hold();
    let bytes = one.decode_bytes();
    // At least one matrix (QBENCH_MB=0 would time nothing).
    let copies = (mb << 20).div_ceil(bytes).max(1);
    let mats: Vec<QMat> = (0..copies).map(|_| hold()).collect();
    let x = random_x(1, k, &mut seed);
    let mut out = vec![0.0f32; m];
    // The best of 7 passes over all the copies (`QBENCH_PASSES`).
    let passes: usize = std::env::var("QBENCH_PASSES").map_or(7, |v| v.parse().expect("QBENCH_PASSES"));
    let mut best = f64::INFINITY;
    if std::env::var_os("QBENCH_SPLIT").is_some() {
        // One one-thread pool per share, built before the clock starts.
        let pools: Vec<rayon::ThreadPool> =
            (0..threads).map(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap()).collect();
        for _ in 0..passes {
            let t = std::time::Instant::now();
            std::thread::scope(|sc| {
                for (part, p1) in mats.chunks(mats.len().div_ceil(threads)).zip(&pools) {
                    let x = &x;
                    sc.spawn(move || {
                        let mut out = vec![0.0f32; m];
                        p1.install(|| {
                            for w in part {
                                qmatmul(qs, x, 1, k, w, &mut out, DType::F32);
                            }
                        });
                    });
                }
            });
            best = best.min(t.elapsed().as_secs_f64());
        }
    } else {
        pool.install(|| {
            for _ in 0..passes {
                let t = std::time::Instant::now();
                for w in &mats {
                    qmatmul(qs, &x, 1, k, w, &mut out, DType::F32);
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
        });
    }
    eprintln!(
        "{qs:?}, {threads} threads{}, {copies} x {m}x{k} {format} (sub-scales: {}, grids: {}, {:.2} bits per weight read): \
         {:.1} GB/s, {:.1} us per matrix",
        if std::env::var_os("QBENCH_SPLIT").is_some() { " (split)" } else { "" },
        one.sub_scales().is_some(),
        one.scales().grid().is_some(),
        (bytes * 8) as f64 / (m * k) as f64,
        (bytes * copies) as f64 / best * 1e-9,
        best / copies as f64 * 1e6
    );
}
