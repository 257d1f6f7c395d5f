//! Parity with the official reference's outputs (testdata/golden, a copy of shared/golden):
//! prefill, cached decode steps and no-cache logits within 1e-5 on the f32 checkpoint, greedy
//! ids exact; the bf16 checkpoint against the bf16 reference within a stated tolerance; and the
//! trained demo checkpoint (bf16) against its bf16 reference.

mod common;

use backend_cpu::{CpuBackend, Simd};
use common::*;
use spark_core::{Executor, LogitsMode, Model, ModelOptions, SeqStep};

const F32_TOL: f32 = 1e-5;
/// Our bf16 path rounds where the reference casts, but accumulation order differs from torch's
/// bf16 kernels, so a value can land one bf16 ulp away, and logits are bf16 themselves (one ulp
/// is 7.8e-3 for |logit| in [1, 2)). Stated tolerance: at most two ulps anywhere (1.6e-2), and a
/// mean absolute difference below 1.5e-3 (measured: max 7.8e-3 = one ulp, mean 9.8e-4; the
/// reference's own bf16-vs-f32 gap is 9.5e-3 max).
const BF16_TOL: f32 = 1.6e-2;
const BF16_MEAN_TOL: f32 = 1.5e-3;

/// One bf16 ulp at the largest magnitude in `v`.
fn bf16_ulp_of_max(v: &[f32]) -> f32 {
    let mag = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    2f32.powi(mag.log2().floor() as i32 - 7)
}

fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

fn model(dir: &str, simd: Simd, threads: usize) -> Model<CpuBackend> {
    let b = CpuBackend::with_simd(Some(threads), simd).unwrap();
    Model::load(b, &repo().join(dir), &ModelOptions::default()).unwrap()
}

fn prefill_all(m: &mut Model<CpuBackend>, seq: u64, ids: &[u32]) -> Vec<f32> {
    let mut out = vec![0.0; ids.len() * m.info().vocab];
    m.forward(&[SeqStep { seq_id: seq, tokens: ids, start_pos: 0, logits: LogitsMode::All }], &mut out).unwrap();
    m.release(seq);
    out
}

/// Cached path: prefill returning the last row, then one token at a time.
fn step_logits(m: &mut Model<CpuBackend>, prompt: &[u32], feed: &[u32]) -> Vec<f32> {
    let v = m.info().vocab;
    let mut rows = vec![0.0; v];
    m.forward(&[SeqStep { seq_id: 7, tokens: prompt, start_pos: 0, logits: LogitsMode::Last }], &mut rows).unwrap();
    let mut all = rows.clone();
    for (t, &id) in feed.iter().enumerate() {
        let pos = (prompt.len() + t) as u32;
        m.forward(&[SeqStep { seq_id: 7, tokens: &[id], start_pos: pos, logits: LogitsMode::Last }], &mut rows)
            .unwrap();
        all.extend_from_slice(&rows);
    }
    m.release(7);
    all
}

