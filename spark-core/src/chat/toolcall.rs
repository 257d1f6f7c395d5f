//! Model output -> reasoning, content and OpenAI-style tool calls.
//!
//! Spark-X2.5 writes, with thinking on, its reasoning, then `</think>`, then content and/or tool
//! calls in its own markup (no newlines, several calls back to back):
//!
//! ```text
//! <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
//! ```
//!
//! Argument values are typed by the tool's JSON schema: strings stay raw, numbers, booleans,
//! objects and arrays are parsed as JSON (a value that does not parse stays a string when the
//! schema allows one).
//!
//! [`ToolCallParser`] is incremental: [`push`](ToolCallParser::push) takes decoded text as it
//! arrives and returns [`Delta`]s (reasoning text, content text, complete tool calls) without
//! ever leaking a partial marker; [`finish`](ToolCallParser::finish) flushes the end.
//! [`parse`] is the one-shot form and is *defined* as one push plus finish, so streaming at any
//! chunking gives the same result as parsing the whole text.
//!
//! The model sometimes leaves its format. When tools were offered, the parser also recovers:
//!
//! - bracketed calls: `[tap]` followed by a JSON object (the arguments, or a call object);
//! - GLM-style calls: `NAME` then a JSON object of arguments, at the start of the content or
//!   inside `<tool_call>...</tool_call>`;
//! - bare JSON call objects: `{"name": ..., "arguments": ...}`, `{"tool": ..., "parameters": ...}`
//!   (also `"function"`, `"args"`, arguments given as a JSON string), or a JSON list of them;
//! - unterminated markup and JSON: unbalanced braces/brackets and unterminated strings are closed,
//!   dangling commas and keys dropped.
//!
//! Every recovery is reported in [`ToolCallParser::recoveries`] (and [`Parsed::recoveries`]).
//! A call naming a tool that was not offered is never produced: it is reported and its text kept
//! as content. With no tools offered nothing is recovered and no call is produced.
//!
//! A recovered or repaired call is produced only when it has every argument its schema lists as
//! `required` (otherwise its text is kept as content, and the note says which are missing); a
//! well-formed call lacking one is produced, with a note. An output cut off by the token limit
//! ends with [`finish_truncated`](ToolCallParser::finish_truncated): a call the limit cut short
//! is kept as content rather than closed, since what it was about to say is unknown.
//!
//! Whitespace: leading and trailing whitespace of the reasoning and of the content is dropped, as
//! is whitespace-only text between tool calls.
//!
//! Streaming latency: text that may start a recovered call (a `[`, a `{"name"`-like object, a
//! tool's name at the start of the content) is held back until it is decided; once a recoverable
//! form is seen, the rest of the output is buffered and parsed at the end.

use serde_json::{Map, Value};

const END_THINK: &str = "</think>";
const THINK: &str = "<think>";
const TOOL_CALL: &str = "<tool_call>";
const END_TOOL_CALL: &str = "</tool_call>";
const ARG_KEY: &str = "<arg_key>";
const END_ARG_KEY: &str = "</arg_key>";
const ARG_VALUE: &str = "<arg_value>";
const END_ARG_VALUE: &str = "</arg_value>";

/// The note for a call cut short by the token limit.
const CUT_OFF: &str = "a tool call was cut off by the token limit (max_tokens); kept as content";

/// Keys naming the tool in a JSON call object.
const NAME_KEYS: [&str; 4] = ["name", "tool", "tool_name", "function"];
/// Keys holding the arguments in a JSON call object.
const ARGS_KEYS: [&str; 5] = ["arguments", "parameters", "args", "input", "params"];

/// A tool offered to the model: its name and its parameters' JSON schema.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    /// The `parameters` JSON schema (`{"type": "object", "properties": {...}}`), or `Null`.
    pub parameters: Value,
}

impl ToolSpec {
    /// The tools of an OpenAI `tools` list (`[{"type": "function", "function": {"name", "parameters"}}]`;
    /// a bare `{"name", "parameters"}` is accepted too). Entries without a name are skipped.
    pub fn from_openai(tools: &Value) -> Vec<ToolSpec> {
        let Some(list) = tools.as_array() else { return vec![] };
        list.iter()
            .filter_map(|t| {
                let f = t.get("function").filter(|f| f.is_object()).unwrap_or(t);
                let name = f.get("name")?.as_str()?.to_string();
                Some(ToolSpec { name, parameters: f.get("parameters").cloned().unwrap_or(Value::Null) })
            })
            .collect()
    }

    /// The schema of one parameter, if the tool declares it.
    fn property(&self, key: &str) -> Option<&Value> {
        self.parameters.get("properties")?.get(key)
    }
}

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// Position among this output's calls (0, 1, ...): the OpenAI streaming `index`.
    pub index: usize,
    pub name: String,
    /// Arguments, typed by the tool's schema.
    pub arguments: Map<String, Value>,
    /// Whether the call was recovered from a non-Spark form or repaired.
    pub recovered: bool,
}

impl ToolCall {
    /// The arguments as the JSON string OpenAI's `function.arguments` carries.
    pub fn arguments_json(&self) -> String {
        Value::Object(self.arguments.clone()).to_string()
    }
}

/// A piece of parsed output, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

/// The whole of a parsed output.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// The reasoning (text before `</think>`), when thinking was on.
    pub reasoning: Option<String>,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
    /// One note per recovery or rejection, in order.
    pub recoveries: Vec<String>,
}

impl Parsed {
    /// Merge deltas (as a streaming client would).
    pub fn from_deltas(deltas: impl IntoIterator<Item = Delta>, thinking: bool) -> Parsed {
        let mut p = Parsed { reasoning: thinking.then(String::new), ..Default::default() };
        for d in deltas {
            match d {
                Delta::Reasoning(s) => p.reasoning.get_or_insert_with(String::new).push_str(&s),
                Delta::Content(s) => p.content.push_str(&s),
                Delta::ToolCall(c) => p.tool_calls.push(c),
            }
        }
        p
    }
}

