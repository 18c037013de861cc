//! The access-log `filter.expression` of a Telemetry: the part of CEL that Istio's
//! documentation shows for access-log filters (Envoy's CEL over its request attributes),
//! compiled when the config loads; anything else is refused there, naming what is not
//! supported.
//!
//! Supported: integer, string ('' or "") and boolean literals and lists of them; the
//! attributes below; `==`, `!=`, `<`, `<=`, `>`, `>=`, `in`, `&&`, `||`, `!` and
//! parentheses; the string methods `startsWith`, `endsWith`, `contains`, `matches`
//! (a full-text regular expression search, as CEL's RE2 `matches`). Evaluation follows
//! CEL: a missing attribute (a header the request has not, `response.grpc_status` of a
//! non-gRPC request) or a type mismatch is an error, `&&` / `||` absorb an error when the
//! other side decides, and a request is logged only when the expression is `true`.

use std::net::SocketAddr;

use http::HeaderName;
use regex::Regex;

/// Compiled regex size cap, as for routes.
const REGEX_SIZE_LIMIT: usize = 1 << 20;
/// Nesting depth, at most (a config must not be able to overflow the stack).
const MAX_DEPTH: usize = 32;

/// The request attributes an expression may name (Envoy's names).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Attr {
    ResponseCode,
    ResponseGrpcStatus,
    RequestMethod,
    /// Path and query.
    RequestPath,
    RequestUrlPath,
    RequestHost,
    RequestProtocol,
    RequestScheme,
    RequestHeader(HeaderName),
    SourceAddress,
    SourcePort,
    DestinationAddress,
    DestinationPort,
    UpstreamAddress,
    ConnectionMtls,
    ConnectionPeerSan,
}

impl Attr {
    fn named(path: &str) -> Option<Attr> {
        Some(match path {
            "response.code" => Attr::ResponseCode,
            "response.grpc_status" => Attr::ResponseGrpcStatus,
            "request.method" => Attr::RequestMethod,
            "request.path" => Attr::RequestPath,
            "request.url_path" => Attr::RequestUrlPath,
            "request.host" => Attr::RequestHost,
            "request.protocol" => Attr::RequestProtocol,
            "request.scheme" => Attr::RequestScheme,
            "source.address" => Attr::SourceAddress,
            "source.port" => Attr::SourcePort,
            "destination.address" => Attr::DestinationAddress,
            "destination.port" => Attr::DestinationPort,
            "upstream.address" => Attr::UpstreamAddress,
            "connection.mtls" => Attr::ConnectionMtls,
            "connection.uri_san_peer_certificate" => Attr::ConnectionPeerSan,
            _ => return None,
        })
    }
}

const SUPPORTED: &str = "response.code, response.grpc_status, request.method, request.path, request.url_path, request.host, \
    request.protocol, request.scheme, request.headers['name'], source.address, source.port, destination.address, \
    destination.port, upstream.address, connection.mtls, connection.uri_san_peer_certificate";

