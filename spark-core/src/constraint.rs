//! Constrained generation: which tokens a request may produce next.
//!
//! - [`Constraint`]: the hook the scheduler consults before it accepts a sampled token.
//! - [`JsonObject`]: JSON mode (OpenAI `response_format: {"type": "json_object"}`): the output
//!   (after the reasoning, when thinking is on) is one JSON object, then end-of-sequence.
//! - [`EndAfter`]: end-of-sequence refused until a given token has come (a tool call that
//!   `tool_choice` requires: the reply may not end before its `</tool_call>`).
//!
//! A constraint judges tokens by their bytes ([`crate::tokenizer::Tokenizer::token_bytes`]), so
//! a UTF-8 character split over tokens is fine; the JSON checker is a byte-level pushdown
//! automaton of RFC 8259's grammar (string contents are not checked as UTF-8).

use std::sync::Arc;

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

/// JSON mode: one JSON object (leading whitespace allowed), then one of `end` (EOS). Before
/// `start` (`</think>`) is generated, when given, every token is allowed.
pub struct JsonObject {
    bytes: TokenBytes,
    end: Vec<u32>,
    start: Option<u32>,
    json: JsonState,
}

impl JsonObject {
    /// `start`: the token after which the JSON begins (`</think>` with thinking on), or `None`
    /// when it begins with the first generated token.
    pub fn new(bytes: TokenBytes, end: Vec<u32>, start: Option<u32>) -> JsonObject {
        JsonObject { bytes, end, start, json: JsonState::default() }
    }

    /// Whether the object is complete.
    pub fn is_complete(&self) -> bool {
        self.start.is_none() && self.json.done()
    }
}

impl Constraint for JsonObject {
    fn allows(&self, token: u32) -> bool {
        if self.start.is_some() {
            return true;
        }
        if self.end.contains(&token) {
            return self.json.done();
        }
        if self.json.done() {
            return false;
        }
        match self.bytes.get(token as usize) {
            Some(Some(b)) if !b.is_empty() => {
                let mut s = self.json.clone();
                b.iter().all(|&c| s.push(c))
            }
            _ => false,
        }
    }

