//! Python-compatible text forms of JSON-like values, as Hugging Face's Jinja environment
//! produces them: `json.dumps(x, ensure_ascii=False)` for `tojson`, and `str(x)` / `repr(x)`
//! for printing and the `string` filter.
//!
//! Both renderers use this module: the Jinja one (via [`PyValue::from_minijinja`]) and the
//! built-in one (via [`PyValue::from_json`]), so the two agree byte for byte.

use minijinja::value::ValueKind;

/// A Python value as the template sees it (the subset JSON and Jinja can hold).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PyValue {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    List(Vec<PyValue>),
    Dict(Vec<(PyValue, PyValue)>),
}

impl PyValue {
    /// Converts parsed JSON; integers stay integers and floats stay floats, as in `json.loads`.
    pub(crate) fn from_json(v: &serde_json::Value) -> PyValue {
        use serde_json::Value as J;
        match v {
            J::Null => PyValue::None,
            J::Bool(b) => PyValue::Bool(*b),
            J::Number(n) => {
                if let Some(i) = n.as_i64() {
                    PyValue::Int(i128::from(i))
                } else if let Some(u) = n.as_u64() {
                    PyValue::Int(i128::from(u))
                } else {
                    PyValue::Float(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            J::String(s) => PyValue::Str(s.clone()),
            J::Array(a) => PyValue::List(a.iter().map(PyValue::from_json).collect()),
            J::Object(o) => {
                PyValue::Dict(o.iter().map(|(k, v)| (PyValue::Str(k.clone()), PyValue::from_json(v))).collect())
            }
        }
    }

    /// Converts a template value. Fails (with Python's `TypeError` wording) for values that
    /// have no JSON form: undefined, bytes, iterators, namespaces, macros, ...
    pub(crate) fn from_minijinja(v: &minijinja::Value) -> Result<PyValue, String> {
        let not_serializable = |kind: &str| format!("Object of type {kind} is not JSON serializable");
        match v.kind() {
            ValueKind::Undefined => Err(not_serializable("Undefined")),
            ValueKind::None => Ok(PyValue::None),
            ValueKind::Bool => Ok(PyValue::Bool(v.is_true())),
            ValueKind::Number => {
                if v.is_integer() {
                    i128::try_from(v.clone()).map(PyValue::Int).map_err(|e| e.to_string())
                } else {
                    f64::try_from(v.clone()).map(PyValue::Float).map_err(|e| e.to_string())
                }
            }
            ValueKind::String => Ok(PyValue::Str(v.as_str().unwrap_or_default().to_string())),
            ValueKind::Seq => {
                let iter = v.try_iter().map_err(|e| e.to_string())?;
                iter.map(|item| PyValue::from_minijinja(&item)).collect::<Result<Vec<_>, _>>().map(PyValue::List)
            }
            ValueKind::Map => {
                let iter = v.try_iter().map_err(|e| e.to_string())?;
                let mut items = Vec::new();
                for key in iter {
                    let value = v.get_item(&key).map_err(|e| e.to_string())?;
                    items.push((PyValue::from_minijinja(&key)?, PyValue::from_minijinja(&value)?));
                }
                Ok(PyValue::Dict(items))
            }
            ValueKind::Bytes => Err(not_serializable("bytes")),
            ValueKind::Iterable => Err(not_serializable("generator")),
            _ => Err(not_serializable(&v.kind().to_string())),
        }
    }

    /// Python `str(x)`.
    pub(crate) fn to_py_str(&self) -> String {
        match self {
            PyValue::Str(s) => s.clone(),
            other => other.to_py_repr(),
        }
    }

    /// Python `repr(x)`.
    pub(crate) fn to_py_repr(&self) -> String {
        let mut out = String::new();
        self.write_repr(&mut out);
        out
    }

    fn write_repr(&self, out: &mut String) {
        match self {
            PyValue::None => out.push_str("None"),
            PyValue::Bool(true) => out.push_str("True"),
            PyValue::Bool(false) => out.push_str("False"),
            PyValue::Int(i) => out.push_str(&i.to_string()),
            PyValue::Float(f) => out.push_str(&float_repr(*f, false)),
            PyValue::Str(s) => out.push_str(&str_repr(s)),
            PyValue::List(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    item.write_repr(out);
                }
                out.push(']');
            }
            PyValue::Dict(items) => {
                out.push('{');
                for (i, (k, v)) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    k.write_repr(out);
                    out.push_str(": ");
                    v.write_repr(out);
                }
                out.push('}');
            }
        }
    }
}

/// Options of Python's `json.dumps` that templates use.
#[derive(Debug, Clone)]
pub(crate) struct JsonOptions {
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(unit)`: pretty-printed, `unit` repeated per level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl Default for JsonOptions {
    /// `json.dumps(x, ensure_ascii=False)`, what HF's `tojson` filter does by default.
    fn default() -> Self {
        JsonOptions {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".to_string(),
            key_separator: ": ".to_string(),
            sort_keys: false,
        }
    }
}

/// Python `json.dumps(value, **opts)`. Errors as Python does for dict keys that are not
/// str, int, float, bool or None.
pub(crate) fn json_dumps(value: &PyValue, opts: &JsonOptions) -> Result<String, String> {
    let mut out = String::new();
    write_json(value, opts, 0, &mut out)?;
    Ok(out)
}

fn write_json(v: &PyValue, opts: &JsonOptions, level: usize, out: &mut String) -> Result<(), String> {
    match v {
        PyValue::None => out.push_str("null"),
        PyValue::Bool(true) => out.push_str("true"),
        PyValue::Bool(false) => out.push_str("false"),
        PyValue::Int(i) => out.push_str(&i.to_string()),
        PyValue::Float(f) => out.push_str(&float_repr(*f, true)),
        PyValue::Str(s) => write_json_str(s, opts.ensure_ascii, out),
        PyValue::List(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline_indent(opts, level + 1, out);
                write_json(item, opts, level + 1, out)?;
            }
            newline_indent(opts, level, out);
            out.push(']');
        }
        PyValue::Dict(items) => {
            if items.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            let mut keyed = items.iter().map(|(k, v)| Ok((json_key(k)?, v))).collect::<Result<Vec<_>, String>>()?;
            if opts.sort_keys {
                keyed.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (k, v)) in keyed.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline_indent(opts, level + 1, out);
                write_json_str(k, opts.ensure_ascii, out);
                out.push_str(&opts.key_separator);
                write_json(v, opts, level + 1, out)?;
            }
            newline_indent(opts, level, out);
            out.push('}');
        }
    }
    Ok(())
}

fn newline_indent(opts: &JsonOptions, level: usize, out: &mut String) {
    if let Some(unit) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(unit);
        }
    }
}

/// The string a dict key becomes in JSON, as Python's encoder coerces it.
fn json_key(k: &PyValue) -> Result<String, String> {
    match k {
        PyValue::Str(s) => Ok(s.clone()),
        PyValue::None => Ok("null".to_string()),
        PyValue::Bool(true) => Ok("true".to_string()),
        PyValue::Bool(false) => Ok("false".to_string()),
        PyValue::Int(i) => Ok(i.to_string()),
        PyValue::Float(f) => Ok(float_repr(*f, true)),
        PyValue::List(_) => Err("keys must be str, int, float, bool or None, not list".into()),
        PyValue::Dict(_) => Err("keys must be str, int, float, bool or None, not dict".into()),
    }
}

/// A JSON string literal as Python's encoder writes it.
fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `repr(s)` of a string: single quotes unless the text has `'` and no `"`.
fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..=0xa0).contains(&(c as u32)) => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python `repr(f)` for a float (`json`: the spellings `json.dumps` uses for NaN and infinities).
pub(crate) fn float_repr(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN" } else { "nan" }.to_string();
    }
    if f.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if f < 0.0 { format!("-{s}") } else { s.to_string() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // Shortest round-trip digits, as Python's repr uses.
    let sci = format!("{f:e}");
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (sci.as_str(), 0),
    };
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exp.abs()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn dumps(v: serde_json::Value) -> String {
        json_dumps(&PyValue::from_json(&v), &JsonOptions::default()).unwrap_or_default()
    }

