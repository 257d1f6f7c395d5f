//! The continuous-batching scheduler on the real CPU backend (golden f32 checkpoint): several
//! requests batched together, with prefill chunks mixed into decode steps, produce exactly the
//! reference's single-sequence greedy ids; cancelling a running request frees its KV at once;
//! requests started from the prefix cache give the same ids as without it.

mod common;

use std::sync::{Arc, Mutex};

use backend_cpu::CpuBackend;
use common::*;
use spark_core::scheduler::{Control, Event, FinishReason, Request, Scheduler, SchedulerConfig, Sink};
use spark_core::{Executor, Model, ModelConfig, ModelOptions};

const CKPT: &str = "testdata/golden/m8/ckpt_f32";

fn model() -> (Model<CpuBackend>, ModelConfig) {
    let b = CpuBackend::new(Some(2)).unwrap();
    let m = Model::load(b, &repo().join(CKPT), &ModelOptions::default()).unwrap();
    let cfg = ModelConfig::from_file(&repo().join(CKPT).join("config.json")).unwrap();
    (m, cfg)
}

type Log = Arc<Mutex<Vec<Event>>>;

fn sink(log: &Log) -> Box<dyn Sink> {
    let log = log.clone();
    Box::new(move |e: Event| {
        log.lock().unwrap().push(e);
        Control::Continue
    })
}

fn greedy(prompt: &[u32], n: usize) -> Request {
    Request::greedy(prompt.to_vec(), n)
}

fn tokens(log: &Log) -> Vec<u32> {
    log.lock().unwrap().iter().filter_map(|e| if let Event::Token { id, .. } = e { Some(*id) } else { None }).collect()
}

#[test]
fn batched_greedy_matches_reference_greedy() {
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
    let (mut m, cfg) = model();
    // A small step budget so prefill chunks of one request share steps with decodes of another.
    let sc = SchedulerConfig { max_seqs: 4, step_tokens: 6, kv_budget: 64 << 20, max_queue: 8, prefix_cache: 0 };
    let mut sch = Scheduler::new(sc, cfg, &m);
    let mut cases = vec![];
    for p in ["p0", "p1", "p0"] {
        let ids = gold[&format!("{p}.input_ids")].ids.clone();
        let want = gold[&format!("{p}.greedy_ids")].ids.clone();
        let log = Log::default();
        sch.submit(greedy(&ids, want.len()), sink(&log)).unwrap();
        cases.push((p, want, log));
        // Let the first request start decoding before the others arrive.
        sch.step(&mut m);
    }
    sch.run_to_completion(&mut m);
    for (p, want, log) in &cases {
        assert_eq!(&tokens(log), want, "{p}: batched greedy ids");
        let last = log.lock().unwrap().last().cloned();
        assert!(matches!(last, Some(Event::Finished { reason: FinishReason::Length, .. })), "{p}: {last:?}");
    }
    assert_eq!(m.kv_bytes(), 0, "every sequence released its KV");
    assert_eq!(sch.metrics().kv_reserved, 0);
}

#[test]
fn cancel_frees_kv_at_once() {
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
    let (mut m, cfg) = model();
    let mut sch = Scheduler::new(SchedulerConfig::default(), cfg, &m);
    let ids = gold["p1.input_ids"].ids.clone();
    let a = Log::default();
    let b = Log::default();
    let ha = sch.submit(greedy(&ids, 1000), sink(&a)).unwrap();
    let hb = sch.submit(greedy(&ids, 1000), sink(&b)).unwrap();
    for _ in 0..4 {
        sch.step(&mut m);
    }
    assert!(m.kv_bytes() > 0);
    sch.cancel(ha);
    sch.step(&mut m);
    assert!(m.seq_len(ha).is_none(), "cancelled sequence released");
    assert!(m.kv_bytes() > 0, "the other keeps running");
    sch.cancel(hb);
    sch.step(&mut m);
    assert_eq!(m.kv_bytes(), 0);
    assert!(sch.is_idle());
    for log in [&a, &b] {
        let last = log.lock().unwrap().last().cloned();
        assert!(matches!(last, Some(Event::Finished { reason: FinishReason::Cancelled, .. })), "{last:?}");
    }
}

