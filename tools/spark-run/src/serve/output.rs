//! From generated token ids to what a client sees: ids are decoded into text as they arrive,
//! stop strings are matched (text that may begin one is held back), and, for chat, the text is
//! split into reasoning, content and tool calls by the Spark tool-call parser.

use serde_json::{json, Value};
use spark_core::chat::toolcall::{Delta, ToolCallParser, ToolSpec};
use spark_core::tokenizer::{StreamDecoder, Tokenizer};

/// Matches stop strings in streamed text.
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops, held: String::new() }
    }

    /// Add text; returns the text that is final and whether a stop string was reached (the stop
    /// string and what follows are dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        let first = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(i) = first {
            let out = self.held[..i].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest suffix that is a prefix of a stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (n, _) in s.char_indices().skip(1) {
                if n > keep && self.held.ends_with(&s[..n]) {
                    keep = n;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The end: what is held was not a stop string.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Log-probability info of one generated token, OpenAI chat style.
pub fn chat_logprob(tok: &Tokenizer, id: u32, logprob: f32, top: &[(u32, f32)]) -> Value {
    let entry = |id: u32, lp: f32| {
        let s = tok.decode(&[id], false).unwrap_or_default();
        json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
    };
    let mut e = entry(id, logprob);
    e["top_logprobs"] = Value::Array(top.iter().map(|&(i, l)| entry(i, l)).collect());
    e
}

/// One request's output pipeline.
pub struct Pipeline<'t> {
    dec: StreamDecoder<'t>,
    stop: StopMatcher,
    parser: Option<ToolCallParser>,
    /// Whether a stop string ended the output.
    pub stopped: bool,
    finished: bool,
    truncated: bool,
    /// `Some(n)`: the output ends with its n-th tool call (`parallel_tool_calls: false`: 1).
    max_calls: Option<usize>,
    calls: usize,
}

impl<'t> Pipeline<'t> {
    /// `chat`: parse reasoning/content/tool calls (with `tools` and `thinking`); otherwise plain text.
    pub fn new(tok: &'t Tokenizer, stops: Vec<String>, chat: Option<(Vec<ToolSpec>, bool)>) -> Pipeline<'t> {
        Pipeline {
            dec: tok.stream_decoder(true),
            stop: StopMatcher::new(stops),
            parser: chat.map(|(tools, thinking)| ToolCallParser::new(tools, thinking)),
            stopped: false,
            finished: false,
            truncated: false,
            max_calls: None,
            calls: 0,
        }
    }

    /// End the output with its `n`-th tool call: what follows is dropped, and the output ends
    /// there as if a stop string had matched.
    pub fn with_max_calls(mut self, n: Option<usize>) -> Self {
        self.max_calls = n;
        self
    }

    /// Recovery notes of the tool-call parser.
    pub fn recoveries(&self) -> Vec<String> {
        self.parser.as_ref().map(|p| p.recoveries().to_vec()).unwrap_or_default()
    }

    /// A generated token; returns deltas (plain text comes as `Delta::Content`).
    pub fn token(&mut self, id: u32) -> Vec<Delta> {
        if self.finished {
            return vec![];
        }
        let text = self.dec.step(id).ok().flatten().unwrap_or_default();
        self.text(&text, false)
    }

    /// The end of generation. `truncated`: the token limit ended it (a tool call it cut short
    /// is kept as content, see [`ToolCallParser::finish_truncated`]).
    pub fn finish(&mut self, truncated: bool) -> Vec<Delta> {
        if self.finished {
            return vec![];
        }
        self.truncated = truncated;
        let text = self.dec.flush().ok().flatten().unwrap_or_default();
        self.text(&text, true)
    }

    fn text(&mut self, text: &str, end: bool) -> Vec<Delta> {
        let (mut out, hit) = self.stop.push(text);
        if end && !hit {
            out.push_str(&self.stop.flush());
        }
        let mut deltas = match &mut self.parser {
            Some(p) => p.push(&out),
            None if out.is_empty() => vec![],
            None => vec![Delta::Content(out)],
        };
        if hit || end {
            self.stopped |= hit;
            self.finished = true;
            if let Some(p) = &mut self.parser {
                deltas.extend(if self.truncated && !hit { p.finish_truncated() } else { p.finish() });
            }
        }
        if let Some(max) = self.max_calls {
            for (i, d) in deltas.iter().enumerate() {
                if matches!(d, Delta::ToolCall(_)) {
                    self.calls += 1;
                    if self.calls >= max {
                        deltas.truncate(i + 1);
                        self.finished = true;
                        break;
                    }
                }
            }
        }
        deltas
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_output_ends_with_its_last_allowed_call() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/spark-demo-tiny");
        let tok = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let tools = ToolSpec::from_openai(&json!([{"type": "function", "function": {"name": "tap"}}]));
        let call = |i: u32| format!("<tool_call>tap<arg_key>index</arg_key><arg_value>{i}</arg_value></tool_call>");
        let text = format!("{}{} and more", call(1), call(2));
        let ids = tok.encode(&text).unwrap();
        for (max, want) in [(None, 2), (Some(1), 1), (Some(2), 2)] {
            let mut p = Pipeline::new(&tok, vec![], Some((tools.clone(), false))).with_max_calls(max);
            let mut deltas = vec![];
            let mut used = 0;
            for &id in &ids {
                used += 1;
                deltas.extend(p.token(id));
                if p.is_finished() {
                    break;
                }
            }
            deltas.extend(p.finish(false));
            let calls = deltas.iter().filter(|d| matches!(d, Delta::ToolCall(_))).count();
            assert_eq!(calls, want, "{max:?}");
            // Limited, it ends at the last call allowed instead of reading on.
            assert_eq!(used < ids.len(), max.is_some(), "{max:?}: read {used} of {}", ids.len());
        }
    }

    #[test]
    fn stop_matcher_holds_prefixes() {
        let mut m = StopMatcher::new(vec!["END".into(), "xyz".into()]);
        assert_eq!(m.push("abc E"), ("abc ".to_string(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("X"), ("ENX".to_string(), false));
        assert_eq!(m.push("1 EN"), ("1 ".to_string(), false));
        assert_eq!(m.push("D tail"), (String::new(), true));
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("aé"), ("a".to_string(), false));
        assert_eq!(m.flush(), "é");
    }
}
