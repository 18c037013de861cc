//! Envoy's access-log formats, as Istio configures them: a text format of command
//! operators (`%START_TIME%`, `%REQ(:METHOD)%`, ...; meshConfig `accessLogFormat`, an
//! `envoyFileAccessLog` provider's `logFormat.text`) and the JSON one (`accessLogEncoding:
//! JSON`, `logFormat.labels`), parsed when the config loads. An operator the waypoint
//! cannot fill is refused there, named, as Envoy refuses an unknown one.
//!
//! Rendering follows Envoy's substitution formatter: a value that is not there is `-`
//! in text; in JSON a label whose value is exactly one operator keeps its type (a number
//! for `%RESPONSE_CODE%`, `null` when not there), other labels are strings.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use http::HeaderName;
use serde_json::Value;

pub mod time;

/// Istio's default text format (`EnvoyTextLogFormat`, pilot/pkg/model/telemetry_logging.go).
pub const ISTIO_TEXT: &str = "[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% \
%PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %CONNECTION_TERMINATION_DETAILS% \
\"%UPSTREAM_TRANSPORT_FAILURE_REASON%\" %BYTES_RECEIVED% %BYTES_SENT% %DURATION% \
%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \
\"%REQ(X-REQUEST-ID)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\" %UPSTREAM_CLUSTER_RAW% \
%UPSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_REMOTE_ADDRESS% \
%REQUESTED_SERVER_NAME% %ROUTE_NAME%\n";

/// Istio's default JSON labels (`EnvoyJSONLogFormatIstio`).
pub const ISTIO_JSON: [(&str, &str); 24] = [
    ("start_time", "%START_TIME%"),
    ("route_name", "%ROUTE_NAME%"),
    ("method", "%REQ(:METHOD)%"),
    ("path", "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%"),
    ("protocol", "%PROTOCOL%"),
    ("response_code", "%RESPONSE_CODE%"),
    ("response_flags", "%RESPONSE_FLAGS%"),
    ("response_code_details", "%RESPONSE_CODE_DETAILS%"),
    (
        "connection_termination_details",
        "%CONNECTION_TERMINATION_DETAILS%",
    ),
    ("bytes_received", "%BYTES_RECEIVED%"),
    ("bytes_sent", "%BYTES_SENT%"),
    ("duration", "%DURATION%"),
    (
        "upstream_service_time",
        "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%",
    ),
    ("x_forwarded_for", "%REQ(X-FORWARDED-FOR)%"),
    ("user_agent", "%REQ(USER-AGENT)%"),
    ("request_id", "%REQ(X-REQUEST-ID)%"),
    ("authority", "%REQ(:AUTHORITY)%"),
    ("upstream_host", "%UPSTREAM_HOST%"),
    ("upstream_cluster", "%UPSTREAM_CLUSTER_RAW%"),
    ("upstream_local_address", "%UPSTREAM_LOCAL_ADDRESS%"),
    ("downstream_local_address", "%DOWNSTREAM_LOCAL_ADDRESS%"),
    ("downstream_remote_address", "%DOWNSTREAM_REMOTE_ADDRESS%"),
    ("requested_server_name", "%REQUESTED_SERVER_NAME%"),
    (
        "upstream_transport_failure_reason",
        "%UPSTREAM_TRANSPORT_FAILURE_REASON%",
    ),
];

/// Longest format accepted, in bytes; most labels; deepest JSON nesting.
pub const MAX_LEN: usize = 16 << 10;
const MAX_LABELS: usize = 256;
const MAX_NESTING: usize = 8;

/// Why a format is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("longer than {MAX_LEN} bytes ({0})")]
    TooLong(usize),
    #[error("at byte {at}: {what}")]
    At { at: usize, what: String },
    #[error("%{0}% is not supported ({SUPPORTED})")]
    Unsupported(String),
    #[error("{0}: more than {MAX_LABELS} labels or nested deeper than {MAX_NESTING}")]
    TooMany(String),
    #[error("{0}: {1}")]
    Label(String, Box<FormatError>),
    #[error("not a JSON object of labels: {0}")]
    Json(String),
}

