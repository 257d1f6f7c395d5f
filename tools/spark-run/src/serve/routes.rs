//! The HTTP endpoints. Requests are read as JSON objects and checked field by field (errors name
//! the field and the value); generation goes through the engine thread; replies are OpenAI
//! objects, or Server-Sent Events when `stream` is true.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use spark_core::chat::toolcall::{Delta, ToolCall, ToolSpec};
use spark_core::constraint::{Constraint, EndAfter, Json as JsonConstraint, Markers, Schema, ToolCalls, ToolGrammar};
use spark_core::sample::SamplingParams;
use spark_core::scheduler::{Constrain, Event, FinishReason, Request, SubmitError};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::engine::{EngineError, Steer};
use super::openai::{show, ApiError, Fields};
use super::output::{chat_logprob, Pipeline};
use super::AppState;

type St = State<Arc<AppState>>;

/// The endpoints; request bodies at most `body_limit` bytes, each piece of one arriving within
/// `body_timeout` of the last (a stalled upload fails with 400 instead of holding the connection).
pub fn router(state: Arc<AppState>, body_limit: usize, body_timeout: std::time::Duration) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(body_timeout))
        .with_state(state)
}

fn count(state: &AppState, endpoint: &str, status: StatusCode) {
    if let Ok(mut h) = state.http.lock() {
        *h.responses.entry((endpoint.to_string(), status.as_u16())).or_default() += 1;
    }
}

fn finish_response(state: &AppState, endpoint: &str, r: Result<Response, ApiError>) -> Response {
    let r = r.unwrap_or_else(IntoResponse::into_response);
    count(state, endpoint, r.status());
    r
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("no such endpoint: {}", uri.path()))
        .with_code("not_found")
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{method} is not allowed on {} (see docs/SERVING.md for each endpoint's method)", uri.path()),
    )
    .with_code("method_not_allowed")
}

async fn health(State(state): St) -> Response {
    let m = state.engine.metrics();
    Json(json!({"status": "ok", "model": state.model_id, "running": m.running, "queued": m.queue_depth}))
        .into_response()
}

async fn models(State(state): St) -> Response {
    let r = Json(json!({"object": "list", "data": [{
        "id": state.model_id, "object": "model", "created": now(), "owned_by": "spark", "max_model_len": state.ctx
    }]}))
    .into_response();
    count(&state, "/v1/models", r.status());
    r
}

async fn metrics(State(state): St) -> Response {
    let m = state.engine.metrics();
    let mut s = String::new();
    // (name, type, help, value), one line each.
    #[rustfmt::skip]
    let metrics: [(&str, &str, &str, String); 15] = [
        ("spark_requests_total", "counter", "Generation requests accepted.", m.requests_submitted.to_string()),
        ("spark_requests_rejected_total", "counter", "Requests rejected by admission.", m.requests_rejected.to_string()),
        ("spark_requests_finished_total", "counter", "Requests ended.", m.requests_finished.to_string()),
        ("spark_requests_cancelled_total", "counter", "Requests cancelled or disconnected.", m.requests_cancelled.to_string()),
        ("spark_prompt_tokens_total", "counter", "Prompt tokens admitted.", m.prompt_tokens.to_string()),
        ("spark_generation_tokens_total", "counter", "Tokens generated.", m.completion_tokens.to_string()),
        ("spark_queue_depth", "gauge", "Requests waiting.", m.queue_depth.to_string()),
        ("spark_running_sequences", "gauge", "Sequences running.", m.running.to_string()),
        ("spark_kv_bytes_in_use", "gauge", "KV-cache bytes held for requests.", m.kv_in_use.to_string()),
        ("spark_kv_bytes_reserved", "gauge", "KV-cache bytes reserved by running sequences.", m.kv_reserved.to_string()),
        ("spark_prefix_cache_bytes", "gauge", "KV-cache bytes kept by the prefix cache.", m.prefix_cache_bytes.to_string()),
        ("spark_prefix_cache_entries", "gauge", "Prefixes kept.", m.prefix_cache_entries.to_string()),
        ("spark_prefix_cache_hits_total", "counter", "Requests started from a kept prefix.", m.prefix_cache_hits.to_string()),
        ("spark_prefix_cache_tokens_total", "counter", "Prompt tokens not prefilled thanks to the prefix cache.", m.prefix_cache_tokens.to_string()),
        ("spark_step_seconds_last", "gauge", "Duration of the last scheduler step.", m.last_step_seconds.to_string()),
    ];
    for (name, kind, help, v) in metrics {
        s.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"));
    }
    s.push_str(&format!(
        "# HELP spark_step_seconds Scheduler step duration.\n# TYPE spark_step_seconds summary\nspark_step_seconds_sum {}\nspark_step_seconds_count {}\n",
        m.step_seconds_total, m.steps
    ));
    s.push_str("# HELP spark_http_responses_total HTTP responses by endpoint and status.\n# TYPE spark_http_responses_total counter\n");
    if let Ok(h) = state.http.lock() {
        for ((ep, code), n) in &h.responses {
            s.push_str(&format!("spark_http_responses_total{{endpoint=\"{ep}\",status=\"{code}\"}} {n}\n"));
        }
    }
    s.push_str(&format!(
        "# HELP spark_uptime_seconds Seconds since start.\n# TYPE spark_uptime_seconds gauge\nspark_uptime_seconds {}\n",
        state.started.elapsed().as_secs_f64()
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s).into_response()
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The request body as a JSON object.
fn body_object(body: Result<Bytes, BytesRejection>) -> Result<Map<String, Value>, ApiError> {
    let bytes = body.map_err(|e| {
        let status = e.status();
        let msg = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is too large".to_string()
        } else {
            format!("could not read the request body: {}", e.body_text())
        };
        ApiError::new(status, "invalid_request_error", msg)
    })?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad_request(format!("the request body must be a JSON object, got {}", show(&other)))),
    }
}

