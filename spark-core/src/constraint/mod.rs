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

    /// The cost of judging every token of a Spark-sized vocabulary (the scheduler's fallback
    /// after 8 refusals), in a few states of each constraint. A synthetic vocabulary of 131072
    /// tokens (the 256 bytes, then random 1-9 letter words, half with a leading space); prints ms
    /// per full check. Not a pass/fail test:
    /// `cargo test --release -p spark-core full_vocabulary_check_cost -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement; run by hand"]
    fn full_vocabulary_check_cost() {
        use serde_json::json;
        let mut rng = 0x1234_5678u64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let alpha = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 .,:;\"{}[]-_\n";
        let mut v: Vec<Option<Vec<u8>>> = (0..=255u8).map(|b| Some(vec![b])).collect();
        while v.len() < 131072 - 16 {
            let mut w: Vec<u8> = (0..1 + next(9)).map(|_| alpha[next(26) as usize]).collect();
            if next(2) == 0 {
                w.insert(0, b' ');
            }
            if next(20) == 0 {
                w[0] = alpha[next(alpha.len() as u64) as usize];
            }
            v.push(Some(w));
        }
        let base = v.len() as u32;
        v.extend((0..16).map(|_| None));
        let eos = base + 15;
        let bytes: TokenBytes = Arc::new(v);
        let n = bytes.len() as u32;
        let time = |label: &str, c: &dyn Constraint| {
            let t = std::time::Instant::now();
            let mut allowed = 0;
            for _ in 0..5 {
                allowed = (0..n).filter(|&t| c.allows(t)).count();
            }
            let ms = t.elapsed().as_secs_f64() * 1000.0 / 5.0;
            println!("{label:<28} {allowed:>7} allowed  {ms:6.2} ms per full check");
        };
        let schema = Arc::new(
            Schema::compile(&json!({"type": "object", "properties": {"name": {"type": "string"},
                "size": {"type": "integer", "minimum": 0}}, "required": ["name", "size"]}))
            .unwrap(),
        );
        let feed = |c: &mut dyn Constraint, text: &[u8]| text.iter().for_each(|&b| c.advance(b.into()));
        let j = Json::new(bytes.clone(), vec![eos], None, schema.clone());
        time("json: start", &j);
        let mut j = Json::new(bytes.clone(), vec![eos], None, schema.clone());
        feed(&mut j, b"{\"name\": \"abc");
        time("json: in a string", &j);
        let mut j = Json::new(bytes.clone(), vec![eos], None, schema.clone());
        feed(&mut j, b"{\"name\": \"abc\", \"size\": 12");
        time("json: in a bounded number", &j);
        let tools = crate::chat::toolcall::ToolSpec::from_openai(&json!([{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "opts": {"type": "object"}}, "required": ["city"]}}}]));
        let m = Markers {
            tool_call: base,
            end_tool_call: base + 1,
            arg_key: base + 2,
            end_arg_key: base + 3,
            arg_value: base + 4,
            end_arg_value: base + 5,
        };
        let grammar = Arc::new(ToolGrammar::new(&tools).0);
        let mut c = ToolCalls::new(grammar, bytes.clone(), vec![eos], m, None, false);
        time("tools: content", &c);
        c.advance(m.tool_call);
        time("tools: the name", &c);
        feed(&mut c, b"get_weather");
        c.advance(m.arg_key);
        feed(&mut c, b"opts");
        c.advance(m.end_arg_key);
        c.advance(m.arg_value);
        feed(&mut c, b"{\"q\": \"x");
        time("tools: in a JSON value", &c);
    }
}