/// Parse a whole output. `thinking`: the prompt opened a reasoning block (`<think>`), so text up
/// to `</think>` is reasoning (all of it, if `</think>` never comes).
pub fn parse(text: &str, tools: &[ToolSpec], thinking: bool) -> Parsed {
    let mut p = ToolCallParser::new(tools.to_vec(), thinking);
    let mut deltas = p.push(text);
    deltas.extend(p.finish());
    let mut parsed = Parsed::from_deltas(deltas, thinking);
    parsed.recoveries = p.recoveries().to_vec();
    parsed
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reasoning,
    Content,
    /// Inside `<tool_call>`; `buf` holds the body so far.
    InCall,
    /// A recoverable form was seen: everything is buffered until `finish`.
    Suspect,
    Done,
}

/// Whether held text starts a recoverable call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    Yes,
    No,
    Undecided,
}

/// Incremental parser of one output. See the module docs.
#[derive(Debug)]
pub struct ToolCallParser {
    tools: Vec<ToolSpec>,
    state: State,
    /// Text received and not yet emitted or consumed.
    buf: String,
    /// Trailing whitespace held back (dropped if a marker, a call or the end follows).
    held_ws: String,
    /// Whether any non-whitespace text of the current section was emitted.
    started: bool,
    n_calls: usize,
    notes: Vec<String>,
    /// The output was cut off by the token limit (set by `finish_truncated`).
    truncated: bool,
    /// A call cut off by the token limit was found: the rest of the output is content.
    cut_call: bool,
}

impl ToolCallParser {
    /// A parser for one output. `tools`: the tools offered (empty: no calls are produced).
    /// `thinking`: the output starts inside a reasoning block.
    pub fn new(tools: Vec<ToolSpec>, thinking: bool) -> ToolCallParser {
        ToolCallParser {
            tools,
            state: if thinking { State::Reasoning } else { State::Content },
            buf: String::new(),
            held_ws: String::new(),
            started: false,
            n_calls: 0,
            notes: Vec::new(),
            truncated: false,
            cut_call: false,
        }
    }

    /// Recovery and rejection notes so far.
    pub fn recoveries(&self) -> &[String] {
        &self.notes
    }

    /// Number of tool calls emitted so far.
    pub fn calls(&self) -> usize {
        self.n_calls
    }

    /// Whether the parser is still in the reasoning block.
    pub fn in_reasoning(&self) -> bool {
        self.state == State::Reasoning
    }