/// Settings common to both generation endpoints.
struct Common {
    params: SamplingParams,
    max_tokens: Option<usize>,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    /// vLLM extension: keep generating past EOS (benchmarks, tests).
    ignore_eos: bool,
    /// OpenAI `logit_bias`: `(token id, bias)`.
    logit_bias: Vec<(u32, f32)>,
}

/// Request fields that would change the output and that this server does not implement: each
/// is refused (a 400 naming it) instead of being silently ignored.
fn refuse_unsupported(f: &Fields<'_>, chat: bool) -> Result<(), ApiError> {
    if let Some(v) = f.get("response_format").filter(|v| !v.is_null()) {
        let ok = match v.get("type").and_then(Value::as_str) {
            Some("text") => true,
            Some("json_object" | "json_schema") => chat,
            _ => false,
        };
        if !ok {
            let what = if chat {
                "{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}"
            } else {
                "{\"type\": \"text\"}"
            };
            return Err(ApiError::invalid(
                "response_format",
                format!("`response_format` {} is not supported; use {what}", show(v)),
            ));
        }
    }
    if chat {
        for k in ["functions", "function_call"] {
            if f.get(k).is_some_and(|v| !v.is_null()) {
                return Err(ApiError::invalid(
                    k,
                    format!("`{k}` is the deprecated form of `tools` / `tool_choice`: use those"),
                ));
            }
        }
        if f.get("audio").is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid("audio", "audio output is not supported (Spark-X2.5 writes text)"));
        }
        if let Some(m) = f.get("modalities").filter(|m| !m.is_null()) {
            if *m != serde_json::json!(["text"]) {
                return Err(ApiError::invalid("modalities", format!("only [\"text\"] is supported, got {}", show(m))));
            }
        }
    }
    Ok(())
}

