//! Tool calls in Spark's markup, held to the offered tools' schemas while they are generated.
//!
//! Spark writes a call as
//! `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, each marker one
//! special token. [`ToolCalls`] lets the content run free and, from a `<tool_call>` token on,
//! allows only what the parser ([`crate::chat::toolcall`]) reads as a valid call:
//!
//! - NAME is an offered tool's name, exactly;
//! - each K is one of the tool's declared parameters, at most once (any key, once, when the tool
//!   declares none or sets `additionalProperties` to `true` or a schema);
//! - each V is what the parser will type it as: when the parameter's schema allows strings only,
//!   a raw string (its `minLength` / `maxLength`, `pattern` or checked `format`, and `enum`
//!   enforced); when it allows no string, JSON of the parameter's schema
//!   ([`Schema::compile_relaxed`]: keywords that are not enforced are relaxed to the bare type,
//!   so nothing valid is refused); otherwise free text (the parser keeps it as a string). Raw
//!   values and free text are well-formed UTF-8;
//! - `</tool_call>` once every required parameter is given;
//! - nothing between the markers (the official format has no whitespace there).
//!
//! Outside calls the markers other than `<tool_call>` are refused; the reasoning (before
//! `</think>`) is free. A token the grammar does not allow that comes anyway (a forced or
//! scripted token) leaves that call unconstrained until its `</tool_call>`. With `must_call`
//! (tool_choice `required` or named) the end-of-sequence tokens are refused until a call has
//! closed. Text that spells a marker with ordinary tokens is not a marker here (the parser, which
//! reads text, may still take it for one).

use std::sync::Arc;

use serde_json::Value;

use regex_automata::util::primitives::StateID;

use super::matcher::{utf8_lead, JsonMatcher};
use super::pattern::Pattern;
use super::schema::{Node, NodeId, Schema, SchemaError};
use super::{ByteFilter, Constraint, TokenBytes};
use crate::chat::toolcall::{schema_types, ToolSpec};

/// Longest key allowed where any key is.
const MAX_FREE_KEY: usize = 64;

/// The marker tokens of Spark's tool-call markup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Markers {
    pub tool_call: u32,
    pub end_tool_call: u32,
    pub arg_key: u32,
    pub end_arg_key: u32,
    pub arg_value: u32,
    pub end_arg_value: u32,
}

impl Markers {
    fn contains(&self, t: u32) -> bool {
        [self.tool_call, self.end_tool_call, self.arg_key, self.end_arg_key, self.arg_value, self.end_arg_value]
            .contains(&t)
    }
}

/// What an argument value may be.
#[derive(Debug, Clone)]
enum Rule {
    /// JSON of this node of the tool's schema.
    Json(NodeId),
    /// A raw string of `min..=max` characters.
    Raw { min: u32, max: Option<u32>, pattern: Option<Arc<Pattern>> },
    /// One of these raw strings.
    Enum(Vec<Vec<u8>>),
    /// Any text.
    Text,
}

#[derive(Debug, Clone)]
struct Param {
    key: Vec<u8>,
    rule: Rule,
}

/// One tool's call grammar.
#[derive(Debug, Clone)]
struct Tool {
    name: Vec<u8>,
    params: Vec<Param>,
    /// Bit i: `params[i]` is required.
    required: u64,
    /// Whether keys other than `params` are allowed.
    free_keys: bool,
    schema: Arc<Schema>,
}

/// The call grammars of the offered tools (compiled once per request).
#[derive(Debug, Clone)]
pub struct ToolGrammar {
    tools: Vec<Tool>,
}

/// Follow single-alternative `anyOf` nodes (what `$ref` compiles to).
fn resolve(schema: &Schema, mut n: NodeId) -> NodeId {
    for _ in 0..32 {
        match &schema.nodes[n] {
            Node::AnyOf(v) if v.len() == 1 => n = v[0],
            _ => break,
        }
    }
    n
}

