//! Telemetry `tracing[].customTags`: span attributes from a literal, an environment
//! variable of the waypoint, a request header, or an Envoy format string (`formatter`),
//! as Envoy's custom tags (Istio's `configureCustomTags`). The last Telemetry in force that sets `customTags` gives
//! them all (istiod's merge is shallow). Tag names are sorted, as istiod sorts them.

use http::HeaderName;
use serde_json::Value;

use super::format::{Entry, TextFormat};

/// Most tags, longest name or value (a span must stay small).
const MAX_TAGS: usize = 64;
const MAX_LEN: usize = 1024;

/// Why a tag is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TagError {
    #[error("more than {MAX_TAGS} tags")]
    TooMany,
    #[error("{0}: not an object with one of literal, environment, header, formatter")]
    Shape(String),
    #[error("{0}.formatter.value: {1}")]
    Formatter(String, String),
    #[error("{0}: {1} longer than {MAX_LEN} bytes")]
    TooLong(String, &'static str),
    #[error("{0}.header.name: {1:?} is not a header name")]
    Header(String, String),
}

#[derive(Clone, Debug, PartialEq)]
enum Kind {
    /// A literal, or an environment variable read at load (the process's does not change).
    Fixed(Option<String>),
    Header {
        name: HeaderName,
        default: Option<String>,
    },
    /// An Envoy substitution format (`%REQ(:PATH)%`...), rendered for the request.
    Formatter(TextFormat),
}

/// One custom tag.
#[derive(Clone, Debug, PartialEq)]
pub struct CustomTag {
    pub name: String,
    kind: Kind,
}

/// A Telemetry's `customTags`, checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CustomTags(Vec<CustomTag>);

fn text(v: Option<&Value>, tag: &str, what: &'static str) -> Result<Option<String>, TagError> {
    let s = v.and_then(Value::as_str).filter(|s| !s.is_empty());
    match s {
        Some(s) if s.len() > MAX_LEN => Err(TagError::TooLong(tag.to_string(), what)),
        s => Ok(s.map(str::to_string)),
    }
}