const SUPPORTED: &str = "START_TIME, REQ, RESP, REQ_WITHOUT_QUERY, PROTOCOL, RESPONSE_CODE, RESPONSE_FLAGS, \
    RESPONSE_CODE_DETAILS, CONNECTION_TERMINATION_DETAILS, UPSTREAM_TRANSPORT_FAILURE_REASON, BYTES_RECEIVED, \
    BYTES_SENT, DURATION, UPSTREAM_HOST, UPSTREAM_CLUSTER, UPSTREAM_CLUSTER_RAW, UPSTREAM_LOCAL_ADDRESS, \
    UPSTREAM_REMOTE_ADDRESS, UPSTREAM_REMOTE_ADDRESS_WITHOUT_PORT, UPSTREAM_REMOTE_PORT, \
    DOWNSTREAM_LOCAL_ADDRESS, DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT, DOWNSTREAM_LOCAL_PORT, \
    DOWNSTREAM_REMOTE_ADDRESS, DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT, DOWNSTREAM_REMOTE_PORT, \
    DOWNSTREAM_DIRECT_REMOTE_ADDRESS, DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT, DOWNSTREAM_PEER_URI_SAN, \
    REQUESTED_SERVER_NAME, ROUTE_NAME, HOSTNAME, TRACE_ID, GRPC_STATUS_NUMBER, UPSTREAM_REQUEST_ATTEMPT_COUNT, \
    ENVIRONMENT, CEL";

/// One command operator.
#[derive(Clone, Debug, PartialEq)]
enum Op {
    StartTime(Option<time::TimeFormat>),
    /// `REQ(main?alt)`; `strip`: REQ_WITHOUT_QUERY.
    Req {
        main: Hdr,
        alt: Option<Hdr>,
        strip: bool,
    },
    Resp {
        main: Hdr,
        alt: Option<Hdr>,
    },
    Protocol,
    ResponseCode,
    ResponseFlags,
    ResponseCodeDetails,
    ConnectionTerminationDetails,
    UpstreamTransportFailureReason,
    BytesReceived,
    BytesSent,
    Duration,
    UpstreamHost,
    UpstreamCluster,
    UpstreamLocalAddress,
    UpstreamRemoteAddress {
        port: bool,
        addr: bool,
    },
    DownstreamLocalAddress {
        port: bool,
        addr: bool,
    },
    DownstreamRemoteAddress {
        port: bool,
        addr: bool,
    },
    DownstreamPeerUriSan,
    RequestedServerName,
    RouteName,
    Hostname,
    TraceId,
    GrpcStatusNumber,
    Attempts,
    /// Read when the format loads: the process's environment does not change.
    Environment(Option<String>),
    /// `%CEL(expr)%` (Istio adds Envoy's CEL formatter for it).
    Cel(Box<super::expr::Expr>),
}

#[derive(Clone, Debug, PartialEq)]
enum Part {
    Text(String),
    Op(Op, Option<usize>),
}

/// A text format: literal text and operators.
#[derive(Clone, Debug, PartialEq)]
pub struct TextFormat {
    parts: Vec<Part>,
}

/// A format as a provider writes it.
#[derive(Clone, Debug, PartialEq)]
pub enum LogFormat {
    Text(TextFormat),
    /// Labels (sorted, as serde_json's map is) to text formats or fixed JSON values.
    Json(BTreeMap<String, Label>),
}

#[derive(Clone, Debug, PartialEq)]
pub enum Label {
    Format(TextFormat),
    Fixed(Value),
    Nested(BTreeMap<String, Label>),
}