fn check_f32(simd: Simd, threads: usize) {
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
    let mut m = model("testdata/golden/m8/ckpt_f32", simd, threads);
    let vocab = m.info().vocab;
    for p in ["p0", "p1", "p2"] {
        let ids = &gold[&format!("{p}.input_ids")].ids;
        let pre = prefill_all(&mut m, 1, ids);
        let d = max_abs_diff(&pre, &gold[&format!("{p}.prefill_logits")].data);
        assert!(d < F32_TOL, "{p} prefill_logits: max diff {d:e} ({simd:?}, {threads} threads)");

        let seq_ids = &gold[&format!("{p}.seq_ids")].ids;
        let nc = prefill_all(&mut m, 2, seq_ids);
        let d = max_abs_diff(&nc, &gold[&format!("{p}.seq_logits_nocache")].data);
        assert!(d < F32_TOL, "{p} seq_logits_nocache: max diff {d:e}");

        let greedy = &gold[&format!("{p}.greedy_ids")].ids;
        let steps = step_logits(&mut m, ids, &greedy[..greedy.len() - 1]);
        let d = max_abs_diff(&steps, &gold[&format!("{p}.step_logits")].data);
        assert!(d < F32_TOL, "{p} step_logits: max diff {d:e}");
        let ours: Vec<u32> = steps.chunks(vocab).map(argmax).collect();
        assert_eq!(&ours, greedy, "{p} greedy ids");
    }
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
fn chunked_prefill_and_batching_match_one_shot() {
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
    let mut m = model("testdata/golden/m8/ckpt_f32", Simd::detect(), 2);
    let vocab = m.info().vocab;
    let ids = &gold["p2.input_ids"].ids; // 70 tokens, window 16
    let want = &gold["p2.prefill_logits"].data;
    for chunk in [1usize, 7, 16, 17, 40] {
        let mut got = vec![];
        for (c, part) in ids.chunks(chunk).enumerate() {
            let mut out = vec![0.0; part.len() * vocab];
            m.forward(
                &[SeqStep { seq_id: 3, tokens: part, start_pos: (c * chunk) as u32, logits: LogitsMode::All }],
                &mut out,
            )
            .unwrap();
            got.extend(out);
        }
        m.release(3);
        let d = max_abs_diff(&got, want);
        assert!(d < F32_TOL, "chunk {chunk}: max diff {d:e}");
    }
    // Two sequences in one step give the same rows as each alone.
    let a = &gold["p0.input_ids"].ids;
    let b = &gold["p1.input_ids"].ids;
    let mut out = vec![0.0; (a.len() + 1) * vocab];
    m.forward(
        &[
            SeqStep { seq_id: 10, tokens: a, start_pos: 0, logits: LogitsMode::All },
            SeqStep { seq_id: 11, tokens: b, start_pos: 0, logits: LogitsMode::Last },
        ],
        &mut out,
    )
    .unwrap();
    let d = max_abs_diff(&out[..a.len() * vocab], &gold["p0.prefill_logits"].data);
    assert!(d < F32_TOL, "batched p0: {d:e}");
    let p1 = &gold["p1.prefill_logits"].data;
    let d = max_abs_diff(&out[a.len() * vocab..], &p1[p1.len() - vocab..]);
    assert!(d < F32_TOL, "batched p1 last row: {d:e}");
    assert!(m.kv_bytes() > 0);
    m.release(10);
    m.release(11);
    assert_eq!(m.kv_bytes(), 0);
}

#[test]
fn bf16_checkpoint_matches_bf16_reference() {
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
    let mut m = model("testdata/golden/m8/ckpt_bf16", Simd::detect(), 2);
    let vocab = m.info().vocab;
    let (mut worst, mut worst_mean) = (0.0f32, 0.0f32);
    for p in ["p0", "p1", "p2"] {
        let ids = &gold[&format!("{p}.input_ids")].ids;
        let pre = prefill_all(&mut m, 1, ids);
        let want = &gold[&format!("{p}.bf16.prefill_logits")].data;
        worst = worst.max(max_abs_diff(&pre, want));
        worst_mean = worst_mean.max(mean_abs_diff(&pre, want));
        let greedy = &gold[&format!("{p}.bf16.greedy_ids")].ids;
        let steps = step_logits(&mut m, ids, &greedy[..greedy.len() - 1]);
        let want = &gold[&format!("{p}.bf16.step_logits")].data;
        worst = worst.max(max_abs_diff(&steps, want));
        worst_mean = worst_mean.max(mean_abs_diff(&steps, want));
        let ours: Vec<u32> = steps.chunks(vocab).map(argmax).collect();
        let agree = ours.iter().zip(greedy).filter(|(a, b)| a == b).count();
        eprintln!("bf16 m8 {p}: greedy agreement with the bf16 reference {agree}/{}", greedy.len());
    }
    eprintln!("bf16 m8: max |ours - reference bf16| = {worst:e} (tolerance {BF16_TOL:e}), mean {worst_mean:e} (tolerance {BF16_MEAN_TOL:e})");
    assert!(worst <= BF16_TOL, "bf16 max diff {worst:e}");
    assert!(worst_mean <= BF16_MEAN_TOL, "bf16 mean diff {worst_mean:e}");
}

#[test]
fn f32_upcast_of_bf16_checkpoint_is_close_to_f32_reference() {
    // --dtype f32 on the bf16 checkpoint: only the weight rounding separates it from f32.
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
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
    let mut m = model("models/spark-demo-tiny", Simd::detect(), 2);
    let vocab = m.info().vocab;
    let mut worst = 0.0f32;
    let mut worst_ulps = 0.0f32;
    let mut worst_mean = 0.0f32;
    for p in ["p0", "p1", "p2"] {
        let ids = &gold[&format!("{p}.input_ids")].ids;
        let pre = prefill_all(&mut m, 1, ids);
        worst = worst.max(max_abs_diff(&pre, &gold[&format!("{p}.bf16.prefill_logits")].data));
        let want = &gold[&format!("{p}.bf16.prefill_logits")].data;
        worst_ulps = worst_ulps.max(max_abs_diff(&pre, want) / bf16_ulp_of_max(want));
        worst_mean = worst_mean.max(mean_abs_diff(&pre, want));
        let greedy = &gold[&format!("{p}.bf16.greedy_ids")].ids;
        let steps = step_logits(&mut m, ids, &greedy[..greedy.len() - 1]);
        worst = worst.max(max_abs_diff(&steps, &gold[&format!("{p}.bf16.step_logits")].data));
        let want = &gold[&format!("{p}.bf16.step_logits")].data;
        worst_ulps = worst_ulps.max(max_abs_diff(&steps, want) / bf16_ulp_of_max(want));
        worst_mean = worst_mean.max(mean_abs_diff(&steps, want));
        let ours: Vec<u32> = steps.chunks(vocab).map(argmax).collect();
        let agree = ours.iter().zip(greedy).filter(|(a, b)| a == b).count();
        eprintln!("demo {p}: greedy agreement with bf16 reference {agree}/{}", greedy.len());
    }
    eprintln!("demo bf16: max |ours - reference bf16| = {worst:e} = {worst_ulps} bf16 ulps of the row's largest logit; mean {worst_mean:e}");
    // Trained weights give larger logits (|logit| up to ~20, where one bf16 ulp is 0.125), so
    // the tolerance is stated in bf16 ulps of the largest logit of the compared block: at most 3
    // (observed 1-2), and a mean absolute difference below 1.2e-2 (observed 5e-3 to 6.5e-3;
    // the reference's own bf16-vs-f32 mean gap on these prompts is 7.9e-3, and our bf16 path is
    // closer to the bf16 reference than to the f32 one). Greedy ids agree 32/32 on all prompts.
    assert!(worst_ulps <= 3.0, "demo bf16: {worst_ulps} ulps");
    assert!(worst_mean < 1.2e-2, "demo bf16 mean diff {worst_mean:e}");
}
