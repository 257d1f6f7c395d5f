//! Byte-level matcher of a JSON text against a compiled [`Schema`].
//!
//! The matcher is a pushdown automaton run on bytes. Its state is a small set of *threads*
//! (stacks of frames), since `anyOf` and literals that are prefixes of each other (`1` and `10`)
//! leave more than one reading open; a thread dies when a byte cannot continue it, the matcher
//! when all have. Every live thread can still be completed, except through schemas that can
//! never finish (a required property whose schema recurses without end), which the compiler does
//! not detect.
//!
//! Whitespace outside strings is bounded, as pretty-printed or compact JSON needs it: between
//! two tokens at most 4 spaces, tabs or carriage returns, or one line break (`\n` or `\r\n`)
//! followed by an indent of at most 20; before the value at most 4 bytes (2 line breaks).
//! Unbounded, a model can fill its whole budget with whitespace (the toy demo model does). Strings
//! hold well-formed UTF-8 (a character may be split over tokens; its bytes are checked as they
//! come); `minLength` / `maxLength` count characters, an escape as one (a surrogate pair as two).
//! Numbers have at most 18 digits before the point and 2 in the exponent, so every number
//! parses (an integer into an `i64`, any number into a finite `f64`).

use std::sync::Arc;

use regex_automata::util::primitives::StateID;

use super::schema::{Node, NodeId, Range, Schema, ANY_ARRAY, ANY_NUMBER, ANY_OBJECT, ANY_STRING, BOOL, NULL};

/// Whitespace between two tokens on one line.
const MAX_INLINE_WS: u8 = 4;
/// Indent after the one line break allowed between two tokens.
const MAX_INDENT: u8 = 20;
/// Whitespace before the value, and line breaks among it.
const MAX_LEADING_WS: u8 = 4;
const MAX_LEADING_BREAKS: u8 = 2;
/// Most readings kept at once (more are dropped: fewer texts allowed, none wrongly).
const MAX_THREADS: usize = 64;
/// Most `anyOf` / `$ref` steps taken to start one value (a reference cycle that consumes no
/// byte ends there).
const MAX_EXPANSION: u32 = 32;

fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

/// Inside a string: plain, after `\`, inside `\uXXXX` (hex digits left), or inside a UTF-8
/// character (continuation bytes left, and the range the next one must be in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lex {
    Plain,
    Escape,
    Unicode(u8),
    Utf8 { left: u8, lo: u8, hi: u8 },
}

/// What a string byte adds to the string's decoded text (what a pattern sees).
enum Decoded {
    /// A `\`: what it escapes comes next.
    Backslash,
    Byte(u8),
    /// A `\u` escape: not written in strings with a pattern (a prefix of its hex digits cannot be
    /// judged against the pattern before the last one; the characters it would give are written
    /// as UTF-8 or with the short escapes).
    Refused,
}

/// The decoded text byte `c` adds, `prev` being the lexer's state before it (the byte is known
/// to be valid string content).
fn decoded(prev: Lex, c: u8) -> Decoded {
    match prev {
        Lex::Plain if c == b'\\' => Decoded::Backslash,
        Lex::Plain | Lex::Utf8 { .. } => Decoded::Byte(c),
        Lex::Escape => match c {
            b'u' => Decoded::Refused,
            b'b' => Decoded::Byte(8),
            b'f' => Decoded::Byte(12),
            b'n' => Decoded::Byte(b'\n'),
            b'r' => Decoded::Byte(b'\r'),
            b't' => Decoded::Byte(b'\t'),
            c => Decoded::Byte(c),
        },
        Lex::Unicode(_) => Decoded::Refused,
    }
}

/// What one string byte was.
enum StrByte {
    /// The closing quote.
    Close,
    /// Content; `new_char`: it starts a character (a UTF-8 lead byte, or `\`).
    Content {
        new_char: bool,
    },
    Bad,
}

/// A non-ASCII byte that starts a well-formed UTF-8 character (RFC 3629 table 3-7: no overlong
/// forms, no surrogates, nothing above U+10FFFF): how many continuation bytes follow, and the
/// range the first of them must be in (the others are in `0x80..=0xbf`).
pub(crate) fn utf8_lead(c: u8) -> Option<(u8, u8, u8)> {
    Some(match c {
        0xc2..=0xdf => (1, 0x80, 0xbf),
        0xe0 => (2, 0xa0, 0xbf),
        0xed => (2, 0x80, 0x9f),
        0xe1..=0xef => (2, 0x80, 0xbf),
        0xf0 => (3, 0x90, 0xbf),
        0xf1..=0xf3 => (3, 0x80, 0xbf),
        0xf4 => (3, 0x80, 0x8f),
        _ => return None,
    })
}

