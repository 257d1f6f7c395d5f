//! Chat-template rendering: a conversation (OpenAI/HF-style `messages`, optional `tools`)
//! to the prompt text the model was trained on.
//!
//! - [`ChatTemplate::Jinja`]: a checkpoint's own Jinja template, rendered the way Hugging
//!   Face transformers renders it (see `jinja.rs`).
//! - [`ChatTemplate::Builtin`]: the Spark-X2.5 format written natively in Rust (see
//!   `builtin.rs`), for checkpoints without a template; it agrees byte for byte with the
//!   distributed template.
//!
//! [`ChatTemplate::for_model_dir`] picks the checkpoint's template when there is one and
//! the built-in one otherwise.

mod builtin;
mod jinja;
mod pyfmt;
pub mod toolcall;

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value};

/// The beginning-of-sentence marker that opens every turn.
pub const BOS_TOKEN: &str = builtin::BOS;
/// The end-of-sentence marker that closes every turn.
pub const EOS_TOKEN: &str = builtin::EOS;

/// Template variables that [`ChatTemplate::render`] sets itself; `kwargs` may not set them.
const RESERVED_VARIABLES: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// A chat template: the checkpoint's Jinja source, or the built-in Spark-X2.5 format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// Jinja source and where it came from (a path, used in error messages).
    Jinja { source: String, origin: String },
    /// The native Spark-X2.5 renderer.
    Builtin,
}

impl ChatTemplate {
    /// The template shipped in a model directory, if any. Looks, in order, at
    /// `chat_template.jinja`, `chat_template.json` (`{"chat_template": ...}`) and the
    /// `chat_template` entry of `tokenizer_config.json`. A template given as a list of named
    /// templates (`[{"name": ..., "template": ...}]`) yields the one named `"default"`.
    /// `Ok(None)` when the directory has none; an error when a file is unreadable or
    /// malformed, or the directory does not exist.
    pub fn from_model_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display());
        }
        let jinja_path = dir.join("chat_template.jinja");
        if jinja_path.is_file() {
            return ChatTemplate::from_file(&jinja_path).map(Some);
        }
        for name in ["chat_template.json", "tokenizer_config.json"] {
            let path = dir.join(name);
            if !path.is_file() {
                continue;
            }
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            let json: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
            let template = match json.get("chat_template") {
                None | Some(Value::Null) => continue,
                Some(entry) => {
                    select_template(entry).with_context(|| format!("chat_template in {}", path.display()))?
                }
            };
            return Ok(Some(ChatTemplate::Jinja {
                source: template,
                origin: format!("{} (chat_template)", path.display()),
            }));
        }
        Ok(None)
    }

    /// The model directory's template, or [`ChatTemplate::Builtin`] when it ships none.
    pub fn for_model_dir(dir: &Path) -> Result<ChatTemplate> {
        Ok(ChatTemplate::from_model_dir(dir)?.unwrap_or(ChatTemplate::Builtin))
    }

    /// A Jinja template read from a file.
    pub fn from_file(path: &Path) -> Result<ChatTemplate> {
        let source =
            std::fs::read_to_string(path).with_context(|| format!("reading chat template {}", path.display()))?;
        Ok(ChatTemplate::Jinja { source, origin: path.display().to_string() })
    }

    /// A short description for logs: the template's origin, or `built-in`.
    pub fn origin(&self) -> &str {
        match self {
            ChatTemplate::Jinja { origin, .. } => origin,
            ChatTemplate::Builtin => "built-in Spark-X2.5 template",
        }
    }

    /// Renders `messages` (a JSON list of `{role, content, ...}`) with the optional `tools`
    /// (a JSON list of `{"type": "function", "function": {...}}`). `kwargs` carries extra
    /// template variables such as `enable_thinking`; it may not set `messages`, `tools`,
    /// `documents` or `add_generation_prompt`. Errors carry the template's
    /// `raise_exception` message (for example `Unsupported message role: robot`).
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<String> {
        if let Some(name) = RESERVED_VARIABLES.iter().find(|n| kwargs.contains_key(**n)) {
            bail!("chat template argument `{name}` cannot be passed in kwargs");
        }
        match self {
            ChatTemplate::Jinja { source, origin } => {
                let mut context: Vec<(String, Value)> = kwargs.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                context.push(("messages".into(), messages.clone()));
                context.push(("tools".into(), tools.cloned().unwrap_or(Value::Null)));
                context.push(("documents".into(), Value::Null));
                context.push(("add_generation_prompt".into(), Value::Bool(add_generation_prompt)));
                jinja::render(source, origin, context)
            }
            ChatTemplate::Builtin => builtin::render(messages, tools, add_generation_prompt, kwargs)
                .map_err(|e| anyhow!("built-in chat template: {e}")),
        }
    }
}

