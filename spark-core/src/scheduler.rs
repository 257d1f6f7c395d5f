//! Continuous batching over any [`Executor`].
//!
//! A [`Scheduler`] holds a queue of requests and the sequences running on the executor. Each
//! [`step`](Scheduler::step) builds **one** batched `forward` that mixes one decode token for
//! every running sequence with prefill chunks of sequences still reading their prompt, within a
//! per-step token budget ([`SchedulerConfig::step_tokens`]); then it samples one token for every
//! sequence that produced logits and reports it to that request's [`Sink`].
//!
//! Admission: a request reserves the KV bytes its longest possible sequence needs
//! ([`sequence_kv_bytes`] at `prompt + max_tokens`, sliding layers bounded by their window) and
//! starts only when the reservation fits the budget and fewer than `max_seqs` run; otherwise it
//! waits in the queue, and beyond `max_queue` waiting requests it is rejected. A request that
//! could never fit is rejected at once.
//!
//! Prefix cache ([`SchedulerConfig::prefix_cache`] bytes; 0 turns it off): when a sequence's
//! prefill reaches one of its request's [`Request::cache_at`] points, a copy of its KV
//! ([`Executor::fork`]) is kept under those prompt tokens. A later request whose prompt starts
//! with a kept entry (and is longer) starts from a copy of it and prefills only the rest. Only
//! whole entries are reused: a sliding layer's ring cannot be rewound past what it overwrote.
//! Entries are evicted least recently used first; their bytes count against `prefix_cache`,
//! not against `kv_budget`.
//!
//! Cancellation: [`Scheduler::cancel`], a sink whose [`Sink::cancelled`] turns true (a client
//! that went away), or a sink returning [`Control::Stop`] ends the request at the next step and
//! releases its KV at once.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::backend::{Executor, LogitsMode, SeqStep};
use crate::config::ModelConfig;
use crate::constraint::Constraint;
use crate::dtype::DType;
use crate::kv::sequence_kv_bytes;
use crate::sample::{logsumexp, top_logprobs, Sampler, SamplingParams};

/// Limits of a scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most sequences running at once.
    pub max_seqs: usize,
    /// Most tokens (decode tokens plus prefill chunks) in one step.
    pub step_tokens: usize,
    /// KV bytes the running sequences may reserve together.
    pub kv_budget: usize,
    /// Most requests waiting in the queue; more are rejected.
    pub max_queue: usize,
    /// KV bytes the prefix cache may hold (0: no cache).
    pub prefix_cache: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig { max_seqs: 16, step_tokens: 256, kv_budget: 512 << 20, max_queue: 64, prefix_cache: 0 }
    }
}

/// One kept prefix: a copy of a sequence's KV after `tokens`.
struct CacheEntry {
    /// The executor's sequence id holding the copy.
    id: u64,
    tokens: Vec<u32>,
    bytes: usize,
    /// When it was last made or used (the scheduler's step counter).
    used: u64,
}

/// What a request asks for.
#[derive(Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Most tokens to generate (clamped to what the context leaves).
    pub max_tokens: usize,
    /// Ids that end generation (EOS and others); they are reported with `stop: true`.
    pub stop_ids: Vec<u32>,
    /// `Some(n)`: report the chosen token's log-probability and the `n` most likely tokens.
    pub logprobs: Option<usize>,
    /// TEST HOOK: when not empty, these tokens are emitted in order instead of sampled ones
    /// (the model still runs on them), and the request ends with them. Lets a server test drive
    /// a known output through the real decode and parse path. Empty in normal use.
    pub script: Vec<u32>,
    /// The first generated tokens, emitted as given instead of sampled (e.g. the start of a tool
    /// call the caller requires); sampling takes over after them. Empty in most requests.
    pub prefix: Vec<u32>,
    /// `(token, bias)`: added to the token's logit before sampling and log-probabilities
    /// (OpenAI `logit_bias`; -100 all but bans a token, +100 all but forces it).
    pub logit_bias: Vec<(u32, f32)>,
    /// Which tokens may come next (JSON output, tool calls held to their schemas); `None` for
    /// free generation.
    pub constraint: Constrain,
    /// Prompt positions after which the sequence's KV is worth keeping for later requests
    /// (e.g. the end of the system block, the start of the reply); see the module docs.
    pub cache_at: Vec<usize>,
}

/// A request's [`Constraint`], if any.
#[derive(Default)]
pub struct Constrain(pub Option<Box<dyn Constraint>>);

impl std::fmt::Debug for Constrain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Constrain(Some(..))" } else { "Constrain(None)" })
    }
}

impl Request {
    /// A greedy request for `max_tokens` tokens with no stop ids, logprobs or script.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
        Request {
            prompt,
            params: SamplingParams::greedy(),
            max_tokens,
            stop_ids: vec![],
            logprobs: None,
            script: vec![],
            prefix: vec![],
            logit_bias: vec![],
            constraint: Constrain::default(),
            cache_at: vec![],
        }
    }
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id was produced, or the sink asked to stop (a stop string matched).
    Stop,
    /// `max_tokens` were produced or the context is full.
    Length,
    /// Cancelled, or the client went away.
    Cancelled,
}

