//! The CUDA backend against the official reference's outputs (testdata/golden/m8): f32
//! checkpoint within 1e-4 (prefill logits, no-cache logits, cached step logits, greedy ids
//! exact), chunked prefill and batching, the fallback GEMM kernels, and the bf16 checkpoint
//! against the bf16 reference. Without a usable CUDA device each test prints
//! `skipped: no CUDA device` and passes. Also: the no-driver probe path, and that the bundled PTX
//! is what NVRTC makes of kernels.cu (where libnvrtc is found). The golden checks are the
//! spark-tests library's, shared with the cpu and wgpu suites.
//!
//! On machines without a GPU, CI also runs these tests on the CPU stand-in for the driver and
//! cuBLAS that `scripts/cuda-emu.sh` builds (docs/CUDA.md): the device is then "spark CUDA
//! emulation (CPU)".
//!
//! The golden data is found under `$SPARK_REPO_DIR` (set by scripts/gpu-check.sh, which runs
//! these executables away from the source tree), else the repository this was built from.

use std::path::PathBuf;

use spark_backend_cuda::device::Libs;
use spark_backend_cuda::{kernels, plugin, CudaBackend, Options};
use spark_core::{Executor, LogitsMode, Model, ModelOptions, SeqStep};
use spark_tests::*;

const F32_TOL: f32 = 1e-4;
/// bf16 tolerance: as backend-cpu's golden test states it (the same rounding points, a different
/// accumulation order: one bf16 ulp of a logit in [1, 2) is 7.8e-3): at most two such ulps
/// anywhere, and a mean absolute difference below 1.5e-3; greedy ids the reference's except at
/// near-ties (where the reference ranks our id within one bf16 ulp of its top, `GREEDY_TIE`).
const BF16_TOL: Bf16Tol = Bf16Tol { max: 1.6e-2, mean: 1.5e-3, greedy_up_to_ties: true };

/// The backend on device 0, or None (with the visible skip line) where there is none usable.
fn backend(opts: Options) -> Option<CudaBackend> {
    let devs = plugin::probe();
    if !devs.iter().any(|d| d.usable) {
        eprintln!("skipped: no CUDA device ({})", devs.first().map_or("", |d| d.note.as_str()));
        return None;
    }
    let b = CudaBackend::with_options(0, opts).expect("opening device 0");
    eprintln!("cuda device: {} ({})", b.facts().name, b.describe());
    Some(b)
}

fn model(b: CudaBackend, dir: &str) -> Model<CudaBackend> {
    Model::load(b, &repo().join(dir), &ModelOptions::default()).unwrap()
}

fn check_f32(b: CudaBackend, label: &str) {
    let mut m = model(b, "testdata/golden/m8/ckpt_f32");
    check_f32_parity(&mut m, &m8_golden(), F32_TOL, label);
}

/// The kernels that are not the default: the fallback GEMM, no GEMV, attention that recomputes
/// its scores.
const FALLBACKS: Options = Options {
    cublas: false,
    gemv: false,
    scored_attention: false,
    graphs: false,
    dense_prefill: false,
    flash_prefill: false,
    flash_split_keys: 256,
    batch_attention: false,
    gemv_max_rows: 16,
    pinned_read: false,
    pdl: false,
    fuse: false,
};

#[test]
fn f32_parity_with_cublas() {
    if let Some(b) = backend(Options::default()) {
        check_f32(b, "cublas");
    }
}

#[test]
fn f32_parity_with_fallback_kernels() {
    if let Some(b) = backend(FALLBACKS) {
        check_f32(b, "fallback gemm, recomputing attention");
    }
}

#[test]
fn chunked_prefill_and_batching_match_one_shot() {
    let Some(b) = backend(Options::default()) else { return };
    let mut m = model(b, "testdata/golden/m8/ckpt_f32");
    check_chunked_prefill_batching_and_forks(&mut m, &m8_golden(), F32_TOL, &[ForkCheck::ContinuesExactly]);
}