#[derive(Clone, Debug, PartialEq)]
enum Value {
    Int(i64),
    Str(String),
    Bool(bool),
    List(Vec<Value>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    In,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    StartsWith,
    EndsWith,
    Contains,
}

#[derive(Clone, Debug)]
enum Node {
    Lit(Value),
    List(Vec<Node>),
    Attr(Attr),
    Not(Box<Node>),
    And(Box<Node>, Box<Node>),
    Or(Box<Node>, Box<Node>),
    Cmp(Cmp, Box<Node>, Box<Node>),
    Call(Method, Box<Node>, Box<Node>),
    Matches(Box<Node>, Regex),
}

/// A compiled filter expression.
#[derive(Clone, Debug)]
pub struct Expr {
    root: Node,
    source: String,
    /// The request headers it reads (kept from the request for the log line).
    headers: Vec<HeaderName>,
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
    /// The request headers the expression reads, as they came.
    pub headers: &'a [(HeaderName, String)],
    pub source: SocketAddr,
    pub destination: SocketAddr,
    pub upstream: Option<SocketAddr>,
    pub peer_san: &'a str,
}

/// An evaluation error (CEL's): the request is not logged unless `||` absorbs it.
struct NoValue;

impl Expr {
    pub fn compile(text: &str) -> Result<Expr, String> {
        let tokens = lex(text)?;
        let mut p = Parser {
            tokens,
            pos: 0,
            depth: 0,
            headers: Vec::new(),
        };
        let root = p.or()?;
        if p.pos != p.tokens.len() {
            return Err(format!(
                "{text:?}: unexpected {:?} after the expression",
                p.tokens[p.pos]
            ));
        }
        Ok(Expr {
            root,
            source: text.to_string(),
            headers: p.headers,
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The request headers the expression reads.
    pub fn headers(&self) -> &[HeaderName] {
        &self.headers
    }

    /// Whether the request is logged: the expression is `true`.
    pub fn matches(&self, a: &Attributes<'_>) -> bool {
        matches!(eval(&self.root, a), Ok(Value::Bool(true)))
    }
}

fn eval(n: &Node, a: &Attributes<'_>) -> Result<Value, NoValue> {
    Ok(match n {
        Node::Lit(v) => v.clone(),
        Node::List(items) => {
            Value::List(items.iter().map(|i| eval(i, a)).collect::<Result<_, _>>()?)
        }
        Node::Attr(attr) => attribute(attr, a)?,
        Node::Not(x) => match eval(x, a)? {
            Value::Bool(b) => Value::Bool(!b),
            _ => return Err(NoValue),
        },
        // CEL's commutative logic: a side that decides wins over an error on the other.
        Node::And(x, y) => match (eval(x, a), eval(y, a)) {
            (Ok(Value::Bool(false)), _) | (_, Ok(Value::Bool(false))) => Value::Bool(false),
            (Ok(Value::Bool(true)), Ok(Value::Bool(true))) => Value::Bool(true),
            _ => return Err(NoValue),
        },
        Node::Or(x, y) => match (eval(x, a), eval(y, a)) {
            (Ok(Value::Bool(true)), _) | (_, Ok(Value::Bool(true))) => Value::Bool(true),
            (Ok(Value::Bool(false)), Ok(Value::Bool(false))) => Value::Bool(false),
            _ => return Err(NoValue),
        },
        Node::Cmp(op, x, y) => Value::Bool(compare(*op, &eval(x, a)?, &eval(y, a)?)?),
        Node::Call(m, x, y) => match (eval(x, a)?, eval(y, a)?) {
            (Value::Str(s), Value::Str(t)) => Value::Bool(match m {
                Method::StartsWith => s.starts_with(&t),
                Method::EndsWith => s.ends_with(&t),
                Method::Contains => s.contains(&t),
            }),
            _ => return Err(NoValue),
        },
        Node::Matches(x, re) => match eval(x, a)? {
            Value::Str(s) => Value::Bool(re.is_match(&s)),
            _ => return Err(NoValue),
        },
    })
}

fn compare(op: Cmp, x: &Value, y: &Value) -> Result<bool, NoValue> {
    use std::cmp::Ordering;
    if op == Cmp::In {
        return match y {
            Value::List(items) => Ok(items.iter().any(|i| i == x)),
            _ => Err(NoValue),
        };
    }
    let ord = match (x, y) {
        (Value::Int(a), Value::Int(b)) => a.cmp(b),
        (Value::Str(a), Value::Str(b)) => a.cmp(b),
        (Value::Bool(a), Value::Bool(b)) if matches!(op, Cmp::Eq | Cmp::Ne) => a.cmp(b),
        // CEL has no overload across types.
        _ => return Err(NoValue),
    };
    Ok(match op {
        Cmp::Eq => ord == Ordering::Equal,
        Cmp::Ne => ord != Ordering::Equal,
        Cmp::Lt => ord == Ordering::Less,
        Cmp::Le => ord != Ordering::Greater,
        Cmp::Gt => ord == Ordering::Greater,
        Cmp::Ge => ord != Ordering::Less,
        Cmp::In => false,
    })
}

fn attribute(attr: &Attr, a: &Attributes<'_>) -> Result<Value, NoValue> {
    Ok(match attr {
        Attr::ResponseCode => Value::Int(i64::from(a.code)),
        Attr::ResponseGrpcStatus => {
            Value::Int(a.grpc_status.and_then(|s| s.parse().ok()).ok_or(NoValue)?)
        }
        Attr::RequestMethod => Value::Str(a.method.to_string()),
        Attr::RequestPath => Value::Str(match a.query {
            Some(q) => format!("{}?{q}", a.path),
            None => a.path.to_string(),
        }),
        Attr::RequestUrlPath => Value::Str(a.path.to_string()),
        Attr::RequestHost => Value::Str(a.host.to_string()),
        Attr::RequestProtocol => Value::Str(a.protocol.to_string()),
        Attr::RequestScheme => Value::Str("http".into()),
        Attr::RequestHeader(name) => Value::Str(
            a.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .ok_or(NoValue)?,
        ),
        Attr::SourceAddress => Value::Str(a.source.to_string()),
        Attr::SourcePort => Value::Int(i64::from(a.source.port())),
        Attr::DestinationAddress => Value::Str(a.destination.to_string()),
        Attr::DestinationPort => Value::Int(i64::from(a.destination.port())),
        Attr::UpstreamAddress => Value::Str(a.upstream.ok_or(NoValue)?.to_string()),
        Attr::ConnectionMtls => Value::Bool(true),
        Attr::ConnectionPeerSan => Value::Str(a.peer_san.to_string()),
    })
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Ident(String),
    Int(i64),
    Str(String),
    Op(&'static str),
}

fn lex(text: &str) -> Result<Vec<Token>, String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            let n = text[start..i]
                .parse()
                .map_err(|_| format!("{text:?}: the number {:?} is too large", &text[start..i]))?;
            out.push(Token::Int(n));
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Token::Ident(text[start..i].to_string()));
        } else if c == b'\'' || c == b'"' {
            let end = text[i + 1..]
                .find(c as char)
                .ok_or_else(|| format!("{text:?}: a string is not closed"))?
                + i
                + 1;
            let s = &text[i + 1..end];
            if s.contains('\\') {
                return Err(format!("{text:?}: escapes in strings are not supported"));
            }
            out.push(Token::Str(s.to_string()));
            i = end + 1;
        } else {
            let two = text.get(i..i + 2).unwrap_or("");
            let op = ["==", "!=", "<=", ">=", "&&", "||"]
                .into_iter()
                .find(|o| *o == two);
            match op {
                Some(o) => {
                    out.push(Token::Op(o));
                    i += 2;
                }
                None => {
                    let one = ["<", ">", "!", "(", ")", "[", "]", ".", ","]
                        .into_iter()
                        .find(|o| o.as_bytes()[0] == c);
                    out.push(Token::Op(one.ok_or_else(|| {
                        format!("{text:?}: {:?} is not supported", c as char)
                    })?));
                    i += 1;
                }
            }
        }
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
    depth: usize,
    headers: Vec<HeaderName>,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.pos)
    }