/// `logit_bias`: `{"token id": bias}` with biases in [-100, 100].
fn logit_bias(f: &Fields<'_>) -> Result<Vec<(u32, f32)>, ApiError> {
    let m = match f.get("logit_bias") {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` must be an object of token ids to biases, got {}", show(v)),
            ))
        }
    };
    if m.len() > 1024 {
        return Err(ApiError::invalid("logit_bias", format!("`logit_bias` has {} entries; at most 1024", m.len())));
    }
    m.iter()
        .map(|(k, v)| {
            let id = k.parse::<u32>().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` key {} is not a token id", show(&Value::String(k.clone()))),
                )
            })?;
            let b = v.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` of token {id} must be a number in [-100, 100], got {}", show(v)),
                )
            })?;
            Ok((id, b as f32))
        })
        .collect()
}

fn common(state: &AppState, f: &Fields<'_>, chat: bool) -> Result<Common, ApiError> {
    refuse_unsupported(f, chat)?;
    if let Some(m) = f.str("model")? {
        if m != state.model_id {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model `{m}` does not exist; this server serves `{}`", state.model_id),
            )
            .with_code("model_not_found"));
        }
    }
    if let Some(n) = f.uint("n", u64::MAX)? {
        if n != 1 {
            return Err(ApiError::invalid("n", format!("`n` must be 1 (one choice per request), got {n}")));
        }
    }
    let d = state.defaults;
    let top_k = match f.get("top_k") {
        Some(v) if v.as_i64() == Some(-1) => Some(0),
        _ => f.uint("top_k", 1 << 30)?.map(|k| k as usize),
    };
    let seed = match f.get("seed") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|x| x as u64))
                .ok_or_else(|| ApiError::invalid("seed", format!("`seed` must be an integer, got {}", show(v))))?,
        ),
    };
    let params = SamplingParams {
        temperature: f.f32_in("temperature", 0.0, 2.0)?.unwrap_or(d.temperature),
        top_p: f.f32_in("top_p", 0.0, 1.0)?.unwrap_or(d.top_p),
        top_k: top_k.unwrap_or(d.top_k),
        min_p: f.f32_in("min_p", 0.0, 1.0)?.unwrap_or(0.0),
        frequency_penalty: f.f32_in("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        presence_penalty: f.f32_in("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        repetition_penalty: f.f32("repetition_penalty")?.unwrap_or(1.0),
        seed: seed.unwrap_or_else(|| state.next_id.load(Ordering::Relaxed) ^ 0x9e37_79b9),
    };
    params.validate().map_err(|e| ApiError::invalid(e.field, e.to_string()))?;
    let mt_key = if chat && f.get("max_completion_tokens").is_some() { "max_completion_tokens" } else { "max_tokens" };
    let max_tokens = match f.uint(mt_key, u32::MAX as u64)? {
        Some(0) => return Err(ApiError::invalid(mt_key, format!("`{mt_key}` must be at least 1, got 0"))),
        x => x.map(|x| x as usize),
    };
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields(o).bool("include_usage")?.unwrap_or(false),
        Some(v) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!("`stream_options` must be an object, got {}", show(v)),
            ))
        }
    };
    Ok(Common {
        params,
        max_tokens,
        stop: f.stop()?,
        stream: f.bool("stream")?.unwrap_or(false),
        include_usage,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        logit_bias: logit_bias(f)?,
    })
}

/// OpenAI messages -> what the chat template expects: text content, tool-call arguments as
/// objects.
fn template_messages(v: Option<&Value>) -> Result<Value, ApiError> {
    let Some(Value::Array(list)) = v else {
        return Err(ApiError::invalid("messages", "`messages` must be a non-empty list of message objects"));
    };
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must not be empty"));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(ApiError::invalid(
                &format!("messages[{i}]"),
                format!("messages[{i}] must be an object, got {}", show(m)),
            ));
        };
        let mut m = m.clone();
        match m.get("role") {
            // OpenAI's newer name for the system role; the Spark template has no developer turn.
            Some(Value::String(r)) if r == "developer" => {
                m.insert("role".into(), Value::String("system".into()));
            }
            Some(Value::String(_)) => {}
            other => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!("messages[{i}].role must be a string, got {}", other.map_or("nothing".into(), show)),
                ))
            }
        }
        match m.get("content").cloned() {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text") | None, Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                &format!("messages[{i}].content[{j}]"),
                                format!("messages[{i}].content[{j}]: only text parts are supported, got {}", show(p)),
                            ))
                        }
                    }
                }
                m.insert("content".into(), Value::String(text));
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].content"),
                    format!("messages[{i}].content must be a string or a list of text parts, got {}", show(&other)),
                ))
            }
        }
        if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
            for (j, c) in calls.iter_mut().enumerate() {
                if let Some(Value::String(args)) = c.get("function").and_then(|f| f.get("arguments")) {
                    let parsed: Value = serde_json::from_str(args).map_err(|e| {
                        ApiError::invalid(
                            &format!("messages[{i}].tool_calls[{j}].function.arguments"),
                            format!(
                                "messages[{i}].tool_calls[{j}].function.arguments is not valid JSON ({e}): {}",
                                show(&Value::String(args.clone()))
                            ),
                        )
                    })?;
                    c["function"]["arguments"] = parsed;
                }
            }
        }
        out.push(Value::Object(m));
    }
    Ok(Value::Array(out))
}

/// What `tool_choice` asks for (`"none"` is no tools at all).
#[derive(Debug, Clone, PartialEq)]
enum ToolChoice {
    /// The model decides.
    Auto,
    /// The reply must be tool calls: `<tool_call>` is forced after the reasoning.
    Required,
    /// The reply must call this tool: `<tool_call>NAME` is forced after the reasoning.
    Named(String),
}

/// `tools` and `tool_choice` -> the specs the parser needs (checked), the list for the
/// template, and the choice.
fn read_tools(f: &Fields<'_>) -> Result<(Vec<ToolSpec>, Option<Value>, ToolChoice), ApiError> {
    let choice_error = |what: String| {
        ApiError::invalid(
            "tool_choice",
            format!(
                "`tool_choice` must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {what}"
            ),
        )
    };
    let choice = match f.get("tool_choice") {
        None => Some(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Some(ToolChoice::Auto),
            "none" => None,
            "required" => Some(ToolChoice::Required),
            _ => return Err(choice_error(show(&Value::String(s.clone())))),
        },
        Some(Value::Object(o)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => Some(ToolChoice::Named(n.to_string())),
                _ => return Err(choice_error(show(&Value::Object(o.clone())))),
            }
        }
        Some(v) => return Err(choice_error(show(v))),
    };
    let Some(v) = f.get("tools") else {
        return match choice {
            None | Some(ToolChoice::Auto) => Ok((vec![], None, ToolChoice::Auto)),
            Some(_) => {
                Err(ApiError::invalid("tool_choice", "`tool_choice` asks for a tool call but no `tools` were given"))
            }
        };
    };
    let Value::Array(list) = v else {
        return Err(ApiError::invalid("tools", format!("`tools` must be a list, got {}", show(v))));
    };
    let mut names = std::collections::HashSet::new();
    for (i, t) in list.iter().enumerate() {
        let name = check_tool(i, t)?;
        if !names.insert(name) {
            return Err(ApiError::invalid(
                &format!("tools[{i}].function.name"),
                format!("tools[{i}].function.name `{name}` names an earlier tool too; tool names must be unique"),
            ));
        }
    }
    let Some(choice) = choice else { return Ok((vec![], None, ToolChoice::Auto)) };
    if let ToolChoice::Named(n) = &choice {
        if !names.contains(n.as_str()) {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` names the tool `{n}`, which is not in `tools`"),
            ));
        }
    }
    if list.is_empty() {
        if choice != ToolChoice::Auto {
            return Err(ApiError::invalid("tool_choice", "`tool_choice` asks for a tool call but `tools` is empty"));
        }
        return Ok((vec![], None, choice));
    }
    Ok((ToolSpec::from_openai(v), Some(v.clone()), choice))
}