/// A fork shares its source's full-layer KV pages until one of them writes into a shared page
/// (copy on write): after a 60-token prefix, the source and the fork take different tokens in
/// one step (writing into the shared page and past it), then one more in another; each matches
/// a fresh sequence fed its own tokens, and the fork took less KV memory than a copy would.
#[test]
fn forks_share_kv_pages_and_diverge_cleanly() {
    let Some(b) = backend(Options::default()) else { return };
    let mut m = model(b, "testdata/golden/m8/ckpt_f32");
    let gold = m8_golden();
    let vocab = m.info().vocab;
    let ids = &gold["p2.input_ids"].ids;
    let (head, a, bb) = (&ids[..60], &ids[60..65], &ids[65..70]);
    let mut last = vec![0.0; vocab];
    m.forward(&[SeqStep { seq_id: 1, tokens: head, start_pos: 0, logits: LogitsMode::Last }], &mut last).unwrap();
    let before = m.kv_bytes();
    m.fork(1, 2).unwrap();
    let after = m.kv_bytes();
    assert!(after < 2 * before, "the fork copied its pages: {before} -> {after} bytes of KV");
    // Both continue in one step, with different tokens.
    let mut out = vec![0.0; 10 * vocab];
    m.forward(
        &[
            SeqStep { seq_id: 1, tokens: a, start_pos: 60, logits: LogitsMode::All },
            SeqStep { seq_id: 2, tokens: bb, start_pos: 60, logits: LogitsMode::All },
        ],
        &mut out,
    )
    .unwrap();
    let next = [ids[0]];
    let (mut s1, mut s2) = (vec![0.0; vocab], vec![0.0; vocab]);
    m.forward(&[SeqStep { seq_id: 2, tokens: &next, start_pos: 65, logits: LogitsMode::Last }], &mut s2).unwrap();
    m.forward(&[SeqStep { seq_id: 1, tokens: &next, start_pos: 65, logits: LogitsMode::Last }], &mut s1).unwrap();
    // Fresh sequences with the same tokens.
    for (seq, tail, got, step) in [(3u64, a, &out[..5 * vocab], &s1), (4, bb, &out[5 * vocab..], &s2)] {
        let all: Vec<u32> = head.iter().chain(tail).chain(&next).copied().collect();
        let mut want = vec![0.0; all.len() * vocab];
        m.forward(&[SeqStep { seq_id: seq, tokens: &all, start_pos: 0, logits: LogitsMode::All }], &mut want).unwrap();
        let d = max_abs_diff(got, &want[60 * vocab..65 * vocab]);
        assert!(d < F32_TOL, "sequence {seq}'s counterpart after the fork: max diff {d:e}");
        let d = max_abs_diff(step, &want[65 * vocab..]);
        assert!(d < F32_TOL, "sequence {seq}'s counterpart, the step after: max diff {d:e}");
        m.release(seq);
    }
    m.release(1);
    m.release(2);
    assert_eq!(m.kv_bytes(), 0, "every sequence was released");
}

/// The same with the flash attention's keys split wherever a chunk sees 16 keys or more (by
/// default splits take 256 keys at least, more than these prompts have).
#[test]
fn chunked_prefill_with_split_flash_attention_matches_one_shot() {
    let Some(b) = backend(Options { flash_split_keys: 16, ..Options::default() }) else { return };
    let mut m = model(b, "testdata/golden/m8/ckpt_f32");
    check_chunked_prefill_batching_and_forks(&mut m, &m8_golden(), F32_TOL, &[ForkCheck::MidwayAndRewind]);
}

/// The same with the per-query scored kernels taking the chunks `attn_flash` takes by default.
#[test]
fn chunked_prefill_without_flash_attention_matches_one_shot() {
    let Some(b) = backend(Options { flash_prefill: false, ..Options::default() }) else { return };
    let mut m = model(b, "testdata/golden/m8/ckpt_f32");
    check_chunked_prefill_batching_and_forks(&mut m, &m8_golden(), F32_TOL, &[]);
}

#[test]
fn bf16_checkpoint_matches_bf16_reference() {
    let Some(b) = backend(Options::default()) else { return };
    let mut m = model(b, "testdata/golden/m8/ckpt_bf16");
    check_bf16_parity(&mut m, &m8_golden(), BF16_TOL, "cuda bf16 m8 (GEMV, scored, flash and dense attention, graphs)");
    // The GEMV kernels for up to 16 rows (by default steps of more than 4 rows take cuBLAS).
    let Some(b) = backend(Options { gemv_max_rows: 16, ..Options::default() }) else { return };
    let mut m = model(b, "testdata/golden/m8/ckpt_bf16");
    check_bf16_parity(&mut m, &m8_golden(), BF16_TOL, "cuda bf16 m8 (GEMV up to 16 rows)");
}

