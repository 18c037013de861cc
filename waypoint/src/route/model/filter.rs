//! Route filters (Gateway API `HTTPRouteFilter`) and what they carry: header
//! modifiers, redirects, rewrites and mirrors, parsed and checked when the config loads.

use http::header::{HeaderName, HeaderValue};
use serde::Deserialize;

use super::super::cors::Cors;
use crate::object::{ObjectName, ObjectRef};

/// A route filter (Gateway API `HTTPRouteFilter`), written as
/// `{type: <Kind>, <kindInCamelCase>: {...}}`.
#[derive(Clone, Debug)]
pub enum Filter {
    RequestHeaderModifier(HeaderModifier),
    ResponseHeaderModifier(HeaderModifier),
    RequestRedirect(RequestRedirect),
    UrlRewrite(UrlRewrite),
    RequestMirror(RequestMirror),
    Cors(Cors),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawFilter {
    #[serde(rename = "type")]
    kind: String,
    request_header_modifier: Option<HeaderModifier>,
    response_header_modifier: Option<HeaderModifier>,
    request_redirect: Option<RequestRedirect>,
    #[serde(rename = "urlRewrite")]
    url_rewrite: Option<UrlRewrite>,
    request_mirror: Option<RequestMirror>,
    cors: Option<Cors>,
}

impl<'de> Deserialize<'de> for Filter {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawFilter::deserialize(d)?;
        let set = [
            raw.request_header_modifier.is_some(),
            raw.response_header_modifier.is_some(),
            raw.request_redirect.is_some(),
            raw.url_rewrite.is_some(),
            raw.request_mirror.is_some(),
            raw.cors.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        let err = |field: &str| {
            serde::de::Error::custom(format!(
                "filter of type {} needs its `{field}` field, and only that one",
                raw.kind
            ))
        };
        let f = match raw.kind.as_str() {
            "RequestHeaderModifier" => raw.request_header_modifier.map(Filter::RequestHeaderModifier).ok_or_else(|| err("requestHeaderModifier"))?,
            "ResponseHeaderModifier" => raw.response_header_modifier.map(Filter::ResponseHeaderModifier).ok_or_else(|| err("responseHeaderModifier"))?,
            "RequestRedirect" => raw.request_redirect.map(Filter::RequestRedirect).ok_or_else(|| err("requestRedirect"))?,
            "URLRewrite" => raw.url_rewrite.map(Filter::UrlRewrite).ok_or_else(|| err("urlRewrite"))?,
            "RequestMirror" => raw.request_mirror.map(Filter::RequestMirror).ok_or_else(|| err("requestMirror"))?,
            "CORS" => raw.cors.map(Filter::Cors).ok_or_else(|| err("cors"))?,
            "ExtensionRef" | "ExternalAuth" => {
                return Err(serde::de::Error::custom(format!("filter type {} is not supported by this waypoint", raw.kind)))
            }
            other => {
                return Err(serde::de::Error::custom(format!(
                    "filter type {other:?} is not one of RequestHeaderModifier, ResponseHeaderModifier, \
                     RequestRedirect, URLRewrite, RequestMirror, CORS"
                )))
            }
        };
        if set != 1 {
            return Err(err(match &f {
                Filter::RequestHeaderModifier(_) => "requestHeaderModifier",
                Filter::ResponseHeaderModifier(_) => "responseHeaderModifier",
                Filter::RequestRedirect(_) => "requestRedirect",
                Filter::UrlRewrite(_) => "urlRewrite",
                Filter::RequestMirror(_) => "requestMirror",
                Filter::Cors(_) => "cors",
            }));
        }
        Ok(f)
    }
}

/// One header to set or add, parsed when the config loads.
#[derive(Clone, Debug)]
pub struct HttpHeader {
    pub name: HeaderName,
    pub value: HeaderValue,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHttpHeader {
    name: String,
    value: String,
}

impl<'de> Deserialize<'de> for HttpHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawHttpHeader::deserialize(d)?;
        let name = HeaderName::from_bytes(raw.name.as_bytes()).map_err(|_| {
            serde::de::Error::custom(format!("{:?} is not a valid header name", raw.name))
        })?;
        let value = HeaderValue::from_str(&raw.value).map_err(|_| {
            serde::de::Error::custom(format!("{:?} is not a valid header value", raw.value))
        })?;
        Ok(HttpHeader { name, value })
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HeaderModifier {
    /// Replaces every value of the header.
    pub set: Vec<HttpHeader>,
    /// Appends a value (the header keeps the ones it had).
    pub add: Vec<HttpHeader>,
    pub remove: Vec<String>,
    /// Envoy's order (a VirtualService's header operations): remove, then set and add.
    #[serde(skip)]
    pub remove_first: bool,
}

/// How a redirect or rewrite changes the path.
#[derive(Clone, Debug)]
pub enum PathModifier {
    ReplaceFullPath(String),
    /// Replaces the matched `PathPrefix` (element-wise), keeping the rest of the path.
    ReplacePrefixMatch(String),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawPathModifier {
    #[serde(rename = "type")]
    kind: String,
    replace_full_path: Option<String>,
    replace_prefix_match: Option<String>,
}

impl<'de> Deserialize<'de> for PathModifier {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawPathModifier::deserialize(d)?;
        let (m, value) = match (
            raw.kind.as_str(),
            raw.replace_full_path,
            raw.replace_prefix_match,
        ) {
            ("ReplaceFullPath", Some(p), None) => (PathModifier::ReplaceFullPath(p.clone()), p),
            ("ReplacePrefixMatch", None, Some(p)) => {
                (PathModifier::ReplacePrefixMatch(p.clone()), p)
            }
            ("ReplaceFullPath", ..) => {
                return Err(serde::de::Error::custom(
                    "type ReplaceFullPath needs replaceFullPath, and only that",
                ))
            }
            ("ReplacePrefixMatch", ..) => {
                return Err(serde::de::Error::custom(
                    "type ReplacePrefixMatch needs replacePrefixMatch, and only that",
                ))
            }
            (other, ..) => {
                return Err(serde::de::Error::custom(format!(
                    "path modifier type {other:?} is not one of ReplaceFullPath, ReplacePrefixMatch"
                )))
            }
        };
        // The result goes upstream as is: it must already be a clean path.
        match crate::path::normalize(&value) {
            Ok(n) if n == value => Ok(m),
            Ok(n) => Err(serde::de::Error::custom(format!(
                "path {value:?} is not in normalized form; write {n:?}"
            ))),
            Err(e) => Err(serde::de::Error::custom(format!("path {value:?}: {e}"))),
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct RequestRedirect {
    pub scheme: Option<String>,
    pub hostname: Option<String>,
    pub path: Option<PathModifier>,
    pub port: Option<u16>,
    /// 301 or 302 (default).
    pub status_code: Option<u16>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UrlRewrite {
    pub hostname: Option<String>,
    pub path: Option<PathModifier>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RequestMirror {
    pub backend_ref: ObjectRef,
    /// Share of requests mirrored, 0-100 (all when neither this nor `fraction` is set).
    #[serde(default)]
    pub percent: Option<u32>,
    #[serde(default)]
    pub fraction: Option<Fraction>,
    /// A VirtualService mirror's DestinationRule subset (Gateway API has none).
    #[serde(skip)]
    pub subset: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fraction {
    pub numerator: u32,
    #[serde(default = "hundred")]
    pub denominator: u32,
}

fn hundred() -> u32 {
    100
}

impl RequestMirror {
    /// The mirror's Service, its namespace defaulting to the route's.
    pub fn service(&self, route_ns: &str) -> ObjectName {
        self.backend_ref.object_name(route_ns)
    }
}