impl Lex {
    fn push(&mut self, c: u8) -> StrByte {
        match *self {
            Lex::Plain => match c {
                b'"' => StrByte::Close,
                b'\\' => {
                    *self = Lex::Escape;
                    StrByte::Content { new_char: true }
                }
                0..=0x1f => StrByte::Bad,
                0x20..=0x7f => StrByte::Content { new_char: true },
                _ => {
                    let Some((left, lo, hi)) = utf8_lead(c) else { return StrByte::Bad };
                    *self = Lex::Utf8 { left, lo, hi };
                    StrByte::Content { new_char: true }
                }
            },
            Lex::Utf8 { left, lo, hi } => {
                if !(lo..=hi).contains(&c) {
                    return StrByte::Bad;
                }
                *self = if left == 1 { Lex::Plain } else { Lex::Utf8 { left: left - 1, lo: 0x80, hi: 0xbf } };
                StrByte::Content { new_char: false }
            }
            Lex::Escape => {
                *self = match c {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Lex::Plain,
                    b'u' => Lex::Unicode(4),
                    _ => return StrByte::Bad,
                };
                StrByte::Content { new_char: false }
            }
            Lex::Unicode(left) => {
                if !c.is_ascii_hexdigit() {
                    return StrByte::Bad;
                }
                *self = if left == 1 { Lex::Plain } else { Lex::Unicode(left - 1) };
                StrByte::Content { new_char: false }
            }
        }
    }
}

/// Whether `text` is a complete number in `r`.
fn number_in(text: &[u8], r: &Range) -> bool {
    std::str::from_utf8(text).ok().and_then(|s| s.parse::<f64>().ok()).is_some_and(|x| r.contains(x))
}

/// Whether `text` is a number this grammar allows (bounded: no exponent).
fn number_text(text: &[u8], integer: bool) -> bool {
    let mut at = match text.first() {
        Some(b'-') => Num::Minus,
        Some(b'0') => Num::Zero,
        Some(b'1'..=b'9') => Num::Int(1),
        _ => return false,
    };
    for &c in &text[1..] {
        match at.next(c, integer, false) {
            Some(a) => at = a,
            None => return false,
        }
    }
    at.complete()
}

/// Whether the number prefix `prefix` can be completed into a number in `r`: a witness is
/// looked for among the prefix itself, the prefix followed by zeros or nines, and the bounds
/// written out (the nearest allowed values). A witness proves the completion exists; when the
/// bounds are so close that none of these is one, the prefix is refused (a text the schema
/// allows may be refused, never the reverse).
fn number_can_reach(prefix: &[u8], integer: bool, r: &Range) -> bool {
    let works = |w: &[u8]| w.starts_with(prefix) && number_text(w, integer) && number_in(w, r);
    if works(prefix) {
        return true;
    }
    for k in 1..=(MAX_INT_DIGITS as usize + 1) {
        for d in [b'0', b'9'] {
            let mut w = prefix.to_vec();
            w.extend(std::iter::repeat_n(d, k));
            if works(&w) {
                return true;
            }
        }
    }
    // The nearest allowed values to each bound.
    let (mut lo, mut hi) = (r.lo, r.hi);
    if integer {
        lo = if r.lo_excl { lo.floor() + 1.0 } else { lo.ceil() };
        hi = if r.hi_excl { hi.ceil() - 1.0 } else { hi.floor() };
    } else {
        if r.lo_excl {
            lo = lo.next_up();
        }
        if r.hi_excl {
            hi = hi.next_down();
        }
    }
    [lo, hi].iter().filter(|x| x.is_finite() && x.abs() < 1e18).any(|&x| {
        let w = if integer { format!("{}", x as i64) } else { format!("{x}") };
        works(w.as_bytes()) || (!integer && !w.contains('.') && works(format!("{w}.0").as_bytes()))
    })
}

/// Where a number is (`-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    /// Integer digits so far.
    Int(u8),
    Dot,
    Frac,
    E,
    ESign,
    /// Exponent digits so far.
    Exp(u8),
}

/// Most digits before the point: an integer fits an `i64` (and a parser's integer type).
const MAX_INT_DIGITS: u8 = 18;
/// Most exponent digits: with the integer digits bounded, a number stays a finite `f64`.
const MAX_EXP_DIGITS: u8 = 2;

impl Num {
    /// Whether the number may end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int(_) | Num::Frac | Num::Exp(_))
    }

    /// The state after `c`; `exp`: whether an exponent may come.
    fn next(self, c: u8, integer: bool, exp: bool) -> Option<Num> {
        Some(match (self, c) {
            // No `-0` integer: parsers read it as a float (-0.0).
            (Num::Minus, b'0') if !integer => Num::Zero,
            (Num::Minus, b'1'..=b'9') => Num::Int(1),
            (Num::Int(n), b'0'..=b'9') if n < MAX_INT_DIGITS => Num::Int(n + 1),
            (Num::Zero | Num::Int(_), b'.') if !integer => Num::Dot,
            (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
            (Num::Zero | Num::Int(_) | Num::Frac, b'e' | b'E') if !integer && exp => Num::E,
            (Num::E, b'+' | b'-') => Num::ESign,
            (Num::E | Num::ESign, b'0'..=b'9') => Num::Exp(1),
            (Num::Exp(n), b'0'..=b'9') if n < MAX_EXP_DIGITS => Num::Exp(n + 1),
            _ => return None,
        })
    }
}

/// An object's position: after `{`, after `,`, after a key (the property's index, `None` for
/// an additional key), or after a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Obj {
    First,
    Key,
    Colon(Option<u8>),
    After,
}

