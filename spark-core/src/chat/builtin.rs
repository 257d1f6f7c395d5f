//! The built-in Spark-X2.5 chat format, rendered natively (no Jinja).
//!
//! Used when a checkpoint ships no template. The layout (see SPARK.md section 6):
//!
//! ```text
//! BOS <|System|> \n you are a helpful assistant. [## Tools\n...<tools>\n{fn json}...\n</tools>] [\n\n SYSTEM] EOS
//! BOS <|User|> TEXT EOS
//! BOS <|Bot|> (</think> | <think>REASONING</think>) TEXT (<tool_call>NAME(<arg_key>K</arg_key><arg_value>V</arg_value>)*</tool_call>)* EOS
//! BOS <|Tool|> (<tool_response>RESULT</tool_response>)+ EOS        (consecutive results share a turn)
//! BOS <|Bot|> (<think> | </think>)                                  (generation prompt)
//! ```
//!
//! Values follow Python semantics, as the distributed template does under Hugging Face's
//! renderer: truthiness, `str()` for interpolated non-strings and `json.dumps` for tool
//! schemas and non-string tool-call arguments. Errors carry the template's
//! `raise_exception` messages.

use anyhow::{anyhow, bail, Result};
use serde_json::{Map, Value};

use super::pyfmt::{json_dumps, JsonOptions, PyValue};

pub(crate) const BOS: &str = "<｜start▁of▁sentence｜>";
pub(crate) const EOS: &str = "<｜end▁of▁sentence｜>";
const DEFAULT_SYSTEM: &str = "you are a helpful assistant.";

/// Renders a conversation in the Spark-X2.5 format.
pub(crate) fn render(
    messages: &Value,
    tools: Option<&Value>,
    add_generation_prompt: bool,
    kwargs: &Map<String, Value>,
) -> Result<String> {
    let messages: &[Value] = match messages {
        Value::Array(list) if !list.is_empty() => list,
        Value::Array(_) | Value::Null => bail!("No messages provided."),
        other => bail!("messages must be a list, got {}", type_name(other)),
    };
    let enable_thinking = kwargs.get("enable_thinking").is_none_or(truthy);

    let mut out = String::new();

    // System block: default prompt, tools, then the caller's first system message.
    let initial_system = if role_of(&messages[0]) == Some("system") {
        render_content(field(&messages[0], "content"), "system")?
    } else {
        String::new()
    };
    out.push_str(BOS);
    out.push_str("<|System|>\n");
    out.push_str(DEFAULT_SYSTEM);
    if let Some(tools) = tools.filter(|t| truthy(t)) {
        let Value::Array(tools) = tools else {
            bail!("tools must be a list of tool definitions");
        };
        out.push_str("## Tools\nYou have access to the following functions:\n<tools>");
        for (i, tool) in tools.iter().enumerate() {
            let function = field(tool, "function").ok_or_else(|| anyhow!("tool {i} has no \"function\" definition"))?;
            out.push('\n');
            out.push_str(&to_json(function)?);
        }
        out.push_str("\n</tools>");
    }
    if !initial_system.is_empty() {
        out.push_str("\n\n");
        out.push_str(&initial_system);
    }
    out.push_str(EOS);

    // Conversation turns.
    for (i, message) in messages.iter().enumerate() {
        if !message.is_object() {
            bail!("message {i} must be an object with a role, got {}", type_name(message));
        }
        match role_of(message) {
            Some("system") => {
                // The first message's system text went into the initial block.
                if i > 0 {
                    out.push_str(BOS);
                    out.push_str("<|System|>\n");
                    out.push_str(&render_content(field(message, "content"), "system")?);
                    out.push_str(EOS);
                }
            }
            Some("user") => {
                out.push_str(BOS);
                out.push_str("<|User|>");
                out.push_str(&render_content(field(message, "content"), "user")?);
                out.push_str(EOS);
            }
            Some("assistant") => render_assistant(message, &mut out)?,
            Some("tool") => {
                let prev_is_tool = i > 0 && role_of(&messages[i - 1]) == Some("tool");
                let next_is_tool = messages.get(i + 1).and_then(role_of) == Some("tool");
                if !prev_is_tool {
                    out.push_str(BOS);
                    out.push_str("<|Tool|>");
                }
                out.push_str("<tool_response>");
                out.push_str(&py_str_opt(field(message, "content")));
                out.push_str("</tool_response>");
                if !next_is_tool {
                    out.push_str(EOS);
                }
            }
            _ => bail!("Unsupported message role: {}", py_str_opt(field(message, "role"))),
        }
    }

    if add_generation_prompt {
        out.push_str(BOS);
        out.push_str("<|Bot|>");
        out.push_str(if enable_thinking { "<think>" } else { "</think>" });
    }
    Ok(out)
}

fn render_assistant(message: &Value, out: &mut String) -> Result<()> {
    let content = render_content(field(message, "content"), "assistant")?;
    let reasoning = match field(message, "reasoning_content") {
        Some(Value::String(s)) => s.as_str(),
        Some(v) if truthy(v) => bail!("assistant reasoning_content must be a string, got {}", type_name(v)),
        _ => "",
    };
    out.push_str(BOS);
    out.push_str("<|Bot|>");
    if reasoning.is_empty() {
        out.push_str("</think>");
    } else {
        out.push_str("<think>");
        out.push_str(reasoning);
        out.push_str("</think>");
    }
    out.push_str(&content);
    match field(message, "tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            for (i, call) in calls.iter().enumerate() {
                render_tool_call(i, call, out)?;
            }
        }
        Some(other) => bail!("assistant tool_calls must be a list, got {}", type_name(other)),
    }
    out.push_str(EOS);
    Ok(())
}

