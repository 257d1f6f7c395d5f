//! Jinja chat templates rendered with minijinja, set up to behave like Hugging Face
//! transformers' `apply_chat_template` environment (`ImmutableSandboxedEnvironment` with
//! `trim_blocks=True`, `lstrip_blocks=True`, the `loopcontrols` extension, its own `tojson`
//! filter and the `raise_exception` / `strftime_now` globals).
//!
//! What is matched on top of minijinja's defaults:
//! - `tojson` is `json.dumps(x, ensure_ascii=False)`: `", "` / `": "` separators, key order
//!   kept, no HTML escaping; `ensure_ascii`, `indent`, `separators`, `sort_keys` are accepted
//!   positionally or by keyword, as in HF.
//! - `{{ x }}` and the `string` filter print Python's `str(x)` (`None`, `True`, `['a', 1]`).
//! - Python string/dict/list methods (`.items()`, `.strip()`, `.startswith()`, ...) through
//!   minijinja-contrib's `pycompat`.
//! - Undefined values are lenient as Jinja2's default `Undefined` (printing and iterating
//!   are fine, attribute access on an undefined value is an error).
//! - Like Jinja2's default (`keep_trailing_newline=False`, which HF does not change), a
//!   single newline at the very end of the template source is dropped; all others are kept.
//!
//! Known difference: the `~` operator writes lists and maps with minijinja's double quotes
//! (`[1, "x"]`) where Python writes `[1, 'x']`; scalars (`None`, `True`, `1.0`) agree.

use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Result};
use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior, Value};

use super::pyfmt::{json_dumps, JsonOptions, PyValue};

/// Renders `source` (named `origin` in errors) with the given context variables.
pub(crate) fn render(source: &str, origin: &str, context: Vec<(String, serde_json::Value)>) -> Result<String> {
    let raised: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let env = environment(Arc::clone(&raised));
    let template = env
        .template_from_named_str(origin, source)
        .map_err(|e| anyhow!("chat template {origin} does not parse: {}", describe(&e)))?;
    let ctx = Value::from_iter(context.into_iter().map(|(k, v)| (k, Value::from_serialize(&v))));
    template.render(ctx).map_err(|e| {
        let message = raised.lock().ok().and_then(|mut m| m.take());
        match message {
            Some(message) => anyhow!("chat template {origin}: {message}"),
            None => anyhow!("chat template {origin} failed: {}", describe(&e)),
        }
    })
}

/// The error and its causes on one line.
fn describe(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The HF-compatible environment. `raised` receives the message of `raise_exception`.
fn environment(raised: Arc<Mutex<Option<String>>>) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        out.write_str(&python_str(value))
            .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write template output"))
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", |value: &Value| Value::from(python_str(value)));
    env.add_function("raise_exception", move |message: Option<Value>| -> Result<Value, Error> {
        let message = message.map(|m| python_str(&m)).unwrap_or_default();
        if let Ok(mut slot) = raised.lock() {
            slot.get_or_insert_with(|| message.clone());
        }
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_function("strftime_now", |format: &str| strftime_utc(format, now_unix()));
    env
}

/// Python `str(value)`; undefined prints as nothing.
fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        _ => match PyValue::from_minijinja(value) {
            Ok(py) => py.to_py_str(),
            Err(_) => value.to_string(),
        },
    }
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, args: Rest<Value>) -> Result<String, Error> {
    let mut positional: Vec<Value> = args.0;
    let kwargs = match positional.last() {
        Some(last) if last.is_kwargs() => {
            let last = positional.pop().unwrap_or_default();
            Kwargs::try_from(last)?
        }
        _ => Kwargs::from_iter(std::iter::empty::<(String, Value)>()),
    };
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if positional.len() > NAMES.len() {
        return Err(Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments"));
    }
    let mut params: [Option<Value>; 4] = Default::default();
    for (i, v) in positional.into_iter().enumerate() {
        params[i] = Some(v);
    }
    for (i, name) in NAMES.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if params[i].is_some() {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            params[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = params;

    let mut opts = JsonOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..JsonOptions::default()
    };
    match indent {
        None => {}
        Some(v) if v.is_none() || v.is_undefined() => {}
        Some(v) => {
            opts.indent = Some(if let Some(s) = v.as_str() {
                s.to_string()
            } else if let Some(n) = v.as_i64() {
                " ".repeat(usize::try_from(n).unwrap_or(0))
            } else {
                return Err(Error::new(ErrorKind::InvalidOperation, "tojson indent must be an integer or a string"));
            });
            opts.item_separator = ",".to_string();
        }
    }
    if let Some(seps) = separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        let parts: Vec<Value> = seps.try_iter().map(|it| it.collect()).unwrap_or_default();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                opts.item_separator = item.as_str().unwrap_or_default().to_string();
                opts.key_separator = key.as_str().unwrap_or_default().to_string();
            }
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson separators must be a pair of strings")),
        }
    }
    let py = PyValue::from_minijinja(value).map_err(|msg| Error::new(ErrorKind::InvalidOperation, msg))?;
    json_dumps(&py, &opts).map_err(|msg| Error::new(ErrorKind::InvalidOperation, msg))
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(0))
        .unwrap_or(0)
}