    #[test]
    fn json_dumps_matches_python_defaults() {
        assert_eq!(
            dumps(json!({"b": 1, "a": [1, 2.5, true, null], "c": {}})),
            r#"{"b": 1, "a": [1, 2.5, true, null], "c": {}}"#
        );
        assert_eq!(dumps(json!("<a> & 'b' é\n\u{1}")), r#""<a> & 'b' é\n\u0001""#);
        assert_eq!(dumps(json!([])), "[]");
        assert_eq!(dumps(json!(2.0)), "2.0");
    }

    #[test]
    fn json_dumps_options() {
        let v = PyValue::from_json(&json!({"b": [1, {"x": "é😀"}], "a": 1}));
        let opts = JsonOptions {
            ensure_ascii: true,
            indent: Some("  ".into()),
            item_separator: ",".into(),
            key_separator: ": ".into(),
            sort_keys: true,
        };
        assert_eq!(
            json_dumps(&v, &opts).unwrap_or_default(),
            "{\n  \"a\": 1,\n  \"b\": [\n    1,\n    {\n      \"x\": \"\\u00e9\\ud83d\\ude00\"\n    }\n  ]\n}"
        );
    }

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (1e100, "1e+100"),
            (-0.0, "-0.0"),
            (100.0, "100.0"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f, false), want, "{f}");
        }
        assert_eq!(float_repr(f64::NAN, true), "NaN");
        assert_eq!(float_repr(f64::NEG_INFINITY, true), "-Infinity");
        assert_eq!(float_repr(f64::INFINITY, false), "inf");
    }

    #[test]
    fn python_str_and_repr() {
        let v = PyValue::from_json(&json!([null, true, 1, 1.5, "it's", "a\"b'c", {"k": "v"}]));
        assert_eq!(v.to_py_str(), r#"[None, True, 1, 1.5, "it's", 'a"b\'c', {'k': 'v'}]"#);
        assert_eq!(PyValue::Str("x".into()).to_py_str(), "x");
        assert_eq!(PyValue::None.to_py_str(), "None");
    }
}