/// Check one `tools` entry: `{"type": "function", "function": {"name", "description"?,
/// "parameters"?, "strict"?}}` with a name the Spark call format can carry and parameters that
/// are an object schema. Returns the name.
fn check_tool(i: usize, t: &Value) -> Result<&str, ApiError> {
    let bad = |field: &str, what: String| {
        Err(ApiError::invalid(&format!("tools[{i}]{field}"), format!("tools[{i}]{field} {what}")))
    };
    let Value::Object(t) = t else {
        return bad("", format!("must be {{\"type\": \"function\", \"function\": {{...}}}}, got {}", show(t)));
    };
    match t.get("type") {
        None => {}
        Some(Value::String(s)) if s == "function" => {}
        Some(v) => return bad(".type", format!("must be \"function\", got {}", show(v))),
    }
    let Some(Value::Object(f)) = t.get("function") else {
        let got = t.get("function").map_or("nothing".into(), show);
        return bad(".function", format!("must be an object with a `name`, got {got}"));
    };
    let name = match f.get("name") {
        Some(Value::String(n)) => n.as_str(),
        v => return bad(".function.name", format!("must be a string, got {}", v.map_or("nothing".into(), show))),
    };
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if name.is_empty() || name.len() > 64 || !name.chars().all(ok_char) {
        return bad(
            ".function.name",
            format!(
                "must be 1 to 64 letters, digits, `_`, `-` or `.` (the model writes it inside its call markup), got {}",
                show(&Value::String(name.to_string()))
            ),
        );
    }
    if let Some(d) = f.get("description").filter(|d| !d.is_null() && !d.is_string()) {
        return bad(".function.description", format!("must be a string, got {}", show(d)));
    }
    if let Some(v) = f.get("strict").filter(|v| !v.is_null() && !v.is_boolean()) {
        return bad(".function.strict", format!("must be a boolean, got {}", show(v)));
    }
    let params = match f.get("parameters") {
        None | Some(Value::Null) => return Ok(name),
        Some(Value::Object(p)) => p,
        Some(v) => return bad(".function.parameters", format!("must be a JSON schema object, got {}", show(v))),
    };
    match params.get("type") {
        None => {}
        Some(Value::String(s)) if s == "object" => {}
        Some(v) => {
            return bad(
                ".function.parameters.type",
                format!("must be \"object\" (arguments are named), got {}", show(v)),
            )
        }
    }
    if let Some(props) = params.get("properties") {
        let Value::Object(props) = props else {
            return bad(".function.parameters.properties", format!("must be an object, got {}", show(props)));
        };
        if let Some((k, v)) = props.iter().find(|(_, v)| !v.is_object() && !v.is_boolean()) {
            return bad(
                &format!(".function.parameters.properties.{k}"),
                format!("must be a JSON schema (an object), got {}", show(v)),
            );
        }
    }
    if let Some(req) = params.get("required") {
        let ok = req.as_array().is_some_and(|a| a.iter().all(Value::is_string));
        if !ok {
            return bad(".function.parameters.required", format!("must be a list of names, got {}", show(req)));
        }
    }
    // `strict: true` asks for arguments that follow the schema exactly: a keyword the call
    // grammar would relax is refused instead (without it, such keywords are relaxed).
    if f.get("strict") == Some(&Value::Bool(true)) {
        if let Err(e) = Schema::compile(&Value::Object(params.clone())) {
            return bad(
                ".function.parameters",
                format!("cannot be enforced with `strict: true`: {e} (drop `strict` to have it relaxed)"),
            );
        }
    }
    Ok(name)
}

fn submit_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Down => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine is not running").retry(5)
        }
        EngineError::Rejected(e) => match e {
            SubmitError::QueueFull(_) => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", e.to_string())
                    .with_code("queue_full")
                    .retry(1)
            }
            // The whole budget cannot hold it: retrying cannot help.
            SubmitError::TooLarge { .. } => {
                ApiError::invalid("max_tokens", format!("{e}; lower max_tokens")).with_code("kv_budget_exceeded")
            }
            SubmitError::PromptTooLong { .. } => {
                ApiError::invalid("messages", e.to_string()).with_code("context_length_exceeded")
            }
            SubmitError::EmptyPrompt => ApiError::invalid("prompt", e.to_string()),
            SubmitError::InvalidParams(m) if m.starts_with("logit_bias") => ApiError::invalid("logit_bias", m),
            SubmitError::InvalidParams(m) => ApiError::bad_request(m),
        },
    }
}

/// Tokens a request is made to emit instead of sampled ones.
#[derive(Default)]
struct Forcing {
    /// TEST HOOK: the whole output (see [`super::Scripted`]).
    script: Vec<u32>,
    /// The first tokens of the output.
    prefix: Vec<u32>,
    /// `</think>` after a budget, and what follows `</think>`.
    steer: Steer,
    /// Which tokens may come next (JSON mode).
    constraint: Option<Box<dyn Constraint>>,
    /// Where the prompt's KV is worth keeping for later requests.
    cache_at: Vec<usize>,
}

/// How a generation is presented.
#[derive(Clone)]
enum Kind {
    /// `max_calls`: `Some(1)` for `parallel_tool_calls: false`.
    Chat {
        tools: Vec<ToolSpec>,
        thinking: bool,
        max_calls: Option<usize>,
    },
    Completion,
}

/// One accepted generation.
struct Job {
    state: Arc<AppState>,
    handle: u64,
    rx: mpsc::UnboundedReceiver<Event>,
    kind: Kind,
    stop: Vec<String>,
    /// `Some(n)`: report log-probabilities with `n` alternatives.
    logprobs: Option<usize>,
    id: String,
    created: u64,
    prompt_tokens: usize,
    include_usage: bool,
}

async fn chat(State(state): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = chat_inner(state.clone(), body).await;
    finish_response(&state, "/v1/chat/completions", r)
}

