//! JSON Schema -> the node graph the byte matcher ([`super::matcher`]) walks.
//!
//! [`Schema::compile`] takes the subset of JSON Schema that constrained generation can enforce
//! byte by byte, and refuses (with the keyword's path) every keyword that would constrain the
//! output but is not enforced, so a schema is never silently half-applied:
//!
//! - `type` (one or a list), `properties`, `required`, `additionalProperties` (a boolean or a
//!   schema; absent means any, as in JSON Schema), `items`, `minItems`, `maxItems`, `minLength`,
//!   `maxLength`, `pattern` ([`super::pattern`]), `minimum`, `maximum`, `exclusiveMinimum`,
//!   `exclusiveMaximum` (numbers; draft 4's boolean forms are refused), `enum`, `const`, `anyOf`,
//!   `oneOf` (enforced as `anyOf`: a value matching two alternatives is not refused), `allOf` of
//!   one schema, `$ref` to `#`, `#/$defs/...` or `#/definitions/...` (recursion allowed),
//!   `nullable` (OpenAPI);
//! - `format` `date`, `time`, `date-time`, `uuid`, `ipv4` and `email` are checked on strings
//!   (their shape); other formats are annotations, as JSON Schema 2020-12 treats them by default;
//! - annotations are ignored: `title`, `description`, `default`, `examples`, `$schema`, `$id`,
//!   `$comment`, `deprecated`, `readOnly`, `writeOnly`, `discriminator`.
//!
//! Generation may produce a subset of the texts a schema allows: object keys are written exactly
//! as `serde_json` escapes them, known keys at most once, `integer` without fraction or exponent,
//! `enum` / `const` values in compact form.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

use super::pattern::{format_regex, Pattern};

/// Index of a node in [`Schema::nodes`].
pub(crate) type NodeId = usize;

/// Most properties one object schema may list (the matcher tracks them in a `u64`).
pub const MAX_PROPERTIES: usize = 64;

/// One schema node.
#[derive(Debug, Clone)]
pub(crate) enum Node {
    /// Any JSON value.
    Any,
    /// An object: its known properties (key as written between the quotes, and schema), which of
    /// them are required (bit i: property i), and the schema of other keys (`None`: none
    /// allowed).
    Object { props: Vec<(Vec<u8>, NodeId)>, required: u64, additional: Option<NodeId> },
    /// An array of `items`, `min..=max` long.
    Array { items: NodeId, min: u32, max: Option<u32> },
    /// A string of `min..=max` characters, matching `pattern` (`pattern` or a checked
    /// `format`) if given.
    String { min: u32, max: Option<u32>, pattern: Option<Arc<Pattern>> },
    /// A number; `integer`: without fraction or exponent; `range`: its bounds (a bounded
    /// number is written without exponent).
    Number { integer: bool, range: Option<Range> },
    /// One of these JSON texts (compact): `enum`, `const`, `true`/`false`, `null`.
    Literals(Vec<Vec<u8>>),
    /// Any of these schemas.
    AnyOf(Vec<NodeId>),
}

/// Node ids every schema has (the generic JSON grammar): any value, and the containers and
/// scalars it is made of.
pub(crate) const ANY: NodeId = 0;
pub(crate) const ANY_OBJECT: NodeId = 1;
pub(crate) const ANY_ARRAY: NodeId = 2;
pub(crate) const ANY_STRING: NodeId = 3;
pub(crate) const ANY_NUMBER: NodeId = 4;
pub(crate) const BOOL: NodeId = 5;
pub(crate) const NULL: NodeId = 6;

/// A compiled schema.
#[derive(Debug, Clone)]
pub struct Schema {
    pub(crate) nodes: Vec<Node>,
    pub(crate) root: NodeId,
}

/// A schema that cannot be enforced: where (a JSON-pointer-like path from the schema's root,
/// `$` itself) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for SchemaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

impl std::error::Error for SchemaError {}

/// Keywords that do not constrain the value.
const ANNOTATIONS: [&str; 12] = [
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "discriminator",
    "format",
];

