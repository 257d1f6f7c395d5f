//! Chat-template rendering against the golden renderings of Hugging Face transformers
//! (testdata/golden/chat/template_cases.json): the distributed Jinja template, the demo
//! checkpoint's own template and the built-in renderer must all match byte for byte.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use spark_core::chat::ChatTemplate;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from(".."))
}

struct Case {
    name: String,
    messages: Value,
    tools: Option<Value>,
    add_generation_prompt: bool,
    kwargs: Map<String, Value>,
    rendered: String,
}

fn load_cases() -> Result<Vec<Case>> {
    let path = repo_root().join("testdata/golden/chat/template_cases.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    let all: Map<String, Value> = serde_json::from_str(&text)?;
    let mut cases = Vec::new();
    for (name, case) in all {
        let mut kwargs = case["kwargs"].as_object().cloned().unwrap_or_default();
        let add_generation_prompt = kwargs.remove("add_generation_prompt").and_then(|v| v.as_bool()).unwrap_or(false);
        let tools = match &case["tools"] {
            Value::Null => None,
            t => Some(t.clone()),
        };
        let Some(rendered) = case["rendered"].as_str() else {
            bail!("case {name} has no rendered string");
        };
        cases.push(Case {
            name,
            messages: case["messages"].clone(),
            tools,
            add_generation_prompt,
            kwargs,
            rendered: rendered.to_string(),
        });
    }
    Ok(cases)
}

/// Describes the first difference between two renderings.
fn first_difference(want: &str, got: &str) -> String {
    let at = want
        .char_indices()
        .zip(got.chars())
        .find(|((_, a), b)| a != b)
        .map_or(want.len().min(got.len()), |((i, _), _)| i);
    let window = |s: &str| {
        let start = s.floor_char_boundary_compat(at.saturating_sub(40));
        let end = s.floor_char_boundary_compat((at + 40).min(s.len()));
        format!("{:?}", &s[start..end])
    };
    format!(
        "first difference at byte {at}\n  want ...{}...\n  got  ...{}...\n  full want: {want:?}\n  full got:  {got:?}",
        window(want),
        window(got)
    )
}

trait FloorCharBoundary {
    fn floor_char_boundary_compat(&self, i: usize) -> usize;
}

impl FloorCharBoundary for str {
    fn floor_char_boundary_compat(&self, mut i: usize) -> usize {
        i = i.min(self.len());
        while !self.is_char_boundary(i) {
            i -= 1;
        }
        i
    }
}

fn check_all(template: &ChatTemplate, label: &str) -> Result<()> {
    let cases = load_cases()?;
    assert!(!cases.is_empty(), "no golden chat cases found");
    let mut failures = Vec::new();
    for case in &cases {
        let got = template.render(&case.messages, case.tools.as_ref(), case.add_generation_prompt, &case.kwargs);
        match got {
            Ok(got) if got == case.rendered => {}
            Ok(got) => {
                failures.push(format!("[{label}] case {}: {}", case.name, first_difference(&case.rendered, &got)))
            }
            Err(e) => failures.push(format!("[{label}] case {}: error {e:#}", case.name)),
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
    eprintln!("[{label}] {} cases match", cases.len());
    Ok(())
}

fn distributed_template() -> Result<ChatTemplate> {
    ChatTemplate::from_file(&repo_root().join("testdata/templates/spark2_5.chat_template.jinja"))
}

fn demo_template() -> Result<ChatTemplate> {
    let t = ChatTemplate::from_model_dir(&repo_root().join("models/spark-demo-tiny"))?;
    t.context("the demo checkpoint ships a chat template")
}

#[test]
fn golden_cases_distributed_jinja_template() -> Result<()> {
    check_all(&distributed_template()?, "jinja file")
}

#[test]
fn golden_cases_checkpoint_template() -> Result<()> {
    let t = demo_template()?;
    assert!(matches!(t, ChatTemplate::Jinja { .. }));
    check_all(&t, "spark-demo-tiny")
}

#[test]
fn golden_cases_checkpoint_template_from_tokenizer_config() -> Result<()> {
    // Only tokenizer_config.json: the template embedded there must render the same.
    let dir = tempfile::tempdir()?;
    std::fs::copy(
        repo_root().join("models/spark-demo-tiny/tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )?;
    let t = ChatTemplate::for_model_dir(dir.path())?;
    assert!(matches!(&t, ChatTemplate::Jinja { origin, .. } if origin.contains("tokenizer_config.json")));
    check_all(&t, "tokenizer_config.json")
}

#[test]
fn golden_cases_builtin_template() -> Result<()> {
    check_all(&ChatTemplate::Builtin, "builtin")
}

fn all_templates() -> Result<Vec<(&'static str, ChatTemplate)>> {
    Ok(vec![
        ("jinja file", distributed_template()?),
        ("spark-demo-tiny", demo_template()?),
        ("builtin", ChatTemplate::Builtin),
    ])
}

fn render_err(t: &ChatTemplate, messages: Value) -> String {
    match t.render(&messages, None, true, &Map::new()) {
        Ok(text) => format!("unexpectedly rendered {text:?}"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn unsupported_role_is_an_error() -> Result<()> {
    for (label, t) in all_templates()? {
        let e = render_err(&t, json!([{"role": "robot", "content": "hi"}]));
        assert!(e.contains("Unsupported message role: robot"), "[{label}] {e}");
    }
    Ok(())
}

#[test]
fn arguments_as_json_string_is_an_error() -> Result<()> {
    let messages = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
        ]}
    ]);
    for (label, t) in all_templates()? {
        let e = render_err(&t, messages.clone());
        assert!(e.contains("tool_call.function.arguments must be a dictionary"), "[{label}] {e}");
    }
    Ok(())
}

#[test]
fn other_template_errors() -> Result<()> {
    for (label, t) in all_templates()? {
        let e = render_err(&t, json!([]));
        assert!(e.contains("No messages provided."), "[{label}] {e}");
        let e = render_err(&t, json!([{"role": "user", "content": [{"type": "image", "url": "x"}]}]));
        assert!(e.contains("Unsupported user content block type: image"), "[{label}] {e}");
        let e = render_err(&t, json!([{"role": "user", "content": {"text": "x"}}]));
        assert!(e.contains("user content must be a string or a list of text blocks"), "[{label}] {e}");
    }
    Ok(())
}

#[test]
fn renderers_agree_beyond_the_golden_cases() -> Result<()> {
    // Later system turns, a lone tool result, unicode and JSON-special characters in
    // arguments, floats, empty tools list, null reasoning.
    let messages = json!([
        {"role": "user", "content": "héllo \"quoted\" <b>"},
        {"role": "system", "content": "Mid-conversation system."},
        {"role": "assistant", "content": "ok", "reasoning_content": null, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {
                "s": "x\ny", "f": 1.5, "big": 1e20, "neg": -3, "n": null, "u": "日本",
                "nested": {"k": ["a\"b", {"z": false}], "e": {}, "l": []}
            }}}
        ]},
        {"role": "tool", "content": "r1"},
        {"role": "user", "content": [{"type": "text", "text": "again"}]}
    ]);
    let tools = json!([{"type": "function", "function": {"name": "f", "description": "é & <x>", "parameters": {}}}]);
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), json!(false));
    let templates = all_templates()?;
    for (tools, gen) in [(Some(&tools), true), (None, false)] {
        let outputs: Vec<(&str, String)> = templates
            .iter()
            .map(|(label, t)| Ok((*label, t.render(&messages, tools, gen, &kwargs)?)))
            .collect::<Result<_>>()?;
        for (label, out) in &outputs[1..] {
            assert!(out == &outputs[0].1, "[{label}] vs [{}]: {}", outputs[0].0, first_difference(&outputs[0].1, out));
        }
        assert!(outputs[0].1.contains(
            "<arg_key>f</arg_key><arg_value>1.5</arg_value><arg_key>big</arg_key><arg_value>1e+20</arg_value>"
        ));
        assert!(outputs[0].1.contains(r#"<arg_value>{"k": ["a\"b", {"z": false}], "e": {}, "l": []}</arg_value>"#));
    }
    Ok(())
}