/// What a sink hears about its request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token. `stop`: it is a stop id (the request finishes right after).
    Token { id: u32, logprob: Option<f32>, top: Vec<(u32, f32)>, stop: bool },
    /// The request ended (always the last event unless [`Event::Error`] came instead).
    Finished { reason: FinishReason, prompt_tokens: usize, completion_tokens: usize },
    /// The executor failed on this request; it has ended.
    Error(String),
}

/// A sink's answer to a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    Continue,
    /// End the request now (finish reason `Stop`).
    Stop,
    /// Use this token as the next one instead of sampling (e.g. force `</think>`).
    ForceNext(u32),
}

/// Where a request's events go.
pub trait Sink: Send {
    fn event(&mut self, e: Event) -> Control;
    /// Whether the consumer is gone; checked every step, even before the first token.
    fn cancelled(&self) -> bool {
        false
    }
}

/// Any `FnMut(Event) -> Control` is a sink.
impl<F: FnMut(Event) -> Control + Send> Sink for F {
    fn event(&mut self, e: Event) -> Control {
        self(e)
    }
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the request queue is full ({0} waiting); retry later")]
    QueueFull(usize),
    #[error("the request needs {need} bytes of KV cache but the whole budget is {budget} bytes")]
    TooLarge { need: usize, budget: usize },
    #[error("the prompt has {len} tokens; the context holds {ctx} (at least one token must be left to generate)")]
    PromptTooLong { len: usize, ctx: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(String),
}

/// Counters and gauges for monitoring.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    pub requests_submitted: u64,
    pub requests_rejected: u64,
    pub requests_finished: u64,
    pub requests_cancelled: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub steps: u64,
    pub step_seconds_total: f64,
    pub last_step_seconds: f64,
    pub queue_depth: usize,
    pub running: usize,
    /// KV bytes reserved by running sequences.
    pub kv_reserved: usize,
    /// KV bytes the executor reports in use by requests (the prefix cache excluded).
    pub kv_in_use: usize,
    /// KV bytes held by the prefix cache, and its entries.
    pub prefix_cache_bytes: usize,
    pub prefix_cache_entries: usize,
    /// Requests that started from a cached prefix, and the prompt tokens they did not prefill.
    pub prefix_cache_hits: u64,
    pub prefix_cache_tokens: u64,
}

struct Seq {
    handle: u64,
    req: Request,
    sink: Box<dyn Sink>,
    sampler: Sampler,
    reserve: usize,
    /// Running (holding its reservation), not queued.
    admitted: bool,
    /// Prompt tokens already fed.
    fed: usize,
    generated: Vec<u32>,
    /// A sampled token not yet fed to the executor.
    pending: Option<u32>,
    forced: Option<u32>,
    /// Prompt positions still to snapshot into the prefix cache, ascending.
    cache_points: Vec<usize>,
}

/// The continuous-batching scheduler. See the module docs.
pub struct Scheduler {
    cfg: SchedulerConfig,
    model: ModelConfig,
    ctx: usize,
    vocab: usize,
    kv_dtype: DType,
    queue: VecDeque<Seq>,
    running: Vec<Seq>,
    next_handle: u64,
    reserved: usize,
    /// Requests to end at the next step, and why (cancelled, or a stop string the caller found).
    cancels: Vec<(u64, FinishReason)>,
    metrics: Metrics,
    cache: Vec<CacheEntry>,
    cache_bytes: usize,
    next_cache_id: u64,
}

/// Executor sequence ids of prefix-cache entries start here (request handles count from 1).
const CACHE_IDS: u64 = 1 << 62;

impl Scheduler {
    /// A scheduler for `exec`, which runs `model`.
    pub fn new(cfg: SchedulerConfig, model: ModelConfig, exec: &dyn Executor) -> Scheduler {
        let info = exec.info();
        Scheduler {
            cfg,
            model,
            ctx: info.ctx,
            vocab: info.vocab,
            kv_dtype: info.dtype,
            queue: VecDeque::new(),
            running: Vec::new(),
            next_handle: 1,
            reserved: 0,
            cancels: Vec::new(),
            metrics: Metrics::default(),
            cache: Vec::new(),
            cache_bytes: 0,
            next_cache_id: CACHE_IDS,
        }
    }

    /// The served context.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// KV bytes a sequence of `len` tokens needs.
    pub fn kv_bytes_for(&self, len: usize) -> usize {
        sequence_kv_bytes(&self.model, self.ctx, self.kv_dtype, len.min(self.ctx))
    }