async fn chat_inner(state: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let obj = body_object(body)?;
    let f = Fields(&obj);
    let c = common(&state, &f, true)?;
    let messages = template_messages(f.get("messages"))?;
    let (tools, tools_value, choice) = read_tools(&f)?;
    let mut kwargs = match f.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(v) => {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                format!("`chat_template_kwargs` must be an object, got {}", show(v)),
            ))
        }
    };
    if let Some(b) = f.bool("enable_thinking")? {
        kwargs.entry("enable_thinking").or_insert(Value::Bool(b));
    }
    let max_thinking = f.uint("max_thinking_tokens", u32::MAX as u64)?.map(|x| x as usize);
    if max_thinking == Some(0) {
        // `</think>` is forced after a reasoning token; none at all is thinking turned off.
        return Err(ApiError::invalid(
            "max_thinking_tokens",
            "`max_thinking_tokens` must be at least 1 (for no reasoning, set \
             `chat_template_kwargs: {\"enable_thinking\": false}`)",
        ));
    }
    let want_lp = f.bool("logprobs")?.unwrap_or(false);
    let top = f.uint("top_logprobs", 20)?;
    if top.is_some() && !want_lp {
        return Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
    }
    let text = state
        .template
        .render(&messages, tools_value.as_ref(), true, &kwargs)
        .map_err(|e| ApiError::invalid("messages", format!("the chat template could not render the request: {e:#}")))?;
    let thinking = text.trim_end().ends_with("<think>");
    let prompt = state.tok.encode(&text).map_err(|e| ApiError::bad_request(format!("tokenizing the prompt: {e:#}")))?;
    let script = match &state.scripted {
        Some(s) if !s.replies.is_empty() => {
            let i = s.next.fetch_add(1, Ordering::Relaxed) as usize % s.replies.len();
            let mut ids = state.tok.encode(&s.replies[i]).unwrap_or_default();
            ids.extend(state.eos.first());
            ids
        }
        _ => vec![],
    };
    let special = state.tok.special_ids();
    let think_budget = match (thinking, max_thinking, special.end_think) {
        (true, Some(n), Some(end)) => Some((n, end)),
        _ => None,
    };
    let mut steer = Steer { think_budget, after_think: None };
    // A required call: its start is forced where the content would begin (after `</think>`,
    // or first when thinking is off). A scripted reply (test hook) is left as scripted.
    let mut prefix = vec![];
    let mut required_call = None;
    let must_call = !matches!(choice, ToolChoice::Auto) && script.is_empty();
    let forced = match &choice {
        ToolChoice::Auto => None,
        ToolChoice::Required => Some("<tool_call>".to_string()),
        ToolChoice::Named(n) => Some(format!("<tool_call>{n}")),
    };
    if let Some(text) = forced.filter(|_| script.is_empty()) {
        let ids = state.tok.encode(&text).map_err(|e| ApiError::bad_request(format!("tokenizing `{text}`: {e:#}")))?;
        let unsupported = || {
            ApiError::invalid(
                "tool_choice",
                "this checkpoint's tokenizer has no <tool_call> / </think> tokens, so a tool call cannot be required",
            )
        };
        if special.tool_call.is_none() || ids.first().copied() != special.tool_call {
            return Err(unsupported());
        }
        if thinking {
            steer.after_think = Some((special.end_think.ok_or_else(unsupported)?, ids));
        } else {
            prefix = ids;
        }
        // The reply may not end (inside its reasoning, or inside the call) before the call closes.
        if let Some(close) = special.end_tool_call {
            required_call = Some(Box::new(EndAfter::new(state.eos.clone(), close)) as Box<dyn Constraint>);
        }
    }
    // Tool calls are held to the tools' schemas as they are written (a named choice: to that
    // tool's); without the markup's tokens, only the required call's end is enforced.
    let markers = (|| {
        Some(Markers {
            tool_call: special.tool_call?,
            end_tool_call: special.end_tool_call?,
            arg_key: special.arg_key?,
            end_arg_key: special.end_arg_key?,
            arg_value: special.arg_value?,
            end_arg_value: special.end_arg_value?,
        })
    })();
    if let Some(marks) = markers.filter(|_| !tools.is_empty()) {
        let offered: Vec<ToolSpec> = match &choice {
            ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).cloned().collect(),
            _ => tools.clone(),
        };
        let (grammar, _relaxed) = ToolGrammar::new(&offered);
        let end_think = if thinking { special.end_think } else { None };
        let calls = ToolCalls::new(
            Arc::new(grammar),
            state.token_bytes.clone(),
            state.eos.clone(),
            marks,
            end_think,
            must_call,
        );
        required_call = Some(Box::new(calls) as Box<dyn Constraint>);
    }
    let logprobs = want_lp.then(|| top.unwrap_or(0) as usize);
    // Keep the prompt's KV after the system block (shared by conversations with the same system
    // prompt and tools) and after the reply's role marker (the next turn of this conversation
    // renders the same tokens up to there).
    let mut cache_at = vec![];
    if let Some(eos) = special.eos {
        cache_at.extend(prompt.iter().position(|&t| t == eos).map(|i| i + 1));
    }
    if let Some(bot) = special.bot {
        cache_at.extend(prompt.iter().rposition(|&t| t == bot).map(|i| i + 1));
    }
    let mut forcing = Forcing { script, prefix, steer, constraint: required_call, cache_at };
    let max_calls = if f.bool("parallel_tool_calls")? == Some(false) { Some(1) } else { None };
    // JSON mode / structured output: the content is one JSON object, or one value of the given
    // schema (the reasoning before it is free).
    if let Some(schema) = json_output(&f)? {
        if !tools.is_empty() {
            return Err(ApiError::invalid(
                "response_format",
                "JSON output cannot be combined with tools (a tool call is not JSON content); drop `tools` or set `tool_choice: \"none\"`",
            ));
        }
        if thinking && special.end_think.is_none() {
            return Err(ApiError::invalid("response_format", "this checkpoint's tokenizer has no </think> token"));
        }
        let start = if thinking { special.end_think } else { None };
        forcing.constraint =
            Some(Box::new(JsonConstraint::new(state.token_bytes.clone(), state.eos.clone(), start, Arc::new(schema)))
                as Box<dyn Constraint>);
    }
    let job = start(&state, prompt, &c, logprobs, forcing, Kind::Chat { tools, thinking, max_calls }).await?;
    if c.stream {
        Ok(stream(job))
    } else {
        collect(job).await
    }
}

