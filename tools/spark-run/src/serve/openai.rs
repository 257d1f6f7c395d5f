//! OpenAI wire format: error objects, and reading request fields with errors that name the field
//! and the value received.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    pub message: String,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, code: None, param: None, message: message.into(), retry_after: None }
    }

    /// 400 invalid_request_error about `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = Some(param.to_string());
        e
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn retry(mut self, secs: u64) -> ApiError {
        self.retry_after = Some(secs);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}

/// A short rendering of a received value for error messages.
pub fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        let t: String = s.chars().take(80).collect();
        format!("{t}…")
    } else {
        s
    }
}

/// Typed access to the fields of a request object.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl<'a> Fields<'a> {
    /// The field, `None` when absent or `null`.
    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    pub fn f32(&self, k: &str) -> Result<Option<f32>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x.abs() <= f32::MAX as f64 => Ok(Some(x as f32)),
                _ => Err(ApiError::invalid(k, format!("`{k}` must be a finite number, got {}", show(v)))),
            },
        }
    }

    /// A number in `[lo, hi]`.
    pub fn f32_in(&self, k: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
        match self.f32(k)? {
            Some(x) if !(lo..=hi).contains(&x) => {
                Err(ApiError::invalid(k, format!("`{k}` must be between {lo} and {hi}, got {x}")))
            }
            x => Ok(x),
        }
    }

    /// A non-negative integer at most `max`.
    pub fn uint(&self, k: &str, max: u64) -> Result<Option<u64>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(x) if x <= max => Ok(Some(x)),
                _ => Err(ApiError::invalid(k, format!("`{k}` must be an integer from 0 to {max}, got {}", show(v)))),
            },
        }
    }

    pub fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid(k, format!("`{k}` must be true or false, got {}", show(v)))),
        }
    }

    pub fn str(&self, k: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::invalid(k, format!("`{k}` must be a string, got {}", show(v)))),
        }
    }

    /// `stop`: a string or a list of at most 16 non-empty strings.
    pub fn stop(&self) -> Result<Vec<String>, ApiError> {
        let bad = |v: &Value| {
            ApiError::invalid("stop", format!("`stop` must be a string or a list of up to 16 strings, got {}", show(v)))
        };
        match self.get("stop") {
            None => Ok(vec![]),
            Some(Value::String(s)) => Ok(if s.is_empty() { vec![] } else { vec![s.clone()] }),
            Some(v @ Value::Array(list)) => {
                if list.len() > 16 {
                    return Err(bad(v));
                }
                list.iter()
                    .map(|x| x.as_str().map(str::to_string).ok_or_else(|| bad(v)))
                    .filter(|s| s.as_ref().map_or(true, |s| !s.is_empty()))
                    .collect()
            }
            Some(v) => Err(bad(v)),
        }
    }
}