/// What one finished request offers a format.
pub struct Entry<'a> {
    pub start: SystemTime,
    pub duration: Duration,
    pub method: &'a str,
    /// With the query.
    pub path: &'a str,
    pub authority: &'a str,
    pub protocol: &'a str,
    /// 0: no response.
    pub code: u16,
    pub response_flags: &'a str,
    pub code_details: Option<&'a str>,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    /// The request and response headers the format reads (names lower case).
    pub request_headers: &'a [(HeaderName, String)],
    pub response_headers: &'a [(HeaderName, String)],
    pub upstream: Option<SocketAddr>,
    pub upstream_cluster: Option<&'a str>,
    pub downstream_local: SocketAddr,
    pub downstream_remote: SocketAddr,
    pub peer_uri_san: Option<&'a str>,
    pub route: Option<&'a str>,
    pub hostname: &'a str,
    pub trace_id: Option<String>,
    pub grpc_status: Option<&'a str>,
    pub attempts: u32,
}

/// A rendered value: a string, a number, or not there.
enum Rendered {
    Str(String),
    Num(u64),
    None,
}

/// A header `REQ` / `RESP` names: one of HTTP/2's pseudo-headers, or a header.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Hdr {
    Method,
    Path,
    Authority,
    Scheme,
    Named(HeaderName),
}

fn header_name(s: &str, at: usize) -> Result<Hdr, FormatError> {
    // Header names are matched case-insensitively.
    let lower = s.trim().to_ascii_lowercase();
    Ok(match lower.as_str() {
        ":method" => Hdr::Method,
        ":path" => Hdr::Path,
        ":authority" => Hdr::Authority,
        ":scheme" => Hdr::Scheme,
        _ => Hdr::Named(
            HeaderName::from_bytes(lower.as_bytes()).map_err(|_| FormatError::At {
                at,
                what: format!("{s:?} is not a header name"),
            })?,
        ),
    })
}

fn headers_arg(arg: Option<&str>, at: usize) -> Result<(Hdr, Option<Hdr>), FormatError> {
    let arg = arg.ok_or_else(|| FormatError::At {
        at,
        what: "REQ and RESP take a header name, REQ(name) or REQ(name?alternative)".into(),
    })?;
    let (main, alt) = match arg.split_once('?') {
        Some((m, a)) => (m, Some(a)),
        None => (arg, None),
    };
    let main = header_name(main, at)?;
    let alt = alt.map(|a| header_name(a, at)).transpose()?;
    Ok((main, alt))
}