/// An array's position: after `[`, after `,`, or after a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arr {
    First,
    Next,
    After,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Frame {
    /// A value of this node comes next (whitespace first allowed).
    Value(NodeId),
    /// Inside an object; `seen`: bit i, property i has been written.
    Object { node: NodeId, seen: u64, phase: Obj },
    /// Inside an object key (on top of its object's frame): the bytes so far, as written.
    Key { buf: Vec<u8>, lex: Lex },
    /// Inside an array, `count` values in.
    Array { node: NodeId, count: u32, phase: Arr },
    /// Inside a string, `chars` characters in; `re`: the pattern's state, if it has one.
    Str { node: NodeId, chars: u32, lex: Lex, re: Option<StateID> },
    /// Inside a number: where, and for a bounded one its text so far and whether that is a
    /// complete number in the bounds.
    Number { node: NodeId, at: Num, text: Vec<u8>, ok: bool },
    /// Inside one of a node's literals: the bytes matched, and the literals still matching.
    Literal { node: NodeId, pos: u32, cands: Vec<u32> },
}

/// One reading of the text so far.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Thread {
    stack: Vec<Frame>,
    /// Whitespace bytes in a row outside strings, line breaks among them, and the bytes since
    /// the last break.
    ws: u8,
    breaks: u8,
    indent: u8,
}

impl Thread {
    /// Whether the text may end here.
    fn can_end(&self) -> bool {
        match self.stack.as_slice() {
            [] => true,
            [Frame::Number { ok, .. }] => *ok,
            _ => false,
        }
    }
}

/// Matches a JSON text, byte by byte, against a schema.
#[derive(Debug, Clone)]
pub struct JsonMatcher {
    schema: Arc<Schema>,
    threads: Vec<Thread>,
}

fn emit(out: &mut Vec<Thread>, t: Thread) {
    if out.len() < MAX_THREADS && !out.contains(&t) {
        out.push(t);
    }
}