/// The schema `response_format` asks the content to follow: any object for `json_object`, the
/// compiled `json_schema.schema` for `json_schema`, `None` for text. A schema that cannot be
/// enforced is a 400 naming the keyword's path.
fn json_output(f: &Fields<'_>) -> Result<Option<Schema>, ApiError> {
    let Some(v) = f.get("response_format").filter(|v| !v.is_null()) else { return Ok(None) };
    match v.get("type").and_then(Value::as_str) {
        Some("json_object") => Ok(Some(Schema::any_object())),
        Some("json_schema") => {
            let bad = |m: String| ApiError::invalid("response_format", m);
            let Some(js) = v.get("json_schema").and_then(Value::as_object) else {
                return Err(bad("`response_format.json_schema` must be an object with `name` and `schema`".into()));
            };
            match js.get("name") {
                Some(Value::String(n)) if !n.is_empty() && n.len() <= 64 => {}
                Some(other) => {
                    return Err(bad(format!(
                        "`response_format.json_schema.name` must be a string of 1 to 64 characters, got {}",
                        show(other)
                    )))
                }
                None => return Err(bad("`response_format.json_schema.name` is required".into())),
            }
            if let Some(strict) = js.get("strict").filter(|s| !s.is_null() && !s.is_boolean()) {
                return Err(bad(format!(
                    "`response_format.json_schema.strict` must be a boolean, got {}",
                    show(strict)
                )));
            }
            // Without a schema OpenAI allows any JSON value; the content is then one JSON value.
            let Some(schema) = js.get("schema") else { return Ok(Some(Schema::any())) };
            Schema::compile(schema)
                .map(Some)
                .map_err(|e| bad(format!("`response_format.json_schema.schema` cannot be enforced: {e}")))
        }
        _ => Ok(None),
    }
}

async fn completions(State(state): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = completions_inner(state.clone(), body).await;
    finish_response(&state, "/v1/completions", r)
}

async fn completions_inner(state: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let obj = body_object(body)?;
    let f = Fields(&obj);
    let c = common(&state, &f, false)?;
    if f.bool("echo")?.unwrap_or(false) {
        return Err(ApiError::invalid("echo", "`echo: true` is not supported"));
    }
    if f.get("suffix").is_some() {
        return Err(ApiError::invalid("suffix", "`suffix` is not supported"));
    }
    let bad = |v: &Value| {
        ApiError::invalid(
            "prompt",
            format!("`prompt` must be a string, a list of token ids, or a one-element list of either; got {}", show(v)),
        )
    };
    let prompt: Vec<u32> = match f.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(v) => {
            let v = match v {
                Value::Array(a) if a.len() == 1 && (a[0].is_string() || a[0].is_array()) => &a[0],
                Value::Array(a) if a.len() > 1 && (a[0].is_string() || a[0].is_array()) => {
                    return Err(ApiError::invalid(
                        "prompt",
                        "batched prompts are not supported: send one prompt per request",
                    ))
                }
                v => v,
            };
            match v {
                Value::String(s) => {
                    state.tok.encode(s).map_err(|e| ApiError::bad_request(format!("tokenizing the prompt: {e:#}")))?
                }
                Value::Array(ids) => ids
                    .iter()
                    .map(|x| x.as_u64().filter(|&i| i <= u32::MAX as u64).map(|i| i as u32).ok_or_else(|| bad(v)))
                    .collect::<Result<_, _>>()?,
                v => return Err(bad(v)),
            }
        }
    };
    let logprobs = f.uint("logprobs", 20)?.map(|n| n as usize);
    // The whole prompt but its last token (which must be run for its logits): the same prompt
    // again, or one that extends it, starts from there.
    let forcing = Forcing { cache_at: vec![prompt.len().saturating_sub(1)], ..Forcing::default() };
    let job = start(&state, prompt, &c, logprobs, forcing, Kind::Completion).await?;
    if c.stream {
        Ok(stream(job))
    } else {
        collect(job).await
    }
}