fn op(name: &str, arg: Option<&str>, at: usize) -> Result<Op, FormatError> {
    let plain = |op: Op| match arg {
        None => Ok(op),
        Some(_) => Err(FormatError::At {
            at,
            what: format!("%{name}% takes no argument"),
        }),
    };
    match name {
        "START_TIME" => Ok(Op::StartTime(
            arg.map(|f| time::TimeFormat::parse(f).map_err(|what| FormatError::At { at, what }))
                .transpose()?,
        )),
        "REQ" | "REQ_WITHOUT_QUERY" => {
            let (main, alt) = headers_arg(arg, at)?;
            Ok(Op::Req {
                main,
                alt,
                strip: name == "REQ_WITHOUT_QUERY",
            })
        }
        "RESP" => {
            let (main, alt) = headers_arg(arg, at)?;
            Ok(Op::Resp { main, alt })
        }
        "CEL" => {
            let text = arg.ok_or_else(|| FormatError::At {
                at,
                what: "CEL takes an expression, %CEL(expression)%".into(),
            })?;
            let e = super::expr::Expr::compile(text).map_err(|e| FormatError::At {
                at,
                what: format!("CEL: {e}"),
            })?;
            Ok(Op::Cel(Box::new(e)))
        }
        "ENVIRONMENT" => {
            let var = arg.ok_or_else(|| FormatError::At {
                at,
                what: "ENVIRONMENT takes a variable name".into(),
            })?;
            Ok(Op::Environment(std::env::var(var).ok()))
        }
        "PROTOCOL" => plain(Op::Protocol),
        "RESPONSE_CODE" => plain(Op::ResponseCode),
        "RESPONSE_FLAGS" => plain(Op::ResponseFlags),
        "RESPONSE_CODE_DETAILS" => plain(Op::ResponseCodeDetails),
        "CONNECTION_TERMINATION_DETAILS" => plain(Op::ConnectionTerminationDetails),
        "UPSTREAM_TRANSPORT_FAILURE_REASON" => plain(Op::UpstreamTransportFailureReason),
        "BYTES_RECEIVED" => plain(Op::BytesReceived),
        "BYTES_SENT" => plain(Op::BytesSent),
        "DURATION" => plain(Op::Duration),
        "UPSTREAM_HOST" => plain(Op::UpstreamHost),
        "UPSTREAM_CLUSTER" | "UPSTREAM_CLUSTER_RAW" => plain(Op::UpstreamCluster),
        "UPSTREAM_LOCAL_ADDRESS" => plain(Op::UpstreamLocalAddress),
        "UPSTREAM_REMOTE_ADDRESS" => plain(Op::UpstreamRemoteAddress {
            port: true,
            addr: true,
        }),
        "UPSTREAM_REMOTE_ADDRESS_WITHOUT_PORT" => plain(Op::UpstreamRemoteAddress {
            port: false,
            addr: true,
        }),
        "UPSTREAM_REMOTE_PORT" => plain(Op::UpstreamRemoteAddress {
            port: true,
            addr: false,
        }),
        "DOWNSTREAM_LOCAL_ADDRESS" => plain(Op::DownstreamLocalAddress {
            port: true,
            addr: true,
        }),
        "DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT" => plain(Op::DownstreamLocalAddress {
            port: false,
            addr: true,
        }),
        "DOWNSTREAM_LOCAL_PORT" => plain(Op::DownstreamLocalAddress {
            port: true,
            addr: false,
        }),
        // No proxy protocol or XFF trust: the direct peer is the remote.
        "DOWNSTREAM_REMOTE_ADDRESS" | "DOWNSTREAM_DIRECT_REMOTE_ADDRESS" => {
            plain(Op::DownstreamRemoteAddress {
                port: true,
                addr: true,
            })
        }
        "DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT"
        | "DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT" => plain(Op::DownstreamRemoteAddress {
            port: false,
            addr: true,
        }),
        "DOWNSTREAM_REMOTE_PORT" => plain(Op::DownstreamRemoteAddress {
            port: true,
            addr: false,
        }),
        "DOWNSTREAM_PEER_URI_SAN" => plain(Op::DownstreamPeerUriSan),
        "REQUESTED_SERVER_NAME" => plain(Op::RequestedServerName),
        "ROUTE_NAME" => plain(Op::RouteName),
        "HOSTNAME" => plain(Op::Hostname),
        "TRACE_ID" => plain(Op::TraceId),
        "GRPC_STATUS_NUMBER" => plain(Op::GrpcStatusNumber),
        "UPSTREAM_REQUEST_ATTEMPT_COUNT" => plain(Op::Attempts),
        other => Err(FormatError::Unsupported(other.to_string())),
    }
}

impl TextFormat {
    /// Parses Envoy's format string: `%NAME%`, `%NAME(arg)%`, `%NAME(arg):N%` (at most
    /// N characters).
    pub fn parse(text: &str) -> Result<TextFormat, FormatError> {
        if text.len() > MAX_LEN {
            return Err(FormatError::TooLong(text.len()));
        }
        let mut parts = Vec::new();
        let mut lit = String::new();
        let mut rest = text;
        while let Some(i) = rest.find('%') {
            lit.push_str(&rest[..i]);
            let at = text.len() - rest.len() + i;
            let cmd = &rest[i + 1..];
            let name_len = cmd
                .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(cmd.len());
            if name_len == 0 {
                return Err(FormatError::At {
                    at,
                    what: "a '%' that does not start a command operator".into(),
                });
            }
            let name = &cmd[..name_len];
            let mut after = &cmd[name_len..];
            let mut arg = None;
            if let Some(a) = after.strip_prefix('(') {
                let close = a.find(')').ok_or_else(|| FormatError::At {
                    at,
                    what: format!("%{name}(: no closing ')'"),
                })?;
                arg = Some(&a[..close]);
                after = &a[close + 1..];
            }
            let mut max = None;
            if let Some(m) = after.strip_prefix(':') {
                let n = m.find(|c: char| !c.is_ascii_digit()).unwrap_or(m.len());
                max = Some(m[..n].parse::<usize>().map_err(|_| FormatError::At {
                    at,
                    what: format!("%{name}%: the length after ':' is not a number"),
                })?);
                after = &m[n..];
            }
            rest = after.strip_prefix('%').ok_or_else(|| FormatError::At {
                at,
                what: format!("%{name}: no closing '%'"),
            })?;
            if !lit.is_empty() {
                parts.push(Part::Text(std::mem::take(&mut lit)));
            }
            parts.push(Part::Op(op(name, arg, at)?, max));
        }
        lit.push_str(rest);
        if !lit.is_empty() {
            parts.push(Part::Text(lit));
        }
        Ok(TextFormat { parts })
    }

