//! The access-log `filter.expression` of a Telemetry: CEL, evaluated by the `cel` crate
//! (cel-rust) over Envoy's request attributes, as Envoy's CEL access-log filter does.
//! Compiled when the config loads; refused there, with the reason, when it does not
//! parse, when it is too large or too deeply nested, when it names an attribute the
//! waypoint does not provide, or when a `matches` pattern is not a literal regular
//! expression within the size limit.
//!
//! Evaluation follows CEL: a missing attribute (a header the request has not,
//! `response.grpc_status` of a non-gRPC request) or a type mismatch is an error, `&&` /
//! `||` absorb an error when the other side decides, and a request is logged only when
//! the expression is `true` (Envoy's filter: an error is not a match).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use cel::common::ast::{operators, EntryExpr, Expr as Ast, LiteralValue};
use cel::objects::{Key, Map};
use cel::{Context, Env, IdedExpr, Value};
use http::HeaderName;
use regex::RegexBuilder;

/// Longest expression accepted, in bytes (Istio's examples are a few dozen).
pub const MAX_LEN: usize = 4096;
/// Nesting depth, at most: of brackets in the text and of the parsed tree (a config
/// must not be able to overflow the stack, when parsing, walking or evaluating).
pub const MAX_DEPTH: usize = 32;
/// A `matches` pattern's compiled size cap (the regex crate's automata: linear time).
const REGEX_SIZE_LIMIT: usize = 64 << 10;
/// Longest `matches` pattern.
const MAX_PATTERN: usize = 1024;

/// Why an expression is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ExprError {
    #[error("longer than {MAX_LEN} bytes ({0})")]
    TooLong(usize),
    #[error("nested deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("not CEL: {0}")]
    Parse(String),
    #[error("the attribute {0} is not supported (supported: {SUPPORTED})")]
    Attribute(String),
    #[error("{0} is not one of Envoy's attributes (request, response, source, destination, connection, upstream)")]
    Unknown(String),
    #[error("matches: the pattern must be a string literal")]
    PatternNotLiteral,
    #[error("matches: {0}")]
    Pattern(String),
    #[error("request.headers: the header name {0:?} is not valid")]
    HeaderName(String),
}

/// The attributes an expression may name, Envoy's names, and the roots they hang from.
const ATTRIBUTES: [&str; 25] = [
    "request.path",
    "request.url_path",
    "request.host",
    "request.scheme",
    "request.method",
    "request.headers",
    "request.referer",
    "request.useragent",
    "request.id",
    "request.query",
    "request.protocol",
    "request.size",
    "request.total_size",
    "response.code",
    "response.grpc_status",
    "response.size",
    "response.flags",
    "source.address",
    "source.port",
    "destination.address",
    "destination.port",
    "upstream.address",
    "upstream.port",
    "connection.mtls",
    "connection.uri_san_peer_certificate",
];
const ROOTS: [&str; 6] = [
    "request",
    "response",
    "source",
    "destination",
    "connection",
    "upstream",
];
/// Envoy's other attribute roots: named, they are refused as unsupported.
const ENVOY_ROOTS: [&str; 4] = ["xds", "metadata", "filter_state", "upstream_filter_state"];
/// CEL's type names, which are identifiers too.
const TYPES: [&str; 11] = [
    "int",
    "uint",
    "double",
    "bool",
    "string",
    "bytes",
    "list",
    "map",
    "type",
    "null_type",
    "dyn",
];
const SUPPORTED: &str = "request.{path, url_path, host, scheme, method, headers, referer, useragent, id, query, protocol, size, total_size}, \
    response.{code, grpc_status, size, flags}, source.{address, port}, destination.{address, port}, upstream.{address, port}, \
    connection.{mtls, uri_san_peer_certificate}";

/// A compiled filter expression.
#[derive(Clone, Debug)]
pub struct Expr {
    ast: Arc<IdedExpr>,
    source: String,
    /// The attribute roots it names (only those are built per request).
    roots: Vec<&'static str>,
    /// The request headers it reads by name (kept from the request for the log line).
    headers: Vec<HeaderName>,
    /// It uses `request.headers` other than by a literal name: every header is kept.
    all_headers: bool,
}