#[test]
fn bf16_checkpoint_matches_bf16_reference_without_gemv_or_scored_attention() {
    let opts = Options {
        gemv: false,
        scored_attention: false,
        dense_prefill: false,
        flash_prefill: false,
        ..Options::default()
    };
    let Some(b) = backend(opts) else { return };
    let mut m = model(b, "testdata/golden/m8/ckpt_bf16");
    check_bf16_parity(&mut m, &m8_golden(), BF16_TOL, "cuda bf16 m8 (cuBLAS, recomputing attention)");
}

/// Greedy decode of several sequences of different lengths, stepped together (batch decode),
/// after each one's prefill; every step's logits, in order.
fn decode_batch(m: &mut dyn Executor, seqs: usize, steps: usize) -> Vec<f32> {
    let vocab = m.info().vocab;
    let mut rows = vec![vec![0.0; vocab]; seqs];
    let mut lens = vec![0u32; seqs];
    let mut all = vec![];
    for (s, row) in rows.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..5 + 9 * s as u32).map(|i| 3 + (i * 7 + s as u32) % 200).collect();
        m.forward(&[SeqStep { seq_id: s as u64, tokens: &prompt, start_pos: 0, logits: LogitsMode::Last }], row)
            .unwrap();
        lens[s] = prompt.len() as u32;
        all.extend_from_slice(row);
    }
    for _ in 0..steps {
        let toks: Vec<[u32; 1]> = rows.iter().map(|r| [argmax(r) as u32]).collect();
        let batch: Vec<SeqStep> = toks
            .iter()
            .enumerate()
            .map(|(s, t)| SeqStep { seq_id: s as u64, tokens: t, start_pos: lens[s], logits: LogitsMode::Last })
            .collect();
        let mut out = vec![0.0; vocab * seqs];
        m.forward(&batch, &mut out).unwrap();
        for (s, r) in rows.iter_mut().enumerate() {
            r.copy_from_slice(&out[s * vocab..(s + 1) * vocab]);
            lens[s] += 1;
        }
        all.extend_from_slice(&out);
    }
    for s in 0..seqs {
        m.release(s as u64);
    }
    all
}

/// Decode steps replayed as CUDA graphs give the same bits as the same launches one by one, and
/// graphs are in fact used: with the GEMV kernels (bf16 m8, one sequence), and with cuBLAS GEMMs
/// captured into the graphs (GEMV off, four sequences: the batched attention too).
#[test]
fn graph_replay_matches_launching_one_by_one() {
    for (label, gemv, seqs) in [("GEMV", true, 1), ("cuBLAS", false, 4)] {
        let Some(b) = backend(Options { gemv, ..Options::default() }) else { return };
        let Some(b2) = backend(Options { gemv, graphs: false, ..Options::default() }) else { return };
        let mut with = model(b, "testdata/golden/m8/ckpt_bf16");
        let mut without = model(b2, "testdata/golden/m8/ckpt_bf16");
        // Past the 16-token window of m8's sliding layers (the ring wraps) and a growth of the
        // full layers' cache (256 positions).
        let steps = 300 - 9 * seqs;
        let a = decode_batch(&mut with, seqs, steps);
        let b = decode_batch(&mut without, seqs, steps);
        let (captured, replayed) = with.backend().graph_counts();
        eprintln!("{label}: graphs: {captured} captured, {replayed} steps replayed of {steps}");
        assert_eq!(without.backend().graph_counts(), (0, 0));
        assert!(replayed as usize >= steps - 50, "{label}: decode steps were not replayed as graphs ({replayed})");
        assert_eq!(max_abs_diff(&a, &b), 0.0, "{label}: graph replay differs from launching one by one");
    }
}