    /// Whether a `%CEL%` reads the request headers other than by name (all are kept).
    fn all_headers(&self) -> bool {
        self.parts
            .iter()
            .any(|p| matches!(p, Part::Op(Op::Cel(x), _) if x.all_headers()))
    }

    /// The request and response headers it reads.
    pub(crate) fn headers(&self, req: &mut Vec<HeaderName>, resp: &mut Vec<HeaderName>) {
        for p in &self.parts {
            if let Part::Op(Op::Cel(x), _) = p {
                for h in x.headers() {
                    if !req.contains(h) {
                        req.push(h.clone());
                    }
                }
            }
            let (list, main, alt) = match p {
                Part::Op(Op::Req { main, alt, .. }, _) => (&mut *req, main, alt),
                Part::Op(Op::Resp { main, alt }, _) => (&mut *resp, main, alt),
                _ => continue,
            };
            for h in std::iter::once(main).chain(alt) {
                if let Hdr::Named(h) = h {
                    if !list.contains(h) {
                        list.push(h.clone());
                    }
                }
            }
        }
    }

    /// Text: an absent value is `-`.
    pub fn render(&self, e: &Entry<'_>, out: &mut String) {
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::Op(op, max) => match render_op(op, e) {
                    Rendered::Str(s) => push_max(out, &s, *max),
                    Rendered::Num(n) => push_max(out, &n.to_string(), *max),
                    Rendered::None => out.push('-'),
                },
            }
        }
    }

    /// JSON: one operator alone keeps its type (`null` when absent), else a string.
    fn render_json(&self, e: &Entry<'_>) -> Value {
        if let [Part::Op(op, max)] = self.parts.as_slice() {
            return match render_op(op, e) {
                Rendered::Str(s) => {
                    let mut out = String::new();
                    push_max(&mut out, &s, *max);
                    Value::String(out)
                }
                Rendered::Num(n) if max.is_none() => Value::from(n),
                Rendered::Num(n) => {
                    let mut out = String::new();
                    push_max(&mut out, &n.to_string(), *max);
                    Value::String(out)
                }
                Rendered::None => Value::Null,
            };
        }
        let mut out = String::new();
        self.render(e, &mut out);
        Value::String(out)
    }
}

fn push_max(out: &mut String, s: &str, max: Option<usize>) {
    match max {
        Some(n) => out.extend(s.chars().take(n)),
        None => out.push_str(s),
    }
}

fn header<'a>(list: &'a [(HeaderName, String)], name: &Hdr) -> Option<&'a str> {
    let Hdr::Named(name) = name else {
        // A response has no request pseudo-headers.
        return None;
    };
    list.iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

fn request_header<'a>(e: &'a Entry<'_>, name: &Hdr) -> Option<&'a str> {
    match name {
        Hdr::Method => Some(e.method),
        Hdr::Path => Some(e.path),
        Hdr::Authority => Some(e.authority),
        Hdr::Scheme => Some("http"),
        Hdr::Named(h) if h == http::header::HOST => Some(e.authority),
        _ => header(e.request_headers, name),
    }
}