/// Two expressions are the same when their text is.
impl PartialEq for Expr {
    fn eq(&self, other: &Expr) -> bool {
        self.source == other.source
    }
}

/// What a finished request offers an expression.
pub struct Attributes<'a> {
    pub code: u16,
    pub grpc_status: Option<&'a str>,
    pub method: &'a str,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub host: &'a str,
    pub protocol: &'a str,
    /// The request headers the expression reads, as they came (names lower case).
    pub headers: &'a [(HeaderName, String)],
    pub source: SocketAddr,
    pub destination: SocketAddr,
    pub upstream: Option<SocketAddr>,
    pub peer_san: &'a str,
    /// Request body bytes, and headers plus body bytes; response body bytes.
    pub request_size: u64,
    pub request_total_size: u64,
    pub response_size: u64,
    /// Envoy's response flags, as the log writes them (`-`, `UF`, `UF,URX`).
    pub response_flags: &'a str,
}

/// Envoy's response flags as `response.flags` gives them: its legacy bit vector, one bit
/// per flag in Envoy's order (`LH` 0x1, `UH` 0x2, ... `DR` 0x10000000).
const FLAG_BITS: [&str; 29] = [
    "LH", "UH", "UT", "LR", "UR", "UF", "UC", "UO", "NR", "DI", "FI", "RL", "UAEX", "RLSE", "DC",
    "URX", "SI", "IH", "DPE", "UMSDR", "RFCF", "NFCF", "DT", "UPE", "NC", "OM", "DF", "DO", "DR",
];

/// The bit vector of flags written as `UF,URX` (`-`: none; unknown ones add nothing).
pub fn flag_bits(flags: &str) -> u64 {
    flags
        .split(',')
        .filter_map(|f| FLAG_BITS.iter().position(|b| *b == f.trim()))
        .fold(0, |acc, i| acc | (1u64 << i))
}

/// CEL's standard environment, built once.
fn env() -> Arc<Env> {
    static ENV: std::sync::OnceLock<Arc<Env>> = std::sync::OnceLock::new();
    ENV.get_or_init(|| Arc::new(Env::stdlib())).clone()
}