/// The text of a JSON string literal's contents (as the schema stores keys and literals).
fn unescape(quoted_inner: &[u8]) -> Option<Vec<u8>> {
    let mut q = Vec::with_capacity(quoted_inner.len() + 2);
    q.push(b'"');
    q.extend_from_slice(quoted_inner);
    q.push(b'"');
    serde_json::from_slice::<String>(&q).ok().map(String::into_bytes)
}

impl ToolGrammar {
    /// Compile the tools' parameter schemas. Returns the grammar and, per tool, what of its schema
    /// was relaxed (keywords not enforced).
    pub fn new(tools: &[ToolSpec]) -> (ToolGrammar, Vec<(String, SchemaError)>) {
        let mut notes = vec![];
        let tools = tools
            .iter()
            .map(|spec| {
                let (schema, relaxed) = match &spec.parameters {
                    Value::Null => (Schema::any_object(), vec![]),
                    p => Schema::compile_relaxed(p),
                };
                notes.extend(relaxed.into_iter().map(|e| (spec.name.clone(), e)));
                Tool::new(spec, Arc::new(schema))
            })
            .collect();
        (ToolGrammar { tools }, notes)
    }

    fn named(&self, name: &[u8]) -> Option<usize> {
        self.tools.iter().position(|t| t.name == name)
    }
}

impl Tool {
    fn new(spec: &ToolSpec, schema: Arc<Schema>) -> Tool {
        let p = &spec.parameters;
        let mut tool = Tool {
            name: spec.name.as_bytes().to_vec(),
            params: vec![],
            required: 0,
            free_keys: true,
            schema: schema.clone(),
        };
        let root = resolve(&schema, schema.root);
        if let Node::Object { props, required, additional } = &schema.nodes[root] {
            tool.required = *required;
            tool.free_keys = additional.is_some() && (props.is_empty() || p.get("additionalProperties").is_some());
            for (k, node) in props {
                let Some(key) = unescape(k) else { continue };
                let declared = std::str::from_utf8(&key).ok().and_then(|k| p.get("properties")?.get(k));
                tool.params.push(Param { rule: rule(&schema, *node, declared), key });
            }
        }
        tool
    }

    /// Whether another key may come.
    fn key_left(&self, call: &Call) -> bool {
        self.free_keys || (0..self.params.len()).any(|i| !call.seen(i))
    }

    /// The key a complete `<arg_key>` text names: `Some(Some(i))` parameter i, `Some(None)` a
    /// free key, `None` not allowed.
    fn key(&self, call: &Call, k: &[u8]) -> Option<Option<usize>> {
        if let Some(i) = self.params.iter().position(|p| p.key == k) {
            return (!call.seen(i)).then_some(Some(i));
        }
        let free = self.free_keys
            && !k.is_empty()
            && std::str::from_utf8(k).is_ok()
            && !call.extra.iter().any(|e| e == k)
            && free_key_prefix(k);
        free.then_some(None)
    }

    /// Whether `k` can still grow into an allowed key.
    fn key_prefix(&self, call: &Call, k: &[u8]) -> bool {
        self.params.iter().enumerate().any(|(i, p)| !call.seen(i) && p.key.starts_with(k))
            || (self.free_keys && free_key_prefix(k))
    }
}

/// Whether `k` can begin a free key: at most [`MAX_FREE_KEY`] bytes of well-formed UTF-8, no
/// whitespace, control characters, `<`, `>`, `"` or `\`.
fn free_key_prefix(k: &[u8]) -> bool {
    let mut u = Utf8::default();
    k.iter().all(|&c| !c.is_ascii_whitespace() && !c.is_ascii_control() && !b"<>\"\\".contains(&c))
        && k.iter().all(|&c| u.push(c).is_some())
        // Room for the rest of a character cut short.
        && k.len() + usize::from(u.left) <= MAX_FREE_KEY
}