/// Run one greedy request to the end on `sch`; its ids.
fn run_one(sch: &mut Scheduler, m: &mut Model<CpuBackend>, prompt: &[u32], n: usize, cache_at: &[usize]) -> Vec<u32> {
    let log = Log::default();
    let mut r = greedy(prompt, n);
    r.cache_at = cache_at.to_vec();
    sch.submit(r, sink(&log)).unwrap();
    sch.run_to_completion(m);
    tokens(&log)
}

#[test]
fn prefix_cache_gives_the_same_greedy_ids() {
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
    let (mut m, cfg) = model();
    let sc = SchedulerConfig { max_seqs: 4, step_tokens: 7, kv_budget: 64 << 20, max_queue: 8, prefix_cache: 64 << 20 };
    let mut sch = Scheduler::new(sc.clone(), cfg.clone(), &m);
    // 70 tokens; the sliding window is 16, so a snapshot at 60 holds a ring that wrapped.
    let ids = gold["p2.input_ids"].ids.clone();
    let want = gold["p2.greedy_ids"].ids.clone();
    assert_eq!(run_one(&mut sch, &mut m, &ids, want.len(), &[20, 60, ids.len()]), want);
    let mt = sch.metrics().clone();
    assert_eq!((mt.prefix_cache_entries, mt.prefix_cache_hits), (2, 0), "{mt:?}");
    assert_eq!(mt.kv_in_use, 0, "{mt:?}");
    assert_eq!(m.kv_bytes(), mt.prefix_cache_bytes);
    // The same prompt starts from the 60-token entry.
    assert_eq!(run_one(&mut sch, &mut m, &ids, want.len(), &[]), want);
    let mt = sch.metrics().clone();
    assert_eq!((mt.prefix_cache_hits, mt.prefix_cache_tokens), (1, 60), "{mt:?}");
    // A prompt sharing the first 20 tokens starts from that entry and decodes as without a cache.
    let mut other = ids[..20].to_vec();
    other.extend(&gold["p1.input_ids"].ids);
    let mut plain = Scheduler::new(SchedulerConfig { prefix_cache: 0, ..sc.clone() }, cfg.clone(), &m);
    let reference = run_one(&mut plain, &mut m, &other, 12, &[]);
    assert_eq!(run_one(&mut sch, &mut m, &other, 12, &[]), reference);
    let mt = sch.metrics().clone();
    assert_eq!((mt.prefix_cache_hits, mt.prefix_cache_tokens), (2, 80), "{mt:?}");
    // A prompt that shares less than a whole entry prefills from the start.
    let mut diverging = ids[..19].to_vec();
    diverging.extend(&gold["p1.input_ids"].ids);
    let reference = run_one(&mut plain, &mut m, &diverging, 6, &[]);
    assert_eq!(run_one(&mut sch, &mut m, &diverging, 6, &[]), reference);
    assert_eq!(sch.metrics().prefix_cache_hits, 2);
    // A budget of one entry keeps the most recent one.
    let entry = mt.prefix_cache_bytes / 2;
    drop(sch);
    let mut m = model().0;
    let mut small = Scheduler::new(SchedulerConfig { prefix_cache: entry + entry / 2, ..sc }, cfg, &m);
    run_one(&mut small, &mut m, &ids, 2, &[30, 40]);
    let mt = small.metrics().clone();
    assert_eq!(mt.prefix_cache_entries, 1, "{mt:?}");
    run_one(&mut small, &mut m, &ids, 2, &[]);
    assert_eq!(small.metrics().prefix_cache_tokens, 40, "the 40-token entry was kept");
}