impl CustomTags {
    /// `customTags` of one tracing entry; `env` reads the waypoint's environment.
    pub fn parse(v: &Value, env: impl Fn(&str) -> Option<String>) -> Result<CustomTags, TagError> {
        let map = v
            .as_object()
            .ok_or_else(|| TagError::Shape("customTags".into()))?;
        if map.len() > MAX_TAGS {
            return Err(TagError::TooMany);
        }
        let mut tags = Vec::new();
        for (name, t) in map {
            if name.len() > MAX_LEN {
                return Err(TagError::TooLong("customTags".into(), "a tag name"));
            }
            let o = t
                .as_object()
                .filter(|o| o.len() == 1)
                .ok_or_else(|| TagError::Shape(name.clone()))?;
            let kind = if let Some(l) = o.get("literal") {
                Kind::Fixed(text(l.get("value"), name, "the value")?)
            } else if let Some(e) = o.get("environment") {
                let var = text(e.get("name"), name, "the variable name")?;
                let default = text(e.get("defaultValue"), name, "the default")?;
                Kind::Fixed(
                    var.and_then(|v| env(&v))
                        .filter(|v| !v.is_empty())
                        .or(default),
                )
            } else if let Some(h) = o.get("header") {
                let raw = text(h.get("name"), name, "the header name")?.unwrap_or_default();
                let header = HeaderName::from_bytes(raw.to_ascii_lowercase().as_bytes())
                    .map_err(|_| TagError::Header(name.clone(), raw.clone()))?;
                Kind::Header {
                    name: header,
                    default: text(h.get("defaultValue"), name, "the default")?,
                }
            } else if let Some(f) = o.get("formatter") {
                let v = text(f.get("value"), name, "the value")?.unwrap_or_default();
                Kind::Formatter(
                    TextFormat::parse(&v)
                        .map_err(|e| TagError::Formatter(name.clone(), e.to_string()))?,
                )
            } else {
                return Err(TagError::Shape(name.clone()));
            };
            tags.push(CustomTag {
                name: name.clone(),
                kind,
            });
        }
        tags.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(CustomTags(tags))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The request and response headers the tags read.
    pub fn headers(&self, req: &mut Vec<HeaderName>, resp: &mut Vec<HeaderName>) {
        for t in &self.0 {
            match &t.kind {
                Kind::Header { name, .. } if !req.contains(name) => req.push(name.clone()),
                Kind::Formatter(f) => f.headers(req, resp),
                _ => {}
            }
        }
    }

    /// The tags' values for a request whose headers (those the tags read) are
    /// `headers`; a tag without a value (no header, no default) is left out, as Envoy
    /// leaves it out.
    pub fn values<'a>(
        &'a self,
        headers: &'a [(HeaderName, String)],
        entry: Option<&'a Entry<'a>>,
    ) -> impl Iterator<Item = (String, String)> + 'a {
        self.0.iter().filter_map(move |t| {
            let v = match &t.kind {
                Kind::Formatter(f) => entry.map(|e| {
                    let mut s = String::new();
                    f.render(e, &mut s);
                    s
                }),
                Kind::Fixed(v) => v.clone(),
                Kind::Header { name, default } => headers
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.clone())
                    .or_else(|| default.clone()),
            };
            Some((t.name.clone(), v?))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn env(name: &str) -> Option<String> {
        (name == "POD_NAME").then(|| "waypoint-1".to_string())
    }

    #[test]
    fn literal_environment_and_header_tags() {
        let v = serde_json::json!({
            "team": {"literal": {"value": "books"}},
            "pod": {"environment": {"name": "POD_NAME"}},
            "zone": {"environment": {"name": "NOPE", "defaultValue": "z1"}},
            "none": {"environment": {"name": "NOPE"}},
            "user": {"header": {"name": "X-User"}},
            "tier": {"header": {"name": "x-tier", "defaultValue": "free"}},
        });
        let tags = Arc::new(CustomTags::parse(&v, env).unwrap());
        let (mut req, mut resp) = (Vec::new(), Vec::new());
        tags.headers(&mut req, &mut resp);
        let names: Vec<&str> = req.iter().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-tier", "x-user"]);
        let headers = [(HeaderName::from_static("x-user"), "ann".to_string())];
        let got: Vec<(String, String)> = tags.values(&headers, None).collect();
        let want: Vec<(String, String)> = [
            ("pod", "waypoint-1"),
            ("team", "books"),
            ("tier", "free"),
            ("user", "ann"),
            ("zone", "z1"),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn bad_tags_are_refused_by_name() {
        for (v, want) in [
            (
                serde_json::json!({"a": {"formatter": {"value": "%NOPE%"}}}),
                "a.formatter.value: %NOPE% is not supported",
            ),
            (serde_json::json!({"a": {}}), "a: not an object"),
            (
                serde_json::json!({"a": {"literal": {"value": "x"}, "header": {"name": "y"}}}),
                "a: not an object",
            ),
            (
                serde_json::json!({"a": {"header": {"name": "bad header"}}}),
                "a.header.name",
            ),
            (
                serde_json::json!({"a": {"literal": {"value": "x".repeat(2000)}}}),
                "longer than",
            ),
            (serde_json::json!([1]), "customTags: not an object"),
        ] {
            let e = CustomTags::parse(&v, env).unwrap_err().to_string();
            assert!(e.contains(want), "{v}: {e}");
        }
        let many: serde_json::Map<String, Value> = (0..100)
            .map(|i| {
                (
                    format!("t{i}"),
                    serde_json::json!({"literal": {"value": "x"}}),
                )
            })
            .collect();
        assert_eq!(
            CustomTags::parse(&Value::Object(many), env),
            Err(TagError::TooMany)
        );
    }

    #[test]
    fn formatter_tags_render_envoys_format_for_the_request() {
        let v = serde_json::json!({"route": {"formatter": {"value": "%REQ(:METHOD)% %REQ(:PATH)% %RESP(x-r)%"}}});
        let tags = CustomTags::parse(&v, env).unwrap();
        let (mut req, mut resp) = (Vec::new(), Vec::new());
        tags.headers(&mut req, &mut resp);
        assert_eq!(resp, [HeaderName::from_static("x-r")]);
        let resp_h = [(HeaderName::from_static("x-r"), "r1".to_string())];
        let e = Entry {
            start: std::time::UNIX_EPOCH,
            duration: std::time::Duration::ZERO,
            method: "GET",
            path: "/p?q=1",
            authority: "echo",
            protocol: "HTTP/1.1",
            code: 200,
            response_flags: "-",
            code_details: None,
            bytes_received: 0,
            bytes_sent: 0,
            request_headers: &[],
            response_headers: &resp_h,
            upstream: None,
            upstream_cluster: None,
            downstream_local: ([10, 96, 0, 10], 80).into(),
            downstream_remote: ([10, 0, 0, 1], 4000).into(),
            peer_uri_san: None,
            route: None,
            hostname: "h",
            trace_id: None,
            grpc_status: None,
            attempts: 0,
        };
        let got: Vec<(String, String)> = tags.values(&[], Some(&e)).collect();
        assert_eq!(got, [("route".to_string(), "GET /p?q=1 r1".to_string())]);
    }
}