/// How the parser will read a parameter's value, from its declared schema (`None`: undeclared,
/// a string).
fn rule(schema: &Schema, node: NodeId, declared: Option<&Value>) -> Rule {
    let Some(d) = declared else { return Rule::Text };
    let types = schema_types(d);
    if types.is_empty() {
        return Rule::Text;
    }
    if types.iter().all(|t| t == "string") {
        return match &schema.nodes[resolve(schema, node)] {
            Node::String { min, max, pattern } => Rule::Raw { min: *min, max: *max, pattern: pattern.clone() },
            Node::Literals(texts) if texts.iter().all(|t| t.first() == Some(&b'"')) => {
                Rule::Enum(texts.iter().filter_map(|t| unescape(&t[1..t.len() - 1])).collect())
            }
            _ => Rule::Text,
        };
    }
    if types.iter().any(|t| t == "string") {
        Rule::Text
    } else {
        Rule::Json(node)
    }
}

/// Well-formedness of UTF-8 bytes fed one at a time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Utf8 {
    left: u8,
    lo: u8,
    hi: u8,
}

impl Utf8 {
    /// `Some(starts a character)`, or `None` when the byte cannot come here.
    fn push(&mut self, c: u8) -> Option<bool> {
        if self.left > 0 {
            if !(self.lo..=self.hi).contains(&c) {
                return None;
            }
            *self = Utf8 { left: self.left - 1, lo: 0x80, hi: 0xbf };
            return Some(false);
        }
        if c >= 0x80 {
            let (left, lo, hi) = utf8_lead(c)?;
            *self = Utf8 { left, lo, hi };
        }
        Some(true)
    }
}

/// The call being written: which tool, which of its parameters are given, free keys given.
#[derive(Debug, Clone)]
struct Call {
    tool: usize,
    seen: u64,
    extra: Vec<Vec<u8>>,
}

impl Call {
    fn seen(&self, i: usize) -> bool {
        i < 64 && self.seen & (1 << i) != 0
    }
}

/// An argument value being written.
#[derive(Debug, Clone)]
enum Val {
    Json(JsonMatcher),
    Raw { min: u32, max: Option<u32>, chars: u32, utf8: Utf8, re: Option<(Arc<Pattern>, StateID)> },
    Enum { cands: Vec<Vec<u8>>, buf: Vec<u8> },
    Text(Utf8),
}

impl Val {
    fn new(tool: &Tool, param: Option<usize>) -> Val {
        match param.map(|i| &tool.params[i].rule) {
            Some(&Rule::Json(n)) => Val::Json(JsonMatcher::at(tool.schema.clone(), n)),
            Some(Rule::Raw { min, max, pattern }) => Val::Raw {
                min: *min,
                max: *max,
                chars: 0,
                utf8: Utf8::default(),
                re: pattern.as_ref().map(|p| (p.clone(), p.start())),
            },
            Some(Rule::Enum(c)) => Val::Enum { cands: c.clone(), buf: vec![] },
            Some(Rule::Text) | None => Val::Text(Utf8::default()),
        }
    }

    fn push(&mut self, bytes: &[u8]) -> bool {
        match self {
            Val::Json(m) => m.push_all(bytes),
            Val::Raw { max, chars, utf8, re, .. } => bytes.iter().all(|&c| {
                let Some(new) = utf8.push(c) else { return false };
                *chars += u32::from(new);
                if let Some((p, s)) = re {
                    match p.step(*s, c) {
                        Some(n) => *s = n,
                        None => return false,
                    }
                }
                max.is_none_or(|m| *chars <= m)
            }),
            Val::Enum { cands, buf } => {
                buf.extend_from_slice(bytes);
                cands.retain(|c| c.starts_with(buf));
                !cands.is_empty()
            }
            Val::Text(u) => bytes.iter().all(|&c| u.push(c).is_some()),
        }
    }