/// The deepest bracket nesting of `text` outside string literals (a cheap bound checked
/// before the parser runs).
fn bracket_depth(text: &str) -> usize {
    let (mut depth, mut max, mut quote): (usize, usize, Option<u8>) = (0, 0, None);
    let mut escaped = false;
    for &c in text.as_bytes() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            b'\'' | b'"' => quote = Some(c),
            b'(' | b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// The stack a compilation runs on: the parser (ANTLR's) recurses once per level of
/// an unbalanced chain (`a.b.c...`, `1 + 1 + ...`, `!!!...`), which only the walk after it
/// bounds, so a text of `MAX_LEN` bytes must not overflow it. Configs load rarely.
const COMPILE_STACK: usize = 64 << 20;

impl Expr {
    pub fn compile(text: &str) -> Result<Expr, ExprError> {
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("cel-compile".into())
                .stack_size(COMPILE_STACK)
                .spawn_scoped(s, || Expr::compile_here(text))
                .map_err(|e| ExprError::Parse(format!("no thread to compile it on: {e}")))?
                .join()
                .unwrap_or_else(|_| Err(ExprError::Parse("the parser failed".into())))
        })
    }

    fn compile_here(text: &str) -> Result<Expr, ExprError> {
        if text.len() > MAX_LEN {
            return Err(ExprError::TooLong(text.len()));
        }
        if bracket_depth(text) > MAX_DEPTH {
            return Err(ExprError::TooDeep);
        }
        let ast = cel::parser::Parser::new()
            .max_recursion_depth(MAX_DEPTH as u16)
            .parse(text)
            .map_err(|e| ExprError::Parse(e.to_string().trim().to_string()))?;
        let mut walk = Walk::default();
        walk.expr(&ast, 0)?;
        let mut roots = walk.roots;
        roots.sort_unstable();
        roots.dedup();
        Ok(Expr {
            ast: Arc::new(ast),
            source: text.to_string(),
            roots,
            headers: walk.headers,
            all_headers: walk.all_headers,
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The request headers the expression reads by name.
    pub fn headers(&self) -> &[HeaderName] {
        &self.headers
    }

    /// Whether it reads request headers other than by a literal name (all are kept).
    pub fn all_headers(&self) -> bool {
        self.all_headers
    }

    /// The expression's value as text (a string, number or boolean), for Envoy's
    /// `%CEL(...)%` format operator; an error or another type is no value.
    pub fn text(&self, a: &Attributes<'_>) -> Option<String> {
        let mut ctx = Context::with_env(env());
        for root in &self.roots {
            ctx.add_variable_from_value(*root, root_value(root, a));
        }
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            match Value::resolve(&self.ast, &ctx) {
                Ok(Value::String(s)) => Some(s.to_string()),
                Ok(Value::Int(i)) => Some(i.to_string()),
                Ok(Value::UInt(u)) => Some(u.to_string()),
                Ok(Value::Float(f)) => Some(f.to_string()),
                Ok(Value::Bool(b)) => Some(b.to_string()),
                _ => None,
            }
        }))
        .unwrap_or(None)
    }

    /// The same as `matches`, without its panic guard (the fuzz target's).
    pub fn eval_bare(&self, a: &Attributes<'_>) -> bool {
        let mut ctx = Context::with_env(env());
        for root in &self.roots {
            ctx.add_variable_from_value(*root, root_value(root, a));
        }
        matches!(Value::resolve(&self.ast, &ctx), Ok(Value::Bool(true)))
    }

    /// Whether the request is logged: the expression is `true`.
    pub fn matches(&self, a: &Attributes<'_>) -> bool {
        let mut ctx = Context::with_env(env());
        for root in &self.roots {
            ctx.add_variable_from_value(*root, root_value(root, a));
        }
        // The interpreter is a dependency: should it panic on some input, that request
        // is not logged and the waypoint goes on.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            matches!(Value::resolve(&self.ast, &ctx), Ok(Value::Bool(true)))
        }))
        .unwrap_or(false)
    }
}