/// Bit mask of an object's first `n` properties.
fn mask(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

impl JsonMatcher {
    pub fn new(schema: Arc<Schema>) -> JsonMatcher {
        let root = schema.root;
        JsonMatcher::at(schema, root)
    }

    /// A matcher of one value of `node` (a subschema of `schema`).
    pub(crate) fn at(schema: Arc<Schema>, node: NodeId) -> JsonMatcher {
        JsonMatcher { schema, threads: vec![Thread { stack: vec![Frame::Value(node)], ws: 0, breaks: 0, indent: 0 }] }
    }

    /// Feed one byte; `false` when it cannot continue a text the schema allows (the matcher is
    /// then dead and refuses everything).
    pub fn push(&mut self, c: u8) -> bool {
        let mut out = Vec::with_capacity(self.threads.len());
        for t in std::mem::take(&mut self.threads) {
            self.feed(t, c, &mut out);
        }
        self.threads = out;
        !self.threads.is_empty()
    }

    /// Feed bytes; `false` as soon as one cannot continue.
    pub fn push_all(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&c| self.push(c))
    }

    /// Whether `bytes` can come next (the matcher is left as it is).
    pub fn accepts(&self, bytes: &[u8]) -> bool {
        // Fast path, for the common case of a token inside a string: plain characters (whole
        // UTF-8 ones, no quote, backslash or control character) continue a string that is not
        // inside an escape or a character and has room for them (a byte is at most a character).
        let plain =
            || !bytes.iter().any(|&c| c < 0x20 || c == b'"' || c == b'\\') && std::str::from_utf8(bytes).is_ok();
        let room = |t: &Thread| match t.stack.last() {
            Some(&Frame::Str { node, chars, lex: Lex::Plain, re: None }) => match self.schema.nodes[node] {
                Node::String { max, .. } => max.is_none_or(|m| chars as usize + bytes.len() <= m as usize),
                _ => false,
            },
            _ => false,
        };
        if self.threads.iter().any(room) && plain() {
            return true;
        }
        self.clone().push_all(bytes)
    }

    /// Whether the text so far is a complete value the schema allows.
    pub fn can_end(&self) -> bool {
        self.threads.iter().any(Thread::can_end)
    }

    /// Whether no more bytes can be taken (the value is complete and nothing may follow, or the
    /// matcher is dead).
    pub fn is_finished(&self) -> bool {
        self.threads.iter().all(|t| t.stack.is_empty())
    }

    fn feed(&self, mut t: Thread, c: u8, out: &mut Vec<Thread>) {
        if !matches!(t.stack.last(), Some(Frame::Str { .. } | Frame::Key { .. })) {
            if is_ws(c) {
                t.ws += 1;
                if c == b'\n' {
                    t.breaks += 1;
                    t.indent = 0;
                } else {
                    t.indent += 1;
                }
                let ok = if matches!(t.stack.as_slice(), [Frame::Value(_)]) {
                    t.ws <= MAX_LEADING_WS && t.breaks <= MAX_LEADING_BREAKS
                } else if t.breaks == 0 {
                    t.ws <= MAX_INLINE_WS
                } else {
                    t.breaks == 1 && t.indent <= MAX_INDENT
                };
                if !ok {
                    return;
                }
            } else {
                t.ws = 0;
                t.breaks = 0;
                t.indent = 0;
            }
        }
        self.dispatch(t, c, out, 0);
    }

    /// Give byte `c` to the thread's top frame.
    fn dispatch(&self, mut t: Thread, c: u8, out: &mut Vec<Thread>, depth: u32) {
        let nodes = &self.schema.nodes;
        let Some(top) = t.stack.pop() else { return };
        match top {
            Frame::Value(n) => {
                if is_ws(c) {
                    t.stack.push(top);
                    emit(out, t);
                } else {
                    self.start(t, n, c, out, depth);
                }
            }
            Frame::Object { node, seen, phase } => {
                let Node::Object { props, required, additional } = &nodes[node] else {
                    unreachable!("an object frame is made for an object node")
                };
                let set = |phase| Frame::Object { node, seen, phase };
                match (phase, c) {
                    (_, c) if is_ws(c) => t.stack.push(set(phase)),
                    (Obj::First | Obj::After, b'}') => {
                        if required & !seen != 0 {
                            return;
                        }
                    }
                    (Obj::First | Obj::Key, b'"') => {
                        t.stack.push(set(phase));
                        t.stack.push(Frame::Key { buf: vec![], lex: Lex::Plain });
                    }
                    (Obj::Colon(p), b':') => {
                        let child = match p {
                            Some(i) => props[i as usize].1,
                            None => additional.expect("an additional key is read only where one is allowed"),
                        };
                        t.stack.push(set(Obj::After));
                        t.stack.push(Frame::Value(child));
                    }
                    (Obj::After, b',') => {
                        // A comma only where another key can follow.
                        if additional.is_none() && mask(props.len()) & !seen == 0 {
                            return;
                        }
                        t.stack.push(set(Obj::Key));
                    }
                    _ => return,
                }
                emit(out, t);
            }
            Frame::Key { mut buf, mut lex } => {
                let Some(Frame::Object { node, seen, .. }) = t.stack.last() else {
                    unreachable!("a key frame sits on its object's frame")
                };
                let (node, seen) = (*node, *seen);
                let Node::Object { props, additional, .. } = &nodes[node] else {
                    unreachable!("an object frame is made for an object node")
                };
                let unseen = |i: usize| seen & (1u64 << i) == 0;
                match lex.push(c) {
                    StrByte::Bad => return,
                    StrByte::Content { .. } => {
                        buf.push(c);
                        if additional.is_none()
                            && !props.iter().enumerate().any(|(i, (k, _))| unseen(i) && k.starts_with(&buf))
                        {
                            return;
                        }
                        t.stack.push(Frame::Key { buf, lex });
                    }
                    StrByte::Close => {
                        let phase = match props.iter().position(|(k, _)| *k == buf) {
                            Some(i) if unseen(i) => Obj::Colon(Some(i as u8)),
                            // A known key written twice.
                            Some(_) => return,
                            None if additional.is_some() => Obj::Colon(None),
                            None => return,
                        };
                        let seen = match phase {
                            Obj::Colon(Some(i)) => seen | (1u64 << i),
                            _ => seen,
                        };
                        *t.stack.last_mut().expect("the object frame is there") = Frame::Object { node, seen, phase };
                    }
                }
                emit(out, t);
            }
            Frame::Array { node, count, phase } => {
                let Node::Array { items, min, max } = nodes[node] else {
                    unreachable!("an array frame is made for an array node")
                };
                let full = max.is_some_and(|m| count >= m);
                match (phase, c) {
                    (_, c) if is_ws(c) => t.stack.push(Frame::Array { node, count, phase }),
                    (Arr::First | Arr::After, b']') => {
                        if count < min {
                            return;
                        }
                    }
                    (Arr::After, b',') => {
                        if full {
                            return;
                        }
                        t.stack.push(Frame::Array { node, count, phase: Arr::Next });
                    }
                    (Arr::First | Arr::Next, _) => {
                        if full {
                            return;
                        }
                        t.stack.push(Frame::Array { node, count: count + 1, phase: Arr::After });
                        return self.start(t, items, c, out, depth);
                    }
                    _ => return,
                }
                emit(out, t);
            }
            Frame::Str { node, chars, mut lex, re } => {
                let Node::String { min, max, ref pattern } = nodes[node] else {
                    unreachable!("a string frame is made for a string node")
                };
                let prev = lex;
                match lex.push(c) {
                    StrByte::Bad => return,
                    StrByte::Close => {
                        if chars < min {
                            return;
                        }
                        if let (Some(p), Some(s)) = (pattern, re) {
                            if !p.accepts(s) {
                                return;
                            }
                        }
                    }
                    StrByte::Content { new_char } => {
                        let chars = chars + u32::from(new_char);
                        if max.is_some_and(|m| chars > m) {
                            return;
                        }
                        let re = match (pattern, re) {
                            (Some(p), Some(s)) => {
                                let next = match decoded(prev, c) {
                                    // Only where a short escape can follow.
                                    Decoded::Backslash => {
                                        b"\"\\/\x08\x0c\n\r\t".iter().any(|&b| p.step(s, b).is_some()).then_some(s)
                                    }
                                    Decoded::Byte(b) => p.step(s, b),
                                    Decoded::Refused => None,
                                };
                                match next {
                                    Some(s) => Some(s),
                                    None => return,
                                }
                            }
                            _ => None,
                        };
                        t.stack.push(Frame::Str { node, chars, lex, re });
                    }
                }
                emit(out, t);
            }
            Frame::Number { node, at, mut text, ok } => {
                let Node::Number { integer, range } = nodes[node] else {
                    unreachable!("a number frame is made for a number node")
                };
                match at.next(c, integer, range.is_none()) {
                    Some(at) => {
                        let ok = match range {
                            None => at.complete(),
                            Some(r) => {
                                text.push(c);
                                if !number_can_reach(&text, integer, &r) {
                                    return;
                                }
                                at.complete() && number_in(&text, &r)
                            }
                        };
                        t.stack.push(Frame::Number { node, at, text, ok });
                        emit(out, t);
                    }
                    // The number ends here; the byte belongs to what follows it.
                    None if ok => self.dispatch(t, c, out, depth),
                    None => {}
                }
            }
            Frame::Literal { node, pos, mut cands } => {
                let Node::Literals(texts) = &nodes[node] else {
                    unreachable!("a literal frame is made for a literal node")
                };
                cands.retain(|&i| texts[i as usize].get(pos as usize) == Some(&c));
                self.literal(t, node, pos + 1, cands, out);
            }
        }
    }

    /// Start a value of node `n` with its first (non-whitespace) byte `c`.
    fn start(&self, mut t: Thread, n: NodeId, c: u8, out: &mut Vec<Thread>, depth: u32) {
        let nodes = &self.schema.nodes;
        match &nodes[n] {
            Node::Any => {
                let k = match c {
                    b'{' => ANY_OBJECT,
                    b'[' => ANY_ARRAY,
                    b'"' => ANY_STRING,
                    b'-' | b'0'..=b'9' => ANY_NUMBER,
                    b't' | b'f' => BOOL,
                    b'n' => NULL,
                    _ => return,
                };
                self.start(t, k, c, out, depth);
            }
            Node::AnyOf(alts) if depth < MAX_EXPANSION => {
                for &a in alts {
                    self.start(t.clone(), a, c, out, depth + 1);
                }
            }
            Node::Object { .. } if c == b'{' => {
                t.stack.push(Frame::Object { node: n, seen: 0, phase: Obj::First });
                emit(out, t);
            }
            Node::Array { .. } if c == b'[' => {
                t.stack.push(Frame::Array { node: n, count: 0, phase: Arr::First });
                emit(out, t);
            }
            Node::String { pattern, .. } if c == b'"' => {
                let re = pattern.as_ref().map(|p| p.start());
                t.stack.push(Frame::Str { node: n, chars: 0, lex: Lex::Plain, re });
                emit(out, t);
            }
            &Node::Number { integer, range } => {
                let at = match c {
                    b'-' => Num::Minus,
                    b'0' => Num::Zero,
                    b'1'..=b'9' => Num::Int(1),
                    _ => return,
                };
                let (text, ok) = match range {
                    None => (vec![], at.complete()),
                    Some(r) => {
                        if !number_can_reach(&[c], integer, &r) {
                            return;
                        }
                        (vec![c], at.complete() && number_in(&[c], &r))
                    }
                };
                t.stack.push(Frame::Number { node: n, at, text, ok });
                emit(out, t);
            }
            Node::Literals(texts) => {
                let cands = (0..texts.len() as u32).filter(|&i| texts[i as usize].first() == Some(&c)).collect();
                self.literal(t, n, 1, cands, out);
            }
            _ => {}
        }
    }

    /// After `pos` bytes of a literal: the literals that are complete end the value (one
    /// reading), the longer ones go on (another).
    fn literal(&self, t: Thread, node: NodeId, pos: u32, cands: Vec<u32>, out: &mut Vec<Thread>) {
        let Node::Literals(texts) = &self.schema.nodes[node] else {
            unreachable!("a literal frame is made for a literal node")
        };
        let (done, rest): (Vec<u32>, Vec<u32>) =
            cands.into_iter().partition(|&i| texts[i as usize].len() == pos as usize);
        if !done.is_empty() {
            emit(out, t.clone());
        }
        if !rest.is_empty() {
            let mut t = t;
            t.stack.push(Frame::Literal { node, pos, cands: rest });
            emit(out, t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn run(schema: &Arc<Schema>, text: &[u8]) -> Option<bool> {
        let mut m = JsonMatcher::new(schema.clone());
        m.push_all(text).then(|| m.can_end())
    }

    fn accepts(text: &str) -> Option<bool> {
        run(&Arc::new(Schema::any_object()), text.as_bytes())
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
                assert_eq!(
                    run(&Arc::new(Schema::any_object()), &ok.as_bytes()[..i]),
                    Some(false),
                    "prefix {i} of {ok}"
                );
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
        assert_eq!(accepts("\n\n{}"), Some(true));
        assert_eq!(accepts("     {}"), None);
        assert_eq!(accepts("\n\n\n{}"), None);
        assert_eq!(accepts(&format!("{{\r\n{}}}", " ".repeat(20))), Some(true));
        assert_eq!(accepts(&format!("{{ \t\r\n{}\"a\" :\t1 }}", "\t".repeat(20))), Some(true));
        assert_eq!(accepts(&format!("{{\n{}}}", " ".repeat(21))), None);
        assert_eq!(accepts(&format!("{{{}}}", " ".repeat(5))), None);
        assert_eq!(accepts("{\n\n}"), None);
        assert_eq!(accepts("{ \"a\":  \n1}"), Some(true));
        assert_eq!(accepts("{ \"a\":     \n1}"), None);
        assert_eq!(accepts(&format!("{{\"{}\": 1}}", " ".repeat(100))), Some(true));
    }

    fn schema(s: Value) -> Arc<Schema> {
        Arc::new(Schema::compile(&s).unwrap())
    }

    #[test]
    fn objects_follow_their_properties() {
        let s = schema(json!({
            "type": "object",
            "properties": {"name": {"type": "string"}, "size": {"type": "integer"}, "tag": {"type": "string"}},
            "required": ["name", "size"],
            "additionalProperties": false
        }));
        for ok in ["{\"name\": \"a\", \"size\": 3}", "{\"size\":-1,\"tag\":\"x\",\"name\":\"\"}"] {
            assert_eq!(run(&s, ok.as_bytes()), Some(true), "{ok}");
        }
        for (bad, why) in [
            ("{\"name\": \"a\"}", "required size missing"),
            ("{\"nam\"", "unknown key"),
            ("{\"x", "no key starts with x"),
            ("{\"name\": 1", "name is a string"),
            ("{\"size\": 1.5", "size is an integer"),
            ("{\"size\": 1e3", "size is an integer"),
            ("{\"size\": 1, \"size\"", "a key twice"),
            ("{\"name\": \"a\", \"size\": 1, \"tag\": \"t\",", "no key left"),
            ("{}", "required keys missing"),
        ] {
            assert_ne!(run(&s, bad.as_bytes()), Some(true), "{bad}: {why}");
            assert_ne!(run(&s, bad.as_bytes()), Some(false), "{bad}: {why}: refused as a prefix");
        }
        // Additional keys (absent `additionalProperties`) take any value; known keys keep
        // their schema.
        let open = schema(json!({"properties": {"n": {"type": "number"}}}));
        assert_eq!(run(&open, b"{\"x\": [1, {\"y\": null}], \"n\": 2.5}"), Some(true));
        assert_eq!(run(&open, b"{\"n\": \"2\""), None);
        assert_eq!(run(&open, b"{\"n\": 1, \"n\""), None);
        let typed = schema(json!({"type": "object", "additionalProperties": {"type": "boolean"}}));
        assert_eq!(run(&typed, b"{\"a\": true, \"b\": false}"), Some(true));
        assert_eq!(run(&typed, b"{\"a\": 1"), None);
    }

    #[test]
    fn strings_are_well_formed_utf8() {
        let s = schema(json!({"type": "string", "maxLength": 3}));
        for ok in ["\"é€😀\"", "\"\\u00e9ab\"", "\"\u{7f}\""] {
            assert_eq!(run(&s, ok.as_bytes()), Some(true), "{ok}");
        }
        assert_eq!(run(&s, "\"é€😀a\"".as_bytes()), None, "four characters");
        // A character split over pushes is checked byte by byte.
        let mut m = JsonMatcher::new(s.clone());
        assert!(m.push_all(b"\"\xe2\x82") && !m.clone().push(b'"') && m.push(0xac) && m.push(b'"') && m.can_end());
        for bad in [
            &b"\"\x80\""[..],        // a continuation byte without a lead
            b"\"\xc0\xaf\"",         // an overlong '/'
            b"\"\xed\xa0\x80\"",     // a UTF-16 surrogate
            b"\"\xf4\x90\x80\x80\"", // above U+10FFFF
            b"\"\xe2\x82\"",         // a character cut short
            b"\"\xff\"",
        ] {
            assert_eq!(run(&s, bad), None, "{bad:?}");
        }
    }

    #[test]
    fn numbers_always_parse() {
        let (int, num) = (schema(json!({"type": "integer"})), schema(json!({"type": "number"})));
        let max = "9".repeat(18);
        for (s, text) in
            [(&int, max.as_str()), (&num, "-0"), (&int, "0"), (&num, "-999999999999999999.5e-99"), (&num, "1E+99")]
        {
            assert_eq!(run(s, text.as_bytes()), Some(true), "{text}");
            let v: Value = serde_json::from_str(text).unwrap();
            assert!(v.is_i64() || v.as_f64().is_some_and(f64::is_finite), "{text}");
        }
        for (s, text) in [
            (&int, format!("{max}0")),
            (&num, "1e100".into()),
            (&int, "1.0".into()),
            (&num, "01".into()),
            (&int, "-0".into()),
        ] {
            assert_eq!(run(s, text.as_bytes()), None, "{text}");
        }
    }

    #[test]
    fn bounded_numbers_stay_in_bounds() {
        let cases = [
            (
                json!({"type": "integer", "minimum": 1, "maximum": 5}),
                &["1", "3", "5"][..],
                &["0", "6", "10", "-1", "1.0", "2e0"][..],
            ),
            (
                json!({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
                &["0.5", "1", "1.0", "0.0001", "1.00"],
                &["0", "0.0", "-0.1", "1.5", "1e-3", "10", "1.01"],
            ),
            (
                json!({"type": "integer", "minimum": -3, "exclusiveMaximum": 100}),
                &["-3", "-1", "0", "99"],
                &["-4", "100", "-0"],
            ),
            (json!({"minimum": 2.5}), &["2.5", "3", "1000"], &["2.4", "-3"]),
            (json!({"type": ["integer", "null"], "maximum": -10}), &["-10", "-11", "null"], &["-9", "0", "1"]),
        ];
        for (s, ok, bad) in cases {
            let c = schema(s.clone());
            for t in ok {
                assert_eq!(run(&c, t.as_bytes()), Some(true), "{s} {t}");
            }
            for t in bad {
                assert_ne!(run(&c, t.as_bytes()), Some(true), "{s} {t}");
            }
        }
        // Every live prefix can still be completed: a digit or the end is always allowed.
        let c = schema(json!({"type": "number", "minimum": 0.25, "exclusiveMaximum": 0.5}));
        let mut m = JsonMatcher::new(c.clone());
        assert!(!m.clone().push(b'1') && !m.clone().push(b'-') && m.push(b'0'));
        assert!(m.push(b'.') && !m.clone().push(b'5') && !m.clone().push(b'1') && m.push(b'3') && m.can_end());
        // Inside an object, the number ends at the delimiter only when it is in bounds.
        let o = schema(json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 10}}}));
        assert_eq!(run(&o, b"{\"n\": 12}"), Some(true));
        assert_eq!(run(&o, b"{\"n\": 1}"), None);
        assert_eq!(run(&o, b"{\"n\": 1"), Some(false), "1 can still grow into 10..");
    }

    #[test]
    fn patterns_see_the_decoded_string() {
        let s = schema(json!({"type": "string", "pattern": "^a\"[\\n]é$"}));
        assert_eq!(run(&s, "\"a\\\"\\né\"".as_bytes()), Some(true));
        let t = schema(json!({"type": "string", "pattern": "^[\\t/]+$"}));
        assert_eq!(run(&t, b"\"\\t\\/\t/\""), None, "a raw tab is not JSON");
        assert_eq!(run(&t, b"\"\\t\\//\""), Some(true));
        // A backslash only where what it can escape may come.
        let u = schema(json!({"type": "string", "pattern": "^[A-Z]+$"}));
        assert_eq!(run(&u, b"\"AB\\"), None);
        for bad in ["\"a\\\"\\nx\"", "\"a\\\"\\né \"", "\"b", "\"a\\u0022"] {
            assert_eq!(run(&s, bad.as_bytes()), None, "{bad}");
        }
        // A string that can no longer match is refused at the byte that decides it, and the
        // closing quote only once it matches.
        let d = schema(json!({"type": "string", "format": "date"}));
        let mut m = JsonMatcher::new(d);
        assert!(m.push_all(b"\"2026-1") && !m.clone().push(b'3') && m.push(b'2') && !m.clone().push(b'"'));
        assert!(m.push_all(b"-06") && m.push(b'"') && m.can_end());
    }

    #[test]
    fn scalars_enums_and_alternatives() {
        let e = schema(json!({"enum": ["red", "green", 1, 10, null]}));
        for ok in ["\"red\"", "\"green\"", "1", "10", "null", " 10"] {
            assert_eq!(run(&e, ok.as_bytes()), Some(true), "{ok}");
        }
        for bad in ["\"re\"", "\"blue\"", "100", "2", "true", "\"red\" "] {
            assert_ne!(run(&e, bad.as_bytes()), Some(true), "{bad}");
        }
        assert_eq!(run(&e, b"1"), Some(true), "1 ends or goes on to 10");
        let c = schema(json!({"const": {"a": [1, 2]}}));
        assert_eq!(run(&c, b"{\"a\":[1,2]}"), Some(true));
        let opt = schema(json!({"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]}));
        for (t, want) in
            [("\"abc\"", Some(true)), ("\"abcd", None), ("null", Some(true)), ("nul", Some(false)), ("1", None)]
        {
            assert_eq!(run(&opt, t.as_bytes()), want, "{t}");
        }
        // Lengths count characters: a UTF-8 sequence and an escape are one each.
        let s = schema(json!({"type": "string", "minLength": 2, "maxLength": 3}));
        for (t, want) in [
            ("\"é\"", None),
            ("\"éé\"", Some(true)),
            ("\"\\u00e9\\n東\"", Some(true)),
            ("\"abcd", None),
            ("\"a\"", None),
        ] {
            assert_eq!(run(&s, t.as_bytes()), want, "{t}");
        }
        let n = schema(json!({"type": ["integer", "boolean"]}));
        assert_eq!(run(&n, b"-12"), Some(true));
        assert_eq!(run(&n, b"-"), Some(false));
        assert_eq!(run(&n, b"true"), Some(true));
        assert_eq!(run(&n, b"1."), None);
        let nullable = schema(json!({"type": "number", "nullable": true}));
        assert_eq!(run(&nullable, b"null"), Some(true));
        assert_eq!(run(&nullable, b"2e-3"), Some(true));
    }

    #[test]
    fn arrays_and_recursion() {
        let a = schema(json!({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}));
        for (t, want) in [("[1]", Some(true)), ("[1, 2]", Some(true)), ("[]", None), ("[1,2,", None), ("[\"a\"", None)]
        {
            assert_eq!(run(&a, t.as_bytes()), want, "{t}");
        }
        let list = schema(json!({
            "$defs": {"Node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}, "required": ["v", "next"], "additionalProperties": false}},
            "$ref": "#/$defs/Node"
        }));
        assert_eq!(run(&list, b"{\"v\": 1, \"next\": {\"v\": 2, \"next\": null}}"), Some(true));
        assert_eq!(run(&list, b"{\"v\": 1, \"next\": {\"v\": 2}}"), None);
        let tree = schema(
            json!({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "additionalProperties": false}),
        );
        assert_eq!(run(&tree, b"{\"kids\": [{}, {\"kids\": [{\"kids\": []}]}]}"), Some(true));
        assert_eq!(run(&tree, b"{\"kids\": [1"), None);
    }

    /// A small xorshift generator (the tests need no crate for it).
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    /// A validator of the supported keywords, written apart from the matcher: what a random
    /// walk through the matcher produces must pass it.
    fn valid(root: &Value, s: &Value, v: &Value) -> bool {
        if let Some(r) = s.get("$ref").and_then(Value::as_str) {
            return valid(root, root.pointer(&r[1..]).unwrap(), v);
        }
        if let Some(alts) = s.get("anyOf").and_then(Value::as_array) {
            return alts.iter().any(|a| valid(root, a, v));
        }
        if let Some(vals) = s.get("enum").and_then(Value::as_array) {
            return vals.contains(v);
        }
        if let Some(t) = s.get("type").and_then(Value::as_str) {
            let ok = match t {
                "object" => v.is_object(),
                "array" => v.is_array(),
                "string" => v.is_string(),
                "integer" => v.as_f64().is_some_and(|f| f.fract() == 0.0),
                "number" => v.is_number(),
                "boolean" => v.is_boolean(),
                _ => v.is_null(),
            };
            if !ok {
                return false;
            }
        }
        if let (Some(o), Some(props)) = (v.as_object(), s.get("properties").and_then(Value::as_object)) {
            let req = s.get("required").and_then(Value::as_array).cloned().unwrap_or_default();
            if !req.iter().all(|k| o.contains_key(k.as_str().unwrap())) {
                return false;
            }
            let closed = s.get("additionalProperties") == Some(&Value::Bool(false));
            for (k, x) in o {
                match props.get(k) {
                    Some(ps) if !valid(root, ps, x) => return false,
                    None if closed => return false,
                    _ => {}
                }
            }
        }
        if let Some(a) = v.as_array() {
            let n = a.len() as u64;
            let items = s.get("items").cloned().unwrap_or(json!({}));
            if s.get("minItems").and_then(Value::as_u64).is_some_and(|m| n < m)
                || s.get("maxItems").and_then(Value::as_u64).is_some_and(|m| n > m)
                || !a.iter().all(|x| valid(root, &items, x))
            {
                return false;
            }
        }
        if let Some(x) = v.as_f64() {
            let bound = |k: &str| s.get(k).and_then(Value::as_f64);
            if bound("minimum").is_some_and(|m| x < m)
                || bound("maximum").is_some_and(|m| x > m)
                || bound("exclusiveMinimum").is_some_and(|m| x <= m)
                || bound("exclusiveMaximum").is_some_and(|m| x >= m)
            {
                return false;
            }
        }
        if let Some(t) = v.as_str() {
            if let Some(p) = s.get("pattern").and_then(Value::as_str) {
                // ECMA-262's \d is ASCII.
                if !regex::Regex::new(&p.replace("\\d", "[0-9]")).unwrap().is_match(t) {
                    return false;
                }
            }
            let n = t.chars().count() as u64;
            if s.get("minLength").and_then(Value::as_u64).is_some_and(|m| n < m)
                || s.get("maxLength").and_then(Value::as_u64).is_some_and(|m| n > m)
            {
                return false;
            }
        }
        true
    }

    #[test]
    fn random_walks_end_in_valid_documents() {
        let s = json!({
            "$defs": {"Step": {"type": "object", "properties": {
                "action": {"enum": ["tap", "swipe", "type"]},
                "index": {"type": "integer", "minimum": 3, "maximum": 40},
                "text": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
                "sub": {"type": "array", "items": {"$ref": "#/$defs/Step"}, "maxItems": 2}
            }, "required": ["action", "index"], "additionalProperties": false}},
            "type": "object",
            "properties": {
                "plan": {"type": "array", "items": {"$ref": "#/$defs/Step"}, "minItems": 1, "maxItems": 3},
                "done": {"type": "boolean"},
                "score": {"type": "number", "exclusiveMinimum": -0.5, "maximum": 0.75},
                "note": {"type": "string", "minLength": 2},
                "id": {"type": "string", "pattern": "^[a-f]\\d{2}(-[xy\"é]+)?$"}
            },
            "required": ["plan", "done", "note", "id"],
            "additionalProperties": false
        });
        let c = Arc::new(Schema::compile(&s).unwrap());
        // After some random steps, these bytes are preferred (in order), so walks end.
        let closers = b"\"]}:,0n";
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut ended = 0;
        for walk in 0..200 {
            let mut m = JsonMatcher::new(c.clone());
            let mut text = vec![];
            while !(m.can_end() && (m.is_finished() || text.len() > 150 || rng.below(4) == 0)) {
                let ok: Vec<u8> = (0..=255u8)
                    .filter(|&b| {
                        let mut m2 = m.clone();
                        m2.push(b)
                    })
                    .collect();
                assert!(
                    !ok.is_empty(),
                    "walk {walk}: a live state allows no byte after {:?}",
                    String::from_utf8_lossy(&text)
                );
                // Random choices stay in ASCII without escapes and exponents (so the text is
                // UTF-8 without lone surrogates, and its numbers fit an f64), where the state
                // allows something else.
                let plain: Vec<u8> = ok.iter().copied().filter(|&b| b < 0x80 && !b"\\eE".contains(&b)).collect();
                let pick = if plain.is_empty() { &ok } else { &plain };
                let b = if text.len() > 60 {
                    closers.iter().copied().find(|x| ok.contains(x)).unwrap_or(pick[0])
                } else {
                    pick[rng.below(pick.len())]
                };
                assert!(m.push(b));
                text.push(b);
                assert!(text.len() < 4000, "walk {walk} does not end: {:?}", String::from_utf8_lossy(&text));
            }
            let v: Value = serde_json::from_slice(&text)
                .unwrap_or_else(|e| panic!("walk {walk}: {e}: {:?}", String::from_utf8_lossy(&text)));
            assert!(valid(&s, &s, &v), "walk {walk}: {v}");
            ended += 1;
        }
        assert_eq!(ended, 200);
    }
}