    /// Feed decoded text; returns what became final.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.state == State::Done {
            return out;
        }
        self.buf.push_str(text);
        self.advance(false, &mut out);
        out
    }

    /// End of an output that the token limit cut off: as [`finish`](Self::finish), except that
    /// a call running to the end (an unterminated `<tool_call>`, or JSON whose brackets would
    /// have to be closed) is kept as content instead of being completed.
    pub fn finish_truncated(&mut self) -> Vec<Delta> {
        self.truncated = true;
        self.finish()
    }

    /// End of the output: flush what is held and parse what was buffered.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.state == State::Done {
            return out;
        }
        self.advance(true, &mut out);
        match self.state {
            State::Reasoning => {
                let rest = std::mem::take(&mut self.buf);
                self.emit_text(&rest, true, &mut out);
            }
            State::Content => {
                let rest = std::mem::take(&mut self.buf);
                self.emit_text(&rest, false, &mut out);
            }
            State::InCall if self.truncated => {
                let body = std::mem::take(&mut self.buf);
                self.note(CUT_OFF.to_string());
                self.emit_text(&format!("{TOOL_CALL}{body}"), false, &mut out);
            }
            State::InCall => {
                let mut body = std::mem::take(&mut self.buf);
                let keep = partial_suffix(&body, &[END_TOOL_CALL]);
                body.truncate(body.len() - keep);
                self.note("unterminated <tool_call>: parsed up to the end of the output".to_string());
                match self.call_from_body(&body, true) {
                    Some(call) => self.emit_call(call, &mut out),
                    None => {
                        let raw = format!("{TOOL_CALL}{body}");
                        self.emit_text(&raw, false, &mut out);
                    }
                }
            }
            State::Suspect => {
                let rest = std::mem::take(&mut self.buf);
                self.recover(&rest, &mut out);
            }
            State::Done => {}
        }
        self.held_ws.clear();
        self.state = State::Done;
        out
    }

    fn note(&mut self, s: String) {
        self.notes.push(s);
    }

    fn advance(&mut self, at_end: bool, out: &mut Vec<Delta>) {
        loop {
            match self.state {
                State::Reasoning => {
                    if !self.started && self.buf.trim_start().starts_with(THINK) {
                        let i = self.buf.find(THINK).unwrap_or(0);
                        self.buf.drain(..i + THINK.len());
                    }
                    if let Some(i) = self.buf.find(END_THINK) {
                        let text: String = self.buf.drain(..i + END_THINK.len()).collect();
                        self.emit_text(&text[..i], true, out);
                        self.held_ws.clear();
                        self.started = false;
                        self.state = State::Content;
                        continue;
                    }
                    let keep = if at_end { 0 } else { partial_suffix(&self.buf, &[END_THINK, THINK]) };
                    let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                    self.emit_text(&text, true, out);
                    return;
                }
                State::Content => {
                    let call_at = self.buf.find(TOOL_CALL);
                    // Text before a `<tool_call>` cannot grow: decide it as at the end.
                    let trig = self.first_trigger(call_at.unwrap_or(self.buf.len()), at_end || call_at.is_some());
                    match (call_at, trig) {
                        (_, Some((i, Decision::Yes))) => {
                            let text: String = self.buf.drain(..i).collect();
                            self.emit_text(&text, false, out);
                            self.state = State::Suspect;
                            return;
                        }
                        (_, Some((i, _))) => {
                            // Undecided: hold from the trigger on.
                            let text: String = self.buf.drain(..i).collect();
                            self.emit_text(&text, false, out);
                            return;
                        }
                        (Some(i), None) => {
                            let text: String = self.buf.drain(..i + TOOL_CALL.len()).collect();
                            self.emit_text(&text[..i], false, out);
                            self.state = State::InCall;
                            continue;
                        }
                        (None, None) => {
                            let keep = if at_end { 0 } else { partial_suffix(&self.buf, &[TOOL_CALL]) };
                            let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                            self.emit_text(&text, false, out);
                            return;
                        }
                    }
                }
                State::InCall => {
                    let Some(i) = self.buf.find(END_TOOL_CALL) else { return };
                    let body: String = self.buf.drain(..i + END_TOOL_CALL.len()).collect();
                    let body = &body[..i];
                    match self.call_from_body(body, false) {
                        Some(call) => self.emit_call(call, out),
                        None => {
                            let raw = format!("{TOOL_CALL}{body}{END_TOOL_CALL}");
                            self.emit_text(&raw, false, out);
                        }
                    }
                    self.state = State::Content;
                    continue;
                }
                State::Suspect | State::Done => return,
            }
        }
    }

    /// Emit reasoning or content text: leading whitespace of a section dropped, trailing
    /// whitespace held back until more text follows.
    fn emit_text(&mut self, text: &str, reasoning: bool, out: &mut Vec<Delta>) {
        let mut s = text;
        if !self.started {
            s = s.trim_start();
        }
        if s.is_empty() {
            return;
        }
        let body = s.trim_end();
        let trail = &s[body.len()..];
        if !body.is_empty() {
            let mut t = std::mem::take(&mut self.held_ws);
            t.push_str(body);
            self.started = true;
            let d = if reasoning { Delta::Reasoning(t) } else { Delta::Content(t) };
            // Merge with a directly preceding delta of the same kind.
            match (out.last_mut(), d) {
                (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) | (Some(Delta::Content(a)), Delta::Content(b)) => {
                    a.push_str(&b)
                }
                (_, d) => out.push(d),
            }
        }
        self.held_ws.push_str(trail);
    }

    fn emit_call(&mut self, mut call: ToolCall, out: &mut Vec<Delta>) {
        call.index = self.n_calls;
        self.n_calls += 1;
        self.held_ws.clear();
        out.push(Delta::ToolCall(call));
    }

    fn tool(&self, name: &str) -> Option<&ToolSpec> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// The first position in `buf[..limit]` that may start a recovered call, with the decision
    /// so far. `None` when there is none (or no tools were offered).
    fn first_trigger(&self, limit: usize, at_end: bool) -> Option<(usize, Decision)> {
        if self.tools.is_empty() {
            return None;
        }
        let head = &self.buf[..limit];
        // A tool name at the very start of the content (GLM style `NAME {json}`).
        if !self.started && self.n_calls == 0 {
            let d = self.decide_glm(head.trim_start(), at_end);
            if d != Decision::No {
                return Some((0, d));
            }
        }
        for (i, c) in head.char_indices() {
            let d = match c {
                '[' => self.decide_bracket(&head[i..], at_end),
                '{' => decide_object(&head[i..], at_end),
                _ => continue,
            };
            if d != Decision::No {
                return Some((i, d));
            }
        }
        None
    }

    fn decide_glm(&self, s: &str, at_end: bool) -> Decision {
        if s.is_empty() {
            return if at_end { Decision::No } else { Decision::Undecided };
        }
        let ident_len = s.find(|c: char| !is_ident(c)).unwrap_or(s.len());
        let (ident, rest) = s.split_at(ident_len);
        if ident.is_empty() {
            return Decision::No;
        }
        if rest.is_empty() {
            let prefix = self.tools.iter().any(|t| t.name.starts_with(ident));
            return if prefix && !at_end { Decision::Undecided } else { Decision::No };
        }
        if self.tool(ident).is_none() {
            return Decision::No;
        }
        let r = rest.trim_start();
        if r.is_empty() {
            return if at_end { Decision::No } else { Decision::Undecided };
        }
        if r.starts_with('{') {
            Decision::Yes
        } else {
            Decision::No
        }
    }

    fn decide_bracket(&self, s: &str, at_end: bool) -> Decision {
        let inner = &s[1..];
        let r = inner.trim_start();
        if r.starts_with('{') {
            return decide_object(r, at_end);
        }
        let n = inner.find(|c: char| !is_ident(c)).unwrap_or(inner.len());
        let ident = &inner[..n];
        match inner[n..].chars().next() {
            None => {
                let prefix = !ident.is_empty() || inner.is_empty();
                let could = prefix && self.tools.iter().any(|t| t.name.starts_with(ident));
                if could && !at_end {
                    Decision::Undecided
                } else {
                    Decision::No
                }
            }
            Some(']') if self.tool(ident).is_some() => Decision::Yes,
            _ => Decision::No,
        }
    }

    /// A strict (or GLM-style) call body, the text between `<tool_call>` and `</tool_call>`.
    fn call_from_body(&mut self, body: &str, unterminated: bool) -> Option<ToolCall> {
        let name_end = body.find('<').unwrap_or(body.len());
        let head = body[..name_end].trim();
        // GLM style: NAME then a JSON object of arguments; or a JSON call object.
        if let Some(j) = head.find(['{', '[']) {
            let name = head[..j].trim();
            let json_text = body[..].trim_start();
            let json_text = &json_text[json_text.find(['{', '[']).unwrap_or(0)..];
            let (v, _, mut notes) = repair_json(json_text)?;
            let call = if name.is_empty() {
                self.call_from_object(&v, None)
            } else if let Value::Object(args) = v {
                notes.push(format!("GLM-style call `{name}` with JSON arguments recovered"));
                self.typed_call(name, args, true)
            } else {
                None
            };
            if call.is_some() {
                self.notes.append(&mut notes);
            }
            return call;
        }
        let name = head;
        if name.is_empty() {
            self.note("a <tool_call> without a tool name was kept as content".into());
            return None;
        }
        let Some(tool) = self.tool(name).cloned() else {
            self.note(format!("call to `{name}`, which was not offered, was rejected and kept as content"));
            return None;
        };
        let mut rest = &body[name_end..];
        let mut args = Map::new();
        let mut recovered = unterminated;
        loop {
            let r = rest.trim_start();
            if r.is_empty() {
                break;
            }
            let Some(after_key) = r.strip_prefix(ARG_KEY) else {
                self.note(format!("unexpected text `{}` in the call to `{name}` was ignored", clip(r)));
                recovered = true;
                break;
            };
            let Some(ke) = after_key.find(END_ARG_KEY) else {
                self.note(format!("unterminated <arg_key> in the call to `{name}` was dropped"));
                recovered = true;
                break;
            };
            let key = after_key[..ke].trim().to_string();
            let r2 = after_key[ke + END_ARG_KEY.len()..].trim_start();
            let Some(after_val) = r2.strip_prefix(ARG_VALUE) else {
                self.note(format!("argument `{key}` of `{name}` has no <arg_value> and was dropped"));
                recovered = true;
                break;
            };
            let (raw, next) = match after_val.find(END_ARG_VALUE) {
                Some(ve) => (&after_val[..ve], &after_val[ve + END_ARG_VALUE.len()..]),
                None => {
                    self.note(format!("unterminated <arg_value> of `{key}` in `{name}` taken to the end"));
                    recovered = true;
                    (after_val, "")
                }
            };
            let v = self.type_value(&tool, &key, raw);
            args.insert(key, v);
            rest = next;
        }
        self.check_required(&tool, ToolCall { index: 0, name: name.to_string(), arguments: args, recovered })
    }

    /// A call lacking an argument its schema requires: a recovered one is refused (`None`, its
    /// text stays content), a well-formed one is kept; both are noted.
    fn check_required(&mut self, tool: &ToolSpec, call: ToolCall) -> Option<ToolCall> {
        let missing: Vec<String> = tool
            .parameters
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter(|k| !call.arguments.contains_key(*k))
            .map(|k| format!("`{k}`"))
            .collect();
        if missing.is_empty() {
            return Some(call);
        }
        let name = &call.name;
        let missing = missing.join(", ");
        if call.recovered {
            self.note(format!("the recovered call to `{name}` lacks required argument(s) {missing}; kept as content"));
            None
        } else {
            self.note(format!("the call to `{name}` lacks required argument(s) {missing}"));
            Some(call)
        }
    }

    /// Type the values of a JSON arguments object by the schema (strings where the schema wants
    /// something else are parsed), and check the tool was offered.
    fn typed_call(&mut self, name: &str, args: Map<String, Value>, recovered: bool) -> Option<ToolCall> {
        let Some(tool) = self.tool(name).cloned() else {
            self.note(format!("call to `{name}`, which was not offered, was rejected and kept as content"));
            return None;
        };
        let mut typed = Map::new();
        for (k, v) in args {
            let v = match (&v, tool.property(&k)) {
                (Value::String(s), Some(schema)) if !allows(schema, "string") => self.type_value(&tool, &k, s),
                _ => v,
            };
            typed.insert(k, v);
        }
        self.check_required(&tool, ToolCall { index: 0, name: name.to_string(), arguments: typed, recovered })
    }

    /// A call from a JSON object: a call object (`name`/`tool` + `arguments`/`parameters`), or,
    /// given `bracket_name`, the arguments themselves.
    fn call_from_object(&mut self, v: &Value, bracket_name: Option<&str>) -> Option<ToolCall> {
        let obj = v.as_object()?;
        let mut name: Option<String> = None;
        let mut args: Option<Value> = None;
        for k in NAME_KEYS {
            match obj.get(k) {
                Some(Value::String(s)) => {
                    name = Some(s.clone());
                    break;
                }
                Some(Value::Object(f)) if k == "function" => {
                    name = f.get("name").and_then(Value::as_str).map(str::to_string);
                    args = ARGS_KEYS.iter().find_map(|a| f.get(*a)).cloned();
                    break;
                }
                _ => {}
            }
        }
        if args.is_none() && name.is_some() {
            args = ARGS_KEYS.iter().find_map(|a| obj.get(*a)).cloned();
        }
        let name = match (name, bracket_name) {
            (Some(n), Some(b)) if n != b => {
                self.note(format!("bracketed name `[{b}]` and JSON name `{n}` differ; `{b}` used"));
                b.to_string()
            }
            (Some(n), _) => n,
            (None, Some(b)) => {
                args = Some(v.clone());
                b.to_string()
            }
            (None, None) => return None,
        };
        let args = match args {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m,
            Some(Value::String(s)) => match repair_json(&s) {
                Some((Value::Object(m), _, notes)) => {
                    self.notes.extend(notes);
                    self.note(format!("arguments of `{name}` given as a JSON string were parsed"));
                    m
                }
                _ => {
                    self.note(format!("arguments of `{name}` are not a JSON object; the call was rejected"));
                    return None;
                }
            },
            Some(other) => {
                self.note(format!(
                    "arguments of `{name}` are not an object (`{}`); the call was rejected",
                    clip(&other.to_string())
                ));
                return None;
            }
        };
        self.typed_call(&name, args, true)
    }

    /// Parse buffered text that holds recoverable calls; what is not a call is content.
    fn recover(&mut self, text: &str, out: &mut Vec<Delta>) {
        let mut pos = 0;
        let mut content_from = 0;
        while pos < text.len() {
            let s = &text[pos..];
            let word_start = !text[..pos].chars().next_back().is_some_and(is_ident);
            let found = self.try_call_at(s, word_start);
            match found {
                Some((calls, used)) if !calls.is_empty() => {
                    let before = &text[content_from..pos];
                    self.emit_text(before, false, out);
                    for c in calls {
                        self.emit_call(c, out);
                    }
                    pos += used;
                    content_from = pos;
                }
                _ if self.cut_call => break,
                _ => {
                    pos += s.chars().next().map_or(1, char::len_utf8);
                }
            }
        }
        let rest = &text[content_from..];
        self.emit_text(rest, false, out);
    }

    /// Try to read calls at the start of `s`: returns the calls and the bytes used.
    fn try_call_at(&mut self, s: &str, word_start: bool) -> Option<(Vec<ToolCall>, usize)> {
        let n_notes = self.notes.len();
        let r = self.try_call_at_inner(s, word_start);
        if r.as_ref().is_none_or(|(c, _)| c.is_empty()) {
            // Keep rejections (text kept as content), drop notes of failed attempts otherwise.
            let kept: Vec<String> = self.notes.drain(n_notes..).filter(|n| n.ends_with("kept as content")).collect();
            self.notes.extend(kept);
        }
        r
    }

    fn try_call_at_inner(&mut self, s: &str, word_start: bool) -> Option<(Vec<ToolCall>, usize)> {
        if let Some(body) = s.strip_prefix(TOOL_CALL) {
            let (inner, used, closed) = match body.find(END_TOOL_CALL) {
                Some(e) => (&body[..e], TOOL_CALL.len() + e + END_TOOL_CALL.len(), true),
                None => (body, s.len(), false),
            };
            if !closed && self.truncated {
                return self.cut_off();
            }
            if !closed {
                self.note("unterminated <tool_call>: parsed up to the end of the output".into());
            }
            return self.call_from_body(inner, !closed).map(|c| (vec![c], used));
        }
        if let Some(inner) = s.strip_prefix('[') {
            let t = inner.trim_start();
            if t.starts_with('{') {
                // A JSON list of call objects.
                let (v, used, notes) = repair_json(s)?;
                let list = v.as_array()?;
                let mut calls = Vec::new();
                for item in list {
                    calls.push(self.call_from_object(item, None)?);
                }
                if self.truncated && !notes.is_empty() {
                    return self.cut_off();
                }
                self.notes.extend(notes);
                self.note("JSON list of tool calls recovered".into());
                return Some((calls, used));
            }
            let n = inner.find(|c: char| !is_ident(c)).unwrap_or(inner.len());
            let name = &inner[..n];
            if !inner[n..].starts_with(']') || self.tool(name).is_none() {
                return None;
            }
            let after = &inner[n + 1..];
            let lead = after.len() - after.trim_start().len();
            let json_at = 1 + n + 1 + lead;
            let (v, used, notes) = if s[json_at..].starts_with('{') {
                repair_json(&s[json_at..])?
            } else {
                // `[tap]` alone: a call without arguments.
                (Value::Object(Map::new()), 0, vec![])
            };
            let call = self.call_from_object(&v, Some(name))?;
            if self.truncated && !notes.is_empty() {
                return self.cut_off();
            }
            self.notes.extend(notes);
            self.note(format!("bracketed call `[{name}]` recovered"));
            return Some((vec![call], json_at + used));
        }
        if s.starts_with('{') {
            let (v, used, notes) = repair_json(s)?;
            let call = self.call_from_object(&v, None)?;
            if self.truncated && !notes.is_empty() {
                return self.cut_off();
            }
            self.notes.extend(notes);
            self.note(format!("bare JSON call to `{}` recovered", call.name));
            return Some((vec![call], used));
        }
        // GLM style: NAME {json}
        if !word_start {
            return None;
        }
        let n = s.find(|c: char| !is_ident(c)).unwrap_or(s.len());
        let name = &s[..n];
        if n == 0 || self.tool(name).is_none() {
            return None;
        }
        let after = &s[n..];
        let lead = after.len() - after.trim_start().len();
        if !after[lead..].starts_with('{') {
            return None;
        }
        let (v, used, notes) = repair_json(&after[lead..])?;
        let Value::Object(args) = v else { return None };
        let call = self.typed_call(name, args, true)?;
        if self.truncated && !notes.is_empty() {
            return self.cut_off();
        }
        self.notes.extend(notes);
        self.note(format!("GLM-style call `{name}` with JSON arguments recovered"));
        Some((vec![call], n + lead + used))
    }

    /// A call the token limit cut short: noted, and the rest of the output is content.
    fn cut_off(&mut self) -> Option<(Vec<ToolCall>, usize)> {
        self.note(CUT_OFF.to_string());
        self.cut_call = true;
        None
    }

    /// A raw argument value typed by the tool's schema for `key`.
    fn type_value(&mut self, tool: &ToolSpec, key: &str, raw: &str) -> Value {
        let Some(schema) = tool.property(key) else {
            return Value::String(raw.to_string());
        };
        let types = schema_types(schema);
        let any = types.is_empty();
        if !any && types.iter().all(|t| t == "string") {
            return Value::String(raw.to_string());
        }
        let t = raw.trim();
        if let Ok(v) = serde_json::from_str::<Value>(t) {
            if any || types.iter().any(|ty| matches_type(&v, ty)) {
                return v;
            }
            if let Some(n) = v.as_f64().filter(|n| n.fract() == 0.0 && types.iter().any(|t| t == "integer")) {
                return Value::from(n as i64);
            }
        }
        if any || types.iter().any(|t| t == "string") {
            return Value::String(raw.to_string());
        }
        // Lenient forms: Python literals, unbalanced JSON.
        let lenient = match t {
            "True" | "TRUE" => Some(Value::Bool(true)),
            "False" | "FALSE" => Some(Value::Bool(false)),
            "None" => Some(Value::Null),
            _ if t.starts_with(['{', '[']) => repair_json(t).map(|(v, _, _)| v),
            _ => None,
        };
        if let Some(v) = lenient.filter(|v| types.iter().any(|ty| matches_type(v, ty))) {
            self.note(format!("argument `{key}` of `{}`: `{}` repaired to {v}", tool.name, clip(raw)));
            return v;
        }
        self.note(format!(
            "argument `{key}` of `{}`: `{}` is not a valid {}; kept as a string",
            tool.name,
            clip(raw),
            types.join("|")
        ));
        Value::String(raw.to_string())
    }
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '_' | '-' | '.')
}