fn map(entries: Vec<(&'static str, Value)>) -> Value {
    let m: HashMap<Key, Value> = entries
        .into_iter()
        .map(|(k, v)| (Key::String(Arc::new(k.to_string())), v))
        .collect();
    Value::Map(Map { map: Arc::new(m) })
}

fn string(s: impl Into<String>) -> Value {
    Value::String(Arc::new(s.into()))
}

fn int(n: impl Into<i64>) -> Value {
    Value::Int(n.into())
}

fn size(n: u64) -> Value {
    Value::Int(i64::try_from(n).unwrap_or(i64::MAX))
}

/// One attribute root (`request`, `response`...) as a CEL map, Envoy's names and types.
/// An attribute Envoy would not have (a header the request has not, the gRPC status of
/// a plain HTTP response, the upstream of a request that had none) is left out: reading
/// it is an error, as in Envoy.
fn root_value(root: &str, a: &Attributes<'_>) -> Value {
    let header = |name: &str| {
        a.headers
            .iter()
            .find(|(n, _)| n.as_str() == name)
            .map(|(_, v)| string(v.as_str()))
    };
    match root {
        "request" => {
            let mut headers: HashMap<Key, Value> = HashMap::new();
            for (n, v) in a.headers {
                // Envoy joins a repeated header's values with ','.
                let k = Key::String(Arc::new(n.as_str().to_string()));
                let joined = match headers.get(&k) {
                    Some(Value::String(prev)) => format!("{prev},{v}"),
                    _ => v.clone(),
                };
                headers.insert(k, string(joined));
            }
            let mut e = vec![
                (
                    "path",
                    string(match a.query {
                        Some(q) => format!("{}?{q}", a.path),
                        None => a.path.to_string(),
                    }),
                ),
                ("url_path", string(a.path)),
                ("host", string(a.host)),
                ("scheme", string("http")),
                ("method", string(a.method)),
                (
                    "headers",
                    Value::Map(Map {
                        map: Arc::new(headers),
                    }),
                ),
                ("query", string(a.query.unwrap_or_default())),
                ("protocol", string(a.protocol)),
                ("size", size(a.request_size)),
                ("total_size", size(a.request_total_size)),
            ];
            for (k, h) in [
                ("referer", "referer"),
                ("useragent", "user-agent"),
                ("id", "x-request-id"),
            ] {
                if let Some(v) = header(h) {
                    e.push((k, v));
                }
            }
            map(e)
        }
        "response" => {
            let mut e = vec![
                ("code", int(a.code)),
                ("size", size(a.response_size)),
                ("flags", Value::UInt(flag_bits(a.response_flags))),
            ];
            if let Some(g) = a.grpc_status.and_then(|s| s.parse::<i64>().ok()) {
                e.push(("grpc_status", int(g)));
            }
            map(e)
        }
        "source" => map(vec![
            ("address", string(a.source.to_string())),
            ("port", int(a.source.port())),
        ]),
        "destination" => map(vec![
            ("address", string(a.destination.to_string())),
            ("port", int(a.destination.port())),
        ]),
        "upstream" => map(a
            .upstream
            .map(|u| vec![("address", string(u.to_string())), ("port", int(u.port()))])
            .unwrap_or_default()),
        // HBONE: every connection to the waypoint is mutual TLS.
        "connection" => map(vec![
            ("mtls", Value::Bool(true)),
            ("uri_san_peer_certificate", string(a.peer_san)),
        ]),
        _ => Value::Null,
    }
}

/// The checks on a parsed expression: depth, attributes named, literal patterns.
#[derive(Default)]
struct Walk {
    roots: Vec<&'static str>,
    headers: Vec<HeaderName>,
    all_headers: bool,
    /// Comprehension variables in scope.
    bound: Vec<String>,
}

/// `a.b` spelled by Select nodes on an identifier: its segments, root first.
fn dotted(e: &IdedExpr) -> Option<Vec<&str>> {
    let mut out = Vec::new();
    let mut e = e;
    for _ in 0..=MAX_DEPTH {
        match &e.expr {
            Ast::Ident(name) => {
                out.push(name.as_str());
                out.reverse();
                return Some(out);
            }
            Ast::Select(s) if !s.test => {
                out.push(s.field.as_str());
                e = &s.operand;
            }
            _ => return None,
        }
    }
    None
}

fn is_request_headers(e: &IdedExpr) -> bool {
    dotted(e).is_some_and(|d| d == ["request", "headers"])
}

impl Walk {
    fn name(&mut self, segments: &[&str]) -> Result<(), ExprError> {
        let Some(root) = segments.first() else {
            return Ok(());
        };
        if self.bound.iter().any(|b| b.as_str() == *root)
            || segments.len() == 1 && TYPES.contains(root)
        {
            return Ok(());
        }
        let Some(r) = ROOTS.iter().find(|r| *r == root) else {
            return Err(if ENVOY_ROOTS.contains(root) {
                ExprError::Attribute(segments.join("."))
            } else {
                ExprError::Unknown(segments.join("."))
            });
        };
        self.roots.push(*r);
        if let Some(field) = segments.get(1) {
            let path = format!("{root}.{field}");
            if !ATTRIBUTES.contains(&path.as_str()) {
                return Err(ExprError::Attribute(path));
            }
            if path == "request.headers" {
                match segments.get(2) {
                    // `request.headers.name` (a field selection, as `has()` writes it).
                    Some(h) => self.header(h)?,
                    None => self.all_headers = true,
                }
            }
        } else {
            // The whole root (`request`): anything in it.
            self.all_headers |= *root == "request";
        }
        Ok(())
    }

    fn header(&mut self, name: &str) -> Result<(), ExprError> {
        // Envoy's header map is lower case: a name with upper case letters never matches.
        match HeaderName::from_bytes(name.as_bytes()) {
            Ok(h) if h.as_str() == name => {
                if !self.headers.contains(&h) {
                    self.headers.push(h);
                }
                Ok(())
            }
            Ok(_) => Ok(()),
            Err(_) => Err(ExprError::HeaderName(name.to_string())),
        }
    }

    fn expr(&mut self, e: &IdedExpr, depth: usize) -> Result<(), ExprError> {
        if depth > MAX_DEPTH {
            return Err(ExprError::TooDeep);
        }
        let d = depth + 1;
        match &e.expr {
            Ast::Ident(_) | Ast::Select(_) if dotted(e).is_some() => {
                let segments = dotted(e).unwrap_or_default();
                self.name(&segments)
            }
            Ast::Select(s) => {
                // A presence test `has(request.headers.x)`, or a field of a value.
                if s.test && is_request_headers(&s.operand) {
                    self.name(&["request", "headers", s.field.as_str()])
                } else {
                    self.expr(&s.operand, d)
                }
            }
            Ast::Ident(_) | Ast::Literal(_) | Ast::Unspecified => Ok(()),
            Ast::Call(c) => {
                // `request.headers['name']`: the one header.
                if c.func_name == operators::INDEX && c.target.is_none() && c.args.len() == 2 {
                    if let (true, Ast::Literal(LiteralValue::String(name))) =
                        (is_request_headers(&c.args[0]), &c.args[1].expr)
                    {
                        self.roots.push("request");
                        return self.header(name.inner());
                    }
                }
                if c.func_name == "matches" {
                    let pattern = if c.target.is_some() {
                        c.args.first()
                    } else {
                        c.args.get(1)
                    };
                    match pattern.map(|p| &p.expr) {
                        Some(Ast::Literal(LiteralValue::String(p))) => check_pattern(p.inner())?,
                        _ => return Err(ExprError::PatternNotLiteral),
                    }
                }
                if let Some(t) = &c.target {
                    self.expr(t, d)?;
                }
                c.args.iter().try_for_each(|a| self.expr(a, d))
            }
            Ast::List(l) => l.elements.iter().try_for_each(|x| self.expr(x, d)),
            Ast::Map(m) => m.entries.iter().try_for_each(|x| match &x.expr {
                EntryExpr::MapEntry(me) => {
                    self.expr(&me.key, d)?;
                    self.expr(&me.value, d)
                }
                EntryExpr::StructField(f) => self.expr(&f.value, d),
            }),
            Ast::Struct(s) => s.entries.iter().try_for_each(|x| match &x.expr {
                EntryExpr::MapEntry(me) => {
                    self.expr(&me.key, d)?;
                    self.expr(&me.value, d)
                }
                EntryExpr::StructField(f) => self.expr(&f.value, d),
            }),
            Ast::Comprehension(c) => {
                self.expr(&c.iter_range, d)?;
                self.expr(&c.accu_init, d)?;
                let n = self.bound.len();
                self.bound.push(c.iter_var.clone());
                self.bound.extend(c.iter_var2.iter().cloned());
                self.bound.push(c.accu_var.clone());
                let r = [&c.loop_cond, &c.loop_step, &c.result]
                    .into_iter()
                    .try_for_each(|x| self.expr(x, d));
                self.bound.truncate(n);
                r
            }
        }
    }
}

/// A `matches` pattern: a regular expression (RE2 syntax, which the regex crate
/// follows) within the size limits; the regex crate runs in linear time.
fn check_pattern(p: &str) -> Result<(), ExprError> {
    if p.len() > MAX_PATTERN {
        return Err(ExprError::Pattern(format!(
            "longer than {MAX_PATTERN} bytes"
        )));
    }
    RegexBuilder::new(p)
        .size_limit(REGEX_SIZE_LIMIT)
        .nest_limit(MAX_DEPTH as u32)
        .build()
        .map(|_| ())
        .map_err(|e| ExprError::Pattern(e.to_string().lines().last().unwrap_or("").to_string()))
}

#[cfg(test)]
mod tests;