    fn can_end(&self) -> bool {
        match self {
            Val::Json(m) => m.can_end(),
            Val::Raw { min, chars, utf8, re, .. } => {
                utf8.left == 0 && chars >= min && re.as_ref().is_none_or(|(p, s)| p.accepts(*s))
            }
            Val::Enum { cands, buf } => cands.iter().any(|c| c == buf),
            Val::Text(u) => u.left == 0,
        }
    }
}

#[derive(Debug, Clone)]
enum State {
    /// Before `</think>`: free.
    Reasoning,
    /// Content outside calls.
    Free,
    /// After `<tool_call>`: the name so far.
    Name(Vec<u8>),
    /// After a value: `<arg_key>` or `</tool_call>` next.
    Between(Call),
    /// After `<arg_key>`: the key so far.
    Key(Call, Vec<u8>),
    /// After `</arg_key>`: `<arg_value>` next, for this parameter (`None`: a free key).
    BeforeValue(Call, Option<usize>),
    /// After `<arg_value>`.
    Value(Call, Val),
    /// A call a disallowed token broke: free until `</tool_call>`.
    Lost,
}

/// The constraint: see the module doc.
pub struct ToolCalls {
    grammar: Arc<ToolGrammar>,
    bytes: TokenBytes,
    end: Vec<u32>,
    marks: Markers,
    end_think: Option<u32>,
    must_call: bool,
    calls: usize,
    state: State,
    /// Which first bytes may come in this state ([`ByteFilter`]).
    filter: ByteFilter,
}

impl ToolCalls {
    /// `end_think`: `Some(</think>)` when the reply begins with reasoning (thinking on).
    pub fn new(
        grammar: Arc<ToolGrammar>,
        bytes: TokenBytes,
        end: Vec<u32>,
        marks: Markers,
        end_think: Option<u32>,
        must_call: bool,
    ) -> ToolCalls {
        let state = if end_think.is_some() { State::Reasoning } else { State::Free };
        ToolCalls { grammar, bytes, end, marks, end_think, must_call, calls: 0, state, filter: ByteFilter::ALL }
    }

    fn token_bytes(&self, t: u32) -> Option<&[u8]> {
        match self.bytes.get(t as usize) {
            Some(Some(b)) if !b.is_empty() => Some(b),
            _ => None,
        }
    }

    fn allowed(&self, state: &State, token: u32) -> bool {
        if self.end.contains(&token) {
            return match state {
                State::Reasoning | State::Free => !self.must_call || self.calls > 0,
                State::Lost => true,
                _ => false,
            };
        }
        if self.marks.contains(token) {
            return self.marker_ok(state, token);
        }
        match state {
            State::Reasoning | State::Free | State::Lost => true,
            _ => match self.token_bytes(token) {
                Some(b) => self.filter.passes(b) && self.text_ok(state, b),
                None => false,
            },
        }
    }

    /// Whether a marker token may come.
    fn marker_ok(&self, state: &State, token: u32) -> bool {
        let m = &self.marks;
        let tools = &self.grammar.tools;
        match state {
            State::Reasoning | State::Lost => true,
            State::Free => token == m.tool_call,
            State::Name(buf) => {
                let Some(i) = self.grammar.named(buf) else { return false };
                let t = &tools[i];
                (token == m.arg_key && t.key_left(&Call { tool: i, seen: 0, extra: vec![] }))
                    || (token == m.end_tool_call && t.required == 0)
            }
            State::Between(call) => {
                let t = &tools[call.tool];
                (token == m.arg_key && t.key_left(call)) || (token == m.end_tool_call && t.required & !call.seen == 0)
            }
            State::Key(call, buf) => token == m.end_arg_key && tools[call.tool].key(call, buf).is_some(),
            State::BeforeValue(..) => token == m.arg_value,
            State::Value(_, v) => token == m.end_arg_value && v.can_end(),
        }
    }