/// The template text of a `chat_template` entry: a string, or the `"default"` one of a list
/// of named templates.
fn select_template(entry: &Value) -> Result<String> {
    match entry {
        Value::String(s) => Ok(s.clone()),
        Value::Array(list) => {
            let mut names = Vec::new();
            for item in list {
                let name = item.get("name").and_then(Value::as_str);
                let template = item.get("template").and_then(Value::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(t.to_string()),
                    (Some(n), Some(_)) => names.push(n.to_string()),
                    _ => bail!("each named template needs a string \"name\" and \"template\""),
                }
            }
            bail!("no template named \"default\" among the named templates [{}]", names.join(", "))
        }
        _ => bail!("must be a string or a list of named templates"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn model_dir_lookup_order_and_named_templates() -> Result<()> {
        let dir = tempfile::tempdir()?;
        assert_eq!(ChatTemplate::from_model_dir(dir.path())?, None);
        assert_eq!(ChatTemplate::for_model_dir(dir.path())?, ChatTemplate::Builtin);

        let cfg = dir.path().join("tokenizer_config.json");
        std::fs::write(
            &cfg,
            json!({"chat_template": [
                {"name": "tool_use", "template": "T"},
                {"name": "default", "template": "D{{ x }}"}
            ]})
            .to_string(),
        )?;
        let t = ChatTemplate::for_model_dir(dir.path())?;
        assert!(matches!(&t, ChatTemplate::Jinja { source, .. } if source == "D{{ x }}"));
        let mut kwargs = Map::new();
        kwargs.insert("x".into(), json!(1));
        assert_eq!(t.render(&json!([]), None, false, &kwargs)?, "D1");

        std::fs::write(&cfg, json!({"chat_template": [{"name": "a", "template": "A"}]}).to_string())?;
        let e = ChatTemplate::from_model_dir(dir.path()).err().map(|e| format!("{e:#}"));
        assert!(e.is_some_and(|e| e.contains("default") && e.contains("tokenizer_config.json")));

        std::fs::write(&cfg, "{not json")?;
        assert!(ChatTemplate::from_model_dir(dir.path()).is_err());

        std::fs::write(dir.path().join("chat_template.jinja"), "J")?;
        let t = ChatTemplate::for_model_dir(dir.path())?;
        assert!(matches!(&t, ChatTemplate::Jinja { source, .. } if source == "J"));

        assert!(ChatTemplate::from_model_dir(&dir.path().join("missing")).is_err());
        Ok(())
    }

    #[test]
    fn reserved_kwargs_are_rejected() {
        let mut kwargs = Map::new();
        kwargs.insert("messages".into(), json!([]));
        let msgs = json!([{"role": "user", "content": "x"}]);
        assert!(ChatTemplate::Builtin.render(&msgs, None, true, &kwargs).is_err());
    }

    #[test]
    fn builtin_errors_keep_template_message() {
        let msgs = json!([{"role": "robot", "content": "x"}]);
        let e = ChatTemplate::Builtin
            .render(&msgs, None, true, &Map::new())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.ends_with("Unsupported message role: robot"), "{e}");
    }
}