/// The decode chunks of several sequences in one batched attention launch per layer give the
/// same bits as one launch per sequence.
#[test]
fn batched_decode_attention_matches_per_sequence_launches() {
    let Some(b) = backend(Options::default()) else { return };
    let Some(b2) = backend(Options { batch_attention: false, ..Options::default() }) else { return };
    let mut batched = model(b, "testdata/golden/m8/ckpt_bf16");
    let mut single = model(b2, "testdata/golden/m8/ckpt_bf16");
    let a = decode_batch(&mut batched, 5, 40);
    let b = decode_batch(&mut single, 5, 40);
    assert_eq!(max_abs_diff(&a, &b), 0.0, "batched attention differs from per-sequence launches");
}

/// The experimental kernels (`Options::fuse`: the RoPE in the QKV GEMV, the head gate in the
/// decode attention, RMSNorm in registers) and/or programmatic dependent launches (`pdl`) give the
/// same bits as the default kernels launched plainly: one sequence (graphs) and four (batched
/// attention, sequences of different lengths), bf16 m8 (partial and full rotary layers).
fn experimental_matches_default(fuse: bool, pdl: bool) {
    for seqs in [1, 4] {
        let Some(b) = backend(Options { fuse, pdl, ..Options::default() }) else { return };
        let Some(b2) = backend(Options::default()) else { return };
        let mut fast = model(b, "testdata/golden/m8/ckpt_bf16");
        let mut plain = model(b2, "testdata/golden/m8/ckpt_bf16");
        let a = decode_batch(&mut fast, seqs, 40);
        eprintln!("fuse {fuse}, pdl {pdl}: {seqs} sequence(s) decoded");
        let b = decode_batch(&mut plain, seqs, 40);
        let d = max_abs_diff(&a, &b);
        assert_eq!(d, 0.0, "{seqs} sequence(s): fuse {fuse}, pdl {pdl} differ from the default (max |diff| {d})");
    }
}

// Ignored until they pass on a GPU: on the H200 (session 6, run 2) the four-sequence case hung
// with the fused kernels, PDL on or off. The cause found afterwards: with the head gate fused, the
// pending decode attention was recorded from inside a cuBLAS GEMM's set-up (a 23-token prefill)
// that held the scratch lock, which recording takes again (a self-deadlock; fixed, the lock is
// released before any launch). scripts/gpu-check.sh runs these with timeouts. On the CPU stand-in
// for the driver (scripts/cuda-emu.sh) the four sequences decode to the end with the fused
// kernels, bit-identical to the default since every norm kernel sums in one order (session 17;
// CI runs `fused_kernels_match_default` there).
#[test]
#[ignore = "experimental: hung on an H200 before the scratch-lock fix; not yet rerun on a GPU"]
fn fused_kernels_match_default() {
    experimental_matches_default(true, false);
}

#[test]
#[ignore = "experimental: not yet run with several sequences on a GPU"]
fn pdl_matches_default() {
    experimental_matches_default(false, true);
}

#[test]
#[ignore = "experimental: hung on an H200 before the scratch-lock fix; not yet rerun on a GPU"]
fn fused_kernels_with_pdl_match_default() {
    experimental_matches_default(true, true);
}

/// A step that mixes one sequence's decode token with another's whole prompt (as the server's
/// scheduler batches them), bf16: the decode attention waits to be launched while the prompt's
/// attention and GEMMs are recorded (this deadlocked on the scratch lock before session 6's fix
/// where the prompt took the dense attention or cuBLAS). Checked against the same tokens run
/// in separate steps, within the bf16 tolerance (the GEMMs see different row counts).
#[test]
fn mixed_prefill_and_decode_steps_match_separate_steps() {
    let run = |mixed: bool| -> Vec<f32> {
        let b = backend(Options::default()).expect("device 0");
        let mut m = model(b, "testdata/golden/m8/ckpt_bf16");
        let vocab = m.info().vocab;
        let a: Vec<u32> = (0..9).map(|i| 3 + i * 11 % 300).collect();
        let mut row = vec![0.0; vocab];
        m.forward(&[SeqStep { seq_id: 1, tokens: &a, start_pos: 0, logits: LogitsMode::Last }], &mut row).unwrap();
        let mut all = row.clone();
        for (pos, len) in [(9u32, 23u32), (10, 40)] {
            // Sequence 1 decodes one token (at pos) while sequence `len` is prefilled from scratch.
            let b_toks: Vec<u32> = (0..len).map(|i| 5 + (i * 7 + len) % 400).collect();
            let step_a = [3 + len];
            let sa = SeqStep { seq_id: 1, tokens: &step_a, start_pos: pos, logits: LogitsMode::Last };
            let sb = SeqStep { seq_id: len as u64 + 10, tokens: &b_toks, start_pos: 0, logits: LogitsMode::Last };
            let mut out = vec![0.0; 2 * vocab];
            if mixed {
                m.forward(&[sa, sb], &mut out).unwrap();
            } else {
                m.forward(&[sa], &mut out[..vocab]).unwrap();
                m.forward(&[sb], &mut out[vocab..]).unwrap();
            }
            all.extend_from_slice(&out);
        }
        all
    };
    if backend(Options::default()).is_none() {
        return;
    }
    let (mixed, separate) = (run(true), run(false));
    let d = max_abs_diff(&mixed, &separate);
    eprintln!("mixed vs separate steps (bf16): max |diff| {d:e}");
    assert!(d <= BF16_TOL.max, "mixed steps differ from separate steps by {d:e}");
}