    /// Whether text `b` may come.
    fn text_ok(&self, state: &State, b: &[u8]) -> bool {
        match state {
            State::Reasoning | State::Free | State::Lost => true,
            State::Name(buf) => self.grammar.tools.iter().any(|t| {
                t.name.len() >= buf.len() + b.len() && t.name.starts_with(buf) && t.name[buf.len()..].starts_with(b)
            }),
            State::Key(call, buf) => {
                let mut k = buf.clone();
                k.extend_from_slice(b);
                self.grammar.tools[call.tool].key_prefix(call, &k)
            }
            State::Between(_) | State::BeforeValue(..) => false,
            State::Value(_, Val::Json(m)) => m.accepts(b),
            State::Value(_, v) => v.clone().push(b),
        }
    }

    fn next(&mut self, state: State, token: u32) -> State {
        let m = self.marks;
        if self.end.contains(&token) {
            return state;
        }
        let lost_or_free = |s: &State| if matches!(s, State::Free) { State::Free } else { State::Lost };
        match state {
            State::Reasoning => {
                if Some(token) == self.end_think {
                    State::Free
                } else {
                    State::Reasoning
                }
            }
            State::Lost => {
                if token == m.end_tool_call {
                    self.calls += 1;
                    State::Free
                } else {
                    State::Lost
                }
            }
            s if !self.allowed(&s, token) => lost_or_free(&s),
            State::Free => {
                if token == m.tool_call {
                    State::Name(vec![])
                } else {
                    State::Free
                }
            }
            State::Name(mut buf) => {
                if token == m.arg_key || token == m.end_tool_call {
                    let tool = self.grammar.named(&buf).expect("allowed: the name is a tool's");
                    if token == m.end_tool_call {
                        self.calls += 1;
                        return State::Free;
                    }
                    return State::Key(Call { tool, seen: 0, extra: vec![] }, vec![]);
                }
                buf.extend_from_slice(self.token_bytes(token).expect("allowed: text"));
                State::Name(buf)
            }
            State::Between(call) => {
                if token == m.end_tool_call {
                    self.calls += 1;
                    State::Free
                } else {
                    State::Key(call, vec![])
                }
            }
            State::Key(mut call, mut buf) => {
                if token == m.end_arg_key {
                    let param = self.grammar.tools[call.tool].key(&call, &buf).expect("allowed: a key");
                    match param {
                        Some(i) if i < 64 => call.seen |= 1 << i,
                        Some(_) => {}
                        None => call.extra.push(buf),
                    }
                    return State::BeforeValue(call, param);
                }
                buf.extend_from_slice(self.token_bytes(token).expect("allowed: text"));
                State::Key(call, buf)
            }
            State::BeforeValue(call, param) => {
                let v = Val::new(&self.grammar.tools[call.tool], param);
                State::Value(call, v)
            }
            State::Value(call, mut v) => {
                if token == m.end_arg_value {
                    return State::Between(call);
                }
                v.push(self.token_bytes(token).expect("allowed: text"));
                State::Value(call, v)
            }
        }
    }

    fn update_filter(&mut self) {
        self.filter = match self.state {
            State::Reasoning | State::Free | State::Lost => ByteFilter::ALL,
            ref s => ByteFilter::new(|b| self.text_ok(s, b)),
        };
    }
}

impl Constraint for ToolCalls {
    fn allows(&self, token: u32) -> bool {
        self.allowed(&self.state, token)
    }