    /// Queue a request. Returns its handle (for [`cancel`](Self::cancel)).
    pub fn submit(&mut self, mut req: Request, sink: Box<dyn Sink>) -> Result<u64, SubmitError> {
        let sampler = Sampler::new(req.params)
            .map_err(|e| SubmitError::InvalidParams(e.to_string()))
            .and_then(|s| self.check(&mut req).map(|()| s));
        let sampler = match sampler {
            Ok(s) => s,
            Err(e) => {
                self.metrics.requests_rejected += 1;
                return Err(e);
            }
        };
        let handle = self.next_handle;
        self.next_handle += 1;
        let reserve = self.kv_bytes_for(req.prompt.len() + req.max_tokens);
        let mut cache_points: Vec<usize> = if self.cfg.prefix_cache > 0 {
            req.cache_at.iter().copied().filter(|&p| p > 0 && p < req.prompt.len()).collect()
        } else {
            vec![]
        };
        cache_points.sort_unstable();
        cache_points.dedup();
        self.metrics.requests_submitted += 1;
        self.queue.push_back(Seq {
            handle,
            req,
            sink,
            sampler,
            reserve,
            admitted: false,
            fed: 0,
            generated: Vec::new(),
            pending: None,
            forced: None,
            cache_points,
        });
        self.metrics.queue_depth = self.queue.len();
        Ok(handle)
    }