/// Keywords this compiler enforces (for the error message).
const SUPPORTED: &str = "type, properties, required, additionalProperties, items, minItems, maxItems, \
     minLength, maxLength, pattern, minimum, maximum, exclusiveMinimum, exclusiveMaximum, enum, const, anyOf, oneOf, \
     allOf (of one schema), $ref, $defs, nullable";

/// The bound keywords of numbers.
const NUMERIC: [&str; 4] = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"];

/// A number's bounds: `lo <= x` (`lo < x` when `lo_excl`) and `x <= hi` (`x < hi`), compared
/// as `f64` (as JSON parsers read numbers).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Range {
    pub lo: f64,
    pub lo_excl: bool,
    pub hi: f64,
    pub hi_excl: bool,
}

impl Range {
    pub(crate) fn contains(&self, x: f64) -> bool {
        (if self.lo_excl { x > self.lo } else { x >= self.lo })
            && (if self.hi_excl { x < self.hi } else { x <= self.hi })
    }
}

impl Schema {
    /// The base nodes: the generic JSON grammar.
    fn base() -> Vec<Node> {
        vec![
            Node::Any,
            Node::Object { props: vec![], required: 0, additional: Some(ANY) },
            Node::Array { items: ANY, min: 0, max: None },
            Node::String { min: 0, max: None, pattern: None },
            Node::Number { integer: false, range: None },
            Node::Literals(vec![b"true".to_vec(), b"false".to_vec()]),
            Node::Literals(vec![b"null".to_vec()]),
        ]
    }

    /// Any JSON object (JSON mode: `response_format: {"type": "json_object"}`).
    pub fn any_object() -> Schema {
        Schema { nodes: Schema::base(), root: ANY_OBJECT }
    }

    /// Any JSON value.
    pub fn any() -> Schema {
        Schema { nodes: Schema::base(), root: ANY }
    }

    /// Compile a JSON schema (see the module doc for what is enforced).
    pub fn compile(schema: &Value) -> Result<Schema, SchemaError> {
        let mut c = Compiler {
            root: schema,
            nodes: Schema::base(),
            refs: HashMap::new(),
            relaxed: None,
            patterns: Default::default(),
        };
        let root = c.node(schema, "$")?;
        Ok(Schema { nodes: c.nodes, root })
    }

    /// Compile a JSON schema, relaxing what cannot be enforced instead of refusing it: a
    /// subschema with such a keyword (or otherwise not compilable) becomes its bare `type` (any
    /// value without one), so the result allows every value the schema allows, and more. For
    /// schemas the caller did not write to constrain generation (tools' parameters). Returns the
    /// errors relaxed.
    pub fn compile_relaxed(schema: &Value) -> (Schema, Vec<SchemaError>) {
        let mut c = Compiler {
            root: schema,
            nodes: Schema::base(),
            refs: HashMap::new(),
            relaxed: Some(vec![]),
            patterns: Default::default(),
        };
        let root = c.node(schema, "$").unwrap_or(ANY);
        let relaxed = c.relaxed.take().unwrap_or_default();
        (Schema { nodes: c.nodes, root }, relaxed)
    }
}

struct Compiler<'a> {
    root: &'a Value,
    nodes: Vec<Node>,
    /// `$ref` targets already compiled (or being compiled: recursion).
    refs: HashMap<String, NodeId>,
    /// `Some`: relax what cannot be enforced ([`Schema::compile_relaxed`]), noting it here.
    relaxed: Option<Vec<SchemaError>>,
    /// Patterns compiled so far (one DFA per distinct regex).
    patterns: RefCell<HashMap<String, Arc<Pattern>>>,
}

fn err<T>(path: &str, message: impl Into<String>) -> Result<T, SchemaError> {
    Err(SchemaError { path: path.to_string(), message: message.into() })
}

/// The compact JSON text of a value.
fn text(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("a serde_json::Value always serializes")
}