    fn advance(&mut self, token: u32) {
        let state = std::mem::replace(&mut self.state, State::Free);
        self.state = self.next(state, token);
        self.update_filter();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::toolcall::parse;
    use serde_json::json;

    // Vocabulary: ids 0..256 are the single bytes, then the six markers, `</think>`, EOS and a
    // few multi-byte tokens.
    const TC: u32 = 256;
    const MARKS: Markers = Markers {
        tool_call: 256,
        end_tool_call: 257,
        arg_key: 258,
        end_arg_key: 259,
        arg_value: 260,
        end_arg_value: 261,
    };
    const END_THINK: u32 = 262;
    const EOS: u32 = 263;
    const WORDS: [&str; 6] = ["tap", "index", "set_mode", "mode", "dark", "light"];
    const NAMES: [(&str, u32); 7] = [
        ("<tool_call>", 256),
        ("</tool_call>", 257),
        ("<arg_key>", 258),
        ("</arg_key>", 259),
        ("<arg_value>", 260),
        ("</arg_value>", 261),
        ("</think>", 262),
    ];

    fn vocab() -> TokenBytes {
        let mut v: Vec<Option<Vec<u8>>> = (0..=255u8).map(|b| Some(vec![b])).collect();
        v.extend((0..8).map(|_| None));
        v.extend(WORDS.iter().map(|w| Some(w.as_bytes().to_vec())));
        Arc::new(v)
    }

    /// Text with markers -> ids (markers as their tokens, everything else byte by byte).
    fn ids(s: &str) -> Vec<u32> {
        let mut s = s.as_bytes();
        let mut out = vec![];
        'outer: while !s.is_empty() {
            for (name, id) in NAMES {
                if let Some(rest) = s.strip_prefix(name.as_bytes()) {
                    out.push(id);
                    s = rest;
                    continue 'outer;
                }
            }
            out.push(u32::from(s[0]));
            s = &s[1..];
        }
        out
    }