/// Whether an object trigger (`{` ...) starts a JSON call object: its first key names a tool.
fn decide_object(s: &str, at_end: bool) -> Decision {
    let r = s[1..].trim_start();
    if r.is_empty() {
        return if at_end { Decision::No } else { Decision::Undecided };
    }
    let Some(key) = r.strip_prefix('"') else { return Decision::No };
    match key.find('"') {
        Some(e) => {
            if NAME_KEYS.contains(&&key[..e]) {
                Decision::Yes
            } else {
                Decision::No
            }
        }
        None if !at_end && NAME_KEYS.iter().any(|k| k.starts_with(key)) => Decision::Undecided,
        None => Decision::No,
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of one of `markers`.
fn partial_suffix(s: &str, markers: &[&str]) -> usize {
    let mut best = 0;
    for m in markers {
        for n in (1..m.len()).rev() {
            if n > best && s.is_char_boundary(s.len().saturating_sub(n)) && s.ends_with(&m[..n]) {
                best = n;
                break;
            }
        }
    }
    best
}

fn clip(s: &str) -> String {
    let mut t: String = s.chars().take(60).collect();
    if t.len() < s.len() {
        t.push('…');
    }
    t
}

/// The JSON types a schema allows (from `type`, `anyOf`/`oneOf` entries, `enum` values); empty
/// when the schema does not say.
pub(crate) fn schema_types(schema: &Value) -> Vec<String> {
    let mut out = Vec::new();
    match schema.get("type") {
        Some(Value::String(t)) => out.push(t.clone()),
        Some(Value::Array(ts)) => out.extend(ts.iter().filter_map(Value::as_str).map(str::to_string)),
        _ => {}
    }
    for k in ["anyOf", "oneOf"] {
        if let Some(Value::Array(alts)) = schema.get(k) {
            for a in alts {
                out.extend(schema_types(a));
            }
        }
    }
    if out.is_empty() {
        if let Some(Value::Array(vals)) = schema.get("enum") {
            for v in vals {
                let t = match v {
                    Value::String(_) => "string",
                    Value::Number(_) => "number",
                    Value::Bool(_) => "boolean",
                    _ => continue,
                };
                out.push(t.to_string());
            }
        }
    }
    out
}

fn allows(schema: &Value, ty: &str) -> bool {
    let t = schema_types(schema);
    t.is_empty() || t.iter().any(|x| x == ty)
}

fn matches_type(v: &Value, ty: &str) -> bool {
    match ty {
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        "null" => v.is_null(),
        _ => false,
    }
}

/// Parse the JSON value (object or array) at the start of `s`, repairing an unterminated one:
/// unterminated strings and unbalanced brackets are closed, a dangling comma, key or colon is
/// dropped. Returns the value, the bytes of `s` used, and notes on what was repaired.
pub fn repair_json(s: &str) -> Option<(Value, usize, Vec<String>)> {
    let s_trim = s.trim_start();
    let lead = s.len() - s_trim.len();
    if !s_trim.starts_with(['{', '[']) {
        return None;
    }
    // Find where the value ends when it is balanced.
    let mut scan = JsonScan::default();
    for (i, c) in s_trim.char_indices() {
        match scan.step(c) {
            Some(Bracket::Close { matched: false }) => return None,
            Some(Bracket::Close { matched: true }) if scan.stack.is_empty() => {
                let v = serde_json::from_str(&s_trim[..=i]).ok()?;
                return Some((v, lead + i + 1, vec![]));
            }
            _ => {}
        }
    }
    // Unterminated: close it, cutting back to an earlier comma when needed.
    let mut cut = s_trim;
    for _ in 0..8 {
        if let Some((text, note)) = close_json(cut) {
            if let Ok(v) = serde_json::from_str::<Value>(&text) {
                let mut notes = vec![note];
                if cut.len() < s_trim.len() {
                    notes.push(format!("dropped an incomplete tail `{}`", clip(&s_trim[cut.len()..])));
                }
                return Some((v, s.len(), notes));
            }
        }
        let i = cut.rfind([',', '{', '['])?;
        if i == 0 && cut.len() == 1 {
            return None;
        }
        cut = if cut.as_bytes()[i] == b',' { &cut[..i] } else { &cut[..=i] };
    }
    None
}

/// A bracket event reported by [`JsonScan::step`].
enum Bracket {
    Open,
    /// A `}` or `]`; `matched` is false when it does not close the innermost open bracket.
    Close {
        matched: bool,
    },
}

/// Tracks strings, escapes and open brackets while walking JSON text one char at a time.
#[derive(Default)]
struct JsonScan {
    /// Closers still expected, innermost last.
    stack: Vec<char>,
    in_str: bool,
    esc: bool,
}

impl JsonScan {
    /// Feed one char; reports brackets outside strings.
    fn step(&mut self, c: char) -> Option<Bracket> {
        if self.in_str {
            match (self.esc, c) {
                (true, _) => self.esc = false,
                (false, '\\') => self.esc = true,
                (false, '"') => self.in_str = false,
                _ => {}
            }
            return None;
        }
        match c {
            '"' => {
                self.in_str = true;
                None
            }
            '{' | '[' => {
                self.stack.push(if c == '{' { '}' } else { ']' });
                Some(Bracket::Open)
            }
            '}' | ']' => Some(Bracket::Close { matched: self.stack.pop() == Some(c) }),
            _ => None,
        }
    }
}

/// Close an unterminated JSON text: returns the closed text and a note.
fn close_json(s: &str) -> Option<(String, String)> {
    let mut scan = JsonScan::default();
    for c in s.chars() {
        scan.step(c);
    }
    let JsonScan { stack, in_str, esc } = scan;
    let mut t = s.to_string();
    let mut what = Vec::new();
    if in_str {
        if esc {
            t.pop();
        }
        t.push('"');
        what.push("an unterminated string".to_string());
    }
    let trimmed = t.trim_end().trim_end_matches(',').trim_end();
    let mut t = trimmed.to_string();
    if t.ends_with(':') {
        t.push_str(" null");
        what.push("a value missing after `:` (null)".into());
    }
    if stack.is_empty() {
        return None;
    }
    let closers: String = stack.iter().rev().collect();
    t.push_str(&closers);
    what.push(format!("{} unbalanced bracket(s) with `{closers}`", stack.len()));
    Some((t, format!("repaired unterminated JSON: closed {}", what.join(", "))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Vec<ToolSpec> {
        ToolSpec::from_openai(&json!([
            {"type": "function", "function": {"name": "tap", "parameters": {"type": "object", "properties": {
                "index": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                "opts": {"type": "object"}, "tags": {"type": "array"}, "note": {"type": ["string", "null"]},
                "ratio": {"type": "number"}}}}}
        ]))
    }

    /// Parse at every chunking of interest and check it agrees with one-shot parsing.
    fn check_streaming(text: &str, thinking: bool) -> Parsed {
        let t = tools();
        let whole = parse(text, &t, thinking);
        let boundaries: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &i in &boundaries {
            let mut p = ToolCallParser::new(t.clone(), thinking);
            let mut d = p.push(&text[..i]);
            d.extend(p.push(&text[i..]));
            d.extend(p.finish());
            let mut got = Parsed::from_deltas(d, thinking);
            got.recoveries = p.recoveries().to_vec();
            assert_eq!(got, whole, "split at byte {i} of {text:?}");
        }
        // One character at a time.
        let mut p = ToolCallParser::new(t.clone(), thinking);
        let mut d = Vec::new();
        for w in boundaries.windows(2) {
            let piece = p.push(&text[w[0]..w[1]]);
            for x in &piece {
                if let Delta::Content(c) | Delta::Reasoning(c) = x {
                    let legit = whole.content.contains("<tool_call") || whole.reasoning.iter().any(|r| r.contains('<'));
                    assert!(legit || (!c.contains("<tool_call") && !c.contains("</think")), "leaked markup {c:?}");
                }
            }
            d.extend(piece);
        }
        d.extend(p.finish());
        let mut got = Parsed::from_deltas(d, thinking);
        got.recoveries = p.recoveries().to_vec();
        assert_eq!(got, whole, "char by char: {text:?}");
        whole
    }

    #[test]
    fn strict_single_call_with_reasoning() {
        let text = "Need the weather.</think>\n\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Hefei</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>";
        let p = check_streaming(text, true);
        assert_eq!(p.reasoning.as_deref(), Some("Need the weather."));
        assert_eq!(p.content, "");
        assert_eq!(p.tool_calls.len(), 1);
        assert_eq!(p.tool_calls[0].name, "get_weather");
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"city": "Hefei", "days": 3}));
        assert!(!p.tool_calls[0].recovered);
        assert!(p.recoveries.is_empty(), "{:?}", p.recoveries);
    }

    #[test]
    fn multiple_calls_back_to_back_and_typed_args() {
        let text = "I'll check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>007</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value><arg_key>opts</arg_key><arg_value>{\"a\": [1, 2]}</arg_value><arg_key>tags</arg_key><arg_value>[\"x\"]</arg_value><arg_key>note</arg_key><arg_value>null</arg_value><arg_key>ratio</arg_key><arg_value>0.5</arg_value><arg_key>extra</arg_key><arg_value>42</arg_value></tool_call><tool_call>tap<arg_key>index</arg_key><arg_value>2</arg_value></tool_call>";
        let p = check_streaming(text, false);
        assert_eq!(p.reasoning, None);
        assert_eq!(p.content, "I'll check.");
        assert_eq!(p.tool_calls.len(), 2);
        assert_eq!(
            Value::Object(p.tool_calls[0].arguments.clone()),
            json!({"city": "007", "metric": true, "opts": {"a": [1, 2]}, "tags": ["x"], "note": null, "ratio": 0.5, "extra": "42"})
        );
        assert_eq!(p.tool_calls[1].index, 1);
        assert_eq!(Value::Object(p.tool_calls[1].arguments.clone()), json!({"index": 2}));
    }

    #[test]
    fn invalid_typed_value_falls_back_to_string_with_a_note() {
        let text = "<tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value><arg_key>note</arg_key><arg_value>not json</arg_value></tool_call>";
        let p = check_streaming(text, false);
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"days": "three", "note": "not json"}));
        assert_eq!(p.recoveries.len(), 1, "{:?}", p.recoveries);
        assert!(p.recoveries[0].contains("days"));
    }

    #[test]
    fn seen_failure_bracketed_unterminated() {
        let text = "Tapping the first item.</think>[tap]\n{\"tool\": \"tap\", \"parameters\": {\"index\": 1}";
        let p = check_streaming(text, true);
        assert_eq!(p.reasoning.as_deref(), Some("Tapping the first item."));
        assert_eq!(p.content, "");
        assert_eq!(p.tool_calls.len(), 1);
        assert_eq!(p.tool_calls[0].name, "tap");
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"index": 1}));
        assert!(p.tool_calls[0].recovered);
        assert!(p.recoveries.iter().any(|n| n.contains("bracketed")), "{:?}", p.recoveries);
        assert!(p.recoveries.iter().any(|n| n.contains("unbalanced")), "{:?}", p.recoveries);
    }

    #[test]
    fn bracketed_with_bare_arguments_and_string_typed_number() {
        let p = check_streaming("[tap] {\"index\": \"3\"}", false);
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"index": 3}));
    }

    #[test]
    fn bare_json_forms() {
        let p = check_streaming("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}", false);
        assert_eq!(p.tool_calls[0].name, "get_weather");
        assert_eq!(p.content, "");
        let p = check_streaming("Sure. {\"tool\": \"tap\", \"parameters\": {\"index\": 4}} done", false);
        assert_eq!(p.content, "Sure. done");
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"index": 4}));
        // Arguments as a JSON string (OpenAI style), unterminated string repaired.
        let p = check_streaming("{\"name\": \"tap\", \"arguments\": \"{\\\"index\\\": 5}\"}", false);
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"index": 5}));
        let p = check_streaming("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par", false);
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"city": "Par"}));
        // A list of calls.
        let p = check_streaming(
            "[{\"name\": \"tap\", \"arguments\": {\"index\": 1}}, {\"name\": \"tap\", \"arguments\": {\"index\": 2}}]",
            false,
        );
        assert_eq!(p.tool_calls.len(), 2);
    }

    #[test]
    fn glm_style_forms() {
        let p = check_streaming("get_weather\n{\"city\": \"Rome\", \"days\": 2}", false);
        assert_eq!(p.tool_calls[0].name, "get_weather");
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"city": "Rome", "days": 2}));
        let p = check_streaming("<tool_call>tap\n{\"index\": 7}</tool_call>", false);
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"index": 7}));
        assert!(!p.recoveries.is_empty());
        // GLM 4.5 layout: newlines between the parts.
        let p =
            check_streaming("<tool_call>tap\n<arg_key>index</arg_key>\n<arg_value>8</arg_value>\n</tool_call>", false);
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"index": 8}));
    }

    #[test]
    fn unknown_tools_are_never_called() {
        for text in [
            "<tool_call>rm_rf<arg_key>path</arg_key><arg_value>/</arg_value></tool_call>",
            "[rm_rf] {\"path\": \"/\"}",
            "{\"name\": \"rm_rf\", \"arguments\": {\"path\": \"/\"}}",
            "rm_rf {\"path\": \"/\"}",
        ] {
            let p = check_streaming(text, false);
            assert!(p.tool_calls.is_empty(), "{text}");
            assert!(!p.content.is_empty(), "{text}");
        }
        let p = parse("<tool_call>rm_rf</tool_call>", &tools(), false);
        assert!(p.recoveries.iter().any(|n| n.contains("not offered")));
        // With no tools offered nothing is a call.
        let p = parse("<tool_call>tap<arg_key>index</arg_key><arg_value>1</arg_value></tool_call>", &[], false);
        assert!(p.tool_calls.is_empty());
    }

    #[test]
    fn plain_text_and_brackets_pass_through() {
        let p = check_streaming("Use a[0] and {x} or [see] here.\n", false);
        assert_eq!(p.content, "Use a[0] and {x} or [see] here.");
        assert!(p.tool_calls.is_empty() && p.recoveries.is_empty());
        let p = check_streaming("  thinking about it  </think>  answer  ", true);
        assert_eq!(p.reasoning.as_deref(), Some("thinking about it"));
        assert_eq!(p.content, "answer");
        // No </think>: all reasoning.
        let p = check_streaming("still thinking <tool", true);
        assert_eq!(p.reasoning.as_deref(), Some("still thinking <tool"));
        assert_eq!(p.content, "");
        let p = check_streaming("tap the button", false);
        assert_eq!(p.content, "tap the button");
    }

    #[test]
    fn unterminated_strict_call() {
        let p = check_streaming("<tool_call>tap<arg_key>index</arg_key><arg_value>5", false);
        assert_eq!(Value::Object(p.tool_calls[0].arguments.clone()), json!({"index": 5}));
        assert!(p.tool_calls[0].recovered);
        assert!(p.recoveries.len() >= 2);
    }

    /// Parse `text` as an output the token limit cut off, at every split point.
    fn parse_truncated(text: &str, t: &[ToolSpec]) -> Parsed {
        let mut first: Option<Parsed> = None;
        for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut p = ToolCallParser::new(t.to_vec(), false);
            let mut d = p.push(&text[..i]);
            d.extend(p.push(&text[i..]));
            d.extend(p.finish_truncated());
            let mut got = Parsed::from_deltas(d, false);
            got.recoveries = p.recoveries().to_vec();
            match &first {
                Some(f) => assert_eq!(&got, f, "split at byte {i} of {text:?}"),
                None => first = Some(got),
            }
        }
        first.unwrap()
    }

    #[test]
    fn a_call_cut_off_by_the_token_limit_is_content() {
        let t = tools();
        for text in [
            "Tapping. <tool_call>tap<arg_key>index</arg_key><arg_value>5",
            "Tapping. <tool_call>tap<arg_key>index</arg_key><arg_value>5</arg_value>",
            "Tapping. {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",
            "Tapping. [tap] {\"index\": 1",
            "get_weather {\"city\": \"Rome\", \"days\": 2",
        ] {
            let p = parse_truncated(text, &t);
            assert!(p.tool_calls.is_empty(), "{text}: {:?}", p.tool_calls);
            assert_eq!(p.content, text, "{text}");
            assert_eq!(p.recoveries, vec![CUT_OFF.to_string()], "{text}");
            // Ended by the model instead, the same text is recovered as a call.
            assert_eq!(parse(text, &t, false).tool_calls.len(), 1, "{text}");
        }
        // Complete calls before the cut are kept; only the cut one becomes content.
        let p = parse_truncated(
            "<tool_call>tap<arg_key>index</arg_key><arg_value>1</arg_value></tool_call><tool_call>tap<arg_key>ind",
            &t,
        );
        assert_eq!(p.tool_calls.len(), 1);
        assert_eq!(p.content, "<tool_call>tap<arg_key>ind");
        // A balanced bare call at the very end is complete, whatever the limit.
        let p = parse_truncated("{\"name\": \"tap\", \"arguments\": {\"index\": 3}}", &t);
        assert_eq!(p.tool_calls.len(), 1);
    }

    #[test]
    fn required_arguments() {
        let t = ToolSpec::from_openai(&json!([{"type": "function", "function": {"name": "send", "parameters": {
            "type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
            "required": ["to", "body"]}}}]));
        // Well-formed but lacking one: produced, with a note.
        let p = parse("<tool_call>send<arg_key>to</arg_key><arg_value>bob</arg_value></tool_call>", &t, false);
        assert_eq!(p.tool_calls.len(), 1);
        assert!(p.recoveries.iter().any(|n| n.contains("lacks required argument(s) `body`")), "{:?}", p.recoveries);
        // Recovered (unterminated, or a repaired JSON form) and lacking one: content.
        for text in [
            "<tool_call>send<arg_key>to</arg_key><arg_value>bob",
            "{\"name\": \"send\", \"arguments\": {\"to\": \"bob\"",
            "send {\"body\": \"hi\"}",
        ] {
            let p = parse(text, &t, false);
            assert!(p.tool_calls.is_empty(), "{text}: {:?}", p.tool_calls);
            assert_eq!(p.content, text);
            assert!(
                p.recoveries.iter().any(|n| n.contains("lacks required") && n.ends_with("kept as content")),
                "{text}: {:?}",
                p.recoveries
            );
        }
        let p = parse("send {\"to\": \"bob\", \"body\": \"hi\"}", &t, false);
        assert_eq!(p.tool_calls.len(), 1);
    }

    #[test]
    fn repair_json_cases() {
        let (v, used, notes) = repair_json("{\"a\": 1} tail").unwrap();
        assert_eq!((v, used, notes.len()), (json!({"a": 1}), 8, 0));
        assert_eq!(repair_json("{\"a\": [1, 2").unwrap().0, json!({"a": [1, 2]}));
        assert_eq!(repair_json("{\"a\": 1, \"b\":").unwrap().0, json!({"a": 1, "b": null}));
        assert_eq!(repair_json("{\"a\": 1, \"b").unwrap().0, json!({"a": 1}));
        assert_eq!(repair_json("{\"a\": \"x\\").unwrap().0, json!({"a": "x"}));
        assert!(repair_json("{]").is_none());
        assert!(repair_json("nope").is_none());
    }
}