/// Results read back through page-locked memory are the same as through pageable memory.
#[test]
fn pinned_reads_match_pageable_reads() {
    let Some(b) = backend(Options { pinned_read: true, ..Options::default() }) else { return };
    let Some(b2) = backend(Options::default()) else { return };
    let mut pinned = model(b, "testdata/golden/m8/ckpt_bf16");
    let mut pageable = model(b2, "testdata/golden/m8/ckpt_bf16");
    let a = decode_batch(&mut pinned, 3, 20);
    let b = decode_batch(&mut pageable, 3, 20);
    assert_eq!(max_abs_diff(&a, &b), 0.0, "pinned reads differ");
}

/// With `SPARK_CUDA_CHECK_CKPT=DIR` (a real-shape checkpoint, e.g. `spark-run gen-random --shape
/// 1.7b`): the CUDA and CPU backends on the same prompt of `SPARK_CUDA_CHECK_LEN` (default 600,
/// past the 512-token sliding window) random tokens, then 4 cached decode steps. Checks the
/// shapes the tiny golden model lacks (head_dim 256, GQA 4, a wrapped ring, 64 rotary dims, the
/// 131072-row head). Both run the checkpoint's dtype; stated tolerance: mean |diff| below 1% of
/// the largest |logit| and the same argmax on every row but at most one (near-ties).
#[test]
fn cpu_and_cuda_agree_on_a_real_shape_checkpoint() {
    let Ok(dir) = std::env::var("SPARK_CUDA_CHECK_CKPT") else {
        eprintln!("skipped: SPARK_CUDA_CHECK_CKPT not set");
        return;
    };
    let Some(b) = backend(Options::default()) else { return };
    let len: usize = std::env::var("SPARK_CUDA_CHECK_LEN").ok().and_then(|v| v.parse().ok()).unwrap_or(600);
    let opts = ModelOptions { ctx: Some(len + 16), ..Default::default() };
    let mut gpu = Model::load(b, std::path::Path::new(&dir), &opts).unwrap();
    let cpu_b = backend_cpu::CpuBackend::new(None).unwrap();
    let mut cpu = Model::load(cpu_b, std::path::Path::new(&dir), &opts).unwrap();
    let vocab = gpu.info().vocab;
    let mut x = 0x9E3779B97F4A7C15u64;
    let prompt: Vec<u32> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            3 + (x % (vocab as u64 - 3)) as u32
        })
        .collect();
    let run = |m: &mut dyn Executor| -> Vec<f32> {
        let t = std::time::Instant::now();
        let mut row = vec![0.0; vocab];
        m.forward(&[SeqStep { seq_id: 1, tokens: &prompt, start_pos: 0, logits: LogitsMode::Last }], &mut row).unwrap();
        let mut all = row.clone();
        for (i, &t) in prompt.iter().take(4).enumerate() {
            let tok = [t];
            let pos = (len + i) as u32;
            m.forward(&[SeqStep { seq_id: 1, tokens: &tok, start_pos: pos, logits: LogitsMode::Last }], &mut row)
                .unwrap();
            all.extend_from_slice(&row);
        }
        m.release(1);
        eprintln!("{}: {len}-token prefill + 4 steps in {:.2?}", m.info().backend, t.elapsed());
        all
    };
    let g = run(&mut gpu);
    drop(gpu);
    let c = run(&mut cpu);
    // The same with cuBLAS only and the attention that recomputes scores: agrees with the above.
    let opts2 = Options {
        gemv: false,
        scored_attention: false,
        dense_prefill: false,
        flash_prefill: false,
        ..Options::default()
    };
    let b = backend(opts2).expect("device 0");
    let mut gpu2 = Model::load(b, std::path::Path::new(&dir), &opts).unwrap();
    let g2 = run(&mut gpu2);
    let (d2, mean2) = (max_abs_diff(&g, &g2), mean_abs_diff(&g, &g2));
    let agree2 = g.chunks(vocab).zip(g2.chunks(vocab)).filter(|(a, b)| argmax(a) == argmax(b)).count();
    eprintln!(
        "real shape: default kernels vs cuBLAS + recomputing attention: max {d2:e}, mean {mean2:e}, argmax {agree2}/5"
    );
    let mag = c.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (d, mean) = (max_abs_diff(&g, &c), mean_abs_diff(&g, &c));
    let agree = g.chunks(vocab).zip(c.chunks(vocab)).filter(|(a, b)| argmax(a) == argmax(b)).count();
    eprintln!("real shape: max |cuda - cpu| {d:e}, mean {mean:e}, max |logit| {mag:e}, argmax agreement {agree}/5");
    assert!(mean < 0.01 * mag, "mean diff {mean:e} vs max |logit| {mag:e}");
    assert!(agree >= 4, "argmax agreement {agree}/5");
    assert!(mean2 < 0.01 * mag && agree2 >= 4, "the two CUDA kernel choices disagree");
}