fn render_op(op: &Op, e: &Entry<'_>) -> Rendered {
    use Rendered::{None as Absent, Num, Str};
    let opt = |s: Option<&str>| s.map_or(Absent, |s| Str(s.to_string()));
    let address = |a: SocketAddr, port: bool, addr: bool| match (addr, port) {
        (true, true) => Str(a.to_string()),
        (true, false) => Str(a.ip().to_string()),
        _ => Num(u64::from(a.port())),
    };
    match op {
        Op::StartTime(f) => Str(time::format(e.start, f.as_ref())),
        Op::Req { main, alt, strip } => {
            let v =
                request_header(e, main).or_else(|| alt.as_ref().and_then(|a| request_header(e, a)));
            opt(v.map(|v| {
                if *strip {
                    v.split('?').next().unwrap_or(v)
                } else {
                    v
                }
            }))
        }
        Op::Resp { main, alt } => opt(header(e.response_headers, main)
            .or_else(|| alt.as_ref().and_then(|a| header(e.response_headers, a)))),
        Op::Protocol => Str(e.protocol.to_string()),
        Op::ResponseCode => Num(u64::from(e.code)),
        Op::ResponseFlags => Str(e.response_flags.to_string()),
        Op::ResponseCodeDetails => opt(e.code_details),
        Op::ConnectionTerminationDetails
        | Op::UpstreamTransportFailureReason
        | Op::UpstreamLocalAddress
        | Op::RequestedServerName => Absent,
        Op::BytesReceived => Num(e.bytes_received),
        Op::BytesSent => Num(e.bytes_sent),
        Op::Duration => Num(u64::try_from(e.duration.as_millis()).unwrap_or(u64::MAX)),
        Op::UpstreamHost => e.upstream.map_or(Absent, |a| Str(a.to_string())),
        Op::UpstreamCluster => opt(e.upstream_cluster),
        Op::UpstreamRemoteAddress { port, addr } => {
            e.upstream.map_or(Absent, |a| address(a, *port, *addr))
        }
        Op::DownstreamLocalAddress { port, addr } => address(e.downstream_local, *port, *addr),
        Op::DownstreamRemoteAddress { port, addr } => address(e.downstream_remote, *port, *addr),
        Op::DownstreamPeerUriSan => opt(e.peer_uri_san),
        Op::RouteName => opt(e.route),
        Op::Hostname => Str(e.hostname.to_string()),
        Op::TraceId => e.trace_id.clone().map_or(Absent, Str),
        Op::GrpcStatusNumber => e
            .grpc_status
            .and_then(|g| g.parse::<u64>().ok())
            .map_or(Absent, Num),
        Op::Attempts => Num(u64::from(e.attempts)),
        Op::Environment(v) => opt(v.as_deref()),
        Op::Cel(x) => {
            let (path, query) = match e.path.split_once('?') {
                Some((p, q)) => (p, Some(q)),
                None => (e.path, None),
            };
            let san = e.peer_uri_san.unwrap_or_default();
            let a = super::expr::Attributes {
                code: e.code,
                grpc_status: e.grpc_status,
                method: e.method,
                path,
                query,
                host: e.authority,
                protocol: e.protocol,
                headers: e.request_headers,
                source: e.downstream_remote,
                destination: e.downstream_local,
                upstream: e.upstream,
                peer_san: san,
                request_size: e.bytes_received,
                request_total_size: e.bytes_received,
                response_size: e.bytes_sent,
                response_flags: e.response_flags,
            };
            x.text(&a).map_or(Absent, Str)
        }
    }
}

fn labels(
    v: &serde_json::Map<String, Value>,
    depth: usize,
) -> Result<BTreeMap<String, Label>, FormatError> {
    if v.len() > MAX_LABELS || depth > MAX_NESTING {
        return Err(FormatError::TooMany("labels".into()));
    }
    v.iter()
        .map(|(k, v)| {
            let l = match v {
                Value::String(s) => Label::Format(
                    TextFormat::parse(s).map_err(|e| FormatError::Label(k.clone(), Box::new(e)))?,
                ),
                Value::Object(o) => Label::Nested(
                    labels(o, depth + 1).map_err(|e| FormatError::Label(k.clone(), Box::new(e)))?,
                ),
                other => Label::Fixed(other.clone()),
            };
            Ok((k.clone(), l))
        })
        .collect()
}