    fn check(&self, req: &mut Request) -> Result<(), SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.prompt.len() >= self.ctx {
            return Err(SubmitError::PromptTooLong { len: req.prompt.len(), ctx: self.ctx });
        }
        if let Some(&(bad, _)) = req.logit_bias.iter().find(|&&(t, _)| t as usize >= self.vocab) {
            return Err(SubmitError::InvalidParams(format!(
                "logit_bias names token id {bad}, outside the vocabulary ({})",
                self.vocab
            )));
        }
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(SubmitError::InvalidParams(format!(
                "token id {bad} is outside the vocabulary ({})",
                self.vocab
            )));
        }
        req.max_tokens = req.max_tokens.min(self.ctx - req.prompt.len());
        let need = self.kv_bytes_for(req.prompt.len() + req.max_tokens);
        if need > self.cfg.kv_budget {
            return Err(SubmitError::TooLarge { need, budget: self.cfg.kv_budget });
        }
        if self.queue.len() >= self.cfg.max_queue {
            return Err(SubmitError::QueueFull(self.queue.len()));
        }
        Ok(())
    }

    /// End a request (queued or running) at the next step; its KV is released then.
    pub fn cancel(&mut self, handle: u64) {
        self.cancels.push((handle, FinishReason::Cancelled));
    }

    /// End a request at the next step as finished normally ([`FinishReason::Stop`]: a stop
    /// string its caller matched in the text), not as cancelled.
    pub fn stop(&mut self, handle: u64) {
        self.cancels.push((handle, FinishReason::Stop));
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty()
    }

    /// Requests waiting, sequences running.
    pub fn load(&self) -> (usize, usize) {
        (self.queue.len(), self.running.len())
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Refresh the gauges (queue, running, KV) from the executor.
    pub fn refresh_metrics(&mut self, exec: &dyn Executor) {
        self.metrics.queue_depth = self.queue.len();
        self.metrics.running = self.running.len();
        self.metrics.kv_reserved = self.reserved;
        self.metrics.kv_in_use = exec.kv_bytes().saturating_sub(self.cache_bytes);
        self.metrics.prefix_cache_bytes = self.cache_bytes;
        self.metrics.prefix_cache_entries = self.cache.len();
    }

    /// Start `s` from the longest cached prefix of its prompt, if any.
    fn start_from_cache(&mut self, exec: &mut dyn Executor, s: &mut Seq) {
        let prompt = &s.req.prompt;
        let best = self
            .cache
            .iter_mut()
            .filter(|e| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|e| e.tokens.len());
        let Some(e) = best else { return };
        if exec.fork(e.id, s.handle).is_err() {
            exec.release(s.handle);
            return;
        }
        e.used = self.metrics.steps;
        s.fed = e.tokens.len();
        s.cache_points.retain(|&p| p > s.fed);
        self.metrics.prefix_cache_hits += 1;
        self.metrics.prefix_cache_tokens += s.fed as u64;
    }

    /// Keep a copy of sequence `handle`'s KV, which holds `tokens`, in the prefix cache.
    fn snapshot(&mut self, exec: &mut dyn Executor, handle: u64, tokens: &[u32]) {
        if let Some(e) = self.cache.iter_mut().find(|e| e.tokens == tokens) {
            e.used = self.metrics.steps;
            return;
        }
        let id = self.next_cache_id;
        self.next_cache_id += 1;
        let before = exec.kv_bytes();
        if exec.fork(handle, id).is_err() {
            exec.release(id);
            return;
        }
        let bytes = exec.kv_bytes().saturating_sub(before);
        self.cache.push(CacheEntry { id, tokens: tokens.to_vec(), bytes, used: self.metrics.steps });
        self.cache_bytes += bytes;
        while self.cache_bytes > self.cfg.prefix_cache {
            let Some(i) = self.cache.iter().enumerate().min_by_key(|(_, e)| e.used).map(|(i, _)| i) else { break };
            let e = self.cache.swap_remove(i);
            exec.release(e.id);
            self.cache_bytes -= e.bytes;
        }
    }

    /// Drop cancelled requests, releasing their KV.
    fn reap(&mut self, exec: &mut dyn Executor) {
        let cancels = std::mem::take(&mut self.cancels);
        let gone = |s: &Seq| {
            cancels
                .iter()
                .find(|&&(h, _)| h == s.handle)
                .map(|&(_, r)| r)
                .or(s.sink.cancelled().then_some(FinishReason::Cancelled))
        };
        let mut i = 0;
        while i < self.queue.len() {
            if let Some(reason) = gone(&self.queue[i]) {
                if let Some(s) = self.queue.remove(i) {
                    self.finish(exec, s, reason);
                }
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if let Some(reason) = gone(&self.running[i]) {
                let s = self.running.remove(i);
                self.finish(exec, s, reason);
            } else {
                i += 1;
            }
        }
    }

    fn finish(&mut self, exec: &mut dyn Executor, mut s: Seq, reason: FinishReason) {
        exec.release(s.handle);
        if s.admitted {
            self.reserved = self.reserved.saturating_sub(s.reserve);
        }
        self.metrics.requests_finished += 1;
        if reason == FinishReason::Cancelled {
            self.metrics.requests_cancelled += 1;
        }
        self.metrics.completion_tokens += s.generated.len() as u64;
        let e = Event::Finished { reason, prompt_tokens: s.req.prompt.len(), completion_tokens: s.generated.len() };
        s.sink.event(e);
    }

    fn fail(&mut self, exec: &mut dyn Executor, mut s: Seq, msg: String) {
        exec.release(s.handle);
        self.reserved = self.reserved.saturating_sub(s.reserve);
        self.metrics.requests_finished += 1;
        s.sink.event(Event::Error(msg));
    }

    /// Move queued requests to running while they fit.
    fn admit(&mut self, exec: &mut dyn Executor) {
        while self.running.len() < self.cfg.max_seqs {
            let Some(front) = self.queue.front() else { break };
            if self.reserved + front.reserve > self.cfg.kv_budget {
                break;
            }
            let Some(mut s) = self.queue.pop_front() else { break };
            self.reserved += s.reserve;
            s.admitted = true;
            if !self.cache.is_empty() {
                self.start_from_cache(exec, &mut s);
            }
            self.metrics.prompt_tokens += s.req.prompt.len() as u64;
            self.running.push(s);
        }
    }

    /// Run one step: admit, build one batch, forward, sample, report. Returns the number of
    /// tokens run (0 when there was nothing to do).
    pub fn step(&mut self, exec: &mut dyn Executor) -> usize {
        let t0 = Instant::now();
        self.reap(exec);
        self.admit(exec);
        // Plan: decode tokens first, then prefill chunks in arrival order.
        let mut budget = self.cfg.step_tokens.max(1);
        let mut plan: Vec<(usize, usize, usize, bool)> = Vec::new(); // (running idx, from, len, logits)
        for (i, s) in self.running.iter().enumerate() {
            if s.pending.is_some() {
                plan.push((i, 0, 1, true));
                budget = budget.saturating_sub(1);
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if s.pending.is_none() && s.fed < s.req.prompt.len() && budget > 0 {
                let mut n = (s.req.prompt.len() - s.fed).min(budget);
                // A chunk ends at the next cache point, so the snapshot holds just the prefix.
                if let Some(&p) = s.cache_points.first() {
                    n = n.min(p - s.fed);
                }
                budget -= n;
                plan.push((i, s.fed, n, s.fed + n == s.req.prompt.len()));
            }
        }
        if plan.is_empty() {
            self.refresh_metrics(exec);
            return 0;
        }
        let pending: Vec<[u32; 1]> = self.running.iter().map(|s| [s.pending.unwrap_or(0)]).collect();
        let batch: Vec<SeqStep<'_>> = plan
            .iter()
            .map(|&(i, from, n, logits)| {
                let s = &self.running[i];
                let logits = if logits { LogitsMode::Last } else { LogitsMode::None };
                if s.pending.is_some() {
                    let pos = s.req.prompt.len() + s.generated.len() - 1;
                    SeqStep { seq_id: s.handle, tokens: &pending[i], start_pos: pos as u32, logits }
                } else {
                    SeqStep { seq_id: s.handle, tokens: &s.req.prompt[from..from + n], start_pos: from as u32, logits }
                }
            })
            .collect();
        let rows = plan.iter().filter(|p| p.3).count();
        let mut out = vec![0.0f32; rows * self.vocab];
        let n_tokens: usize = plan.iter().map(|p| p.2).sum();
        let result = exec.forward(&batch, &mut out);
        drop(batch);
        if let Err(e) = result {
            // Fail every sequence of the batch; the executor may hold partial state for them.
            let mut idx: Vec<usize> = plan.iter().map(|p| p.0).collect();
            idx.sort_unstable();
            for &i in idx.iter().rev() {
                let s = self.running.remove(i);
                self.fail(exec, s, format!("the model failed on this step: {e}"));
            }
            self.refresh_metrics(exec);
            return n_tokens;
        }
        // Apply the step to each sequence; collect the ones that finish.
        let mut done: Vec<(usize, FinishReason)> = Vec::new();
        let mut snapshots: Vec<(u64, usize, usize)> = Vec::new(); // (handle, running idx, tokens)
        let mut row = 0;
        for &(i, _, n, logits) in &plan {
            let s = &mut self.running[i];
            if s.pending.take().is_none() {
                s.fed += n;
                if s.cache_points.first() == Some(&s.fed) {
                    s.cache_points.remove(0);
                    snapshots.push((s.handle, i, s.fed));
                }
            }
            if !logits {
                continue;
            }
            let logits_row = &mut out[row * self.vocab..(row + 1) * self.vocab];
            row += 1;
            if let Some(r) = s.sample_and_report(logits_row, self.ctx) {
                done.push((i, r));
            }
        }
        for (handle, i, n) in snapshots {
            let tokens = self.running[i].req.prompt[..n].to_vec();
            self.snapshot(exec, handle, &tokens);
        }
        done.sort_unstable_by_key(|d| d.0);
        for &(i, reason) in done.iter().rev() {
            let s = self.running.remove(i);
            self.finish(exec, s, reason);
        }
        let dt = t0.elapsed();
        self.record_step(dt);
        self.refresh_metrics(exec);
        n_tokens
    }

    fn record_step(&mut self, dt: Duration) {
        self.metrics.steps += 1;
        self.metrics.last_step_seconds = dt.as_secs_f64();
        self.metrics.step_seconds_total += dt.as_secs_f64();
    }

    /// Run until nothing is queued or running.
    pub fn run_to_completion(&mut self, exec: &mut dyn Executor) {
        while !self.is_idle() {
            self.step(exec);
        }
    }
}

impl Seq {
    /// Sample a token the request's constraint allows: sample, and while the token is refused
    /// ban it and sample again; after 8 refusals ban every refused token and sample once more.
    /// `None` when the constraint allows no token at all.
    fn sample_allowed(&mut self, logits: &mut [f32]) -> Option<u32> {
        let Some(c) = self.req.constraint.0.as_ref() else {
            return Some(self.sampler.sample(logits, &self.req.prompt, &self.generated));
        };
        // The logits with the bans so far (the sampler changes the slice it is given).
        let mut banned = logits.to_vec();
        for _ in 0..8 {
            let t = self.sampler.sample(logits, &self.req.prompt, &self.generated);
            if c.allows(t) {
                return Some(t);
            }
            banned[t as usize] = f32::NEG_INFINITY;
            logits.copy_from_slice(&banned);
        }
        for (t, l) in banned.iter_mut().enumerate() {
            if *l != f32::NEG_INFINITY && !c.allows(t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        if banned.iter().all(|&l| l == f32::NEG_INFINITY) {
            return None;
        }
        logits.copy_from_slice(&banned);
        let t = self.sampler.sample(logits, &self.req.prompt, &self.generated);
        c.allows(t).then_some(t)
    }

    /// Sample the next token from `logits`, report it, and say whether the request ends.
    fn sample_and_report(&mut self, logits: &mut [f32], ctx: usize) -> Option<FinishReason> {
        for &(t, b) in &self.req.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        let n = self.generated.len();
        let scripted = self.req.script.get(n).or_else(|| self.req.prefix.get(n)).copied();
        let (lp_info, tok) = match self.forced.take().or(scripted) {
            Some(t) => {
                let lp = self.req.logprobs.map(|n| {
                    let lse = logsumexp(logits);
                    (logits.get(t as usize).map_or(f32::NEG_INFINITY, |l| l - lse), top_logprobs(logits, n))
                });
                (lp, t)
            }
            None => {
                let lp = self.req.logprobs.map(|n| (logsumexp(logits), top_logprobs(logits, n)));
                let raw = lp.as_ref().map(|_| logits.to_vec());
                // Nothing the constraint allows (it always leaves a way to go on or end): end.
                let Some(tok) = self.sample_allowed(logits) else { return Some(FinishReason::Stop) };
                let lp = lp.zip(raw).map(|((lse, top), raw)| (raw[tok as usize] - lse, top));
                (lp, tok)
            }
        };
        if let Some(c) = self.req.constraint.0.as_mut() {
            c.advance(tok);
        }
        self.generated.push(tok);
        let stop = self.req.stop_ids.contains(&tok);
        let (logprob, top) = match lp_info {
            Some((l, t)) => (Some(l), t),
            None => (None, vec![]),
        };
        let ctl = self.sink.event(Event::Token { id: tok, logprob, top, stop });
        if self.sink.cancelled() {
            return Some(FinishReason::Cancelled);
        }
        if stop || (!self.req.script.is_empty() && self.generated.len() >= self.req.script.len()) {
            return Some(FinishReason::Stop);
        }
        match ctl {
            Control::Stop => return Some(FinishReason::Stop),
            Control::ForceNext(t) => self.forced = Some(t),
            Control::Continue => {}
        }
        if self.generated.len() >= self.req.max_tokens || self.req.prompt.len() + self.generated.len() >= ctx {
            return Some(FinishReason::Length);
        }
        self.pending = Some(tok);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ExecutorInfo;
    use crate::error::{Error, Result};
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    const VOCAB: usize = 16;

    /// A deterministic executor: the next token is a hash of the whole sequence so far.
    #[derive(Default)]
    struct Fake {
        seqs: HashMap<u64, Vec<u32>>,
        batches: Vec<usize>,
        fail_on: Option<u32>,
    }

    fn next_of(toks: &[u32]) -> usize {
        toks.iter().fold(7usize, |h, &t| (h * 31 + t as usize + 1) % 1009) % VOCAB
    }

    impl Executor for Fake {
        fn info(&self) -> ExecutorInfo {
            ExecutorInfo { backend: "fake".into(), vocab: VOCAB, ctx: 64, dtype: DType::F32 }
        }
        fn forward(&mut self, batch: &[SeqStep<'_>], out: &mut [f32]) -> Result<()> {
            self.batches.push(batch.len());
            let mut row = 0;
            for s in batch {
                if Some(s.tokens[0]) == self.fail_on {
                    return Err(Error::invalid("poisoned token"));
                }
                let seq = self.seqs.entry(s.seq_id).or_default();
                if s.start_pos as usize != seq.len() {
                    return Err(Error::invalid("bad start_pos"));
                }
                seq.extend_from_slice(s.tokens);
                if s.logits == LogitsMode::Last {
                    let r = &mut out[row * VOCAB..(row + 1) * VOCAB];
                    r.fill(0.0);
                    r[next_of(seq)] = 5.0;
                    row += 1;
                }
            }
            Ok(())
        }
        fn release(&mut self, seq_id: u64) {
            self.seqs.remove(&seq_id);
        }
        fn fork(&mut self, src: u64, dst: u64) -> Result<()> {
            let s = self.seqs.get(&src).cloned().unwrap_or_default();
            self.seqs.insert(dst, s);
            Ok(())
        }
        fn seq_len(&self, seq_id: u64) -> Option<usize> {
            self.seqs.get(&seq_id).map(Vec::len)
        }
        fn kv_bytes(&self) -> usize {
            self.seqs.values().map(|s| s.len() * 8).sum()
        }
    }

    fn model() -> ModelConfig {
        let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/golden/m8/ckpt_f32/config.json");
        ModelConfig::from_file(std::path::Path::new(p)).unwrap()
    }

    fn greedy_reference(prompt: &[u32], n: usize) -> Vec<u32> {
        let mut seq = prompt.to_vec();
        let mut out = vec![];
        for _ in 0..n {
            let t = next_of(&seq) as u32;
            out.push(t);
            seq.push(t);
        }
        out
    }

    type Log = Arc<Mutex<Vec<Event>>>;

    fn sink(log: &Log) -> Box<dyn Sink> {
        let log = log.clone();
        Box::new(move |e: Event| {
            log.lock().unwrap().push(e);
            Control::Continue
        })
    }

    fn req(prompt: Vec<u32>, n: usize) -> Request {
        Request::greedy(prompt, n)
    }

    fn tokens(log: &Log) -> Vec<u32> {
        log.lock()
            .unwrap()
            .iter()
            .filter_map(|e| if let Event::Token { id, .. } = e { Some(*id) } else { None })
            .collect()
    }

    fn finished(log: &Log) -> Option<FinishReason> {
        log.lock()
            .unwrap()
            .iter()
            .find_map(|e| if let Event::Finished { reason, .. } = e { Some(*reason) } else { None })
    }

    #[test]
    fn batched_greedy_equals_single_sequence() {
        let mut exec = Fake::default();
        let cfg = SchedulerConfig { step_tokens: 5, ..Default::default() };
        let mut sch = Scheduler::new(cfg, model(), &exec);
        let prompts: Vec<Vec<u32>> = vec![(0..12).collect(), vec![3, 1, 4], (5..14).rev().collect(), vec![9]];
        let logs: Vec<Log> = prompts.iter().map(|_| Log::default()).collect();
        for (p, l) in prompts.iter().zip(&logs) {
            sch.submit(req(p.clone(), 10), sink(l)).unwrap();
        }
        sch.run_to_completion(&mut exec);
        for (p, l) in prompts.iter().zip(&logs) {
            assert_eq!(tokens(l), greedy_reference(p, 10));
            assert_eq!(finished(l), Some(FinishReason::Length));
        }
        assert!(exec.batches.iter().any(|&b| b > 1), "some steps were batched");
        assert_eq!(exec.kv_bytes(), 0);
        assert_eq!(sch.metrics().completion_tokens, 40);
        assert_eq!(sch.metrics().kv_reserved, 0);
    }

    #[test]
    fn a_stop_found_by_the_caller_ends_as_stop_not_cancelled() {
        let mut exec = Fake::default();
        let mut sch = Scheduler::new(SchedulerConfig::default(), model(), &exec);
        let a = Log::default();
        let h = sch.submit(req(vec![1, 2, 3], 50), sink(&a)).unwrap();
        for _ in 0..3 {
            sch.step(&mut exec);
        }
        sch.stop(h);
        sch.step(&mut exec);
        assert_eq!(exec.kv_bytes(), 0);
        assert!(sch.is_idle());
        assert_eq!(finished(&a), Some(FinishReason::Stop));
        assert_eq!(sch.metrics().requests_cancelled, 0);
        assert_eq!(sch.metrics().requests_finished, 1);
    }

    #[test]
    fn cancel_and_disconnect_free_kv() {
        let mut exec = Fake::default();
        let mut sch = Scheduler::new(SchedulerConfig::default(), model(), &exec);
        let a = Log::default();
        let h = sch.submit(req(vec![1, 2, 3], 50), sink(&a)).unwrap();
        struct Gone(Arc<Mutex<bool>>, Log);
        impl Sink for Gone {
            fn event(&mut self, e: Event) -> Control {
                self.1.lock().unwrap().push(e);
                Control::Continue
            }
            fn cancelled(&self) -> bool {
                *self.0.lock().unwrap()
            }
        }
        let flag = Arc::new(Mutex::new(false));
        let b = Log::default();
        sch.submit(req(vec![4, 5], 50), Box::new(Gone(flag.clone(), b.clone()))).unwrap();
        for _ in 0..3 {
            sch.step(&mut exec);
        }
        assert!(exec.kv_bytes() > 0);
        sch.cancel(h);
        *flag.lock().unwrap() = true;
        sch.step(&mut exec);
        assert_eq!(exec.kv_bytes(), 0);
        assert!(sch.is_idle());
        assert_eq!(finished(&a), Some(FinishReason::Cancelled));
        assert_eq!(finished(&b), Some(FinishReason::Cancelled));
        assert_eq!(sch.metrics().kv_reserved, 0);
    }

    #[test]
    fn admission_queue_and_rejections() {
        let exec = Fake::default();
        let m = model();
        let one = Scheduler::new(SchedulerConfig::default(), m.clone(), &exec).kv_bytes_for(20);
        let cfg =
            SchedulerConfig { kv_budget: one + one / 2, max_queue: 2, max_seqs: 4, step_tokens: 64, prefix_cache: 0 };
        let mut exec = Fake::default();
        let mut sch = Scheduler::new(cfg, m, &exec);
        let logs: Vec<Log> = (0..3).map(|_| Log::default()).collect();
        sch.submit(req(vec![1; 10], 10), sink(&logs[0])).unwrap();
        sch.submit(req(vec![2; 10], 10), sink(&logs[1])).unwrap();
        sch.step(&mut exec);
        assert_eq!(sch.load(), (1, 1), "the second waits for KV budget");
        assert!(sch.submit(req(vec![3; 10], 10), sink(&logs[2])).is_ok());
        assert!(matches!(sch.submit(req(vec![3; 10], 10), sink(&logs[2])), Err(SubmitError::QueueFull(_))));
        assert!(matches!(sch.submit(req(vec![1; 40], 20), sink(&logs[2])), Err(SubmitError::TooLarge { .. })));
        assert!(matches!(sch.submit(req(vec![1; 64], 1), sink(&logs[2])), Err(SubmitError::PromptTooLong { .. })));
        assert!(matches!(sch.submit(req(vec![], 1), sink(&logs[2])), Err(SubmitError::EmptyPrompt)));
        assert!(matches!(sch.submit(req(vec![99], 1), sink(&logs[2])), Err(SubmitError::InvalidParams(_))));
        let mut bad = req(vec![1], 1);
        bad.params.top_p = 2.0;
        assert!(matches!(sch.submit(bad, sink(&logs[2])), Err(SubmitError::InvalidParams(m)) if m.contains("top_p")));
        sch.run_to_completion(&mut exec);
        assert!(logs.iter().all(|l| finished(l) == Some(FinishReason::Length)));
        assert_eq!(exec.kv_bytes(), 0);
    }

    #[test]
    fn stop_ids_force_next_logprobs_and_errors() {
        let mut exec = Fake::default();
        let mut sch = Scheduler::new(SchedulerConfig::default(), model(), &exec);
        let prompt = vec![1u32, 2, 3];
        let expect = greedy_reference(&prompt, 6);
        // Stop on the third greedy token.
        let l = Log::default();
        let mut r = req(prompt.clone(), 20);
        r.stop_ids = vec![expect[2]];
        r.logprobs = Some(2);
        sch.submit(r, sink(&l)).unwrap();
        sch.run_to_completion(&mut exec);
        let first_dup = expect.iter().position(|&t| t == expect[2]).unwrap();
        assert_eq!(tokens(&l), expect[..=first_dup].to_vec());
        assert_eq!(finished(&l), Some(FinishReason::Stop));
        if let Some(Event::Token { logprob: Some(lp), top, .. }) = l.lock().unwrap().first() {
            assert!(*lp < 0.0 && top.len() == 2 && (top[0].1 - lp).abs() < 1e-6);
        } else {
            panic!("no logprobs");
        }
        // Force a token after the first one.
        let l2 = Log::default();
        let log2 = l2.clone();
        let mut n = 0;
        sch.submit(
            req(prompt.clone(), 3),
            Box::new(move |e: Event| {
                log2.lock().unwrap().push(e);
                n += 1;
                if n == 1 {
                    Control::ForceNext(15)
                } else {
                    Control::Continue
                }
            }),
        )
        .unwrap();
        sch.run_to_completion(&mut exec);
        assert_eq!(tokens(&l2)[1], 15);
        // A script (test hook) replaces sampling and ends the request.
        let l4 = Log::default();
        let mut r = req(prompt.clone(), 10);
        r.script = vec![5, 6, 7];
        sch.submit(r, sink(&l4)).unwrap();
        sch.run_to_completion(&mut exec);
        assert_eq!(tokens(&l4), vec![5, 6, 7]);
        assert_eq!(finished(&l4), Some(FinishReason::Stop));
        // A prefix is forced, then sampling takes over (the fake model's greedy answer).
        let l5 = Log::default();
        let mut r = req(prompt.clone(), 4);
        r.prefix = vec![9, 8];
        sch.submit(r, sink(&l5)).unwrap();
        sch.run_to_completion(&mut exec);
        let got = tokens(&l5);
        assert_eq!(&got[..2], &[9, 8]);
        assert_eq!(&got[2..], greedy_reference(&[1, 2, 3, 9, 8], 2));
        // A logit bias moves greedy decoding off the fake model's answer.
        let l6 = Log::default();
        let mut r = req(prompt.clone(), 2);
        let first = greedy_reference(&prompt, 1)[0];
        r.logit_bias = vec![(first, -100.0), ((first + 3) % 8, 10.0)];
        sch.submit(r, sink(&l6)).unwrap();
        sch.run_to_completion(&mut exec);
        assert_eq!(tokens(&l6)[0], (first + 3) % 8);
        // A constraint: only the tokens it allows come out, each one passed to it, and a
        // constraint that allows nothing ends the request.
        struct Only(Vec<u32>, std::sync::Arc<std::sync::Mutex<Vec<u32>>>);
        impl Constraint for Only {
            fn allows(&self, t: u32) -> bool {
                self.0.contains(&t)
            }
            fn advance(&mut self, t: u32) {
                self.1.lock().unwrap().push(t);
            }
        }
        for params in [SamplingParams::greedy(), SamplingParams { temperature: 1.0, seed: 3, ..Default::default() }] {
            let seen = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
            let l7 = Log::default();
            let mut r = req(prompt.clone(), 6);
            r.params = params;
            r.prefix = vec![12];
            r.constraint = Constrain(Some(Box::new(Only(vec![3, 11], seen.clone()))));
            sch.submit(r, sink(&l7)).unwrap();
            sch.run_to_completion(&mut exec);
            let got = tokens(&l7);
            assert_eq!(got.len(), 6);
            assert!(got[1..].iter().all(|t| [3, 11].contains(t)), "{got:?}");
            assert_eq!(*seen.lock().unwrap(), got);
        }
        let l8 = Log::default();
        let mut r = req(prompt.clone(), 6);
        r.constraint = Constrain(Some(Box::new(Only(vec![], Default::default()))));
        sch.submit(r, sink(&l8)).unwrap();
        sch.run_to_completion(&mut exec);
        assert!(tokens(&l8).is_empty());
        assert_eq!(finished(&l8), Some(FinishReason::Stop));
        assert_eq!(exec.kv_bytes(), 0);
        let mut r = req(prompt.clone(), 2);
        r.logit_bias = vec![(1 << 30, 1.0)];
        assert!(matches!(sch.submit(r, sink(&l6)), Err(SubmitError::InvalidParams(_))));
        assert_eq!(finished(&l5), Some(FinishReason::Length));
        // The executor failing fails the request and frees its KV.
        exec.fail_on = Some(7);
        let l3 = Log::default();
        sch.submit(req(vec![7, 7], 3), sink(&l3)).unwrap();
        sch.run_to_completion(&mut exec);
        assert!(matches!(l3.lock().unwrap().last(), Some(Event::Error(_))));
        assert_eq!(exec.kv_bytes(), 0);
    }
}
