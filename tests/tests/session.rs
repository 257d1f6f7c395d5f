//! The generation loop's session (spark_core::engine::Session) on the golden f32 checkpoint,
//! whose sliding window (16) is shorter than its prompts: a next turn that shares all but the
//! last token of the previous prompt, after a reply long enough that the live cache cannot be
//! rewound, restarts from the session's snapshot (`keep_snapshot`) instead of from the first
//! token, and generates what a fresh session does.

mod common;

use backend_cpu::CpuBackend;
use common::*;
use spark_core::engine::Session;
use spark_core::sample::Sampler;
use spark_core::{Executor, Model, ModelOptions};

fn model() -> Model<CpuBackend> {
    let b = CpuBackend::new(Some(2)).unwrap();
    Model::load(b, &repo().join("testdata/golden/m8/ckpt_f32"), &ModelOptions::default()).unwrap()
}

fn greedy(s: &mut Session, m: &mut Model<CpuBackend>, prompt: &[u32], n: usize) -> (Vec<u32>, usize) {
    let out = s.generate(m, prompt, n, &mut Sampler::greedy(), &[], &mut |_| true).unwrap();
    (out.tokens, out.prefilled)
}

#[test]
fn next_turn_restarts_from_the_snapshot() {
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
    let first = gold["p2.input_ids"].ids.clone();
    let want = gold["p2.greedy_ids"].ids.clone();
    // The next turn: the previous prompt but its last token, then new tokens.
    let mut next = first[..first.len() - 1].to_vec();
    next.extend(&gold["p1.input_ids"].ids[..12]);

    let mut m = model();
    let mut s = Session::new(1);
    s.keep_snapshot = true;
    let (got, prefilled) = greedy(&mut s, &mut m, &first, want.len());
    assert_eq!(got, want, "turn 1 equals the reference");
    assert_eq!(prefilled, first.len());
    // The reply (20+ tokens) moved the rings past what a rewind to the common prefix needs.
    let (got, prefilled) = greedy(&mut s, &mut m, &next, 8);
    assert_eq!(prefilled, 12, "only the new tokens are prefilled");

    let mut fresh = Session::new(2);
    let (reference, prefilled) = greedy(&mut fresh, &mut m, &next, 8);
    assert_eq!(prefilled, next.len());
    assert_eq!(got, reference, "from the snapshot, the same ids as from scratch");

    // Without a snapshot the same turn prefills everything again.
    let mut plain = Session::new(3);
    greedy(&mut plain, &mut m, &first, want.len());
    assert_eq!(greedy(&mut plain, &mut m, &next, 8).1, next.len());

    // reset() releases the snapshot too.
    s.reset(&mut m);
    assert!(m.seq_len(s.snapshot_id()).is_none() && m.seq_len(1).is_none());
}