fn render_tool_call(i: usize, call: &Value, out: &mut String) -> Result<()> {
    let function = field(call, "function").ok_or_else(|| anyhow!("tool call {i} has no \"function\""))?;
    let Some(Value::Object(args)) = field(function, "arguments") else {
        bail!("tool_call.function.arguments must be a dictionary; normalize JSON strings before apply_chat_template");
    };
    let Some(Value::String(name)) = field(function, "name") else {
        bail!("tool call {i} has no function name string");
    };
    out.push_str("<tool_call>");
    out.push_str(name);
    for (key, value) in args {
        out.push_str("<arg_key>");
        out.push_str(key);
        out.push_str("</arg_key><arg_value>");
        match value {
            Value::String(s) => out.push_str(s),
            other => out.push_str(&to_json(other)?),
        }
        out.push_str("</arg_value>");
    }
    out.push_str("</tool_call>");
    Ok(())
}

/// A string, nothing, or a list of `{"type": "text", "text": ...}` blocks, as text.
fn render_content(content: Option<&Value>, context_name: &str) -> Result<String> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for block in blocks {
                let kind = field(block, "type");
                if kind.and_then(Value::as_str) == Some("text") {
                    text.push_str(&py_str_opt(field(block, "text")));
                } else {
                    bail!("Unsupported {context_name} content block type: {}", py_str_opt(kind));
                }
            }
            Ok(text)
        }
        Some(_) => bail!("{context_name} content must be a string or a list of text blocks"),
    }
}

fn field<'a>(value: &'a Value, key: &str) -> Option<&'a Value> {
    value.as_object().and_then(|o| o.get(key))
}

fn role_of(message: &Value) -> Option<&str> {
    field(message, "role").and_then(Value::as_str)
}

/// Python truthiness of a JSON value.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Python `str(x)` of a possibly missing value (missing prints as nothing, as Jinja's
/// undefined does).
fn py_str_opt(value: Option<&Value>) -> String {
    value.map(|v| PyValue::from_json(v).to_py_str()).unwrap_or_default()
}

/// `json.dumps(x, ensure_ascii=False)`.
fn to_json(value: &Value) -> Result<String> {
    json_dumps(&PyValue::from_json(value), &JsonOptions::default()).map_err(|e| anyhow!(e))
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn r(messages: Value, tools: Option<Value>, gen: bool, kwargs: Value) -> Result<String> {
        let kwargs = kwargs.as_object().cloned().unwrap_or_default();
        render(&messages, tools.as_ref(), gen, &kwargs)
    }

    fn err(messages: Value) -> String {
        r(messages, None, true, json!({})).err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn minimal_prompt() -> Result<()> {
        let out = r(json!([{"role": "user", "content": "hi"}]), None, true, json!({}))?;
        assert_eq!(out, format!("{BOS}<|System|>\n{DEFAULT_SYSTEM}{EOS}{BOS}<|User|>hi{EOS}{BOS}<|Bot|><think>"));
        let out =
            r(json!([{"role": "user", "content": "hi"}]), Some(json!([])), true, json!({"enable_thinking": false}))?;
        assert!(out.ends_with("<|Bot|></think>"));
        Ok(())
    }

    #[test]
    fn later_system_turn_and_tool_content_forms() -> Result<()> {
        let out = r(
            json!([
                {"role": "user", "content": "a"},
                {"role": "system", "content": [{"type": "text", "text": "s"}]},
                {"role": "tool", "content": null},
                {"role": "tool", "content": [1, "x"]},
                {"role": "assistant", "reasoning_content": null, "tool_calls": null}
            ]),
            None,
            false,
            json!({}),
        )?;
        assert_eq!(
            out,
            format!(
                "{BOS}<|System|>\n{DEFAULT_SYSTEM}{EOS}{BOS}<|User|>a{EOS}{BOS}<|System|>\ns{EOS}\
                 {BOS}<|Tool|><tool_response>None</tool_response><tool_response>[1, 'x']</tool_response>{EOS}\
                 {BOS}<|Bot|></think>{EOS}"
            )
        );
        Ok(())
    }

    #[test]
    fn errors_mirror_template_messages() {
        assert_eq!(err(json!([])), "No messages provided.");
        assert_eq!(err(json!([{"role": "robot", "content": "x"}])), "Unsupported message role: robot");
        assert_eq!(
            err(json!([{"role": "user", "content": [{"type": "image"}]}])),
            "Unsupported user content block type: image"
        );
        assert_eq!(
            err(json!([{"role": "system", "content": 5}])),
            "system content must be a string or a list of text blocks"
        );
        assert!(err(json!([{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{\"a\": 1}"}}
        ]}]))
        .starts_with("tool_call.function.arguments must be a dictionary"));
        assert!(!err(json!("nope")).is_empty());
        assert!(!err(json!([5])).is_empty());
    }
}