/// Whether `v` is of JSON Schema type `ty`.
fn is_type(v: &Value, ty: &str) -> bool {
    match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => false,
    }
}

const TYPES: [&str; 7] = ["object", "array", "string", "number", "integer", "boolean", "null"];

impl Compiler<'_> {
    fn push(&mut self, n: Node) -> NodeId {
        self.nodes.push(n);
        self.nodes.len() - 1
    }

    fn node(&mut self, v: &Value, path: &str) -> Result<NodeId, SchemaError> {
        match self.node_exact(v, path) {
            Err(e) if self.relaxed.is_some() => {
                self.relaxed.as_mut().expect("checked").push(e);
                // The bare type, compiled exactly (it cannot fail but on a bad `type`: then any).
                let relaxed = self.relaxed.take();
                let bare = match v.get("type") {
                    Some(t) => self.node_exact(&serde_json::json!({ "type": t }), path).unwrap_or(ANY),
                    None => ANY,
                };
                self.relaxed = relaxed;
                Ok(bare)
            }
            r => r,
        }
    }

    fn node_exact(&mut self, v: &Value, path: &str) -> Result<NodeId, SchemaError> {
        let m = match v {
            Value::Bool(true) => return Ok(ANY),
            Value::Bool(false) => return err(path, "the schema `false` allows no value"),
            Value::Object(m) => m,
            other => return err(path, format!("a schema must be an object or a boolean, got {other}")),
        };
        let keys: Vec<&str> = m
            .keys()
            .map(String::as_str)
            .filter(|k| !ANNOTATIONS.contains(k) && *k != "$defs" && *k != "definitions")
            .collect();
        for k in &keys {
            let known = [
                "type",
                "properties",
                "required",
                "additionalProperties",
                "items",
                "minItems",
                "maxItems",
                "minLength",
                "maxLength",
                "enum",
                "const",
                "anyOf",
                "oneOf",
                "allOf",
                "$ref",
                "nullable",
                "minimum",
                "maximum",
                "exclusiveMinimum",
                "exclusiveMaximum",
                "pattern",
            ];
            if !known.contains(k) {
                return err(&format!("{path}.{k}"), format!("`{k}` is not enforced (enforced: {SUPPORTED})"));
            }
        }
        let only = |allowed: &[&str], what: &str| -> Result<(), SchemaError> {
            match keys.iter().find(|k| !allowed.contains(k)) {
                Some(k) => err(&format!("{path}.{k}"), format!("`{k}` beside `{what}` is not enforced")),
                None => Ok(()),
            }
        };
        if let Some(r) = m.get("$ref") {
            only(&["$ref"], "$ref")?;
            return self.reference(r, &format!("{path}.$ref"));
        }
        for k in ["anyOf", "oneOf", "allOf"] {
            let Some(alts) = m.get(k) else { continue };
            only(&[k, "nullable"], k)?;
            let p = format!("{path}.{k}");
            let Some(alts) = alts.as_array().filter(|a| !a.is_empty()) else {
                return err(&p, format!("`{k}` must be a non-empty array of schemas"));
            };
            if k == "allOf" {
                if alts.len() != 1 {
                    return err(&p, "`allOf` of more than one schema is not enforced");
                }
                let n = self.node(&alts[0], &format!("{p}[0]"))?;
                return self.nullable(m, n, path);
            }
            let mut ids = vec![];
            for (i, a) in alts.iter().enumerate() {
                ids.push(self.node(a, &format!("{p}[{i}]"))?);
            }
            let n = self.push(Node::AnyOf(ids));
            return self.nullable(m, n, path);
        }
        let types: Vec<&str> = match m.get("type") {
            None => {
                if m.contains_key("properties") || m.contains_key("required") || m.contains_key("additionalProperties")
                {
                    vec!["object"]
                } else if ["items", "minItems", "maxItems"].iter().any(|k| m.contains_key(*k)) {
                    vec!["array"]
                } else if ["minLength", "maxLength", "pattern"].iter().any(|k| m.contains_key(*k)) {
                    vec!["string"]
                } else if NUMERIC.iter().any(|k| m.contains_key(*k)) {
                    vec!["number"]
                } else {
                    vec![]
                }
            }
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) if !ts.is_empty() => {
                let mut out = vec![];
                for t in ts {
                    match t.as_str() {
                        Some(t) => out.push(t),
                        None => return err(&format!("{path}.type"), format!("type names must be strings, got {t}")),
                    }
                }
                out
            }
            Some(other) => {
                return err(
                    &format!("{path}.type"),
                    format!("`type` must be a type name or a list of them, got {other}"),
                )
            }
        };
        for t in &types {
            if !TYPES.contains(t) {
                return err(&format!("{path}.type"), format!("unknown type {t:?} (known: {})", TYPES.join(", ")));
            }
        }
        // `enum` / `const`: the listed values (of the listed types, if any).
        for k in ["enum", "const"] {
            let Some(v) = m.get(k) else { continue };
            let p = format!("{path}.{k}");
            let vals: Vec<&Value> = if k == "const" {
                vec![v]
            } else {
                match v.as_array() {
                    Some(a) => a.iter().collect(),
                    None => return err(&p, format!("`enum` must be an array, got {v}")),
                }
            };
            let nullable = m.get("nullable") == Some(&Value::Bool(true));
            let mut texts: Vec<Vec<u8>> = vals
                .into_iter()
                .filter(|v| types.is_empty() || types.iter().any(|t| is_type(v, t)) || (nullable && v.is_null()))
                .map(text)
                .collect();
            texts.dedup();
            if texts.is_empty() {
                return err(&p, "no listed value is of the schema's type: nothing can match");
            }
            return Ok(self.push(Node::Literals(texts)));
        }
        let mut alts = vec![];
        for t in &types {
            let n = match *t {
                "object" => self.object(m, path)?,
                "array" => self.array(m, path)?,
                "string" => {
                    let (min, max) = self.bounds(m, path, "minLength", "maxLength")?;
                    let pattern = self.pattern(m, path)?;
                    self.push(Node::String { min, max, pattern })
                }
                "number" | "integer" => {
                    let integer = *t == "integer";
                    match self.range(m, path, integer)? {
                        None if !integer => ANY_NUMBER,
                        range => self.push(Node::Number { integer, range }),
                    }
                }
                "boolean" => BOOL,
                _ => NULL,
            };
            alts.push(n);
        }
        // Keywords of a type the schema does not list constrain nothing; refuse them rather than
        // guess what was meant.
        let of = |k: &str| match k {
            "properties" | "required" | "additionalProperties" => Some("object"),
            "items" | "minItems" | "maxItems" => Some("array"),
            "minLength" | "maxLength" | "pattern" => Some("string"),
            "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" => Some("number"),
            _ => None,
        };
        for k in &keys {
            if let Some(t) = of(k) {
                let listed = types.contains(&t) || (t == "number" && types.contains(&"integer"));
                if !types.is_empty() && !listed {
                    return err(
                        &format!("{path}.{k}"),
                        format!("`{k}` applies to {t}s, but `type` does not allow {t}"),
                    );
                }
            }
        }
        let n = match alts.len() {
            0 => ANY,
            1 => alts[0],
            _ => self.push(Node::AnyOf(alts)),
        };
        self.nullable(m, n, path)
    }

    /// OpenAPI's `nullable: true`: `null` too.
    fn nullable(&mut self, m: &serde_json::Map<String, Value>, n: NodeId, path: &str) -> Result<NodeId, SchemaError> {
        match m.get("nullable") {
            None | Some(Value::Bool(false)) => Ok(n),
            Some(Value::Bool(true)) => Ok(self.push(Node::AnyOf(vec![n, NULL]))),
            Some(other) => err(&format!("{path}.nullable"), format!("`nullable` must be a boolean, got {other}")),
        }
    }

    /// The bounds of a number (`None`: unbounded). Draft 4's boolean `exclusiveMinimum` /
    /// `exclusiveMaximum` are refused; a range no value (no integer, for `integer`) can meet
    /// is an error.
    fn range(
        &self,
        m: &serde_json::Map<String, Value>,
        path: &str,
        integer: bool,
    ) -> Result<Option<Range>, SchemaError> {
        let get = |k: &str| -> Result<Option<f64>, SchemaError> {
            match m.get(k) {
                None => Ok(None),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() => Ok(Some(x)),
                    _ => err(&format!("{path}.{k}"), format!("`{k}` must be a number, got {v}")),
                },
            }
        };
        let (min, max, xmin, xmax) =
            (get("minimum")?, get("maximum")?, get("exclusiveMinimum")?, get("exclusiveMaximum")?);
        if min.is_none() && max.is_none() && xmin.is_none() && xmax.is_none() {
            return Ok(None);
        }
        // The tighter of each pair.
        let (mut lo, mut lo_excl) = (f64::NEG_INFINITY, false);
        if let Some(x) = min {
            (lo, lo_excl) = (x, false);
        }
        if let Some(x) = xmin.filter(|&x| x >= lo) {
            (lo, lo_excl) = (x, true);
        }
        let (mut hi, mut hi_excl) = (f64::INFINITY, false);
        if let Some(x) = max {
            (hi, hi_excl) = (x, false);
        }
        if let Some(x) = xmax.filter(|&x| x <= hi) {
            (hi, hi_excl) = (x, true);
        }
        let r = Range { lo, lo_excl, hi, hi_excl };
        let empty = if integer {
            let first = if lo_excl { lo.floor() + 1.0 } else { lo.ceil() };
            !r.contains(first.max(-1e18))
        } else {
            lo > hi || (lo == hi && (lo_excl || hi_excl))
        };
        if empty {
            return err(path, format!("no {} lies in the bounds", if integer { "integer" } else { "number" }));
        }
        Ok(Some(r))
    }

    /// A string's `pattern`, or the regex of its `format` when that is one spark checks.
    fn pattern(&self, m: &serde_json::Map<String, Value>, path: &str) -> Result<Option<Arc<Pattern>>, SchemaError> {
        let format = m.get("format").and_then(Value::as_str).and_then(format_regex);
        let (regex, at) = match (m.get("pattern"), format) {
            (None, None) => return Ok(None),
            (Some(_), Some(_)) => {
                return err(&format!("{path}.pattern"), "`pattern` beside a checked `format` is not enforced")
            }
            (Some(Value::String(p)), None) => (p.as_str(), format!("{path}.pattern")),
            (Some(v), None) => return err(&format!("{path}.pattern"), format!("`pattern` must be a string, got {v}")),
            (None, Some(r)) => (r, format!("{path}.format")),
        };
        match self.patterns.borrow_mut().entry(regex.to_string()) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(Some(e.get().clone())),
            std::collections::hash_map::Entry::Vacant(e) => {
                let p = Arc::new(Pattern::new(regex).map_err(|msg| SchemaError { path: at, message: msg })?);
                Ok(Some(e.insert(p).clone()))
            }
        }
    }

    /// `min..max` from two optional non-negative integer keywords.
    fn bounds(
        &self,
        m: &serde_json::Map<String, Value>,
        path: &str,
        lo: &str,
        hi: &str,
    ) -> Result<(u32, Option<u32>), SchemaError> {
        let get = |k: &str| -> Result<Option<u32>, SchemaError> {
            match m.get(k) {
                None => Ok(None),
                Some(v) => match v.as_u64().and_then(|x| u32::try_from(x).ok()) {
                    Some(x) => Ok(Some(x)),
                    None => err(&format!("{path}.{k}"), format!("`{k}` must be a non-negative integer, got {v}")),
                },
            }
        };
        let (min, max) = (get(lo)?.unwrap_or(0), get(hi)?);
        if max.is_some_and(|x| x < min) {
            return err(&format!("{path}.{hi}"), format!("`{hi}` is below `{lo}`: nothing can match"));
        }
        Ok((min, max))
    }

    fn object(&mut self, m: &serde_json::Map<String, Value>, path: &str) -> Result<NodeId, SchemaError> {
        let mut props = vec![];
        if let Some(p) = m.get("properties") {
            let Some(p) = p.as_object() else {
                return err(&format!("{path}.properties"), format!("`properties` must be an object, got {p}"));
            };
            for (k, v) in p {
                let id = self.node(v, &format!("{path}.properties.{k}"))?;
                let quoted = text(&Value::String(k.clone()));
                props.push((quoted[1..quoted.len() - 1].to_vec(), id));
            }
        }
        let additional = match m.get("additionalProperties") {
            None | Some(Value::Bool(true)) => Some(ANY),
            Some(Value::Bool(false)) => None,
            Some(v) => Some(self.node(v, &format!("{path}.additionalProperties"))?),
        };
        let mut required = 0u64;
        if let Some(r) = m.get("required") {
            let p = format!("{path}.required");
            let Some(r) = r.as_array() else {
                return err(&p, format!("`required` must be an array of property names, got {r}"));
            };
            for name in r {
                let Some(name) = name.as_str() else {
                    return err(&p, format!("`required` must list property names (strings), got {name}"));
                };
                let quoted = text(&Value::String(name.to_string()));
                let key = &quoted[1..quoted.len() - 1];
                let i = match props.iter().position(|(k, _)| k == key) {
                    Some(i) => i,
                    None => match additional {
                        Some(a) => {
                            props.push((key.to_vec(), a));
                            props.len() - 1
                        }
                        None => {
                            return err(
                                &p,
                                format!(
                                    "{name:?} is required but not in `properties`, and `additionalProperties` is false"
                                ),
                            )
                        }
                    },
                };
                if i < MAX_PROPERTIES {
                    required |= 1 << i;
                }
            }
        }
        if props.len() > MAX_PROPERTIES {
            return err(
                &format!("{path}.properties"),
                format!("{} properties: at most {MAX_PROPERTIES} per object are enforced", props.len()),
            );
        }
        Ok(self.push(Node::Object { props, required, additional }))
    }

    fn array(&mut self, m: &serde_json::Map<String, Value>, path: &str) -> Result<NodeId, SchemaError> {
        let items = match m.get("items") {
            None => ANY,
            Some(v) => self.node(v, &format!("{path}.items"))?,
        };
        let (min, max) = self.bounds(m, path, "minItems", "maxItems")?;
        Ok(self.push(Node::Array { items, min, max }))
    }

    /// A `$ref` to the root or to a definition, compiled once (a recursive reference points
    /// at the node being compiled).
    fn reference(&mut self, r: &Value, path: &str) -> Result<NodeId, SchemaError> {
        let Some(r) = r.as_str() else {
            return err(path, format!("`$ref` must be a string, got {r}"));
        };
        if let Some(&id) = self.refs.get(r) {
            return Ok(id);
        }
        let Some(pointer) = r.strip_prefix('#') else {
            return err(path, format!("only local references (`#...`) are resolved, got {r:?}"));
        };
        let Some(target) = self.root.pointer(pointer) else {
            return err(path, format!("{r:?} points at nothing in the schema"));
        };
        // Reserve the node first: the target may refer back to it.
        let id = self.push(Node::AnyOf(vec![]));
        self.refs.insert(r.to_string(), id);
        let t = self.node(target, &format!("{path}({r})"))?;
        self.nodes[id] = Node::AnyOf(vec![t]);
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fails(s: Value) -> SchemaError {
        Schema::compile(&s).expect_err(&s.to_string())
    }

    #[test]
    fn refused_keywords_are_named_with_their_path() {
        for (bad, path) in [
            (json!({"type": "integer", "minimum": 1.2, "maximum": 1.8}), "$"),
            (json!({"type": "number", "exclusiveMinimum": 1, "maximum": 1}), "$"),
            (json!({"type": "number", "exclusiveMinimum": true, "minimum": 1}), "$.exclusiveMinimum"),
            (json!({"type": "string", "minimum": 1}), "$.minimum"),
        ] {
            assert_eq!(fails(bad.clone()).path, path, "{bad}");
        }
        let e = fails(json!({"type": "object", "properties": {"age": {"type": "integer", "multipleOf": 2}}}));
        assert_eq!(e.path, "$.properties.age.multipleOf");
        assert!(e.message.contains("not enforced"), "{e}");
        assert_eq!(fails(json!({"type": "string", "pattern": "(?=a)"})).path, "$.pattern");
        assert_eq!(fails(json!({"type": "string", "pattern": "a", "format": "date"})).path, "$.pattern");
        assert_eq!(fails(json!({"type": "string", "pattern": 3})).path, "$.pattern");
        assert_eq!(fails(json!({"type": "integer", "pattern": "a"})).path, "$.pattern");
        assert_eq!(fails(json!({"allOf": [{}, {}]})).path, "$.allOf");
        assert_eq!(fails(json!({"anyOf": [{}], "type": "string"})).path, "$.type");
        assert_eq!(fails(json!({"type": "strnig"})).path, "$.type");
        assert_eq!(fails(json!({"type": "string", "maxItems": 3})).path, "$.maxItems");
        assert_eq!(fails(json!({"$ref": "#/$defs/missing"})).path, "$.$ref");
        assert_eq!(fails(json!({"$ref": "http://x/y"})).path, "$.$ref");
        assert_eq!(fails(json!({"type": "string", "enum": [1, 2]})).path, "$.enum");
        assert_eq!(fails(json!({"type": "array", "minItems": 3, "maxItems": 2})).path, "$.maxItems");
        assert_eq!(fails(json!(false)).path, "$");
        let e = fails(json!({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": false}));
        assert_eq!(e.path, "$.required");
        let many: serde_json::Map<String, Value> = (0..65).map(|i| (format!("p{i}"), json!({}))).collect();
        assert_eq!(fails(json!({"type": "object", "properties": many})).path, "$.properties");
    }

    #[test]
    fn relaxed_compilation_keeps_the_bare_type() {
        let s = json!({
            "type": "object",
            "properties": {
                "age": {"type": "integer", "multipleOf": 2},
                "tag": {"uniqueItems": true},
                "ok": {"type": "boolean"},
                "ref": {"$ref": "#/nowhere"}
            },
            "required": ["age"]
        });
        assert!(Schema::compile(&s).is_err());
        let (c, relaxed) = Schema::compile_relaxed(&s);
        let paths: Vec<&str> = relaxed.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["$.properties.age.multipleOf", "$.properties.tag.uniqueItems", "$.properties.ref.$ref"]);
        let Node::Object { props, required, .. } = &c.nodes[c.root] else { panic!("{:?}", c.nodes[c.root]) };
        assert_eq!(*required, 1);
        let node = |k: &str| &c.nodes[props.iter().find(|p| p.0 == k.as_bytes()).unwrap().1];
        assert!(matches!(node("age"), Node::Number { integer: true, range: None }));
        assert!(matches!(node("tag"), Node::Any));
        assert!(matches!(node("ok"), Node::Literals(_)));
        assert!(matches!(node("ref"), Node::Any));
    }

    #[test]
    fn annotations_and_definitions_compile() {
        let s = json!({
            "title": "Step", "description": "d", "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$defs": {"Node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}},
            "type": "object",
            "properties": {
                "when": {"type": "string", "format": "date-time"},
                "head": {"$ref": "#/$defs/Node"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                "kind": {"enum": ["a", "b"], "default": "a"},
                "n": {"type": ["integer", "null"]},
                "self": {"$ref": "#"}
            },
            "required": ["when", "kind"],
            "additionalProperties": false
        });
        let c = Schema::compile(&s).unwrap();
        assert!(
            matches!(c.nodes[c.root], Node::Object { additional: None, required, .. } if required.count_ones() == 2)
        );
    }
}