async fn start(
    state: &Arc<AppState>,
    prompt: Vec<u32>,
    c: &Common,
    logprobs: Option<usize>,
    forcing: Forcing,
    kind: Kind,
) -> Result<Job, ApiError> {
    // The prompt must leave room to generate, in the context and in the KV budget.
    let param = if matches!(kind, Kind::Chat { .. }) { "messages" } else { "prompt" };
    let n = prompt.len();
    if n >= state.ctx {
        let msg = format!(
            "the prompt has {n} tokens but the context holds {} (at least one token must be left to generate)",
            state.ctx
        );
        return Err(ApiError::invalid(param, msg).with_code("context_length_exceeded"));
    }
    if n >= state.seq_tokens {
        let msg = format!(
            "the prompt has {n} tokens but the server's KV budget (--kv-budget) holds {} tokens per sequence",
            state.seq_tokens
        );
        return Err(ApiError::invalid(param, msg).with_code("kv_budget_exceeded"));
    }
    let prompt_tokens = prompt.len();
    let req = Request {
        // Unset: as many as the context and the KV budget allow.
        max_tokens: c.max_tokens.unwrap_or(state.seq_tokens - prompt.len()),
        prompt,
        params: c.params,
        stop_ids: if c.ignore_eos { vec![] } else { state.eos.clone() },
        logprobs,
        script: forcing.script,
        prefix: forcing.prefix,
        logit_bias: c.logit_bias.clone(),
        constraint: Constrain(forcing.constraint),
        cache_at: forcing.cache_at,
    };
    let (handle, rx) = state.engine.submit(req, forcing.steer).await.map_err(submit_error)?;
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = if matches!(kind, Kind::Chat { .. }) { "chatcmpl" } else { "cmpl" };
    Ok(Job {
        state: state.clone(),
        handle,
        rx,
        kind,
        stop: c.stop.clone(),
        logprobs,
        id: format!("{prefix}-{n:x}{:x}", now()),
        created: now(),
        prompt_tokens,
        include_usage: c.include_usage,
    })
}

/// What came out of one event.
enum Step {
    Deltas(Vec<Delta>, Option<Value>),
    /// The end: the finish reason, the completion tokens, and the last deltas (with a stop
    /// string, those of its token: the text before it and what the tool-call parser still held,
    /// such as a call the stop string cut short) and the last token's logprob.
    Done(&'static str, usize, Vec<Delta>, Option<Value>),
    Failed(String),
}

impl Job {
    fn pipeline(&self) -> Pipeline<'_> {
        let chat = match &self.kind {
            Kind::Chat { tools, thinking, .. } => Some((tools.clone(), *thinking)),
            Kind::Completion => None,
        };
        let max_calls = if let Kind::Chat { max_calls, .. } = &self.kind { *max_calls } else { None };
        Pipeline::new(&self.state.tok, self.stop.clone(), chat).with_max_calls(max_calls)
    }

    fn usage(&self, completion: usize) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
               "total_tokens": self.prompt_tokens + completion})
    }

    fn tool_call_json(&self, c: &ToolCall) -> Value {
        json!({"index": c.index, "id": format!("call_{}_{}", self.id, c.index), "type": "function",
               "function": {"name": c.name, "arguments": c.arguments_json()}})
    }
}

/// Turn one engine event into deltas / an end. `generated` counts tokens so far.
fn on_event(job: &Job, pipe: &mut Pipeline<'_>, ev: Event, generated: &mut usize) -> Step {
    match ev {
        Event::Token { id, logprob, top, stop } => {
            *generated += 1;
            let lp = match (job.logprobs, logprob) {
                (Some(_), Some(l)) => Some(chat_logprob(&job.state.tok, id, l, &top)),
                _ => None,
            };
            let deltas = if stop { vec![] } else { pipe.token(id) };
            if pipe.is_finished() {
                // A stop string: end now and free the sequence, keeping what came before it.
                job.state.engine.stop(job.handle);
                return Step::Done("stop", *generated, deltas, lp);
            }
            Step::Deltas(deltas, lp)
        }
        Event::Finished { reason, completion_tokens, .. } => {
            let r = match reason {
                FinishReason::Length => "length",
                _ => "stop",
            };
            Step::Done(r, completion_tokens, pipe.finish(r == "length"), None)
        }
        Event::Error(m) => Step::Failed(m),
    }
}

fn finish_reason(reason: &str, n_calls: usize) -> &str {
    if reason == "stop" && n_calls > 0 {
        "tool_calls"
    } else {
        reason
    }
}

fn legacy_logprobs(entries: &[Value]) -> Value {
    let tokens: Vec<Value> = entries.iter().map(|e| e["token"].clone()).collect();
    let lps: Vec<Value> = entries.iter().map(|e| e["logprob"].clone()).collect();
    let tops: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut m = Map::new();
            if let Some(list) = e["top_logprobs"].as_array() {
                for t in list {
                    if let Some(s) = t["token"].as_str() {
                        m.insert(s.to_string(), t["logprob"].clone());
                    }
                }
            }
            Value::Object(m)
        })
        .collect();
    let mut off = 0;
    let offsets: Vec<usize> = entries
        .iter()
        .map(|e| {
            let o = off;
            off += e["token"].as_str().map_or(0, str::len);
            o
        })
        .collect();
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