#[test]
fn probe_and_open_never_panic() {
    let libs = Libs::detect();
    let devs = plugin::probe();
    assert!(!devs.is_empty());
    for d in &devs {
        eprintln!("probe: {d:?}");
    }
    if !libs.driver {
        assert_eq!(devs.len(), 1);
        assert!(!devs[0].usable);
        assert!(devs[0].note.contains("libcuda.so not found"), "{}", devs[0].note);
    }
    if !devs.iter().any(|d| d.usable) {
        let e =
            plugin::open(&repo().join("testdata/golden/m8/ckpt_f32"), &Default::default()).err().expect("no device");
        eprintln!("open: {e}");
        assert!(!e.message.is_empty());
        let e = CudaBackend::with_options(0, Options::default()).err().expect("no device");
        eprintln!("backend: {e}");
        assert!(!e.message.is_empty());
    }
}

#[test]
fn bundled_ptx_is_current() {
    if !Libs::detect().nvrtc {
        eprintln!("skipped: libnvrtc not found (put it on LD_LIBRARY_PATH to check the bundled PTX)");
        return;
    }
    // The sm_90 build (programmatic dependent launch) must compile too; it is not bundled.
    kernels::compile("compute_90").expect("NVRTC compiles kernels.cu for compute_90");
    let ptx = kernels::compile(kernels::BUNDLED_ARCH).expect("NVRTC compiles kernels.cu");
    if std::env::var("SPARK_CUDA_WRITE_PTX").is_ok_and(|v| v == "1") {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/kernels.ptx");
        std::fs::write(&path, &ptx).unwrap();
        eprintln!("wrote {}", path.display());
        return;
    }
    // Only the NVRTC that made the bundled PTX (named in its header) makes the same text.
    let release = |p: &str| p.lines().find(|l| l.contains("Cuda compilation tools")).map(str::to_string);
    if release(&ptx) != release(kernels::BUNDLED_PTX) {
        eprintln!(
            "kernels.cu compiles with this NVRTC ({:?}); not comparing with the bundled PTX ({:?})",
            release(&ptx),
            release(kernels::BUNDLED_PTX)
        );
        return;
    }
    assert!(
        ptx == kernels::BUNDLED_PTX,
        "src/kernels.ptx is stale: rerun this test with SPARK_CUDA_WRITE_PTX=1 (and libnvrtc 13.0 on LD_LIBRARY_PATH)"
    );
}
