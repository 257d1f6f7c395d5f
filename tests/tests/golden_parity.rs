//! Parity with the official reference's outputs (testdata/golden, a copy of shared/golden):
//! prefill, cached decode steps and no-cache logits within 1e-5 on the f32 checkpoint, greedy
//! ids exact; the bf16 checkpoint against the bf16 reference within a stated tolerance; and the
//! trained demo checkpoint (bf16) against its bf16 reference. The checks themselves are the
//! spark-tests library's (src/lib.rs), shared with the CUDA and wgpu suites.

use backend_cpu::{CpuBackend, Simd};
use spark_core::{Model, ModelOptions};
use spark_tests::*;

const F32_TOL: f32 = 1e-5;
/// Our bf16 path rounds where the reference casts, but accumulation order differs from torch's
/// bf16 kernels, so a value can land one bf16 ulp away, and logits are bf16 themselves (one ulp
/// is 7.8e-3 for |logit| in [1, 2)). Stated tolerance: at most two ulps anywhere (1.6e-2), and a
/// mean absolute difference below 1.5e-3 (measured: max 7.8e-3 = one ulp, mean 9.8e-4; the
/// reference's own bf16-vs-f32 gap is 9.5e-3 max).
const BF16_TOL: Bf16Tol = Bf16Tol { max: 1.6e-2, mean: 1.5e-3, greedy_up_to_ties: true };

fn model(dir: &str, simd: Simd, threads: usize) -> Model<CpuBackend> {
    let b = CpuBackend::with_simd(Some(threads), simd).unwrap();
    Model::load(b, &repo().join(dir), &ModelOptions::default()).unwrap()
}

fn check_f32(simd: Simd, threads: usize) {
    let mut m = model("testdata/golden/m8/ckpt_f32", simd, threads);
    check_f32_parity(&mut m, &m8_golden(), F32_TOL, &format!("{simd:?}, {threads} threads"));
}

#[test]
fn f32_parity_every_simd_level_this_cpu_has() {
    for simd in [Simd::Avx2, Simd::Avx512] {
        if simd <= Simd::detect() {
            eprintln!("golden f32 parity with {simd:?}");
            check_f32(simd, 2);
        } else {
            eprintln!("skipped: this CPU has no {simd:?}");
        }
    }
}

#[test]
fn f32_parity_portable_one_thread() {
    check_f32(Simd::Portable, 1);
}

#[test]
fn chunked_prefill_batching_and_forks_match_one_shot() {
    let mut m = model("testdata/golden/m8/ckpt_f32", Simd::detect(), 2);
    let forks = [ForkCheck::ContinuesExactly, ForkCheck::MidwayAndRewind];
    check_chunked_prefill_batching_and_forks(&mut m, &m8_golden(), F32_TOL, &forks);
}

/// The SIMD levels the bf16 paths are checked at (AVX-512 and AMX change the bf16 matmuls).
fn bf16_levels() -> Vec<Simd> {
    [Simd::Avx2, Simd::Avx512, Simd::Amx]
        .into_iter()
        .filter(|&s| {
            let ok = s <= Simd::detect();
            if !ok {
                eprintln!("skipped: this CPU has no {s:?}");
            }
            ok
        })
        .collect()
}

#[test]
fn bf16_checkpoint_matches_bf16_reference() {
    for simd in bf16_levels() {
        let mut m = model("testdata/golden/m8/ckpt_bf16", simd, 2);
        check_bf16_parity(&mut m, &m8_golden(), BF16_TOL, &format!("bf16 m8 {simd:?}"));
    }
}

#[test]
fn f32_upcast_of_bf16_checkpoint_is_close_to_f32_reference() {
    // --dtype f32 on the bf16 checkpoint: only the weight rounding separates it from f32.
    let gold = m8_golden();
    let b = CpuBackend::new(Some(2)).unwrap();
    let opts = ModelOptions { dtype: Some(spark_core::DType::F32), ..Default::default() };
    let mut m = Model::load(b, &repo().join("testdata/golden/m8/ckpt_bf16"), &opts).unwrap();
    let ids = &gold["p1.input_ids"].ids;
    let pre = prefill_all(&mut m, 1, ids);
    let d = max_abs_diff(&pre, &gold["p1.prefill_logits"].data);
    assert!(d < 2e-2 && d > 1e-6, "upcast bf16 weights vs f32 reference: {d:e}");
}

#[test]
fn demo_checkpoint_matches_its_bf16_reference() {
    let gold = load_golden(&repo().join("testdata/spark-demo-tiny/golden.safetensors"));
    for simd in bf16_levels() {
        let mut m = model("models/spark-demo-tiny", simd, 2);
        let r = bf16_report(&mut m, &gold, &format!("demo {simd:?}"));
        eprintln!(
            "demo bf16 {simd:?}: max |ours - reference bf16| = {:e} = {} bf16 ulps of the row's largest logit; mean {:e}",
            r.max, r.max_ulps, r.mean
        );
        // Trained weights give larger logits (|logit| up to ~20, where one bf16 ulp is 0.125), so
        // the tolerance is stated in bf16 ulps of the largest logit of the compared block: at most 3
        // (observed 1-2), and a mean absolute difference below 1.2e-2 (observed 5e-3 to 6.5e-3;
        // the reference's own bf16-vs-f32 mean gap on these prompts is 7.9e-3, and our bf16 path is
        // closer to the bf16 reference than to the f32 one). Greedy ids agree 32/32 on all prompts.
        assert!(r.max_ulps <= 3.0, "demo bf16 {simd:?}: {} ulps", r.max_ulps);
        assert!(r.mean < 1.2e-2, "demo bf16 {simd:?} mean diff {:e}", r.mean);
    }
}