    fn text(ids: &[u32]) -> String {
        let mut bytes = vec![];
        for &t in ids {
            match NAMES.iter().find(|n| n.1 == t) {
                Some((name, _)) => bytes.extend_from_slice(name.as_bytes()),
                None if t == EOS => {}
                None => bytes.extend_from_slice(vocab()[t as usize].as_ref().unwrap()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn tools() -> Vec<ToolSpec> {
        ToolSpec::from_openai(&json!([
            {"type": "function", "function": {"name": "tap", "parameters": {
                "type": "object", "properties": {"index": {"type": "integer", "multipleOf": 1}}, "required": ["index"]}}},
            {"type": "function", "function": {"name": "tap_long", "parameters": {
                "type": "object", "properties": {"index": {"type": "integer"}, "ms": {"type": "number"}}}}},
            {"type": "function", "function": {"name": "set_mode", "parameters": {
                "type": "object",
                "properties": {
                    "mode": {"enum": ["dark", "light"]},
                    "label": {"type": "string", "maxLength": 3},
                    "on": {"type": "boolean"},
                    "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                    "note": {"type": ["string", "null"]},
                    "code": {"type": "string", "pattern": "^[A-Z]{2}$"}
                },
                "required": ["mode"],
                "additionalProperties": false}}},
            {"type": "function", "function": {"name": "open"}},
        ]))
    }

    fn constraint(thinking: bool, must_call: bool) -> ToolCalls {
        let (g, notes) = ToolGrammar::new(&tools());
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert_eq!(notes[0].1.path, "$.properties.index.multipleOf");
        ToolCalls::new(Arc::new(g), vocab(), vec![EOS], MARKS, thinking.then_some(END_THINK), must_call)
    }

    /// Whether every token of `s`, then EOS, is allowed.
    fn accepts(s: &str) -> bool {
        let mut c = constraint(false, false);
        for t in ids(s) {
            if !c.allows(t) {
                return false;
            }
            c.advance(t);
        }
        c.allows(EOS)
    }

    #[test]
    fn calls_follow_the_tools() {
        for ok in [
            "",
            "Sure. <b>bold</b> text",
            "<tool_call>tap<arg_key>index</arg_key><arg_value>12</arg_value></tool_call>",
            "I tap.<tool_call>tap<arg_key>index</arg_key><arg_value> 0</arg_value></tool_call>done",
            "<tool_call>tap_long</tool_call><tool_call>open<arg_key>any.key-1</arg_key><arg_value>x y</arg_value></tool_call>",
            "<tool_call>set_mode<arg_key>on</arg_key><arg_value>true</arg_value><arg_key>mode</arg_key>\
             <arg_value>light</arg_value><arg_key>label</arg_key><arg_value>é<></arg_value><arg_key>ids</arg_key>\
             <arg_value>[1, -2]</arg_value><arg_key>note</arg_key><arg_value>anything: 1</arg_value><arg_key>code</arg_key>\
             <arg_value>QZ</arg_value></tool_call>",
        ] {
            assert!(accepts(ok), "{ok}");
        }
        for bad in [
            "<tool_call>tapp<arg_key>index</arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call> tap<arg_key>index</arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call>tap<arg_key>idx</arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call>tap<arg_key>index</arg_key><arg_value>one</arg_value></tool_call>",
            "<tool_call>tap<arg_key>index</arg_key><arg_value>1.5</arg_value></tool_call>",
            "<tool_call>tap</tool_call>",
            "<tool_call>tap<arg_key>index</arg_key><arg_value>1</arg_value>",
            "<tool_call>tap<arg_key>index</arg_key><arg_value>1</arg_value> </tool_call>",
            "<tool_call>tap<arg_key>index</arg_key><arg_value>1</arg_value><arg_key>index</arg_key><arg_value>2</arg_value></tool_call>",
            "<tool_call>set_mode<arg_key>mode</arg_key><arg_value>dim</arg_value></tool_call>",
            "<tool_call>set_mode<arg_key>mode</arg_key><arg_value>dark</arg_value><arg_key>code</arg_key><arg_value>ABC</arg_value></tool_call>",
            "<tool_call>set_mode<arg_key>mode</arg_key><arg_value>dark</arg_value><arg_key>code</arg_key><arg_value>A</arg_value></tool_call>",
            "<tool_call>set_mode<arg_key>mode</arg_key><arg_value>dark</arg_value><arg_key>code</arg_key><arg_value>\"AB\"</arg_value></tool_call>",
            "<tool_call>set_mode<arg_key>mode</arg_key><arg_value>darker</arg_value></tool_call>",
            "<tool_call>set_mode<arg_key>mode</arg_key><arg_value>\"dark\"</arg_value></tool_call>",
            "<tool_call>set_mode<arg_key>mode</arg_key><arg_value>dark</arg_value><arg_key>label</arg_key><arg_value>abcd</arg_value></tool_call>",
            "<tool_call>set_mode<arg_key>mode</arg_key><arg_value>dark</arg_value><arg_key>x</arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call>set_mode<arg_key>mode</arg_key><arg_value>dark</arg_value><arg_key>ids</arg_key><arg_value>[1,2,3]</arg_value></tool_call>",
            "<tool_call>open<arg_key>a b</arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call>open<arg_key></arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call>open<arg_key>k</arg_key><arg_value>1</arg_value><arg_key>k</arg_key><arg_value>2</arg_value></tool_call>",
            "text<arg_key>",
            "text</tool_call>",
        ] {
            assert!(!accepts(bad), "{bad}");
        }
        // Invalid UTF-8 in a raw value.
        let mut c = constraint(false, false);
        for t in ids("<tool_call>open<arg_key>k</arg_key><arg_value>") {
            c.advance(t);
        }
        assert!(c.allows(0xe2) && !c.allows(0xff));
        c.advance(0xe2);
        assert!(!c.allows(MARKS.end_arg_value) && !c.allows(b'a'.into()) && c.allows(0x82));
    }

    #[test]
    fn reasoning_is_free_and_a_required_call_must_close() {
        let mut c = constraint(true, true);
        for t in ids("think <arg_key> freely <tool_call>") {
            assert!(c.allows(t));
            c.advance(t);
        }
        assert!(!c.allows(EOS));
        c.advance(END_THINK);
        assert!(!c.allows(EOS) && !c.allows(MARKS.arg_key) && c.allows(TC));
        for t in ids("<tool_call>tap_long</tool_call>") {
            assert!(c.allows(t));
            c.advance(t);
        }
        assert!(c.allows(EOS));
    }

    #[test]
    fn a_forced_token_outside_the_grammar_frees_that_call() {
        let mut c = constraint(false, false);
        for t in ids("<tool_call>rm<arg_key>path</arg_key><arg_value>/</arg_value>") {
            c.advance(t);
        }
        assert!(c.allows(EOS) && c.allows(b'x'.into()));
        c.advance(MARKS.end_tool_call);
        assert!(!c.allows(MARKS.arg_key) && c.allows(TC));
    }

    /// Random walks through the grammar: every text that ends is parsed by the tool-call parser
    /// without a recovery or a note, into calls whose arguments follow the schemas.
    #[test]
    fn random_walks_parse_into_valid_calls() {
        let tools = tools();
        let mut rng = 0x9e3779b97f4a7c15u64;
        let mut next = move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        let vocab = vocab();
        let (mut ended, mut calls) = (0, 0);
        for walk in 0..300 {
            let mut c = constraint(false, walk % 2 == 0);
            let mut out = vec![];
            for _ in 0..200 {
                // Outside calls, no text the parser could take for a non-Spark call form.
                let free = matches!(c.state, State::Free);
                let allowed: Vec<u32> = (0..vocab.len() as u32)
                    .filter(|&t| c.allows(t) && !(free && t < 256 && !(t as u8).is_ascii_lowercase() && t != 32))
                    .collect();
                assert!(!allowed.is_empty(), "walk {walk}: nothing allowed after {:?}", text(&out));
                // Prefer markers, words and printable bytes, so walks end in a few hundred steps.
                let pick = loop {
                    let t = allowed[next(allowed.len())];
                    let weight = match t {
                        EOS => 10,
                        256.. => 40,
                        0x20..=0x7e => 8,
                        _ => 1,
                    };
                    if next(40) < weight {
                        break t;
                    }
                };
                out.push(pick);
                if pick == EOS {
                    break;
                }
                c.advance(pick);
            }
            if out.last() != Some(&EOS) {
                continue;
            }
            ended += 1;
            let s = text(&out);
            let p = parse(&s, &tools, false);
            assert!(p.recoveries.is_empty(), "walk {walk}: {s:?}: {:?}", p.recoveries);
            for call in &p.tool_calls {
                calls += 1;
                let args = &call.arguments;
                match call.name.as_str() {
                    "tap" => assert!(args["index"].is_i64() || args["index"].is_u64(), "{s:?}"),
                    "set_mode" => {
                        assert!(["dark", "light"].contains(&args["mode"].as_str().unwrap()), "{s:?}");
                        if let Some(l) = args.get("label") {
                            assert!(l.as_str().unwrap().chars().count() <= 3, "{s:?}");
                        }
                        if let Some(ids) = args.get("ids") {
                            let ids = ids.as_array().unwrap();
                            assert!(ids.len() <= 2 && ids.iter().all(|i| i.is_i64() || i.is_u64()), "{s:?}");
                        }
                        if let Some(code) = args.get("code") {
                            let code = code.as_str().unwrap();
                            assert!(code.len() == 2 && code.bytes().all(|b| b.is_ascii_uppercase()), "{s:?}");
                        }
                        if let Some(on) = args.get("on") {
                            assert!(on.is_boolean(), "{s:?}");
                        }
                    }
                    "tap_long" | "open" => {}
                    other => panic!("walk {walk}: call to {other}"),
                }
            }
        }
        assert!(ended >= 100 && calls >= 50, "{ended} walks ended, {calls} calls");
    }
}
