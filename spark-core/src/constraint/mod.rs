//! Constrained generation: which tokens a request may produce next.
//!
//! - [`Constraint`]: the hook the scheduler consults before it accepts a sampled token.
//! - [`Json`]: JSON output (OpenAI `response_format` `json_object` and `json_schema`): the output
//!   (after the reasoning, when thinking is on) is one JSON value its [`Schema`] allows, then
//!   end-of-sequence. [`schema`] compiles JSON Schema, [`pattern`] its regexes, [`matcher`]
//!   runs it on bytes.
//! - [`ToolCalls`]: Spark's tool-call markup held to the offered tools' schemas ([`toolcall`]),
//!   and, when `tool_choice` requires a call, no end before one has closed.
//! - [`EndAfter`]: end-of-sequence refused until a given token has come (a required tool call,
//!   for tokenizers without the markup's tokens).
//!
//! A constraint judges tokens by their bytes ([`crate::tokenizer::Tokenizer::token_bytes`]), so
//! a UTF-8 character split over tokens is fine. Judging every token of a large vocabulary (the
//! scheduler's fallback) is kept cheap by a filter on a token's first bytes, computed once per
//! step (`ByteFilter`).

use std::sync::Arc;

pub mod matcher;
pub mod pattern;
pub mod schema;
pub mod toolcall;

pub use matcher::JsonMatcher;
pub use schema::{Schema, SchemaError};
pub use toolcall::{Markers, ToolCalls, ToolGrammar};

/// Limits the tokens of one request. The scheduler samples as usual, and while the sampled
/// token is not [`allows`](Constraint::allows)ed it bans it and samples again (after a few
/// tries it bans every token not allowed, then samples once more). Every generated token,
/// forced ones included, is passed to [`advance`](Constraint::advance).
pub trait Constraint: Send {
    /// Whether `token` may come next.
    fn allows(&self, token: u32) -> bool;
    /// `token` was generated.
    fn advance(&mut self, token: u32);
}

/// The bytes of every token id (`None`: a special token, never text), shared by requests.
pub type TokenBytes = Arc<Vec<Option<Vec<u8>>>>;

/// A quick pre-check of a token's first bytes: which bytes may come next, and which may follow
/// a space (most tokens of a large vocabulary begin with one). A token it refuses is refused
/// without running a matcher over it; the scheduler's fallback asks about every token.
#[derive(Clone)]
pub(crate) struct ByteFilter {
    first: [bool; 256],
    after_space: [bool; 256],
}

impl ByteFilter {
    pub(crate) const ALL: ByteFilter = ByteFilter { first: [true; 256], after_space: [true; 256] };

    /// The filter of a state where `ok(bytes)` says whether `bytes` may come next.
    pub(crate) fn new(ok: impl Fn(&[u8]) -> bool) -> ByteFilter {
        let mut f = ByteFilter { first: [false; 256], after_space: [false; 256] };
        for c in 0..=255u8 {
            f.first[c as usize] = ok(&[c]);
        }
        if f.first[b' ' as usize] {
            for c in 0..=255u8 {
                f.after_space[c as usize] = ok(&[b' ', c]);
            }
        }
        f
    }

    /// Whether a token of these (non-empty) bytes may pass.
    pub(crate) fn passes(&self, b: &[u8]) -> bool {
        self.first[b[0] as usize] && (b[0] != b' ' || b.len() == 1 || self.after_space[b[1] as usize])
    }
}

/// JSON output: one JSON value a [`Schema`] allows (JSON mode: [`Schema::any_object`]), then
/// one of `end` (EOS). Before `start` (`</think>`) is generated, when given, every token is
/// allowed.
pub struct Json {
    bytes: TokenBytes,
    end: Vec<u32>,
    start: Option<u32>,
    json: JsonMatcher,
    filter: ByteFilter,
}

impl Json {
    /// `start`: the token after which the JSON begins (`</think>` with thinking on), or `None`
    /// when it begins with the first generated token.
    pub fn new(bytes: TokenBytes, end: Vec<u32>, start: Option<u32>, schema: Arc<Schema>) -> Json {
        let mut j = Json { bytes, end, start, json: JsonMatcher::new(schema), filter: ByteFilter::ALL };
        j.update_filter();
        j
    }

    /// Whether the value is complete.
    pub fn is_complete(&self) -> bool {
        self.start.is_none() && self.json.can_end()
    }

    fn update_filter(&mut self) {
        self.filter = ByteFilter::new(|b| self.json.accepts(b));
    }
}

impl Constraint for Json {
    fn allows(&self, token: u32) -> bool {
        if self.start.is_some() {
            return true;
        }
        if self.end.contains(&token) {
            return self.json.can_end();
        }
        match self.bytes.get(token as usize) {
            Some(Some(b)) if !b.is_empty() && self.filter.passes(b) => self.json.accepts(b),
            _ => false,
        }
    }

    fn advance(&mut self, token: u32) {
        if let Some(s) = self.start {
            if token == s {
                self.start = None;
                self.update_filter();
            }
            return;
        }
        if let Some(Some(b)) = self.bytes.get(token as usize) {
            self.json.push_all(b);
            self.update_filter();
        }
    }
}

/// Refuses the `end` tokens until `after` has been generated; everything else is allowed.
pub struct EndAfter {
    end: Vec<u32>,
    after: u32,
    seen: bool,
}

impl EndAfter {
    pub fn new(end: Vec<u32>, after: u32) -> EndAfter {
        EndAfter { end, after, seen: false }
    }
}

impl Constraint for EndAfter {
    fn allows(&self, token: u32) -> bool {
        self.seen || !self.end.contains(&token)
    }

    fn advance(&mut self, token: u32) {
        self.seen |= token == self.after;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_after() {
        let mut c = EndAfter::new(vec![1], 9);
        assert!(!c.allows(1) && c.allows(2) && c.allows(9));
        c.advance(2);
        assert!(!c.allows(1));
        c.advance(9);
        assert!(c.allows(1));
    }

    #[test]
    fn tokens_are_judged_by_all_their_bytes() {
        let vocab: Vec<Option<Vec<u8>>> = ["{", "\"a\"", ": ", "1", "}", " {\"", "x", "\"", ":", "é"]
            .iter()
            .map(|s| Some(s.as_bytes().to_vec()))
            .chain([None])
            .collect();
        let eos = vocab.len() as u32 - 1;
        let mut c = Json::new(Arc::new(vocab), vec![eos], Some(6), Arc::new(Schema::any_object()));
        // Before the start token anything goes.
        assert!(c.allows(6) && c.allows(eos));
        c.advance(6);
        assert!(!c.allows(6) && !c.allows(eos) && !c.allows(1));
        assert!(c.allows(0) && c.allows(5));
        for t in [5, 9, 7, 8, 3] {
            assert!(c.allows(t), "token {t}");
            c.advance(t);
        }
        assert!(!c.allows(eos) && !c.is_complete());
        assert!(c.allows(4));
        c.advance(4);
        assert!(c.is_complete());
        // Complete: only the end.
        assert!(c.allows(eos));
        assert!((0..eos).all(|t| !c.allows(t)));
    }
}
