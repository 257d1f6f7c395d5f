//! Golden parity, written once for every backend: the official reference's outputs
//! (`testdata/golden`, a copy of `shared/golden`) loaded, compared, and checked against any
//! step-level [`Executor`]. The cross-crate tests (`tests/tests/`) and the backend crates' own
//! test suites (backend-cuda, backend-wgpu, as a dev-dependency) only build their executor and
//! call these checks with their own tolerances.
//!
//! This library depends on spark-core alone (no backend crate), so any backend crate can take it
//! as a dev-dependency without a cycle.
//!
//! Golden files hold, per prompt `p0`, `p1`, `p2`: `input_ids`, `prefill_logits` (every row),
//! `seq_ids` and `seq_logits_nocache` (prompt + greedy continuation in one uncached pass),
//! `greedy_ids` and `step_logits` (the prompt's last row, then one row per cached decode step),
//! and the same under `bf16.` for the reference run in bf16.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use spark_core::config::LayerType;
use spark_core::gguf::{Value, ValueType};
use spark_core::{Executor, LogitsMode, ModelConfig, SeqStep};

/// The golden prompts.
pub const PROMPTS: [&str; 3] = ["p0", "p1", "p2"];

/// The repository root: `$SPARK_REPO_DIR` where set (scripts/gpu-check.sh runs test executables
/// away from the source tree), else the repository this crate was built from.
pub fn repo() -> PathBuf {
    if let Ok(d) = std::env::var("SPARK_REPO_DIR") {
        return PathBuf::from(d);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// A golden tensor: f32 data (for f32 tensors) or ids (for i64 tensors), and its shape.
pub struct Gold {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
    pub ids: Vec<u32>,
}

/// Every tensor of one golden file, by name.
pub type Golden = HashMap<String, Gold>;

/// Every tensor of a golden.safetensors file.
pub fn load_golden(path: &Path) -> Golden {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e} (set SPARK_REPO_DIR)", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out = HashMap::new();
    for (name, t) in st.tensors() {
        let (data, ids) = match t.dtype() {
            safetensors::Dtype::F32 => {
                (t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(), vec![])
            }
            safetensors::Dtype::I64 => {
                (vec![], t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect())
            }
            other => panic!("unexpected golden dtype {other:?} for {name}"),
        };
        out.insert(name, Gold { shape: t.shape().to_vec(), data, ids });
    }
    out
}

/// The golden outputs of the tiny m8 checkpoints (`testdata/golden/m8/ckpt_f32`, `ckpt_bf16`).
pub fn m8_golden() -> Golden {
    load_golden(&repo().join("testdata/golden/m8/golden.safetensors"))
}

/// Largest |a - b|.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Mean |a - b|.
pub fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

/// Index of the largest value (the first of equals).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// The greedy id of each `vocab`-wide row.
pub fn greedy_ids(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits.chunks(vocab).map(argmax).collect()
}

/// One bf16 ulp at the largest magnitude in `v`.
pub fn bf16_ulp_of_max(v: &[f32]) -> f32 {
    let mag = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    2f32.powi(mag.log2().floor() as i32 - 7)
}

/// Every row of a one-shot prefill of `ids` as sequence `seq` (released afterwards).
pub fn prefill_all(m: &mut dyn Executor, seq: u64, ids: &[u32]) -> Vec<f32> {
    let mut out = vec![0.0; ids.len() * m.info().vocab];
    m.forward(&[SeqStep { seq_id: seq, tokens: ids, start_pos: 0, logits: LogitsMode::All }], &mut out).unwrap();
    m.release(seq);
    out
}

/// Cached path: prefill returning the last row, then one token of `feed` at a time; the rows
/// are concatenated (`1 + feed.len()` of them). Uses sequence 7, released afterwards.
pub fn step_logits(m: &mut dyn Executor, prompt: &[u32], feed: &[u32]) -> Vec<f32> {
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

/// f32 parity on every prompt: prefill logits, no-cache logits and cached step logits each
/// within `tol` (max |diff| < tol), greedy ids exact, and no KV left behind. `label` names the
/// configuration in messages.
pub fn check_f32_parity(m: &mut dyn Executor, gold: &Golden, tol: f32, label: &str) {
    let vocab = m.info().vocab;
    for p in PROMPTS {
        let ids = &gold[&format!("{p}.input_ids")].ids;
        let pre = prefill_all(m, 1, ids);
        let d = max_abs_diff(&pre, &gold[&format!("{p}.prefill_logits")].data);
        eprintln!("{p} prefill_logits: max diff {d:e} ({label})");
        assert!(d < tol, "{p} prefill_logits: max diff {d:e} ({label})");

        let seq_ids = &gold[&format!("{p}.seq_ids")].ids;
        let nc = prefill_all(m, 2, seq_ids);
        let d = max_abs_diff(&nc, &gold[&format!("{p}.seq_logits_nocache")].data);
        eprintln!("{p} seq_logits_nocache: max diff {d:e} ({label})");
        assert!(d < tol, "{p} seq_logits_nocache: max diff {d:e} ({label})");

        let greedy = &gold[&format!("{p}.greedy_ids")].ids;
        let steps = step_logits(m, ids, &greedy[..greedy.len() - 1]);
        let d = max_abs_diff(&steps, &gold[&format!("{p}.step_logits")].data);
        eprintln!("{p} step_logits: max diff {d:e} ({label})");
        assert!(d < tol, "{p} step_logits: max diff {d:e} ({label})");
        assert_eq!(&greedy_ids(&steps, vocab), greedy, "{p} greedy ids ({label})");
    }
    assert_eq!(m.kv_bytes(), 0, "every sequence was released ({label})");
}

/// What [`check_chunked_prefill_batching_and_forks`] also checks while the batch's two
/// sequences are still cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForkCheck {
    /// A fork of p0 after its prefill gives, for the next greedy token, the very same logits
    /// (bit for bit) as the original.
    ContinuesExactly,
    /// A fork of p2 after 40 tokens continues (the rest in one step) within the tolerance of the
    /// one-shot prefill, and rewinding the fork by one token and going again does too.
    MidwayAndRewind,
}

/// On the f32 checkpoint (`gold` = [`m8_golden`]): p2 (70 tokens, window 16) prefilled in chunks
/// of 1, 7, 16, 17 and 40 tokens matches the one-shot prefill within `tol`; p0 (every row) and
/// p1 (last row) in one step match each alone within `tol`; then each of `forks`; at the end
/// every sequence is released and no KV is left.
pub fn check_chunked_prefill_batching_and_forks(m: &mut dyn Executor, gold: &Golden, tol: f32, forks: &[ForkCheck]) {
    let vocab = m.info().vocab;
    let ids = &gold["p2.input_ids"].ids;
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
        assert!(d < tol, "chunk {chunk}: max diff {d:e}");
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
    assert!(d < tol, "batched p0: {d:e}");
    let p1 = &gold["p1.prefill_logits"].data;
    let d = max_abs_diff(&out[a.len() * vocab..], &p1[p1.len() - vocab..]);
    assert!(d < tol, "batched p1 last row: {d:e}");
    assert!(m.kv_bytes() > 0);

    for fork in forks {
        match fork {
            ForkCheck::ContinuesExactly => {
                m.fork(10, 12).unwrap();
                let next = [gold["p0.greedy_ids"].ids[0]];
                let (mut r1, mut r2) = (vec![0.0; vocab], vec![0.0; vocab]);
                let pos = a.len() as u32;
                m.forward(&[SeqStep { seq_id: 10, tokens: &next, start_pos: pos, logits: LogitsMode::Last }], &mut r1)
                    .unwrap();
                m.forward(&[SeqStep { seq_id: 12, tokens: &next, start_pos: pos, logits: LogitsMode::Last }], &mut r2)
                    .unwrap();
                assert_eq!(r1, r2, "forked sequence");
                m.release(12);
            }
            ForkCheck::MidwayAndRewind => {
                let (head, tail) = ids.split_at(40);
                let mut out = vec![0.0; vocab];
                m.forward(&[SeqStep { seq_id: 20, tokens: head, start_pos: 0, logits: LogitsMode::Last }], &mut out)
                    .unwrap();
                m.fork(20, 21).unwrap();
                m.release(20);
                let mut rest = vec![0.0; tail.len() * vocab];
                m.forward(&[SeqStep { seq_id: 21, tokens: tail, start_pos: 40, logits: LogitsMode::All }], &mut rest)
                    .unwrap();
                let d = max_abs_diff(&rest, &want[40 * vocab..]);
                assert!(d < tol, "fork: {d:e}");
                // Rewinding a growing cache and going again.
                let last = ids.len() - 1;
                let mut again = vec![0.0; vocab];
                let step =
                    SeqStep { seq_id: 21, tokens: &ids[last..], start_pos: last as u32, logits: LogitsMode::Last };
                m.forward(&[step], &mut again).unwrap();
                let d = max_abs_diff(&again, &want[last * vocab..]);
                assert!(d < tol, "rewind by one: {d:e}");
                m.release(21);
            }
        }
    }
    m.release(10);
    m.release(11);
    assert_eq!(m.kv_bytes(), 0, "every sequence was released");
}

/// Distance from a bf16 reference over every prompt (prefill logits and cached step logits).
#[derive(Debug, Clone, Copy, Default)]
pub struct Bf16Report {
    /// Largest |ours - reference|.
    pub max: f32,
    /// Largest |ours - reference| of a compared block, in bf16 ulps of that block's largest
    /// reference logit.
    pub max_ulps: f32,
    /// Largest mean |ours - reference| of a compared block.
    pub mean: f32,
    /// Greedy ids (from our step logits) that differ from the reference's.
    pub greedy_disagree: usize,
    /// Where they differ, the largest gap in the reference's own logits between its top id and
    /// ours (0 when every id agrees): small gaps are near-ties that one rounding can flip.
    pub greedy_worst_gap: f32,
}

/// Measures `m` against the `bf16.` outputs of `gold` on every prompt, printing the greedy
/// agreement per prompt (prefixed with `label`).
pub fn bf16_report(m: &mut dyn Executor, gold: &Golden, label: &str) -> Bf16Report {
    let vocab = m.info().vocab;
    let mut r = Bf16Report::default();
    let mut add = |ours: &[f32], want: &[f32]| {
        let d = max_abs_diff(ours, want);
        r.max = r.max.max(d);
        r.max_ulps = r.max_ulps.max(d / bf16_ulp_of_max(want));
        r.mean = r.mean.max(mean_abs_diff(ours, want));
    };
    let mut disagree = 0;
    for p in PROMPTS {
        let ids = &gold[&format!("{p}.input_ids")].ids;
        let pre = prefill_all(m, 1, ids);
        add(&pre, &gold[&format!("{p}.bf16.prefill_logits")].data);
        let greedy = &gold[&format!("{p}.bf16.greedy_ids")].ids;
        let steps = step_logits(m, ids, &greedy[..greedy.len() - 1]);
        add(&steps, &gold[&format!("{p}.bf16.step_logits")].data);
        let ours = greedy_ids(&steps, vocab);
        let want = &gold[&format!("{p}.bf16.step_logits")].data;
        r.greedy_worst_gap = r.greedy_worst_gap.max(greedy_worst_gap(&ours, greedy, want, vocab));
        let agree = ours.iter().zip(greedy).filter(|(a, b)| a == b).count();
        disagree += greedy.len() - agree;
        eprintln!("{label} {p}: greedy agreement with the bf16 reference {agree}/{}", greedy.len());
    }
    r.greedy_disagree = disagree;
    r
}

/// Where greedy ids `ours` differ from the reference's `want`, the largest gap in the
/// reference's logits (`want_logits`, one row of `vocab` per id) between its id and ours; 0 when
/// all agree.
pub fn greedy_worst_gap(ours: &[u32], want: &[u32], want_logits: &[f32], vocab: usize) -> f32 {
    let mut worst = 0.0f32;
    for (i, (&a, &b)) in ours.iter().zip(want).enumerate() {
        if a != b {
            let row = &want_logits[i * vocab..(i + 1) * vocab];
            worst = worst.max(row[b as usize] - row[a as usize]);
        }
    }
    worst
}

/// Tolerances of [`check_bf16_parity`].
#[derive(Debug, Clone, Copy)]
pub struct Bf16Tol {
    /// Largest |ours - reference| allowed (inclusive).
    pub max: f32,
    /// Largest mean |ours - reference| of a block allowed (inclusive).
    pub mean: f32,
    /// Whether every greedy id must equal the reference's, except at near-ties: where one
    /// differs, the reference's own logit of our id must be within [`GREEDY_TIE`] of its top.
    pub greedy_up_to_ties: bool,
}

/// The near-tie bound of [`Bf16Tol::greedy_up_to_ties`]: one bf16 ulp of a logit in [1, 2).
pub const GREEDY_TIE: f32 = 7.8125e-3;

/// The bf16 checkpoint against the bf16 reference ([`bf16_report`]) within `tol`.
pub fn check_bf16_parity(m: &mut dyn Executor, gold: &Golden, tol: Bf16Tol, label: &str) {
    let r = bf16_report(m, gold, label);
    eprintln!(
        "{label}: max |ours - reference bf16| = {:e} (tolerance {:e}), mean {:e} (tolerance {:e})",
        r.max, tol.max, r.mean, tol.mean
    );
    assert!(r.max <= tol.max, "{label}: bf16 max diff {:e}", r.max);
    assert!(r.mean <= tol.mean, "{label}: bf16 mean diff {:e}", r.mean);
    if tol.greedy_up_to_ties {
        eprintln!(
            "{label}: {} greedy id(s) differ; largest reference gap where they do {:e} (near-tie bound {:e})",
            r.greedy_disagree, r.greedy_worst_gap, GREEDY_TIE
        );
        assert!(
            r.greedy_worst_gap <= GREEDY_TIE,
            "{label}: a greedy id differs from the bf16 reference where it is no near-tie (gap {:e})",
            r.greedy_worst_gap
        );
    }
}

/// `spark2_5` metadata for a config, as llama.cpp's converter writes it (GGUF test files).
pub fn gguf_metadata(cfg: &ModelConfig, arch: &str) -> Vec<(String, Value)> {
    let k = |s: &str| format!("{arch}.{s}");
    let u = |v: usize| Value::U32(v as u32);
    let (swa, full) = (cfg.rope_for(LayerType::Sliding), cfg.rope_for(LayerType::Full));
    vec![
        ("general.architecture".to_string(), Value::Str(arch.into())),
        ("general.name".into(), Value::Str("m8".into())),
        (k("block_count"), u(cfg.n_layers)),
        (k("context_length"), u(cfg.max_positions)),
        (k("embedding_length"), u(cfg.hidden)),
        (k("feed_forward_length"), u(cfg.intermediate)),
        (k("attention.head_count"), u(cfg.n_heads)),
        (k("attention.head_count_kv"), u(cfg.n_kv_heads)),
        (k("rope.freq_base"), Value::F32(full.theta as f32)),
        (k("rope.freq_base_swa"), Value::F32(swa.theta as f32)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_eps)),
        (k("attention.key_length"), u(cfg.head_dim)),
        (k("attention.value_length"), u(cfg.head_dim)),
        (k("vocab_size"), u(cfg.vocab)),
        (k("attention.sliding_window"), u(cfg.sliding_window)),
        (
            k("attention.sliding_window_pattern"),
            Value::Array(
                ValueType::Bool,
                cfg.layer_types.iter().map(|&t| Value::Bool(t == LayerType::Sliding)).collect(),
            ),
        ),
        (k("rope.dimension_count"), u(full.rot_dims)),
        (k("rope.dimension_count_swa"), u(swa.rot_dims)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(cfg.bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(cfg.eos[0])),
        ("tokenizer.ggml.padding_token_id".into(), Value::U32(cfg.pad.unwrap_or(2))),
    ]
}

/// The GGUF name of a checkpoint tensor.
pub fn gguf_tensor_name(hf: &str) -> String {
    match hf {
        "model.embedding.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (i, part) = rest.split_once('.').unwrap();
    let g = match part {
        "input_layernorm.weight" => "attn_norm",
        "self_attn.q_k_v_proj.weight" => "attn_qkv",
        "self_attn.g_proj.weight" => "attn_gate",
        "self_attn.out_proj.weight" => "attn_output",
        "post_attention_layernorm.weight" => "ffn_norm",
        "mlp.gate_proj.weight" => "ffn_gate",
        "mlp.up_proj.weight" => "ffn_up",
        "mlp.down_proj.weight" => "ffn_down",
        other => panic!("unexpected tensor {other}"),
    };
    format!("blk.{i}.{g}.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparisons() {
        assert_eq!(max_abs_diff(&[1.0, -2.0, 3.0], &[1.5, -2.0, 2.0]), 1.0);
        assert_eq!(mean_abs_diff(&[1.0, -2.0, 3.0, 0.0], &[1.5, -2.0, 2.0, 0.5]), 0.5);
        assert_eq!(argmax(&[0.0, 3.0, -1.0, 3.0]), 1);
        assert_eq!(greedy_ids(&[0.0, 1.0, 5.0, 2.0, 0.5, 0.1], 3), vec![2, 0]);
        // |x| in [1, 2): one bf16 ulp is 2^-7; in [16, 32): 2^-3.
        assert_eq!(bf16_ulp_of_max(&[0.5, -1.5]), 2f32.powi(-7));
        assert_eq!(bf16_ulp_of_max(&[-20.0, 3.0]), 0.125);
        // Two steps of a 3-token vocabulary; the second disagrees, by a gap of 0.5.
        let logits = [0.0, 1.0, 0.5, 2.0, 1.5, 0.0];
        assert_eq!(greedy_worst_gap(&[1, 0], &[1, 0], &logits, 3), 0.0);
        assert_eq!(greedy_worst_gap(&[1, 1], &[1, 0], &logits, 3), 0.5);
    }

    #[test]
    #[should_panic(expected = "length mismatch")]
    fn comparing_different_lengths_panics() {
        max_abs_diff(&[1.0], &[1.0, 2.0]);
    }

    // The checks can fail: the CPU backend with a small error added where each check looks.

    use backend_cpu::CpuBackend;
    use spark_core::backend::ExecutorInfo;
    use spark_core::{Model, ModelOptions};

    /// An executor whose first logit of every step is off by `by` (only in steps of sequence
    /// `seq`, where given).
    struct Perturbed {
        inner: Model<CpuBackend>,
        seq: Option<u64>,
        by: f32,
    }

    impl Executor for Perturbed {
        fn info(&self) -> ExecutorInfo {
            self.inner.info()
        }
        fn forward(&mut self, batch: &[SeqStep<'_>], out: &mut [f32]) -> spark_core::Result<()> {
            self.inner.forward(batch, out)?;
            if self.seq.is_none_or(|s| batch.iter().any(|b| b.seq_id == s)) {
                out[0] += self.by;
            }
            Ok(())
        }
        fn release(&mut self, seq_id: u64) {
            self.inner.release(seq_id)
        }
        fn fork(&mut self, src: u64, dst: u64) -> spark_core::Result<()> {
            self.inner.fork(src, dst)
        }
        fn seq_len(&self, seq_id: u64) -> Option<usize> {
            self.inner.seq_len(seq_id)
        }
        fn kv_bytes(&self) -> usize {
            self.inner.kv_bytes()
        }
    }

    fn perturbed(ckpt: &str, seq: Option<u64>, by: f32) -> Perturbed {
        let b = CpuBackend::new(Some(2)).unwrap();
        let inner = Model::load(b, &repo().join("testdata/golden/m8").join(ckpt), &ModelOptions::default()).unwrap();
        Perturbed { inner, seq, by }
    }

    #[test]
    #[should_panic(expected = "p0 prefill_logits")]
    fn f32_parity_catches_an_error_above_its_tolerance() {
        check_f32_parity(&mut perturbed("ckpt_f32", None, 1e-4), &m8_golden(), 1e-5, "perturbed");
    }

    #[test]
    #[should_panic(expected = "forked sequence")]
    fn fork_check_catches_a_fork_that_differs_by_a_little() {
        let mut m = perturbed("ckpt_f32", Some(12), 1e-6);
        check_chunked_prefill_batching_and_forks(&mut m, &m8_golden(), 1e-5, &[ForkCheck::ContinuesExactly]);
    }

    #[test]
    #[should_panic(expected = "fork:")]
    fn midway_fork_check_catches_an_error_above_its_tolerance() {
        let mut m = perturbed("ckpt_f32", Some(21), 1e-4);
        check_chunked_prefill_batching_and_forks(&mut m, &m8_golden(), 1e-5, &[ForkCheck::MidwayAndRewind]);
    }

    #[test]
    #[should_panic(expected = "bf16 max diff")]
    fn bf16_parity_catches_an_error_above_its_tolerance() {
        let tol = Bf16Tol { max: 1.6e-2, mean: 1.5e-3, greedy_up_to_ties: false };
        check_bf16_parity(&mut perturbed("ckpt_bf16", None, 0.1), &m8_golden(), tol, "perturbed");
    }
}