async fn collect(mut job: Job) -> Result<Response, ApiError> {
    let mut rx = std::mem::replace(&mut job.rx, mpsc::unbounded_channel().1);
    let mut pipe = job.pipeline();
    let mut deltas = Vec::new();
    let mut lps = Vec::new();
    let mut generated = 0;
    let (reason, completion) = loop {
        let Some(ev) = rx.recv().await else {
            return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "the engine stopped"));
        };
        match on_event(&job, &mut pipe, ev, &mut generated) {
            Step::Deltas(d, lp) => {
                deltas.extend(d);
                lps.extend(lp);
            }
            Step::Done(r, n, d, lp) => {
                deltas.extend(d);
                lps.extend(lp);
                break (r, n);
            }
            Step::Failed(m) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m)),
        }
    };
    let recoveries = pipe.recoveries();
    let usage = job.usage(completion);
    let body = match &job.kind {
        Kind::Chat { thinking, .. } => {
            let p = spark_core::chat::toolcall::Parsed::from_deltas(deltas, *thinking);
            let mut msg = json!({"role": "assistant", "content": if p.content.is_empty() && !p.tool_calls.is_empty() { Value::Null } else { Value::String(p.content.clone()) }});
            if let Some(r) = p.reasoning.filter(|r| !r.is_empty()) {
                msg["reasoning_content"] = Value::String(r);
            }
            if !p.tool_calls.is_empty() {
                msg["tool_calls"] = Value::Array(p.tool_calls.iter().map(|c| job.tool_call_json(c)).collect());
                if let Some(a) = msg["tool_calls"].as_array_mut() {
                    for c in a {
                        if let Some(o) = c.as_object_mut() {
                            o.remove("index");
                        }
                    }
                }
            }
            let logprobs = if job.logprobs.is_some() { json!({"content": lps}) } else { Value::Null };
            let mut body = json!({
                "id": job.id, "object": "chat.completion", "created": job.created, "model": job.state.model_id,
                "choices": [{"index": 0, "message": msg, "logprobs": logprobs,
                             "finish_reason": finish_reason(reason, p.tool_calls.len())}],
                "usage": usage,
            });
            if !recoveries.is_empty() {
                body["spark"] = json!({"tool_call_recoveries": recoveries});
            }
            body
        }
        Kind::Completion => {
            let text: String =
                deltas.into_iter().filter_map(|d| if let Delta::Content(s) = d { Some(s) } else { None }).collect();
            let logprobs = if job.logprobs.is_some() { legacy_logprobs(&lps) } else { Value::Null };
            json!({
                "id": job.id, "object": "text_completion", "created": job.created, "model": job.state.model_id,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}],
                "usage": usage,
            })
        }
    };
    Ok(Json(body).into_response())
}

fn stream(job: Job) -> Response {
    let (tx, rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(stream_task(job, tx));
    Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response()
}

async fn stream_task(mut job: Job, tx: mpsc::Sender<Result<SseEvent, Infallible>>) {
    let mut rx = std::mem::replace(&mut job.rx, mpsc::unbounded_channel().1);
    let chat = matches!(job.kind, Kind::Chat { .. });
    let chunk = |choice: Value| -> Value {
        let object = if chat { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": job.id, "object": object, "created": job.created, "model": job.state.model_id, "choices": [choice]})
    };
    let send = |v: Value| {
        let tx = tx.clone();
        async move { tx.send(Ok(SseEvent::default().data(v.to_string()))).await.is_ok() }
    };
    if chat
        && !send(chunk(
            json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
        ))
        .await
    {
        job.state.engine.cancel(job.handle);
        return;
    }
    let mut pipe = job.pipeline();
    let mut generated = 0;
    let mut lps: Vec<Value> = Vec::new();
    let mut n_calls = 0;
    let delta_choice = |d: &Delta, lps: &mut Vec<Value>| -> Value {
        let lp = if job.logprobs.is_some() && !lps.is_empty() {
            let taken = std::mem::take(lps);
            if chat {
                json!({"content": taken})
            } else {
                legacy_logprobs(&taken)
            }
        } else {
            Value::Null
        };
        match d {
            Delta::Content(s) if !chat => json!({"index": 0, "text": s, "logprobs": lp, "finish_reason": null}),
            Delta::Content(s) => json!({"index": 0, "delta": {"content": s}, "logprobs": lp, "finish_reason": null}),
            Delta::Reasoning(s) => {
                json!({"index": 0, "delta": {"reasoning_content": s}, "logprobs": lp, "finish_reason": null})
            }
            Delta::ToolCall(c) => {
                json!({"index": 0, "delta": {"tool_calls": [job.tool_call_json(c)]}, "logprobs": lp, "finish_reason": null})
            }
        }
    };
    let outcome = loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = tx.closed() => {
                // The client went away: drop the request now.
                job.state.engine.cancel(job.handle);
                return;
            }
        };
        let Some(ev) = ev else { break Err("the engine stopped".to_string()) };
        let (deltas, done) = match on_event(&job, &mut pipe, ev, &mut generated) {
            Step::Deltas(d, lp) => {
                lps.extend(lp);
                (d, None)
            }
            Step::Done(r, n, d, lp) => {
                lps.extend(lp);
                (d, Some((r, n)))
            }
            Step::Failed(m) => break Err(m),
        };
        for d in &deltas {
            if matches!(d, Delta::ToolCall(_)) {
                n_calls += 1;
            }
            if !send(chunk(delta_choice(d, &mut lps))).await {
                job.state.engine.cancel(job.handle);
                return;
            }
        }
        if let Some(done) = done {
            break Ok(done);
        }
    };
    match outcome {
        Ok((reason, completion)) => {
            let lp = if job.logprobs.is_some() && !lps.is_empty() {
                if chat {
                    json!({"content": lps})
                } else {
                    legacy_logprobs(&lps)
                }
            } else {
                Value::Null
            };
            let reason = finish_reason(reason, n_calls);
            let last = if chat {
                json!({"index": 0, "delta": {}, "logprobs": lp, "finish_reason": reason})
            } else {
                json!({"index": 0, "text": "", "logprobs": lp, "finish_reason": reason})
            };
            let mut fin = chunk(last);
            let recoveries = pipe.recoveries();
            if !recoveries.is_empty() {
                fin["spark"] = json!({"tool_call_recoveries": recoveries});
            }
            if !send(fin).await {
                return;
            }
            if job.include_usage {
                let mut u = chunk(Value::Null);
                u["choices"] = json!([]);
                u["usage"] = job.usage(completion);
                if !send(u).await {
                    return;
                }
            }
        }
        Err(m) => {
            let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m);
            if !send(e.body()).await {
                return;
            }
        }
    }
    let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
}