    fn eat(&mut self, op: &str) -> bool {
        if matches!(self.peek(), Some(Token::Op(o)) if *o == op) {
            self.pos += 1;
            return true;
        }
        false
    }

    fn expect(&mut self, op: &str) -> Result<(), String> {
        if self.eat(op) {
            return Ok(());
        }
        Err(format!(
            "expected {op:?}, found {}",
            self.peek()
                .map_or("the end".to_string(), |t| format!("{t:?}"))
        ))
    }

    fn nested<T>(&mut self, f: impl FnOnce(&mut Parser) -> Result<T, String>) -> Result<T, String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(format!("nested deeper than {MAX_DEPTH}"));
        }
        let r = f(self);
        self.depth -= 1;
        r
    }

    fn or(&mut self) -> Result<Node, String> {
        self.nested(|p| {
            let mut n = p.and()?;
            while p.eat("||") {
                n = Node::Or(Box::new(n), Box::new(p.and()?));
            }
            Ok(n)
        })
    }

    fn and(&mut self) -> Result<Node, String> {
        let mut n = self.unary()?;
        while self.eat("&&") {
            n = Node::And(Box::new(n), Box::new(self.unary()?));
        }
        Ok(n)
    }

    fn unary(&mut self) -> Result<Node, String> {
        if self.eat("!") {
            return self.nested(|p| Ok(Node::Not(Box::new(p.unary()?))));
        }
        self.comparison()
    }

    fn comparison(&mut self) -> Result<Node, String> {
        let left = self.postfix()?;
        let op = match self.peek() {
            Some(Token::Op("==")) => Cmp::Eq,
            Some(Token::Op("!=")) => Cmp::Ne,
            Some(Token::Op("<")) => Cmp::Lt,
            Some(Token::Op("<=")) => Cmp::Le,
            Some(Token::Op(">")) => Cmp::Gt,
            Some(Token::Op(">=")) => Cmp::Ge,
            Some(Token::Ident(i)) if i == "in" => Cmp::In,
            _ => return Ok(left),
        };
        self.pos += 1;
        let right = self.postfix()?;
        Ok(Node::Cmp(op, Box::new(left), Box::new(right)))
    }

    fn postfix(&mut self) -> Result<Node, String> {
        let mut n = self.primary()?;
        while self.eat(".") {
            let Some(Token::Ident(m)) = self.peek().cloned() else {
                return Err("expected a method name after '.'".into());
            };
            self.pos += 1;
            let method = match m.as_str() {
                "startsWith" => Some(Method::StartsWith),
                "endsWith" => Some(Method::EndsWith),
                "contains" => Some(Method::Contains),
                "matches" => None,
                other => return Err(format!("the method {other}() is not supported (startsWith, endsWith, contains, matches)")),
            };
            self.expect("(")?;
            let arg = self.or()?;
            self.expect(")")?;
            n = match method {
                Some(method) => Node::Call(method, Box::new(n), Box::new(arg)),
                None => {
                    let Node::Lit(Value::Str(pattern)) = arg else {
                        return Err("matches: the pattern must be a string literal".into());
                    };
                    let re = regex::RegexBuilder::new(&pattern)
                        .size_limit(REGEX_SIZE_LIMIT)
                        .build()
                        .map_err(|e| format!("matches: {e}"))?;
                    Node::Matches(Box::new(n), re)
                }
            };
        }
        Ok(n)
    }

    fn primary(&mut self) -> Result<Node, String> {
        let Some(t) = self.peek().cloned() else {
            return Err("the expression ends too early".into());
        };
        self.pos += 1;
        match t {
            Token::Int(n) => Ok(Node::Lit(Value::Int(n))),
            Token::Str(s) => Ok(Node::Lit(Value::Str(s))),
            Token::Op("(") => {
                let n = self.or()?;
                self.expect(")")?;
                Ok(n)
            }
            Token::Op("[") => self.nested(|p| {
                let mut items = Vec::new();
                if !p.eat("]") {
                    loop {
                        items.push(p.or()?);
                        if p.eat("]") {
                            break;
                        }
                        p.expect(",")?;
                    }
                }
                Ok(Node::List(items))
            }),
            Token::Ident(i) if i == "true" || i == "false" => {
                Ok(Node::Lit(Value::Bool(i == "true")))
            }
            Token::Ident(first) => self.attribute(first),
            other => Err(format!("unexpected {other:?}")),
        }
    }

    /// `a.b` (attributes are two names), or `request.headers['name']`.
    fn attribute(&mut self, first: String) -> Result<Node, String> {
        let mut path = first;
        if self.eat(".") {
            let Some(Token::Ident(second)) = self.peek().cloned() else {
                return Err(format!("expected a name after {path}."));
            };
            self.pos += 1;
            path = format!("{path}.{second}");
        }
        if path == "request.headers" {
            self.expect("[")?;
            let Some(Token::Str(name)) = self.peek().cloned() else {
                return Err("request.headers[...] takes a string".into());
            };
            self.pos += 1;
            self.expect("]")?;
            let h = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("{name:?} is not a header name"))?;
            if !self.headers.contains(&h) {
                self.headers.push(h.clone());
            }
            return Ok(Node::Attr(Attr::RequestHeader(h)));
        }
        Attr::named(&path).map(Node::Attr).ok_or_else(|| {
            format!("the attribute {path} is not supported; the waypoint knows {SUPPORTED}")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs<'a>(code: u16, headers: &'a [(HeaderName, String)]) -> Attributes<'a> {
        Attributes {
            code,
            grpc_status: None,
            method: "GET",
            path: "/api/items",
            query: Some("x=1"),
            host: "echo.default.svc.cluster.local",
            protocol: "HTTP/1.1",
            headers,
            source: "10.0.0.1:40000".parse().unwrap(),
            destination: "10.96.0.10:80".parse().unwrap(),
            upstream: None,
            peer_san: "spiffe://cluster.local/ns/default/sa/sleep",
        }
    }

    fn check(text: &str, code: u16) -> bool {
        let h = [(HeaderName::from_static("x-debug"), "on".to_string())];
        Expr::compile(text)
            .unwrap_or_else(|e| panic!("{text}: {e}"))
            .matches(&attrs(code, &h))
    }

    #[test]
    fn istios_examples_evaluate() {
        assert!(check("response.code >= 400", 503) && !check("response.code >= 400", 200));
        assert!(check(
            "response.code == 200 && request.method == 'GET'",
            200
        ));
        assert!(check(
            "request.url_path.startsWith('/api') || response.code >= 500",
            200
        ));
        assert!(check(
            "request.path == '/api/items?x=1' && request.url_path.endsWith('items')",
            200
        ));
        assert!(check("request.headers['x-debug'] == \"on\"", 200));
        assert!(
            check("!(response.code in [200, 204])", 404)
                && !check("response.code in [200, 204]", 503)
        );
        assert!(check(
            "request.host.contains('default') && connection.mtls",
            200
        ));
        assert!(check(
            "connection.uri_san_peer_certificate.matches('^spiffe://cluster.local/ns/default/')",
            200
        ));
        assert!(check("source.port > 1024 && destination.port == 80", 200));
    }

    #[test]
    fn errors_follow_cel() {
        // A missing header is an error: not logged, unless `||` has a true side.
        assert!(!check("request.headers['x-missing'] == 'a'", 200));
        assert!(!check("request.headers['x-missing'] != 'a'", 200));
        assert!(check(
            "request.headers['x-missing'] == 'a' || response.code == 200",
            200
        ));
        assert!(!check(
            "request.headers['x-missing'] == 'a' && response.code == 200",
            200
        ));
        assert!(
            !check(
                "request.headers['x-missing'] == 'a' && response.code == 500",
                200
            ),
            "false && error is false, not logged"
        );
        // Mixed types and non-boolean results are not true.
        assert!(
            !check("response.code == '200'", 200)
                && !check("response.code", 200)
                && !check("response.grpc_status == 0", 200)
        );
    }

    #[test]
    fn what_is_not_supported_is_refused_by_name() {
        for (text, want) in [
            (
                "xds.cluster_name == 'x'",
                "the attribute xds.cluster_name is not supported",
            ),
            ("response.flags > 0", "response.flags is not supported"),
            (
                "size(request.path) > 1",
                "the attribute size is not supported",
            ),
            (
                "request.path.lowerAscii() == 'x'",
                "the method lowerAscii() is not supported",
            ),
            ("response.code >= ", "ends too early"),
            ("response.code >= 400 400", "unexpected Int(400)"),
            ("request.headers[1] == 'x'", "takes a string"),
            ("'a\\'b' == 'x'", "escapes"),
            ("response.code + 1 > 2", "'+' is not supported"),
            ("request.url_path.matches('(')", "matches:"),
        ] {
            let e = Expr::compile(text).expect_err(text);
            assert!(e.contains(want), "{text}: {e}");
        }
        let deep = format!("{}true{}", "(".repeat(100), ")".repeat(100));
        assert!(Expr::compile(&deep)
            .expect_err("deep")
            .contains("nested deeper"));
    }
}