/// A small `strftime` over UTC for `strftime_now` (HF uses local time; servers mostly run
/// in UTC). Supports `%Y %y %m %d %e %H %I %M %S %p %j %a %A %b %B %h %F %T %%`; other
/// directives are kept as written.
fn strftime_utc(format: &str, unix: i64) -> String {
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs % 3600 / 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month as usize).saturating_sub(1).min(11)];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{hour12:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('F') => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            Some('T') => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 -> (year, month 1..=12, day 1..=31), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// (year, month, day) -> days since 1970-01-01.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn r(source: &str, ctx: serde_json::Value) -> Result<String> {
        let ctx = match ctx {
            serde_json::Value::Object(m) => m.into_iter().collect(),
            _ => Vec::new(),
        };
        render(source, "test", ctx)
    }

    #[test]
    fn tojson_is_python_json_dumps() -> Result<()> {
        let out = r(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':'), sort_keys=true) }}",
            json!({"x": {"b": "<&'>", "a": [1, 2.0, null, true]}}),
        )?;
        assert_eq!(
            out,
            "{\"b\": \"<&'>\", \"a\": [1, 2.0, null, true]}|{\n  \"b\": \"<&'>\",\n  \"a\": [\n    1,\n    2.0,\n    null,\n    true\n  ]\n}|{\"a\":[1,2.0,null,true],\"b\":\"<&'>\"}"
        );
        assert!(r("{{ nope | tojson }}", json!({})).is_err());
        Ok(())
    }

    #[test]
    fn raise_exception_becomes_error_with_message() {
        let err = r("a{{ raise_exception('bad ' ~ x) }}", json!({"x": "thing"}))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.ends_with("bad thing"), "{err}");
    }

    #[test]
    fn python_printing_and_methods() -> Result<()> {
        let out = r(
            "{{ n }} {{ t }} {{ l }} {{ u }}|{{ n | string }}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{{ ' s '.strip() }}|{{ 'abc'.startswith('a') }}",
            json!({"n": null, "t": true, "l": ["a", 1], "d": {"z": 1, "a": 2}}),
        )?;
        assert_eq!(out, "None True ['a', 1] |None|z=1;a=2;|s|True");
        Ok(())
    }

    #[test]
    fn tests_loop_items_namespace_and_whitespace() -> Result<()> {
        let src = "{%- set ns = namespace(c=0) %}\n{%- for m in ms %}\n  {%- if loop.previtem is undefined %}[{% endif %}\n  {%- set ns.c = ns.c + 1 %}\n  {{- m }}\n  {%- if loop.nextitem is defined %},{% endif %}\n{%- endfor %}\n]{{ ns.c }}|{{ 's' is string }}{{ 's' is iterable }}{{ {} is mapping }}{{ [] is mapping }}\n";
        let out = r(src, json!({"ms": [1, 2, 3]}))?;
        assert_eq!(out, "[1,2,3]3|TrueTrueTrueFalse");
        // trim_blocks / lstrip_blocks as HF sets them; inner newlines kept.
        let out = r("  {% if true %}\nx\n{% endif %}\ny\n\n", json!({}))?;
        assert_eq!(out, "x\ny\n");
        Ok(())
    }

    #[test]
    fn lenient_undefined_like_jinja2() {
        assert_eq!(r("[{{ a }}]{% for x in a %}{% endfor %}", json!({})).ok(), Some("[]".into()));
        assert!(r("{{ a.b }}", json!({})).is_err());
    }

    #[test]
    fn strftime_formats_utc() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S %a %b %j %I%p %%", t), "2024-02-29 13:05:09 Thu Feb 060 01PM %");
        assert_eq!(strftime_utc("%d %B %Y", 0), "01 January 1970");
    }
}