pub(crate) fn render_labels(l: &BTreeMap<String, Label>, e: &Entry<'_>) -> Value {
    Value::Object(
        l.iter()
            .map(|(k, v)| {
                let v = match v {
                    Label::Format(f) => f.render_json(e),
                    Label::Fixed(v) => v.clone(),
                    Label::Nested(n) => render_labels(n, e),
                };
                (k.clone(), v)
            })
            .collect(),
    )
}

impl LogFormat {
    /// A text format; Istio appends the newline when it is missing.
    pub fn text(text: &str) -> Result<LogFormat, FormatError> {
        let mut f = TextFormat::parse(text)?;
        if !text.ends_with('\n') {
            f.parts.push(Part::Text("\n".into()));
        }
        Ok(LogFormat::Text(f))
    }

    /// Istio's default text format.
    pub fn istio_text() -> LogFormat {
        LogFormat::text(ISTIO_TEXT).unwrap_or(LogFormat::Json(BTreeMap::new()))
    }

    /// JSON labels; none (or an empty object): Istio's default labels.
    pub fn json(v: Option<&Value>) -> Result<LogFormat, FormatError> {
        let default = || {
            ISTIO_JSON
                .iter()
                .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
                .collect::<serde_json::Map<_, _>>()
        };
        let map = match v {
            None => default(),
            Some(Value::Object(o)) if o.is_empty() => default(),
            Some(Value::Object(o)) => o.clone(),
            Some(other) => return Err(FormatError::Json(format!("{other}"))),
        };
        Ok(LogFormat::Json(labels(&map, 0)?))
    }

    /// meshConfig's `accessLogEncoding: JSON` format: `accessLogFormat` holds the labels
    /// as a JSON text (Istio uses its default labels when it does not parse).
    pub fn json_text(text: &str) -> Result<LogFormat, FormatError> {
        if text.is_empty() {
            return LogFormat::json(None);
        }
        if text.len() > MAX_LEN {
            return Err(FormatError::TooLong(text.len()));
        }
        let v: Value = serde_json::from_str(text).map_err(|e| FormatError::Json(e.to_string()))?;
        LogFormat::json(Some(&v))
    }

    /// The request and response headers it reads.
    pub fn headers(&self, req: &mut Vec<HeaderName>, resp: &mut Vec<HeaderName>) {
        fn walk(
            l: &BTreeMap<String, Label>,
            req: &mut Vec<HeaderName>,
            resp: &mut Vec<HeaderName>,
        ) {
            for v in l.values() {
                match v {
                    Label::Format(f) => f.headers(req, resp),
                    Label::Nested(n) => walk(n, req, resp),
                    Label::Fixed(_) => {}
                }
            }
        }
        match self {
            LogFormat::Text(f) => f.headers(req, resp),
            LogFormat::Json(l) => walk(l, req, resp),
        }
    }

    /// Whether it reads every request header (a `%CEL%` iterating them).
    pub fn all_headers(&self) -> bool {
        fn walk(l: &BTreeMap<String, Label>) -> bool {
            l.values().any(|v| match v {
                Label::Format(f) => f.all_headers(),
                Label::Nested(n) => walk(n),
                Label::Fixed(_) => false,
            })
        }
        match self {
            LogFormat::Text(f) => f.all_headers(),
            LogFormat::Json(l) => walk(l),
        }
    }

    /// One line, ending with a newline.
    pub fn render(&self, e: &Entry<'_>) -> String {
        match self {
            LogFormat::Text(f) => {
                let mut out = String::with_capacity(256);
                f.render(e, &mut out);
                out
            }
            LogFormat::Json(l) => {
                let mut out = render_labels(l, e).to_string();
                let _ = writeln!(out);
                out
            }
        }
    }
}

#[cfg(test)]
mod tests;
