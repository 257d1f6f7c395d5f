//! The generation loop over any [`Executor`]: chunked prefill that reuses whatever prefix of the
//! prompt is already cached, then token-by-token decoding with a [`Sampler`], stopping on EOS,
//! stop ids, a token budget or the caller's say-so.
//!
//! With [`Session::keep_snapshot`] on, a session also keeps a copy of its KV at its last
//! prompt's end minus one token (a caller that renders the next turn without the reasoning, as
//! OpenAI-style clients do, renders the same tokens up to there, then differs: `<think>` became
//! `</think>`). Off by default: `spark-run chat` keeps the generated tokens, reasoning included,
//! as the next prompt's start, so its live cache is always reusable.
//! When the live cache cannot be rewound to the next prompt's common prefix (a sliding layer's
//! ring has overwritten what the rewind needs), prefill restarts from that copy instead of from
//! the first token.

use std::time::{Duration, Instant};

use crate::backend::{Executor, LogitsMode, SeqStep};
use crate::error::{Error, ErrorKind, Result};
use crate::sample::Sampler;

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop id (EOS by default) was produced; it is included in the output.
    Eos,
    /// `max_new` tokens were produced.
    Length,
    /// The token callback asked to stop.
    Callback,
    /// The context is full.
    Context,
}

/// What one `generate` call did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    /// Prompt tokens actually computed (the rest came from the cache).
    pub prefilled: usize,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

/// One conversation's sequence in an executor, remembering which tokens its cache holds.
pub struct Session {
    pub seq_id: u64,
    /// Tokens whose K/V are in the cache, in order.
    cached: Vec<u32>,
    /// Prefill chunk size (bounds activation memory).
    pub chunk: usize,
    /// Keep the copy described in the module docs (one more sequence's KV in the executor;
    /// default off).
    pub keep_snapshot: bool,
    /// The tokens the copy (executor sequence [`snapshot_id`](Self::snapshot_id)) holds.
    snapshot: Option<Vec<u32>>,
}

impl Session {
    pub fn new(seq_id: u64) -> Session {
        Session { seq_id, cached: Vec::new(), chunk: 512, keep_snapshot: false, snapshot: None }
    }

    /// The executor sequence id of the kept copy.
    pub fn snapshot_id(&self) -> u64 {
        self.seq_id ^ (1 << 62)
    }

    /// Tokens currently cached.
    pub fn cached(&self) -> &[u32] {
        &self.cached
    }

    /// Forget the cache.
    pub fn reset(&mut self, exec: &mut dyn Executor) {
        exec.release(self.seq_id);
        self.cached.clear();
        exec.release(self.snapshot_id());
        self.snapshot = None;
    }

    /// Copy the live sequence (holding `prompt[..at]`) as the snapshot, unless it already is.
    fn take_snapshot(&mut self, exec: &mut dyn Executor, prompt: &[u32], at: usize) {
        if self.snapshot.as_deref() == Some(&prompt[..at]) {
            return;
        }
        let id = self.snapshot_id();
        self.snapshot = None;
        if exec.fork(self.seq_id, id).is_ok() {
            self.snapshot = Some(prompt[..at].to_vec());
        } else {
            exec.release(id);
        }
    }

    /// Make the cache hold exactly `prompt` and return the logits of its last token. The
    /// longest common prefix with what is cached is kept when the cache can be rewound to it.
    pub fn prefill(&mut self, exec: &mut dyn Executor, prompt: &[u32]) -> Result<(Vec<f32>, usize)> {
        if prompt.is_empty() {
            return Err(Error::invalid("the prompt is empty: at least one token is needed"));
        }
        let vocab = exec.info().vocab;
        let common = self.cached.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        // The last prompt token is always recomputed: its logits are needed.
        let mut start = common.min(prompt.len() - 1);
        if exec.seq_len(self.seq_id) != Some(self.cached.len()) {
            start = 0;
        }
        let mut logits = vec![0.0; vocab];
        let mut pos = start;
        let mut first = true;
        // Where the snapshot is taken: the prompt but its last token.
        let snap_at = prompt.len() - 1;
        while pos < prompt.len() {
            // Only when the live sequence holds exactly `prompt[..pos]` (not yet rewound).
            if self.keep_snapshot && pos == snap_at && snap_at > 0 && exec.seq_len(self.seq_id) == Some(pos) {
                self.take_snapshot(exec, prompt, snap_at);
            }
            let mut end = (pos + self.chunk).min(prompt.len());
            if self.keep_snapshot && pos < snap_at {
                end = end.min(snap_at);
            }
            let last = end == prompt.len();
            let step = SeqStep {
                seq_id: self.seq_id,
                tokens: &prompt[pos..end],
                start_pos: pos as u32,
                logits: if last { LogitsMode::Last } else { LogitsMode::None },
            };
            let out = if last { &mut logits[..] } else { &mut [][..] };
            match exec.forward(&[step], out) {
                Err(e)
                    if first && pos > 0 && e.kind == ErrorKind::InvalidInput && e.message.contains("cannot rewind") =>
                {
                    // The sliding window already dropped what a rewind needs: start again from the
                    // snapshot when the prompt begins with it, else from the first token.
                    exec.release(self.seq_id);
                    self.cached.clear();
                    pos = 0;
                    start = 0;
                    if let Some(snap) =
                        self.snapshot.as_ref().filter(|s| s.len() < prompt.len() && prompt.starts_with(s))
                    {
                        if exec.fork(self.snapshot_id(), self.seq_id).is_ok() {
                            pos = snap.len();
                            start = pos;
                            self.cached = snap.clone();
                        } else {
                            exec.release(self.seq_id);
                        }
                    }
                    continue;
                }
                Err(e) => {
                    exec.release(self.seq_id);
                    self.cached.clear();
                    return Err(e);
                }
                Ok(()) => {}
            }
            first = false;
            pos = end;
        }
        self.cached.truncate(start.min(self.cached.len()));
        self.cached.extend_from_slice(&prompt[self.cached.len()..]);
        Ok((logits, prompt.len() - start))
    }

    /// Generate after `prompt`. `on_token` sees each new token and returns `false` to stop.
    pub fn generate(
        &mut self,
        exec: &mut dyn Executor,
        prompt: &[u32],
        max_new: usize,
        sampler: &mut Sampler,
        stop_ids: &[u32],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Outcome> {
        let t0 = Instant::now();
        let (mut logits, prefilled) = self.prefill(exec, prompt)?;
        let prefill_time = t0.elapsed();
        let t1 = Instant::now();
        let ctx = exec.info().ctx;
        let mut out = Vec::new();
        let mut stop = StopReason::Length;
        while out.len() < max_new {
            let tok = sampler.sample(&mut logits, prompt, &out);
            out.push(tok);
            if !on_token(tok) {
                stop = StopReason::Callback;
                break;
            }
            if stop_ids.contains(&tok) {
                stop = StopReason::Eos;
                break;
            }
            if out.len() == max_new {
                break;
            }
            let pos = self.cached.len();
            if pos + 1 > ctx {
                stop = StopReason::Context;
                break;
            }
            let step = SeqStep { seq_id: self.seq_id, tokens: &[tok], start_pos: pos as u32, logits: LogitsMode::Last };
            if let Err(e) = exec.forward(&[step], &mut logits) {
                exec.release(self.seq_id);
                self.cached.clear();
                return Err(e);
            }
            self.cached.push(tok);
        }
        Ok(Outcome { tokens: out, stop, prefilled, prefill_time, decode_time: t1.elapsed() })
    }
}