    fn advance(&mut self, token: u32) {
        if let Some(s) = self.start {
            if token == s {
                self.start = None;
            }
            return;
        }
        if let Some(Some(b)) = self.bytes.get(token as usize) {
            for &c in b {
                self.json.push(c);
            }
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

/// Where the checker is inside the JSON text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Mode {
    /// Before the top-level value: whitespace or `{`.
    #[default]
    Start,
    /// A value is expected (after `:`, or after `,` in an array).
    Value,
    /// After `[`: a value or `]`.
    ArrayFirst,
    /// After `{`: a key or `}`.
    ObjectFirst,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// Inside a string (`key`: an object key).
    Str { key: bool },
    /// After `\` in a string.
    Escape { key: bool },
    /// Inside `\uXXXX`: hex digits left.
    Unicode { key: bool, left: u8 },
    /// Inside a number.
    Number(Num),
    /// Inside `true`, `false` or `null`: the literal and the bytes matched.
    Literal(&'static [u8], u8),
    /// After a value: `,`, the container's closer, or (at the top) the end.
    After,
    /// The top-level value is complete.
    Done,
}

/// Where the checker is inside a number (`-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

impl Num {
    /// Whether the number may end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::Exp)
    }
}

/// Most whitespace bytes in a row outside strings (room for a line break and deep
/// indentation), of them line-break bytes (`\r\n`), and whitespace before the object.
/// Unbounded, a model can fill its whole budget with newlines.
const MAX_WS_RUN: u8 = 32;
const MAX_BREAKS: u8 = 2;
const MAX_LEADING_WS: u8 = 4;

/// A byte-level JSON checker whose top-level value must be an object.
#[derive(Debug, Clone, Default)]
struct JsonState {
    /// Open containers: `b'{'` or `b'['`.
    stack: Vec<u8>,
    mode: Mode,
    /// Whitespace bytes in a row so far (outside strings), and line-break bytes among them.
    ws: u8,
    breaks: u8,
}

fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

impl JsonState {
    fn done(&self) -> bool {
        self.mode == Mode::Done
    }

    /// Feed one byte; `false` (the state is then unspecified) when it cannot continue valid
    /// JSON (or is one whitespace byte too many).
    fn push(&mut self, c: u8) -> bool {
        let in_string = matches!(self.mode, Mode::Str { .. } | Mode::Escape { .. } | Mode::Unicode { .. });
        if is_ws(c) && !in_string {
            self.ws += 1;
            self.breaks += u8::from(c == b'\n' || c == b'\r');
            let limit = if self.mode == Mode::Start { MAX_LEADING_WS } else { MAX_WS_RUN };
            if self.ws > limit || self.breaks > MAX_BREAKS {
                return false;
            }
        } else {
            self.ws = 0;
            self.breaks = 0;
        }
        match self.mode {
            Mode::Start => {
                if is_ws(c) {
                    return true;
                }
                if c == b'{' {
                    self.stack.push(b'{');
                    self.mode = Mode::ObjectFirst;
                    return true;
                }
                false
            }
            Mode::Value | Mode::ArrayFirst => {
                if is_ws(c) {
                    return true;
                }
                if c == b']' && self.mode == Mode::ArrayFirst {
                    return self.close(c);
                }
                self.value(c)
            }
            Mode::ObjectFirst | Mode::Key => {
                if is_ws(c) {
                    return true;
                }
                if c == b'}' && self.mode == Mode::ObjectFirst {
                    return self.close(c);
                }
                if c == b'"' {
                    self.mode = Mode::Str { key: true };
                    return true;
                }
                false
            }
            Mode::Colon => {
                if is_ws(c) {
                    return true;
                }
                if c == b':' {
                    self.mode = Mode::Value;
                    return true;
                }
                false
            }
            Mode::Str { key } => match c {
                b'"' => {
                    self.mode = if key { Mode::Colon } else { Mode::After };
                    true
                }
                b'\\' => {
                    self.mode = Mode::Escape { key };
                    true
                }
                c => c >= 0x20,
            },
            Mode::Escape { key } => match c {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                    self.mode = Mode::Str { key };
                    true
                }
                b'u' => {
                    self.mode = Mode::Unicode { key, left: 4 };
                    true
                }
                _ => false,
            },
            Mode::Unicode { key, left } => {
                if !c.is_ascii_hexdigit() {
                    return false;
                }
                self.mode = if left == 1 { Mode::Str { key } } else { Mode::Unicode { key, left: left - 1 } };
                true
            }
            Mode::Number(n) => {
                let next = match (n, c) {
                    (Num::Minus, b'0') => Some(Num::Zero),
                    (Num::Minus, b'1'..=b'9') => Some(Num::Int),
                    (Num::Int, b'0'..=b'9') => Some(Num::Int),
                    (Num::Zero | Num::Int, b'.') => Some(Num::Dot),
                    (Num::Dot | Num::Frac, b'0'..=b'9') => Some(Num::Frac),
                    (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Some(Num::E),
                    (Num::E, b'+' | b'-') => Some(Num::ESign),
                    (Num::E | Num::ESign | Num::Exp, b'0'..=b'9') => Some(Num::Exp),
                    _ => None,
                };
                match next {
                    Some(n) => {
                        self.mode = Mode::Number(n);
                        true
                    }
                    // The number ends here; the byte belongs to what follows it.
                    None if n.complete() => {
                        self.mode = Mode::After;
                        self.push(c)
                    }
                    None => false,
                }
            }
            Mode::Literal(word, i) => {
                if word.get(i as usize) != Some(&c) {
                    return false;
                }
                self.mode = if i as usize + 1 == word.len() { Mode::After } else { Mode::Literal(word, i + 1) };
                true
            }
            Mode::After => {
                if is_ws(c) {
                    return true;
                }
                match (self.stack.last(), c) {
                    (Some(b'{'), b',') => {
                        self.mode = Mode::Key;
                        true
                    }
                    (Some(b'['), b',') => {
                        self.mode = Mode::Value;
                        true
                    }
                    (Some(_), b'}' | b']') => self.close(c),
                    _ => false,
                }
            }
            Mode::Done => false,
        }
    }

    /// The first byte of a value.
    fn value(&mut self, c: u8) -> bool {
        self.mode = match c {
            b'{' => {
                self.stack.push(b'{');
                Mode::ObjectFirst
            }
            b'[' => {
                self.stack.push(b'[');
                Mode::ArrayFirst
            }
            b'"' => Mode::Str { key: false },
            b'-' => Mode::Number(Num::Minus),
            b'0' => Mode::Number(Num::Zero),
            b'1'..=b'9' => Mode::Number(Num::Int),
            b't' => Mode::Literal(b"true", 1),
            b'f' => Mode::Literal(b"false", 1),
            b'n' => Mode::Literal(b"null", 1),
            _ => return false,
        };
        true
    }

    /// `}` or `]` closing the innermost container.
    fn close(&mut self, c: u8) -> bool {
        let want = if c == b'}' { b'{' } else { b'[' };
        if self.stack.pop() != Some(want) {
            return false;
        }
        self.mode = if self.stack.is_empty() { Mode::Done } else { Mode::After };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepts(text: &str) -> Option<bool> {
        accepts_bytes(text.as_bytes())
    }

    fn accepts_bytes(text: &[u8]) -> Option<bool> {
        let mut s = JsonState::default();
        for &c in text {
            if !s.push(c) {
                return None;
            }
        }
        Some(s.done())
    }

    #[test]
    fn json_objects_and_prefixes() {
        for ok in [
            "{}",
            " \n{\"a\": 1}",
            "{\"a\": [1, -2.5e+3, 0, 0.25, true, false, null, \"x\\\"y\\u00e9\"], \"b\": {\"c\": []}}",
            "{\"k\":{}}",
            "{\"emoji\": \"東京 ✓\"}",
            "{\"n\": 12}",
            "{\n    \"deep\": {\n        \"x\": [\n            1\n        ]\n    }\n}",
        ] {
            assert_eq!(accepts(ok), Some(true), "{ok}");
            // Every prefix is a valid prefix, and only the whole text is complete.
            for i in 0..ok.len() {
                assert_eq!(accepts_bytes(&ok.as_bytes()[..i]), Some(false), "prefix {i} of {ok}");
            }
        }
        for bad in [
            "[1]",
            "\"s\"",
            "1",
            "{,}",
            "{\"a\" 1}",
            "{\"a\": 01}",
            "{\"a\": 1,}",
            "{\"a\": [1,]}",
            "{\"a\": tru}x",
            "{\"a\": .5}",
            "{\"a\": 1.}",
            "{\"a\": 1e}",
            "{\"a\": \"\\x\"}",
            "{\"a\": \"\n\"}",
            "{}}",
            "{]",
            "{} {}",
            "{\"a\": -}",
            "{\"a\": nul }",
        ] {
            assert_ne!(accepts(bad), Some(true), "{bad}");
        }
        // Whitespace runs are bounded (a model can fill its whole budget with newlines).
        assert_eq!(accepts("    {}"), Some(true));
        assert_eq!(accepts("     {}"), None);
        assert_eq!(accepts(&format!("{{\r\n{}}}", " ".repeat(30))), Some(true));
        assert_eq!(accepts(&format!("{{{}}}", " ".repeat(33))), None);
        assert_eq!(accepts("{\n\n\n}"), None);
        assert_eq!(accepts(&format!("{{\"{}\": 1}}", " ".repeat(100))), Some(true));
    }

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
        let mut c = JsonObject::new(Arc::new(vocab), vec![eos], Some(6));
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
